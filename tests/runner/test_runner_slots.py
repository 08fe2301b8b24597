"""Truncation, context shift and cache-slot choice (ggmlpy.runner.slots): no ggml.

The ShiftDiscard, FindCacheSlot, LoadCacheSlot, ShiftCacheSlot and CountCommon
vectors are Ollama's (``runner/ollamarunner/cache_test.go``, the engine as of
commit f63eea3d2), restated here as data.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ggmlpy.runner.slots import (
    InputTooLong,
    LoadPlan,
    NoFreeSlot,
    SlotTable,
    common_prefix,
    effective_keep,
    group_boundary,
    group_sizes,
    shift_discard,
    truncate_indices,
    truncate_prompt,
)


def markers(n: int, at: dict[int, int]) -> list[int]:
    sb = [0] * n
    for i, k in at.items():
        sb[i] = k
    return sb


# --------------------------------------------------------------------------- ShiftDiscard

# (name, n_ctx, n_keep, n_inputs, same_batch markers {index: k}, expected discard)
SHIFT_VECTORS = [
    ("Shift", 2048, 5, 2048, None, 1021),
    ("Max Keep", 2048, 2047, 2048, None, 1),
    ("No Keep", 2048, 0, 2048, None, 1024),
    ("Truncate", 2048, 5, 5000, None, 3973),
    ("Truncate Keep", 2048, 2047, 5000, None, 2953),
    ("No Op", 2048, 5, 512, None, 0),
    ("Same Batch", 2048, 5, 2048, {1024: 512 - 1}, 1531),
    ("Same Batch Near Start", 2048, 5, 2048, {10: 512 - 1}, 1021),
    ("Consecutive Same Batch", 32, 0, 32, {i: 10 - 1 for i in range(0, 32, 10)}, 20),
    ("Overlapping Same Batch", 32, 0, 32, {4: 10 - 1, 8: 10 - 1, 14: 10 - 1}, 24),
    # TestShiftCacheSlot "Normal shift": ctx 10, 10 inputs, keep 2 -> 6 inputs remain
    ("ShiftCacheSlot Normal shift", 10, 2, 10, None, 4),
]


@pytest.mark.parametrize("name, n_ctx, n_keep, n_inputs, at, expected", SHIFT_VECTORS,
                         ids=[v[0] for v in SHIFT_VECTORS])
def test_shift_discard_ollama_vectors(name, n_ctx, n_keep, n_inputs, at, expected):
    sb = None if at is None else markers(n_inputs, at)
    assert shift_discard(n_inputs, n_keep, n_ctx, sb) == expected
    if sb is not None:
        assert shift_discard(n_inputs, n_keep, n_ctx, np.asarray(sb)) == expected


def ollama_shift_discard(n_inputs, n_keep, n_ctx, sb):
    """Ollama's ShiftDiscard loop, transcribed (a nested marker overwrites the counter)."""
    target = max((n_ctx - n_keep) // 2, 1)
    free = n_ctx - n_inputs
    discard = same = 0
    for i in range(n_keep, n_inputs):
        if same <= 0 and free >= target:
            break
        same -= 1
        free += 1
        discard += 1
        if sb[i] > 0:
            same = sb[i]
    return discard


def union_shift_discard(n_inputs, n_keep, n_ctx, sb):
    """The same loop with ggmlpy's rule: overlapping groups form one group."""
    target = max((n_ctx - n_keep) // 2, 1)
    free = n_ctx - n_inputs
    discard = same = 0
    for i in range(n_keep, n_inputs):
        if same <= 0 and free >= target:
            break
        same -= 1
        free += 1
        discard += 1
        same = max(same, sb[i])
    return discard


def nested(sb) -> bool:
    reach = -1
    for i, k in enumerate(sb):
        if k > 0:
            if i + k < reach:
                return True
            reach = max(reach, i + k)
    return False


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_shift_discard_matches_loop(data):
    n_ctx = data.draw(st.integers(1, 40))
    n_keep = data.draw(st.integers(0, n_ctx - 1))
    n_inputs = data.draw(st.integers(n_keep, 60))
    sb = data.draw(st.lists(st.sampled_from([0, 0, 0, 0, 1, 2, 5]), min_size=n_inputs,
                            max_size=n_inputs))
    got = shift_discard(n_inputs, n_keep, n_ctx, sb)
    assert got == union_shift_discard(n_inputs, n_keep, n_ctx, sb)
    if not nested(sb):
        assert got == ollama_shift_discard(n_inputs, n_keep, n_ctx, sb)
    assert 0 <= got <= n_inputs - n_keep
    # after discarding, the target free space is reached (unless nothing is left)
    if got < n_inputs - n_keep:
        assert n_ctx - (n_inputs - got) >= max((n_ctx - n_keep) // 2, 1) or got == 0


def test_shift_discard_nested_group_kept_whole():
    """A short group nested in a long one: ggmlpy discards through the long group's end.
    (Ollama's counter would stop after the short group, at 8.)"""
    sb = markers(20, {0: 9, 2: 1})
    assert shift_discard(20, 0, 20, sb) == 10
    assert ollama_shift_discard(20, 0, 20, sb) == 10  # target 10 reached past both here
    sb = markers(40, {0: 30, 2: 1})
    assert shift_discard(40, 0, 8, sb) == 36  # needs 36 anyway: 40 inputs, ctx 8
    sb = markers(20, {0: 15, 2: 1})
    assert shift_discard(20, 0, 6, sb) == 17  # need 17 -> group 0..15 already covered
    sb = markers(16, {0: 12, 1: 1})
    assert ollama_shift_discard(16, 0, 16, sb) == 8
    assert shift_discard(16, 0, 16, sb) == 13


@pytest.mark.parametrize("args, exc", [
    ((10, 10, 10), ValueError),     # keep == ctx
    ((10, -1, 10), ValueError),     # negative keep
    ((3, 5, 10), ValueError),       # keep > inputs
    ((10, 0, 0), ValueError),       # empty context
    ((10, 0, 10, [0] * 9), ValueError),  # wrong same_batch length
    ((3, 0, 10, [0, -1, 0]), ValueError),
    ((3, 0, 10, [0, 1.5, 0]), TypeError),
    ((10.0, 0, 10), TypeError),
])
def test_shift_discard_validation(args, exc):
    with pytest.raises(exc):
        shift_discard(*args)


# --------------------------------------------------------------------------- truncation


def test_effective_keep():
    assert effective_keep(5, 100, 2048) == 5
    assert effective_keep(-1, 100, 2048) == 100  # whole prompt
    assert effective_keep(-1, 5000, 2048) == 2047  # clamped to n_ctx - 1
    assert effective_keep(4096, 10, 2048) == 2047
    assert effective_keep(0, 0, 1) == 0
    with pytest.raises(ValueError):
        effective_keep(0, 10, 0)


def test_truncate_fits_unchanged():
    toks = list(range(100, 110))
    assert truncate_prompt(toks, 10, 4) == toks
    assert truncate_prompt(toks, 10, 4, truncate=False) == toks
    assert truncate_indices(10, 10, 4) == list(range(10))
    out = truncate_prompt(np.arange(5, dtype=np.int32), 8, 0)
    assert out == [0, 1, 2, 3, 4] and all(type(t) is int for t in out)


def test_truncate_drops_after_keep():
    toks = list(range(10))
    assert truncate_prompt(toks, 6, 2) == [0, 1, 6, 7, 8, 9]
    assert truncate_indices(10, 6, 2) == [0, 1, 6, 7, 8, 9]
    assert truncate_prompt(toks, 6, 0) == [4, 5, 6, 7, 8, 9]
    # negative keep = whole prompt, clamped to n_ctx - 1 = 5
    assert truncate_prompt(toks, 6, -1) == [0, 1, 2, 3, 4, 9]
    assert truncate_prompt(toks, 1, -1) == [9]


def test_truncate_disabled_raises_input_too_long():
    with pytest.raises(InputTooLong, match=r"\(11 tokens\).*\(10 tokens\)") as info:
        truncate_prompt(list(range(11)), 10, 0, truncate=False)
    assert isinstance(info.value, ValueError)
    assert (info.value.n_inputs, info.value.n_ctx) == (11, 10)
    import pickle
    again = pickle.loads(pickle.dumps(info.value))
    assert (again.n_inputs, again.n_ctx, str(again)) == (11, 10, str(info.value))
    custom = InputTooLong("input too long: 9 tokens for an embedding with context 8")
    assert str(custom).startswith("input too long") and custom.n_inputs is None
    assert str(pickle.loads(pickle.dumps(custom))) == str(custom)


def test_truncate_drops_whole_group_the_cut_lands_in():
    toks = list(range(10))
    sb = markers(10, {4: 3})  # group 4..7
    # discard 4 from index 2 -> start 6, inside the group -> start 8
    assert truncate_prompt(toks, 6, 2, sb) == [0, 1, 8, 9]
    assert truncate_indices(10, 6, 2, sb) == [0, 1, 8, 9]
    # a group that starts exactly at the cut is kept whole
    sb = markers(10, {6: 2})
    assert truncate_prompt(toks, 6, 2, sb) == [0, 1, 6, 7, 8, 9]
    # a group entirely inside the dropped range changes nothing
    sb = markers(10, {2: 1})
    assert truncate_prompt(toks, 6, 2, sb) == [0, 1, 6, 7, 8, 9]
    # a chain of overlapping groups is dropped together
    sb = markers(12, {3: 3, 5: 3})  # 3..6 and 5..8
    assert truncate_prompt(list(range(12)), 8, 2, sb) == [0, 1, 9, 10, 11]


def test_truncate_errors():
    with pytest.raises(ValueError, match="within num_keep"):
        truncate_prompt(list(range(10)), 6, 3, markers(10, {1: 1}))
    # the same marker is fine when the prompt fits (Ollama only checks when truncating)
    assert truncate_prompt(list(range(5)), 6, 3, markers(5, {1: 1})) == list(range(5))
    with pytest.raises(ValueError, match="entire prompt removed"):
        truncate_prompt(list(range(10)), 6, 2, markers(10, {5: 4}))
    with pytest.raises(ValueError, match="empty"):
        truncate_prompt([], 6, 0)
    with pytest.raises(ValueError, match="one entry per input"):
        truncate_prompt(list(range(10)), 6, 0, [0] * 3)
    with pytest.raises(ValueError, match="n_ctx"):
        truncate_prompt([1, 2], 0, 0)


def ollama_truncate(n_inputs, n_ctx, n_keep, sb):
    """Ollama's NewSequence truncation walk, transcribed; returns kept indices or an error."""
    if n_keep < 0:
        n_keep = n_inputs
    n_keep = min(n_keep, n_ctx - 1)
    if n_inputs <= n_ctx:
        return list(range(n_inputs))
    start = n_keep + n_inputs - n_ctx
    same = 0
    for i in range(n_inputs):
        if same > 0:
            same -= 1
            if start == i:
                start += 1
        elif start == i:
            break
        if sb[i] != 0:
            if i < n_keep:
                return "keep"
            same = sb[i]
    if start >= n_inputs:
        return "all"
    return list(range(n_keep)) + list(range(start, n_inputs))


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_truncate_matches_ollama_walk(data):
    n_inputs = data.draw(st.integers(1, 40))
    n_ctx = data.draw(st.integers(1, 40))
    n_keep = data.draw(st.integers(-1, 45))
    sb = data.draw(st.lists(st.sampled_from([0, 0, 0, 0, 1, 3, 6]), min_size=n_inputs,
                            max_size=n_inputs))
    if nested(sb):
        return
    want = ollama_truncate(n_inputs, n_ctx, n_keep, sb)
    if want == "keep":
        with pytest.raises(ValueError, match="within num_keep"):
            truncate_indices(n_inputs, n_ctx, n_keep, sb)
    elif want == "all":
        with pytest.raises(ValueError, match="entire prompt removed"):
            truncate_indices(n_inputs, n_ctx, n_keep, sb)
    else:
        got = truncate_indices(n_inputs, n_ctx, n_keep, sb)
        assert got == want
        assert len(got) <= n_ctx
        toks = [100 + i for i in range(n_inputs)]
        assert truncate_prompt(toks, n_ctx, n_keep, sb) == [toks[i] for i in got]


# --------------------------------------------------------------------------- common prefix

@pytest.mark.parametrize("a, b, expected", [
    ([1, 2, 3], [1, 2, 3], 3),   # Ollama "Equal"
    ([1], [1, 2, 3], 1),         # "Prefix"
    ([], [1, 2, 3], 0),          # "Empty"
    ([], [], 0),                 # "Both Empty"
    ([1, 2], [1, 5], 1),
    ([7], [8], 0),
])
def test_common_prefix_small(a, b, expected):
    assert common_prefix(a, b) == expected
    assert common_prefix(b, a) == expected


@pytest.mark.parametrize("mismatch", [0, 1, 63, 64, 65, 319, 320, 5000, 99_999, None])
def test_common_prefix_long(mismatch):
    a = list(range(100_000))
    b = list(a)
    if mismatch is not None:
        b[mismatch] = -1
    want = 100_000 if mismatch is None else mismatch
    assert common_prefix(a, b) == want
    assert common_prefix(np.asarray(a), np.asarray(b)) == want
    assert common_prefix(a, b[:1000]) == min(want, 1000)


# --------------------------------------------------------------------------- slots


class FakeClock:
    def __init__(self, t: float = 100.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def table(slots, multi_user, clock=None) -> SlotTable:
    """slots: list of (tokens, in_use, last_used)."""
    t = SlotTable(len(slots), multi_user=multi_user, clock=clock or FakeClock())
    for s, (tokens, in_use, last_used) in zip(t.slots, slots):
        s.tokens, s.in_use, s.last_used = list(tokens), in_use, last_used
    return t


NEVER = -math.inf
# Ollama TestFindCacheSlot: (name, slots, prompt, longest (slot, len), best (slot, len))
FIND_VECTORS = [
    ("Empty", [([], False, NEVER), ([], False, NEVER)], [1], (0, 0), (0, 0)),
    ("Extend", [([1], False, -1.0), ([1, 2], False, -2.0)], [1, 2], (1, 2), (1, 2)),
    ("New", [([1, 2], False, -1.0), ([], False, NEVER)], [2], (0, 0), (1, 0)),
    ("Fork", [([1, 2], False, -1.0), ([], False, NEVER)], [1], (0, 1), (1, 1)),
    ("Evict", [([1], False, -1.0), ([1, 2], False, -2.0)], [2, 3], (0, 0), (1, 0)),
    ("In use", [([1, 2], True, -1.0), ([1], False, -2.0)], [1, 2], (1, 1), (1, 2)),
]


@pytest.mark.parametrize("name, slots, prompt, longest, best", FIND_VECTORS,
                         ids=[v[0] for v in FIND_VECTORS])
def test_find_slot_ollama_vectors(name, slots, prompt, longest, best):
    assert table(slots, False).find(prompt)[:2] == longest
    assert table(slots, True).find(prompt)[:2] == best
    # the Fork case copies slot 0's prefix into slot 1; In use forks from busy slot 0
    fork = table(slots, True).find(prompt)[2]
    assert fork == ({"Fork": 0, "In use": 0}.get(name))


# Ollama TestLoadCacheSlot: (name, multi_user, slots, prompt, slot or error, remaining length)
LOAD_VECTORS = [
    ("Basic cache hit - single user", False, [([1, 2], False, -1.0), ([], False, -2.0)],
     [1, 2, 3], 0, 1),
    ("Basic cache hit - multi user", True, [([1, 2], False, -1.0), ([], False, -2.0)],
     [1, 2, 3], 0, 1),
    ("Exact match - leave one input", False, [([1, 2], False, -1.0)], [1, 2], 0, 1),
    ("No available slots", False, [([1, 2], True, -1.0)], [1, 2, 3], None, None),
]


@pytest.mark.parametrize("name, multi_user, slots, prompt, slot, n_remaining", LOAD_VECTORS,
                         ids=[v[0] for v in LOAD_VECTORS])
def test_load_slot_ollama_vectors(name, multi_user, slots, prompt, slot, n_remaining):
    t = table(slots, multi_user)
    if slot is None:
        with pytest.raises(NoFreeSlot):
            t.load(prompt)
        return
    plan = t.load(prompt)
    assert plan.slot == slot and len(plan.remaining) == n_remaining
    assert t[slot].in_use and t[slot].last_used == 100.0
    assert t[slot].tokens == prompt[:plan.n_past]


def test_single_user_longest_prefix_and_ties():
    t = table([([5, 6], False, 0.0), ([1, 2, 3], False, 0.0), ([1, 2, 9], False, 0.0)], False)
    plan = t.load([1, 2, 3, 4])
    assert plan == LoadPlan(slot=1, n_past=3, fork_from=None, remaining=[4])
    t = table([([1, 2, 7], False, 0.0), ([1, 2, 9], False, 0.0)], False)
    assert t.load([1, 2, 3]).slot == 0  # tie -> first slot
    # single user never forks, even when the best prefix is in a busy slot
    t = table([([1, 2, 3], True, 0.0), ([4], False, 0.0)], False)
    assert t.load([1, 2, 3, 4]) == LoadPlan(slot=1, n_past=0, fork_from=None,
                                             remaining=[1, 2, 3, 4])


def test_full_match_evaluates_last_token():
    for multi in (False, True):
        t = table([([1, 2, 3], False, 0.0)], multi)
        plan = t.load([1, 2, 3])
        assert (plan.n_past, plan.remaining) == (2, [3])
        assert t[0].tokens == [1, 2]
        # a cached prompt longer than the new one: same rule
        t = table([([1, 2, 3, 4], False, 0.0), ([], False, 1.0)], multi)
        plan = t.load([1, 2])
        assert (plan.n_past, plan.remaining) == (1, [2])


def test_multi_user_forks_from_busy_slot():
    clock = FakeClock(50.0)
    t = table([([1, 2, 3, 4], True, 10.0), ([9, 9], False, 5.0), ([], False, NEVER)], True,
              clock)
    plan = t.load([1, 2, 3, 7])
    # LRU free slot is 2 (never used); prefix of 3 forked from busy slot 0
    assert plan == LoadPlan(slot=2, n_past=3, fork_from=0, remaining=[7])
    assert t[2].tokens == [1, 2, 3] and t[2].in_use and t[2].last_used == 50.0
    assert t[0].tokens == [1, 2, 3, 4]  # the source is untouched
    # the whole prompt in a busy slot: fork len-1 tokens, evaluate the last one
    plan = t.load([1, 2])
    assert plan == LoadPlan(slot=1, n_past=1, fork_from=0, remaining=[2])


def test_multi_user_full_slot_contents_reused_in_place():
    t = table([([1, 2], False, 1.0), ([7], False, 0.0)], True)
    # slot 0's whole content is a prefix of the prompt -> reuse slot 0 although slot 1 is LRU
    assert t.load([1, 2, 3]) == LoadPlan(slot=0, n_past=2, fork_from=None, remaining=[3])


def test_multi_user_lru_eviction_order():
    clock = FakeClock(0.0)
    t = SlotTable(3, multi_user=True, clock=clock)
    order = []
    for i in range(6):
        clock.t = float(i)
        plan = t.load([100 + i, 1])
        order.append(plan.slot)
        t.committed(plan.slot, plan.remaining)  # evaluated: the cache holds the prompt
        t.release(plan.slot)
    assert order == [0, 1, 2, 0, 1, 2]
    # last used: slot 0 at 3, slot 1 at 4, slot 2 at 5; extending slot 0's contents
    # reuses slot 0 in place and makes slot 1 the least recently used
    clock.t = 10.0
    assert t.load(t[0].tokens + [5]).slot == 0
    t.release(0)
    clock.t = 11.0
    assert t.load([42]).slot == 1


def test_no_free_slot():
    for multi in (False, True):
        t = SlotTable(2, multi_user=multi, clock=FakeClock())
        t.load([1])
        t.load([2])
        with pytest.raises(NoFreeSlot, match="no available cache slots"):
            t.load([3])
        t.release(0)
        assert t.load([3]).slot == 0


def test_cache_prompt_false_reuses_nothing():
    for multi in (False, True):
        t = table([([1, 2, 3], False, 0.0), ([1, 2], True, 0.0)], multi)
        plan = t.load([1, 2, 3, 4], cache_prompt=False)
        assert plan == LoadPlan(slot=0, n_past=0, fork_from=None, remaining=[1, 2, 3, 4])
        assert t[0].tokens == []


def test_slot_upkeep_helpers():
    t = SlotTable(2, multi_user=False, clock=FakeClock())
    plan = t.load([1, 2, 3])
    assert plan.n_past == 0
    t.committed(0, np.array([1, 2, 3]))
    t.committed(0, [4])
    assert t[0].tokens == [1, 2, 3, 4] and all(type(v) is int for v in t[0].tokens)
    t.remove(0, 1, 3)  # a shift discarding positions 1..2
    assert t[0].tokens == [1, 4]
    t.remove(0, 1)
    assert t[0].tokens == [1]
    t.set_tokens(0, [9, 8])
    assert t[0].tokens == [9, 8]
    t.release(0)
    assert not t[0].in_use and t[0].tokens == [9, 8]  # kept for reuse
    t.reset(0)
    assert t[0].tokens == []
    with pytest.raises(IndexError):
        t.committed(2, [1])
    with pytest.raises(ValueError):
        t.remove(0, 3, 1)
    with pytest.raises(ValueError):
        t.load([])
    with pytest.raises(ValueError):
        SlotTable(0)
    assert len(t) == 2 and "n_slots=2" in repr(t)


def test_rewind_when_cache_cannot_resume():
    t = table([([1, 2, 3, 4], False, 0.0)], False)
    plan = t.load([1, 2, 3, 4, 5])
    assert plan.n_past == 4
    plan = t.rewind(plan, 1)
    assert plan == LoadPlan(slot=0, n_past=1, fork_from=None, remaining=[2, 3, 4, 5])
    assert t[0].tokens == [1]
    with pytest.raises(ValueError):
        t.rewind(plan, 2)


# --------------------------------------------------------------------------- property test


class RefTable:
    """Brute-force model of Ollama's slot choice over plain lists."""

    def __init__(self, n, multi):
        self.tokens = [[] for _ in range(n)]
        self.busy = [False] * n
        self.used = [-math.inf] * n
        self.multi = multi

    @staticmethod
    def prefix(a, b):
        n = 0
        while n < len(a) and n < len(b) and a[n] == b[n]:
            n += 1
        return n

    def load(self, prompt, now, cache_prompt):
        counts = [self.prefix(t, prompt) for t in self.tokens]
        fork = None
        if not self.multi:
            free = [i for i in range(len(counts)) if not self.busy[i]]
            if not free:
                return None
            best = max(counts[i] for i in free)
            slot = min(i for i in free if counts[i] == best)
            n_past = best
        else:
            best = max(counts)
            lslot = counts.index(best)
            free = [i for i in range(len(counts)) if not self.busy[i]]
            if best == len(self.tokens[lslot]) and not self.busy[lslot]:
                slot, n_past = lslot, best
            elif not free:
                return None
            else:
                oldest = min(self.used[i] for i in free)
                slot = min(i for i in free if self.used[i] == oldest)
                n_past = best
                if best > 0 and lslot != slot:
                    fork = lslot
        if not cache_prompt:
            n_past, fork = 0, None
        if n_past == len(prompt):
            n_past -= 1
        if n_past == 0:
            fork = None
        self.busy[slot] = True
        self.used[slot] = now
        self.tokens[slot] = prompt[:n_past]
        return slot, n_past, fork, prompt[n_past:]


ops = st.lists(
    st.one_of(
        st.tuples(st.just("load"), st.lists(st.integers(0, 2), min_size=1, max_size=6),
                  st.booleans()),
        st.tuples(st.just("release"), st.integers(0, 3)),
        st.tuples(st.just("commit"), st.integers(0, 3),
                  st.lists(st.integers(0, 2), max_size=3)),
    ),
    max_size=30,
)


@settings(max_examples=150, deadline=None)
@given(n_slots=st.integers(1, 4), multi=st.booleans(), program=ops)
def test_slot_table_matches_brute_force(n_slots, multi, program):
    clock = FakeClock(0.0)
    t = SlotTable(n_slots, multi_user=multi, clock=clock)
    ref = RefTable(n_slots, multi)
    for step, op in enumerate(program):
        clock.t = float(step)
        if op[0] == "load":
            prompt, cache_prompt = op[1], op[2]
            want = ref.load(prompt, float(step), cache_prompt)
            if want is None:
                with pytest.raises(NoFreeSlot):
                    t.load(prompt, cache_prompt)
                continue
            plan = t.load(prompt, cache_prompt)
            assert (plan.slot, plan.n_past, plan.fork_from, plan.remaining) == want
            assert 0 <= plan.n_past < len(prompt)
            assert plan.fork_from is None or (multi and plan.fork_from != plan.slot)
        elif op[0] == "release":
            s = op[1] % n_slots
            t.release(s)
            ref.busy[s] = False
        else:
            s = op[1] % n_slots
            t.committed(s, op[2])
            ref.tokens[s] = ref.tokens[s] + op[2]
        for i in range(n_slots):
            assert t[i].tokens == ref.tokens[i]
            assert t[i].in_use == ref.busy[i]


# --------------------------------------------------------------------------- groups as batch units


def union_units(sb: list[int]) -> list[int]:
    """Reference: walk the inputs, a unit ends where no marker seen in it reaches further."""
    sizes, start, reach = [], 0, -1
    for i, k in enumerate(sb):
        reach = max(reach, i + k)
        if reach == i:
            sizes.append(i + 1 - start)
            start, reach = i + 1, -1
    return sizes


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_group_sizes_match_the_union_walk(data):
    n = data.draw(st.integers(0, 40))
    sb = data.draw(st.lists(st.sampled_from([0, 0, 0, 1, 2, 5]), min_size=n, max_size=n))
    if any(i + k >= n for i, k in enumerate(sb)):
        with pytest.raises(ValueError, match="runs past the last input"):
            group_sizes(sb, n)
        return
    sizes = group_sizes(sb, n)
    assert sizes == union_units(sb) and sum(sizes) == n
    # a boundary never cuts a unit; anywhere else moves back to the unit's start
    starts = np.cumsum([0] + sizes)
    for m in range(n + 1):
        assert group_boundary(sb, m) == starts[starts <= m].max()


def test_group_sizes_without_groups_and_bad_markers():
    assert group_sizes(None, 3) == [1, 1, 1] and group_sizes([0, 0], 2) == [1, 1]
    assert group_sizes(markers(6, {1: 2}), 6) == [1, 3, 1, 1]
    assert group_boundary(markers(6, {1: 2}), 3) == 1 and group_boundary(None, 3) == 3
    with pytest.raises(ValueError, match=">= 0"):
        group_sizes([0, -1], 2)
    with pytest.raises(ValueError, match="one entry per input"):
        group_sizes([0], 2)


@pytest.mark.parametrize("multi", [False, True])
def test_reused_prefix_stops_at_a_group_start(multi):
    """A cached prefix that ends inside a same-batch group is reused up to the group's start."""
    t = SlotTable(1, multi_user=multi, clock=FakeClock())
    t.committed(0, [1, 2, 3, 4, 5, 6], markers(6, {2: 2}))
    sb = markers(6, {2: 3})                       # the new prompt's group 2..5 extends past the cached 2..4
    plan = t.load([1, 2, 3, 4, 5, 9], same_batch=sb)
    assert plan.n_past == 2 and plan.remaining == [3, 4, 5, 9]
    assert t[0].tokens == [1, 2] and t[0].same_batch == [0, 0]


def test_record_keeps_markers_with_tokens():
    t = SlotTable(1, multi_user=False, clock=FakeClock())
    t.committed(0, [1, 2, 3, 4, 5], markers(5, {1: 2}))
    t.remove(0, 0, 1)
    assert t[0].tokens == [2, 3, 4, 5] and t[0].same_batch == [2, 0, 0, 0]
    plan = t.load([2, 3, 4, 5, 6], same_batch=[2, 0, 0, 0, 0])
    assert plan.n_past == 4 and t[0].same_batch == [2, 0, 0, 0]
    t.rewind(plan, 1)
    assert t[0].tokens == [2] and t[0].same_batch == [2]
    with pytest.raises(ValueError, match="markers"):
        t.committed(0, [1, 2], [0])
    assert t[0].tokens == [2]                     # nothing half-recorded
    with pytest.raises(ValueError, match="markers"):
        t.set_tokens(0, [1, 2], [0])


# --------------------------------------------------------------------------- slot <-> cache


class FakeCache:
    """What a SlotTable calls on a cache, recorded; positions per sequence as lists of tokens."""

    def __init__(self, n, shift=True, resume=True):
        self.seqs = [[] for _ in range(n)]
        self.calls = []
        self.shift, self.resume = shift, resume

    def clear(self, seq=None):
        self.calls.append(("clear", seq))
        for s in range(len(self.seqs)) if seq is None else [seq]:
            self.seqs[s] = []

    def remove(self, seq, begin, end=None):
        from ggmlpy.kvcache import NotSupported

        self.calls.append(("remove", seq, begin, end))
        if end is not None and not self.shift:
            raise NotSupported("no shift")
        del self.seqs[seq][begin:end]

    def copy_prefix(self, src, dst, n):
        self.calls.append(("copy_prefix", src, dst, n))
        self.seqs[dst] = self.seqs[src][:n]

    def can_resume(self, seq, pos):
        return self.resume

    def seq_pos_max(self, seq):
        return len(self.seqs[seq]) - 1


def _filled(n, multi, **kw):
    cache = FakeCache(n, **kw)
    t = SlotTable(n, multi_user=multi, clock=FakeClock(), cache=cache)
    return t, cache


def test_load_slot_trims_the_cache_to_the_reused_prefix():
    t, cache = _filled(2, False)
    t.committed(0, [1, 2, 3, 4])
    cache.seqs[0] = [1, 2, 3, 4]
    assert t.load_slot([1, 2, 9]) == (0, 2)
    assert cache.seqs[0] == [1, 2] and t[0].tokens == [1, 2] and t[0].in_use
    assert cache.calls == [("remove", 0, 2, None)]


def test_load_slot_forks_a_busy_prefix_and_falls_back_when_the_cache_cannot_resume():
    t, cache = _filled(2, True)
    t.committed(0, [1, 2, 3])
    cache.seqs[0] = [1, 2, 3]
    t[0].in_use = True
    assert t.load_slot([1, 2, 7]) == (1, 2)
    assert cache.seqs[1] == [1, 2] and ("copy_prefix", 0, 1, 2) in cache.calls
    t.release(1)
    cache.resume = False                         # a window evicted what the prompt needs: start over
    t.reset(1)
    t.committed(1, [5, 6])
    cache.seqs[1] = [5, 6]
    assert t.load_slot([5, 6, 8])[1] == 0
    assert t[1].tokens == [] and cache.seqs[1] == []


def test_load_slot_goes_back_to_the_caches_resume_point():
    """A cache of recurrent states resumes only where it kept a state (``resume_point``): a fork of 3 positions
    whose state was kept at 2 resumes at 2, the copied K/V trimmed to it (the third is computed again);
    without a fork, the cache is trimmed to 2 too."""
    t, cache = _filled(2, True)
    cache.resume_point = lambda seq, pos: min(int(pos), 2)
    t.committed(0, [1, 2, 3, 4])
    cache.seqs[0] = [1, 2, 3, 4]
    t[0].in_use = True
    assert t.load_slot([1, 2, 3, 9]) == (1, 2)
    assert cache.seqs[1] == [1, 2] and t[1].tokens == [1, 2]
    assert cache.calls[-2:] == [("copy_prefix", 0, 1, 3), ("remove", 1, 2, None)]
    t.release(0)
    t.release(1)
    t.reset(1)
    cache.seqs[1] = []
    assert t.load_slot([1, 2, 3, 4, 5]) == (0, 2) and cache.seqs[0] == [1, 2]


def test_load_slot_failure_clears_and_releases_the_slot():
    t, cache = _filled(1, False)

    def broken(*a):
        raise KeyError("injected")

    cache.can_resume = broken
    t.committed(0, [1, 2])
    with pytest.raises(KeyError):
        t.load_slot([1, 2, 3])
    assert not t[0].in_use and t[0].tokens == [] and cache.calls[-1] == ("clear", 0)


@pytest.mark.parametrize("can_shift", [True, False])
def test_shift_moves_cache_and_record_together(can_shift):
    t, cache = _filled(1, False, shift=can_shift)
    t.committed(0, [1, 2, 3, 4, 5], markers(5, {3: 1}))
    cache.seqs[0] = [1, 2, 3, 4, 5]
    redo = t.shift(0, 1, 2)
    if can_shift:
        assert redo is None and t[0].tokens == cache.seqs[0] == [1, 4, 5] and t[0].same_batch == [0, 1, 0]
    else:                                         # cleared; the kept tokens come back to be computed again
        assert redo == ([1, 4, 5], [0, 1, 0]) and t[0].tokens == cache.seqs[0] == []


def test_clear_and_free_touch_cache_and_record_together():
    t, cache = _filled(2, False)
    for s in (0, 1):
        t.load_slot([s + 1])
        t.committed(s, [s + 1])
        cache.seqs[s] = [s + 1]
    t.free(0)
    assert not t[0].in_use and t[0].tokens == cache.seqs[0] == [1]       # kept for reuse
    t.free(1, failed=True)
    assert not t[1].in_use and t[1].tokens == cache.seqs[1] == []
    t.clear()
    assert t[0].tokens == cache.seqs[0] == [] and cache.calls[-1] == ("clear", None)
