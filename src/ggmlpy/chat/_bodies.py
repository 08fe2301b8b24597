"""Tool-call bodies to calls: the JSON and XML-ish shapes the formats use.

Each parser takes the text between a format's markers and returns a list of
``(name, arguments, id or None)`` or raises :class:`NoParse`; the caller then keeps the text as
content. JSON is read with a bounded nesting depth (:data:`MAX_JSON_DEPTH`), so a hostile reply
cannot reach Python's recursion limit.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Optional

#: deeper JSON than this is not a tool call (checked before decoding)
MAX_JSON_DEPTH = 64

Call = tuple[str, Any, Optional[str]]


class NoParse(Exception):
    """The text is not a tool call of this format."""


def _depth_ok(text: str) -> bool:
    depth = 0
    in_str = esc = False
    for ch in text:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            if depth > MAX_JSON_DEPTH:
                return False
        elif ch in "]}":
            depth -= 1
    return True


def loads(text: str) -> Any:
    """``json.loads`` of the whole (stripped) text, bounded; :class:`NoParse` on any failure."""
    text = text.strip()
    if not text or not _depth_ok(text):
        raise NoParse
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # also ints past Python's digit limit
        raise NoParse from None


def loads_prefix(text: str) -> tuple[Any, str]:
    """The JSON value at the start of ``text`` (after whitespace) and the text after it."""
    text = text.lstrip()
    if not _depth_ok(text):
        raise NoParse
    try:
        value, end = json.JSONDecoder().raw_decode(text)
    except (ValueError, RecursionError):
        raise NoParse from None
    return value, text[end:]


def _name(value: Any) -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > 256:
        raise NoParse
    return value.strip()


def _arguments(value: Any) -> Any:
    """Arguments given as an object, or as a JSON string of one (OpenAI's shape)."""
    if isinstance(value, str):
        return loads(value)
    return value


def name_arguments(obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters"),
                   name_key: str = "name", id_key: Optional[str] = None) -> Call:
    """``{"name": ..., "arguments": {...}}`` (and the key variants formats use)."""
    if not isinstance(obj, dict) or name_key not in obj:
        raise NoParse
    for key in args_keys:
        if key in obj:
            args = _arguments(obj[key])
            break
    else:
        args = {}
    call_id = obj.get(id_key) if id_key else None
    if call_id is not None and not isinstance(call_id, (str, int)):
        raise NoParse
    return _name(obj[name_key]), args, None if call_id is None else str(call_id)


def json_object(text: str) -> list[Call]:
    """One ``{"name", "arguments"}`` object (Hermes, Qwen, Llama 3.x's ``parameters``)."""
    return [name_arguments(loads(text))]


def json_list(text: str, **keys: Any) -> list[Call]:
    """A JSON array of call objects (Mistral Nemo, Command-R)."""
    value = loads(text)
    if not isinstance(value, list) or not value:
        raise NoParse
    return [name_arguments(v, **keys) for v in value]


def typed_value(raw: str, schema: Optional[dict]) -> Any:
    """An XML-style parameter's text as the value its schema asks for: strings stay text, other
    types are read as JSON (falling back to the text); without a schema, JSON if it reads as an
    object, array, number, boolean or null, else the text."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "string" or (isinstance(kind, list) and "string" in kind and len(kind) == 1):
        return raw
    try:
        return loads(raw)
    except NoParse:
        return raw


Schemas = Callable[[str], Optional[dict]]


def _params(pairs: list[tuple[str, str]], name: str, schemas: Schemas) -> dict:
    props = schemas(name) or {}
    return {k: typed_value(v, props.get(k)) for k, v in pairs}


def _only(text: str, pattern: re.Pattern) -> list[re.Match]:
    """All matches of ``pattern``, which must cover ``text`` but for whitespace."""
    found, pos = [], 0
    for m in pattern.finditer(text):
        if text[pos:m.start()].strip():
            raise NoParse
        found.append(m)
        pos = m.end()
    if text[pos:].strip() or not found:
        raise NoParse
    return found


def _strip_nl(value: str) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


def qwen3_coder(text: str, schemas: Schemas) -> list[Call]:
    """``<function=name><parameter=k>v</parameter>...</function>`` (Qwen3-Coder, Nemotron 3)."""
    calls = []
    for f in _only(text, _FUNCTION):
        name = _name(f.group(1))
        body = f.group(2)
        pairs = [(p.group(1).strip(), _strip_nl(p.group(2))) for p in _only(body, _PARAMETER)] \
            if body.strip() else []
        calls.append((name, _params(pairs, name, schemas), None))
    return calls


_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def glm(text: str, schemas: Schemas) -> list[Call]:
    """``name<arg_key>k</arg_key><arg_value>v</arg_value>...`` (GLM 4.5-4.7, Laguna, Ling)."""
    head, sep, rest = text.partition("<arg_key>")
    name = _name(head)
    pairs = [(m.group(1).strip(), m.group(2)) for m in _only(sep + rest, _ARG)] if sep else []
    return [(name, _params(pairs, name, schemas), None)]


_INVOKE = re.compile(r'<invoke name="([^"]+)">(.*?)</invoke>', re.S)
_PARAM_NAMED = re.compile(r'<parameter name="([^"]+)">(.*?)</parameter>', re.S)


def minimax(text: str, schemas: Schemas) -> list[Call]:
    """``<invoke name="f"><parameter name="k">v</parameter></invoke>`` (MiniMax M2)."""
    calls = []
    for inv in _only(text, _INVOKE):
        name = _name(inv.group(1))
        body = inv.group(2)
        pairs = [(p.group(1), p.group(2)) for p in _only(body, _PARAM_NAMED)] if body.strip() else []
        calls.append((name, _params(pairs, name, schemas), None))
    return calls


_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")


def mistral(text: str) -> list[Call]:
    """After ``[TOOL_CALLS]``: a JSON array (Nemo), ``name[CALL_ID]id[ARGS]{...}`` (Small 3.2) or
    ``name[ARGS]{...}`` (Ministral, Devstral), the last two repeated with ``[TOOL_CALLS]``."""
    calls: list[Call] = []
    for part in text.split("[TOOL_CALLS]"):
        part = part.strip()
        if part.startswith("["):
            calls.extend(json_list(part, id_key="id"))
            continue
        head, sep, args = part.partition("[ARGS]")
        if not sep:
            raise NoParse
        name, _, call_id = head.partition("[CALL_ID]")
        call_id = call_id.strip() or None
        if call_id is not None and not _MISTRAL_ID.fullmatch(call_id):
            raise NoParse
        calls.append((_name(name), loads(args), call_id))
    return calls


_DS_CALL = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>", re.S)
_DS_FENCE = re.compile(r"\s*(\S[^\n]*)\n```(?:json)?\n(.*?)\n?```\s*", re.S)


def deepseek(text: str) -> list[Call]:
    """``<｜tool▁call▁begin｜>function<｜tool▁sep｜>name\\n```json\\n{...}\\n```<｜tool▁call▁end｜>``
    (R1) or ``<｜tool▁call▁begin｜>name<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`` (V3.1), repeated."""
    calls = []
    for m in _only(text, _DS_CALL):
        head, body = m.group(1).strip(), m.group(2)
        if head == "function":
            fence = _DS_FENCE.fullmatch(body)
            if not fence:
                raise NoParse
            calls.append((_name(fence.group(1)), loads(fence.group(2)), None))
        else:
            calls.append((_name(head), loads(body), None))
    return calls


_KIMI_CALL = re.compile(r"<\|tool_call_begin\|>(.*?)<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>", re.S)


def kimi(text: str) -> list[Call]:
    """``<|tool_call_begin|>functions.name:0<|tool_call_argument_begin|>{...}<|tool_call_end|>``; the id
    is ``functions.name:0`` as the model wrote it."""
    calls = []
    for m in _only(text, _KIMI_CALL):
        call_id = m.group(1).strip()
        name = call_id.rsplit(":", 1)[0] if ":" in call_id else call_id
        name = name.split(".", 1)[1] if name.startswith("functions.") else name
        calls.append((_name(name), loads(m.group(2)), call_id))
    return calls


def command_r(text: str) -> list[Call]:
    """A JSON array of ``{"tool_call_id", "tool_name", "parameters"}`` (Command-R7B, Cohere2)."""
    return json_list(text, name_key="tool_name", args_keys=("parameters",), id_key="tool_call_id")


def function_tag(text: str) -> list[Call]:
    """After ``<function=``: ``name>{...}`` (Functionary v3.1)."""
    name, sep, args = text.partition(">")
    if not sep:
        raise NoParse
    return [(_name(name), loads(args), None)]


def generic(text: str) -> list[Call]:
    """llama.cpp's generic JSON: ``{"tool_call": {...}}`` or ``{"tool_calls": [...]}``."""
    value = loads(text)
    if not isinstance(value, dict):
        raise NoParse
    if set(value) == {"tool_call"}:
        return [name_arguments(value["tool_call"], id_key="id")]
    if set(value) == {"tool_calls"} and isinstance(value["tool_calls"], list) and value["tool_calls"]:
        return [name_arguments(v, id_key="id") for v in value["tool_calls"]]
    raise NoParse
