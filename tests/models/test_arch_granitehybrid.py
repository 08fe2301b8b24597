"""models/granitehybrid.py (``general.architecture = "granitehybrid"``, Granite 4.0 H) against transformers,
through files written by llama.cpp's converter.

Two tiny random-weight ``GraniteMoeHybridForCausalLM`` (6 layers: Mamba-2 in 0, 1, 3 and 5, attention without
RoPE in 2 and 4; n_embd 128; Mamba-2 inner width 256 in 8 heads of 32, 2 groups, state 16, 4 taps; attention
4 heads over 2 KV heads; Granite's multipliers all set: embedding 1.5, residual 0.7, attention 0.2, logits
2.0; weights of std 0.1) with the real gpt-2 vocabulary (padded to a multiple of 8, as the converter pads
Mamba vocabularies): ``moe`` with 4 experts of 64, 2 used per token, and a shared expert of 128 (Granite 4.0
H Tiny/Small's layout); ``dense`` without experts (Micro's). transformers 5 names the layer kinds
``linear_attention``/``full_attention``; the published checkpoints and llama.cpp's converter say
``mamba``/``attention``: the saved config.json is written so before converting.

Tolerance with F32 weights and an F32 cache: per position, max |got - ref| / max |ref| at most 1e-5 (``TOL``;
measured moe 1.8e-6 in one batch, 2.0e-6 token by token, 1.9e-6 for three sequences in one batch; dense 1.7e-6,
1.7e-6, 2.3e-6; llama.cpp's own error on the same files 1.9e-6 and 1.7e-6). The converter's F16 / Q8_0 files,
an F16 cache: F16 median 4e-3, max 6e-3; Q8_0 median 0.1, max 0.25 (measured moe F16 1.9e-3 / 3.0e-3, llama.cpp
1.8e-3 / 2.9e-3; Q8_0 0.055 / 0.164, llama.cpp 0.058 / 0.166, the max where a token's 2nd and 3rd experts are
nearly tied; dense F16 1.4e-3 / 2.4e-3, Q8_0 0.041 / 0.073, llama.cpp alike).

The runner over the two caches (the attention layers' K/V, the Mamba-2 layers' convolution and scan states):
requests together equal each alone, prefix reuse from a checkpoint computed as a fresh runner does, the context
shift's fallback, embeddings, a state saved and loaded.
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
from ggmlpy.models.granitehybrid import GraniteHybridConfig, GraniteHybridModel  # noqa: E402
from ggmlpy.runner import DoneReason, Runner  # noqa: E402

pytestmark = pytest.mark.hf

A = "granitehybrid"
LAYERS = ["linear_attention", "linear_attention", "full_attention", "linear_attention", "full_attention",
          "linear_attention"]
RECURRENT = tuple(t == "linear_attention" for t in LAYERS)
COMMON = dict(hidden_size=128, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, layer_types=LAYERS,
              mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
              max_position_embeddings=256, rms_norm_eps=1e-5, embedding_multiplier=1.5, residual_multiplier=0.7,
              attention_multiplier=0.2, logits_scaling=2.0, initializer_range=0.1)
VARIANTS = {
    "moe": dict(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=128),
    "dense": dict(intermediate_size=64, num_local_experts=0, num_experts_per_tok=0, shared_intermediate_size=64),
}
#: per-position error bounds (median, max) by converter --outtype; see the module docstring
QUANT_TOL = {"f16": (4e-3, 6e-3), "q8_0": (0.1, 0.25)}
F32 = {"type_k": "f32", "type_v": "f32"}


def _layer_names(config: dict) -> None:
    """The saved config.json's layer kinds as the published checkpoints (and llama.cpp's converter) name them."""
    config["layer_types"] = ["attention" if t == "full_attention" else "mamba" for t in config["layer_types"]]


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    made = {}

    def get(name):
        if name not in made:
            tok = hf_convert.tokenizer("gpt-2")
            tokens = [tok.bos_token_id, *tok(TEXT + " " + TEXT, add_special_tokens=False)["input_ids"]]
            c = make("GraniteMoeHybridForCausalLM", "GraniteMoeHybridConfig", "gpt-2", tokens,
                     tmp_path_factory.mktemp(name), vocab_size=-(-len(tok) // 8) * 8, bos_token_id=tok.bos_token_id,
                     eos_token_id=tok.eos_token_id, **COMMON, **VARIANTS[name])
            c.config_edit, c.name = _layer_names, name
            c.ref = hf_logits(c.hf, tokens)
            made[name] = c
        return made[name]
    return get


@pytest.fixture(scope="module", params=list(VARIANTS))
def conv(request, variants):
    return variants(request.param)


@pytest.fixture(scope="module")
def moe(variants):
    return variants("moe")


def derived(conv, what: str, **kw):
    if what not in conv.paths:
        conv.paths[what] = copy_gguf(conv.path(), conv.out_dir / f"{what}.gguf", **kw)
    return conv.paths[what]


def hf_greedy(hf, prompt, n):
    toks = list(prompt)
    for _ in range(n):
        toks.append(int(hf_logits(hf, toks)[-1].argmax()))
    return toks[len(prompt):]


def test_the_file_is_the_converters(conv):
    """llama.cpp's keys and tensors: the KV head count per layer, the ssm.* keys, RoPE off, the multipliers, the
    experts and the shared expert (or the dense feed-forward); the model reads them."""
    with gguf.GGUFReader(str(conv.path())) as r:
        md, info = r.metadata, {t.name: (tuple(t.ne), t.type) for t in r.tensors}
    assert list(md[f"{A}.attention.head_count_kv"]) == [0, 0, 2, 0, 2, 0]
    assert (md[f"{A}.ssm.conv_kernel"], md[f"{A}.ssm.inner_size"], md[f"{A}.ssm.state_size"],
            md[f"{A}.ssm.time_step_rank"], md[f"{A}.ssm.group_count"]) == (4, 256, 16, 8, 2)
    assert md[f"{A}.rope.scaling.finetuned"] is False or not md[f"{A}.rope.scaling.finetuned"]
    assert info["blk.0.ssm_in.weight"][0] == (128, 2 * 256 + 2 * 2 * 16 + 8)
    assert info["blk.0.ssm_conv1d.weight"] == ((4, 256 + 2 * 2 * 16), Type.F32)
    assert info["blk.0.ssm_norm.weight"][0] == (128, 2) and info["blk.0.ssm_a"][0] == (1, 8)
    moe_ = conv.name == "moe"
    assert ("blk.0.ffn_gate_exps.weight" in info) == moe_ == ("blk.0.ffn_up_shexp.weight" in info)
    assert ("blk.0.ffn_gate.weight" in info) != moe_
    with load_model(conv.path(), devices="cpu") as model:
        c = model.config
        assert type(model) is GraniteHybridModel and model.conv_bias and not model.tied_output
        assert c.recurrent_layers == RECURRENT and not c.use_rope
        assert (c.embedding_scale, c.logit_scale) == (1.5, 2.0) and abs(c.residual_scale - 0.7) < 1e-6
        assert (c.n_expert, c.n_expert_used, c.n_ff_shexp) == ((4, 2, 128) if moe_ else (0, 0, 0))


def test_the_cache_recipe(moe):
    with load_model(moe.path(), load=False, devices="cpu") as model:
        w = model.new_cache()
        assert isinstance(w, Wrapper) and [type(c) for c in w.caches] == [Causal, Recurrent]
        assert w.caches[1].states == {"conv": (3, 256 + 2 * 2 * 16), "ssm": (16, 32, 8)}
        assert [w.underlying(i) is w.caches[1] for i in range(6)] == list(RECURRENT)


# ------------------------------------------------------------------ logits against transformers


@pytest.mark.parametrize("flash", [False, True])
def test_one_batch_matches_transformers(conv, flash):
    err = errors(run_batch(conv.path(), conv.tokens, flash_attn=flash), conv.ref)
    assert err.max() <= TOL, err


@pytest.mark.parametrize("flash", [False, True])
def test_token_by_token_matches_transformers(conv, flash):
    """Each token alone: the convolution and scan states carry every earlier token."""
    err = errors(run_steps(conv.path(), conv.tokens, flash_attn=flash), conv.ref)
    assert err.max() <= TOL, err


def test_several_sequences_in_one_batch(conv):
    t = conv.tokens
    assert sequences_error(conv, [t[:9], t[4:20], t[14:]], [5, 6, 7]) <= TOL


def test_llama_cpps_error_on_the_same_file(conv, tmp_path):
    """llama.cpp (llama-cpp-python) on the same F32 file, F32 cache: within the same tolerance."""
    err = errors(llama_cpp_logits(conv.path(), conv.tokens, tmp_path), conv.ref)
    assert err.max() <= TOL, err


@pytest.mark.parametrize("what", ["no-skip", "group-norm-of-ones", "residual-unscaled", "rope-on"])
def test_the_settings_are_what_matches(moe, what):
    """Without the scan's skip term (``ssm_d`` of zeros), with group norms of ones, with the residual multiplier
    unset or with RoPE turned on, the logits leave the tolerance by far."""
    tensors = {"no-skip": ("ssm_d", np.zeros_like), "group-norm-of-ones": ("ssm_norm.weight", np.ones_like)}
    meta = {"residual-unscaled": {f"{A}.residual_scale": None}, "rope-on": {f"{A}.rope.scaling.finetuned": True}}
    if what in tensors:
        suffix, fill = tensors[what]
        path = derived(moe, what, tensors=lambda name, data: [(name, fill(data) if name.endswith(suffix) else data)])
    else:
        path = derived(moe, what, meta=meta[what])
    err = errors(run_batch(path, moe.tokens), moe.ref)
    assert err.max() > 100 * TOL, err


@pytest.mark.parametrize("outtype", list(QUANT_TOL))
def test_converter_quantized_files_track_transformers(conv, outtype):
    with load_model(conv.path(outtype), devices="cpu") as model:
        assert model.weights["blk.0.ssm_in.weight"].type == Type[outtype.upper()]
        for name in ("ssm_conv1d.weight", "ssm_a", "ssm_d", "ssm_norm.weight"):
            assert model.weights[f"blk.0.{name}"].type == Type.F32
        with Runner(model, n_ctx=64) as rt:
            got = rt.decode(conv.tokens, logits="all")
    err = errors(got, conv.ref)
    med, worst = QUANT_TOL[outtype]
    assert np.median(err) <= med and err.max() <= worst, err


# ------------------------------------------------------------------ the runner


def test_requests_together_generate_what_each_does_alone(moe):
    prompts = [moe.tokens[:6], moe.tokens[5:17], moe.tokens[-4:]]

    def generate(ps):
        with load_model(moe.path(), devices="cpu") as model, \
                Runner(model, n_ctx=64, n_seq_max=len(ps), n_batch=16, **F32) as rt:
            return [h.result() for h in [rt.submit(p, max_tokens=5, temperature=0, logprobs=True) for p in ps]]

    together = generate(prompts)
    for p, r in zip(prompts, together):
        (alone,) = generate([p])
        assert r.error is None and r.tokens == alone.tokens
        np.testing.assert_allclose([x.logprob for x in r.logprobs], [x.logprob for x in alone.logprobs], atol=1e-4)
        assert r.tokens == hf_greedy(moe.hf, p, len(r.tokens))


def test_prefix_reuse_from_a_checkpoint(moe):
    """A conversation going on from a prompt reuses the prompt (a checkpoint of both states) and computes the rest
    as a fresh runner does; the same prompt again reuses all but its last token."""
    prompt = moe.tokens[:12]
    with load_model(moe.path(), devices="cpu") as model:
        with Runner(model, n_ctx=64, n_seq_max=2, **F32) as rt:
            a = rt.generate(prompt, max_tokens=4, temperature=0)
            b = rt.generate(prompt + a.tokens[:2] + [9], max_tokens=4, temperature=0)
            c = rt.generate(prompt, max_tokens=4, temperature=0)
        assert (a.n_cached, b.n_cached, c.n_cached) == (0, 12, 11) and c.tokens == a.tokens
        with Runner(model, n_ctx=64, **F32) as fresh:
            assert b.tokens == fresh.generate(prompt + a.tokens[:2] + [9], max_tokens=4, temperature=0).tokens


def test_context_shift_falls_back_to_computing_again(moe):
    prompt = moe.tokens[:14]
    with load_model(moe.path(), devices="cpu") as model, Runner(model, n_ctx=24, **F32) as rt:
        rt.decode(prompt, logits=None)
        with pytest.raises(NotSupported, match="shifting positions"):
            rt.cache.remove(0, 4, 7)
        rt.clear()
        res = rt.submit(prompt, max_tokens=16, n_keep=4, temperature=0).result()
    assert res.error is None and res.done_reason == DoneReason.LENGTH and res.n_shifts >= 1 and len(res.tokens) == 16


def test_embeddings_match_transformers(moe):
    toks = moe.tokens[:30]
    with load_model(moe.path(), devices="cpu") as model, Runner(model, n_ctx=64, **F32) as rt:
        got = rt.embed(toks)
    with torch.no_grad():
        hidden = moe.hf.model(torch.tensor([toks])).last_hidden_state[0].numpy()
    want = hidden.mean(0)
    want /= np.linalg.norm(want)
    assert np.abs(got - want).max() <= TOL * np.abs(want).max()


def test_state_save_and_load(moe, tmp_path):
    toks = moe.tokens
    with load_model(moe.path(), devices="cpu") as model:
        with Runner(model, n_ctx=64, n_seq_max=2, **F32) as rt:
            rt.decode(toks[:30], seq=1, logits=None)
            rt.save_state(1, tmp_path / "s.bin")
        with Runner(model, n_ctx=64, n_seq_max=3, **F32) as rt:
            assert rt.load_state(2, tmp_path / "s.bin") == toks[:30]
            got = rt.decode([toks[30]], seq=2)
    assert errors(got, moe.ref[30:31]).max() <= TOL


# ------------------------------------------------------------------ metadata and tensors


@pytest.mark.parametrize("key,value,error,match", [
    ("attention.sliding_window", 4, MetadataError, r"'granitehybrid\.attention\.sliding_window': 4"),
    ("attention.head_count_kv", [0, 2, 0], MetadataError, r"3 values for 6 layers"),
    ("ssm.state_size", None, MetadataError, r"'granitehybrid\.ssm\.state_size': is missing"),
    ("ssm.group_count", 3, ValueError, r"granitehybrid\.ssm\.inner_size 256 must be a multiple"),
    ("expert_gating_func", 2, MetadataError, r"'granitehybrid\.expert_gating_func': 2 is not supported"),
    ("expert_count", 0, MetadataError, r"'granitehybrid\.expert_used_count': 2, but granitehybrid\.expert_count is 0"),
])
def test_unsupported_metadata_names_the_key(moe, key, value, error, match):
    with gguf.GGUFReader(str(moe.path())) as r:
        md = dict(r.metadata)
    md.pop(f"{A}.{key}", None)
    if value is not None:
        md[f"{A}.{key}"] = value
    with pytest.raises(error, match=match):
        GraniteHybridConfig.from_metadata(md, "m.gguf").validate("m.gguf")


def test_the_layer_kinds_and_types_are_checked_against_the_tensors(moe):
    wrong = derived(moe, "wrong-kinds", meta={f"{A}.attention.head_count_kv": np.array([0, 0, 0, 0, 2, 0], np.int32)})
    with pytest.raises(MetadataError, match=r"layer 2 is Mamba-2 by it, but the file has blk\.2\.attn_q\.weight"):
        load_model(wrong, devices="cpu")
    f16 = derived(moe, "f16-a", types=lambda name, old: Type.F16 if name.endswith("ssm_a") else old)
    with pytest.raises(MissingTensor, match=r"blk\.0\.ssm_a"):
        load_model(f16, devices="cpu")


def test_the_benchmarks_synthetic_models_run(tmp_path):
    """ggmlpy bench --arch granitehybrid: the built-in file (llama.cpp's keys, F32 SSM tensors) loads, gives one
    batch's logits token by token too, and llama.cpp reads it and computes the same logits."""
    from ggmlpy.models.synthetic import synthetic_path

    path = synthetic_path("tiny", "Q8_0", cache_dir=tmp_path, arch="granitehybrid")
    toks = [3, 1, 4, 1, 5, 9, 2, 6]
    with load_model(path, devices="cpu") as model:
        assert type(model) is GraniteHybridModel and model.config.recurrent_layers == (True, False)
    full, steps = run_batch(path, toks), run_steps(path, toks)
    assert np.isfinite(full).all() and errors(steps, full).max() <= 1e-3
    assert errors(llama_cpp_logits(path, toks, tmp_path), full).max() <= 1e-3
