"""Batches and micro-batches: the records of what the loop computes in one step.

A logical batch (:class:`_Batch`) of up to ``n_batch`` rows (several sequences, round-robin) is cut by
the loop (:func:`~.loop.split_ubatches`) into micro-batches (:class:`_UBatch`) of at most ``n_ubatch``
rows; a same-batch group (Ollama's ``SameBatch``: e.g. an image's embeddings) is never cut. A
:class:`_Placeholder` stands for a token still being sampled from the batch computing (pipelining).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import numpy as np

if TYPE_CHECKING:
    from .loop import _Request

__all__: list = []


_ROW0 = np.zeros(1, np.int32)             # out_rows of a one-token micro-batch: its only row
_NO_ROWS = np.zeros(0, np.int32)
_ROW0.flags.writeable = _NO_ROWS.flags.writeable = False


@dataclass
class _UBatch:
    tokens: np.ndarray
    positions: np.ndarray
    seqs: np.ndarray
    out_rows: np.ndarray         # indices into this micro-batch whose output is wanted
    built: object = None         # BuiltGraph
    plan: object = None


@dataclass
class _Member:
    req: _Request
    n_in: int                    # inputs of this sequence in the batch
    has_out: bool                # whether the batch produces its output (a sample, or the embedding rows)
    n_out: int = 1               # its output rows in the batch's output (an embedding's: what its pooling reads)


@dataclass
class _Batch:
    ubatches: list
    embedding: object            # False (logits), True (hidden states) or "rank" (classification scores)
    members: list
    outputs: list = field(default_factory=list)
    done: Optional[threading.Event] = None    # set by the compute thread (pipelining)
    error: Optional[BaseException] = None


class _Placeholder:
    """A sequence's next input whose token is sampled from the batch still computing (pipelining).

    Once in a batch it knows its micro-batch row and its place in the slot's token record (which holds
    ``-1`` there): :meth:`fill` writes the sampled token into both.
    """

    __slots__ = ("value", "ubatch", "row", "record", "pos")

    def __init__(self) -> None:
        self.value = self.ubatch = self.row = self.record = self.pos = None

    def fill(self, tok: int) -> None:
        self.value = int(tok)
        if self.ubatch is not None:
            self.ubatch.tokens[self.row] = self.value
        rec = self.record
        if rec is not None and self.pos < len(rec.tokens) and rec.tokens[self.pos] == -1:
            rec.tokens[self.pos] = self.value

    def __int__(self) -> int:
        return 0 if self.value is None else self.value

    def __repr__(self) -> str:
        return f"<sampled token {self.value}>"


def _drop_graphs(batch: _Batch) -> None:
    """Free the graphs of a batch's micro-batches that were built and not computed (nothing computes them)."""
    for ub in batch.ubatches:
        if ub.built is not None:
            ub.built.free()
            ub.built = None


def split_equal(n_ubatch: int, tokens, positions, seqs, want, tied) -> list:
    """:func:`~.loop.split_ubatches` with ``equal``: micro-batches that give each of their sequences as many
    consecutive rows (a cache with recurrent states), the rows in their order."""
    seqs = np.asarray(seqs)
    n = len(tokens)
    bounds = np.concatenate(([0], np.flatnonzero(np.diff(seqs)) + 1, [n])).tolist()
    pieces = []                     # (first row, rows): each run cut at n_ubatch, never inside a tied group
    for a, e in zip(bounds[:-1], bounds[1:]):
        while a < e:
            b = min(a + n_ubatch, e)
            if tied is not None and b < e:
                c = b
                while c > a and tied[c]:
                    c -= 1
                if c > a:
                    b = c
            pieces.append((a, b - a))
            a = b
    groups: list[list] = []
    for a, k in pieces:
        g = groups[-1] if groups else None
        if g and g[0][1] == k and (len(g) + 1) * k <= n_ubatch and all(seqs[x] != seqs[a] for x, _ in g):
            g.append((a, k))
        else:
            groups.append([(a, k)])
    out = []
    for g in groups:
        a, b = g[0][0], g[-1][0] + g[-1][1]
        out.append(_UBatch(tokens[a:b], positions[a:b], seqs[a:b], np.flatnonzero(want[a:b])))
    return out
