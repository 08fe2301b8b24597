"""ggmlpy.tokenizer.chat_template against hostile templates and inputs, round 3 (issue 33, item 3).

* Every operation that can grow a value (``str.format``, ``%``, ``join``, ``replace``, ``*``,
  ``+``, padding, string filters, ``list``/``batch``/``slice``, ``split``, ``dict.fromkeys``, ...)
  is bounded before it runs, and the values a render holds at once are bounded together
  (``{% set %}`` after ``{% set %}``, list literals, macro recursion): each hostile template of
  the table fails with ChatTemplateError, and the whole table runs in a fresh interpreter whose
  peak RSS stays within 64 MiB of what it was before the first case.
* No object the template did not build prints: functions, methods, classes, generators, loops,
  macros and the environment's helpers are refused wherever they would turn into text
  (output, ``~``, ``%``, ``str.format``, string filters, ``raise_exception``), while the values a
  template may build still print exactly as Jinja prints them.
* Inputs that contain themselves or nest too deeply are refused with ChatTemplateError.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import jinja2.sandbox
import pytest

from ggmlpy.tokenizer.chat_template import MAX_INPUT_DEPTH, ChatTemplate, ChatTemplateError

MSGS = [{"role": "user", "content": "hi"}]

#: the peak RSS the whole table may add to a fresh interpreter (the defaults: max_output 1 MiB)
RSS_BOUND_MIB = 64


def _list(items: str, n: int) -> str:
    """A list literal of ``n`` distinct values: many values alive at once."""
    return "[" + ", ".join(items.format(i=i) for i in range(n)) + "]"


#: id -> (template, kind, words in the message). Unbounded, each takes hundreds of MB to many
#: GB (or, for wordwrap, minutes in one call); bounded, each fails at once.
HOSTILE = {
    # str.format: the example, and its cousins
    "format_repeat": ("{{ ('{0}' * 10000).format('x' * 100000) }}", "size", "formatted"),
    "format_map_repeat": ("{{ ('{a}' * 10000).format_map({'a': 'x' * 100000}) }}", "size", "formatted"),
    "format_repr_escapes": ("{{ ('{0!r}' * 100).format('\\x00' * 100000) }}", "size", "formatted"),
    "format_width": ("{{ '{:>1000000000}'.format(1) }}", "size", "formatted"),
    "format_nested_spec": ("{{ '{0:{1}}'.format('a', '>1000000000') }}", "size", "formatted"),
    "format_markup_escapes": ("{{ ('{}'|safe).format('<' * 300000) }}", "size", "formatted"),
    # % formatting
    "printf_mapping_repeat": ("{{ ('%(a)s' * 10000) % {'a': 'x' * 100000} }}", "size", "formatted"),
    "printf_star": ("{{ '%*d' % (10**9, 1) }}", "size", "formatted"),
    "printf_precision": ("{{ '%.1000000000f' % 1.0 }}", "size", "formatted"),
    "printf_precisions": ("{{ ('%.500000f' * 3) % (1.0, 1.0, 1.0) }}", "size", "formatted"),
    "printf_repr_escapes": ("{{ '%s' % ([('\\x00' * 100000)] * 10,) }}", "size", "text"),
    "printf_ascii": ("{{ '%a' % ('\U0001f600' * 200000) }}", "size", "formatted"),
    "format_filter_mapping": ("{{ ('%(a)s' * 10000)|format(a='x' * 100000) }}", "size", "formatted"),
    # values many at once: each within the limit, together far over it
    "set_after_set": ("".join(f"{{% set a{i} = 'x' * 1000000 ~ {i} %}}" for i in range(40)),
                      "size", "holds values"),
    "list_literal_big": ("{{ " + _list("'\U0001f600' * 300000 ~ {i}", 100) + "|length }}", "size", "holds values"),
    "list_literal_small": ("{{ " + _list("'\U0001f600' * 2000 ~ {i}", 3000) + "|length }}", "size", "holds values"),
    "macro_frames": ("{% macro f(n) %}{% set s = '\U0001f600' * 1000000 ~ n %}{% if n < 200 %}{{ f(n + 1) }}"
                     "{% endif %}{% endmacro %}{{ f(0) }}", "size", "holds values"),
    "macro_buffers": ("{% macro f(n) %}{{ 'x' * 900000 ~ n }}{% if n %}{{ f(n - 1) }}{% endif %}{% endmacro %}"
                      "{{ f(100) }}", "size", "holds values"),
    "recursive_loop_frames": ("{% for x in [1] recursive %}{% set s = '\U0001f600' * 900000 ~ loop.depth %}"
                              "{{ loop([x]) }}{% endfor %}", "size", "holds values"),
    "slices": ("{% set big = 'x' * 1000000 %}" + "".join(f"{{% set s{i} = big[{i}:] %}}" for i in range(40)),
               "size", "holds values"),
    # growth in one call
    "namespace_concat": ("{% set ns = namespace(s='') %}{% for i in range(100000) %}"
                         "{% set ns.s = ns.s ~ ('x' * 1000) %}{% endfor %}", "size", "larger than"),
    "namespace_list": ("{% set ns = namespace(l=[]) %}{% for i in range(1000) %}"
                       "{% set ns.l = ns.l + ['x' * 10000 ~ i] %}{% endfor %}", "size", "larger than"),
    "dict_growth": ("{% set ns = namespace(d={}) %}{% for i in range(100000) %}"
                    "{% set ns.d = dict(ns.d, **{('k' ~ i): 'x' * 1000}) %}{% endfor %}", "size", "larger than"),
    "fromkeys_method": ("{{ {}.fromkeys(range(100000), 'x')|length }}", "size", "dict"),
    "fromkeys_items": ("{{ dict.fromkeys(range(100000)).items()|list|length }}", "size", "dict"),
    "batch_items": ("{{ range(100000)|batch(1)|list|length }}", "size", "list"),
    "slice_items": ("{{ range(99999)|slice(99999)|list|length }}", "size", "list"),
    "list_of_chars": ("{{ ('\u4e2d' * 1000000)|list|length }}", "size", "list"),
    "split_words": ("{{ ('\u4e2d ' * 500000).split()|length }}", "size", "pieces"),
    "split_sep": ("{{ ('a,' * 500000).split(',')|length }}", "size", "pieces"),
    "splitlines": ("{{ ('\\n' * 1000000).splitlines()|length }}", "size", "lines"),
    "wordwrap_quadratic": ("{{ ('x' * 1000000)|wordwrap(1) }}", "size", "wrapped"),
    "wordwrap_whitespace": ("{{ ('\\t' * 1000000)|wordwrap(80) }}", "size", "wrapped"),
    "indent_width": ("{{ ('a\\n' * 1000)|indent(10**6) }}", "size", "indented"),
    "escape": ("{{ ('&' * 1000000)|e }}", "size", "escaped"),
    "urlize": ("{{ ('a.com ' * 150000)|urlize }}", "size", "linked"),
    "urlencode": ("{{ ('x' * 1000000)|urlencode }}", "size", "URL-encoded"),
    "upper_filter": ("{{ ('\u00df' * 1000000)|upper }}", "size", "string"),
    "upper_method": ("{{ ('\u00df' * 1000000).upper() }}", "size", "string"),
    "title": ("{{ ('\u4e2d ' * 500000)|title }}", "size", "string"),
    "encode": ("{{ ('\U0001f600' * 500000).encode('ascii', 'xmlcharrefreplace') }}", "size", "encoded"),
    "zfill": ("{{ 'x'.zfill(10**9) }}", "size", "padded"),
    "string_of_escapes": ("{{ ['\\x00\U0001f600' * 400000]|string }}", "size", "text"),
    "pprint_key_indent": ("{{ {'k' * 500000: [1, 2, 3]}|pprint }}", "size", "pretty-printed"),
    "strftime": ("{{ strftime_now('%c' * 500000) }}", "size", "strftime_now"),
    "join_items": ("{{ range(100000)|map('center', 20)|join }}", "size", "larger than"),
}


def _run_table(cases: dict[str, tuple[str, str, str]]) -> tuple[list[dict], float]:
    """Renders each case in a fresh interpreter: what it raised, and the peak RSS (MiB) the
    cases added to the interpreter (after a warm-up render)."""
    script = textwrap.dedent("""
        import json, resource, sys
        from ggmlpy.tokenizer.chat_template import ChatTemplate, ChatTemplateError

        def peak_mib():
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            return rss / (2**20 if sys.platform == "darwin" else 2**10)

        msgs = [{"role": "user", "content": "hi"}]
        ChatTemplate("{{ messages|tojson }}{{ '%s' % 1 }}{{ '{}'.format(2) }}").render(msgs)
        base = peak_mib()
        results = []
        for src in json.load(sys.stdin):
            try:
                out = ChatTemplate(src).render(msgs)
                results.append({"rendered": out[:100]})
            except ChatTemplateError as exc:
                results.append({"kind": exc.kind, "message": str(exc), "lineno": exc.lineno,
                                "rss": peak_mib() - base})
            except BaseException as exc:  # the test names it
                results.append({"raw": f"{type(exc).__name__}: {exc}"[:300]})
        print(json.dumps({"results": results, "peak": peak_mib() - base}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], input=json.dumps([c[0] for c in cases.values()]),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    return data["results"], data["peak"]


def test_hostile_templates_fail_within_bounded_memory():
    results, peak = _run_table(HOSTILE)
    problems = []
    for (case, (_src, kind, words)), got in zip(HOSTILE.items(), results):
        if got.get("kind") != kind or words not in got.get("message", ""):
            problems.append(f"{case}: wanted {kind!r} with {words!r}, got {got}")
        elif got["lineno"] is None or " at 0x" in got["message"]:
            problems.append(f"{case}: {got}")
    assert not problems, "\n".join(problems)
    # the peak is cumulative: the first case past the bound is the culprit
    over = [(case, round(got["rss"])) for case, got in zip(HOSTILE, results) if got["rss"] > RSS_BOUND_MIB]
    assert peak <= RSS_BOUND_MIB, f"peak RSS +{peak:.0f} MiB; cases over: {over}"


# -- nothing the template did not build turns into text --------------------------------------------

#: id -> template: each would print an internal name, and most a heap address
LEAKS = {
    "percent_r": "{{ '%r' % (raise_exception,) }}",
    "percent_s": "{{ '%s' % raise_exception }}",
    "output": "{{ raise_exception }}",
    "output_method": "{{ 'abc'.upper }}",
    "output_in_list": "{{ [raise_exception] }}",
    "output_in_dict": "{{ {'f': strftime_now} }}",
    "output_in_namespace": "{{ namespace(f=range) }}",
    "format": "{{ '{}'.format(range) }}",
    "format_repr": "{{ '{!r}'.format(lipsum) }}",
    "format_attribute": "{{ '{0.upper}'.format('a') }}",
    "format_map": "{{ '{f}'.format_map({'f': dict}) }}",
    "class": "{{ namespace }}",
    "helper_object": "{{ dict }}",
    "cycler": "{{ cycler(1, 2) }}",
    "joiner": "{{ joiner() }}",
    "self": "{{ self }}",
    "generator": "{{ [1, 2]|map('string') }}",
    "iterator": "{{ [1, 2]|reverse }}",
    "loop": "{% for m in messages %}{{ loop }}{% endfor %}",
    "loop_method": "{% for m in messages %}{{ loop.cycle }}{% endfor %}",
    "macro": "{% macro m() %}{% endmacro %}{{ m }}",
    "caller": "{% macro m() %}{{ caller }}{% endmacro %}{% call m() %}{% endcall %}",
    "concat": "{{ 'x' ~ raise_exception }}",
    "concat_list": "{{ [1] ~ [raise_exception] }}",
    "string_filter": "{{ raise_exception|string }}",
    "pprint_filter": "{{ raise_exception|pprint }}",
    "join_filter": "{{ [raise_exception]|join }}",
    "join_separator": "{{ [1, 2]|join(raise_exception) }}",
    "center_filter": "{{ raise_exception|center(80) }}",
    "safe_filter": "{{ raise_exception|safe }}",
    "format_filter": "{{ '%s'|format(raise_exception) }}",
    "upper_filter": "{{ range|upper }}",
    "replace_filter": "{{ raise_exception|replace('a', 'b') }}",
    "block_filter": "{% filter upper %}{{ strftime_now }}{% endfilter %}",
    "raise_message": "{{ raise_exception(raise_exception) }}",
    "default": "{{ undefined_name|default(raise_exception) }}",
}


@pytest.mark.parametrize("case", list(LEAKS))
def test_no_internal_object_reaches_the_output(case):
    with pytest.raises(ChatTemplateError) as err:
        ChatTemplate(LEAKS[case]).render(MSGS)
    assert err.value.kind == "forbidden", err.value
    assert "into text" in str(err.value)
    assert "0x" not in str(err.value)


#: what a template may build prints exactly as Jinja prints it
PRINTABLE = [
    "{{ [1, 'a', none, true, 1.5, (1,), {'k': [2, 'é\\n']}] }}",
    "{{ namespace(a=1, b=[1]) }}|{{ dict(a=(1, 2)) }}|{{ (1, 'b') }}|{{ [] }}|{{ {} }}",
    "{{ '%r|%s|%5s|%-3d|%05.1f|%x|%c|%%' % ('x', [1, 'y'], 'ab', 7, 3.14159, 255, 65) }}",
    "{{ '%(a)s-%(b)r' % {'a': 1, 'b': 'q'} }}|{{ 'x %s y %d'|format('q', 3) }}",
    "{{ '{!r}|{:>6}|{:^5}|{:.3}|{:,}|{a}'.format('x', 'r', 'c', 'abcdef', 1234567, a=[1]) }}",
    "{{ '{0[0]}{0[1]}'.format('ab') }}|{{ '{a}'.format_map({'a': 'b'}) }}",
    "{{ messages[0].items() }}|{{ messages[0].keys() }}|{{ messages[0].values() }}|{{ range(3) }}",
    "{{ [nothing] }}|{{ nothing }}|{{ 'a' ~ nothing ~ 1 ~ [2] }}",
    "{{ messages|groupby('role') }}|{{ 'a\\tb'|string }}|{{ [1, 2]|join(', ') }}|{{ ('<a>'|safe) }}",
    "{{ {'k': 1}|pprint }}|{{ 'x'|pprint }}|{{ [1]|string|upper }}|{{ '<&>'|e }}",
    "{{ 'ab cd'|wordcount }}|{{ 'ab'|title }}|{{ 'a b c'.split() }}|{{ 'a,b'.split(',') }}|{{ 'a\\nb'.splitlines() }}",
]


@pytest.mark.parametrize("src", PRINTABLE)
def test_template_values_print_as_jinja_prints_them(src):
    plain = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    assert ChatTemplate(src).render(MSGS) == plain.from_string(src).render(messages=MSGS)


# -- inputs ---------------------------------------------------------------------------------------


def _nested(depth: int) -> list:
    top = inner = []
    for _ in range(depth):
        inner.append([])
        inner = inner[0]
    return top


def test_cyclic_inputs_are_refused():
    cyclic = [1]
    cyclic.append(cyclic)
    looped = {"a": 1}
    looped["self"] = looped
    t = ChatTemplate("{{ messages|length }}")
    for kwargs, where in [
        ({"messages": [{"role": "user", "content": cyclic}]}, "messages[0]['content'][1]"),
        ({"messages": [{"role": "user", "content": "x", "meta": looped}]}, "messages[0]['meta']['self']"),
        ({"messages": MSGS, "tools": [{"type": "function", "function": looped}]}, "tools[0]['function']['self']"),
        ({"messages": MSGS, "documents": [{"title": "t", "text": cyclic}]}, "documents[0]['text'][1]"),
        ({"messages": MSGS, "extra": {"a": cyclic}}, "extra['a'][1]"),
    ]:
        with pytest.raises(ChatTemplateError) as err:
            t.render(**kwargs)
        assert err.value.kind == "input"
        assert f"input {where} contains itself" in str(err.value)


def test_deep_inputs_are_refused():
    t = ChatTemplate("{{ messages|tojson }}")
    # the depth counts from the argument: messages -> message -> content -> the nested lists
    assert t.render([{"role": "user", "content": _nested(MAX_INPUT_DEPTH - 3)}]).count("[") == MAX_INPUT_DEPTH - 1
    for kwargs in ({"messages": [{"role": "user", "content": _nested(MAX_INPUT_DEPTH)}]},
                   {"messages": [{"role": "user", "content": _nested(100_000)}]},
                   {"messages": MSGS, "extra": _nested(100_000)}):
        with pytest.raises(ChatTemplateError) as err:
            t.render(**kwargs)
        assert err.value.kind == "input"
        assert f"nests deeper than {MAX_INPUT_DEPTH} levels" in str(err.value)


def test_shared_inputs_are_rebuilt_once():
    """An input sharing its parts (a DAG that prints as 2**64 elements) is prepared at once, and
    printing it is refused as too large."""
    shared: list = ["x"]
    for _ in range(64):
        shared = [shared, shared]
    with pytest.raises(ChatTemplateError) as err:
        ChatTemplate("{{ messages }}").render([{"role": "user", "content": shared}])
    assert err.value.kind == "size"
    assert ChatTemplate("{{ messages[0].role }}").render([{"role": "user", "content": shared}]) == "user"
