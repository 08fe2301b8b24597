"""Constrained output and parsed replies through the runner, on a model converted by llama.cpp's converter
with a real vocabulary (llama-bpe, 128,256 tokens) and random weights: the model prefers garbage, so
every valid completion is the grammar's doing.

* ``json_schema=`` / ``grammar=`` (GBNF) on generate: every completion validates (``jsonschema``) or
  matches, greedy and sampled, alone and several at once in one runner, with and without the pipeline
  (the masks are prepared while the batch computes);
* fail closed: a grammar that does not compile is refused at submit, before anything is queued; a
  generation the grammar cannot continue ends with done reason ``grammar``;
* chats: ``response_format`` json_object / json_schema; ``tool_choice="required"`` and a named tool on
  Llama 3.1's and Qwen 2.5's templates give a parsed ``Completion.tool_calls`` whose arguments validate
  under the tool's schema, and the streamed ``deltas`` join to the same reply.
"""

from __future__ import annotations

import json
import re

import pytest
from text_helpers import llama_chat_gguf

from ggmlpy import GGMLValueError
from ggmlpy.load import load_model
from ggmlpy.runner import Runner
from ggmlpy.sampling.grammar import Grammar

jsonschema = pytest.importorskip("jsonschema")

#: tools as OpenAI's strict mode writes them (no extra keys) with bounded strings: unbounded text lets a
#: garbage-preferring model write forever inside the grammar
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
                                       "required": ["zone"], "additionalProperties": False}}}
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"ok": {"type": "boolean"},
                                      "tags": {"type": "array", "items": {"type": "integer", "maximum": 999,
                                                                          "minimum": -999}, "maxItems": 2}},
     "required": ["ok"], "additionalProperties": False},
]
PROMPT = "Write the answer:"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    with load_model(llama_chat_gguf(tmp_path_factory), devices="cpu") as m:
        yield m


@pytest.fixture
def rt(model):
    # one runner per test: the graphs it pools are freed with it (the live-handle check counts them)
    with Runner(model, n_ctx=512, n_seq_max=3) as r:
        yield r


def done_json(r, schema):
    assert r.done_reason == "stop", (r.done_reason, r.text)
    value = json.loads(r.text)
    jsonschema.validate(value, schema)
    return value


@pytest.mark.parametrize("schema", SCHEMAS, ids=["object", "array", "nested"])
def test_json_schema_output_validates_greedy_and_sampled(rt, schema):
    # every string, number and list is bounded: the garbage-preferring model must end within max_tokens
    done_json(rt.generate(PROMPT, max_tokens=200, temperature=0, json_schema=schema), schema)
    for seed in range(3):
        done_json(rt.generate(PROMPT, max_tokens=200, seed=seed, temperature=1.5, json_schema=schema), schema)
    # unconstrained, the model writes no JSON at all: the grammar did the work
    free = rt.generate(PROMPT, max_tokens=24, temperature=0).text
    with pytest.raises(ValueError):
        json.loads(free)


def test_several_constrained_requests_at_once_equal_each_alone(rt):
    alone = [rt.generate(PROMPT, max_tokens=64, temperature=0, json_schema=s).tokens for s in SCHEMAS]
    handles = [rt.submit(PROMPT, max_tokens=64, temperature=0, json_schema=s) for s in SCHEMAS]
    assert [h.result().tokens for h in handles] == alone


def test_the_pipeline_prepares_masks_with_the_same_result(model):
    schema = SCHEMAS[0]
    with Runner(model, n_ctx=512, n_seq_max=2, pipeline=False) as a, \
            Runner(model, n_ctx=512, n_seq_max=2, pipeline=True) as b:
        want = [a.generate(PROMPT, max_tokens=64, seed=s, json_schema=schema).tokens for s in (1, 2)]
        got = [h.result().tokens for h in [b.submit(PROMPT, max_tokens=64, seed=s, json_schema=schema)
                                             for s in (1, 2)]]
    assert got == want


def test_gbnf_grammar(rt):
    gbnf = 'root ::= "answer: " [0-9]{1,3} (", " [0-9]{1,3}){0,2} "."'
    for seed in range(3):
        r = rt.generate(PROMPT, max_tokens=48, seed=seed, temperature=1.2, grammar=gbnf)
        assert r.done_reason == "stop" and re.fullmatch(r"answer: \d{1,3}(, \d{1,3}){0,2}\.", r.text), r.text
    # llama.cpp's convention: text starting with %llguidance is llguidance's Lark, not GBNF
    lark = '%llguidance {}\nstart: "answer: " NUM ("; " NUM)? "!"\nNUM: /[0-9]{2}/'
    r = rt.generate(PROMPT, max_tokens=48, seed=0, temperature=1.2, grammar=lark)
    assert r.done_reason == "stop" and re.fullmatch(r"answer: \d\d(; \d\d)?!", r.text), r.text
    with pytest.raises(GGMLValueError, match="gbnf grammar"):     # not Lark without the prefix
        rt.generate(PROMPT, max_tokens=8, grammar=lark.split("\n", 1)[1])


def test_a_grammar_that_does_not_compile_is_refused_before_anything_runs(rt):
    before = rt.n_batches
    with pytest.raises(GGMLValueError, match="gbnf"):
        rt.generate(PROMPT, max_tokens=8, grammar='root ::= "a" undefined-rule')
    with pytest.raises(GGMLValueError, match="json"):
        rt.generate(PROMPT, max_tokens=8, json_schema={"type": "nonsense"})
    with pytest.raises(GGMLValueError, match="together"):
        rt.generate(PROMPT, max_tokens=8, grammar='root ::= "a"', json_schema={"type": "object"})
    assert rt.n_batches == before


def test_a_generation_the_grammar_cannot_continue_ends_with_done_reason_grammar(rt):
    """A grammar over the engine's per-token bound (llguidance's items per row): the matcher errs, allows
    only the end of generation, and the request says why instead of running unconstrained."""
    alts = " | ".join(f'"w{i}x"' for i in range(4000))
    r = rt.generate(PROMPT, max_tokens=16, temperature=0, grammar=f"root ::= ({alts}) ({alts})")
    assert r.done_reason == "grammar" and "max is 2000" in str(r.error) and "<non-verbose" not in str(r.error)
    assert r.text in ("", "w") and len(r.tokens) <= 2       # at most the token before the bound, then the end


def test_chat_response_format(rt):
    msgs = [{"role": "user", "content": "Give me JSON."}]
    # any JSON object is unbounded: a bias toward '}' lets the garbage-preferring model close it (the
    # grammar still decides where '}' may go)
    close, = rt.tokenizer.encode("}", add_special=False)
    r = rt.chat(msgs, max_tokens=64, temperature=0, response_format={"type": "json_object"}, logit_bias={close: 8.0})
    assert r.done_reason == "stop" and isinstance(json.loads(r.content), dict)
    schema = SCHEMAS[1]
    r = rt.chat(msgs, max_tokens=64, seed=1, response_format={"type": "json_schema",
                                                                "json_schema": {"name": "c", "schema": schema}})
    jsonschema.validate(json.loads(r.content), schema)
    with pytest.raises(GGMLValueError, match="one constraint"):
        rt.chat(msgs, max_tokens=4, response_format={"type": "json_object"}, json_schema={"type": "object"})


@pytest.mark.parametrize("template", ["meta-llama-Llama-3.1-8B-Instruct", "Qwen-Qwen2.5-7B-Instruct"])
def test_forced_tool_calls_parse_and_validate(rt, template):
    import hf_convert

    tpl = hf_convert.chat_templates()[template]
    msgs = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]
    tools = [WEATHER, TIME]
    for choice, name in (("required", None), ({"type": "function", "function": {"name": "get_time"}}, "get_time")):
        for seed in (1, 2):
            r = rt.chat(msgs, tools=tools, tool_choice=choice, template=tpl, max_tokens=120, seed=seed,
                        temperature=1.0)
            assert r.done_reason == "stop", (r.done_reason, r.text)
            assert len(r.tool_calls) == 1, r.text
            call = r.tool_calls[0]
            assert call.name in ("get_weather", "get_time") and (name is None or call.name == name)
            schema = (WEATHER if call.name == "get_weather" else TIME)["function"]["parameters"]
            jsonschema.validate(call.arguments, schema)
            assert call.id and r.content == ""
            # streamed: the deltas join to the same reply, and no call text shows as content
            deltas = [d for ev in rt.chat(msgs, tools=tools, tool_choice=choice, template=tpl, max_tokens=120,
                                          seed=seed, temperature=1.0, stream=True) for d in ev.deltas]
            assert "".join(d.content for d in deltas) == ""
            calls = [d.tool_call for d in deltas if d.tool_call is not None]
            assert [(c.name, json.loads(c.arguments), c.id) for c in calls] == [(call.name, call.arguments, call.id)]


def test_tool_choice_none_hides_the_tools_and_bad_choices_are_refused(rt, monkeypatch):
    import hf_convert

    tpl = hf_convert.chat_templates()["Qwen-Qwen2.5-7B-Instruct"]
    msgs = [{"role": "user", "content": "Hi"}]
    assert rt.chat_prompt(msgs, tools=[WEATHER], template=tpl) != rt.chat_prompt(msgs, template=tpl)
    seen = []
    real = rt.inputs.chat
    monkeypatch.setattr(rt.inputs, "chat", lambda m, what, kw, *a, **k: seen.append(kw["tools"]) or real(m, what, kw,
                                                                                                          *a, **k))
    rt.chat(msgs, tools=[WEATHER], tool_choice="none", template=tpl, max_tokens=2, temperature=0)
    rt.chat(msgs, tools=[WEATHER], tool_choice="auto", template=tpl, max_tokens=2, temperature=0)
    assert seen == [None, [WEATHER]]
    with pytest.raises(GGMLValueError):
        rt.chat(msgs, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}},
                template=tpl, max_tokens=4)
    with pytest.raises(GGMLValueError):
        rt.chat(msgs, tools=[WEATHER], tool_choice=5, template=tpl, max_tokens=4)
    assert isinstance(Grammar.json_object(), Grammar)
