"""The one scanner every format runs on: text in, content/reasoning/tool-call deltas out.

A format is a small state machine over *markers* (``<think>``, ``<tool_call>``, ``[TOOL_CALLS]``...):
in each state it names the markers it looks for and where the text between them goes (the
content, the reasoning, a capture that becomes a tool call, or nowhere). :class:`ReplyStream`
finds the markers in the text as it arrives and keeps back only what could still turn into one
(a partial marker at the end of the text so far, never emitted as content and then taken back).
A capture is parsed when its closing marker (or the end of the reply) arrives: tool calls if it
parses, else its raw text becomes content.

Because ``parse(text)`` is this scanner fed the whole text at once, a stream fed any chunking of
the same text gives the same reply: the scanner's decisions depend only on the text, never on where
the chunks were cut (the tests feed every split point).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ggmlpy._core import GGMLTypeError

from .types import Reply, ReplyDelta, ToolCall, ToolCallDelta, arguments_json, generated_id

if TYPE_CHECKING:
    from .formats import ChatFormat

__all__ = ["ReplyStream"]


class _Trim:
    """Drops the leading and trailing whitespace of a stream of text without taking anything back:
    whitespace is held until text follows it, and dropped if none does."""

    __slots__ = ("started", "pending")

    def __init__(self):
        self.started = False
        self.pending = ""

    def push(self, text: str) -> str:
        if not self.started:
            text = text.lstrip()
            if not text:
                return ""
            self.started = True
        text = self.pending + text
        kept = text.rstrip()
        self.pending = text[len(kept):]
        return kept


class ReplyStream:
    """Incremental parse of one reply: :meth:`feed` text as it is generated, then :meth:`finish`.

    Each call returns the :class:`ReplyDelta` list the new text completes. Text that may still
    become a marker (``<tool`` may be the start of ``<tool_call>``) is held back until it is
    known not to be one; a tool call is emitted once it is complete (its arguments in one
    fragment). Joining every delta's ``content`` and ``reasoning`` and each call's ``arguments``
    gives exactly :meth:`ChatFormat.parse` of the whole text, for any chunking.

    Build one with :meth:`ChatFormat.stream`; :attr:`reply` is what has been emitted so far.

    Examples
    --------
    >>> from ggmlpy.chat import chat_format
    >>> s = chat_format("{{ '<tool_call>' }}").stream()
    >>> [d.content for d in s.feed("Hi <tool")]
    ['Hi']
    >>> d, = s.feed('_call>{"name": "f", "arguments": {}}</tool_call>')
    >>> d.tool_call.name, d.tool_call.arguments
    ('f', '{}')
    """

    def __init__(self, fmt: ChatFormat):
        self._fmt = fmt
        self._buf = ""
        self._state: Any = fmt._initial_state()
        self._capture: list[str] = []
        self._captured = 0
        self._content = _Trim()
        self._reasoning = _Trim()
        self._out: list[ReplyDelta] = []
        self._done = False
        self.reply = Reply()
        """Everything emitted so far, assembled."""

    # -- public -----------------------------------------------------------------------------------

    def feed(self, text: str) -> list[ReplyDelta]:
        """Scan ``text`` (the next piece of the reply); the deltas it completes.

        Raises
        ------
        GGMLTypeError
            ``text`` is not a str.
        GGMLValueError
            The stream was already finished.
        """
        if not isinstance(text, str):
            raise GGMLTypeError(f"ReplyStream.feed: text must be a str, not {type(text).__name__}")
        self._check_open()
        self._buf += text
        self._run(final=False)
        return self._take()

    def finish(self) -> list[ReplyDelta]:
        """End of the reply: release what was held back, parse an unclosed capture; the last deltas."""
        self._check_open()
        self._run(final=True)
        self._done = True
        return self._take()

    # -- the scanner ------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._done:
            from ggmlpy._core import GGMLValueError

            raise GGMLValueError("ReplyStream: the stream is finished (start a new one per reply)")

    def _run(self, final: bool) -> None:
        fmt = self._fmt
        while True:
            markers = fmt._markers(self._state)
            buf = self._buf
            hit, at = None, -1
            for m in markers:
                i = buf.find(m)
                if i >= 0 and (at < 0 or i < at or (i == at and len(m) > len(hit))):
                    hit, at = m, i
            # the earliest place where a marker may begin that the text so far cannot settle
            hold = -1 if final else _partial_start(buf, markers, at if hit is not None else len(buf))
            if hold >= 0:
                self._buf = buf[hold:]
                if self._sink(buf[:hold]):
                    continue
                return
            if hit is None:
                self._buf = ""
                if self._sink(buf):
                    continue
                if final:
                    self._state = fmt._on_marker(self, self._state, None)
                return
            self._buf = buf[at:]
            if self._sink(buf[:at]):           # the marker is scanned again in the new state
                continue
            self._buf = self._buf[len(hit):]
            self._state = fmt._on_marker(self, self._state, hit)

    def _sink(self, text: str) -> bool:
        """Send ``text`` where the state says; True when a capture turned out not to be one (its
        text is back in the buffer, to be scanned again in the new state)."""
        if not text:
            return False
        where = self._fmt._sink(self._state)
        if where == "content":
            self._emit_content(text)
        elif where == "reasoning":
            self._emit_reasoning(text)
        elif where == "capture":
            self._capture.append(text)
            self._captured += len(text)
            if self._captured - len(text) < 64 and not self._fmt._viable(self._state, "".join(self._capture)):
                self._state = self._fmt._on_marker(self, self._state, "")
                return True
        return False   # "drop": discarded

    # -- what formats call ------------------------------------------------------------------------

    def _take_capture(self) -> str:
        text = "".join(self._capture)
        self._capture.clear()
        self._captured = 0
        return text

    def _emit_content(self, text: str) -> None:
        text = self._content.push(text)
        if text:
            self.reply.content += text
            self._out.append(ReplyDelta(content=text))

    def _emit_reasoning(self, text: str) -> None:
        text = self._reasoning.push(text)
        if text:
            self.reply.reasoning = (self.reply.reasoning or "") + text
            self._out.append(ReplyDelta(reasoning=text))

    def _emit_calls(self, calls: list[tuple[str, Any, str | None]]) -> None:
        for name, arguments, call_id in calls:
            index = len(self.reply.tool_calls)
            call = ToolCall(call_id or generated_id(index, name, arguments), name, arguments)
            self.reply.tool_calls.append(call)
            self._out.append(ReplyDelta(tool_call=ToolCallDelta(index, call.id, name, arguments_json(arguments))))

    def _take(self) -> list[ReplyDelta]:
        out, self._out = self._out, []
        merged: list[ReplyDelta] = []
        for d in out:      # adjacent text of one kind becomes one delta
            if merged and d.tool_call is None and merged[-1].tool_call is None and \
                    bool(d.content) == bool(merged[-1].content):
                last = merged.pop()
                d = ReplyDelta(content=last.content + d.content, reasoning=last.reasoning + d.reasoning)
            merged.append(d)
        return merged


def _partial_start(buf: str, markers: tuple[str, ...], limit: int) -> int:
    """The first index ``j <= limit`` where ``buf[j:]`` is a proper prefix of a marker (the text
    that follows may complete it), or -1."""
    if not markers:
        return -1
    longest = max(len(m) for m in markers)
    for j in range(max(0, len(buf) - longest + 1), min(limit, len(buf) - 1) + 1):
        tail = buf[j:]
        if any(len(m) > len(tail) and m.startswith(tail) for m in markers):
            return j
    return -1
