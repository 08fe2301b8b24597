"""The other families: JSON-after-a-marker formats (Mistral, DeepSeek, Kimi K2, Command-R, Functionary
v3.1, Llama 3.x) and the two with their own state machines (gpt-oss harmony, Functionary v3.2)."""

from __future__ import annotations

import re
from typing import Any, Optional

from . import _bodies as B
from .formats import NL, ChatFormat, _Block, _q
from .grammar import lit
from .stream import ReplyStream

__all__ = ["CommandR", "DeepSeek", "FunctionaryV31", "FunctionaryV32", "GptOss", "JsonArray", "KimiK2", "Llama3",
           "Mistral"]


class Mistral(ChatFormat):
    """``[TOOL_CALLS]`` then a JSON array (Nemo), ``name[CALL_ID]id[ARGS]{...}`` (Small 3.2) or
    ``name[ARGS]{...}`` (Ministral 3, Devstral); reasoning in ``[THINK]...[/THINK]``."""

    name = "mistral"

    def __init__(self, *, style: str = "json", **kw):
        self.style = style   # "json", "call_id" or "args": what tool_grammar writes
        super().__init__(**kw)

    def _make_blocks(self):
        return (_Block("[TOOL_CALLS]", (), B.mistral),)

    def _make_bare(self):
        return None

    def _grammar_call(self, g, name, parameters):
        if self.style == "call_id":
            return f'{lit(f"[TOOL_CALLS]{name}[CALL_ID]")} /[a-zA-Z0-9]{{9}}/ "[ARGS]" {g.json(parameters)}'
        if self.style == "args":
            return f'{lit(f"[TOOL_CALLS]{name}[ARGS]")} {g.json(parameters)}'
        head = '[TOOL_CALLS][{"name": ' + _q(name) + ', "arguments": '
        return f'{lit(head)} {g.json(parameters)} {lit(", " + _q("id") + ": " + chr(34))} /[a-zA-Z0-9]{{9}}/ ' \
               f'{lit(chr(34) + "}]")}'


class DeepSeek(ChatFormat):
    """``<｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜>`` with R1's fenced JSON or V3.1's plain JSON;
    reasoning in ``<think>``."""

    name = "deepseek"

    def __init__(self, *, fenced: bool = True, **kw):
        self.fenced = fenced   # R1's "function<｜tool▁sep｜>name\n```json" (what tool_grammar writes)
        super().__init__(**kw)

    def _make_blocks(self):
        return (_Block("<｜tool▁calls▁begin｜>", ("<｜tool▁calls▁end｜>",), B.deepseek),)

    def _make_bare(self):
        return None

    def _grammar_call(self, g, name, parameters):
        if self.fenced:
            head = f"<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n"
            tail = "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
        else:
            head = f"<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{name}<｜tool▁sep｜>"
            tail = "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
        return f"{lit(head)} {g.json(parameters)} {lit(tail)}"


class KimiK2(ChatFormat):
    """``<|tool_calls_section_begin|><|tool_call_begin|>functions.name:0<|tool_call_argument_begin|>{...}
    <|tool_call_end|><|tool_calls_section_end|>``; the id is the model's ``functions.name:0``."""

    name = "kimi_k2"

    def _make_blocks(self):
        return (_Block("<|tool_calls_section_begin|>", ("<|tool_calls_section_end|>",), B.kimi),)

    def _make_bare(self):
        return None

    def _grammar_call(self, g, name, parameters):
        head = f"<|tool_calls_section_begin|><|tool_call_begin|>functions.{name}:0<|tool_call_argument_begin|>"
        return f'{lit(head)} {g.json(parameters)} {lit("<|tool_call_end|><|tool_calls_section_end|>")}'


class CommandR(ChatFormat):
    """``<|START_ACTION|>[{"tool_call_id", "tool_name", "parameters"}]<|END_ACTION|>``; reasoning in
    ``<|START_THINKING|>...<|END_THINKING|>``; the response markers are dropped (Command-R7B, Cohere2)."""

    name = "command_r"

    def __init__(self, **kw):
        super().__init__(**kw)
        self._drop = ("<|START_RESPONSE|>", "<|END_RESPONSE|>", "<|START_TEXT|>", "<|END_TEXT|>")

    def _make_blocks(self):
        return (_Block("<|START_ACTION|>", ("<|END_ACTION|>",), B.command_r),)

    def _make_bare(self):
        return None

    def _grammar_call(self, g, name, parameters):
        head = '<|START_ACTION|>[\n    {"tool_call_id": "0", "tool_name": ' + _q(name) + ', "parameters": '
        return f'{lit(head)} {g.json(parameters)} {lit("}" + NL + "]<|END_ACTION|>")}'


def _python_call(body: str) -> list:
    """``<|python_tag|>``'s body: a JSON call, or Llama's ``tool.call(k="v", ...)`` for built-in
    tools, or else code for the ``python`` tool."""
    try:
        return B.json_object(body)
    except B.NoParse:
        pass
    m = re.fullmatch(r"\s*(\w+)\.call\((.*)\)\s*", body, re.S)
    if m:
        args, rest = {}, m.group(2).strip()
        for kv in re.finditer(r'\s*(\w+)\s*=\s*("(?:[^"\\]|\\.)*")\s*(,|$)', rest):
            args[kv.group(1)] = B.loads(kv.group(2))
        return [(m.group(1), args, None)]
    if not body.strip():
        raise B.NoParse
    return [("python", {"code": body}, None)]


class Llama3(ChatFormat):
    """A reply that is one JSON object ``{"name": ..., "parameters": ...}`` (Llama 3.1-3.3's custom
    tools), or ``<|python_tag|>`` and a built-in tool's call. A reply starting with ``{`` is held
    until it is known not to be such an object (or to its end)."""

    name = "llama3"

    def _make_blocks(self):
        return (_Block("<|python_tag|>", (), _python_call),)

    def _make_bare(self):
        return ("name", "type"), B.json_object

    def _grammar_call(self, g, name, parameters):
        head = '{"name": ' + _q(name) + ', "parameters": '
        return f'{lit(head)} {g.json(parameters)} "}}"'


class FunctionaryV31(Llama3):
    """``<function=name>{...}</function>`` (Functionary v3.1 on Llama 3.1), ``<|python_tag|>`` for code."""

    name = "functionary_v3_1"

    def _make_blocks(self):
        return (_Block("<function=", ("</function>",), B.function_tag), _Block("<|python_tag|>", (), _python_call))

    def _make_bare(self):
        return None

    def _grammar_call(self, g, name, parameters):
        return f'{lit(f"<function={name}>")} {g.json(parameters)} "</function>"'


class JsonArray(ChatFormat):
    """A JSON array of ``{"name", "arguments"}`` between tags: ``<tool_calls>[...]</tool_calls>``
    (Apriel 1.5), ``<TOOLCALL>[...]</TOOLCALL>`` (Nemotron Nano v2)."""

    name = "json_array"

    def __init__(self, *, open_tag: str = "<tool_calls>", close_tag: str = "</tool_calls>", **kw):
        self._tags = (open_tag, close_tag)
        super().__init__(**kw)

    def _make_blocks(self):
        return (_Block(self._tags[0], (self._tags[1],), B.json_list),)

    def _make_bare(self):
        return None

    def _grammar_call(self, g, name, parameters):
        head = self._tags[0] + '[{"name": ' + _q(name) + ', "arguments": '
        return f'{lit(head)} {g.json(parameters)} {lit("}]" + self._tags[1])}'


# -- own state machines -------------------------------------------------------------------------------


class GptOss(ChatFormat):
    """gpt-oss's harmony messages: ``<|channel|>analysis<|message|>...`` (reasoning),
    ``<|channel|>final<|message|>...`` (content), ``to=functions.name ... <|message|>{...}<|call|>``
    (a call), each ended by ``<|end|>``, ``<|call|>``, ``<|return|>`` or the next ``<|start|>``."""

    name = "gpt_oss"
    _ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")
    _CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
    _TO = re.compile(r"to=functions\.([^\s<]+)")

    def __init__(self, **kw):
        kw.pop("reasoning_tags", None)
        super().__init__(**kw)
        self.reasoning_tags = ("<|channel|>analysis<|message|>", "<|end|>")
        self.thinking_forced_open = False

    def _make_bare(self):
        return None

    def _initial_state(self):
        return "header"

    def _markers(self, state):
        return ("<|message|>",) if state == "header" else self._ENDS

    def _sink(self, state):
        if state == "header" or isinstance(state, tuple):
            return "capture"
        return "reasoning" if state == "analysis" else "content"

    def _on_marker(self, stream: ReplyStream, state: Any, marker: Optional[str]) -> Any:
        if state == "header":
            header = stream._take_capture()
            if marker is None:      # text that never opened a message: content, markup aside
                if "<|channel|>" not in header:
                    stream._emit_content(header)
                return "header"
            to = self._TO.search(header)
            if to:
                return ("call", to.group(1), header + marker)
            channel = self._CHANNEL.search(header)
            return "analysis" if channel and channel.group(1) == "analysis" else "final"
        if isinstance(state, tuple):
            body = stream._take_capture()
            self._close(stream, body, lambda b: [(state[1], B.loads(b), None)], state[2] + body + (marker or ""))
        return "header"

    def _grammar_prefix(self, g):
        return f'("<|channel|>analysis<|message|>" {g.until("<|end|>")} "<|start|>assistant")? '

    def _grammar_call(self, g, name, parameters):
        head = f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"
        return f'{lit(head)} {g.json(parameters)} "<|call|>"'


class FunctionaryV32(ChatFormat):
    """Functionary v3.2's ``>>>recipient\\n`` sections after the prompt's ``>>>``: ``all`` is content,
    any other recipient a call whose body is its JSON arguments (``python``: code)."""

    name = "functionary_v3_2"

    def _make_bare(self):
        return None

    def _initial_state(self):
        return "recipient"

    def _markers(self, state):
        return ("\n", ">>>") if state == "recipient" else (">>>",)

    def _sink(self, state):
        return "content" if state == "content" else "capture"

    def _on_marker(self, stream: ReplyStream, state: Any, marker: Optional[str]) -> Any:
        if state == "content":
            return "recipient"
        body = stream._take_capture()
        if state == "recipient":
            name = body.strip()
            if name == "all" and marker != ">>>":
                return "content"
            if marker == "\n" and re.fullmatch(r"[\w.\-]{1,256}", name):
                return ("call", name)
            stream._emit_content(body + (marker if marker == "\n" else ""))
            return "recipient" if marker == ">>>" else "content"

        def parse(b: str) -> list:
            try:
                return [(state[1], B.loads(b), None)]
            except B.NoParse:
                if state[1] == "python" and b.strip():
                    return [("python", {"code": b}, None)]
                raise

        self._close(stream, body, parse, state[1] + "\n" + body)
        return "recipient"

    def _grammar_prefix(self, g):
        return ""

    def _grammar_call(self, g, name, parameters):
        return f"{lit(name + NL)} {g.json(parameters)}"
