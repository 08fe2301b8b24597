"""models/olmo2.py and models/granite.py against transformers' Olmo2ForCausalLM and GraniteForCausalLM,
through files written by llama.cpp's converter with the real gpt-2 vocabulary.

The granite model has every multiplier (embedding 12, residual 0.22, attention 0.05 in place of
1 / sqrt(16), logits divided by 8), Q/K/V and output-projection biases and a tied output; olmo2's
post-norms and whole-projection Q/K norms are made random before converting, as every constant weight.

Tolerance with F32 weights and an F32 cache: at each position the max abs error is at most 1e-5 x that
position's largest |logit| (measured: olmo2 7.0e-7 in one batch, 5.9e-7 token by token, 7.1e-7 for several
sequences in one batch; granite 2.6e-7, 2.6e-7 and 2.7e-7). F16 and Q8_0 files with an F16 cache:
test_models_llama's tolerances on the whole array (measured olmo2 1.1e-3 and 1.9e-2, granite 1.9e-4 and
4.7e-3), the same top-1 wherever the reference's lead exceeds twice the error (everywhere, measured).
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch") if not os.environ.get("CI") else __import__("torch")
transformers = pytest.importorskip("transformers") if not os.environ.get("CI") else __import__("transformers")

import hf_convert  # noqa: E402
from arch_helpers import assert_same_top1, copy_gguf, make, run_batch, run_steps, sequences_error  # noqa: E402
from test_models_converted import TEXT, TOL, errors, hf_logits  # noqa: E402
from test_models_llama import rel_err  # noqa: E402

from ggmlpy import GGMLValueError, gguf  # noqa: E402
from ggmlpy.models import MissingTensor, UnknownArchitecture, load_model  # noqa: E402
from ggmlpy.models.granite import GraniteModel  # noqa: E402
from ggmlpy.models.olmo2 import Olmo2Model  # noqa: E402
from ggmlpy.runner import Runner  # noqa: E402

pytestmark = pytest.mark.hf

GRANITE = dict(attention_bias=True, tie_word_embeddings=True, embedding_multiplier=12.0, residual_multiplier=0.22,
               attention_multiplier=0.05, logits_scaling=8.0)
MODELS = {
    "olmo2": ("Olmo2ForCausalLM", "Olmo2Config", dict(tie_word_embeddings=False)),
    "granite": ("GraniteForCausalLM", "GraniteConfig", GRANITE),
}


@pytest.fixture(scope="module")
def tokens():
    tok = hf_convert.tokenizer("gpt-2")
    return [tok.bos_token_id, *tok(TEXT, add_special_tokens=False)["input_ids"], tok.eos_token_id]


def _convert(arch: str, out_dir, tokens):
    cls_name, cfg_name, extra = MODELS[arch]
    tok = hf_convert.tokenizer("gpt-2")
    c = make(cls_name, cfg_name, "gpt-2", tokens, out_dir, vocab_size=len(tok), hidden_size=64, intermediate_size=128,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             rms_norm_eps=1e-5, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **extra)
    c.arch = arch
    c.path()
    return c


@pytest.fixture(scope="module")
def olmo2(tmp_path_factory, tokens):
    return _convert("olmo2", tmp_path_factory.mktemp("olmo2"), tokens)


@pytest.fixture(scope="module")
def granite(tmp_path_factory, tokens):
    return _convert("granite", tmp_path_factory.mktemp("granite"), tokens)


@pytest.fixture(scope="module", params=list(MODELS))
def conv(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def ref(conv):
    return hf_logits(conv.hf, conv.tokens)


def test_the_file_is_the_converters(conv):
    """olmo2: post-norms and no pre-norms, Q/K norms as wide as the whole projections, NEOX RoPE; granite:
    the multipliers under llama.cpp's names, biases, the tied output, normal RoPE."""
    with gguf.GGUFReader(str(conv.path())) as r:
        md, names = r.metadata, {t.name: tuple(t.ne) for t in r.tensors}
    assert md["general.architecture"] == conv.arch
    with load_model(conv.path(), devices="cpu") as model:
        c = model.config
        if conv.arch == "olmo2":
            assert isinstance(model, Olmo2Model) and c.rope_mode == 2
            assert names["blk.0.attn_q_norm.weight"] == (64,) and names["blk.0.attn_k_norm.weight"] == (32,)
            assert {"blk.1.post_attention_norm.weight", "blk.1.post_ffw_norm.weight"} <= set(names)
            assert not any("attn_norm" in n or "ffn_norm" in n for n in names)
        else:
            assert isinstance(model, GraniteModel) and c.rope_mode == 0
            assert (md["granite.embedding_scale"], md["granite.logit_scale"]) == (12.0, 8.0)
            assert (c.embedding_scale, c.logit_scale) == (12.0, 8.0)
            assert c.residual_scale == pytest.approx(0.22) and c.attention_scale == pytest.approx(0.05)
            assert model.tied_output and model.qkv_bias and model.out_bias
            assert {"blk.1.attn_qkv.bias", "blk.1.attn_qkv.weight", "blk.1.ffn_gate_up.weight"} <= set(model.fused)


@pytest.mark.parametrize("flash", [False, True])
def test_one_batch_matches_transformers(conv, ref, flash):
    err = errors(run_batch(conv.path(), conv.tokens, flash_attn=flash), ref)
    assert err.max() <= TOL, err


@pytest.mark.parametrize("flash", [False, True])
def test_token_by_token_matches_transformers(conv, ref, flash):
    err = errors(run_steps(conv.path(), conv.tokens, flash_attn=flash), ref)
    assert err.max() <= TOL, err


@pytest.mark.parametrize("flash", [False, True])
def test_several_sequences_in_one_batch(conv, flash):
    t = conv.tokens
    assert sequences_error(conv, [t[:7], t[3:15], t[10:]], [11, 12, 13], flash=flash) <= TOL


def test_unfused_weights_give_the_same_logits(conv, ref):
    """olmo2's Q/K norms read Q and K as strided views of the fused product, or whole from their own."""
    with load_model(conv.path(), fuse=False, devices="cpu") as model, \
            Runner(model, n_ctx=64, type_k="f32", type_v="f32") as rt:
        assert model.fused == {}
        err = errors(rt.decode(conv.tokens, logits="all"), ref)
    assert err.max() <= TOL, err


@pytest.mark.parametrize("outtype,tol", [("f16", 3e-3), ("q8_0", 3e-2)])
def test_f16_and_q8_0_files(conv, ref, outtype, tol):
    got = run_batch(conv.path(outtype), conv.tokens, type_k="f16", type_v="f16")
    assert rel_err(got, ref) < tol, rel_err(got, ref)
    assert_same_top1(got, ref)


def test_granite_multipliers_left_unset(granite, tmp_path):
    """A file without the optional multipliers: no embedding or residual scaling, 1 / sqrt(head_dim) in
    the attention (transformers' modules given those values)."""
    conv, ref = granite, hf_logits(granite.hf, granite.tokens)
    keys = ("granite.embedding_scale", "granite.residual_scale", "granite.attention.scale")
    path = copy_gguf(conv.path(), tmp_path / "unset.gguf", meta=dict.fromkeys(keys))
    hf = conv.hf.model
    layers = list(hf.layers)
    saved = hf.embedding_multiplier, [(la.residual_multiplier, la.self_attn.scaling) for la in layers]
    try:
        hf.embedding_multiplier = 1.0
        for la in layers:
            la.residual_multiplier, la.self_attn.scaling = 1.0, 1 / math.sqrt(16)
        want = hf_logits(conv.hf, conv.tokens)
    finally:
        hf.embedding_multiplier = saved[0]
        for la, (res, sc) in zip(layers, saved[1]):
            la.residual_multiplier, la.self_attn.scaling = res, sc
    assert errors(want, ref).max() > 1e-2
    with load_model(path, devices="cpu") as model:
        assert (model.config.embedding_scale, model.config.residual_scale, model.config.attention_scale) == \
            (1.0, 1.0, None)
    assert errors(run_batch(path, conv.tokens), want).max() <= TOL


@pytest.mark.parametrize("arch,meta,error,match", [
    ("olmo2", {"olmo2.attention.sliding_window": 4}, GGMLValueError, r"olmo2\.attention\.sliding_window"),
    ("granite", {"granite.logit_scale": None}, gguf.MetadataError, r"granite\.logit_scale.*missing"),
    ("granite", {"granite.logit_scale": 0.0}, gguf.MetadataError, r"granite\.logit_scale"),
    ("granite", {"granite.expert_count": 4}, UnknownArchitecture, r"granite\.expert_count"),
    ("granite", {"granite.deepstack_mapping": [-1, 1]}, GGMLValueError, r"granite\.deepstack_mapping"),
    ("granite", {"granite.rope.scaling.finetuned": "yes"}, gguf.MetadataTypeError,
     r"granite\.rope\.scaling\.finetuned"),
    ("granite", {"granite.rope.scaling.finetuned": False}, GGMLValueError, r"granite\.rope\.scaling\.finetuned"),
    ("granite", {"granite.rope.scaling.type": "longrope"}, GGMLValueError, r"granite\.rope\.scaling\.type"),
])
def test_unsupported_metadata_names_the_key(request, tmp_path, arch, meta, error, match):
    conv = request.getfixturevalue(arch)
    with pytest.raises(error, match=match):
        load_model(copy_gguf(conv.path(), tmp_path / "x.gguf", meta=meta), devices="cpu")


def test_granite_feed_forward_biases_are_refused(granite, tmp_path):
    def with_bias(name, data):
        extra = [("blk.0.ffn_up.bias", np.zeros(128, np.float32))] if name == "blk.0.ffn_up.weight" else []
        return [(name, data), *extra]

    with pytest.raises(MissingTensor, match=r"blk\.0\.ffn_up\.bias.*mlp_bias"):
        load_model(copy_gguf(granite.path(), tmp_path / "bias.gguf", tensors=with_bias), devices="cpu")
