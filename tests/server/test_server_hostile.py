"""Hostile requests to ``ggmlpy serve``: each gets a 4xx with a clear message, the server keeps serving, and
its memory stays flat over a few hundred requests."""

from __future__ import annotations

import json

import httpx
import pytest
from server_helpers import ServerProcess

openai = pytest.importorskip("openai")

#: a Llama-3-like template that refuses one word, as templates' own raise_exception does
RAISING = ("{% for m in messages %}{% if m['content'] == 'boom' %}{{ raise_exception('the template refuses boom') }}"
           "{% endif %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>"
           "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
OK = {"model": "model-f32", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def server(chat_gguf, tmp_path_factory):
    tpl = tmp_path_factory.mktemp("tpl") / "raising.jinja"
    tpl.write_text(RAISING)
    srv = ServerProcess(chat_gguf, "-c", "256", "-np", "1", "-dev", "cpu", "--max-body", "1",
                        "--chat-template-file", tpl)
    yield srv
    assert srv.stop() == 0, srv.output()


def _post(srv, body, path="/v1/chat/completions", **kw) -> httpx.Response:
    if not isinstance(body, dict):
        return httpx.post(srv.url + path, content=body, headers={"content-type": "application/json"}, timeout=60, **kw)
    return httpx.post(srv.url + path, json=body, timeout=60, **kw)


def _serves(srv) -> None:
    r = _post(srv, OK)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop"), r.text


@pytest.mark.parametrize("body, status, param, words", [
    (b"{not json", 400, None, "malformed JSON"),
    (b"[1, 2]", 400, None, "must be a JSON object"),
    (b"", 400, None, "empty"),
    (b"\xff\xfe{}", 400, None, "not UTF-8"),
    ({**OK, "messages": "hi"}, 400, "messages", "non-empty array"),
    ({**OK, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role", "one of"),
    ({**OK, "max_tokens": "5"}, 400, "max_tokens", "must be an integer"),
    ({**OK, "max_tokens": 10 ** 9}, 400, "max_tokens", "more than the context"),
    ({**OK, "n": 1000}, 400, "n", "in [1, 16]"),
    ({**OK, "temperature": [1]}, 400, "temperature", "must be a number"),
    ({**OK, "top_p": 7}, 400, "top_p", "in [0.0, 1.0]"),
    ({**OK, "stop": [1, 2]}, 400, "stop", "strings"),
    ({**OK, "logit_bias": {"cat": 1}}, 400, "logit_bias", "token ids"),
    ({**OK, "samplers": ["top_k", "telepathy"]}, 400, "samplers", "telepathy"),
    ({**OK, "repeat_last_n": -2}, 400, "repeat_last_n", "at least -1"),
    ({**OK, "dry_penalty_last_n": -2}, 400, "dry_penalty_last_n", "at least -1"),
    ({**OK, "dry_allowed_length": -1}, 400, "dry_allowed_length", "at least 0"),
    ({**OK, "dry_multiplier": 0.8, "dry_sequence_breakers": ["x"] * 65}, 400, "dry_sequence_breakers", "at most 64"),
    ({**OK, "dry_sequence_breakers": ["\n", ""]}, 400, "dry_sequence_breakers", "non-empty strings"),
    ({**OK, "tools": [{"type": "function"}]}, 400, "tools[0]", "function"),
    ({**OK, "tool_choice": "required"}, 400, "tool_choice", "no tools"),
    ({**OK, "response_format": {"type": "yaml"}}, 400, "response_format", "json_schema"),
    ({**OK, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     400, None, "schema"),
    ({**OK, "functions": [{"name": "f"}]}, 400, "functions", "send tools"),
    ({**OK, "messages": [{"role": "user", "content": "boom"}]}, 400, None, "the template refuses boom"),
    ({**OK, "messages": [{"role": "user", "content": "x " * 400}]}, 413, None, "does not fit the context"),
])
def test_bad_requests_get_a_clear_4xx_and_the_server_goes_on(server, body, status, param, words):
    r = _post(server, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param
    _serves(server)


def test_long_wide_breakers_and_minus_one_windows_are_served(server):
    """A breaker of 100k characters is cut to llama.cpp's 40 bytes, multi-byte ones work, and -1 windows (the
    context size) are taken: the request is served."""
    r = _post(server, {**OK, "dry_multiplier": 0.8, "dry_allowed_length": 0, "dry_penalty_last_n": -1,
                       "repeat_penalty": 1.1, "repeat_last_n": -1, "dry_sequence_breakers": ["。" * 100_000, "é"]})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop"), r.text


def test_unknown_fields_are_ignored_as_openai_does(server):
    r = _post(server, {**OK, "frobnicate": {"deep": [1, 2]}, "user": "u1", "store": False})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"


def test_oversized_bodies_are_refused_before_they_are_read(server):
    big = json.dumps({**OK, "pad": "x" * (2 << 20)})
    r = _post(server, big)
    assert r.status_code == 413 and "more than the server takes" in r.json()["error"]["message"]

    def chunks():                         # no Content-Length: counted as it arrives
        yield b'{"pad": "'
        for _ in range(40):
            yield b"x" * 65536
        yield b'"}'
    r = _post(server, chunks())
    assert r.status_code == 413
    _serves(server)


def test_images_naming_local_files_are_refused_unread(server, tmp_path):
    secret = tmp_path / "secret.png"
    secret.write_bytes(b"not an image at all")
    messages = []
    for url in (str(secret), str(tmp_path / "missing.png"), f"file://{secret}", "file:///etc/passwd"):
        part = {"type": "image_url", "image_url": {"url": url}}
        r = _post(server, {**OK, "messages": [{"role": "user", "content": [{"type": "text", "text": "see"}, part]}]})
        assert r.status_code == 400, r.text
        messages.append(r.json()["error"])
    # the same answer whether the file exists or not: nothing was looked up
    assert all(m == messages[0] for m in messages), messages
    assert "never reads local files" in messages[0]["message"]
    assert messages[0]["param"] == "messages[0].content[1].image_url.url"
    _serves(server)


def test_memory_stays_flat_over_hundreds_of_requests(server):
    client = server.client()

    def burst(n: int) -> None:
        for i in range(n):
            if i % 3 == 0:
                client.chat.completions.create(model="model-f32", messages=[{"role": "user", "content": f"q{i}"}],
                                               max_tokens=1, temperature=0)
            elif i % 3 == 1:
                client.completions.create(model="model-f32", prompt=f"p{i}", max_tokens=1, temperature=0)
            else:
                assert _post(server, b"{bad").status_code == 400

    burst(60)                            # warm: caches, lazily built graphs, the allocator's arenas
    before = server.rss_mib()
    burst(240)
    grown = server.rss_mib() - before
    assert grown < 24, f"the server's RSS grew {grown:.1f} MiB over 240 requests"
