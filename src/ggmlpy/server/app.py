"""The ASGI application: :func:`create_app` puts each API module's routes behind the server's checks.

Route modules each export ``ROUTES``, a list of Starlette routes: :mod:`.openai_routes` always, and
:mod:`.ollama_routes` and :mod:`.extras_routes` (Ollama's API, llama-server's extras) when they are
present. Every request passes, outermost first:

1. request logging (method, path, status, milliseconds, on the ``ggmlpy.server`` logger);
2. the API key (``Authorization: Bearer <key>`` or ``x-api-key: <key>``; ``/health`` and ``/`` are
   public), compared in constant time: 401 without it;
3. the body limit (``state.max_body``): 413 from ``Content-Length`` before anything is read, or as soon
   as a chunked body passes it; and its read timeout (``state.timeout``, llama-server's ``--timeout``): 408
   when no part of the body comes for that long.

Errors are :class:`~.errors.ApiError`; any other exception is a 500 whose message names its type (the
traceback goes to the log, never to the client). A path under ``/api/`` gets Ollama's error shape.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from .errors import ApiError
from .state import ServerState

__all__ = ["create_app", "error_response"]

log = logging.getLogger("ggmlpy.server")

#: paths answered without the API key
PUBLIC = frozenset({"/", "/health", "/v1/health"})


def _ollama_path(path: str) -> bool:
    return path.startswith("/api/")


def error_response(err: ApiError, path: str = "") -> JSONResponse:
    """The response of ``err``: OpenAI's body, or Ollama's under ``/api/`` or for an error flagged so."""
    return JSONResponse(err.body(True if _ollama_path(path) else None), status_code=err.status, headers=err.headers)


async def _send_error(send, err: ApiError, path: str) -> None:
    resp = error_response(err, path)
    await send({"type": "http.response.start", "status": resp.status_code, "headers": resp.raw_headers})
    await send({"type": "http.response.body", "body": resp.body})


class GuardMiddleware:
    """The API key, the body limit and the body's read timeout, as plain ASGI (so a refused body is never
    read)."""

    def __init__(self, app, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        key = self.state.api_key
        if key is not None and path not in PUBLIC and scope.get("method") != "OPTIONS":
            given = headers.get("x-api-key")
            auth = headers.get("authorization", "")
            if given is None and auth[:7].lower() == "bearer ":
                given = auth[7:].strip()
            if given is None or not hmac.compare_digest(given.encode(), key.encode()):
                return await _send_error(send, ApiError(401, "invalid or missing API key (Authorization: Bearer "
                                                        "<key>, or x-api-key)"), path)
        limit = self.state.max_body
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                return await _send_error(send, ApiError(400, f"invalid Content-Length {length[:32]!r}"), path)
            if int(length) > limit:
                return await _send_error(send, ApiError(413, f"the request body is {int(length)} bytes, more than "
                                                        f"the server takes ({limit})"), path)
        seen, complete, timeout = 0, False, self.state.timeout

        async def bounded_receive():
            nonlocal seen, complete
            if complete or timeout <= 0:         # after the body: the disconnect watch waits without bound
                message = await receive()
            else:
                try:
                    message = await asyncio.wait_for(receive(), timeout)
                except asyncio.TimeoutError:
                    # llama-server's read timeout; the rest of the body may still come: the connection closes
                    raise ApiError(408, f"the request body stopped arriving: nothing for {timeout:g} s (--timeout)",
                                   headers={"Connection": "close"}) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                complete = True
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise ApiError(413, f"the request body is more than the server takes ({limit} bytes)")
            return message

        await self.app(scope, bounded_receive, send)


class LogMiddleware:
    """One log line per request: method, path, status, milliseconds."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status = time.perf_counter(), [0]

        async def logged_send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, logged_send)
        finally:
            log.info("%s %s %d %.1f ms", scope.get("method"), scope.get("path"), status[0],
                     (time.perf_counter() - t0) * 1e3)


async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    return error_response(exc, request.url.path)


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    # Starlette's own 404 (no such route) and 405 (wrong method), in the API's shape
    message = {404: f"no route {request.method} {request.url.path}",
               405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
    return error_response(ApiError(exc.status_code, message, headers=exc.headers), request.url.path)


async def _server_error(request: Request, exc: Exception) -> JSONResponse:
    log.exception("%s %s failed", request.method, request.url.path)
    return error_response(ApiError(500, f"internal error: {type(exc).__name__}"), request.url.path)


async def health(request: Request) -> JSONResponse:
    """llama-server's ``/health``: 200 ``{"status": "ok"}`` when ready (``?include_slots``: with the idle and
    busy slots and the requests waiting), 503 while loading (with the progress) or after a failed load."""
    state: ServerState = request.app.state.server
    if state.status == "ready":
        if "include_slots" not in request.query_params:
            return JSONResponse({"status": "ok"})
        busy = min(state.active, state.n_parallel)      # llama-server's older /health counts
        return JSONResponse({"status": "ok", "slots_idle": state.n_parallel - busy, "slots_processing": busy,
                             "requests_waiting": max(0, state.active - state.n_parallel)})
    if state.status == "error":
        return JSONResponse({"status": "error", "error": {"message": state.error, "type": "server_error",
                                                          "code": 500}}, status_code=500)
    body = {"status": state.status, "progress": round(state.progress, 4),
            "error": {"message": "Loading model" if state.status == "loading" else "Shutting down",
                      "type": "unavailable_error", "code": 503}}
    return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})


async def root(request: Request) -> JSONResponse:
    state: ServerState = request.app.state.server
    return JSONResponse({"name": "ggmlpy", "model": state.model_name, "status": state.status})


def _route_modules() -> list:
    """The API modules present: OpenAI's always, Ollama's and llama-server's extras when installed."""
    import importlib

    from . import openai_routes, rerank_routes

    mods = [openai_routes, rerank_routes]
    for name in ("ollama_routes", "extras_routes"):
        try:
            mods.append(importlib.import_module(f"{__package__}.{name}"))
        except ModuleNotFoundError as e:
            if e.name != f"{__package__}.{name}":     # the module exists and failed to import: say so
                raise
    return mods


def create_app(state: ServerState) -> Starlette:
    """The Starlette application serving ``state``'s model (``app.state.server`` is ``state``)."""
    routes = [Route("/health", health, methods=["GET"]), Route("/v1/health", health, methods=["GET"]),
              Route("/", root, methods=["GET"])]
    for mod in _route_modules():
        routes.extend(mod.ROUTES)
    app = Starlette(routes=routes,
                    middleware=[Middleware(LogMiddleware), Middleware(GuardMiddleware, state=state)],
                    exception_handlers={ApiError: _api_error, HTTPException: _http_error, Exception: _server_error})
    app.state.server = state
    return app
