"""llama-server's extras (``ggmlpy.server.extras_routes``) against a real ``ggmlpy serve`` process (httpx), and
in process (Starlette's TestClient over ``create_app``) where a test needs to hold the runner busy, block the
load, or run without ``--slot-save-path``."""

from __future__ import annotations

import os
import re
import threading

import pytest

pytest.importorskip("starlette")
httpx = pytest.importorskip("httpx")

from process_server import N_CTX, N_PARALLEL, _no_leaked_handles, local_runner, served  # noqa: E402, F401

MSGS = [{"role": "user", "content": "Tell me about slots."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    return served(tmp_path_factory)


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server["url"], timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    return local_runner(tmp_path_factory)


def _app(runner, **kw):
    from starlette.testclient import TestClient

    from ggmlpy.server.app import create_app
    from ggmlpy.server.state import ServerState

    return TestClient(create_app(ServerState("", model_name="local", runner=runner, **kw)))


# ---------------------------------------------------------------------------- /health

def test_health_loading_then_ok(server, runner):
    # the real process: it answered while loading (the load starts once the socket listens), then ok
    seen = server["health"]
    assert seen[-1] == (200, {"status": "ok"})
    for status, body in seen[:-1]:
        assert status == 503 and body["status"] == "loading" and 0 <= body["progress"] <= 1
    # in process, the load held until released: loading, then ok
    from starlette.testclient import TestClient

    from ggmlpy.server.app import create_app
    from ggmlpy.server.state import ServerState

    st = ServerState("", model_name="x")
    go = threading.Event()
    c = TestClient(create_app(st))
    st.start_loading(lambda progress: (progress(1, 4), go.wait(30), (None, runner))[-1])
    r = c.get("/health")
    assert r.status_code == 503 and r.json()["status"] == "loading" and r.json()["progress"] == pytest.approx(0.2475)
    assert c.get("/slots").status_code == 503
    go.set()
    st._load_thread.join(30)
    assert c.get("/health").json() == {"status": "ok"} and c.get("/slots").status_code == 200
    bad = ServerState("", model_name="y")
    bad.start_loading(lambda progress: 1 / 0).join(30)
    r = TestClient(create_app(bad)).get("/health")
    assert r.status_code == 500 and "ZeroDivisionError" in r.json()["error"]["message"]


# ---------------------------------------------------------------------------- /slots

def _slots(client) -> list:
    r = client.get("/slots")
    assert r.status_code == 200
    return r.json()


def _metric(client, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", client.get("/metrics").text, re.M)
    assert m, name
    return float(m.group(1))


def test_slots_shape(client):
    s = _slots(client)
    assert [x["id"] for x in s] == list(range(N_PARALLEL))
    for x in s:
        assert x["n_ctx"] == N_CTX and x["is_processing"] is False and x["state"] == "idle"
        assert isinstance(x["n_cached"], int)


def _chat(client, content: str) -> dict:
    r = client.post("/api/chat", json={"messages": [{"role": "user", "content": content}], "stream": False,
                                       "options": {"temperature": 0, "num_predict": 8}})
    assert r.status_code == 200, r.text
    return r.json()


def test_slot_save_erase_restore_continues_the_same(client, server):
    prompt = "A prompt no other test sends: slots, saved and restored."
    first = _chat(client, prompt)
    n_held = first["prompt_eval_count"] + first["eval_count"] - 1    # the last token is sampled, not computed
    slot = next(x for x in _slots(client) if x["n_cached"] == n_held)["id"]
    r = client.post(f"/slots/{slot}?action=save", json={"filename": "kept.bin"})
    assert r.status_code == 200, r.text
    saved = r.json()
    assert saved["id_slot"] == slot and saved["filename"] == "kept.bin" and saved["n_saved"] == n_held
    assert saved["n_written"] == os.path.getsize(server["slots"] / "kept.bin") > 0 and saved["timings"]["save_ms"] > 0
    for x in _slots(client):                # nothing else holds the prompt: the restore must bring it back
        r = client.post(f"/slots/{x['id']}?action=erase")
        assert r.status_code == 200 and r.json() == {"id_slot": x["id"], "n_erased": x["n_cached"]}
    assert all(x["n_cached"] == 0 for x in _slots(client))
    r = client.post(f"/slots/{slot}?action=restore", json={"filename": "kept.bin"})
    assert r.status_code == 200, r.text
    assert r.json()["n_restored"] == n_held and r.json()["n_read"] == saved["n_written"]
    assert _slots(client)[slot]["n_cached"] == n_held
    cached = _metric(client, "llamacpp:prompt_tokens_cached_total")
    again = _chat(client, prompt)
    assert again["message"] == first["message"] and again["eval_count"] == first["eval_count"]
    # the restored cells were reused: the whole prompt but its last token came from the cache
    assert _metric(client, "llamacpp:prompt_tokens_cached_total") - cached == first["prompt_eval_count"] - 1


def test_slot_filenames_refused(client, server, tmp_path):
    folder = server["slots"]
    outside = folder.parent
    before = sorted(os.listdir(outside)), sorted(os.listdir(folder))
    (folder / "link.bin").symlink_to(tmp_path / "elsewhere.bin")
    try:
        for name in ("../escape.bin", str(outside / "abs.bin"), "sub/x.bin", "..", ".hidden", "", "a\\b", "x" * 300,
                     5, None, "link.bin"):
            for action in ("save", "restore"):
                r = client.post(f"/slots/0?action={action}", json={"filename": name})
                assert r.status_code == 400, (name, action, r.text)
                assert r.json()["error"]["param"] == "filename"
    finally:
        (folder / "link.bin").unlink()
    assert (sorted(os.listdir(outside)), sorted(os.listdir(folder))) == before
    assert not (tmp_path / "elsewhere.bin").exists()
    assert client.post("/slots/0?action=restore", json={"filename": "missing.bin"}).status_code == 404
    assert client.post(f"/slots/{N_PARALLEL}?action=erase").status_code == 400
    assert client.post("/slots/0?action=dance").status_code == 400


def test_slot_actions_without_a_folder_and_when_busy(runner, tmp_path, monkeypatch):
    from ggmlpy.server import extras_routes

    c = _app(runner)
    r = c.post("/slots/0?action=save", json={"filename": "a.bin"})
    assert r.status_code == 501 and "--slot-save-path" in r.json()["error"]["message"]
    c = _app(runner, slot_save_path=str(tmp_path))
    monkeypatch.setattr(extras_routes, "SLOT_WAIT", 0.3)
    h = runner.submit("Busy busy", max_tokens=-1, temperature=0)       # runs until cancelled
    try:
        r = c.post("/slots/0?action=save", json={"filename": "busy.bin"})
        assert r.status_code == 409 and "idle" in r.json()["error"]["message"]
        assert c.get("/slots").json()[0]["is_processing"] or c.get("/slots").json()[1]["is_processing"]
        assert not (tmp_path / "busy.bin").exists()
    finally:
        h.cancel()
        h.result()
    assert c.post("/slots/0?action=save", json={"filename": "busy.bin"}).status_code == 200


# ---------------------------------------------------------------------------- text

def test_tokenize_detokenize_round_trip(client, runner):
    tok = runner.tokenizer
    text = "Hello <|eot_id|> wörld — ✓ 123"
    ids = client.post("/tokenize", json={"content": text}).json()["tokens"]
    assert ids == tok.encode(text, False, True)
    plain = client.post("/tokenize", json={"content": text, "parse_special": False}).json()["tokens"]
    assert plain == tok.encode(text, False, False) and len(plain) > len(ids)     # <|eot_id|> as text
    assert client.post("/tokenize", json={"content": text, "add_special": True}).json()["tokens"][0] == tok.bos
    pieces = client.post("/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids
    joined = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces)
    assert joined == text.encode()
    back = client.post("/detokenize", json={"tokens": ids}).json()["content"]
    assert back == tok.decode(ids) == text
    assert client.post("/detokenize", json={"tokens": [runner.n_vocab]}).status_code == 400
    assert client.post("/tokenize", json={"content": 3}).status_code == 400


def test_apply_template(client, runner):
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    r = client.post("/apply-template", json={"messages": msgs})
    assert r.json() == {"prompt": runner.tokenizer.apply_chat_template(msgs)}
    assert r.json()["prompt"].endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert client.post("/apply-template", json={"messages": "x"}).status_code == 400


# ---------------------------------------------------------------------------- /metrics and /props

def test_metrics_parse_and_move(client):
    parser = pytest.importorskip("prometheus_client.parser")
    text = client.get("/metrics").text
    assert client.get("/metrics").headers["content-type"].startswith("text/plain; version=0.0.4")
    families = {f.name: f for f in parser.text_string_to_metric_families(text)}
    for name in ("llamacpp:prompt_tokens", "llamacpp:tokens_predicted", "llamacpp:prompt_tokens_seconds",
                 "llamacpp:predicted_tokens_seconds", "llamacpp:requests_processing", "llamacpp:requests_deferred",
                 "llamacpp:kv_cache_usage_ratio"):
        assert name in families, sorted(families)
    assert families["llamacpp:prompt_tokens"].type == "counter"
    assert families["llamacpp:kv_cache_usage_ratio"].type == "gauge"
    before = {k: _metric(client, k) for k in ("llamacpp:tokens_predicted_total", "llamacpp:prompt_tokens_total",
                                              "llamacpp:prompt_tokens_cached_total", "llamacpp:n_decode_total")}
    r = _chat(client, "Count the metrics, please, one by one.")
    after = {k: _metric(client, k) for k in before}
    assert after["llamacpp:tokens_predicted_total"] - before["llamacpp:tokens_predicted_total"] == r["eval_count"]
    assert (after["llamacpp:prompt_tokens_total"] + after["llamacpp:prompt_tokens_cached_total"]
            - before["llamacpp:prompt_tokens_total"] - before["llamacpp:prompt_tokens_cached_total"]) == \
        r["prompt_eval_count"]
    assert after["llamacpp:n_decode_total"] > before["llamacpp:n_decode_total"]
    assert _metric(client, "llamacpp:predicted_tokens_seconds") > 0
    assert 0 < _metric(client, "llamacpp:kv_cache_usage_ratio") <= 1
    assert _metric(client, "llamacpp:requests_processing") == 0
    # the OpenAI routes count too
    before = _metric(client, "llamacpp:tokens_predicted_total")
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5,
                                                  "temperature": 0})
    assert r.status_code == 200, r.text
    assert _metric(client, "llamacpp:tokens_predicted_total") - before == r.json()["usage"]["completion_tokens"]


def test_props(client):
    from text_helpers import LLAMA3_TEMPLATE

    p = client.get("/props").json()
    assert p["total_slots"] == N_PARALLEL and p["n_ctx"] == N_CTX and p["chat_template"] == LLAMA3_TEMPLATE
    assert p["default_generation_settings"]["n_ctx"] == N_CTX
    params = p["default_generation_settings"]["params"]
    assert params["temperature"] == pytest.approx(0.8) and params["top_k"] == 40
    mem = p["memory"]
    assert mem["total"] == sum(d["self"] for d in mem["devices"].values()) > 0 and "CPU" in mem["devices"]
    assert p["modalities"] == {"vision": False, "audio": False} and p["model_path"].endswith(".gguf")
    assert "fit" in p
