"""Streams of both APIs under stress, through the one path they share (``ggmlpy.server.bridge``), against real
``ggmlpy serve`` processes: a client that leaves an Ollama stream frees its slot at once; a client that stops
reading (a raw socket with a small receive buffer) stalls no other stream, on OpenAI's SSE and Ollama's NDJSON
routes alike, and gets every byte once it reads; ``--timeout`` (llama-server's socket timeout) answers 408 to a
body that stops arriving and drops a client that accepts nothing.

Loopback sockets buffer about 3 MB before a writer waits (kernel buffers plus uvicorn's). The servers here are
named by a 100,000-character ``--alias``, which every streamed object carries (``"model"``), so a stream that
is not read passes the buffers within a few dozen tokens and its writer really waits.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from server_helpers import ServerProcess

pytest.importorskip("starlette")

LONG_ALIAS = "tiny-" + "x" * 99_995
#: bytes of streamed objects that surely passed the socket buffers (measured about 3 MB on loopback)
PAST_THE_BUFFERS = 10 << 20
MSGS = [{"role": "user", "content": "Tell me a long story about a lighthouse."}]
OTHER = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def wide(chat_gguf):
    """Two slots, every streamed object ~100 KB (the long alias)."""
    srv = ServerProcess(chat_gguf, "-c", "512", "-np", "2", "-dev", "cpu", "--alias", LONG_ALIAS)
    yield srv
    assert srv.stop() == 0, srv.output()[-4000:]


# ---------------------------------------------------------------------------------------------- helpers

def _raw_request(url: str, path: str, body: dict, rcvbuf: int = 4096, send_body: bool = True,
                 close: bool = True) -> socket.socket:
    """POST ``body`` on a socket of its own whose receive buffer is ``rcvbuf`` bytes (set before connecting, so
    the kernel does not grow it); the response is left unread. ``send_body=False`` sends the headers and the
    body's first 10 bytes only; ``close``: ask the server to close the connection after the response."""
    host, port = url.removeprefix("http://").split(":")
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect((host, int(port)))
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n{'Connection: close' if close else ''}\r\n\r\n").encode()
    s.sendall(head + (data if send_body else data[:10]))
    return s


def _read_to_eof(s: socket.socket, timeout: float = 120.0) -> bytes:
    s.settimeout(timeout)
    out = []
    while True:
        b = s.recv(1 << 20)
        if not b:
            return b"".join(out)
        out.append(b)


def _http(raw: bytes) -> tuple[int, dict, bytes, bool]:
    """A raw HTTP/1.1 response: status, headers (lower-case), the body de-chunked, and whether the chunked body
    ended with its terminating chunk."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict((k.strip().lower(), v.strip()) for k, _, v in (h.partition(":") for h in lines[1:]))
    status = int(lines[0].split()[1])
    if headers.get("transfer-encoding") != "chunked":
        return status, headers, rest, True
    body, i = bytearray(), 0
    while True:
        j = rest.find(b"\r\n", i)
        if j < 0:
            return status, headers, bytes(body), False
        n = int(rest[i:j].split(b";")[0], 16)
        if n == 0:
            return status, headers, bytes(body), True
        if len(rest) < j + 2 + n:
            return status, headers, bytes(body), False
        body += rest[j + 2:j + 2 + n]
        i = j + 2 + n + 2


def _busy(url: str) -> list[dict]:
    return [s for s in httpx.get(url + "/slots", timeout=30).json() if s["is_processing"]]


def _wait(cond, timeout: float, what: str, step: float = 0.05):
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        value = cond()
        if value:
            return value
        time.sleep(step)
    raise AssertionError(f"not within {timeout} s: {what}")


# The two APIs: (path, a long streamed request, a short one, how the stream's objects are framed)
ROUTES = {
    "openai": ("/v1/chat/completions",
               {"messages": MSGS, "max_tokens": 400, "temperature": 0, "stream": True},
               {"messages": OTHER, "max_tokens": 16, "temperature": 0, "stream": True}),
    "ollama": ("/api/chat",
               {"messages": MSGS, "options": {"num_predict": 400, "temperature": 0}},
               {"messages": OTHER, "options": {"num_predict": 16, "temperature": 0}}),
}


def _objects(api: str, body: bytes) -> tuple[list[dict], bool]:
    """The stream's JSON objects, and whether it ended as a finished stream ends (``[DONE]``; a ``done`` line)."""
    if api == "openai":
        events = [e.removeprefix(b"data: ") for e in body.split(b"\n\n") if e]
        done = bool(events) and events[-1] == b"[DONE]"
        return [json.loads(e) for e in events if e != b"[DONE]"], done
    objs = [json.loads(line) for line in body.split(b"\n") if line]
    return objs, bool(objs) and objs[-1].get("done") is True


def _replies(objs: list[dict]) -> list:
    """What a stream's objects say, without their ids and times."""
    return [o.get("choices") or o.get("message") for o in objs]


def _stream_alone(url: str, api: str) -> tuple[float, list[dict]]:
    """The short request streamed by a client that reads at once: seconds to its end, and its objects."""
    path, _, short = ROUTES[api]
    t0 = time.monotonic()
    with httpx.stream("POST", url + path, json=short, timeout=120) as r:
        assert r.status_code == 200
        raw = r.read()
    objs, done = _objects(api, raw)
    assert done, raw[-300:]
    return time.monotonic() - t0, objs


# ---------------------------------------------------------------------------------------------- disconnects

def test_leaving_an_ollama_stream_frees_its_slot_at_once(shared, http):
    """Both slots streaming Ollama chats; one client leaves after its first line: its slot is free at once
    (``/slots``), and the next request gets it and answers while the other stream still runs."""
    body = {"messages": MSGS, "options": {"num_predict": 480, "temperature": 0}}
    with httpx.Client(base_url=shared.url, timeout=120) as a, httpx.Client(base_url=shared.url, timeout=120) as b:
        with a.stream("POST", "/api/chat", json=body) as ra, b.stream("POST", "/api/chat", json=body) as rb:
            # (the line iterators are kept: one dropped closes its response, which is a client leaving)
            lines_a, lines_b = ra.iter_lines(), rb.iter_lines()
            assert json.loads(next(lines_a))["done"] is False and json.loads(next(lines_b))["done"] is False
            assert len(_busy(shared.url)) == 2
            ra.close()                      # the client leaves mid-stream
            busy = _wait(lambda: (lambda b: len(b) == 1 and b)(_busy(shared.url)), 10,
                         "the left stream's slot is free")
            t0 = time.monotonic()
            r = http.post("/api/chat", json={"messages": OTHER, "stream": False,
                                             "options": {"num_predict": 4, "temperature": 0}})
            took = time.monotonic() - t0
            assert r.status_code == 200 and r.json()["done_reason"] == "length" and r.json()["eval_count"] == 4
            # the other stream (480 tokens) is still running: the request did not wait for a slot to end
            still = _busy(shared.url)
            assert [s["id"] for s in still] == [s["id"] for s in busy], (still, busy, took)
            assert json.loads(next(lines_b))["done"] is False
    _wait(lambda: not _busy(shared.url), 10, "both slots free once both clients left")


# ---------------------------------------------------------------------------------------------- slow readers

@pytest.mark.parametrize("api", ["openai", "ollama"])
def test_a_client_that_stops_reading_stalls_no_other_stream(wide, api):
    """A stream nobody reads (a raw socket, a 4 KiB receive buffer) past the socket buffers: another client's
    stream at the same time ends at its normal pace (against its time alone, generously bounded) while the
    unread one is still generating; the unread client then gets its whole stream."""
    path, long, _ = ROUTES[api]
    alone, want = _stream_alone(wide.url, api)
    slow = _raw_request(wide.url, path, long)
    try:
        p0 = _wait(lambda: _busy(wide.url), 60, "the unread stream started")[0]["n_cached"]
        # ~100 KB an object: 100 tokens are past the buffers, so its writer waits on the socket now
        _wait(lambda: max((s["n_cached"] for s in _busy(wide.url)), default=0) >= p0 + PAST_THE_BUFFERS // 100_000,
              120, "the unread stream generated 100 tokens", step=0.2)
        took, got = _stream_alone(wide.url, api)
        assert _busy(wide.url), "the unread stream (400 tokens) ended before the short one: nothing was measured"
        assert took < 3 * alone + 10, f"the short stream took {took:.1f} s beside an unread one, {alone:.1f} s alone"
        assert _replies(got) == _replies(want)        # greedy: the same reply, whatever else runs
        status, headers, body, complete = _http(_read_to_eof(slow))
    finally:
        slow.close()
    assert status == 200 and complete
    objs, done = _objects(api, body)
    assert done and len(body) > PAST_THE_BUFFERS, (done, len(body))
    assert all(o["model"] == LONG_ALIAS for o in objs)
    if api == "openai":
        assert objs[-1]["choices"][0]["finish_reason"] == "length" and objs[-1]["timings"]["predicted_n"] == 400
    else:
        assert objs[-1]["done_reason"] == "length" and objs[-1]["eval_count"] == 400


# ---------------------------------------------------------------------------------------------- --timeout

@pytest.fixture(scope="module")
def strict(chat_gguf):
    """``--timeout 0.5``, one slot, streamed objects of ~100 KB."""
    srv = ServerProcess(chat_gguf, "-c", "512", "-np", "1", "-dev", "cpu", "--alias", LONG_ALIAS, "-to", "0.5")
    yield srv
    assert srv.stop() == 0, srv.output()[-4000:]


def test_timeout_answers_408_to_a_body_that_stops_arriving(strict):
    s = _raw_request(strict.url, "/v1/chat/completions", {"messages": OTHER, "max_tokens": 2}, send_body=False,
                     close=False)
    t0 = time.monotonic()
    try:
        status, headers, body, _ = _http(_read_to_eof(s, 60))    # the server closes the connection after it
    finally:
        s.close()
    assert 0.4 < time.monotonic() - t0 < 30
    assert status == 408 and headers["connection"] == "close"
    err = json.loads(body)["error"]
    assert err["type"] == "timeout_error" and "--timeout" in err["message"] and "0.5 s" in err["message"]
    r = httpx.post(strict.url + "/api/chat", json={"messages": OTHER, "stream": False,
                                                   "options": {"num_predict": 2, "temperature": 0}}, timeout=60)
    assert r.status_code == 200 and r.json()["eval_count"] == 2


@pytest.mark.parametrize("api", ["openai", "ollama"])
def test_timeout_drops_a_client_that_accepts_nothing(strict, api):
    """A stream past the socket buffers that its client does not read for --timeout: the server drops the client
    and cancels its request (the slot is free long before the request's own end), says why in its log, and
    serves on; the client, reading at last, gets the start of the stream and then the end of the connection."""
    path, long, _ = ROUTES[api]
    long = {**long, **({"max_tokens": -1} if api == "openai" else {"options": {"num_predict": -1, "temperature": 0}})}
    s = _raw_request(strict.url, path, long)
    try:
        _wait(lambda: _busy(strict.url), 60, "the stream started")
        _wait(lambda: not _busy(strict.url), 120, "the unread stream's request cancelled", step=0.2)
        held = httpx.get(strict.url + "/slots", timeout=30).json()[0]["n_cached"]
        # cancelled: the request (until a full context, ~490 tokens) did not run to its end (the drop came
        # after ~30 tokens passed the buffers and 0.5 s more)
        assert held < 400, held
        status, _, body, complete = _http(_read_to_eof(s))
    finally:
        s.close()
    # the stream's start, and no end: neither [DONE] nor a done line came
    assert status == 200 and not complete and body.startswith(b"data: {" if api == "openai" else b'{"model"')
    assert b"[DONE]" not in body and b'"done":true' not in body
    out = strict.output()
    assert "accepted nothing for 0.5 s (--timeout): dropped" in out and "without completing response" not in out
    r = httpx.post(strict.url + "/v1/completions", json={"prompt": "after", "max_tokens": 2, "temperature": 0},
                   timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
