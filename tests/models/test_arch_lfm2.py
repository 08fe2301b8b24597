"""models/lfm2.py (``general.architecture = "lfm2"``) against transformers, through files written by llama.cpp's
converter; the recurrent state cache (ggmlpy.kvcache.Recurrent) through the runner.

A tiny random-weight ``Lfm2ForCausalLM`` (6 layers: short convolutions of 3 taps in layers 0, 1, 3 and 5,
attention in 2 and 4; n_embd 128, 4 heads of 32 over 2 KV heads, feed-forward 256, tied head, weights of
std 0.1 so that greedy generations do not repeat one token) with the real gpt-2 vocabulary (the converter
takes any BPE tokenizer it knows). The norms, Q/K norms included, are made random first; the convolution
kernels are random by HF's own initialisation.

Tolerance with F32 weights and an F32 cache: per position, max |got - ref| / max |ref| at most 1e-5
(``TOL``; measured 2.9e-6 in one batch, 2.9e-6 token by token, 3.3e-6 for three sequences in one batch,
either attention path). llama.cpp's own error on the same file, through llama-cpp-python: 2.9e-6. A
kernel with its taps in the other order, or Q/K norms of ones, leave the tolerance by far.

The converter's F16 / Q8_0 files (the convolution kernels stay F32, as llama-quantize keeps them), an F16
cache: F16 median 4e-3, max 1e-2; Q8_0 median 0.1, max 0.15 (the weights of std 0.1 make larger logits and
larger rounding errors than the other architectures' tests see: measured F16 median 2.7e-3, max 7.6e-3,
llama.cpp with an F16 cache 2.8e-3 / 7.6e-3; Q8_0 median 0.069, max 0.108, llama.cpp 0.067 / 0.111).

The runner: requests served together generate what each does alone; a prompt is reused from a checkpoint
of the convolution state (the end of the last prompt, or the token before it) and the rest computed again,
as a fresh runner computes it; a context shift is refused by the state and the runner computes what it
kept again; embeddings; a state saved and loaded into another sequence and runner.
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
from ggmlpy.gguf import MetadataError, MetadataTypeError  # noqa: E402
from ggmlpy.kvcache import Causal, NotSupported, Recurrent, Wrapper  # noqa: E402
from ggmlpy.models import MissingTensor, UnknownArchitecture, load_model  # noqa: E402
from ggmlpy.models.lfm2 import CHECKPOINTS, Lfm2Config, Lfm2Model  # noqa: E402
from ggmlpy.runner import DoneReason, Runner  # noqa: E402
from ggmlpy.runner.slots import shift_discard  # noqa: E402

pytestmark = pytest.mark.hf

A = "lfm2"
LAYERS = ["conv", "conv", "full_attention", "conv", "full_attention", "conv"]
RECURRENT = tuple(t == "conv" for t in LAYERS)
CONFIG = dict(hidden_size=128, intermediate_size=384, block_multiple_of=32, num_hidden_layers=6, num_attention_heads=4,
              num_key_value_heads=2, layer_types=LAYERS, conv_L_cache=3, max_position_embeddings=256, norm_eps=1e-5,
              tie_word_embeddings=True, initializer_range=0.1)
#: per-position error bounds (median, max) by converter --outtype; see the module docstring
QUANT_TOL = {"f16": (4e-3, 1e-2), "q8_0": (0.1, 0.15)}
F32 = {"type_k": "f32", "type_v": "f32"}


@pytest.fixture(scope="module")
def conv(tmp_path_factory):
    tok = hf_convert.tokenizer("gpt-2")
    tokens = [tok.bos_token_id, *tok(TEXT + " " + TEXT, add_special_tokens=False)["input_ids"]]
    c = make("Lfm2ForCausalLM", "Lfm2Config", "gpt-2", tokens, tmp_path_factory.mktemp("lfm2"), vocab_size=len(tok),
             bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **CONFIG)
    c.ref = hf_logits(c.hf, tokens)
    return c


def derived(conv, what: str, **kw):
    """A file made from ``conv``'s F32 file by :func:`copy_gguf` once (cached under ``what``)."""
    if what not in conv.paths:
        conv.paths[what] = copy_gguf(conv.path(), conv.out_dir / f"{what}.gguf", **kw)
    return conv.paths[what]


def hf_greedy(hf, prompt, n):
    toks = list(prompt)
    for _ in range(n):
        toks.append(int(hf_logits(hf, toks)[-1].argmax()))
    return toks[len(prompt):]


def test_the_file_is_the_converters(conv):
    """llama.cpp's keys and tensors: the KV head count per layer (0: a convolution), the taps, the kernels F32 and
    2-d, the output norm under llama.cpp's name; the norms were made random before converting."""
    with gguf.GGUFReader(str(conv.path())) as r:
        md, info = r.metadata, {t.name: (tuple(t.ne), t.type) for t in r.tensors}
        kern = r.tensor_data("blk.3.shortconv.conv.weight")
        qn = r.tensor_data("blk.2.attn_q_norm.weight")
    assert md["general.architecture"] == A and md[f"{A}.shortconv.l_cache"] == 3
    assert list(md[f"{A}.attention.head_count_kv"]) == [0, 0, 2, 0, 2, 0]
    assert info["blk.0.shortconv.conv.weight"] == ((3, 128), Type.F32)
    assert info["blk.0.shortconv.in_proj.weight"][0] == (128, 384) and "blk.0.attn_q.weight" not in info
    assert info["token_embd_norm.weight"][0] == (128,) and "output.weight" not in info
    np.testing.assert_array_equal(kern, conv.hf.model.layers[3].conv.conv.weight.detach().numpy()[:, 0])
    assert np.abs(qn - 1).min() > 0
    with load_model(conv.path(), devices="cpu") as model:
        c = model.config
        assert type(model) is Lfm2Model and model.tied_output
        assert (c.recurrent_layers, c.conv_l_cache, c.n_head_kv, c.head_dim, c.n_ff) == (RECURRENT, 3, 2, 32, 256)


def test_the_cache_recipe_and_its_memory(conv):
    """A Wrapper: the attention layers' K/V in a Causal, the convolutions' states in a Recurrent (2 past inputs of
    128 channels a sequence, its checkpoints too); the memory report has each where it belongs, the states
    the same at any context, the K/V growing with it."""
    with load_model(conv.path(), load=False, devices="cpu") as model:
        reports = {(n_ctx, n_seq): Runner.measure(model, n_ctx=n_ctx, n_seq_max=n_seq, **F32)
                   for n_ctx, n_seq in ((256, 2), (512, 2), (256, 3))}
    with load_model(conv.path(), devices="cpu") as model, Runner(model, n_ctx=256, n_seq_max=2, **F32) as rt:
        w = rt.cache
        assert isinstance(w, Wrapper) and [type(c) for c in w.caches] == [Causal, Recurrent]
        kv, rs = w.caches
        assert [w.underlying(i) is rs for i in range(6)] == list(RECURRENT)
        assert rs.states == {"conv": (2, 128)} and rs.n_checkpoints == CHECKPOINTS and w.split_equal
        assert kv.n_layers == 2 and rs.n_layers == 4
    per_layer = rs.bytes_per_layer(2)
    assert per_layer == 4 * 2 * 128 * (2 * (1 + CHECKPOINTS) + 1)
    cpu = {k: r.devices["CPU"] for k, r in reports.items()}
    conv_layers = {i for i, r in enumerate(RECURRENT) if r}
    for m in cpu.values():
        assert set(m.state) == conv_layers and {g for g, b in m.cache.items() if b} == {2, 4}
    assert set(cpu[256, 2].state.values()) == {per_layer} and cpu[512, 2].state == cpu[256, 2].state
    assert set(cpu[256, 3].state.values()) == {rs.bytes_per_layer(3)}
    assert cpu[512, 2].cache[2] == 2 * cpu[256, 2].cache[2]


def test_the_fit_counts_the_states(conv):
    """n_gpu_layers="auto"'s search learns the states per layer apart from the K/V: a smaller context scales the
    K/V it expects, not the states."""
    from ggmlpy.backend import choose_devices, split_layers
    from ggmlpy.runner.fit import _Search

    with load_model(conv.path(), load=False, devices="cpu") as model:
        report = Runner.measure(model, n_ctx=256, n_seq_max=2, **F32)
        placement = split_layers(6, choose_devices("cpu"))
    s = _Search(conv.path(), choose_devices("cpu"), 6, {}, {"CPU": 1 << 40}, None, {})
    s._learn(report, placement)
    m = report.devices["CPU"]
    assert s.state == m.state and set(s.cache) == {2, 4}
    assert s._size(0) == s.weights[0] + m.state[0] and s._size(2) == s.weights[2] + m.cache[2]
    s.rescale_cache(0.5)
    assert s.state == m.state and s.cache[2] == m.cache[2] // 2


# ------------------------------------------------------------------ logits against transformers


@pytest.mark.parametrize("flash", [False, True])
def test_one_batch_matches_transformers(conv, flash):
    err = errors(run_batch(conv.path(), conv.tokens, flash_attn=flash), conv.ref)
    assert err.max() <= TOL, err


@pytest.mark.parametrize("flash", [False, True])
def test_token_by_token_matches_transformers(conv, flash):
    """Each token alone: the convolutions' states carry every earlier input."""
    err = errors(run_steps(conv.path(), conv.tokens, flash_attn=flash), conv.ref)
    assert err.max() <= TOL, err


@pytest.mark.parametrize("flash", [False, True])
def test_several_sequences_in_one_batch(conv, flash):
    """Three sequences of different lengths in one batch (micro-batches of equal rows per sequence), then one
    more token of each in one micro-batch of three states, against transformers on each sequence alone."""
    t = conv.tokens
    assert sequences_error(conv, [t[:9], t[4:20], t[14:]], [5, 6, 7], flash=flash) <= TOL


def test_llama_cpps_error_on_the_same_file(conv, tmp_path):
    """llama.cpp (llama-cpp-python) on the same F32 file, F32 cache: within the same tolerance (measured 2.9e-6)."""
    err = errors(llama_cpp_logits(conv.path(), conv.tokens, tmp_path), conv.ref)
    assert err.max() <= TOL, err


@pytest.mark.parametrize("what", ["taps-reversed", "qk-norms-of-ones"])
def test_the_weights_are_read_as_llama_cpp_does(conv, what):
    """Each convolution's taps in the other order (the newest input first), or Q/K norms of ones: the logits
    leave the tolerance by far, so the match checks the kernel's time order and the Q/K norms."""
    def change(name, data):
        if what == "taps-reversed" and name.endswith("shortconv.conv.weight"):
            return [(name, np.ascontiguousarray(data[:, ::-1]))]
        if what == "qk-norms-of-ones" and name.endswith(("attn_q_norm.weight", "attn_k_norm.weight")):
            return [(name, np.ones_like(data))]
        return [(name, data)]

    err = errors(run_batch(derived(conv, what, tensors=change), conv.tokens), conv.ref)
    assert err.max() > 100 * TOL, err


@pytest.mark.parametrize("outtype", list(QUANT_TOL))
def test_converter_quantized_files_track_transformers(conv, outtype):
    """The converter's own F16 / Q8_0 files, an F16 cache (see the module docstring for the numbers)."""
    with load_model(conv.path(outtype), devices="cpu") as model:
        want = Type[outtype.upper()]
        assert model.weights["blk.0.shortconv.in_proj.weight"].type == want
        assert model.weights["blk.0.shortconv.conv.weight"].type == Type.F32
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
        return [h.result() for h in hs], rt.batch_sizes, rt.reallocations


@pytest.mark.parametrize("pipeline", [False, True])
def test_requests_together_generate_what_each_does_alone(conv, pipeline):
    """Three requests served together (their prompts cut into micro-batches of equal rows per sequence, their
    generation steps one micro-batch of three; pipelined too: the next batch planned while one computes, its
    state rows read after that one wrote them) generate what each does alone, logprobs too, and transformers'
    greedy tokens."""
    prompts = [conv.tokens[:6], conv.tokens[5:17], conv.tokens[-4:]]
    together, sizes, reallocations = _generate(conv, prompts, pipeline)
    assert [3] in sizes and reallocations == 0
    for p, r in zip(prompts, together):
        (alone,), _, _ = _generate(conv, [p])
        assert r.error is None and r.tokens == alone.tokens and len(set(r.tokens)) > 1
        np.testing.assert_allclose([x.logprob for x in r.logprobs], [x.logprob for x in alone.logprobs], atol=1e-4)
        assert r.tokens == hf_greedy(conv.hf, p, len(r.tokens))


@pytest.mark.parametrize("pipeline", [False, True])
def test_prefix_reuse_from_checkpoints(conv, pipeline):
    """A recurrent state goes back only to a checkpoint: the runner keeps the state at the end of each prompt and
    one token before it. A conversation that goes on from a prompt (after 2 of its 4 generated tokens) reuses
    the prompt's 12 tokens (its state after the generation cannot go back to 14); the same prompt again reuses
    11 and computes the last; a prompt that branches off at 8 reuses nothing. A fork into another slot takes the
    checkpoint too. Each computes what a fresh runner does (pipelined too: a generation step is planned while
    the one before computes)."""
    prompt = conv.tokens[:12]
    cont = prompt + [9, 10, 11]
    with load_model(conv.path(), devices="cpu") as model:
        with Runner(model, n_ctx=64, n_seq_max=2, pipeline=pipeline, **F32) as rt:
            a = rt.generate(prompt, max_tokens=4, temperature=0)
            rs = rt.cache.caches[1]
            assert [k for k, _ in rs.rows.checkpoints[0]] == [11, 12]
            b = rt.generate(prompt + a.tokens[:2] + [9], max_tokens=4, temperature=0, logprobs=True)
            c = rt.generate(prompt, max_tokens=4, temperature=0)
            d = rt.generate(prompt[:8] + [5, 6], max_tokens=4, temperature=0)
            rt.clear()
            rt.generate(prompt, max_tokens=3, temperature=0)       # slot 0: the prompt and 2 generated tokens
            # the same prompt going on another way: the slot holds more than it shares, so the prefix is forked
            # into the other slot, from the checkpoint at the prompt's end
            e = rt.generate(cont, max_tokens=4, temperature=0)
            assert rt.slots[1].tokens[:len(cont)] == cont
        assert (a.n_cached, b.n_cached, c.n_cached, d.n_cached, e.n_cached) == (0, 12, 11, 0, 12)
        with Runner(model, n_ctx=64, **F32) as fresh:
            for r, p in ((b, prompt + a.tokens[:2] + [9]), (c, prompt), (d, prompt[:8] + [5, 6]), (e, cont)):
                f = fresh.generate(p, max_tokens=4, temperature=0, logprobs=True)
                fresh.clear()
                assert r.tokens == f.tokens, p
                if r.logprobs:
                    np.testing.assert_allclose([x.logprob for x in r.logprobs], [x.logprob for x in f.logprobs],
                                               atol=1e-4)
    assert c.tokens == a.tokens


def test_context_shift_falls_back_to_computing_again(conv):
    """The state cannot drop a middle range: cache.remove raises NotSupported and changes nothing. A request that
    outgrows its context (n_ctx 24, n_keep 4) is shifted by the runner's fallback, the kept tokens computed again
    from the start, and generates exactly what direct calls doing that generate."""
    toks, n_ctx, keep = conv.tokens, 24, 4
    prompt = toks[:14]
    with load_model(conv.path(), devices="cpu") as model, Runner(model, n_ctx=n_ctx, **F32) as rt:
        rt.decode(prompt, logits=None)
        before = (rt.cache.caches[0].cells.pos.copy(), rt.cache.caches[1].rows.__dict__.copy())
        with pytest.raises(NotSupported, match="shifting positions"):
            rt.cache.remove(0, keep, keep + 3)
        assert (rt.cache.caches[0].cells.pos == before[0]).all() and rt.cache.caches[1].rows.__dict__ == before[1]
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
    """Runner.save_state/load_state of a sequence held in both caches (its K/V and its convolution states), into
    another sequence of a runner with more sequences (other rows): it goes on as transformers."""
    toks = conv.tokens
    with load_model(conv.path(), devices="cpu") as model:
        with Runner(model, n_ctx=64, n_seq_max=2, **F32) as rt:
            rt.decode(toks[:30], seq=1, logits=None)
            rt.save_state(1, tmp_path / "s.bin")
        with Runner(model, n_ctx=64, n_seq_max=3, **F32) as rt:
            rt.decode(toks[:5], seq=0, logits=None)
            assert rt.load_state(2, tmp_path / "s.bin") == toks[:30]
            got = rt.decode([toks[30]], seq=2)
            assert rt.seq_len(0) == 5
    assert errors(got, conv.ref[30:31]).max() <= TOL


# ------------------------------------------------------------------ metadata and tensors


@pytest.mark.parametrize("key,value,error,match", [
    ("attention.sliding_window", 4, MetadataError, r"'lfm2\.attention\.sliding_window': 4: sliding-window"),
    ("attention.causal", False, MetadataError, r"'lfm2\.attention\.causal': false: bidirectional"),
    ("attention.causal", 1, MetadataTypeError, r"'lfm2\.attention\.causal': expected a bool"),
    ("attention.head_count_kv", [0, 0, 2, 0, 1, 0], MetadataError,
     r"'lfm2\.attention\.head_count_kv'.*one head count for every attention layer"),
    ("attention.head_count_kv", [0, 2, 0], MetadataError, r"'lfm2\.attention\.head_count_kv'.*3 values for 6"),
    ("attention.head_count_kv", None, MetadataError, r"'lfm2\.attention\.head_count_kv': is missing"),
    ("shortconv.l_cache", None, MetadataError, r"'lfm2\.shortconv\.l_cache': is missing"),
    ("shortconv.l_cache", 1, MetadataError, r"'lfm2\.shortconv\.l_cache': 1 is out of range \[2, 1024\]"),
    ("expert_count", 4, UnknownArchitecture, r"mixture-of-experts lfm2"),
    ("rope.scaling.type", "longrope", ValueError, r"rope scaling 'longrope' \(lfm2\.rope\.scaling\.type\)"),
])
def test_unsupported_metadata_names_the_key(conv, key, value, error, match):
    with gguf.GGUFReader(str(conv.path())) as r:
        md = dict(r.metadata)
    md.pop(f"{A}.{key}", None)
    if value is not None:
        md[f"{A}.{key}"] = value
    with pytest.raises(error, match=match):
        Lfm2Config.from_metadata(md, "m.gguf").validate("m.gguf")


def test_the_layer_kinds_are_checked_against_the_tensors(conv):
    """A head count that calls an attention layer a convolution is named with the tensor it contradicts, before
    anything is allocated; a kernel not in F32 (ggml's ssm_conv reads F32) is refused naming the tensor."""
    wrong = derived(conv, "wrong-kinds", meta={f"{A}.attention.head_count_kv": np.array([0, 0, 0, 0, 2, 0], np.int32)})
    with pytest.raises(MetadataError, match=r"'lfm2\.attention\.head_count_kv': layer 2 is a convolution by it, "
                                            r"but the file has blk\.2\.attn_q\.weight"):
        load_model(wrong, devices="cpu")
    f16 = derived(conv, "f16-kernels", types=lambda name, old: Type.F16 if name.endswith("conv.weight") else old)
    with pytest.raises(MissingTensor, match=r"blk\.0\.shortconv\.conv\.weight"):
        load_model(f16, devices="cpu")


def test_the_benchmarks_synthetic_models_run(tmp_path):
    """ggmlpy bench --arch lfm2: the built-in file (llama.cpp's keys, F32 kernels) loads, gives one batch's logits
    token by token too, and llama.cpp reads it and computes the same logits."""
    from ggmlpy.models.synthetic import synthetic_path

    path = synthetic_path("tiny", "Q8_0", cache_dir=tmp_path, arch="lfm2")
    toks = [3, 1, 4, 1, 5, 9, 2, 6]
    with load_model(path, devices="cpu") as model:
        assert type(model) is Lfm2Model and model.config.recurrent_layers == (True, False)
    full, steps = run_batch(path, toks), run_steps(path, toks)
    assert np.isfinite(full).all() and errors(steps, full).max() <= 1e-3
    assert errors(llama_cpp_logits(path, toks, tmp_path), full).max() <= 1e-3
