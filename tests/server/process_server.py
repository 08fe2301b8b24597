"""A real ``ggmlpy serve`` process on 127.0.0.1 over the tiny converted Llama (``text_helpers.llama_chat_gguf``),
and an in-process runner with the same settings to compare against; each made once per test process and shared
by the Ollama and the extras tests (the process is stopped at exit).

Both use ggml's kernels (``GGMLPY_KERNELS=ggml``): the own kernels are chosen by timing, which could differ
between the two processes and change a greedy token of random weights.
"""

from __future__ import annotations

import atexit
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

N_CTX = 256
N_PARALLEL = 2

_lock = threading.Lock()
_cache: dict = {}
# The child imports the ggmlpy this test process imported (an installed wheel in CI, a checkout's src in an
# editable or worktree run): a checkout's src put first would shadow a wheel with sources lacking the built _core.
PACKAGE_ROOT = str(Path(__import__("ggmlpy").__file__).resolve().parents[1])


def model_path(tmp_path_factory) -> str:
    from text_helpers import llama_chat_gguf

    return str(llama_chat_gguf(tmp_path_factory))


def start(path: str, *args: str, timeout: float = 120.0) -> tuple[subprocess.Popen, str, list]:
    """Start ``python -m ggmlpy serve -m path --port 0 *args``; returns the process, its base URL (read from
    its ``listening on`` line) and the list its later stderr lines are appended to."""
    env = dict(os.environ, GGMLPY_KERNELS="ggml",
               PYTHONPATH=PACKAGE_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "ggmlpy", "serve", "-m", path, "--port", "0", "-c", str(N_CTX),
                             "-dev", "cpu", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=env)
    lines: list = []
    found = threading.Event()
    url: list = []

    def drain():
        for line in proc.stderr:
            lines.append(line)
            m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
            if m and not url:
                url.append(m.group(1))
                found.set()
        found.set()

    threading.Thread(target=drain, daemon=True).start()
    if not found.wait(timeout) or not url:
        proc.kill()
        raise RuntimeError(f"ggmlpy serve did not start: {''.join(lines)[-2000:]}")
    return proc, url[0], lines


def wait_ready(client, timeout: float = 120.0) -> list:
    """Poll ``/health`` until 200; returns the statuses seen."""
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = client.get("/health")
        seen.append((r.status_code, r.json()))
        if r.status_code == 200:
            return seen
        if r.status_code == 500:
            raise RuntimeError(f"the model failed to load: {r.json()}")
        time.sleep(0.05)
    raise RuntimeError(f"not ready after {timeout} s: {seen[-1:]}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()


def served(tmp_path_factory) -> dict:
    """The shared server: ``url``, ``slots`` (its --slot-save-path), ``health`` (the /health answers seen
    while it loaded), ``path`` (the model file), ``log`` (its stderr lines)."""
    import httpx

    with _lock:
        if "server" not in _cache:
            path = model_path(tmp_path_factory)
            slots = tmp_path_factory.mktemp("slots") / "saved"
            slots.mkdir()
            proc, url, lines = start(path, "-np", str(N_PARALLEL), "--slot-save-path", str(slots), "--alias", "tiny")
            atexit.register(_stop, proc)
            with httpx.Client(base_url=url, timeout=60) as c:
                health = wait_ready(c)
            _cache["server"] = {"url": url, "slots": slots, "health": health, "path": path, "log": lines,
                                "proc": proc}
        return _cache["server"]


def local_runner(tmp_path_factory):
    """An in-process runner over the same file with the server's settings."""
    import ggmlpy

    with _lock:
        if "runner" not in _cache:
            r = ggmlpy.open(model_path(tmp_path_factory), n_ctx=N_CTX, n_seq_max=N_PARALLEL, devices="cpu",
                            kernels="ggml")
            atexit.register(r.close)
            _cache["runner"] = r
        return _cache["runner"]


@pytest.fixture(autouse=True)
def _no_leaked_handles():
    """Replaces the suite's live-handle check in the server tests (imported into each module): the in-process
    runner is shared by every test of the process, and its graph pool grows as requests of new shapes come, by
    design; the runner's own tests check that what it creates is freed."""
    yield
