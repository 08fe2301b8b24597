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

How: the template is parsed, then rewritten (loops iterate through a step-counting wrapper,
built values pass a size check, operands of ``~`` a text check) before Jinja compiles it;
the sandbox's hooks for calls, operators and ``str.format``, and every filter and test,
charge the render's budget; large built values are held in a table that a sweep releases
once nothing else refers to them; block output is collected in size-checked buffers.

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
from jinja2.sandbox import (
    ImmutableSandboxedEnvironment,
    SandboxedEscapeFormatter,
    SandboxedFormatter,
    safe_range,
)
from jinja2.utils import Namespace
from jinja2.visitor import NodeTransformer
from markupsafe import Markup, soft_str

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
#: what a container's element costs on top of its own size: the reference to it (8 bytes),
#: so that a list of a million tiny strings counts what it occupies
_ITEM_SIZE = 8
#: values the template builds of at least this size are held (see _Budget.hold); the number
#: of smaller ones alive at once is bounded by the template's length and recursion depth
_HOLD_MIN = 1 << 10
#: strings of at least this size are counted once per value however often they are reached
_HOLD_MIN_STRING = 1 << 10
#: the values a render holds at once add up to at most this many times its value limit
_HELD_FACTOR = 2
#: how deeply the inputs (messages, tools, extra variables) may nest
MAX_INPUT_DEPTH = 128


class ChatTemplateError(GGMLValueError):
    """A chat template that cannot be rendered.

    ``kind`` says why: ``"syntax"`` (does not parse or compile), ``"raised"`` (the template
    called ``raise_exception``), ``"forbidden"`` (an attribute or callable the sandbox
    forbids, or an object that may not turn into text), ``"load"`` (``include``/``import``/``extends``), ``"steps"``, ``"time"``,
    ``"recursion"``, ``"range"`` (a ``range()`` longer than the sandbox's 100,000 items),
    ``"size"`` (a value, or the values held at once, too large), ``"output"`` (output too
    large), ``"input"`` (an input contains itself or nests too deeply), ``"memory"``, ``"continue"`` (``continue_final_message`` could not be honoured) or
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

    __slots__ = ("steps", "max_steps", "max_seconds", "deadline", "next_check", "max_value", "known",
                 "inputs", "held", "held_size", "buffered", "max_held", "next_sweep")

    def __init__(self, max_steps: int, max_seconds: float, max_value: int,
                 known: dict[int, int] | None = None, inputs: set[int] | None = None):
        self.steps = 0
        self.max_steps = max_steps
        self.max_seconds = max_seconds
        self.deadline = time.monotonic() + max_seconds
        self.next_check = min(_CLOCK_EVERY, max_steps)
        self.max_value = max_value
        #: id -> size of the containers in the render's inputs, so sizing a value that holds
        #: (say) the messages does not walk them again; they stay alive while the render runs
        self.known = known if known is not None else {}
        #: ids of the inputs' large strings: they are not the template's to account for
        self.inputs = inputs if inputs is not None else set()
        #: id -> [value, size]: the large values the template built, held here (so their ids
        #: stay theirs) until a sweep finds that nothing else refers to them any more
        self.held: dict[int, list] = {}
        self.held_size = 0
        #: characters in block output buffers not yet joined (a macro's output, per frame)
        self.buffered = 0
        self.max_held = _HELD_FACTOR * max_value
        self.next_sweep = self.max_held

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

    def size(self, value: Any, fresh: bool = False) -> int:
        """The size of ``value`` as the budget counts it: 1 per scalar, 1 + length per string,
        1 + the sizes of the elements per container, plus ``_ITEM_SIZE`` per element (a dict's
        keys and values both), shared elements counted each time they are reached: that is
        what printing or comparing the value costs. Each distinct container is walked once (so
        ``[[s] * 1000] * 1000`` is cheap to size, and found too large), and the walk stops as
        soon as the total passes ``max_value``.

        ``fresh``: count only what the template allocated for this value: the inputs, the
        values already held and strings reached twice count nothing (see :meth:`hold`)."""
        leaf = self._leaf_size(value, fresh, None)
        if leaf is not None:
            if leaf > self.max_value and not fresh:
                raise self.too_large("a value")
            return leaf
        limit = self.max_value if not fresh else sys.maxsize
        sizes: dict[int, int] = {}   # containers already walked in this call
        seen: set[int] | None = set() if fresh else None  # large strings already counted
        path: set[int] = {id(value)}  # containers being walked (a namespace can hold itself)
        # depth-first, without recursion: each entry is [container, its children, size so far]
        stack = [[value, _children(value), 1]]
        walked = 0
        total = 0
        while stack:
            entry = stack[-1]
            for child in entry[1]:
                walked += 1
                size = self._leaf_size(child, fresh, seen)
                if size is None:
                    size = sizes.get(id(child))
                    if size is not None and fresh:
                        size = 0  # shared: allocated once
                if size is None:
                    if id(child) in path:
                        size = 1  # a cycle prints as "..."
                    else:
                        path.add(id(child))
                        stack.append([child, _children(child), 1])
                        break
                entry[2] += size + _ITEM_SIZE
                if entry[2] > limit:
                    self.charge(walked)
                    raise self.too_large("a value")
            else:
                stack.pop()
                path.discard(id(entry[0]))
                sizes[id(entry[0])] = entry[2]
                if stack:
                    stack[-1][2] += entry[2] + _ITEM_SIZE
                    if stack[-1][2] > limit:
                        self.charge(walked)
                        raise self.too_large("a value")
                else:
                    total = entry[2]
        self.charge(walked)
        return total

    def _leaf_size(self, v: Any, fresh: bool, seen: set[int] | None) -> int | None:
        """The size of a scalar, string or input container; None for a container to walk."""
        t = type(v)
        if t is str or t is bytes:
            n = len(v)
            if fresh and n >= _HOLD_MIN_STRING:
                key = id(v)
                if key in self.held or key in self.inputs or seen is not None and key in seen:
                    return 0
                if seen is not None:
                    seen.add(key)
            return 1 + n
        if t is int or t is float or t is bool or v is None:
            return 1
        known = self.known.get(id(v))
        if known is not None:
            return 0 if fresh else known
        if fresh and id(v) in self.held:
            return 0
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

    def built(self, value: Any) -> Any:
        """:meth:`check` for a value an operation just built, which is then held (if large)."""
        t = type(value)
        if t is str or t is int or t is float or t is bool or value is None:
            self.check(value)
            if t is str and len(value) >= _HOLD_MIN and id(value) not in self.inputs:
                self.hold(value, len(value))
        elif self.size(value) >= _HOLD_MIN:
            fresh = self.size(value, fresh=True)
            if fresh >= _HOLD_MIN:
                self.hold(value, fresh)
        return value

    def hold(self, value: Any, size: int) -> None:
        """Accounts for a large value the template built, for as long as anything refers to it.

        Every value is bounded on its own, but a template can keep many of them alive at once
        (one per ``{% set %}``, per list element, per macro frame of a recursion). The values
        held together are bounded by ``max_held``: each large one is kept here, and when the
        total passes the limit a sweep drops those that nothing but this table refers to."""
        key = id(value)
        if key in self.held:
            return
        self.held[key] = [value, size]
        self.held_size += size
        if self.held_size + self.buffered > self.next_sweep:
            self.sweep()

    def sweep(self) -> None:
        held = self.held
        # newest first: a container built from values goes before them, and its release
        # releases them
        for key in reversed(list(held)):
            if sys.getrefcount(held[key][0]) <= _HELD_REFS:
                self.held_size -= held.pop(key)[1]
        self.charge(len(held))
        if self.held_size + self.buffered > self.max_held:
            raise _LimitExceeded(
                "size", f"the chat template holds values of more than {self.max_held} in all "
                        f"({_HELD_FACTOR} times max_output plus the size of the inputs) at once")
        # what is held now stays held at least until the next sweep: half the limit between
        self.next_sweep = self.held_size + self.buffered + self.max_held // 2

    def buffer(self, n: int) -> None:
        """``n`` characters more (or, negative, fewer) in block output buffers."""
        self.buffered += n
        if n > 0 and self.held_size + self.buffered > self.next_sweep:
            self.sweep()

    def materialize(self, iterable: Any) -> list:
        """``list(iterable)``, stopping as soon as the elements are too large together."""
        items = []
        total = 1
        for item in iterable:
            self.charge(_ITER_STEPS)
            total += self.size(item) + _ITEM_SIZE
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

    def check_number_text(self, text: str, what: str) -> int:
        """Every run of digits in ``text`` (a width or precision in a format) within the limit;
        returns the largest."""
        largest = 0
        for digits in re.findall(r"\d+", text):
            if len(digits) > 12 or int(digits) > self.max_value:
                raise self.too_large(what)
            largest = max(largest, int(digits))
        return largest

    def check_result(self, size: int, what: str) -> None:
        """An operation's result, estimated before it is built, within the limit."""
        if size > self.max_value:
            raise self.too_large(what)

    # -- text: what str() and repr() of a value give ------------------------------------------

    def text_size(self, value: Any, quoted: bool = False, what: str = "text") -> int:
        """An upper bound on ``len(str(value))`` (``repr`` with ``quoted``), within the limit.

        Only what a template can build from its inputs turns into text: strings, numbers,
        booleans, None, undefined values, and lists, tuples, dicts, sets, dict views, ranges
        and namespaces of those. Anything else (a function, a method, a class, a generator, a
        loop, a macro, the environment's objects) would print its internal name and a heap
        address: that is refused, whatever turns it into text."""
        size = _text_leaf(value, quoted)
        if size is None:
            size = self._text_walk(value)
        if size > self.max_value:
            raise self.too_large(what)
        return size

    def _text_walk(self, value: Any) -> int:
        path: set[int] = {id(value)}
        stack = [(value, _children(value))]
        total = _TEXT_CONTAINER
        walked = 0
        while stack:
            container, children = stack[-1]
            for child in children:
                walked += 1
                size = _text_leaf(child, True)
                if size is None:
                    if id(child) in path:
                        size = 5  # "[...]", "{...}"
                    else:
                        path.add(id(child))
                        stack.append((child, _children(child)))
                        total += _TEXT_CONTAINER + _TEXT_SEPARATOR
                        break
                total += size + _TEXT_SEPARATOR
                if total > self.max_value:
                    self.charge(walked)
                    raise self.too_large("text")
            else:
                stack.pop()
                path.discard(id(container))
        self.charge(walked)
        return total

    def check_printf(self, fmt: Any, args: Any) -> None:
        """Before ``fmt % args``: the size of the result, from the format's conversions and the
        arguments they take (widths and precisions, including ``*`` ones)."""
        text = fmt if isinstance(fmt, str) else bytes(fmt).decode("latin-1")
        self.check_result(_printf_size(self, text, args), "a formatted string")

    def check_format_spec(self, value: Any, spec: str, escape: bool) -> int:
        """Before ``format(value, spec)`` (a ``str.format`` field): an upper bound on its size."""
        width = self.check_number_text(spec, "a formatted string") if spec else 0
        size = self.text_size(value, what="a formatted string")
        if type(value) is float or isinstance(value, int) and width:
            size += _NUMBER_TEXT  # a precision adds digits: the width bound above covers it
        if escape:
            size *= _ESCAPE_GROWTH
        return size + width


def _children(container: Any) -> Iterator[Any]:
    if isinstance(container, dict):
        return itertools.chain(container.keys(), container.values())
    if isinstance(container, Namespace):
        # the only mutable container templates have: sized by its attributes, every time
        return iter((object.__getattribute__(container, "_Namespace__attrs"),))
    return iter(container)


_DICT_VIEWS = (type({}.keys()), type({}.values()), type({}.items()))
#: the containers whose str() a template may see: they print their elements' repr() only
_TEXT_CONTAINERS = frozenset({list, tuple, dict, set, frozenset, *_DICT_VIEWS})
#: per element of a printed container: ", " or ": ", and a tuple's trailing comma
_TEXT_SEPARATOR = 4
#: per printed container: brackets and a name ("frozenset({...})", "<Namespace {...}>")
_TEXT_CONTAINER = 20
#: digits a float may need before a precision's (1e308 printed in full)
_NUMBER_TEXT = 320
#: what HTML escaping can make of one character ("&#34;")
_ESCAPE_GROWTH = 5
#: strings are measured for repr() in pieces of this many characters, so the measure is small
_REPR_CHUNK = 4096


def _repr_size(s: str) -> int:
    """An upper bound on ``len(repr(s))``, without building it whole."""
    if s.isprintable():
        return len(s) + 2 + s.count("\\") + s.count("'")
    # each character's escape does not depend on its neighbours, only on the quote chosen
    return s.count("'") + sum(len(repr(s[i:i + _REPR_CHUNK]))
                              for i in range(0, len(s), _REPR_CHUNK))


def _text_leaf(v: Any, quoted: bool) -> int | None:
    """An upper bound on the length of ``str(v)`` (``repr(v)`` if ``quoted``) for a scalar;
    None for a printable container; SecurityError for anything a template may not print."""
    t = type(v)
    if t is str:
        return _repr_size(v) if quoted else len(v)
    if t is int:
        return v.bit_length() * 3 // 10 + 2
    if t is float or t is bool or v is None:
        return 24
    if t is bytes:
        return 4 * len(v) + 3
    if t in _TEXT_CONTAINERS:
        return None
    if isinstance(v, str):  # Markup, from |safe
        return _repr_size(v) + 8 if quoted else len(v)
    if isinstance(v, jinja2.Undefined):
        return 9  # "" or "Undefined"
    if t is range:
        return 40
    if isinstance(v, Namespace) or isinstance(v, tuple) and (
            t.__repr__ is tuple.__repr__ or t.__module__ == "jinja2.filters"):
        return None  # |groupby's named tuples print as tuples
    raise SecurityError(
        f"the chat template tried to turn a {t.__name__!r} object into text: only strings, "
        "numbers, booleans, None, and lists, tuples, dicts and namespaces of them can be printed "
        "or formatted (any other object would print an internal name and a memory address)")


class _NoArgument(Exception):
    """A % format runs out of arguments: Python's own error follows."""


def _printf_size(b: _Budget, text: str, args: Any) -> int:
    """An upper bound on ``len(text % args)``, parsing the conversions as Python does (a key in
    parentheses, flags, width, precision, length modifier, conversion type)."""
    positional = args if isinstance(args, tuple) else (args,)
    mapping = args if not isinstance(args, (tuple, str)) and hasattr(args, "__getitem__") else None
    n = len(text)
    at = 0
    total = 0
    i = 0

    def next_arg() -> Any:
        nonlocal at
        if at >= len(positional):
            raise _NoArgument
        at += 1
        return positional[at - 1]

    try:
        while total <= b.max_value:
            j = text.find("%", i)
            if j < 0:
                return total + n - i
            total += j - i
            k = j + 1
            keyed = False
            arg = None
            if k < n and text[k] == "(":
                depth, start = 1, k + 1
                k += 1
                while k < n and depth:
                    depth += {"(": 1, ")": -1}.get(text[k], 0)
                    k += 1
                if depth or mapping is None:
                    return total  # Python refuses it
                try:
                    arg = mapping[text[start:k - 1]]
                except Exception:  # noqa: BLE001 - Python raises the same
                    return total
                keyed = True
            while k < n and text[k] in "-+ #0":
                k += 1
            width = 0
            if k < n and text[k] == "*":
                star = next_arg()
                width = abs(star) if isinstance(star, int) else 0
                k += 1
            else:
                start = k
                while k < n and text[k].isdigit():
                    k += 1
                width = int(text[start:k]) if k - start <= 12 and k > start else (
                    b.max_value + 1 if k > start else 0)
            precision = None
            if k < n and text[k] == ".":
                k += 1
                if k < n and text[k] == "*":
                    star = next_arg()
                    precision = abs(star) if isinstance(star, int) else 0
                    k += 1
                else:
                    start = k
                    while k < n and text[k].isdigit():
                        k += 1
                    precision = int(text[start:k] or 0) if k - start <= 12 else b.max_value + 1
            b.check_width(width, "a formatted string")
            b.check_width(precision, "a formatted string")
            while k < n and text[k] in "hlL":
                k += 1
            if k >= n:
                return total
            conversion = text[k]
            i = k + 1
            if conversion == "%":
                total += max(width, 1)
                continue
            if not keyed:
                arg = next_arg()
            total += max(width, _printf_field(b, conversion, arg, precision))
    except _NoArgument:
        pass
    return total


def _printf_field(b: _Budget, conversion: str, arg: Any, precision: int | None) -> int:
    if conversion in "sra":
        size = b.text_size(arg, quoted=conversion != "s", what="a formatted string")
        if conversion == "a":
            size *= 10  # \U0001f600 for one character
        return size if precision is None or conversion != "s" else min(size, precision)
    if conversion in "diouxXc":
        digits = arg.bit_length() // 3 + 3 if isinstance(arg, int) else _NUMBER_TEXT
        return max(digits, (precision or 0) + 3)
    if conversion in "eEfFgG":
        return _NUMBER_TEXT + (6 if precision is None else precision) + 8
    return 0  # not a conversion: Python raises

def _held_refs() -> int:
    # what sys.getrefcount says of a value referred to only by a held entry (the entry and
    # the call's argument), measured here as _Budget.sweep measures it
    probe = [object(), 0]
    return sys.getrefcount(probe[0])


_HELD_REFS = _held_refs()

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
    # the message reaches the caller: the same rule as any text the template makes
    _budget().text_size(message, what="an error message")
    raise _TemplateRaised(str(message))


#: the longest format ``strftime_now`` takes (Python expands it character by character first)
_MAX_STRFTIME = 4096


def _strftime_now(fmt: str) -> str:
    if isinstance(fmt, str) and len(fmt) > _MAX_STRFTIME:
        raise _LimitExceeded("size", f"strftime_now: a format of more than {_MAX_STRFTIME} "
                                     "characters")
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
        _pre_fromkeys(_budget(), *args, **kwargs)
        return dict.fromkeys(*args, **kwargs)


def _pre_fromkeys(b: _Budget, iterable: Any = (), value: Any = None, *_: Any, **__: Any) -> None:
    # one entry per key, each counting the value: refused before the dict exists
    if isinstance(iterable, Sized):
        b.check_result(len(iterable) * (2 * _ITEM_SIZE + 1 + b.size(value)), "a dict")


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
# call. Each takes the filter's arguments after the value (as the filter declares them), and
# runs after the value and arguments passed the text check (so str() of them is bounded).

#: every character Python's str.split() and str.splitlines() may split at
_WHITESPACE = "".join(c for c in map(chr, range(0x3000 + 1)) if c.isspace())
_LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
#: wordwrap: characters a textwrap chunk is cut at (whitespace, and hyphens)
_WRAP_BREAKS = _WHITESPACE + "-"
#: textwrap cuts an over-long word, and a long run of whitespace, in quadratic time: one step
#: per this many of (run length)^2 / width
_WRAP_QUADRATIC = 2048


def _count_chars(s: str, chars: str) -> int:
    return sum(map(s.count, chars))


def _pieces(n: int, length: int) -> int:
    """The size of a list of ``n`` strings of ``length`` characters in all."""
    return 1 + n * (_ITEM_SIZE + 1) + length


def _case_size(s: str) -> int:
    # case mappings may turn one character into up to three ("ß".upper() == "SS", "ΐ": 3)
    return len(s) if s.isascii() else 3 * len(s)


def _pre_center(b: _Budget, value: Any, width: Any = 80, *_: Any, **__: Any) -> None:
    b.check_width(width, "a centered string")


def _pre_indent(b: _Budget, s: Any, width: Any = 4, *_: Any, **__: Any) -> None:
    per_line = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
    b.check_width(per_line, "an indented string")
    s = str(s)
    lines = _count_chars(s, _LINE_BREAKS) + 1
    b.check_width(len(s) + lines * per_line, "an indented string")


def _pre_wordwrap(b: _Budget, s: Any, width: Any = 79, break_long_words: Any = True,
                  wrapstring: Any = None, *_: Any, **__: Any) -> None:
    s = str(s)
    if not isinstance(width, int) or width <= 0:
        return  # textwrap refuses it
    joins = len(s) // width + _count_chars(s, _WRAP_BREAKS) + _count_chars(s, _LINE_BREAKS) + 1
    sep = len(wrapstring) if isinstance(wrapstring, str) else 1
    b.check_width(len(s) + joins * sep, "a wrapped string")
    # textwrap holds a string per chunk (a word, a space, a piece of a long word) at once
    b.check_result(_pieces(joins, len(s)), "a wrapped string")
    # and cuts long words and long runs of whitespace in quadratic time
    if len(s) > width:
        runs = re.finditer(rf"\S{{{width + 1},}}|\s{{{_WRAP_QUADRATIC},}}", s)
        b.charge(sum((m.end() - m.start()) ** 2 // (width * _WRAP_QUADRATIC) for m in runs))


def _pre_format(b: _Budget, value: Any, *args: Any, **kwargs: Any) -> None:
    b.check_printf(str(value), kwargs or args)


def _pre_join(b: _Budget, value: Any, d: Any = "", attribute: Any = None, *_: Any,
              **__: Any) -> None:
    # value is a list here (materialized); the text of its items is checked; the separators
    if isinstance(value, Sequence):
        d = str(d)
        b.check_width(len(d) * max(len(value) - 1, 0), "a joined string")
        if attribute is None:
            b.check_result(len(d) * max(len(value) - 1, 0) + b.text_size(value), "a joined string")


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
    if fill_with is not None and isinstance(linecount, int):
        b.check_width(linecount * (_ITEM_SIZE + 1), "a batch")


def _pre_slice(b: _Budget, value: Any, slices: Any = 1, *_: Any, **__: Any) -> None:
    if isinstance(slices, int):
        b.check_width(slices * (_ITEM_SIZE + 1), "a slice")


def _pre_list(b: _Budget, value: Any, *_: Any, **__: Any) -> None:
    if isinstance(value, str):  # a string per character
        b.check_result(_pieces(len(value), len(value)), "a list")


def _pre_escape(b: _Budget, s: Any, *_: Any, **__: Any) -> None:
    s = str(s)
    b.check_result(len(s) + (_ESCAPE_GROWTH - 1) * _count_chars(s, "&<>\"'"), "an escaped string")


def _pre_urlize(b: _Budget, s: Any, trim_url_limit: Any = None, nofollow: Any = False,
                target: Any = None, rel: Any = None, extra_schemes: Any = None, *_: Any,
                **__: Any) -> None:
    # each word may become <a href="https://word" rel="... target">word</a>, escaped
    s = str(s)
    words = _count_chars(s, _WHITESPACE) + 1
    extra = sum(len(str(x)) for x in (target, rel) if x is not None)
    b.check_result(2 * _ESCAPE_GROWTH * len(s) + words * (64 + 2 * extra), "a linked string")
    b.check_result(_pieces(2 * words, len(s)), "a linked string")
    b.charge(words * 16)


def _pre_urlencode(b: _Budget, value: Any, *_: Any, **__: Any) -> None:
    # a character is at most 4 bytes of UTF-8, each %XX
    b.check_result(12 * b.text_size(value), "a URL-encoded string")


def _pre_case(b: _Budget, s: Any, *_: Any, **__: Any) -> None:
    s = str(s)
    b.check_result(_case_size(s), "a string")


def _pre_title(b: _Budget, s: Any, *_: Any, **__: Any) -> None:
    s = str(s)
    b.check_result(_case_size(s), "a string")
    # Jinja's title splits the string at every run of whitespace and brackets first
    b.check_result(_pieces(2 * _count_chars(s, _WHITESPACE + "-({[<") + 1, len(s)), "a string")


def _pre_pprint(b: _Budget, value: Any, *_: Any, **__: Any) -> None:
    b.check_result(_pprint_size(b, value), "a pretty-printed string")


def _pre_xmlattr(b: _Budget, d: Any, *_: Any, **__: Any) -> None:
    b.check_result(_ESCAPE_GROWTH * b.text_size(d) + 4 * len(d) if isinstance(d, Sized) else 0,
                   "an attribute string")


def _pprint_size(b: _Budget, value: Any) -> int:
    """An upper bound on ``len(pprint.pformat(value))``: each element may get a line of its
    own, indented by its depth (and, in a dict, by its key), and a long string a line per
    word."""
    leaf = _text_leaf(value, True)
    if leaf is not None:
        return 2 * leaf + 2
    total = 0
    walked = 0
    path: set[int] = {id(value)}
    stack = [(value, _children(value), 1)]
    while stack:
        container, children, indent = stack[-1]
        for child in children:
            walked += 1
            size = _text_leaf(child, True)
            if size is None and id(child) not in path:
                path.add(id(child))
                # a dict value is indented by its key; a key is at most the container's text
                stack.append((child, _children(child), indent + _TEXT_CONTAINER + (
                    b.text_size(container) if isinstance(container, dict) else 0)))
                break
            size = 5 if size is None else size
            total += (size + _TEXT_SEPARATOR) * (indent + 2)
            if total > b.max_value:
                b.charge(walked)
                return total
        else:
            stack.pop()
            path.discard(id(container))
    b.charge(walked)
    return total


def _wordcount(s: Any) -> int:
    """Jinja's ``wordcount``, counting the words without listing them."""
    return sum(1 for _ in _WORD.finditer(soft_str(s)))


_WORD = re.compile(r"\w+")

_FILTER_PRECHECKS: dict[str, Callable[..., None]] = {
    "center": _pre_center, "indent": _pre_indent, "wordwrap": _pre_wordwrap,
    "format": _pre_format, "join": _pre_join, "replace": _pre_replace,
    "batch": _pre_batch, "slice": _pre_slice, "sum": _pre_sum, "list": _pre_list,
    "e": _pre_escape, "escape": _pre_escape, "forceescape": _pre_escape,
    "urlize": _pre_urlize, "urlencode": _pre_urlencode, "upper": _pre_case,
    "lower": _pre_case, "capitalize": _pre_case, "title": _pre_title, "pprint": _pre_pprint,
    "xmlattr": _pre_xmlattr,
}

#: filters that turn an iterator into a list anyway: given an iterator (``x | map(...)``) they
#: get a list built under the budget instead, which changes nothing else they do
_FILTER_MATERIALIZE = frozenset({"list", "join", "sum", "sort", "unique", "slice", "groupby"})

#: filters that never turn their value or arguments into text (they select, count, sort or
#: convert to numbers; tojson refuses what JSON cannot hold). Every other filter's value and
#: arguments pass the text check first: printable, and bounded as text.
_NON_TEXT_FILTERS = frozenset({
    "abs", "attr", "batch", "count", "d", "default", "dictsort", "first", "float", "groupby",
    "int", "items", "last", "length", "list", "map", "max", "min", "random", "reject",
    "rejectattr", "reverse", "round", "select", "selectattr", "slice", "sort", "sum", "tojson",
    "unique",
})


def _wrap_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` charged one step per call, its value and arguments size-checked (and, for a
    filter that makes text of them, text-checked), its result too."""
    # filters marked pass_context / pass_eval_context / pass_environment get that first
    skip = 1 if getattr(func, "jinja_pass_arg", None) is not None else 0
    precheck = _FILTER_PRECHECKS.get(name)
    materialize = name in _FILTER_MATERIALIZE
    text = name not in _NON_TEXT_FILTERS

    @functools.wraps(func)  # keeps jinja_pass_arg, so Jinja still passes the context
    def filter_(*args: Any, **kwargs: Any) -> Any:
        b = _budget()
        b.charge(_FILTER_STEPS)
        if materialize and len(args) > skip and isinstance(args[skip], Iterator):
            args = (*args[:skip], b.materialize(args[skip]), *args[skip + 1:])
        for arg in itertools.chain(args[skip:], kwargs.values()):
            b.check(arg)
            if text:
                b.text_size(arg)
        if precheck is not None:
            precheck(b, *args[skip:], **kwargs)
        return b.built(func(*args, **kwargs))

    return filter_


def _wrap_test(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """A test charged one step per call; ``in`` by the length scanned, ``lower``/``upper``
    (which make text of their value) text-checked."""

    @functools.wraps(func)
    def test_(*args: Any, **kwargs: Any) -> Any:
        b = _budget()
        b.charge(_FILTER_STEPS)
        if name in ("lower", "upper") and args:
            b.text_size(args[0])
        elif name == "in" and len(args) > 1:
            _scan_filter(None, args[1])
        return func(*args, **kwargs)

    return test_


def _check_string_method(b: _Budget, owner: str | bytes, name: str, args: tuple,
                         kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """Before ``owner.<name>(*args, **kwargs)`` for the str/bytes methods that can grow a
    string, or make many, a lot; returns the arguments to call with (``join`` gets its
    iterable as a list built under the budget, ``split`` a bound on its splits)."""
    is_str = isinstance(owner, str)
    if name in ("center", "ljust", "rjust", "zfill"):
        if args:
            b.check_width(args[0], "a padded string")
    elif name == "expandtabs":
        tabsize = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(tabsize, int):
            b.check_width(len(owner) + owner.count("\t" if is_str else b"\t")
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
    elif name in ("split", "rsplit"):
        sep = args[0] if args else kwargs.get("sep")
        maxsplit = args[1] if len(args) > 1 else kwargs.get("maxsplit", -1)
        if not isinstance(maxsplit, int):
            return args, kwargs  # Python refuses it
        # at most this many pieces fit the limit: split no further than that, and refuse
        # (after the call, see _check_pieces) a result that reached it
        most = b.max_value // (_ITEM_SIZE + 1)
        if isinstance(sep, (str, bytes)) and len(sep):
            n = owner.count(sep) + 1
            if 0 <= maxsplit < n:
                n = maxsplit + 1
            b.check_result(_pieces(n, len(owner)), "a list of pieces")
        elif maxsplit < 0 or maxsplit >= most:
            kwargs = {k: v for k, v in kwargs.items() if k not in ("sep", "maxsplit")}
            args = (sep, most)
    elif name == "splitlines":
        breaks = _count_chars(owner, _LINE_BREAKS) if is_str else owner.count(b"\n") + owner.count(b"\r")
        b.check_result(_pieces(breaks + 1, len(owner)), "a list of lines")
    elif name in ("upper", "lower", "title", "capitalize", "swapcase", "casefold"):
        if is_str:
            b.check_result(_case_size(owner), "a string")
    elif name == "encode":
        # "xmlcharrefreplace" and "backslashreplace" give up to 10 bytes per character
        b.check_result(10 * len(owner) + 8, "an encoded string")
    elif name == "hex":
        b.check_result(3 * len(owner), "a hex string")
    elif name == "maketrans" and args:
        b.check_result(_pieces(b.size(args[0]), 0), "a translation table")
    return args, kwargs


def _check_pieces(b: _Budget, name: str, result: Any) -> None:
    """After ``split``/``rsplit`` bounded by :func:`_check_string_method`: refuse a result
    that reached the bound (the whole split would not fit)."""
    if name in ("split", "rsplit") and isinstance(result, list):
        if len(result) > b.max_value // (_ITEM_SIZE + 1):
            raise b.too_large("a list of pieces")


# ---------------------------------------------------------------------------------------------
# The environment


class _OutputBuffer(list):
    """Where Jinja collects the output of a macro, call block, ``{% set %}`` block, filter block
    or recursive loop before joining it: it stops growing past the value limit, so a block that
    loops over big distinct strings fails before it holds them all, and what all the buffers
    of a render hold at once (one per macro frame of a recursion) counts as held."""

    __slots__ = ("_budget", "_length", "_counted")

    def __init__(self, budget: _Budget):
        super().__init__()
        self._budget = budget
        self._length = 0
        self._counted = 0  # what this buffer added to budget.buffered

    def append(self, item: Any) -> None:
        if isinstance(item, str):
            n = len(item)
            self._length += n
            if self._length > self._budget.max_value:
                raise self._budget.too_large("a block of output")
            if id(item) not in self._budget.held:  # a held string is counted once, there
                self._counted += n
                self._budget.buffer(n)
        super().append(item)

    def extend(self, items: Any) -> None:
        for item in items:
            self.append(item)


class _CodeGenerator(CodeGenerator):
    """Jinja's code generator, with block output buffers that are :class:`_OutputBuffer`."""

    def buffer(self, frame: Any) -> None:
        frame.buffer = self.temporary_identifier()
        self.writeline(f"{frame.buffer} = environment.ggmlpy_buffer()")


class _BoundedFormatter(SandboxedFormatter):
    """``str.format`` for templates: the sandbox's formatter (attribute access checked), with
    each field text-checked and bounded before it is formatted, and the result bounded as it
    grows, so ``('{0}' * 10000).format(s)`` fails at the field that passes the limit."""

    escape = False

    def __init__(self, env: Any, budget: _Budget, **kwargs: Any):
        super().__init__(env, **kwargs)
        self._budget = budget
        self._total = 0

    def vformat(self, format_string: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        self._total = len(format_string)
        return super().vformat(format_string, args, kwargs)

    def convert_field(self, value: Any, conversion: str | None) -> Any:
        if conversion is not None:  # !s, !r, !a: the text is built here
            size = self._budget.text_size(value, quoted=conversion != "s",
                                          what="a formatted string")
            self._budget.check_result(self._total + size * (10 if conversion == "a" else 1),
                                      "a formatted string")
        return super().convert_field(value, conversion)

    def format_field(self, value: Any, format_spec: str) -> str:
        b = self._budget
        b.charge(_FILTER_STEPS)
        b.check_result(self._total + b.check_format_spec(value, format_spec, self.escape),
                       "a formatted string")
        text = super().format_field(value, format_spec)
        self._total += len(text)
        b.check_result(self._total, "a formatted string")
        return text


class _BoundedEscapeFormatter(_BoundedFormatter, SandboxedEscapeFormatter):
    """:class:`_BoundedFormatter` for ``Markup.format`` (which escapes each field)."""

    escape = True


class _SandboxEnvironment(ImmutableSandboxedEnvironment):
    """transformers' environment plus the budget: each hook charges steps and checks sizes."""

    # the operators that can build a big value (or a big integer) in one step. Unary
    # operators need no hook: -x, +x and not x make numbers and booleans only.
    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        # the sandbox would return an undefined value that fails only when used; fail now, so a
        # template cannot even test which internals exist
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} "
                            "object is unsafe")

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """``str.format``/``format_map`` (and ``Markup``'s) as the sandbox gives them to
        templates, through :class:`_BoundedFormatter`."""
        if (not isinstance(value, (types.MethodType, types.BuiltinMethodType))
                or value.__name__ not in ("format", "format_map")
                or not isinstance(value.__self__, str)):
            return None
        fmt = value.__self__
        is_map = value.__name__ == "format_map"

        def format_(*args: Any, **kwargs: Any) -> str:
            if is_map:
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one argument and no keywords")
                args, kwargs = (), args[0]
            b = _budget()
            formatter = (_BoundedEscapeFormatter(self, b, escape=fmt.escape)
                         if isinstance(fmt, Markup) else _BoundedFormatter(self, b))
            return type(fmt)(formatter.vformat(fmt, args, kwargs))

        format_.__name__ = format_.__qualname__ = value.__name__
        return format_

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805,B902
        b = _budget()
        b.charge(_CALL_STEPS)
        kind = type(__obj)
        name = None
        if isinstance(__obj, LoopContext):
            # a recursive loop's ``loop(children)``: count those iterations too
            if args:
                args = (_CountedIterable(args[0], b), *args[1:])
        elif kind is types.BuiltinMethodType:
            owner = getattr(__obj, "__self__", None)
            name = __obj.__name__
            if isinstance(owner, (str, bytes)):
                internal = {k: v for k, v in kwargs.items() if k in ("_loop_vars", "_block_vars")}
                plain = {k: v for k, v in kwargs.items() if k not in internal}
                args, plain = _check_string_method(b, owner, name, args, plain)
                kwargs = {**plain, **internal}
            elif name == "fromkeys":  # {}.fromkeys(...)
                _pre_fromkeys(b, *args, **kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        if name is not None:
            _check_pieces(b, name, result)
        return b.built(result)

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
        return b.built(self.binop_table[operator](left, right))

    def concat(self, parts: Any) -> str:  # type: ignore[override]
        # joins the output of blocks, macros, {% set %}...{% endset %} and {% filter %}: many
        # small pieces (one per loop iteration) can add up to a huge string
        b = _budget()
        if isinstance(parts, _OutputBuffer):
            b.buffer(-parts._counted)  # joined: the result is held (if large) as a value
            parts._counted = 0
        elif not isinstance(parts, list):
            parts = list(parts)
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
    # value that prints huge (many references to one big string) from being printed at all,
    # and an object that is not the template's to print (a function: its name and address)
    b = _budget()
    b.check(value)
    if type(value) is not str:
        b.text_size(value, what="a printed value")
    return value


@jinja2.pass_context  # never folded into a constant at compile time
def _loop_filter(context: Any, iterable: Any) -> _CountedIterable:
    return _CountedIterable(iterable, _budget())


@jinja2.pass_context
def _value_filter(context: Any, value: Any) -> Any:
    # a value just built by a literal or a ``~``
    return _budget().built(value)


@jinja2.pass_context
def _text_filter(context: Any, value: Any) -> Any:
    # an operand of ``~``, which str() turns into text next
    b = _budget()
    b.check(value)
    if type(value) is not str:
        b.text_size(value, what="a concatenation")
    return value


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
_TEXT_FILTER = "ggmlpy text"
_SCAN_FILTER = "ggmlpy scan"


class _Instrument(NodeTransformer):
    """Rewrites a parsed template so the budget sees what the sandbox hooks do not: loop
    iterations (each ``{% for %}`` iterates through a counting wrapper), membership tests
    (``x in big_list`` is charged by the list's length), and values built without a call
    (``~`` concatenations, list/tuple/dict literals, slices), which get size-checked (and
    the operands of ``~`` text-checked).
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

    def visit_Getitem(self, node: nodes.Getitem) -> nodes.Node:
        self.generic_visit(node)
        # Jinja slices without the sandbox's getitem: a slice is a copy, a value built
        if isinstance(node.arg, nodes.Slice) and getattr(node, "ctx", "load") == "load":
            return self._wrap(_VALUE_FILTER, node)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        # each operand is text-checked before str() turns it into text, the result after joining
        node.nodes = [self._wrap(_TEXT_FILTER, n) for n in node.nodes]
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
    env.filters["wordcount"] = _wrap_filter("wordcount", _wordcount)
    for name, func in list(env.tests.items()):
        env.tests[name] = _wrap_test(name, func)
    env.filters[_LOOP_FILTER] = _loop_filter
    env.filters[_VALUE_FILTER] = _value_filter
    env.filters[_TEXT_FILTER] = _text_filter
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
