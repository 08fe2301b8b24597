"""OpenAI's routes of a real ``ggmlpy serve`` process, through the official ``openai`` client: each answer
against the Runner in this process on the same file (greedy), the streamed deltas against the whole
reply, tools and JSON schemas validated, the error shapes and statuses."""

from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import pytest
from server_helpers import ServerProcess

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

KEY = "sk-test-key"
MSGS = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(chat_gguf, tmp_path_factory):
    import hf_convert

    tpl = tmp_path_factory.mktemp("tpl") / "qwen.jinja"
    tpl.write_text(hf_convert.chat_templates()["Qwen-Qwen2.5-7B-Instruct"])
    srv = ServerProcess(chat_gguf, "-c", "512", "-np", "2", "-dev", "cpu", "--api-key", KEY, "--alias", "tiny",
                        "--chat-template-file", tpl)
    srv.template = tpl.read_text()
    yield srv
    assert srv.stop() == 0, srv.output()


@pytest.fixture(scope="module")
def client(server):
    return server.client(api_key=KEY)


def test_greedy_chat_equals_the_runner_and_streaming_joins_to_it(server, client, reference):
    want = reference.chat(MSGS, template=server.template, max_tokens=16, temperature=0)
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=16, temperature=0)
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content == want.content and want.text
    assert c.finish_reason == {"length": "length", "stop": "stop"}[want.done_reason]
    assert r.usage.prompt_tokens == want.prompt_eval_count and r.usage.completion_tokens == want.eval_count
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    t = r.model_extra["timings"]
    assert t["predicted_n"] == want.eval_count and t["prompt_per_second"] > 0 and t["predicted_per_second"] > 0
    assert r.id.startswith("chatcmpl-") and r.model == "tiny" and r.object == "chat.completion"

    chunks = list(client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == c.message.content
    finals = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert [ch.choices[0].finish_reason for ch in finals] == [c.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == want.eval_count
    assert chunks[-1].usage.prompt_tokens == want.prompt_eval_count
    # without include_usage no chunk carries usage
    plain = list(client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=4, temperature=0, stream=True))
    assert all(ch.usage is None for ch in plain) and all(ch.choices for ch in plain)


def test_seeded_sampling_n_choices_and_stop(server, client, reference):
    kw = dict(max_tokens=8, temperature=1.0, seed=7, top_k=20)
    want = reference.chat(MSGS, template=server.template, **kw)
    r = client.chat.completions.create(model="tiny", messages=MSGS, n=2, max_tokens=8, temperature=1.0, seed=7,
                                       extra_body={"top_k": 20})
    assert [ch.index for ch in r.choices] == [0, 1]
    assert r.choices[0].message.content == want.content          # choice 0 is the request alone
    other = reference.chat(MSGS, template=server.template, **{**kw, "seed": 8})
    assert r.choices[1].message.content == other.content         # choice i samples with seed + i
    # a stop string cuts the reply where the runner cuts it
    full = reference.chat(MSGS, template=server.template, max_tokens=16, temperature=0).content
    cut = full[3:6]
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=16, temperature=0, stop=[cut])
    assert r.choices[0].message.content == full[:full.index(cut)] and r.choices[0].finish_reason == "stop"


def test_logprobs_match_the_runner(server, client, reference):
    want = reference.chat(MSGS, template=server.template, max_tokens=4, temperature=0, logprobs=True,
                          top_logprobs=3)
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=3)
    got = r.choices[0].logprobs.content
    assert len(got) == len(want.logprobs) == 4
    tok = reference.tokenizer
    for g, w in zip(got, want.logprobs):
        assert bytes(g.bytes) == tok.token_to_piece(w.token) and g.logprob == pytest.approx(w.logprob)
        assert [bytes(t.bytes) for t in g.top_logprobs] == [tok.token_to_piece(t.token) for t in w.top]
    r = client.completions.create(model="tiny", prompt="The cat", max_tokens=3, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 3 and all(len(t) == 2 for t in lp.top_logprobs) and "".join(lp.tokens) == r.choices[0].text


def test_tools_required_give_a_valid_call(client):
    msgs = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]
    for seed in (1, 2):
        r = client.chat.completions.create(model="tiny", messages=msgs, tools=[WEATHER], tool_choice="required",
                                           max_tokens=120, temperature=1.0, seed=seed)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", c
        (call,) = c.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
        # streamed: the same call, and no call text as content
        chunks = list(client.chat.completions.create(model="tiny", messages=msgs, tools=[WEATHER], seed=seed,
                                                     tool_choice="required", max_tokens=120, temperature=1.0,
                                                     stream=True))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == ""
        calls = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
        assert [(tc.function.name, tc.function.arguments) for tc in calls] == [
            (call.function.name, call.function.arguments)]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # a tool call in the history and a tool result render and answer
    history = msgs + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                      {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    r = client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER], max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_json_schema_and_json_object(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = client.chat.completions.create(model="tiny", messages=MSGS, response_format=fmt, max_tokens=120,
                                       temperature=0)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    r = client.chat.completions.create(model="tiny", messages=MSGS, response_format={"type": "json_object"},
                                       max_tokens=60, temperature=0, logit_bias={"92": 8})   # 92: "}" pulls it shut
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.lstrip().startswith("{")


def test_completions_take_text_and_token_ids(client, reference):
    want = reference.generate("The cat sat", max_tokens=8, temperature=0)
    r = client.completions.create(model="tiny", prompt="The cat sat", max_tokens=8, temperature=0)
    assert r.choices[0].text == want.text and r.object == "text_completion"
    assert r.usage.prompt_tokens == want.prompt_eval_count
    ids = reference.tokenizer.encode("The cat sat")
    r2 = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0)
    assert r2.choices[0].text == want.text
    r3 = client.completions.create(model="tiny", prompt=["The cat sat", ids], max_tokens=8, temperature=0,
                                   echo=True)
    assert [c.text for c in r3.choices] == ["The cat sat" + want.text,
                                            reference.tokenizer.decode(ids) + want.text]
    chunks = list(client.completions.create(model="tiny", prompt="The cat sat", max_tokens=8, temperature=0,
                                            stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == want.text


def test_embeddings_float_and_base64_agree(server, client, reference):
    inputs = ["a cat", "the quick brown fox", reference.tokenizer.encode("hi")]
    r = client.embeddings.create(model="tiny", input=inputs, encoding_format="float")
    assert [d.index for d in r.data] == [0, 1, 2]
    got = np.array([d.embedding for d in r.data], dtype=np.float32)
    for i, text in enumerate(inputs):
        np.testing.assert_allclose(got[i], reference.embed(text), rtol=1e-5, atol=1e-6)
    raw = httpx.post(server.url + "/v1/embeddings", headers={"Authorization": f"Bearer {KEY}"},
                     json={"model": "tiny", "input": inputs, "encoding_format": "base64"}).json()
    assert all(isinstance(d["embedding"], str) for d in raw["data"])
    b64 = np.array([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in raw["data"]])
    assert np.array_equal(b64, got)
    # the client's default asks for base64 and decodes it
    assert np.array_equal(np.array([d.embedding for d in client.embeddings.create(model="tiny", input=inputs).data],
                                   dtype=np.float32), got)
    assert r.usage.prompt_tokens == raw["usage"]["prompt_tokens"] > 0
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model="tiny", input="x", dimensions=3)


def test_models_list_and_aliases(server, client, chat_gguf):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    r = client.chat.completions.create(model=chat_gguf.name, messages=MSGS, max_tokens=1, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")


def test_errors_have_openai_shape_and_status(server, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-9", messages=MSGS)
    assert e.value.status_code == 404 and e.value.code == "model_not_found" and e.value.param == "model"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MSGS, temperature="hot")
    assert e.value.param == "temperature" and e.value.type == "invalid_request_error"
    long_prompt = "word " * 600
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model="tiny", prompt=long_prompt, max_tokens=4)
    assert e.value.status_code == 413 and e.value.code == "context_length_exceeded"
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").models.list()
    r = httpx.get(server.url + "/v1/models")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(server.url + "/v1/models", headers={"x-api-key": KEY}).status_code == 200
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}          # public
    r = httpx.get(server.url + "/v1/nowhere", headers={"x-api-key": KEY})
    assert r.status_code == 404 and "no route" in r.json()["error"]["message"]


def test_loading_answers_503_with_retry_after():
    """While the model loads (in-process: the app over a state with no runner yet)."""
    from starlette.testclient import TestClient

    from ggmlpy.server.app import create_app
    from ggmlpy.server.state import ServerState

    state = ServerState("m.gguf", n_parallel=1, n_ctx=64)
    state.progress = 0.25
    with TestClient(create_app(state)) as tc:
        h = tc.get("/health")
        assert h.status_code == 503 and h.json()["status"] == "loading" and h.json()["progress"] == 0.25
        r = tc.post("/v1/chat/completions", json={"model": "m", "messages": MSGS})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "unavailable_error" and "loading" in r.json()["error"]["message"]
        c = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=tc, max_retries=0)
        with pytest.raises(openai.InternalServerError) as e:
            c.completions.create(model="m", prompt="hi")
        assert e.value.status_code == 503
