"""models/deepseek.py (``general.architecture = "deepseek2"``) against transformers, through files written by
llama.cpp's converter.

Two tiny random-weight models with the real gpt-2 vocabulary (the converter reads DeepSeek's tokenizer as a
BPE one), n_embd 64, 4 heads of 64 + 32 (position-free + rotated) query/key values and 40 output values,
a latent of 96 (every size different, each row a whole number of 32-value blocks, as Q8_0 needs):

* ``v3``, a ``DeepseekV3ForCausalLM``: 3 layers, the first dense; the query compressed to 64; 8 experts, 3 used
  per token, in 4 groups of which 2 are kept, 1 shared expert; sigmoid routing (``scoring_func``, as the
  released config says) with the correction bias ``e_score_correction_bias`` (an HF buffer, made random here
  as the constant weights are), the chosen weights renormalised and scaled by 2.5; YaRN x4 from an original
  context of 64 with ``mscale = mscale_all_dim = 1`` (the released models');
* ``v2``, a ``DeepseekV2ForCausalLM`` in V2-Lite's layout: 2 layers, no dense one, no query compression
  (``attn_q``), softmax routing over 6 experts, 2 used, not renormalised, scaled by 1.5; 2 shared experts;
  tied embeddings; YaRN with ``mscale = mscale_all_dim = 0.707`` (V2-Lite's).

Every feature matters: each setting turned off in a copied file (the groups, the bias, the routing function,
the renormalisation, the scale, YaRN's log multiplier) leaves the tolerance by far
(:func:`test_the_settings_are_what_matches`).

Tolerance with F32 weights and an F32 cache: per position, max |got - ref| / max |ref| at most 1e-5 (measured
in one batch, token by token and with three sequences in one batch, both attention paths: v3 9.2e-7 to 1.2e-6,
v2 7.4e-7 to 1.0e-6). llama.cpp itself (llama-cpp-python 0.3.36, F32 cache, no flash attention) on the v3 file:
9.2e-7, the same logits as ggmlpy's to 1e-6 (with flash attention llama.cpp casts the F32 cache to F16:
1.5e-3). It does not load the v2 file: it requires ``attention.q_lora_rank`` unless the model has 26 or 27
layers (V2-Lite's), which this module does not.

Converter files (``--outtype f16`` / ``q8_0``: the layers' matrices, the per-head ``attn_k_b``/``attn_v_b``
included, in that type; router, bias and norms F32), F16 cache, against transformers: F16 at most 3e-3
everywhere (measured 1.9e-3, median 1.1e-3); Q8_0 median 3e-2 and max 0.1 at the positions whose routing is
clear (in every layer the last kept group's and the last chosen expert's scores lead the next by more than
0.01: 31 of the 39), the tolerances of the other architectures' tests (measured median 0.025, max 0.043
there; 0.10 to 0.20 at four of the eight near ties, where llama.cpp's error is the same). llama.cpp on the same
files gives the same logits at the clear positions to 2e-3 of the largest logit, the rounding of F16
activations summed in another order by its build of ggml (measured 5e-4 for F16, 0 for Q8_0).
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
from test_models_converted import TEXT, TOL, errors, hf_logits  # noqa: E402

from ggmlpy import Type, gguf  # noqa: E402
from ggmlpy._core import GGMLValueError  # noqa: E402
from ggmlpy.gguf import MetadataError, MetadataTypeError  # noqa: E402
from ggmlpy.kvcache import Causal  # noqa: E402
from ggmlpy.models import blocks, load_model  # noqa: E402
from ggmlpy.models.deepseek import DeepseekConfig, DeepseekModel  # noqa: E402
from ggmlpy.runner import DoneReason, Runner  # noqa: E402
from ggmlpy.runner.slots import shift_discard  # noqa: E402

pytestmark = pytest.mark.hf

A = "deepseek2"
COMMON = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
              num_key_value_heads=4, kv_lora_rank=96, qk_rope_head_dim=32, v_head_dim=40, qk_nope_head_dim=64,
              max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.1)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0}
# name: (HF class, config class, config kwargs)
MODELS = {
    "v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config", dict(
        num_hidden_layers=3, first_k_dense_replace=1, q_lora_rank=64, n_routed_experts=8, num_experts_per_tok=3,
        n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        scoring_func="sigmoid", tie_word_embeddings=False,
        rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 1.0})),
    "v2": ("DeepseekV2ForCausalLM", "DeepseekV2Config", dict(
        num_hidden_layers=2, first_k_dense_replace=0, q_lora_rank=None, n_routed_experts=6, num_experts_per_tok=2,
        n_shared_experts=2, routed_scaling_factor=1.5, norm_topk_prob=False, topk_method="greedy",
        tie_word_embeddings=True, rope_parameters={**YARN, "mscale": 0.707, "mscale_all_dim": 0.707})),
}
#: per-position error bounds (median, max) by converter --outtype; see the module docstring
QUANT_TOL = {"f16": (3e-3, 3e-3), "q8_0": (3e-2, 0.1)}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """``models(name)``: the HF model and its files (each made once for the module)."""
    made = {}

    def get(name):
        if name not in made:
            cls, cfg, extra = MODELS[name]
            tok = hf_convert.tokenizer("gpt-2")
            tokens = [tok.bos_token_id, *tok(TEXT + " " + TEXT, add_special_tokens=False)["input_ids"]]
            conv = make(cls, cfg, "gpt-2", tokens, tmp_path_factory.mktemp(name), vocab_size=len(tok),
                        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **COMMON, **extra)
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
def v3(models):
    return models("v3")


def derived(conv, what: str, src=None, **kw):
    """A file made from ``src`` (``conv``'s F32 file) by :func:`copy_gguf` once (cached under ``what``)."""
    if what not in conv.paths:
        conv.paths[what] = copy_gguf(src or conv.path(), conv.out_dir / f"{what}.gguf", **kw)
    return conv.paths[what]


def one_layer(conv):
    """The file with only its first layer (where a context shift is exact)."""
    return derived(conv, "one-layer", meta={f"{A}.block_count": 1},
                   tensors=lambda name, data: [] if name.startswith("blk.") and not name.startswith("blk.0.")
                   else [(name, data)])


# ------------------------------------------------------------------ the file and the model read from it


def test_the_file_is_the_converters(conv):
    """llama.cpp's keys and tensors for multi-head latent attention (the latent cache row as the key length,
    one KV head, HF's head sizes as the _mla lengths, kv_b_proj split into attn_k_b/attn_v_b) and DeepSeek's
    experts; the model reads them."""
    hc = conv.hf.config
    v3 = conv.name == "v3"
    with gguf.GGUFReader(str(conv.path())) as r:
        md, ne = r.metadata, {t.name: tuple(t.ne) for t in r.tensors}
        bias = r.tensor_data("blk.1.exp_probs_b.bias") if v3 else None
    assert md["general.architecture"] == A and md[f"{A}.attention.head_count_kv"] == 1
    assert (md[f"{A}.attention.key_length"], md[f"{A}.attention.value_length"]) == (128, 96)
    assert (md[f"{A}.attention.key_length_mla"], md[f"{A}.attention.value_length_mla"]) == (96, 40)
    assert (md[f"{A}.attention.kv_lora_rank"], md[f"{A}.rope.dimension_count"]) == (96, 32)
    assert ne["blk.1.attn_k_b.weight"] == (64, 96, 4) and ne["blk.1.attn_v_b.weight"] == (96, 40, 4)
    assert ne["blk.1.attn_kv_a_mqa.weight"] == (64, 128) and ne["blk.1.attn_output.weight"] == (160, 64)
    assert ("blk.1.attn_q_b.weight" in ne) == v3 and ("blk.1.attn_q.weight" in ne) != v3
    assert ("output.weight" in ne) != hc.tie_word_embeddings
    n_exp = hc.n_routed_experts
    assert ne["blk.1.ffn_gate_exps.weight"] == (64, 32, n_exp)
    assert ne["blk.1.ffn_gate_shexp.weight"] == (64, 32 * hc.n_shared_experts)
    assert ("blk.0.ffn_gate.weight" in ne) == v3 and md[f"{A}.leading_dense_block_count"] == int(v3)
    assert md[f"{A}.rope.scaling.yarn_log_multiplier"] == pytest.approx(0.1 * hc.rope_parameters["mscale_all_dim"])
    if v3:
        assert md[f"{A}.expert_gating_func"] == 2 and md[f"{A}.expert_weights_norm"] is True
        assert (md[f"{A}.expert_group_count"], md[f"{A}.expert_group_used_count"]) == (4, 2)
        np.testing.assert_array_equal(bias, conv.hf.model.layers[1].mlp.gate.e_score_correction_bias.numpy())
        assert np.abs(bias).min() > 0
    else:
        assert f"{A}.expert_gating_func" not in md and f"{A}.expert_weights_norm" not in md
    with load_model(conv.path(), devices="cpu") as model:
        c = model.config
        assert type(model) is DeepseekModel and model.tied_output == hc.tie_word_embeddings
        assert (c.head_dim, c.rope_dim, c.n_lora_kv, c.head_dim_v, c.n_head_kv) == (96, 32, 96, 40, 1)
        assert (c.n_lora_q, c.n_dense_lead, c.n_expert, c.n_expert_used) == \
            (64 if v3 else 0, int(v3), n_exp, hc.num_experts_per_tok)
        assert (c.gating, c.expert_weights_norm, c.expert_weights_scale) == \
            (("sigmoid", True, 2.5) if v3 else ("softmax", False, 1.5))
        assert (c.n_group, c.n_group_used) == ((4, 2) if v3 else (0, 0))
        assert model.probs_bias == (frozenset({1, 2}) if v3 else frozenset())
        # HF's scaling: 1 / sqrt(qk_head_dim) times YaRN's mscale(factor, mscale_all_dim) squared
        mscale = 0.1 * hc.rope_parameters["mscale_all_dim"] * np.log(4.0) + 1.0
        assert c.kq_scale == pytest.approx(mscale * mscale / np.sqrt(96), rel=1e-6)


def test_the_cache_holds_the_latent(v3):
    """The cache recipe: one K-only row per token and layer of latent (96) + rotated key (32) values, read as
    K and (its latent) as V; the memory report holds exactly that, not a K and V per head (4 x (96 + 40)
    values here, 128 x (192 + 128) in DeepSeek-V3, whose row is 576)."""
    with load_model(v3.path(), devices="cpu") as model, Runner(model, n_ctx=64, type_k="f16") as rt:
        c = rt.cache
        assert type(c) is Causal and c.v_in_k and c.values == []
        assert (c.n_embd_k, c.n_embd_v, c.n_head_kv, c.dtype) == (128, 96, 1, Type.F16)
        assert [k.ne for k in c.keys] == [(128, c.n_cells, 1, 1)] * 3
        cache = rt.memory_report().devices["CPU"].cache
        assert sum(cache.values()) == 3 * c.n_cells * 128 * 2
        rt.decode(v3.tokens[:5], logits=None)
        # what a token stores: its normed latent and its rotated key part, from one layer's weights
        row = c.keys[1].numpy()[4].astype(np.float32)
    with torch.no_grad():
        layer = v3.hf.model.layers[1]
        h = v3.hf.model(torch.tensor([v3.tokens[:5]]), output_hidden_states=True).hidden_states[1]
        latent = layer.self_attn.kv_a_layernorm(layer.self_attn.kv_a_proj_with_mqa(layer.input_layernorm(h))[..., :96])
    np.testing.assert_allclose(row[:96], latent[0, 4].numpy(), rtol=2e-3, atol=2e-3)


def test_the_sizing_estimates_count_the_latent(v3):
    """What is sized before a cache exists counts the latent row too: the placement search's first estimate
    (``cache_rows``: K only) and the roofline's cache bytes per token (``ggmlpy bench --roofline``)."""
    from ggmlpy.benchmark.roofline import ModelWork

    with load_model(v3.path(), load=False, devices="cpu") as model:
        assert model.config.cache_rows() == (128, 0)
    work = ModelWork.from_gguf(v3.path())
    assert [ly.v_in_k for ly in work.layers] == [True] * 3
    # one token at position 9 reads 10 rows of 128 f16 values in each of the 3 layers
    assert work.kv_bytes(9, 1, "f16", "f16") == 3 * 10 * 128 * 2


def test_a_quantized_cache_needs_flash_attention(v3):
    """The latent's V is part of K: a quantized K cache cannot be read transposed; with flash attention it is
    used (and V's type is K's, as in llama.cpp)."""
    with load_model(v3.path(), devices="cpu") as model:
        with pytest.raises(GGMLValueError, match="deepseek2: a q8_0 K cache needs flash attention"):
            Runner(model, n_ctx=64, type_k="q8_0", flash_attn=False)
        with Runner(model, n_ctx=64, type_k="q8_0", type_v="f16", flash_attn=True) as rt:
            assert rt.cache.dtype == rt.cache.dtype_v == Type.Q8_0
            got = rt.decode(v3.tokens, logits="all")
    assert np.median(errors(got, v3.ref)) <= 3e-2


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
    """Tokens of three sequences routed and attended in one batch (one latent cache), then one more token of
    each, against transformers on each sequence alone."""
    t = conv.tokens
    assert sequences_error(conv, [t[:9], t[4:24], t[17:]], [5, 6, 7], flash=flash) <= TOL


# ------------------------------------------------------------------ prompts over decompressed heads


def long_prompt(conv, n: int) -> list:
    """``n`` tokens: the module's text again and again (the models hold 256 positions)."""
    t = conv.tokens
    return (t * (n // len(t) + 1))[:n]


@pytest.fixture
def heads_spy(monkeypatch):
    """The row counts of the batches :func:`blocks.mla` sent over decompressed heads (one entry per layer built)."""
    rows = []
    original = blocks._mla_heads

    def spy(ctx, q, *a, **kw):
        rows.append(q.ne[2])
        return original(ctx, q, *a, **kw)

    monkeypatch.setattr(blocks, "_mla_heads", spy)
    return rows


def test_a_long_prompt_attends_over_decompressed_heads(conv, heads_spy):
    """A 150-token prompt in one batch takes the decompressed heads in every layer (blocks.mla_heads_pay) and
    matches transformers as the absorbed path does; a batch of a few rows stays absorbed."""
    toks = long_prompt(conv, 150)
    ref = hf_logits(conv.hf, toks)
    got = run_batch(conv.path(), toks, n_ctx=256, flash_attn=True)
    assert heads_spy.count(150) == len(conv.hf.model.layers), heads_spy
    assert errors(got, ref).max() <= TOL
    heads_spy.clear()
    assert errors(run_batch(conv.path(), toks[:20], n_ctx=256, flash_attn=True), ref[:20]).max() <= TOL
    assert 20 not in heads_spy


def test_decompressed_heads_after_a_history_and_beside_other_sequences(v3, heads_spy):
    """A prompt's second micro-batch (130 rows over 40 cached cells) and three sequences in one batch of 180
    rows (each row sees its own sequence's cells only) over decompressed heads, against transformers; then
    one more token of each (absorbed)."""
    toks = long_prompt(v3, 170)
    with load_model(v3.path(), devices="cpu") as model, \
            Runner(model, n_ctx=256, type_k="f32", type_v="f32", flash_attn=True) as rt:
        got = np.concatenate([rt.decode(toks[:40], logits="all"), rt.decode(toks[40:], logits="all")])
        assert rt.reallocations == 0            # the reservation (decompressed at full context) held both
    assert 130 in heads_spy and 40 not in heads_spy
    assert errors(got, hf_logits(v3.hf, toks)).max() <= TOL
    heads_spy.clear()
    seqs = [toks[:60], toks[3:73], toks[100:150]]
    assert sequences_error(v3, seqs, [5, 6, 7], n_ctx=256, flash=True) <= TOL
    assert 180 in heads_spy


def test_decompressed_heads_with_a_float16_cache(v3, monkeypatch):
    """With the default float16 cache the decompressed heads (float32 keys and values from the cached latent)
    land as close to transformers as the absorbed path (ggml's attention over the float16 latent)."""
    toks = long_prompt(v3, 150)
    ref = hf_logits(v3.hf, toks)
    heads = errors(run_batch(v3.path(), toks, n_ctx=256, flash_attn=True, type_k="f16", type_v="f16"), ref)
    monkeypatch.setattr(blocks, "mla_heads", False)
    absorbed = errors(run_batch(v3.path(), toks, n_ctx=256, flash_attn=True, type_k="f16", type_v="f16"), ref)
    assert heads.max() <= 3e-3 and heads.max() <= 1.5 * absorbed.max(), (heads.max(), absorbed.max())


def test_the_heads_budget_keeps_a_long_context_absorbed(v3, heads_spy, monkeypatch):
    """A cache whose decompressed heads would pass blocks.MLA_HEADS_MAX_BYTES keeps every graph absorbed, the
    reservation at full context included: the compute buffers do not grow with the context for them."""
    per_cell = 4 * 4 * (96 + 40)                     # n_head x (key + value sizes) float32
    monkeypatch.setattr(blocks, "MLA_HEADS_MAX_BYTES", per_cell * 255)
    toks = long_prompt(v3, 150)
    assert errors(run_batch(v3.path(), toks, n_ctx=256, flash_attn=True), hf_logits(v3.hf, toks)).max() <= TOL
    assert heads_spy == []


def test_unfused_weights_give_the_same_logits(v3):
    """The dense and shared experts' gate and up kept apart (they are fused by default)."""
    with load_model(v3.path(), fuse=False, devices="cpu") as model, \
            Runner(model, n_ctx=64, type_k="f32", type_v="f32") as rt:
        assert model.fused == {}
        got = rt.decode(v3.tokens, logits="all")
    with load_model(v3.path(), devices="cpu") as model:
        assert {"blk.0.ffn_gate_up.weight", "blk.1.ffn_gate_up_shexp.weight"} <= set(model.fused)
    assert errors(got, v3.ref).max() <= TOL


def test_llama_cpp_gives_the_same_logits(v3):
    """llama.cpp on the same file (F32 cache, no flash attention) is as close to transformers, and ggmlpy's
    logits are its own."""
    lc = llama_cpp_logits(v3.path(), v3.tokens, v3.out_dir)
    assert errors(lc, v3.ref).max() <= TOL
    assert errors(run_batch(v3.path(), v3.tokens, flash_attn=False), lc).max() <= 1e-6


@pytest.mark.parametrize("what,kw", [
    ("no-groups", dict(meta={f"{A}.expert_group_count": None, f"{A}.expert_group_used_count": None})),
    ("softmax", dict(meta={f"{A}.expert_gating_func": 1})),
    ("unscaled", dict(meta={f"{A}.expert_weights_scale": 1.0})),
    ("not-renormalised", dict(meta={f"{A}.expert_weights_norm": False})),
    ("no-log-multiplier", dict(meta={f"{A}.rope.scaling.yarn_log_multiplier": None})),
    ("no-bias", dict(tensors=lambda name, data: [] if name.endswith("exp_probs_b.bias") else [(name, data)])),
])
def test_the_settings_are_what_matches(v3, what, kw):
    """With one routing or scaling setting turned off (each read from the file), the logits leave the tolerance
    by far (measured 0.23 to 0.45): the F32 match checks every one."""
    err = errors(run_batch(derived(v3, what, **kw), v3.tokens), v3.ref)
    assert err.max() > 100 * TOL, err


# ------------------------------------------------------------------ quantized files


def routing_lead(hf, tokens) -> np.ndarray:
    """Per position, the smallest margin of any layer's routing decision: the last kept group's score over the
    best dropped one, and the last chosen expert's (biased sigmoid) score over the best one not chosen among
    the kept groups. Where it is small, a quantized model may rightly route otherwise, as llama.cpp would."""
    c = hf.config
    k, n_group, kept = c.num_experts_per_tok, c.n_group, c.topk_group
    with torch.no_grad():
        out = hf(torch.tensor([tokens]), output_router_logits=True)
    layers = [m.mlp.gate for m in hf.model.layers if hasattr(m.mlp, "gate")]
    lead = np.full(len(tokens), np.inf)
    for logits, gate in zip(out.router_logits, layers):
        s = torch.sigmoid(logits.reshape(len(tokens), -1)) + gate.e_score_correction_bias
        groups = s.reshape(len(tokens), n_group, -1)
        g = groups.topk(2, -1).values.sum(-1).sort(-1, descending=True).values
        chosen = g[:, kept - 1:kept] <= groups.topk(2, -1).values.sum(-1)
        e = groups.masked_fill(~chosen[..., None], -np.inf).reshape(len(tokens), -1).sort(-1, descending=True).values
        lead = np.minimum(lead, np.minimum((g[:, kept - 1] - g[:, kept]).numpy(), (e[:, k - 1] - e[:, k]).numpy()))
    return lead


@pytest.mark.parametrize("outtype", list(QUANT_TOL))
def test_converter_quantized_files_track_transformers(v3, outtype):
    """The converter's own F16 / Q8_0 files, an F16 cache (see the module docstring for the bounds)."""
    path = v3.path(outtype)
    want = Type[outtype.upper()]
    with load_model(path, devices="cpu") as model:
        for name in ("ffn_down_exps", "ffn_down_shexp", "attn_k_b", "attn_v_b", "attn_kv_a_mqa", "attn_output"):
            assert model.weights[f"blk.1.{name}.weight"].type == want, name
        assert model.weights["blk.1.ffn_gate_inp.weight"].type == model.weights["blk.1.exp_probs_b.bias"].type \
            == Type.F32
        with Runner(model, n_ctx=64, flash_attn=False) as rt:
            got = rt.decode(v3.tokens, logits="all")
    err = errors(got, v3.ref)
    med, worst = QUANT_TOL[outtype]
    clear = routing_lead(v3.hf, v3.tokens) > 0.01
    assert clear.sum() >= len(clear) - 8
    assert np.median(err) <= med and err[clear].max() <= worst, err
    if importlib.util.find_spec("llama_cpp") is None:
        return
    assert errors(got, llama_cpp_logits(path, v3.tokens, v3.out_dir, f32_cache=False))[clear].max() <= 2e-3


# ------------------------------------------------------------------ metadata


@pytest.mark.parametrize("key,value,error,match", [
    ("attention.key_length_mla", None, MetadataError, r"'deepseek2\.attention\.key_length_mla': is missing: a "
                                                      r"deepseek2 file from before"),
    ("attention.key_length", 96, MetadataError, r"'deepseek2\.attention\.key_length': 96, but a latent cache row"),
    ("attention.value_length", 40, MetadataError, r"'deepseek2\.attention\.value_length': 40, but the latent"),
    ("attention.head_count_kv", 4, MetadataError, r"'deepseek2\.attention\.head_count_kv': 4, but multi-head"),
    ("rope.dimension_count", 96, MetadataError, r"'deepseek2\.rope\.dimension_count': 96 must be less than"),
    ("attention.kv_lora_rank", None, MetadataError, r"'deepseek2\.attention\.kv_lora_rank': is missing"),
    ("expert_gating_func", 4, MetadataError, r"'deepseek2\.expert_gating_func': 4 is not supported"),
    ("expert_weights_norm", 1, MetadataTypeError, r"'deepseek2\.expert_weights_norm': expected a bool"),
    ("expert_shared_count", 0, MetadataError, r"'deepseek2\.expert_shared_count': 0 is out of range"),
    ("expert_shared_count", None, MetadataError, r"'deepseek2\.expert_shared_count': is missing"),
    ("expert_feed_forward_length", None, MetadataError, r"'deepseek2\.expert_feed_forward_length': is missing"),
    ("expert_count", 0, MetadataError, r"'deepseek2\.expert_count': is 0, but layers 1 \.\. 2 are not dense"),
    ("expert_used_count", 9, MetadataError, r"'deepseek2\.expert_used_count': 9 is out of range \[1, 8\]"),
    ("expert_group_count", 3, MetadataError, r"'deepseek2\.expert_group_count': 3 groups of 8 experts"),
    ("expert_group_used_count", 4, MetadataError, r"'deepseek2\.expert_group_used_count': 4 must be in \[1, 3\]"),
    ("expert_group_used_count", 1, MetadataError, r"'deepseek2\.expert_group_used_count': 1 must be .* the 3 "),
    ("attention.temperature_scale", 0.1, MetadataError, r"'deepseek2\.attention\.temperature_scale': 0\.1: "),
    ("rope.scaling.yarn_beta_fast", 16.0, MetadataError, r"'deepseek2\.rope\.scaling\.yarn_beta_fast': 16 is not"),
    ("rope.scaling.yarn_attn_factor", 1.2, MetadataError, r"'deepseek2\.rope\.scaling\.yarn_attn_factor': 1\.2 "),
    ("rope.scaling.type", "longrope", ValueError, r"rope scaling 'longrope' \(deepseek2\.rope\.scaling\.type\)"),
])
def test_unsupported_metadata_names_the_key(v3, key, value, error, match):
    with gguf.GGUFReader(str(v3.path())) as r:
        md = dict(r.metadata)
    md.pop(f"{A}.{key}", None)
    if value is not None:
        md[f"{A}.{key}"] = value
    with pytest.raises(error, match=match):
        DeepseekConfig.from_metadata(md, "m.gguf").validate("m.gguf")


def test_accepted_metadata(v3):
    """What llama.cpp builds anyway: no gating key in a V2 file (softmax; sigmoid for GLM-4.7-Lite's shape),
    YaRN's own scale as HF's attention_factor, no feed_forward_length without dense layers."""
    with gguf.GGUFReader(str(v3.path())) as r:
        md = dict(r.metadata)
    md.pop(f"{A}.expert_gating_func")
    md[f"{A}.rope.scaling.yarn_attn_factor"] = 1.0
    assert DeepseekConfig.from_metadata(md, "m.gguf").gating == "softmax"
    glm = {**md, f"{A}.block_count": 47, f"{A}.vocab_size": 154880}
    assert DeepseekConfig.from_metadata(glm, "m.gguf").gating == "sigmoid"
    md.pop(f"{A}.feed_forward_length")
    md[f"{A}.leading_dense_block_count"] = 0
    c = DeepseekConfig.from_metadata(md, "m.gguf")
    assert c.n_ff == c.n_ff_exp == 32 and c.moe_layers == range(0, 3)


def test_expert_sizes_are_checked_against_the_tensors(v3):
    """Keys that contradict the first expert layer's tensors are named before anything is allocated."""
    path = derived(v3, "bad-shared", meta={f"{A}.expert_shared_count": 2})
    with pytest.raises(MetadataError, match=r"'deepseek2\.expert_shared_count': the metadata gives 2 .*"
                                            r"blk\.1\.ffn_gate_shexp"):
        load_model(path, devices="cpu")


def test_nextn_layers_are_skipped(v3):
    """A file with a multi-token-prediction layer after the others (block_count counting it, its NextN tensors
    as llama.cpp names them) loads, skips it as llama.cpp does, and gives the same logits."""
    extra = {"nextn.eh_proj.weight": (128, 64), "nextn.enorm.weight": (64,), "nextn.hnorm.weight": (64,)}

    def add_layer(name, data):
        out = [(name, data)]
        if name.startswith("blk.2."):
            out.append(("blk.3." + name[6:], data))
        if name == "output_norm.weight":
            out += [(f"blk.3.{n}", np.ones(ne[::-1], np.float32)) for n, ne in extra.items()]
        return out

    path = derived(v3, "nextn", meta={f"{A}.block_count": 4, f"{A}.nextn_predict_layers": 1}, tensors=add_layer)
    with load_model(path, devices="cpu") as model:
        assert (model.config.n_layer, model.config.n_layer_nextn) == (3, 1)
        assert not any(n.startswith("blk.3.") for n in model.weights.tensors)
        with Runner(model, n_ctx=64, type_k="f32", type_v="f32") as rt:
            got = rt.decode(v3.tokens, logits="all")
    assert errors(got, v3.ref).max() <= TOL


# ------------------------------------------------------------------ the runner


def hf_greedy(hf, prompt, n):
    toks = list(prompt)
    for _ in range(n):
        toks.append(int(hf_logits(hf, toks)[-1].argmax()))
    return toks[len(prompt):]


def test_requests_together_generate_each_as_alone(v3):
    """Three requests served together (their tokens in shared batches) generate what each does alone, and
    transformers' greedy tokens."""
    prompts = [v3.tokens[:6], v3.tokens[5:17], v3.tokens[-4:]]
    with load_model(v3.path(), devices="cpu") as model:
        with Runner(model, n_ctx=64, n_seq_max=3, n_batch=16, type_k="f32", type_v="f32") as rt:
            together = [h.result() for h in [rt.submit(p, max_tokens=6, temperature=0) for p in prompts]]
            assert [3] in rt.batch_sizes, rt.batch_sizes
            assert rt.reallocations == 0
        with Runner(model, n_ctx=64, type_k="f32", type_v="f32") as rt:
            alone = [rt.generate(p, max_tokens=6, temperature=0) for p in prompts]
    for p, t, a in zip(prompts, together, alone):
        assert t.tokens == a.tokens
        want = hf_greedy(v3.hf, p, 6)
        assert t.tokens == want[:len(t.tokens)] and (len(t.tokens) == 6 or t.done_reason == DoneReason.STOP)


def test_prefix_reuse(v3):
    """A request that shares another's history reuses its latent cells and generates what a fresh runner does."""
    prompt = v3.tokens[:12]
    with load_model(v3.path(), devices="cpu") as model:
        with Runner(model, n_ctx=64, n_seq_max=2, type_k="f32", type_v="f32") as rt:
            a = rt.generate(prompt, max_tokens=4, temperature=0)
            b = rt.generate(prompt + a.tokens[:2] + [9], max_tokens=4, temperature=0)
            assert (a.n_cached, b.n_cached) == (0, len(prompt) + 2)
        with Runner(model, n_ctx=64, type_k="f32", type_v="f32") as rt:
            assert rt.generate(prompt + a.tokens[:2] + [9], max_tokens=4, temperature=0).tokens == b.tokens


@pytest.mark.parametrize("flash", [False, True])
def test_context_shift_equals_from_scratch(v3, flash):
    """remove(keep, keep + discard) re-rotates the rotated part at the end of each latent row (with YaRN) and
    leaves the latent; the logits equal a fresh run over the kept tokens (one layer: a shift is exact there).
    Re-rotating the row's first values instead (llama.cpp's layout for other models) misses by far."""
    path = one_layer(v3)
    assert shift_error(path, v3.tokens[:24], 4, 10, flash).max() <= TOL
    original = DeepseekModel.shift_fn

    def wrong(self, ctx, layer, k, offsets):      # the rotation applied at the row's start
        c = self.config
        from ggmlpy.models import blocks

        head = ctx.view(k, (c.rope_dim, k.ne[1], k.ne[2]), (k.nb[1], k.nb[2]), 0)
        rest = ctx.view(k, (c.n_lora_kv, k.ne[1], k.ne[2]), (k.nb[1], k.nb[2]), c.rope_dim * k.nb[0])
        return ctx.concat(blocks.rope_shift(ctx, head, offsets, c), rest, 0)

    DeepseekModel.shift_fn = wrong
    try:
        assert shift_error(path, v3.tokens[:24], 4, 10, flash).max() > 100 * TOL
    finally:
        DeepseekModel.shift_fn = original


def test_runner_context_shift(v3):
    """Generation past a full context shifts it, and the token after the shift is a fresh run's."""
    prompt, n_ctx, keep = v3.tokens[:6], 16, 2
    with load_model(one_layer(v3), devices="cpu") as model, \
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


def test_embeddings_match_transformers(v3):
    """Pooled final hidden states (the final norm, no head) of the prompt in one batch."""
    with load_model(v3.path(), devices="cpu") as model, Runner(model, n_ctx=64, type_k="f32", type_v="f32") as rt:
        got = rt.embed(v3.tokens)
    with torch.no_grad():
        hidden = v3.hf.model(torch.tensor([v3.tokens])).last_hidden_state[0].numpy()
    want = hidden.mean(0)
    want /= np.linalg.norm(want)
    assert np.abs(got - want).max() <= TOL * np.abs(want).max()


def test_state_save_and_load(v3, tmp_path):
    """Runner.save_state/load_state of a sequence's latent cells (K rows only): it continues as before, into
    another sequence id; the file holds no V."""
    toks = v3.tokens
    with load_model(v3.path(), devices="cpu") as model, \
            Runner(model, n_ctx=64, n_seq_max=2, type_k="f32", type_v="f32") as rt:
        rt.decode(toks[:30], seq=1, logits=None)
        size = rt.save_state(1, tmp_path / "s.bin")
        assert size < 30 * 3 * 128 * 4 + 8192        # 30 rows of 128 float32 values per layer, and the header
        rt.clear()
        assert rt.load_state(0, tmp_path / "s.bin") == toks[:30]
        got = rt.decode([toks[30]], seq=0)
    assert errors(got, v3.ref[30:31]).max() <= TOL


def test_the_benchmarks_synthetic_model_runs(tmp_path):
    """ggmlpy bench --arch deepseek2: the built-in file (llama.cpp's keys, sigmoid routing with groups, Q8_0
    per-head matrices) loads and gives one batch's logits token by token too; llama.cpp gives the same."""
    from ggmlpy.models.synthetic import synthetic_path

    path = synthetic_path("tiny", "Q8_0", cache_dir=tmp_path, arch=A)
    toks = [3, 1, 4, 1, 5, 9, 2, 6]
    with load_model(path, devices="cpu") as model:
        c = model.config
        assert type(model) is DeepseekModel and (c.n_group, c.gating, c.n_dense_lead) == (4, "sigmoid", 1)
        assert model.weights["blk.1.attn_k_b.weight"].type == Type.Q8_0
    full, steps = run_batch(path, toks, flash_attn=False), run_steps(path, toks)
    assert np.isfinite(full).all() and errors(steps, full).max() <= 1e-3
    if importlib.util.find_spec("llama_cpp") is None:
        return
    assert errors(full, llama_cpp_logits(path, toks, tmp_path)).max() <= 1e-6


def test_the_real_shape_preset_is_deepseek_v3s_layers():
    """The benchmark's deepseek-v3-12L-32E: transformers' DeepseekV3ForCausalLM with DeepSeek-V3's widths, 12
    layers (3 dense) and 32 experts has its parameters (counted without weights: the meta device), and the
    file the routing bias besides (32 per expert layer)."""
    from ggmlpy.models.synthetic import SIZES

    c = SIZES["deepseek-v3-12L-32E"]
    cfg = transformers.DeepseekV3Config(
        vocab_size=c.n_vocab, hidden_size=c.n_embd, intermediate_size=c.n_ff, moe_intermediate_size=c.n_ff_exp,
        num_hidden_layers=c.n_layer, num_attention_heads=c.n_head, num_key_value_heads=c.n_head,
        n_shared_experts=c.n_expert_shared, n_routed_experts=c.n_expert, kv_lora_rank=c.n_lora_kv,
        q_lora_rank=c.n_lora_q, qk_rope_head_dim=c.n_rot, v_head_dim=c.n_embd_head_v,
        qk_nope_head_dim=c.head_dim - c.n_rot, n_group=c.n_group, topk_group=c.n_group_used,
        num_experts_per_tok=c.n_expert_used, first_k_dense_replace=c.n_dense_lead)
    real = transformers.DeepseekV3Config()          # DeepSeek-V3's own widths
    for key in ("hidden_size", "intermediate_size", "moe_intermediate_size", "num_attention_heads", "kv_lora_rank",
                "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim", "vocab_size",
                "num_experts_per_tok", "n_group", "topk_group", "n_shared_experts", "first_k_dense_replace"):
        assert getattr(cfg, key) == getattr(real, key), key
    with torch.device("meta"):
        hf = transformers.DeepseekV3ForCausalLM(cfg)
    n_hf = sum(p.numel() for p in hf.parameters())
    assert c.n_params == n_hf + (c.n_layer - c.n_dense_lead) * c.n_expert


@pytest.mark.slow
def test_the_real_widths_run(tmp_path):
    """The preset's latent attention at its real widths (n_embd 7168, 128 heads of 128 + 64 values, the 1536 and
    512 compressions, 576-value cache rows), in one expert layer of 8 narrow experts and a 1024-token
    vocabulary, written Q4_K_M (the per-head matrices Q8_0): it loads and runs, and llama.cpp gives the same."""
    from dataclasses import replace

    from ggmlpy.models.synthetic import SIZES, write_synthetic

    cfg = replace(SIZES["deepseek-v3-12L-32E"], n_layer=1, n_dense_lead=0, n_vocab=1024, n_expert=8, n_ff_exp=256,
                  n_expert_used=2, n_group=4, n_group_used=2)
    path = write_synthetic(tmp_path / "m.gguf", cfg, "Q4_K_M")
    toks = [3, 1, 4, 1, 5, 9, 2, 6]
    with load_model(path, devices="cpu") as model, Runner(model, n_ctx=64, flash_attn=True) as rt:
        assert model.weights["blk.0.attn_k_b.weight"].type == Type.Q8_0
        assert rt.cache.n_embd_k == 576 and rt.cache.values == []
        got = rt.decode(toks, logits="all")
    assert np.isfinite(got).all()
    if importlib.util.find_spec("llama_cpp") is None:
        return
    # the same attention path and cache type as llama.cpp: at these widths an F16 cache alone moves the logits
    # by 2.5% of the largest from an F32 one (measured), in both
    assert errors(got, llama_cpp_logits(path, toks, tmp_path, f32_cache=False, flash=True)).max() <= 1e-5


def test_repacked_weights_compute_the_plain_logits(tmp_path):
    """Q4_0 weights in the CPU's extra buffer types (the expert stacks for mul_mat_id, the plain matrices) give
    the plain model's logits; the per-head attn_k_b/attn_v_b (a batched product) stay plain."""
    from ggmlpy.models.synthetic import write_synthetic

    path = write_synthetic(tmp_path / "q4_0.gguf", "tiny", "Q4_0", seed=5, arch=A)
    prompt = [1, 17, 250, 3, 99, 42, 7, 300, 128, 64, 11, 200, 5]
    out = {}
    for repack in (True, False):
        with load_model(path, repack=repack, devices="cpu") as model, \
                Runner(model, n_ctx=64, n_batch=8, n_ubatch=8) as rt:
            assert not model.weights["blk.1.attn_k_b.weight"].is_repacked
            logits = rt.decode(prompt, logits="all")
            out[repack] = np.concatenate([logits] + [rt.decode([t]) for t in (9, 33, 2)])
    assert errors(out[True], out[False]).max() < 1e-4
