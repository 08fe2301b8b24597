"""Token sampling: llama.cpp's sampler chain, constrained output and log-probabilities (numpy only).

* :mod:`~ggmlpy.sampling.params`: :class:`SamplingParams`, every setting of llama.cpp's
  ``common_params_sampling`` a user sets from ``llama-cli`` or ``llama-server`` (temperature, top-k,
  top-p, min-p, typical-p, top-n-sigma, min-keep, the repetition/frequency/presence penalties over the
  last N tokens, logit bias, XTC, DRY, Mirostat 1/2, dynamic temperature, the chain's order) and a
  logits-processor hook; :func:`gguf_sampling_defaults`, what a model file's ``general.sampling.*``
  recommends.
* :mod:`~ggmlpy.sampling.chain`: :class:`Sampler`, one sequence's chain and state (its random generator,
  the tokens it has seen, Mirostat's ``mu``, a grammar's matcher), the samplers as llama.cpp's
  ``src/llama-sampler.cpp`` computes them; :mod:`~ggmlpy.sampling.dry`: DRY's repetition search.
* :mod:`~ggmlpy.sampling.grammar`: constrained output (GBNF, Lark, regular expressions, JSON schemas,
  OpenAI's ``response_format``) through llguidance: :class:`Grammar`, compiled once, and a
  :class:`GrammarMatcher` per request that masks the tokens the grammar does not allow before the chain.
* :mod:`~ggmlpy.sampling.logprobs`: :func:`logprobs`, the chosen token's log-probability and the most
  likely alternatives over the raw logits (as Ollama and OpenAI report them).

``temperature=0`` is greedy decoding: the arg-max of the logits after the samplers that move them (logit
bias, penalties, DRY) and those that may drop the most likely token (typical-p, XTC), as llama.cpp's
``temp <= 0``. Invalid settings raise :class:`ggmlpy.GGMLValueError` (a ValueError) naming the setting,
never clamped.
"""

from __future__ import annotations

from .chain import Sampler
from .grammar import Grammar, GrammarMatcher, VocabBridge
from .logprobs import Logprobs, TokenLogprob, log_softmax, logprobs
from .params import (
    DEFAULT_SAMPLERS,
    MAX_TOP_LOGPROBS,
    SAMPLER_NAMES,
    SamplingParams,
    gguf_sampling_defaults,
    parse_samplers,
    sampling_params,
)

__all__ = [
    "DEFAULT_SAMPLERS",
    "Grammar",
    "GrammarMatcher",
    "MAX_TOP_LOGPROBS",
    "SAMPLER_NAMES",
    "Logprobs",
    "Sampler",
    "SamplingParams",
    "TokenLogprob",
    "VocabBridge",
    "gguf_sampling_defaults",
    "log_softmax",
    "logprobs",
    "parse_samplers",
    "sampling_params",
]
