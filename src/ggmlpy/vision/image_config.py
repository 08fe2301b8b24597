"""The preprocessing settings of one vision encoder: :class:`ImageConfig`, checked, and read from an mmproj
GGUF's metadata (:meth:`ImageConfig.from_metadata`: the ``clip.*`` keys llama.cpp's converter writes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ggmlpy._core import GGMLTypeError, GGMLValueError

__all__ = ["ImageConfig"]

#: The projector types :mod:`ggmlpy.vision.preprocess` preprocesses for.
PROJECTOR_TYPES = ("gemma3", "idefics3", "llama4", "pixtral", "qwen2vl_merger", "qwen2.5vl_merger", "qwen3vl_merger")
#: Qwen-VL: the processors' pixel budget by default, ``(min_pixels, max_pixels)``. The minimum is the published
#: processors' (Qwen2.5-VL 56 x 56, Qwen3-VL 256 x 256); the maximum 1280 tokens (``Qwen2VLImageProcessor``'s
#: own default and Ollama's, where the published configs allow 16384 tokens an image)
QWEN_PIXELS = {"qwen2vl_merger": (56 * 56, 28 * 28 * 1280), "qwen2.5vl_merger": (56 * 56, 28 * 28 * 1280),
               "qwen3vl_merger": (256 * 256, 32 * 32 * 1280)}
_ANY_SIZE = ("pixtral", *QWEN_PIXELS)

# mmproj GGUF keys, as llama.cpp's converter writes them.
KEY_PROJECTOR_TYPE = "clip.projector_type"
KEY_VISION_PROJECTOR_TYPE = "clip.vision.projector_type"  # mixed-modality files name the vision one here
KEY_IMAGE_SIZE = "clip.vision.image_size"
KEY_PATCH_SIZE = "clip.vision.patch_size"
KEY_IMAGE_MEAN = "clip.vision.image_mean"
KEY_IMAGE_STD = "clip.vision.image_std"
KEY_PREPROC_IMAGE_SIZE = "clip.vision.preproc_image_size"
KEY_SCALE_FACTOR = "clip.vision.projector.scale_factor"
KEY_SPATIAL_MERGE = "clip.vision.spatial_merge_size"     # pixtral's scale factor (Mistral 3's patch merger)

# llama.cpp's default when a gemma3 file has no scale factor (the converter writes it only when it is not 4).
_GEMMA3_SCALE_FACTOR = 4
# Idefics3Config's default, used when ImageConfig is built by hand without one (and Llama 4's: 1 / 0.5).
_IDEFICS3_SCALE_FACTOR = 2
# Llama4ImageProcessor's default most tiles on a canvas (the GGUF does not carry it).
_LLAMA4_MAX_PATCHES = 16


def _check_int(name: str, v: Any, minimum: int = 1) -> int:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise GGMLTypeError(f"ImageConfig: {name} is {v!r} ({type(v).__name__}); expected an integer >= {minimum}")
    if v < minimum:
        raise GGMLValueError(f"ImageConfig: {name} is {v}; expected an integer >= {minimum}")
    return int(v)


def _check_triple(name: str, v: Any, positive: bool) -> tuple[float, float, float]:
    try:
        arr = np.asarray(v, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise GGMLTypeError(f"ImageConfig: {name} is {v!r}; expected 3 numbers (one per RGB channel)") from e
    if arr.shape != (3,) or not np.all(np.isfinite(arr)) or (positive and not np.all(arr > 0)):
        what = "3 finite numbers > 0" if positive else "3 finite numbers"
        raise GGMLValueError(f"ImageConfig: {name} is {v!r}; expected {what} (one per RGB channel)")
    return (float(arr[0]), float(arr[1]), float(arr[2]))


@dataclass(frozen=True)
class ImageConfig:
    """How to preprocess images for one vision encoder (the settings of the model's HF image processor).

    Parameters
    ----------
    projector_type : {"gemma3", "idefics3", "llama4", "pixtral"}
        The mmproj projector, which picks the preprocessing pipeline.
    image_size : int
        The encoder's input side in pixels: the tile size (HF's ``size`` for gemma3, ``max_image_size``'s
        ``longest_edge`` for idefics3). A multiple of ``patch_size``. pixtral: the longest edge an image is
        scaled down to (``size["longest_edge"]``; its images have any size up to that).
    patch_size : int
        The encoder's patch side in pixels.
    image_mean, image_std : tuple of 3 floats
        Per-channel normalisation, ``(x / 255 - mean) / std``; both default to transformers'
        ``IMAGENET_STANDARD_MEAN``/``STD`` (0.5), which Gemma 3 and Idefics3/SmolVLM use.
    scale_factor : int, optional
        Patches merged per side by the projector (Gemma 3's pooling kernel, Idefics3's pixel shuffle, Mistral
        3's patch merger); it sets the number of tokens per tile. Defaults to 4 for gemma3 (llama.cpp's
        default), 2 for idefics3 (``Idefics3Config``'s) and 1 for pixtral (Pixtral-12B has no merger).
        ``image_size / patch_size`` must be a multiple of it (not for pixtral).
    longest_edge : int, optional
        idefics3 only (ignored for gemma3): the first resize's longest edge, HF's ``size["longest_edge"]``.
        Defaults to ``4 * image_size``, the ratio every published Idefics3/SmolVLM processor uses.
    do_image_splitting : bool
        idefics3 only: split into tiles plus a global image (HF's default) or resize to one tile.
    max_patches : int
        llama4 only: the most tiles on an image's canvas (``Llama4ImageProcessor``'s ``max_patches``,
        16); a canvas of more than one tile adds a global tile.
    min_pixels, max_pixels : int, optional
        Qwen-VL only: the processor's pixel budget (``size["shortest_edge"]``, ``size["longest_edge"]``), which
        the image is scaled into (:data:`QWEN_PIXELS` by default; the GGUF does not carry it).

    Raises
    ------
    GGMLTypeError, GGMLValueError
        A field of the wrong type or out of range (the message names it).
    """

    projector_type: str
    image_size: int
    patch_size: int
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    scale_factor: int | None = None
    longest_edge: int | None = None
    do_image_splitting: bool = True
    max_patches: int = _LLAMA4_MAX_PATCHES
    min_pixels: int | None = None
    max_pixels: int | None = None

    def __post_init__(self) -> None:
        if self.projector_type not in PROJECTOR_TYPES:
            raise GGMLValueError(f"ImageConfig: projector_type {self.projector_type!r} is not supported; "
                                 f"expected one of {PROJECTOR_TYPES}")
        set_ = object.__setattr__  # frozen: normalise the fields in place once, here
        set_(self, "image_size", _check_int("image_size", self.image_size))
        set_(self, "patch_size", _check_int("patch_size", self.patch_size))
        if self.image_size % self.patch_size and self.projector_type not in _ANY_SIZE:
            raise GGMLValueError(f"ImageConfig: image_size is {self.image_size}, not a multiple of patch_size "
                                 f"{self.patch_size}")
        set_(self, "image_mean", _check_triple("image_mean", self.image_mean, positive=False))
        set_(self, "image_std", _check_triple("image_std", self.image_std, positive=True))
        default_scale = {"gemma3": _GEMMA3_SCALE_FACTOR, "pixtral": 1}.get(self.projector_type, _IDEFICS3_SCALE_FACTOR)
        any_size = self.projector_type in _ANY_SIZE
        scale = default_scale if self.scale_factor is None else _check_int("scale_factor", self.scale_factor)
        side = self.image_size // self.patch_size
        if side % scale and not any_size:
            raise GGMLValueError(f"ImageConfig: scale_factor is {scale}, which does not divide the {side} patches "
                                 f"per side (image_size {self.image_size} / patch_size {self.patch_size})")
        set_(self, "scale_factor", scale)
        if self.projector_type == "idefics3":
            edge = 4 * self.image_size if self.longest_edge is None else _check_int("longest_edge", self.longest_edge)
            set_(self, "longest_edge", edge)
        if not isinstance(self.do_image_splitting, (bool, np.bool_)):
            raise GGMLTypeError(f"ImageConfig: do_image_splitting is {self.do_image_splitting!r}; expected a bool")
        set_(self, "do_image_splitting", bool(self.do_image_splitting))
        set_(self, "max_patches", _check_int("max_patches", self.max_patches))
        if self.projector_type in QWEN_PIXELS:
            lo, hi = QWEN_PIXELS[self.projector_type]
            lo = lo if self.min_pixels is None else _check_int("min_pixels", self.min_pixels)
            hi = hi if self.max_pixels is None else _check_int("max_pixels", self.max_pixels)
            if not self.align ** 2 <= hi or lo > hi or hi > 1 << 28:
                raise GGMLValueError(f"ImageConfig: min_pixels {lo} / max_pixels {hi}: expected min_pixels <= "
                                     f"max_pixels, max_pixels in [{self.align ** 2}, {1 << 28}] (one token of "
                                     f"{self.align} x {self.align} pixels at least)")
            set_(self, "min_pixels", lo)
            set_(self, "max_pixels", hi)

    @property
    def max_tokens(self) -> int:
        """Qwen-VL: the most tokens an image takes (``max_pixels`` over a token's pixels)."""
        assert self.max_pixels is not None
        return self.max_pixels // self.align ** 2

    @property
    def align(self) -> int:
        """pixtral, Qwen-VL: the pixels per output token along a side, ``patch_size * scale_factor`` (what
        their processors round the image's sides to)."""
        assert self.scale_factor is not None
        return self.patch_size * self.scale_factor

    @property
    def tokens_per_tile(self) -> int:
        """Tokens the projector emits per tile: ``(image_size / patch_size / scale_factor) ** 2``.

        Gemma 3's ``mm_tokens_per_image`` (256 for 896/14/4); Idefics3's ``image_seq_len`` (169 for 364/14/2).
        """
        assert self.scale_factor is not None  # set by __post_init__
        return (self.image_size // self.patch_size // self.scale_factor) ** 2

    @classmethod
    def from_metadata(cls, md: dict[str, Any], *, do_image_splitting: bool = True) -> ImageConfig:
        """The configuration an mmproj GGUF's metadata describes.

        Parameters
        ----------
        md : dict
            Metadata key to Python value (as :attr:`ggmlpy.gguf.GGUFReader.metadata`); arrays may be lists or
            numpy arrays. Read: ``clip.projector_type`` (or ``clip.vision.projector_type``, which mixed-modality
            files use and which wins), ``clip.vision.image_size``, ``clip.vision.patch_size``,
            ``clip.vision.image_mean``, ``clip.vision.image_std``, ``clip.vision.projector.scale_factor``
            (optional for gemma3, default 4, as in llama.cpp; required for idefics3, which llama.cpp's converter
            always writes) and for idefics3 ``clip.vision.preproc_image_size`` (optional, default
            ``4 * image_size``; files converted before llama.cpp wrote it lack it).
        do_image_splitting : bool
            See :class:`ImageConfig`.

        Raises
        ------
        GGMLValueError
            A required key is missing, or the projector type is not one this module handles.
        GGMLTypeError, GGMLValueError
            A value of the wrong type or out of range (the message names the key).
        """
        if not isinstance(md, dict):
            raise GGMLTypeError(f"ImageConfig.from_metadata: got {type(md).__name__}; expected the metadata dict "
                                "of an mmproj GGUF")

        def get(key: str, required: bool = True) -> Any:
            if key not in md:
                if required:
                    raise GGMLValueError(f"mmproj metadata: missing key {key!r} (is this an mmproj GGUF of a "
                                         "vision model?)")
                return None
            return md[key]

        ptype_key = KEY_VISION_PROJECTOR_TYPE if KEY_VISION_PROJECTOR_TYPE in md else KEY_PROJECTOR_TYPE
        ptype = get(ptype_key)
        if not isinstance(ptype, str):
            raise GGMLTypeError(f"mmproj metadata: {ptype_key!r} is {ptype!r}; expected a string")
        if ptype not in PROJECTOR_TYPES:
            raise GGMLValueError(f"mmproj metadata: {ptype_key!r} is {ptype!r}, a projector type this module does "
                                 f"not preprocess for; expected one of {PROJECTOR_TYPES}")
        fields = {
            "image_size": (KEY_IMAGE_SIZE, get(KEY_IMAGE_SIZE)),
            "patch_size": (KEY_PATCH_SIZE, get(KEY_PATCH_SIZE)),
            "image_mean": (KEY_IMAGE_MEAN, get(KEY_IMAGE_MEAN)),
            "image_std": (KEY_IMAGE_STD, get(KEY_IMAGE_STD)),
            "scale_factor": (KEY_SCALE_FACTOR, get(KEY_SCALE_FACTOR, required=ptype == "idefics3")),
        }
        if ptype in _ANY_SIZE:
            fields["scale_factor"] = (KEY_SPATIAL_MERGE, get(KEY_SPATIAL_MERGE, required=False))
        if ptype == "idefics3":
            fields["longest_edge"] = (KEY_PREPROC_IMAGE_SIZE, get(KEY_PREPROC_IMAGE_SIZE, required=False))
        kwargs = {name: value for name, (_, value) in fields.items()}
        try:
            return cls(projector_type=ptype, do_image_splitting=do_image_splitting, **kwargs)
        except (GGMLTypeError, GGMLValueError) as e:
            # name the GGUF key rather than the field
            msg = str(e)
            for name, (key, _) in fields.items():
                if msg.startswith(f"ImageConfig: {name} "):
                    msg = f"mmproj metadata: {key!r}" + msg[len(f"ImageConfig: {name}"):]
                    break
            raise type(e)(msg) from e
