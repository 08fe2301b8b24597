"""Vision encoders from the ``mmproj`` GGUF files llama.cpp's converter writes (``convert_hf_to_gguf.py
--mmproj``): a SigLIP vision transformer and the projector that turns its patches into text embeddings.

Two projector families, as llama.cpp's ``clip.cpp`` builds them (read for facts; this is our own code):

* ``gemma3`` (Gemma 3): the patch grid is average-pooled by ``clip.vision.projector.scale_factor``
  (default 4: 64 x 64 patches to 16 x 16 tokens), RMS-normalised (``mm.soft_emb_norm``, stored as
  ``1 + w``) and projected (``mm.input_projection``, stored transposed: ``ne = (n_embd_text,
  n_embd)``). In the text model the image's tokens attend to each other both ways.
* ``idefics3`` (Idefics3, SmolVLM): the patch grid is pixel-shuffled by the scale factor (each
  ``s x s`` block of patches becomes one token of ``s * s`` times the width) and projected
  (``mm.model.fc``, no bias). The image's tokens are causal, as any text.

The transformer (SigLIP, both): a patch embedding convolution with bias, learned position embeddings,
``block_count`` pre-norm layers (LayerNorm with bias, multi-head attention with biases, an MLP with
GELU (tanh approximation, in F32)), a final LayerNorm (``v.post_ln``).

:class:`VisionModel` reads the file, places and loads the weights (as a text model does: allocation
first, so a memory report exists before any data is read), and builds the encoder graph for a batch of
preprocessed images (:mod:`ggmlpy.vision.preprocess`). :meth:`VisionModel.encode` runs it alone;
the runner runs it through its own scheduler instead, so the worst-case reservation covers it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from ggmlpy import _core
from ggmlpy._core import Context, GGMLValueError, PoolOp, Tensor, Type
from ggmlpy.backend import Placement, Runtime
from ggmlpy.gguf import GGUFReader, MetadataError, MetadataTypeError
from ggmlpy.weights import MetaReader, WeightLoader, Weights, check_all_used, check_tensor

from . import llama4, pixtral, qwenvl
from .image_config import QWEN_PIXELS, ImageConfig
from .layers import _gelu_tanh, _layer_norm, _linear, _vit_layer
from .preprocess import preprocess
from .prompt import image_prompt
from .resize import IDEFICS3_MAX_IMAGE_SIZE, PreprocessedImage

__all__ = ["PRECISIONS", "PROJECTORS", "EncodedGraph", "VisionConfig", "VisionModel", "load_mmproj"]

#: the encoder's numerics (:class:`VisionModel`'s ``precision``)
PRECISIONS = ("exact", "fast")

#: projector types (``clip.projector_type``) this module builds
PROJECTORS = ("gemma3", "idefics3", "llama4", "pixtral", qwenvl.QWEN2, qwenvl.QWEN25, qwenvl.QWEN3)
#: the encoders of images of any size (one image a pass, one run of tokens per row or per image)
_QWEN = (qwenvl.QWEN2, qwenvl.QWEN25, qwenvl.QWEN3)
_ANY_SIZE = ("pixtral",) + _QWEN
#: the scale factor a file without ``clip.vision.projector.scale_factor`` means (llama.cpp's defaults)
_DEFAULT_SCALE = {"gemma3": 4, "idefics3": 2, "llama4": 2, "pixtral": 1, **{q: 2 for q in _QWEN}}
#: the token text the HF processors write for each image position
_IMAGE_TOKEN = {"gemma3": "<image_soft_token>", "idefics3": "<image>", "llama4": "<|patch|>", "pixtral": "[IMG]",
                **{q: "<|image_pad|>" for q in _QWEN}}
#: what the family's chat templates write for an image part, which its processor then expands
_PLACEHOLDER = dict(_IMAGE_TOKEN, gemma3="<start_of_image>", llama4="<|image|>")
#: what a plain prompt's media marker becomes around the image's tokens, where the chat template writes it
_MARKER_WRAP = {q: ("<|vision_start|>", "<|vision_end|>") for q in _QWEN}
#: gemma3's projection, which the file stores as ``ne = (n_embd_text, n_embd)``
_PROJ_T = "mm.input_projection.weight"
#: graph nodes per encoder layer (with headroom)
_NODES_PER_LAYER = 64
#: the range of ``clip.vision.image_mean`` / ``image_std`` values: the pixels are rescaled to [0, 1] first, so a
#: mean outside it, or a std above 1 (the std of such values is at most 0.5) or near 0, is no processor's
_MEAN_RANGE, _STD_RANGE = (0.0, 1.0), (1e-3, 1.0)


@dataclass(frozen=True)
class VisionConfig:
    """Hyperparameters of an mmproj file (``clip.*`` metadata).

    Attributes
    ----------
    projector : str
        ``clip.projector_type``: one of :data:`PROJECTORS`.
    image_size, patch_size : int
        Side of the (square) image the encoder takes, and of a patch, in pixels.
    n_embd, n_ff, n_layer, n_head : int
        The transformer's width, MLP width, layers and attention heads.
    eps : float
        LayerNorm epsilon (also the gemma3 projector's RMSNorm epsilon), in ``(0, 1]``.
    n_embd_text : int
        Width of the projected embeddings: the text model's ``n_embd`` (``clip.vision.projection_dim``).
    image_mean, image_std : tuple of float
        Per-channel normalisation of the pixels (after scaling to [0, 1]): means in [0, 1], stds in
        [0.001, 1].
    scale_factor : int
        gemma3: the pooling kernel; idefics3, llama4: the pixel-shuffle factor; pixtral: the patch merger's
        (``clip.vision.spatial_merge_size``, 1 without a merger).
    preproc_image_size : int or None
        idefics3: the longest edge images are resized to before they are cut into tiles (at most 4096,
        where the HF processor caps it).
    act : str
        The MLP's activation: ``"gelu"``, ``"silu"`` (pixtral and Qwen2.5-VL files with ``clip.use_silu``) or
        ``"quick_gelu"`` (Qwen2-VL).
    wa_pattern : int
        Qwen2.5-VL: every ``wa_pattern``-th layer attends over the whole image, the others within windows
        (``clip.vision.n_wa_pattern``).
    deepstack : tuple of int
        Qwen3-VL: the layers whose outputs feed a deepstack merger (``clip.vision.is_deepstack_layers``).
    """

    projector: str
    image_size: int
    patch_size: int
    n_embd: int
    n_ff: int
    n_layer: int
    n_head: int
    eps: float
    n_embd_text: int
    image_mean: tuple
    image_std: tuple
    scale_factor: int
    preproc_image_size: Optional[int] = None
    act: str = "gelu"
    wa_pattern: int = 0
    deepstack: tuple = ()

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def n_patches(self) -> int:
        return self.patches_per_side ** 2

    @property
    def tokens_per_image(self) -> int:
        """Text positions one encoded image (one tile for idefics3 and llama4) takes; pixtral: the most one
        row of an image takes (its longest side's tokens), the longest run of image tokens in a prompt."""
        if self.projector == "pixtral":
            return -(-self.image_size // (self.patch_size * self.scale_factor))
        if self.projector in _QWEN:
            # the processor's default budget (ImageConfig's max_tokens)
            return QWEN_PIXELS[self.projector][1] // (self.patch_size * self.scale_factor) ** 2
        return self.n_patches // self.scale_factor ** 2

    @property
    def min_image_tokens(self) -> int:
        """The fewest image positions an image takes (the any-size encoders: one token, a lower bound; the
        others: one tile)."""
        return 1 if self.projector in _ANY_SIZE else self.tokens_per_image

    @property
    def n_embd_out(self) -> int:
        """Values per image token the encoder gives: ``n_embd_text``, times ``1 + len(deepstack)`` (Qwen3)."""
        return self.n_embd_text * (1 + len(self.deepstack))

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def from_metadata(cls, md: dict, path: str = "") -> VisionConfig:
        """Read and check the hyperparameters (each error names the key and the file).

        Besides each value's type and range: the projector type is ``clip.vision.projector_type`` where
        the file has it (mixed-modality files; it wins over ``clip.projector_type``, as in llama.cpp), and
        the file must ask for the encoder's GELU (``clip.use_gelu`` true, no ``clip.use_silu``: without
        it llama.cpp runs a quick GELU, which this encoder does not compute).

        Raises
        ------
        ggmlpy.gguf.MetadataError, ggmlpy.gguf.MetadataTypeError
        """
        m = MetaReader(md, "clip", path)
        if md.get("general.architecture") != "clip":
            raise MetadataError(path, "general.architecture", f"{md.get('general.architecture')!r:.80}: not an "
                                                              f"mmproj file (expected 'clip')")
        if not _meta_bool(md, "clip.has_vision_encoder", False, path):
            raise MetadataError(path, "clip.has_vision_encoder", "the file has no vision encoder (audio-only "
                                                                 "projectors are not supported)")
        key = "clip.vision.projector_type" if "clip.vision.projector_type" in md else "clip.projector_type"
        proj = m.gets(key[len("clip."):])
        if proj not in PROJECTORS:
            raise MetadataError(path, key, f"{proj!r:.80} is not supported (supported: {', '.join(PROJECTORS)})")
        silu = _meta_bool(md, "clip.use_silu", False, path)
        if silu and proj not in ("pixtral", qwenvl.QWEN25):
            raise MetadataError(path, "clip.use_silu", "the file asks for SiLU; the encoder computes GELU")
        if proj == qwenvl.QWEN2:
            pass                   # QuickGELU: the converter writes neither key for Qwen2-VL
        elif not silu and not _meta_bool(md, "clip.use_gelu", False, path):
            raise MetadataError(path, "clip.use_gelu", "not true: the file asks for a quick GELU (llama.cpp's "
                                                       "default); the encoder computes GELU")
        act = "silu" if silu else "quick_gelu" if proj == qwenvl.QWEN2 else "gelu"
        d: dict[str, Any] = {"projector": proj, "act": act}
        d["image_size"] = m.geti("vision.image_size", lo=1, hi=1 << 14)
        d["patch_size"] = m.geti("vision.patch_size", lo=1, hi=d["image_size"])
        d["n_embd"] = m.geti("vision.embedding_length", lo=1, hi=1 << 16)
        d["n_ff"] = m.geti("vision.feed_forward_length", lo=1, hi=1 << 18)
        d["n_layer"] = m.geti("vision.block_count", lo=1, hi=512)
        d["n_head"] = m.geti("vision.attention.head_count", lo=1, hi=d["n_embd"])
        d["eps"] = m.getf("vision.attention.layer_norm_epsilon", 1e-6, lo=0.0, lo_open=True, hi=1.0)
        d["n_embd_text"] = m.geti("vision.projection_dim", lo=1, hi=1 << 17)
        scale_key = "vision.spatial_merge_size" if proj in _ANY_SIZE else "vision.projector.scale_factor"
        d["scale_factor"] = m.geti(scale_key, _DEFAULT_SCALE[proj], lo=1, hi=64)
        pre = md.get("clip.vision.preproc_image_size")
        d["preproc_image_size"] = None if pre is None else m.geti("vision.preproc_image_size", lo=1,
                                                                  hi=IDEFICS3_MAX_IMAGE_SIZE)
        for key, default, (lo, hi) in (("image_mean", (0.5, 0.5, 0.5), _MEAN_RANGE),
                                       ("image_std", (0.5, 0.5, 0.5), _STD_RANGE)):
            d[key] = _meta_triple(md, f"clip.vision.{key}", default, lo, hi, path)
        if proj == qwenvl.QWEN25:
            d["wa_pattern"] = m.geti("vision.n_wa_pattern", lo=1, hi=d["n_layer"])
        if proj == qwenvl.QWEN3 and "clip.vision.is_deepstack_layers" in md:
            ds = md["clip.vision.is_deepstack_layers"]
            if not isinstance(ds, (list, tuple, np.ndarray)) or len(ds) != d["n_layer"] or not all(
                    isinstance(x, (bool, np.bool_)) for x in ds):
                raise MetadataTypeError(path, "clip.vision.is_deepstack_layers", f"expected {d['n_layer']} bools "
                                        f"(one per layer), got {ds!r:.80}")
            d["deepstack"] = tuple(i for i, x in enumerate(ds) if x)
        cfg = cls(**d)
        bad = []
        if proj in _ANY_SIZE:
            pass                   # any image size: image_size is only the longest edge (qwen: unused)
        elif cfg.image_size % cfg.patch_size:
            bad.append(f"image_size {cfg.image_size} is not a multiple of patch_size {cfg.patch_size}")
        elif cfg.patches_per_side % cfg.scale_factor:
            bad.append(f"{cfg.patches_per_side} patches per side are not a multiple of the projector's scale "
                       f"factor {cfg.scale_factor}")
        if cfg.n_embd % cfg.n_head:
            bad.append(f"embedding_length {cfg.n_embd} is not a multiple of head_count {cfg.n_head}")
        elif proj in ("llama4",) + _ANY_SIZE and cfg.head_dim % 4:
            # the 2D RoPE rotates pairs in each half of a head
            bad.append(f"head size {cfg.head_dim} (embedding_length / head_count) is not a multiple of 4, which "
                       f"the {proj} encoder's 2D RoPE needs")
        if proj in _QWEN and cfg.scale_factor != qwenvl.MERGE:
            bad.append(f"spatial_merge_size {cfg.scale_factor}: the Qwen-VL mergers take 2 x 2 patches")
        if bad:
            raise MetadataError(path, "clip.vision", "; ".join(bad))
        return cfg


def _meta_bool(md: dict, key: str, default: bool, path: str) -> bool:
    """Boolean ``md[key]`` (``default`` when absent); any other type is a MetadataTypeError (a 1 or a "true"
    is not taken for a bool)."""
    v = md.get(key, default)
    if not isinstance(v, (bool, np.bool_)):
        raise MetadataTypeError(path, key, f"expected a bool, got {type(v).__name__} {v!r:.80}")
    return bool(v)


def _meta_triple(md: dict, key: str, default: tuple, lo: float, hi: float, path: str) -> tuple:
    """Three finite numbers in ``[lo, hi]`` from the array ``md[key]`` (``default`` when absent)."""
    if key not in md:
        return default
    v = md[key]
    # an array of numbers: not a string (whose characters would pass as digits), bools or strings
    ok = isinstance(v, (list, tuple, np.ndarray)) and all(
        isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_)) for x in v)
    if not ok:
        raise MetadataTypeError(path, key, f"expected an array of 3 numbers, got {type(v).__name__} {v!r:.80}")
    vals = tuple(float(x) for x in v)
    if len(vals) != 3:
        raise MetadataError(path, key, f"expected 3 numbers (one per channel), got {len(vals)}")
    if not all(math.isfinite(x) and lo <= x <= hi for x in vals):
        raise MetadataError(path, key, f"{vals} is out of range: each must be a finite number in [{lo:g}, {hi:g}]")
    return vals


@dataclass
class EncodedGraph:
    """An encoder graph for ``n_images`` images and its input/output tensors."""

    ctx: Context
    graph: Any
    pixels: Tensor          # F32 ne = (image_size, image_size, 3, n_images): numpy (n, 3, H, W)
    output: Tensor          # F32 ne = (n_embd_text, tokens_per_image, n_images)
    n_images: int
    key: tuple = ()
    #: inputs that do not change with the images: (tensor, values), set with the pixels (llama4's positions)
    consts: tuple = ()

    def set_inputs(self, pixels: np.ndarray) -> None:
        self.pixels.set(np.ascontiguousarray(pixels, dtype=np.float32))
        for t, values in self.consts:
            t.set(values)

    def free(self) -> None:
        self.ctx.free()


class VisionModel(WeightLoader):
    """A vision encoder and projector from an mmproj GGUF file (see the module docstring).

    Parameters
    ----------
    reader : ggmlpy.gguf.GGUFReader
        The open file.
    placement : ggmlpy.backend.Placement, optional
        The text model's placement: the encoder goes where its output layer is (group ``"vision"``).
        Default: the CPU.
    report : ggmlpy.memory.MemoryReport, optional
        Where the weights are recorded (the text model's report, so that one report shows both).
    precision : {"exact", "fast"}
        ``"exact"`` (default): attention as ``mul_mat`` + ``soft_max`` in F32 and GELU from F32 ops, image
        features within ~1e-6 of transformers'. ``"fast"``: ggml's flash attention (K and V rounded to
        F16) and ggml's GELU (an F16 table on the CPU), as llama.cpp's mtmd computes them: features within
        ~1e-3 of transformers' (llama.cpp's error on the same file), the encoder faster (bench/README).
        Fixed at load, since the worst-case reservation is built with it.

    Attributes
    ----------
    config : VisionConfig
    weights : ggmlpy.weights.Weights
    size, n_params : int
        Bytes and number of weight values.
    """

    def __init__(self, reader, placement: Optional[Placement] = None, report=None, precision: str = "exact") -> None:
        if precision not in PRECISIONS:
            raise GGMLValueError(f"vision precision {precision!r}: expected one of {PRECISIONS}")
        self.precision = precision
        self.path = str(reader.path)
        self._reader = reader
        self.config = cfg = VisionConfig.from_metadata(reader.metadata, self.path)
        if placement is None:
            from ggmlpy import _core

            cpu = _core.device("CPU")
            placement = Placement(layers=[], output=cpu, input=cpu)
        self.placement = placement
        self.device = placement.device_of("vision")
        c = cfg
        self.image_config = ImageConfig(c.projector, c.image_size, c.patch_size, c.image_mean, c.image_std,
                                        c.scale_factor, c.preproc_image_size)
        #: Gemma 3's image tokens attend to each other both ways (transformers' token_type_ids mask)
        self.bidirectional = c.projector == "gemma3"
        #: the text of the token a processor writes per image position
        self.image_token_text = _IMAGE_TOKEN[c.projector]
        #: the text a chat template writes for an image part (``{"type": "image"}``), which becomes the
        #: image's prompt as the processor expands it (Gemma 3's ``boi_token``, Idefics3's ``image_token``)
        self.image_placeholder = _PLACEHOLDER[c.projector]
        #: the text around an image's tokens where a plain prompt has the media marker (Qwen-VL's
        #: ``<|vision_start|>``/``<|vision_end|>``, which its chat templates write around the placeholder)
        self.marker_wrap = _MARKER_WRAP.get(c.projector, ("", ""))
        #: whether a run of an image's tokens stays in one micro-batch (its chunk attends to itself as a
        #: whole, or is at most a tile); Qwen-VL's images (causal, up to max_pixels) are cut anywhere
        self.tie_images = c.projector not in _QWEN
        #: tiles of the largest image (idefics3: the grid of its longest edge, and the global image;
        #: llama4: the largest canvas and the global tile)
        # (the first resize caps the longest edge at IDEFICS3_MAX_IMAGE_SIZE, as preprocess does)
        edge = min(self.image_config.longest_edge or 0, IDEFICS3_MAX_IMAGE_SIZE)
        grid = -(-edge // c.image_size) if c.projector == "idefics3" else 0
        self.max_tiles = grid * grid + 1 if grid > 1 else 1
        if c.projector == "llama4" and self.image_config.max_patches > 1:
            self.max_tiles = self.image_config.max_patches + 1
        expected = list(self._expected())
        self.fused: dict[str, tuple[str, ...]] = {}
        # (the text model's tensor overrides are not the encoder's: llama.cpp's -ot skips the mmproj too)
        self.weights = Weights(placement, max_tensors=len(expected) + 4, report=report, repack=False,
                               overrides=False)
        self.report = self.weights.report
        try:
            for name, ne, types in expected:
                check_tensor(reader, self.path, f"the {cfg.projector} encoder", name, ne, types)
            for name, ne, _types in expected:
                if name == _PROJ_T:
                    # kept transposed, in F32: the product then needs no transpose per graph, and the
                    # activations are not rounded to F16 as a product with an F16 weight would round them
                    self.converted = {name: lambda a: np.ascontiguousarray(a.T, dtype=np.float32)}
                    self.weights.add(name, Type.F32, (ne[1], ne[0]), "vision")
                else:
                    self.weights.add(name, reader.tensor_info(name).type, ne, "vision")
            check_all_used(reader, self.path, {e[0] for e in expected}, f"the {cfg.projector} encoder", cfg.n_layer)
            self.weights.allocate()
        except BaseException:
            self.weights.close()
            raise
        stored = [t for t, _ in self.weights.tensors.values()]
        self.n_params = sum(int(np.prod(t.ne)) for t in stored)
        self.size = sum(t.nbytes for t in stored)
        self.loaded = False

    # ------------------------------------------------------------------ weights

    def _expected(self):
        """``(name, ne, types)`` of every tensor the encoder reads (ggml ``ne`` order)."""
        c = self.config
        f32 = (Type.F32,)
        p, e, ff = c.patch_size, c.n_embd, c.n_ff
        if c.projector == "llama4":
            yield from llama4.expected(self)
            return
        if c.projector == "pixtral":
            yield from pixtral.expected(self)
            return
        if c.projector in _QWEN:
            if c.projector == qwenvl.QWEN3:
                qwenvl.check_pos_table(self)
            yield from qwenvl.expected(self)
            return
        yield "v.patch_embd.weight", (p, p, 3, e), (Type.F32, Type.F16)
        yield "v.patch_embd.bias", (e,), f32
        # F32 only: it is added to the F32 patches (the converter writes it so)
        yield "v.position_embd.weight", (e, c.n_patches), (Type.F32,)
        for i in range(c.n_layer):
            b = f"v.blk.{i}."
            yield from _vit_layer(b, e, ff, "ln2")
        yield "v.post_ln.weight", (e,), f32
        yield "v.post_ln.bias", (e,), f32
        if c.projector == "gemma3":
            yield "mm.soft_emb_norm.weight", (e,), f32
            yield "mm.input_projection.weight", (c.n_embd_text, e), (Type.F32, Type.F16, Type.BF16)
        else:
            yield "mm.model.fc.weight", (e * c.scale_factor ** 2, c.n_embd_text), None

    # ------------------------------------------------------------------ graph

    def graph_size(self) -> int:
        return _NODES_PER_LAYER * self.config.n_layer + 64

    @property
    def largest_image(self) -> tuple[int, int]:
        """The ``(height, width)`` in pixels of the largest image (tile) the encoder takes: ``image_size``
        square; pixtral: its longest edge rounded up to whole tokens, both ways (the worst case the
        reservation is built for)."""
        c = self.config
        if c.projector == "pixtral":
            side = c.tokens_per_image * c.patch_size * c.scale_factor
            return side, side
        if c.projector in _QWEN:
            r, k = qwenvl.largest_grid(c.tokens_per_image, windowed=c.projector == qwenvl.QWEN25)
            align = c.patch_size * c.scale_factor
            return r * align, k * align
        return c.image_size, c.image_size

    def runs(self, pixels: np.ndarray) -> list[int]:
        """The lengths of the runs of image tokens checked pixels take in a prompt, in order: one run of
        ``tokens_per_image`` per tile; pixtral: one per row of the image's token grid."""
        c = self.config
        align = c.patch_size * c.scale_factor
        if c.projector == "pixtral":
            return [pixels.shape[-1] // align] * (pixels.shape[-2] // align)
        if c.projector in _QWEN:
            return [(pixels.shape[-1] // align) * (pixels.shape[-2] // align)]
        return [c.tokens_per_image] * len(pixels)

    def grid(self, pixels: np.ndarray) -> tuple[int, int]:
        """The ``(rows, columns)`` of an image's tokens (what Qwen-VL's M-RoPE positions follow)."""
        align = self.config.patch_size * self.config.scale_factor
        return pixels.shape[-2] // align, pixels.shape[-1] // align

    def _size_ok(self, h: int, w: int) -> bool:
        """Whether an image of ``h x w`` pixels is one this any-size encoder takes (within its reservation)."""
        c = self.config
        align = c.patch_size * c.scale_factor
        if not all(d > 0 and d % align == 0 for d in (h, w)):
            return False
        if c.projector in _QWEN:
            return (h // align) * (w // align) <= c.tokens_per_image
        big = self.largest_image[0]
        return h <= big and w <= big

    def build(self, n_images: int = 1, size: Optional[tuple[int, int]] = None) -> EncodedGraph:
        """The encoder graph for ``n_images`` preprocessed images (unallocated; compute it through a
        :class:`~ggmlpy.backend.Runtime`, then read :attr:`EncodedGraph.output`). pixtral: one image of
        ``size`` = ``(height, width)`` pixels (default :attr:`largest_image`)."""
        c = self.config
        n = int(n_images)
        if n < 1:
            raise GGMLValueError(f"vision build: n_images must be >= 1 (got {n_images})")
        h, w = self.largest_image if size is None else (int(size[0]), int(size[1]))
        if c.projector in _ANY_SIZE:
            if n != 1:
                raise GGMLValueError(f"vision build: {c.projector} encodes one image at a time (got n_images={n})")
            if not self._size_ok(h, w):
                raise GGMLValueError(f"vision build: an image of {h}x{w} pixels; {self._sizes()}")
        elif (h, w) != (c.image_size, c.image_size):
            raise GGMLValueError(f"vision build: an image of {h}x{w} pixels; this encoder takes "
                                 f"{c.image_size}x{c.image_size} tiles")
        gsize = self.graph_size()
        ctx = Context.for_tensors(gsize, graph_size=gsize, no_alloc=True)
        try:
            pixels = ctx.new_tensor(Type.F32, (w, h, 3, n), name="inp_pixels").set_input()
            consts: tuple = ()
            gh, gw = h // c.patch_size, w // c.patch_size
            if c.projector == "pixtral":
                x, consts = pixtral.transformer(self, ctx, pixels, gh, gw)
                x = pixtral.project(self, ctx, x, gh, gw)
            elif c.projector in _QWEN:
                x, deep, consts = qwenvl.transformer(self, ctx, pixels, gh, gw)
                x = qwenvl.project(self, ctx, x, deep, gh * gw)
            elif c.projector == "llama4":
                x, consts = llama4.transformer(self, ctx, pixels, n)
            else:
                x = self._transformer(ctx, pixels, n)
            if c.projector not in _ANY_SIZE:
                x = self._project(ctx, x, n)
            x.set_output()
            gf = ctx.new_graph(gsize)
            gf.build_forward_expand(x)
        except BaseException:
            ctx.free()
            raise
        return EncodedGraph(ctx, gf, pixels, x, n, consts=consts)

    def _transformer(self, ctx: Context, pixels: Tensor, n: int) -> Tensor:
        """SigLIP: the patches' final hidden states, ``ne = (n_embd, n_patches, n)``."""
        c, w = self.config, self.weights
        e, npatch, hd = c.n_embd, c.n_patches, c.head_dim
        # the patch convolution as one product over the patches' pixels, unrolled in F32 (ggml's conv_2d
        # unrolls the image to F16, which moves the features by ~4e-4 of their largest value)
        kern = w["v.patch_embd.weight"]
        cols = ctx.im2col(kern, pixels, c.patch_size, c.patch_size, 0, 0, 1, 1, True, Type.F32)  # (3 p p, pw, ph, n)
        x = ctx.mul_mat(ctx.reshape_2d(kern, 3 * c.patch_size ** 2, e), ctx.reshape_2d(cols, cols.ne[0], npatch * n))
        x = ctx.reshape_3d(x, e, npatch, n)
        x = ctx.add(x, w["v.patch_embd.bias"])
        x = ctx.add(x, w["v.position_embd.weight"])
        scale = 1.0 / math.sqrt(hd)
        for i in range(c.n_layer):
            b = f"v.blk.{i}."
            cur = _layer_norm(ctx, x, w, b + "ln1", c.eps)
            q = _linear(ctx, w, b + "attn_q", cur)
            k = _linear(ctx, w, b + "attn_k", cur)
            v = _linear(ctx, w, b + "attn_v", cur)
            q = ctx.permute(ctx.reshape_4d(q, hd, c.n_head, npatch, n), 0, 2, 1, 3)        # (hd, npatch, head, n)
            k = ctx.permute(ctx.reshape_4d(k, hd, c.n_head, npatch, n), 0, 2, 1, 3)
            v = ctx.reshape_4d(v, hd, c.n_head, npatch, n)
            x = ctx.add(x, _linear(ctx, w, b + "attn_out", self._attention(ctx, q, k, v, scale)))
            cur = _layer_norm(ctx, x, w, b + "ln2", c.eps)
            up = _linear(ctx, w, b + "ffn_up", cur)
            cur = ctx.gelu(up) if self.precision == "fast" else _gelu_tanh(ctx, up)
            x = ctx.add(x, _linear(ctx, w, b + "ffn_down", cur))
        return _layer_norm(ctx, x, w, "v.post_ln", c.eps)

    def _attention(self, ctx: Context, q: Tensor, k: Tensor, v: Tensor, scale: float,
                   mask: Optional[Tensor] = None) -> Tensor:
        """Every token of an image over all of its tokens: ``q``, ``k`` ``ne = (hd, tokens, head, n)``, ``v``
        ``(hd, head, tokens, n)``; the heads' outputs ``ne = (hd * head, tokens, n)``. On the CPU where ggmlpy's
        F32 prompt kernel is vectorised (and for the any-size encoders when exact), that kernel; else exact:
        ``mul_mat`` + ``soft_max`` in F32, fast: ggml's flash attention with K and V in F16 (as llama.cpp's).
        ``mask`` (F32, F16 when fast) ``ne = (tokens, tokens, 1, n)``: added to the scores (Qwen2.5-VL's
        windows)."""
        hd, ntok, nh, n = q.ne
        vec = _core._attn_prefill_vectorized(hd, hd)
        if mask is None and self.device.type == "CPU" and (
                vec or (self.precision == "exact" and self.config.projector in _ANY_SIZE)):
            # ggmlpy's prompt kernel: F32 throughout, and no (tokens x tokens x heads) score matrix, which mul_mat
            # would reserve (9 GiB for Mistral Small's 1540 px); where it is vectorised (AVX-512, head sizes
            # multiples of 16) faster than mul_mat + soft_max and than flash_attn_ext. A batch's tiles are
            # more heads (each its own keys).
            qh = ctx.reshape_3d(ctx.cont(ctx.permute(q, 0, 3, 1, 2)), hd, nh * n, ntok)    # (hd, head x tile, tokens)
            kh = ctx.reshape_3d(ctx.cont(k), hd, ntok, nh * n)                              # (hd, tokens, head x tile)
            vh = ctx.reshape_3d(ctx.cont(ctx.permute(v, 0, 2, 1, 3)), hd, ntok, nh * n)
            o = ctx.attn_prefill(qh, kh, vh, None, scale=scale)                             # (hd, head x tile, tokens)
            if n == 1:
                return ctx.reshape_3d(o, hd * nh, ntok, 1)
            return ctx.cont_3d(ctx.permute(ctx.reshape_4d(o, hd, nh, n, ntok), 0, 1, 3, 2), hd * nh, ntok, n)
        if self.precision == "fast":
            v = ctx.permute(v, 0, 2, 1, 3)                                                 # (hd, tokens, head, n)
            o = ctx.flash_attn_ext(q, ctx.cast(k, Type.F16), ctx.cast(v, Type.F16), mask, scale=scale)
            return ctx.reshape_3d(o, hd * nh, ntok, n)                                     # o: (hd, head, tokens, n)
        v = ctx.cont(ctx.permute(v, 1, 2, 0, 3))                                           # (tokens, hd, head, n)
        kq = ctx.soft_max_ext(ctx.mul_mat(k, q), mask, scale)                              # (tokens_k, tokens_q, ...)
        o = ctx.mul_mat(v, kq)                                                             # (hd, tokens, head, n)
        return ctx.cont_3d(ctx.permute(o, 0, 2, 1, 3), hd * nh, ntok, n)

    def _gelu_erf(self, ctx: Context, x: Tensor) -> Tensor:
        """transformers' exact GELU; fast: ggml's (the tanh form from an F16 table, as llama.cpp's mtmd)."""
        return ctx.gelu(x) if self.precision == "fast" else ctx.gelu_erf(x)

    def _project(self, ctx: Context, x: Tensor, n: int) -> Tensor:
        """The projector: ``ne = (n_embd_text, tokens_per_image, n)``."""
        c, w = self.config, self.weights
        e, side, s = c.n_embd, c.patches_per_side, c.scale_factor
        if c.projector == "gemma3":
            # average-pool the patch grid: patches as planes (W, H) per channel
            x = ctx.cont(ctx.permute(x, 1, 0, 2, 3))                                       # (npatch, e, n)
            x = ctx.reshape_4d(x, side, side, e, n)
            x = ctx.pool_2d(x, PoolOp.AVG, s, s, s, s)                                     # (side/s, side/s, e, n)
            x = ctx.reshape_3d(x, (side // s) ** 2, e, n)
            x = ctx.cont(ctx.permute(x, 1, 0, 2, 3))                                       # (e, tokens, n)
            x = ctx.mul(ctx.rms_norm(x, c.eps), w["mm.soft_emb_norm.weight"])
            return ctx.mul_mat(w[_PROJ_T], x)           # stored transposed at load: ne = (n_embd, n_embd_text)
        # idefics3: pixel shuffle (numpy (n, H, W, e) -> (n, H/s * W/s, e*s*s)), then the linear projection
        x = ctx.reshape_4d(x, e * s, side // s, side, n)                                   # (e s, W/s, H, n)
        x = ctx.cont(ctx.permute(x, 0, 2, 1, 3))                                           # (e s, H, W/s, n)
        x = ctx.reshape_4d(x, e * s * s, side // s, side // s, n)                          # (e s s, H/s, W/s, n)
        x = ctx.cont(ctx.permute(x, 0, 2, 1, 3))                                           # (e s s, W/s, H/s, n)
        x = ctx.reshape_3d(x, e * s * s, (side // s) ** 2, n)
        if c.projector == "llama4":
            # transformers' pixel shuffle is Idefics3's (the same token order and channel layout); then the
            # adapter (two linear maps, each followed by an exact GELU) and the projection
            x = self._gelu_erf(ctx, ctx.mul_mat(w["mm.model.mlp.1.weight"], x))
            x = self._gelu_erf(ctx, ctx.mul_mat(w["mm.model.mlp.2.weight"], x))
        return ctx.mul_mat(w["mm.model.fc.weight"], x)

    # ------------------------------------------------------------------ running

    def encode(self, pixels: np.ndarray, runtime: Optional[Runtime] = None) -> np.ndarray:
        """Encode preprocessed images alone (outside a runner).

        Parameters
        ----------
        pixels : float32 array ``(n, 3, image_size, image_size)`` (or one image ``(3, H, W)``)
        runtime : a Runtime over this model's device (default: a new one for this call)

        Returns
        -------
        numpy.ndarray
            float32 ``(n, tokens_per_image, n_embd_text)``.
        """
        pixels = self.check_pixels(pixels)
        own = runtime is None
        rt = Runtime([self.device], graph_size=2 * self.graph_size()) if own else runtime
        try:
            return self.run(pixels, rt)
        finally:
            if own:
                rt.close()

    def run(self, pixels: np.ndarray, runtime: Runtime) -> np.ndarray:
        """:meth:`encode` of pixels already checked (:meth:`check_pixels`) on ``runtime``: the one route
        from pixels to embeddings, which a runner's step takes too."""
        n = pixels.shape[0]
        g = self.build(n, pixels.shape[2:])
        try:
            runtime.run(g.graph, lambda: g.set_inputs(pixels))
            out = g.output.get()
        finally:
            g.free()
        return np.asarray(out, dtype=np.float32).reshape(n, -1, self.config.n_embd_out)

    def prepare(self, image, what: str = "prepare", allow_local_files: bool = True) -> tuple[np.ndarray, str]:
        """One image for a prompt: its checked pixels (float32 ``(tiles, 3, S, S)``) and the text its
        processor writes in its place (:func:`~ggmlpy.vision.preprocess.image_prompt`).

        ``image`` is anything :func:`~ggmlpy.vision.preprocess.preprocess` reads (paths only with
        ``allow_local_files``), or a :class:`~ggmlpy.vision.preprocess.PreprocessedImage`.

        Raises
        ------
        GGMLValueError
            An unreadable image, bad pixels, or more tiles than this encoder's images have.
        """
        pre = image if isinstance(image, PreprocessedImage) else \
            preprocess(image, self.image_config, allow_local_files=allow_local_files)
        pixels = self.check_pixels(pre.pixel_values)
        if len(pixels) > self.max_tiles:
            # only a PreprocessedImage made with other settings gets here: preprocess bounds the tiles
            raise GGMLValueError(f"{what}: an image of {len(pixels)} tiles; this encoder's images have at most "
                                 f"{self.max_tiles} (what the runner reserved for), preprocess it with "
                                 f"the encoder's image_config")
        return pixels, image_prompt(pre, self.image_config)

    def _sizes(self) -> str:
        """The image sizes an any-size encoder takes, in words."""
        c = self.config
        align = c.patch_size * c.scale_factor
        if c.projector in _QWEN:
            return f"{c.projector} takes sides that are multiples of {align}, at most {c.tokens_per_image} tokens"
        return f"{c.projector} takes sides that are multiples of {align} up to {self.largest_image[0]}"

    def check_pixels(self, pixels) -> np.ndarray:
        """``pixels`` as float32 ``(n, 3, S, S)`` (pixtral: ``(1, 3, H, W)``), or a clear error naming the
        shape expected."""
        c = self.config
        a = np.asarray(pixels)
        if a.ndim == 3:
            a = a[None]
        if c.projector in _ANY_SIZE:
            if a.ndim != 4 or a.shape[0] != 1 or a.shape[1] != 3 or not self._size_ok(*a.shape[2:]):
                raise GGMLValueError(f"vision encode: pixels of shape {np.shape(pixels)}; expected one image (1, 3, "
                                     f"H, W): {self._sizes()} (preprocess it with ggmlpy.vision.preprocess)")
        else:
            want = (3, c.image_size, c.image_size)
            if a.ndim != 4 or a.shape[1:] != want or a.shape[0] < 1:
                raise GGMLValueError(f"vision encode: pixels of shape {np.shape(pixels)}; expected (n, {want[0]}, "
                                     f"{want[1]}, {want[2]}) (preprocess the images with ggmlpy.vision.preprocess)")
        if a.dtype.kind != "f":
            raise GGMLValueError(f"vision encode: pixels of dtype {a.dtype}; expected float32 (normalised values)")
        a = np.ascontiguousarray(a, dtype=np.float32)
        if not np.isfinite(a).all():
            raise GGMLValueError("vision encode: pixels hold NaN or inf")
        return a

    def __repr__(self) -> str:
        c = self.config
        return (f"VisionModel({c.projector!r}, image {c.image_size}px / patch {c.patch_size}, n_layer={c.n_layer}, "
                f"n_embd={c.n_embd} -> {c.n_embd_text}, {c.tokens_per_image} tokens per image, {self.precision}, "
                f"on {self.device.name})")


def load_mmproj(path: str | os.PathLike, placement: Optional[Placement] = None, report=None,
                progress: Optional[Callable[[int, int], None]] = None, load: bool = True,
                check_tensors: bool = False, precision: str = "exact") -> VisionModel:
    """Open an mmproj GGUF file, place and allocate its weights, and load them.

    Parameters
    ----------
    path : the mmproj file (``convert_hf_to_gguf.py --mmproj``)
    placement : the text model's placement (the encoder goes to its output device); default the CPU
    report : a MemoryReport to record the weights in (the text model's)
    progress, load, check_tensors : as :func:`ggmlpy.models.load_model`
    precision : ``"exact"`` (default) or ``"fast"``: see :class:`VisionModel`

    Raises
    ------
    FileNotFoundError, ggmlpy.gguf.GGUFError, ggmlpy.gguf.MetadataError, ggmlpy.gguf.MetadataTypeError
        No file, not a GGUF file, not an mmproj file, an unsupported projector, an activation other than
        GELU, a bad hyperparameter (see :meth:`VisionConfig.from_metadata`; the message names the key and
        the file), a tensor the hyperparameters leave unused.
    MissingTensor
        A tensor missing or of the wrong shape or type (named, with the file).
    GGMLMemoryError
        No room for the weights.
    """
    reader = GGUFReader(path)
    try:
        model = VisionModel(reader, placement, report, precision)
    except BaseException:
        reader.close()
        raise
    if load:
        try:
            model.load(progress, check_tensors=check_tensors)
        except BaseException:
            model.close()
            raise
    return model
