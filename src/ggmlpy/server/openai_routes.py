"""OpenAI's API: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``, ``/v1/models`` (each also
without the ``/v1`` prefix, as llama-server answers them).

Each route: the body parsed and checked (:mod:`.requests_map`, 400 naming the field), the model ready
(503 while loading), the request admitted (503 with the queue full), the runner's requests submitted on
a worker thread (a template or grammar error is a 400, a prompt over the context a 413), then the answer
waited for or streamed (:mod:`.bridge`), built by :mod:`.responses`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .bridge import CLIENT_GONE, SSE, Job, answer, run_batches
from .errors import bad_request
from .requests_map import (
    chat_request,
    check_images,
    completion_request,
    embedding_request,
    parse_json,
    runner_error,
)
from .responses import (
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    embedding_response,
    finish_reason,
    logprobs_chat,
    logprobs_completion,
    new_id,
    timings,
    usage,
)
from .state import ServerState

__all__ = ["ROUTES", "model_card"]


def model_card(state: ServerState) -> dict:
    """The one model, as OpenAI's ``Model`` object (llama-server adds ``meta``)."""
    meta = {"n_ctx": state.n_ctx, "n_parallel": state.n_parallel, "status": state.status}
    return {"id": state.model_name, "object": "model", "created": int(state.started), "owned_by": "ggmlpy",
            "meta": meta}


async def models(request: Request) -> JSONResponse:
    state: ServerState = request.app.state.server
    return JSONResponse({"object": "list", "data": [model_card(state)]})


async def _body(request: Request) -> dict:
    return parse_json(await request.body())


def _seeded(kw: dict, i: int, default_seed=None) -> dict:
    """Choice ``i``'s keywords: with a seed (the request's, else the server's ``-s``), choice i samples with
    seed + i (choice 0 is the request alone)."""
    seed = kw.get("seed", default_seed)
    if i and seed is not None:
        return {**kw, "seed": (seed + i) % (1 << 64)}
    return kw


def _answer(request: Request, route: str, n: int, make: Callable, stream: bool, build: Callable,
            chunks: Callable, images: Optional[list] = None):
    """Submit ``n`` requests, then answer: ``build(completions)`` as JSON, or ``chunks(job)`` as SSE (a submit
    error names the image at fault among ``images``, their places in the request)."""
    return answer(request, route, n, make, stream=stream, build=build, chunks=chunks, framing=SSE,
                  submit_error=lambda e: runner_error(e, images=images))


async def chat_completions(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = await _body(request)
    runner = state.require_ready()
    req = chat_request(state, body)
    check_images(runner, req["images"])
    kw, n, messages = req["kw"], req["n"], req["messages"]
    rid, model, tok = new_id("chatcmpl"), state.model_name, runner.tokenizer

    def make(i: int):
        return runner.submit_chat(messages, shift=False, template=state.template,
                                  **_seeded(kw, i, runner.sampling_defaults.get("seed")))

    def build(completions: list) -> dict:
        return chat_response(rid, model, completions, tok, req["logprobs"])

    async def chunks(job: Job):
        created = int(time.time())
        for i in range(n):
            yield chat_chunk(rid, model, created, i, {"role": "assistant", "content": ""})
        async for i, ev in job.events():
            lp = logprobs_chat([ev.logprobs], tok) if req["logprobs"] and ev.logprobs is not None else None
            for d in ev.deltas:
                delta: dict = {}
                if d.content:
                    delta["content"] = d.content
                if d.reasoning:
                    delta["reasoning_content"] = d.reasoning
                if d.tool_call is not None:
                    tc = d.tool_call
                    delta["tool_calls"] = [{"index": tc.index, "id": tc.id, "type": "function",
                                            "function": {"name": tc.name, "arguments": tc.arguments}}]
                if delta:
                    yield chat_chunk(rid, model, created, i, delta, logprobs=lp)
                    lp = None
            if lp is not None:
                yield chat_chunk(rid, model, created, i, {}, logprobs=lp)
        if not job.ran_to_end():             # the stream closes with the error event (or the client left)
            return
        for i, c in enumerate(job.results):
            last = chat_chunk(rid, model, created, i, {}, finish_reason(c))
            last["timings"] = timings(c)
            yield last
        if req["include_usage"]:
            yield {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                   "system_fingerprint": "ggmlpy", "choices": [], "usage": usage(job.results, [0] * n)}

    return await _answer(request, "/v1/chat/completions", n, make, req["stream"], build, chunks, req["images"])


async def completions(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = await _body(request)
    runner = state.require_ready()
    req = completion_request(state, body)
    kw, n, prompts = req["kw"], req["n"], req["prompts"]
    rid, model, tok = new_id("cmpl"), state.model_name, runner.tokenizer
    total = len(prompts) * n
    keys = [p if isinstance(p, str) else tuple(p) for p in prompts for _ in range(n)]

    def make(i: int):
        prompt = prompts[i // n]
        return runner.submit(prompt, shift=False, detokenize=True,
                             **_seeded(kw, i % n, runner.sampling_defaults.get("seed")))

    def echo(i: int) -> str:
        if not req["echo"]:
            return ""
        p = prompts[i // n]
        return p if isinstance(p, str) else tok.decode(p)

    def build(comps: list) -> dict:
        texts = [echo(i) + (c.text or "") for i, c in enumerate(comps)]
        return completion_response(rid, model, comps, texts, keys, tok, req["logprobs"])

    async def chunks(job: Job):
        created = int(time.time())
        if req["echo"]:
            for i in range(total):
                yield completion_chunk(rid, model, created, i, echo(i))
        async for i, ev in job.events():
            lp = logprobs_completion([ev.logprobs], tok) if req["logprobs"] and ev.logprobs is not None else None
            if ev.text or lp is not None:
                yield completion_chunk(rid, model, created, i, ev.text or "", logprobs=lp)
        if not job.ran_to_end():
            return
        for i, c in enumerate(job.results):
            last = completion_chunk(rid, model, created, i, "", finish_reason(c))
            last["timings"] = timings(c)
            yield last
        if req["include_usage"]:
            yield {"id": rid, "object": "text_completion", "created": created, "model": model,
                   "system_fingerprint": "ggmlpy", "choices": [], "usage": usage(job.results, keys)}

    return await _answer(request, "/v1/completions", total, make, req["stream"], build, chunks)


async def embeddings(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = await _body(request)
    runner = state.require_ready()
    req = embedding_request(state, body)
    n_embd = int(runner.model.config.n_embd)
    if req["dimensions"] is not None and req["dimensions"] != n_embd:
        raise bad_request(f"dimensions: this model's embeddings have {n_embd} dimensions, got {req['dimensions']}",
                          "dimensions")
    pooling = runner.embedding_pooling(None, "embeddings")
    if pooling in ("none", "rank"):
        # llama-server's answer: OpenAI's embeddings are one vector per input
        raise bad_request(f"this model pools by {pooling!r} (its pooling_type): not OpenAI-compatible, which wants "
                          "one vector per input" + (" (a reranker: use /v1/rerank)" if pooling == "rank" else ""))
    inputs, norm = req["inputs"], req["embd_normalize"]
    # as many at a time as the runner computes together (an encoder packs them into one batch), queued at once;
    # one pump thread each
    step = max(1, 2 * state.n_parallel, runner.n_seq_max)

    def together(start: int, stop: int) -> list:
        return runner.submit_embeddings(inputs[start:stop], normalize=norm, what="embeddings")

    with state.admit(1):
        results = await run_batches(request, len(inputs), None, step, lambda e: runner_error(e, param="input"),
                                    together=together)
    if results is None:
        state.count("/v1/embeddings", "cancelled")
        return Response(status_code=CLIENT_GONE)
    vectors, counts = [c.embedding for c in results], [c.prompt_eval_count for c in results]
    state.count("/v1/embeddings", "ok", sum(counts))
    return JSONResponse(embedding_response(state.model_name, vectors, counts, req["encoding_format"]))


def _routes() -> list:
    table = [("/chat/completions", chat_completions, "POST"), ("/completions", completions, "POST"),
             ("/embeddings", embeddings, "POST"), ("/models", models, "GET")]
    out = []
    for path, fn, method in table:
        out.append(Route("/v1" + path, fn, methods=[method]))
        out.append(Route(path, fn, methods=[method]))
    return out


ROUTES = _routes()
