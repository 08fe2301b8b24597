"""Sizes estimated before an operation runs: the filters and string methods that can build a value
much larger than their input in one call (padding, joins, replacements, case mappings, splits,
escaping, pretty-printing), refused by the render's budget (:mod:`._limits`) before they build it.

Each filter pre-check takes the filter's arguments after the value (as the filter declares them), and
runs after the value and arguments passed the text check (so str() of them is bounded);
:mod:`._sandbox` calls them from its filter wrappers and its ``call`` hook.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence, Sized
from typing import Any, Callable

from markupsafe import soft_str

from ._limits import (
    _ESCAPE_GROWTH,
    _ITEM_SIZE,
    _TEXT_CONTAINER,
    _TEXT_SEPARATOR,
    _Budget,
    _children,
    _text_leaf,
)

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


def _pre_fromkeys(b: _Budget, iterable: Any = (), value: Any = None, *_: Any, **__: Any) -> None:
    # one entry per key, each counting the value: refused before the dict exists
    if isinstance(iterable, Sized):
        b.check_result(len(iterable) * (2 * _ITEM_SIZE + 1 + b.size(value)), "a dict")


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
