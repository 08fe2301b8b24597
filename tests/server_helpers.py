"""``ggmlpy serve`` as a real process on 127.0.0.1 for tests/server: started with ``python -m ggmlpy serve``,
on a port the server picks (``--port 0``, read back from its "listening on" line), waited on via ``/health``.

The child inherits this process's environment as it is (``PYTHONPATH`` included, never a checkout's ``src``
put first: under CI that would shadow the installed wheel with sources lacking the built ``_core``), so it
imports the ggmlpy the tests imported. It uses ggml's kernels (``GGMLPY_KERNELS=ggml``), as the in-process
reference runner does (tests/server/conftest.py): the own kernels are chosen by timing, which could differ
between two processes and change a greedy token of random weights.
"""

from __future__ import annotations

import atexit
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Optional

import httpx

LISTENING = re.compile(r"listening on http://127\.0\.0\.1:(\d+)")

#: the shared server's and the reference runner's context per slot, and slots (tests/server/conftest.py)
N_CTX = 512
N_PARALLEL = 2


class ServerProcess:
    """A running ``ggmlpy serve``: ``url`` (``http://127.0.0.1:PORT``), ``lines`` (its output so far),
    ``health`` (the ``(status, body)`` answers of ``/health`` seen while it loaded).

    Parameters
    ----------
    model, *args
        The model file and the rest of the command line (``-c``, ``-np``, ...).
    ready : bool
        Wait until ``/health`` answers 200 (else only until the socket listens).
    timeout : float
        Seconds to wait for each.
    env : dict, optional
        Variables set over this process's environment for the child (over ``kernels`` too).
    kernels : str or None
        ``GGMLPY_KERNELS`` for the child (default ``ggml``, as the reference runner); None: inherited.

    The process is stopped (SIGTERM, then SIGKILL) at the latest when the test process exits.
    """

    def __init__(self, model, *args: str, ready: bool = True, timeout: float = 120.0, env: Optional[dict] = None,
                 kernels: Optional[str] = "ggml") -> None:
        cmd = [sys.executable, "-m", "ggmlpy", "serve", "-m", str(model), "--host", "127.0.0.1", "--port", "0",
               *map(str, args)]
        child_env = {**os.environ, "PYTHONUNBUFFERED": "1", **({"GGMLPY_KERNELS": kernels} if kernels else {}),
                     **(env or {})}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env)
        atexit.register(self._stop_quietly)
        self.lines: list[str] = []
        self.health: list[tuple[int, dict]] = []
        self._port = threading.Event()
        self.port = 0
        threading.Thread(target=self._read, daemon=True).start()
        if not self._port.wait(timeout) or not self.port:
            self._stop_quietly()
            raise RuntimeError("the server never listened:\n" + self.output())
        self.url = f"http://127.0.0.1:{self.port}"
        if ready:
            self.wait_ready(timeout)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            m = LISTENING.search(line)
            if m and not self.port:
                self.port = int(m.group(1))
                self._port.set()
        self._port.set()                     # the process ended (without listening, if port is still 0)

    def output(self) -> str:
        return "".join(self.lines)

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Poll ``/health`` until 200, recording each answer in :attr:`health`; a failed load (500) or an
        exit raises with the server's output."""
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}):\n{self.output()}")
            try:
                r = httpx.get(self.url + "/health", timeout=5)
            except httpx.HTTPError:
                time.sleep(0.05)
                continue
            self.health.append((r.status_code, r.json()))
            if r.status_code == 200:
                return
            if r.status_code == 500:
                raise RuntimeError(f"the model failed to load: {r.json()}\n{self.output()}")
            time.sleep(0.05)
        raise RuntimeError("the server never became ready:\n" + self.output())

    def client(self, **kw):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0,
                             timeout=kw.pop("timeout", 120), **kw)

    def rss_mib(self, field: str = "VmRSS") -> float:
        """The process's resident memory in MiB (``field="VmHWM"``: its peak so far)."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
        raise RuntimeError(f"no {field}")

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM and wait; the exit status (SIGKILL and TimeoutExpired after ``timeout`` seconds)."""
        self.terminate()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise

    def _stop_quietly(self) -> None:
        if self.proc.poll() is None:
            try:
                self.stop(20)
            except subprocess.TimeoutExpired:
                pass
