"""What every route of the server reads: :class:`ServerState`.

One object per server, made before the socket listens; the model loads in a thread afterwards
(:meth:`ServerState.start_loading`), so ``/health`` answers ``loading`` with the load's progress
meanwhile and every model route answers 503 with ``Retry-After`` (:meth:`ServerState.require_ready`).

Requests: the runner serves ``n_parallel`` at once (its slots) and queues the rest itself; the server
admits at most ``n_parallel + max_queue`` (:meth:`ServerState.admit`), and answers 503 with
``Retry-After`` beyond that, so a burst cannot pile up without bound. Each admitted request's handle
is known here while it runs, so a shutdown can cancel what is still running when its grace ends.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Callable, Optional

from .errors import ApiError

__all__ = ["ServerState"]

#: seconds a 503 asks the client to wait (Retry-After) while loading or with the queue full
RETRY_AFTER = 1


class ServerState:
    """The server's model, settings and counters.

    Attributes
    ----------
    runner : Runner or None
        The runner once the model is loaded (None while loading, or after a failed load).
    model : LlamaModel or None
        The loaded model (closed with the runner).
    model_name : str
        The name ``/v1/models`` lists and requests may give: ``--alias``, else the file's stem.
    path : str
        The model file.
    status : str
        ``"loading"``, ``"ready"``, ``"error"`` (see ``error``) or ``"stopping"`` (after SIGTERM).
    progress : float
        0..1 while loading (the load's bytes read), 1 once ready.
    error : str or None
        Why the load failed.
    n_parallel, n_ctx : int
        Slots (``-np``) and context per slot (``-c``; the runner's own once loaded).
    max_queue : int
        Requests admitted beyond ``n_parallel`` to wait for a slot; more are answered 503.
    api_key : str or None
        Requests must carry it (``Authorization: Bearer`` or ``x-api-key``), except ``/health`` and ``/``.
    slot_save_path : str or None
        Where slot state files go (llama-server's ``--slot-save-path``).
    n_predict : int
        Every request's ``max_tokens`` when it sets none (``-n``; -1: until the end of generation or a full
        context).
    stop : tuple of str
        Every request's stop strings when it gives none (``--stop``).
    timeout : float
        The socket timeout (``--timeout``, llama-server's): seconds a request body may stop arriving, and a
        stream's client may accept nothing, before the server gives up on it (0: no bound).
    max_body : int
        The largest request body, in bytes (413 beyond).
    template : str or None
        The chat template used instead of the model's (``--chat-template-file``).
    started : float
        ``time.time()`` at start.
    requests, routes : Counter
        Requests served: by outcome (``ok``, ``error``, ``cancelled``), and by route path.
    tokens_prompt, tokens_generated : int
        Prompt tokens evaluated and tokens generated, over all requests.
    """

    def __init__(self, path: str = "", model_name: Optional[str] = None, n_parallel: int = 1, n_ctx: int = 0,
                 api_key: Optional[str] = None, slot_save_path: Optional[str] = None, max_queue: Optional[int] = None,
                 timeout: float = 0.0, max_body: int = 64 << 20, runner=None, template: Optional[str] = None,
                 n_predict: int = -1, stop: Sequence[str] = ()) -> None:
        self.path = str(path)
        self.model_name = model_name or (Path(self.path).stem if self.path else "model")
        self.n_parallel = int(n_parallel)
        self.n_ctx = int(n_ctx)
        self.api_key = api_key or None
        self.slot_save_path = slot_save_path
        self.max_queue = 4 * self.n_parallel + 16 if max_queue is None else int(max_queue)
        self.timeout = float(timeout)
        self.n_predict = int(n_predict)
        self.stop = tuple(stop)
        self.max_body = int(max_body)
        self.template = template
        self.started = time.time()
        self.runner = runner
        self.model = None
        self.status = "ready" if runner is not None else "loading"
        self.progress = 1.0 if runner is not None else 0.0
        self.error: Optional[str] = None
        self.requests: Counter = Counter()
        self.routes: Counter = Counter()
        self.tokens_prompt = 0
        self.tokens_generated = 0
        self._lock = threading.Lock()
        self._active: set = set()          # handles of admitted requests still running
        self._admitted = 0
        self._load_thread: Optional[threading.Thread] = None
        if runner is not None:
            self._ready(runner)

    # -- loading ---------------------------------------------------------------------------------------
    def start_loading(self, loader: Callable, on_fail: Optional[Callable] = None) -> threading.Thread:
        """Run ``loader(progress)`` in a thread; it returns ``(model, runner)`` and may call
        ``progress(done, total)``. The state turns ``ready`` or ``error`` when it returns (then
        ``on_fail()`` is called: the server stops, as llama-server does)."""
        def progress(done: int, total: int) -> None:
            if total > 0:
                self.progress = max(0.0, min(1.0, done / total)) * 0.99   # 1.0 once the runner has started

        def load() -> None:
            try:
                model, runner = loader(progress)
            except BaseException as e:         # reported by /health and every route; the process stays up
                self.status, self.error = "error", f"{type(e).__name__}: {e}"
                if on_fail is not None:
                    on_fail()
                return
            self.model = model
            if self.status == "stopping":      # SIGTERM arrived during the load
                runner.close()
                if model is not None:
                    model.close()
                return
            self._ready(runner)

        self._load_thread = threading.Thread(target=load, name="ggmlpy-serve-load", daemon=True)
        self._load_thread.start()
        return self._load_thread

    def _ready(self, runner) -> None:
        self.runner = runner
        self.n_ctx = int(getattr(runner, "n_ctx", self.n_ctx) or self.n_ctx)
        self.n_parallel = int(getattr(runner, "n_seq_max", self.n_parallel) or self.n_parallel)
        self.progress = 1.0
        self.status = "ready"

    def require_ready(self, ollama: bool = False):
        """The runner, or the server's error: 503 with ``Retry-After`` while loading or stopping, 500
        after a failed load."""
        if self.status == "ready" and self.runner is not None:
            return self.runner
        if self.status == "error":
            raise ApiError(500, f"the model failed to load: {self.error}", ollama=ollama)
        if self.status == "stopping":
            raise ApiError(503, "the server is shutting down", headers={"Retry-After": str(RETRY_AFTER)},
                           ollama=ollama)
        raise ApiError(503, f"the model is loading ({self.progress:.0%})", headers={"Retry-After": str(RETRY_AFTER)},
                       ollama=ollama)

    # -- admission -------------------------------------------------------------------------------------
    @property
    def waiting(self) -> int:
        """Requests admitted and waiting for a slot (beyond ``n_parallel``)."""
        return max(0, self._admitted - self.n_parallel)

    @property
    def in_flight(self) -> int:
        """Requests admitted and not yet answered."""
        return self._admitted

    def enter(self, cost: int = 1, ollama: bool = False) -> None:
        """Count a request of ``cost`` sequences (``n``) in; 503 with ``Retry-After`` when ``n_parallel +
        max_queue`` are already in. Every :meth:`enter` is matched by one :meth:`leave`."""
        with self._lock:
            if self._admitted > 0 and self._admitted + cost > self.n_parallel + self.max_queue:
                raise ApiError(503, f"the server is busy: {self._admitted} requests in flight, at most "
                                    f"{self.n_parallel} running and {self.max_queue} queued; retry later",
                               headers={"Retry-After": str(RETRY_AFTER)}, ollama=ollama)
            self._admitted += cost

    def leave(self, cost: int = 1) -> None:
        with self._lock:
            self._admitted -= cost

    @contextlib.contextmanager
    def admit(self, cost: int = 1, ollama: bool = False) -> Iterator[None]:
        """:meth:`enter` and :meth:`leave` around a block (a request answered within it)."""
        self.enter(cost, ollama)
        try:
            yield
        finally:
            self.leave(cost)

    def track(self, handle) -> None:
        """Remember a running request's handle (cancelled if the server stops before it ends)."""
        with self._lock:
            self._active.add(handle)

    def untrack(self, handle) -> None:
        with self._lock:
            self._active.discard(handle)

    def cancel_all(self) -> int:
        """Cancel every running request (the end of a shutdown's grace); returns how many."""
        with self._lock:
            active = list(self._active)
        for h in active:
            h.cancel()
        return len(active)

    @property
    def active(self) -> int:
        """Requests the runner holds (running or queued in it)."""
        return len(self._active)

    # -- counters --------------------------------------------------------------------------------------
    def count(self, route: str, outcome: str, prompt_tokens: int = 0, generated_tokens: int = 0) -> None:
        """Add one request's outcome and tokens to the counters."""
        with self._lock:
            self.routes[route] += 1
            self.requests[outcome] += 1
            self.tokens_prompt += int(prompt_tokens)
            self.tokens_generated += int(generated_tokens)

    def close(self) -> None:
        """Close the runner and the model (after the server has stopped)."""
        runner, model, self.runner = self.runner, self.model, None
        if runner is not None:
            runner.close()
        if model is not None:
            model.close()
