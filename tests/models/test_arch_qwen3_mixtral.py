"""models/qwen3.py (qwen3, qwen3moe) and Mixtral (models/llama.py with experts) against transformers,
through files written by llama.cpp's converter.

Three tiny random-weight models (two layers, n_embd 256 so that K-quants fit every row): a
Qwen3ForCausalLM (per-head Q/K norms, head size 128 != n_embd / n_head, tied output), a
Qwen3MoeForCausalLM (8 experts, 3 used per token, experts 256 wide while the dense size is 512, separate
output) with the qwen2 vocabulary, and a MixtralForCausalLM (8 experts, 2 used) with the llama-spm
vocabulary, which the converter writes as a ``llama`` file with ``llama.expert_count``. Every constant
weight (norms, Q/K norms) is made random first. The routing differs from token to token (checked), and
the experts' renormalised weights matter (a file that turns them off is checked to fail).

Tolerance with F32 weights and an F32 cache: at each position the max abs error is at most 1e-5 x that
position's largest |logit| (measured, in one batch / token by token / three sequences in one batch, the
largest of the two attention paths: qwen3 1.0e-6 / 9.1e-7 / 8.4e-7, qwen3moe 7.7e-7 / 7.3e-7 / 7.8e-7,
mixtral 6.5e-7 / 6.4e-7 / 5.6e-7). With the routing weights not renormalised, or one expert more per
token, the error is 0.08 to 0.22: far outside.

Every matrix of the layers quantized by ggmlpy (the routers stay F32, as llama-quantize keeps them;
embeddings and head stay F32), an F16 cache, per-position error: F16 at most 3e-3 everywhere with the
same top-1 (measured 1.1e-3 to 1.3e-3); Q8_0 median 3e-2 and max 0.1 (measured medians 1.2e-2 to 1.9e-2;
max 1.6e-2 mixtral, 2.3e-2 qwen3, 4.9e-2 qwen3moe: where a token's k-th and (k+1)-th experts are nearly
tied the quantized model may route it to the other, as llama.cpp would); Q4_K median 0.25 and max 0.35
(measured medians 0.13 to 0.17, max 0.19 to 0.23).
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
from ggmlpy.models import LlamaModel, UnknownArchitecture, load_model  # noqa: E402
from ggmlpy.models.qwen3 import Qwen3Model  # noqa: E402
from ggmlpy.runner import DoneReason, Runner  # noqa: E402
from ggmlpy.runner.slots import shift_discard  # noqa: E402

pytestmark = pytest.mark.hf

COMMON = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, rms_norm_eps=1e-6)
# name: (HF class, config class, GGUF architecture, llama.cpp vocabulary, model class, config kwargs)
MODELS = {
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", "qwen3", "qwen2", Qwen3Model, dict(
        intermediate_size=512, head_dim=128, rope_theta=1e6, tie_word_embeddings=True)),
    "qwen3moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", "qwen3moe", "qwen2", Qwen3Model, dict(
        intermediate_size=512, head_dim=128, rope_theta=1e6, num_experts=8, num_experts_per_tok=3,
        moe_intermediate_size=256, norm_topk_prob=True, tie_word_embeddings=False)),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", "llama", "llama-spm", LlamaModel, dict(
        intermediate_size=256, num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False)),
}
MOE = ["qwen3moe", "mixtral"]
# per-position error bounds (median, max) by weight type; see the module docstring
QUANT_TOL = {"F16": (3e-3, 3e-3), "Q8_0": (3e-2, 0.1), "Q4_K": (0.25, 0.35)}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """``models(name)``: the HF model and its files (each made once for the module)."""
    made = {}

    def get(name):
        if name not in made:
            cls, cfg, arch, vocab, _, extra = MODELS[name]
            tok = hf_convert.tokenizer(vocab)
            tokens = [tok.bos_token_id, *tok(TEXT, add_special_tokens=False)["input_ids"], tok.eos_token_id]
            conv = make(cls, cfg, vocab, tokens, tmp_path_factory.mktemp(name), vocab_size=len(tok),
                        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **COMMON, **extra)
            conv.name, conv.arch = name, arch
            conv.ref = hf_logits(conv.hf, tokens)
            made[name] = conv
        return made[name]

    return get


@pytest.fixture(scope="module", params=list(MODELS))
def conv(request, models):
    return models(request.param)


@pytest.fixture(scope="module", params=MOE)
def moe(request, models):
    return models(request.param)


def derived(conv, what: str, **kw):
    """A file made from ``conv``'s F32 file by :func:`copy_gguf` once (cached under ``what``)."""
    if what not in conv.paths:
        conv.paths[what] = copy_gguf(conv.path(), conv.out_dir / f"{what}.gguf", **kw)
    return conv.paths[what]


def quantized(conv, t: str):
    """Every matrix of the layers in type ``t``, except the routers (F32, as llama-quantize keeps them)."""
    keep = ("norm.weight", "ffn_gate_inp.weight")
    return derived(conv, t, types=lambda name, old: Type[t] if name.startswith("blk.") and not name.endswith(keep)
                   else old)


def one_layer(conv):
    """The file with only its first layer (where a context shift is exact)."""
    return derived(conv, "one-layer", meta={f"{conv.arch}.block_count": 1},
                   tensors=lambda name, data: [] if name.startswith("blk.1.") else [(name, data)])


def test_the_file_is_the_converters(conv):
    """llama.cpp's keys and tensors: Q/K norms for qwen3*, the experts (and mixtral as a llama file), the
    head tied or not; the Q/K norms were made random before converting."""
    _, _, arch, _, model_cls, extra = MODELS[conv.name]
    hc = conv.hf.config
    n_expert = extra.get("num_experts", extra.get("num_local_experts", 0))
    k, ff = getattr(hc, "num_experts_per_tok", 0), extra.get("moe_intermediate_size", hc.intermediate_size)
    with gguf.GGUFReader(str(conv.path())) as r:
        md, ne = r.metadata, {t.name: tuple(t.ne) for t in r.tensors}
    assert md["general.architecture"] == arch and ("output.weight" in ne) == (not hc.tie_word_embeddings)
    if n_expert:
        assert (md[f"{arch}.expert_count"], md[f"{arch}.expert_used_count"]) == (n_expert, k) and k < n_expert
        assert ne["blk.1.ffn_gate_inp.weight"] == (256, n_expert) and "blk.0.ffn_up.weight" not in ne
        assert ne["blk.1.ffn_up_exps.weight"] == (256, ff, n_expert)
        assert ne["blk.1.ffn_down_exps.weight"] == (ff, 256, n_expert)
    if arch.startswith("qwen3"):
        assert md[f"{arch}.attention.key_length"] == 128 and ne["blk.0.attn_q.weight"] == (256, 512)
        assert ne["blk.1.attn_q_norm.weight"] == ne["blk.1.attn_k_norm.weight"] == (128,)
        q_norm = conv.hf.model.layers[1].self_attn.q_norm.weight
        assert not torch.all(q_norm == q_norm[0])
    with load_model(conv.path(), devices="cpu") as model:
        c = model.config
        assert type(model) is model_cls and c.n_expert == n_expert
        if n_expert:
            assert (c.n_expert_used, c.n_ff_exp, c.expert_weights_norm) == (k, ff, True)


@pytest.mark.parametrize("flash", [False, True])
def test_one_batch_matches_transformers(conv, flash):
    err = errors(run_batch(conv.path(), conv.tokens, flash_attn=flash), conv.ref)
    assert err.max() <= TOL, err


@pytest.mark.parametrize("flash", [False, True])
def test_token_by_token_matches_transformers(conv, flash):
    err = errors(run_steps(conv.path(), conv.tokens, flash_attn=flash), conv.ref)
    assert err.max() <= TOL, err


def test_unfused_weights_give_the_same_logits(conv):
    """Q/K/V kept apart (the Q/K norms then read contiguous heads, not views of the fused product)."""
    with load_model(conv.path(), fuse=False, devices="cpu") as model, \
            Runner(model, n_ctx=64, type_k="f32", type_v="f32") as rt:
        assert model.fused == {}
        got = rt.decode(conv.tokens, logits="all")
    assert errors(got, conv.ref).max() <= TOL


@pytest.mark.parametrize("flash", [False, True])
def test_several_sequences_in_one_batch(conv, flash):
    """Tokens of three sequences routed in one batch (one mul_mat_id over all of them), then one more
    token of each, against transformers on each sequence alone."""
    t = conv.tokens
    assert sequences_error(conv, [t[:9], t[4:20], t[14:]], [5, 6, 7], flash=flash) <= TOL


def hf_greedy(hf, prompt, n):
    toks = list(prompt)
    for _ in range(n):
        toks.append(int(hf_logits(hf, toks)[-1].argmax()))
    return toks[len(prompt):]


def test_requests_batched_generate_as_transformers(conv):
    """Three requests served together (their tokens in shared batches) generate transformers' greedy
    tokens, each."""
    prompts = [conv.tokens[:6], conv.tokens[5:17], conv.tokens[-4:]]
    with load_model(conv.path(), devices="cpu") as model, \
            Runner(model, n_ctx=64, n_seq_max=3, n_batch=16, type_k="f32", type_v="f32") as rt:
        hs = [rt.submit(p, max_tokens=6, temperature=0) for p in prompts]
        got = [h.result() for h in hs]
        assert [3] in rt.batch_sizes, rt.batch_sizes          # a step with one token of each request
        assert rt.reallocations == 0                       # the start-up reservation covered routing too
    for p, r in zip(prompts, got):
        want = hf_greedy(conv.hf, p, 6)
        assert r.tokens == want[:len(r.tokens)] and (len(r.tokens) == 6 or r.done_reason == DoneReason.STOP)


@pytest.mark.parametrize("flash", [False, True])
def test_context_shift_equals_from_scratch(conv, flash):
    """After remove(keep, keep + discard) the kept keys are re-rotated by the model's shift (NEOX RoPE
    after the Q/K norms for qwen3*); the logits equal a fresh run over the kept tokens (one layer: a
    shift is exact there)."""
    assert shift_error(one_layer(conv), conv.tokens[:24], 4, 10, flash).max() <= TOL


def test_runner_context_shift(conv):
    """Generation past a full context shifts it, and the token after the shift is a fresh run's."""
    prompt, n_ctx, keep = conv.tokens[:6], 16, 2
    with load_model(one_layer(conv), devices="cpu") as model, \
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


def test_prefix_reuse(conv):
    """A request that shares another's history reuses its cells (routing per token does not depend on
    the batch), and generates what a fresh runner does."""
    prompt = conv.tokens[:12]
    with load_model(conv.path(), devices="cpu") as model:
        with Runner(model, n_ctx=64, n_seq_max=2, type_k="f32", type_v="f32") as rt:
            a = rt.generate(prompt, max_tokens=4, temperature=0)
            b = rt.generate(prompt + a.tokens[:2] + [9], max_tokens=4, temperature=0)
            assert (a.n_cached, b.n_cached) == (0, len(prompt) + 2)
        with Runner(model, n_ctx=64, type_k="f32", type_v="f32") as rt:
            assert rt.generate(prompt + a.tokens[:2] + [9], max_tokens=4, temperature=0).tokens == b.tokens


@pytest.mark.parametrize("wtype", list(QUANT_TOL))
def test_quantized_weights_track_transformers(conv, wtype):
    path = quantized(conv, wtype)
    with load_model(path, devices="cpu") as model:
        assert model.weights["blk.1.attn_output.weight"].type == Type[wtype]
        if model.config.n_expert:
            assert model.weights["blk.1.ffn_down_exps.weight"].type == Type[wtype]
            assert model.weights["blk.1.ffn_gate_inp.weight"].type == Type.F32
        with Runner(model, n_ctx=64) as rt:
            got = rt.decode(conv.tokens, logits="all")
    err = errors(got, conv.ref)
    med, worst = QUANT_TOL[wtype]
    assert np.median(err) <= med and err.max() <= worst, err
    if wtype == "F16":
        np.testing.assert_array_equal(got.argmax(-1), conv.ref.argmax(-1))


# ---------------------------------------------------------------------------------------------- experts


def test_routing_differs_from_token_to_token(moe):
    """transformers picks several expert sets for the prompt's tokens in every layer (a routing bug, even
    one that swaps whole sets, would show in the logits)."""
    k = moe.hf.config.num_experts_per_tok
    with torch.no_grad():
        out = moe.hf(torch.tensor([moe.tokens]), output_router_logits=True)
    for layer in out.router_logits:
        picks = {tuple(sorted(r)) for r in torch.topk(layer, k, -1).indices.tolist()}
        assert len(picks) >= 3, picks


@pytest.mark.parametrize("change", ["no_norm", "one_more"])
def test_the_routing_settings_are_what_matches(moe, change):
    """With the routing weights not renormalised, or one expert more per token, the logits leave the
    tolerance by far: the F32 match checks the routing, not only the experts."""
    a = moe.arch
    meta = {f"{a}.expert_weights_norm": False} if change == "no_norm" else \
        {f"{a}.expert_used_count": moe.hf.config.num_experts_per_tok + 1}
    err = errors(run_batch(derived(moe, change, meta=meta), moe.tokens), moe.ref)
    assert err.max() > 100 * TOL, err


@pytest.mark.parametrize("name,key,value,error,match", [
    ("qwen3moe", "expert_count", None, MetadataError, r"'qwen3moe\.expert_count': is missing: a qwen3moe model has"),
    ("qwen3moe", "expert_used_count", 9, MetadataError, r"'qwen3moe\.expert_used_count': 9 is out of range \[1, 8\]"),
    ("qwen3moe", "expert_gating_func", 2, MetadataError, r"'qwen3moe\.expert_gating_func': 2 is not supported"),
    ("qwen3moe", "expert_group_count", 4, MetadataError, r"'qwen3moe\.expert_group_count': 4 is not supported"),
    ("qwen3moe", "expert_shared_count", 1, MetadataError, r"'qwen3moe\.expert_shared_count': 1 is not supported"),
    ("qwen3moe", "expert_weights_scale", 2.5, MetadataError, r"'qwen3moe\.expert_weights_scale': 2\.5 is not"),
    ("qwen3moe", "expert_weights_norm", 1, MetadataTypeError, r"'qwen3moe\.expert_weights_norm': expected a bool"),
    ("qwen3", "expert_count", 4, UnknownArchitecture, r"mixture-of-experts qwen3 models are not supported"),
    ("mixtral", "expert_used_count", None, MetadataError, r"'llama\.expert_used_count': is missing"),
    ("mixtral", "expert_count", 0, MetadataError, r"'llama\.expert_used_count': 2, but llama\.expert_count is 0"),
])
def test_unsupported_expert_metadata_names_the_key(models, name, key, value, error, match):
    conv = models(name)
    cls = MODELS[name][4]
    with gguf.GGUFReader(str(conv.path())) as r:
        md = dict(r.metadata)
    full = f"{conv.arch}.{key}"
    md.pop(full, None)
    if value is not None:
        md[full] = value
    with pytest.raises(error, match=match):
        cls.config_class.from_metadata(md, "m.gguf")


@pytest.mark.parametrize("name,key,value", [("mixtral", "expert_count", 6),
                                            ("qwen3moe", "expert_feed_forward_length", 128)])
def test_expert_sizes_are_checked_against_the_tensors(models, name, key, value):
    """A key that contradicts the expert tensors is named before anything is allocated."""
    conv = models(name)
    path = derived(conv, f"bad-{key}", meta={f"{conv.arch}.{key}": value})
    with pytest.raises(MetadataError, match=rf"'{conv.arch}\.{key}': the metadata gives {value}, but blk\.0\."):
        load_model(path, devices="cpu")


@pytest.mark.parametrize("arch", ["qwen3", "qwen3moe"])
def test_the_benchmarks_synthetic_models_run(tmp_path, arch):
    """ggmlpy bench --arch qwen3/qwen3moe: the built-in files (llama.cpp's keys, Q8_0 experts, F32
    router) load and give one batch's logits token by token too."""
    from ggmlpy.models.synthetic import synthetic_path

    path = synthetic_path("tiny", "Q8_0", cache_dir=tmp_path, arch=arch)
    toks = [3, 1, 4, 1, 5, 9, 2, 6]
    with load_model(path, devices="cpu") as model:
        assert type(model) is Qwen3Model and bool(model.config.n_expert) == (arch == "qwen3moe")
    full, steps = run_batch(path, toks), run_steps(path, toks)
    assert np.isfinite(full).all() and errors(steps, full).max() <= 1e-3
