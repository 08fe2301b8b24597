"""Models built from GGUF files: the :class:`Model` protocol, a registry by architecture, one module each.

:func:`load_model` reads a GGUF file's metadata, picks the class registered
for its ``general.architecture``, creates and places the weights (the memory
report exists before any data is read) and then loads the data with progress.

* :mod:`~ggmlpy.models.base`: the :class:`Model` protocol (and :class:`~ggmlpy.kvcache.Cache`, re-exported),
  :class:`BuiltGraph`, the registry (:data:`ARCHITECTURES`, :func:`register`);
* :mod:`~ggmlpy.models.config`: :class:`DecoderConfig`, the hyperparameters every GGUF decoder reads
  (through a checking :class:`MetaReader`), and the parts of reading them architectures share;
* :mod:`~ggmlpy.models.decoder`: what every GGUF decoder model shares: :class:`DecoderModel` (weights
  checked, fused, placed and loaded; the graph's inputs; the cache recipe) and its two frames,
  ``PreNormDecoder`` and ``LocalGlobalDecoder``;
* :mod:`~ggmlpy.models.blocks`: the graph functions architectures compose (norms, RoPE, Q/K/V,
  attention through the cache, latent attention, gated and mixture-of-experts feed-forward, output head);
* one module per architecture family, each a :class:`DecoderModel` registered with :func:`register`:
  :mod:`~ggmlpy.models.llama` (llama, mistral, qwen2; Mixtral: a llama file with experts),
  :mod:`~ggmlpy.models.qwen3` (qwen3, qwen3moe), :mod:`~ggmlpy.models.gemma` (gemma2, gemma3 text:
  sliding-window layers through a :class:`~ggmlpy.kvcache.Wrapper` cache), :mod:`~ggmlpy.models.gptoss`
  (gpt-oss: attention sinks, biased experts, alternating window layers), :mod:`~ggmlpy.models.phi3`,
  :mod:`~ggmlpy.models.olmo2`, :mod:`~ggmlpy.models.granite`, :mod:`~ggmlpy.models.lfm2` (LFM2: short
  convolutions with a recurrent state per sequence and attention layers, through a
  :class:`~ggmlpy.kvcache.Wrapper` of a :class:`~ggmlpy.kvcache.Recurrent` and a
  :class:`~ggmlpy.kvcache.Causal`), :mod:`~ggmlpy.models.granitehybrid` (Granite 4.0 H: Mamba-2 layers and
  attention layers the same way, experts with a shared one), :mod:`~ggmlpy.models.qwen3next` (qwen3next,
  qwen35, qwen35moe: gated DeltaNet layers and gated attention layers the same way), :mod:`~ggmlpy.models.deepseek`
  (deepseek2: multi-head latent attention over a latent cache, DeepSeek's experts),
  :mod:`~ggmlpy.models.glm4moe` (GLM-4.5: partial RoPE, DeepSeek's experts), :mod:`~ggmlpy.models.llama4`
  (Llama 4: chunked attention and NoPE layers through a :class:`~ggmlpy.kvcache.Wrapper`, interleaved
  experts), :mod:`~ggmlpy.models.qwenvl` (qwen2vl, qwen3vl: Qwen-VL's text models, multi-section RoPE and
  deepstack); and the encoders of
  :mod:`~ggmlpy.models.bert` (bert, nomic-bert, nomic-bert-moe: embeddings and reranking, non-causal,
  through an :class:`~ggmlpy.kvcache.Encoder` cache);
* :func:`load_model` (:mod:`ggmlpy.load`, a floor up: it opens the vision encoder and runs the fit);
* :mod:`~ggmlpy.models.synthetic`: the benchmark's built-in model files.
"""

from __future__ import annotations

from . import (  # noqa: F401  (each registers its architectures)
    bert,
    deepseek,
    gemma,
    glm4moe,
    gptoss,
    granite,
    granitehybrid,
    lfm2,
    llama4,
    olmo2,
    phi3,
    qwen3,
    qwen3next,
    qwenvl,
)
from .base import (
    ARCHITECTURES,
    BuiltGraph,
    Cache,
    Model,
    UnknownArchitecture,
    model_class,
    register,
)
from .config import DecoderConfig
from .decoder import DecoderModel, MetaReader, MissingTensor
from .llama import LlamaConfig, LlamaModel


def __getattr__(name: str):
    # ggmlpy.models.load_model, as before: load_model lives a floor up (ggmlpy.load: it opens the vision
    # encoder and runs the fit, which measures with a runner), so it is imported only when asked for
    if name == "load_model":
        from ggmlpy.load import load_model

        return load_model
    raise AttributeError(f"module 'ggmlpy.models' has no attribute {name!r}")

__all__ = ["ARCHITECTURES", "BuiltGraph", "Cache", "DecoderConfig", "DecoderModel", "LlamaConfig", "LlamaModel",
           "MetaReader", "MissingTensor", "Model", "UnknownArchitecture", "load_model", "model_class", "register"]
