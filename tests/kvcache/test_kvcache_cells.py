"""Tests for ggmlpy.kvcache.Cells, the pure-numpy KV cache bookkeeping."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from ggmlpy.kvcache import Cells, NotSupported

X = -np.inf


def _m(*rows: str) -> np.ndarray:
    """Mask from strings: 'o' = visible (0.0), 'x' = masked (-inf)."""
    return np.array([[0.0 if ch == "o" else X for ch in r] for r in rows], dtype=np.float32)


def _snapshot(cells: Cells):
    return (cells.pos.copy(), cells.seqs.copy(), cells.used,
            [(cells.seq_pos_min(s), cells.seq_pos_max(s)) for s in range(cells.n_seq_max)])


def _assert_same(a, b):
    assert np.array_equal(a[0], b[0])
    assert np.array_equal(a[1], b[1])
    assert a[2:] == b[2:]


def _interleaved() -> Cells:
    """6 cells: seq 0 at pos 0,1,2 in cells 0,2,4; seq 1 at pos 0,1,2 in cells 1,3,5."""
    c = Cells(6, 2)
    c.apply([0, 2, 4, 1, 3, 5], [0, 1, 2, 0, 1, 2], [0, 0, 0, 1, 1, 1])
    return c


BATCH = ([0, 1, 2, 0, 1, 2], [0, 0, 0, 1, 1, 1])


# ---------------------------------------------------------------- construction


def test_init_and_properties():
    c = Cells(5, 3)
    assert (c.n_cells, c.n_seq_max, c.used) == (5, 3, 0)
    assert c.pos.dtype == np.int32 and np.array_equal(c.pos, [-1] * 5)
    assert c.seqs.shape == (5, 3) and c.seqs.dtype == bool and not c.seqs.any()
    assert c.seq_pos_min(0) == -1 and c.seq_pos_max(2) == -1
    with pytest.raises(ValueError):
        c.pos[0] = 3
    with pytest.raises(ValueError):
        c.seqs[0, 0] = True
    for bad in [(0, 1), (1, 0), (-2, 1)]:
        with pytest.raises(ValueError):
            Cells(*bad)
    with pytest.raises(ValueError):
        c.seq_pos_min(3)
    with pytest.raises(TypeError):
        c.seq_pos_max(1.0)


# ---------------------------------------------------------------- find_free / apply


def test_find_free_and_apply():
    c = Cells(6, 2)
    assert np.array_equal(c.find_free(4), [0, 1, 2, 3])
    assert c.find_free(0).size == 0
    assert c.find_free(7) is None
    assert c.used == 0  # planning never mutates
    c.apply([0, 2, 3], [0, 1, 2], [0, 0, 1])
    assert np.array_equal(c.pos, [0, -1, 1, 2, -1, -1])
    assert np.array_equal(c.seqs[:, 0], [1, 0, 1, 0, 0, 0])
    assert np.array_equal(c.seqs[:, 1], [0, 0, 0, 1, 0, 0])
    assert c.used == 3
    assert (c.seq_pos_min(0), c.seq_pos_max(0), c.seq_pos_min(1), c.seq_pos_max(1)) == (0, 1, 2, 2)
    assert np.array_equal(c.find_free(3), [1, 4, 5])  # holes need not be contiguous
    assert c.find_free(4) is None
    with pytest.raises(ValueError):
        c.find_free(-1)


@pytest.mark.parametrize(
    "args",
    [
        ([1], [0], [2]),  # seq id out of range
        ([1], [0], [-1]),
        ([1, 4], [0], [0, 0]),  # lengths differ
        ([0], [5], [0]),  # cell not free
        ([1, 1], [5, 6], [0, 0]),  # repeated cell
        ([6], [5], [0]),  # cell out of range
        ([1], [-1], [0]),  # negative position
    ],
)
def test_apply_rejects_and_leaves_state(args):
    c = Cells(6, 2)
    c.apply([0], [0], [0])
    before = _snapshot(c)
    with pytest.raises(ValueError):
        c.apply(*args)
    _assert_same(before, _snapshot(c))


# ---------------------------------------------------------------- mask


def test_mask_causal_two_sequences_interleaved():
    c = _interleaved()
    m = c.mask(*BATCH)
    assert m.dtype == np.float32 and m.shape == (6, 6)
    expected = _m("oxxxxx", "oxoxxx", "oxoxox", "xoxxxx", "xoxoxx", "xoxoxo")
    assert np.array_equal(m, expected)


def test_mask_window():
    m = _interleaved().mask(*BATCH, window=1)
    expected = _m("oxxxxx", "oxoxxx", "xxoxox", "xoxxxx", "xoxoxx", "xxxoxo")
    assert np.array_equal(m, expected)
    m0 = _interleaved().mask(*BATCH, window=0)
    assert np.array_equal(m0, _m("oxxxxx", "xxoxxx", "xxxxox", "xoxxxx", "xxxoxx", "xxxxxo"))


def test_mask_except_rows_and_non_causal():
    c = _interleaved()
    m = c.mask(*BATCH, except_rows=[0, 4])
    expected = _m("oxoxox", "oxoxxx", "oxoxox", "xoxxxx", "xoxoxo", "xoxoxo")
    assert np.array_equal(m, expected)
    full = _m(*["oxoxox"] * 3, *["xoxoxo"] * 3)
    assert np.array_equal(c.mask(*BATCH, causal=False), full)
    # window still applies to exempt rows
    m = c.mask(*BATCH, except_rows=[1], window=0)
    assert np.array_equal(m[:3], _m("oxxxxx", "xxoxox", "xxxxox"))


def test_mask_range_and_errors():
    c = _interleaved()
    m = c.mask(*BATCH, lo=2, hi=5)
    assert np.array_equal(m, _interleaved().mask(*BATCH)[:, 2:5])
    assert c.mask([], [], hi=3).shape == (0, 3)
    # free cells are masked for everyone
    c.remove(0, 1, None)
    assert np.array_equal(c.mask([5], [0]), _m("oxxxxx"))
    for kw in [dict(lo=4, hi=2), dict(hi=7), dict(lo=-1), dict(window=-1),
               dict(except_rows=[6])]:
        with pytest.raises(ValueError):
            c.mask(*BATCH, **kw)
    with pytest.raises(ValueError):
        c.mask([0, 1], [0])
    with pytest.raises(ValueError):
        c.mask([0], [2])


# ---------------------------------------------------------------- visible_range


def test_visible_range():
    c = Cells(10, 3)
    c.apply([2, 3, 6, 7], [0, 1, 0, 1], [0, 0, 1, 1])
    assert c.visible_range([0]) == (2, 4)
    assert c.visible_range([1]) == (6, 8)
    assert c.visible_range([0, 1]) == (2, 8)
    assert c.visible_range([0], pad=4) == (0, 4)
    assert c.visible_range([1], pad=4) == (4, 8)
    assert c.visible_range([1], pad=3) == (6, 9)
    assert c.visible_range([0, 1], pad=6) == (0, 10)  # 12, clamped
    assert c.visible_range([2]) == (0, 0)
    with pytest.raises(ValueError):
        c.visible_range([0], pad=0)


# ---------------------------------------------------------------- remove


def test_remove_to_end():
    c = Cells(6, 1)
    c.apply(range(6), range(6), [0] * 6)
    shifted = c.remove(0, 3)
    assert shifted.size == 0
    assert np.array_equal(c.pos, [0, 1, 2, -1, -1, -1])
    assert c.used == 3 and c.seq_pos_max(0) == 2
    assert np.array_equal(c.find_free(1), [3])


def test_remove_middle_shifts():
    c = Cells(6, 1)
    c.apply([5, 4, 3, 2, 1, 0], range(6), [0] * 6)  # pos 0 in cell 5, ...
    shifted = c.remove(0, 1, 3)
    assert np.array_equal(shifted, [0, 1, 2])  # cells of pos 5, 4, 3
    assert np.array_equal(c.pos, [3, 2, 1, -1, -1, 0])
    assert (c.used, c.seq_pos_min(0), c.seq_pos_max(0)) == (4, 0, 3)
    assert c.remove(0, 1, 1).size == 0  # empty range is a no-op
    assert np.array_equal(c.pos, [3, 2, 1, -1, -1, 0])
    with pytest.raises(ValueError):
        c.remove(0, 3, 2)


def test_remove_shared_shift_not_supported_unchanged():
    c = Cells(8, 2)
    c.apply(range(5), range(5), [0] * 5)
    c.copy_prefix(0, 1, 5)  # every cell shared
    before = _snapshot(c)
    with pytest.raises(NotSupported):
        c.remove(0, 1, 2)
    _assert_same(before, _snapshot(c))
    # removing to the end never shifts, so sharing is fine
    c.remove(0, 3)
    assert np.array_equal(c.seqs[:, 0], [1, 1, 1, 0, 0, 0, 0, 0])
    assert np.array_equal(c.seqs[:, 1], [1, 1, 1, 1, 1, 0, 0, 0])
    # removing shared cells without shifting unshared ones is fine
    # shifting after a middle removal touches shared cells 1, 2 -> refused, untouched
    c.apply([5, 6], [3, 4], [0, 0])
    before = _snapshot(c)
    with pytest.raises(NotSupported):
        c.remove(0, 0, 1)
    _assert_same(before, _snapshot(c))


def test_remove_shift_only_unshared_cells():
    c = Cells(8, 2)
    c.apply(range(3), range(3), [0] * 3)
    c.copy_prefix(0, 1, 2)  # cells 0, 1 shared
    c.apply([3, 4], [3, 4], [0, 0])
    shifted = c.remove(0, 1, 2)  # cells with pos >= 2 (2, 3, 4) are not shared
    assert np.array_equal(shifted, [2, 3, 4])
    assert np.array_equal(c.pos[:5], [0, 1, 1, 2, 3])
    assert np.array_equal(c.seqs[:5, 0], [1, 0, 1, 1, 1])
    assert np.array_equal(c.seqs[:5, 1], [1, 1, 0, 0, 0])
    assert c.used == 5


# ---------------------------------------------------------------- copy_prefix


def test_copy_prefix():
    c = Cells(8, 3)
    c.apply(range(4), range(4), [0] * 4)
    c.apply([4, 5], [0, 1], [1, 1])
    c.copy_prefix(0, 1, 2)
    assert np.array_equal(c.seqs[:, 1], [1, 1, 0, 0, 0, 0, 0, 0])
    assert c.used == 4  # cells 4, 5 were freed
    assert np.array_equal(c.pos[4:6], [-1, -1])
    # seq 1 continues at pos 2, 3 and does not see seq 0's pos 2, 3
    cell_ids = c.find_free(2)
    c.apply(cell_ids, [2, 3], [1, 1])
    assert np.array_equal(c.mask([2, 3], [1, 1], hi=6), _m("ooxxox", "ooxxoo"))
    c.copy_prefix(0, 2, 0)
    assert not c.seqs[:, 2].any()
    with pytest.raises(ValueError):
        c.copy_prefix(0, 0, 2)
    with pytest.raises(ValueError):
        c.copy_prefix(0, 3, 2)


# ---------------------------------------------------------------- can_resume / trim_window


def test_can_resume():
    c = Cells(8, 2)
    assert c.can_resume(0, 0)
    assert not c.can_resume(0, 1)
    c.apply(range(5), range(5), [0] * 5)
    assert all(c.can_resume(0, p) for p in range(6))
    assert not c.can_resume(0, 6)
    assert not c.can_resume(1, 1)
    c.trim_window({0: 5}, 4)  # drops pos 0
    assert not c.can_resume(0, 5)
    assert c.can_resume(0, 5, window=4)
    assert not c.can_resume(0, 4, window=4)  # needs pos 0
    assert not c.can_resume(0, 5, window=0)  # 0 = unlimited: needs [0, 5), pos 0 is gone
    with pytest.raises(ValueError):
        c.can_resume(0, -1)


def test_can_resume_window_zero_means_unlimited():
    c = Cells(4, 1)
    c.apply([0, 1], [1, 2], [0, 0])
    assert not c.can_resume(0, 3, window=0)
    assert c.can_resume(0, 3, window=2)


def test_trim_window():
    c = Cells(10, 2)
    c.apply(range(6), range(6), [0] * 6)
    c.copy_prefix(0, 1, 3)
    c.trim_window({0: 6, 1: 3}, 3)  # seq 0 keeps pos >= 3, seq 1 keeps pos >= 0
    assert np.array_equal(c.seqs[:6, 0], [0, 0, 0, 1, 1, 1])
    assert np.array_equal(c.seqs[:6, 1], [1, 1, 1, 0, 0, 0])
    assert c.used == 6
    c.trim_window({1: 5}, 3)  # seq 1 keeps pos >= 2
    assert np.array_equal(c.pos, [-1, -1, 2, 3, 4, 5, -1, -1, -1, -1])
    assert (c.used, c.seq_pos_min(1), c.seq_pos_min(0)) == (4, 2, 3)
    with pytest.raises(ValueError):
        c.trim_window({2: 1}, 1)


def test_clear():
    c = _interleaved()
    c.clear(1)
    assert c.used == 3 and not c.seqs[:, 1].any()
    assert np.array_equal(c.pos, [0, -1, 1, -1, 2, -1])
    assert c.seq_pos_max(1) == -1
    c.clear()
    assert c.used == 0 and np.array_equal(c.pos, [-1] * 6)


# ---------------------------------------------------------------- defrag


def _apply_moves(payload: np.ndarray, moves) -> None:
    for src, dst, n in moves:
        payload[dst:dst + n] = payload[src:src + n].copy()


def _pairs(c: Cells, payload: np.ndarray) -> set:
    return {(s, int(c.pos[i]), int(payload[i])) for i, s in zip(*np.nonzero(c.seqs))}


def _check_defrag(c: Cells, payload: np.ndarray):
    before = _pairs(c, payload)
    used = c.used
    moves = c.defrag_plan()
    assert c.used == used and _pairs(c, payload) == before  # plan does not mutate
    _apply_moves(payload, moves)
    c.apply_defrag(moves)
    occupied = c.seqs.any(axis=1)
    assert c.used == used
    assert np.array_equal(np.flatnonzero(occupied), np.arange(used))
    assert _pairs(c, payload) == before
    assert c.defrag_plan() == []
    return moves


def test_defrag_historic_scenario():
    c = Cells(16, 1)
    payload = np.arange(1, 17)
    c.apply(range(16), range(16), [0] * 16)
    assert np.array_equal(c.remove(0, 2, 4), np.arange(4, 16))
    c.remove(0, 13)
    assert c.used == 13
    moves = _check_defrag(c, payload)
    assert moves == [(13, 2, 2)]
    assert np.array_equal(payload[:13], [1, 2, 14, 15, 5, 6, 7, 8, 9, 10, 11, 12, 13])
    assert np.array_equal(c.pos[:13], [0, 1, 11, 12, 2, 3, 4, 5, 6, 7, 8, 9, 10])


def test_defrag_runs_and_sequences():
    c = Cells(10, 2)
    live = [0, 3, 5, 7, 8, 9]
    c.apply(live, [0, 1, 2, 0, 1, 2], [0, 0, 0, 1, 1, 1])
    payload = np.arange(100, 110)
    moves = _check_defrag(c, payload)
    assert moves == [(7, 1, 2), (9, 4, 1)]
    assert np.array_equal(payload[:6], [100, 107, 108, 103, 109, 105])


def test_defrag_nothing_to_do_and_apply_errors():
    c = Cells(5, 1)
    assert c.defrag_plan() == []
    c.apply([0, 1, 3], [0, 1, 2], [0, 0, 0])
    before = _snapshot(c)
    with pytest.raises(ValueError):
        c.apply_defrag([(3, 2, 1), (3, 0, 1)])  # second overwrites live cell 0
    with pytest.raises(ValueError):
        c.apply_defrag([(3, 4, 2)])
    _assert_same(before, _snapshot(c))
    c.apply_defrag([(3, 2, 1)])
    assert np.array_equal(c.pos, [0, 1, 2, -1, -1])


# ---------------------------------------------------------------- state machine


def _loop_mask(cells, payload, tokens, positions, seq_ids, window, causal, except_rows,
               lo, hi):
    occupied = cells.seqs.any(axis=1)
    out = np.full((len(positions), hi - lo), -np.inf, dtype=np.float32)
    for i, (p, s) in enumerate(zip(positions, seq_ids)):
        for j, c in enumerate(range(lo, hi)):
            if not occupied[c]:
                continue
            cpos, cseqs = tokens[int(payload[c])]
            if s not in cseqs:
                continue
            if causal and cpos > p and i not in except_rows:
                continue
            if window is not None and cpos < p - window:
                continue
            out[i, j] = 0.0
    return out


class CellsMachine(RuleBasedStateMachine):
    """Cells against a reference: token id -> [pos, set of seqs] (one token = one cell)."""

    @initialize(n_cells=st.integers(2, 16), n_seq=st.integers(1, 3))
    def setup(self, n_cells, n_seq):
        self.cells = Cells(n_cells, n_seq)
        self.payload = np.full(n_cells, -1, dtype=np.int64)
        self.tokens: dict[int, list] = {}
        self.next_id = 0

    def _max_pos(self, seq):
        return max((p for p, ss in self.tokens.values() if seq in ss), default=-1)

    def _prune(self):
        self.tokens = {t: v for t, v in self.tokens.items() if v[1]}

    @rule(data=st.data())
    def add_batch(self, data):
        n_seq = self.cells.n_seq_max
        order = data.draw(st.lists(st.integers(0, n_seq - 1), min_size=1, max_size=6))
        nxt = {s: self._max_pos(s) + 1 for s in range(n_seq)}
        batch = []
        for s in order:  # sequences interleave in the batch
            batch.append((s, nxt[s]))
            nxt[s] += 1
        n = len(batch)
        cell_ids = self.cells.find_free(n)
        n_free = self.cells.n_cells - len(self.tokens)
        if cell_ids is None:
            assert n_free < n
            return
        assert n <= n_free and len(cell_ids) == n
        assert not self.cells.seqs[cell_ids].any()
        ids = np.arange(self.next_id, self.next_id + n)
        self.next_id += n
        self.cells.apply(cell_ids, [p for _, p in batch], [s for s, _ in batch])
        self.payload[cell_ids] = ids
        for t, (s, p) in zip(ids, batch):
            self.tokens[int(t)] = [p, {s}]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def remove(self, data):
        live = sorted({s for _, ss in self.tokens.values() for s in ss})
        seq = data.draw(st.sampled_from(live) if live else st.integers(0, self.cells.n_seq_max - 1))
        top = self._max_pos(seq)
        if top >= 1 and not data.draw(st.booleans(), label="to_end"):
            # a middle range that leaves positions behind it to shift
            begin = data.draw(st.integers(0, top - 1))
            end = begin + data.draw(st.integers(1, top - begin))
        else:
            begin, end = data.draw(st.integers(0, top + 1)), None
        mine = {t: v for t, v in self.tokens.items() if seq in v[1]}
        moved = set()
        if end is not None and end > begin:
            moved = {t for t, (p, _) in mine.items() if p >= end}
            if any(len(mine[t][1]) > 1 for t in moved):
                before = _snapshot(self.cells)
                with pytest.raises(NotSupported):
                    self.cells.remove(seq, begin, end)
                _assert_same(before, _snapshot(self.cells))
                return
        shifted = self.cells.remove(seq, begin, end)
        assert set(self.payload[shifted].tolist()) == moved and len(shifted) == len(moved)
        for t, v in mine.items():
            if v[0] >= begin and (end is None or v[0] < end):
                v[1].discard(seq)
            elif t in moved:
                v[0] -= end - begin
        self._prune()

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def copy_prefix(self, data):
        n_seq = self.cells.n_seq_max
        if n_seq < 2:
            return
        src = data.draw(st.integers(0, n_seq - 1))
        dst = data.draw(st.integers(0, n_seq - 1).filter(lambda d: d != src))
        length = data.draw(st.integers(0, self._max_pos(src) + 2))
        self.cells.copy_prefix(src, dst, length)
        for p, ss in self.tokens.values():
            ss.discard(dst)
            if src in ss and p < length:
                ss.add(dst)
        self._prune()

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def trim_window(self, data):
        n_seq = self.cells.n_seq_max
        lows = data.draw(st.dictionaries(st.integers(0, n_seq - 1), st.integers(0, 15)))
        window = data.draw(st.integers(0, 6))
        self.cells.trim_window(lows, window)
        for p, ss in self.tokens.values():
            for s, low in lows.items():
                if p < low - window:
                    ss.discard(s)
        self._prune()

    @precondition(lambda self: self.cells.seqs[self.cells.used:].any())
    @rule()
    def defrag(self):
        _check_defrag(self.cells, self.payload)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def clear(self, data):
        seq = data.draw(st.none() | st.integers(0, self.cells.n_seq_max - 1))
        self.cells.clear(seq)
        for _, ss in self.tokens.values():
            if seq is None:
                ss.clear()
            else:
                ss.discard(seq)
        self._prune()

    @rule(data=st.data())
    def mask_and_range(self, data):
        cells = self.cells
        n_seq = cells.n_seq_max
        n_b = data.draw(st.integers(0, 5))
        positions = data.draw(st.lists(st.integers(0, 16), min_size=n_b, max_size=n_b))
        seq_ids = data.draw(st.lists(st.integers(0, n_seq - 1), min_size=n_b, max_size=n_b))
        window = data.draw(st.none() | st.integers(0, 5))
        causal = data.draw(st.booleans())
        except_rows = data.draw(st.sets(st.integers(0, n_b - 1))) if n_b else set()
        lo = data.draw(st.integers(0, cells.n_cells))
        hi = data.draw(st.integers(lo, cells.n_cells))
        got = cells.mask(positions, seq_ids, window=window, causal=causal,
                         except_rows=sorted(except_rows), lo=lo, hi=hi)
        want = _loop_mask(cells, self.payload, self.tokens, positions, seq_ids, window,
                          causal, except_rows, lo, hi)
        assert got.dtype == np.float32 and np.array_equal(got, want)
        # visible_range against the reference
        pad = data.draw(st.integers(1, 4))
        wanted = set(seq_ids)
        idx = [c for c in range(cells.n_cells) if cells.seqs[c].any()
               and self.tokens[int(self.payload[c])][1] & wanted]
        if idx:
            ref = (idx[0] // pad * pad, min(-(-(idx[-1] + 1) // pad) * pad, cells.n_cells))
        else:
            ref = (0, 0)
        assert cells.visible_range(seq_ids, pad=pad) == ref
        # can_resume against the reference
        s = data.draw(st.integers(0, n_seq - 1))
        pos = data.draw(st.integers(0, 14))
        win = data.draw(st.none() | st.integers(0, 5))
        stored = {p for p, ss in self.tokens.values() if s in ss}
        start = 0 if not win else max(0, pos - win)
        assert cells.can_resume(s, pos, window=win) == all(q in stored for q in range(start, pos))

    @invariant()
    def matches_reference(self):
        cells = self.cells
        occupied = cells.seqs.any(axis=1)
        assert cells.used == len(self.tokens) == int(occupied.sum())
        assert np.all(cells.pos[~occupied] == -1)
        assert sorted(self.payload[occupied].tolist()) == sorted(self.tokens)
        n_pairs = 0
        for t, (p, ss) in self.tokens.items():
            for s in ss:
                hits = np.flatnonzero(cells.seqs[:, s] & (cells.pos == p))
                assert len(hits) == 1 and self.payload[hits[0]] == t
                n_pairs += 1
        assert int(cells.seqs.sum()) == n_pairs
        for s in range(cells.n_seq_max):
            ps = [p for p, ss in self.tokens.values() if s in ss]
            assert cells.seq_pos_min(s) == (min(ps) if ps else -1)
            assert cells.seq_pos_max(s) == (max(ps) if ps else -1)


CellsMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestCellsMachine = CellsMachine.TestCase


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n_seq=st.integers(1, 3), window=st.sampled_from([None, 0, 2, 5]),
       causal=st.booleans(), half=st.booleans())
def test_mask_equals_its_definition(seed, n_seq, window, causal, half):
    """Cells.mask (C loops) against its docstring's rule written as plain loops: random cells shared by
    random sequences, a random batch with exempt rows, a random cell range, both dtypes."""
    rng = np.random.default_rng(seed)
    n_cells = int(rng.integers(1, 24))
    cells = Cells(n_cells, n_seq)
    used = rng.random(n_cells) < 0.7
    cell_ids = np.flatnonzero(used)
    if cell_ids.size:
        cells.apply(cell_ids, rng.integers(0, 30, cell_ids.size), rng.integers(0, n_seq, cell_ids.size))
        if n_seq > 1:                                 # some cells shared by a second sequence
            cells.copy_prefix(0, int(rng.integers(1, n_seq)), int(rng.integers(0, 30)))
    n = int(rng.integers(1, 6))
    positions, seq_ids = rng.integers(0, 35, n), rng.integers(0, n_seq, n)
    exempt = sorted(set(rng.integers(0, n, int(rng.integers(0, n + 1))).tolist()))
    lo = int(rng.integers(0, n_cells + 1))
    hi = int(rng.integers(lo, n_cells + 1))
    got = cells.mask(positions, seq_ids, window=window, causal=causal, except_rows=exempt,
                     lo=lo, hi=hi, dtype=np.float16 if half else np.float32)
    assert got.dtype == (np.float16 if half else np.float32) and got.shape == (n, hi - lo)
    pos, seqs = cells.pos, cells.seqs
    for i in range(n):
        p = int(positions[i])
        for j in range(hi - lo):
            c = lo + j
            ok = bool(seqs[c, seq_ids[i]])
            if causal and i not in exempt:
                ok = ok and pos[c] <= p
            if window is not None:                   # 0: the token's own position only
                ok = ok and pos[c] >= p - window
            assert got[i, j] == (0.0 if ok else -np.inf), (i, j, c, int(pos[c]), p)
