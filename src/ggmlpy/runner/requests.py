"""What a caller holds of a request: its :class:`Handle`, the streamed :class:`TokenEvent` s, the final
:class:`Completion` (the loop's private record of a request is ``loop._Request``)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import numpy as np

from ggmlpy._core import GGMLError
from ggmlpy.sampling import Logprobs

if TYPE_CHECKING:
    from .loop import _Request
    from .runner import Runner

__all__ = ["Completion", "DoneReason", "Handle", "RequestTimeout", "RunnerError", "Stream", "TokenEvent"]


class RequestTimeout(TimeoutError, GGMLError):
    """:meth:`Handle.result` waited ``timeout`` seconds and the request is still running."""


class RunnerError(RuntimeError, GGMLError):
    """A request failed inside the runner (the runner itself goes on serving).

    ``__cause__`` is the original error (a failed compute, a sampling error...).
    """


class DoneReason:
    """Why a sequence ended (``Completion.done_reason``)."""

    STOP = "stop"            # a stop token was sampled, or a stop string completed
    LENGTH = "length"        # max_tokens reached, or the context is full (shifting off, or max_tokens=-2)
    GRAMMAR = "grammar"      # the output could not continue under its grammar (Completion.error says why)
    CANCEL = "cancel"        # Handle.cancel(), or Runner.close() before the request ended
    ERROR = "error"          # see Completion.error (Handle.result() raises RunnerError from it)


@dataclass
class TokenEvent:
    """One generated token, as streamed by :class:`Handle`.

    ``text`` is set for requests that produce text (a text prompt, stop strings, a chat, or
    ``detokenize=True``; see :meth:`Runner.submit`), else None: the text this token completed, after
    the streaming detokenizer and the stop strings. It may be ``""``: the token ends with part of a
    UTF-8 character (held until the character is whole), is a control token, or may start a stop
    string (held until that is decided). The text of a stop token or a stop string is never
    streamed. The ``text`` of all of a request's events, joined, is its :attr:`Completion.text`.

    When a request ends between tokens (cancelled, the context full) while text is held back, one
    last event carries it with ``token`` None.

    ``deltas`` is set for chat requests: what this token added to the parsed reply
    (:class:`~ggmlpy.chat.ReplyDelta` s: content text, reasoning text, or a whole tool call), the
    text that may still become a tool call or a reasoning tag held back until that is decided (so a
    partial tool call never shows as content). Joined, they are the Completion's ``content``,
    ``reasoning`` and ``tool_calls``.
    """

    token: Optional[int]
    logprobs: Optional[Logprobs] = None
    text: Optional[str] = None
    deltas: list = field(default_factory=list)


@dataclass
class Completion:
    """The result of a request.

    ``tokens`` are the generated ids (the stop token included when one ended
    it, and the token that completed a stop string); ``embedding`` is set for
    embedding requests. ``text`` is set for requests that produce text (see
    :class:`TokenEvent`): the generated text, without the stop token's or the
    stop string's text and without anything after a stop string. Timings follow
    Ollama: prompt evaluation runs from the first batch to the first token,
    generation from the first token to the last.
    """

    tokens: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    done_reason: Optional[str] = None
    #: why it failed (done reason ``error``: :meth:`Handle.result` raises from it), or why its grammar
    #: stopped it (``grammar``: not raised)
    error: Optional[BaseException] = None
    embedding: Optional[np.ndarray] = None
    prompt_eval_count: int = 0
    prompt_eval_duration: float = 0.0
    eval_count: int = 0
    eval_duration: float = 0.0
    n_cached: int = 0
    n_shifts: int = 0
    text: Optional[str] = None
    #: a chat's reply parsed in the chat template's format (:mod:`ggmlpy.chat`): the text for the user,
    #: the reasoning (None when there is none) and the tool calls (:class:`~ggmlpy.chat.ToolCall`)
    content: Optional[str] = None
    reasoning: Optional[str] = None
    tool_calls: list = field(default_factory=list)

    @property
    def ttft(self) -> float:
        """Seconds from the request's first batch to its first token."""
        return self.prompt_eval_duration


class Stream:
    """A request's tokens as they are generated: what ``generate(..., stream=True)`` and
    ``chat(..., stream=True)`` return.

    An iterator of :class:`TokenEvent` s (``ev.text`` is the text each token completed, for a text
    prompt or a chat; ``ev.token`` its id), the same events :class:`Handle` streams, ending when the
    request ends (a stop, ``max_tokens``, a full context); it raises :class:`RunnerError` if the request
    failed. Then :meth:`result` is the request's :class:`Completion` (``done_reason``, timings).

    Leaving early cancels the request: :meth:`close` (called by a ``with`` block's end) cancels it and
    waits until the runner has ended it, so its slot is free when it returns; a stream dropped before
    its end (a ``break`` out of ``for ev in rt.generate(..., stream=True)``, garbage collection) is
    cancelled without waiting. An event stream is the same type whatever the prompt, as llama-cpp-python's
    ``stream=True`` yields one chunk type and mlx-lm's ``stream_generate`` one response type; the text
    alone is ``"".join(ev.text for ev in stream)``.

    Examples
    --------
    ``for ev in rt.generate("Once upon a time", max_tokens=32, stream=True): print(ev.text, end="")``
    """

    def __init__(self, handle: Handle) -> None:
        #: The request's :class:`Handle` (``cancel()``, ``done``, ``result()``).
        self.handle = handle
        self._events = iter(handle)

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> TokenEvent:
        return next(self._events)

    def result(self, timeout: Optional[float] = None) -> Completion:
        """The request's :class:`Completion`, once it has ended (see :meth:`Handle.result`)."""
        return self.handle.result(timeout)

    def close(self) -> None:
        """Cancel the request if it is still running and wait until it has ended (done reason ``cancel``,
        or the one it reached first); no more events are yielded. Safe to call more than once."""
        if not self.handle.done:
            self.handle.cancel()
        self._events.close()
        try:
            self.handle.result()          # the runner ends a cancelled request at its next batch
        except RunnerError:               # it failed before the cancel landed: nothing left to stop
            pass

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        # Dropped before its end: cancel, never wait (a finalizer may run on any thread).
        handle = getattr(self, "handle", None)
        if handle is not None and not handle.done:
            try:
                handle.cancel()
            except Exception:             # at interpreter exit the runner may be half torn down
                pass


class Handle:
    """A submitted request: iterate it for :class:`TokenEvent` s, or wait with :meth:`result`."""

    def __init__(self, runner: Runner, req: _Request) -> None:
        self._runner, self._req = runner, req

    def __iter__(self) -> Iterator[TokenEvent]:
        while True:
            ev = self._req.events.get()
            if ev is None:
                break
            yield ev
        if self._req.result.done_reason == DoneReason.ERROR:
            raise RunnerError(f"request failed: {self._req.result.error}") from self._req.result.error

    def cancel(self) -> None:
        """Stop the request; its slot is freed at the next batch boundary."""
        self._req.cancelled = True
        self._runner._wake()

    @property
    def done(self) -> bool:
        return self._req.finished.is_set()

    def result(self, timeout: Optional[float] = None) -> Completion:
        """Wait for the request to end and return its :class:`Completion` (errors re-raised)."""
        if not self._req.finished.wait(timeout):
            raise RequestTimeout(f"result: the request is still running after {timeout} s")
        r = self._req.result
        if r.done_reason == DoneReason.ERROR:
            raise RunnerError(f"request failed: {r.error}") from r.error
        return r
