"""Reranking: ``/v1/rerank`` (also ``/rerank``, ``/v1/reranking``, ``/reranking``), llama-server's route.

The body is Jina's (as llama-server reads it): ``query`` (a string), ``documents`` (a non-empty array of
strings), ``top_n`` (default: all), ``return_documents`` (Jina's: each result also carries ``document:
{"text": ...}``). The answer: ``results``, each ``{"index", "relevance_score"}``, sorted by score, highest
first, cut to ``top_n``; ``model``, ``object: "list"`` and ``usage`` (the tokens of every pair). TEI's shape
(``texts`` instead of ``documents``) answers TEI's way: a bare array of ``{"index", "score"}`` (with
``"text"`` when ``return_text``).

Each document is one pair with the query (:meth:`~ggmlpy.runner.Runner.rerank_prompt`, as llama-server's
``format_prompt_rerank``), scored by the model's classification head (pooling ``rank``: the raw first
output, as llama-server returns it); the pairs go to the runner together and are computed in as few batches
as fit. A model without a classification head is answered 501, as llama-server started without
``--reranking`` answers.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .bridge import CLIENT_GONE, run_batches
from .errors import ApiError, bad_request
from .requests_map import _BOOL, _INT, _field, check_model, parse_json, runner_error
from .state import ServerState

__all__ = ["ROUTES", "rerank_request"]

#: the most documents in one request (OpenAI's bound on embedding inputs, for the same reason)
MAX_DOCUMENTS = 2048


def rerank_request(state: ServerState, body: dict) -> dict:
    """The checked body: ``{"query", "documents", "top_n", "return_documents", "tei"}`` (400 naming the field)."""
    check_model(state, body)
    query = body.get("query")
    if not isinstance(query, str):
        raise bad_request("query must be provided, a string" if query is None else
                          f"query must be a string, got {type(query).__name__}", "query")
    tei = "documents" not in body and "texts" in body
    param = "texts" if tei else "documents"
    docs = body.get(param)
    if not isinstance(docs, list) or not docs:
        raise bad_request(f"{param} must be a non-empty array of strings", param)
    if len(docs) > MAX_DOCUMENTS:
        raise bad_request(f"{param}: at most {MAX_DOCUMENTS} documents, got {len(docs)}", param)
    for k, d in enumerate(docs):
        if not isinstance(d, str):
            raise bad_request(f"{param}[{k}] must be a string, got {type(d).__name__}", param)
    top_n = _field(body, "top_n", _INT, len(docs), 1)
    back = _field(body, "return_text" if tei else "return_documents", _BOOL, False)
    return {"query": query, "documents": docs, "top_n": min(top_n, len(docs)), "return_documents": back, "tei": tei}


async def rerank(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = parse_json(await request.body())
    runner = state.require_ready()
    req = rerank_request(state, body)
    if not getattr(runner.model, "n_cls_out", 0):
        raise ApiError(501, f"this {runner.model.config.arch} model is not a reranker (it has no classification "
                            "head, cls.output): /v1/rerank needs one")
    docs = req["documents"]

    def together(start: int, stop: int) -> list:
        prompts = [runner.rerank_prompt(req["query"], d) for d in docs[start:stop]]
        return runner.submit_embeddings(prompts, pooling="rank", normalize=False, what="rerank")

    with state.admit(1):
        try:
            # as many pairs at a time as the runner computes together, queued at once
            results = await run_batches(request, len(docs), None, max(1, runner.n_seq_max),
                                        lambda e: runner_error(e, param="documents"), together=together)
        except ApiError:
            state.count("/v1/rerank", "error")
            raise
    if results is None:                          # the client left: nobody reads an answer
        state.count("/v1/rerank", "cancelled")
        return Response(status_code=CLIENT_GONE)
    n_tokens = sum(c.prompt_eval_count for c in results)
    state.count("/v1/rerank", "ok", n_tokens)
    label = "score" if req["tei"] else "relevance_score"
    ranked = sorted(({"index": i, label: float(c.embedding[0])} for i, c in enumerate(results)),
                    key=lambda r: r[label], reverse=True)[:req["top_n"]]
    if req["return_documents"]:
        for r in ranked:
            if req["tei"]:
                r["text"] = docs[r["index"]]
            else:
                r["document"] = {"text": docs[r["index"]]}
    if req["tei"]:
        return JSONResponse(ranked)
    return JSONResponse({"model": body.get("model") or state.model_name, "object": "list",
                         "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}, "results": ranked})


ROUTES = [Route(p, rerank, methods=["POST"]) for p in ("/v1/rerank", "/rerank", "/v1/reranking", "/reranking")]
