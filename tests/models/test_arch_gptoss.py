"""models/gptoss.py (``general.architecture = "gpt-oss"``) against transformers, through files written by
llama.cpp's converter.

A tiny random-weight ``GptOssForCausalLM`` (4 layers, n_embd 64, 4 heads of 24 over 2 KV heads, so the
attention width 96 differs from n_embd as in the real models; 4 experts of 32, 2 used per token) with the
real gpt-2 vocabulary (the converter reads gpt-oss's tokenizer as a BPE one). Every feature matters:
the constant weights HF initialises (norms; Q/K/V, output and expert biases at 0) are made random first;
the sinks and the router bias are random by HF's own initialisation; the sliding window (6 positions,
layers 0 and 2) is far shorter than the 39-token prompt; YaRN scales RoPE by 4 from an original
context of 64 (its ramp falls inside the head); each test below that changes one of them (sinks,
window, experts used, YaRN's ramp) leaves the tolerance by far.

**YaRN's ramp.** The released models' HF config says ``truncate: false`` (the ramp between the exact
correction bounds, as OpenAI's reference); llama.cpp builds gpt-oss with ggml's YaRN, which always rounds
them out to whole dimensions (``ggml_rope_yarn_corr_dims``: floor and ceil), and the file cannot say
otherwise (the converter writes no such key). ggmlpy follows llama.cpp, so the HF model here is made with
``truncate: true``; :func:`test_yarn_ramp_is_llama_cpps` shows the other one differs (0.12 of the
largest logit on this model).

Tolerances, F32 weights and cache: per position, max |got - ref| / max |ref| at most 1e-5 (measured 7e-7
in one batch and token by token, both attention paths). Converter files with ``--outtype f16`` / ``q8_0``
(experts, attention and, for q8_0, the embeddings and head in that type; the converter keeps router,
biases and sinks F32), F16 cache: the tolerances of the other architectures' tests, F16 3e-3
(median and max) and Q8_0 median 3e-2, max 0.1 (the max where no layer's routing is near a tie); MXFP4
experts, the released files' type, within the other tests' 4-bit tolerance.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch") if not os.environ.get("CI") else __import__("torch")
transformers = pytest.importorskip("transformers") if not os.environ.get("CI") else __import__("transformers")

import hf_convert  # noqa: E402
from arch_helpers import copy_gguf, make, run_batch, run_steps, sequences_error, shift_error  # noqa: E402
from test_models_converted import TEXT, TOL, errors, hf_logits  # noqa: E402

from ggmlpy import Type, gguf  # noqa: E402
from ggmlpy.gguf import MetadataError, MetadataTypeError  # noqa: E402
from ggmlpy.kvcache import Causal, Wrapper  # noqa: E402
from ggmlpy.models import load_model  # noqa: E402
from ggmlpy.models.gptoss import GptOssConfig, GptOssModel  # noqa: E402
from ggmlpy.runner import Runner  # noqa: E402

pytestmark = pytest.mark.hf

A = "gpt-oss"
WINDOW = 6
ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "original_max_position_embeddings": 64}
CONFIG = dict(hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=24, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
              max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.1)
#: per-position error bounds (median, max) by converter --outtype; see the module docstring
QUANT_TOL = {"f16": (3e-3, 3e-3), "q8_0": (3e-2, 0.1)}


@pytest.fixture(scope="module")
def conv(tmp_path_factory):
    tok = hf_convert.tokenizer("gpt-2")
    tokens = [tok.bos_token_id, *tok(TEXT + " " + TEXT, add_special_tokens=False)["input_ids"]]
    c = make("GptOssForCausalLM", "GptOssConfig", "gpt-2", tokens, tmp_path_factory.mktemp("gptoss"),
             vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
             rope_parameters={**ROPE, "truncate": True}, **CONFIG)
    assert len(tokens) > 6 * WINDOW
    c.ref = hf_logits(c.hf, tokens)
    with torch.no_grad():
        router = c.hf(torch.tensor([tokens]), output_router_logits=True).router_logits
    # per position, the smallest lead of a chosen expert's router logit over the best one not chosen, of any
    # layer (k = 2 of 4 experts): where it is small, a quantized model may rightly choose the other
    top = np.stack([np.sort(r.reshape(len(tokens), -1).numpy(), -1)[:, ::-1] for r in router])
    c.lead = (top[:, :, 1] - top[:, :, 2]).min(0)
    return c


def derived(conv, what: str, src=None, **kw):
    """A file made from ``src`` (``conv``'s F32 file) by :func:`copy_gguf` once (cached under ``what``)."""
    if what not in conv.paths:
        conv.paths[what] = copy_gguf(src or conv.path(), conv.out_dir / f"{what}.gguf", **kw)
    return conv.paths[what]


def test_the_file_is_the_converters(conv):
    """llama.cpp's keys and tensors: sinks, every bias, the experts as float (no MXFP4 from float weights),
    the window without a pattern (llama.cpp's period 2 is HF's layer_types), YaRN; the model reads them."""
    hc = conv.hf.config
    with gguf.GGUFReader(str(conv.path())) as r:
        md, info = r.metadata, {t.name: (tuple(t.ne), t.type) for t in r.tensors}
        bias = r.tensor_data("blk.1.ffn_down_exps.bias")
    assert md["general.architecture"] == A and md[f"{A}.attention.sliding_window"] == WINDOW
    assert f"{A}.attention.sliding_window_pattern" not in md
    assert (md[f"{A}.expert_count"], md[f"{A}.expert_used_count"], md[f"{A}.expert_feed_forward_length"]) == (4, 2, 32)
    assert (md[f"{A}.rope.scaling.type"], md[f"{A}.rope.scaling.factor"]) == ("yarn", 4.0)
    assert md[f"{A}.rope.scaling.original_context_length"] == 64
    assert info["blk.1.attn_sinks.weight"] == ((4,), Type.F32)
    assert info["blk.1.attn_q.weight"][0] == (64, 96) and info["blk.1.attn_output.bias"][0] == (64,)
    assert info["blk.1.ffn_gate_inp.bias"][0] == (4,)
    assert info["blk.1.ffn_gate_exps.weight"] == ((64, 32, 4), Type.F32)
    assert info["blk.1.ffn_down_exps.weight"] == ((32, 64, 4), Type.F32)
    assert info["blk.1.ffn_up_exps.bias"] == ((32, 4), Type.F32) and info["blk.1.ffn_down_exps.bias"][0] == (64, 4)
    # HF initialises the expert biases to 0; made random before converting (the F32 match checks them)
    np.testing.assert_array_equal(bias, conv.hf.model.layers[1].mlp.experts.down_proj_bias.detach().numpy())
    assert np.abs(bias).min() > 0
    with load_model(conv.path(), devices="cpu") as model:
        c = model.config
        assert type(model) is GptOssModel and model.qkv_bias
        assert c.swa_layers == tuple(t == "sliding_attention" for t in hc.layer_types) == (True, False) * 2
        assert (c.sliding_window, c.n_expert, c.n_expert_used, c.n_ff_exp, c.head_dim) == (WINDOW, 4, 2, 32, 24)
        assert (c.rope_scaling, c.rope_freq_scale, c.rope_ext_factor, c.n_ctx_orig) == ("yarn", 0.25, 1.0, 64)


def test_the_cache_recipe(conv):
    """A Wrapper: the local layers in a window cache, which evicts what no later token sees; the global
    ones in a full cache."""
    with load_model(conv.path(), devices="cpu") as model, \
            Runner(model, n_ctx=1024, n_ubatch=32, type_k="f32", type_v="f32") as rt:
        w = rt.cache
        assert isinstance(w, Wrapper) and len(w.caches) == 2
        local, full = w.caches
        assert (local.window, full.window) == (WINDOW - 1, None)
        assert [w.underlying(i) is local for i in range(4)] == [True, False, True, False]
        assert local.n_cells < full.n_cells == 1024
        rt.decode(conv.tokens, logits=None)
        assert local.cells.used < len(conv.tokens) == full.cells.used


# ------------------------------------------------------------------ logits against transformers


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
    """Tokens of three sequences (each longer than the window) routed and attended in one batch, then one
    more token of each, against transformers on each sequence alone."""
    t = conv.tokens
    assert sequences_error(conv, [t[:15], t[4:24], t[17:]], [5, 6, 7], flash=flash) <= TOL


@pytest.mark.parametrize("flash", [False, True])
def test_context_shift_equals_from_scratch(conv, flash):
    """remove(keep, keep + discard) re-rotates the kept keys with YaRN (a one-layer file: a shift is exact
    there), for a local layer (the window cache) and a global one (pattern 1: every layer global)."""
    one = derived(conv, "one-layer", meta={f"{A}.block_count": 1},
                  tensors=lambda name, data: [] if name.startswith("blk.") and not name.startswith("blk.0.")
                  else [(name, data)])
    glob = derived(conv, "one-global", src=one, meta={f"{A}.attention.sliding_window_pattern": 1})
    for path in (one, glob):
        assert shift_error(path, conv.tokens[:24], 4, 10, flash).max() <= TOL


# ------------------------------------------------------------------ what makes the match


@pytest.mark.parametrize("what,meta", [
    ("no-window", {f"{A}.attention.sliding_window_pattern": 1}),      # every layer global
    ("three-experts", {f"{A}.expert_used_count": 3}),
])
def test_the_settings_are_what_matches(conv, what, meta):
    """With every layer global (no window) or one expert more per token, the logits leave the tolerance by
    far: the F32 match checks the window and the routing."""
    err = errors(run_batch(derived(conv, what, meta=meta), conv.tokens), conv.ref)
    assert err.max() > 100 * TOL, err


def test_the_sinks_are_what_matches(conv):
    """With the sinks far below every logit (no sink), the logits leave the tolerance by far."""
    path = derived(conv, "no-sinks", tensors=lambda name, data: [(name, np.full_like(data, -30.0) if
                                                                   name.endswith("attn_sinks.weight") else data)])
    err = errors(run_batch(path, conv.tokens), conv.ref)
    assert err.max() > 100 * TOL, err


def test_yarn_ramp_is_llama_cpps(conv):
    """The HF model with the released models' ``truncate: false`` (the same weights) differs from this one
    far beyond the tolerance, and this module matches the ``truncate: true`` one: the YaRN ramp is ggml's
    whole-dimension one, as llama.cpp builds it (see the module docstring)."""
    cfg = transformers.GptOssConfig(attn_implementation="eager", vocab_size=conv.hf.config.vocab_size,
                                    rope_parameters={**ROPE, "truncate": False}, **CONFIG)
    other = transformers.GptOssForCausalLM(cfg).float().eval()
    other.load_state_dict(conv.hf.state_dict())
    got = run_batch(conv.path(), conv.tokens)
    assert errors(got, conv.ref).max() <= TOL
    assert errors(got, hf_logits(other, conv.tokens)).max() > 100 * TOL


# ------------------------------------------------------------------ quantized files


@pytest.mark.parametrize("outtype", list(QUANT_TOL))
def test_converter_quantized_files_track_transformers(conv, outtype):
    """The converter's own F16 / Q8_0 files, an F16 cache: the median error within the type's tolerance
    everywhere, the max at the positions whose routing is clear (every layer's 2nd chosen router logit
    leads the best other by more than 0.02: 37 of the 39). Where it is not, Q8_0 may rightly pick the
    other expert, as llama.cpp would: measured max 0.15 at position 30, whose layer-1 lead is 0.005; the
    clear positions' max is 0.044 (F16: 1.9e-3 everywhere, median 1.1e-3; Q8_0 median 0.023)."""
    path = conv.path(outtype)
    with load_model(path, devices="cpu") as model:
        want = Type[outtype.upper()]
        assert model.weights["blk.1.ffn_down_exps.weight"].type == want
        assert model.weights["blk.1.attn_output.weight"].type == want
        assert model.weights["blk.1.ffn_gate_inp.weight"].type == Type.F32
        assert model.weights["blk.1.ffn_down_exps.bias"].type == Type.F32
        with Runner(model, n_ctx=64) as rt:
            got = rt.decode(conv.tokens, logits="all")
    err = errors(got, conv.ref)
    med, worst = QUANT_TOL[outtype]
    clear = conv.lead > 0.02
    assert clear.sum() >= len(clear) - 3, conv.lead
    assert np.median(err) <= med and err[clear].max() <= worst, err


def test_mxfp4_experts_as_released(conv):
    """The released files' expert type: every expert matrix in MXFP4 (made by ggmlpy from the F32 file), the
    rest as it is. Repacked for the CPU or not, the same logits; against transformers within the 4-bit
    tolerance of the other architectures' Q4_K (median 0.25, max 0.35 at the clear positions; measured
    median 0.14, max 0.28)."""
    path = derived(conv, "mxfp4", types=lambda name, old: Type.MXFP4 if name.endswith("_exps.weight") else old)
    got = []
    for repack in (True, False):
        with load_model(path, repack=repack, devices="cpu") as model, Runner(model, n_ctx=64) as rt:
            assert model.weights["blk.1.ffn_up_exps.weight"].type == Type.MXFP4
            got.append(rt.decode(conv.tokens, logits="all"))
    np.testing.assert_array_equal(got[0], got[1])
    err = errors(got[0], conv.ref)
    assert np.median(err) <= 0.25 and err[conv.lead > 0.02].max() <= 0.35, err


# ------------------------------------------------------------------ metadata


@pytest.mark.parametrize("key,value,error,match", [
    ("expert_gating_func", 1, MetadataError, r"'gpt-oss\.expert_gating_func': 1 is not supported"),
    ("expert_weights_norm", True, MetadataError, r"'gpt-oss\.expert_weights_norm': true is not supported"),
    ("expert_weights_norm", 1, MetadataTypeError, r"'gpt-oss\.expert_weights_norm': expected a bool"),
    ("expert_weights_scale", 2.5, MetadataError, r"'gpt-oss\.expert_weights_scale': 2\.5 is not supported"),
    ("expert_shared_count", 1, MetadataError, r"'gpt-oss\.expert_shared_count': 1 is not supported"),
    ("expert_group_count", 2, MetadataError, r"'gpt-oss\.expert_group_count': 2 is not supported"),
    ("expert_count", None, MetadataError, r"'gpt-oss\.expert_count': is missing"),
    ("expert_used_count", 5, MetadataError, r"'gpt-oss\.expert_used_count': 5 is out of range \[1, 4\]"),
    ("expert_feed_forward_length", None, MetadataError, r"'gpt-oss\.expert_feed_forward_length': is missing"),
    ("attention.sliding_window", None, MetadataError, r"'gpt-oss\.attention\.sliding_window': is missing"),
    ("attention.sliding_window", 1, ValueError, r"gpt-oss\.attention\.sliding_window 1 must be >= 2"),
    ("attention.sliding_window_pattern", [True, False], MetadataError,
     r"'gpt-oss\.attention\.sliding_window_pattern'.*2 values for 4 layers"),
    ("rope.scaling.yarn_beta_fast", 16.0, MetadataError, r"'gpt-oss\.rope\.scaling\.yarn_beta_fast': 16 is not"),
    ("rope.scaling.yarn_log_multiplier", 0.1, MetadataError, r"'gpt-oss\.rope\.scaling\.yarn_log_multiplier'"),
    ("rope.scaling.yarn_attn_factor", 1.5, MetadataError, r"'gpt-oss\.rope\.scaling\.yarn_attn_factor': 1\.5"),
    ("rope.scaling.type", "longrope", ValueError, r"rope scaling 'longrope' \(gpt-oss\.rope\.scaling\.type\)"),
])
def test_unsupported_metadata_names_the_key(conv, key, value, error, match):
    with gguf.GGUFReader(str(conv.path())) as r:
        md = dict(r.metadata)
    md.pop(f"{A}.{key}", None)
    if value is not None:
        md[f"{A}.{key}"] = value
    with pytest.raises(error, match=match):
        GptOssConfig.from_metadata(md, "m.gguf").validate("m.gguf")


def test_accepted_metadata(conv):
    """What llama.cpp builds anyway: its gating value for gpt-oss (softmax_weight), an unscaled weight, YaRN's
    own attention factor; no feed_forward_length (there is no dense feed-forward); a local RoPE base."""
    with gguf.GGUFReader(str(conv.path())) as r:
        md = dict(r.metadata)
    md.pop(f"{A}.feed_forward_length")
    md.update({f"{A}.expert_gating_func": 3, f"{A}.expert_weights_scale": 1.0, f"{A}.expert_weights_norm": False,
               f"{A}.rope.scaling.yarn_attn_factor": 1 + 0.1 * np.log(4.0), f"{A}.rope.freq_base_swa": 500.0})
    c = GptOssConfig.from_metadata(md, "m.gguf")
    c.validate()
    assert (c.n_ff, c.n_ff_exp, c.rope_base_swa, c.rope_of(0).rope_base, c.rope_of(1).rope_base) == \
        (32, 32, 500.0, 500.0, 10000.0)


def test_expert_sizes_are_checked_against_the_tensors(conv):
    """A key that contradicts the expert tensors is named before anything is allocated."""
    path = derived(conv, "bad-experts", meta={f"{A}.expert_feed_forward_length": 16})
    with pytest.raises(MetadataError, match=r"'gpt-oss\.expert_feed_forward_length': the metadata gives 16, "
                                            r"but blk\.0\.ffn_gate_exps"):
        load_model(path, devices="cpu")


def test_a_single_kind_of_layer_has_one_cache(conv):
    path = derived(conv, "all-local", meta={f"{A}.attention.sliding_window_pattern": 0})
    with load_model(path, load=False, devices="cpu") as model:
        assert model.config.swa_layers == (True,) * 4
        c = model.new_cache(flash_attn=True)
    assert type(c) is Causal and c.window == WINDOW - 1
