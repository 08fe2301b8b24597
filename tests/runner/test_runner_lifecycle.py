"""Runner lifetimes across threads: close() racing direct calls and submit(), errors inside the loop, leaks
measured by RSS, host memory sized before anything is allocated, max_tokens -1 / -2.

Every wait has a timeout: a hang (a request that never ends, a thread that never stops) fails the test
instead of blocking the run. Crash-prone races run in child processes.
"""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest
from helpers import rss_growth, run_child
from hypothesis import given, settings
from hypothesis import strategies as st

import ggmlpy
from ggmlpy.models import load_model
from ggmlpy.models.synthetic import write_synthetic
from ggmlpy.runner import DoneReason, Runner, RunnerError

HANG = 60          # seconds before a wait counts as a hang


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_synthetic(tmp_path_factory.mktemp("lc") / "tiny.gguf", "tiny", "F16", seed=3)


@pytest.fixture(scope="module")
def model(tiny_path):
    m = load_model(tiny_path, devices="cpu")
    yield m
    m.close()


def _runner_threads():
    return [t for t in threading.enumerate() if t.name in ("ggmlpy-runner", "ggmlpy-compute")]


def _assert_all_ended(handles):
    """Every handle is done: a Completion with a done reason, or a RunnerError."""
    for h in handles:
        assert h.done, "an accepted request did not finish"
        try:
            r = h.result(timeout=0)
        except RunnerError:
            continue
        assert r.done_reason in (DoneReason.CANCEL, DoneReason.LENGTH, DoneReason.STOP)


# --------------------------------------------------------------------------- close() vs direct calls

CLOSE_VS_DIRECT = r"""
import random, sys, threading, time
import numpy as np
import ggmlpy
from ggmlpy.models import load_model
from ggmlpy.runner import Runner

m = load_model(sys.argv[1], devices="cpu")
rounds = int(sys.argv[2])
rng = random.Random(7)
outcomes = {"closed": 0, "finished": 0}
for i in range(rounds):
    rt = Runner(m, n_ctx=512, n_batch=64, n_ubatch=64, n_seq_max=2, pipeline=bool(i % 2))
    kind = ("decode", "decode_batch", "generate", "embed", "clear")[i % 5]
    errors = []
    started = threading.Event()

    def work():
        try:
            for _ in range(1000):
                started.set()
                if kind == "decode":
                    rt.decode(list(range(1, 40)), seq=0)
                    rt.clear(0)
                elif kind == "decode_batch":
                    rt.decode_batch([5] * 48, list(range(24)) * 2, [0] * 24 + [1] * 24, [23, 47])
                    rt.clear()
                elif kind == "generate":
                    rt.generate(list(range(1, 30)), max_tokens=8, temperature=0)
                elif kind == "embed":
                    rt.embed(list(range(1, 60)))
                else:
                    rt.decode([1, 2, 3], seq=1)
                    rt.clear()
        except ggmlpy.ClosedError:
            outcomes["closed"] += 1
            return
        except BaseException as e:
            errors.append(e)
            return
        outcomes["finished"] += 1

    t = threading.Thread(target=work)
    t.start()
    started.wait(30)
    time.sleep(rng.random() * 0.02)
    rt.close()
    t.join(60)
    assert not t.is_alive(), f"round {i} ({kind}): the worker thread hangs after close()"
    assert not errors, f"round {i} ({kind}): {errors[0]!r}"
    for call in (lambda: rt.decode([1]), lambda: rt.submit([1]), lambda: rt.clear(), lambda: rt.seq_len(0)):
        try:
            call()
        except ggmlpy.ClosedError:
            pass
        else:
            raise AssertionError(f"round {i}: a call after close() did not raise ClosedError")
print("OK", outcomes)
"""


def test_close_while_another_thread_decodes_does_not_crash(tiny_path):
    """close() from the main thread while a worker thread is inside decode / decode_batch / generate / embed /
    clear: close waits for the call, the worker's next call raises ClosedError, nothing crashes (60 rounds,
    random timing, in a child process: on the old code most rounds died with SIGSEGV)."""
    r = run_child(CLOSE_VS_DIRECT, tiny_path, 60, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "OK" in r.stdout
    closed = eval(r.stdout.split("OK", 1)[1])      # noqa: S307 - our own child's dict
    assert closed["closed"] == 60                 # every worker was stopped by close(), none ran out of loops


def test_calls_after_close_raise_closed_error(model):
    rt = Runner(model, n_ctx=64)
    assert rt.generate([1, 2, 3], max_tokens=2, temperature=0).done_reason == DoneReason.LENGTH
    rt.close()
    rt.close()                                    # twice is fine
    assert rt.closed
    for call in (lambda: rt.decode([1]), lambda: rt.decode_batch([1], [0], [0], [0]),
                 lambda: rt.submit([1, 2]), lambda: rt.generate([1]), lambda: rt.embed([1]),
                 lambda: rt.clear(), lambda: rt.seq_len(0)):
        with pytest.raises(ggmlpy.ClosedError, match="closed"):
            call()
    assert not _runner_threads()


# --------------------------------------------------------------------------- submit() vs close()

@pytest.mark.parametrize("pipeline", [False, True])
def test_submit_racing_close_every_request_ends(model, pipeline):
    """Threads submit while the main thread closes: after close() returns every accepted handle is done
    (cancel / length, or an error), submit raises ClosedError and no runner thread is alive (30 rounds)."""
    rng = random.Random(11)
    for rnd in range(30):
        rt = Runner(model, n_ctx=64, n_batch=16, n_seq_max=2, pipeline=pipeline)
        accepted, outcome = [], {}
        go = threading.Event()

        def submitter(k, rt=rt, accepted=accepted, outcome=outcome, go=go):
            go.wait()
            for j in range(200):
                try:
                    accepted.append(rt.submit([1 + (k + j) % 100, 2, 3], max_tokens=1 + j % 6, temperature=0))
                except ggmlpy.ClosedError:
                    outcome[k] = "refused"
                    return
                except BaseException as e:        # reported below: the test fails with it
                    outcome[k] = e
                    return
            outcome[k] = "all"

        threads = [threading.Thread(target=submitter, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        go.set()
        time.sleep(rng.random() * 0.03)
        rt.close()
        for t in threads:
            t.join(HANG)
            assert not t.is_alive()
        assert sorted(outcome) == [0, 1, 2] and set(outcome.values()) <= {"refused", "all"}, outcome
        _assert_all_ended(accepted)
        with pytest.raises(ggmlpy.ClosedError):
            rt.submit([1])
        assert not _runner_threads(), f"round {rnd}: a runner thread is alive after close()"


@settings(max_examples=25, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["submit", "cancel", "sleep", "long"]), st.integers(0, 50)),
                    min_size=1, max_size=30),
       close_at=st.integers(0, 30), pipeline=st.booleans(), n_seq=st.integers(1, 3))
def test_random_interleavings_of_submit_cancel_close(model, ops, close_at, pipeline, n_seq):
    """Random programs of submit / cancel / sleep run by two threads while a third closes the runner after
    ``close_at`` operations: whatever the interleaving, every accepted request ends and no thread survives."""
    rt = Runner(model, n_ctx=32, n_batch=8, n_seq_max=n_seq, pipeline=pipeline)
    handles, lock = [], threading.Lock()
    done_ops = [0]
    step = threading.Condition()

    def program(part):
        for op, arg in part:
            try:
                if op == "submit":
                    h = rt.submit([1 + arg, 2 + arg], max_tokens=1 + arg % 5, temperature=0)
                    with lock:
                        handles.append(h)
                elif op == "long":
                    # ends only by cancel/close
                    h = rt.submit(list(range(1, 2 + arg % 20)), max_tokens=-1, temperature=0)
                    with lock:
                        handles.append(h)
                elif op == "cancel":
                    with lock:
                        if handles:
                            handles[arg % len(handles)].cancel()
                else:
                    time.sleep(arg / 20000)
            except ggmlpy.ClosedError:
                pass
            with step:
                done_ops[0] += 1
                step.notify_all()

    threads = [threading.Thread(target=program, args=(ops[k::2],)) for k in range(2)]
    for t in threads:
        t.start()
    with step:
        step.wait_for(lambda: done_ops[0] >= min(close_at, len(ops)), timeout=HANG)
    rt.close()
    for t in threads:
        t.join(HANG)
        assert not t.is_alive()
    _assert_all_ended(handles)
    assert not _runner_threads()


# --------------------------------------------------------------------------- errors inside the loop

@pytest.mark.parametrize("pipeline", [False, True])
def test_a_failing_compute_ends_its_requests_and_the_runner_goes_on(model, monkeypatch, pipeline):
    rt = Runner(model, n_ctx=64, n_batch=8, n_seq_max=2, pipeline=pipeline)
    try:
        real = Runner._compute
        calls = [0]

        def failing(self, ub):
            calls[0] += 1
            if calls[0] == 3:
                raise ggmlpy.ComputeFailed("injected compute failure")
            return real(self, ub)

        monkeypatch.setattr(Runner, "_compute", failing)
        hs = [rt.submit([1, 2, 3, 4], max_tokens=20, temperature=0),
              rt.submit([5, 6, 7], max_tokens=20, temperature=0)]
        failed = 0
        for h in hs:
            try:
                h.result(timeout=HANG)
            except RunnerError as e:
                assert isinstance(e.__cause__, ggmlpy.ComputeFailed)
                failed += 1
        assert failed >= 1
        monkeypatch.undo()
        assert rt.generate([1, 2, 3], max_tokens=3, temperature=0).done_reason == DoneReason.LENGTH
    finally:
        rt.close()


@pytest.mark.parametrize("where", ["_complete", "_form_batch", "_launch"])
def test_an_error_anywhere_in_the_loop_ends_every_waiting_request(model, monkeypatch, where):
    """A bug in the loop's own bookkeeping (not in one request) ends every request, running and queued, with
    that error instead of leaving their handles blocked forever; the runner then serves new requests."""
    rt = Runner(model, n_ctx=64, n_batch=8, n_seq_max=2, pipeline=True)
    try:
        real = getattr(Runner, where)
        calls, armed = [0], [True]

        def broken(self, *a):
            calls[0] += 1
            if calls[0] >= 2 and armed[0]:
                raise KeyError("injected bug")
            return real(self, *a)

        monkeypatch.setattr(Runner, where, broken)
        hs = [rt.submit([1 + i, 2, 3], max_tokens=10, temperature=0) for i in range(5)]  # 2 slots: 3 queued
        for h in hs:
            with pytest.raises(RunnerError) as ei:
                h.result(timeout=HANG)
            assert isinstance(ei.value.__cause__, KeyError)
        armed[0] = False              # checked at each call: a round already inside broken() goes on normally
        monkeypatch.undo()
        assert rt.generate([1, 2, 3], max_tokens=3, temperature=0).tokens  # serving again
    finally:
        rt.close()
    assert not _runner_threads()


def test_errors_are_ggml_errors(model):
    with Runner(model, n_ctx=16) as rt:
        with pytest.raises(ggmlpy.GGMLError):
            rt.submit([1], max_tokens=-3)
        with pytest.raises(ggmlpy.GGMLError):
            rt.submit(list(range(1, 40)))                 # InputTooLong
    assert issubclass(RunnerError, ggmlpy.GGMLError) and issubclass(RunnerError, RuntimeError)


# --------------------------------------------------------------------------- max_tokens -1 and -2

def test_max_tokens_minus_one_generates_past_the_context_until_cancelled(model):
    """-1: no limit at all; with shifting the request runs past n_ctx (several shifts) until cancelled."""
    with Runner(model, n_ctx=16, n_batch=8) as rt:
        h = rt.submit([1, 2, 3], max_tokens=-1, temperature=0)
        n = 0
        for _ in h:
            n += 1
            if n == 60:
                h.cancel()
        r = h.result(timeout=HANG)
    assert r.done_reason == DoneReason.CANCEL
    assert len(r.tokens) >= 60 and r.n_shifts >= 3


@pytest.mark.parametrize("shift", [True, False])
def test_max_tokens_minus_two_stops_when_the_context_is_full(model, shift):
    """-2: until the context is full, with or without shifting: n_ctx - len(prompt) + 1 tokens (the last one
    sampled from position n_ctx - 1), done reason length, no shift."""
    with Runner(model, n_ctx=16, n_batch=8) as rt:
        r = rt.submit([1, 2, 3], max_tokens=-2, shift=shift, temperature=0).result(timeout=HANG)
        assert r.done_reason == DoneReason.LENGTH and r.n_shifts == 0
        assert len(r.tokens) == 16 - 3 + 1
        with pytest.raises(ggmlpy.GGMLValueError, match="max_tokens"):
            rt.submit([1], max_tokens=-3)


# --------------------------------------------------------------------------- memory: early failure, leaks

def test_a_failed_direct_decode_drops_the_slots_record_with_its_cells(model, monkeypatch):
    """A direct decode whose compute fails clears the sequence's cells, and its token record with them:
    the next request over the same prompt re-processes it (nothing claims a prefix the cache lost)."""
    with Runner(model, n_ctx=64) as rt:
        rt.generate([1, 2, 3, 4], max_tokens=2, temperature=0)
        assert rt.slots[0].tokens[:4] == [1, 2, 3, 4]

        def failing(self, ub):
            raise ggmlpy.ComputeFailed("injected compute failure")

        monkeypatch.setattr(Runner, "_compute", failing)
        with pytest.raises(ggmlpy.ComputeFailed):
            rt.decode([9], seq=0)
        monkeypatch.undo()
        assert rt.seq_len(0) == 0 and rt.slots[0].tokens == []
        assert rt.generate([1, 2, 3, 4], max_tokens=2, temperature=0).n_cached == 0


def test_huge_context_fails_early_with_a_memory_report(model, monkeypatch):
    """n_ctx=2**24: the worst-case mask alone is 512 x 2**24 cells; the start fails before allocating the
    cache, with GGMLMemoryError and the report (the old code ran for seconds, then numpy's bare
    MemoryError)."""
    import ggmlpy.runner.runner as runner_mod

    monkeypatch.setattr(runner_mod, "_available_host_memory", lambda: 8 << 30)
    with pytest.raises(ggmlpy.GGMLMemoryError, match="n_ctx=16777216") as ei:
        Runner(model, n_ctx=2**24)
    assert "attention mask" in str(ei.value) and "available" in str(ei.value)
    rep = ei.value.report
    assert rep is model.report and "memory [MiB]" in str(ei.value)
    # the same runner with a context that fits starts, and estimates what it needs
    with Runner(model, n_ctx=256, n_ubatch=64) as rt:
        kv = 2 * 256 * 2 * 32 * 2                    # layers x cells x (K + V) x n_embd_kv x F16
        assert rt.host_bytes() == 64 * 256 * 2 + 2 * 256 * (4 + 1) + kv   # float16 mask, cells, K/V


def test_huge_context_fails_early_on_this_machine(model):
    """The real host memory figure: 2**26 cells of mask rows cannot fit on any test machine."""
    with pytest.raises(ggmlpy.GGMLMemoryError) as ei:
        Runner(model, n_ctx=2**26, n_ubatch=512)
    assert ei.value.report is not None


def test_runner_open_close_with_a_large_context_gives_memory_back(model):
    """Runner(n_ctx=2**18) holds a 64 MiB cache on the tiny model; 4 open/close cycles: RSS flat (it grew
    64 MiB per cycle while backend buffers were never freed)."""
    def cycle():
        rt = Runner(model, n_ctx=2**18, n_batch=32, n_ubatch=32)
        rt.generate([1, 2, 3], max_tokens=2, temperature=0)
        rt.close()

    assert rss_growth(cycle, loops=4, warmup=1) < 16


def test_failed_runner_start_gives_memory_back(model, monkeypatch):
    """A start that fails after the cache and the scheduler were allocated (the reservation raises) frees
    both: RSS flat over 4 failures with a 64 MiB cache."""
    from ggmlpy.backend import Runtime

    real = Runtime.reserve

    def reserve_then_fail(self, *a, **kw):
        real(self, *a, **kw)
        raise ggmlpy.GGMLMemoryError("injected: compute buffer does not fit", None)

    monkeypatch.setattr(Runtime, "reserve", reserve_then_fail)

    def fail():
        with pytest.raises(ggmlpy.GGMLMemoryError, match="injected"):
            Runner(model, n_ctx=2**18, n_batch=32, n_ubatch=32)

    assert rss_growth(fail, loops=4, warmup=1) < 16
    assert not _runner_threads()


def test_cache_too_large_for_the_device_fails_cleanly_and_gives_memory_back(model, monkeypatch):
    """Host check passed (patched), the device refuses the 256 GiB cache: GGMLMemoryError with the report marking
    the cache allocation failed; nothing stays allocated (RSS flat over 4 failures)."""
    import ggmlpy.runner.runner as runner_mod

    monkeypatch.setattr(runner_mod, "_available_host_memory", lambda: 1 << 50)

    def fail():
        with pytest.raises(ggmlpy.GGMLMemoryError) as ei:
            Runner(model, n_ctx=2**30, n_batch=1, n_ubatch=1)
        assert ei.value.report.devices["CPU"].cache_ok is False

    assert rss_growth(fail, loops=4, warmup=1) < 16
    assert not _runner_threads()


def test_failed_graph_build_during_reservation_frees_everything(model, monkeypatch):
    """The model's build raising in the middle of the reservation (after a first graph was built): the graphs
    built so far, the scheduler and the cache are freed (ggmlpy's live handles and RSS both flat)."""
    from ggmlpy import _core

    real = type(model).build
    calls = [0]

    def build(self, *a, **kw):
        calls[0] += 1
        if calls[0] % 2 == 0:
            raise ggmlpy.GGMLValueError("injected build failure")
        return real(self, *a, **kw)

    monkeypatch.setattr(type(model), "build", build)

    def fail():
        with pytest.raises(ggmlpy.GGMLValueError, match="injected"):
            Runner(model, n_ctx=2**18, n_batch=32, n_ubatch=32)

    live = _core._live_objects()
    assert rss_growth(fail, loops=4, warmup=1) < 16
    assert _core._live_objects() == live


def test_runtime_reserve_and_free_gives_memory_back(model):
    """Runtime (backends + scheduler) with a reservation for a 2**16-cell context, then close(): RSS flat."""
    from ggmlpy.backend import Runtime
    from ggmlpy.kvcache import Causal

    cfg = model.config
    cache = Causal(cfg.n_layer, cfg.head_dim * cfg.n_head_kv, cfg.head_dim * cfg.n_head_kv, ggmlpy.Type.F16,
                   padding=256, n_head_kv=cfg.n_head_kv)
    cache.init(2**16, 1, 64, placement=model.placement)

    def cycle():
        rt = Runtime(model.placement.devices(), graph_size=2 * model.graph_size())
        built = []

        def build(n):
            plan = cache.start_forward(np.zeros(n, np.int64), np.zeros(n, np.int64), reserve=True)
            built.append(model.build(cache, plan, n, n, flash_attn=True))
            return built[-1].graph

        sizes = rt.reserve(build, n_prompt=64)
        assert sizes["CPU"] > 8 << 20                # the mask alone is 64 x 2**16 F16
        for b in built:
            b.free()
        rt.close()
        rt.close()

    try:
        # a leak would be >= 8 MiB of compute buffer per cycle (>= 64 MiB); allocator noise stays far below
        assert rss_growth(cycle, loops=8, warmup=2) < 24
        # reserved compute buffers are never written here, so RSS alone would not see them leak
        assert rss_growth(cycle, loops=8, warmup=0, field="VmSize") < 24
    finally:
        cache.close()
