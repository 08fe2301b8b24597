"""models/glm4moe.py (``general.architecture = "glm4moe"``) against transformers, through files written by
llama.cpp's converter.

Two tiny random-weight ``Glm4MoeForCausalLM`` (n_embd 64, 4 heads of 32 over 2 KV heads, so the attention
width 128 differs from n_embd; 8 experts of 32, 3 used, 1 shared expert) with the real gpt-2 vocabulary and
the special tokens GLM's vocabulary has and the converter looks up (``[gMASK]``, ``<|user|>``,
``<|observation|>``):

* ``glm45`` (GLM-4.5's layout): 3 layers, the first dense; Q/K/V biases and per-head Q/K norms
  (``use_qk_norm``); half of each head rotated (``partial_rotary_factor`` 0.5, NEOX); experts in 4 groups of
  which 2 are kept; sigmoid routing with the correction bias ``e_score_correction_bias`` (an HF buffer, made
  random here as the constant weights are), the weights renormalised and scaled by 2.5;
* ``air`` (GLM-4.5-Air's): 2 layers, none dense; biases but no Q/K norms; a quarter of each head rotated;
  no groups; not renormalised, scaled by 1.5; tied embeddings.

The converter counts a NextN (multi-token prediction) layer in ``block_count`` and writes
``nextn_predict_layers = 1`` with no tensors for it (transformers does not keep them): the file runs 3
(2) layers, as llama.cpp reads it. A file that has the NextN layer's tensors loads and runs the same
(:func:`test_nextn_layers_are_skipped`).

Every feature matters: with the Q/K norms, the routing groups, the bias, the renormalisation, the scale or the
rotated part's size changed in a copied file, the logits leave the tolerance by far
(:func:`test_the_settings_are_what_matches`).

Tolerance with F32 weights and an F32 cache: per position, max |got - ref| / max |ref| at most 1e-5 (measured
in one batch, token by token and with three sequences in one batch, both attention paths: glm45 7.2e-7 to
9.7e-7, air 8.9e-7 to 1.1e-6). llama.cpp itself (llama-cpp-python 0.3.36, F32 cache, no flash attention) on
the same files: the same error (7.2e-7, 1.0e-6), and ggmlpy's logits are its own to 1e-6 (measured
bit-identical).

Converter files (``--outtype f16`` / ``q8_0``), F16 cache, against transformers: F16 at most 3e-3 everywhere,
Q8_0 median 3e-2 and max 0.1 at the positions whose routing is clear (in every layer the last kept group's
and the last chosen expert's scores lead the next by more than 0.01: 32 of the 39), the tolerances of the
other architectures' tests (measured: see :data:`QUANT_TOL`; 0.13 to 0.31 at three of the seven near ties,
a sigmoid score 0.001 to 0.005 from the next, where llama.cpp's error is the same); llama.cpp on the same
files gives the same logits at those positions to 2e-3 of the largest logit (measured bit-identical).
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch") if not os.environ.get("CI") else __import__("torch")
transformers = pytest.importorskip("transformers") if not os.environ.get("CI") else __import__("transformers")

import hf_convert  # noqa: E402
from arch_helpers import (  # noqa: E402
    copy_gguf,
    llama_cpp_logits,
    make,
    run_batch,
    run_steps,
    sequences_error,
    shift_error,
)
from test_arch_deepseek import hf_greedy, routing_lead  # noqa: E402
from test_models_converted import TEXT, TOL, errors, hf_logits  # noqa: E402

from ggmlpy import Type, gguf  # noqa: E402
from ggmlpy.gguf import MetadataError, MetadataTypeError  # noqa: E402
from ggmlpy.kvcache import Causal  # noqa: E402
from ggmlpy.models import load_model  # noqa: E402
from ggmlpy.models.glm4moe import Glm4MoeConfig, Glm4MoeModel  # noqa: E402
from ggmlpy.runner import DoneReason, Runner  # noqa: E402
from ggmlpy.runner.slots import shift_discard  # noqa: E402

pytestmark = pytest.mark.hf

A = "glm4moe"
COMMON = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1,
              attention_bias=True, max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.1)
MODELS = {
    "glm45": dict(num_hidden_layers=3, first_k_dense_replace=1, use_qk_norm=True, n_group=4, topk_group=2,
                  norm_topk_prob=True, routed_scaling_factor=2.5, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    "air": dict(num_hidden_layers=2, first_k_dense_replace=0, use_qk_norm=False, n_group=1, topk_group=1,
                norm_topk_prob=False, routed_scaling_factor=1.5, tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}),
}
#: per-position error bounds (median, max at the clear positions) by converter --outtype; measured glm45 F16
#: max 1.9e-3, Q8_0 median 0.025, 0.038 at the clear positions
QUANT_TOL = {"f16": (3e-3, 3e-3), "q8_0": (3e-2, 0.1)}
#: GLM's special tokens the converter looks up in the tokenizer (conversion/base.py: _set_vocab_glm)
GLM_TOKENS = ["[gMASK]", "<|user|>", "<|observation|>"]


def glm_tokenizer():
    """gpt-2's tokenizer (a BPE vocabulary the converter recognises) with GLM's special tokens added."""
    tok = transformers.AutoTokenizer.from_pretrained(str(hf_convert.tokenizer_dir("gpt-2")))
    tok.add_special_tokens({"additional_special_tokens": GLM_TOKENS})
    return tok


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """``models(name)``: the HF model and its files (each made once for the module)."""
    made = {}

    def get(name):
        if name not in made:
            tok = glm_tokenizer()
            tokens = [tok.bos_token_id, *tok(TEXT + " " + TEXT, add_special_tokens=False)["input_ids"]]
            conv = make("Glm4MoeForCausalLM", "Glm4MoeConfig", "gpt-2", tokens, tmp_path_factory.mktemp(name),
                        vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                        **COMMON, **MODELS[name])
            conv.tokenizer = tok
            with torch.no_grad():
                for n, b in conv.hf.named_buffers():
                    if n.endswith("e_score_correction_bias"):
                        # a buffer HF initialises to 0, which the constant-weight perturbation does not reach
                        b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(5)) * 0.1)
            conv.name, conv.ref = name, hf_logits(conv.hf, tokens)
            made[name] = conv
        return made[name]

    return get


@pytest.fixture(scope="module", params=list(MODELS))
def conv(request, models):
    return models(request.param)


@pytest.fixture(scope="module")
def glm45(models):
    return models("glm45")


def derived(conv, what: str, src=None, **kw):
    """A file made from ``src`` (``conv``'s F32 file) by :func:`copy_gguf` once (cached under ``what``)."""
    if what not in conv.paths:
        conv.paths[what] = copy_gguf(src or conv.path(), conv.out_dir / f"{what}.gguf", **kw)
    return conv.paths[what]


def one_layer(conv):
    """The file with only its first layer (where a context shift is exact)."""
    return derived(conv, "one-layer", meta={f"{A}.block_count": 1, f"{A}.nextn_predict_layers": None},
                   tensors=lambda name, data: [] if name.startswith("blk.") and not name.startswith("blk.0.")
                   else [(name, data)])


# ------------------------------------------------------------------ the file and the model read from it


def test_the_file_is_the_converters(conv):
    """llama.cpp's keys and tensors: partial RoPE, biases, Q/K norms where the model has them, the pre-feed-forward
    norm as post_attention_norm, DeepSeek-style experts; a NextN layer counted but not written. The model reads
    them."""
    hc = conv.hf.config
    glm45 = conv.name == "glm45"
    n_layer = hc.num_hidden_layers
    rot = int(32 * hc.rope_parameters["partial_rotary_factor"])
    with gguf.GGUFReader(str(conv.path())) as r:
        md, ne = r.metadata, {t.name: tuple(t.ne) for t in r.tensors}
        bias = r.tensor_data("blk.1.exp_probs_b.bias")
    assert md["general.architecture"] == A and md["tokenizer.ggml.pre"] == "gpt-2"
    assert (md[f"{A}.block_count"], md[f"{A}.nextn_predict_layers"]) == (n_layer + 1, 1)
    assert not any(n.startswith(f"blk.{n_layer}.") for n in ne)
    assert (md[f"{A}.attention.key_length"], md[f"{A}.rope.dimension_count"]) == (32, rot)
    assert md[f"{A}.expert_gating_func"] == 2 and md[f"{A}.leading_dense_block_count"] == int(glm45)
    assert md[f"{A}.expert_weights_norm"] is glm45 and md[f"{A}.expert_weights_scale"] == hc.routed_scaling_factor
    assert ne["blk.1.attn_q.weight"] == (64, 128) and ne["blk.1.attn_k.bias"] == (64,)
    assert ("blk.1.attn_q_norm.weight" in ne) == glm45 and ne["blk.1.post_attention_norm.weight"] == (64,)
    assert ne["blk.1.ffn_gate_exps.weight"] == (64, 32, 8) and ne["blk.1.ffn_down_shexp.weight"] == (32, 64)
    assert ("blk.0.ffn_gate.weight" in ne) == glm45 and ("output.weight" in ne) != hc.tie_word_embeddings
    np.testing.assert_array_equal(bias, conv.hf.model.layers[1].mlp.gate.e_score_correction_bias.numpy())
    with load_model(conv.path(), devices="cpu") as model:
        c = model.config
        assert type(model) is Glm4MoeModel and (model.qkv_bias, model.qk_norm) == (True, glm45)
        assert (c.n_layer, c.n_layer_nextn, c.head_dim, c.rope_dim, c.n_head_kv) == (n_layer, 1, 32, rot, 2)
        assert (c.gating, c.n_dense_lead, c.n_expert, c.n_expert_used, c.n_expert_shared) == \
            ("sigmoid", int(glm45), 8, 3, 1)
        assert (c.n_group, c.n_group_used) == ((4, 2) if glm45 else (0, 0))
        assert model.probs_bias == frozenset(range(int(glm45), n_layer))
        assert type(model.new_cache()) is Causal


# ------------------------------------------------------------------ logits against transformers (and llama.cpp)


@pytest.mark.parametrize("flash", [False, True])
def test_one_batch_matches_transformers(conv, flash):
    err = errors(run_batch(conv.path(), conv.tokens, flash_attn=flash), conv.ref)
    assert err.max() <= TOL, err


@pytest.mark.parametrize("flash", [False, True])
def test_token_by_token_matches_transformers(conv, flash):
    err = errors(run_steps(conv.path(), conv.tokens, flash_attn=flash), conv.ref)
    assert err.max() <= TOL, err


@pytest.mark.parametrize("flash", [False, True])
def test_several_sequences_in_one_batch(conv, flash):
    t = conv.tokens
    assert sequences_error(conv, [t[:9], t[4:24], t[17:]], [5, 6, 7], flash=flash) <= TOL


def test_unfused_weights_give_the_same_logits(glm45):
    """Q/K/V (with their biases), the dense layer's and the shared experts' gate and up kept apart."""
    with load_model(glm45.path(), fuse=False, devices="cpu") as model, \
            Runner(model, n_ctx=64, type_k="f32", type_v="f32") as rt:
        assert model.fused == {}
        got = rt.decode(glm45.tokens, logits="all")
    with load_model(glm45.path(), devices="cpu") as model:
        assert {"blk.1.attn_qkv.weight", "blk.1.attn_qkv.bias", "blk.1.ffn_gate_up_shexp.weight"} <= set(model.fused)
    assert errors(got, glm45.ref).max() <= TOL


def test_llama_cpp_gives_the_same_logits(conv):
    lc = llama_cpp_logits(conv.path(), conv.tokens, conv.out_dir)
    assert errors(lc, conv.ref).max() <= TOL
    assert errors(run_batch(conv.path(), conv.tokens, flash_attn=False), lc).max() <= 1e-6


@pytest.mark.parametrize("what,kw", [
    ("no-qk-norm", dict(tensors=lambda name, data: [] if name.endswith(("attn_q_norm.weight", "attn_k_norm.weight"))
                        else [(name, data)])),
    ("no-groups", dict(meta={f"{A}.expert_group_count": None, f"{A}.expert_group_used_count": None})),
    ("softmax", dict(meta={f"{A}.expert_gating_func": 1})),
    ("unscaled", dict(meta={f"{A}.expert_weights_scale": 1.0})),
    ("not-renormalised", dict(meta={f"{A}.expert_weights_norm": False})),
    ("full-rope", dict(meta={f"{A}.rope.dimension_count": 32})),
    ("no-bias", dict(tensors=lambda name, data: [] if name.endswith("exp_probs_b.bias") else [(name, data)])),
])
def test_the_settings_are_what_matches(glm45, what, kw):
    """With one setting changed (each read from the file), the logits leave the tolerance by far (measured 0.41 to
    0.70)."""
    err = errors(run_batch(derived(glm45, what, **kw), glm45.tokens), glm45.ref)
    assert err.max() > 100 * TOL, err


# ------------------------------------------------------------------ quantized files


@pytest.mark.parametrize("outtype", list(QUANT_TOL))
def test_converter_quantized_files_track_transformers(glm45, outtype):
    path = glm45.path(outtype)
    want = Type[outtype.upper()]
    with load_model(path, devices="cpu") as model:
        for name in ("ffn_down_exps", "ffn_down_shexp", "attn_qkv", "attn_output"):
            assert model.weights[f"blk.1.{name}.weight"].type == want, name
        assert model.weights["blk.1.ffn_gate_inp.weight"].type == Type.F32
        with Runner(model, n_ctx=64, flash_attn=False) as rt:
            got = rt.decode(glm45.tokens, logits="all")
    err = errors(got, glm45.ref)
    med, worst = QUANT_TOL[outtype]
    clear = routing_lead(glm45.hf, glm45.tokens) > 0.01
    assert clear.sum() >= len(clear) - 8
    assert np.median(err) <= med and err[clear].max() <= worst, err
    if importlib.util.find_spec("llama_cpp") is None:
        return
    assert errors(got, llama_cpp_logits(path, glm45.tokens, glm45.out_dir, f32_cache=False))[clear].max() <= 2e-3


# ------------------------------------------------------------------ metadata


@pytest.mark.parametrize("key,value,error,match", [
    ("rope.dimension_sections", [8, 4, 4, 0], MetadataError, r"'glm4moe\.rope\.dimension_sections': is set"),
    ("expert_gating_func", 4, MetadataError, r"'glm4moe\.expert_gating_func': 4 is not supported"),
    ("expert_weights_norm", 1, MetadataTypeError, r"'glm4moe\.expert_weights_norm': expected a bool"),
    ("expert_shared_count", None, MetadataError, r"'glm4moe\.expert_shared_count': is missing"),
    ("expert_shared_count", 0, MetadataError, r"'glm4moe\.expert_shared_count': 0 is out of range"),
    ("expert_count", 0, MetadataError, r"'glm4moe\.expert_count': is 0, but layers 1 \.\. 2 are not dense"),
    ("expert_group_used_count", 4, MetadataError, r"'glm4moe\.expert_group_used_count': 4 must be in \[1, 3\]"),
    ("nextn_predict_layers", 4, MetadataError, r"'glm4moe\.nextn_predict_layers': 4 is out of range"),
    ("rope.dimension_count", 40, ValueError, r"glm4moe\.rope\.dimension_count 40 must be even and in \(0, 32\]"),
    ("attention.value_length", 16, ValueError, r"key and value head sizes differ"),
])
def test_unsupported_metadata_names_the_key(glm45, key, value, error, match):
    with gguf.GGUFReader(str(glm45.path())) as r:
        md = dict(r.metadata)
    md.pop(f"{A}.{key}", None)
    if value is not None:
        md[f"{A}.{key}"] = value
    with pytest.raises(error, match=match):
        Glm4MoeConfig.from_metadata(md, "m.gguf").validate("m.gguf")


def test_sigmoid_is_glm4moes_default_routing(glm45):
    """llama.cpp routes a glm4moe file without expert_gating_func by sigmoid (deepseek2's default is softmax)."""
    with gguf.GGUFReader(str(glm45.path())) as r:
        md = dict(r.metadata)
    md.pop(f"{A}.expert_gating_func")
    assert Glm4MoeConfig.from_metadata(md, "m.gguf").gating == "sigmoid"
    path = derived(glm45, "no-gating-key", meta={f"{A}.expert_gating_func": None})
    assert errors(run_batch(path, glm45.tokens), glm45.ref).max() <= TOL


def test_nextn_layers_are_skipped(glm45):
    """A file with its NextN layer's tensors (a whole layer after the last one run, and the nextn.* tensors, as
    llama.cpp names them) loads, leaves them in the file, and gives the same logits."""
    extra = {"nextn.eh_proj.weight": (128, 64), "nextn.enorm.weight": (64,), "nextn.hnorm.weight": (64,),
             "nextn.shared_head_norm.weight": (64,)}

    def add_layer(name, data):
        out = [(name, data)]
        if name.startswith("blk.2."):
            out.append(("blk.3." + name[6:], data))
        if name == "output_norm.weight":
            out += [(f"blk.3.{n}", np.ones(ne[::-1], np.float32)) for n, ne in extra.items()]
        return out

    path = derived(glm45, "nextn", tensors=add_layer)
    with gguf.GGUFReader(str(path)) as r:
        assert "blk.3.nextn.eh_proj.weight" in r and "blk.3.ffn_gate_exps.weight" in r
    with load_model(path, devices="cpu") as model:
        assert (model.config.n_layer, model.config.n_layer_nextn) == (3, 1)
        assert not any(n.startswith("blk.3.") for n in model.weights.tensors)
        with Runner(model, n_ctx=64, type_k="f32", type_v="f32") as rt:
            got = rt.decode(glm45.tokens, logits="all")
    assert errors(got, glm45.ref).max() <= TOL


# ------------------------------------------------------------------ the runner


def test_requests_together_generate_each_as_alone(glm45):
    prompts = [glm45.tokens[:6], glm45.tokens[5:17], glm45.tokens[-4:]]
    with load_model(glm45.path(), devices="cpu") as model:
        with Runner(model, n_ctx=64, n_seq_max=3, n_batch=16, type_k="f32", type_v="f32") as rt:
            together = [h.result() for h in [rt.submit(p, max_tokens=6, temperature=0) for p in prompts]]
            assert [3] in rt.batch_sizes, rt.batch_sizes
            assert rt.reallocations == 0
        with Runner(model, n_ctx=64, type_k="f32", type_v="f32") as rt:
            alone = [rt.generate(p, max_tokens=6, temperature=0) for p in prompts]
    for p, t, a in zip(prompts, together, alone):
        assert t.tokens == a.tokens
        want = hf_greedy(glm45.hf, p, 6)
        assert t.tokens == want[:len(t.tokens)] and (len(t.tokens) == 6 or t.done_reason == DoneReason.STOP)


def test_prefix_reuse(glm45):
    prompt = glm45.tokens[:12]
    with load_model(glm45.path(), devices="cpu") as model:
        with Runner(model, n_ctx=64, n_seq_max=2, type_k="f32", type_v="f32") as rt:
            a = rt.generate(prompt, max_tokens=4, temperature=0)
            b = rt.generate(prompt + a.tokens[:2] + [9], max_tokens=4, temperature=0)
            assert (a.n_cached, b.n_cached) == (0, len(prompt) + 2)
        with Runner(model, n_ctx=64, type_k="f32", type_v="f32") as rt:
            assert rt.generate(prompt + a.tokens[:2] + [9], max_tokens=4, temperature=0).tokens == b.tokens


@pytest.mark.parametrize("flash", [False, True])
def test_context_shift_equals_from_scratch(glm45, flash):
    """remove(keep, keep + discard) re-rotates only the rotated half of each key head (after the Q/K norm); the
    logits equal a fresh run over the kept tokens (one layer: a shift is exact there)."""
    assert shift_error(one_layer(glm45), glm45.tokens[:24], 4, 10, flash).max() <= TOL


def test_runner_context_shift(glm45):
    prompt, n_ctx, keep = glm45.tokens[:6], 16, 2
    with load_model(one_layer(glm45), devices="cpu") as model, \
            Runner(model, n_ctx=n_ctx, type_k="f32", type_v="f32") as rt:
        r = rt.generate(prompt, max_tokens=n_ctx - len(prompt) + 2, n_keep=keep, temperature=0)
        if r.done_reason == DoneReason.STOP:
            pytest.skip("the model generated its EOS before the context filled")
        assert r.n_shifts == 1
        full = (prompt + r.tokens[:-1])[:n_ctx]
        d = shift_discard(len(full), keep, n_ctx)
        rt.clear()
        logits = rt.decode(full[:keep] + full[keep + d:] + (prompt + r.tokens[:-1])[n_ctx:])
    assert int(logits[0].argmax()) == r.tokens[-1]


def test_embeddings_match_transformers(glm45):
    with load_model(glm45.path(), devices="cpu") as model, \
            Runner(model, n_ctx=64, type_k="f32", type_v="f32") as rt:
        got = rt.embed(glm45.tokens)
    with torch.no_grad():
        hidden = glm45.hf.model(torch.tensor([glm45.tokens])).last_hidden_state[0].numpy()
    want = hidden.mean(0)
    want /= np.linalg.norm(want)
    assert np.abs(got - want).max() <= TOL * np.abs(want).max()


def test_state_save_and_load(glm45, tmp_path):
    toks = glm45.tokens
    with load_model(glm45.path(), devices="cpu") as model, \
            Runner(model, n_ctx=64, n_seq_max=2, type_k="f32", type_v="f32") as rt:
        rt.decode(toks[:30], seq=1, logits=None)
        rt.save_state(1, tmp_path / "s.bin")
        rt.clear()
        assert rt.load_state(0, tmp_path / "s.bin") == toks[:30]
        got = rt.decode([toks[30]], seq=0)
    assert errors(got, glm45.ref[30:31]).max() <= TOL


# ------------------------------------------------------------------ the benchmark's files


def test_the_benchmarks_synthetic_model_runs(tmp_path):
    """ggmlpy bench --arch glm4moe: the built-in file loads and gives one batch's logits token by token too;
    llama.cpp gives the same."""
    from ggmlpy.models.synthetic import synthetic_path

    path = synthetic_path("tiny", "Q8_0", cache_dir=tmp_path, arch=A)
    toks = [3, 1, 4, 1, 5, 9, 2, 6]
    with load_model(path, devices="cpu") as model:
        c = model.config
        assert type(model) is Glm4MoeModel and model.qkv_bias and model.qk_norm
        assert (c.rope_dim, c.head_dim, c.gating, c.n_dense_lead, c.n_expert_shared) == (8, 16, "sigmoid", 1, 1)
    full, steps = run_batch(path, toks, flash_attn=False), run_steps(path, toks)
    assert np.isfinite(full).all() and errors(steps, full).max() <= 1e-3
    if importlib.util.find_spec("llama_cpp") is None:
        return
    assert errors(full, llama_cpp_logits(path, toks, tmp_path)).max() <= 1e-6


def test_the_real_shape_preset_is_glm45_airs_layers():
    """The benchmark's glm4.5-air-8L: transformers' Glm4MoeForCausalLM with GLM-4.5-Air's widths (its config's
    defaults) in 8 layers has its parameters, plus GLM-4.5's Q/K norms and the routing bias the file stores."""
    from ggmlpy.models.synthetic import SIZES

    c = SIZES["glm4.5-air-8L"]
    real = transformers.Glm4MoeConfig()             # GLM-4.5-Air's, but for the head size its config.json gives
    cfg = transformers.Glm4MoeConfig(num_hidden_layers=c.n_layer, attention_bias=True, head_dim=128)
    assert (c.n_embd, c.n_head, c.n_head_kv, c.n_ff, c.n_ff_exp, c.n_expert, c.n_expert_used, c.n_vocab,
            c.n_dense_lead) == \
        (real.hidden_size, real.num_attention_heads, real.num_key_value_heads, real.intermediate_size,
         real.moe_intermediate_size, real.n_routed_experts, real.num_experts_per_tok, real.vocab_size,
         real.first_k_dense_replace)
    assert (c.head_dim, c.n_rot) == (128, int(128 * real.rope_parameters["partial_rotary_factor"]))
    with torch.device("meta"):
        hf = transformers.Glm4MoeForCausalLM(cfg)
    n_hf = sum(p.numel() for p in hf.parameters())
    assert c.n_params == n_hf + c.n_layer * 2 * c.head_dim + (c.n_layer - c.n_dense_lead) * c.n_expert
