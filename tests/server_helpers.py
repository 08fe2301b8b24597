"""``ggmlpy serve`` as a real process on 127.0.0.1 for tests/server: started with ``python -m ggmlpy serve``,
on a port the server picks (``--port 0``, read back from its "listening on" line), waited on via ``/health``."""

from __future__ import annotations

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


class ServerProcess:
    """A running ``ggmlpy serve``; ``url`` (``http://127.0.0.1:PORT``), ``lines`` (its output so far).
    ``env``: variables set for the process over this one's (``{"GGMLPY_KERNELS": "ggml"}``)."""

    def __init__(self, model, *args: str, ready: bool = True, timeout: float = 120.0,
                 env: Optional[dict] = None) -> None:
        cmd = [sys.executable, "-m", "ggmlpy", "serve", "-m", str(model), "--host", "127.0.0.1", "--port", "0",
               *map(str, args)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        self.lines: list[str] = []
        self._port = threading.Event()
        self.port = 0
        threading.Thread(target=self._read, daemon=True).start()
        if not self._port.wait(timeout):
            self.stop()
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

    def output(self) -> str:
        return "".join(self.lines)

    def wait_ready(self, timeout: float = 120.0) -> None:
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}):\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
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
        self.terminate()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
