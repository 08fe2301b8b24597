"""Ollama's API (``ggmlpy.server.ollama_routes``) against a real ``ggmlpy serve`` process, talked to with httpx:
each route's documented shape, replies equal to the runner's own on the same input, the options reaching the
sampler chain; and the pure mappings (:mod:`ggmlpy.server.ollama`) alone."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

pytest.importorskip("starlette")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

from server_helpers import N_CTX, N_PARALLEL  # noqa: E402

from ggmlpy.server import ollama as om  # noqa: E402

MSGS = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
GREEDY = {"temperature": 0, "num_predict": 12}
NS_FIELDS = ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration")


def _ndjson(r) -> list[dict]:
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/x-ndjson")
    lines = r.text.splitlines()
    assert lines and all(lines)
    return [json.loads(line) for line in lines]


def _check_final(obj: dict, c) -> None:
    """The last object's statistics: integers in nanoseconds, the counts the runner reports."""
    assert obj["done"] is True and obj["done_reason"] == c.done_reason
    for k in NS_FIELDS:
        assert isinstance(obj[k], int) and obj[k] >= 0, k
    assert obj["total_duration"] >= obj["prompt_eval_duration"] + obj["eval_duration"] > 0
    assert obj["prompt_eval_count"] == c.prompt_eval_count
    assert obj["eval_count"] == c.eval_count == len(c.tokens)


# ---------------------------------------------------------------------------- /api/chat and /api/generate

def test_chat_greedy_equals_runner_chat(http, reference):
    r = http.post("/api/chat", json={"model": "tiny", "messages": MSGS, "stream": False, "options": GREEDY})
    assert r.status_code == 200, r.text
    body = r.json()
    want = reference.chat(MSGS, temperature=0, max_tokens=12)
    assert want.content                                   # random weights: some text, never empty here
    assert body["model"] == "tiny" and body["created_at"].endswith("Z")
    assert body["message"] == {"role": "assistant", "content": want.content}
    _check_final(body, want)
    assert "Warning" not in r.headers


def test_chat_stream_joined_equals_unstreamed(http, reference):
    objs = _ndjson(http.post("/api/chat", json={"messages": MSGS, "options": GREEDY}))   # streams by default
    *chunks, last = objs
    assert len(chunks) >= 2 and all(o["done"] is False for o in chunks)
    assert all(o["message"]["role"] == "assistant" for o in objs)
    assert last["message"]["content"] == ""
    streamed = "".join(o["message"]["content"] for o in chunks)
    assert streamed == reference.chat(MSGS, temperature=0, max_tokens=12).content
    _check_final(last, reference.chat(MSGS, temperature=0, max_tokens=12))


def test_generate_templated_and_raw(http, reference):
    # not raw: the chat template over system + prompt, as Ollama applies the model's template
    r = http.post("/api/generate", json={"prompt": "Name a colour.", "system": "You are terse.", "stream": False,
                                           "options": GREEDY})
    assert r.status_code == 200, r.text
    want = reference.chat(MSGS, temperature=0, max_tokens=12)
    assert r.json()["response"] == want.content
    _check_final(r.json(), want)
    # raw: the prompt as it is
    objs = _ndjson(http.post("/api/generate", json={"prompt": "Once upon a time", "raw": True, "options": GREEDY}))
    want = reference.generate("Once upon a time", temperature=0, max_tokens=12)
    assert "".join(o["response"] for o in objs) == want.text
    assert objs[-1]["response"] == "" and objs[-1]["eval_count"] == 12


def _fresh(http) -> None:
    """Empty the server's slots: a sampled draw compared with another process's must not see a prefix reused
    from cells a slot restore put elsewhere (equal within float rounding only, which can flip a draw)."""
    for i in range(N_PARALLEL):
        assert http.post(f"/slots/{i}?action=erase").status_code == 200


def test_options_reach_the_sampler_chain(http, reference):
    _fresh(http)
    opts = {"temperature": 0.9, "seed": 11, "top_k": 20, "top_p": 0.8, "min_p": 0.02, "typical_p": 0.95,
            "repeat_penalty": 1.3, "repeat_last_n": 16, "presence_penalty": 0.4, "frequency_penalty": 0.3,
            "num_predict": 10}
    kw = {k: v for k, v in opts.items() if k != "num_predict"}
    r = http.post("/api/chat", json={"messages": MSGS, "stream": False, "options": opts})
    want = reference.chat(MSGS, max_tokens=10, **kw)
    assert r.json()["message"]["content"] == want.content
    assert want.content != reference.chat(MSGS, max_tokens=10, seed=11).content     # the options matter
    miro = {"mirostat": 2, "mirostat_tau": 3.0, "mirostat_eta": 0.2, "seed": 5, "num_predict": 8}
    r = http.post("/api/chat", json={"messages": MSGS, "stream": False, "options": miro})
    want = reference.chat(MSGS, max_tokens=8, mirostat=2, mirostat_tau=3.0, mirostat_eta=0.2, seed=5)
    assert r.json()["message"]["content"] == want.content
    # a stop string ends the reply where the runner's does
    text = reference.chat(MSGS, temperature=0, max_tokens=12).content
    stop = text[3:6]
    r = http.post("/api/chat", json={"messages": MSGS, "stream": False,
                                       "options": {**GREEDY, "stop": [stop]}})
    assert r.json()["message"]["content"] == reference.chat(MSGS, temperature=0, max_tokens=12, stop=[stop]).content
    assert r.json()["done_reason"] == "stop" and stop not in r.json()["message"]["content"]


def test_num_ctx_ignored_with_the_reason(http):
    r = http.post("/api/chat", json={"messages": MSGS, "stream": False,
                                       "options": {**GREEDY, "num_predict": 2, "num_ctx": 8192, "num_gpu": 3}})
    assert r.status_code == 200
    w = r.headers["Warning"]
    assert w.startswith("299 ggmlpy") and "num_ctx 8192 ignored" in w and str(N_CTX) in w and "num_gpu ignored" in w
    r = http.post("/api/chat", json={"messages": MSGS, "stream": False, "options": {"num_ctx": N_CTX,
                                                                                     "num_predict": 1}})
    assert "Warning" not in r.headers


def test_format_schema_is_followed(http):
    schema = {"type": "object", "additionalProperties": False, "required": ["colour", "n"],
              "properties": {"colour": {"type": "string", "maxLength": 8},
                             "n": {"type": "integer", "minimum": 0, "maximum": 99}}}
    r = http.post("/api/chat", json={"messages": MSGS, "stream": False, "format": schema,
                                       "options": {"temperature": 0, "num_predict": 200}})
    assert r.status_code == 200, r.text
    assert r.json()["done_reason"] == "stop"
    jsonschema.validate(json.loads(r.json()["message"]["content"]), schema)
    # "json": some JSON object; streamed, the joined text parses
    objs = _ndjson(http.post("/api/generate", json={"prompt": "JSON:", "format": "json",
                                                      "options": {"temperature": 0, "num_predict": 200}}))
    if objs[-1]["done_reason"] == "stop":
        assert isinstance(json.loads("".join(o["response"] for o in objs)), dict)
    else:
        assert "".join(o["response"] for o in objs).lstrip().startswith("{")


def test_tools_and_think_are_passed_to_the_template(http, reference):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather",
                                                "parameters": {"type": "object", "properties": {
                                                    "city": {"type": "string"}}, "required": ["city"]}}}]
    history = [*MSGS, {"role": "assistant", "content": "",
                       "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
               {"role": "tool", "content": "sunny", "tool_name": "get_weather"}]
    r = http.post("/api/chat", json={"messages": history, "tools": tools, "think": True, "stream": False,
                                       "options": GREEDY})
    assert r.status_code == 200, r.text
    want = reference.chat(om.messages_from_ollama(history), tools=tools, template_kwargs={"enable_thinking": True},
                       temperature=0, max_tokens=12)
    assert r.json()["message"]["content"] == want.content
    assert r.json()["prompt_eval_count"] == want.prompt_eval_count
    assert http.post("/api/chat", json={"messages": MSGS, "think": "loud"}).status_code == 400


def test_refusals_are_ollama_errors(http):
    png = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"0" * 64).decode()
    cases = [
        ({"messages": [{"role": "user", "content": "hi", "images": [png]}], "stream": False}, "image"),
        ({"messages": [{"role": "user", "content": "hi", "images": ["%%%"]}]}, "base64"),
        ({"messages": MSGS, "format": "yaml"}, "format"),
        ({"messages": MSGS, "options": {"temperature": "hot"}}, "temperature"),
        ({"messages": MSGS, "options": {"top_k": 1.5}}, "top_k"),
        ({"messages": "hi"}, "messages"),
    ]
    for body, word in cases:
        r = http.post("/api/chat", json=body)
        assert r.status_code == 400, (body, r.text)
        assert set(r.json()) == {"error"} and word in r.json()["error"].lower(), r.json()
    for body, word in (({"prompt": "x", "template": "{{ .Prompt }}"}, "template"), ({"prompt": "x", "suffix": "y"},
                                                                                    "suffix"),
                       ({"prompt": "x", "context": [1, 2]}, "context")):
        r = http.post("/api/generate", json=body)
        assert r.status_code == 400 and r.json()["error"].startswith(word)
    # a body that is not a JSON object, whatever way, is a 400 in Ollama's shape on every route (deep nesting
    # once escaped as a RecursionError: a 500)
    for route in ("/api/chat", "/api/generate", "/api/embed", "/tokenize", "/detokenize", "/apply-template"):
        for raw, said in ((b"{not json", "malformed JSON"), (b"[" * 100_000 + b"]" * 100_000, "malformed JSON"),
                          (b"\xff\xfe{}", "not UTF-8"), (b"[1, 2]", "must be a JSON object")):
            r = http.post(route, content=raw)
            assert r.status_code == 400 and said in r.text, (route, raw[:10], r.status_code, r.text[:200])
            if route.startswith("/api/"):
                assert set(r.json()) == {"error"}


def test_empty_request_loads(http):
    r = http.post("/api/chat", json={"model": "tiny", "messages": []})
    assert r.json()["done"] is True and r.json()["done_reason"] == "load" and r.json()["message"]["content"] == ""
    r = http.post("/api/generate", json={"model": "tiny", "keep_alive": 0})
    assert r.json()["done"] is True and r.json()["done_reason"] == "load" and r.json()["response"] == ""


# ---------------------------------------------------------------------------- /api/embed

def test_embed_equals_runner_embed(http, reference):
    texts = ["Why is the sky blue?", "Why is the grass green?"]
    r = http.post("/api/embed", json={"model": "tiny", "input": texts})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "tiny" and len(body["embeddings"]) == 2 and body["prompt_eval_count"] > 0
    for got, text in zip(body["embeddings"], texts):
        np.testing.assert_allclose(got, reference.embed(text), rtol=0, atol=1e-5)
    one = http.post("/api/embed", json={"input": texts[0]}).json()["embeddings"]
    assert len(one) == 1 and np.allclose(one[0], body["embeddings"][0], atol=1e-6)
    # dimensions: the first d values, normalised again
    d = http.post("/api/embed", json={"input": texts[0], "dimensions": 16}).json()["embeddings"][0]
    want = reference.embed(texts[0])[:16]
    np.testing.assert_allclose(d, want / np.linalg.norm(want), atol=1e-5)
    # the older /api/embeddings: not normalised
    old = http.post("/api/embeddings", json={"prompt": texts[0]}).json()["embedding"]
    np.testing.assert_allclose(old, reference.embed(texts[0], normalize=False), rtol=1e-5, atol=1e-5)
    assert http.post("/api/embed", json={"input": []}).status_code == 400


# ---------------------------------------------------------------------------- the model's description

def test_tags_show_version(http, reference, chat_gguf):
    from text_helpers import LLAMA3_TEMPLATE

    import ggmlpy

    tags = http.get("/api/tags").json()["models"]
    assert len(tags) == 1
    m = tags[0]
    details = {"parent_model": "", "format": "gguf", "family": "llama", "families": ["llama"],
               "parameter_size": "16.49M", "quantization_level": "F32"}
    assert m["name"] == m["model"] == "tiny" and m["details"] == details
    assert m["size"] == __import__("os").path.getsize(chat_gguf) and len(m["digest"]) == 64
    show = http.post("/api/show", json={"model": "tiny"}).json()
    assert show["details"] == details and show["template"] == LLAMA3_TEMPLATE
    info = show["model_info"]
    assert info["general.architecture"] == "llama" and info["llama.block_count"] == 2
    assert info["llama.embedding_length"] == 64 and info["tokenizer.ggml.tokens"] == []
    assert "completion" in show["capabilities"]
    verbose = http.post("/api/show", json={"model": "tiny", "verbose": True}).json()["model_info"]
    assert len(verbose["tokenizer.ggml.tokens"]) == reference.n_vocab
    assert http.get("/api/version").json() == {"version": ggmlpy.__version__}


def test_ps_sizes_are_the_memory_report(http, reference, monkeypatch):
    ps = http.get("/api/ps").json()["models"]
    assert len(ps) == 1
    e = ps[0]
    assert e["name"] == "tiny" and e["context_length"] == N_CTX and e["details"]["family"] == "llama"
    mem = http.get("/props").json()["memory"]        # the server's own report
    assert e["size"] == mem["total"] > 0
    assert e["devices"] == {n: d["self"] for n, d in mem["devices"].items()}
    assert e["size_vram"] == 0                           # the CPU alone
    # in process: size_vram counts the accelerators' bytes
    from ggmlpy.server import ollama_routes
    from ggmlpy.server.state import ServerState

    st = ServerState("", model_name="x", runner=reference)
    rep = reference.memory_report()
    entry = ollama_routes.ps_entry(st, reference)
    assert entry["size"] == rep.total and entry["size_vram"] == 0
    monkeypatch.setattr(ollama_routes, "_device_types", lambda r: {n: "GPU" for n in rep.devices})
    assert ollama_routes.ps_entry(st, reference)["size_vram"] == rep.total


# ---------------------------------------------------------------------------- the mappings alone

def test_map_options():
    kw, ignored = om.map_options({"temperature": 0.5, "top_k": 7, "top_p": 0.9, "min_p": 0.1, "typical_p": 0.8,
                                  "repeat_penalty": 1.1, "repeat_last_n": 32, "presence_penalty": 0.5,
                                  "frequency_penalty": 0.25, "seed": 3, "num_predict": 9, "stop": ["a", ""],
                                  "mirostat": 1, "mirostat_tau": 4, "mirostat_eta": 0.3, "num_keep": 4,
                                  "num_ctx": 128}, 128)
    assert kw == {"temperature": 0.5, "top_k": 7, "top_p": 0.9, "min_p": 0.1, "typical_p": 0.8,
                  "repeat_penalty": 1.1, "repeat_last_n": 32, "presence_penalty": 0.5, "frequency_penalty": 0.25,
                  "seed": 3, "max_tokens": 9, "stop": ["a"], "mirostat": 1, "mirostat_tau": 4.0,
                  "mirostat_eta": 0.3, "n_keep": 4}
    assert ignored == []
    kw, ignored = om.map_options({"seed": -1, "num_predict": -1, "stop": "x", "tfs_z": 1, "bogus": 2}, 128)
    assert kw == {"seed": None, "max_tokens": -2, "stop": ["x"]}
    assert [w.split()[0] for w in ignored] == ["tfs_z", "bogus"]
    assert om.map_options(None, 1) == ({"max_tokens": -2}, [])
    for bad in ({"temperature": True}, {"seed": 1.5}, {"stop": [1]}, {"num_predict": -3}, {"top_p": float("nan")}):
        with pytest.raises(om.OllamaError):
            om.map_options(bad, 128)
    with pytest.raises(om.OllamaError):
        om.map_options([1], 128)


def test_reply_mappings():
    from ggmlpy.chat.types import ReplyDelta, ToolCall, ToolCallDelta
    from ggmlpy.runner import Completion
    from ggmlpy.server.ollama_routes import _result_message

    calls = [ToolCall("call_1", "f", {"a": 1}), ToolCall("call_2", "g", {})]
    c = Completion(content="hi", reasoning="think", tool_calls=calls, text="raw")
    assert _result_message(c, True, False) == {"message": {
        "role": "assistant", "content": "hi", "thinking": "think",
        "tool_calls": [{"id": "call_1", "function": {"index": 0, "name": "f", "arguments": {"a": 1}}},
                       {"id": "call_2", "function": {"index": 1, "name": "g", "arguments": {}}}]}}
    assert _result_message(c, False, True) == {"response": "raw"}
    part, n = om.chunk_from_deltas([ReplyDelta(reasoning="r"), ReplyDelta(content="x"),
                                    ReplyDelta(tool_call=ToolCallDelta(0, "call_3", "h", '{"b": [2]}'))], 1)
    assert n == 2 and part == {"content": "x", "thinking": "r", "tool_calls": [
        {"id": "call_3", "function": {"index": 1, "name": "h", "arguments": {"b": [2]}}}]}
    assert om.chunk_from_deltas([ReplyDelta()], 0) == ({}, 0)
    msgs = om.messages_from_ollama([{"role": "USER", "content": "hi", "images": [base64.b64encode(b"ab").decode()]},
                                    {"role": "assistant", "content": "", "thinking": "t",
                                     "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 1}'}}]},
                                    {"role": "tool", "content": "1", "tool_name": "f"}])
    assert msgs == [{"role": "user", "content": [{"type": "image", "image": b"ab"}, {"type": "text", "text": "hi"}]},
                    {"role": "assistant", "content": "", "reasoning_content": "t",
                     "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]},
                    {"role": "tool", "content": "1", "name": "f"}]
    assert om.think_kwargs("high") == {"enable_thinking": True, "reasoning_effort": "high"}
    assert om.think_kwargs(False) == {"enable_thinking": False} and om.think_kwargs(None) == {}
    assert om.format_constraint("json") == {"json_schema": {"type": "object"}} and om.format_constraint("") == {}
    assert [om.parameter_size(n) for n in (8_030_261_248, 8_000_000_000, 16_490_944, 7_000_000, 500_000, 12)] == \
        ["8.0B", "8B", "16.49M", "7M", "500K", "12"]
    assert om.quantization_level(15) == "Q4_K_M" and om.quantization_level(None) == "unknown"
    assert om.timestamp(0.5) == "1970-01-01T00:00:00.500000000Z"
