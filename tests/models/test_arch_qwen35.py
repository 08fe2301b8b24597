"""models/qwen3next.py's ``Qwen35Model`` (``general.architecture = "qwen35"``, Qwen3.5 text) against transformers,
through files written by llama.cpp's converter.

A tiny random-weight ``Qwen3_5ForCausalLM`` (4 layers: gated DeltaNet in 0, 1 and 3, gated attention in 2; n_embd
64, 4 attention heads of 32 over 2 KV heads with a rotary quarter; DeltaNet heads of 16, 2 key heads shared by 4
value heads; a SwiGLU feed-forward of 96; weights of std 0.1) with the real qwen35 vocabulary, converted with
``--no-mtp``. The heads are 32 wide because llama.cpp's multimodal RoPE needs the default sections (11 + 11 + 10)
to fit in a head. The converter orders the value heads so that ggml's ``gated_delta_net`` pairs them with the key
heads as transformers does (``h % n_key_heads``), and writes ``ssm_beta`` and ``ssm_alpha`` apart.

Tolerance with F32 weights and an F32 cache: ``TOL`` (1e-5); measured 6.6e-6 in one batch, 3.7e-6 token by token;
llama.cpp's own error on the same file through llama-cpp-python 7.0e-6.
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
    check_mtp_layers_are_left_unread,
    test_context_shift_falls_back_to_computing_again,
    test_prefix_reuse_from_checkpoints,
)
from test_models_converted import TEXT, TOL, errors, hf_logits  # noqa: E402

from ggmlpy import gguf  # noqa: E402
from ggmlpy.gguf import MetadataError  # noqa: E402
from ggmlpy.kvcache import Causal, Recurrent, Wrapper  # noqa: E402
from ggmlpy.models import UnknownArchitecture, load_model  # noqa: E402
from ggmlpy.models.qwen3next import Qwen35Config, Qwen35Model  # noqa: E402
from ggmlpy.runner import Runner  # noqa: E402

pytestmark = pytest.mark.hf

A = "qwen35"
LAYERS = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
RECURRENT = tuple(t == "linear_attention" for t in LAYERS)
CONFIG = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=32, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
              linear_num_key_heads=2, linear_num_value_heads=4, layer_types=LAYERS, full_attention_interval=3,
              max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.1)
F32 = {"type_k": "f32", "type_v": "f32"}


@pytest.fixture(scope="module")
def conv(tmp_path_factory):
    tok = hf_convert.tokenizer("qwen35")
    tokens = tok(TEXT + " " + TEXT, add_special_tokens=False)["input_ids"]
    c = make("Qwen3_5ForCausalLM", "Qwen3_5TextConfig", "qwen35", tokens, tmp_path_factory.mktemp("qwen35"),
             vocab_size=len(tok), **CONFIG)
    c.extra_args = ("--no-mtp",)
    c.ref = hf_logits(c.hf, tokens)
    return c


def test_the_file_is_the_converters(conv):
    """llama.cpp's keys and tensors (``ssm_beta`` / ``ssm_alpha`` apart, a dense feed-forward), read back."""
    with gguf.GGUFReader(str(conv.path())) as r:
        md, names = r.metadata, {t.name for t in r.tensors}
    assert md["general.architecture"] == A and list(md[f"{A}.attention.recurrent_layers"]) == list(RECURRENT)
    assert {"blk.0.ssm_beta.weight", "blk.0.ssm_alpha.weight", "blk.0.ffn_gate.weight"} <= names
    assert "blk.0.ssm_ba.weight" not in names and "blk.0.ffn_gate_inp.weight" not in names
    with load_model(conv.path(), devices="cpu") as model:
        c = model.config
        assert type(model) is Qwen35Model and c.recurrent_layers == RECURRENT
        assert (c.ssm_n_group, c.ssm_n_head, c.n_ff, c.n_expert, c.rope_dim) == (2, 4, 96, 0, 8)
    with load_model(conv.path(), devices="cpu") as model, Runner(model, n_ctx=64, **F32) as rt:
        assert isinstance(rt.cache, Wrapper) and [type(x) for x in rt.cache.caches] == [Causal, Recurrent]


@pytest.mark.parametrize("flash", [False, True])
def test_one_batch_matches_transformers(conv, flash):
    err = errors(run_batch(conv.path(), conv.tokens, flash_attn=flash), conv.ref)
    assert err.max() <= TOL, err


def test_token_by_token_matches_transformers(conv):
    err = errors(run_steps(conv.path(), conv.tokens), conv.ref)
    assert err.max() <= TOL, err


def test_several_sequences_in_one_batch(conv):
    t = conv.tokens
    assert sequences_error(conv, [t[:9], t[4:20], t[14:]], [5, 6, 7]) <= TOL


def test_llama_cpps_error_on_the_same_file(conv, tmp_path):
    err = errors(llama_cpp_logits(conv.path(), conv.tokens, tmp_path), conv.ref)
    assert err.max() <= TOL, err


def test_mtp_layers_are_left_unread(conv, tmp_path):
    """As qwen3next's (the same reading): a file with an MTP layer runs the others, as llama.cpp does."""
    check_mtp_layers_are_left_unread(conv, tmp_path)


def test_requests_together_generate_what_each_does_alone(conv):
    prompts = [conv.tokens[:6], conv.tokens[5:17], conv.tokens[-4:]]
    with load_model(conv.path(), devices="cpu") as model:
        with Runner(model, n_ctx=64, n_seq_max=3, n_batch=16, **F32) as rt:
            together = [h.result() for h in [rt.submit(p, max_tokens=6, temperature=0) for p in prompts]]
        with Runner(model, n_ctx=64, **F32) as rt:
            for p, r in zip(prompts, together):
                alone = rt.generate(p, max_tokens=6, temperature=0)
                rt.clear()
                assert r.error is None and r.tokens == alone.tokens


def test_state_save_and_load(conv, tmp_path):
    toks = conv.tokens
    with load_model(conv.path(), devices="cpu") as model:
        with Runner(model, n_ctx=64, n_seq_max=2, **F32) as rt:
            rt.decode(toks[:30], seq=1, logits=None)
            rt.save_state(1, tmp_path / "s.bin")
        with Runner(model, n_ctx=64, n_seq_max=3, **F32) as rt:
            assert rt.load_state(2, tmp_path / "s.bin") == toks[:30]
            got = rt.decode([toks[30]], seq=2)
    assert errors(got, conv.ref[30:31]).max() <= TOL


def test_experts_are_refused_naming_the_key(conv):
    """qwen35 is the dense model (Qwen3.5-MoE is qwen35moe, a model of its own): an expert count is refused."""
    with gguf.GGUFReader(str(conv.path())) as r:
        md = dict(r.metadata)
    md[f"{A}.expert_count"] = 4
    with pytest.raises((UnknownArchitecture, MetadataError), match=r"qwen35"):
        Qwen35Config.from_metadata(md, "m.gguf").validate("m.gguf")


@pytest.mark.parametrize("sections, ok", [([11, 11, 10, 0], True), ([2, 1, 1, 0], True), ([0, 0, 2, 0], False),
                                          ([1, 1, 1, 1], False), ([4, 0, 0, 0], False), ([1, 2], False),
                                          ([0, 0, 0, 0], False)])
def test_rope_sections_that_text_cannot_use_are_refused(conv, sections, ok):
    """The interleaved multimodal sections are NEOX RoPE for text only when every rotated pair (4 here) takes the
    temporal, height or width position; otherwise a pair would rotate by the fourth position (llama.cpp: 0 for
    text, measured 0.17 off with [0, 0, 2, 0]): refused, naming the key."""
    with gguf.GGUFReader(str(conv.path())) as r:
        md = dict(r.metadata)
    md[f"{A}.rope.dimension_sections"] = np.array(sections, np.int32)
    if ok:
        assert Qwen35Config.from_metadata(md, "m.gguf").rope_dim == 8
    else:
        with pytest.raises(MetadataError, match=r"qwen35\.rope\.dimension_sections"):
            Qwen35Config.from_metadata(md, "m.gguf")
