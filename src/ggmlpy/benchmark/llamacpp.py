"""The peer engine of ``--vs llama.cpp``: llama.cpp through llama-cpp-python's low-level API (:class:`LlamaCppEngine`).

It runs only in the worker process (:mod:`.worker`): llama-cpp-python and
ggmlpy each ship a ``libggml-base.so`` with the same soname, which must never
share a process. So this module imports nothing from ggmlpy, and imports
``llama_cpp`` only when an engine is made (the driver imports this module too,
through the package, but never makes one).

Image tests (``-i``) go through llama.cpp's ``mtmd`` library (``libmtmd``, whose bindings
llama-cpp-python ships as ``llama_cpp.mtmd_cpp``), as ``llama-mtmd-cli`` and ``llama-server`` encode
images: an mtmd context per test (the test's threads and flash attention), the image tokenized once
(``mtmd_tokenize``: resize, and slices for idefics3, untimed), then every image chunk encoded
(``mtmd_encode_chunk``) and its embeddings copied out (``mtmd_get_output_embd``). A llama-cpp-python
without a usable ``libmtmd`` makes them :class:`~.errors.UnsupportedTest`, reported as skipped.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import platform
from typing import Any, Callable

import numpy as np

from .engines import Engine
from .errors import BenchError, UnsupportedTest
from .results import Instance

__all__ = ["LlamaCppEngine"]


def _cpu_model_name() -> str:
    # ggmlpy._system.cpu_model_name's twin: this module must not import ggmlpy (see above)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


#: llama-bench's --n-cpu-moe override per layer (ggmlpy.backend.N_CPU_MOE_PATTERN's twin: no ggmlpy here)
_N_CPU_MOE_PATTERN = r"blk\.{}\.ffn_(up|down|gate|gate_up)_(ch|)exps"


class _BuftOverride(ctypes.Structure):
    """llama.cpp's ``struct llama_model_tensor_buft_override``."""
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


class LlamaCppEngine(Engine):
    """llama.cpp through llama-cpp-python's low-level API (run only in a worker process)."""

    name = "llama.cpp"
    # ggml_type's values for the cache types (ggmlpy.kvcache.CACHE_TYPES's names; not imported: no ggmlpy here)
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
        self.verbose = verbose
        self.mt: Any = None                  # llama_cpp.mtmd_cpp, imported by the first image test
        self.mctx: Any = None                # an image test's mtmd context, its input chunks and bitmap
        self._chunks: Any = None
        self._bitmap: Any = None
        self._image_chunks: list[tuple[Any, int]] = []
        self._n_embd = 0
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
        mp.split_mode = {"none": 0, "layer": 1}[inst.split_mode]     # llama.cpp's enum llama_split_mode
        mp.main_gpu = inst.main_gpu
        if inst.tensor_split:
            self._tensor_split = (ctypes.c_float * len(inst.tensor_split))(*inst.tensor_split)  # alive while loading
            mp.tensor_split = self._tensor_split
        self._set_overrides(mp, inst)
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

    def _set_overrides(self, mp: Any, inst: Instance) -> None:
        """``-ot`` and ``-ncmoe`` as llama-bench sets them: ``tensor_buft_overrides``, an array of (pattern,
        buffer type) ended by a null pair, the buffer types looked up by name (a device's own buffer type,
        as llama-bench lists them; ggmlpy also takes the device's name: the same for CPU, CUDA0, Vulkan0)."""
        pairs = []
        if inst.tensor_buft_overrides != "none":
            pairs = [tuple(x.split("=", 1)) for x in inst.tensor_buft_overrides.split(";")]
        pairs += [(_N_CPU_MOE_PATTERN.format(i), "CPU") for i in range(min(inst.n_cpu_moe, 1024))]
        if not pairs:
            return
        if not hasattr(mp, "tensor_buft_overrides"):
            raise UnsupportedTest(f"llama_cpp {self.version} takes no tensor overrides")
        # llama-cpp-python binds no ggml_backend_* function; its libggml (loaded with libllama) has them
        ggml = ctypes.CDLL(os.path.join(os.path.dirname(self.ll.__file__), "lib", "libggml.so"))
        for f, res, args in (("ggml_backend_dev_count", ctypes.c_size_t, []),
                             ("ggml_backend_dev_get", ctypes.c_void_p, [ctypes.c_size_t]),
                             ("ggml_backend_dev_buffer_type", ctypes.c_void_p, [ctypes.c_void_p]),
                             ("ggml_backend_buft_name", ctypes.c_char_p, [ctypes.c_void_p])):
            getattr(ggml, f).restype, getattr(ggml, f).argtypes = res, args
        bufts = {}
        for i in range(ggml.ggml_backend_dev_count()):
            buft = ggml.ggml_backend_dev_buffer_type(ggml.ggml_backend_dev_get(i))
            if buft:
                bufts[ggml.ggml_backend_buft_name(buft).decode().lower()] = buft
        arr = (_BuftOverride * (len(pairs) + 1))()
        for k, (pattern, name) in enumerate(pairs):
            if name.strip().lower() not in bufts:
                raise BenchError(f"-ot {pattern}={name}: llama.cpp has no buffer type {name!r} "
                                 f"(it has: {', '.join(sorted(bufts))})")
            arr[k].pattern, arr[k].buft = pattern.encode(), bufts[name.strip().lower()]
        self._overrides = arr            # alive while the model loads (llama.cpp reads it then)
        mp.tensor_buft_overrides = ctypes.cast(arr, ctypes.c_void_p)

    def unload(self) -> None:
        self.free_context()
        if self.model is not None:
            self._fn("llama_model_free", "llama_free_model")(self.model)
            self.model = None

    def new_context(self, inst: Instance) -> None:
        ll = self.ll
        self.free_context()
        if inst.n_images > 0:
            self._new_mtmd(inst)
            return
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
        if hasattr(cp, "op_offload"):
            cp.op_offload = not inst.no_op_offload
        cp.embeddings = inst.embeddings
        init = self._fn("llama_init_from_model", "llama_new_context_with_model")
        self.ctx = init(self.model, cp)
        if not self.ctx:
            raise BenchError("llama.cpp failed to create the context")
        self._tok = None

    def free_context(self) -> None:
        self._free_mtmd()
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

    # ------------------------------------------------------------------ images (mtmd)

    _MTMD_FUNCTIONS = ("mtmd_context_params_default", "mtmd_init_from_file", "mtmd_free", "mtmd_default_marker",
                       "mtmd_bitmap_init", "mtmd_bitmap_free", "mtmd_input_chunks_init", "mtmd_input_chunks_free",
                       "mtmd_input_chunks_size", "mtmd_input_chunks_get", "mtmd_input_chunk_get_type",
                       "mtmd_input_chunk_get_n_tokens", "mtmd_input_text", "mtmd_bitmap_p_ctypes", "mtmd_tokenize",
                       "mtmd_encode_chunk", "mtmd_get_output_embd")

    def _mtmd(self) -> Any:
        """llama_cpp.mtmd_cpp (loading libmtmd), or UnsupportedTest saying why it cannot be used."""
        if self.mt is not None:
            return self.mt
        mt = getattr(self.ll, "mtmd_cpp", None)
        if mt is None:
            try:
                mt = importlib.import_module("llama_cpp.mtmd_cpp")
            except Exception as e:          # ImportError, or OSError/AttributeError from loading the library
                raise UnsupportedTest(f"image tests need llama.cpp's libmtmd, which llama_cpp {self.version} "
                                      f"cannot load ({type(e).__name__}: {e})") from None
        missing = [n for n in self._MTMD_FUNCTIONS if not hasattr(mt, n)]
        if missing:
            raise UnsupportedTest(f"image tests need llama.cpp's libmtmd; llama_cpp {self.version}'s mtmd_cpp has "
                                  f"no {', '.join(missing)}")
        if not self.verbose and hasattr(mt, "mtmd_log_set"):
            mt.mtmd_log_set(self._log_cb, None)           # the encoder's own log (clip, mtmd)
            if hasattr(mt, "mtmd_helper_log_set"):
                mt.mtmd_helper_log_set(self._log_cb, None)
        self.mt = mt
        return mt

    def _new_mtmd(self, inst: Instance) -> None:
        mt = self._mtmd()
        mp = mt.mtmd_context_params_default()
        mp.n_threads = inst.n_threads
        mp.print_timings = False
        # the encoder where ggmlpy's goes: beside the output layer, on the CPU with -ngl 0 or -dev none
        # (a llama.cpp built without a GPU backend runs it on the CPU either way)
        mp.use_gpu = inst.devices != "none" and inst.n_gpu_layers != 0
        if hasattr(mp, "flash_attn_type"):          # llama_flash_attn_type: -1 auto, 0 off, 1 on, as -fa
            mp.flash_attn_type = inst.flash_attn
        self.mctx = mt.mtmd_init_from_file(inst.mmproj.encode(), self.model, mp)
        if not self.mctx:
            raise BenchError(f"llama.cpp (mtmd) failed to load the mmproj {inst.mmproj} for {inst.model} "
                             "(run with -v for its log)")

    def prepare_images(self, inst: Instance, image: np.ndarray) -> tuple[int, int]:
        mt = self.mt
        ny, nx = image.shape[:2]
        data = np.ascontiguousarray(image, dtype=np.uint8).tobytes()
        self._bitmap = mt.mtmd_bitmap_init(nx, ny, (ctypes.c_uint8 * len(data)).from_buffer_copy(data))
        self._chunks = mt.mtmd_input_chunks_init()
        if not self._bitmap or not self._chunks:
            raise BenchError("llama.cpp (mtmd): could not allocate the image")
        marker = mt.mtmd_default_marker()
        text = mt.mtmd_input_text(text=marker, text_len=len(marker), add_special=False, parse_special=True)
        bitmaps = (mt.mtmd_bitmap_p_ctypes * 1)(self._bitmap)
        rc = mt.mtmd_tokenize(self.mctx, self._chunks, ctypes.byref(text), bitmaps, 1)
        if rc != 0:
            raise BenchError(f"llama.cpp (mtmd): mtmd_tokenize failed ({rc})")
        image_type = getattr(mt, "MTMD_INPUT_CHUNK_TYPE_IMAGE", 1)
        chunks = [mt.mtmd_input_chunks_get(self._chunks, i) for i in range(mt.mtmd_input_chunks_size(self._chunks))]
        self._image_chunks = [(c, int(mt.mtmd_input_chunk_get_n_tokens(c))) for c in chunks
                              if mt.mtmd_input_chunk_get_type(c) == image_type]
        if not self._image_chunks:
            raise BenchError("llama.cpp (mtmd): the image gave no image chunk")
        ll = self.ll
        self._n_embd = int((getattr(ll, "llama_model_n_embd_inp", None) or ll.llama_model_n_embd)(self.model))
        # one chunk per tile (idefics3: a chunk per slice, then the overview image)
        return len(self._image_chunks), sum(n for _, n in self._image_chunks)

    def encode_images(self, n: int) -> None:
        mt, n_embd = self.mt, self._n_embd
        for _ in range(n):
            for chunk, n_tokens in self._image_chunks:
                rc = mt.mtmd_encode_chunk(self.mctx, chunk)
                if rc != 0:
                    raise BenchError(f"llama.cpp (mtmd): mtmd_encode_chunk failed ({rc})")
                out = mt.mtmd_get_output_embd(self.mctx)
                if not out:
                    raise BenchError("llama.cpp (mtmd): no output embeddings")
                np.ctypeslib.as_array(out, shape=(n_tokens * n_embd,)).copy()    # read, as ggmlpy's output is

    def _free_mtmd(self) -> None:
        mt = self.mt
        self._image_chunks = []
        if self._chunks:
            mt.mtmd_input_chunks_free(self._chunks)
        if self._bitmap:
            mt.mtmd_bitmap_free(self._bitmap)
        if self.mctx:
            mt.mtmd_free(self.mctx)
        self._chunks = self._bitmap = self.mctx = None
