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

from server_helpers import N_CTX, N_PARALLEL  # noqa: E402

MSGS = [{"role": "user", "content": "Tell me about slots."}]


def _app(reference, **kw):
    from starlette.testclient import TestClient

    from ggmlpy.server.app import create_app
    from ggmlpy.server.state import ServerState

    return TestClient(create_app(ServerState("", model_name="local", runner=reference, **kw)))


# ---------------------------------------------------------------------------- /health

def test_health_loading_then_ok(shared, reference):
    # the real process: it answered while loading (the load starts once the socket listens), then ok
    seen = shared.health
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
    st.start_loading(lambda progress: (progress(1, 4), go.wait(30), (None, reference))[-1])
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

def _slots(http) -> list:
    r = http.get("/slots")
    assert r.status_code == 200
    return r.json()


def _metric(http, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", http.get("/metrics").text, re.M)
    assert m, name
    return float(m.group(1))


def test_slots_shape(http):
    s = _slots(http)
    assert [x["id"] for x in s] == list(range(N_PARALLEL))
    for x in s:
        assert x["n_ctx"] == N_CTX and x["is_processing"] is False and x["state"] == "idle"
        assert isinstance(x["n_cached"], int)


def _chat(http, content: str) -> dict:
    r = http.post("/api/chat", json={"messages": [{"role": "user", "content": content}], "stream": False,
                                       "options": {"temperature": 0, "num_predict": 8}})
    assert r.status_code == 200, r.text
    return r.json()


def test_slot_save_erase_restore_continues_the_same(http, shared):
    prompt = "A prompt no other test sends: slots, saved and restored."
    first = _chat(http, prompt)
    n_held = first["prompt_eval_count"] + first["eval_count"] - 1    # the last token is sampled, not computed
    slot = next(x for x in _slots(http) if x["n_cached"] == n_held)["id"]
    r = http.post(f"/slots/{slot}?action=save", json={"filename": "kept.bin"})
    assert r.status_code == 200, r.text
    saved = r.json()
    assert saved["id_slot"] == slot and saved["filename"] == "kept.bin" and saved["n_saved"] == n_held
    assert saved["n_written"] == os.path.getsize(shared.slots / "kept.bin") > 0 and saved["timings"]["save_ms"] > 0
    for x in _slots(http):                # nothing else holds the prompt: the restore must bring it back
        r = http.post(f"/slots/{x['id']}?action=erase")
        assert r.status_code == 200 and r.json() == {"id_slot": x["id"], "n_erased": x["n_cached"]}
    assert all(x["n_cached"] == 0 for x in _slots(http))
    r = http.post(f"/slots/{slot}?action=restore", json={"filename": "kept.bin"})
    assert r.status_code == 200, r.text
    assert r.json()["n_restored"] == n_held and r.json()["n_read"] == saved["n_written"]
    assert _slots(http)[slot]["n_cached"] == n_held
    cached = _metric(http, "llamacpp:prompt_tokens_cached_total")
    again = _chat(http, prompt)
    assert again["message"] == first["message"] and again["eval_count"] == first["eval_count"]
    # the restored cells were reused: the whole prompt but its last token came from the cache
    assert _metric(http, "llamacpp:prompt_tokens_cached_total") - cached == first["prompt_eval_count"] - 1


def test_slot_filenames_refused(http, shared, tmp_path):
    folder = shared.slots
    outside = folder.parent
    before = sorted(os.listdir(outside)), sorted(os.listdir(folder))
    (folder / "link.bin").symlink_to(tmp_path / "elsewhere.bin")
    try:
        for name in ("../escape.bin", str(outside / "abs.bin"), "sub/x.bin", "..", ".hidden", "", "a\\b", "x" * 300,
                     5, None, "link.bin"):
            for action in ("save", "restore"):
                r = http.post(f"/slots/0?action={action}", json={"filename": name})
                assert r.status_code == 400, (name, action, r.text)
                assert r.json()["error"]["param"] == "filename"
    finally:
        (folder / "link.bin").unlink()
    assert (sorted(os.listdir(outside)), sorted(os.listdir(folder))) == before
    assert not (tmp_path / "elsewhere.bin").exists()
    assert http.post("/slots/0?action=restore", json={"filename": "missing.bin"}).status_code == 404
    assert http.post(f"/slots/{N_PARALLEL}?action=erase").status_code == 400
    assert http.post("/slots/0?action=dance").status_code == 400


def test_slot_actions_without_a_folder_and_when_busy(reference, tmp_path, monkeypatch):
    from ggmlpy.server import extras_routes

    c = _app(reference)
    r = c.post("/slots/0?action=save", json={"filename": "a.bin"})
    assert r.status_code == 501 and "--slot-save-path" in r.json()["error"]["message"]
    c = _app(reference, slot_save_path=str(tmp_path))
    monkeypatch.setattr(extras_routes, "SLOT_WAIT", 0.3)
    h = reference.submit("Busy busy", max_tokens=-1, temperature=0)       # runs until cancelled
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

def test_tokenize_detokenize_round_trip(http, reference):
    tok = reference.tokenizer
    text = "Hello <|eot_id|> wörld — ✓ 123"
    ids = http.post("/tokenize", json={"content": text}).json()["tokens"]
    assert ids == tok.encode(text, False, True)
    plain = http.post("/tokenize", json={"content": text, "parse_special": False}).json()["tokens"]
    assert plain == tok.encode(text, False, False) and len(plain) > len(ids)     # <|eot_id|> as text
    assert http.post("/tokenize", json={"content": text, "add_special": True}).json()["tokens"][0] == tok.bos
    pieces = http.post("/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids
    joined = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces)
    assert joined == text.encode()
    back = http.post("/detokenize", json={"tokens": ids}).json()["content"]
    assert back == tok.decode(ids) == text
    assert http.post("/detokenize", json={"tokens": [reference.n_vocab]}).status_code == 400
    assert http.post("/tokenize", json={"content": 3}).status_code == 400


def test_apply_template(http, reference):
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    r = http.post("/apply-template", json={"messages": msgs})
    assert r.json() == {"prompt": reference.tokenizer.apply_chat_template(msgs)}
    assert r.json()["prompt"].endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert http.post("/apply-template", json={"messages": "x"}).status_code == 400


# ---------------------------------------------------------------------------- /metrics and /props

def test_metrics_parse_and_move(http):
    parser = pytest.importorskip("prometheus_client.parser")
    text = http.get("/metrics").text
    assert http.get("/metrics").headers["content-type"].startswith("text/plain; version=0.0.4")
    families = {f.name: f for f in parser.text_string_to_metric_families(text)}
    for name in ("llamacpp:prompt_tokens", "llamacpp:tokens_predicted", "llamacpp:prompt_tokens_seconds",
                 "llamacpp:predicted_tokens_seconds", "llamacpp:requests_processing", "llamacpp:requests_deferred",
                 "llamacpp:kv_cache_usage_ratio"):
        assert name in families, sorted(families)
    assert families["llamacpp:prompt_tokens"].type == "counter"
    assert families["llamacpp:kv_cache_usage_ratio"].type == "gauge"
    before = {k: _metric(http, k) for k in ("llamacpp:tokens_predicted_total", "llamacpp:prompt_tokens_total",
                                              "llamacpp:prompt_tokens_cached_total", "llamacpp:n_decode_total")}
    r = _chat(http, "Count the metrics, please, one by one.")
    after = {k: _metric(http, k) for k in before}
    assert after["llamacpp:tokens_predicted_total"] - before["llamacpp:tokens_predicted_total"] == r["eval_count"]
    assert (after["llamacpp:prompt_tokens_total"] + after["llamacpp:prompt_tokens_cached_total"]
            - before["llamacpp:prompt_tokens_total"] - before["llamacpp:prompt_tokens_cached_total"]) == \
        r["prompt_eval_count"]
    assert after["llamacpp:n_decode_total"] > before["llamacpp:n_decode_total"]
    assert _metric(http, "llamacpp:predicted_tokens_seconds") > 0
    assert 0 < _metric(http, "llamacpp:kv_cache_usage_ratio") <= 1
    assert _metric(http, "llamacpp:requests_processing") == 0
    # the OpenAI routes count too
    before = _metric(http, "llamacpp:tokens_predicted_total")
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5,
                                                  "temperature": 0})
    assert r.status_code == 200, r.text
    assert _metric(http, "llamacpp:tokens_predicted_total") - before == r.json()["usage"]["completion_tokens"]


def test_props(http):
    from text_helpers import LLAMA3_TEMPLATE

    p = http.get("/props").json()
    assert p["total_slots"] == N_PARALLEL and p["n_ctx"] == N_CTX and p["chat_template"] == LLAMA3_TEMPLATE
    assert p["default_generation_settings"]["n_ctx"] == N_CTX
    params = p["default_generation_settings"]["params"]
    assert params["temperature"] == pytest.approx(0.8) and params["top_k"] == 40
    mem = p["memory"]
    assert mem["total"] == sum(d["self"] for d in mem["devices"].values()) > 0 and "CPU" in mem["devices"]
    assert p["modalities"] == {"vision": False, "audio": False} and p["model_path"].endswith(".gguf")
    assert "fit" in p
