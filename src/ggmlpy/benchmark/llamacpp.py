"""The peer engine of ``--vs llama.cpp``: llama.cpp through llama-cpp-python's low-level API (:class:`LlamaCppEngine`).

It runs only in the worker process (:mod:`.worker`): llama-cpp-python and
ggmlpy each ship a ``libggml-base.so`` with the same soname, which must never
share a process. So this module imports nothing from ggmlpy, and imports
``llama_cpp`` only when an engine is made (the driver imports this module too,
through the package, but never makes one).
"""

from __future__ import annotations

import ctypes
import platform
from typing import Any, Callable

import numpy as np

from .engines import Engine
from .errors import BenchError
from .results import Instance

__all__ = ["LlamaCppEngine"]


def _cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class LlamaCppEngine(Engine):
    """llama.cpp through llama-cpp-python's low-level API (run only in a worker process)."""

    name = "llama.cpp"
    _GGML_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8,
                   "iq4_nl": 20, "bf16": 30}

    def __init__(self, verbose: bool = False) -> None:
        super().__init__()
        # here, not at the top: llama_cpp is optional, and loads llama.cpp's ggml, which the driver process (which
        # imports this module with the package) must never hold
        import llama_cpp

        self.ll = llama_cpp
        self.version = getattr(llama_cpp, "__version__", "")
        self.model: Any = None
        self.ctx: Any = None
        if not verbose:
            # Keep a reference: ctypes callbacks must outlive their registration.
            self._log_cb = llama_cpp.llama_log_callback(lambda level, text, data: None)
            llama_cpp.llama_log_set(self._log_cb, None)
        llama_cpp.llama_backend_init()

    def _fn(self, *names: str) -> Callable:
        for n in names:
            f = getattr(self.ll, n, None)
            if f is not None:
                return f
        raise BenchError(f"llama_cpp {self.version} has none of {', '.join(names)}")

    def system(self) -> dict[str, Any]:
        return {"build_commit": f"llama-cpp-python {self.version}", "build_number": 0,
                "cpu_info": _cpu_model_name(), "gpu_info": ""}

    def load(self, inst: Instance) -> None:
        ll = self.ll
        mp = ll.llama_model_default_params()
        mp.n_gpu_layers = inst.n_gpu_layers if inst.n_gpu_layers >= 0 else 999
        if inst.devices not in ("auto", "none"):
            raise BenchError("-dev with explicit devices is not supported for llama.cpp here")
        if inst.devices == "none":
            mp.n_gpu_layers = 0
        if hasattr(mp, "load_mode"):        # llama.cpp's enum llama_load_mode (it replaced use_mmap)
            mp.load_mode = {"none": getattr(ll, "LLAMA_LOAD_MODE_NONE", 0),
                            "mmap": getattr(ll, "LLAMA_LOAD_MODE_MMAP", 1)}[inst.load_mode]
        else:
            mp.use_mmap = inst.load_mode == "mmap"
        if hasattr(mp, "use_extra_bufts"):
            mp.use_extra_bufts = inst.repack
        elif not inst.repack:
            raise BenchError(f"--repack 0: llama_cpp {self.version} cannot keep weights out of the extra buffer types")
        load = self._fn("llama_model_load_from_file", "llama_load_model_from_file")
        self.model = load(inst.model.encode(), mp)
        if not self.model:
            raise BenchError(f"llama.cpp failed to load {inst.model}")
        buf = ctypes.create_string_buffer(256)
        ll.llama_model_desc(self.model, buf, 256)
        if hasattr(ll, "llama_model_get_vocab") and hasattr(ll, "llama_vocab_n_tokens"):
            n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.model))
        else:
            n_vocab = ll.llama_n_vocab(self.model)
        gpu = bool(getattr(ll, "llama_supports_gpu_offload", lambda: False)())
        self.info = {"desc": buf.value.decode(errors="replace"),
                     "size": int(ll.llama_model_size(self.model)),
                     "n_params": int(ll.llama_model_n_params(self.model)),
                     "n_vocab": int(n_vocab), "backends": "GPU" if gpu else "CPU"}

    def unload(self) -> None:
        self.free_context()
        if self.model is not None:
            self._fn("llama_model_free", "llama_free_model")(self.model)
            self.model = None

    def new_context(self, inst: Instance) -> None:
        ll = self.ll
        self.free_context()
        cp = ll.llama_context_default_params()
        cp.n_ctx = inst.n_ctx
        cp.n_batch = inst.n_batch
        cp.n_ubatch = inst.n_ubatch
        cp.n_seq_max = 1
        cp.n_threads = inst.n_threads
        cp.n_threads_batch = inst.n_threads
        cp.type_k = self._GGML_TYPES[inst.type_k]
        cp.type_v = self._GGML_TYPES[inst.type_v]
        if hasattr(cp, "flash_attn_type"):
            cp.flash_attn_type = inst.flash_attn
        elif hasattr(cp, "flash_attn"):
            cp.flash_attn = inst.flash_attn == 1
        if hasattr(cp, "swa_full"):
            cp.swa_full = False
        cp.offload_kqv = not inst.no_kv_offload
        cp.embeddings = inst.embeddings
        init = self._fn("llama_init_from_model", "llama_new_context_with_model")
        self.ctx = init(self.model, cp)
        if not self.ctx:
            raise BenchError("llama.cpp failed to create the context")
        self._tok = None

    def free_context(self) -> None:
        if self.ctx is not None:
            self.ll.llama_free(self.ctx)
            self.ctx = None

    def clear(self) -> None:
        ll = self.ll
        if hasattr(ll, "llama_memory_clear") and hasattr(ll, "llama_get_memory"):
            ll.llama_memory_clear(ll.llama_get_memory(self.ctx), False)
        elif hasattr(ll, "llama_kv_self_clear"):
            ll.llama_kv_self_clear(self.ctx)
        else:
            ll.llama_kv_cache_clear(self.ctx)

    def decode(self, tokens: np.ndarray) -> None:
        ll = self.ll
        n = len(tokens)
        arr = (ll.llama_token * n)(*tokens.tolist())
        rc = ll.llama_decode(self.ctx, ll.llama_batch_get_one(arr, n))
        if rc != 0:
            raise BenchError(f"llama_decode failed ({rc})")
        ll.llama_synchronize(self.ctx)
