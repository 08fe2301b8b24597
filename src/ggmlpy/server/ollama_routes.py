"""Ollama's API over the server's runner: ``/api/generate``, ``/api/chat``, ``/api/embed`` (and the older
``/api/embeddings``), ``/api/tags``, ``/api/show``, ``/api/ps``, ``/api/version``.

The mapping of each body to the runner's keywords, and of a :class:`~ggmlpy.runner.Completion` to Ollama's
objects, is :mod:`.ollama`'s; this module is the HTTP side: the body read, then the path OpenAI's routes take too
(:func:`.bridge.answer`: the request admitted and submitted off the event loop, waited for or streamed with
back-pressure, cancelled when the client leaves or the server stops), streamed as NDJSON (one object a line,
``application/x-ndjson``), errors as ``{"error": "..."}`` (a stream the server ends early closes with such a
line, as Ollama's does). Options that were ignored are named in a ``Warning`` header (and logged).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Optional

import numpy as np
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from . import ollama as om
from .bridge import CLIENT_GONE, NDJSON, Job, answer, count, run_batches
from .errors import ApiError
from .requests_map import check_images, json_body, state_of
from .state import ServerState

__all__ = ["ROUTES"]

log = logging.getLogger("ggmlpy.server")


def _api_error(e: BaseException, images: Optional[list] = None) -> ApiError:
    """A runner's or a mapping's exception as the HTTP error Ollama's clients get (an image's error names
    the image among ``images``, their places in the request)."""
    from ggmlpy.runner import ClosedError

    k = getattr(e, "image_index", None)
    if images and isinstance(k, int) and 0 <= k < len(images):
        return ApiError(400, f"{images[k]}: {e}", ollama=True)
    if isinstance(e, om.OllamaError):
        return ApiError(e.status, str(e), ollama=True)
    if isinstance(e, ClosedError):
        return ApiError(503, f"the server is shutting down: {e}", ollama=True)
    if isinstance(e, (ValueError, TypeError)):      # GGMLValueError, InputTooLong, TokenizerError, ImageError...
        return ApiError(400, str(e), ollama=True)
    return ApiError(500, f"{type(e).__name__}: {e}", ollama=True)


def _warning_headers(ignored: list) -> dict:
    """RFC 7234's ``Warning`` (code 299, persistent) naming what the request asked that was ignored."""
    if not ignored:
        return {}
    for why in ignored:
        log.warning("ollama request: %s", why)
    text = "; ".join(ignored).replace('"', "'").encode("ascii", "replace").decode()
    return {"Warning": f'299 ggmlpy "{text[:1000]}"'}


def _submit(runner, call: om.ChatCall, template: Optional[str]):
    if call.kind == "raw":
        return runner.submit(call.arg, **call.kwargs)
    return runner.submit_chat(call.arg, template=template, **call.kwargs)


def _result_message(c, chat: bool, raw: bool) -> dict:
    """The non-streamed reply's fields: ``message`` (a chat) or ``response`` (a generation)."""
    text = c.text if raw else (c.content or "")
    extra: dict[str, Any] = {}
    if not raw:
        if c.reasoning:
            extra["thinking"] = c.reasoning
        if c.tool_calls:
            extra["tool_calls"] = om.tool_calls_to_ollama(c.tool_calls)
    if chat:
        return {"message": {"role": "assistant", "content": text, **extra}}
    return {"response": text or "", **extra}


def _event_fields(ev, chat: bool, raw: bool, n_calls: int) -> tuple[dict | None, int]:
    """One streamed token's object fields, None when it added nothing (a held-back or control token)."""
    if raw:
        return ({"response": ev.text} if ev.text else None), n_calls
    part, n_calls = om.chunk_from_deltas(ev.deltas, n_calls)
    if not part:
        return None, n_calls
    if chat:
        return {"message": {"role": "assistant", "content": part.pop("content", ""), **part}}, n_calls
    return {"response": part.pop("content", ""), **part}, n_calls


async def _run(request: Request, call: om.ChatCall, chat: bool, stream: bool) -> Response:
    """Submit ``call`` and answer with its reply: one JSON object, or NDJSON as the tokens come (the core's
    path, :func:`.bridge.answer`: the disconnect watch, back-pressure, ``--timeout``, the shutdown)."""
    state = state_of(request)
    runner = state.require_ready(ollama=True)
    started = time.monotonic()
    name = state.model_name
    raw = call.kind == "raw"
    check_images(runner, call.images, truncate=bool(call.kwargs.get("truncate")), ollama=True)

    def build(completions: list) -> dict:
        c = completions[0]
        return {"model": name, "created_at": om.timestamp(), **_result_message(c, chat, raw),
                **om.final_fields(c, started)}

    async def chunks(job: Job):
        n_calls = 0
        async for _, ev in job.events():
            fields, n_calls = _event_fields(ev, chat, raw, n_calls)
            if fields is not None:
                yield {"model": name, "created_at": om.timestamp(), **fields, "done": False}
        if not job.ran_to_end():             # the stream ends with Ollama's error line (or the client left)
            return
        last = {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
        yield {"model": name, "created_at": om.timestamp(), **last, **om.final_fields(job.results[0], started)}

    # --chat-template-file's template, as the OpenAI routes use it
    return await answer(request, request.url.path, 1, lambda i: _submit(runner, call, state.template),
                        stream=stream, build=build, chunks=chunks, framing=NDJSON,
                        submit_error=lambda e: _api_error(e, call.images), run_error=_api_error,
                        headers=_warning_headers(call.ignored), ollama=True)


def _loaded(state: ServerState, chat: bool) -> JSONResponse:
    """An empty request: Ollama's answer that the model is loaded (``done_reason`` ``load``)."""
    state.require_ready(ollama=True)
    last = {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
    return JSONResponse({"model": state.model_name, "created_at": om.timestamp(), **last, "done": True,
                         "done_reason": "load"})


def _mapped(fn, body: dict, state: ServerState, n_ctx: int) -> om.ChatCall:
    """The request's call, with the server's ``-n`` and ``--stop`` where its ``options`` set no ``num_predict``
    (or -1, -2: as llama-server reads -1) and no ``stop``."""
    try:
        call = fn(body, n_ctx)
    except om.OllamaError as e:
        raise _api_error(e) from None
    if call.kwargs.get("max_tokens") == -2 and state.n_predict > 0:
        call.kwargs["max_tokens"] = state.n_predict
    if not call.kwargs.get("stop") and state.stop:
        call.kwargs["stop"] = list(state.stop)
    return call


async def chat(request: Request) -> Response:
    """``POST /api/chat``: the assistant's next message (NDJSON by default, one object with ``"stream": false``)."""
    state, body = state_of(request), await json_body(request, ollama=True)
    runner = state.require_ready(ollama=True)
    call = _mapped(om.chat_call, body, state, runner.n_ctx)
    if not call.arg:
        return _loaded(state, True)
    return await _run(request, call, True, body.get("stream") is not False)


async def generate(request: Request) -> Response:
    """``POST /api/generate``: a completion of ``prompt`` (the chat template applied unless ``raw``)."""
    state, body = state_of(request), await json_body(request, ollama=True)
    runner = state.require_ready(ollama=True)
    call = _mapped(om.generate_call, body, state, runner.n_ctx)
    if not body.get("prompt") and not body.get("images"):
        return _loaded(state, False)
    return await _run(request, call, False, body.get("stream") is not False)


async def _embeddings(request: Request, inputs: list, truncate: bool, normalize: bool):
    """The completions of ``inputs`` (embeddings) and when they began; None when the client left."""
    state = state_of(request)
    runner = state.require_ready(ollama=True)
    started = time.monotonic()
    with state.admit(cost=len(inputs), ollama=True):
        try:
            # queued together, as many as the runner computes at once (an encoder: one batch)
            results = await run_batches(request, len(inputs), None, max(1, 2 * state.n_parallel, runner.n_seq_max),
                                        _api_error, _api_error, together=lambda a, b: runner.submit_embeddings(
                                            inputs[a:b], truncate=truncate, normalize=normalize, what="submit"))
        except ApiError:
            state.count(request.url.path, "error")
            raise
    if results is None:                          # the client left: nobody reads an answer
        state.count(request.url.path, "cancelled")
        return None, started
    count(state, request.url.path, results)
    return results, started


async def embed(request: Request) -> Response:
    """``POST /api/embed``: L2-normalised mean-pooled embeddings of ``input`` (a string or a list);
    ``dimensions`` keeps the first that many values, normalised again (as Ollama does)."""
    body = await json_body(request, ollama=True)
    try:
        inputs, truncate, dims = om.embed_inputs(body)
        _, ignored = om.map_options(body.get("options"), state_of(request).n_ctx)
    except om.OllamaError as e:
        raise _api_error(e) from None
    results, started = await _embeddings(request, inputs, truncate, True)
    if results is None:
        return Response(status_code=CLIENT_GONE)
    vectors = []
    for c in results:
        v = np.asarray(c.embedding, dtype=np.float32)
        if dims is not None and dims < v.size:
            v = v[:dims]
            n = float(np.linalg.norm(v))
            v = v / n if n > 0 else v
        vectors.append(v.tolist())
    return JSONResponse({"model": state_of(request).model_name, "embeddings": vectors,
                         "total_duration": om._ns(time.monotonic() - started), "load_duration": 0,
                         "prompt_eval_count": sum(int(c.prompt_eval_count) for c in results)},
                        headers=_warning_headers(ignored))


async def embeddings(request: Request) -> Response:
    """``POST /api/embeddings`` (superseded by ``/api/embed``): one ``prompt``, the embedding not normalised."""
    body = await json_body(request, ollama=True)
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise ApiError(400, "prompt must be a non-empty string", ollama=True)
    results, _ = await _embeddings(request, [prompt], True, False)
    if results is None:
        return Response(status_code=CLIENT_GONE)
    return JSONResponse({"embedding": np.asarray(results[0].embedding, dtype=np.float32).tolist()})


# --------------------------------------------------------------------------- the model

def _digest(runner) -> str:
    """The weights' fingerprint (:mod:`ggmlpy.models.fingerprint`), standing in for Ollama's blob digest
    (hashing a file of many GB on a listing request would take minutes)."""
    from ggmlpy.models.fingerprint import model_fingerprint

    fp = model_fingerprint(runner.model)
    return str(fp) if fp else ""


def _card(state: ServerState, runner) -> dict:
    size, mtime = om.file_facts(state.path) if state.path else (int(runner.model.size), state.started)
    return {"name": state.model_name, "model": state.model_name, "modified_at": om.timestamp(mtime), "size": size,
            "digest": _digest(runner), "details": om.model_details(runner.model)}


async def tags(request: Request) -> JSONResponse:
    """``GET /api/tags``: the one model this server serves."""
    state = state_of(request)
    runner = state.require_ready(ollama=True)
    return JSONResponse({"models": [await run_in_threadpool(_card, state, runner)]})


def _capabilities(runner) -> list:
    caps = ["completion"]
    template = getattr(runner.tokenizer, "chat_template", None) or ""
    if "tools" in template:
        caps.append("tools")
    if "enable_thinking" in template or "<think>" in template or "reasoning" in template:
        caps.append("thinking")
    if runner.vision is not None:
        caps.append("vision")
    return caps


def _show(state: ServerState, runner, verbose: bool) -> dict:
    info = om.model_info(state.path, verbose) if state.path else {}
    template = getattr(runner.tokenizer, "chat_template", None) or ""
    params = "\n".join(f"{k:<30} {json.dumps(v)}" for k, v in sorted(runner.sampling_defaults.items())
                       if isinstance(v, (int, float, str)))
    out = {"modelfile": f"# Modelfile generated by ggmlpy\nFROM {state.path}\n", "parameters": params,
           "template": template, "details": om.model_details(runner.model), "model_info": info,
           "capabilities": _capabilities(runner)}
    if state.path:
        out["modified_at"] = om.timestamp(om.file_facts(state.path)[1])
    if isinstance(info.get("general.license"), str):
        out["license"] = info["general.license"]
    return out


async def show(request: Request) -> JSONResponse:
    """``POST /api/show``: the model's details (family, parameter size, quantization), its GGUF metadata
    (``model_info``; arrays over 64 items empty unless ``verbose``), chat template and capabilities."""
    state, body = state_of(request), await json_body(request, ollama=True)
    runner = state.require_ready(ollama=True)
    return JSONResponse(await run_in_threadpool(_show, state, runner, bool(body.get("verbose"))))


def _device_types(runner) -> dict:
    try:
        return {d.name: d.type for d in runner.model.placement.devices()}
    except Exception:                          # a model without a placement: names decide
        return {}


def ps_entry(state: ServerState, runner) -> dict:
    """``/api/ps``'s entry: ``size`` the memory report's total (weights, cache, graphs on every device),
    ``size_vram`` the part on accelerators, and, beyond Ollama's fields, ``devices``: each device's bytes."""
    report = runner.memory_report()
    types = _device_types(runner)
    devices = {n: m.self_total for n, m in report.devices.items()}
    vram = sum(b for n, b in devices.items() if types.get(n, "CPU" if n.upper().startswith("CPU") else "GPU")
               not in ("CPU", "ACCEL"))
    card = _card(state, runner)
    return {"name": card["name"], "model": card["model"], "size": int(report.total), "digest": card["digest"],
            "details": card["details"], "expires_at": "9999-12-31T23:59:59Z", "size_vram": int(vram),
            "context_length": int(runner.n_ctx), "devices": devices}


async def ps(request: Request) -> JSONResponse:
    """``GET /api/ps``: the loaded model and its memory (never unloaded: ``expires_at`` is far away)."""
    state = state_of(request)
    runner = state.require_ready(ollama=True)
    return JSONResponse({"models": [await run_in_threadpool(ps_entry, state, runner)]})


async def version(request: Request) -> JSONResponse:
    """``GET /api/version``: ggmlpy's version."""
    from ggmlpy._version import __version__

    return JSONResponse({"version": __version__})


ROUTES = [
    Route("/api/generate", generate, methods=["POST"]),
    Route("/api/chat", chat, methods=["POST"]),
    Route("/api/embed", embed, methods=["POST"]),
    Route("/api/embeddings", embeddings, methods=["POST"]),
    Route("/api/tags", tags, methods=["GET"]),
    Route("/api/show", show, methods=["POST"]),
    Route("/api/ps", ps, methods=["GET"]),
    Route("/api/version", version, methods=["GET"]),
]
