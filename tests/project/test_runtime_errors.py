"""Errors of the Python runtime layers: every exception class derives from GGMLError, error paths raise GGMLError
subclasses (never a bare ValueError/TypeError), the command line reports one clear line and exit code 1, and the
progress bar / memory table say what they show."""

from __future__ import annotations

import importlib
import inspect
import io
import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import free_port

import ggmlpy
from ggmlpy import GGMLError, GGMLTypeError, GGMLValueError

RUNTIME_MODULES = ["ggmlpy.runner", "ggmlpy.runner.slots", "ggmlpy.sampling", "ggmlpy.kvcache", "ggmlpy.backend",
                   "ggmlpy.weights",
                   "ggmlpy.benchmark", "ggmlpy.models", "ggmlpy.cli"]


@pytest.mark.parametrize("name", RUNTIME_MODULES)
def test_every_exception_class_of_the_runtime_derives_from_ggml_error(name):
    mod = importlib.import_module(name)
    # a package's classes live in its submodules and are re-exported
    found = [obj for _, obj in inspect.getmembers(mod, inspect.isclass)
             if issubclass(obj, BaseException) and (obj.__module__ == name or obj.__module__.startswith(name + "."))]
    assert found or name in ("ggmlpy.cli", "ggmlpy.sampling", "ggmlpy.backend"), f"{name}: no exception class seen"
    bad = [c.__name__ for c in found if not issubclass(c, GGMLError)]
    assert not bad, f"{name}: {bad} do not derive from ggmlpy.GGMLError"


def test_runtime_exceptions_keep_their_builtin_base():
    from ggmlpy.benchmark import BenchError, PeerUnavailable
    from ggmlpy.kvcache import CacheStateError, KVCacheFull, NotSupported
    from ggmlpy.runner import RunnerError
    from ggmlpy.runner.slots import InputTooLong, NoFreeSlot, SlotIndexError

    expected = {NotSupported: RuntimeError, KVCacheFull: RuntimeError, CacheStateError: RuntimeError,
                RunnerError: RuntimeError, NoFreeSlot: RuntimeError, InputTooLong: ValueError,
                SlotIndexError: IndexError, BenchError: ValueError, PeerUnavailable: ValueError}
    for cls, base in expected.items():
        assert issubclass(cls, GGMLError) and issubclass(cls, base), cls


def _cases():
    from ggmlpy.kvcache import Causal, Cells
    from ggmlpy.runner.slots import SlotTable, shift_discard, truncate_indices
    from ggmlpy.sampling import Sampler, SamplingParams, logprobs

    cells = Cells(8, 2)
    return [
        ("Cells(0, 1)", lambda: Cells(0, 1), GGMLValueError),
        ("Cells seq of a wrong type", lambda: cells.seq_pos_max("0"), GGMLTypeError),
        ("Cells seq out of range", lambda: cells.seq_pos_max(5), GGMLValueError),
        ("Cells.mask 2-D positions", lambda: cells.mask(np.zeros((2, 2), np.int64), [0, 0]), GGMLValueError),
        ("Causal bad sizes", lambda: Causal(0, 8, 8), GGMLValueError),
        ("Causal shift_fn not callable", lambda: Causal(1, 8, 8, shift_fn=3), GGMLTypeError),
        ("Causal not initialised", lambda: Causal(1, 8, 8).start_forward([0], [0]), GGMLError),
        ("SamplingParams temperature", lambda: SamplingParams(temperature=-1), GGMLValueError),
        ("SamplingParams top_p", lambda: SamplingParams(top_p=0), GGMLValueError),
        ("Sampler params type", lambda: Sampler({"temperature": 1}), GGMLTypeError),
        ("Sampler NaN logits", lambda: Sampler(SamplingParams(temperature=0)).sample(np.full(4, np.nan, np.float32)),
         GGMLValueError),
        ("logprobs token out of range", lambda: logprobs(np.zeros(4, np.float32), 9, 0), GGMLValueError),
        ("SlotTable(0)", lambda: SlotTable(0), GGMLValueError),
        ("SlotTable index", lambda: SlotTable(2)[5], IndexError),
        ("shift_discard n_ctx", lambda: shift_discard(4, 0, 0), GGMLValueError),
        ("truncate_indices too long", lambda: truncate_indices(10, 4, 0, truncate=False), GGMLValueError),
    ]


@pytest.mark.parametrize("what,call,exc", _cases(), ids=[c[0] for c in _cases()])
def test_runtime_error_paths_raise_ggml_errors(what, call, exc):
    with pytest.raises(exc) as ei:
        call()
    assert isinstance(ei.value, GGMLError), f"{what}: {type(ei.value).__mro__}"


def test_no_bare_builtin_raise_left_in_the_runtime_modules():
    """Source check: the runtime modules raise only ggmlpy's classes (a bare ValueError would escape an
    ``except ggmlpy.GGMLError``)."""
    import re

    root = os.path.realpath(os.path.dirname(ggmlpy.__file__))
    files = []
    for name in ("runner", "sequences", "sampling", "kvcache", "backend", "models"):
        path = os.path.join(root, name)
        if os.path.isdir(path):           # a package: every module of it
            files += [os.path.join(path, f) for f in sorted(os.listdir(path)) if f.endswith(".py")]
        else:
            files.append(path + ".py")
    assert len(files) >= 8
    for path in files:
        src = open(path).read()
        hits = re.findall(r"raise (ValueError|TypeError|RuntimeError|IndexError|KeyError|Exception)\(", src)
        assert not hits, f"{path} raises {hits}"


# --------------------------------------------------------------------------- command line


def _ggmlpy(*args, env=None, timeout=120):
    e = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "ggmlpy.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=e)


@pytest.mark.parametrize("argv,needle,code", [
    (["bench", "-rpc", "127.0.0.1:{port}", "--synthetic", "tiny", "-p", "8", "-n", "0"], "127.0.0.1:{port}", 1),
    (["bench", "-m", "/nonexistent/model.gguf", "-p", "8", "-n", "0"], "/nonexistent/model.gguf", 1),
    # usage errors: exit status 2, as in every ggmlpy command (ggmlpy._cliargs)
    (["bench", "-p", "nonsense"], "nonsense", 2),
    (["bench", "--no-such-option"], "no-such-option", 2),
])
def test_cli_errors_are_one_line_and_exit_1(argv, needle, code):
    port = free_port()             # nothing listens there
    argv = [a.format(port=port) for a in argv]
    r = _ggmlpy(*argv)
    assert r.returncode == code, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert "Traceback" not in r.stderr
    assert len(lines) == 1 and "error" in lines[0] and needle.format(port=port) in lines[0], r.stderr
    # the traceback is there for whoever asks
    dbg = _ggmlpy(*argv, env={"GGMLPY_DEBUG": "1"})
    assert dbg.returncode == code
    if argv[1] in ("-rpc", "-m"):
        assert "Traceback" in dbg.stderr


# --------------------------------------------------------------------------- progress bar, memory table

def test_progress_bar_prints_the_final_line_once():
    """The model loader reports the last chunk and then the tensor's end: both are (total, total)."""
    from ggmlpy.backend import ProgressBar

    out = io.StringIO()
    bar = ProgressBar("loading", width=10, stream=out)
    total = 100 << 20
    for done in list(range(0, total, 7 << 20)) + [total, total, total]:
        bar(done, total)
    lines = out.getvalue().splitlines()
    assert sum("100%" in ln for ln in lines) == 1
    assert len(lines) == len(set(lines))               # no line twice
    assert lines[-1].endswith("100.0/100.0 MiB")
    bar(0, total)                                      # a second run with the same bar starts again
    bar(total, total)
    assert out.getvalue().splitlines()[-1].startswith("loading [##########] 100%")


def test_progress_bar_counts_parameters_as_parameters():
    from ggmlpy.backend import ProgressBar

    out = io.StringIO()
    bar = ProgressBar("writing 15M F16", width=10, stream=out, unit="params")
    bar(0, 24_500_000)
    bar(24_500_000, 24_500_000)
    text = out.getvalue()
    assert "MiB" not in text and "24.5/24.5 M params" in text


def test_progress_bar_shows_100_only_when_done():
    from ggmlpy.backend import ProgressBar

    out = io.StringIO()
    bar = ProgressBar("x", width=10, stream=out)
    bar(999, 1000)                                     # 99.9% rounds to "100%" in a 3-digit field
    assert "100%" not in out.getvalue() and " 99%" in out.getvalue()


def test_benchmark_writes_synthetic_model_progress_in_parameters(tmp_path):
    from ggmlpy import benchmark as bm

    err = io.StringIO()
    p = bm.parse_args(["--synthetic", "tiny", "--type", "F16", "-p", "8", "-n", "0"])
    p.cache_dir = str(tmp_path)
    bm._synthetic_models(p, err)
    text = err.getvalue()
    assert "M params" in text and "MiB" not in text and text.count("100%") == 1


def test_memory_table_explains_a_negative_unaccounted():
    from ggmlpy.backend import DeviceMemory, MemoryReport

    rep = MemoryReport(1)
    rep.devices["CPU"] = DeviceMemory("CPU", "test cpu", 1, weights={0: 3 << 20}, cache={0: 5 << 20}, graph=1 << 20,
                                      free=95 << 20, total=100 << 20)
    m = rep.devices["CPU"]
    assert m.unaccounted == -(4 << 20)
    text = str(rep)
    assert "-4.00 *" in text and "unaccounted < 0" in text and "first written" in text
    rep.devices["CPU"].free = 80 << 20                 # positive: no note
    assert "unaccounted < 0" not in str(rep)
    assert "negative" in DeviceMemory.unaccounted.__doc__.lower()
