"""The two ends of ``--vs``: a peer engine in a child process, driven one test at a time over JSON lines.

The driver's end is :class:`WorkerClient`. It runs this file as a script,
``python .../benchmark/worker.py --engine-worker llama.cpp [-v]``, and that
process, the worker, runs :func:`serve`. They speak one JSON object a line:

* the worker starts with ``{"ok": true, "version": ...}``, or
  ``{"ok": false, "error": ...}`` and exits (llama_cpp missing or broken);
* ``{"cmd": "run", "inst": {Instance fields}, "reps", "seed", "index",
  "warmup", "delay", "progress_prefix"}`` (image tests: and ``"image_size"``) runs one test
  (:func:`~.engines.run_instance`) and gets ``{"ok": true, "result": {Result
  fields}}`` or ``{"ok": false, "error": "Type: message"}`` (with ``"unsupported": true`` for a
  test the engine cannot run at all, :class:`~.errors.UnsupportedTest`);
* ``{"cmd": "exit"}``, or the end of its input, ends the worker.

The worker must never load ggmlpy: llama-cpp-python and ggmlpy each ship a
``libggml-base.so`` with the same soname, which must never share a process. Run
as a script, this file imports its own folder as a package of another name
(:data:`WORKER_PACKAGE`), so ggmlpy's and ggmlpy.benchmark's ``__init__`` never
run there, and blocks ``ggmlpy`` itself. The modules the worker imports
(:mod:`.engines`, :mod:`.errors`, :mod:`.llamacpp`, :mod:`.results` and this
one) therefore import nothing from ggmlpy.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import types
from dataclasses import asdict
from typing import Any

#: The name the worker process imports this folder under.
WORKER_PACKAGE = "_ggmlpy_benchmark_worker"

if __name__ == "__main__" and not __package__:
    # The worker process: this file run as a script. A script's folder comes first in sys.path, where this
    # folder's modules (options, output, ...) would shadow top-level ones: take it out.
    _here = {os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.realpath(__file__))}
    sys.path[:] = [s for s in sys.path
                   if os.path.abspath(s or ".") not in _here and os.path.realpath(s or ".") not in _here]
    sys.modules["ggmlpy"] = None  # type: ignore[assignment]  # an import of ggmlpy fails instead of loading ggml
    _package = types.ModuleType(WORKER_PACKAGE)
    _package.__path__ = [os.path.dirname(os.path.abspath(__file__))]
    sys.modules[WORKER_PACKAGE] = _package
    if len(sys.argv) < 3 or sys.argv[1] != "--engine-worker":
        print(f"usage: {os.path.basename(__file__)} --engine-worker ENGINE [-v]  (started by ggmlpy bench --vs)",
              file=sys.stderr)
        sys.exit(2)
    sys.exit(importlib.import_module(WORKER_PACKAGE + ".worker").serve(sys.argv[2], "-v" in sys.argv[3:]))

from .engines import Engine, run_instance  # noqa: E402  (after the worker's set-up above)
from .errors import BenchError, UnsupportedTest  # noqa: E402
from .llamacpp import LlamaCppEngine  # noqa: E402
from .results import Instance, Result  # noqa: E402

__all__ = ["WORKER_PACKAGE", "PeerUnavailable", "PeerUnsupported", "WorkerClient", "serve"]


class PeerUnavailable(BenchError):
    """The peer engine's package is not installed (or does not start)."""


class PeerUnsupported(UnsupportedTest):
    """The peer cannot run this kind of test (llama.cpp's image tests without libmtmd): a skip, not a failure."""


class WorkerClient:
    """A peer engine in a child process, driven one test at a time over JSON lines.

    The child runs this file as a script (``python .../worker.py --engine-worker
    llama.cpp``), so ggmlpy's package, and with it ggmlpy's ggml libraries, is
    never imported there.
    """

    def __init__(self, engine: str, verbose: bool = False):
        self.engine = engine
        cmd = [sys.executable, "-u", os.path.abspath(__file__), "--engine-worker", engine]
        if verbose:
            cmd.append("-v")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=None, text=True, bufsize=1)
        hello = self._recv()
        if not hello.get("ok"):
            self.close()
            raise PeerUnavailable(hello.get("error", f"{engine} worker failed to start"))
        self.version = hello.get("version", "")

    def _recv(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            return {"ok": False, "error": f"the {self.engine} worker exited ({code})"}
        return json.loads(line)

    def run(self, inst: Instance, **kw: Any) -> Result:
        """Run one test in the worker (same arguments as :func:`run_instance`)."""
        assert self.proc.stdin is not None
        if self.proc.poll() is not None:
            raise BenchError(f"the {self.engine} worker has exited ({self.proc.returncode})")
        try:
            self.proc.stdin.write(json.dumps({"cmd": "run", "inst": asdict(inst), **kw}) + "\n")
            self.proc.stdin.flush()
        except OSError as e:
            raise BenchError(f"the {self.engine} worker is gone: {e}") from None
        reply = self._recv()
        if not reply.get("ok"):
            raise (PeerUnsupported if reply.get("unsupported") else BenchError)(reply.get("error", "worker error"))
        return Result.from_dict(reply["result"])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                self.proc.kill()
                self.proc.wait()


def serve(engine_name: str, verbose: bool) -> int:
    """The child side of :class:`WorkerClient`: serve ``engine_name`` on stdin/stdout until told to exit.

    Returns the exit code of the worker process.
    """
    # Replies go through a private copy of stdout; the engine's C code may print
    # to fd 1, which now goes to stderr.
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def send(obj: dict[str, Any]) -> None:
        reply.write(json.dumps(obj) + "\n")
        reply.flush()

    if engine_name != "llama.cpp":
        send({"ok": False, "error": f"unknown engine {engine_name!r}"})
        return 2
    try:
        engine: Engine = LlamaCppEngine(verbose=verbose)
    except ImportError as e:
        send({"ok": False, "error": _NO_LLAMA_CPP + f" ({e})"})
        return 1
    except Exception as e:  # a broken install
        send({"ok": False, "error": f"llama_cpp failed to start: {type(e).__name__}: {e}"})
        return 1
    send({"ok": True, "version": engine.version})
    try:
        for line in sys.stdin:
            msg = json.loads(line)
            if msg.get("cmd") != "run":
                break
            inst = Instance(**msg["inst"])
            kw = {k: msg[k] for k in ("reps", "seed", "index", "warmup", "delay", "image_size") if k in msg}
            prefix = msg.get("progress_prefix")
            prog = (lambda s, _p=prefix: print(f"{_p}{s}", file=sys.stderr, flush=True)) if prefix \
                else None
            try:
                res = run_instance(engine, inst, progress=prog, **kw)
                send({"ok": True, "result": res.to_dict()})
            except UnsupportedTest as e:
                send({"ok": False, "error": str(e), "unsupported": True})
            except Exception as e:
                send({"ok": False, "error": f"{type(e).__name__}: {e}"})
    finally:
        engine.close()
    return 0


_NO_LLAMA_CPP = ("--vs llama.cpp needs llama-cpp-python (the llama_cpp package), which is not "
                 "installed: pip install llama-cpp-python (it builds llama.cpp from source)")
