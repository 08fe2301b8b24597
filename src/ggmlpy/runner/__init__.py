"""The model runner: sequences, batching, forward, sampling, logprobs, embeddings.

A :class:`Runner` owns a model's KV cache, a scheduler over the model's devices (with the worst-case
graphs reserved at start) and a request loop after Ollama's ``ollamarunner``:

* :meth:`Runner.decode` is the low-level step: append tokens to a sequence and get logits back (the
  benchmark and the tests use it);
* :meth:`Runner.submit` queues a request from any thread and returns a :class:`Handle` that streams
  tokens and can be cancelled; :meth:`Runner.generate` and :meth:`Runner.embed` wait for the result;
  :meth:`Runner.chat` and :meth:`Runner.submit_chat` render the file's chat template.

One job per module:

* :mod:`.runner`: :class:`Runner`, its construction, public API, state and close;
* :mod:`.inputs`: text, chat messages and images -> one prepared prompt, checked once (with
  :mod:`.text`'s rules for BOS, special tokens and chat templates, and its streaming of text back);
* :mod:`.loop`: the request loop: admit, form a batch, launch, complete, pipelining;
* :mod:`.embeddings`: ``embed``, ``submit_embeddings`` and ``rerank`` (inputs queued together, packed into a
  batch as sequences), and the pooling and normalisation of an input's output rows, as llama.cpp's;
* :mod:`.slots`: the slot table, the record of what each cache sequence holds, which makes the cache
  calls that change it;
* :mod:`.batching`: the batch and micro-batch records; :mod:`.step`: one micro-batch computed (plan, graph,
  apply, fill, run), the reservation, the image encode;
* :mod:`.requests`: what a caller holds (:class:`Handle`, :class:`TokenEvent`, :class:`Completion`);
  :mod:`.images`: the image store; :mod:`.state`: a saved sequence's meta and its checks;
* :mod:`.fit`: the placement search of ``load_model(..., n_gpu_layers="auto")``, by measuring what a
  runner would reserve on each candidate placement.

``docs/runner.md`` describes every setting and option, and the walk of a token and of an image.
"""

from __future__ import annotations

from ggmlpy._core import ClosedError

from .requests import (
    Completion,
    DoneReason,
    Handle,
    RequestTimeout,
    RunnerError,
    Stream,
    TokenEvent,
)
from .runner import Runner
from .slots import InputTooLong

__all__ = ["ClosedError", "Completion", "DoneReason", "Handle", "InputTooLong", "RequestTimeout", "Runner",
           "RunnerError", "Stream", "TokenEvent"]
