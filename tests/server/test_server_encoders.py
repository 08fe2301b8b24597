"""``ggmlpy serve`` with encoders, as a real process: ``/v1/embeddings`` of a BERT embedding model through the
openai client equals Runner.embed of the same file; ``/v1/rerank`` (and its aliases) of an XLM-RoBERTa reranker
equals Runner.rerank, in llama-server's shape (sorted, cut to top_n, the documents when asked; TEI's shape for
``texts``); the refusals (a chat on an encoder, a rerank on an embedding model, OpenAI embeddings of a reranker
that pools by rank, bad bodies) name what is wrong."""

from __future__ import annotations

import base64
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch") if not os.environ.get("CI") else __import__("torch")

import httpx  # noqa: E402
from encoder_helpers import bert_gguf, xlmr_gguf  # noqa: E402
from server_helpers import ServerProcess  # noqa: E402

from ggmlpy import load_model  # noqa: E402
from ggmlpy.runner import Runner  # noqa: E402

pytestmark = pytest.mark.hf

TEXTS = ["Hello world", "The quick brown fox jumps over the lazy dog.", "naïve café"]
QUERY = "what is a tensor"
DOCS = ["a tensor is an array of numbers", "the cat sat on the mat", "tensors generalise matrices",
        "rain is expected tomorrow"]


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return bert_gguf(tmp_path_factory.mktemp("srv-bert"))[1]


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    return xlmr_gguf(tmp_path_factory.mktemp("srv-xlmr"))[1]


def reference(path, fn):
    # ggml's kernels, as ServerProcess runs the server with
    with load_model(str(path), devices="cpu") as model, \
            Runner(model, n_ctx=64, reuse_graphs=False, kernels="ggml") as rt:
        return fn(rt)


def test_embeddings_of_an_encoder(bert):
    """The openai client's embeddings (float and base64) of several inputs equal Runner.embed (mean pooling,
    the file's; L2-normalised); embd_normalize=-1 gives them raw; a chat is refused, naming the encoder; a
    rerank on an embedding model is 501."""
    ref = reference(bert, lambda rt: rt.embed(TEXTS))
    raw = reference(bert, lambda rt: rt.embed(TEXTS, normalize=False))
    srv = ServerProcess(bert, "-c", "64")
    try:
        client = srv.client()
        for fmt in ("float", "base64"):
            got = client.embeddings.create(model="model-f32", input=TEXTS, encoding_format=fmt)
            vecs = [np.frombuffer(base64.b64decode(d.embedding), "<f4") if isinstance(d.embedding, str)
                    else d.embedding for d in got.data]          # asked for base64, the client leaves it so
            np.testing.assert_allclose(np.array(vecs), ref, rtol=0, atol=1e-6)
        assert got.usage.prompt_tokens > len(TEXTS)
        r = httpx.post(srv.url + "/v1/embeddings", json={"input": TEXTS, "embd_normalize": -1}, timeout=60)
        np.testing.assert_allclose(np.array([d["embedding"] for d in r.json()["data"]]), raw, rtol=0, atol=1e-5)
        r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                       timeout=60)
        assert r.status_code == 400 and "encoder" in r.json()["error"]["message"]
        r = httpx.post(srv.url + "/v1/rerank", json={"query": "q", "documents": ["d"]}, timeout=60)
        assert r.status_code == 501 and "not a reranker" in r.json()["error"]["message"]
    finally:
        assert srv.stop() == 0


def test_rerank(reranker):
    """/v1/rerank: every document's relevance_score is Runner.rerank's, the results sorted highest first and cut
    to top_n, with the documents when asked; /rerank and TEI's texts shape answer the same scores; bad bodies
    are 400 naming the field; OpenAI embeddings of a reranker (pooling none) are refused."""
    scores = reference(reranker, lambda rt: rt.rerank(QUERY, DOCS))
    order = np.argsort(-scores)
    srv = ServerProcess(reranker, "-c", "64")
    try:
        r = httpx.post(srv.url + "/v1/rerank", json={"model": "model-f32", "query": QUERY, "documents": DOCS},
                       timeout=60)
        body = r.json()
        assert r.status_code == 200 and body["object"] == "list" and body["usage"]["prompt_tokens"] > 0
        assert [x["index"] for x in body["results"]] == order.tolist()
        np.testing.assert_allclose([x["relevance_score"] for x in body["results"]], scores[order], rtol=0, atol=1e-6)
        r = httpx.post(srv.url + "/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 2,
                                                  "return_documents": True}, timeout=60)
        top = r.json()["results"]
        assert [x["index"] for x in top] == order[:2].tolist()
        assert [x["document"]["text"] for x in top] == [DOCS[i] for i in order[:2]]
        r = httpx.post(srv.url + "/v1/reranking", json={"query": QUERY, "texts": DOCS, "return_text": True},
                       timeout=60)
        tei = r.json()
        assert isinstance(tei, list) and [x["index"] for x in tei] == order.tolist()
        np.testing.assert_allclose([x["score"] for x in tei], scores[order], rtol=0, atol=1e-6)
        assert tei[0]["text"] == DOCS[order[0]]
        for bad, field in (({"documents": DOCS}, "query"), ({"query": QUERY, "documents": []}, "documents"),
                           ({"query": QUERY, "documents": ["a", 3]}, "documents"),
                           ({"query": QUERY, "documents": DOCS, "top_n": 0}, "top_n")):
            r = httpx.post(srv.url + "/v1/rerank", json=bad, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == field, (bad, r.text)
        r = httpx.post(srv.url + "/v1/embeddings", json={"input": "hi"}, timeout=60)
        assert r.status_code == 400 and "not OpenAI-compatible" in r.json()["error"]["message"]
    finally:
        assert srv.stop() == 0
