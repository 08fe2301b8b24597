"""Fuzzing: random op programs must never kill the interpreter.

Each example runs ``tests/fuzz_driver.py`` in a child process with a seed from
hypothesis. The child makes a few hundred random calls -- ops on tensors of
random types (quantized included), shapes (0 and 1 included), views, permutes
and transposes, with parameters that are negative, zero, huge or NaN -- and
computes random graphs of the results. It logs each call before making it, so
when ggml aborts or the process crashes the test names the call that did it,
and the log replays the whole program (``python tests/fuzz_driver.py --replay LOG``).
Every exception the child sees must be a ``GGMLError`` naming the op (or a
Cython argument-conversion ``TypeError`` / ``OverflowError``); any other is
reported as a failure too.

Knobs (environment):

``GGMLPY_FUZZ_CASES``  programs (hypothesis examples), default 50
``GGMLPY_FUZZ_CALLS``  calls per program, default 300
``GGMLPY_FUZZ_SEED``   run this one seed only (to reproduce a failure)
``GGMLPY_FUZZ_AVOID``  driver features to leave out while a known bug is open
                       (``lifetime``, ``type:Q8_1``, ``index-compute``; see the driver)
``GGMLPY_FUZZ_RANDOM`` 1: fresh random seeds each run (default: the same seeds every run)

The crashes the fuzzer found are also pinned below as deterministic
regression cases (``test_crash_regression``), each a minimal program run in a
child process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

DRIVER = Path(__file__).resolve().parents[1] / "fuzz_driver.py"
CASES = int(os.environ.get("GGMLPY_FUZZ_CASES", "50"))
CALLS = int(os.environ.get("GGMLPY_FUZZ_CALLS", "300"))
AVOID = os.environ.get("GGMLPY_FUZZ_AVOID", "")
SEED = os.environ.get("GGMLPY_FUZZ_SEED")
RANDOM = os.environ.get("GGMLPY_FUZZ_RANDOM", "0") not in ("", "0")
TIMEOUT = 120 + CALLS // 2     # seconds per program
# Driver features that reach the crashes pinned in test_crash_regression below.
HARNESS_AVOID = "messages,lifetime,type:Q8_1,type:Q8_K,col-views,empty,huge,op:scale,op:scale_bias,op:view"


class FuzzFailure(AssertionError):
    """A fuzz program crashed, hung, or saw an exception that breaks the promise."""


def _describe_rc(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit code {rc}"


def run_program(seed: int, log_dir: Path, calls: int = CALLS, avoid: str = AVOID) -> dict:
    """Run one fuzz program in a child; fail the test on a crash or a recorded failure."""
    log = log_dir / f"fuzz-{seed}.log"
    cmd = [sys.executable, "-X", "faulthandler", str(DRIVER), "--seed", str(seed), "--calls", str(calls),
           "--log", str(log)]
    if avoid:
        cmd += ["--avoid", avoid]
    rerun = (f"GGMLPY_FUZZ_SEED={seed} GGMLPY_FUZZ_CALLS={calls}"
             f"{' GGMLPY_FUZZ_AVOID=' + avoid if avoid else ''} pytest tests/fuzz/{Path(__file__).name}")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired as e:
        lines = log.read_text().splitlines() if log.exists() else []
        raise FuzzFailure(f"fuzz program seed={seed} hung for {TIMEOUT}s in the call:\n    "
                          f"{lines[-1] if lines else '?'}\nlog: {log}\nrerun: {rerun}\n"
                          f"stderr:\n{(e.stderr or b'')[-2000:]!r}") from None
    if proc.returncode != 0:
        lines = log.read_text().splitlines() if log.exists() else []
        last = lines[-1] if lines else "(no call logged)"
        context = "\n".join(f"    {ln}" for ln in lines[-16:-1])
        raise FuzzFailure(
            f"fuzz program seed={seed} {_describe_rc(proc.returncode)} in the call:\n    {last}\n"
            f"preceding calls:\n{context}\n"
            f"stderr (tail):\n{proc.stderr[-2500:]}\n"
            f"full program: {log} (replay: python {DRIVER} --replay {log})\nrerun: {rerun}")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    if summary["failures"]:
        lines = [f"  call {f['call']}: {f['stmt']}\n      {f['error']}" for f in summary["failures"][:20]]
        raise FuzzFailure(f"fuzz program seed={seed}: {len(summary['failures'])} calls raised a bad exception:\n"
                          + "\n".join(lines) + f"\nfull program: {log}\nrerun: {rerun}")
    return summary


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


@pytest.mark.fuzz
def test_fuzz_random_programs(fuzz_dir):
    totals = {"programs": 0, "calls": 0, "raised": 0, "computes": 0, "compute_ok": 0}
    aliases: dict[str, int] = {}

    def one(seed):
        s = run_program(seed, fuzz_dir)
        totals["programs"] += 1
        for k in ("calls", "raised", "computes", "compute_ok"):
            totals[k] += s[k]
        for k, v in s["alias_notes"].items():
            aliases[k] = aliases.get(k, 0) + v

    t0 = time.monotonic()
    if SEED is not None:
        one(int(SEED))
    else:
        @settings(max_examples=CASES, deadline=None, derandomize=not RANDOM, database=None,
                  phases=(Phase.explicit, Phase.generate),     # a seed has nothing to shrink
                  suppress_health_check=list(HealthCheck))
        @given(seed=st.integers(0, 2**32 - 1))
        def check(seed):
            one(seed)

        check()
    dt = time.monotonic() - t0
    print(f"\nfuzz: {totals['programs']} programs, {totals['calls']} calls ({totals['raised']} raised), "
          f"{totals['computes']} graph computes ({totals['compute_ok']} ran) in {dt:.1f}s; "
          f"messages naming the delegated op: {aliases}")
    assert totals["programs"] >= 1


@pytest.mark.fuzz
def test_fuzz_driver_reports_a_crash(tmp_path):
    # The harness itself: a program that aborts is reported with its last call.
    log = tmp_path / "crash.log"
    code = ("import os, sys; log = open(sys.argv[1], 'w', buffering=1); "
            "log.write('t1 = ctx0.first()\\n'); log.write('t2 = ctx0.fatal()\\n'); os.abort()")
    proc = subprocess.run([sys.executable, "-c", code, str(log)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGABRT
    assert log.read_text().splitlines()[-1] == "t2 = ctx0.fatal()"
    assert _describe_rc(proc.returncode) == "killed by SIGABRT"


@pytest.mark.fuzz
def test_fuzz_driver_replay(tmp_path):
    # A logged program replays: the log is plain Python, one call a line.
    # (leaves out what crashes today: this checks the harness, not the binding)
    s = run_program(7, tmp_path, calls=60, avoid=HARNESS_AVOID)
    assert s["calls"] >= 60
    proc = subprocess.run([sys.executable, str(DRIVER), "--replay", str(tmp_path / "fuzz-7.log")],
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "[0] ctx0 = G.Context" in proc.stdout


# -- crashes found by the fuzzer, reduced -------------------------------------------------------------

PRELUDE = """
import numpy as np, ggmlpy as G
from ggmlpy import Type
ctx = G.Context(1 << 22)

def run(*ts):
    gf = ctx.new_graph(64)
    for t in ts:
        gf.build_forward_expand(t)
    gf.compute(1)

def ok_or_error(op, fn):
    # Either works, or raises a GGMLError naming op (one of "a|b"); never kills the process.
    try:
        fn()
    except G.GGMLError as e:
        assert any(o in str(e) for o in op.split("|")), f"{type(e).__name__} does not name {op!r}: {e}"
        print("raised:", e)
"""

# Each: (id, op the error must name, body). The body ends in ok_or_error(...).
REGRESSIONS = [
    # A tensor whose input lives in a freed context: build_forward_expand walks
    # the freed tensor structs (SIGSEGV). Expected: ClosedError.
    ("expand-over-freed-input", "build_forward_expand", """
        other = G.Context(64 << 20)                   # large: freed memory is unmapped
        a = other.from_numpy(np.ones(4, np.float32))
        b = ctx.relu(a)
        other.free()
        gf = ctx.new_graph(8)
        ok_or_error("build_forward_expand", lambda: gf.build_forward_expand(b))
    """),
    # reset() of an input's context: the struct is reused by a new tensor and
    # the graph computes from it (abort in the unary kernel). Expected: ClosedError.
    ("compute-over-reset-input", "build_forward_expand|graph_compute", """
        other = G.Context(1 << 20)
        a = other.from_numpy(np.ones(64, np.float32))
        b = ctx.sgn(a)
        other.reset()
        other.new_tensor(Type.Q4_0, (32, 2))          # takes a's place in the arena
        ok_or_error("build_forward_expand|graph_compute", lambda: run(b))
    """),
    ("view-of-view-over-freed-context", "view", """
        other = G.Context(64 << 20)
        x = other.new_tensor(Type.F32, (16,))
        v = ctx.view(x, (4,))                         # v lives in ctx, its view_src in other
        other.free()
        ok_or_error("view", lambda: ctx.view(v, (2,)))
    """),
    ("src-of-tensor-over-freed-context", "src", """
        other = G.Context(64 << 20)
        a = other.from_numpy(np.ones(4, np.float32))
        b = ctx.relu(a)
        other.free()
        ok_or_error("src", lambda: [repr(s) for s in b.src])
    """),
    # Q8_1 / Q8_K are intermediate types with no quantizer of their own.
    ("set-q8_1", "set", """
        t = ctx.new_tensor(Type.Q8_1, (32,))
        ok_or_error("set", lambda: t.set(np.ones(32, np.float32)))
    """),
    ("set-q8_K", "set", """
        t = ctx.new_tensor(Type.Q8_K, (256,))
        ok_or_error("set", lambda: t.set(np.ones(256, np.float32)))
    """),
    ("from_numpy-q8_K", "from_numpy|set", """
        ok_or_error("from_numpy|set", lambda: ctx.from_numpy(np.ones(256, np.float32), type=Type.Q8_K))
    """),
    ("quantize-q8_1", "quantize", """
        ok_or_error("quantize", lambda: G.quantize(np.ones(32, np.float32), Type.Q8_1))
    """),
    ("set-transposed-iq2_s", "set", """
        q = ctx.new_tensor(Type.IQ2_S, (256, 2))
        ok_or_error("set", lambda: ctx.transpose(q).set(np.zeros((256, 2), np.float32)))
    """),
    # ne[0] == 1 views with nb[0] != element size pass ggml_is_contiguous(_rows),
    # but the kernels and some builders assert nb[0] == element size.
    ("cos-of-transposed-column", "cos", """
        t = ctx.transpose(ctx.from_numpy(np.arange(4, dtype=np.float32)))   # ne (1, 4), nb[0] = 16
        ok_or_error("cos", lambda: run(ctx.cos(t)))
    """),
    ("add-of-transposed-column", "add", """
        t = ctx.transpose(ctx.from_numpy(np.arange(4, dtype=np.float32)))
        ok_or_error("add", lambda: run(ctx.add(t, t)))
    """),
    ("rms_norm-of-transposed-column", "rms_norm", """
        t = ctx.transpose(ctx.from_numpy(np.arange(4, dtype=np.float32)))
        ok_or_error("rms_norm", lambda: run(ctx.rms_norm(t)))
    """),
    ("group_norm-of-transposed-column", "group_norm", """
        t = ctx.transpose(ctx.from_numpy(np.arange(8, dtype=np.float32)))
        ok_or_error("group_norm", lambda: run(ctx.group_norm(t, 4)))
    """),
    ("scale-of-transposed-unit-dim", "scale", """
        t = ctx.transpose(ctx.new_tensor(Type.F32, (1, 2, 3)))              # ne (2, 1, 3), nb (4, 4, 8)
        ok_or_error("scale", lambda: run(ctx.scale(t, 2.0)))
    """),
    ("scale-of-transposed-column", "scale", """
        t = ctx.transpose(ctx.from_numpy(np.arange(4, dtype=np.float32)))
        ok_or_error("scale", lambda: run(ctx.scale(t, 2.0)))
    """),
    ("roll-of-permuted", "roll", """
        p = ctx.permute(ctx.new_tensor(Type.F32, (3, 7, 2, 1)), 1, 3, 2, 0)  # ne (1, 3, 2, 7)
        ok_or_error("roll", lambda: run(ctx.roll(p, 0, 2, 1, 0)))
    """),
    ("diag_mask_inf-of-transposed-column", "diag_mask_inf", """
        t = ctx.transpose(ctx.from_numpy(np.arange(4, dtype=np.float32)))   # "contiguous" for ggml
        ok_or_error("diag_mask_inf", lambda: run(ctx.diag_mask_inf(t, 0)))
    """),
    ("round-of-empty-transposed", "round", """
        t = ctx.transpose(ctx.new_tensor(Type.F32, (2, 0)))                  # ne (0, 2), nb[0] = 8
        ok_or_error("round", lambda: run(ctx.round(t)))
    """),
    # ggml sizes a view as row_size(ne0) * ne1 * ne2 * ne3 whatever the strides.
    ("view-zero-stride-dense-size", "view", """
        a = ctx.new_tensor(Type.F32, (8,))
        ok_or_error("view", lambda: ctx.view(a, (1, 1, 32), (4, 0), 0))
    """),
    ("conv_2d-zero-width-kernel", "conv_2d", """
        k = ctx.new_tensor(Type.F32, (0, 1, 1, 1))
        ok_or_error("conv_2d", lambda: run(ctx.conv_2d(k, ctx.new_tensor(Type.F32, (4, 4)))))
    """),
    ("conv_1d-zero-width-kernel", "conv_1d", """
        k = ctx.new_tensor(Type.F32, (0, 1, 1))
        ok_or_error("conv_1d", lambda: run(ctx.conv_1d(k, ctx.new_tensor(Type.F32, (4, 1)))))
    """),
    ("interpolate-of-empty", "interpolate", """
        a = ctx.new_tensor(Type.F32, (0, 1))
        ok_or_error("interpolate", lambda: run(ctx.interpolate(a, 5, 33, 3, 2, 1)))
    """),
    # shape/numpy() treat a zero dimension past n_dims as 1: a view of memory the
    # tensor does not have (here 4 GiB past a 0-byte tensor).
    ("numpy-of-zero-dim-tensor", "numpy", """
        t = ctx.new_tensor(Type.F32, (2**20, 1024, 0))
        ok_or_error("numpy", lambda: float(t.numpy().sum()))
    """),
    # Byte / element counts that wrap around 2**64 pass the room checks.
    ("new_tensor-size-wraps", "new_tensor", """
        ok_or_error("new_tensor", lambda: run(ctx.relu(ctx.new_tensor(Type.F32, (2**62, 4)))))
    """),
    ("interpolate-size-wraps", "interpolate", """
        a = ctx.from_numpy(np.ones(1, np.float32))
        ok_or_error("interpolate", lambda: run(ctx.interpolate(a, 2**62, 4, 1, 6, 0)))
    """),
    ("repeat_4d-size-overflows", "repeat_4d", """
        a = ctx.from_numpy(np.ones(1, np.float32))
        ok_or_error("repeat_4d", lambda: run(ctx.repeat_4d(a, 16, 2, 3, 2**63 - 1)))
    """),
    # NaN/inf into an i-quant: ggml's grid search aborts ("not on grid"). Expected: GGMLValueError.
    ("iquant-non-finite", "set|quantize", """
        x = np.resize(np.array([np.nan, np.inf, 1.0], np.float32), (2, 256))
        t = ctx.new_tensor(Type.IQ3_XXS, (256, 2))
        ok_or_error("set", lambda: t.set(x))
        ok_or_error("quantize", lambda: G.quantize(x, Type.IQ3_XXS))
    """),
]


@pytest.mark.fuzz
@pytest.mark.parametrize("name, op, body", REGRESSIONS, ids=[r[0] for r in REGRESSIONS])
def test_crash_regression(name, op, body):
    code = PRELUDE + textwrap.dedent(body) + "\nprint('CHILD-OK')\n"
    proc = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "CHILD-OK" in proc.stdout, (
        f"{name}: child {_describe_rc(proc.returncode)}\n--- program\n{textwrap.dedent(body)}\n"
        f"--- stdout\n{proc.stdout[-1500:]}\n--- stderr\n{proc.stderr[-2500:]}")
