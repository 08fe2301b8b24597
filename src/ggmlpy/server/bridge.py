"""A runner request seen from the event loop: :class:`Job`, the response that streams one
(:class:`StreamResponse`: server-sent events for OpenAI's routes, NDJSON for Ollama's), and :func:`answer`,
the path every generating route of both APIs takes.

The runner computes on its own thread and hands each request's events to a queue; here one small
thread per request (``Job._pump``) moves them onto the event loop, so the loop never blocks on the
runner and the runner never blocks on a client:

* **back-pressure**: a stream's writer awaits uvicorn's ``send``, which waits while the client's socket
  buffer is full; only that request's coroutine waits, and its events wait in its own queue (at most
  ``max_tokens``, bounded by the context), so the other sequences go on at full speed;
* **disconnects**: a task watches the connection (``http.disconnect``) for the whole request, streamed
  or not; when the client goes away the request is cancelled at once, and the runner frees its slot at
  its next batch boundary;
* **--timeout** (llama-server's socket timeout): a stream whose client accepts nothing for that long is
  dropped, its request cancelled (the request body's read is bounded by the same, :mod:`.app`);
* **shutdown**: the shutdown's grace cancels what is left (:meth:`ServerState.cancel_all`), and the
  response ends with a reason (an error body, or an error event or line in the stream).
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from typing import NamedTuple, Optional

from .errors import ApiError, error_body
from .state import ServerState

__all__ = ["CLIENT_GONE", "NDJSON", "SSE", "DroppedStreamFilter", "Framing", "Job", "StreamResponse", "answer", "count",
           "run_batches", "run_to_end", "submit", "wait_for_disconnect"]

log = logging.getLogger("ggmlpy.server")

_DONE, _FAILED = object(), object()

#: the status of a response whose client has gone (nginx's "client closed request"; never seen by it)
CLIENT_GONE = 499


class Job:
    """The runner requests of one HTTP request (``n`` choices, or a batch of prompts), tracked by the
    server state while they run.

    ``events()`` yields ``(index, TokenEvent)`` as they come, across the handles; then ``results`` holds
    each handle's :class:`~ggmlpy.runner.Completion` (or the exception it ended with). ``error_of`` maps
    such an exception to the HTTP error it ends the response with (default: a 500 naming it).
    """

    def __init__(self, state: ServerState, handles: Sequence,
                 error_of: Optional[Callable[[BaseException], ApiError]] = None) -> None:
        self.state = state
        self.handles = list(handles)
        self.results: list = [None] * len(self.handles)
        self.cancelled_by: Optional[str] = None     # "client", "timeout" (the client took nothing), "shutdown"
        self.error_of = error_of
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
        """The error a request that did not run to its own end ends with: a failure inside the runner,
        or the server's shutdown (None: it finished, or its client left)."""
        for r in self.results:
            if isinstance(r, BaseException):
                return self.error_of(r) if self.error_of is not None else ApiError(500, f"the request failed: {r}")
        if self.cancelled_by == "shutdown" or (self.cancelled_by is None and self.state.status == "stopping"
                                               and any(_reason(r) == "cancel" for r in self.results)):
            return ApiError(503, "the server is shutting down: the request was cancelled",
                            headers={"Retry-After": "1"})
        return None

    def ran_to_end(self) -> bool:
        """Whether every request ended on its own (a stop, the length, a tool call): a stream then gets its
        closing chunks; otherwise :meth:`end_reason` says why (or the client left)."""
        if self.end_reason() is not None:
            return False
        return not any(isinstance(r, BaseException) or _reason(r) in ("error", "cancel") for r in self.results)

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


async def run_to_end(job: Job, receive: Callable) -> bool:
    """Wait for ``job`` while watching the connection; True when it ended, False when its client left
    (it is then cancelled)."""
    waiting = asyncio.ensure_future(job.wait())
    gone = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        done, _ = await asyncio.wait({waiting, gone}, return_when=asyncio.FIRST_COMPLETED)
        if waiting in done:
            return True
        job.cancel("client")
        await waiting                        # the runner ends a cancelled request at its next batch
        return False
    finally:
        gone.cancel()
        if not waiting.done():
            job.close()
            waiting.cancel()


async def submit(make: Callable, n: int, error_of: Callable[[BaseException], ApiError]) -> list:
    """Call ``make(i)`` for each of ``n`` requests on a worker thread (tokenizing, rendering the template
    and compiling a grammar take time); a failure cancels those already queued and is the HTTP error
    ``error_of`` makes of it."""
    def submit_all() -> list:
        handles = []
        try:
            for i in range(n):
                handles.append(make(i))
        except BaseException:
            for h in handles:
                h.cancel()
            raise
        return handles

    try:
        return await asyncio.to_thread(submit_all)
    except ApiError:
        raise
    except Exception as e:
        raise error_of(e) from None


def _check_results(job: Job) -> list:
    """The completions of an ended job, or the error it ended with."""
    err = job.end_reason()
    if err is not None:
        raise err
    return job.results


def count(state: ServerState, route: str, completions: list, outcome: str = "ok") -> None:
    """Add one HTTP request's completions to the counters and to ``/metrics``' token counters."""
    from .extras import metrics_of

    comps = [c for c in completions if c is not None and not isinstance(c, BaseException)]
    state.count(route, outcome, sum(c.prompt_eval_count - c.n_cached for c in comps),
                sum(c.eval_count for c in comps))
    metrics = metrics_of(state)
    for c in comps:
        metrics.record(c)


# ---------------------------------------------------------------------------------------------- streaming

class Framing(NamedTuple):
    """How a stream's objects are written: ``encode(obj)`` one object, ``error(err)`` the object a stream
    the server ended early closes with, ``end`` the bytes after the last (may be empty)."""

    media_type: str
    encode: Callable[[dict], bytes]
    error: Callable[[ApiError], bytes]
    end: bytes


def _event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def _line(obj: dict) -> bytes:
    return (json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n").encode()


#: OpenAI's server-sent events: ``data: {...}``, an error as ``{"error": {...}}`` (the ``openai`` client raises
#: it as an APIError), then ``data: [DONE]``
SSE = Framing("text/event-stream; charset=utf-8", _event,
              lambda err: _event(error_body(err.message, err.type, code=err.status)), b"data: [DONE]\n\n")
#: Ollama's NDJSON: one object a line, an error as ``{"error": "..."}`` (as Ollama's own stream ends), nothing after
NDJSON = Framing("application/x-ndjson", _line, lambda err: _line({"error": err.message}), b"")

#: set in a response's task when it drops a client on purpose (see :class:`DroppedStreamFilter`)
_dropped: contextvars.ContextVar[bool] = contextvars.ContextVar("ggmlpy_dropped_stream", default=False)


class DroppedStreamFilter(logging.Filter):
    """Drops uvicorn's "returned without completing response" line for a stream that :class:`StreamResponse`
    ended on purpose (its client took nothing for ``--timeout``; the server's own warning says so). The
    line is logged in the response's task, where the flag is set; any other such line is kept."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (_dropped.get() and "without completing response" in record.getMessage())


class StreamResponse:
    """An ASGI response streaming ``chunks`` (JSON objects) in ``framing`` (:data:`SSE`, :data:`NDJSON`).

    The connection is watched while it streams: a client that goes away cancels ``job`` at once. A
    request that ends early on the server's side (a failure, the shutdown) closes with ``framing``'s
    error object. ``timeout`` > 0: a client that accepts no bytes for that many seconds (its socket
    buffer full, as llama-server's write timeout) is dropped and its request cancelled.
    """

    def __init__(self, job: Job, chunks: AsyncIterator[dict], framing: Framing = SSE, timeout: float = 0.0,
                 on_end: Optional[Callable] = None, headers: Optional[dict] = None) -> None:
        self.job, self.chunks, self.framing, self.timeout, self.on_end = job, chunks, framing, timeout, on_end
        self.headers = dict(headers or {})
        self.media_type = framing.media_type

    async def __call__(self, scope, receive, send) -> None:
        gone = asyncio.ensure_future(wait_for_disconnect(receive))
        gone.add_done_callback(lambda t: t.cancelled() or self.job.cancel("client"))

        async def write(message: dict) -> bool:
            """Send one message; False when the client has gone or took nothing for ``timeout`` s."""
            if gone.done():
                return False
            if self.timeout <= 0:
                await send(message)
                return not gone.done()
            try:
                await asyncio.wait_for(send(message), self.timeout)
            except asyncio.TimeoutError:
                self.job.cancel("timeout")
                _dropped.set(True)
                log.warning("%s: the client accepted nothing for %g s (--timeout): dropped, its request cancelled",
                            scope.get("path"), self.timeout)
                return False
            return not gone.done()

        headers = [(b"content-type", self.media_type.encode()), (b"cache-control", b"no-cache"),
                   (b"x-accel-buffering", b"no"),
                   *((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in self.headers.items())]
        try:
            if await write({"type": "http.response.start", "status": 200, "headers": headers}):
                await self._stream(write)
        except OSError:                      # the socket failed under us: the client is gone
            self.job.cancel("client")
        finally:
            gone.cancel()
            if not self.job.done:
                self.job.close()
            await _drain(self.chunks)
            if self.on_end is not None:
                self.on_end()

    async def _stream(self, write: Callable) -> None:
        def body(data: bytes, more: bool = True) -> dict:
            return {"type": "http.response.body", "body": data, "more_body": more}

        async for chunk in self.chunks:
            if not await write(body(self.framing.encode(chunk))):
                return
        err = self.job.end_reason()
        if err is not None and not await write(body(self.framing.error(err))):
            return
        await write(body(self.framing.end, more=False))


async def _drain(chunks) -> None:
    """Close an async generator left early (its ``finally`` blocks run now, on this task)."""
    aclose = getattr(chunks, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except Exception:
            pass


# ---------------------------------------------------------------------------------------------- the routes' path

async def answer(request, route: str, n: int, make: Callable, *, stream: bool, build: Callable,
                 chunks: Callable, framing: Framing = SSE, submit_error: Callable[[BaseException], ApiError],
                 run_error: Optional[Callable[[BaseException], ApiError]] = None, headers: Optional[dict] = None,
                 ollama: bool = False):
    """Admit, submit and answer one generating request of ``n`` runner requests (``make(i)`` submits the
    i-th): ``build(completions)`` as JSON, or ``chunks(job)``'s objects streamed in ``framing``.

    ``submit_error`` maps what the runner raised at submit, ``run_error`` a request that failed while it
    ran, to the HTTP error; ``headers`` go on the response (Ollama's ``Warning``); ``ollama``: the 503 of
    a full queue in Ollama's shape. A client that leaves a request it waits for gets no answer (499 in
    the log); the request is cancelled at once.
    """
    from starlette.responses import JSONResponse, Response

    state: ServerState = request.app.state.server
    state.enter(n, ollama)
    try:
        job = Job(state, await submit(make, n, submit_error), error_of=run_error)
    except BaseException:
        state.leave(n)
        state.count(route, "error")
        raise
    if stream:
        def end() -> None:
            state.leave(n)
            count(state, route, job.results, "ok" if job.cancelled_by is None else "cancelled")
        return StreamResponse(job, chunks(job), framing, state.timeout, on_end=end, headers=headers)
    try:
        if not await run_to_end(job, request.receive):
            count(state, route, job.results, "cancelled")
            return Response(status_code=CLIENT_GONE)
        completions = _check_results(job)
    except ApiError:
        count(state, route, job.results, "error")
        raise
    finally:
        state.leave(n)
    count(state, route, completions)
    return JSONResponse(build(completions), headers=headers)


async def run_batches(request, n: int, make: Callable, step: int, submit_error: Callable[[BaseException], ApiError],
                      run_error: Optional[Callable[[BaseException], ApiError]] = None,
                      together: Optional[Callable] = None) -> Optional[list]:
    """The completions of ``n`` runner requests (``make(i)``) submitted ``step`` at a time (embeddings: one
    pump thread each), the connection watched; None when the client left (the rest is not submitted).
    ``together(start, stop)``, where given, queues requests ``start .. stop - 1`` at once instead and returns
    their handles (:meth:`~ggmlpy.runner.Runner.submit_embeddings`: the runner then batches them together)."""
    state: ServerState = request.app.state.server
    out: list = []
    for start in range(0, n, step):
        stop = min(n, start + step)
        if together is not None:
            try:
                handles = await asyncio.to_thread(together, start, stop)
            except ApiError:
                raise
            except Exception as e:
                raise submit_error(e) from None
        else:
            handles = await submit(lambda i, start=start: make(start + i), stop - start, submit_error)
        job = Job(state, handles, error_of=run_error)
        if not await run_to_end(job, request.receive):
            return None
        out.extend(_check_results(job))
    return out
