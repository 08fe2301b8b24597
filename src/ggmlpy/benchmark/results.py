"""One test (:class:`Instance`) and what one engine measured on it (:class:`Result`), with the ratios of two results.

A test is a prompt (``pp``), a generation (``tg``), both (``pp+tg``), or the encoding of images (``img``,
``-i``): an image test has no tokens (``n_prompt = n_gen = 0``), ``n_images`` images and the mmproj file of
their encoder, and its rate counts the image embedding rows the encoder gives the text model.

Both processes of ``--vs`` use these: the driver sends an Instance to the
llama.cpp worker and gets a Result back, each as a dict of JSON values. So this
module imports nothing from ggmlpy.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["AUTO_NGL", "Instance", "Result", "ratio", "round_ratio"]

#: ``-ngl auto`` (``-fit on``): the layers placed by trying allocations (``load_model(n_gpu_layers="auto")``)
AUTO_NGL = -2


@dataclass(frozen=True)
class Instance:
    """One test: a model, a configuration and its sizes.

    An image test (``n_images > 0``) has ``n_prompt = n_gen = n_depth = 0`` and the encoder's ``mmproj``
    file; the fields after them default so that every other test is what it was before they existed.
    """

    model: str
    n_prompt: int
    n_gen: int
    n_depth: int = 0
    n_batch: int = 2048
    n_ubatch: int = 512
    type_k: str = "f16"
    type_v: str = "f16"
    n_threads: int = 1
    n_gpu_layers: int = -1
    devices: str = "auto"
    flash_attn: int = -1
    load_mode: str = "mmap"
    no_kv_offload: bool = False
    no_op_offload: bool = False
    split_mode: str = "layer"
    main_gpu: int = 0
    #: proportions per accelerator (-ts); () for the default split by free memory
    tensor_split: tuple = ()
    #: the first layers whose experts stay on the CPU (-ncmoe)
    n_cpu_moe: int = 0
    #: tensor overrides (-ot), llama-bench's ``PATTERN=DEVICE;...``, or "none"
    tensor_buft_overrides: str = "none"
    embeddings: bool = False
    repack: bool = True
    #: images encoded per repetition (an ``img`` test; 0 for token tests)
    n_images: int = 0
    #: the mmproj GGUF file of the vision encoder (image tests only; "" otherwise)
    mmproj: str = ""

    def __post_init__(self) -> None:
        # a tuple (hashable, comparable) also when it comes back from JSON as a list (worker, --resume)
        object.__setattr__(self, "tensor_split", tuple(self.tensor_split))

    @property
    def n_ctx(self) -> int:
        """Context size of the test (llama-bench: prompt + generation + depth)."""
        return self.n_prompt + self.n_gen + self.n_depth

    @property
    def name(self) -> str:
        """llama-bench's test name: ``pp512``, ``tg128``, ``pp512+tg128``, `` @ d1024``; ours for images:
        ``img1``."""
        if self.n_images > 0:
            s = f"img{self.n_images}"
        elif self.n_prompt > 0 and self.n_gen == 0:
            s = f"pp{self.n_prompt}"
        elif self.n_gen > 0 and self.n_prompt == 0:
            s = f"tg{self.n_gen}"
        else:
            s = f"pp{self.n_prompt}+tg{self.n_gen}"
        return s + (f" @ d{self.n_depth}" if self.n_depth > 0 else "")

    def model_key(self) -> tuple:
        """What decides whether the model must be reloaded between two tests (the mmproj: whether it is
        loaded with a vision encoder, and which)."""
        key = (self.model, self.n_gpu_layers, self.load_mode, self.devices, self.repack, self.mmproj,
               self.split_mode, self.main_gpu, self.tensor_split, self.n_cpu_moe, self.tensor_buft_overrides)
        if self.n_gpu_layers == AUTO_NGL:
            # the placement is fitted to this test's context, batches and cache types
            key += (self.n_ctx, self.n_batch, self.n_ubatch, self.type_k, self.type_v, self.flash_attn)
        return key


def _mean(v: list[float]) -> float:
    return sum(v) / len(v) if v else 0.0


def _stdev(v: list[float]) -> float:
    if len(v) <= 1:
        return 0.0
    m = _mean(v)
    return math.sqrt(max(0.0, sum((x - m) ** 2 for x in v) / (len(v) - 1)))


@dataclass
class Result:
    """The measurements of one test by one engine, and what describes it."""

    inst: Instance
    engine: str
    engine_version: str
    build_commit: str
    build_number: int
    cpu_info: str
    gpu_info: str
    backends: str
    model_type: str
    model_size: int
    model_n_params: int
    load_mode: str
    test_time: str
    samples_ns: list[int]
    ttft_ns: list[int]
    load_time_ms: float
    ggmlpy_version: str = ""
    ratios: dict[str, tuple[float, float]] = field(default_factory=dict)
    #: ``--roofline``'s fields (:func:`ggmlpy.benchmark.roofline.roofline_fields`), set by the driver.
    roofline: dict[str, Any] | None = None
    #: image tests: the side in pixels of the (square) image given to the engine, the tiles the engine cut it
    #: into, and the embedding rows it gave the text model per image (tiles x tokens per tile); 0 otherwise
    image_size: int = 0
    image_tiles: int = 0
    image_tokens: int = 0

    @property
    def n_tokens(self) -> int:
        """Tokens one repetition processes: prompt and generated tokens, or the image tests' embedding rows
        (``n_images x image_tokens``)."""
        return self.inst.n_prompt + self.inst.n_gen + self.inst.n_images * self.image_tokens

    @property
    def samples_ts(self) -> list[float]:
        """Per-repetition rates in tokens per second (image tests: embedding rows per second)."""
        n = self.n_tokens
        return [1e9 * n / t for t in self.samples_ns]

    @property
    def avg_ts(self) -> float:
        return _mean(self.samples_ts)

    @property
    def stddev_ts(self) -> float:
        return _stdev(self.samples_ts)

    @property
    def avg_ns(self) -> int:
        return int(_mean([float(t) for t in self.samples_ns]))

    @property
    def stddev_ns(self) -> int:
        return int(_stdev([float(t) for t in self.samples_ns]))

    @property
    def ttft_ms(self) -> float:
        return _mean([t / 1e6 for t in self.ttft_ns])

    def record(self) -> dict[str, Any]:
        """llama-bench's fields with JSON types (bools, ints, floats), in order."""
        i = self.inst
        return {
            "build_commit": self.build_commit, "build_number": self.build_number,
            "cpu_info": self.cpu_info, "gpu_info": self.gpu_info, "backends": self.backends,
            "model_filename": i.model, "model_type": self.model_type,
            "model_size": self.model_size, "model_n_params": self.model_n_params,
            "n_batch": i.n_batch, "n_ubatch": i.n_ubatch, "n_threads": i.n_threads,
            "cpu_mask": "0x0", "cpu_strict": False, "poll": 50,
            "type_k": i.type_k, "type_v": i.type_v, "n_gpu_layers": i.n_gpu_layers,
            "n_cpu_moe": i.n_cpu_moe, "split_mode": i.split_mode, "main_gpu": i.main_gpu,
            "no_kv_offload": i.no_kv_offload, "flash_attn": i.flash_attn, "devices": i.devices,
            "tensor_split": "/".join(f"{x:.2f}" for x in i.tensor_split) or "0.00",
            "tensor_buft_overrides": i.tensor_buft_overrides, "load_mode": self.load_mode, "embeddings": i.embeddings,
            "no_op_offload": int(i.no_op_offload), "no_host": False, "repack": i.repack, "fit_target": 0,
            "fit_min_ctx": 0,
            "n_prompt": i.n_prompt, "n_gen": i.n_gen, "n_depth": i.n_depth,
            "test_time": self.test_time, "avg_ns": self.avg_ns, "stddev_ns": self.stddev_ns,
            "avg_ts": self.avg_ts, "stddev_ts": self.stddev_ts,
        }

    def extras(self, peers: list[str]) -> dict[str, Any]:
        """Our extra fields; ``ratio_vs_<peer>`` (and its stddev) per peer, None on peer rows."""
        out: dict[str, Any] = {
            "engine": self.engine, "engine_version": self.engine_version,
            "ggmlpy_version": self.ggmlpy_version,
            "load_time_ms": round(self.load_time_ms, 3), "ttft_ms": round(self.ttft_ms, 3),
        }
        for peer in peers:
            r = self.ratios.get(peer)
            out[_ratio_key(peer)] = r[0] if r else None
            out[_ratio_key(peer) + "_stddev"] = r[1] if r else None
        return out

    def image_fields(self) -> dict[str, Any]:
        """The image tests' fields (:data:`ggmlpy.benchmark.output.IMAGE_FIELDS`), written after all others
        when ``-i`` is given (zeros and "" on the token tests of such a run)."""
        i = self.inst
        return {"n_images": i.n_images, "mmproj": i.mmproj, "image_size": self.image_size,
                "image_tiles": self.image_tiles, "image_tokens": self.image_tokens}

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["inst"] = asdict(self.inst)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Result:
        d = dict(d)
        d["inst"] = Instance(**d["inst"])
        d["ratios"] = {k: tuple(v) for k, v in d.get("ratios", {}).items()}
        return cls(**d)


def _ratio_key(peer: str) -> str:
    return "ratio_vs_" + re.sub(r"[^0-9a-zA-Z]+", "_", peer).strip("_").lower()


def _merge(a: Result, b: Result) -> Result:
    """``a`` with the repetitions of ``b`` (the same test in a later round) added."""
    a.samples_ns = [*a.samples_ns, *b.samples_ns]
    a.ttft_ns = [*a.ttft_ns, *b.ttft_ns]
    return a


def round_ratio(per_round: list[float]) -> tuple[float, float]:
    """The median of per-round ratios, with their sample standard deviation as the spread.

    Each round times ggmlpy and then the peer back to back, so a ratio within a round
    compares the two under the same load; the median ignores a round a burst of other
    work on the machine spoiled.
    """
    v = [x for x in per_round if math.isfinite(x)]
    if not v:
        return (float("nan"), float("nan"))
    v.sort()
    mid = len(v) // 2
    med = v[mid] if len(v) % 2 else (v[mid - 1] + v[mid]) / 2
    return med, _stdev(v)


def ratio(a: Result, b: Result) -> tuple[float, float]:
    """``a.avg_ts / b.avg_ts`` and its spread (relative stddevs added in quadrature)."""
    if b.avg_ts <= 0 or a.avg_ts <= 0:
        return (float("nan"), float("nan"))
    r = a.avg_ts / b.avg_ts
    return r, r * math.hypot(a.stddev_ts / a.avg_ts, b.stddev_ts / b.avg_ts)
