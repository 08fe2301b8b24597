"""Parsers against llama.cpp's templates: a rendered assistant turn parses back to what was rendered,
streamed in any chunks to the same reply; hostile replies stay content."""

from __future__ import annotations

import json

import pytest
from chat_refs import ARGS, CALL_ID, CONTENT, HAND_REFERENCES, REASONING, TOOLS, reference, sources
from hypothesis import given
from hypothesis import strategies as st

from ggmlpy._core import GGMLTypeError, GGMLValueError
from ggmlpy.chat import MAX_JSON_DEPTH, ChatFormat, Reply, ToolCall, chat_format

#: templates whose detected tool format does not read their rendered turn, and why
KNOWN_GAPS = {
    "Apriel-1.6-15b-Thinker-fixed": "its reasoning has no tags ('Here are my reasoning steps' ... '[BEGIN FINAL "
                                    "RESPONSE]'): not split off",
    "NVIDIA-Nemotron-Nano-v2": "renders the call as a second assistant turn",
}


def _tool_templates() -> list[str]:
    names = []
    for name, src in sources().items():
        if chat_format(src).name != "generic" and name not in KNOWN_GAPS and \
                (name in HAND_REFERENCES or reference(name) is not None):
            names.append(name)
    return names


TOOL_TEMPLATES = _tool_templates()


def _case(name: str) -> tuple[str, ChatFormat]:
    if name in HAND_REFERENCES:
        return HAND_REFERENCES[name], chat_format(sources()[name], tools=TOOLS)
    reply, fmt, _ = reference(name)
    return reply, fmt


def _expected(name: str, reply: str, fmt: ChatFormat) -> tuple[str, str | None, list]:
    """What the reply holds: the content, reasoning and call the conversation gave, where the
    template rendered them."""
    content = CONTENT if CONTENT in reply else ""
    reasoning = REASONING if REASONING in reply else None
    calls = [("get_weather", ARGS)] if "get_weather" in reply else []
    return content, reasoning, calls


def test_the_tool_formats_cover_the_families():
    """Every family asked for is recognised in at least one real template (and all of them parse)."""
    found = {chat_format(sources()[n]).name for n in TOOL_TEMPLATES}
    assert {"hermes", "llama3", "mistral", "gpt_oss", "deepseek", "functionary_v3_1", "functionary_v3_2",
            "command_r", "kimi_k2", "qwen3_coder", "glm_4_5", "minimax_m2", "json_array"} <= found, found
    assert len(TOOL_TEMPLATES) >= 41


@pytest.mark.parametrize("name", TOOL_TEMPLATES)
def test_rendered_turn_parses_back(name):
    reply, fmt = _case(name)
    content, reasoning, calls = _expected(name, reply, fmt)
    got = fmt.parse(reply)
    assert (got.content, got.reasoning) == (content, reasoning), reply
    assert [(c.name, c.arguments) for c in got.tool_calls] == calls, reply
    for call in got.tool_calls:
        assert json.loads(call.arguments_json) == call.arguments
        if CALL_ID in reply:
            assert call.id == CALL_ID                  # Mistral's own id
        elif fmt.name == "command_r":
            assert call.id == "0"
        elif fmt.name == "kimi_k2":
            assert call.id == "functions.get_weather:0"
        else:
            assert call.id.startswith("call_") and len(call.id) == 14 and call.id[5:].isalnum()


def _streamed(fmt: ChatFormat, chunks: list[str]) -> Reply:
    """The reply rebuilt from the deltas alone."""
    s = fmt.stream()
    deltas = [d for c in chunks for d in s.feed(c)] + s.finish()
    content = "".join(d.content for d in deltas)
    reasoning = "".join(d.reasoning for d in deltas) or None
    calls: dict[int, list] = {}
    for d in deltas:
        if d.tool_call is not None:
            tc = d.tool_call
            if tc.index not in calls:
                assert tc.id and tc.name, "the first delta of a call names it"
                calls[tc.index] = [tc.id, tc.name, ""]
            calls[tc.index][2] += tc.arguments
    assert sorted(calls) == list(range(len(calls)))
    return Reply(content, reasoning, [ToolCall(i, n, json.loads(a)) for i, n, a in calls.values()])


def _markers(fmt: ChatFormat) -> set[str]:
    return {m for state in ("content", "reasoning", "header", "recipient") for m in fmt._markers(state)
            if len(m) > 2}


@pytest.mark.parametrize("name", TOOL_TEMPLATES)
def test_streaming_at_every_split_equals_the_whole_parse(name):
    reply, fmt = _case(name)
    whole = fmt.parse(reply)
    assert _streamed(fmt, list(reply)) == whole          # one character at a time
    for i in range(len(reply) + 1):
        assert _streamed(fmt, [reply[:i], reply[i:]]) == whole, i
    s = fmt.stream()
    for ch in reply:        # content is never a marker's beginning that is then taken back
        for d in s.feed(ch):
            assert not any(m[:3] in d.content for m in _markers(fmt) if m[:3] not in whole.content), d


@pytest.mark.parametrize("name", TOOL_TEMPLATES[::4])
@given(data=st.data())
def test_streaming_random_chunks(name, data):
    reply, fmt = _case(name)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(reply)), max_size=12)))
    chunks = [reply[a:b] for a, b in zip([0, *cuts], [*cuts, len(reply)])]
    assert _streamed(fmt, chunks) == fmt.parse(reply)


HERMES = "{{ '<think>' }}{{ '<tool_call>' }}"


@pytest.mark.parametrize("text, content", [
    ('<tool_call>{"name": "f", "arguments": {"a": </tool_call>', '<tool_call>{"name": "f", "arguments": {"a": '
                                                                 '</tool_call>'),     # invalid JSON
    ('Hi <tool_call>{"name": "f"', 'Hi <tool_call>{"name": "f"'),                    # unclosed, unparsable
    ('<tool_call>[1, 2]</tool_call>', "<tool_call>[1, 2]</tool_call>"),              # not a call
    ("a <tool b", "a <tool b"),                                                       # a marker's start only
])
def test_garbage_stays_content(text, content):
    got = chat_format(HERMES).parse(text)
    assert (got.content, got.tool_calls) == (content, [])
    assert _streamed(chat_format(HERMES), list(text)) == got


def test_unclosed_call_and_reasoning_at_the_end():
    fmt = chat_format(HERMES)
    got = fmt.parse('<tool_call>{"name": "f", "arguments": {"a": 1}}')
    assert [(c.name, c.arguments) for c in got.tool_calls] == [("f", {"a": 1})]
    assert fmt.parse("<think>still thinking").reasoning == "still thinking"


def test_deep_json_is_bounded():
    fmt = chat_format(HERMES)
    deep = '<tool_call>{"name": "f", "arguments": ' + "[" * 100_000 + "]" * 100_000 + "}</tool_call>"
    got = fmt.parse(deep)
    assert got.tool_calls == [] and got.content == deep
    ok = '<tool_call>{"name": "f", "arguments": {"a": ' + "[" * (MAX_JSON_DEPTH - 2) + "]" * (MAX_JSON_DEPTH - 2) + \
        "}}</tool_call>"
    assert len(fmt.parse(ok).tool_calls) == 1


def test_huge_reply_is_linear():
    import time

    fmt = chat_format(HERMES)
    big = "x" * 200_000
    text = ("word <tool " * 20_000) + '<tool_call>{"name": "f", "arguments": {"s": "' + big + '"}}</tool_call>'
    t0 = time.perf_counter()
    s = fmt.stream()
    for i in range(0, len(text), 7):
        s.feed(text[i:i + 7])
    s.finish()
    assert time.perf_counter() - t0 < 10
    assert s.reply == fmt.parse(text) and s.reply.tool_calls[0].arguments["s"] == big


def test_wrong_types_are_clear_errors():
    fmt = chat_format(HERMES)
    with pytest.raises(GGMLTypeError, match="str"):
        fmt.parse(b"bytes")
    with pytest.raises(GGMLTypeError, match="str"):
        fmt.stream().feed(None)
    with pytest.raises(GGMLTypeError, match="template_source"):
        chat_format(None)
    with pytest.raises(GGMLTypeError):
        chat_format(HERMES, tools="nope")
    s = fmt.stream()
    s.finish()
    with pytest.raises(GGMLValueError, match="finished"):
        s.feed("x")


def test_generic_format():
    plain = chat_format("{{ messages }}")
    assert plain.name == "generic" and plain.reasoning_tags is None
    assert plain.parse(" <think>x</think> y ").content == "<think>x</think> y"
    think = chat_format("{{ '<think>' }}")
    assert (think.parse("<think>x</think> y").reasoning, think.parse("<think>x</think> y").content) == ("x", "y")
    with_tools = chat_format("{{ messages }}", tools=TOOLS)
    got = with_tools.parse('{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}')
    assert [(c.name, c.arguments) for c in got.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert with_tools.parse('{"answer": 1}').content == '{"answer": 1}'


def test_thinking_forced_open_follows_the_prompt():
    qwen3 = sources()["Qwen-Qwen3-0.6B"]
    assert not chat_format(qwen3).thinking_forced_open          # Qwen3 lets the model open it
    r1 = chat_format(sources()["deepseek-ai-DeepSeek-R1-Distill-Qwen-32B"])
    assert r1.thinking_forced_open and r1.reasoning_tags == ("<think>", "</think>")
    got = r1.parse("why</think>because")
    assert (got.reasoning, got.content) == ("why", "because")
    assert not chat_format(sources()["Qwen3.5-4B"], enable_thinking=False).thinking_forced_open
    assert chat_format(sources()["Qwen3.5-4B"]).thinking_forced_open


def test_ids_are_unique_per_reply_and_deterministic():
    fmt = chat_format(HERMES)
    two = '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "f", "arguments": {}}</tool_call>'
    a, b = fmt.parse(two).tool_calls
    assert a.id != b.id and fmt.parse(two).tool_calls[0].id == a.id
