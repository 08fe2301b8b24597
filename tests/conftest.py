"""Shared pytest setup: marker groups, hypothesis profiles, and a leak check."""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# The tests mirror src/ggmlpy in folders (core/, kvcache/, models/, ...); the helpers they share stay here
# at tests/. There is no __init__.py: pytest imports each test file as a top-level module named after its
# file (so test file names are unique across folders) and puts this folder on sys.path for this
# conftest, which is how ``import helpers`` works. Some tests import another test module by name
# (``from test_core_backend import rpc_server``, device/test_device.py runs models/test_arch_rpc.py's
# sessions): every test folder goes on sys.path here too, so such an import works the same whether one
# file, one folder or the whole suite runs.
_TESTS = Path(__file__).resolve().parent
for _folder in sorted(p for p in _TESTS.iterdir() if p.is_dir() and any(p.glob("test_*.py"))):
    if str(_folder) not in sys.path:
        sys.path.append(str(_folder))


def _fixed_malloc_trim_threshold() -> None:
    """glibc raises its trim threshold (up to 64 MiB) after a large block is freed, and malloc_trim
    never trims the top of a thread's arena: memory a thread (the runner's compute worker) freed then
    stays resident, and an RSS check sees up to 16 MiB that no object holds (measured: a failed
    Runner's freed cache planning, 4 runs in 12). A fixed threshold turns the adjustment off, so
    ``helpers.rss_growth`` sees what live objects hold. Set once, before the tests allocate."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").mallopt(-1, 128 * 1024)   # M_TRIM_THRESHOLD: glibc's default, fixed
    except (OSError, AttributeError):
        pass


_fixed_malloc_trim_threshold()

# Every own kernel wherever it runs (the graphs the tests check must not depend on this machine's
# timings, nor write its kernels.json); tests/models/test_kernel_choice.py tests the measured choice, and
# subprocesses (the CLI's tests) inherit the setting.
os.environ.setdefault("GGMLPY_KERNELS", "own")

settings.register_profile("dev", max_examples=50, deadline=None)
settings.register_profile("ci", max_examples=200, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "dev"))

# Groups that need something this machine may not have run only when asked:
# --run-<group> or GGMLPY_TEST_<GROUP>=1. fuzz, slow and hf run by default (hf
# tests skip when torch/transformers are missing, except under CI=true, where
# they must run: .ci/run installs them). wheel tests build ggml from scratch (the portable
# wheel's CPU variants take most of an hour on two cores): also opt-in.
OPT_IN = ("gpu", "wheel")


def pytest_addoption(parser):
    for group in OPT_IN + ("slow", "fuzz", "hf"):
        parser.addoption(f"--run-{group}", action="store_true", help=f"run tests marked {group}")
    parser.addoption("--skip-fuzz", action="store_true", help="skip the fuzz tests")


def _enabled(config, group: str) -> bool:
    env = os.environ.get(f"GGMLPY_TEST_{group.upper()}")
    if env is not None:
        return env not in ("", "0")
    if group == "fuzz" and config.getoption("--skip-fuzz"):
        return False
    return group not in OPT_IN or config.getoption(f"--run-{group}")


def pytest_collection_modifyitems(config, items):
    for item in items:
        for group in OPT_IN + ("slow", "fuzz", "hf"):
            if group in item.keywords and not _enabled(config, group):
                item.add_marker(pytest.mark.skip(reason=f"{group} tests are off (GGMLPY_TEST_{group.upper()}=1)"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, f"rep_{rep.when}", rep)


_LAST_FAILED = False


@pytest.fixture(autouse=True)
def _no_leaked_handles(request):
    """Every Context and Graph a test creates is freed once it is unreachable."""
    from ggmlpy import _core

    global _LAST_FAILED
    if _LAST_FAILED:
        # the last failure's traceback (sys.last_traceback) held objects that may be freed during this
        # test: count from a clean slate
        gc.collect()
    before = _core._live_objects()
    yield
    rep = getattr(request.node, "rep_call", None)
    _LAST_FAILED = rep is None or not rep.passed
    if _LAST_FAILED:
        return  # a failing test's traceback keeps its objects alive; report the failure only
    after = _core._live_objects()
    if after != before:
        gc.collect()  # only when needed: a full collection per test would dominate the run time
        after = _core._live_objects()
    assert after == before, f"live C handles changed: {before} -> {after}"
