"""The bounded Jinja environment chat templates render in: transformers' sandboxed environment and
helpers, with every hook charging the render's budget (:mod:`._limits`).

How: the template is parsed, then rewritten (loops iterate through a step-counting wrapper,
built values pass a size check, operands of ``~`` a text check) before Jinja compiles it;
the sandbox's hooks for calls, operators and ``str.format``, and every filter and test,
charge the render's budget; large built values are held in a table that a sweep releases
once nothing else refers to them; block output is collected in size-checked buffers.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
import types
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any, Callable

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.runtime import LoopContext
from jinja2.sandbox import (
    ImmutableSandboxedEnvironment,
    SandboxedEscapeFormatter,
    SandboxedFormatter,
    safe_range,
)
from jinja2.utils import Namespace
from jinja2.visitor import NodeTransformer
from markupsafe import Markup

from ._limits import (
    _BUDGET,
    _CALL_STEPS,
    _CHARS_PER_STEP,
    _COMPILE_STEPS,
    _COMPILE_VALUE,
    _FILTER_STEPS,
    _OP_STEPS,
    DEFAULT_MAX_SECONDS,
    _Budget,
    _budget,
    _CountedIterable,
    _LimitExceeded,
)
from ._prechecks import (
    _FILTER_MATERIALIZE,
    _FILTER_PRECHECKS,
    _NON_TEXT_FILTERS,
    _check_pieces,
    _check_string_method,
    _pre_fromkeys,
    _wordcount,
)


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


# Older Jinja releases have known sandbox escapes, and chat templates are untrusted code
# (transformers refuses them for the same reason).
if _version_tuple(jinja2.__version__) < (3, 1, 6):
    raise ImportError(f"ggmlpy.tokenizer.chat_template needs jinja2>=3.1.6, found {jinja2.__version__}")


class _TemplateRaised(TemplateError):
    """What ``raise_exception`` raises; a TemplateError like transformers' own."""


class _LoadForbidden(TemplateError):
    """A template tried to include, import or extend another template."""


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
