"""The defaults of ggmlpy's settings: one table, read by the API and by the ``ggmlpy`` command alike.

Every setting below has its default here and nowhere else: :class:`~ggmlpy.sampling.SamplingParams`,
the keyword arguments of :meth:`Runner.generate <ggmlpy.runner.Runner.generate>` (and ``submit``,
``chat``), :func:`ggmlpy.load_model`, :class:`~ggmlpy.runner.Runner`, :func:`ggmlpy.open` and the
options of ``ggmlpy run`` / ``ggmlpy chat`` take their values from :data:`DEFAULTS`, and
``tests/runner/test_api.py`` checks that each of them does. ``docs/runner.md`` shows the same table.

==================  ===========  ==========================  ===========================================
setting             default      CLI option                  where it comes from
==================  ===========  ==========================  ===========================================
``temperature``     0.8          ``--temp``                  llama.cpp, llama-cpp-python, Ollama
``top_k``           40           ``--top-k``                 the same three
``top_p``           0.95         ``--top-p``                 the same three (Ollama 0.9)
``min_p``           0.05         ``--min-p``                 llama.cpp, llama-cpp-python (Ollama 0)
``seed``            None         ``-s``                      a fresh seed per request (llama.cpp: -1)
(the other samplers) off         llama-cli's names           llama.cpp's ``common_params_sampling``: see
                                                             :class:`~ggmlpy.sampling.SamplingParams`
``devices``         ``"auto"``   ``-dev``                    every local accelerator, then the CPU
``n_gpu_layers``    -1           ``-ngl``                    all layers on the accelerators (if any)
``n_ctx``           4096         ``-c``                      llama.cpp's; at most the training context
``n_batch``         512          ``-b``                      llama.cpp's
``n_ubatch``        512          (``-b``, at most 512)       llama.cpp's
``n_seq_max``       1                                        one sequence (llama.cpp's ``-np 1``)
``type_k/type_v``   ``"f16"``                                llama.cpp's
``max_tokens``      128          ``-n`` (default -1)         see below
==================  ===========  ==========================  ===========================================

Why sampling is on by default
    Every runtime of GGUF files samples by default, with these values: llama.cpp (``llama-cli``,
    ``llama-server``), llama-cpp-python (``Llama.__call__``, ``create_chat_completion``) and Ollama; so
    do vLLM (temperature 1) and OpenAI's API. transformers' ``generate`` is greedy unless the model's
    ``generation_config.json`` says otherwise, and the chat models' files do say otherwise. Greedy
    decoding repeats itself on small models, and a chat in the terminal must not. ``temperature=0``
    asks for greedy decoding (the arg-max), explicitly, everywhere.

Why the command line's ``-n`` differs
    A terminal session (``ggmlpy run``, ``ggmlpy chat``) writes until the end of generation or until
    the context is full (``-n -1`` with no context shift), as ``llama-cli`` and ``ollama run`` do; a
    call from a program gets a bound it can rely on (``max_tokens=128``; llama-cpp-python and vLLM bound
    a completion at 16 tokens), and asks for ``max_tokens=-1`` or ``-2`` when it wants more.
    :data:`CLI_N_PREDICT` is the command line's own value.

The context: ``n_ctx`` not given is :func:`n_ctx_for` the model: 4096, or the model's training
context when that is smaller (no position beyond what the model was trained on), as ``ggmlpy run``
always did; a placement search (``load_model(..., n_gpu_layers="auto")``) reserves for the same.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Optional

__all__ = ["CLI_N_PREDICT", "DEFAULTS", "n_ctx_for"]

#: The one default of each setting (see the module docstring for the table and the reasons); read-only,
#: since signatures took their values when the modules were imported.
DEFAULTS = MappingProxyType({
    # sampling: SamplingParams' fields, the request keywords, --temp/--top-k/--top-p/--min-p/-s
    "temperature": 0.8,
    "top_k": 40,
    "top_p": 0.95,
    "min_p": 0.05,
    "seed": None,
    # the rest of llama.cpp's chain (common_params_sampling), each off by default as there
    "typical_p": 1.0,
    "top_n_sigma": -1.0,
    "min_keep": 0,
    "repeat_penalty": 1.0,
    "repeat_last_n": 64,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "xtc_probability": 0.0,
    "xtc_threshold": 0.1,
    "dry_multiplier": 0.0,
    "dry_base": 1.75,
    "dry_allowed_length": 2,
    "dry_penalty_last_n": 64,
    "dry_sequence_breakers": ("\n", ":", "\"", "*"),
    "mirostat": 0,
    "mirostat_tau": 5.0,
    "mirostat_eta": 0.1,
    "dynatemp_range": 0.0,
    "dynatemp_exponent": 1.0,
    "adaptive_target": -1.0,
    "adaptive_decay": 0.9,
    # where the weights go: load_model, open, -dev/-ngl
    "devices": "auto",
    "n_gpu_layers": -1,
    # the runner: Runner, open, a placement search, -c/-b
    "n_ctx": 4096,
    "n_batch": 512,
    "n_ubatch": 512,
    "n_seq_max": 1,
    "type_k": "f16",
    "type_v": "f16",
    # a request from a program (the command line's -n is CLI_N_PREDICT)
    "max_tokens": 128,
})

#: ``ggmlpy run`` / ``ggmlpy chat``'s ``-n``: until the end of generation or a full context.
CLI_N_PREDICT = -1


def n_ctx_for(n_ctx_train: Optional[int]) -> int:
    """The context of a runner whose ``n_ctx`` is not given: ``DEFAULTS["n_ctx"]``, at most the model's
    training context ``n_ctx_train`` (unknown or 0: the default).

    Examples
    --------
    >>> n_ctx_for(131072), n_ctx_for(2048), n_ctx_for(None)
    (4096, 2048, 4096)
    """
    n = int(DEFAULTS["n_ctx"])
    return min(n, int(n_ctx_train)) if n_ctx_train and int(n_ctx_train) > 0 else n
