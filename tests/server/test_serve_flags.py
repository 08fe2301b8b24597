"""``ggmlpy serve``'s command line: it offers only flags that act in a server (``run``'s prompt, image, system and
constrained-output flags are usage errors naming the flag), and those it shares with ``run`` act as llama-server's
do: ``-n``, ``--stop`` (llama-server's ``-r``) and ``-s`` are every request's defaults, a request's own field wins.
"""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from server_helpers import ServerProcess

from ggmlpy import cli
from ggmlpy._cliargs import _SAMPLING_FLAGS

#: run's and chat's flags that mean nothing to a server (each with a value where it takes one)
NOT_SERVED = [["--image", "x.png"], ["--system", "be brief"], ["--grammar", "root ::= \"a\""],
              ["--grammar-file", "g.gbnf"], ["-j", "{}"], ["--json-schema", "{}"], ["-jf", "s.json"],
              ["--json-schema-file", "s.json"], ["-p", "hello"], ["--prompt", "hello"], ["-f", "p.txt"],
              ["--chat"], ["--no-parse-special"], ["--verbose"]]

#: every flag serve takes, by what it does there
MODEL = {"-m", "--model", "-hf", "--hf-repo", "-hff", "--hf-file", "--mmproj", "-c", "--ctx-size", "-b", "--batch-size",
         "-t", "--threads", "-ngl", "--n-gpu-layers", "-dev", "--device", "-sm", "--split-mode", "-ts",
         "--tensor-split", "-mg", "--main-gpu", "-nopo", "--no-op-offload", "-ot", "--override-tensor", "-ncmoe",
         "--n-cpu-moe", "-cmoe", "--cpu-moe", "-rpc", "--rpc", "-ctk", "--cache-type-k", "-ctv", "--cache-type-v",
         "-fa", "--flash-attn", "--chat-template-file", "--vision-precision"}
REQUEST_DEFAULTS = {"-n", "--n-predict", "--stop", "-s", "--seed", "--samplers", "--sampling-seq", "--sampler-seq",
                    "--dry-sequence-breaker", "-l", "--logit-bias"}
REQUEST_DEFAULTS |= {f for flags, *_ in _SAMPLING_FLAGS for f in flags}
SERVER = {"--host", "--port", "-np", "--parallel", "--max-queue", "--api-key", "--slot-save-path", "--alias", "-to",
          "--timeout", "--shutdown-grace", "--max-body"}
GENERAL = {"-h", "--help", "--debug"}


def _serve_parser():
    sub = next(a for a in cli.build_parser()._actions if a.dest == "command")
    return sub.choices["serve"]


def test_serve_offers_only_flags_that_act():
    offered = {s for a in _serve_parser()._actions for s in a.option_strings}
    acting = MODEL | REQUEST_DEFAULTS | SERVER | GENERAL
    assert offered == acting, (sorted(offered - acting), sorted(acting - offered))
    r = subprocess.run([sys.executable, "-m", "ggmlpy", "serve", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    usage = r.stdout.split("\n\n", 1)[0]
    for flag, *_ in NOT_SERVED:
        assert f"[{flag} " not in usage and f"[{flag}]" not in usage, flag
    for flag in ("-n N_PREDICT", "--stop STR", "-s SEED", "-to SECONDS"):
        assert f"[{flag}]" in usage, flag
    assert "the max_tokens of a request that sets none" in r.stdout and "llama-server's -r" in r.stdout


@pytest.mark.parametrize("extra", NOT_SERVED, ids=[e[0] for e in NOT_SERVED])
def test_a_run_flag_is_a_usage_error_naming_it(extra, capsys):
    assert cli.main(["serve", "-m", "model.gguf", *extra]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert err == [f"ggmlpy serve: error: unrecognized arguments: {' '.join(extra)}"]


@pytest.mark.parametrize("argv, message", [
    (["--stop", ""], "--stop: a stop string is empty"),
    (["-n", "0"], "-n 0: must be at least 1"),
    (["-to", "-1"], "--timeout -1.0: must be a finite number of seconds >= 0"),
])
def test_bad_default_values_are_usage_errors(argv, message, capsys):
    assert cli.main(["serve", "-m", "model.gguf", *argv]) == 2
    assert capsys.readouterr().err.strip().startswith(f"ggmlpy serve: error: {message}")


@pytest.mark.parametrize("what, message", [("missing", "no such file"), ("text", "not a GGUF file")])
def test_a_bad_model_file_is_an_error_before_the_socket_listens(what, message, tmp_path, capsys, monkeypatch):
    path = tmp_path / "model.gguf"
    if what == "text":
        path.write_text("not a model")
    import uvicorn

    # nothing may listen: the file is refused first (it used to listen, then fail in the loading thread)
    monkeypatch.setattr(uvicorn, "Config", lambda *a, **k: pytest.fail("the server was configured"))
    assert cli.main(["serve", "-m", str(path), "--port", "0"]) == 1
    assert capsys.readouterr().err.strip() == f"ggmlpy serve: error: -m {path}: {message}" + (
        "" if what == "missing" else " (magic b'not ', expected b'GGUF') [ggml: invalid magic characters: 'not ', "
                                     "expected 'GGUF']")


MSGS = [{"role": "user", "content": "Name a colour."}]
NEVER = "\x01never\x01"


def test_n_stop_and_seed_are_every_requests_defaults(chat_gguf, reference):
    """``-n 6 --stop S -s 42``: a request that sets none of them gets 6 tokens at most, cut at S, and seed 42
    (choice i of n: 42 + i); a request's own max_tokens, stop and seed win; on both APIs."""
    full = reference.chat(MSGS, temperature=0, max_tokens=6).content
    stop = full[2:5]
    cut = full[:full.index(stop)]
    srv = ServerProcess(chat_gguf, "-c", "512", "-np", "2", "-dev", "cpu", "-n", "6", f"--stop={stop}", "-s", "42")
    try:
        client = srv.client()
        r = client.chat.completions.create(model="model-f32", messages=MSGS, temperature=0)
        assert r.choices[0].message.content == cut and r.choices[0].finish_reason == "stop"
        r = client.chat.completions.create(model="model-f32", messages=MSGS, temperature=0, stop=[NEVER])
        assert r.choices[0].message.content == full and r.usage.completion_tokens == 6
        assert r.choices[0].finish_reason == "length"
        r = client.chat.completions.create(model="model-f32", messages=MSGS, temperature=0, stop=[NEVER], max_tokens=3)
        assert r.usage.completion_tokens == 3
        # the seed: the server's for a request without one, choice i with 42 + i; the request's own wins
        drawn = [reference.chat(MSGS, temperature=1.0, seed=s, max_tokens=6, stop=[NEVER]).content for s in (42, 43, 7)]
        assert len(set(drawn)) == 3                       # the seed matters
        r = client.chat.completions.create(model="model-f32", messages=MSGS, temperature=1.0, stop=[NEVER], n=2)
        assert [c.message.content for c in r.choices] == drawn[:2]
        r = client.chat.completions.create(model="model-f32", messages=MSGS, temperature=1.0, stop=[NEVER], seed=7)
        assert r.choices[0].message.content == drawn[2]
        assert httpx.get(srv.url + "/props").json()["default_generation_settings"]["params"]["seed"] == 42
        # Ollama's routes take the same defaults
        for options, content, count in (({"temperature": 0}, cut, None), ({"temperature": 0, "stop": [NEVER]}, full, 6),
                                        ({"temperature": 0, "stop": [NEVER], "num_predict": 3}, None, 3),
                                        ({"temperature": 1.0, "stop": [NEVER]}, drawn[0], 6)):
            r = httpx.post(srv.url + "/api/chat", json={"messages": MSGS, "stream": False, "options": options},
                           timeout=60)
            assert r.status_code == 200, r.text
            if content is not None:
                assert r.json()["message"]["content"] == content, options
            if count is not None:
                assert r.json()["eval_count"] == count, options
    finally:
        assert srv.stop() == 0, srv.output()
