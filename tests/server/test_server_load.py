"""``ggmlpy serve`` under load: more clients than slots, a full queue, clients that leave mid-stream, and
SIGTERM with requests running and queued."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from server_helpers import ServerProcess

openai = pytest.importorskip("openai")

PROMPTS = ["Tell me about cats.", "What is two plus two?", "Name a river.", "Say hello in French."]


def _msgs(text: str) -> list:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def server(chat_gguf):
    srv = ServerProcess(chat_gguf, "-c", "512", "-np", "2", "-dev", "cpu", "--max-queue", "2")
    yield srv
    assert srv.stop() == 0, srv.output()


def _health(srv) -> dict:
    return httpx.get(srv.url + "/health?include_slots").json()


def test_more_clients_than_slots_each_get_the_answer_alone(server):
    client = server.client()
    alone = [client.chat.completions.create(model="model-f32", messages=_msgs(p), max_tokens=12,
                                            temperature=0).choices[0].message.content for p in PROMPTS]
    alone_c = [client.completions.create(model="model-f32", prompt=p, max_tokens=12, temperature=0).choices[0].text
               for p in PROMPTS]
    got, errors = {}, []

    def ask(i: int) -> None:
        try:
            if i % 2:
                got[i] = client.chat.completions.create(model="model-f32", messages=_msgs(PROMPTS[i // 2]),
                                                        max_tokens=12, temperature=0).choices[0].message.content
            else:
                got[i] = client.completions.create(model="model-f32", prompt=PROMPTS[i // 2], max_tokens=12,
                                                   temperature=0).choices[0].text
        except Exception as e:          # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]   # 4 clients, 2 slots, 2 queued
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert got == {0: alone_c[0], 1: alone[0], 2: alone_c[1], 3: alone[1]}


def test_a_full_queue_is_503_and_leaving_clients_free_their_slots(server):
    client = server.client()
    streams = [client.chat.completions.create(model="model-f32", messages=_msgs(p), max_tokens=400, temperature=0,
                                              stream=True) for p in PROMPTS]    # 2 running + 2 queued: full
    for s in streams[:2]:
        next(iter(s))                    # the role chunk: each has begun
    t0 = time.monotonic()
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model="model-f32", prompt="one more", max_tokens=2)
    assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "1"
    assert "busy" in e.value.message and time.monotonic() - t0 < 5      # refused at once, not queued
    h = _health(server)
    assert h["slots_processing"] == 2 and h["requests_waiting"] == 2
    for s in streams:
        s.close()                        # the clients leave mid-stream
    t0 = time.monotonic()
    while _health(server)["slots_processing"] and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    assert _health(server) == {"status": "ok", "slots_idle": 2, "slots_processing": 0, "requests_waiting": 0}
    # the next request gets a slot at once (the 4 x 400 tokens left behind would take minutes here)
    r = client.completions.create(model="model-f32", prompt="after", max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason == "length" and time.monotonic() - t0 < 15


def test_sigterm_finishes_or_ends_every_request_with_a_reason(chat_gguf):
    """Three long streams (two OpenAI SSE, one Ollama NDJSON) and two requests queued behind them; SIGTERM with a
    0.3 s grace: every request ends with a reason, none hangs, the server exits 0."""
    srv = ServerProcess(chat_gguf, "-c", "512", "-np", "3", "-dev", "cpu", "--shutdown-grace", "0.3")
    client = srv.client()
    outcome: dict = {}
    begun = [threading.Event(), threading.Event(), threading.Event()]

    def short(i: int) -> None:
        try:
            r = client.completions.create(model="model-f32", prompt=PROMPTS[i % 4], max_tokens=3, temperature=0)
            outcome[i] = ("done", r.choices[0].finish_reason)
        except openai.APIError as e:
            outcome[i] = ("error", getattr(e, "status_code", None), e.message)

    def long(i: int) -> None:
        got = []
        try:
            for ch in client.chat.completions.create(model="model-f32", messages=_msgs(PROMPTS[i]), max_tokens=500,
                                                     temperature=0, stream=True):
                got.append(ch)
                if ch.choices and ch.choices[0].delta.content:
                    begun[i].set()
            outcome[i] = ("done", got[-1].choices[0].finish_reason)
        except openai.APIError as e:
            outcome[i] = ("error", len(got), e.message)

    def long_ollama(i: int) -> None:
        lines = []
        body = {"messages": _msgs(PROMPTS[i]), "options": {"num_predict": 500, "temperature": 0}}
        try:
            with httpx.stream("POST", srv.url + "/api/chat", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    lines.append(json.loads(line))
                    if lines[-1].get("message", {}).get("content"):
                        begun[i].set()
            outcome[i] = ("lines", lines)
        except httpx.HTTPError as e:
            outcome[i] = ("http error", repr(e), lines)

    threads = [threading.Thread(target=long, args=(0,)), threading.Thread(target=long, args=(1,)),
               threading.Thread(target=long_ollama, args=(2,)), threading.Thread(target=short, args=(3,)),
               threading.Thread(target=short, args=(4,))]
    for t in threads:
        t.start()
        time.sleep(0.1)
    assert all(b.wait(60) for b in begun), outcome     # the three long replies are generating
    t0 = time.monotonic()
    srv.terminate()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a request hung across the shutdown"
    assert srv.proc.wait(30) == 0, srv.output()
    assert time.monotonic() - t0 < 30
    assert set(outcome) == {0, 1, 2, 3, 4}, outcome
    for i in (0, 1):                     # ~500 tokens cannot finish in the 0.3 s grace: ended with the reason
        assert outcome[i][0] == "error" and "shutting down" in outcome[i][2], outcome
    # the NDJSON stream too: its lines so far, then Ollama's error line with the reason (no done line)
    kind, lines = outcome[2][0], outcome[2][-1]
    assert kind == "lines" and len(lines) > 1 and all(o["done"] is False for o in lines[:-1]), outcome[2]
    assert set(lines[-1]) == {"error"} and "shutting down" in lines[-1]["error"], lines[-1]
    for i in (3, 4):                     # queued behind them: cancelled with a 503, or done if they got a slot
        assert outcome[i] in (("done", "length"),) or (outcome[i][0] == "error" and "shutting down" in outcome[i][2]), \
            outcome


def test_the_sampling_flags_are_every_requests_defaults(chat_gguf):
    """``ggmlpy serve --temp 0 --repeat-penalty 0.4 -l ...``: a request that sets nothing is greedy under that
    penalty and bias (llama-server's server-wide defaults); a request's own field beats the flag."""
    srv = ServerProcess(chat_gguf, "-c", "256", "-np", "1", "-dev", "cpu", "--temp", "0", "--repeat-penalty", "0.4",
                        "--repeat-last-n", "-1", "-l", "11+2.5")
    try:
        client = srv.client()
        msgs = _msgs("Tell me about cats.")
        plain = client.chat.completions.create(model="model-f32", messages=msgs, max_tokens=10)
        again = client.chat.completions.create(model="model-f32", messages=msgs, max_tokens=10)
        assert plain.choices[0].message.content == again.choices[0].message.content       # greedy: --temp 0
        spelled = client.chat.completions.create(model="model-f32", messages=msgs, max_tokens=10, temperature=0,
                                                 extra_body={"repeat_penalty": 0.4, "repeat_last_n": -1,
                                                             "logit_bias": {"11": 2.5}})
        assert plain.choices[0].message.content == spelled.choices[0].message.content
        free = client.chat.completions.create(model="model-f32", messages=msgs, max_tokens=10, temperature=0,
                                              extra_body={"repeat_penalty": 1.0, "logit_bias": {"11": 0}})
        assert free.choices[0].message.content != plain.choices[0].message.content      # the request's own wins
    finally:
        assert srv.stop() == 0, srv.output()
