"""The request loop: admit requests into slots, form a batch, launch it, complete it (Ollama's ``ollamarunner``).

:class:`RequestLoop` is the scheduling half of :class:`~ggmlpy.runner.Runner` (its base class; the
loop works on the runner's state). One thread (``ggmlpy-runner``) runs :meth:`~RequestLoop._round` over
and over: waiting requests take a slot (:meth:`~ggmlpy.runner.slots.SlotTable.load_slot`: prefix
reuse, the cache trimmed to it), a batch is filled round-robin across the active sequences up to
``n_batch`` inputs and cut into micro-batches (:func:`split_ubatches`), each built by the runner's
:class:`~ggmlpy.runner.step.Step`, then computed, and each sequence's output sampled, streamed and
fed back as its next input (:mod:`.requests`).

With ``pipeline`` the batch is computed on a second thread (``ggmlpy-compute``; ggml releases the GIL)
while the loop builds the next one: a sequence waiting for the batch in flight gets a
:class:`~.batching._Placeholder` as its next input, which the sampled token fills just before the
next batch computes, as Ollama does; the output is the sequential loop's.

A sequence that reaches ``n_ctx`` is shifted (:meth:`~ggmlpy.runner.slots.SlotTable.shift`) or ends
with ``length``.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from typing import Optional

import numpy as np

from ggmlpy._core import ClosedError, GGMLValueError
from ggmlpy.sampling import Sampler, SamplingParams
from ggmlpy.sampling import logprobs as _logprobs
from ggmlpy.sampling.chain import sample_batch

from .batching import _Batch, _drop_graphs, _Member, _Placeholder, _UBatch, split_equal
from .embeddings import embedding_norm, pool
from .inputs import Prompt
from .requests import Completion, DoneReason, Handle, TokenEvent
from .slots import InputTooLong, group_sizes, shift_discard, truncate_indices
from .text import TextStream

__all__ = ["RequestLoop"]

log = logging.getLogger("ggmlpy")


class _Request:
    """A request being served (the loop's private state)."""

    def __init__(self, prompt, params, max_tokens, stop, n_keep, shift, embedding, pooling, normalize,
                 same_batch, sampler=None):
        self.prompt = prompt                 # list[int]: the prepared prompt (runner.inputs.Prompt.ids)
        self.same_batch = same_batch         # per prompt input: how many following inputs share its batch
        self.params = params
        self.sampler = sampler               # the sequence's sampler chain (None for an embedding)
        self.max_tokens = max_tokens
        self.stop = frozenset(int(t) for t in stop)
        self.n_keep = n_keep
        self.shift = shift
        self.embedding = embedding
        self.pooling = pooling
        # what its batch outputs: logits (False), hidden states (True) or classification scores ("rank"); a
        # batch holds requests of one kind (one graph)
        self.kind = ("rank" if pooling == "rank" else True) if embedding else False
        self.normalize = normalize
        self.slot: Optional[int] = None
        self.record = None               # the SlotTable's Slot: the one record of what the cache holds
        self.pending: deque = deque()    # inputs not yet in the cache: tokens, a same-batch group as a tuple
        self.n_prompt_left = 0           # prompt tokens in `pending` (no sampling while > 0)
        self.events: queue.Queue = queue.Queue()
        self.finished = threading.Event()
        self.cancelled = False
        self.result = Completion()
        self.t_start: Optional[float] = None
        self.t_first: Optional[float] = None
        self.placeholder = None          # _Placeholder standing for the token prev's compute will sample
        self.cut: Optional[int] = None   # a batch ends this sequence's rows at this position (a checkpoint)
        self.text = None                 # text.TextStream of a request that produces text
        self.reply = None                # chat.ReplyStream of a chat: its reply parsed as it streams


class RequestLoop:
    """The request loop, a base class of :class:`~ggmlpy.runner.Runner`.

    It keeps the queue of waiting requests, the active ones by slot, the loop and compute threads and
    the batch in flight (:meth:`_init_loop`), all under ``_lock`` (a Condition), and it decides who
    uses the cache and the scheduler: the loop while requests are served, else one direct call at a
    time (:meth:`_direct`). It uses of the runner: the settings ``n_ctx``, ``n_batch``, ``n_ubatch``,
    ``n_seq_max``, ``pipeline``, ``defrag_thold``; ``slots``, ``cache``, ``step`` and ``closed``.
    """

    def _init_loop(self) -> None:
        self._lock = threading.Condition()       # guards everything below
        self._engine = threading.Lock()          # direct decode()/clear() calls one at a time
        self._closing = False                    # set once by close(): no new request or direct call
        self._direct_busy = 0                    # direct calls using the cache and scheduler now
        self._waiting: deque = deque()           # submitted, not yet in a slot
        self._active: dict[int, _Request] = {}   # by slot
        self._next_seq = 0                       # where the next batch's round-robin starts
        self._thread: Optional[threading.Thread] = None     # the loop
        self._worker: Optional[threading.Thread] = None     # the compute thread (pipelining)
        self._jobs: Optional[queue.SimpleQueue] = None
        self._inflight = 0                       # batches launched and not yet completed
        self._prev: Optional[_Batch] = None      # the batch launched last, not yet completed
        self._building: Optional[_Batch] = None  # formed, not launched yet
        self.n_defrags = 0
        self.n_batches = 0
        self.batch_sizes: deque = deque(maxlen=256)   # micro-batch sizes of recent batches (diagnostics)
        self.overlap_s = 0.0                     # graph building hidden behind compute (pipeline)

    def _check_open(self, what: str) -> None:
        if self._closing:
            raise ClosedError(f"{what}: the runner is closed")

    def _direct_enter(self, what: str) -> None:
        """Start a direct use of the cache and scheduler (see :meth:`_direct`); pair with :meth:`_direct_exit`."""
        with self._lock:
            while True:
                # checked again after every wait: a request may be accepted while we wait for
                # the loop's last batch, and then the loop owns the cache
                self._check_open(what)
                if self._active or self._waiting:
                    raise GGMLValueError(f"{what}: requests are being served; {what}() is for direct use only")
                if not self._inflight:
                    break
                self._lock.wait()                    # the loop's last batch is still computing
            self._direct_busy += 1
        try:
            self._engine.acquire()
        except BaseException:
            self._direct_done()
            raise
        try:
            self._check_open(what)                   # close() may have come while we queued for the engine
        except BaseException:
            self._direct_exit()
            raise

    def _direct_exit(self) -> None:
        self._engine.release()
        self._direct_done()

    def _direct_done(self) -> None:
        with self._lock:
            self._direct_busy -= 1
            self._lock.notify_all()       # close() waits for the last direct call

    @contextlib.contextmanager
    def _direct(self, what: str):
        """Direct use of the cache and scheduler: only while no request is served or computing.

        close() waits for a direct call in progress before it frees anything,
        and a direct call started after close() raises ClosedError.
        """
        self._direct_enter(what)
        try:
            yield
        finally:
            self._direct_exit()

    def _queue(self, prompt: Prompt, text: tuple, *, max_tokens: int = 128, sampling: Optional[SamplingParams] = None,
               n_keep: int = 0, shift: bool = True, truncate: bool = False, embedding: bool = False,
               pooling: Optional[str] = None, normalize: bool | int = True, reply=None,
               hold: Optional[list] = None) -> Handle:
        """Queue a prepared prompt as a request (the request options checked, the prompt fitted to the context);
        with ``hold`` (a list) the request is appended to it instead, for :meth:`_enqueue` of them all at once."""
        stop_ids, stop_texts, tok = text
        ids, sb = prompt.ids, prompt.same_batch
        if not ids:
            raise GGMLValueError("submit: empty prompt")
        max_tokens = int(max_tokens)
        if not embedding and (max_tokens == 0 or max_tokens < -2):
            raise GGMLValueError(f"submit: max_tokens must be >= 1, -1 (no limit) or -2 (until the context is "
                                 f"full) (got {max_tokens})")
        if not embedding:
            self._check_generates("submit")
        params = sampling if sampling is not None else SamplingParams()
        if sb is None:
            sb = [0] * len(ids)
        n_keep = len(ids) if n_keep < 0 else int(n_keep)
        n_keep = min(n_keep, self.n_ctx - 1)
        if embedding:
            pooling = self.embedding_pooling(pooling, "submit")
            normalize = embedding_norm(normalize, "submit")
            limit = self.max_embedding_tokens
            if len(ids) > limit:
                if not truncate or any(sb):
                    why = f"context {self.n_ctx}" if limit == self.n_ctx else \
                        f"n_ubatch {self.n_ubatch} (a non-causal model reads an input in one micro-batch)"
                    raise InputTooLong(f"input too long: {len(ids)} tokens for an embedding, at most {limit} "
                                       f"({why}){'' if any(sb) else '; truncate=True keeps the first ones'}")
                ids, sb = ids[:limit], sb[:limit]
        elif len(ids) > self.n_ctx:
            keep_idx = truncate_indices(len(ids), self.n_ctx, n_keep, same_batch=sb, truncate=truncate)
            ids = [ids[i] for i in keep_idx]
            sb = [sb[i] for i in keep_idx]
        stop_ids += tuple(self.model.config.eos_token_ids)
        if tok is not None:
            stop_ids += tuple(sorted(tok.eog))     # llama.cpp ends a generation at any of them
        sampler = None if embedding else self._sampler(params, ids)
        if sampler is not None and sampler.grammar is not None:
            # the grammar ends its output with an end-of-generation token: each of them stops the request
            stop_ids += tuple(sampler.grammar.vocab.eog)
        req = _Request(ids, params, max_tokens, stop_ids, n_keep, shift, embedding, pooling, normalize, sb, sampler)
        if tok is not None:
            # a detokenizer of its own: it holds the bytes of a character not yet complete
            req.text = TextStream(tok.detokenizer(skip_special=True), stop_texts)
            req.result.text = ""
            req.reply = reply
        if hold is not None:
            hold.append(req)
        else:
            self._enqueue(req)
        return Handle(self, req)

    def _check_generates(self, what: str) -> None:
        """Refuse generation on a model without a language-model head (an encoder)."""
        if not getattr(self.model, "can_generate", True):
            raise GGMLValueError(f"{what}: this {self.model.config.arch} model is an encoder (embeddings and "
                                 "reranking): it has no head to generate text with; use embed() or rerank() "
                                 "(or embedding=True)")

    def _sampler(self, params: SamplingParams, ids: list) -> Sampler:
        """A request's sampler chain, with the prompt's tokens in its history (image rows left out): the
        penalties count them, as llama-server's ``init_sampler`` does."""
        tok = None
        if params.dry_multiplier != 0.0 and params.dry_sequence_breakers:
            try:
                tok = self.tokenizer                 # DRY's breakers are strings found in tokens' text
            except GGMLValueError as e:
                raise GGMLValueError(f"submit: dry_sequence_breakers need the model's vocabulary: {e}") from e
        matcher = None
        if params.constraint is not None:
            try:
                vocab = self.tokenizer
            except GGMLValueError as e:
                raise GGMLValueError(f"submit: a grammar needs the model's vocabulary: {e}") from e
            matcher = params.constraint.matcher(vocab)      # a grammar the vocabulary refuses fails here
        s = Sampler(params, tokenizer=tok, n_ctx=self.n_ctx, grammar=matcher)
        s.accept([t for t in ids if t >= 0])
        return s

    def _enqueue(self, *reqs: _Request) -> None:
        """Queue requests for the loop (starting the loop thread if needed), all at once: the loop sees all
        or none of them (the inputs of one embed() call are packed into one batch where they fit)."""
        with self._lock:
            # checked again under the lock: close() sets _closing under it, so a request is either
            # refused here or seen by whoever ends the requests (the loop, or close() itself)
            self._check_open("submit")
            if self._direct_busy:
                raise GGMLValueError("submit: a direct decode()/clear() is running on this runner")
            self._waiting.extend(reqs)
            self._ensure_loop()
            self._lock.notify_all()

    def _wake(self) -> None:
        with self._lock:
            self._lock.notify_all()

    def _ensure_loop(self) -> None:
        """Start the loop thread if it is not running (lock held, runner open)."""
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name="ggmlpy-runner", daemon=True)
            self._thread.start()

    def _admit(self, wait_prev) -> None:
        """Move waiting requests into free slots (lock held); compact the cache if they left it fragmented."""
        admitted = False
        while self._waiting and len(self._active) < self.n_seq_max:
            req = self._waiting.popleft()
            if req.cancelled:
                self._finish(req, DoneReason.CANCEL)
                continue
            try:
                self._load_slot(req)
            except Exception as e:               # the request ends with it (its handle raises it)
                self._finish(req, DoneReason.ERROR, e)
                continue
            self._active[req.slot] = req
            admitted = True
        if admitted and self.defrag_thold is not None and self.cache.fragmentation() > self.defrag_thold:
            wait_prev()                      # rows move under the batch in flight otherwise
            self.cache.defrag()
            self.n_defrags += 1

    def _load_slot(self, req: _Request) -> None:
        """Take a slot (prefix reuse, the cache trimmed to it) and queue the rest of the prompt."""
        slot, n_past = self.slots.load_slot(req.prompt, cache_prompt=not req.embedding, same_batch=req.same_batch)
        req.slot = slot
        req.record = self.slots[slot]
        req.pending = deque(as_units(req.prompt[n_past:], req.same_batch[n_past:]))
        req.n_prompt_left = len(req.prompt) - n_past
        req.cut = None
        n = len(req.prompt)
        if getattr(self.cache, "n_checkpoints", 0) and not req.embedding:
            # recurrent states go back only to a checkpoint: keep one at the prompt's end (a conversation goes
            # on from there) and one token before it (the same prompt again computes only its last token),
            # the batch cut there so that a micro-batch ends at it (llama.cpp's server checkpoints likewise)
            for k in (n - 1, n):
                if k > n_past:
                    self.cache.want_checkpoint(slot, k)
            req.cut = n - 1 if n - 1 > n_past else None
        req.result.n_cached = n_past
        req.result.prompt_eval_count = len(req.prompt)
        req.t_start = time.perf_counter()

    def _finish(self, req: _Request, reason: str, error: Optional[BaseException] = None) -> None:
        """End a request on any path: result, stream end, slot freed (lock held).

        The request ends even when freeing its slot fails (that error is
        logged and, for a request that was not failing already, becomes its
        error): a waiting :meth:`Handle.result` must always return.
        """
        if req.finished.is_set():
            return
        r = req.result
        r.done_reason = reason
        r.error = error
        try:
            failed = reason == DoneReason.ERROR
            if req.text is not None and not failed:
                # ended between tokens (cancelled, the context full): the text held back goes out last
                tail = req.text.finish()
                deltas = []
                if req.reply is not None:
                    deltas = (req.reply.feed(tail) if tail else []) + req.reply.finish()
                    parsed = req.reply.reply
                    r.content, r.reasoning, r.tool_calls = parsed.content, parsed.reasoning, list(parsed.tool_calls)
                if tail or deltas:
                    r.text += tail
                    req.events.put(TokenEvent(None, None, tail, deltas))
            if req.t_first is not None:
                r.eval_duration = time.perf_counter() - req.t_first
            ph = req.placeholder
            if ph is not None and ph.value is None:
                ph.fill(0)              # a row already built computes token 0: the cache then really holds 0
            req.pending = deque()
            if req.slot is not None:
                if self._active.get(req.slot) is req:
                    del self._active[req.slot]
                # a failed request's sequence may hold half-written cells (none to clear once closed)
                self.slots.free(req.slot, failed=failed and not self.closed)
        except Exception as e:
            log.exception("runner: freeing the slot of a finished request failed")
            if r.error is None:
                r.done_reason, r.error = DoneReason.ERROR, e
        finally:
            req.finished.set()
            req.events.put(None)
            self._lock.notify_all()              # wait_idle(), close() and direct calls watch _active

    def _shift(self, req: _Request) -> None:
        """Make room in a full context: drop tokens after n_keep (or clear and re-process)."""
        rec = req.record
        keep = min(req.n_keep, self.n_ctx - 1)
        discard = shift_discard(len(rec.tokens), keep, self.n_ctx, rec.same_batch)
        req.result.n_shifts += 1
        if discard <= 0:
            return
        redo = self.slots.shift(req.slot, keep, discard)
        if redo is not None:               # the cache could not shift: what it kept is computed again
            req.pending.extendleft(reversed(as_units(*redo)))
            req.n_prompt_left += len(redo[0])

    def _form_batch(self, wait_prev) -> Optional[_Batch]:
        """Fill a batch round-robin from ``_next_seq`` (lock held); None when nothing is pending.

        ``wait_prev()`` completes the batch in flight; it is called before
        anything that must not overlap its compute (a shift rewrites keys).
        """
        self._admit(wait_prev)
        for req in list(self._active.values()):
            if req.cancelled:
                wait_prev()
                self._finish(req, DoneReason.CANCEL)
        ready = [s for s in sorted(self._active) if self._active[s].pending]
        if not ready:
            return None
        order = [s for s in ready if s >= self._next_seq] + [s for s in ready if s < self._next_seq]
        kind = self._active[order[0]].kind
        embedding = kind is not False
        toks: list = []
        pos, rows_seq, want, tied = [], [], [], []
        members = []
        limit = self.n_batch
        resume = None
        for slot in order:
            req = self._active.get(slot)
            if req is None or req.kind != kind or not req.pending:
                continue
            if embedding:
                # whole inputs only, as many as fit: llama.cpp's embedding batch of several sequences
                n_need = sum(len(u) if type(u) is tuple else 1 for u in req.pending)
                if toks and len(toks) + n_need > limit:
                    if resume is None:
                        resume = slot
                    continue
                limit = max(limit, n_need)                 # the whole input in one batch
                first_row = len(toks)
            n_in = 0
            rec = req.record
            new_toks, new_sb = [], []                # what this batch adds to the slot's record
            while req.pending and len(toks) < limit:
                unit = req.pending[0]
                need = len(unit) if type(unit) is tuple else 1
                if req.cut is not None:
                    at = len(rec.tokens) + n_in
                    if at == req.cut and n_in:
                        break                 # this sequence's rows end at its checkpoint (_load_slot)
                    if at >= req.cut or at + need > req.cut:
                        req.cut = None        # reached, or inside a same-batch group: no cut
                if need > limit:
                    if toks:
                        break                 # a group bigger than the batch goes first in the next one
                    limit = need
                if len(toks) + need > limit:
                    break
                if len(rec.tokens) + n_in + need > self.n_ctx:
                    if n_in:
                        break                 # never shift in the middle of a batch
                    wait_prev()
                    if req.finished.is_set():
                        break
                    if not req.shift or embedding or req.max_tokens == -2:     # -2: until the context is full
                        self._finish(req, DoneReason.LENGTH)
                        break
                    self._shift(req)
                    if len(rec.tokens) + need > self.n_ctx:
                        self._finish(req, DoneReason.LENGTH)
                        break
                    continue
                req.pending.popleft()
                p0 = len(rec.tokens) + n_in
                for j, tok in enumerate(unit if need > 1 else (unit,)):    # a same-batch group goes in whole
                    if type(tok) is _Placeholder:
                        tok.row, tok.record, tok.pos = len(toks), rec, p0 + j
                        new_toks.append(-1 if tok.value is None else tok.value)
                    else:
                        new_toks.append(tok)
                    new_sb.append(need - 1 if j == 0 else 0)
                    # an embedding input is kept in one micro-batch where it fits (an encoder must be)
                    tied.append(j > 0 or (embedding and n_in > 0))
                    pos.append(p0 + j)
                    toks.append(tok)
                    rows_seq.append(slot)
                    want.append(embedding and req.pooling in ("mean", "none"))
                n_in += need
                req.n_prompt_left = max(req.n_prompt_left - need, 0)
            if n_in:
                self.slots.committed(slot, new_toks, new_sb)
            if req.finished.is_set():
                continue
            if n_in:
                # generation: one output row, the last input, once the prompt is all in; an embedding: the
                # rows its pooling reads (cls and rank the first, last the last, mean and none all)
                has_out = embedding or req.n_prompt_left == 0
                n_out = 1
                if not embedding and has_out:
                    want[-1] = True
                elif req.pooling in ("cls", "rank"):
                    want[first_row] = True
                elif req.pooling == "last":
                    want[-1] = True
                else:
                    n_out = n_in
                members.append(_Member(req, n_in, has_out, n_out))
            if req.pending and resume is None:
                resume = slot
            if len(toks) >= limit:
                break
        if not toks:
            return None
        self._next_seq = resume if resume is not None else rows_seq[-1] + 1
        # the one change of container on a token's way: the batch's rows become the graph's int32 input
        tok_a = np.array([0 if isinstance(t, _Placeholder) and t.value is None else int(t) for t in toks],
                         dtype=np.int32)
        ubs = split_ubatches(self.n_ubatch, tok_a, np.asarray(pos, np.int64), np.asarray(rows_seq, np.int64),
                             np.asarray(want), np.asarray(tied, bool), equal=getattr(self.cache, "split_equal", False))
        starts = np.cumsum([0] + [len(ub.tokens) for ub in ubs])
        for t in toks:
            if isinstance(t, _Placeholder):
                k = int(np.searchsorted(starts, t.row, side="right")) - 1
                t.ubatch, t.row = ubs[k], t.row - int(starts[k])
        self.batch_sizes.append([len(ub.tokens) for ub in ubs])
        return _Batch(ubs, kind, members)

    def _launch(self, batch: _Batch) -> None:
        """Compute a built batch: on the compute thread when pipelining (ggml releases the GIL), else here."""
        if not self.pipeline:
            self._prev = batch                # completed at once by the caller
            self._work(batch)
            return
        if self._worker is None or not self._worker.is_alive():
            # one long-lived thread: ggml's CPU backend (OpenMP) keeps a thread team per calling thread,
            # so a new thread per batch would pay for a new team every time
            self._jobs = queue.SimpleQueue()
            self._worker = threading.Thread(target=self._work_loop, args=(self._jobs,), name="ggmlpy-compute",
                                            daemon=True)
            self._worker.start()
        batch.done = threading.Event()
        self._inflight += 1
        self._prev = batch
        self._jobs.put(batch)

    def _work_loop(self, jobs) -> None:
        while True:
            batch = jobs.get()
            if batch is None:
                return
            try:
                self._work(batch)
            finally:
                batch.done.set()          # the loop waits on it: set on every path

    def _compute(self, ub: _UBatch) -> Optional[np.ndarray]:
        """Compute one built micro-batch (:meth:`Step.compute <ggmlpy.runner.step.Step.compute>`): the
        loop's compute thread and the direct calls both come through here."""
        return self.step.compute(ub)

    def _work(self, batch: _Batch) -> None:
        try:
            for ub in batch.ubatches:
                r = self._compute(ub)
                if r is not None:
                    batch.outputs.append(r)
        except BaseException as e:       # noqa: BLE001 - handed to _complete, which ends the batch's requests
            batch.error = e

    def _complete(self, batch: _Batch) -> None:
        """Wait for a batch, then sample, stream and feed each sequence's next input (lock held)."""
        if batch.done is not None:
            batch.done.wait()
            batch.done = None
            self._inflight -= 1
            self._lock.notify_all()
        self.n_batches += 1
        if batch.error is not None:
            _drop_graphs(batch)          # graphs of micro-batches not computed (or whose compute failed)
            for m in batch.members:
                self._finish(m.req, DoneReason.ERROR, batch.error)
            return
        out = np.concatenate(batch.outputs) if batch.outputs else None
        now = time.perf_counter()
        base = 0
        picked = self._sample_step(batch, out)
        for m in batch.members:
            req = m.req
            if not m.has_out:
                continue
            n_rows = m.n_out
            rows = out[base:base + n_rows]
            base += n_rows
            if req.finished.is_set():
                continue
            if batch.embedding:
                req.result.embedding = pool(rows, req.pooling, req.normalize)
                req.result.prompt_eval_duration = now - req.t_start
                self._finish(req, DoneReason.STOP)
                continue
            if req.cancelled:
                self._finish(req, DoneReason.CANCEL)
                continue
            row = rows[0]
            r = req.result
            text, stop_text = None, False
            try:
                tok = picked.get(id(m))
                if isinstance(tok, BaseException):
                    raise tok
                lp = _logprobs(row, tok, req.params.top_logprobs) if req.params.logprobs else None
                if req.text is not None:
                    # the text is decided before the event goes out, so the last event carries the tail
                    if tok in req.stop:
                        text = req.text.finish()        # a stop token's own text is left out
                    else:
                        text, stop_text = req.text.feed(tok)
                        if not stop_text and req.max_tokens > 0 and r.eval_count + 1 >= req.max_tokens:
                            text += req.text.finish()
            except Exception as e:           # a sampling failure ends that request only (its handle raises it)
                self._finish(req, DoneReason.ERROR, e)
                continue
            if req.t_first is None:
                req.t_first = now
                r.prompt_eval_duration = now - req.t_start
            r.tokens.append(tok)
            r.eval_count += 1
            if lp is not None:
                r.logprobs.append(lp)
            deltas = []
            if text is not None:
                r.text += text
                if req.reply is not None and text:
                    deltas = req.reply.feed(text)
            req.events.put(TokenEvent(tok, lp, text, deltas))
            ph = req.placeholder
            req.placeholder = None
            if ph is not None:
                ph.fill(tok)          # already in the next batch (or still pending): the real token now
            if tok in req.stop or stop_text:
                g = req.sampler.grammar
                if g is not None and g.is_error:          # the grammar could not go on: it allowed only the end
                    self._finish(req, DoneReason.GRAMMAR, GGMLValueError(f"grammar: {g.reason}"))
                else:
                    self._finish(req, DoneReason.STOP)
            elif req.max_tokens > 0 and r.eval_count >= req.max_tokens:
                self._finish(req, DoneReason.LENGTH)
            elif ph is None:
                req.pending.append(tok)

    @staticmethod
    def _prepare_masks(batch: _Batch) -> None:
        """The grammar masks of the tokens this batch's outputs will sample, computed now: while the
        compute thread runs the batch when pipelining (llguidance releases the GIL), so sampling then
        only applies them."""
        if batch.embedding:
            return
        for m in batch.members:
            if m.has_out:
                g = m.req.sampler.grammar if m.req.sampler is not None else None
                if g is not None and not m.req.finished.is_set():
                    g.prepare()

    @staticmethod
    def _sample_step(batch: _Batch, out) -> dict:
        """Every generating sequence's next token (:func:`~ggmlpy.sampling.chain.sample_batch`): by member, a
        token id or the exception its sampler raised (it ends that request only)."""
        if batch.embedding or out is None:
            return {}
        members, samplers, rows, base = [], [], [], 0
        for m in batch.members:
            if not m.has_out:
                continue
            req = m.req
            if not req.finished.is_set() and not req.cancelled:
                members.append(m)
                samplers.append(req.sampler)
                rows.append(base)
            base += 1
        if not members:
            return {}
        return {id(m): t for m, t in zip(members, sample_batch(samplers, out[rows]))}

    def _wait_prev(self) -> None:
        """Complete the batch in flight, if any (lock held)."""
        p, self._prev = self._prev, None
        if p is not None:
            self._complete(p)

    def _loop(self) -> None:
        """The request loop (thread ``ggmlpy-runner``).

        It returns once close() was called and every request it knew has
        ended. An error escaping one round (a bug, an error in sampling
        bookkeeping...) ends every request with that error, so no handle is
        left waiting, and the loop goes on serving new requests.
        """
        self._prev = self._building = None          # a loop started again after one that died
        while True:
            try:
                if self._round():
                    return
            except BaseException as e:
                log.exception("runner: the request loop failed; every request it holds ends with the error")
                with self._lock:
                    self._abandon(e)
                    if not isinstance(e, Exception) or self._closing:
                        return
                    self._lock.wait(timeout=0.5)          # an error that repeats must not spin a core

    def _abandon(self, error: BaseException) -> None:
        """After a failed round: wait for the compute in flight, then end every request with ``error`` (lock held)."""
        p, self._prev = self._prev, None
        if p is not None and p.done is not None:
            p.done.wait()                 # the compute thread still reads this batch's graphs and cache
            p.done = None
            self._inflight -= 1
        for b in (p, self._building):
            if b is not None:
                _drop_graphs(b)
        self._building = None
        for req in list(self._active.values()) + list(self._waiting):
            self._finish(req, DoneReason.ERROR, error)
        self._waiting.clear()

    def _round(self) -> bool:
        """One batch: form it (lock held), build it (lock released), launch it. True once closing is done."""
        with self._lock:
            if self._closing:
                self._wait_prev()
                for req in list(self._active.values()) + list(self._waiting):
                    self._finish(req, DoneReason.CANCEL)
                self._waiting.clear()
                return True
            prev = self._prev
            if prev is not None:
                # a sequence waiting for prev's sample gets a placeholder as its next input,
                # so the next batch can be built while prev computes
                for m in prev.members:
                    req = m.req
                    if m.has_out and not prev.embedding and not req.pending and not req.finished.is_set():
                        req.placeholder = _Placeholder()
                        req.pending.append(req.placeholder)
            # an error forming the batch goes to _loop, which ends every request (queued ones too:
            # an error that repeats would otherwise keep them waiting forever)
            batch = self._form_batch(self._wait_prev)
            if batch is None and self._prev is None:
                if not self._active and not self._waiting:
                    self._lock.wait(timeout=0.5)
                return False
            self._building = batch
        if batch is not None:
            t0 = time.perf_counter()
            try:
                for ub in batch.ubatches:
                    self.step.build(ub, batch.embedding)
            except Exception as e:     # handed to the batch: _complete ends its requests with it
                batch.error = e
            if prev is not None and prev.done is not None and not prev.done.is_set():
                self.overlap_s += time.perf_counter() - t0
        with self._lock:
            self._wait_prev()
            if batch is None:
                return False
            if batch.error is not None:
                self._complete(batch)
                self._building = None
                return False
            self._launch(batch)
            self._building = None
            self._prepare_masks(batch)
            if not self.pipeline:
                self._wait_prev()
        return False

    def _stop_loop(self) -> None:
        """At close (``_closing`` set): wait for the loop thread, which ends every request it holds after its
        batch in flight; then end those it never saw (it died, or never started)."""
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join()
        with self._lock:
            while self._direct_busy:      # a direct decode() computing in another thread
                self._lock.wait()
            for req in list(self._active.values()) + list(self._waiting):
                self._finish(req, DoneReason.CANCEL)
            self._waiting.clear()

    def _stop_worker(self) -> None:
        """Stop the compute thread, after the batch it may still be computing."""
        w = self._worker
        if w is not None:
            self._jobs.put(None)
            if w is not threading.current_thread():
                w.join()


def split_ubatches(n_ubatch: int, tokens, positions, seqs, want, tied=None, equal: bool = False) -> list:
    """Cut one logical batch into :class:`_UBatch` es of at most ``n_ubatch`` rows.

    ``tied[i]`` marks a row that must stay with the row before it (a
    same-batch group): a cut moves back to the group's start.

    ``equal`` (a cache with recurrent states: ``cache.split_equal``): every micro-batch gives each of its
    sequences the same number of consecutive rows, as ``ssm_conv`` and ``ssm_scan`` take them
    (llama.cpp's ``split_equal``). The rows keep their order: consecutive runs of one sequence each, cut
    at ``n_ubatch``, go together while they are as long and of different sequences (decoding sequences
    share one micro-batch; a prompt's rows take their own).
    """
    if equal:
        return split_equal(n_ubatch, tokens, positions, seqs, want, tied)
    out = []
    a, n = 0, len(tokens)
    while a < n:
        b = min(a + n_ubatch, n)
        if tied is not None and b < n:
            c = b
            while c > a and tied[c]:
                c -= 1
            if c > a:
                b = c
        out.append(_UBatch(tokens[a:b], positions[a:b], seqs[a:b], np.flatnonzero(want[a:b])))
        a = b
    return out


def as_units(tokens: list, same_batch: list) -> list:
    """Inputs as the loop queues them: a token, or a same-batch group as one tuple (never split)."""
    units, a = [], 0
    for k in group_sizes(same_batch, len(tokens)):
        units.append(tokens[a] if k == 1 else tuple(tokens[a:a + k]))
        a += k
    return units
