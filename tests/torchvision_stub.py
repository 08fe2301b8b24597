"""A stand-in for ``torchvision.transforms.v2.functional``, for importing transformers modules that need
torchvision where it is missing or does not load (PyPI's torchvision wheels need CUDA builds of torch;
these tests run on the CPU build).

transformers' Llama 4 image processor uses three functions from it; :data:`functional` does what
torchvision 0.28 does with them (read from its source): ``resize`` (unchanged sizes returned as they
are; uint8 bilinear with antialiasing through torch's own uint8 kernel, as torchvision does on AVX2,
AVX-512 and ARM CPUs), ``pad`` (one constant) and ``normalize`` (mean and std in the image's dtype, sub
then div). Modules that import torchvision only for their own processor classes (Pixtral's processor)
import too, and their pure-Python parts can run.
"""

from __future__ import annotations

import contextlib
import enum
import importlib
import sys
import types


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    LANCZOS = "lanczos"


def resize(image, size, interpolation=InterpolationMode.BILINEAR, antialias=True, **_):
    import torch.nn.functional as F

    h, w = int(size[0]), int(size[1])
    if tuple(image.shape[-2:]) == (h, w):
        return image
    assert str(image.dtype) == "torch.uint8" and interpolation == InterpolationMode.BILINEAR
    shape = image.shape
    flat = image.reshape(-1, *shape[-3:])
    out = F.interpolate(flat, size=[h, w], mode="bilinear", align_corners=False, antialias=antialias)
    return out.reshape(*shape[:-2], h, w)


def pad(image, padding, fill=0, **_):
    import torch.nn.functional as F

    left, top, right, bottom = padding
    fills = set(fill) if isinstance(fill, (list, tuple)) else {fill}
    assert len(fills) == 1, "the stand-in pads with one value"
    return F.pad(image, (left, right, top, bottom), value=fills.pop())


def normalize(image, mean, std, inplace=False):
    import torch

    mean_t = torch.as_tensor(mean, dtype=image.dtype).view(-1, 1, 1)
    std_t = torch.as_tensor(std, dtype=image.dtype).view(-1, 1, 1)
    return image.sub(mean_t).div_(std_t)


functional = types.ModuleType("torchvision.transforms.v2.functional")
functional.InterpolationMode = InterpolationMode
functional.resize, functional.pad, functional.normalize = resize, pad, normalize


def import_with_stub(*names: str) -> list:
    """Import transformers modules with the stand-in in ``sys.modules`` for the time of the import (it is
    removed again, so ``import torchvision`` elsewhere still fails as it should); the modules keep it.
    ``transformers.image_processing_backends.tvF`` is set to it too (:func:`backends_with_stub`)."""
    import transformers.image_processing_backends  # noqa: F401  (imported before the stand-in exists)

    mods_names = ["torchvision", "torchvision.transforms", "torchvision.transforms.v2", functional.__name__]
    saved = {n: sys.modules.get(n) for n in mods_names}
    mods = [types.ModuleType(n) for n in mods_names[:-1]] + [functional]
    for parent, child in zip(mods, mods[1:]):
        setattr(parent, child.__name__.rsplit(".", 1)[1], child)
    sys.modules.update(zip(mods_names, mods))
    try:
        return [importlib.import_module(n) for n in names]
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


@contextlib.contextmanager
def backends_with_stub():
    """``TorchvisionBackend`` (which looks ``tvF`` up in its module) with the stand-in, for the block."""
    import transformers.image_processing_backends as backends

    had, old = hasattr(backends, "tvF"), getattr(backends, "tvF", None)
    backends.tvF = functional
    try:
        yield
    finally:
        if had:
            backends.tvF = old
        else:
            del backends.tvF
