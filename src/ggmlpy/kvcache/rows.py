"""Recurrent-state bookkeeping: which state row holds each sequence's state, and its checkpoints (:class:`StateRows`).

A recurrent layer (a short convolution, a Mamba or DeltaNet scan) keeps one fixed-size state per sequence
instead of one K/V row per token: the state after the sequence's last token. :class:`StateRows` is the
bookkeeping of those states, pure Python and no tensors (the cache in :mod:`ggmlpy.kvcache.recurrent`
owns them): the store has :attr:`StateRows.n_rows` rows, and

* each sequence's *live* state is in one row (``tail``) and covers its first ``length`` tokens;
* a *checkpoint* is an earlier state of a sequence kept in a row of its own (``checkpoints``): the state
  after its first ``n`` tokens, so that the sequence can go on from ``n`` again (a prompt reused up to
  there). A recurrent state cannot be cut back otherwise: it holds no per-token history;
* rows are shared by reference count. A copied prefix (:meth:`copy`) and a new checkpoint take no copy of
  the data, only a reference: a row held more than once is never written; the next batch of a sequence
  whose row is shared reads it and writes its new state into a free row (copy on write, done by the
  graph that computes the batch, which reads before it writes).

Plan, then commit, as :class:`~ggmlpy.kvcache.Cells`: :meth:`StateRows.advance` is applied to a copy by
the cache's ``start_forward`` and the copy replaces the rows when the plan is applied.

Why the rows always suffice
---------------------------
Every sequence holds at most one live row and ``n_checkpoints`` checkpoints, so no more than
:attr:`StateRows.n_rows` ``= n_seq_max * (1 + n_checkpoints)`` references exist. A batch needs a free
row only for a sequence whose row is also held by something outside the batch, or by another sequence
of the batch that writes it in place; in both cases that row stays referenced, so the rows referenced
after the batch (at most ``n_rows``) include every row it reads, and the new ones were free before.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ggmlpy._core import GGMLTypeError, GGMLValueError

from .cells import CacheStateError, NotSupported

__all__ = ["StateRows"]


class StateRows:
    """Which row holds the state of each sequence, and its checkpoints (see the module docstring).

    Parameters
    ----------
    n_seq_max : int
        Sequences (ids ``0 .. n_seq_max - 1``).
    n_checkpoints : int
        Checkpoints kept per sequence (the oldest goes first); 0: none.

    Attributes
    ----------
    tail : list of int
        Per sequence, its live state's row, -1 for none (an empty sequence starts from zeros).
    length : list of int
        Per sequence, the tokens its live state covers (positions ``0 .. length - 1``).
    checkpoints : list of list of (int, int)
        Per sequence, ``(n, row)``: the state after its first ``n`` tokens, oldest first.
    refs : list of int
        Per row, how many tails and checkpoints hold it.
    """

    def __init__(self, n_seq_max: int, n_checkpoints: int = 0) -> None:
        if isinstance(n_seq_max, bool) or int(n_seq_max) < 1:
            raise GGMLValueError(f"n_seq_max must be >= 1, got {n_seq_max}")
        if isinstance(n_checkpoints, bool) or int(n_checkpoints) < 0:
            raise GGMLValueError(f"n_checkpoints must be >= 0, got {n_checkpoints}")
        self.n_seq_max = int(n_seq_max)
        self.n_checkpoints = int(n_checkpoints)
        self.n_rows = self.n_seq_max * (1 + self.n_checkpoints)
        self.tail = [-1] * self.n_seq_max
        self.length = [0] * self.n_seq_max
        self.checkpoints: list[list[tuple[int, int]]] = [[] for _ in range(self.n_seq_max)]
        #: per sequence, the lengths at which :meth:`advance` keeps a checkpoint (:meth:`want_checkpoint`)
        self.wanted: list[set[int]] = [set() for _ in range(self.n_seq_max)]
        self.refs = [0] * self.n_rows
        #: bumped by every change (a plan made on older rows is applied by replaying it)
        self.version = 0

    def copy(self) -> StateRows:
        new = StateRows.__new__(StateRows)
        new.n_seq_max, new.n_checkpoints, new.n_rows = self.n_seq_max, self.n_checkpoints, self.n_rows
        new.tail, new.length, new.refs = list(self.tail), list(self.length), list(self.refs)
        new.checkpoints = [list(c) for c in self.checkpoints]
        new.wanted = [set(w) for w in self.wanted]
        new.version = self.version
        return new

    # ------------------------------------------------------------------ reading

    def check_seq(self, seq, name: str = "seq") -> int:
        if isinstance(seq, (bool, np.bool_)) or not isinstance(seq, (int, np.integer)):
            raise GGMLTypeError(f"{name} must be an int, got {type(seq).__name__}")
        seq = int(seq)
        if not 0 <= seq < self.n_seq_max:
            raise GGMLValueError(f"{name} {seq} out of range [0, {self.n_seq_max})")
        return seq

    def resume_point(self, seq: int, n: int) -> int:
        """The most tokens ``<= n`` the sequence can go on from: its live state's length or a checkpoint's, else 0."""
        seq, n = self.check_seq(seq), int(n)
        best = self.length[seq] if self.tail[seq] >= 0 and self.length[seq] <= n else 0
        for k, _row in self.checkpoints[seq]:
            if best < k <= n:
                best = k
        return best

    @property
    def used(self) -> int:
        """Rows held by a tail or a checkpoint."""
        return sum(1 for r in self.refs if r)

    # ------------------------------------------------------------------ changes

    def _ref(self, row: int) -> None:
        self.refs[row] += 1

    def _unref(self, row: int) -> None:
        if row >= 0:
            self.refs[row] -= 1

    def _free_rows(self, n: int) -> list[int]:
        rows = [r for r, k in enumerate(self.refs) if k == 0][:n]
        if len(rows) < n:          # cannot happen (the module docstring says why): a bookkeeping bug
            raise CacheStateError(f"recurrent state: {n} free rows needed, {len(rows)} free of {self.n_rows}")
        return rows

    def advance(self, seqs: list[int], n_tokens: int) -> tuple[list[int], list[int]]:
        """Each of ``seqs`` (distinct) takes ``n_tokens`` more tokens: the row each reads its state from (-1:
        none, start from zeros) and the row it writes its new state to. Applied here; call it on a copy to plan.

        A sequence writes in place when nothing outside the batch holds its row (of several in the batch
        sharing one such row, the first), else into a free row. Lengths in :attr:`wanted` reached here
        become checkpoints.
        """
        in_batch: dict[int, int] = {}
        for s in seqs:
            if self.tail[s] >= 0:
                in_batch[self.tail[s]] = in_batch.get(self.tail[s], 0) + 1
        src = [self.tail[s] for s in seqs]
        taken: set[int] = set()
        dst: list[Optional[int]] = []
        for row in src:
            if row >= 0 and row not in taken and self.refs[row] == in_batch[row]:
                taken.add(row)
                dst.append(row)
            else:
                dst.append(None)
        fresh = iter(self._free_rows(sum(d is None for d in dst)))
        dst = [next(fresh) if d is None else d for d in dst]
        for s, old, new in zip(seqs, src, dst):
            if new != old:
                self._unref(old)
                self._ref(new)
            self.tail[s] = new
            self.length[s] += int(n_tokens)
            k = self.length[s]
            if k in self.wanted[s]:
                self._add_checkpoint(s, k, new)
            self.wanted[s] = {w for w in self.wanted[s] if w > k}
        self.version += 1
        return src, dst

    def replayed(self, seqs: list[int], n_tokens: int, src: list[int], dst: list[int]) -> StateRows:
        """A copy with a plan's rows (made by :meth:`advance` on older rows) applied, if advancing these rows
        takes the same ones (the graph reads and writes those); raises otherwise."""
        trial = self.copy()
        if trial.advance(seqs, n_tokens) != (list(src), list(dst)):
            raise CacheStateError("recurrent state: the rows changed since the batch was planned (its graph "
                                  "reads and writes others now); plan it again")
        return trial

    def want_checkpoint(self, seq: int, n: int) -> None:
        """Keep the sequence's state once it covers exactly ``n`` tokens (as :meth:`advance` reaches it)."""
        seq, n = self.check_seq(seq), int(n)
        if n > self.length[seq]:
            self.wanted[seq].add(n)
            self.version += 1

    def _add_checkpoint(self, seq: int, n: int, row: int) -> None:
        cps = self.checkpoints[seq]
        for i, (k, r) in enumerate(cps):
            if k == n:               # the same length again: the newer state replaces it
                self._unref(r)
                del cps[i]
                break
        if self.n_checkpoints == 0:
            return
        while len(cps) >= self.n_checkpoints:
            self._unref(cps.pop(0)[1])
        cps.append((n, row))
        self._ref(row)

    def clear(self, seq: Optional[int] = None) -> None:
        """Forget one sequence (its state, checkpoints and wishes), or every one."""
        for s in range(self.n_seq_max) if seq is None else (self.check_seq(seq),):
            self._unref(self.tail[s])
            for _k, r in self.checkpoints[s]:
                self._unref(r)
            self.tail[s], self.length[s] = -1, 0
            self.checkpoints[s] = []
            self.wanted[s] = set()
        self.version += 1

    def plan_truncate(self, seq: int, n: int) -> Optional[int]:
        """What :meth:`truncate` to ``n`` tokens would take: None (nothing to do: the state covers ``n`` or
        fewer), -1 (clear the sequence) or the row of the checkpoint at ``n``.

        Raises
        ------
        NotSupported
            The state covers more than ``n > 0`` tokens and no checkpoint is at ``n``.
        """
        seq, n = self.check_seq(seq), int(n)
        if n <= 0:
            return -1
        if self.tail[seq] < 0 or self.length[seq] <= n:
            return None
        for k, row in self.checkpoints[seq]:
            if k == n:
                return row
        kept = ", ".join(str(k) for k, _ in self.checkpoints[seq]) or "none"
        raise NotSupported(f"a recurrent state cannot be cut back: sequence {seq} holds {self.length[seq]} tokens "
                           f"and no checkpoint at {n} (checkpoints at: {kept})")

    def truncate(self, seq: int, n: int) -> None:
        """Keep only the sequence's first ``n`` tokens: go back to its checkpoint at ``n`` (checkpoints past it
        are dropped), clear it for ``n <= 0``, nothing when it covers ``n`` or fewer. Raises as
        :meth:`plan_truncate`, changing nothing."""
        row = self.plan_truncate(seq, n)
        seq, n = int(seq), int(n)
        if row is None:
            return
        if row < 0:
            self.clear(seq)
            return
        self._ref(row)
        self._unref(self.tail[seq])
        self.tail[seq], self.length[seq] = row, n
        keep = []
        for k, r in self.checkpoints[seq]:
            if k > n:
                self._unref(r)
            else:
                keep.append((k, r))
        self.checkpoints[seq] = keep
        self.wanted[seq] = {w for w in self.wanted[seq] if w > n}
        self.version += 1

    def copy_seq(self, src: int, dst: int, n: int) -> int:
        """Give ``dst`` (cleared first) the longest state of ``src`` covering at most ``n`` tokens (its live
        one or a checkpoint) and ``src``'s checkpoints below that: references, no data. Returns the tokens
        ``dst`` now covers (0: none)."""
        src, dst, n = self.check_seq(src, "src"), self.check_seq(dst, "dst"), int(n)
        if src == dst:
            return self.resume_point(src, n)
        self.clear(dst)
        k = self.resume_point(src, n)
        if k == 0:
            return 0
        row = self.tail[src] if self.tail[src] >= 0 and self.length[src] == k else \
            next(r for c, r in self.checkpoints[src] if c == k)
        self._ref(row)
        self.tail[dst], self.length[dst] = row, k
        for c, r in self.checkpoints[src]:
            if c <= k:
                self._ref(r)
                self.checkpoints[dst].append((c, r))
        self.version += 1
        return k

    def load(self, seq: int, n: int, row: int) -> None:
        """The sequence (cleared first) holds a state of ``n`` tokens written into the free ``row``."""
        seq = self.check_seq(seq)
        self.clear(seq)
        if self.refs[row]:
            raise GGMLValueError(f"recurrent state: row {row} is in use")
        self._ref(row)
        self.tail[seq], self.length[seq] = row, int(n)
        self.version += 1

    def free_row_after_clear(self, seq: int) -> Optional[int]:
        """A row that is free once ``seq`` is cleared (for loading a state into it), or None."""
        trial = self.copy()
        trial.clear(seq)
        rows = [r for r, k in enumerate(trial.refs) if k == 0]
        return rows[0] if rows else None

    def check(self) -> None:
        """Assert the bookkeeping is consistent (for tests): every reference counted once."""
        refs = [0] * self.n_rows
        for s in range(self.n_seq_max):
            if self.tail[s] >= 0:
                refs[self.tail[s]] += 1
            else:
                assert self.length[s] == 0 and not self.checkpoints[s], s
            assert len(self.checkpoints[s]) <= self.n_checkpoints, s
            for _k, r in self.checkpoints[s]:
                refs[r] += 1
        assert refs == self.refs, (refs, self.refs)

    def __repr__(self) -> str:
        live = {s: (self.tail[s], self.length[s]) for s in range(self.n_seq_max) if self.tail[s] >= 0}
        return f"StateRows(n_rows={self.n_rows}, used={self.used}, live={live})"
