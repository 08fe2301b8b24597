"""A runner request seen from the event loop: :class:`Job`, and the SSE response that streams one.

The runner computes on its own thread and hands each request's events to a queue; here one small
thread per request (:func:`_pump`) moves them onto the event loop, so the loop never blocks on the
runner and the runner never blocks on a client:

* **back-pressure**: a stream's writer awaits uvicorn's ``send``, which waits while the client's socket
  buffer is full; only that request's coroutine waits, and its events wait in its own queue (at most
  ``max_tokens``, bounded by the context), so the other sequences go on at full speed;
* **disconnects**: a task watches the connection (``http.disconnect``) for the whole request, streamed
  or not; when the client goes away the request is cancelled at once, and the runner frees its slot at
  its next batch boundary;
* **timeouts and shutdown**: ``--timeout`` cancels a request still running after that long, and the
  shutdown's grace cancels what is left (:meth:`ServerState.cancel_all`); either way the response ends
  with a reason (an error body, or an error event in the stream).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Optional

from .errors import ApiError, error_body
from .state import ServerState

__all__ = ["Job", "SSEResponse", "wait_for_disconnect"]

_DONE, _FAILED = object(), object()


class Job:
    """The runner requests of one HTTP request (``n`` choices, or a batch of prompts), tracked by the
    server state while they run.

    ``events()`` yields ``(index, TokenEvent)`` as they come, across the handles; then ``results`` holds
    each handle's :class:`~ggmlpy.runner.Completion` (or the exception it ended with).
    """

    def __init__(self, state: ServerState, handles: Sequence) -> None:
        self.state = state
        self.handles = list(handles)
        self.results: list = [None] * len(self.handles)
        self.cancelled_by: Optional[str] = None     # "client", "timeout", "shutdown"
        self._queue: asyncio.Queue = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._open = len(self.handles)
        for h in self.handles:
            state.track(h)
        for i, h in enumerate(self.handles):
            threading.Thread(target=self._pump, args=(i, h), name="ggmlpy-serve-pump", daemon=True).start()

    def _pump(self, index: int, handle) -> None:
        """Move one handle's events onto the loop (its own thread: the handle's queue blocks)."""
        try:
            for ev in handle:
                self._post((index, ev))
            self._post((index, _DONE, handle.result()))
        except BaseException as e:          # RunnerError: the request failed inside the runner
            self._post((index, _FAILED, e))

    def _post(self, item) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:                # the loop is gone (the server stopped): end the request
            for h in self.handles:
                h.cancel()

    async def events(self) -> AsyncIterator[tuple]:
        """``(index, TokenEvent)`` until every handle has ended (then :attr:`results` is filled)."""
        while self._open:
            item = await self._queue.get()
            if len(item) == 3:
                index, _, value = item
                self.results[index] = value
                self._open -= 1
                self.state.untrack(self.handles[index])
                continue
            yield item

    async def wait(self) -> list:
        """Every handle's result, ignoring the events."""
        async for _ in self.events():
            pass
        return self.results

    def cancel(self, why: str) -> None:
        """Cancel every handle still running (``why``: client, timeout, shutdown)."""
        if self.cancelled_by is None:
            self.cancelled_by = why
        for h in self.handles:
            if not h.done:
                h.cancel()

    @property
    def done(self) -> bool:
        return self._open == 0

    def end_reason(self) -> Optional[ApiError]:
        """The error a request cancelled by the server ends with (None: it finished, or its client left)."""
        for r in self.results:
            if isinstance(r, BaseException):
                return ApiError(500, f"the request failed: {r}")
        if self.cancelled_by == "timeout":
            return ApiError(408, f"the request ran past the server's --timeout ({self.state.timeout:g} s) and was "
                                 f"cancelled", type="timeout_error")
        if self.cancelled_by == "shutdown" or (self.cancelled_by is None and self.state.status == "stopping"
                                               and any(_reason(r) == "cancel" for r in self.results)):
            return ApiError(503, "the server is shutting down: the request was cancelled",
                            headers={"Retry-After": "1"})
        return None

    def close(self) -> None:
        """Cancel what still runs and forget the handles (a response that ends early)."""
        self.cancel("client")
        for h in self.handles:
            self.state.untrack(h)


def _reason(result) -> Optional[str]:
    return getattr(result, "done_reason", None)


async def wait_for_disconnect(receive: Callable) -> None:
    """Return when the client has gone away (the request body already read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def run_to_end(job: Job, receive: Callable, timeout: float) -> bool:
    """Wait for ``job`` while watching the connection; True when it ended, False when its client left
    (it is then cancelled). ``timeout`` > 0 cancels it after that many seconds."""
    waiting = asyncio.ensure_future(job.wait())
    gone = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        done, _ = await asyncio.wait({waiting, gone}, timeout=timeout or None, return_when=asyncio.FIRST_COMPLETED)
        if waiting in done:
            return True
        job.cancel("client" if gone in done else "timeout")
        await waiting                        # the runner ends a cancelled request at its next batch
        return gone not in done
    finally:
        gone.cancel()
        if not waiting.done():
            job.close()
            waiting.cancel()


class SSEResponse:
    """An ASGI response streaming ``chunks`` (JSON objects) as server-sent events, then ``[DONE]``.

    The connection is watched while it streams: a client that goes away cancels ``job`` at once. A
    request cancelled by the server (timeout, shutdown) ends with an error event, ``{"error": {...}}``,
    which the ``openai`` client raises as an APIError.
    """

    media_type = "text/event-stream"

    def __init__(self, job: Job, chunks: AsyncIterator[dict], timeout: float = 0.0,
                 on_end: Optional[Callable] = None) -> None:
        self.job, self.chunks, self.timeout, self.on_end = job, chunks, timeout, on_end

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                                (b"x-accel-buffering", b"no")]})
        gone = asyncio.ensure_future(wait_for_disconnect(receive))
        gone.add_done_callback(lambda t: t.cancelled() or self.job.cancel("client"))
        timer = None
        if self.timeout > 0:
            timer = asyncio.get_running_loop().call_later(self.timeout, self.job.cancel, "timeout")
        try:
            async for chunk in self.chunks:
                if gone.done():
                    break
                await send({"type": "http.response.body", "body": _event(chunk), "more_body": True})
            if not gone.done():
                err = self.job.end_reason()
                if err is not None:
                    await send({"type": "http.response.body", "more_body": True,
                                "body": _event(error_body(err.message, err.type, code=err.status))})
                await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
        except OSError:                      # the socket failed under us: the client is gone
            self.job.cancel("client")
        finally:
            if timer is not None:
                timer.cancel()
            gone.cancel()
            if not self.job.done:
                self.job.close()
                await _drain(self.chunks)
            if self.on_end is not None:
                self.on_end()


async def _drain(chunks) -> None:
    """Close an async generator left early (its ``finally`` blocks run now, on this task)."""
    aclose = getattr(chunks, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except Exception:
            pass


def _event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
