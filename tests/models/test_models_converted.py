"""Models loaded from GGUF files written by llama.cpp's own converter, against transformers.

Tiny random-weight models (a llama-3-style LlamaForCausalLM with llama3 RoPE scaling and the real
llama-bpe vocabulary; a Qwen2ForCausalLM with Q/K/V biases, tied output and the qwen2 vocabulary) are
converted by ``convert_hf_to_gguf.py`` (tests/hf_convert.py) and loaded with ``load_model``: the file's
names, shapes, Q/K permutation, metadata and rope_freqs are llama.cpp's, not our writer's. Constant
weights (norms, biases) are made random first, so a dropped or misread tensor shows.

Tolerance with F32 weights and an F32 cache: at each position the max abs error is at most 1e-5 x that
position's largest |logit| (measured over 24 and 27 tokens: llama3 5.6e-7 in one batch and 5.2e-7 token
by token, with and without flash attention; qwen2 4.9e-7 (4.7e-7 flash) and 4.2e-7). Without the llama3
frequency factors the llama3 logits would be off by 5.7e-3.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch") if not os.environ.get("CI") else __import__("torch")
transformers = pytest.importorskip("transformers") if not os.environ.get("CI") else __import__("transformers")

import hf_convert  # noqa: E402

from ggmlpy import gguf  # noqa: E402
from ggmlpy.models import load_model  # noqa: E402
from ggmlpy.runner import Runner  # noqa: E402

pytestmark = pytest.mark.hf

TOL = 1e-5
TEXT = "The quick brown fox jumps over the lazy dog, then naps: 42 times in 2024!"

# name: (HF class, config class, llama.cpp vocabulary, GGUF architecture, config kwargs)
MODELS = {
    "llama3": ("LlamaForCausalLM", "LlamaConfig", "llama-bpe", "llama", dict(
        rope_theta=500000.0, tie_word_embeddings=False,
        # Llama 3.1's scaling with a short original context, so that the factors (the converter's
        # rope_freqs.weight) change the positions this prompt reaches
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64})),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", "qwen2", "qwen2", dict(
        rope_theta=1000000.0, tie_word_embeddings=True, use_sliding_window=False)),
}


class Converted:
    def __init__(self, hf, path, vocab, arch, tokens, perturbed):
        self.hf, self.path, self.vocab, self.arch = hf, path, vocab, arch
        self.tokens, self.perturbed = tokens, perturbed


@pytest.fixture(scope="module", params=list(MODELS))
def converted(request, tmp_path_factory) -> Converted:
    """One tiny model per architecture, converted once for all the tests of this module."""
    cls_name, cfg_name, vocab, arch, extra = MODELS[request.param]
    tok = hf_convert.tokenizer(vocab)
    cfg = getattr(transformers, cfg_name)(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, attn_implementation="eager", **extra)
    torch.manual_seed(11)
    hf = getattr(transformers, cls_name)(cfg).float().eval()
    perturbed = hf_convert.perturb_constant_weights(hf, seed=12)
    path = hf_convert.convert(hf, tmp_path_factory.mktemp(request.param), vocab)
    # real text through the real tokenizer, between the vocabulary's own BOS and EOS ids: rows at
    # both ends of the embedding matrix
    tokens = [tok.bos_token_id, *tok(TEXT, add_special_tokens=False)["input_ids"], tok.eos_token_id]
    return Converted(hf, path, vocab, arch, tokens, perturbed)


def hf_logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([tokens], dtype=torch.long)).logits[0].float().numpy()


def errors(got: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Per position: max |got - ref| / max |ref|."""
    assert got.shape == ref.shape
    return np.abs(got - ref).max(-1) / np.abs(ref).max(-1)


def test_the_file_is_the_converters(converted):
    """What makes these files differ from our writer's: llama.cpp's tokenizer metadata, every weight
    that HF keeps (tied output: none written), and the constants made random before converting."""
    hf = converted.hf
    r = gguf.GGUFReader(str(converted.path))
    try:
        md = r.metadata
        assert md["general.architecture"] == converted.arch
        assert md["tokenizer.ggml.model"] == "gpt2" and md["tokenizer.ggml.pre"] == converted.vocab
        assert len(md["tokenizer.ggml.tokens"]) == hf.config.vocab_size
        names = {t.name for t in r.tensors}
    finally:
        r.close()
    assert ("output.weight" in names) == (not hf.config.tie_word_embeddings)
    assert ("rope_freqs.weight" in names) == (converted.arch == "llama")
    n_layer = hf.config.num_hidden_layers
    assert {"model.norm.weight", *(f"model.layers.{i}.input_layernorm.weight" for i in range(n_layer))} \
        <= set(converted.perturbed)
    if converted.arch == "qwen2":
        assert {f"blk.{i}.attn_{x}.bias" for i in range(n_layer) for x in "qkv"} <= names


@pytest.mark.parametrize("flash", [False, True])
def test_one_batch_matches_transformers(converted, flash):
    ref = hf_logits(converted.hf, converted.tokens)
    with load_model(converted.path, devices="cpu") as model, \
            Runner(model, n_ctx=64, type_k="f32", type_v="f32", flash_attn=flash) as rt:
        got = rt.decode(converted.tokens, logits="all")
    err = errors(got, ref)
    assert err.max() <= TOL, err


@pytest.mark.parametrize("flash", [False, True])
def test_token_by_token_matches_transformers(converted, flash):
    ref = hf_logits(converted.hf, converted.tokens)
    with load_model(converted.path, devices="cpu") as model, \
            Runner(model, n_ctx=64, type_k="f32", type_v="f32", flash_attn=flash) as rt:
        got = np.concatenate([rt.decode([t]) for t in converted.tokens])
    err = errors(got, ref)
    assert err.max() <= TOL, err


def test_spm_tokenizer_model():
    """The SentencePiece model for converters that read tokenizer.model: Llama's special ids and
    byte fallback, the size asked for."""
    path = hf_convert.spm_tokenizer_model()
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
    assert sp.get_piece_size() == 1000
    assert (sp.unk_id(), sp.bos_id(), sp.eos_id(), sp.pad_id()) == (0, 1, 2, -1)
    assert sp.piece_to_id("<0x0A>") > 2 and sp.is_byte(sp.piece_to_id("<0x0A>"))
    assert sp.decode(sp.encode("def convert(model):\n    return 1")) == "def convert(model):\n    return 1"
