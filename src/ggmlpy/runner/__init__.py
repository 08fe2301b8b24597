"""The model runner: sequences, batching, forward, sampling, logprobs, embeddings.

A :class:`Runner` owns a model's KV cache, a scheduler over the model's
devices (with the worst-case graphs reserved at start) and a request loop
after Ollama's ``ollamarunner``:

* :meth:`Runner.decode` is the low-level step: append tokens to a sequence
  and get logits back (the benchmark and the tests use it);
* :meth:`Runner.submit` queues a request from any thread and returns a
  :class:`Handle` that streams tokens and can be cancelled;
  :meth:`Runner.generate` and :meth:`Runner.embed` wait for the result;
* text in and out (:mod:`.text`): a str prompt is encoded with the model's
  tokenizer, stop strings are matched across token boundaries, and requests
  that produce text stream :attr:`TokenEvent.text` and end with
  :attr:`Completion.text`; :meth:`Runner.chat` and :meth:`Runner.submit_chat`
  render the file's chat template.

The loop fills each batch round-robin across the active sequences up to
``n_batch`` tokens (computed in micro-batches of ``n_ubatch``), requests
logits only for each sequence's last input, samples, and feeds the sampled
token back as the sequence's next input. With ``pipeline=True`` the next
batch's graphs are built while the current batch computes (ggml releases the
GIL), and the sampled tokens are written into the next batch just before it
computes, as Ollama does; the output is identical to the sequential loop.

A sequence that reaches ``n_ctx`` is shifted (keep ``n_keep`` tokens, drop
half of the rest, re-rotating the kept keys) or, when the cache cannot shift,
cleared and re-processed. A new request takes the free slot with the longest
common prefix, or forks another slot's prefix, re-evaluating at least its
last prompt token so that it has logits.

One container per stage, for a token's walk from :meth:`Runner.submit` to compute:
the request's ``prompt`` (:class:`requests._Request`), its ``pending`` queue
(inputs not in the cache yet; a same-batch group is one tuple), the slot's
token record (:class:`~ggmlpy.sequences.Slot`, owned by the ``SlotTable``;
the runner keeps no copy), the micro-batch rows (:class:`batching._UBatch`),
the cache's plan (cells, mask) and the graph's inputs it fills.
"""

from __future__ import annotations

from ggmlpy._core import ClosedError
from ggmlpy.sequences import InputTooLong

from .loop import Runner
from .requests import Completion, DoneReason, Handle, RequestTimeout, RunnerError, TokenEvent

__all__ = ["ClosedError", "Completion", "DoneReason", "Handle", "InputTooLong", "RequestTimeout", "Runner",
           "RunnerError", "TokenEvent"]
