"""models/qwen3next.py (``general.architecture = "qwen3next"``) against transformers, through files written by
llama.cpp's converter; the recurrent state cache (ggmlpy.kvcache.Recurrent) through the runner.

A tiny random-weight ``Qwen3NextForCausalLM`` (4 layers: gated DeltaNet in 0, 1 and 3, gated attention in 2;
n_embd 64, 4 attention heads of 16 over 2 KV heads with a rotary quarter; DeltaNet heads of 16, 2 key heads
shared by 4 value heads, convolutions of 4 taps; 4 experts of 32, 2 used, a shared expert of 48; weights of std
0.1) with the real qwen2 vocabulary, converted with ``--no-mtp`` (transformers keeps no MTP layers; a file with
one is made from it, :func:`test_mtp_layers_are_left_unread`). The constant weights (norms, ``dt_bias``) are
made random first.

Tolerance with F32 weights and an F32 cache: per position, max |got - ref| / max |ref| at most ``TOL`` (1e-5) in
one batch (measured 7.0e-6 either attention path, 6.6e-6 for three sequences in one batch; llama.cpp's own error
on the same file through llama-cpp-python: 7.0e-6) and ``TOL_STEPS`` (2e-5) token by token (measured 1.0e-5;
llama.cpp's own 9.4e-6): transformers computes a prompt's delta rule in chunks (``chunk_gated_delta_rule``), a
different order of float32 sums from the token-by-token recurrence that ggml's ``gated_delta_net`` runs, so the
error grows with each step's recurrence. An attention output gate of zeros or convolution taps in the other order
leave the tolerance by far.

The converter's F16 / Q8_0 files (the convolution kernels stay F32), an F16 cache: F16 median 3.0e-3, max 9.1e-3
(llama.cpp with an F16 cache 3.1e-3 / 9.2e-3); Q8_0 median 0.145, max 0.61 (llama.cpp 0.148 / 0.61: rows of 64
values are two Q8_0 blocks each, and a recurrence carries every rounding forward).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch") if not os.environ.get("CI") else __import__("torch")
transformers = pytest.importorskip("transformers") if not os.environ.get("CI") else __import__("transformers")

import hf_convert  # noqa: E402
from arch_helpers import copy_gguf, llama_cpp_logits, make, run_batch, run_steps, sequences_error  # noqa: E402
from test_models_converted import TEXT, TOL, errors, hf_logits  # noqa: E402

from ggmlpy import Type, gguf  # noqa: E402
from ggmlpy.gguf import MetadataError  # noqa: E402
from ggmlpy.kvcache import Causal, NotSupported, Recurrent, Wrapper  # noqa: E402
from ggmlpy.models import MissingTensor, load_model  # noqa: E402
from ggmlpy.models.qwen3next import CHECKPOINTS, Qwen3NextConfig, Qwen3NextModel  # noqa: E402
from ggmlpy.runner import DoneReason, Runner  # noqa: E402
from ggmlpy.runner.slots import shift_discard  # noqa: E402

pytestmark = pytest.mark.hf

A = "qwen3next"
LAYERS = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
RECURRENT = tuple(t == "linear_attention" for t in LAYERS)
CONFIG = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
              linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
              moe_intermediate_size=32, shared_expert_intermediate_size=48, layer_types=LAYERS,
              full_attention_interval=3, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
              initializer_range=0.1)
F32 = {"type_k": "f32", "type_v": "f32"}
#: per-position error bounds (median, max) by converter --outtype; see the module docstring
QUANT_TOL = {"f16": (5e-3, 1.5e-2), "q8_0": (0.2, 0.8)}
#: token by token (see the module docstring: transformers' chunked delta rule against the recurrence)
TOL_STEPS = 2e-5


@pytest.fixture(scope="module")
def conv(tmp_path_factory):
    tok = hf_convert.tokenizer("qwen2")
    tokens = tok(TEXT + " " + TEXT, add_special_tokens=False)["input_ids"]
    c = make("Qwen3NextForCausalLM", "Qwen3NextConfig", "qwen2", tokens, tmp_path_factory.mktemp("qwen3next"),
             vocab_size=len(tok), **CONFIG)
    c.extra_args = ("--no-mtp",)          # transformers' model has no MTP layers; the converter expects them
    c.ref = hf_logits(c.hf, tokens)
    return c


def hf_greedy(hf, prompt, n):
    toks = list(prompt)
    for _ in range(n):
        toks.append(int(hf_logits(hf, toks)[-1].argmax()))
    return toks[len(prompt):]


def test_the_file_is_the_converters(conv):
    """llama.cpp's keys and tensors: the recurrent layers, the DeltaNet sizes, the fused q/k/v and the gate, the
    kernels F32; the layer kinds and sizes read back."""
    with gguf.GGUFReader(str(conv.path())) as r:
        md, info = r.metadata, {t.name: (tuple(t.ne), t.type) for t in r.tensors}
    assert md["general.architecture"] == A and list(md[f"{A}.attention.recurrent_layers"]) == list(RECURRENT)
    assert (md[f"{A}.ssm.state_size"], md[f"{A}.ssm.group_count"], md[f"{A}.ssm.time_step_rank"]) == (16, 2, 4)
    assert info["blk.0.ssm_conv1d.weight"] == ((4, 128), Type.F32) and info["blk.0.attn_qkv.weight"][0] == (64, 128)
    assert info["blk.2.attn_q.weight"][0] == (64, 128) and "blk.2.attn_qkv.weight" not in info
    with load_model(conv.path(), devices="cpu") as model:
        c = model.config
        assert type(model) is Qwen3NextModel
        assert (c.recurrent_layers, c.ssm_d_conv, c.ssm_d_state, c.ssm_n_group, c.ssm_n_head) == (RECURRENT, 4, 16,
                                                                                                    2, 4)
        assert (c.n_expert, c.n_expert_used, c.n_ff_exp, c.n_ff_shexp, c.rope_dim) == (4, 2, 32, 48, 4)


def test_the_cache_recipe(conv):
    """A Wrapper: the attention layer's K/V in a Causal, the DeltaNet layers' two states in a Recurrent (3 past
    inputs of 128 channels; a 16 x 16 matrix per value head)."""
    with load_model(conv.path(), devices="cpu") as model, Runner(model, n_ctx=64, n_seq_max=2, **F32) as rt:
        w = rt.cache
        assert isinstance(w, Wrapper) and [type(c) for c in w.caches] == [Causal, Recurrent]
        kv, rs = w.caches
        assert [w.underlying(i) is rs for i in range(4)] == list(RECURRENT)
        assert rs.states == {"conv": (3, 128), "ssm": (16, 16, 4)} and rs.n_checkpoints == CHECKPOINTS
        assert kv.n_layers == 1 and rs.n_layers == 3
        # per layer: both states of each sequence, its checkpoints, and one scratch row
        assert rs.bytes_per_layer(2) == 4 * (3 * 128 + 16 * 16 * 4) * (2 * (1 + CHECKPOINTS) + 1)
        cpu = rt.memory_report().devices["CPU"]
        assert set(cpu.state) == {0, 1, 3} and {g for g, b in cpu.cache.items() if b} == {2}


# ------------------------------------------------------------------ logits against transformers


@pytest.mark.parametrize("flash", [False, True])
def test_one_batch_matches_transformers(conv, flash):
    err = errors(run_batch(conv.path(), conv.tokens, flash_attn=flash), conv.ref)
    assert err.max() <= TOL, err


def test_token_by_token_matches_transformers(conv):
    """Each token alone: the convolution and delta-rule states carry every earlier input."""
    err = errors(run_steps(conv.path(), conv.tokens), conv.ref)
    assert err.max() <= TOL_STEPS, err


def test_several_sequences_in_one_batch(conv):
    """Three sequences of different lengths in one batch (micro-batches of equal rows per sequence), then one
    more token of each in one micro-batch of three states, against transformers on each sequence alone."""
    t = conv.tokens
    assert sequences_error(conv, [t[:9], t[4:20], t[14:]], [5, 6, 7]) <= TOL


def test_llama_cpps_error_on_the_same_file(conv, tmp_path):
    """llama.cpp (llama-cpp-python) on the same F32 file, F32 cache: within the same tolerance (measured 7.0e-6,
    as ggmlpy's)."""
    err = errors(llama_cpp_logits(conv.path(), conv.tokens, tmp_path), conv.ref)
    assert err.max() <= TOL, err


def mtp_file(conv, tmp_path):
    """``conv``'s file as the converter writes it from a checkpoint with one MTP layer (no ``--no-mtp``): one more
    layer like the last attention one (its tensors, scaled so that running it would move the logits) with the
    ``nextn.*`` tensors, ``block_count`` one more, ``nextn_predict_layers`` 1, ``recurrent_layers`` over all."""
    with gguf.GGUFReader(str(conv.path())) as r:
        a = r.metadata["general.architecture"]
        n, rec = r.metadata[f"{a}.block_count"], list(r.metadata[f"{a}.attention.recurrent_layers"])
        n_embd = r.tensor_info("token_embd.weight").ne[0]
    attn = max(i for i in range(n) if not rec[i])
    extra = {"nextn.eh_proj.weight": (2 * n_embd, n_embd), "nextn.enorm.weight": (n_embd,),
             "nextn.hnorm.weight": (n_embd,), "nextn.shared_head_norm.weight": (n_embd,)}

    def add_layer(name, data):
        out = [(name, data)]
        if name.startswith(f"blk.{attn}."):
            out.append((f"blk.{n}." + name.split(".", 2)[2], data * 3))
        if name == "output_norm.weight":
            out += [(f"blk.{n}.{t}", np.ones(ne[::-1], np.float32)) for t, ne in extra.items()]
        return out

    path = tmp_path / "mtp.gguf"
    copy_gguf(conv.path(), path, tensors=add_layer,
              meta={f"{a}.block_count": n + 1, f"{a}.nextn_predict_layers": 1,
                    f"{a}.attention.recurrent_layers": np.array(rec + [False])},
              meta_types=dict.fromkeys([f"{a}.block_count", f"{a}.nextn_predict_layers"], gguf.ValueType.UINT32))
    return path, n


def check_mtp_layers_are_left_unread(conv, tmp_path, tol=TOL):
    """A file with a multi-token-prediction layer (:func:`mtp_file`) runs the others, leaves the last layer in
    the file, and gives transformers' logits; llama.cpp on the same file too (it skips the MTP tensors unless
    asked for MTP). Returns the errors (ggmlpy's, llama.cpp's)."""
    path, n = mtp_file(conv, tmp_path)
    with load_model(path, devices="cpu") as model:
        c = model.config
        assert (c.n_layer, c.n_layer_nextn, len(c.recurrent_layers)) == (n, 1, n)
        assert not any(t.startswith(f"blk.{n}.") for t in model.weights.tensors)
    err = errors(run_batch(path, conv.tokens), conv.ref)
    assert err.max() <= tol, err
    ref_err = errors(llama_cpp_logits(path, conv.tokens, tmp_path), conv.ref)
    assert ref_err.max() <= tol, ref_err
    return err.max(), ref_err.max()


def test_mtp_layers_are_left_unread(conv, tmp_path):
    check_mtp_layers_are_left_unread(conv, tmp_path)


@pytest.mark.parametrize("what", ["no-output-gate", "conv-taps-reversed"])
def test_the_weights_are_read_as_llama_cpp_does(conv, what, tmp_path):
    """The attention's output gate dropped (its rows zero: sigmoid 0.5), or each convolution's taps in the other
    order: the logits leave the tolerance by far, so the match checks each of them."""
    def change(name, data):
        if what == "no-output-gate" and name == "blk.2.attn_q.weight":
            d = data.copy().reshape(4, 32, -1)
            d[:, 16:] = 0
            return [(name, d.reshape(128, -1))]
        if what == "conv-taps-reversed" and name.endswith("ssm_conv1d.weight"):
            return [(name, np.ascontiguousarray(data[:, ::-1]))]
        return [(name, data)]

    path = copy_gguf(conv.path(), tmp_path / f"{what}.gguf", tensors=change)
    err = errors(run_batch(path, conv.tokens), conv.ref)
    assert err.max() > 100 * TOL, err


@pytest.mark.parametrize("outtype", list(QUANT_TOL))
def test_converter_quantized_files_track_transformers(conv, outtype):
    """The converter's own F16 / Q8_0 files, an F16 cache (see the module docstring for the numbers)."""
    with load_model(conv.path(outtype), devices="cpu") as model:
        assert model.weights["blk.0.attn_qkv.weight"].type == Type[outtype.upper()]
        assert model.weights["blk.0.ssm_conv1d.weight"].type == Type.F32
        with Runner(model, n_ctx=64) as rt:
            got = rt.decode(conv.tokens, logits="all")
    err = errors(got, conv.ref)
    med, worst = QUANT_TOL[outtype]
    assert np.median(err) <= med and err.max() <= worst, err


# ------------------------------------------------------------------ the runner over recurrent states


def _generate(conv, prompts, pipeline=False):
    with load_model(conv.path(), devices="cpu") as model, \
            Runner(model, n_ctx=64, n_seq_max=len(prompts), n_batch=16, pipeline=pipeline, **F32) as rt:
        hs = [rt.submit(p, max_tokens=6, temperature=0, logprobs=True) for p in prompts]
        return [h.result() for h in hs], rt.batch_sizes


@pytest.mark.parametrize("pipeline", [False, True])
def test_requests_together_generate_what_each_does_alone(conv, pipeline):
    """Three requests served together (pipelined too: the next batch planned while one computes) generate what
    each does alone, logprobs too, and transformers' greedy tokens."""
    prompts = [conv.tokens[:6], conv.tokens[5:17], conv.tokens[-4:]]
    together, sizes = _generate(conv, prompts, pipeline)
    assert [3] in sizes
    for p, r in zip(prompts, together):
        (alone,), _ = _generate(conv, [p])
        assert r.error is None and r.tokens == alone.tokens
        np.testing.assert_allclose([x.logprob for x in r.logprobs], [x.logprob for x in alone.logprobs], atol=1e-4)
        assert r.tokens == hf_greedy(conv.hf, p, len(r.tokens))


def test_prefix_reuse_from_checkpoints(conv):
    """A recurrent state goes back only to a checkpoint (the end of a prompt, the token before it): the same
    prompt again reuses 11 of its 12 tokens, a conversation going on from it reuses 12, a branch at 8 nothing;
    each computes what a fresh runner does."""
    prompt = conv.tokens[:12]
    with load_model(conv.path(), devices="cpu") as model:
        with Runner(model, n_ctx=64, n_seq_max=2, **F32) as rt:
            a = rt.generate(prompt, max_tokens=4, temperature=0)
            assert [k for k, _ in rt.cache.caches[1].rows.checkpoints[0]] == [11, 12]
            b = rt.generate(prompt + a.tokens[:2] + [9], max_tokens=4, temperature=0, logprobs=True)
            c = rt.generate(prompt, max_tokens=4, temperature=0)
            d = rt.generate(prompt[:8] + [5, 6], max_tokens=4, temperature=0)
        assert (a.n_cached, b.n_cached, c.n_cached, d.n_cached) == (0, 12, 11, 0)
        with Runner(model, n_ctx=64, **F32) as fresh:
            for r, p in ((b, prompt + a.tokens[:2] + [9]), (c, prompt), (d, prompt[:8] + [5, 6])):
                f = fresh.generate(p, max_tokens=4, temperature=0, logprobs=True)
                fresh.clear()
                assert r.tokens == f.tokens, p
                if r.logprobs:
                    np.testing.assert_allclose([x.logprob for x in r.logprobs], [x.logprob for x in f.logprobs],
                                               atol=1e-4)
    assert c.tokens == a.tokens


def test_context_shift_falls_back_to_computing_again(conv):
    """The states cannot drop a middle range: cache.remove raises NotSupported. A request that outgrows its
    context (n_ctx 24, n_keep 4) is shifted by the runner's fallback, the kept tokens computed again from the
    start, and generates what direct calls doing that generate."""
    toks, n_ctx, keep = conv.tokens, 24, 4
    prompt = toks[:14]
    with load_model(conv.path(), devices="cpu") as model, Runner(model, n_ctx=n_ctx, **F32) as rt:
        rt.decode(prompt, logits=None)
        with pytest.raises(NotSupported, match="shifting positions"):
            rt.cache.remove(0, keep, keep + 3)
        rt.clear()
        res = rt.submit(prompt, max_tokens=20, n_keep=keep, temperature=0).result()
        assert res.error is None and res.done_reason == DoneReason.LENGTH and res.n_shifts >= 1
        rt.clear()
        record, out, shifts = list(prompt), [], 0
        logits = rt.decode(prompt)
        while True:
            out.append(int(logits[-1].argmax()))
            if len(out) == 20:
                break
            if len(record) + 1 > n_ctx:
                discard = shift_discard(len(record), keep, n_ctx)
                record = record[:keep] + record[keep + discard:]
                rt.clear()
                rt.decode(record, logits=None)
                shifts += 1
            logits = rt.decode([out[-1]])
            record.append(out[-1])
    assert res.tokens == out and res.n_shifts == shifts


def test_embeddings_match_transformers(conv):
    """Pooled final-normed hidden states (no head) of the whole input in one batch."""
    toks = conv.tokens[:30]
    with load_model(conv.path(), devices="cpu") as model, Runner(model, n_ctx=64, **F32) as rt:
        got = rt.embed(toks)
    with torch.no_grad():
        hidden = conv.hf.model(torch.tensor([toks])).last_hidden_state[0].numpy()
    want = hidden.mean(0)
    want /= np.linalg.norm(want)
    assert np.abs(got - want).max() <= TOL * np.abs(want).max()


def test_state_save_and_load(conv, tmp_path):
    """Runner.save_state/load_state of a sequence held in both caches (its K/V, its convolution and delta-rule
    states), into another sequence of a runner with more sequences: it goes on as transformers."""
    toks = conv.tokens
    with load_model(conv.path(), devices="cpu") as model:
        with Runner(model, n_ctx=64, n_seq_max=2, **F32) as rt:
            rt.decode(toks[:30], seq=1, logits=None)
            rt.save_state(1, tmp_path / "s.bin")
        with Runner(model, n_ctx=64, n_seq_max=3, **F32) as rt:
            rt.decode(toks[:5], seq=0, logits=None)
            assert rt.load_state(2, tmp_path / "s.bin") == toks[:30]
            got = rt.decode([toks[30]], seq=2)
    assert errors(got, conv.ref[30:31]).max() <= TOL


# ------------------------------------------------------------------ metadata


@pytest.mark.parametrize("key,value,match", [
    ("ssm.inner_size", 128, r"'qwen3next\.ssm\.inner_size'|ssm\.inner_size 128 must be"),
    ("ssm.group_count", 3, r"ssm\.time_step_rank 4 \(value heads\) must be a multiple"),
    ("attention.recurrent_layers", [True, False], r"'qwen3next\.attention\.recurrent_layers': 2 values for 4"),
    ("nextn_predict_layers", 1, r"'qwen3next\.attention\.recurrent_layers': a multi-token-prediction layer"),
    ("nextn_predict_layers", 4, r"'qwen3next\.nextn_predict_layers': 4 is out of range"),
    ("attention.sliding_window", 4, r"'qwen3next\.attention\.sliding_window': 4: sliding-window"),
    ("expert_gating_func", 2, r"'qwen3next\.expert_gating_func': 2 is not supported"),
])
def test_unsupported_metadata_names_the_key(conv, key, value, match):
    with gguf.GGUFReader(str(conv.path())) as r:
        md = dict(r.metadata)
    md[f"{A}.{key}"] = np.array(value) if isinstance(value, list) else value
    with pytest.raises((MetadataError, ValueError), match=match):
        Qwen3NextConfig.from_metadata(md, "m.gguf").validate("m.gguf")


def test_without_the_recurrent_layers_key_every_third_is_attention(conv):
    """Files without ``attention.recurrent_layers`` (older converters): llama.cpp's default from
    ``full_attention_interval``."""
    with gguf.GGUFReader(str(conv.path())) as r:
        md = dict(r.metadata)
    del md[f"{A}.attention.recurrent_layers"]
    assert Qwen3NextConfig.from_metadata(md, "m.gguf").recurrent_layers == RECURRENT
    md[f"{A}.full_attention_interval"] = 2
    assert Qwen3NextConfig.from_metadata(md, "m.gguf").recurrent_layers == (True, False, True, False)


def test_the_layer_kinds_are_checked_against_the_tensors(conv, tmp_path):
    """Recurrent layers that call the attention layer a DeltaNet layer are named with the tensor they contradict,
    before anything is allocated; a convolution kernel not in F32 (ggml's ssm_conv reads F32) is refused naming
    the tensor."""
    wrong = copy_gguf(conv.path(), tmp_path / "kinds.gguf", meta={f"{A}.attention.recurrent_layers": [True] * 4})
    with pytest.raises(MetadataError, match=r"'qwen3next\.attention\.recurrent_layers': layer 2 is gated DeltaNet "
                                            r"by it, but the file has blk\.2\.attn_q\.weight"):
        load_model(wrong, devices="cpu")
    f16 = copy_gguf(conv.path(), tmp_path / "f16.gguf",
                    types=lambda name, old: Type.F16 if name.endswith("ssm_conv1d.weight") else old)
    with pytest.raises(MissingTensor, match=r"blk\.0\.ssm_conv1d\.weight"):
        load_model(f16, devices="cpu")


def test_the_benchmarks_synthetic_models_run(tmp_path):
    """ggmlpy bench --arch qwen3next: the built-in file (llama.cpp's keys, F32 kernels) loads, gives one batch's
    logits token by token too, and llama.cpp reads it and computes the same logits."""
    from ggmlpy.models.synthetic import synthetic_path

    path = synthetic_path("tiny", "Q8_0", cache_dir=tmp_path, arch="qwen3next")
    toks = [3, 1, 4, 1, 5, 9, 2, 6]
    with load_model(path, devices="cpu") as model:
        c = model.config
        assert type(model) is Qwen3NextModel and c.recurrent_layers == (True, False)
        assert (c.ssm_n_group, c.ssm_n_head, c.n_expert, c.rope_dim) == (2, 4, 8, 4)
    full, steps = run_batch(path, toks), run_steps(path, toks)
    assert np.isfinite(full).all() and np.abs(full).max() > 0 and errors(steps, full).max() <= 1e-3
    assert errors(llama_cpp_logits(path, toks, tmp_path), full).max() <= 1e-3


def test_the_qwen3_next_preset_cut_is_read_as_llama_cpp_reads_it(tmp_path):
    """The qwen3-next-12L-128E preset's widths (heads of 256, 16 DeltaNet key heads of 128, 10 experts used) cut
    to its first 4 layers (three DeltaNet, one attention), 16 experts and a 1024-token vocabulary: llama.cpp
    computes the same logits (measured: identical)."""
    from dataclasses import replace

    from ggmlpy.models.synthetic import SIZES, write_synthetic

    cfg = replace(SIZES["qwen3-next-12L-128E"], n_layer=4, n_vocab=1024, n_expert=16,
                  recurrent_layers=(True, True, True, False))
    path = write_synthetic(tmp_path / "m.gguf", cfg, "Q8_0")
    toks = [3, 1, 4, 1, 5, 9, 2, 6]
    with load_model(path, devices="cpu") as model:
        c = model.config
        assert (c.head_dim, c.ssm_n_group, c.ssm_n_head, c.ssm_d_state, c.n_expert_used) == (256, 16, 32, 128, 10)
    full = run_batch(path, toks)
    assert np.isfinite(full).all() and np.abs(full).max() > 0
    assert errors(llama_cpp_logits(path, toks, tmp_path), full).max() <= 1e-3
