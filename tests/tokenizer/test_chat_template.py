"""ggmlpy.tokenizer.chat_template: real models' chat templates against transformers, and hostile templates.

* Every template of llama.cpp's ``models/templates/*.jinja`` (70 real models, from the llama-cpp-python
  sdist tests/hf_convert.py fetches) renders a handful of conversations (plain, multi-turn,
  reasoning, tool calls and results, extra variables, continue_final_message) exactly as
  transformers' ``apply_chat_template(..., tokenize=False)`` does, or fails where it fails.
* The helpers transformers gives templates (tojson, namespace, dict, strftime_now, generation,
  loop controls) and its input preparation (None dropped, plain data, reasoning aliases) agree
  with transformers on small templates.
* Hostile templates (syntax errors, raise_exception, endless or huge loops, recursion, huge values
  or output, sandbox escapes, include/import/extends) raise ChatTemplateError of the right kind,
  quickly and within a small memory peak.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import functools
import importlib
import json
import os
import sys
import threading
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/, for hf_convert
import hf_convert  # noqa: E402

from ggmlpy.tokenizer import _sandbox  # noqa: E402
from ggmlpy.tokenizer.chat_template import ChatTemplate, ChatTemplateError  # noqa: E402

#: llama.cpp's models/templates/*.jinja (checked against the files by the first test)
TEMPLATES = [
    "Apertus-8B-Instruct", "Apriel-1.6-15b-Thinker-fixed", "Bielik-11B-v3.0-Instruct", "ByteDance-Seed-OSS",
    "Cohere2MoE", "CohereForAI-c4ai-command-r-plus-tool_use", "CohereForAI-c4ai-command-r7b-12-2024-tool_use",
    "GLM-4.6", "GLM-4.7-Flash", "GigaChat3-10B-A1.8B", "GigaChat3.1-10B-A1.8B", "HuggingFaceTB-SmolLM3-3B",
    "Kimi-K2-Instruct", "Kimi-K2-Thinking", "Kimi-K3", "LFM2-8B-A1B", "LFM2.5-8B-A1B", "LFM2.5-Instruct",
    "MiMo-VL", "MiniMax-M1", "MiniMax-M2", "MiniMax-M3", "Mistral-Small-3.2-24B-Instruct-2506",
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", "NVIDIA-Nemotron-Nano-v2",
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use", "NousResearch-Hermes-3-Llama-3.1-8B-tool_use",
    "Qwen-QwQ-32B", "Qwen-Qwen2.5-7B-Instruct", "Qwen-Qwen3-0.6B", "Qwen3-Coder", "Qwen3.5-4B", "Reka-Edge",
    "Spark2.5", "StepFun3.5-Flash", "deepseek-ai-DeepSeek-R1-Distill-Llama-8B",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "deepseek-ai-DeepSeek-V3.1", "deepseek-ai-DeepSeek-V3.2",
    "deepseek-ai-DeepSeek-V4-Flash-0731", "deepseek-ai-DeepSeek-V4", "fireworks-ai-llama-3-firefunction-v2",
    "google-gemma-2-2b-it", "google-gemma-4-31B-it-interleaved", "google-gemma-4-31B-it",
    "ibm-granite-granite-3.3-2B-Instruct", "ibm-granite-granite-4.0", "ibm-granite-granite-4.1",
    "inclusionai-ling-3.0-flash", "llama-cpp-deepseek-r1", "llama-cpp-rwkv-world",
    "meetkai-functionary-medium-v3.1", "meetkai-functionary-medium-v3.2", "meta-llama-Llama-3.1-8B-Instruct",
    "meta-llama-Llama-3.2-3B-Instruct", "meta-llama-Llama-3.3-70B-Instruct", "microsoft-Phi-3.5-mini-instruct",
    "mistralai-Ministral-3-14B-Reasoning-2512", "mistralai-Mistral-Nemo-Instruct-2407", "moonshotai-Kimi-K2",
    "muse-glimmer", "openai-gpt-oss-120b", "openbmb-MiniCPM5-1B", "poolside-Laguna-S-2.1",
    "poolside-Laguna-XS-2.1", "poolside-Laguna-XS.2", "tencent-Hy3", "unsloth-Apriel-1.5",
    "unsloth-mistral-Devstral-Small-2507", "upstage-Solar-Open-100B",
]

BOS, EOS = "<s>", "</s>"
#: strftime_now's "now" in every comparison (several templates print today's date)
FROZEN_NOW = datetime.datetime(2026, 3, 14, 15, 9, 26)

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Temperature unit"},
            },
            "required": ["city"],
        },
    },
}
#: nine alphanumerics: the Mistral templates refuse any other tool call id
CALL_ID = "aB3dE6gH9"


def _tool_conversation(arguments) -> list[dict]:
    return [
        {"role": "system", "content": "Use the tools when needed."},
        {"role": "user", "content": "What's the weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": CALL_ID, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": CALL_ID, "name": "get_weather", "content": '{"temperature": 21}'},
    ]


#: what firefunction-v2's template requires
FIREFUNCTION_VARS = {"functions": "[]", "datetime": "2024-07-26"}

#: name -> (messages, tools, extra template variables, continue_final_message)
CONVERSATIONS = {
    "user": ([{"role": "user", "content": "Hello there"}], None, {}, False),
    "system_user": ([{"role": "system", "content": "You are terse."},
                     {"role": "user", "content": "Hi! Café ☕ <b>&amp;</b>?"}], None, {}, False),
    "multi_turn": ([{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."},
                    {"role": "user", "content": "And 3+3?"}], None, {}, False),
    "reasoning": ([{"role": "user", "content": "Is 7 prime?"},
                   {"role": "assistant", "content": "Yes.", "reasoning_content": "7 has no divisors but 1 and 7."},
                   {"role": "user", "content": "And 9?"}], None, {}, False),
    # HF's convention: arguments as a dict
    "tools": (_tool_conversation({"city": "Paris", "unit": "celsius"}), [WEATHER_TOOL], {}, False),
    # OpenAI's: arguments as a JSON string (what functionary's template expects)
    "tools_json_args": (_tool_conversation('{"city": "Paris"}'), [WEATHER_TOOL], {}, False),
    # extra variables reach the template (Qwen3 reads enable_thinking, Llama 3.x date_string,
    # firefunction needs functions and datetime)
    "extra_vars": ([{"role": "user", "content": "Hello there"}], None, {**FIREFUNCTION_VARS, "enable_thinking": False,
                                                                       "date_string": "26 Jul 2024"}, False),
    "continue_final": ([{"role": "user", "content": "Name a colour."},
                        {"role": "assistant", "content": "The colour is"}], None, {}, True),
}


@functools.cache
def _sources() -> dict[str, str]:
    return hf_convert.chat_templates()


def source(name: str) -> str:
    return _sources()[name]


def _need(module: str):
    # CI installs the test extras and must run these tests; elsewhere a missing module skips them
    # (import_module, not __import__: that returns the top package of a dotted name)
    return importlib.import_module(module) if os.environ.get("CI") else pytest.importorskip(module)


@pytest.fixture(scope="module")
def hf_tokenizer():
    """A tiny real transformers tokenizer: its apply_chat_template is the reference. Only BOS and
    EOS are set, as ChatTemplate's bos_token/eos_token (transformers passes every special token
    the tokenizer has)."""
    transformers = _need("transformers")
    tokenizers = _need("tokenizers")
    model = tokenizers.models.WordLevel({"<unk>": 0}, unk_token="<unk>")
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer(model),
                                               bos_token=BOS, eos_token=EOS)
    tok.unk_token = None  # from_slow bookkeeping aside, only bos/eos are special tokens
    assert tok.special_tokens_map == {"bos_token": BOS, "eos_token": EOS}
    return tok


class _FrozenDatetime(datetime.datetime):
    @classmethod
    def now(cls, tz=None):
        return FROZEN_NOW if tz is None else FROZEN_NOW.replace(tzinfo=tz)


@pytest.fixture
def frozen_now(monkeypatch):
    """Both renderers' strftime_now see FROZEN_NOW."""
    monkeypatch.setattr(_sandbox, "datetime", _FrozenDatetime)
    utils = _need("transformers.utils.chat_template_utils")
    monkeypatch.setattr(utils, "datetime", _FrozenDatetime)


def _reference(tok, src: str, messages, *, tools=None, add_generation_prompt=False,
               continue_final_message=False, **kwargs):
    """transformers' rendering, or the exception it raises."""
    try:
        return tok.apply_chat_template(messages, chat_template=src, tools=tools, tokenize=False,
                                       add_generation_prompt=add_generation_prompt,
                                       continue_final_message=continue_final_message, **kwargs), None
    except Exception as exc:  # noqa: BLE001 - any failure is compared below
        return None, exc


def _ours(src: str, messages, **kwargs):
    try:
        return ChatTemplate(src, bos_token=BOS, eos_token=EOS).render(messages, **kwargs), None
    except ValueError as exc:  # ChatTemplateError, or a ValueError on the arguments
        return None, exc


def _assert_same_failure(ref_exc: Exception, exc: Exception | None, rendered: str | None):
    """Where transformers fails we fail too, for the same reason."""
    import jinja2

    assert exc is not None, f"transformers raised {ref_exc!r} but we rendered {rendered!r}"
    if type(ref_exc) is jinja2.exceptions.TemplateError:      # the template's raise_exception
        assert isinstance(exc, ChatTemplateError) and exc.kind == "raised", exc
        assert str(ref_exc) in str(exc)
    elif isinstance(ref_exc, jinja2.exceptions.SecurityError):  # e.g. list.append
        assert isinstance(exc, ChatTemplateError) and exc.kind == "forbidden", exc
    elif isinstance(ref_exc, ValueError) and not isinstance(exc, ChatTemplateError):
        pass  # continue_final_message's argument checks: both ValueError
    else:  # TypeError, UndefinedError, ...: a failure while rendering, named in our message
        assert isinstance(exc, ChatTemplateError), exc
        assert type(ref_exc).__name__ in str(exc), (ref_exc, exc)
        assert exc.lineno is not None


def test_the_list_covers_llama_cpps_templates():
    assert sorted(TEMPLATES) == sorted(_sources())


@pytest.mark.hf
@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
@pytest.mark.parametrize("name", TEMPLATES)
def test_real_template_matches_transformers(name, conversation, hf_tokenizer, frozen_now):
    src = source(name)
    messages, tools, extra, cont = CONVERSATIONS[conversation]
    modes = [{"continue_final_message": True}] if cont else [
        {"add_generation_prompt": False}, {"add_generation_prompt": True}]
    for mode in modes:
        want, ref_exc = _reference(hf_tokenizer, src, messages, tools=tools, **mode, **extra)
        got, exc = _ours(src, messages, tools=tools, **{"add_generation_prompt": False, **mode}, **extra)
        if ref_exc is not None:
            _assert_same_failure(ref_exc, exc, got)
        else:
            assert exc is None, f"{mode}: transformers renders, we raise {exc!r}"
            assert got == want, mode


def _plain_render(t: ChatTemplate, messages, **kwargs) -> str:
    """Render with no tools, or with tools for the templates that need them."""
    try:
        return t.render(messages, **FIREFUNCTION_VARS, **kwargs)
    except ChatTemplateError:
        if "tools" not in t.variables:
            raise
    return t.render(messages, tools=[WEATHER_TOOL], **FIREFUNCTION_VARS, **kwargs)


@pytest.mark.parametrize("name", TEMPLATES)
def test_real_template_renders_a_plain_conversation(name):
    """Every template renders something meaningful for a user turn (tool_use-only templates need
    tools; firefunction needs its ``functions`` and ``datetime`` variables)."""
    t = ChatTemplate(source(name), bos_token=BOS, eos_token=EOS)
    assert "messages" in t.variables
    out = _plain_render(t, [{"role": "user", "content": "Hello there"}])
    assert "Hello there" in out


@pytest.mark.parametrize("name", TEMPLATES)
def test_real_template_needs_its_budget(name):
    """The budget is real for real templates too: with no room at all they fail, with the
    defaults they render a 300-turn conversation."""
    with pytest.raises(ChatTemplateError) as err:
        _plain_render(ChatTemplate(source(name), max_steps=0), [{"role": "user", "content": "Hello there"}])
    assert err.value.kind == "steps"
    turns = []
    for i in range(150):
        turns += [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]
    out = _plain_render(ChatTemplate(source(name)), turns + [{"role": "user", "content": "last"}])
    assert "question 149" in out and "last" in out


# -- helpers and input preparation, against transformers on small templates ---------------------


HELPER_TEMPLATES = {
    "tojson": "{{ x|tojson }}|{{ x|tojson(indent=2) }}|{{ x|tojson(separators=(',', ':')) }}|"
              "{{ x|tojson(sort_keys=true) }}|{{ x|tojson(ensure_ascii=true) }}|{{ x|tojson(true) }}",
    "namespace": "{% set ns = namespace(n=0, s='') %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
                 "{% set ns.s = ns.s ~ m.role[0] %}{% endfor %}{{ ns.n }}:{{ ns.s }}",
    "dict": "{{ dict(a=1, b=[2]) }}{{ dict.fromkeys(['p', 'q'], 0) }}{{ dict([('k', 'v')]) }}",
    "loopcontrols": "{% for i in range(10) %}{% if i == 2 %}{% continue %}{% endif %}{% if i > 4 %}{% break %}"
                    "{% endif %}{{ i }}{% endfor %}",
    "generation": "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{% set inner = 1 %}"
                  "[{{ m.content }}]{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}"
                  "{{ inner is defined }}",
    "whitespace": "{% for m in messages %}\n    {% if m.role == 'user' %}\n  U: {{ m.content }}\n    {% endif %}\n"
                  "{%- endfor %}\n{{ bos_token }}|{{ eos_token }}|{{ add_generation_prompt }}\n",
    "strftime": "{{ strftime_now('%Y-%m-%d %H:%M:%S %d %b %Y') }}",
    "loop": "{% for m in messages %}{{ loop.index }}/{{ loop.length }}{{ loop.first }}{{ loop.last }}"
            "{{ loop.cycle('a', 'b') }}{% endfor %}{% for m in messages if m.role == 'user' %}{{ loop.index }}"
            "{% else %}none{% endfor %}",
    "recursive_loop": "{% for k, v in x|dictsort recursive %}{{ k }}({% if v is mapping %}{{ loop(v|dictsort) }}"
                      "{% else %}{{ v }}{% endif %}){% endfor %}",
    "filters": "{{ messages|map(attribute='role')|join(',') }}|{{ messages|selectattr('role', 'equalto', 'user')"
               "|list|length }}|{{ '  a b  '|trim|upper|center(9) }}|{{ 'x %s y %d'|format('q', 3) }}|"
               "{{ 'a\nb'|indent(2, true) }}|{{ 'abcabc'|replace('b', 'BB') }}|{{ [3, 1, 2]|sort|reverse|list }}|"
               "{{ '%05.1f|%-4s|' % (3.14159, 'ab') }}{{ '{:>6}|{:^5}'.format('r', 'c') }}|{{ (2 ** 10) * 3 }}",
    "undefined": "[{{ nothing }}][{{ messages[0].nothing }}][{{ nothing is defined }}][{{ messages[5] is defined }}]",
    "tools_docs": "{{ tools|tojson }}|{{ documents|tojson }}|{{ custom }}",
    "messages_json": "{{ messages|tojson }}",
}


@pytest.mark.hf
@pytest.mark.parametrize("name", list(HELPER_TEMPLATES))
def test_helpers_match_transformers(name, hf_tokenizer, frozen_now):
    src = HELPER_TEMPLATES[name]
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "héllo"},
                {"role": "assistant", "content": "a", "reasoning": "thought"}]
    x = {"b": [1, 2.5, None, True], "a": "é<&>'\"", "c": {"z": 1, "y": ()}}
    kwargs = {"x": x, "tools": [WEATHER_TOOL], "documents": [{"title": "T", "text": "D"}], "custom": "C"}
    for agp in (False, True):
        want, ref_exc = _reference(hf_tokenizer, src, messages, add_generation_prompt=agp, **kwargs)
        assert ref_exc is None, ref_exc
        got = ChatTemplate(src, bos_token=BOS, eos_token=EOS).render(messages, add_generation_prompt=agp,
                                                                     **kwargs)
        assert got == want


def test_helpers_values():
    """The same helpers, checked against known values (no transformers needed)."""
    r = ChatTemplate(HELPER_TEMPLATES["loopcontrols"]).render([{"role": "user", "content": ""}])
    assert r == "0134"
    r = ChatTemplate("{{ x|tojson }}|{{ x|tojson(indent=1, sort_keys=true) }}").render(
        [{"role": "user", "content": ""}], x={"b": "é<", "a": [1]})
    assert r == '{"b": "é<", "a": [1]}|{\n "a": [\n  1\n ],\n "b": "é<"\n}'
    r = ChatTemplate(HELPER_TEMPLATES["generation"]).render(
        [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}])
    assert r == "u[a]False"  # the body renders unchanged, and its {% set %} stays inside
    r = ChatTemplate("{% for m in messages %}\n  {% if true %}\n{{ m.content }}\n  {% endif %}\n{% endfor %}\n").render(
        [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}])
    assert r == "x\ny\n"  # trim_blocks and lstrip_blocks, and Jinja's dropped final newline


def test_strftime_now_is_the_real_clock():
    fmt = "%Y-%m-%d"
    before = datetime.datetime.now().strftime(fmt)
    got = ChatTemplate("{{ strftime_now('%Y-%m-%d') }}").render([{"role": "user", "content": ""}])
    assert got in (before, datetime.datetime.now().strftime(fmt))


class Colour(enum.IntEnum):
    RED = 1


class Tag(str):
    pass


@dataclasses.dataclass
class Block:
    type: str
    text: str


class Opaque:
    def read(self):  # a method a template must not reach
        raise AssertionError("called")


@pytest.mark.hf
def test_inputs_are_rebuilt_like_transformers(hf_tokenizer):
    """Rich objects in the inputs (enums, str subclasses, tuples, dataclasses, numpy scalars,
    anything else) reach the template as transformers makes them; None-valued keys are dropped;
    reasoning under any of its names is visible as reasoning_content and thinking."""
    src = ("{% for m in messages %}{{ m|tojson }}|{{ m.content }}|{{ m.reasoning_content }}|{{ m.thinking }}\n"
           "{% endfor %}{{ extra|tojson }}|{{ extra.opaque.read is defined }}")
    messages = [
        {"role": "user", "content": [Block("text", "block text")], "tool_calls": None},
        {"role": Tag("assistant"), "content": "ok", "thinking": "hmm", "n": Colour.RED, "f": np.float32(0.5),
         "flag": np.bool_(False), "t": (1, 2)},
        {"role": "assistant", "content": None, "reasoning": "why"},
    ]
    extra = {"opaque": Opaque(), "arr": np.int64(7), "tup": ("a", Colour.RED)}
    want, ref_exc = _reference(hf_tokenizer, src, messages, extra=extra)
    assert ref_exc is None, ref_exc
    got = ChatTemplate(src, bos_token=BOS, eos_token=EOS).render(messages, add_generation_prompt=False,
                                                                extra=extra)
    assert got == want
    assert '"<Opaque>"' in got and '"content": "ok"' in got and "tool_calls" not in got


@pytest.mark.hf
@pytest.mark.parametrize("field,content", [
    ("content", "The answer is "),
    ("content", [{"type": "text", "text": "first"}, {"type": "text", "text": "The answer is"}]),
    ("reasoning_content", "Let me think"),
])
def test_continue_final_message_matches_transformers(field, content, hf_tokenizer):
    src = ("{% for m in messages %}<{{ m.role }}>{% if m.reasoning_content %}[{{ m.reasoning_content }}]{% endif %}"
           "{% if m.content is string %}{{ m.content|trim }}{% else %}{% for b in m.content %}{{ b.text }}"
           "{% endfor %}{% endif %}</{{ m.role }}>\n{% endfor %}")
    last = {"role": "assistant", "content": content} if field == "content" else {
        "role": "assistant", "content": "", field: content}
    messages = [{"role": "user", "content": "q"}, last]
    cont = True if field == "content" else field
    want, ref_exc = _reference(hf_tokenizer, src, messages, continue_final_message=cont)
    assert ref_exc is None, ref_exc
    got = ChatTemplate(src).render(messages, add_generation_prompt=False, continue_final_message=cont)
    assert got == want
    assert not got.endswith("</assistant>\n")


def test_continue_final_message_errors():
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    t = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}")
    with pytest.raises(ValueError, match="not compatible"):
        t.render(messages, continue_final_message=True)  # add_generation_prompt defaults to True
    with pytest.raises(ValueError, match="no 'thinking'"):
        t.render(messages, add_generation_prompt=False, continue_final_message="thinking")
    dropped = ChatTemplate("{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{% endif %}{% endfor %}")
    with pytest.raises(ChatTemplateError) as err:
        dropped.render(messages, add_generation_prompt=False, continue_final_message=True)
    assert err.value.kind == "continue"


def test_arguments_are_validated():
    t = ChatTemplate("{{ messages|length }}")
    with pytest.raises(ValueError, match="empty conversation"):
        t.render([])
    with pytest.raises(TypeError, match="must be dicts"):
        t.render(["hello"])
    with pytest.raises(TypeError, match="list of dicts"):
        t.render("hello")

    def get_weather(city: str):
        """Get the weather."""

    with pytest.raises(TypeError, match="JSON-schema dicts"):
        t.render([{"role": "user", "content": ""}], tools=[get_weather])
    with pytest.raises(TypeError, match="documents"):
        t.render([{"role": "user", "content": ""}], documents=["text"])
    assert t.render([{"role": "user", "content": ""}], tools=[WEATHER_TOOL]) == "1"


def test_variables_and_overrides():
    t = ChatTemplate("{{ bos_token }}{{ messages[0].content }}{{ eos_token }}{{ sep }}", bos_token="B",
                     eos_token="E")
    assert t.variables == {"bos_token", "messages", "eos_token", "sep"}
    assert t.render([{"role": "user", "content": "x"}]) == "BxE"
    # extra variables reach the template, and override the tokens as in transformers
    assert t.render([{"role": "user", "content": "x"}], sep="|", eos_token="e") == "Bxe|"


def test_template_is_compiled_once():
    src = "{{ messages[0].content }} once"
    assert ChatTemplate(src)._template is ChatTemplate(src)._template
    assert ChatTemplate(src + " ")._template is not ChatTemplate(src)._template


def test_renders_concurrently():
    """Each render has its own budget, even with the compiled template shared across threads: 20
    messages take about 60,000 steps, 50 about 150,000; six renders together far more."""
    t = ChatTemplate("{% for i in range(messages|length * 1000) %}{{ i % 10 }}{% endfor %}", max_steps=100_000)
    results, errors = {}, []

    def work(n):
        try:
            results[n] = t.render([{"role": "user", "content": ""}] * n)
        except Exception as exc:  # noqa: BLE001
            errors.append((n, exc))

    threads = [threading.Thread(target=work, args=(n,)) for n in (5, 20, 50, 5, 20, 50)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert results[5] == "0123456789" * 500 and results[20] == "0123456789" * 2000
    assert sorted(n for n, _ in errors) == [50, 50]
    assert all(isinstance(e, ChatTemplateError) and e.kind == "steps" for _, e in errors)


# -- limits, exactly -------------------------------------------------------------------------------


def test_max_output_is_exact():
    src = "{% for i in range(10) %}{{ 'abcdefghij' }}{% endfor %}"
    msgs = [{"role": "user", "content": ""}]
    assert ChatTemplate(src, max_output=100).render(msgs) == "abcdefghij" * 10
    with pytest.raises(ChatTemplateError) as err:
        ChatTemplate(src, max_output=99).render(msgs)
    assert err.value.kind == "output" and "max_output=99" in str(err.value)


def test_max_steps_counts_iterations():
    src = "{% for i in range(1000) %}{% endfor %}done"
    msgs = [{"role": "user", "content": ""}]
    assert ChatTemplate(src, max_steps=1100).render(msgs) == "done"
    with pytest.raises(ChatTemplateError) as err:
        ChatTemplate(src, max_steps=900).render(msgs)
    assert err.value.kind == "steps" and "max_steps=900" in str(err.value)
    assert err.value.lineno == 1


def test_max_seconds():
    with pytest.raises(ChatTemplateError) as err:
        ChatTemplate("{% for i in range(100000) %}{% endfor %}", max_seconds=0).render(
            [{"role": "user", "content": ""}])
    assert err.value.kind == "time"


def test_values_may_be_as_large_as_the_inputs():
    """A big message passes through (the value limit grows with the inputs), output stays bounded."""
    big = "x" * 3_000_000
    t = ChatTemplate("{{ (messages[0].content ~ '!')|length }}", max_output=10)
    assert t.render([{"role": "user", "content": big}]) == "3000001"
    with pytest.raises(ChatTemplateError) as err:
        ChatTemplate("{{ messages[0].content }}", max_output=10).render([{"role": "user", "content": big}])
    assert err.value.kind == "output"


# -- hostile templates -----------------------------------------------------------------------------

#: id -> (template, kind, words the message must contain). Each would, unchecked, run for hours or
#: allocate 100 MB to many GB; the limits stop each within a couple of seconds and a few MB.
HOSTILE = {
    "syntax": ("{% for x in %}", "syntax", "Expected an expression"),
    "syntax_unclosed": ("line 1\n{% if true %}\nline 3", "syntax", "endif"),
    "unknown_filter": ("{{ 'a'|no_such_filter }}", "syntax", "no_such_filter"),
    "raise_exception": ("ok\n\n{{ raise_exception('Only user and assistant roles') }}", "raised",
                        "Only user and assistant roles"),
    "range_huge": ("{% for i in range(10**9) %}{% endfor %}", "range", "range"),
    "range_astronomic": ("{% for i in range(10**100) %}{% endfor %}", "range", "range"),
    "nested_loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                     "steps", "max_steps"),
    "nested_loops_output": ("{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}"
                            "{% endfor %}", "steps", "max_steps"),
    "loop_over_big_list": ("{% set l = range(100000)|list %}{% for a in l %}{% for b in l %}{% endfor %}"
                           "{% endfor %}", "steps", "max_steps"),
    "macro_recursion": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursion", "recursed"),
    "macro_fork_bomb": ("{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
                        "{{ f(60) }}", "steps", "max_steps"),
    "recursive_loop": ("{% for x in [1] recursive %}{{ loop([x]) }}{% endfor %}", "recursion", "recursed"),
    "caller_bomb": ("{% macro f() %}{{ caller() }}{{ caller() }}{% endmacro %}{% macro g(n) %}{% if n %}"
                    "{% call f() %}{{ g(n - 1) }}{% endcall %}{% endif %}{% endmacro %}{{ g(20) }}",
                    "steps", "max_steps"),
    "output_loop": ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "output", "max_output"),
    "repeat_string": ("{{ 'a' * 10**8 }}", "size", "repeated"),
    "repeat_list": ("{{ [0] * 10**9 }}", "size", "repeated"),
    "repeat_reversed": ("{{ 10**9 * 'ab' }}", "size", "repeated"),
    "doubling_concat": ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                        "{% endfor %}", "size", "larger than"),
    "doubling_plus": ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
                      "{% endfor %}", "size", "larger than"),
    "doubling_list": ("{% set ns = namespace(l=[1]) %}{% for i in range(64) %}{% set ns.l = ns.l + ns.l %}"
                      "{% endfor %}", "size", "larger than"),
    "nested_sharing": ("{% set s = 'a' * 1000 %}{% set a = [s, s, s, s, s, s, s, s, s, s] %}"
                       "{% set b = [a, a, a, a, a, a, a, a, a, a] %}{% set c = [b, b, b, b, b, b, b, b, b, b] %}"
                       "{% set d = [c, c, c, c, c, c, c, c, c, c] %}{% set e = [d, d, d, d, d, d, d, d, d, d] %}"
                       "{{ e }}", "size", "larger than"),
    "self_nesting": ("{% set ns = namespace(l=[1]) %}{% for i in range(64) %}{% set ns.l = ns.l + [ns.l] %}"
                     "{% endfor %}{{ ns.l }}", "size", "larger than"),
    "namespace_mutation": ("{% set ns = namespace(x='') %}{% set l = [ns] * 1000 %}{% set ns.x = 'a' * 100000 %}"
                           "{{ l }}", "size", "larger than"),
    "fromkeys": ("{{ dict.fromkeys(range(100000), 'a' * 1000) }}", "size", "larger than"),
    "block_set": ("{% set s = 'x' * 100000 %}{% set big %}{% for i in range(10000) %}{{ s }}{% endfor %}"
                  "{% endset %}", "size", "block of output"),
    "macro_output": ("{% macro f() %}{% for i in range(10000) %}{{ 'x' * 100000 }}{% endfor %}{% endmacro %}"
                     "{% set y = f() %}", "size", "block of output"),
    "join_separator": ("{{ range(10000)|join('x' * 100000) }}", "size", "joined"),
    "join_method": ("{{ ('x' * 100000).join(range(10000)|map('string')) }}", "size", "joined"),
    "center_method": ("{{ 'a'.center(10**9) }}", "size", "padded"),
    "ljust_method": ("{{ 'a'.ljust(10**9) }}", "size", "padded"),
    "center_filter": ("{{ 'a'|center(10**9) }}", "size", "centered"),
    "indent_filter": ("{{ ('a\n' * 1000)|indent(10**6) }}", "size", "indented"),
    "replace_filter": ("{{ ('a' * 10000)|replace('a', 'b' * 100000) }}", "size", "replaced"),
    "replace_method": ("{{ ('a' * 10000).replace('', 'b' * 100000) }}", "size", "replaced"),
    "expandtabs": ("{{ ('\t' * 10000).expandtabs(100000) }}", "size", "expanded"),
    "printf_width": ("{{ '%0999999999d' % 1 }}", "size", "formatted"),
    "printf_star": ("{{ '%*d' % (999999999, 1) }}", "size", "formatted"),
    "format_filter": ("{{ '%999999999s'|format('a') }}", "size", "formatted"),
    "format_width": ("{{ '{:>999999999}'.format(1) }}", "size", "formatted"),
    "format_nested_width": ("{{ '{:>{}}'.format(1, 999999999) }}", "size", "formatted"),
    "tojson_indent": ("{{ messages|tojson(indent=10**9) }}", "size", "indent"),
    "power": ("{{ 2 ** (10 ** 9) }}", "size", "bits"),
    "squaring": ("{% set ns = namespace(n=3) %}{% for i in range(64) %}{% set ns.n = ns.n * ns.n %}{% endfor %}",
                 "size", "bits"),
    "lipsum": ("{{ lipsum(10**6) }}", "size", "lorem"),
    "slice_filter": ("{{ [1]|slice(10**9)|list }}", "size", "slice"),
    "batch_filter": ("{{ [1]|batch(10**9, 0)|list }}", "size", "batch"),
    "list_of_generated": ("{{ range(100000)|map('center', 100000)|list }}", "size", "list"),
    "sum_of_lists": ("{{ ([[0] * 10] * 10000)|sum(start=[])|length }}", "steps", "max_steps"),
    "scan_in_loop": ("{% set l = range(100000)|list %}{% for i in range(100000) %}{% if -1 in l %}{% endif %}"
                     "{% endfor %}", "steps", "max_steps"),
    # sandbox escapes: forbidden the moment they are touched
    "str_class_mro": ("{{ ''.__class__.__mro__ }}", "forbidden", "'__class__'"),
    "messages_class": ("{{ messages.__class__ }}", "forbidden", "'__class__'"),
    "cycler_globals": ("{{ cycler.__init__.__globals__ }}", "forbidden", "'__init__'"),
    "joiner_globals": ("{{ joiner.__init__.__globals__.os }}", "forbidden", "'__init__'"),
    "function_globals": ("{{ raise_exception.__globals__ }}", "forbidden", "'__globals__'"),
    "mro_method": ("{{ messages.mro() }}", "error", "UndefinedError"),
    "type_mro": ("{{ (dict.fromkeys([])|attr('__class__')).mro() }}", "forbidden", "'__class__'"),
    "subscript_dunder": ("{{ messages['__class__'] }}", "forbidden", "'__class__'"),
    "attr_filter": ("{{ messages|attr('__class__') }}", "forbidden", "'__class__'"),
    "map_attribute": ("{{ messages|map(attribute='__class__')|list }}", "forbidden", "'__class__'"),
    "format_field": ("{{ '{0.__class__}'.format(messages) }}", "forbidden", "'__class__'"),
    "list_append": ("{% set _ = messages.append(1) %}", "forbidden", "'append'"),
    "dict_update": ("{% set _ = messages[0].update(role='x') %}", "forbidden", "'update'"),
    "template_context": ("{{ self._TemplateReference__context }}", "forbidden", "_TemplateReference__context"),
    "loop_internals": ("{% for m in messages %}{{ loop._iterator }}{% endfor %}", "forbidden", "'_iterator'"),
    "namespace_dunder": ("{% set ns = namespace(__class__=1) %}", "forbidden", "underscore"),
    "namespace_set_dunder": ("{% set ns = namespace() %}{% set ns._x = 1 %}", "forbidden", "underscore"),
    "include": ("{% include 'other.jinja' %}", "load", "include"),
    "include_ignore_missing": ("{% include 'other.jinja' ignore missing %}", "load", "include"),
    "import": ("{% import 'other.jinja' as o %}", "load", "import"),
    "from_import": ("{% from 'other.jinja' import x %}", "load", "import"),
    "extends": ("{% extends 'base.jinja' %}", "load", "extend"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_template(case):
    src, kind, words = HOSTILE[case]
    # memory is traced where something could be allocated (tracing slows Python down several
    # times, and the cases that run out of steps or time allocate nothing)
    trace = kind not in ("steps", "time", "recursion")
    if trace:
        tracemalloc.start()
    try:
        with pytest.raises(ChatTemplateError) as err:
            ChatTemplate(src).render([{"role": "user", "content": "hi"}])
        peak = tracemalloc.get_traced_memory()[1] if trace else 0
    finally:
        tracemalloc.stop()
    exc = err.value
    assert isinstance(exc, ValueError)
    assert exc.kind == kind, exc
    assert words in str(exc), exc
    assert peak < 32 << 20, f"{peak / 2**20:.0f} MiB"
    # where the failure happened: a line of the template, quoted
    assert exc.lineno is not None and f"line {exc.lineno}" in str(exc), exc
    # no Python object escapes into the message
    assert " at 0x" not in str(exc)


def test_error_names_the_line():
    src = ("{% for m in messages %}\n{{ m.content }}\n"
           "{% if m.role == 'tool' %}{{ raise_exception('no tools') }}{% endif %}\n{% endfor %}")
    t = ChatTemplate(src)
    assert t.render([{"role": "user", "content": "a"}]) == "a\n"
    with pytest.raises(ChatTemplateError) as err:
        t.render([{"role": "tool", "content": "a"}])
    assert err.value.kind == "raised" and err.value.lineno == 3
    assert "template line 3" in str(err.value) and "raise_exception('no tools')" in str(err.value)
    with pytest.raises(ChatTemplateError) as err:
        ChatTemplate("a\nb\n{{ 1 + }}")
    assert err.value.kind == "syntax" and err.value.lineno == 3


def test_a_dead_include_is_harmless():
    """As in transformers, include/import fail when they run, not when the template is loaded."""
    t = ChatTemplate("{% if false %}{% include 'x' %}{% endif %}ok")
    assert t.render([{"role": "user", "content": ""}]) == "ok"


def test_forbidden_attribute_fails_even_when_only_tested():
    """transformers renders a forbidden attribute as an undefined value (falsy, empty); here it
    is an error, so a template cannot probe for internals."""
    with pytest.raises(ChatTemplateError) as err:
        ChatTemplate("{% if messages.__class__ is defined %}yes{% endif %}").render([{"role": "user", "content": ""}])
    assert err.value.kind == "forbidden"


def test_chat_template_error_is_a_value_error():
    assert issubclass(ChatTemplateError, ValueError)
    with pytest.raises(TypeError):
        ChatTemplate(b"{{ x }}")  # type: ignore[arg-type]
    assert json.loads(ChatTemplate("{{ messages|tojson }}").render([{"role": "user", "content": "é"}])) == [
        {"role": "user", "content": "é"}]


def test_the_old_module_and_the_tokenizer_package_give_the_same_names():
    # ggmlpy.chat_template is where the renderer lived before it moved into the tokenizer package
    import ggmlpy.chat_template as old
    import ggmlpy.tokenizer as face
    from ggmlpy.tokenizer import _limits
    from ggmlpy.tokenizer import chat_template as new

    assert old.ChatTemplate is new.ChatTemplate is face.ChatTemplate is ChatTemplate
    assert old.ChatTemplateError is new.ChatTemplateError is face.ChatTemplateError is ChatTemplateError
    assert (old.MAX_INPUT_DEPTH, old.DEFAULT_MAX_STEPS, old.DEFAULT_MAX_SECONDS, old.MAX_INT_BITS) == (
        new.MAX_INPUT_DEPTH, new.DEFAULT_MAX_STEPS, new.DEFAULT_MAX_SECONDS, _limits.MAX_INT_BITS)
