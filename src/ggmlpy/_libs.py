"""Import ``_core``, finding the CUDA libraries of a CUDA build in NVIDIA's pip packages.

A CUDA build's ``libggml-cuda.so`` needs ``libcudart`` and ``libcublas``. A
system CUDA on the loader's path is used as it is. Otherwise they come from
NVIDIA's wheels (``pip install 'ggmlpy[cuda]'``: ``nvidia-cuda-runtime`` and
``nvidia-cublas``, which install into ``site-packages/nvidia/cu13/lib``; the
CUDA 12 wheels into ``nvidia/cuda_runtime/lib`` and ``nvidia/cublas/lib``).
An rpath to ``$ORIGIN/../nvidia/...`` would only find them when both packages
sit in the same site-packages; searching ``sys.path`` also covers user sites,
``--system-site-packages`` venvs and ``--target`` folders. So: try the import,
and when the loader names a missing library, load that one file from the first
``sys.path`` entry that has it (``RTLD_GLOBAL``, so the retried import's loader
finds it by its soname), then retry. A CPU build never gets here.
"""

from __future__ import annotations

import ctypes
import glob
import importlib
import os
import re
import sys
from types import ModuleType

_MISSING = re.compile(r"(lib[\w.+-]+?\.so(?:\.\d+)*): cannot open shared object file")
# Only NVIDIA's libraries are looked for in NVIDIA's packages.
_NVIDIA = re.compile(r"lib(cudart|cublas|cublasLt|nvJitLink|nvrtc)\.so")
_loaded: list[ctypes.CDLL] = []     # kept for the life of the process, as the loader would


def _find_in_nvidia_packages(soname: str) -> str | None:
    for entry in sys.path:
        hits = sorted(glob.glob(os.path.join(entry or ".", "nvidia", "*", "lib", soname)))
        if hits:
            return hits[0]
    return None


def _with_nvidia_libraries(load, what: str):
    """``load()``, retried after loading each missing NVIDIA library it names from NVIDIA's wheels."""
    tried: set[str] = set()
    while True:
        try:
            return load()
        except (ImportError, OSError) as e:      # the import system says ImportError, ctypes OSError
            m = _MISSING.search(str(e))
            if m is None or not _NVIDIA.match(m.group(1)) or m.group(1) in tried:
                raise
            soname = m.group(1)
            tried.add(soname)
            path = _find_in_nvidia_packages(soname)
            if path is None:
                raise ImportError(
                    f"ggmlpy was built with CUDA and {what} needs {soname}, which neither the system's "
                    f"library path nor NVIDIA's pip packages on sys.path have: "
                    f"pip install 'ggmlpy[cuda]' (nvidia-cuda-runtime, nvidia-cublas of the CUDA "
                    f"version it was built with), or add a CUDA toolkit's lib folder to "
                    f"LD_LIBRARY_PATH ({e})") from e
            _loaded.append(ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL))


def import_core(here: str | None = None) -> ModuleType:
    """``import ggmlpy._core``, loading missing CUDA libraries from NVIDIA's wheels first.

    A portable build (``GGML_BACKEND_DL``: CPU variants ``libggml-cpu-*.so`` beside ``_core``) does not
    link ``libggml-cuda.so`` into ``_core``: ggml loads it at import and silently drops it when its CUDA
    libraries are missing. So in such a build that module is loaded here first, through the same search.
    """
    here = here or os.path.dirname(os.path.abspath(__file__))
    if glob.glob(os.path.join(here, "libggml-cpu-*.so")):
        for module in sorted(glob.glob(os.path.join(here, "libggml-cuda*.so"))):
            _loaded.append(_with_nvidia_libraries(lambda m=module: ctypes.CDLL(m), os.path.basename(module)))
    return _with_nvidia_libraries(lambda: importlib.import_module("ggmlpy._core"), "ggmlpy._core")


import_core()
