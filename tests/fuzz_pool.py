"""The child-process pool of the command-line fuzzers: gguf_fuzz.py, state_fuzz.py, rpc_fit_fuzz.py.

A fuzzer numbers its cases. A child process (the fuzzer's own script with ``--child --range A:B``)
runs cases ``A .. B - 1``, printing ``start i`` before case ``i`` (:func:`case_start`) and the
case's result, one JSON object with ``"i"``, after it (:func:`case_result`). The parent
(:func:`results`) runs up to ``jobs`` children at a time and watches them:

* a child that dies inside a case is an *abort*: the case is reported (:class:`Lost`) and a new
  child runs the rest of the range;
* a case that makes no progress for ``case_timeout`` seconds is a *hang*: the child is killed, the
  case reported and a new child runs the rest of the range;
* a child that exits with a non-zero status, or stalls, between cases is reported with no case, and
  the rest of its range is not run.

What a case is, what its result holds and how the summary counts it stay with each fuzzer.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

# --- the command line ----------------------------------------------------------------------------

def add_options(ap: argparse.ArgumentParser, *, cases: int, case_timeout: float, work_help: str,
                batch: int | None = None, out: str | None = None) -> None:
    """Add the options the fuzzers share to ``ap``.

    Parameters
    ----------
    ap : argparse.ArgumentParser
        The fuzzer's parser.
    cases, case_timeout : int, float
        Defaults of ``--cases`` and ``--case-timeout``.
    work_help : str
        The help of ``--work`` (what the fuzzer keeps there).
    batch : int, optional
        Default of ``--batch`` (cases per child); with it come ``--start`` and ``--jobs``. None: one
        child runs every case, and the fuzzer has none of the three.
    out : str, optional
        Default of ``--out``; with it comes ``--write-case``. None: neither.
    """
    ap.add_argument("--cases", type=int, default=cases)
    if batch is not None:
        ap.add_argument("--start", type=int, default=0, help="number of the first case")
    ap.add_argument("--seed", type=int, default=0)
    if batch is not None:
        ap.add_argument("--jobs", type=int, default=1, help="child processes at a time")
        ap.add_argument("--batch", type=int, default=batch, help="cases per child process")
    ap.add_argument("--case-timeout", type=float, default=case_timeout)
    ap.add_argument("--log", help="write every case's result (JSON lines) here")
    if out is not None:
        ap.add_argument("--write-case", type=int,
                        help="write case N to --out and describe it, run nothing")
        ap.add_argument("--out", default=out)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--range", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=work_help)


def child_range(a: argparse.Namespace) -> tuple[int, int]:
    """A child's ``--range A:B`` as ``(A, B)``."""
    lo, hi = map(int, a.range.split(":"))
    return lo, hi


def run_main(log_path: str | None, run: Callable) -> int:
    """Call ``run(log)`` with the ``--log`` file (or None) open and print its summary as JSON.

    Returns the exit status: 0 when the summary lists no failures, else 1.
    """
    log = open(log_path, "w") if log_path else None
    try:
        summary = run(log)
    finally:
        if log is not None:
            log.close()
    print(json.dumps(summary))
    return 0 if not summary["failures"] else 1


# --- the child's side -----------------------------------------------------------------------------

def case_start(i: int) -> None:
    """Tell the parent that case ``i`` starts (it is named if the child dies or stalls in it)."""
    print(f"start {i}", flush=True)


def case_result(res: dict) -> None:
    """Hand the parent the result of the case just run (``res["i"]`` names it)."""
    print(json.dumps(res), flush=True)


# --- the parent's side ----------------------------------------------------------------------------

def ranges(start: int, cases: int, batch: int | None = None) -> list[tuple[int, int]]:
    """Cases ``start .. start + cases - 1`` split into ranges of ``batch`` (None: one range)."""
    if batch is None:
        batch = max(cases, 1)
    return [(s, min(s + batch, start + cases)) for s in range(start, start + cases, batch)]


@contextlib.contextmanager
def work_dir(work: str | None, prefix: str) -> Iterator[str]:
    """``work``, or a temporary folder (removed afterwards) when it is None."""
    if work is not None:
        yield work
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        yield tmp


def finish(summary: dict, t0: float) -> dict:
    """Add the wall time since ``t0`` to ``summary`` and keep its first 50 failures; returns it."""
    summary["wall_s"] = round(time.monotonic() - t0, 1)
    summary["failures"] = summary["failures"][:50]
    return summary


class Lost:
    """A child that died or was killed without a result for the case it was in.

    Attributes
    ----------
    outcome : str
        ``"abort"`` (it exited; ``rc`` its status) or ``"hang"`` (no progress for ``case_timeout``
        seconds: killed).
    case : int or None
        The case it was in; None when it exited with a non-zero status or stalled between cases.
    first, stop : int
        The range the child was started for.
    rc : int
        Its return code.
    stderr : str
        The end of its standard error.
    case_timeout : float
        The run's ``case_timeout`` (a hang's :attr:`error` names it).
    """

    def __init__(self, outcome: str, case: int | None, first: int, stop: int, rc: int, stderr: str,
                 case_timeout: float) -> None:
        self.outcome, self.case, self.first, self.stop = outcome, case, first, stop
        self.rc, self.stderr, self.case_timeout = rc, stderr, case_timeout

    @property
    def error(self) -> str:
        """What went wrong in the case: the return code and stderr, or the timeout."""
        if self.outcome == "abort":
            return f"rc={self.rc} {self.stderr}"
        return f"no result after {self.case_timeout:g} s"

    @property
    def message(self) -> str:
        """A failure line for a child lost between cases."""
        if self.outcome == "abort":
            return f"child for cases {self.first}..{self.stop} exited {self.rc}: {self.stderr}"
        return f"child for cases {self.first}..{self.stop} stalled between cases"


class _Child:
    """One child process and what the parent knows of it.

    Its stderr goes to a file: a full pipe would stall it.
    """

    def __init__(self, command: list, first: int, stop: int, work: str) -> None:
        self.first, self.stop = first, stop
        self.err = tempfile.TemporaryFile(dir=work)
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=self.err)
        self.fd = self.proc.stdout.fileno()
        self.buf = b""
        self.eof = False
        self.current: int | None = None
        self.since = time.monotonic()

    def stderr(self) -> str:
        self.err.seek(0)
        text = self.err.read().decode(errors="replace")
        self.err.close()
        return text[-1500:]

    def reap(self, kill: bool = False) -> tuple[int, str]:
        """End the child (``kill``: by SIGKILL); its return code and the end of its stderr."""
        if kill:
            self.proc.kill()
        rc = self.proc.wait()
        self.proc.stdout.close()
        return rc, self.stderr()


def results(script: str, todo: list[tuple[int, int]], *, seed: int, work: str, jobs: int = 1,
            case_timeout: float, args: tuple | list = ()) -> Iterator[dict | Lost]:
    """Run the ranges ``todo`` in children of ``script``; yield each result and each :class:`Lost`.

    Parameters
    ----------
    script : str
        The fuzzer, run as ``script --child --range A:B --seed SEED --work WORK *args``.
    todo : list of (int, int)
        The ranges of cases (:func:`ranges`), each run by one child, in this order.
    seed : int
        The run's seed.
    work : str
        The folder the children work in (their stderr files go there too).
    jobs : int
        Children at a time.
    case_timeout : float
        Seconds a case may run without a result before its child is killed (a hang).
    args : sequence of str
        The fuzzer's own options for its children.

    Yields
    ------
    dict or Lost
        A case's result as the child printed it (JSON), or a child lost in a case or between cases.
    """
    todo = list(todo)
    running: list[_Child] = []

    def spawn(first: int, stop: int) -> _Child:
        command = [sys.executable, "-X", "faulthandler", script, "--child", "--range",
                   f"{first}:{stop}", "--seed", str(seed), "--work", work, *args]
        return _Child(command, first, stop, work)

    def respawn(c: _Child) -> None:
        # the rest of the range, before any other: the cases keep close to their plain order
        if c.current + 1 < c.stop:
            todo.insert(0, (c.current + 1, c.stop))

    try:
        while todo or running:
            while todo and len(running) < jobs:
                running.append(spawn(*todo.pop(0)))
            ready, _, _ = select.select([c.fd for c in running], [], [], 0.5)
            for c in list(running):
                if c.fd in ready:
                    chunk = os.read(c.fd, 1 << 16)
                    c.eof = not chunk
                    c.buf += chunk
                while b"\n" in c.buf:
                    line, c.buf = c.buf.split(b"\n", 1)
                    if line.startswith(b"start "):
                        c.current = int(line.split()[1])
                        c.since = time.monotonic()
                    elif line.startswith(b"{"):
                        c.current = None
                        c.since = time.monotonic()
                        yield json.loads(line)
                if c.eof:
                    rc, err = c.reap()
                    running.remove(c)
                    if c.current is not None:      # died in a case: an abort (or an odd exit)
                        yield Lost("abort", c.current, c.first, c.stop, rc, err, case_timeout)
                        respawn(c)
                    elif rc != 0:
                        yield Lost("abort", None, c.first, c.stop, rc, err, case_timeout)
                elif time.monotonic() - c.since > case_timeout:
                    rc, err = c.reap(kill=True)
                    running.remove(c)
                    yield Lost("hang", c.current, c.first, c.stop, rc, err, case_timeout)
                    if c.current is not None:
                        respawn(c)
    finally:
        # the caller stopped early (an exception): no child outlives the run
        for c in running:
            with contextlib.suppress(OSError, ValueError):
                c.reap(kill=True)


def run_ranges(script: str, todo: list[tuple[int, int]], *, seed: int, work: str, jobs: int,
               case_timeout: float, args: tuple | list = (), summary: dict,
               record: Callable[[dict], None], describe: Callable[[int], dict]) -> None:
    """:func:`results`, a lost case recorded as a result and a child lost between cases counted.

    A case lost to an abort or a hang goes to ``record`` as ``{**describe(i), "outcome": "abort" or
    "hang", "error": ...}``; a child lost between cases adds one to ``summary["aborts"]`` or
    ``summary["hangs"]`` and a line to ``summary["failures"]``. Results go to ``record`` as they
    are.
    """
    for r in results(script, todo, seed=seed, work=work, jobs=jobs, case_timeout=case_timeout,
                     args=args):
        if not isinstance(r, Lost):
            record(r)
        elif r.case is not None:
            record({**describe(r.case), "outcome": r.outcome, "error": r.error})
        else:
            summary[r.outcome + "s"] += 1
            summary["failures"].append(r.message)
