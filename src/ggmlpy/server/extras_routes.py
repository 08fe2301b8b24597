"""llama-server's extra endpoints: ``/slots`` and the slot actions, ``/tokenize``, ``/detokenize``,
``/apply-template``, ``/metrics``, ``/props``. (``/health`` is :mod:`.app`'s.)

Slot actions (``POST /slots/{id}?action=save|restore|erase``, body ``{"filename": ...}``) go through the
runner's state files (:meth:`~ggmlpy.runner.Runner.save_state`, ``load_state``, ``clear``) in the folder
given by ``--slot-save-path``; without it they answer 501, as llama-server does. The file name must be a
plain name (:func:`.extras.slot_file`): anything else is 400 and nothing is read or written. The runner's
state calls need it idle (no request served, not only this slot: the cache and the scheduler are shared), so
an action waits for the runner to be idle, up to :data:`SLOT_WAIT` seconds (llama-server defers the task
until the slot is free), then answers 409 if requests are still being served.
"""

from __future__ import annotations

import os
import time

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from . import extras as ex
from .errors import ApiError
from .requests_map import json_body, state_of
from .state import ServerState

__all__ = ["ROUTES", "SLOT_WAIT"]

#: seconds a slot action waits for the runner to be idle before answering 409
SLOT_WAIT = 10.0


async def slots(request: Request) -> JSONResponse:
    """``GET /slots``: each slot's id, context, whether it is busy, and the tokens its cache holds;
    ``?fail_on_no_slot=1`` answers 503 when none is idle."""
    runner = state_of(request).require_ready()
    info = ex.slots_info(runner)
    if request.query_params.get("fail_on_no_slot") in ("1", "true") and all(s["is_processing"] for s in info):
        raise ApiError(503, "no slot available")
    return JSONResponse(info)


def _when_idle(runner, fn, *args):
    """``fn(*args)`` once the runner is idle; 409 if it stays busy for SLOT_WAIT seconds or a request came
    first (the runner refuses direct calls while it serves)."""
    from ggmlpy._core import GGMLValueError

    deadline = time.monotonic() + SLOT_WAIT
    while True:
        if not runner.wait_idle(max(0.0, deadline - time.monotonic())):
            raise ApiError(409, f"the runner is serving requests; slot actions need it idle (waited {SLOT_WAIT:g} s)")
        try:
            return fn(*args)
        except GGMLValueError as e:
            if "requests are being served" not in str(e) or time.monotonic() >= deadline:
                raise
            # a request arrived between the wait and the call: wait again


def _slot_action(state: ServerState, runner, slot: int, action: str, filename) -> dict:
    t0 = time.perf_counter()
    if action == "erase":
        n = ex.slots_info(runner)[slot]["n_cached"]
        _when_idle(runner, runner.clear, slot)
        return {"id_slot": slot, "n_erased": n}
    try:
        path = ex.slot_file(state.slot_save_path, filename, must_exist=action == "restore")
    except ex.SlotFileError as e:
        raise ApiError(400, str(e), param="filename") from None
    except FileNotFoundError as e:
        raise ApiError(404, str(e), param="filename") from None
    if action == "save":
        n_written = _when_idle(runner, runner.save_state, slot, path)
        n = ex.slots_info(runner)[slot]["n_cached"]
        return {"id_slot": slot, "filename": filename, "n_saved": n, "n_written": int(n_written),
                "timings": {"save_ms": (time.perf_counter() - t0) * 1e3}}
    from ggmlpy.kvcache import StateError

    try:
        tokens = _when_idle(runner, runner.load_state, slot, path)
    except StateError as e:
        raise ApiError(400, str(e), param="filename") from None
    return {"id_slot": slot, "filename": filename, "n_restored": len(tokens), "n_read": os.path.getsize(path),
            "timings": {"restore_ms": (time.perf_counter() - t0) * 1e3}}


async def slot_action(request: Request) -> JSONResponse:
    """``POST /slots/{id}?action=save|restore|erase``: a slot's cache to or from a file, or emptied."""
    state = state_of(request)
    action = request.query_params.get("action", "")
    if action not in ("save", "restore", "erase"):
        raise ApiError(400, f"action must be save, restore or erase (got {action[:20]!r})", param="action")
    if action != "erase" and not state.slot_save_path:
        raise ApiError(501, "This server does not support slots action. Start it with `--slot-save-path`")
    runner = state.require_ready()
    raw = request.path_params["id"]
    if not raw.isdigit() or not 0 <= int(raw) < runner.n_seq_max:
        raise ApiError(400, f"invalid slot id {raw[:20]!r}: this server has slots 0..{runner.n_seq_max - 1}")
    body = await json_body(request)
    try:
        out = await run_in_threadpool(_slot_action, state, runner, int(raw), action, body.get("filename"))
    except ApiError:
        raise
    except ValueError as e:             # a state file of another model, a cache too full to restore into...
        raise ApiError(400, str(e)) from e
    return JSONResponse(out)


def _tokenizer(runner):
    try:
        return runner.tokenizer
    except ValueError as e:
        raise ApiError(501, f"the model has no tokenizer: {e}") from None


async def tokenize(request: Request) -> JSONResponse:
    """``POST /tokenize``: ``content`` → ``tokens`` (``add_special`` default false, ``parse_special`` default
    true, ``with_pieces``: each id with its text, or its bytes when not valid UTF-8)."""
    runner = state_of(request).require_ready()
    body = await json_body(request)
    content = body.get("content")
    if not isinstance(content, str):
        raise ApiError(400, "content must be a string", param="content")
    try:
        add = ex.optional_bool(body, "add_special", False)
        parse = ex.optional_bool(body, "parse_special", True)
        with_pieces = ex.optional_bool(body, "with_pieces", False)
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    tok = _tokenizer(runner)
    ids = await run_in_threadpool(tok.encode, content, add, parse)
    return JSONResponse({"tokens": ex.pieces(tok, ids) if with_pieces else ids})


async def detokenize(request: Request) -> JSONResponse:
    """``POST /detokenize``: ``tokens`` → ``content``."""
    runner = state_of(request).require_ready()
    body = await json_body(request)
    tok = _tokenizer(runner)
    try:
        ids = ex.check_ids(body.get("tokens", []), runner.n_vocab)
    except ValueError as e:
        raise ApiError(400, str(e), param="tokens") from None
    return JSONResponse({"content": await run_in_threadpool(tok.decode, ids)})


async def apply_template(request: Request) -> JSONResponse:
    """``POST /apply-template``: ``messages`` (and ``tools``) rendered by the chat template, with the
    assistant's turn opened, as the text ``/completion`` would take."""
    runner = state_of(request).require_ready()
    body = await json_body(request)
    messages = body.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ApiError(400, "messages must be a list of objects", param="messages")
    tok = _tokenizer(runner)
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ApiError(400, "chat_template_kwargs must be an object", param="chat_template_kwargs")
    try:
        text = await run_in_threadpool(lambda: tok.apply_chat_template(
            messages, add_generation_prompt=body.get("add_generation_prompt", True) is not False,
            tools=body.get("tools"), **kwargs))
    except ValueError as e:           # no template, the template's own error
        raise ApiError(400, str(e)) from None
    return JSONResponse({"prompt": text})


async def metrics(request: Request) -> Response:
    """``GET /metrics``: Prometheus's text format: llama.cpp's ``llamacpp:`` counters and gauges (tokens,
    seconds, throughput, requests processing and deferred, KV-cache use)."""
    state = state_of(request)
    runner = state.require_ready()
    extra = {"ggmlpy:requests_errors_total": ("Requests that ended in an error", state.requests.get("error", 0))}
    text = ex.render_metrics(ex.metrics_of(state), runner, extra)
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


async def props(request: Request) -> JSONResponse:
    """``GET /props``: the default generation settings, slots, chat template, memory report and fit."""
    state = state_of(request)
    runner = state.require_ready()
    return JSONResponse(await run_in_threadpool(ex.props, state, runner))


ROUTES = [
    Route("/slots", slots, methods=["GET"]),
    Route("/slots/{id}", slot_action, methods=["POST"]),
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
    Route("/apply-template", apply_template, methods=["POST"]),
    Route("/metrics", metrics, methods=["GET"]),
    Route("/props", props, methods=["GET"]),
]
