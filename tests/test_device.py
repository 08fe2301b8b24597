"""Devices other than the CPU (CUDA, Vulkan, Metal...): what ggmlpy says about them on any build, and
(marked gpu) each such device present against numpy and the CPU backend.

The unmarked tests run everywhere. The ``gpu`` tests run with ``--run-gpu`` or ``GGMLPY_TEST_GPU=1``,
once per non-CPU device ggml lists (``CUDA0``, ``Vulkan0``...; Mesa's software Vulkan driver,
lavapipe, counts: ggml lists it once ``GGML_VK_VISIBLE_DEVICES=0`` is set). With none present they
fail with the reason instead of skipping, since asking for them means a device run was intended.

Tolerances are per backend, and what differs between backends is stated here rather than skipped:

* CUDA: its f32 products go through cuBLAS (TF32 off), within 1e-4 of numpy;
* Vulkan: its shaders sum float32 products in their own order: 6.6e-4 measured on lavapipe for the
  scheduler's two-layer graph, so 2e-3;
* everywhere: a model's logits against the CPU run within 2e-2 of their scale (float16 weights and
  flash attention's f16 accumulation differ per backend), and the greedy token in at least 3 of 4
  rows.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import sched_model

import ggmlpy as gp
from ggmlpy import _core as c
from ggmlpy import backend as bk
from ggmlpy._system import format_system_info

#: Non-CPU devices ggml lists on this build and machine (RPC devices are added by hand, not listed).
ACCELS = [d.name for d in c.devices() if d.type != "CPU" and not d.name.upper().startswith("RPC")]

#: Absolute and relative tolerance of an op against numpy, per backend (module docstring).
OP_TOL = {"CUDA": 1e-4, "Vulkan": 2e-3, "Metal": 1e-3}


def _backend_of(name: str) -> str:
    return next((b for b in OP_TOL if name.upper().startswith(b.upper())), name.rstrip("0123456789"))


@pytest.fixture(scope="module")
def tiny_model_path(tmp_path_factory):
    from ggmlpy.models.synthetic import write_synthetic
    return str(write_synthetic(tmp_path_factory.mktemp("dev") / "tiny-F16.gguf", "tiny", "F16", seed=3))


# --------------------------------------------------------------------------- every build


def _cpu_only_info():
    info = gp.system_info()
    info["devices"] = [d for d in info["devices"] if d["backend"] == "CPU"]
    return info


def test_info_says_how_to_show_a_hidden_software_vulkan_device(monkeypatch):
    """ggml skips CPU-type Vulkan devices (lavapipe) unless GGML_VK_VISIBLE_DEVICES names them: a
    Vulkan build that lists none says so, and how to show one."""
    info = _cpu_only_info()
    info["backends"] = ["Vulkan", "RPC", "CPU"]
    monkeypatch.delenv("GGML_VK_VISIBLE_DEVICES", raising=False)
    text = format_system_info(info)
    assert "(Vulkan: compiled in, no device found; ggml hides software Vulkan devices such as Mesa's lavapipe: " \
           "GGML_VK_VISIBLE_DEVICES=0 shows the first)" in text
    monkeypatch.setenv("GGML_VK_VISIBLE_DEVICES", "0")
    assert "(Vulkan: compiled in, no device found)" in format_system_info(info)   # set, and still none
    info["backends"] = ["CUDA", "RPC", "CPU"]
    assert "lavapipe" not in format_system_info(info)


def test_info_marks_a_software_vulkan_device():
    info = _cpu_only_info()
    cpu = info["devices"][0]
    info["backends"] = ["Vulkan", "RPC", "CPU"]
    info["devices"].insert(0, dict(cpu, name="Vulkan0", type="GPU", backend="Vulkan",
                                   description="llvmpipe (LLVM 15.0.6, 256 bits)"))
    text = format_system_info(info)
    assert "(Vulkan0 is a software device (Mesa's lavapipe)" in text and "no device found" not in text
    info["devices"][0]["description"] = "NVIDIA GeForce RTX 4090"
    assert "software device" not in format_system_info(info)


def test_a_missing_backend_names_its_flag_and_a_deviceless_one_its_hint():
    compiled = set(c._backends())
    for name, backend, flag in (("Vulkan0", "Vulkan", "GGML_VULKAN"), ("Metal0", "Metal", "GGML_METAL")):
        if name in ACCELS:
            continue
        if backend in compiled:
            match = rf"{name}: no such device: the {backend} backend is compiled in but found 0 device"
        else:
            match = rf"{name}: this build of ggmlpy has no {backend.upper()} backend.*{flag}=on"
        with pytest.raises(gp.BackendUnavailable, match=match):
            c.device(name)
    if "Vulkan" in compiled and "Vulkan0" not in ACCELS:
        with pytest.raises(gp.BackendUnavailable, match="GGML_VK_VISIBLE_DEVICES"):
            c.device("Vulkan0")
    with pytest.raises(gp.BackendUnavailable, match=r"NPU7: no such device \(devices: .*CPU\)$"):
        c.device("NPU7")


# --------------------------------------------------------------------------- on each device (--run-gpu)


@pytest.fixture(scope="module", params=ACCELS or ["CUDA0"])
def accel(request):
    # BackendUnavailable here (no such device on this build or machine) fails the test with the
    # reason: gpu tests run only when asked for, so a missing device is a finding, not a skip.
    be = c.backend_init(request.param)
    yield request.param, be
    be.free()


def _compute_on(be, build, inputs):
    """Build a graph with ``build(ctx, *leaves)``, allocate it on ``be``, set ``inputs``, return the output."""
    ctx = gp.Context.for_tensors(64, graph_size=256, no_alloc=True)
    leaves = [ctx.new_tensor(t, tuple(reversed(a.shape))).set_input() for a, t in inputs]
    y = build(ctx, *leaves).set_output()
    gf = ctx.new_graph(256)
    gf.build_forward_expand(y)
    ga = c.Gallocr(be.buffer_type)
    ga.alloc_graph(gf)
    for leaf, (a, t) in zip(leaves, inputs):
        leaf.set(a if t != gp.Type.Q8_0 else gp.quantize(a, gp.Type.Q8_0))
    be.graph_compute(gf)
    return y.get()


OPS = {   # name: (build, numpy reference, inputs (numpy shape, type), tolerance floor)
    "add": (lambda ctx, a, b: ctx.add(a, b), lambda a, b: a + b, [((4, 33), "f32"), ((1, 33), "f32")], 1e-6),
    "mul_mat_f32": (lambda ctx, w, x: ctx.mul_mat(w, x), lambda w, x: x @ w.T,
                    [((64, 96), "f32"), ((7, 96), "f32")], 1e-4),
    "mul_mat_f16": (lambda ctx, w, x: ctx.mul_mat(w, x), lambda w, x: x @ w.T,
                    [((64, 96), "f16"), ((7, 96), "f32")], 1e-2),
    "soft_max": (lambda ctx, a: ctx.soft_max(a), lambda a: np.exp(a - a.max(-1, keepdims=True))
                 / np.exp(a - a.max(-1, keepdims=True)).sum(-1, keepdims=True), [((5, 40), "f32")], 1e-5),
    "rms_norm": (lambda ctx, a: ctx.rms_norm(a, 1e-6), lambda a: a / np.sqrt((a * a).mean(-1, keepdims=True) + 1e-6),
                 [((6, 64), "f32")], 1e-5),
    "silu": (lambda ctx, a: ctx.silu(a), lambda a: a / (1 + np.exp(-a)), [((3, 50), "f32")], 1e-5),
}


@pytest.mark.gpu
@pytest.mark.parametrize("op", sorted(OPS))
def test_op_matches_numpy(accel, op):
    name, be = accel
    build, ref, shapes, floor = OPS[op]
    tol = max(floor, OP_TOL.get(_backend_of(name), 1e-3))
    rng = np.random.default_rng(1)
    types = {"f32": (np.float32, gp.Type.F32), "f16": (np.float16, gp.Type.F16)}
    inputs = [(rng.standard_normal(s).astype(types[t][0]), types[t][1]) for s, t in shapes]
    got = _compute_on(be, build, inputs)
    want = ref(*[a.astype(np.float32) for a, _ in inputs])
    np.testing.assert_allclose(got.reshape(want.shape), want, rtol=tol, atol=tol)
    # and the CPU backend agrees on the same graph
    cpu = c.backend_init("CPU")
    try:
        np.testing.assert_allclose(got, _compute_on(cpu, build, inputs), rtol=tol, atol=tol)
    finally:
        cpu.free()


@pytest.mark.gpu
def test_device_is_reported(accel):
    name, _ = accel
    dev = c.device(name)
    free_b, total_b = dev.memory()
    assert dev.type in ("GPU", "IGPU") and 0 < free_b <= total_b
    assert not dev.buffer_type().is_host or dev.type == "IGPU"
    assert dev.host_buffer_type() is None or dev.host_buffer_type().is_host
    assert any(d["name"] == name for d in gp.system_info()["devices"])
    assert bk.choose_devices("auto")[0] == c.device(ACCELS[0])


@pytest.mark.gpu
def test_scheduler_splits_a_graph_over_the_device_and_the_cpu(accel):
    name, be = accel
    tol = max(1e-4, OP_TOL.get(_backend_of(name), 1e-3))
    cpu = c.backend_init("CPU")
    rng = np.random.default_rng(2)
    ws, build, ref = sched_model([be, cpu], rng, dim=32, scale=6.0)   # first weight in device memory, second host
    for w, _, _, m in ws:
        np.testing.assert_array_equal(w.get(), m)           # read back from device memory too
    s = c.Scheduler([be, cpu], graph_size=256)
    for n in (16, 1, 5):
        ctx, x, y, gf = build(n)
        s.alloc_graph(gf)
        X = rng.standard_normal((n, 32)).astype(np.float32)
        x.set(X)
        s.compute(gf)
        want = ref(X)
        np.testing.assert_allclose(y.get().reshape(n, 32), want, rtol=tol, atol=tol * np.abs(want).max())
        assert s.n_splits >= 1
    assert s.buffer_size(be) > 0


@pytest.mark.gpu
@pytest.mark.parametrize("n_gpu_layers", [-1, 1])
@pytest.mark.parametrize("flash_attn", [False, True])
def test_tiny_model_decode_matches_cpu(accel, tiny_model_path, n_gpu_layers, flash_attn):
    from ggmlpy.models import load_model
    from ggmlpy.runner import Runner

    name, _ = accel
    prompt = [1, 15, 27, 3, 99, 4, 8]
    logits = {}
    for devs in ("cpu", [name]):
        with load_model(tiny_model_path, devices=devs, n_gpu_layers=n_gpu_layers if devs != "cpu" else -1) as m:
            if devs != "cpu":
                assert any(d.name == name for d in m.placement.layers)
            with Runner(m, n_ctx=64, flash_attn=flash_attn, type_k="f32", type_v="f32") as rt:
                rows = [rt.decode(prompt)] + [rt.decode([t]) for t in (5, 6, 7)]
            logits[str(devs)] = np.concatenate(rows)
    a, b = logits["cpu"], logits[str([name])]
    assert np.isfinite(b).all()
    np.testing.assert_allclose(b, a, rtol=2e-2, atol=2e-2 * np.abs(a).max())
    assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.75
