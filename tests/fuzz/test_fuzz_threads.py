"""A sample of the multi-threaded lifetime fuzzer (tests/fuzz_threads.py) in the normal test run.

The long run (issue 11: 200,000 calls, 0 aborts) is a documented command in the driver's docstring
and the README; this sample runs a few thousand random calls from several threads over shared
contexts, graphs, buffers, allocators and schedulers, in child processes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

DRIVER = Path(__file__).resolve().parents[1] / "fuzz_threads.py"


@pytest.mark.fuzz
def test_threads_sharing_objects_never_crash_the_interpreter():
    out = subprocess.run([sys.executable, str(DRIVER), "--calls", "8000", "--chunk", "4000", "--threads", "3",
                          "--seed", "7"], capture_output=True, text=True, timeout=600)
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["aborts"] == 0 and summary["hangs"] == 0, out.stderr[-4000:]
    assert summary["unexpected"] == 0, out.stderr[-4000:]
    assert summary["calls"] == 8000
    # the programs really exercised the refusals, not only the happy path
    assert summary["outcomes"].get("ClosedError", 0) > 100
    assert summary["outcomes"].get("GGMLValueError", 0) > 10
    assert out.returncode == 0


@pytest.mark.fuzz
def test_threads_sharing_runners_never_crash_the_interpreter():
    # Runners over one tiny model, created, used (decode, generate, submit, cancel, clear) and closed
    # from several threads, beside the core objects.
    out = subprocess.run([sys.executable, str(DRIVER), "--calls", "3000", "--chunk", "3000", "--threads", "3",
                          "--seed", "11", "--runner"], capture_output=True, text=True, timeout=600)
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["aborts"] == 0 and summary["hangs"] == 0 and summary["unexpected"] == 0, out.stderr[-4000:]
    assert summary["calls"] == 3000 and out.returncode == 0


def test_driver_reports_a_crash_as_an_abort(tmp_path):
    # A child that dies must be counted, not passed over: run the driver on a program that aborts.
    fake = tmp_path / "fuzz_threads.py"
    fake.write_text(DRIVER.read_text().replace("def a_new_ctx(self, rng):",
                                               "def a_new_ctx(self, rng):\n        import os; os.abort()"))
    out = subprocess.run([sys.executable, str(fake), "--calls", "200", "--chunk", "200", "--threads", "1"],
                         capture_output=True, text=True, timeout=120)
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["aborts"] == 1 and out.returncode == 1
