"""Tool-call grammars: llguidance Lark text that forces one call in a format's syntax.

:meth:`ChatFormat.tool_grammar` builds the grammar from pieces each format gives (the markup around
one call, and for XML-style formats around each parameter); this module holds what they share:
the checks of ``tools`` and ``tool_choice``, Lark literals, ``%json`` rules for argument schemas.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from ggmlpy._core import GGMLTypeError, GGMLValueError

__all__ = ["function_tools", "chosen_tools"]


def function_tools(tools: Any) -> list[dict]:
    """``tools`` as a list of ``{"name", "parameters", ...}`` function dicts.

    Accepts OpenAI's ``{"type": "function", "function": {...}}`` and bare function dicts.

    Raises
    ------
    GGMLTypeError
        ``tools`` is not a list of dicts.
    GGMLValueError
        A tool has no name, or a name given twice.
    """
    if tools is None:
        return []
    if isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence):
        raise GGMLTypeError(f"tools must be a list of dicts, not {type(tools).__name__}")
    out, seen = [], set()
    for tool in tools:
        if not isinstance(tool, Mapping):
            raise GGMLTypeError(f"each tool must be a dict, not {type(tool).__name__}")
        fn = tool.get("function", tool) if tool.get("type", "function") == "function" else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise GGMLValueError(f"a tool must be {{'type': 'function', 'function': {{'name': ...}}}} "
                                 f"(got {str(dict(tool))[:200]})")
        if fn["name"] in seen:
            raise GGMLValueError(f"tool {fn['name']!r} is given twice")
        seen.add(fn["name"])
        params = fn.get("parameters")
        if params is not None and not isinstance(params, Mapping):
            raise GGMLTypeError(f"tool {fn['name']!r}: parameters must be a JSON-schema dict")
        out.append({"name": fn["name"], "parameters": dict(params or {"type": "object"})})
    return out


def chosen_tools(tools: Any, tool_choice: Any) -> Optional[list[dict]]:
    """The tools a call must be made to: all for ``"required"``, one for a named function, None for
    ``"auto"`` and ``"none"``.

    Raises
    ------
    GGMLValueError
        An unknown ``tool_choice``, a named function not among ``tools``, ``"required"`` without
        tools.
    """
    fns = function_tools(tools)
    if tool_choice in (None, "auto", "none"):
        return None
    if tool_choice == "required":
        if not fns:
            raise GGMLValueError("tool_choice='required' needs tools")
        return fns
    if isinstance(tool_choice, Mapping):
        fn = tool_choice.get("function", tool_choice)
        name = fn.get("name") if isinstance(fn, Mapping) else None
        for f in fns:
            if f["name"] == name:
                return [f]
        raise GGMLValueError(f"tool_choice names {name!r}, which is not among the tools "
                             f"({[f['name'] for f in fns]})")
    raise GGMLValueError(f"tool_choice must be 'auto', 'none', 'required' or "
                         f"{{'type': 'function', 'function': {{'name': ...}}}}, not {tool_choice!r}")


def lit(text: str) -> str:
    """``text`` as a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


class Lark:
    """A grammar under construction: named rules, and the ``start`` rule last."""

    def __init__(self):
        self.rules: list[str] = []

    def rule(self, body: str, attrs: str = "") -> str:
        name = f"r{len(self.rules)}"
        self.rules.append(f"{name}{attrs}: {body}")
        return name

    def json(self, schema: Any) -> str:
        """A rule for one JSON value of ``schema``, with at most 20 whitespace characters at each place
        JSON allows them (as ``ggmlpy.sampling.grammar.JSON_OPTIONS``): llguidance's default whitespace
        is unbounded, and a model could write it forever inside a tool call."""
        if isinstance(schema, dict) and "x-guidance" not in schema:
            schema = {**schema, "x-guidance": {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,20}"}}
        return self.rule("%json " + json.dumps(schema, ensure_ascii=False))

    def until(self, stop: str) -> str:
        """A rule for any text up to and including the first ``stop`` (a reasoning block)."""
        return self.rule(f"/(?s:.*)/ {lit(stop)}", "[lazy]")

    def text(self, start: str) -> str:
        return "\n".join([f"start: {start}", *self.rules]) + "\n"


def string_schema(schema: Any) -> bool:
    kind = schema.get("type") if isinstance(schema, Mapping) else None
    return kind == "string" or kind == ["string"]


def xml_params(g: Lark, parameters: Mapping, wrap) -> str:
    """The parameters of an XML-style call, in schema order, required ones mandatory:
    ``wrap(key, value_rule, is_string)`` gives one parameter's markup. Strings are free text without
    ``<``, other values JSON by their schema."""
    props = parameters.get("properties") or {}
    required = set(parameters.get("required") or ())
    parts = []
    for key, schema in props.items():
        value = g.rule(r"/[^<]*/") if string_schema(schema) else g.json(schema)
        piece = wrap(key, value, string_schema(schema))
        parts.append(piece if key in required else f"({piece})?")
    return " ".join(parts) if parts else '""'
