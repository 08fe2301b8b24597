"""The budget of one chat-template render: steps, time, and the sizes of the values it builds.

A render's :class:`_Budget` is reached through a context variable (:func:`_budget`), because the
environment (and the compiled template) is shared by every render in every thread. It counts steps
(loop iterations, calls, filters, operators) against ``max_steps`` and looks at the clock every
``_CLOCK_EVERY`` steps; it sizes every value the template builds (:meth:`_Budget.size`,
:meth:`_Budget.built`), bounds what turns into text (:meth:`_Budget.text_size`, ``%`` formats before
they run) and holds the large values alive at once (:meth:`_Budget.hold`). :mod:`._sandbox` charges it
from Jinja's hooks; :mod:`.chat_template` makes one per render.
"""

from __future__ import annotations

import contextvars
import itertools
import re
import sys
import time
from collections.abc import Iterator, MappingView
from typing import Any

import jinja2
from jinja2.exceptions import SecurityError
from jinja2.utils import Namespace

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


class _LimitExceeded(Exception):
    """A budget ran out. Deliberately not a subclass of anything Jinja or the sandbox catches
    (AttributeError, TypeError, LookupError), so a template cannot swallow it."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


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
