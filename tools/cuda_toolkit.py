"""Install a CUDA toolkit from PyPI wheels into one folder CMake can build with.

    python tools/cuda_toolkit.py /opt/cuda-pip              # install, then print the env to export
    eval "$(python tools/cuda_toolkit.py /opt/cuda-pip --env)"
    CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90" pip install ".[cuda]"

Why CUDA 13: the ``*-cu12`` nvcc wheels hold only ptxas and libnvvm (no nvcc
driver, cicc, cudafe++, fatbinary or nvlink), so nothing can compile with them.
The CUDA 13 wheels (``nvidia-cuda-nvcc``, ``-crt``, ``nvidia-nvvm``, ...) hold
the whole compiler and all install into one ``nvidia/cu13`` folder laid out
like a toolkit (bin, include, lib, nvvm). Two things are missing for a build,
and this script adds them as symlinks inside its own folder:

- ``lib64 -> lib``: nvcc.profile links from ``$(TOP)/lib64`` (CMake's compiler
  check fails with "cannot find -lcudart_static" without it);
- ``libcudart.so``/``libcublas.so``/``libcublasLt.so`` -> ``*.so.13``: the wheels
  ship only the versioned names and FindCUDAToolkit looks for the plain ones.

The toolkit goes into a folder of its own (``pip install --target``) rather
than into the environment, so those symlinks never land in a pip-managed tree.
The wheels have no libcuda stub either; CMakeLists.txt then builds without
CUDA VMM (GGML_CUDA_NO_VMM). At run time ggmlpy needs only libcudart and
libcublas, which come from the ``cuda`` extra (``pip install ggmlpy[cuda]``)
or a system CUDA; see docs/install.md, "CUDA".
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

# One minor line for every wheel: nvcc 13.0 with 13.0 headers and libraries.
# 13.0 runs on every r580+ driver (CUDA's minor-version compatibility).
CUDA_LINE = "13.0"
PACKAGES = (
    "nvidia-cuda-nvcc",     # nvcc, ptxas, fatbinary, nvlink, cudafe++
    "nvidia-cuda-crt",      # nvcc's crt/ headers
    "nvidia-nvvm",          # cicc and libdevice
    "nvidia-cuda-runtime",  # cudart headers and libraries
    "nvidia-cublas",        # cuBLAS headers and libraries
    "nvidia-cuda-cccl",     # CUB/Thrust/libcu++ headers (ggml-cuda includes cub)
)
# The libraries FindCUDAToolkit finds by their unversioned name.
LINK_NAMES = ("libcudart.so", "libcublas.so", "libcublasLt.so")


def toolkit_root(prefix: Path) -> Path:
    return prefix / "nvidia" / "cu13"


def install(prefix: Path, line: str) -> None:
    reqs = [f"{p}=={line}.*" for p in PACKAGES]
    cmd = [sys.executable, "-m", "pip", "install", "--upgrade", "--target", str(prefix), *reqs]
    print("+", shlex.join(cmd), file=sys.stderr)
    subprocess.run(cmd, check=True)


def complete(root: Path) -> None:
    """Add the symlinks a build needs that the wheels leave out (idempotent)."""
    lib = root / "lib"
    if not (lib / "libcudart.so.13").exists():
        raise SystemExit(f"{lib}: no libcudart.so.13; is this a CUDA 13 wheel install?")
    lib64 = root / "lib64"
    if not lib64.exists():
        lib64.symlink_to("lib")
    for name in LINK_NAMES:
        versioned = sorted(lib.glob(name + ".*"))
        link = lib / name
        if versioned and not link.exists():
            link.symlink_to(versioned[0].name)


def check(root: Path) -> str:
    out = subprocess.run([str(root / "bin" / "nvcc"), "--version"], check=True,
                         capture_output=True, text=True).stdout
    return out.strip().splitlines()[-1]


def env_lines(root: Path) -> list[str]:
    # CUDACXX picks the compiler for enable_language(CUDA); CUDAToolkit_ROOT (read
    # from the environment by FindCUDAToolkit) makes ggml find the same toolkit's
    # headers and libraries, not some other CUDA on PATH.
    return [
        f"export CUDACXX={shlex.quote(str(root / 'bin' / 'nvcc'))}",
        f"export CUDAToolkit_ROOT={shlex.quote(str(root))}",
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("prefix", type=Path, help="folder to install the toolkit into (about 1 GB)")
    ap.add_argument("--cuda", default=CUDA_LINE, help=f"CUDA minor line of the wheels (default {CUDA_LINE})")
    ap.add_argument("--env", action="store_true",
                    help="only print the export lines for an existing install (for eval)")
    args = ap.parse_args(argv)
    prefix = args.prefix.resolve()
    root = toolkit_root(prefix)
    if not args.env:
        install(prefix, args.cuda)
    if not (root / "bin" / "nvcc").exists():
        raise SystemExit(f"{root}: no bin/nvcc (run without --env to install)")
    complete(root)
    if not args.env:
        print(f"# {check(root)} in {root}; export the lines below, then build, e.g.\n"
              f"# CMAKE_ARGS=\"-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90\" pip install \".[cuda]\"",
              file=sys.stderr)
    print("\n".join(env_lines(root)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
