"""Models built from GGUF files: the :class:`Model` protocol, a registry by architecture, one module each.

:func:`load_model` reads a GGUF file's metadata, picks the class registered
for its ``general.architecture``, creates and places the weights (the memory
report exists before any data is read) and then loads the data with progress.

* :mod:`~ggmlpy.models.base`: the :class:`Model` and :class:`Cache` protocols,
  :class:`BuiltGraph`, the registry (:data:`ARCHITECTURES`, :func:`register`);
* :mod:`~ggmlpy.models.llama`: llama, mistral, qwen2;
* :mod:`~ggmlpy.models.load`: :func:`load_model`;
* :mod:`~ggmlpy.models.synthetic`: the benchmark's built-in model files.
"""

from __future__ import annotations

from .base import (
           ARCHITECTURES,
           BuiltGraph,
           Cache,
           Model,
           UnknownArchitecture,
           model_class,
           register,
)
from .llama import LlamaConfig, LlamaModel, MissingTensor
from .load import load_model

__all__ = ["ARCHITECTURES", "BuiltGraph", "Cache", "LlamaConfig", "LlamaModel", "MissingTensor", "Model",
           "UnknownArchitecture", "load_model", "model_class", "register"]
