"""models/qwen3next.py's ``Qwen35MoeModel`` (``general.architecture = "qwen35moe"``, Qwen3.5 MoE text) against
transformers, through files written by llama.cpp's converter, and against llama.cpp on the same file.

A tiny random-weight ``Qwen3_5MoeForCausalLM``: test_arch_qwen35's model (4 layers: gated DeltaNet in 0, 1 and 3,
gated attention in 2; heads of 32 for llama.cpp's multimodal RoPE sections) with qwen3next's feed-forward: 4
experts of 32, 2 used, a shared expert of 48 with its sigmoid gate; the real qwen35 vocabulary, converted with
``--no-mtp`` (transformers keeps no MTP layers; a file with one: :func:`test_mtp_layers_are_left_unread`).

Tolerance with F32 weights and an F32 cache: ``TOL_BATCH`` (1.5e-5) in one batch (measured 8.3e-6 either attention
path on a Zen 4, llama.cpp's own error on the same file 8.6e-6, the file with an MTP layer the same; on a Zen 3
without AVX-512, where ggml's attention kernels run instead of ggmlpy's, 1.11e-5 and llama.cpp's the same 1.11e-5),
``TOL_STEPS`` (2e-5) token by
token (measured 9.0e-6) and for three sequences with a step each (1.01e-5): transformers' chunked delta rule
against ggml's recurrence, see test_arch_qwen3next. The runner tests over the
recurrent states (prefix reuse at checkpoints, context shift's fallback) are test_arch_qwen3next's, run here on
this model.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch") if not os.environ.get("CI") else __import__("torch")
transformers = pytest.importorskip("transformers") if not os.environ.get("CI") else __import__("transformers")

import hf_convert  # noqa: E402
from arch_helpers import llama_cpp_logits, make, run_batch, run_steps, sequences_error  # noqa: E402
from test_arch_qwen3next import (  # noqa: E402, F401  (the runner tests, collected here on this model)
    TOL_STEPS,
    check_mtp_layers_are_left_unread,
    test_context_shift_falls_back_to_computing_again,
    test_prefix_reuse_from_checkpoints,
)
from test_models_converted import TEXT, errors, hf_logits  # noqa: E402

from ggmlpy import gguf  # noqa: E402
from ggmlpy.kvcache import Causal, Recurrent, Wrapper  # noqa: E402
from ggmlpy.models import load_model  # noqa: E402
from ggmlpy.models.qwen3next import Qwen35Model, Qwen35MoeModel  # noqa: E402
from ggmlpy.runner import Runner  # noqa: E402

pytestmark = pytest.mark.hf

A = "qwen35moe"
LAYERS = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
RECURRENT = tuple(t == "linear_attention" for t in LAYERS)
CONFIG = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=32, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
              linear_num_key_heads=2, linear_num_value_heads=4, layer_types=LAYERS, full_attention_interval=3,
              num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
              max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.1)
F32 = {"type_k": "f32", "type_v": "f32"}
#: one batch (see the module docstring)
TOL_BATCH = 1.5e-5


@pytest.fixture(scope="module")
def conv(tmp_path_factory):
    tok = hf_convert.tokenizer("qwen35")
    tokens = tok(TEXT + " " + TEXT, add_special_tokens=False)["input_ids"]
    c = make("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig", "qwen35", tokens, tmp_path_factory.mktemp("qwen35moe"),
             vocab_size=len(tok), **CONFIG)
    c.extra_args = ("--no-mtp",)
    c.ref = hf_logits(c.hf, tokens)
    return c


def test_the_file_is_the_converters(conv):
    """llama.cpp's keys and tensors (qwen35's layers, qwen3next's experts and shared expert), read back."""
    with gguf.GGUFReader(str(conv.path())) as r:
        md, names = r.metadata, {t.name for t in r.tensors}
    assert md["general.architecture"] == A and list(md[f"{A}.attention.recurrent_layers"]) == list(RECURRENT)
    assert {"blk.0.ssm_beta.weight", "blk.0.ssm_alpha.weight", "blk.0.ffn_gate_inp.weight",
            "blk.0.ffn_gate_exps.weight", "blk.0.ffn_gate_inp_shexp.weight", "blk.0.ffn_up_shexp.weight"} <= names
    with load_model(conv.path(), devices="cpu") as model:
        c = model.config
        assert type(model) is Qwen35MoeModel and c.recurrent_layers == RECURRENT
        assert (c.ssm_n_group, c.ssm_n_head, c.n_expert, c.n_expert_used, c.n_ff_exp, c.n_ff_shexp) == (2, 4, 4, 2,
                                                                                                        32, 48)
    with load_model(conv.path(), devices="cpu") as model, Runner(model, n_ctx=64, **F32) as rt:
        assert isinstance(rt.cache, Wrapper) and [type(x) for x in rt.cache.caches] == [Causal, Recurrent]


@pytest.mark.parametrize("flash", [False, True])
def test_one_batch_matches_transformers(conv, flash):
    err = errors(run_batch(conv.path(), conv.tokens, flash_attn=flash), conv.ref)
    assert err.max() <= TOL_BATCH, err


def test_token_by_token_matches_transformers(conv):
    err = errors(run_steps(conv.path(), conv.tokens), conv.ref)
    assert err.max() <= TOL_STEPS, err


def test_several_sequences_in_one_batch(conv):
    t = conv.tokens
    # a step after each prompt: the recurrence's bound (measured 1.01e-5)
    assert sequences_error(conv, [t[:9], t[4:20], t[14:]], [5, 6, 7]) <= TOL_STEPS


def test_llama_cpps_error_on_the_same_file(conv, tmp_path):
    err = errors(llama_cpp_logits(conv.path(), conv.tokens, tmp_path), conv.ref)
    assert err.max() <= TOL_BATCH, err


def test_mtp_layers_are_left_unread(conv, tmp_path):
    check_mtp_layers_are_left_unread(conv, tmp_path, tol=TOL_BATCH)


def test_requests_together_generate_what_each_does_alone(conv):
    prompts = [conv.tokens[:6], conv.tokens[5:17], conv.tokens[-4:]]
    with load_model(conv.path(), devices="cpu") as model:
        with Runner(model, n_ctx=64, n_seq_max=3, n_batch=16, **F32) as rt:
            together = [h.result() for h in [rt.submit(p, max_tokens=6, temperature=0) for p in prompts]]
            assert [3] in rt.batch_sizes, rt.batch_sizes
        with Runner(model, n_ctx=64, **F32) as rt:
            for p, r in zip(prompts, together):
                alone = rt.generate(p, max_tokens=6, temperature=0)
                rt.clear()
                assert r.error is None and r.tokens == alone.tokens


def test_state_save_and_load(conv, tmp_path):
    """A sequence's state (attention cache and recurrent states) saved and loaded into another runner's other
    sequence goes on as the reference does."""
    toks = conv.tokens
    with load_model(conv.path(), devices="cpu") as model:
        with Runner(model, n_ctx=64, n_seq_max=2, **F32) as rt:
            rt.decode(toks[:30], seq=1, logits=None)
            rt.save_state(1, tmp_path / "s.bin")
        with Runner(model, n_ctx=64, n_seq_max=3, **F32) as rt:
            assert rt.load_state(2, tmp_path / "s.bin") == toks[:30]
            got = rt.decode([toks[30]], seq=2)
    assert errors(got, conv.ref[30:31]).max() <= TOL_BATCH


@pytest.mark.parametrize("arch,model_type,n_expert", [("qwen35", Qwen35Model, 0), ("qwen35moe", Qwen35MoeModel, 8)])
def test_the_benchmarks_synthetic_models_run(tmp_path, arch, model_type, n_expert):
    """ggmlpy bench --arch qwen35 / qwen35moe: the built-in file (llama.cpp's keys, the RoPE sections it requires)
    loads, gives one batch's logits token by token too, and llama.cpp reads it and computes the same logits."""
    from ggmlpy.models.synthetic import synthetic_path

    path = synthetic_path("tiny", "Q8_0", cache_dir=tmp_path, arch=arch)
    toks = [3, 1, 4, 1, 5, 9, 2, 6]
    with load_model(path, devices="cpu") as model:
        c = model.config
        assert type(model) is model_type and c.recurrent_layers == (True, False)
        assert (c.ssm_n_group, c.ssm_n_head, c.n_expert, c.rope_dim) == (2, 4, n_expert, 4)
    full, steps = run_batch(path, toks), run_steps(path, toks)
    assert np.isfinite(full).all() and np.abs(full).max() > 0 and errors(steps, full).max() <= 1e-3
    assert errors(llama_cpp_logits(path, toks, tmp_path), full).max() <= 1e-3
