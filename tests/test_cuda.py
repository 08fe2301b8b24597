"""CUDA: what any build says when CUDA is asked for, and (marked gpu) CUDA against numpy and the CPU.

The unmarked tests run on every build and machine: a CPU-only build must say
CUDA is not compiled in and give the rebuild command; a CUDA build on a
machine without a GPU must say the backend is there but found no device. The
``gpu`` tests run with ``--run-gpu`` or ``GGMLPY_TEST_GPU=1`` on a machine with
an NVIDIA GPU and a CUDA build (README.md, "CUDA build"); on a CPU-only build
they fail with the rebuild command instead of skipping, since asking for them
means a GPU run was intended.
"""

from __future__ import annotations

import os
import re
import sys
import warnings

import numpy as np
import pytest
from helpers import sched_model

import ggmlpy as gp
from ggmlpy import _core as c
from ggmlpy import _libs
from ggmlpy import backend as bk

COMPILED = "CUDA" in c._backends()
HAS_DEVICE = any(d.name.upper().startswith("CUDA") for d in c.devices())


def _expect_unavailable():
    """The message a request for CUDA0 must give on this build, when there is no CUDA device."""
    if COMPILED:
        return r"(?i)CUDA0: no such device: the CUDA backend is compiled in but found 0 device"
    return r"(?i)CUDA0: this build of ggmlpy has no CUDA backend .*CMAKE_ARGS=\"-DGGML_CUDA=on\" pip install"


no_device = pytest.mark.skipif(HAS_DEVICE, reason="a CUDA device is present")


@pytest.fixture(scope="module")
def tiny_model_path(tmp_path_factory):
    from ggmlpy.models.synthetic import write_synthetic
    return str(write_synthetic(tmp_path_factory.mktemp("cuda") / "tiny-F16.gguf", "tiny", "F16", seed=3))


# --------------------------------------------------------------------------- every build, no GPU needed

def test_info_reports_what_was_compiled():
    info = gp.system_info()
    lib_dir = os.path.dirname(c.__file__)
    assert COMPILED == os.path.exists(os.path.join(lib_dir, "libggml-cuda.so"))
    assert ("CUDA" in info["backends"]) == COMPILED
    cuda_devs = [d for d in info["devices"] if d["backend"] == "CUDA"]
    assert bool(cuda_devs) == HAS_DEVICE
    assert all(d["type"] == "GPU" and d["name"].startswith("CUDA") for d in cuda_devs)


def test_info_text_says_when_a_compiled_in_backend_found_no_device():
    from ggmlpy._system import format_system_info
    info = gp.system_info()
    info["backends"] = ["CUDA", "RPC", "CPU"]
    info["devices"] = [d for d in info["devices"] if d["backend"] == "CPU"]
    text = format_system_info(info)
    assert "backends: CUDA, RPC, CPU" in text and "(CUDA: compiled in, no device found)" in text
    info["devices"].insert(0, dict(info["devices"][0], name="CUDA0", type="GPU", backend="CUDA"))
    assert "no device found" not in format_system_info(info)


@no_device
@pytest.mark.parametrize("how", ["device", "backend_init", "choose_devices", "choose_devices_str"])
def test_asking_for_cuda_is_a_clear_error(how):
    call = {"device": lambda: c.device("CUDA0"),
            "backend_init": lambda: c.backend_init("cuda0"),
            "choose_devices": lambda: bk.choose_devices(["CUDA0"]),
            "choose_devices_str": lambda: bk.choose_devices("CUDA0,CPU")}[how]
    with pytest.raises(gp.BackendUnavailable, match=_expect_unavailable()) as ei:
        call()
    assert isinstance(ei.value, RuntimeError)
    assert re.search(r"devices: [^;]*\bCPU\b", str(ei.value))   # what there is instead (RPC devices too, if added)


@no_device
def test_load_model_on_cuda_is_a_clear_error_and_closes_the_file(tiny_model_path):
    from ggmlpy.models import load_model
    with pytest.raises(gp.BackendUnavailable, match=_expect_unavailable()):
        load_model(tiny_model_path, devices=["CUDA0"])
    # nothing is left open or half-built: the same file loads on the CPU afterwards
    with load_model(tiny_model_path, devices="cpu") as m:
        assert all(d.type == "CPU" for d in m.placement.devices())


@no_device
def test_n_gpu_layers_without_an_accelerator_warns(tiny_model_path):
    # as llama.cpp ("--gpu-layers option will be ignored"): said, not an error (llama-bench's -ngl 99 runs on a CPU)
    with pytest.warns(UserWarning, match=r"n_gpu_layers=2 .*no accelerator"):
        p = bk.split_layers(4, bk.choose_devices("auto"), n_gpu_layers=2)
    assert all(d.type == "CPU" for d in p.layers)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bk.split_layers(4, bk.choose_devices("auto"), n_gpu_layers=-1)   # the default says nothing
        bk.split_layers(4, bk.choose_devices("auto"), n_gpu_layers=0)


def test_other_missing_backends_name_their_flag():
    with pytest.raises(gp.BackendUnavailable, match=r"Vulkan0: this build of ggmlpy has no VULKAN backend.*GGML_VULKAN=on"):
        c.device("Vulkan0")
    with pytest.raises(gp.BackendUnavailable, match=r"NPU7: no such device \(devices: .*CPU\)$"):
        c.device("NPU7")


# --------------------------------------------------------------------------- finding NVIDIA's libraries

def test_missing_library_regex():
    msg = "libcudart.so.13: cannot open shared object file: No such file or directory"
    assert _libs._MISSING.search(msg).group(1) == "libcudart.so.13"
    assert _libs._NVIDIA.match("libcublasLt.so.12") and not _libs._NVIDIA.match("libgomp.so.1")


def _fail_then(monkeypatch, sonames):
    """import_module fails once per soname (as the loader would), then returns a stand-in."""
    calls = []

    def fake_import(name):
        calls.append(name)
        if len(calls) <= len(sonames):
            raise ImportError(f"{sonames[len(calls) - 1]}: cannot open shared object file: No such file or directory")
        return c
    monkeypatch.setattr(_libs.importlib, "import_module", fake_import)
    return calls


def test_import_core_loads_missing_cuda_libraries_from_nvidia_packages(tmp_path, monkeypatch):
    # Any real shared library stands in for libcudart; what is tested is where it is looked for.
    stand_in = next(p for p in ("/lib/x86_64-linux-gnu/libm.so.6", "/usr/lib/x86_64-linux-gnu/libm.so.6",
                                "/lib64/libm.so.6", "/usr/lib/libm.so.6") if os.path.exists(p))
    for sub, so in (("cu13", "libcudart.so.13"), ("cu13", "libcublas.so.13")):
        d = tmp_path / "site" / "nvidia" / sub / "lib"
        d.mkdir(parents=True, exist_ok=True)
        (d / so).symlink_to(stand_in)
    monkeypatch.setattr(sys, "path", [str(tmp_path / "empty"), str(tmp_path / "site")])
    monkeypatch.setattr(_libs, "_loaded", [])
    calls = _fail_then(monkeypatch, ["libcudart.so.13", "libcublas.so.13"])
    assert _libs.import_core() is c
    assert len(calls) == 3 and len(_libs._loaded) == 2


def test_import_core_says_how_to_get_missing_cuda_libraries(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    _fail_then(monkeypatch, ["libcublas.so.13"])
    with pytest.raises(ImportError, match=r"needs libcublas.so.13.*pip install 'ggmlpy\[cuda\]'"):
        _libs.import_core()


def test_portable_build_loads_its_cuda_module_through_the_search(tmp_path, monkeypatch):
    # GGML_BACKEND_DL: ggml would dlopen libggml-cuda.so itself and drop it quietly without libcudart
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "libggml-cpu-haswell.so").write_bytes(b"")
    (pkg / "libggml-cuda.so").write_bytes(b"")
    lib = tmp_path / "site" / "nvidia" / "cu13" / "lib"
    lib.mkdir(parents=True)
    (lib / "libcudart.so.13").write_bytes(b"")
    monkeypatch.setattr(sys, "path", [str(tmp_path / "site")])
    monkeypatch.setattr(_libs, "_loaded", [])
    opened = []

    def fake_cdll(path, mode=0):
        opened.append(os.path.basename(path))
        if path.endswith("libggml-cuda.so") and "libcudart.so.13" not in opened:
            raise OSError("libcudart.so.13: cannot open shared object file: No such file or directory")
        return path
    monkeypatch.setattr(_libs.ctypes, "CDLL", fake_cdll)
    monkeypatch.setattr(_libs.importlib, "import_module", lambda name: c)
    assert _libs.import_core(str(pkg)) is c
    assert opened == ["libggml-cuda.so", "libcudart.so.13", "libggml-cuda.so"]
    # a native build (no CPU variants beside _core) links the module: nothing is opened before the import
    (pkg / "libggml-cpu-haswell.so").unlink()
    opened.clear()
    assert _libs.import_core(str(pkg)) is c and opened == []
    # and a module whose CUDA libraries are nowhere fails the import with the way out
    (pkg / "libggml-cpu-haswell.so").write_bytes(b"")
    monkeypatch.setattr(sys, "path", [str(tmp_path / "empty")])
    with pytest.raises(ImportError, match=r"libggml-cuda.so needs libcudart.so.13.*ggmlpy\[cuda\]"):
        _libs.import_core(str(pkg))


def test_import_core_leaves_other_import_errors_alone(monkeypatch):
    _fail_then(monkeypatch, ["libfoo.so.1"])
    with pytest.raises(ImportError, match=r"^libfoo.so.1: cannot open"):
        _libs.import_core()


def test_cuda_toolkit_script_completes_a_wheel_layout(tmp_path):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
    try:
        import cuda_toolkit
    finally:
        sys.path.pop(0)
    root = cuda_toolkit.toolkit_root(tmp_path)
    (root / "lib").mkdir(parents=True)
    for so in ("libcudart.so.13", "libcublas.so.13", "libcublasLt.so.13", "libnvblas.so.13"):
        (root / "lib" / so).write_bytes(b"")
    for _ in range(2):                                   # idempotent: a second run changes nothing
        cuda_toolkit.complete(root)
    assert os.readlink(root / "lib64") == "lib"
    for name in ("libcudart.so", "libcublas.so", "libcublasLt.so"):
        assert os.readlink(root / "lib" / name) == name + ".13"
    assert not (root / "lib" / "libnvblas.so").exists()
    lines = cuda_toolkit.env_lines(root)
    assert lines == [f"export CUDACXX={root / 'bin' / 'nvcc'}", f"export CUDAToolkit_ROOT={root}"]
    with pytest.raises(SystemExit, match="no libcudart"):
        cuda_toolkit.complete(tmp_path / "elsewhere")


# --------------------------------------------------------------------------- on a GPU (--run-gpu)

@pytest.fixture(scope="module")
def cuda():
    # BackendUnavailable here (a CPU-only build, or no GPU) fails the test with the reason: gpu
    # tests only run when asked for, so a missing GPU is a finding, not a skip.
    return c.backend_init("CUDA0")


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


OPS = {
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
def test_op_on_cuda_matches_numpy(cuda, op):
    build, ref, shapes, tol = OPS[op]
    rng = np.random.default_rng(1)
    types = {"f32": (np.float32, gp.Type.F32), "f16": (np.float16, gp.Type.F16)}
    inputs = [(rng.standard_normal(s).astype(types[t][0]), types[t][1]) for s, t in shapes]
    got = _compute_on(cuda, build, inputs)
    want = ref(*[a.astype(np.float32) for a, _ in inputs])
    np.testing.assert_allclose(got.reshape(want.shape), want, rtol=tol, atol=tol)
    # and the CPU backend agrees on the same graph
    cpu = _compute_on(c.backend_init("CPU"), build, inputs)
    np.testing.assert_allclose(got, cpu, rtol=tol, atol=tol)


@pytest.mark.gpu
def test_cuda_device_is_reported(cuda):
    dev = c.device("CUDA0")
    free_b, total_b = dev.memory()
    assert dev.type == "GPU" and 0 < free_b <= total_b
    assert not dev.buffer_type().is_host and dev.host_buffer_type().is_host
    assert any(d["backend"] == "CUDA" for d in gp.system_info()["devices"])
    assert bk.choose_devices("auto")[0] == dev


@pytest.mark.gpu
def test_scheduler_splits_a_graph_over_cuda_and_cpu(cuda):
    cpu = c.backend_init("CPU")
    rng = np.random.default_rng(2)
    ws, build, ref = sched_model([cuda, cpu], rng, dim=32, scale=6.0)   # first weight in GPU memory, second host
    for w, _, _, m in ws:
        np.testing.assert_array_equal(w.get(), m)           # read back from GPU memory too
    s = c.Scheduler([cuda, cpu], graph_size=256)
    for n in (16, 1, 5):
        ctx, x, y, gf = build(n)
        s.alloc_graph(gf)
        X = rng.standard_normal((n, 32)).astype(np.float32)
        x.set(X)
        s.compute(gf)
        np.testing.assert_allclose(y.get().reshape(n, 32), ref(X), rtol=1e-4, atol=1e-4)
        assert s.n_splits >= 1
    assert s.buffer_size(cuda) > 0


@pytest.mark.gpu
@pytest.mark.parametrize("n_gpu_layers", [-1, 1])
@pytest.mark.parametrize("flash_attn", [False, True])
def test_tiny_model_decode_on_cuda_matches_cpu(cuda, tiny_model_path, n_gpu_layers, flash_attn):
    from ggmlpy.models import load_model
    from ggmlpy.runner import Runner

    prompt = [1, 15, 27, 3, 99, 4, 8]
    logits = {}
    for devs in ("cpu", ["CUDA0"]):
        with load_model(tiny_model_path, devices=devs, n_gpu_layers=n_gpu_layers) as m:
            if devs != "cpu":
                assert any(d.name == "CUDA0" for d in m.placement.layers)
            with Runner(m, n_ctx=64, flash_attn=flash_attn, type_k="f32", type_v="f32") as rt:
                rows = [rt.decode(prompt)] + [rt.decode([t]) for t in (5, 6, 7)]
            logits[str(devs)] = np.concatenate(rows)
    a, b = logits["cpu"], logits["['CUDA0']"]
    assert np.isfinite(b).all()
    np.testing.assert_allclose(b, a, rtol=2e-2, atol=2e-2 * np.abs(a).max())
    assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.75
