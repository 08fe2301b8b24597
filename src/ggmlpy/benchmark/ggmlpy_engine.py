"""The engine under test: ggmlpy's model loader and :class:`~ggmlpy.runner.Runner` (:class:`GgmlpyEngine`).

Image tests load the model with its vision encoder (``load_model(path, mmproj=...)``) and encode with
:meth:`Runner.encode_image <ggmlpy.runner.Runner.encode_image>`, the runner's own path: the encoder graph
of one image's tiles built, its pixels set, computed by the runner's scheduler (with the test's threads)
and its output read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ggmlpy._core import GGMLValueError
from ggmlpy._core import devices as _devices
from ggmlpy._system import ggml_commit
from ggmlpy._version import __version__
from ggmlpy.backend import choose_devices, main_accelerator, parse_tensor_overrides
from ggmlpy.load import load_model
from ggmlpy.runner import Runner

from .engines import Engine
from .errors import BenchError
from .results import AUTO_NGL, Instance

__all__ = ["GgmlpyEngine", "has_gpu"]


def _kind(d: Any) -> str:
    """A device's type name in upper case (``CPU``, ``GPU``, ``IGPU``, ``ACCEL``)."""
    return getattr(d.type, "name", str(d.type)).upper()


def has_gpu(local: bool = False) -> bool:
    """Whether ggml has a GPU device (the table then shows llama-bench's ``ngl`` column); ``local``: one
    that is not an RPC server's (which "auto" placement only takes when ``-rpc`` names it)."""
    return any("GPU" in _kind(d) and (not local or d.endpoint is None) for d in _devices())


class GgmlpyEngine(Engine):
    """ggmlpy's llama model and runner."""

    name = "ggmlpy"

    def __init__(self, rpc: list[str] | None = None, kernels: str | None = None,
                 vision_precision: str = "exact") -> None:
        super().__init__()
        self.rpc = list(rpc or [])           # -rpc servers: "auto" device choice takes only those named
        self.kernels = kernels               # --kernels: the runners' own-kernel mode
        self.vision_precision = vision_precision     # --vision-precision: the encoder's numerics (-i)
        self.kernel_notes: dict[str, None] = {}     # each distinct choice's footnote, in order
        self.version = __version__
        self.model: Any = None
        self.rt: Any = None
        self.embeddings = False
        self.pixels: Any = None     # an image test's PreprocessedImage

    def system(self) -> dict[str, Any]:
        cpu, gpu = [], []
        for d in _devices():
            kind = _kind(d)
            (gpu if "GPU" in kind else cpu if kind in ("CPU", "ACCEL") else []).append(d.description)
        return {"build_commit": ggml_commit(), "build_number": 0,
                "cpu_info": ", ".join(cpu), "gpu_info": ", ".join(gpu)}

    def load(self, inst: Instance) -> None:
        devices: Any = {"auto": "auto", "none": "cpu"}.get(inst.devices, inst.devices.split("/"))
        kw: dict[str, Any] = {"n_gpu_layers": inst.n_gpu_layers}
        rpc = self.rpc
        if inst.split_mode == "none":
            # llama.cpp's -sm none: every offloaded layer on the one accelerator -mg names
            try:
                devices = main_accelerator(devices, inst.main_gpu, rpc=self.rpc)
            except GGMLValueError as e:
                raise BenchError(str(e)) from None
            rpc = ()                # the servers are added; naming them again would add every one
        if inst.n_gpu_layers == AUTO_NGL:
            # fitted to this test's runner (Instance.model_key reloads for another one)
            kw = {"n_gpu_layers": "auto", "n_ctx": inst.n_ctx, "n_batch": inst.n_batch, "n_ubatch": inst.n_ubatch,
                  "type_k": inst.type_k, "type_v": inst.type_v,
                  "flash_attn": None if inst.flash_attn < 0 else bool(inst.flash_attn)}
        if inst.tensor_split:
            kw["tensor_split"] = list(inst.tensor_split)
        if inst.tensor_buft_overrides != "none":
            try:        # (after the RPC servers are added: an override may name their devices)
                choose_devices("cpu", rpc=rpc)
                kw["tensor_overrides"] = parse_tensor_overrides(inst.tensor_buft_overrides.split(";"), "-ot")
            except GGMLValueError as e:
                raise BenchError(str(e)) from None
        self.model = load_model(inst.model, devices=devices, rpc=rpc, mmap=inst.load_mode == "mmap",
                                repack=inst.repack, mmproj=inst.mmproj or None, n_cpu_moe=inst.n_cpu_moe,
                                vision_precision=self.vision_precision, **kw)
        m = self.model
        self.info = {"desc": m.desc, "size": int(m.size), "n_params": int(m.n_params),
                     "n_vocab": int(m.n_vocab), "backends": m.backend_names}
        vision = getattr(m, "vision", None)
        if vision is not None:
            self.info["image_size"] = int(vision.config.image_size)

    def unload(self) -> None:
        self.free_context()
        if self.model is not None:
            self.model.close()
            self.model = None

    def new_context(self, inst: Instance) -> None:
        self.free_context()
        fa = None if inst.flash_attn < 0 else bool(inst.flash_attn)
        n_ctx, n_batch, n_ubatch = inst.n_ctx, inst.n_batch, inst.n_ubatch
        if inst.n_images > 0:
            # encoding needs no text context: the smallest the runner takes with an encoder (one image
            # tile in a micro-batch); its reservation still covers the encoder graph of the largest image
            n_ctx = n_batch = n_ubatch = self._vision(inst).config.tokens_per_image
        self.rt = Runner(self.model, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch,
                         n_seq_max=1, n_threads=inst.n_threads, flash_attn=fa,
                         type_k=inst.type_k, type_v=inst.type_v, offload_kqv=not inst.no_kv_offload,
                         op_offload=not inst.no_op_offload,
                         kernels=self.kernels)
        self.kernel_notes.setdefault(f"{Path(inst.model).name}: {self.rt.kernels.describe()}", None)
        self.embeddings = inst.embeddings

    def free_context(self) -> None:
        self.pixels = None
        if self.rt is not None:
            self.rt.close()
            self.rt = None

    def _vision(self, inst: Instance) -> Any:
        vision = getattr(self.model, "vision", None)
        if vision is None:
            raise BenchError(f"{inst.name}: {inst.model} was loaded without a vision encoder (--mmproj)")
        return vision

    def prepare_images(self, inst: Instance, image: np.ndarray) -> tuple[int, int]:
        from ggmlpy.vision.preprocess import preprocess

        vision = self._vision(inst)
        self.pixels = preprocess(image, vision.image_config)
        tiles = len(self.pixels.tiles)
        return tiles, sum(vision.runs(self.pixels.pixel_values))

    def encode_images(self, n: int) -> None:
        # the runner's own path (preprocessed once, untimed): graph, inputs, compute, output read
        for _ in range(n):
            self.rt.encode_image(self.pixels)

    def clear(self) -> None:
        self.rt.clear()

    def decode(self, tokens: np.ndarray) -> None:
        if self.embeddings:
            # llama.cpp's embeddings mode outputs every token; ggmlpy's embeddings path gives their
            # hidden states (no output head), as Runner.embed uses them
            self.rt.decode(tokens, seq=0, logits="all", embeddings=True)
        else:
            # llama.cpp's llama_batch_get_one outputs the logits of the last token of
            # every decode; ask for the same work.
            self.rt.decode(tokens, seq=0, logits="last")

    def memory_report(self) -> str | None:
        return str(self.rt.memory_report()) if self.rt is not None else None
