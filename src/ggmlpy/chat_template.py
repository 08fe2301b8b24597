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
  elements counted through nested containers, so ``[[s] * 1000] * 1000`` counts a million
  ``s``, which is what printing it would cost). The operations that could build such a
  value in one go (``'a' * n``, ``x ** n``, ``'%9999999d' % 1``, ``'a'.center(n)``,
  ``|indent(n)``, ``|join``, block output collected in macros, ...) are checked before they
  run, so memory stays bounded too.

How: the template is parsed, then rewritten (loops iterate through a step-counting wrapper,
built values pass a size check) before Jinja compiles it; the sandbox's hooks for calls and
operators, and every filter, charge the render's budget; block output is collected in
size-checked buffers.

Not supported (transformers has them): tools given as Python functions (pass JSON-schema
dicts), batches of conversations, and the assistant-token mask that ``{% generation %}``
blocks feed.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import itertools
import json
import re
import string
import sys
import time
import types
from collections.abc import Iterator, Mapping, MappingView, Sequence, Sized
from datetime import datetime
from typing import Any, Callable

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range
from jinja2.utils import Namespace
from jinja2.visitor import NodeTransformer

from ggmlpy._core import GGMLValueError

__all__ = ["ChatTemplate", "ChatTemplateError"]


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


# Older Jinja releases have known sandbox escapes, and chat templates are untrusted code
# (transformers refuses them for the same reason).
if _version_tuple(jinja2.__version__) < (3, 1, 6):
    raise ImportError(f"ggmlpy.chat_template needs jinja2>=3.1.6, found {jinja2.__version__}")

#: default for ``ChatTemplate(max_steps=...)``: about a second of template work (a step is
#: roughly 100 ns). Real templates take a few hundred steps per message.
DEFAULT_MAX_STEPS = 5_000_000
#: steps charged per loop iteration, filter, operator and call: roughly what each costs (a
#: call goes through the sandbox's checks, 2-5 microseconds)
_ITER_STEPS = 1
_FILTER_STEPS = 2
_OP_STEPS = 2
_CALL_STEPS = 20
#: default for ``ChatTemplate(max_seconds=...)``: a backstop for steps that are slow one by one
DEFAULT_MAX_SECONDS = 10.0
#: the largest integer a template may compute, in bits (real templates count messages)
MAX_INT_BITS = 1 << 16
#: budgets used while the template is compiled: Jinja folds constant expressions then (such as
#: ``'a' | center(10)``), and anything bigger is simply left to run, under the real budget
_COMPILE_STEPS = 100_000
_COMPILE_VALUE = 1 << 16
#: how many steps run between two looks at the clock (a look costs about half a step)
_CLOCK_EVERY = 64
#: a string costs one step per this many characters when it is checked (built or passed on)
_CHARS_PER_STEP = 256
#: reasoning is accepted under these names; the first is the one templates read
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
#: appended to the final message for ``continue_final_message`` and cut off after rendering
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
#: what Jinja names a template compiled from a string, in code objects and tracebacks
_TEMPLATE_FILENAME = "<template>"


class ChatTemplateError(GGMLValueError):
    """A chat template that cannot be rendered.

    ``kind`` says why: ``"syntax"`` (does not parse or compile), ``"raised"`` (the template
    called ``raise_exception``), ``"forbidden"`` (an attribute or callable the sandbox
    forbids), ``"load"`` (``include``/``import``/``extends``), ``"steps"``, ``"time"``,
    ``"recursion"``, ``"range"`` (a ``range()`` longer than the sandbox's 100,000 items),
    ``"size"`` (a value too large), ``"output"`` (output too large),
    ``"memory"``, ``"continue"`` (``continue_final_message`` could not be honoured) or
    ``"error"`` (any other failure while rendering, such as a type error). ``lineno`` is the
    template line the failure happened at, when Jinja reports one.
    """

    def __init__(self, message: str, *, kind: str = "error", lineno: int | None = None):
        super().__init__(message)
        self.kind = kind
        self.lineno = lineno


class _LimitExceeded(Exception):
    """A budget ran out. Deliberately not a subclass of anything Jinja or the sandbox catches
    (AttributeError, TypeError, LookupError), so a template cannot swallow it."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class _TemplateRaised(TemplateError):
    """What ``raise_exception`` raises; a TemplateError like transformers' own."""


class _LoadForbidden(TemplateError):
    """A template tried to include, import or extend another template."""


# ---------------------------------------------------------------------------------------------
# Budget: per render, reached through a context variable because the environment (and the
# compiled template) is shared by every render in every thread.


class _Budget:
    """Steps, time and value sizes one render may use."""

    __slots__ = ("steps", "max_steps", "max_seconds", "deadline", "next_check", "max_value", "known")

    def __init__(self, max_steps: int, max_seconds: float, max_value: int,
                 known: dict[int, int] | None = None):
        self.steps = 0
        self.max_steps = max_steps
        self.max_seconds = max_seconds
        self.deadline = time.monotonic() + max_seconds
        self.next_check = min(_CLOCK_EVERY, max_steps)
        self.max_value = max_value
        #: id -> size of the containers in the render's inputs, so sizing a value that holds
        #: (say) the messages does not walk them again; they stay alive while the render runs
        self.known = known if known is not None else {}

    def charge(self, n: int = 1) -> None:
        self.steps += n
        if self.steps > self.next_check:
            if self.steps > self.max_steps:
                raise _LimitExceeded(
                    "steps", f"the chat template ran more than max_steps={self.max_steps} steps "
                             "(loop iterations, calls, filters, operators): it loops too long")
            if time.monotonic() > self.deadline:
                raise _LimitExceeded(
                    "time", f"the chat template ran longer than max_seconds={self.max_seconds}")
            self.next_check = min(self.steps + _CLOCK_EVERY, self.max_steps)

    def too_large(self, what: str) -> _LimitExceeded:
        return _LimitExceeded("size", f"the chat template built {what} larger than the limit of "
                                      f"{self.max_value} (max_output plus the size of the inputs)")

    def size(self, value: Any) -> int:
        """The size of ``value`` as the budget counts it: 1 per scalar, 1 + length per string,
        1 + the sizes of the elements per container (a dict's keys and values both), shared
        elements counted each time they are reached: that is what printing or comparing the
        value costs. Each distinct container is walked once (so ``[[s] * 1000] * 1000`` is
        cheap to size, and found too large), and the walk stops as soon as the total passes
        ``max_value``."""
        leaf = self._leaf_size(value)
        if leaf is not None:
            if leaf > self.max_value:
                raise self.too_large("a value")
            return leaf
        limit = self.max_value
        sizes: dict[int, int] = {}   # containers already walked in this call
        path: set[int] = {id(value)}  # containers being walked (a namespace can hold itself)
        # depth-first, without recursion: each entry is [container, its children, size so far]
        stack = [[value, _children(value), 1]]
        walked = 0
        total = 0
        while stack:
            entry = stack[-1]
            for child in entry[1]:
                walked += 1
                size = self._leaf_size(child)
                if size is None:
                    size = sizes.get(id(child))
                if size is None:
                    if id(child) in path:
                        size = 1  # a cycle prints as "..."
                    else:
                        path.add(id(child))
                        stack.append([child, _children(child), 1])
                        break
                entry[2] += size
                if entry[2] > limit:
                    self.charge(walked)
                    raise self.too_large("a value")
            else:
                stack.pop()
                path.discard(id(entry[0]))
                sizes[id(entry[0])] = entry[2]
                if stack:
                    stack[-1][2] += entry[2]
                    if stack[-1][2] > limit:
                        self.charge(walked)
                        raise self.too_large("a value")
                else:
                    total = entry[2]
        self.charge(walked)
        return total

    def _leaf_size(self, v: Any) -> int | None:
        """The size of a scalar, string or input container; None for a container to walk."""
        t = type(v)
        if t is str or t is bytes:
            return 1 + len(v)
        if t is int or t is float or t is bool or v is None:
            return 1
        known = self.known.get(id(v))
        if known is not None:
            return known
        if isinstance(v, (str, bytes, bytearray)):
            return 1 + len(v)
        if isinstance(v, (list, tuple, set, frozenset, MappingView, dict, Namespace)):
            return None
        return 1

    def check(self, value: Any) -> Any:
        """``value`` unchanged if its size is within the limit (cheap for strings and scalars)."""
        t = type(value)
        if t is str:
            n = len(value)
            if n > self.max_value:
                raise self.too_large("a string")
            if n >= _CHARS_PER_STEP:
                self.charge(n // _CHARS_PER_STEP)
        elif t is int:
            if value.bit_length() > MAX_INT_BITS:
                raise _LimitExceeded("size", f"the chat template computed an integer of more "
                                             f"than {MAX_INT_BITS} bits")
        elif t is not float and t is not bool and value is not None:
            self.size(value)
        return value

    def materialize(self, iterable: Any) -> list:
        """``list(iterable)``, stopping as soon as the elements are too large together."""
        items = []
        total = 1
        for item in iterable:
            self.charge(_ITER_STEPS)
            total += self.size(item)
            if total > self.max_value:
                raise self.too_large("a list")
            items.append(item)
        return items

    def check_width(self, width: Any, what: str) -> None:
        if isinstance(width, int) and width > self.max_value:
            raise self.too_large(what)

    def check_repeat(self, left: Any, right: Any) -> None:
        """Before ``left * right``: sequence repetition and integer products."""
        if isinstance(left, int) and isinstance(right, int):
            if left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise _LimitExceeded("size", f"the chat template computed an integer of more "
                                             f"than {MAX_INT_BITS} bits")
            return
        if isinstance(right, int):
            seq, n = left, right
        elif isinstance(left, int):
            seq, n = right, left
        else:
            return
        if n <= 0:
            return
        if isinstance(seq, (str, bytes, bytearray)):
            per_copy = len(seq)
        elif isinstance(seq, (list, tuple)):
            per_copy = self.size(seq) - 1
        else:
            return
        if per_copy * n > self.max_value:
            raise self.too_large("a repeated sequence")

    def check_add(self, left: Any, right: Any) -> None:
        """Before ``left + right``: concatenation (the result is sized fully afterwards)."""
        if (isinstance(left, (str, bytes, list, tuple)) and isinstance(right, (str, bytes, list, tuple))
                and len(left) + len(right) > self.max_value):
            raise self.too_large("a concatenation")

    def check_power(self, base: Any, exponent: Any) -> None:
        if (isinstance(base, int) and isinstance(exponent, int) and exponent > 0
                and abs(base) > 1 and base.bit_length() * exponent > MAX_INT_BITS):
            raise _LimitExceeded("size", f"the chat template computed an integer of more than "
                                         f"{MAX_INT_BITS} bits")

    def check_number_text(self, text: str, what: str) -> None:
        """Every run of digits in ``text`` (a width or precision in a format) within the limit."""
        for digits in re.findall(r"\d+", text):
            if len(digits) > 12 or int(digits) > self.max_value:
                raise self.too_large(what)

    def check_printf(self, fmt: Any, args: Any) -> None:
        """Before ``fmt % args``: widths and precisions, including ``*`` ones taken from args."""
        text = fmt if isinstance(fmt, str) else bytes(fmt).decode("latin-1")
        star = False
        for spec in _PRINTF_SPEC.findall(text):
            if spec == "%%":
                continue
            spec = re.sub(r"^%\([^)]*\)", "%", spec)  # a mapping key is no width
            star = star or "*" in spec
            self.check_number_text(spec, "a formatted string")
        if star:
            for arg in args if isinstance(args, tuple) else (args,):
                self.check_width(arg, "a formatted string")
        self.check(args)

    def check_format(self, fmt: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        """Before ``fmt.format(*args, **kwargs)``: widths in the format specs, and the arguments
        when a spec takes its width from them (``'{:{}}'.format(1, 10**9)``)."""
        nested = False
        try:
            fields = list(string.Formatter().parse(fmt))
        except ValueError:
            return  # malformed: str.format raises the same error itself
        for _text, _name, spec, _conversion in fields:
            if spec:
                nested = nested or "{" in spec
                self.check_number_text(spec, "a formatted string")
        if nested:
            for arg in (*args, *kwargs.values()):
                if isinstance(arg, (int, str)):
                    self.check_number_text(str(arg), "a formatted string")
        self.check(tuple(args))
        self.check(dict(kwargs))


def _children(container: Any) -> Iterator[Any]:
    if isinstance(container, dict):
        return itertools.chain(container.keys(), container.values())
    if isinstance(container, Namespace):
        # the only mutable container templates have: sized by its attributes, every time
        return iter((object.__getattribute__(container, "_Namespace__attrs"),))
    return iter(container)


_PRINTF_SPEC = re.compile(r"%%|%(?:\([^)]*\))?[-#0 +]*(?:\*|\d+)?(?:\.(?:\*|\d+))?")

_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar(
    "ggmlpy_chat_template_budget", default=None)


def _budget() -> _Budget:
    budget = _BUDGET.get()
    if budget is None:  # only ChatTemplate.render and the compiler run templates
        raise RuntimeError("a ggmlpy chat template ran outside ChatTemplate.render")
    return budget


class _CountedIterable:
    """What a ``{% for %}`` loop iterates: the original iterable, one step charged per item."""

    __slots__ = ("_inner", "_budget")

    def __init__(self, inner: Any, budget: _Budget):
        self._inner = inner
        self._budget = budget

    def __len__(self) -> int:
        # LoopContext asks for the length (loop.length, loop.last); a TypeError makes it count
        return len(self._inner)

    def __iter__(self) -> Iterator[Any]:
        charge = self._budget.charge
        for item in self._inner:
            charge(_ITER_STEPS)
            yield item


# ---------------------------------------------------------------------------------------------
# Template helpers (the globals and filters transformers adds)


def _raise_exception(message: Any) -> None:
    raise _TemplateRaised(str(message))


def _strftime_now(fmt: str) -> str:
    # the module-level ``datetime`` is looked up per call, so tests can freeze it
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """transformers' ``tojson``: :func:`json.dumps` with these arguments, in this order (so
    ``tojson(2)`` sets ``ensure_ascii``, not the indent). Jinja's own filter escapes HTML."""
    budget = _budget()
    # json encodes the indent once per nesting level per line: a huge one is a memory bomb
    if isinstance(indent, int) and indent > 1024 or isinstance(indent, str) and len(indent) > 1024:
        raise _LimitExceeded("size", "tojson: an indent of more than 1024 characters")
    encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                               sort_keys=sort_keys)
    # stream the encoding so an oversized result is refused before it exists whole
    parts = []
    total = 0
    for part in encoder.iterencode(value):
        total += len(part)
        if total > budget.max_value:
            raise budget.too_large("a JSON string")
        parts.append(part)
    return "".join(parts)


def _range(*args: int) -> range:
    """The sandbox's ``range`` (at most 100,000 items), failing as a budget error."""
    try:
        return safe_range(*args)
    except OverflowError as exc:
        raise _LimitExceeded("range", f"range() is too long: {exc}") from None


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:
    # Jinja's lipsum, with its parameter names (templates may pass them by name)
    budget = _budget()
    if isinstance(n, int) and isinstance(max, int) and n * max > budget.max_value:
        raise budget.too_large("lorem ipsum")
    return jinja2.utils.generate_lorem_ipsum(n=n, html=html, min=min, max=max)


class _DictFactory:
    """``dict`` as templates see it: it builds dicts and offers ``fromkeys``; the ``dict`` type
    itself (and its attributes) stays out of reach, as in transformers."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _check_namespace_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise SecurityError(f"chat templates cannot store underscore-prefixed attributes on a "
                            f"namespace, but got {name!r}")


class _TemplateNamespace(Namespace):
    """``namespace()`` refusing names that start with ``_`` (transformers does the same: such
    names could shadow Namespace internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: B902 - ``self`` may be a kwarg name
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_namespace_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        Namespace.__setitem__(self, name, value)


class _GenerationExtension(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks the assistant's part of a
    rendering with it (for training masks); for rendering its body is output unchanged. Like
    transformers, the body is a call block, so ``{% set %}`` inside it stays inside it."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


# Filter pre-checks: the filters that can build a value much larger than their input in one
# call. Each takes the filter's arguments after the value (as the filter declares them).


def _pre_center(b: _Budget, value: Any, width: Any = 80, *_: Any, **__: Any) -> None:
    b.check_width(width, "a centered string")


def _pre_indent(b: _Budget, s: Any, width: Any = 4, *_: Any, **__: Any) -> None:
    per_line = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
    b.check_width(per_line, "an indented string")
    lines = str(s).count("\n") + 1
    b.check_width(len(str(s)) + lines * per_line, "an indented string")


def _pre_wordwrap(b: _Budget, s: Any, width: Any = 79, break_long_words: Any = True,
                  wrapstring: Any = None, *_: Any, **__: Any) -> None:
    if isinstance(wrapstring, str) and len(wrapstring) > 1:
        b.check_width((len(str(s)) + 1) * len(wrapstring), "a wrapped string")


def _pre_format(b: _Budget, value: Any, *args: Any, **kwargs: Any) -> None:
    b.check_printf(str(value), kwargs or args)


def _pre_join(b: _Budget, value: Any, d: Any = "", *_: Any, **__: Any) -> None:
    # value is a list here (materialized); its size is checked; the separators are not
    if isinstance(value, Sequence) and isinstance(d, str):
        b.check_width(len(d) * max(len(value) - 1, 0), "a joined string")


def _pre_replace(b: _Budget, s: Any, old: Any, new: Any, count: Any = None, *_: Any,
                 **__: Any) -> None:
    s, old, new = str(s), str(old), str(new)
    if len(new) <= len(old):
        return
    n = len(s) + 1 if old == "" else s.count(old)
    if isinstance(count, int) and count >= 0:
        n = min(n, count)
    b.check_width(len(s) + n * (len(new) - len(old)), "a replaced string")


def _pre_sum(b: _Budget, iterable: Any, attribute: Any = None, start: Any = 0, *_: Any,
             **__: Any) -> None:
    # summing lists copies the running total once per item: quadratic work in one C call,
    # charged as such (one step per 16 elements copied) before it starts
    if isinstance(start, (list, tuple)) and isinstance(iterable, Sequence):
        copied = running = len(start)
        for item in iterable:
            running += len(item) if isinstance(item, Sized) else 1
            copied += running
        b.charge(copied // 16)


def _pre_batch(b: _Budget, value: Any, linecount: Any = 1, fill_with: Any = None, *_: Any,
               **__: Any) -> None:
    if fill_with is not None:
        b.check_width(linecount, "a batch")


def _pre_slice(b: _Budget, value: Any, slices: Any = 1, *_: Any, **__: Any) -> None:
    b.check_width(slices, "a slice")


_FILTER_PRECHECKS: dict[str, Callable[..., None]] = {
    "center": _pre_center, "indent": _pre_indent, "wordwrap": _pre_wordwrap,
    "format": _pre_format, "join": _pre_join, "replace": _pre_replace,
    "batch": _pre_batch, "slice": _pre_slice, "sum": _pre_sum,
}

#: filters that turn an iterator into a list anyway: given an iterator (``x | map(...)``) they
#: get a list built under the budget instead, which changes nothing else they do
_FILTER_MATERIALIZE = frozenset({"list", "join", "sum", "sort", "unique", "slice", "groupby"})


def _wrap_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` charged one step per call, its value and arguments size-checked, its result too."""
    # filters marked pass_context / pass_eval_context / pass_environment get that first
    skip = 1 if getattr(func, "jinja_pass_arg", None) is not None else 0
    precheck = _FILTER_PRECHECKS.get(name)
    materialize = name in _FILTER_MATERIALIZE

    @functools.wraps(func)  # keeps jinja_pass_arg, so Jinja still passes the context
    def filter_(*args: Any, **kwargs: Any) -> Any:
        b = _budget()
        b.charge(_FILTER_STEPS)
        if materialize and len(args) > skip and isinstance(args[skip], Iterator):
            args = (*args[:skip], b.materialize(args[skip]), *args[skip + 1:])
        for arg in args[skip:]:
            b.check(arg)
        for arg in kwargs.values():
            b.check(arg)
        if precheck is not None:
            precheck(b, *args[skip:], **kwargs)
        return b.check(func(*args, **kwargs))

    return filter_


def _check_string_method(b: _Budget, owner: str | bytes, name: str, args: tuple,
                         kwargs: dict[str, Any]) -> tuple:
    """Before ``owner.<name>(*args)`` for the str/bytes methods that can grow a string a lot;
    returns the arguments to call with (``join`` gets its iterable as a list built under the
    budget)."""
    if name in ("center", "ljust", "rjust", "zfill"):
        if args:
            b.check_width(args[0], "a padded string")
    elif name == "expandtabs":
        tabsize = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(tabsize, int):
            b.check_width(len(owner) + owner.count(b"\t" if isinstance(owner, bytes) else "\t")
                          * tabsize, "an expanded string")
    elif name == "replace" and len(args) >= 2:
        old, new = args[0], args[1]
        count = args[2] if len(args) > 2 else kwargs.get("count", -1)
        if isinstance(old, type(owner)) and isinstance(new, type(owner)) and len(new) > len(old):
            n = len(owner) + 1 if len(old) == 0 else owner.count(old)
            if isinstance(count, int) and count >= 0:
                n = min(n, count)
            b.check_width(len(owner) + n * (len(new) - len(old)), "a replaced string")
    elif name == "join" and args:
        items = b.materialize(args[0])
        b.check_width(len(owner) * max(len(items) - 1, 0), "a joined string")
        args = (items, *args[1:])
    elif name == "translate" and args and isinstance(args[0], Mapping):
        longest = max((len(v) for v in args[0].values() if isinstance(v, str)), default=1)
        b.check_width(len(owner) * longest, "a translated string")
    return args


# ---------------------------------------------------------------------------------------------
# The environment


class _OutputBuffer(list):
    """Where Jinja collects the output of a macro, call block, ``{% set %}`` block, filter block
    or recursive loop before joining it: it stops growing past the value limit, so a block that
    loops over big distinct strings fails before it holds them all."""

    __slots__ = ("_budget", "_length")

    def __init__(self, budget: _Budget):
        super().__init__()
        self._budget = budget
        self._length = 0

    def append(self, item: Any) -> None:
        self._length += len(item) if isinstance(item, str) else 0
        if self._length > self._budget.max_value:
            raise self._budget.too_large("a block of output")
        super().append(item)

    def extend(self, items: Any) -> None:
        for item in items:
            self.append(item)


class _CodeGenerator(CodeGenerator):
    """Jinja's code generator, with block output buffers that are :class:`_OutputBuffer`."""

    def buffer(self, frame: Any) -> None:
        frame.buffer = self.temporary_identifier()
        self.writeline(f"{frame.buffer} = environment.ggmlpy_buffer()")


class _SandboxEnvironment(ImmutableSandboxedEnvironment):
    """transformers' environment plus the budget: each hook charges steps and checks sizes."""

    # the operators that can build a big value (or a big integer) in one step
    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        # the sandbox would return an undefined value that fails only when used; fail now, so a
        # template cannot even test which internals exist
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} "
                            "object is unsafe")

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805,B902
        b = _budget()
        b.charge(_CALL_STEPS)
        kind = type(__obj)
        if isinstance(__obj, LoopContext):
            # a recursive loop's ``loop(children)``: count those iterations too
            if args:
                args = (_CountedIterable(args[0], b), *args[1:])
        elif kind is types.BuiltinMethodType:
            owner = getattr(__obj, "__self__", None)
            if isinstance(owner, (str, bytes)):
                plain = {k: v for k, v in kwargs.items() if k not in ("_loop_vars", "_block_vars")}
                args = _check_string_method(b, owner, __obj.__name__, args, plain)
        elif kind is types.FunctionType and __obj.__name__ in ("format", "format_map"):
            # the sandbox's wrapper around str.format (it keeps the method as __wrapped__)
            fmt = getattr(getattr(__obj, "__wrapped__", None), "__self__", None)
            if isinstance(fmt, str):
                plain = {k: v for k, v in kwargs.items() if k not in ("_loop_vars", "_block_vars")}
                if __obj.__name__ == "format_map" and args and isinstance(args[0], Mapping):
                    b.check_format(fmt, (), args[0])
                else:
                    b.check_format(fmt, args, plain)
        return b.check(super().call(__context, __obj, *args, **kwargs))

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        b = _budget()
        b.charge(_OP_STEPS)
        if operator == "+":
            b.check_add(left, right)
        elif operator == "*":
            b.check_repeat(left, right)
        elif operator == "**":
            b.check_power(left, right)
        elif operator == "%" and isinstance(left, (str, bytes)):
            b.check_printf(left, right)
        return b.check(self.binop_table[operator](left, right))

    def concat(self, parts: Any) -> str:  # type: ignore[override]
        # joins the output of blocks, macros, {% set %}...{% endset %} and {% filter %}: many
        # small pieces (one per loop iteration) can add up to a huge string
        if not isinstance(parts, list):
            parts = list(parts)
        b = _budget()
        if sum(map(len, parts)) > b.max_value:
            raise b.too_large("a block of output")
        return "".join(parts)

    def get_template(self, *args: Any, **kwargs: Any) -> Any:
        raise _LoadForbidden("chat templates cannot include, import or extend other templates")

    select_template = get_template
    get_or_select_template = get_template

    code_generator_class = _CodeGenerator

    def ggmlpy_buffer(self) -> _OutputBuffer:
        # called by the generated code (not by templates) wherever Jinja starts a buffer
        return _OutputBuffer(_budget())


def _finalize(value: Any) -> Any:
    # every ``{{ expression }}`` passes through here before str(): sizing it first keeps a
    # value that prints huge (many references to one big string) from being printed at all
    return _budget().check(value)


@jinja2.pass_context  # never folded into a constant at compile time
def _loop_filter(context: Any, iterable: Any) -> _CountedIterable:
    return _CountedIterable(iterable, _budget())


@jinja2.pass_context
def _value_filter(context: Any, value: Any) -> Any:
    return _budget().check(value)


@jinja2.pass_context
def _scan_filter(context: Any, value: Any) -> Any:
    # the right side of ``in``: a membership test scans a list or string in C, unseen
    if isinstance(value, (str, bytes)):
        _budget().charge(len(value) // _CHARS_PER_STEP)
    elif isinstance(value, (list, tuple)):
        _budget().charge(len(value) // 16)
    return value


#: names of the filters _Instrument inserts: with a space, so no template can spell them
_LOOP_FILTER = "ggmlpy loop"
_VALUE_FILTER = "ggmlpy value"
_SCAN_FILTER = "ggmlpy scan"


class _Instrument(NodeTransformer):
    """Rewrites a parsed template so the budget sees what the sandbox hooks do not: loop
    iterations (each ``{% for %}`` iterates through a counting wrapper), membership tests
    (``x in big_list`` is charged by the list's length), and values built without a call
    (``~`` concatenations, list/tuple/dict literals), which get size-checked.
    The helpers are filters because Jinja compiles a filter to a direct function call, while
    a call goes through the sandbox's checks (ten times slower)."""

    @staticmethod
    def _wrap(helper: str, node: nodes.Expr) -> nodes.Expr:
        return nodes.Filter(node, helper, [], [], None, None, lineno=node.lineno)

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = self._wrap(_LOOP_FILTER, node.iter)
        return node

    def visit_Compare(self, node: nodes.Compare) -> nodes.Node:
        self.generic_visit(node)
        for operand in node.ops:
            if operand.op in ("in", "notin"):
                operand.expr = self._wrap(_SCAN_FILTER, operand.expr)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        # each operand is sized before str() turns it into text, the result after joining
        node.nodes = [self._wrap(_VALUE_FILTER, n) for n in node.nodes]
        return self._wrap(_VALUE_FILTER, node)

    def _literal(self, node: nodes.Expr, items: list[nodes.Node]) -> nodes.Node:
        self.generic_visit(node)
        if getattr(node, "ctx", "load") != "load" or all(isinstance(n, nodes.Const) for n in items):
            return node  # an assignment target, or a constant Jinja folds at compile time
        return self._wrap(_VALUE_FILTER, node)

    def visit_List(self, node: nodes.List) -> nodes.Node:
        return self._literal(node, node.items)

    def visit_Tuple(self, node: nodes.Tuple) -> nodes.Node:
        return self._literal(node, node.items)

    def visit_Dict(self, node: nodes.Dict) -> nodes.Node:
        return self._literal(node, [n for pair in node.items for n in (pair.key, pair.value)])


def _make_environment() -> _SandboxEnvironment:
    env = _SandboxEnvironment(trim_blocks=True, lstrip_blocks=True, finalize=_finalize,
                              extensions=[_GenerationExtension, jinja2.ext.loopcontrols])
    for name, func in list(env.filters.items()):
        env.filters[name] = _wrap_filter(name, func)
    env.filters["tojson"] = _wrap_filter("tojson", _tojson)
    env.filters[_LOOP_FILTER] = _loop_filter
    env.filters[_VALUE_FILTER] = _value_filter
    env.filters[_SCAN_FILTER] = _scan_filter
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _DictFactory()
    env.globals["namespace"] = _TemplateNamespace
    env.globals["lipsum"] = _lipsum
    env.globals["range"] = _range
    return env


_ENV = _make_environment()


@functools.lru_cache(maxsize=64)
def _compile(source: str) -> tuple[jinja2.Template, frozenset[str]]:
    """The compiled template for ``source`` and the variables it reads (cached by source)."""
    token = _BUDGET.set(_Budget(_COMPILE_STEPS, DEFAULT_MAX_SECONDS, _COMPILE_VALUE))
    try:
        ast = _ENV.parse(source)
        variables = frozenset(jinja2.meta.find_undeclared_variables(ast))
        ast = _Instrument().visit(ast)
        code = _ENV.compile(ast)
        template = _ENV.template_class.from_code(_ENV, code, _ENV.make_globals(None), None)
    finally:
        _BUDGET.reset(token)
    return template, variables


# ---------------------------------------------------------------------------------------------
# Inputs


def _plain(value: Any) -> Any:
    """``value`` rebuilt from plain JSON-like types, as transformers rebuilds every input: rich
    objects (arrays, images, enums, ...) have methods the sandbox does not know to be
    dangerous. Subclasses of str/int/float become the base type, mappings dicts, dataclasses
    and pydantic models dicts of their fields, numpy scalars Python scalars, and anything else
    the placeholder ``"<TypeName>"``."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    numpy = sys.modules.get("numpy")  # no numpy imported: no numpy scalar can be here
    if numpy is not None and isinstance(value, numpy.generic):
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _measure(value: Any, known: dict[int, int]) -> int:
    """The budget size of an input (see :meth:`_Budget.size`), recording each container's."""
    if isinstance(value, (str, bytes)):
        return 1 + len(value)
    if isinstance(value, (list, tuple)):
        size = 1 + sum(_measure(v, known) for v in value)
    elif isinstance(value, dict):
        size = 1 + sum(_measure(k, known) + _measure(v, known) for k, v in value.items())
    else:
        return 1
    known[id(value)] = size
    return size


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
    for message in _plain(list(messages)):
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

        Raises :class:`ChatTemplateError` when the template fails, TypeError/ValueError when
        the arguments are malformed (not dicts, an empty conversation).
        """
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are not "
                             "compatible: pass add_generation_prompt=False to continue the final "
                             "message")
        try:
            chat, tools, documents, extra = self._prepare(messages, tools, documents, kwargs)
        except RecursionError:
            raise ValueError("the chat template's inputs are nested too deeply (or contain "
                             "themselves)") from None

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
            tools = _plain(list(tools))
        if documents is not None:
            for document in documents:
                if not isinstance(document, Mapping):
                    raise TypeError("documents must be a list of dicts with 'title' and 'text' "
                                    f"keys, got {document!r}")
            documents = _plain(list(documents))
        extra = _plain({"bos_token": self.bos_token, "eos_token": self.eos_token, **kwargs})
        return chat, tools, documents, extra

    def _render_bounded(self, variables: dict[str, Any]) -> str:
        known: dict[int, int] = {}
        # (each value measured apart: a temporary list's id could be reused while rendering)
        input_size = sum(_measure(v, known) for v in variables.values())
        budget = _Budget(self.max_steps, self.max_seconds, self.max_output + input_size, known)
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
