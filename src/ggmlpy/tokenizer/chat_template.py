"""Chat templates: render a GGUF's ``tokenizer.chat_template`` as Hugging Face transformers does, safely.

A GGUF file carries its model's chat template as a Jinja2 source string (the Hugging Face
convention). :class:`ChatTemplate` compiles it once and renders conversations to the prompt
string the model was trained on, with the same result as transformers'
``tokenizer.apply_chat_template(messages, tokenize=False, ...)``:

* the same Jinja environment: :class:`jinja2.sandbox.ImmutableSandboxedEnvironment` with
  ``trim_blocks=True``, ``lstrip_blocks=True``, the ``loopcontrols`` extension
  (``{% break %}``, ``{% continue %}``) and a ``{% generation %}...{% endgeneration %}`` tag
  whose body renders unchanged;
* the same helpers: ``raise_exception(msg)``, ``strftime_now(fmt)``, a ``tojson`` filter that
  calls :func:`json.dumps` with ``ensure_ascii=False`` (and accepts ``indent``, ``separators``,
  ``sort_keys``), a ``dict`` that only builds dicts, and a ``namespace`` that refuses names
  starting with ``_``;
* the same variables: ``messages``, ``tools``, ``documents``, ``add_generation_prompt``,
  ``bos_token``, ``eos_token`` and any extra keyword argument (transformers passes every
  special token of the tokenizer; here extra ones such as ``unk_token`` are keyword arguments);
* the same input preparation: keys whose value is ``None`` are dropped from each message,
  everything the template sees is rebuilt from plain JSON types (other objects become a
  ``"<TypeName>"`` placeholder), and a message's reasoning given as ``reasoning_content``,
  ``thinking`` or ``reasoning`` is visible under ``reasoning_content`` and ``thinking``;
* the same ``continue_final_message`` (prefill) handling.

Templates come from untrusted files, so rendering is bounded as well as sandboxed. Every
failure is a :class:`ChatTemplateError` whose ``kind`` and message say what went wrong and,
where it is known, at which template line:

* a syntax error, or a template calling ``raise_exception(...)``;
* an attribute the sandbox forbids (``__class__``, ``__globals__``, ``mro``, list/dict
  mutators, ...). transformers renders a forbidden attribute as an undefined value and only
  fails when that value is used further; here the access itself fails, so a template cannot
  even probe which internals exist;
* ``{% include %}``, ``{% import %}``, ``{% extends %}`` (there is no loader), when they run;
* a render that takes more than ``max_steps`` steps or ``max_seconds`` seconds, or recurses
  deeper than Python's stack. Steps approximate time: loop iterations, calls, filters,
  operators, membership tests by the length scanned, and values by their size;
* output of more than ``max_output`` characters, or any value the template builds that is
  larger than ``max_output`` plus the size of the inputs (a string's length; a container's
  elements counted through nested containers, 8 more each for the reference, so
  ``[[s] * 1000] * 1000`` counts a million ``s``, which is what printing it would cost);
* values held at once (one per ``{% set %}``, list element, macro frame or block buffer)
  that add up to more than twice that limit;
* turning into text anything but what a template can build: strings, numbers, booleans,
  None, undefined values, and lists, tuples, dicts, sets, dict views, ranges and namespaces
  of those. A function, method, class, generator, loop, macro or helper object (whose text
  would be an internal name and a memory address) is refused (kind ``"forbidden"``) in
  output, ``~``, ``%``, ``str.format``, string filters and ``raise_exception``'s message;
* inputs that contain themselves or nest deeper than :data:`MAX_INPUT_DEPTH` (kind
  ``"input"``).

Every operation that can build a value much larger than its operands (``str.format`` and
``format_map``, ``%``, ``*``, ``+``, ``**``, ``join``, ``replace``, padding, ``expandtabs``,
``split``, case mappings, ``encode``, ``dict.fromkeys``, the ``format``, ``join``, ``indent``,
``center``, ``wordwrap``, ``escape``, ``urlize``, ``urlencode``, ``list``, ``batch``,
``slice``, ``pprint``, ``string``, ``tojson``, ``lipsum``, ``range``, ...) has its result's
size estimated from its operands and is refused before it runs (``str.format`` field by
field), so memory stays bounded by a small multiple of ``max_output`` plus the inputs (and,
for values below a kilobyte, of the template's length), not only the output.

How the bounds are kept: :mod:`ggmlpy.tokenizer._sandbox` (the environment and its hooks),
:mod:`ggmlpy.tokenizer._limits` (the budget) and :mod:`ggmlpy.tokenizer._prechecks` (sizes
estimated before an operation runs).

Not supported (transformers has them): tools given as Python functions (pass JSON-schema
dicts), batches of conversations, and the assistant-token mask that ``{% generation %}``
blocks feed.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from jinja2.exceptions import SecurityError, TemplateSyntaxError

from ggmlpy._core import GGMLValueError

from ._limits import (
    _BUDGET,
    _HOLD_MIN_STRING,
    _ITEM_SIZE,
    DEFAULT_MAX_SECONDS,
    DEFAULT_MAX_STEPS,
    _Budget,
    _LimitExceeded,
)
from ._sandbox import _compile, _LoadForbidden, _TemplateRaised

__all__ = ["ChatTemplate", "ChatTemplateError"]

#: reasoning is accepted under these names; the first is the one templates read
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
#: appended to the final message for ``continue_final_message`` and cut off after rendering
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
#: what Jinja names a template compiled from a string, in code objects and tracebacks
_TEMPLATE_FILENAME = "<template>"
#: how deeply the inputs (messages, tools, extra variables) may nest
MAX_INPUT_DEPTH = 128


class ChatTemplateError(GGMLValueError):
    """A chat template that cannot be rendered.

    ``kind`` says why: ``"syntax"`` (does not parse or compile), ``"raised"`` (the template
    called ``raise_exception``), ``"forbidden"`` (an attribute or callable the sandbox
    forbids, or an object that may not turn into text), ``"load"``
    (``include``/``import``/``extends``), ``"steps"``, ``"time"``,
    ``"recursion"``, ``"range"`` (a ``range()`` longer than the sandbox's 100,000 items),
    ``"size"`` (a value, or the values held at once, too large), ``"output"`` (output too
    large), ``"input"`` (an input contains itself or nests too deeply), ``"memory"``,
    ``"continue"`` (``continue_final_message`` could not be honoured) or
    ``"error"`` (any other failure while rendering, such as a type error). ``lineno`` is the
    template line the failure happened at, when Jinja reports one.
    """

    def __init__(self, message: str, *, kind: str = "error", lineno: int | None = None):
        super().__init__(message)
        self.kind = kind
        self.lineno = lineno


# ---------------------------------------------------------------------------------------------
# Inputs


def _plain(value: Any, where: str) -> Any:
    """``value`` rebuilt from plain JSON-like types, as transformers rebuilds every input: rich
    objects (arrays, images, enums, ...) have methods the sandbox does not know to be
    dangerous. Subclasses of str/int/float become the base type, mappings dicts, dataclasses
    and pydantic models dicts of their fields, numpy scalars Python scalars, and anything else
    the placeholder ``"<TypeName>"``. A container met twice is rebuilt once (and shared).

    ``where`` names the input (``"messages"``): a value that contains itself, or nests deeper
    than :data:`MAX_INPUT_DEPTH`, raises :class:`ChatTemplateError` (kind ``"input"``) saying
    where."""
    done: dict[int, Any] = {}
    originals: list[Any] = []   # keeps the ids in ``done`` theirs (model_dump makes new dicts)
    path: list[Any] = []        # the keys from ``value`` down to the container being rebuilt
    active: set[int] = set()    # the containers being rebuilt: met again, a cycle

    def at() -> str:
        keys = path if where else path[1:]
        return (where or str(path[0])) + "".join(f"[{k!r}]" for k in keys)[:200]

    def rebuild(v: Any) -> Any:
        if v is None or type(v) in (str, int, float, bool):
            return v
        if isinstance(v, str):
            return str.__str__(v)
        if isinstance(v, int):
            return int.__int__(v)
        if isinstance(v, float):
            return float.__float__(v)
        numpy = sys.modules.get("numpy")  # no numpy imported: no numpy scalar can be here
        if numpy is not None and isinstance(v, numpy.generic):
            return rebuild(v.item())
        key = id(v)
        if key in done:
            return done[key]
        if key in active:
            raise ChatTemplateError(f"the chat template's input {at()} contains itself",
                                    kind="input")
        if isinstance(v, (Mapping, list, tuple)):
            items = v
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):
            items = {f.name: getattr(v, f.name) for f in dataclasses.fields(v)}
        elif callable(getattr(v, "model_dump", None)):
            items = v.model_dump()
            if not isinstance(items, Mapping):
                return rebuild(items)
        else:
            return f"<{type(v).__name__}>"
        if len(path) >= MAX_INPUT_DEPTH:
            raise ChatTemplateError(f"the chat template's input {at()} nests deeper than "
                                    f"{MAX_INPUT_DEPTH} levels", kind="input")
        active.add(key)
        if isinstance(items, Mapping):
            out: Any = {}
            for k, x in items.items():
                path.append(k)
                out[rebuild(k)] = rebuild(x)
                path.pop()
        else:
            out = []
            for i, x in enumerate(items):
                path.append(i)
                out.append(rebuild(x))
                path.pop()
            if isinstance(items, tuple):
                out = tuple(out)
        active.discard(key)
        done[key] = out
        originals.append(v)
        return out

    return rebuild(value)


def _measure(value: Any, known: dict[int, int], inputs: set[int]) -> tuple[int, int]:
    """The budget size of an input (see :meth:`_Budget.size`: shared parts counted each time
    they are reached, what printing it costs) and what it occupies (shared parts counted
    once); records each container's size, and the ids of its large strings."""
    distinct = 0

    def measure(v: Any) -> int:
        nonlocal distinct
        if isinstance(v, (str, bytes)):
            if len(v) >= _HOLD_MIN_STRING:
                if id(v) in inputs:
                    return 1 + len(v)
                inputs.add(id(v))
            distinct += 1 + len(v)
            return 1 + len(v)
        size = known.get(id(v))
        if size is not None:
            return size
        if isinstance(v, (list, tuple)):
            distinct += 1 + _ITEM_SIZE * len(v)
            size = 1 + sum(measure(x) + _ITEM_SIZE for x in v)
        elif isinstance(v, dict):
            distinct += 1 + 2 * _ITEM_SIZE * len(v)
            size = 1 + sum(measure(k) + measure(x) + 2 * _ITEM_SIZE for k, x in v.items())
        else:
            distinct += 1
            return 1
        known[id(v)] = size
        return size

    return measure(value), distinct


def _alias_reasoning(message: dict) -> dict:
    # Templates read ``reasoning_content`` (gpt-oss reads ``thinking``): fill both from
    # whichever name the caller used. Key order as transformers builds it, since templates
    # can iterate over a message.
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _prepare_messages(messages: Sequence[Any]) -> list[dict]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a list of dicts, not {type(messages).__name__}")
    if len(messages) == 0:
        raise ValueError("cannot apply a chat template to an empty conversation")
    prepared = []
    for message in _plain(list(messages), "messages"):
        if not isinstance(message, dict):
            raise TypeError(f"chat messages must be dicts (or dataclasses or pydantic models), "
                            f"got {message!r}")
        # like apply_chat_template: APIs send ``content=None``/``tool_calls=None``, which many
        # templates render as "None" or trip on, while they handle a missing key
        message = {k: v for k, v in message.items() if v is not None}
        prepared.append(_alias_reasoning(message))
    return prepared


# ---------------------------------------------------------------------------------------------


class ChatTemplate:
    """A compiled chat template, rendered in a bounded sandbox.

    ``source`` is the Jinja template (a GGUF's ``tokenizer.chat_template``); it is compiled
    here, once per distinct source in the process, and a template that does not parse raises
    :class:`ChatTemplateError` (kind ``"syntax"``). ``bos_token`` and ``eos_token`` are the
    values the template sees under those names. Limits per :meth:`render`:

    * ``max_output``: characters of output (and, plus the size of the inputs, of any value
      the template builds);
    * ``max_steps``: loop iterations, calls, filter applications and operators, together;
    * ``max_seconds``: wall-clock time, a backstop for steps that are individually slow.

    The compiled template is shared, so one ChatTemplate may render from several threads.
    """

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "",
                 max_output: int = 1 << 20, max_steps: int = DEFAULT_MAX_STEPS,
                 max_seconds: float = DEFAULT_MAX_SECONDS):
        if not isinstance(source, str):
            raise TypeError(f"a chat template is a str, not {type(source).__name__}")
        if max_output < 0 or max_steps < 0 or max_seconds < 0:
            raise ValueError("max_output, max_steps and max_seconds must not be negative")
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.max_output = max_output
        self.max_steps = max_steps
        self.max_seconds = max_seconds
        try:
            self._template, self._variables = _compile(source)
        except TemplateSyntaxError as exc:
            raise self._error("syntax", f"the chat template does not compile: {exc.message}",
                              exc, lineno=exc.lineno) from exc
        except RecursionError as exc:
            raise self._error("recursion", "the chat template is nested too deeply to compile",
                              exc) from exc
        except Exception as exc:  # e.g. Python refusing the generated code, or a budget error
            raise self._error(getattr(exc, "kind", "syntax"), f"the chat template does not "
                              f"compile: {type(exc).__name__}: {exc}", exc) from exc

    @property
    def variables(self) -> frozenset[str]:
        """The names the template reads from outside (``messages``, ``tools``, ...)."""
        return self._variables

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None,
               documents: Sequence[Mapping[str, Any]] | None = None,
               continue_final_message: bool | str = False, **kwargs: Any) -> str:
        """The prompt for ``messages``, as ``apply_chat_template(..., tokenize=False)`` gives it.

        ``messages`` is a list of dicts with ``role`` and ``content`` (content may be a string
        or a list of content blocks), and optionally ``tool_calls`` (a list of
        ``{"type": "function", "function": {"name": ..., "arguments": {...}}}``),
        ``reasoning_content`` and whatever else the template reads; ``role: "tool"`` messages
        carry tool results. ``tools`` are JSON-schema dicts
        (``{"type": "function", "function": {"name", "description", "parameters"}}``):
        unlike transformers, Python functions are not converted to schemas. ``documents`` are
        dicts (``title``, ``text``) for retrieval-augmented templates.

        ``add_generation_prompt`` appends the start of an assistant turn (the default here,
        since rendering a prompt is mostly done to generate). ``continue_final_message``
        instead leaves the last message open for the model to continue (``True`` continues its
        ``content``, a string names the field, e.g. ``"reasoning_content"``); it needs
        ``add_generation_prompt=False``. Other keyword arguments become template variables
        (``enable_thinking=False``, ``unk_token=...``); they override ``bos_token`` and
        ``eos_token``.

        Raises :class:`ChatTemplateError` when the template fails (or, kind ``"input"``, when
        an input contains itself or nests deeper than :data:`MAX_INPUT_DEPTH`),
        TypeError/ValueError when the arguments are malformed (not dicts, an empty
        conversation).
        """
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are not "
                             "compatible: pass add_generation_prompt=False to continue the final "
                             "message")
        try:
            chat, tools, documents, extra = self._prepare(messages, tools, documents, kwargs)
        except RecursionError:  # e.g. a model_dump that recurses
            raise ChatTemplateError("the chat template's inputs are nested too deeply",
                                    kind="input") from None

        final = None
        if continue_final_message:
            final = self._tag_final_message(chat, continue_final_message)

        rendered = self._render_bounded(dict(extra, messages=chat, tools=tools,
                                             documents=documents,
                                             add_generation_prompt=add_generation_prompt))
        if final is not None:
            rendered = self._cut_at_tag(rendered, final)
        return rendered

    # -- internals ----------------------------------------------------------------------------

    def _prepare(self, messages: Any, tools: Any, documents: Any,
                 kwargs: dict[str, Any]) -> tuple[list[dict], Any, Any, dict[str, Any]]:
        """The inputs as the template sees them: plain data, validated like transformers."""
        chat = _prepare_messages(messages)
        if tools is not None:
            for tool in tools:
                if not isinstance(tool, Mapping):
                    raise TypeError(f"tools must be JSON-schema dicts (Python functions are not "
                                    f"converted), got {tool!r}")
            tools = _plain(list(tools), "tools")
        if documents is not None:
            for document in documents:
                if not isinstance(document, Mapping):
                    raise TypeError("documents must be a list of dicts with 'title' and 'text' "
                                    f"keys, got {document!r}")
            documents = _plain(list(documents), "documents")
        extra = _plain({"bos_token": self.bos_token, "eos_token": self.eos_token, **kwargs}, "")
        return chat, tools, documents, extra

    def _render_bounded(self, variables: dict[str, Any]) -> str:
        known: dict[int, int] = {}
        # (each value measured apart: a temporary list's id could be reused while rendering)
        inputs: set[int] = set()
        # what the inputs occupy: a value may be as large as the output plus that
        input_size = sum(_measure(v, known, inputs)[1] for v in variables.values())
        budget = _Budget(self.max_steps, self.max_seconds, self.max_output + input_size, known,
                         inputs)
        token = _BUDGET.set(budget)
        parts: list[str] = []
        total = 0
        try:
            chunks = self._template.generate(**variables)
            try:
                for chunk in chunks:
                    if not chunk:
                        continue
                    total += len(chunk)
                    if total > self.max_output:
                        raise self._error(
                            "output", f"the chat template's output exceeds "
                                      f"max_output={self.max_output} characters", None,
                            lineno=self._suspended_lineno(chunks))
                    parts.append(chunk)
            finally:
                chunks.close()
        except ChatTemplateError:
            raise
        except _LimitExceeded as exc:
            raise self._error(exc.kind, str(exc), exc) from exc
        except _TemplateRaised as exc:
            raise self._error("raised", f"the chat template raised an error: {exc.message}",
                              exc) from exc
        except _LoadForbidden as exc:
            raise self._error("load", str(exc.message), exc) from exc
        except SecurityError as exc:
            raise self._error("forbidden", f"the chat template did something the sandbox "
                                           f"forbids: {exc}", exc) from exc
        except RecursionError as exc:
            raise self._error("recursion", "the chat template recursed too deeply", exc) from exc
        except MemoryError as exc:
            raise self._error("memory", "the chat template ran out of memory", exc) from exc
        except Exception as exc:
            raise self._error("error", f"the chat template failed: {type(exc).__name__}: {exc}",
                              exc) from exc
        finally:
            _BUDGET.reset(token)
        return "".join(parts)

    def _tag_final_message(self, chat: list[dict], field: bool | str) -> str:
        """Marks the end of the text to continue (as transformers does) and returns that text."""
        field = field if isinstance(field, str) else "content"
        last = chat[-1]
        final = last.get(field)
        if final is None:
            raise ValueError(f"continue_final_message is set but the final message has no "
                             f"{field!r} to continue")
        fields = [field]
        if field in _REASONING_FIELDS:
            # reasoning is copied under several names: tag every copy, whichever one is read
            fields = [f for f in _REASONING_FIELDS if last.get(f) == final]
        if not any(f in self.source for f in fields):
            raise ValueError(f"continue_final_message is set to {field!r} but the chat template "
                             "never reads that field")
        if isinstance(final, (list, tuple)):
            for block in reversed(final):
                if isinstance(block, dict) and "text" in block:
                    text = block["text"]
                    block["text"] = text + _CONTINUE_TAG
                    return text
            raise ValueError("continue_final_message is set but the final message has no text "
                             "block to continue")
        for f in fields:
            last[f] = last[f] + _CONTINUE_TAG
        return final

    @staticmethod
    def _cut_at_tag(rendered: str, final: str) -> str:
        tag = _CONTINUE_TAG.strip()
        if final.strip() not in rendered or tag not in rendered:
            raise ChatTemplateError("continue_final_message is set but the final message does "
                                    "not appear in the rendered chat: the template changes or "
                                    "drops it", kind="continue")
        at = rendered.rindex(tag)
        if rendered[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
            return rendered[:at]
        # the template trimmed the message's trailing space (and so the tag's): trim ours too
        return rendered[:at].rstrip()

    def _suspended_lineno(self, chunks: Any) -> int | None:
        """The template line a suspended rendering stopped at (the one that output the last
        chunk): the innermost generator running template code, mapped back by Jinja."""
        lineno = None
        gen = chunks
        while gen is not None:
            frame = getattr(gen, "gi_frame", None)
            if frame is not None and frame.f_code.co_filename == _TEMPLATE_FILENAME:
                lineno = self._template.get_corresponding_lineno(frame.f_lineno)
            gen = getattr(gen, "gi_yieldfrom", None)
        return lineno

    def _error(self, kind: str, message: str, exc: BaseException | None,
               lineno: int | None = None) -> ChatTemplateError:
        if lineno is None and exc is not None:
            lineno = _template_lineno(exc)
        if lineno is not None:
            lines = re.split(r"\r\n|\r|\n", self.source)
            where = f"template line {lineno}"
            if 0 < lineno <= len(lines) and lines[lineno - 1].strip():
                text = lines[lineno - 1].strip()
                where += f": {text[:80]!r}" + ("..." if len(text) > 80 else "")
            message = f"{message} ({where})"
        return ChatTemplateError(message, kind=kind, lineno=lineno)


def _template_lineno(exc: BaseException) -> int | None:
    """The template line an exception was raised at: Jinja rewrites tracebacks so that template
    code appears as frames of the file ``<template>`` at template line numbers."""
    lineno = None
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == _TEMPLATE_FILENAME:
            lineno = tb.tb_lineno
        tb = tb.tb_next
    return lineno
