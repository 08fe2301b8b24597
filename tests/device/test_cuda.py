"""CUDA: what any build says when CUDA is asked for, and how the CUDA libraries are found.

These run on every build and machine: a CPU-only build must say CUDA is not
compiled in and give the rebuild command; a CUDA build on a machine without a
GPU must say the backend is there but found no device. The device suite (ops,
the scheduler, models on the device against the CPU) is ``test_device.py``'s,
run for every non-CPU device present (CUDA0, Vulkan0...) with ``--run-gpu``.
"""

from __future__ import annotations

import os
import re
import sys
import warnings

import pytest

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
no_accelerator = pytest.mark.skipif(any(d.type != "CPU" for d in c.devices()),
                                    reason="an accelerator is present (test_device.py's suite)")


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


@no_accelerator
def test_n_gpu_layers_without_an_accelerator_warns(tiny_model_path):
    # as llama.cpp ("--gpu-layers option will be ignored"): said, not an error (llama-bench's -ngl 99 runs on a CPU)
    with pytest.warns(UserWarning, match=r"n_gpu_layers=2 .*no accelerator"):
        p = bk.split_layers(4, bk.choose_devices("auto"), n_gpu_layers=2)
    assert all(d.type == "CPU" for d in p.layers)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bk.split_layers(4, bk.choose_devices("auto"), n_gpu_layers=-1)   # the default says nothing
        bk.split_layers(4, bk.choose_devices("auto"), n_gpu_layers=0)


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
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
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
