"""Own kernels chosen by measurement (ggmlpy.models.kernels, ggmlpy.models.calibrate).

The rule and its cache are tested with fake timings (measure_site replaced); one test per op measures
for real on tiny shapes; the runner's graphs are checked to take an own kernel exactly where the
(fake) timings said it was faster, and to give the same tokens in every mode.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import ggmlpy
from ggmlpy import _core
from ggmlpy.models import calibrate, kernels, load_model
from ggmlpy.models.kernels import KernelChoices, Measurement, Site, decide
from ggmlpy.models.synthetic import write_synthetic
from ggmlpy.runner import Runner

# --------------------------------------------------------------------------- the rule


@pytest.mark.parametrize("own, ggml, want", [
    (0.5, 1.0, True), (0.969, 1.0, True), (0.975, 1.0, False), (1.0, 1.0, False), (1.2, 1.0, False),
    (math.inf, 1.0, False), (0.0, 1.0, False), (float("nan"), 1.0, False), (0.5, math.inf, False),
    (-1.0, 1.0, False),
])
def test_decide_takes_the_own_kernel_only_where_it_measured_margin_faster(own, ggml, want):
    assert decide(own, ggml) is want
    assert Measurement(own, ggml).use_own is want


def test_choices_by_mode_and_site():
    fast, slow = Site("matvec", "F16", (64, 128)), Site("matvec", "F16", (128, 64))
    entries = {fast.key: Measurement(1.0, 2.0), slow.key: Measurement(2.0, 1.0)}
    measured = KernelChoices("measure", entries=entries)
    assert measured.use(fast) and not measured.use(slow)
    assert measured.use(Site("matvec", "Q8_0", (64, 128)))            # not measured: the own kernel
    assert all(KernelChoices("own", entries=entries).use(s) for s in (fast, slow))
    assert not any(KernelChoices("ggml", entries=entries).use(s) for s in (fast, slow))
    lines = measured.summary()
    assert any(line.startswith("matvec F16 64x128") and line.endswith("-> own") for line in lines)
    assert any(line.startswith("matvec F16 128x64") and line.endswith("-> ggml") for line in lines)
    assert "own at 1 of 2 sites" in measured.describe()


def test_the_path_is_the_one_that_measured_fastest():
    """attn_decode has two paths (VARIANTS): a graph takes the measured one; an unmeasured site, another
    mode or an unknown name (a hand-edited cache) takes the default, an op with one path none."""
    site = Site("attn_decode", "F16/F16", (64, 64, 32, 8, 1))
    other = Site("attn_decode", "F16/F16", (64, 64, 32, 8, 0))
    odd = Site("attn_decode", "F32/F32", (64, 64, 32, 8, 0))
    mv = Site("matvec", "F16", (64, 128))
    entries = {site.key: Measurement(1.0, 2.0, "avx2"), other.key: Measurement(1.0, 2.0, "avx512"),
               odd.key: Measurement(1.0, 2.0, "sse9"), mv.key: Measurement(1.0, 2.0)}
    kc = KernelChoices("measure", entries=entries)
    assert kernels.VARIANTS["attn_decode"][0] == "avx512"
    assert [kc.variant(s) for s in (site, other, odd)] == ["avx2", "avx512", "avx512"]
    assert kc.variant(Site("attn_decode", "F16/F16", (128, 128, 32, 8, 0))) == "avx512"
    assert kc.variant(mv) == kernels.VARIANTS["matvec"][0] == "vnni"       # measured with one path: the default
    assert kc.variant(Site("geglu", "F32", (256, 0))) == ""
    assert KernelChoices("own", entries=entries).variant(site) == "avx512"
    with kernels.using(kc):
        assert kernels.variant(site) == "avx2"
    assert any(line.startswith(site.key) and "own [avx2]" in line for line in kc.summary())


def test_site_key_round_trips():
    s = Site("attn_decode", "F16/F16", (128, 128, 32, 8, 1))
    assert s.key == "attn_decode F16/F16 128x128x32x8x1"
    assert Site.from_key(s.key) == s


def test_mode_reads_the_environment(monkeypatch):
    monkeypatch.setenv("GGMLPY_KERNELS", "GGML")
    assert kernels.mode() == "ggml"
    assert kernels.mode("measure") == "measure"
    monkeypatch.setenv("GGMLPY_KERNELS", "fastest")
    with pytest.raises(ggmlpy.GGMLValueError, match=r"\$GGMLPY_KERNELS: 'fastest' is not a kernel mode"):
        kernels.mode()
    with pytest.raises(ggmlpy.GGMLValueError, match="kernels: 'x'"):
        kernels.mode("x")


def test_using_is_scoped():
    assert kernels.current().mode == "own"
    with kernels.using(KernelChoices("ggml")):
        assert not kernels.use(Site("matvec", "F16", (1, 1)))
        with kernels.using(KernelChoices("own")):
            assert kernels.use(Site("matvec", "F16", (1, 1)))
        assert kernels.current().mode == "ggml"
    assert kernels.current().mode == "own"


# --------------------------------------------------------------------------- the cache


SITES = [Site("matvec", "F16", (64, 128)), Site("matvec", "F16", (128, 64)), Site("geglu", "F32", (128, 0))]


class FakeTimer:
    """measure_site's stand-in: the own kernel faster at the sites in ``fast``; counts the calls."""

    def __init__(self, fast=()):
        self.fast = {s.key for s in fast}
        self.calls: list[str] = []

    def __call__(self, be, site, weights=(), n_expert_used=1):
        self.calls.append(site.key)
        return Measurement(1.0, 2.0) if site.key in self.fast else Measurement(2.0, 1.0)


def _record(sites):
    def record(rec):
        with kernels.using(rec):
            for s in sites:
                kernels.use(s)
    return record


@pytest.fixture
def timer(monkeypatch):
    t = FakeTimer(fast=SITES[:1])
    monkeypatch.setattr(calibrate, "measure_site", t)
    return t


def test_measured_once_per_machine_then_read_from_the_cache(tmp_path, timer):
    kc = calibrate.kernel_choices(_record(SITES), 2, mode="measure", cache_dir=tmp_path)
    assert sorted(timer.calls) == sorted(s.key for s in SITES)
    assert [kc.use(s) for s in SITES] == [True, False, False]
    assert kc.measured_s > 0 and kc.path == str(tmp_path / "kernels.json")
    data = json.loads((tmp_path / "kernels.json").read_text())
    entry = data["machines"][calibrate.machine_key(2)]
    assert entry["sites"][SITES[0].key]["use_own"] is True and entry["n_threads"] == 2
    timer.calls.clear()
    again = calibrate.kernel_choices(_record(SITES), 2, mode="measure", cache_dir=tmp_path)
    assert timer.calls == [] and again.entries == kc.entries and again.measured_s == 0.0
    assert str(tmp_path) in again.describe()
    # a new site: only it is measured, and the file keeps the others
    extra = Site("matvec", "Q8_0", (256, 64))
    calibrate.kernel_choices(_record([*SITES, extra]), 2, mode="measure", cache_dir=tmp_path)
    assert timer.calls == [extra.key]
    assert len(json.loads((tmp_path / "kernels.json").read_text())["machines"][calibrate.machine_key(2)]["sites"]) == 4


def test_the_cache_is_keyed_by_threads_build_and_version(tmp_path, timer, monkeypatch):
    """Another thread count, ggml build, CPU backend variant, ggmlpy version or build of the extension
    (a kernel changed) measures again; the first entry stays."""
    calibrate.kernel_choices(_record(SITES), 2, mode="measure", cache_dir=tmp_path)
    timer.calls.clear()
    calibrate.kernel_choices(_record(SITES), 1, mode="measure", cache_dir=tmp_path)
    assert len(timer.calls) == len(SITES)                       # another thread count
    for name, value in (("ggml_version", lambda: "9.9.9"), ("ggml_commit", lambda: "abc"),
                        ("cpu_variant", lambda: ("zen4", "x")), ("__version__", "9.0"),
                        ("_build_id", lambda: "rebuilt")):
        with monkeypatch.context() as m:
            m.setattr(calibrate, name, value)
            timer.calls.clear()
            calibrate.kernel_choices(_record(SITES), 2, mode="measure", cache_dir=tmp_path)
            assert len(timer.calls) == len(SITES), name
    with monkeypatch.context() as m:
        m.setattr(calibrate, "cpu_model_name", lambda: "Other CPU")
        timer.calls.clear()
        calibrate.kernel_choices(_record(SITES), 2, mode="measure", cache_dir=tmp_path)
        assert len(timer.calls) == len(SITES)
    timer.calls.clear()
    calibrate.kernel_choices(_record(SITES), 2, mode="measure", cache_dir=tmp_path)
    assert timer.calls == []                                   # the first entry is still there


def test_refresh_measures_again_and_replaces(tmp_path, timer):
    calibrate.kernel_choices(_record(SITES), 2, mode="measure", cache_dir=tmp_path)
    timer.fast = {SITES[1].key}
    timer.calls.clear()
    kc = calibrate.kernel_choices(_record(SITES), 2, mode="measure", cache_dir=tmp_path, refresh=True)
    assert len(timer.calls) == len(SITES)
    assert [kc.use(s) for s in SITES] == [False, True, False]
    cached = calibrate.kernel_choices(_record(SITES), 2, mode="measure", cache_dir=tmp_path)
    assert [cached.use(s) for s in SITES] == [False, True, False]


@pytest.mark.parametrize("content", ["{", "[]", '{"format": 0, "machines": {}}', '{"format": 1, "machines": 3}',
                                     "BAD_SITE"])
def test_a_damaged_or_old_cache_is_measured_again(tmp_path, timer, content):
    path = tmp_path / "kernels.json"
    if content == "BAD_SITE":
        content = json.dumps({"format": calibrate.FORMAT, "machines": {calibrate.machine_key(2): {
            "sites": {SITES[0].key: {"own_s": "fast"}, SITES[1].key: {"own_s": 1.0, "ggml_s": 2.0}}}}})
    path.write_text(content)
    bad_site = "fast" in content                   # only the malformed site (and the missing one) measured
    kc = calibrate.kernel_choices(_record(SITES), 2, mode="measure", cache_dir=tmp_path)
    want = [SITES[0].key, SITES[2].key] if bad_site else [s.key for s in SITES]
    assert sorted(timer.calls) == sorted(want)
    assert kc.use(SITES[0]) and not kc.use(SITES[2])
    assert json.loads(path.read_text())["format"] == calibrate.FORMAT


def test_an_unwritable_cache_still_chooses(tmp_path, timer):
    blocker = tmp_path / "file"
    blocker.write_text("")
    kc = calibrate.kernel_choices(_record(SITES), 2, mode="measure", cache_dir=blocker / "sub")
    assert [kc.use(s) for s in SITES] == [True, False, False] and kc.path == ""


def test_other_modes_measure_nothing(tmp_path, timer):
    for m in ("own", "ggml"):
        kc = calibrate.kernel_choices(_record(SITES), 2, mode=m, cache_dir=tmp_path)
        assert kc.mode == m and kc.entries == {}
    assert timer.calls == [] and not (tmp_path / "kernels.json").exists()


def test_a_site_that_cannot_be_measured_keeps_ggml(tmp_path, monkeypatch):
    def fail(be, site, weights=(), n_expert_used=1):
        raise ggmlpy.GGMLError("no")

    monkeypatch.setattr(calibrate, "measure_site", fail)
    kc = calibrate.kernel_choices(_record(SITES[:1]), 1, mode="measure", cache_dir=tmp_path)
    assert not kc.use(SITES[0])


def test_the_measured_path_is_cached_with_the_timings(tmp_path, monkeypatch):
    site = Site("attn_decode", "F16/F16", (64, 64, 4, 2, 0))
    monkeypatch.setattr(calibrate, "measure_site", lambda be, s, w=(), n_expert_used=1: Measurement(1.0, 2.0, "avx2"))
    kc = calibrate.kernel_choices(_record([site]), 2, mode="measure", cache_dir=tmp_path)
    assert kc.variant(site) == "avx2"
    entry = json.loads((tmp_path / "kernels.json").read_text())["machines"][calibrate.machine_key(2)]
    assert entry["sites"][site.key]["variant"] == "avx2"
    monkeypatch.setattr(calibrate, "measure_site", None)            # read back, not measured
    again = calibrate.kernel_choices(_record([site]), 2, mode="measure", cache_dir=tmp_path)
    assert again.entries == kc.entries and again.variant(site) == "avx2"
    assert any("-> own [avx2]" in line for line in calibrate.cached_summary(tmp_path))


def test_attention_decode_is_measured_at_each_reachable_depth_class(tmp_path, timer):
    s = Site("attn_decode", "F16/F16", (64, 64, 4, 2, 1))
    calibrate.kernel_choices(_record([s]), 1, mode="measure", cache_dir=tmp_path, n_ctx=512)
    assert timer.calls == ["attn_decode F16/F16 64x64x4x2x0"]
    timer.calls.clear()
    calibrate.kernel_choices(_record([s]), 1, mode="measure", cache_dir=tmp_path / "b", n_ctx=4096)
    assert sorted(timer.calls) == ["attn_decode F16/F16 64x64x4x2x0", "attn_decode F16/F16 64x64x4x2x1"]


# --------------------------------------------------------------------------- real measurements


@pytest.fixture
def cpu():
    be = _core.backend_init("CPU")
    be.set_threadpool(2)
    yield be
    be.free()


def _weights(types_shapes):
    ctx = ggmlpy.Context.for_tensors(len(types_shapes), no_alloc=True)
    ts = [ctx.new_tensor(t, ne) for t, ne in types_shapes]
    buf = _core.alloc_ctx_tensors(ctx, _core.device("CPU").buffer_type())
    rng = np.random.default_rng(0)
    for t in ts:
        t.set(rng.standard_normal(t.shape, dtype=np.float32) * np.float32(0.02))
    return ctx, buf, ts


@pytest.mark.parametrize("site, types_shapes", [
    (Site("matvec", "F16", (256, 128)), [(ggmlpy.Type.F16, (256, 128))] * 3),
    (Site("matvec", "Q8_0", (256, 64)), [(ggmlpy.Type.Q8_0, (256, 64))]),
    (Site("matvec_id", "F16", (128, 64, 4)), [(ggmlpy.Type.F16, (128, 64, 4))]),
    (Site("attn_decode", "F16/F16", (64, 64, 4, 2, 0)), []),
    (Site("attn_decode", "F32/F16", (32, 32, 2, 2, 1)), []),
    (Site("attn_prefill", "F16/F16", (64, 64, 4, 2)), []),
    (Site("attn_prefill", "F32/F32", (96, 64, 4, 4)), []),         # deepseek2's decompressed heads
    (Site("geglu", "F32", (256, 0)), []),
    (Site("geglu", "F32", (256, 1)), []),
])
def test_every_op_is_measured_for_real(cpu, site, types_shapes, monkeypatch):
    monkeypatch.setitem(calibrate.TIMING, "max_s", 0.0)
    monkeypatch.setattr(calibrate, "ATTN_BYTES", 1 << 20)
    ctx, buf, ws = _weights(types_shapes) if types_shapes else (None, None, [])
    try:
        m = calibrate.measure_site(cpu, site, ws, n_expert_used=2)
    finally:
        if ctx is not None:
            ctx.free()
            buf.free()
    assert 0 < m.own_s < 1 and 0 < m.ggml_s < 1


def test_the_prompt_experts_site_is_measured_for_real(cpu, monkeypatch):
    """experts_rq: a repacked Q4_K stack through mul_mat_id_rq and mul_mat_id, PREFILL_ROWS tokens (gemv.c's
    VNNI kernel on an AVX-512 VNNI CPU, gemm.c's on one with AVX2 only)."""
    monkeypatch.setitem(calibrate.TIMING, "max_s", 0.0)
    ctx, buf, w = _repacked_q4_k((256, 64, 8))
    try:
        assert w.is_repacked and _core._mul_mat_id_rq_ok(w) and not _core._mul_mat_rq4k_ok(w)
        m = calibrate.measure_site(cpu, kernels.experts_site(w), [w], n_expert_used=2)
    finally:
        ctx.free()
        buf.free()
    assert 0 < m.own_s < 1 and 0 < m.ggml_s < 1


def _repacked_q4_k(shape):
    """A Q4_K matrix or expert stack in ggml's CPU_REPACK buffer, its context and buffer (skips where no own
    kernel reads it: ggml repacks Q4_K on x86 with AVX2)."""
    extra = {b.name: b for b in _core.device("CPU").extra_buffer_types()}
    if "CPU_REPACK" not in extra or not _core._mul_mat_rq4k_allow():
        pytest.skip("no repacked Q4_K here (CPU_REPACK)")
    ctx = ggmlpy.Context.for_tensors(1, no_alloc=True)
    w = ctx.new_tensor(ggmlpy.Type.Q4_K, shape)
    buf = _core.alloc_ctx_tensors(ctx, extra["CPU_REPACK"])
    w.set(np.random.default_rng(0).standard_normal(w.shape, dtype=np.float32))
    if not _core._mul_mat_id_rq_ok(w):
        ctx.free()
        buf.free()
        pytest.skip("no kernel for repacked Q4_K here (x86 with AVX2)")
    return ctx, buf, w


def test_the_prompt_gemm_site_is_measured_for_real(cpu, monkeypatch):
    """gemm_rq: PREFILL_ROWS tokens through a repacked Q4_K matrix, mul_mat_rq4k against mul_mat."""
    monkeypatch.setitem(calibrate.TIMING, "max_s", 0.0)
    ctx, buf, w = _repacked_q4_k((512, 64))
    try:
        site = kernels.gemm_site(w)
        assert site == Site("gemm_rq", "Q4_K/repacked", (512, 64))
        m = calibrate.measure_site(cpu, site, [w])
    finally:
        ctx.free()
        buf.free()
    assert 0 < m.own_s < 1 and 0 < m.ggml_s < 1


def test_a_prompt_gemm_site_builds_the_op_that_measured_faster():
    """blocks.linear on a repacked Q4_K matrix: mul_mat_rq4k (a custom op) for more than MATVEC_MAX_COLS
    tokens where it measured faster, was not measured, or in mode "own"; ggml's mul_mat where it measured
    slower, in mode "ggml", with blocks.gemm_kernel off, and for a few tokens."""
    from ggmlpy.models import blocks

    wctx, buf, w = _repacked_q4_k((512, 64))
    site = kernels.gemm_site(w)
    try:
        with ggmlpy.Context(16 << 20) as ctx:
            def op(mode, measured=None, n=16):
                x = ctx.new_tensor(ggmlpy.Type.F32, (512, n))
                entries = {site.key: measured} if measured is not None else {}
                with kernels.using(KernelChoices(mode, entries=entries)):
                    return blocks.linear(ctx, w, x).op.name

            assert op("measure", Measurement(1.0, 2.0)) == op("measure") == op("own") == "CUSTOM"
            assert op("measure", Measurement(2.0, 1.0)) == op("ggml") == "MUL_MAT"
            assert op("own", n=blocks.MATVEC_MAX_COLS) == "MUL_MAT"
            old = blocks.gemm_kernel
            blocks.gemm_kernel = False
            try:
                assert op("own") == "MUL_MAT"
            finally:
                blocks.gemm_kernel = old
    finally:
        wctx.free()
        buf.free()


@pytest.mark.parametrize("n_head", [8, 2])
def test_attention_decode_times_both_paths_where_both_run(cpu, monkeypatch, n_head):
    """Grouped heads on an AVX-512 CPU: both paths are timed and the faster named; without groups (or
    AVX-512) there is one path and no name."""
    monkeypatch.setitem(calibrate.TIMING, "max_s", 0.0)
    monkeypatch.setattr(calibrate, "ATTN_BYTES", 1 << 20)
    m = calibrate.measure_site(cpu, Site("attn_decode", "F16/F16", (64, 64, n_head, 2, 0)))
    both = n_head > 2 and _core._attn_decode_avx512(64, 64)
    assert (m.variant in kernels.VARIANTS["attn_decode"]) if both else m.variant == ""
    assert 0 < m.own_s < 1 and 0 < m.ggml_s < 1


@pytest.mark.parametrize("forced", [False, True])
@pytest.mark.parametrize("wtype", [ggmlpy.Type.Q8_0, ggmlpy.Type.Q6_K, ggmlpy.Type.F16])
def test_matvec_times_both_paths_where_both_run(cpu, monkeypatch, wtype, forced):
    """Q8_0 and Q6_K weights on an AVX-512 VNNI CPU: the row kernel and ggml's vec_dot under the schedule
    are both timed (a graph each, then ggml's) and the faster named; other weights (or CPUs) have one
    path and no name. ``forced``: the two-path case on any CPU (the predicate replaced)."""
    monkeypatch.setitem(calibrate.TIMING, "max_s", 0.0)
    if forced:
        monkeypatch.setattr(_core, "_mul_mat_vec_own_rows", lambda w: True)
    labels = []
    graph = calibrate._Bench.graph
    monkeypatch.setattr(calibrate._Bench, "graph", lambda self, ctx, outs, label="": (
        labels.append((label, {_core._mul_mat_vec_path(o) for o in outs})), graph(self, ctx, outs, label))[1])
    ctx, buf, ws = _weights([(wtype, (256, 64))] * 2)
    try:
        both = _core._mul_mat_vec_own_rows(ws[0])
        m = calibrate.measure_site(cpu, kernels.matvec_site(ws[0]), ws)
    finally:
        ctx.free()
        buf.free()
    if both:
        assert labels == [("vnni", {"vnni"}), ("dot", {"dot"}), ("", {None})]
        assert m.variant in kernels.VARIANTS["matvec"]
    else:
        assert labels == [("", {"vnni"}), ("", {None})] and m.variant == ""
    assert 0 < m.own_s < 1 and 0 < m.ggml_s < 1


def test_a_matvec_site_builds_the_path_that_measured_faster():
    """blocks.linear at a measured Q8_0 site: the own op on the measured path (ggml's vec_dot for "dot",
    the row kernel for "vnni", the row kernel where unmeasured or in mode "own"), ggml's mul_mat where the
    own kernel measured slower or in mode "ggml"."""
    from ggmlpy.models import blocks

    with ggmlpy.Context(16 << 20) as ctx:
        w = ctx.new_tensor(ggmlpy.Type.Q8_0, (256, 64))
        x = ctx.new_tensor(ggmlpy.Type.F32, (256, 1))
        site = kernels.matvec_site(w)

        def path(mode, measured=None):
            entries = {site.key: measured} if measured is not None else {}
            with kernels.using(KernelChoices(mode, entries=entries)):
                return _core._mul_mat_vec_path(blocks.linear(ctx, w, x))

        assert path("measure", Measurement(1.0, 2.0, "dot")) == "dot"
        assert path("measure", Measurement(1.0, 2.0, "vnni")) == "vnni"
        assert path("measure") == path("own") == "vnni"
        assert path("measure", Measurement(2.0, 1.0, "dot")) is None
        assert path("ggml") is None


@pytest.mark.parametrize("llc, emptied", [(4 << 20, True), (1 << 10, False)])
def test_a_site_that_fits_in_the_last_level_cache_is_timed_from_memory(cpu, monkeypatch, llc, emptied):
    """Weights that fit twice in the last-level cache would stay there from run to run (generation reads
    them from memory): the cache is emptied before every timed run; larger sites stream anyway."""
    monkeypatch.setitem(calibrate.TIMING, "max_s", 0.0)
    monkeypatch.setattr(calibrate, "_llc_bytes", lambda: llc)
    monkeypatch.setattr(calibrate, "EVICT_BYTES", 1 << 20)
    calls = []
    monkeypatch.setattr(calibrate._Bench, "_empty_cache", lambda self: calls.append(self.evict.nbytes))
    ctx, buf, ws = _weights([(ggmlpy.Type.Q8_0, (256, 64))] * 2)
    try:
        m = calibrate.measure_site(cpu, Site("matvec", "Q8_0", (256, 64)), ws)
    finally:
        ctx.free()
        buf.free()
    rounds = calibrate.TIMING["min_rounds"]
    assert calls == ([2 * llc] * (2 * rounds) if emptied else [])      # both graphs, every round
    assert 0 < m.own_s < 1 and 0 < m.ggml_s < 1


@pytest.mark.parametrize("llc, emptied", [(256 << 10, True), (16 << 10, False)])
def test_an_experts_site_is_sized_by_the_experts_a_run_reads(cpu, monkeypatch, llc, emptied):
    """64 experts of 1.1 MB, 2 used: a run reads 35 KB of them, every run the same, so the cache is
    emptied even where all 64 would not fit in it (256 KB), and not where the 35 KB would not."""
    monkeypatch.setitem(calibrate.TIMING, "max_s", 0.0)
    monkeypatch.setattr(calibrate, "_llc_bytes", lambda: llc)
    monkeypatch.setattr(calibrate, "EVICT_BYTES", 1 << 20)
    calls = []
    monkeypatch.setattr(calibrate._Bench, "_empty_cache", lambda self: calls.append(self.evict.nbytes))
    ctx, buf, ws = _weights([(ggmlpy.Type.Q8_0, (256, 64, 64))])
    try:
        assert ws[0].nbytes > 2 * llc
        m = calibrate.measure_site(cpu, Site("matvec_id", "Q8_0", (256, 64, 64)), ws, n_expert_used=2)
    finally:
        ctx.free()
        buf.free()
    assert calls == ([1 << 20] * (2 * calibrate.TIMING["min_rounds"]) if emptied else [])
    assert 0 < m.own_s < 1 and 0 < m.ggml_s < 1


def test_the_typical_run_decides_not_the_luckiest():
    # an own kernel whose best run beats ggml's but whose usual run loses is not taken
    own = [1.0, 1.0, 5.0, 5.0, 5.0, 5.0, 5.0]
    m = calibrate._measurement([own, [2.0] * 7], ["", ""])
    assert (m.own_s, m.ggml_s, m.use_own) == (5.0, 2.0, False)
    # of two paths the one with the faster median is named and timed
    m = calibrate._measurement([own, [3.0] * 7, [4.0] * 7], ["avx512", "avx2", ""])
    assert (m.variant, m.own_s, m.use_own) == ("avx2", 3.0, True)


def test_last_level_cache_size_from_sysfs(tmp_path):
    for name, size in (("index0", "32K"), ("index2", "1024K"), ("index3", "32768K")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "size").write_text(size + "\n")
    assert calibrate._llc_bytes(tmp_path) == 32 << 20
    (tmp_path / "index4").mkdir()
    (tmp_path / "index4" / "size").write_text("2M\n")
    assert calibrate._llc_bytes(tmp_path) == 32 << 20
    assert calibrate._llc_bytes(tmp_path / "missing") == 32 << 20           # unreadable: the default
    (tmp_path / "index4" / "size").write_text("96M\n")
    assert calibrate._llc_bytes(tmp_path) == 96 << 20


def test_a_matvec_site_without_weights_is_an_error(cpu):
    with pytest.raises(ggmlpy.GGMLError, match="no weight recorded"):
        calibrate.measure_site(cpu, Site("matvec", "F16", (64, 64)), [])


# --------------------------------------------------------------------------- the runner's graphs


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    return write_synthetic(str(tmp_path_factory.mktemp("k") / "g.gguf"), "tiny", "F16", arch="gemma3")


def _custom_ops(runner, n):
    with kernels.using(runner.kernels):
        b = runner.step.worst_case_graph(n)
    try:
        return sum(1 for node in b.graph.nodes if node.op == ggmlpy.Op.CUSTOM)
    finally:
        b.free()


def test_the_runner_takes_own_kernels_only_where_they_measured_faster(tiny_gemma, tmp_path, monkeypatch):
    monkeypatch.setenv("GGMLPY_CACHE", str(tmp_path))
    monkeypatch.setenv("GGMLPY_KERNELS", "measure")
    seen = []

    def timer(be, site, weights=(), n_expert_used=1):
        seen.append(site)
        return Measurement(1.0, 2.0) if site.key in faster else Measurement(2.0, 1.0)

    monkeypatch.setattr(calibrate, "measure_site", timer)
    with load_model(tiny_gemma, devices="cpu") as m:
        faster = set()
        with Runner(m, n_ctx=64, n_threads=1, n_ubatch=64) as r:
            ops = {s.op for s in seen}
            # the prompt's own kernels are sites only where this CPU runs them vectorised
            hd = m.config.head_dim
            want = {"matvec", "attn_decode"} | ({"attn_prefill"} if _core._attn_prefill_vectorized(hd, hd) else set()) \
                | ({"geglu"} if _core._geglu_vectorized() else set())
            assert ops == want, ops
            assert not any(r.kernels.use(s) for s in seen)
            assert _custom_ops(r, 1) == 0 and _custom_ops(r, 64) == 0
        # everything measured faster (a new cache folder: measured again)
        monkeypatch.setenv("GGMLPY_CACHE", str(tmp_path / "fast"))
        faster = {s.key for s in seen}
        with Runner(m, n_ctx=64, n_threads=1, n_ubatch=64) as r:
            decode_own, prompt_own = _custom_ops(r, 1), _custom_ops(r, 64)
        assert decode_own > 0 and (prompt_own > 0) == (want > {"matvec", "attn_decode"})
        # only the matrix-vector products faster
        monkeypatch.setenv("GGMLPY_CACHE", str(tmp_path / "mv"))
        faster = {s.key for s in seen if s.op == "matvec"}
        with Runner(m, n_ctx=64, n_threads=1, n_ubatch=64) as r:
            assert 0 < _custom_ops(r, 1) < decode_own
            assert _custom_ops(r, 64) == 0                      # a prompt has no matrix-vector product


@pytest.mark.skipif(not _core._attn_decode_avx512(16, 16), reason="no AVX-512 on this CPU")
def test_the_runner_builds_the_path_that_measured_faster(tmp_path, monkeypatch):
    """The tiny model (4 query heads over 2 kv heads of 16): with the AVX2 path measured faster, a
    token's logits are bit for bit those with the AVX-512 path switched off process-wide; with the
    AVX-512 path faster, those with it on. The two paths' logits differ in the last bits, so either
    comparison fails if the graph took the other path."""
    path = write_synthetic(str(tmp_path / "m.gguf"), "tiny", "F32")
    prompt = (np.arange(200, dtype=np.int32) % 100) + 1

    def logits(kernel_mode, variant=None, allow=True):
        monkeypatch.setenv("GGMLPY_KERNELS", kernel_mode)
        monkeypatch.setenv("GGMLPY_CACHE", str(tmp_path / f"c-{variant}"))
        monkeypatch.setattr(calibrate, "measure_site", lambda be, s, w=(), n_expert_used=1:
                            Measurement(1.0, 2.0, variant if s.op == "attn_decode" else ""))
        old = _core._attn_decode_allow_avx512(allow)
        try:
            with load_model(path, devices="cpu") as m, \
                    Runner(m, n_ctx=256, n_threads=2, type_k="f32", type_v="f32") as r:
                r.decode(prompt, seq=0, logits=None)
                return np.stack([r.decode([5 + i], seq=0, logits="last").copy() for i in range(3)])
        finally:
            _core._attn_decode_allow_avx512(old)

    wide, narrow = logits("own"), logits("own", allow=False)
    assert not np.array_equal(wide, narrow)
    assert np.array_equal(logits("measure", "avx2"), narrow)
    assert np.array_equal(logits("measure", "avx512"), wide)


def test_every_mode_generates_the_same_tokens(tiny_gemma, tmp_path, monkeypatch):
    monkeypatch.setenv("GGMLPY_CACHE", str(tmp_path))
    monkeypatch.setitem(calibrate.TIMING, "max_s", 0.0)
    prompt = list(range(3, 40))
    out = {}
    with load_model(tiny_gemma, devices="cpu") as m:
        for mode in ("own", "ggml", "measure"):
            monkeypatch.setenv("GGMLPY_KERNELS", mode)
            with Runner(m, n_ctx=128, n_threads=2) as r:
                assert r.kernels.mode == mode
                out[mode] = r.generate(prompt, max_tokens=12, temperature=0).tokens
    assert out["own"] == out["ggml"] == out["measure"]
    assert (tmp_path / "kernels.json").exists()


def test_forget_drops_this_machines_timings_only(tmp_path, timer):
    calibrate.kernel_choices(_record(SITES), 1, mode="measure", cache_dir=tmp_path)
    calibrate.kernel_choices(_record(SITES), 2, mode="measure", cache_dir=tmp_path)
    path = tmp_path / "kernels.json"
    data = json.loads(path.read_text())
    data["machines"]["Other CPU | 2 threads | ggml 0.0.0 (x), cpu native | ggmlpy 0.0"] = {"sites": {}}
    path.write_text(json.dumps(data))
    assert calibrate.forget(tmp_path) == 2
    assert list(json.loads(path.read_text())["machines"]) == [
        "Other CPU | 2 threads | ggml 0.0.0 (x), cpu native | ggmlpy 0.0"]
    timer.calls.clear()
    calibrate.kernel_choices(_record(SITES), 2, mode="measure", cache_dir=tmp_path)
    assert len(timer.calls) == len(SITES)
    assert calibrate.forget(tmp_path / "none") == 0


@pytest.mark.parametrize("machines", [{"KEY": 3}, {"KEY": {"sites": [1, 2]}}, {"KEY": {"sites": {"x": 1}}}])
def test_a_malformed_entry_is_measured_again_and_replaced(tmp_path, timer, machines):
    key = calibrate.machine_key(2)
    (tmp_path / "kernels.json").write_text(json.dumps(
        {"format": calibrate.FORMAT, "machines": {key if k == "KEY" else k: v for k, v in machines.items()}}))
    assert any(line.endswith("own at 0 of 0 sites") for line in calibrate.cached_summary(tmp_path))
    kc = calibrate.kernel_choices(_record(SITES), 2, mode="measure", cache_dir=tmp_path)
    assert len(timer.calls) == len(SITES) and kc.use(SITES[0])
    entry = json.loads((tmp_path / "kernels.json").read_text())["machines"][key]
    assert set(entry["sites"]) >= {s.key for s in SITES}


def test_measuring_gives_back_what_it_allocates(cpu, monkeypatch):
    """Each measurement allocates caches, inputs and two graphs' buffers (8 MiB of K/V here) and
    frees them: the process's RSS does not grow over repeated measurements."""
    from helpers import rss_growth

    monkeypatch.setitem(calibrate.TIMING, "max_s", 0.0)
    monkeypatch.setattr(calibrate, "ATTN_BYTES", 8 << 20)
    site = Site("attn_decode", "F16/F16", (64, 64, 8, 4, 1))
    assert rss_growth(lambda: calibrate.measure_site(cpu, site), loops=6) < 4.0
