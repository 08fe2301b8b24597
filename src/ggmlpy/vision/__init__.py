"""Images in: preprocessing as the models' Hugging Face processors do it (:mod:`~ggmlpy.vision.preprocess`,
the entry points, over :mod:`~ggmlpy.vision.decode`, :mod:`~ggmlpy.vision.image_config`,
:mod:`~ggmlpy.vision.resize` and :mod:`~ggmlpy.vision.prompt`) and the vision encoders of mmproj GGUF
files (:mod:`~ggmlpy.vision.encoder`)."""

from .encoder import PROJECTORS, VisionConfig, VisionModel, load_mmproj
from .preprocess import (
    ImageConfig,
    ImageError,
    PreprocessedImage,
    gemma3_image_prompt,
    idefics3_image_prompt,
    image_prompt,
    load_image,
    preprocess,
)

__all__ = ["PROJECTORS", "ImageConfig", "ImageError", "PreprocessedImage", "VisionConfig", "VisionModel",
           "gemma3_image_prompt", "idefics3_image_prompt", "image_prompt", "load_image", "load_mmproj", "preprocess"]
