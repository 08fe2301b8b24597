"""models/bert.py (bert, nomic-bert, nomic-bert-moe, rerankers) against transformers and llama.cpp, through files
written by llama.cpp's converter.

Tiny random-weight models (two layers, n_embd 64, 4 heads): a ``BertModel`` with the ``bert-bge`` WordPiece
vocabulary and sentence-transformers' mean pooling (the converter writes ``pooling_type``); a transformers
``NomicBertModel`` saved in nomic's own layout (rotary, SwiGLU); the same with nomic-bert-moe's experts
(every second layer from the second, 4 experts, 2 per token); an ``XLMRobertaForSequenceClassification`` (a
Unigram vocabulary, the classifier's dense + tanh + out_proj: ``cls`` and ``cls.output``) and a
``BertForSequenceClassification`` (``cls.output`` only: the converter drops BERT's pooler). Every constant
weight is made random first.

Errors: per input, max |got - ref| / max |ref|. With F32 weights the hidden states and pooled embeddings
agree with transformers to ~1e-7 (measured, normalised pooled embeddings: bert 7e-8 .. 2e-7, nomic-bert 8e-8 ..
1.9e-7; hidden states 2.8e-7), bounded at 1e-5; llama.cpp on the same files is measured at 3.5e-6 .. 1e-5 for
bert (its GELU is ggml's tanh approximation, BERT's is erf) and 8e-8 .. 2.1e-7 for nomic-bert (SwiGLU), so the
tests assert ggmlpy within llama.cpp's own error (plus 1e-6 for rounding). The converter's F16 and Q8_0 files:
ggmlpy and llama.cpp both at 1.4e-4 .. 2e-4 and 1.3e-3 .. 3.2e-3 (the weights' rounding dominates). nomic-bert-moe
against llama.cpp (transformers has no such model): 4e-4 .. 7e-4 (llama.cpp's tanh GELU in the experts); with one
expert per token instead of two, 0.2 .. 0.37. Reranking scores equal transformers' classifier logits to 1e-5 of
their largest (measured ~1e-7).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch") if not os.environ.get("CI") else __import__("torch")
transformers = pytest.importorskip("transformers") if not os.environ.get("CI") else __import__("transformers")

import hf_convert  # noqa: E402
from arch_helpers import copy_gguf  # noqa: E402
from encoder_helpers import (  # noqa: E402
    COMMON,
    LLAMA_CPP,
    bert_gguf,
    llama_cpp_outputs,
    llama_cpp_rerank_prompt,
    llama_cpp_tokenize,
    make_hf,
    nomic_dir,
    xlmr_gguf,
)

from ggmlpy import GGMLValueError, gguf  # noqa: E402
from ggmlpy.kvcache import Encoder  # noqa: E402
from ggmlpy.models import load_model  # noqa: E402
from ggmlpy.models.bert import BertModel  # noqa: E402
from ggmlpy.runner import InputTooLong, Runner  # noqa: E402

pytestmark = pytest.mark.hf

TEXTS = ["Hello world", "The quick brown fox jumps over the lazy dog.", "a", "naïve café résumé, 42 times!",
         "Embeddings map text to vectors; rerankers score pairs."]
QUERY = "what is a tensor"
DOCS = ["a tensor is an array of numbers", "the cat sat on the mat", "tensors generalise matrices",
        "rain is expected tomorrow"]
TOL = 1e-5


def rel(got, ref) -> float:
    return float(np.abs(np.asarray(got) - np.asarray(ref)).max() / np.abs(np.asarray(ref)).max())


def unit(v):
    return v / np.linalg.norm(v)


def theirs_error(lcpp, i: int, ref) -> float:
    """llama.cpp's error on input ``i`` (its output normalised), or no bound where llama-cpp-python is missing
    (the comparison with transformers still holds)."""
    return np.inf if lcpp is None else rel(unit(lcpp[i]), ref)


def hf_hidden(hf, toks) -> np.ndarray:
    """transformers' last hidden states of one input, every token of type 0 (as llama.cpp feeds them)."""
    with torch.no_grad():
        ids = torch.tensor([toks])
        return hf(ids, token_type_ids=torch.zeros_like(ids)).last_hidden_state[0].numpy()


def hf_pool(h: np.ndarray, pooling: str) -> np.ndarray:
    return {"mean": h.mean(0), "cls": h[0], "last": h[-1]}[pooling]


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    """A BertModel with mean pooling, converted (F32), and the test texts' token ids."""
    hf, path = bert_gguf(tmp_path_factory.mktemp("bert"))
    with load_model(path, devices="cpu") as m:
        ids = [m.tokenizer.encode(t) for t in TEXTS]
    return hf, path, ids


@pytest.fixture
def runner(bert):
    # per test: a runner's pooled graphs would outlive the test (the live-handle check counts them)
    with load_model(bert[1], devices="cpu") as model, Runner(model, n_ctx=64) as rt:
        yield rt


def test_the_file_is_the_converters(bert, runner):
    """llama.cpp's keys and tensors: non-causal, mean pooling from modules.json, token types and learned positions;
    the model is an encoder (no head, cannot generate) with a cache that keeps nothing."""
    _, path, _ = bert
    with gguf.GGUFReader(str(path)) as r:
        md = r.metadata
        names = {t.name for t in r.tensors}
    assert md["general.architecture"] == "bert" and md["bert.attention.causal"] is False
    assert md["bert.pooling_type"] == 1 and md["tokenizer.ggml.model"] == "bert"
    assert {"token_types.weight", "position_embd.weight", "token_embd_norm.bias", "blk.1.ffn_up.bias"} <= names
    m = runner.model
    assert isinstance(m, BertModel) and not m.causal and not m.can_generate and m.pooling == "mean"
    assert m.n_cls_out == 0 and isinstance(runner.cache, Encoder)
    assert "blk.0.attn_qkv.weight" in m.weights and "blk.0.attn_qkv.bias" in m.weights    # Q/K/V fused


def test_tokenizer_is_llama_cpps(bert, runner):
    """The BERT vocabulary tokenizes as llama.cpp's on the same file ([CLS] ... [SEP], once, although the file
    says add_eos), on the test texts and llama.cpp's own bert-bge test strings."""
    _, path, _ = bert
    texts = TEXTS + [t for t, _ in hf_convert.vocab_tests("bert-bge")][:40]
    from ggmlpy.runner.text import encode_prompt

    for t in texts:
        assert encode_prompt(runner.tokenizer, t) == llama_cpp_tokenize(path, t), t


@pytest.mark.parametrize("flash", [True, False])
def test_hidden_states_match_transformers(bert, flash):
    """Every token's last hidden state (pooling none), one input at a time and several in one batch, both
    attention paths."""
    hf, path, ids = bert
    with load_model(path, devices="cpu") as model, Runner(model, n_ctx=64, flash_attn=flash) as rt:
        each = [rt.decode(t, logits="all", embeddings=True) for t in ids]
        together = rt.embed(ids, pooling="none", normalize=False)
    for toks, a, b in zip(ids, each, together):
        ref = hf_hidden(hf, toks)
        assert rel(a, ref) < TOL and rel(b, ref) < TOL


@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_pooled_embeddings_within_llama_cpps_error(bert, runner, pooling):
    """Pooled, L2-normalised embeddings against transformers' hidden states pooled the same way: within 1e-5,
    and no further from transformers than llama.cpp's own embeddings of the same file."""
    hf, path, ids = bert
    got = runner.embed(ids, pooling=pooling)
    lcpp = llama_cpp_outputs(path, ids, pooling, 64) if LLAMA_CPP else None
    for i, toks in enumerate(ids):
        ref = unit(hf_pool(hf_hidden(hf, toks), pooling))
        ours, theirs = rel(got[i], ref), theirs_error(lcpp, i, ref)
        assert ours < TOL and ours <= theirs + 1e-6, (i, ours, theirs)


def test_default_pooling_is_the_files_and_normalize_as_llama_cpp(bert, runner):
    """No pooling given: the file's (mean). normalize: llama.cpp's embd_normalize (False/-1 raw, 0 the int16
    range, 1 taxicab, 2/True Euclidean, 3 the 3-norm)."""
    hf, _, ids = bert
    raw = hf_pool(hf_hidden(hf, ids[1]), "mean")
    assert rel(runner.embed(ids[1], normalize=False), raw) < TOL
    for norm, scale in ((-1, 1.0), (0, 32760.0 / np.abs(raw).max()), (1, 1 / np.abs(raw).sum()),
                        (2, 1 / np.linalg.norm(raw)), (3, 1 / (np.abs(raw) ** 3).sum() ** (1 / 3))):
        assert rel(runner.embed(ids[1], normalize=norm), raw * scale) < TOL, norm


def test_inputs_are_packed_into_one_micro_batch(bert, runner):
    """embed() of several inputs computes them as separate sequences of one micro-batch (each sees only its own
    tokens: the same embeddings as one at a time)."""
    _, _, ids = bert
    alone = np.stack([runner.embed(t) for t in ids])
    before = runner.n_batches
    together = runner.embed(ids)
    assert runner.n_batches == before + 1 and runner.batch_sizes[-1] == [sum(map(len, ids))]
    np.testing.assert_allclose(together, alone, rtol=0, atol=1e-6)


def test_limits_and_refusals(bert, runner):
    """An input past the model's 64 positions (n_ctx_train, the rows of position_embd) is refused, or cut with
    truncate; the cache refuses such a position before ggml could read past the table; an encoder refuses to
    generate, to give logits and to rank."""
    _, path, ids = bert
    long = [101] + [1996] * 70 + [102]
    with pytest.raises(InputTooLong, match="at most 64"):
        runner.embed(long)
    np.testing.assert_allclose(runner.embed(long, truncate=True), runner.embed(long[:64]), rtol=0, atol=1e-6)
    with load_model(path, devices="cpu") as model, Runner(model, n_ctx=128) as rt:
        with pytest.raises(GGMLValueError, match="past the model's 64 positions"):
            rt.decode(long, logits="all", embeddings=True)
        assert rt.embed(ids[0]).shape == (64,)                         # still serves
    for call in (lambda: runner.generate("hi", max_tokens=2), lambda: runner.decode(ids[0]),
                 lambda: runner.chat([{"role": "user", "content": "hi"}]),
                 lambda: runner.decode_batch(ids[0], list(range(len(ids[0]))), [0] * len(ids[0]), [0])):
        with pytest.raises(GGMLValueError, match="encoder"):
            call()
    with pytest.raises(GGMLValueError, match="not a reranker"):
        runner.rerank("q", ["d"])
    with pytest.raises(GGMLValueError, match="pooling must be one of"):
        runner.embed(ids[0], pooling="max")


@pytest.mark.parametrize("outtype, bound", [("f16", 1e-3), ("q8_0", 1e-2)])
def test_quantized_files(bert, tmp_path_factory, outtype, bound):
    """The converter's F16 and Q8_0 files: pooled embeddings within a bound of transformers' (measured: F16 2e-4,
    Q8_0 3.2e-3, as llama.cpp's) and within 3x llama.cpp's error on the same file."""
    hf, _, ids = bert
    _, path = bert_gguf(tmp_path_factory.mktemp(f"bert-{outtype}"), outtype=outtype, hf=hf)
    with load_model(path, devices="cpu") as model, Runner(model, n_ctx=64) as rt:
        got = rt.embed(ids)
    lcpp = llama_cpp_outputs(path, ids, "mean", 64) if LLAMA_CPP else None
    for i, toks in enumerate(ids):
        ref = unit(hf_hidden(hf, toks).mean(0))
        ours, theirs = rel(got[i], ref), theirs_error(lcpp, i, ref)
        assert ours < bound and ours <= 3 * theirs + TOL, (i, ours, theirs)


# ---------------------------------------------------------------------------------------------- nomic-bert

@pytest.fixture(scope="module")
def nomic(tmp_path_factory):
    tok = hf_convert.tokenizer("bert-bge")
    hf = make_hf("NomicBertModel", "NomicBertConfig", vocab_size=len(tok), hidden_act="silu",
                 max_position_embeddings=2048, rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
                 **COMMON)
    out = tmp_path_factory.mktemp("nomic")
    path = hf_convert.convert_dir(nomic_dir(hf, out / "hf"), out / "nomic.gguf")
    with load_model(path, devices="cpu") as m:
        ids = [m.tokenizer.encode(t) for t in TEXTS]
    return hf, path, ids


def test_nomic_bert_matches_transformers(nomic):
    """nomic-bert (rotary Q/K, SwiGLU, a fused Wqkv): every token's hidden state against transformers'
    NomicBertModel, and the mean-pooled embedding within llama.cpp's own error."""
    hf, path, ids = nomic
    with gguf.GGUFReader(str(path)) as r:
        assert r.metadata["general.architecture"] == "nomic-bert" and "blk.0.attn_qkv.weight" in r
    with load_model(path, devices="cpu") as model, Runner(model, n_ctx=64) as rt:
        hidden = rt.embed(ids, pooling="none", normalize=False)
        pooled = rt.embed(ids, pooling="mean")
    lcpp = llama_cpp_outputs(path, ids, "mean", 64) if LLAMA_CPP else None
    for i, toks in enumerate(ids):
        with torch.no_grad():
            ref = hf(torch.tensor([toks])).last_hidden_state[0].numpy()
        assert rel(hidden[i], ref) < TOL
        ours, theirs = rel(pooled[i], unit(ref.mean(0))), theirs_error(lcpp, i, unit(ref.mean(0)))
        assert ours < TOL and ours <= theirs + 1e-6, (i, ours, theirs)


def test_nomic_bert_moe_matches_llama_cpp(tmp_path_factory):
    """nomic-bert-moe (every second layer from the second a mixture of 4 GELU experts, 2 per token, by softmax
    probability, not renormalised): every token's hidden state against llama.cpp's on the same file (the
    reference here: transformers has no such model), within llama.cpp's F16 K/V and tanh-GELU error; the same
    file with one expert per token differs far more (the routing is real)."""
    if not LLAMA_CPP:
        pytest.skip("llama-cpp-python is not installed (optional peer): the only reference for nomic-bert-moe")
    tok = hf_convert.tokenizer("bert-bge")
    hf = make_hf("NomicBertModel", "NomicBertConfig", vocab_size=len(tok), hidden_act="gelu",
                 max_position_embeddings=2048, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                 **{**COMMON, "num_hidden_layers": 4})
    out = tmp_path_factory.mktemp("nomic-moe")
    path = hf_convert.convert_dir(nomic_dir(hf, out / "hf", moe={"every": 2, "experts": 4, "top_k": 2}),
                                  out / "moe.gguf")
    one = copy_gguf(path, out / "moe-top1.gguf", meta={"nomic-bert-moe.expert_used_count": 1})
    with gguf.GGUFReader(str(path)) as r:
        assert r.metadata["general.architecture"] == "nomic-bert-moe" and "blk.1.ffn_up_exps.weight" in r
        assert "blk.0.ffn_up_exps.weight" not in r and "blk.3.ffn_gate_inp.weight" in r
    with load_model(path, devices="cpu") as model, Runner(model, n_ctx=64) as rt:
        ids = [model.tokenizer.encode(t) for t in TEXTS]
        got = rt.embed(ids, pooling="none", normalize=False)
    with load_model(one, devices="cpu") as model, Runner(model, n_ctx=64) as rt:
        top1 = rt.embed(ids, pooling="none", normalize=False)
    ref = llama_cpp_outputs(path, ids, "none", 64)
    for i in range(len(ids)):
        assert rel(got[i], ref[i]) < 5e-3 and rel(top1[i], ref[i]) > 10 * rel(got[i], ref[i]), i


# ---------------------------------------------------------------------------------------------- rerankers

@pytest.fixture(scope="module")
def xlmr(tmp_path_factory):
    return xlmr_gguf(tmp_path_factory.mktemp("xlmr"))


def test_rerank_scores_are_the_classifier_logits(xlmr):
    """rerank(): each pair formed as llama-server forms it (<s> query </s></s> document </s> for this
    vocabulary, from its flags), scored as transformers' classifier (logits within 1e-5 of their spread) and
    as llama.cpp's rank pooling on the same file; the pairs computed in one micro-batch."""
    hf, path = xlmr
    with gguf.GGUFReader(str(path)) as r:
        assert {"cls.weight", "cls.output.weight"} <= {t.name for t in r.tensors}
        assert r.metadata["tokenizer.ggml.model"] == "t5"
    with load_model(path, devices="cpu") as model, Runner(model, n_ctx=64) as rt:
        assert model.n_cls_out == 1 and model.pooling == "none"
        prompts = [rt.rerank_prompt(QUERY, d) for d in DOCS]
        scores = rt.rerank(QUERY, DOCS)
        assert rt.batch_sizes[-1] == [sum(map(len, prompts))]
        assert rt.embed(prompts[0], pooling="rank").shape == (1,)
    for d, p in zip(DOCS, prompts):
        assert not LLAMA_CPP or p == llama_cpp_rerank_prompt(path, QUERY, d)
    assert prompts[0][0] == 0 and prompts[0].count(2) == 3          # <s> ... </s></s> ... </s>
    with torch.no_grad():
        ref = np.array([hf(torch.tensor([p])).logits[0, 0].item() for p in prompts])
    spread = np.ptp(ref)
    assert spread > 1e-3 and np.abs(scores - ref).max() < TOL * max(spread, np.abs(ref).max())
    if LLAMA_CPP:
        lcpp = np.array([s[0] for s in llama_cpp_outputs(path, prompts, "rank", 1)])
        assert np.abs(lcpp - ref).max() < 1e-2 * max(spread, np.abs(ref).max())


def test_bert_classifier_is_scored_as_the_file_holds_it(tmp_path_factory):
    """A BertForSequenceClassification reranker: llama.cpp's converter keeps its classifier (cls.output) but
    drops BERT's pooler (dense + tanh), so the file scores classifier(first token's hidden state): ggmlpy gives
    that (transformers' classifier on its hidden state, and llama.cpp's rank score), not transformers' logits
    through the pooler."""
    tok = hf_convert.tokenizer("bert-bge")
    hf = make_hf("BertForSequenceClassification", "BertConfig", vocab_size=len(tok), num_labels=1,
                 max_position_embeddings=64, initializer_range=0.2, **COMMON)
    path = hf_convert.convert(hf, tmp_path_factory.mktemp("bert-cls"), "bert-bge")
    with gguf.GGUFReader(str(path)) as r:
        names = {t.name for t in r.tensors}
    assert "cls.output.weight" in names and "cls.weight" not in names
    with load_model(path, devices="cpu") as model, Runner(model, n_ctx=64) as rt:
        prompts = [rt.rerank_prompt(QUERY, d) for d in DOCS]
        scores = rt.rerank(QUERY, DOCS)
    assert prompts[0][0] == 101 and prompts[0].count(102) == 2      # [CLS] query [SEP] document [SEP]
    with torch.no_grad():
        first = [hf.bert(torch.tensor([p])).last_hidden_state[0, 0] for p in prompts]
        file_ref = np.array([hf.classifier(h).item() for h in first])
        logits = np.array([hf(torch.tensor([p])).logits[0, 0].item() for p in prompts])
    scale = np.abs(file_ref).max()
    assert np.abs(scores - file_ref).max() < TOL * scale
    assert np.abs(logits - file_ref).max() > 100 * TOL * scale       # the pooler mattered
    if LLAMA_CPP:
        lcpp = np.array([s[0] for s in llama_cpp_outputs(path, prompts, "rank", 1)])
        assert np.abs(lcpp - file_ref).max() < 1e-2 * scale


def test_embed_command(bert, xlmr):
    """``ggmlpy embed``: each -p's embedding (the file's pooling, normalised) as Runner.embed gives it, as a JSON
    array; with --query a reranker's scores as Runner.rerank gives them."""
    import json
    import subprocess
    import sys

    _, path, _ = bert
    cmd = [sys.executable, "-m", "ggmlpy", "embed", "-m", str(path), "--embd-output-format", "array"]
    out = subprocess.run([*cmd, "-p", TEXTS[0], "-p", TEXTS[1]], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    with load_model(path, devices="cpu") as model, Runner(model, n_ctx=64) as rt:
        ref = rt.embed(TEXTS[:2])
    np.testing.assert_allclose(np.array(json.loads(out.stdout)), ref, rtol=0, atol=1e-6)
    _, rr = xlmr
    cmd = [sys.executable, "-m", "ggmlpy", "embed", "-m", str(rr), "--query", QUERY, "--embd-output-format", "array"]
    out = subprocess.run([*cmd, *(x for d in DOCS for x in ("-p", d))], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    with load_model(rr, devices="cpu") as model, Runner(model, n_ctx=64) as rt:
        ref = rt.rerank(QUERY, DOCS)
    np.testing.assert_allclose(np.array(json.loads(out.stdout))[:, 0], ref, rtol=0, atol=1e-6)
