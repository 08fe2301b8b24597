"""The reply formats: :class:`ChatFormat` (markers, blocks, grammar) and one subclass per family.

A format says, for each state of :class:`~ggmlpy.chat.stream.ReplyStream`'s scan, which markers it
looks for and where the text goes. Most formats are *block* formats: content, an optional
reasoning block between two tags, and tool-call blocks (an opening marker, closing markers or the
end of the reply, a body parser from :mod:`ggmlpy.chat._bodies`). gpt-oss (harmony channels) and
Functionary v3.2 (``>>>recipient`` sections) have their own state machines.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any, Callable, Optional

from ggmlpy._core import GGMLTypeError

from . import _bodies as B
from .grammar import Lark, chosen_tools, function_tools, lit, xml_params
from .stream import ReplyStream
from .types import Reply

__all__ = ["ChatFormat"]

THINK = ("<think>", "</think>")
NL = "\n"


@dataclasses.dataclass(frozen=True)
class _Block:
    """A tool-call block: ``open``, then a body up to one of ``close`` (or the reply's end when
    ``close`` is empty), read by ``parse``."""

    open: str
    close: tuple[str, ...]
    parse: Callable[[str], list]


class ChatFormat:
    """How one model family writes its reply: content, reasoning and tool calls.

    Build one with :func:`ggmlpy.chat.chat_format` (which reads the chat template); the subclasses
    are the families. Plain :class:`ChatFormat` is the generic format: content only, a
    ``<think>...</think>`` block split off when ``reasoning_tags`` are set, and, when tools are
    given, llama.cpp's generic JSON reply (``{"tool_call": {"name": ..., "arguments": ...}}``).

    Parameters
    ----------
    reasoning_tags : tuple of (str, str), optional
        The tags around reasoning (``("<think>", "</think>")``); None when the family has none.
    thinking_forced_open : bool
        Whether the generation prompt already opened the reasoning block (Qwen3 thinking and
        DeepSeek R1 templates end the prompt with ``<think>\\n``): the reply then starts inside
        reasoning.
    tools : list of dict, optional
        The tools of the request (OpenAI shape); their parameter schemas type the values of
        XML-style formats (a parameter declared as a string stays text, others are read as JSON).

    Attributes
    ----------
    name : str
        The family (``"hermes"``, ``"mistral"``, ...).
    """

    name = "generic"

    def __init__(self, *, reasoning_tags: Optional[tuple[str, str]] = None, thinking_forced_open: bool = False,
                 tools: Any = None):
        self.reasoning_tags = tuple(reasoning_tags) if reasoning_tags else None
        self.thinking_forced_open = bool(thinking_forced_open and self.reasoning_tags)
        self.tools = function_tools(tools)
        self._schemas = {t["name"]: (t["parameters"].get("properties") or {}) for t in self.tools}
        self._blocks: tuple[_Block, ...] = self._make_blocks()
        self._bare: Optional[tuple[tuple[str, ...], Callable[[str], list]]] = self._make_bare()
        self._drop: tuple[str, ...] = ()

    def __repr__(self) -> str:
        return (f"<{type(self).__name__} {self.name!r} reasoning_tags={self.reasoning_tags} "
                f"thinking_forced_open={self.thinking_forced_open}>")

    # -- public -----------------------------------------------------------------------------------

    def parse(self, text: str) -> Reply:
        """Split a whole reply into content, reasoning and tool calls.

        Never raises on what a model writes: markup that does not parse as a tool call (invalid
        JSON, an unknown shape, nesting deeper than :data:`ggmlpy.chat.MAX_JSON_DEPTH`) stays in
        the content, and an unclosed reasoning block is reasoning to the end.

        Raises
        ------
        GGMLTypeError
            ``text`` is not a str.

        Examples
        --------
        >>> from ggmlpy.chat import chat_format
        >>> fmt = chat_format("{{ '<think>' }}{{ '<tool_call>' }}")
        >>> r = fmt.parse('<think>sunny?</think>Checking.<tool_call>{"name": "w", "arguments": {"c": 1}}'
        ...               '</tool_call>')
        >>> r.content, r.reasoning, r.tool_calls[0].name, r.tool_calls[0].arguments
        ('Checking.', 'sunny?', 'w', {'c': 1})
        """
        if not isinstance(text, str):
            raise GGMLTypeError(f"ChatFormat.parse: text must be a str, not {type(text).__name__}")
        s = self.stream()
        s.feed(text)
        s.finish()
        return s.reply

    def stream(self) -> ReplyStream:
        """A :class:`ReplyStream` for one reply in this format."""
        return ReplyStream(self)

    def tool_grammar(self, tools: Any, tool_choice: Any = "auto") -> Optional[str]:
        """An llguidance Lark grammar that forces one tool call in this format, or None.

        For ``tool_choice="required"`` the call is to any of ``tools``; for
        ``{"type": "function", "function": {"name": ...}}`` to that one; its arguments follow the
        tool's ``parameters`` schema (``%json``). Where the prompt opened the reasoning block the
        grammar first lets the reasoning run to its closing tag, and where a format has optional
        reasoning it may come first. ``"auto"`` and ``"none"`` give None (nothing to force). What
        the grammar accepts, :meth:`parse` reads back as that call.

        Raises
        ------
        GGMLValueError
            An unknown tool_choice, a function not among ``tools``, or a format that writes no
            tool calls.
        GGMLTypeError
            ``tools`` is not a list of dicts.
        """
        chosen = chosen_tools(tools, tool_choice)
        if chosen is None:
            return None
        g = Lark()
        calls = " | ".join(f"({self._grammar_call(g, t['name'], t['parameters'])})" for t in chosen)
        return g.text(f"{self._grammar_prefix(g)}({calls})")

    # -- the scan (see stream.py) -------------------------------------------------------------------

    def _make_blocks(self) -> tuple[_Block, ...]:
        return ()

    def _make_bare(self):
        """(keys, parser) for a reply that is a bare JSON object starting with one of ``keys``."""
        return (("tool_call", "tool_calls"), B.generic) if self.tools else None

    def _initial_state(self) -> Any:
        if self.thinking_forced_open:
            return "reasoning"
        return "start" if self._bare else "content"

    def _markers(self, state: Any) -> tuple[str, ...]:
        if state == "content":
            opens = tuple(b.open for b in self._blocks)
            return ((self.reasoning_tags[0],) if self.reasoning_tags else ()) + opens + self._drop
        if state == "reasoning":
            return self.reasoning_tags or ()
        if state in ("start", "header", "recipient"):
            return ()
        return self._blocks[state[1]].close

    def _sink(self, state: Any) -> str:
        return state if state in ("content", "reasoning") else "capture"

    def _viable(self, state: Any, captured: str) -> bool:
        if state != "start":
            return True
        return _json_key_start(captured[:64], self._bare[0])

    def _on_marker(self, stream: ReplyStream, state: Any, marker: Optional[str]) -> Any:
        if state == "content":
            if marker is None or marker in self._drop:
                return "content"
            if self.reasoning_tags and marker == self.reasoning_tags[0]:
                return "reasoning"
            return ("block", next(i for i, b in enumerate(self._blocks) if b.open == marker))
        if state == "reasoning":
            # a reasoning block ends at its tag; an opening tag inside one (re-emitted) is dropped
            if marker != self.reasoning_tags[1]:
                return "reasoning"
            # a bare JSON call may follow the reasoning, where it would have opened the reply
            return "start" if self._bare and not stream.reply.content and not stream.reply.tool_calls else "content"
        if state == "start":
            body = stream._take_capture()
            if marker == "":           # not a bare JSON call after all: scan it as content
                stream._buf = body + stream._buf
                return "content"
            self._close(stream, body, self._bare[1], body)
            return "content"
        block = self._blocks[state[1]]
        body = stream._take_capture()
        self._close(stream, body, block.parse, block.open + body + (marker or ""))
        return "content"

    def _close(self, stream: ReplyStream, body: str, parse: Callable[[str], list], raw: str) -> None:
        try:
            calls = parse(body)
        except B.NoParse:
            calls = None
        except (RecursionError, ValueError, TypeError):   # a parser's own limits, never the caller's
            calls = None
        if calls:
            stream._emit_calls(calls)
        else:
            stream._emit_content(raw)

    def _schema(self, name: str) -> Optional[dict]:
        return self._schemas.get(name)

    # -- the grammar --------------------------------------------------------------------------------

    def _grammar_prefix(self, g: Lark) -> str:
        if not self.reasoning_tags:
            return ""
        if self.thinking_forced_open:
            return f"{g.until(self.reasoning_tags[1])} /[ \\n]*/ "
        return f"({lit(self.reasoning_tags[0])} {g.until(self.reasoning_tags[1])} /[ \\n]*/)? "

    def _grammar_call(self, g: Lark, name: str, parameters: Mapping) -> str:
        head = '{"tool_call": {"name": ' + _q(name) + ', "arguments": '
        return f'{lit(head)} {g.json(parameters)} {lit("}}")}'


def _q(s: str) -> str:
    """``s`` as a JSON string."""
    return json.dumps(s, ensure_ascii=False)


def _json_key_start(text: str, keys: tuple[str, ...]) -> bool:
    """Whether ``text`` is, or may still become, ``{"<key>":`` for one of ``keys`` (after
    whitespace): the start of a bare JSON call."""
    s = text.lstrip()
    if not s:
        return True
    if s[0] != "{":
        return False
    rest = s[1:].lstrip()
    if not rest:
        return True
    for key in keys:
        q = f'"{key}"'
        if rest.startswith(q):
            tail = rest[len(q):].lstrip()
            return not tail or tail[0] == ":"
        if q.startswith(rest):
            return True
    return False


# -- the block formats ------------------------------------------------------------------------------


class Hermes(ChatFormat):
    """``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` (Hermes 2/3, Qwen 2.5/3, QwQ, Granite 4)."""

    name = "hermes"

    def _make_blocks(self):
        return (_Block("<tool_call>", ("</tool_call>",), B.json_object),)

    def _make_bare(self):
        return None

    def _grammar_call(self, g, name, parameters):
        head = '<tool_call>\n{"name": ' + _q(name) + ', "arguments": '
        return f'{lit(head)} {g.json(parameters)} {lit("}" + NL + "</tool_call>")}'


class Qwen3Coder(ChatFormat):
    """``<tool_call><function=name><parameter=k>v</parameter></function></tool_call>`` (Qwen3-Coder,
    Qwen3.5, Nemotron 3, StepFun 3.5); ``<seed:tool_call>`` and ``<seed:think>`` for Seed-OSS."""

    name = "qwen3_coder"

    def __init__(self, *, open_tag: str = "<tool_call>", close_tag: str = "</tool_call>", **kw):
        self._tags = (open_tag, close_tag)
        super().__init__(**kw)

    def _make_blocks(self):
        return (_Block(self._tags[0], (self._tags[1],), lambda body: B.qwen3_coder(body, self._schema)),)

    def _make_bare(self):
        return None

    def _grammar_call(self, g, name, parameters):
        def wrap(k, v, text):   # free text takes its own newlines; JSON gets the template's
            nl = "" if text else NL
            return f'{lit(f"<parameter={k}>" + nl)} {v} {lit(nl + "</parameter>" + NL)}'

        params = xml_params(g, parameters, wrap)
        return f'{lit(self._tags[0] + NL + f"<function={name}>" + NL)} {params} ' \
               f'{lit("</function>" + NL + self._tags[1])}'


class Glm45(ChatFormat):
    """``<tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>`` (GLM 4.5-4.7,
    Laguna, Ling 3, Spark)."""

    name = "glm_4_5"

    def _make_blocks(self):
        return (_Block("<tool_call>", ("</tool_call>",), lambda body: B.glm(body, self._schema)),)

    def _make_bare(self):
        return None

    def _grammar_call(self, g, name, parameters):
        params = xml_params(g, parameters, lambda k, v, _: f'{lit(f"<arg_key>{k}</arg_key><arg_value>")} {v} '
                                                        f'{lit("</arg_value>")}')
        return f'{lit("<tool_call>" + name)} {params} {lit("</tool_call>")}'


class MiniMaxM2(ChatFormat):
    """``<minimax:tool_call><invoke name="f"><parameter name="k">v</parameter></invoke></minimax:tool_call>``."""

    name = "minimax_m2"

    def _make_blocks(self):
        return (_Block("<minimax:tool_call>", ("</minimax:tool_call>",),
                       lambda body: B.minimax(body, self._schema)),)

    def _make_bare(self):
        return None

    def _grammar_call(self, g, name, parameters):
        params = xml_params(g, parameters,
                            lambda k, v, _: f'{lit(f"<parameter name={_q(k)}>")} {v} {lit("</parameter>")}')
        return f'{lit(f"<minimax:tool_call>{NL}<invoke name={_q(name)}>")} {params} ' \
               f'{lit("</invoke>" + NL + "</minimax:tool_call>")}'
