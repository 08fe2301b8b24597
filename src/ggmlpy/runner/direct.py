"""The runner's direct calls: a micro-batch computed now, in the caller's thread, outside the request loop.

:class:`DirectCalls` is a base class of :class:`~ggmlpy.runner.Runner` (as the request loop is): ``decode``,
``decode_batch`` and ``encode_image`` take the cache and the scheduler for one call at a time
(:meth:`~.loop.RequestLoop._direct`), never while requests are served, and record what they append in the
slot table as the loop does. It uses of the runner: ``inputs``, ``slots``, ``step``, ``cache``, ``n_ctx``,
``n_ubatch``, ``n_seq_max`` and the loop's ``_direct``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import numpy as np

from ggmlpy._core import GGMLValueError

from .batching import _NO_ROWS, _ROW0, _UBatch
from .loop import split_ubatches

__all__ = ["DirectCalls"]


class DirectCalls:
    """Direct use of a runner's cache: :meth:`decode`, :meth:`decode_batch`, :meth:`encode_image`."""

    def encode_image(self, image) -> np.ndarray:
        """An image's embeddings as the text model receives them: ``float32[rows, n_embd]``, the rows of its
        tiles in order (what replaces its image tokens in a prompt); computed now, synchronously, through
        this runner's scheduler, and not kept (prompts keep theirs, see :meth:`submit`).

        ``image`` is anything ``images=`` takes (a :class:`~ggmlpy.vision.preprocess.PreprocessedImage`
        skips the preprocessing, as ``ggmlpy bench -i`` times it).

        Raises
        ------
        GGMLValueError
            No vision encoder, a bad image, one over the reservation's tile bound, or requests being
            served (like :meth:`decode`, for direct use).
        """
        tiles = self.inputs.pixels(image, "encode_image")
        with self._direct("encode_image"):
            return self.step.encode(tiles)

    def decode(self, tokens, seq: int = 0, logits="last", positions=None, *,
               embeddings: bool = False, images: Sequence = ()) -> Optional[np.ndarray]:
        """Append ``tokens`` to sequence ``seq`` and compute them (synchronously).

        Positions continue from what the cache holds for ``seq`` unless
        given. The tokens are computed in micro-batches of ``n_ubatch``.

        Parameters
        ----------
        logits : ``"last"`` (default), ``"all"``, ``None``/False, or a list of indices into ``tokens``
            The rows to output.
        embeddings : bool
            Output those rows' final-normed hidden states (the graph
            :meth:`embed` uses, without the output head) instead of logits.

        Returns
        -------
        numpy.ndarray ``float32[n_rows, n_vocab]`` (``[n_rows, n_embd]`` with
        ``embeddings``) of the requested rows, or None.

        Raises
        ------
        GGMLValueError
            Token ids outside the vocabulary, a sequence id out of range,
            positions at or past ``n_ctx``, or requests being served.
        ClosedError
            The runner is closed (a close() from another thread waits for a
            decode already computing).
        """
        self._check_open("decode")
        seq = self._check_seq_id(seq, "decode")
        if not embeddings and logits is not None and logits is not False:
            self._check_logits("decode")
        one_row = type(logits) is str and logits in ("last", "all")
        tied = None
        if images is not None and len(images):
            p = self.inputs.prompt(tokens, "decode", images=images)
            toks = np.asarray(p.ids, np.int32)
            tied = np.zeros(len(toks), bool)
            for i, k in enumerate(p.same_batch):
                tied[i + 1:i + 1 + k] = True
        else:
            if positions is None and (one_row or logits is None or logits is False):
                tok = self.inputs.one_token(tokens)
                if tok is not None:             # one generation step: scalars instead of arrays
                    return self._decode_one(tok, seq, logits is not None and logits is not False, bool(embeddings))
            toks = self.inputs.check_tokens(tokens, "decode")
        n = len(toks)
        if n == 0:
            raise GGMLValueError("decode: empty batch")
        if positions is not None:
            pos = np.asarray(positions, dtype=np.int64)
            if pos.shape != toks.shape:
                raise GGMLValueError(f"decode: {len(pos)} positions for {n} tokens")
        want = np.zeros(n, dtype=bool)
        if isinstance(logits, str):
            if logits == "last":
                want[-1] = True
            elif logits == "all":
                want[:] = True
            else:
                raise GGMLValueError(f"decode: logits must be 'last', 'all', None or indices (got {logits!r})")
        elif logits is not None and logits is not False:
            idx = np.asarray(logits, dtype=np.int64)
            if idx.size and (idx.min() < -n or idx.max() >= n):
                raise GGMLValueError(f"decode: logits indices out of range for {n} tokens")
            want[idx] = True
        with self._direct("decode"):
            if positions is None:             # read under _direct: the cache is alive and no one else writes
                start = self.cache.seq_pos_max(seq) + 1
                pos = np.arange(start, start + n, dtype=np.int64)
            if pos.min() < 0 or pos.max() >= self.n_ctx:
                raise GGMLValueError(f"decode: positions {int(pos.min())}..{int(pos.max())} are outside the "
                                     f"context [0, {self.n_ctx}) of sequence {seq}")
            return self._run_direct(split_ubatches(self.n_ubatch, toks, pos, np.full(n, seq, np.int64), want, tied,
                                                   equal=getattr(self.cache, "split_equal", False)),
                                    [seq],
                                    embedding=bool(embeddings), appended=(int(pos[0]), toks.tolist())
                                    if positions is None else None)

    def _check_logits(self, what: str) -> None:
        if not getattr(self.model, "can_generate", True):
            raise GGMLValueError(f"{what}: this {self.model.config.arch} model is an encoder: it has no output head "
                                 "for logits (decode(..., embeddings=True) gives its hidden states)")

    def _decode_one(self, tok: int, seq: int, want: bool, embedding: bool) -> Optional[np.ndarray]:
        # One generation step, the hot path of token-by-token decoding: what decode() + _run_direct do
        # for one token, without the batch checks, micro-batch splitting or a generator context manager
        # (each step runs on caches the weight sweep has just emptied, so every call saved counts).
        self._direct_enter("decode")
        try:
            p = self.cache.seq_pos_max(seq) + 1
            if p >= self.n_ctx:
                raise GGMLValueError(f"decode: positions {p}..{p} are outside the context [0, {self.n_ctx}) of "
                                     f"sequence {seq}")
            ub = _UBatch(np.array([tok], np.int32), np.array([p], np.int64), np.array([seq], np.int64),
                         _ROW0 if want else _NO_ROWS)
            r = self._run_ubatch(ub, embedding, (seq,))
            self._record_direct((seq,), (p, (tok,)))
            return r
        finally:
            self._direct_exit()

    def _record_direct(self, seqs, appended) -> None:
        """After a direct batch: the slot of ``seqs[0]`` records ``appended = (first position, tokens)``
        when they continued what it holds; otherwise the slots of ``seqs`` are dropped (a request
        re-processes them)."""
        if appended is not None and len(self.slots[seqs[0]].tokens) == appended[0]:
            self.slots.committed(seqs[0], appended[1])
        else:
            for s in seqs:
                self.slots.reset(s)
        self.n_batches += 1

    def _run_ubatch(self, ub: _UBatch, embedding: bool, seqs) -> Optional[np.ndarray]:
        """Build and compute one micro-batch of direct use; on failure, whatever part of the batch
        reached the cache is undone for the sequences ``seqs``, as for a failed compute."""
        try:
            self.step.build(ub, embedding)
            return self._compute(ub)
        except BaseException:
            if ub.built is not None:
                ub.built.free()
                ub.built = None
            for s in seqs:
                self.slots.clear(s)
            raise

    def _run_direct(self, ubatches, seqs, embedding, appended=None) -> Optional[np.ndarray]:
        """Compute micro-batches of direct use (sequences ``seqs``); their output rows, concatenated.

        ``appended`` is ``(first position, tokens)`` when one sequence's tokens continued it: its slot's
        token record grows with them (so a request can reuse them as a prefix); otherwise the slots'
        records are dropped (a request re-processes them).
        """
        rows = []
        # a continuation is recorded micro-batch by micro-batch: the next one's M-RoPE positions read what the
        # sequence holds before it (:mod:`.mrope`)
        grow = appended is not None and len(self.slots[seqs[0]].tokens) == appended[0]
        for ub in ubatches:
            r = self._run_ubatch(ub, embedding, seqs)
            if r is not None:
                rows.append(r)
            if grow:
                self.slots.committed(seqs[0], ub.tokens.tolist())
        if grow:
            self.n_batches += 1
        else:
            self._record_direct(seqs, appended)
        return (rows[0] if len(rows) == 1 else np.concatenate(rows)) if rows else None

    def decode_batch(self, tokens, positions, seq_ids, logits) -> np.ndarray:
        """Compute one batch of several sequences: ``tokens``, ``positions``, ``seq_ids`` per row.

        ``logits`` is a boolean mask (or indices) of the rows to return, in order.
        """
        self._check_open("decode_batch")
        self._check_logits("decode_batch")
        toks = self.inputs.check_tokens(tokens, "decode_batch")
        pos = np.asarray(positions, dtype=np.int64)
        seqs = np.asarray(seq_ids, dtype=np.int64)
        if not (toks.shape == pos.shape == seqs.shape) or toks.size == 0:
            raise GGMLValueError(f"decode_batch: tokens, positions and seq_ids need one equal, non-zero length "
                                 f"(got {toks.size}, {pos.size}, {seqs.size})")
        for s in np.unique(seqs):
            self._check_seq_id(s, "decode_batch")
        if pos.min() < 0 or pos.max() >= self.n_ctx:
            raise GGMLValueError(f"decode_batch: positions must be in [0, {self.n_ctx})")
        want = np.zeros(toks.size, dtype=bool)
        want[np.asarray(logits)] = True
        with self._direct("decode_batch"):
            return self._run_direct(split_ubatches(self.n_ubatch, toks, pos, seqs, want,
                                                   equal=getattr(self.cache, "split_equal", False)),
                                    [int(s) for s in np.unique(seqs)], embedding=False)
