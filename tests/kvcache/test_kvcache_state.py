"""Stateful test of ggmlpy.kvcache.Causal against a plain-Python reference model.

A hypothesis ``RuleBasedStateMachine`` drives a real F32 :class:`Causal` cache
(2 layers, 2 KV heads of dim 8, 3 sequences, capacity 8 per sequence, batches
of at most 4, a NEOX RoPE ``shift_fn``) through forwards, removes (to the end
and of a middle range, with the key shift), ``copy_prefix``, ``defrag`` and
``clear``. The reference knows nothing about cell indices: it holds a list of
entries, one per live cell, each with its position, the set of sequences
sharing it and the *unrotated* keys and the values of every layer.

After every step the cache must hold exactly the reference's ``(seq, pos)``
pairs, each cell's K rows must equal ``RoPE(unrotated key, pos)`` (numpy
reference RoPE; 1e-4, 1e-3 once the cell was shifted by ggml) and its V rows
the written values exactly, and the mask of a planned (not committed) batch
must equal a mask built with loops.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import ggmlpy
from ggmlpy import RopeType, Type
from ggmlpy.kvcache import Causal, KVCacheFull, NotSupported

N_LAYERS = 2
HEAD_DIM = 8
N_HEAD = 2
N_SEQ = 3
CAPACITY = 8
MAX_BATCH = 4
BASE = 10000.0
INT32_MAX = 2**31 - 1

TOL_K = 1e-4  # K written as numpy RoPE, stored as F32
TOL_K_SHIFTED = 1e-3  # K re-rotated by ggml's rope_ext

seq_ids = st.integers(0, N_SEQ - 1)
batch_seqs = st.lists(seq_ids, min_size=1, max_size=MAX_BATCH)
batches = st.lists(batch_seqs, max_size=8)


def _rope_np(x: np.ndarray, pos) -> np.ndarray:
    """NEOX RoPE of x (..., n_head, head_dim) at pos (scalar or matching leading axis)."""
    d = x.shape[-1]
    half = d // 2
    pos = np.asarray(pos, dtype=np.float64)
    theta = pos[..., None, None] * BASE ** (-2.0 * np.arange(half) / d)
    cos, sin = np.cos(theta), np.sin(theta)
    x = x.astype(np.float64)
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1).astype(np.float32)


def _shift_fn(ctx, layer, k, offsets):
    return ctx.rope_ext(k, offsets, n_dims=HEAD_DIM, mode=RopeType.NEOX, freq_base=BASE)


class _Entry:
    """One live cell of the reference: position, sharing sequences and payload."""

    __slots__ = ("pos", "seqs", "raw_k", "v", "shifted")

    def __init__(self, pos, seqs, raw_k, v):
        self.pos = pos
        self.seqs = set(seqs)
        self.raw_k = raw_k  # (n_layers, n_head, head_dim), unrotated
        self.v = v  # (n_layers, n_head, head_dim)
        self.shifted = False


class CausalMachine(RuleBasedStateMachine):
    """Real Causal cache vs a list of reference entries."""

    def __init__(self):
        super().__init__()
        self.cache = None

    @initialize(seed=st.integers(0, 2**32 - 1), prefill=batches)
    def setup(self, seed, prefill):
        self.rng = np.random.default_rng(seed)
        self.cache = Causal(N_LAYERS, HEAD_DIM * N_HEAD, HEAD_DIM * N_HEAD, Type.F32,
                            n_head_kv=N_HEAD, shift_fn=_shift_fn)
        self.cache.init(CAPACITY, N_SEQ, MAX_BATCH)
        self.entries: list[_Entry] = []
        for seqs in prefill:  # start from a populated cache more often than not
            self._forward(seqs)

    def teardown(self):
        if self.cache is not None:
            self.cache.close()

    # ------------------------------------------------------------ reference helpers

    def _of(self, seq):
        return [e for e in self.entries if seq in e.seqs]

    def _next_pos(self, seq) -> int:
        held = self._of(seq)
        return max(e.pos for e in held) + 1 if held else 0

    def _free(self) -> int:
        return self.cache.n_cells - len(self.entries)

    def _drop(self, seq, keep) -> None:
        """Remove seq from entries where keep(entry) is false; delete empty entries."""
        for e in self.entries:
            if seq in e.seqs and not keep(e):
                e.seqs.discard(seq)
        self.entries = [e for e in self.entries if e.seqs]

    def _batch(self, seqs):
        """Next positions for a batch of sequence ids (several tokens of a seq ascend)."""
        nxt = {}
        positions = []
        for s in seqs:
            p = nxt.get(s, self._next_pos(s))
            positions.append(p)
            nxt[s] = p + 1
        return np.array(positions, dtype=np.int64), np.array(seqs, dtype=np.int64)

    def _snapshot(self):
        c = self.cache
        return (c.cells.pos.copy(), c.cells.seqs.copy(), c.cells.used,
                [t.get().copy() for t in (*c.keys, *c.values)])

    def _assert_unchanged(self, before) -> None:
        after = self._snapshot()
        assert np.array_equal(before[0], after[0])
        assert np.array_equal(before[1], after[1])
        assert before[2] == after[2]
        for a, b in zip(before[3], after[3]):
            assert np.array_equal(a, b)

    # ------------------------------------------------------------ rules

    @rule(seqs=batch_seqs)
    def forward(self, seqs):
        self._forward(seqs)

    @rule(many=batches)
    def forward_many(self, many):
        for seqs in many:
            self._forward(seqs)

    def _forward(self, seqs):
        """One batch: plan, write K = RoPE(raw, pos) and V for every layer, commit."""
        positions, sids = self._batch(seqs)
        n = positions.size
        raw_k = self.rng.standard_normal((n, N_LAYERS, N_HEAD, HEAD_DIM)).astype(np.float32)
        v = self.rng.standard_normal((n, N_LAYERS, N_HEAD, HEAD_DIM)).astype(np.float32)
        if n > self._free():
            before = self._snapshot()
            with pytest.raises(KVCacheFull):
                self.cache.start_forward(positions, sids)
            self._assert_unchanged(before)
            return
        plan = self.cache.start_forward(positions, sids)  # KVCacheFull here is a failure
        rot = np.stack([_rope_np(raw_k[:, layer], positions) for layer in range(N_LAYERS)])
        with ggmlpy.Context(1 << 20) as ctx:
            gf = ctx.new_graph(64)
            idx = self.cache.index_tensor(ctx, plan)
            for layer in range(N_LAYERS):
                kt = ctx.new_tensor(Type.F32, (HEAD_DIM, N_HEAD, n))
                kt.set(np.ascontiguousarray(rot[layer]))
                vt = ctx.new_tensor(Type.F32, (HEAD_DIM, N_HEAD, n))
                vt.set(np.ascontiguousarray(v[:, layer]))
                for t in self.cache.put(ctx, layer, plan, kt, vt, idx=idx):
                    gf.build_forward_expand(t)
            gf.compute(1)
        self.cache.apply(plan)
        for i in range(n):
            self.entries.append(_Entry(int(positions[i]), {int(sids[i])}, raw_k[i], v[i]))

    @rule(seq=seq_ids, back=st.integers(0, 3), max_int=st.booleans())
    def remove_to_end(self, seq, back, max_int):
        begin = max(0, self._next_pos(seq) - back)
        self.cache.remove(seq, begin, INT32_MAX if max_int else None)
        self._drop(seq, lambda e: e.pos < begin)

    @rule(seq=seq_ids, a=st.integers(0, 12), length=st.integers(1, 6))
    def remove_middle(self, seq, a, length):
        top = self._next_pos(seq)
        begin = a % (top + 1)
        end = begin + length
        moved = [e for e in self._of(seq) if e.pos >= end]
        if any(len(e.seqs) > 1 for e in moved):
            before = self._snapshot()
            with pytest.raises(NotSupported):
                self.cache.remove(seq, begin, end)
            self._assert_unchanged(before)
            return
        self.cache.remove(seq, begin, end)
        self._drop(seq, lambda e: not begin <= e.pos < end)
        for e in moved:
            e.pos -= end - begin
            e.shifted = True

    @rule(src=seq_ids, dst=seq_ids, length=st.integers(0, 2 * CAPACITY))
    def copy_prefix(self, src, dst, length):
        if src == dst:
            with pytest.raises(ValueError):
                self.cache.copy_prefix(src, dst, length)
            return
        self.cache.copy_prefix(src, dst, length)
        self._drop(dst, lambda e: False)
        for e in self._of(src):
            if e.pos < length:
                e.seqs.add(dst)

    @rule()
    def defrag(self):
        used = self.cache.cells.used
        self.cache.defrag()
        live = np.flatnonzero(self.cache.cells.seqs.any(axis=1))
        assert np.array_equal(live, np.arange(used))
        assert self.cache.fragmentation() == 0.0
        assert self.cache.defrag() == []

    @rule(seq=st.one_of(st.none(), seq_ids))
    def clear(self, seq):
        self.cache.clear(seq)
        if seq is None:
            self.entries = []
        else:
            self._drop(seq, lambda e: False)

    # ------------------------------------------------------------ invariants

    @invariant()
    def contents_match(self):
        if self.cache is None:
            return
        cells = self.cache.cells
        pos, seqs = cells.pos, cells.seqs
        assert cells.used == len(self.entries)
        ks = [t.get().reshape(-1, N_HEAD, HEAD_DIM) for t in self.cache.keys]
        vs = [t.get().reshape(-1, N_HEAD, HEAD_DIM) for t in self.cache.values]
        got_pairs = {(int(s), int(pos[c])) for c in np.flatnonzero(seqs.any(axis=1))
                     for s in np.flatnonzero(seqs[c])}
        want_pairs = {(s, e.pos) for e in self.entries for s in e.seqs}
        assert got_pairs == want_pairs
        for e in self.entries:
            cell = None
            for s in e.seqs:
                found = np.flatnonzero(seqs[:, s] & (pos == e.pos))
                assert found.size == 1, (s, e.pos, found)
                assert cell is None or cell == found[0], "shared entry split over cells"
                cell = int(found[0])
            assert set(np.flatnonzero(seqs[cell]).tolist()) == e.seqs
            tol = TOL_K_SHIFTED if e.shifted else TOL_K
            for layer in range(N_LAYERS):
                want_k = _rope_np(e.raw_k[layer], e.pos)
                np.testing.assert_allclose(ks[layer][cell], want_k, atol=tol, rtol=0)
                assert np.array_equal(vs[layer][cell], e.v[layer])
        for s in range(N_SEQ):
            held = [e.pos for e in self._of(s)]
            assert self.cache.seq_pos_min(s) == (min(held) if held else -1)
            assert self.cache.seq_pos_max(s) == (max(held) if held else -1)

    @invariant()
    def planned_mask_matches(self):
        if self.cache is None:
            return
        n = int(self.rng.integers(1, MAX_BATCH + 1))
        if n > self._free():
            return
        positions, sids = self._batch(self.rng.integers(0, N_SEQ, n).tolist())
        before = self._snapshot()
        plan = self.cache.start_forward(positions, sids)
        self._assert_unchanged(before)  # planning changes nothing
        cpos, cseqs = before[0], before[1]
        cell_ids = plan.cell_ids.tolist()
        assert len(set(cell_ids)) == n and not cseqs[cell_ids].any(), "cell_ids must be free cells"
        # the history after the batch is committed: cell -> (pos, set of seqs)
        hist = {int(c): (int(cpos[c]), set(np.flatnonzero(cseqs[c]).tolist()))
                for c in np.flatnonzero(cseqs.any(axis=1))}
        for c, p, s in zip(cell_ids, positions.tolist(), sids.tolist()):
            hist[c] = (p, {s})
        for c, (_, ss) in hist.items():
            if ss & set(sids.tolist()):
                assert plan.lo <= c < plan.hi, "visible range misses a cell of the batch"
        want = np.full((n, plan.hi - plan.lo), -np.inf, dtype=np.float32)
        for i in range(n):
            for j in range(plan.hi - plan.lo):
                c = plan.lo + j
                if c in hist and int(sids[i]) in hist[c][1] and hist[c][0] <= positions[i]:
                    want[i, j] = 0.0
        assert plan.mask.shape == want.shape
        assert np.array_equal(plan.mask, want)


CausalMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=20, deadline=None)
TestCausalMachine = CausalMachine.TestCase


# ------------------------------------------------------------ the one-token plan

@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), window=st.sampled_from([None, 3, 40]),
       padding=st.sampled_from([1, 4]), n_seq=st.integers(1, 3))
def test_one_token_plan_equals_general_plan(seed, window, padding, n_seq):
    """start_forward of one token (planned in C, committed in place) gives the same cell, range and
    mask as the general path, and apply leaves the same cells: across random fills, removes and clears,
    with windows (one wider than the capacity, so nothing is evicted) and padding. An evicting cache
    evicts on a trimmed copy of the cells."""
    rng = np.random.default_rng(seed)
    cache = Causal(1, 8, 8, Type.F32, window=window, padding=padding)
    cache.init(10, n_seq, 3)
    try:
        nxt = [0] * n_seq
        for _ in range(30):
            cells = cache.cells
            op = rng.integers(0, 8)
            if op == 0 and cells.used:
                s = int(rng.integers(0, n_seq))
                cache.remove(s, int(rng.integers(0, nxt[s] + 1)))
                nxt[s] = cache.seq_pos_max(s) + 1
                continue
            if op == 1:
                s = int(rng.integers(0, n_seq))
                cache.clear(s)
                nxt[s] = 0
                continue
            if op == 2 and cells.n_cells - cells.used >= 2:     # a two-token batch: the general path
                s = int(rng.integers(0, n_seq))
                cache.apply(cache.start_forward([nxt[s], nxt[s] + 1], [s, s]))
                nxt[s] += 2
                continue
            s = int(rng.integers(0, n_seq))
            p = nxt[s] + int(rng.integers(0, 2))                # sometimes a gap in the positions
            if cells.used == cells.n_cells:
                with pytest.raises(KVCacheFull):
                    cache.start_forward([p], [s])
                cache.clear(s)
                nxt[s] = 0
                continue
            fast = cache.start_forward(np.array([p]), np.array([s]))
            slow = cache.start_forward([p], [s], except_rows=())  # the general path: a trial copy of the cells
            # a token that evicts (window 3 of capacity 10) is planned on a trimmed copy, with the
            # general path's trim; otherwise the plan commits in place
            assert slow._one is None
            kept = slow._after.seqs & (slow._after.pos == cells.pos)[:, None]
            evicts = bool((cells.seqs & ~kept).any())           # some sequence leaves a position
            assert (fast._one is None) == (fast._after is not None) == evicts
            if evicts:
                assert cache.memory is not None and fast.trim == slow.trim
            assert fast.cell_ids.tolist() == slow.cell_ids.tolist()
            assert (fast.lo, fast.hi) == (slow.lo, slow.hi)
            assert fast.mask.dtype == slow.mask.dtype == np.float16 and np.array_equal(fast.mask, slow.mask)
            after = slow._after
            cache.apply(fast)
            got = cache.cells
            assert (got is cells) == (fast._one is not None)     # committed in place
            assert np.array_equal(got.pos, after.pos) and np.array_equal(got.seqs, after.seqs)
            assert got.used == after.used
            for q in range(n_seq):
                assert (got.seq_pos_min(q), got.seq_pos_max(q)) == (after.seq_pos_min(q), after.seq_pos_max(q))
            assert got.find_free(got.n_cells - got.used) is not None
            nxt[s] = p + 1
    finally:
        cache.close()


def test_one_token_plan_is_stale_after_a_change():
    """A one-token plan commits in place only onto the cells it was made from; after another change it is
    re-applied through a copy, and a plan applies once."""
    cache = Causal(1, 8, 8, Type.F32)
    cache.init(8, 2, 2)
    try:
        a = cache.start_forward([0], [0])
        b = cache.start_forward([0], [1])               # the same free cell, planned from the same state
        cache.apply(a)
        with pytest.raises(ggmlpy.GGMLValueError, match="not free"):
            cache.apply(b)                               # stale: checked against the cells as they are now
        assert cache.cells.used == 1 and cache.seq_pos_max(1) == -1
        with pytest.raises(ggmlpy.GGMLValueError, match="not free"):
            cache.apply(a)                               # once
        c = cache.start_forward([1], [0])
        cache.clear(1)                                   # a change that leaves seq 0 alone
        cache.apply(c)
        assert cache.seq_pos_max(0) == 1 and cache.cells.used == 2
    finally:
        cache.close()
