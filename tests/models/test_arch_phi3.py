"""models/phi3.py against transformers' Phi3ForCausalLM, through files written by llama.cpp's converter.

The main model has LongRoPE (short and long factors, an original context of 16 that the test prompt and
the runner's context cross) and rotates half of each head (``partial_rotary_factor`` 0.5, as Phi-4-mini
rotates 3/4); the converter writes Q/K/V as one ``attn_qkv`` matrix and gate/up as one ``ffn_up``, its
SentencePiece vocabulary is trained by tests/hf_convert.py. A second model has a sliding window of 8, a
third one layer (where a context shift is exact).

Tolerance with F32 weights and an F32 cache: at each position the max abs error is at most 1e-5 x that
position's largest |logit| (measured: 4.7e-7 in one batch, 5.6e-7 with flash attention, 5.0e-7 token by
token, 4.3e-7 for several sequences in one batch, 4.6e-7 with the window). F16 and Q8_0 files with an
F16 cache: test_models_llama's tolerances on the whole array (measured F16 4.9e-4, Q8_0 1.0e-2), the same
top-1 wherever the reference's lead exceeds twice the error (Q8_0 flips one near-tie of 51).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch") if not os.environ.get("CI") else __import__("torch")
transformers = pytest.importorskip("transformers") if not os.environ.get("CI") else __import__("transformers")
spm = pytest.importorskip("sentencepiece") if not os.environ.get("CI") else __import__("sentencepiece")

import hf_convert  # noqa: E402
from arch_helpers import assert_same_top1, copy_gguf, make, run_batch, run_steps, sequences_error  # noqa: E402
from test_models_converted import TEXT, TOL, errors, hf_logits  # noqa: E402
from test_models_llama import rel_err  # noqa: E402

from ggmlpy import GGMLValueError, gguf  # noqa: E402
from ggmlpy.models import UnknownArchitecture, load_model  # noqa: E402
from ggmlpy.models.phi3 import ContextCache, Phi3Model  # noqa: E402
from ggmlpy.runner import Runner  # noqa: E402

pytestmark = pytest.mark.hf

ORIG = 16               # LongRoPE's original context: the runner's n_ctx above it picks the long factors
SHORT = [1.0, 1.3, 1.6, 1.9]
LONG = [3.0, 5.0, 7.0, 9.0]


def phi3_config(**kw) -> dict:
    cfg = dict(vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, sliding_window=None,
               tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return {**cfg, **kw}


def longrope(**kw) -> dict:
    return phi3_config(original_max_position_embeddings=ORIG, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "short_factor": SHORT,
        "long_factor": LONG, "original_max_position_embeddings": ORIG, "factor": 256 / ORIG}, **kw)


@pytest.fixture(scope="module")
def tokens():
    sp = spm.SentencePieceProcessor(model_file=str(hf_convert.spm_tokenizer_model()))
    return [sp.bos_id(), *sp.encode(TEXT), sp.eos_id()]


@pytest.fixture(scope="module")
def phi3(tmp_path_factory, tokens):
    conv = make("Phi3ForCausalLM", "Phi3Config", hf_convert.SPM, tokens, tmp_path_factory.mktemp("phi3"), **longrope())
    assert len(tokens) > ORIG
    conv.path()
    return conv


@pytest.fixture(scope="module")
def ref(phi3):
    """transformers' logits of the whole prompt (longer than ORIG: the long factors)."""
    return hf_logits(phi3.hf, phi3.tokens)


def test_the_file_is_the_converters(phi3):
    """llama.cpp's layout: fused attn_qkv and ffn_up (gate rows, then up rows), the two factor sets of
    rope_dim / 2 values, LongRoPE's attention factor, the original context; no scaling type."""
    hf = phi3.hf
    with gguf.GGUFReader(str(phi3.path())) as r:
        md, names = r.metadata, {t.name: tuple(t.ne) for t in r.tensors}
        assert np.array_equal(r.tensor_data("rope_factors_long.weight"), np.float32(LONG))
        assert np.array_equal(r.tensor_data("rope_factors_short.weight"), np.float32(SHORT))
    assert md["general.architecture"] == "phi3" and "phi3.rope.scaling.type" not in md
    assert md["phi3.rope.scaling.original_context_length"] == ORIG and md["phi3.rope.dimension_count"] == 8
    assert md["phi3.rope.scaling.attn_factor"] == pytest.approx(hf.model.rotary_emb.attention_scaling, rel=1e-6)
    assert names["blk.0.attn_qkv.weight"] == (64, 64 + 2 * 32) and names["blk.0.ffn_up.weight"] == (64, 2 * 96)
    assert "blk.0.ffn_gate.weight" not in names and "blk.0.attn_q.weight" not in names
    with load_model(phi3.path(), devices="cpu") as model:
        c = model.config
        assert isinstance(model, Phi3Model) and model.longrope == ("rope_factors_short.weight",
                                                                    "rope_factors_long.weight")
        assert (c.rope_dim, c.n_ctx_orig, c.rope_freq_scale, c.rope_ext_factor) == (8, ORIG, 1.0, 0.0)
        assert c.rope_attn_factor == pytest.approx(hf.model.rotary_emb.attention_scaling, rel=1e-6)
        assert c.rope_attn_factor > 1
        assert c.sliding_window is None and model.fused == {}


@pytest.mark.parametrize("flash", [False, True])
def test_one_batch_matches_transformers(phi3, ref, flash):
    err = errors(run_batch(phi3.path(), phi3.tokens, flash_attn=flash), ref)
    assert err.max() <= TOL, err


@pytest.mark.parametrize("flash", [False, True])
def test_token_by_token_matches_transformers(phi3, ref, flash):
    err = errors(run_steps(phi3.path(), phi3.tokens, flash_attn=flash), ref)
    assert err.max() <= TOL, err


@pytest.mark.parametrize("flash", [False, True])
def test_several_sequences_in_one_batch(phi3, flash):
    """Three sequences longer than ORIG (transformers uses the long factors for each alone)."""
    t = phi3.tokens
    assert sequences_error(phi3, [t[:20], t[8:40], t[17:]], [5, 6, 7], flash=flash) <= TOL


def test_the_factors_follow_the_context_as_in_llama_cpp(phi3, ref):
    """llama.cpp picks the factors by the context per sequence: a prompt of ORIG tokens gets the short
    factors in a context of ORIG (transformers' choice for that prompt alone), and the long ones in a
    context of 64 (transformers' for the same positions of a longer prompt)."""
    prompt = phi3.tokens[:ORIG]
    short = hf_logits(phi3.hf, prompt)
    assert errors(short, ref[:ORIG]).max() > 1e-3                 # the two sets give other logits
    with load_model(phi3.path(), devices="cpu") as model:
        for n_ctx, want, name in ((ORIG, short, "short"), (64, ref[:ORIG], "long")):
            with Runner(model, n_ctx=n_ctx, type_k="f32", type_v="f32") as rt:
                assert isinstance(rt.cache, ContextCache) and rt.cache.n_ctx_seq == n_ctx
                assert model.rope_factors(rt.cache, 0) is model.weights[f"rope_factors_{name}.weight"]
                err = errors(rt.decode(prompt, logits="all"), want)
            assert err.max() <= TOL, (n_ctx, err)
        assert model.rope_factors(None, 1) is model.weights["rope_factors_short.weight"]


def test_longrope_scaling_type_and_separate_qkv_are_read(phi3, ref, tmp_path):
    """A file that says rope.scaling.type = longrope, and one with attn_q/attn_k/attn_v instead of
    attn_qkv (fused again by the loader, or kept apart), give the same logits."""
    def split(name, data):
        if not name.endswith("attn_qkv.weight"):
            return [(name, data)]
        pre = name[:-len("attn_qkv.weight")]
        return [(pre + "attn_q.weight", data[:64]), (pre + "attn_k.weight", data[64:96]),
                (pre + "attn_v.weight", data[96:])]

    typed = copy_gguf(phi3.path(), tmp_path / "typed.gguf", meta={"phi3.rope.scaling.type": "longrope"})
    assert errors(run_batch(typed, phi3.tokens), ref).max() <= TOL
    parts = copy_gguf(phi3.path(), tmp_path / "parts.gguf", tensors=split)
    for fuse in (False, True):
        with load_model(parts, fuse=fuse, devices="cpu") as model, \
                Runner(model, n_ctx=64, type_k="f32", type_v="f32") as rt:
            assert ("blk.1.attn_qkv.weight" in model.fused) == fuse and not model.qkv_in_file
            err = errors(rt.decode(phi3.tokens, logits="all"), ref)
        assert err.max() <= TOL, (fuse, err)


@pytest.mark.parametrize("outtype,tol", [("f16", 3e-3), ("q8_0", 3e-2)])
def test_f16_and_q8_0_files(phi3, ref, outtype, tol):
    got = run_batch(phi3.path(outtype), phi3.tokens, type_k="f16", type_v="f16")
    assert rel_err(got, ref) < tol, rel_err(got, ref)
    assert_same_top1(got, ref)


@pytest.fixture(scope="module")
def windowed(tmp_path_factory, tokens):
    conv = make("Phi3ForCausalLM", "Phi3Config", hf_convert.SPM, tokens, tmp_path_factory.mktemp("phi3w"),
                **phi3_config(sliding_window=8))
    ref = hf_logits(conv.hf, tokens)
    conv.hf.config.sliding_window = None
    try:
        assert errors(hf_logits(conv.hf, tokens), ref).max() > 1e-3     # the window matters for this prompt
    finally:
        conv.hf.config.sliding_window = 8
    return conv, ref


@pytest.mark.parametrize("flash", [False, True])
def test_sliding_window(windowed, tokens, flash):
    """A window of 8 (Phi-3-mini-4k's is 2047) on every layer, as transformers applies it."""
    conv, ref = windowed
    with load_model(conv.path(), devices="cpu") as model:
        assert model.config.sliding_window == 8 and model.new_cache(flash_attn=flash).window == 7
    assert errors(run_batch(conv.path(), tokens, flash_attn=flash), ref).max() <= TOL
    assert errors(run_steps(conv.path(), tokens, flash_attn=flash), ref).max() <= TOL


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory, tokens):
    conv = make("Phi3ForCausalLM", "Phi3Config", hf_convert.SPM, tokens, tmp_path_factory.mktemp("phi3s"),
                seed=21, **longrope(num_hidden_layers=1))
    conv.path()
    return conv


@pytest.mark.parametrize("flash", [False, True])
def test_context_shift_equals_from_scratch(one_layer, flash):
    """After remove(keep, keep + discard) the kept keys are re-rotated with the long factors and without
    the attention factor again (it scales cos and sin: applied twice, every shifted key would grow by
    it); the logits equal a fresh run over the kept tokens (one layer: a shift is exact there)."""
    toks, keep, discard = one_layer.tokens[:30], 4, 10
    with load_model(one_layer.path(), devices="cpu") as model, \
            Runner(model, n_ctx=32, type_k="f32", type_v="f32", flash_attn=flash) as rt:
        assert model.config.rope_attn_factor > 1.1
        rt.decode(toks)
        rt.cache.remove(0, keep, keep + discard)
        shifted = rt.decode([9, 10], logits="all")
        rt.clear()
        scratch = rt.decode(toks[:keep] + toks[keep + discard:] + [9, 10], logits="all")[-2:]
    assert errors(shifted, scratch).max() <= TOL


def test_runner_shift_and_prefix_reuse(one_layer):
    """The runner's own context shift (generation past n_ctx) and a reused prefix give what a fresh run
    gives."""
    from ggmlpy.runner.slots import shift_discard

    prompt, n_ctx, keep = one_layer.tokens[:6], 24, 2
    with load_model(one_layer.path(), devices="cpu") as model:
        with Runner(model, n_ctx=n_ctx, type_k="f32", type_v="f32", pipeline=False) as rt:
            r = rt.generate(prompt, max_tokens=n_ctx - len(prompt) + 2, n_keep=keep, temperature=0)
            assert r.n_shifts == 1
            history = prompt + r.tokens[:-1]
            full = history[:n_ctx]
            d = shift_discard(len(full), keep, n_ctx)
            rt.clear()
            logits = rt.decode(full[:keep] + full[keep + d:] + history[n_ctx:])
        assert int(logits[0].argmax()) == r.tokens[-1]
        prompt = one_layer.tokens[:20]
        with Runner(model, n_ctx=64, n_seq_max=2, type_k="f32", type_v="f32") as rt:
            a = rt.generate(prompt, max_tokens=5, temperature=0)
            b = rt.generate(prompt + a.tokens[:2] + [9], max_tokens=5, temperature=0)  # shares the whole history
            assert (a.n_cached, b.n_cached) == (0, len(prompt) + 2)
        with Runner(model, n_ctx=64, type_k="f32", type_v="f32") as rt:
            assert rt.generate(prompt + a.tokens[:2] + [9], max_tokens=5, temperature=0).tokens == b.tokens


@pytest.mark.parametrize("key,value,error", [
    ("phi3.expert_count", 4, UnknownArchitecture),
    ("phi3.rope.scaling.type", "su", GGMLValueError),
])
def test_unsupported_metadata_names_the_key(phi3, tmp_path, key, value, error):
    path = copy_gguf(phi3.path(), tmp_path / "x.gguf", meta={key: value})
    with pytest.raises(error, match=key.replace(".", r"\.")):
        load_model(path, devices="cpu")
