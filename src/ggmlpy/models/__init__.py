"""Model graphs built from GGUF files.

:func:`load_model` reads a GGUF file's metadata, picks the architecture,
creates and places the weights (the memory report exists before any data is
read) and then loads the data with progress.
"""

from __future__ import annotations

from .llama import (
    ARCHITECTURES,
    LlamaConfig,
    LlamaModel,
    MissingTensor,
    UnknownArchitecture,
    load_model,
)

__all__ = ["ARCHITECTURES", "LlamaConfig", "LlamaModel", "MissingTensor", "UnknownArchitecture", "load_model"]
