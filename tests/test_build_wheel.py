"""tools/build_wheel.py without building: the command line, the checks of a wheel's contents on small
synthetic wheels, the verdict on what ``ggmlpy info`` lists, and the CUDA toolkit's environment."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_tool():
    spec = importlib.util.spec_from_file_location("build_wheel", ROOT / "tools" / "build_wheel.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bw = _load_tool()


# --- the command line --------------------------------------------------------------------------------

@pytest.mark.parametrize("backend, out, build, defines", [
    ("cpu", "wheelhouse", "build/wheel", ["-DGGML_NATIVE=OFF"]),
    ("vulkan", "wheelhouse/vulkan", "build/wheel-vulkan", ["-DGGML_NATIVE=OFF", "-DGGML_VULKAN=ON"]),
    ("cuda", "wheelhouse/cu13", "build/wheel-cuda",
     ["-DGGML_NATIVE=OFF", "-DGGML_CUDA=ON", "-DGGML_CUDA_FA_ALL_QUANTS=OFF",
      f"-DCMAKE_CUDA_ARCHITECTURES={bw.CUDA_ARCHS}"]),
])
def test_each_backend_has_its_index_folder_build_folder_and_switches(backend, out, build, defines):
    args = bw.parse_args(["--backend", backend])
    assert (args.out, args.build_dir) == (ROOT / out, ROOT / build)
    assert bw.cmake_defines(args) == defines


def test_options_override_the_defaults(tmp_path):
    args = bw.parse_args(["--backend", "cuda", "--cuda-arch", "90", "--native", "--out", str(tmp_path / "o"),
                          "--build-dir", str(tmp_path / "b")])
    assert (args.out, args.build_dir) == (tmp_path / "o", tmp_path / "b")
    assert bw.cmake_defines(args) == ["-DGGML_NATIVE=ON", "-DGGML_CUDA=ON", "-DGGML_CUDA_FA_ALL_QUANTS=OFF",
                                      "-DCMAKE_CUDA_ARCHITECTURES=90"]
    assert bw.cmake_defines(bw.parse_args(["--native"])) == ["-DGGML_NATIVE=ON"]


def test_an_unknown_backend_is_refused(capsys):
    with pytest.raises(SystemExit):
        bw.parse_args(["--backend", "metal"])
    assert "invalid choice: 'metal'" in capsys.readouterr().err


def test_default_cuda_architectures_are_valid_cmake_entries():
    """Each entry a CMake architecture (NN, NN-real, NN-virtual, NNa-real): ggml-cuda's CMake would
    otherwise fail half an hour into a publishing run; only real code for 75-89, and some PTX."""
    archs = bw.CUDA_ARCHS.split(";")
    assert all(re.fullmatch(r"\d{2,3}a?(-real|-virtual)?", a) for a in archs), archs
    assert {"75-real", "80-real", "86-real", "89-real"} <= set(archs)
    assert any(not a.endswith("-real") for a in archs)        # PTX for GPUs newer than the list


def test_the_cuda_extra_provides_what_the_repair_leaves_out():
    """The run-time libraries excluded from a CUDA wheel (``.so.13``) are those of the major version the
    ``cuda`` extra pins, and the extra names NVIDIA's runtime and cuBLAS packages."""
    try:
        import tomllib
    except ImportError:
        pytest.skip("tomllib: Python 3.11+")
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["cuda"]
    pins = {re.match(r"[\w-]+", r).group(): r for r in extra}
    assert set(pins) == {"nvidia-cuda-runtime", "nvidia-cublas"}
    majors = {m.group(1) for r in extra for m in [re.search(r"==(\d+)\.\*", r)]}
    excluded = bw.BACKENDS["cuda"].excluded
    assert majors == {"13"} and {"libcudart.so.13", "libcublas.so.13", "libcublasLt.so.13"} <= set(excluded)
    assert "libcuda.so.1" in excluded            # the driver's, never a package's


# --- the wheel's contents ----------------------------------------------------------------------------

needs_toolchain = pytest.mark.skipif(not (shutil.which("cc") and shutil.which("readelf")),
                                     reason="a C compiler makes the small libraries, readelf reads them")


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    """Two small shared libraries: ``good`` needs libggml-base.so and finds it through $ORIGIN, ``stray``
    needs it with no rpath."""
    d = tmp_path_factory.mktemp("libs")
    (d / "base.c").write_text("int base_fn(void) { return 1; }\n")
    (d / "user.c").write_text("int base_fn(void);\nint user_fn(void) { return base_fn(); }\n")
    cc = ["cc", "-shared", "-fPIC", "-o"]
    subprocess.run([*cc, d / "libggml-base.so", d / "base.c"], check=True)
    subprocess.run([*cc, d / "good.so", d / "user.c", f"-L{d}", "-lggml-base", "-Wl,-rpath,$ORIGIN"], check=True)
    subprocess.run([*cc, d / "stray.so", d / "user.c", f"-L{d}", "-lggml-base"], check=True)
    return d


def _wheel(path: Path, members: dict) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for name, src in members.items():
            if src is None:
                z.writestr(name, b"")
            else:
                z.write(src, name)
    return path


def _portable(libs: Path, backend_lib: str | None = None, **extra) -> dict:
    members = {"ggmlpy/libggml-base.so": libs / "libggml-base.so",
               "ggmlpy/libggml-cpu-x64.so": libs / "good.so",
               "ggmlpy/libggml-cpu-haswell.so": libs / "good.so",
               "ggmlpy/libggml-rpc.so": libs / "good.so",
               "ggmlpy.libs/libgomp-f9a9ad78.so.1.0.0": None}          # what auditwheel copies in: fine
    if backend_lib:
        members[backend_lib] = libs / "good.so"
    return {**members, **extra}


@needs_toolchain
def test_a_portable_vulkan_wheel_passes_and_names_its_cpu_variants(libs, tmp_path):
    whl = _wheel(tmp_path / "v.whl", _portable(libs, "ggmlpy/libggml-vulkan.so"))
    assert bw.check_wheel(whl, "vulkan") == ["libggml-cpu-haswell.so", "libggml-cpu-x64.so"]
    assert bw.check_wheel(whl, "cpu") == ["libggml-cpu-haswell.so", "libggml-cpu-x64.so"]
    with pytest.raises(SystemExit, match="ggmlpy/libggml-cuda.so missing"):
        bw.check_wheel(whl, "cuda")


@needs_toolchain
@pytest.mark.parametrize("member", ["ggmlpy/libggml-cpu-haswell.so", "ggmlpy/libggml-vulkan.so"])
def test_a_library_that_does_not_find_libggml_base_is_refused(libs, tmp_path, member):
    whl = _wheel(tmp_path / "v.whl", {**_portable(libs, "ggmlpy/libggml-vulkan.so"), member: libs / "stray.so"})
    with pytest.raises(SystemExit, match=re.escape(f"{member} does not find libggml-base.so beside it (no rpath)")):
        bw.check_wheel(whl, "vulkan")


@needs_toolchain
def test_a_portable_wheel_without_its_rpc_backend_is_refused(libs, tmp_path):
    members = _portable(libs)
    del members["ggmlpy/libggml-rpc.so"]
    with pytest.raises(SystemExit, match="ggmlpy/libggml-rpc.so missing"):
        bw.check_wheel(_wheel(tmp_path / "c.whl", members), "cpu")


@needs_toolchain
@pytest.mark.parametrize("backend, grafted", [
    ("vulkan", "ggmlpy.libs/libvulkan-1a2b3c4d.so.1"),
    ("cuda", "ggmlpy.libs/libcudart-0e1f2a3b.so.13"),
    ("cuda", "ggmlpy.libs/libcublasLt-99aa00bb.so.13"),
    ("cuda", "ggmlpy.libs/libcuda-12345678.so.1"),
])
def test_a_library_left_to_the_users_system_must_not_be_copied_in(libs, tmp_path, backend, grafted):
    lib = bw.BACKENDS[backend].library
    whl = _wheel(tmp_path / "w.whl", _portable(libs, lib, **{grafted: None}))
    with pytest.raises(SystemExit, match=re.escape(f"holds {grafted}, which must come from the user's system")):
        bw.check_wheel(whl, backend)


def test_grafted_names_match_the_soname_only():
    names = ["ggmlpy.libs/libcublasLt-99aa00bb.so.13", "ggmlpy.libs/libcublas-0a0b0c0d.so.13",
             "ggmlpy.libs/libcublas-0a0b0c0d.so.12", "ggmlpy/libcublas.so.13"]
    assert bw._grafted(names, "libcublas.so.13") == ["ggmlpy.libs/libcublas-0a0b0c0d.so.13"]
    assert bw._grafted(names, "libcublasLt.so.13") == ["ggmlpy.libs/libcublasLt-99aa00bb.so.13"]
    assert bw._grafted(names, "libvulkan.so.1") == []


def test_the_cuda_extra_is_read_from_the_wheels_metadata(tmp_path):
    meta = ("Metadata-Version: 2.1\nName: ggmlpy\nVersion: 0.1.0\nRequires-Dist: numpy>=1.21\n"
            "Requires-Dist: pillow>=9; extra == \"vision\"\n"
            "Requires-Dist: nvidia-cuda-runtime==13.*; extra == \"cuda\"\n"
            "Requires-Dist: nvidia-cublas ==13.* ; extra == 'cuda'\n\nREADME text: Requires-Dist: x; extra == \"cuda\"\n")
    whl = tmp_path / "ggmlpy-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("ggmlpy-0.1.0.dist-info/METADATA", meta)
    assert bw.extra_requirements(whl, "cuda") == ["nvidia-cuda-runtime==13.*", "nvidia-cublas==13.*"]
    assert bw.extra_requirements(whl, "bench") == []


# --- before the build: the tools ---------------------------------------------------------------------

def test_a_vulkan_build_names_only_the_missing_apt_packages(tmp_path, monkeypatch):
    (tmp_path / "vulkan.h").write_text("")
    monkeypatch.setattr(bw, "VULKAN_PACKAGES", (("libvulkan-dev", str(tmp_path / "vulkan.h")),
                                                ("glslc", "no-such-glslc"),
                                                ("spirv-headers", str(tmp_path / "spirv.hpp"))))
    with pytest.raises(SystemExit, match=r"^--backend vulkan needs: apt-get install glslc spirv-headers$"):
        bw.check_build_tools("vulkan")
    bw.check_build_tools("cuda")            # its toolkit comes from the package index


def test_cuda_env_completes_an_installed_toolkit_and_exports_its_compiler(tmp_path, monkeypatch):
    """An installed toolkit (here a fake nvcc) is reused, not reinstalled; cuda_toolkit adds its links and
    the environment names its nvcc and root, shell quoting undone (a folder with a space)."""
    prefix = tmp_path / "cuda kit"
    root = prefix / "nvidia" / "cu13"
    (root / "bin").mkdir(parents=True)
    (root / "lib").mkdir()
    (root / "lib" / "libcudart.so.13").write_text("")
    nvcc = root / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver'\necho 'Build cuda_13.0.r13.0'\n")
    nvcc.chmod(0o755)
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import cuda_toolkit
    monkeypatch.setattr(cuda_toolkit, "install", lambda *a: pytest.fail("reinstalled an installed toolkit"))
    env = bw.cuda_env(prefix)
    assert env == {"CUDACXX": str(nvcc), "CUDAToolkit_ROOT": str(root)}
    assert os.readlink(root / "lib64") == "lib" and os.readlink(root / "lib" / "libcudart.so") == "libcudart.so.13"


# --- the installed wheel: what ggmlpy info lists -----------------------------------------------------

def _info(backends, devices=(), variant=("haswell", "/x/libggml-cpu-haswell.so")):
    return {"backends": list(backends), "cpu_variant": variant,
            "devices": [{"name": n, "backend": b, "description": d} for n, b, d in devices]}


CPU = ("CPU", "CPU", "AMD EPYC")
LLVMPIPE = ("Vulkan0", "Vulkan", "llvmpipe (LLVM 15.0.6, 256 bits)")


def test_vulkan_on_lavapipe_must_show_llvmpipe_as_vulkan0():
    ok = _info(["Vulkan", "RPC", "CPU"], [LLVMPIPE, CPU])
    assert bw.check_info(ok, "vulkan", lavapipe=True) == \
        "Vulkan backend loaded; Vulkan devices: Vulkan0 (llvmpipe (LLVM 15.0.6, 256 bits))"
    with pytest.raises(SystemExit, match=r"lavapipe is installed but Vulkan0 is not its llvmpipe \(Vulkan devices: none\)"):
        bw.check_info(_info(["Vulkan", "RPC", "CPU"], [CPU]), "vulkan", lavapipe=True)
    other = _info(["Vulkan", "CPU"], [("Vulkan0", "Vulkan", "NVIDIA H100"), CPU])
    with pytest.raises(SystemExit, match="not its llvmpipe"):
        bw.check_info(other, "vulkan", lavapipe=True)
    # no software driver to rely on: the backend loading is what is checked
    assert bw.check_info(_info(["Vulkan", "CPU"], [CPU]), "vulkan") == "Vulkan backend loaded; Vulkan devices: none"


def test_a_backend_that_did_not_load_fails():
    with pytest.raises(SystemExit, match=r"does not list the Vulkan backend \(backends: RPC, CPU\)"):
        bw.check_info(_info(["RPC", "CPU"], [CPU]), "vulkan", lavapipe=True)
    with pytest.raises(SystemExit, match="does not list the CUDA backend"):
        bw.check_info(_info(["RPC", "CPU"], [CPU]), "cuda")


def test_cuda_without_a_driver_loads_and_lists_no_device():
    assert bw.check_info(_info(["CUDA", "RPC", "CPU"], [CPU]), "cuda", nvidia=False) == \
        "CUDA backend loaded; CUDA devices: none"
    h100 = _info(["CUDA", "RPC", "CPU"], [("CUDA0", "CUDA", "NVIDIA H100 80GB HBM3"), CPU])
    assert bw.check_info(h100, "cuda", nvidia=True).endswith("CUDA0 (NVIDIA H100 80GB HBM3)")
    with pytest.raises(SystemExit, match="an NVIDIA driver is loaded but ggmlpy lists no CUDA device"):
        bw.check_info(_info(["CUDA", "RPC", "CPU"], [CPU]), "cuda", nvidia=True)


def test_a_portable_wheel_must_have_loaded_a_cpu_variant():
    with pytest.raises(SystemExit, match="names no CPU variant"):
        bw.check_info(_info(["CPU"], [CPU], variant=None), "cpu")
    assert bw.check_info(_info(["CPU"], [CPU], variant=None), "cpu", portable=False).startswith("CPU backend loaded")


def test_lavapipe_is_found_where_the_loader_would_look(tmp_path, monkeypatch):
    icd = tmp_path / "lvp_icd.x86_64.json"
    monkeypatch.setenv("VK_DRIVER_FILES", f"{tmp_path / 'nvidia_icd.json'}{os.pathsep}{icd}")
    assert bw.lavapipe_driver() == icd
    monkeypatch.setenv("VK_DRIVER_FILES", str(tmp_path / "radeon_icd.json"))
    assert bw.lavapipe_driver() is None
    monkeypatch.delenv("VK_DRIVER_FILES")
    monkeypatch.delenv("VK_ICD_FILENAMES", raising=False)
    monkeypatch.setattr(bw, "VULKAN_ICD_DIRS", (str(tmp_path),))
    assert bw.lavapipe_driver() is None
    (tmp_path / "intel_icd.json").write_text("{}")
    icd.write_text("{}")
    assert bw.lavapipe_driver() == icd


def test_the_tool_runs_on_linux_only(monkeypatch, capsys):
    monkeypatch.setattr(sys, "platform", "darwin")
    assert bw.main(["--backend", "vulkan"]) == 2
    assert "Linux only" in capsys.readouterr().err
