"""The runner's slots: what each cache sequence holds, and the one owner of slot <-> cache.

A *slot* is one cache sequence and the record of the tokens it holds. The :class:`SlotTable` chooses
a slot for a prompt (prefix reuse) and, given the cache, makes the cache calls that go with each
change of a record (:meth:`SlotTable.load_slot`, :meth:`~SlotTable.shift`, :meth:`~SlotTable.clear`,
:meth:`~SlotTable.free`, :meth:`~SlotTable.save`, :meth:`~SlotTable.restore`), as Ollama's
``InputCache`` does (``runner/ollamarunner/cache.go``: ``LoadCacheSlot``, ``ShiftCacheSlot``), so
that the record and the cache cannot drift apart. The decisions (truncation, the shift's discard,
the slot choice) are pure Python/numpy and are tested without ggml (``NewSequence``, ``ShiftDiscard``,
``FindCacheSlot``).

Same-batch groups
-----------------
Some inputs must be evaluated in one batch with their neighbours (an image's
embedding rows, for instance). As in Ollama's ``input.Input.SameBatch``, a
``same_batch`` sequence runs parallel to the inputs: ``same_batch[i] = k > 0``
means inputs ``i+1 .. i+k`` belong to the same batch as input ``i``; ``0``
means no constraint; ``None`` means no groups at all. Truncation and context
shift never keep part of a group and drop the rest.

When groups overlap or nest, ggmlpy treats their union as one group. Ollama
keeps a single counter that a nested marker overwrites, so a short group
nested inside a longer one can end its discard inside the longer group; the
two agree whenever groups do not nest, which covers all of Ollama's test
vectors.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import numpy as np

from ggmlpy._core import GGMLError, GGMLTypeError, GGMLValueError
from ggmlpy.kvcache import NotSupported, resume_point

__all__ = [
    "InputTooLong",
    "LoadPlan",
    "NoFreeSlot",
    "Slot",
    "SlotIndexError",
    "SlotTable",
    "common_prefix",
    "effective_keep",
    "group_boundary",
    "group_sizes",
    "shift_discard",
    "truncate_indices",
    "truncate_prompt",
]


class InputTooLong(GGMLValueError):
    """The prompt is longer than the context and truncation is disabled.

    ``InputTooLong(n_inputs, n_ctx)`` writes the standard message;
    ``InputTooLong("message")`` takes a caller's own (both attributes are then
    None).

    Attributes
    ----------
    n_inputs : int or None
        Length of the prompt.
    n_ctx : int or None
        Context length of one sequence.
    """

    def __init__(self, n_inputs: int | str, n_ctx: Optional[int] = None) -> None:
        if isinstance(n_inputs, str) and n_ctx is None:
            self.n_inputs: Optional[int] = None
            self.n_ctx: Optional[int] = None
            super().__init__(n_inputs)
            return
        self.n_inputs = int(n_inputs)
        self.n_ctx = int(n_ctx) if n_ctx is not None else None
        super().__init__(
            f"the input length ({self.n_inputs} tokens) exceeds the context length "
            f"({self.n_ctx} tokens) and truncation is disabled"
        )

    def __reduce__(self):  # keep pickling working with the custom __init__
        if self.n_inputs is None:
            return (type(self), (str(self),))
        return (type(self), (self.n_inputs, self.n_ctx))


class NoFreeSlot(RuntimeError, GGMLError):
    """Every cache slot is in use."""


class SlotIndexError(IndexError, GGMLError):
    """A slot number outside the table."""


# --------------------------------------------------------------------------- helpers


def _int(name: str, value: object) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise GGMLTypeError(f"{name} must be an int, got {value!r}")
    return int(value)


def _reach(same_batch: Sequence[int] | None, n_inputs: int) -> Optional[np.ndarray]:
    """``reach[i]``: the last input that must share input ``i``'s batch.

    ``None`` when there are no groups. Every rule about groups below is computed from this and
    :func:`_close_groups`.
    """
    if same_batch is None:
        return None
    sb = np.asarray(same_batch)
    if sb.ndim != 1 or sb.size != n_inputs:
        raise GGMLValueError(
            f"same_batch must have one entry per input ({n_inputs}), got shape {sb.shape}"
        )
    if sb.size and sb.dtype.kind not in "iu":
        if sb.dtype.kind != "f" or not np.array_equal(sb, np.floor(sb)):
            raise GGMLTypeError(f"same_batch must hold integers, got {sb.dtype} values")
    sb = sb.astype(np.int64, copy=False)
    if sb.size and int(sb.min()) < 0:
        raise GGMLValueError(f"same_batch entries must be >= 0, got {int(sb.min())}")
    if not sb.any():
        return None
    return np.arange(n_inputs, dtype=np.int64) + sb


def _close_groups(reach: Optional[np.ndarray], start: int, end: int, n: int) -> int:
    """Smallest ``e >= end`` so that discarding ``[start, e)`` splits no group.

    Only groups whose marker lies in the discarded range extend it (a marker
    before ``start`` is the caller's business). Returns at most ``n``.
    """
    if reach is None or end <= start:
        return end
    cm = np.maximum.accumulate(reach[start:])
    # Discarding [start, e) is closed iff every marker in it reaches below e,
    # i.e. cm[e - 1 - start] <= e - 1.
    j0 = end - 1 - start
    ok = cm[j0:] <= np.arange(end - 1, n)
    if not ok.any():
        return n
    return end + int(np.argmax(ok))


def group_sizes(same_batch: Sequence[int] | None, n_inputs: int) -> list[int]:
    """The inputs as consecutive batch units: 1 for an input without a group, the group's length for a group.

    Overlapping or nested groups form one unit. ``sum(result) == n_inputs``.

    Raises
    ------
    ValueError
        If ``same_batch`` does not hold one non-negative integer per input, or a group runs past the last
        input.
    """
    reach = _reach(same_batch, n_inputs)
    if reach is None:
        return [1] * n_inputs
    if int(reach.max()) >= n_inputs:
        i = int(np.argmax(reach >= n_inputs))
        raise GGMLValueError(f"same_batch[{i}] = {int(reach[i]) - i} runs past the last input ({n_inputs} inputs)")
    sizes, a = [], 0
    while a < n_inputs:
        b = _close_groups(reach, a, a + 1, n_inputs) if reach[a] > a else a + 1
        sizes.append(b - a)
        a = b
    return sizes


def group_boundary(same_batch: Sequence[int] | None, n: int) -> int:
    """The largest ``m <= n`` where the inputs can be cut without splitting a group (``0 <= m``)."""
    if not same_batch or n <= 0:
        return max(n, 0)
    a = 0
    for size in group_sizes(same_batch, len(same_batch)):
        if a + size > n:
            return a
        a += size
    return a


# --------------------------------------------------------------------------- shift & truncation


def effective_keep(n_keep: int, n_inputs: int, n_ctx: int) -> int:
    """The ``num_keep`` a sequence actually uses (Ollama ``NewSequence``).

    A negative ``n_keep`` means the whole prompt; the result is clamped to
    ``n_ctx - 1`` so that a context shift can always discard at least one input.

    Parameters
    ----------
    n_keep : int
        Requested number of leading inputs to keep (negative: all).
    n_inputs : int
        Prompt length.
    n_ctx : int
        Context length of one sequence (``>= 1``).
    """
    n_keep, n_inputs, n_ctx = (_int("n_keep", n_keep), _int("n_inputs", n_inputs),
                               _int("n_ctx", n_ctx))
    if n_ctx < 1:
        raise GGMLValueError(f"n_ctx must be >= 1, got {n_ctx}")
    if n_inputs < 0:
        raise GGMLValueError(f"n_inputs must be >= 0, got {n_inputs}")
    if n_keep < 0:
        n_keep = n_inputs
    return min(n_keep, n_ctx - 1)


def shift_discard(n_inputs: int, n_keep: int, n_ctx: int,
                  same_batch: Sequence[int] | None = None) -> int:
    """How many inputs after ``n_keep`` a context shift discards (Ollama ``ShiftDiscard``).

    Inputs ``n_keep, n_keep+1, ...`` are discarded one by one until the free
    space ``n_ctx - remaining`` reaches ``max((n_ctx - n_keep) // 2, 1)``, and
    then further until the discarded run ends outside every same-batch group.
    The caller removes positions ``[n_keep, n_keep + discard)`` from the cache
    (which shifts the rest down) and from its record of the sequence.

    Parameters
    ----------
    n_inputs : int
        Inputs the sequence holds now (may exceed ``n_ctx``).
    n_keep : int
        Leading inputs that are never discarded, ``0 <= n_keep < n_ctx`` and
        ``n_keep <= n_inputs``.
    n_ctx : int
        Context length of one sequence.
    same_batch : sequence of int, optional
        Same-batch markers, one per input (see the module docstring).

    Returns
    -------
    int
        The number of inputs to discard, between 0 and ``n_inputs - n_keep``.
    """
    n_inputs, n_keep, n_ctx = (_int("n_inputs", n_inputs), _int("n_keep", n_keep),
                               _int("n_ctx", n_ctx))
    if n_ctx < 1:
        raise GGMLValueError(f"n_ctx must be >= 1, got {n_ctx}")
    if not 0 <= n_keep < n_ctx:
        raise GGMLValueError(
            f"unable to shift context: keep must be in [0, n_ctx) (keep: {n_keep} context: {n_ctx})"
        )
    if not 0 <= n_keep <= n_inputs:
        raise GGMLValueError(f"n_keep ({n_keep}) exceeds the number of inputs ({n_inputs})")
    reach = _reach(same_batch, n_inputs)
    target_free = max((n_ctx - n_keep) // 2, 1)
    need = min(max(target_free - (n_ctx - n_inputs), 0), n_inputs - n_keep)
    if need == 0:
        return 0
    return _close_groups(reach, n_keep, n_keep + need, n_inputs) - n_keep


def truncate_indices(n_inputs: int, n_ctx: int, n_keep: int,
                     same_batch: Sequence[int] | None = None,
                     truncate: bool = True) -> list[int]:
    """Indices of the prompt inputs kept when a prompt must fit ``n_ctx`` (Ollama ``NewSequence``).

    The index form of :func:`truncate_prompt`, for callers that carry more than
    token ids per input (same-batch markers, multimodal data).

    Parameters
    ----------
    n_inputs : int
        Prompt length (``>= 1``).
    n_ctx : int
        Context length of one sequence.
    n_keep : int
        Leading inputs to keep; negative means the whole prompt. Clamped with
        :func:`effective_keep`.
    same_batch : sequence of int, optional
        Same-batch markers, one per input.
    truncate : bool
        Whether a too-long prompt may be truncated.

    Returns
    -------
    list of int
        ``range(n_inputs)`` when the prompt fits; otherwise the first
        ``keep`` indices followed by the tail that starts ``n_inputs - n_ctx``
        inputs later, moved further when the cut lands inside a same-batch
        group (the whole group is dropped, so the result may be shorter than
        ``n_ctx``).

    Raises
    ------
    InputTooLong
        If ``n_inputs > n_ctx`` and ``truncate`` is false.
    ValueError
        If the prompt is empty, a same-batch marker sits inside the kept head
        (only checked when truncating, as Ollama does), or truncation would
        remove the whole tail.
    """
    keep, start = _truncation(n_inputs, n_ctx, n_keep, same_batch, truncate)
    if start == keep:
        return list(range(n_inputs))
    return list(range(keep)) + list(range(start, n_inputs))


def _truncation(n_inputs: int, n_ctx: int, n_keep: int,
                same_batch: Sequence[int] | None, truncate: bool) -> tuple[int, int]:
    """``(keep, start)``: keep ``[0, keep)`` and ``[start, n_inputs)``."""
    n_inputs = _int("n_inputs", n_inputs)
    if n_inputs < 1:
        raise GGMLValueError("no input provided: the prompt is empty")
    keep = effective_keep(n_keep, n_inputs, n_ctx)
    reach = _reach(same_batch, n_inputs)
    if n_inputs <= n_ctx:
        return keep, keep
    if not truncate:
        raise InputTooLong(n_inputs, n_ctx)
    if reach is not None:
        inside = np.flatnonzero(reach[:keep] > np.arange(keep))
        if inside.size:
            i = int(inside[0])
            raise GGMLValueError(
                f"a same-batch group may not start within num_keep "
                f"(index: {i} num_keep: {keep} same_batch: {int(reach[i]) - i})"
            )
    start = _close_groups(reach, keep, keep + (n_inputs - n_ctx), n_inputs)
    if start >= n_inputs:
        raise GGMLValueError(
            f"entire prompt removed by truncation (prompt: {n_inputs} context: {n_ctx} "
            f"keep: {keep})"
        )
    return keep, start


def truncate_prompt(tokens: Sequence[int], n_ctx: int, n_keep: int,
                    same_batch: Sequence[int] | None = None,
                    truncate: bool = True) -> list[int]:
    """The prompt tokens that remain after fitting the prompt into ``n_ctx``.

    If ``len(tokens) <= n_ctx`` the prompt is returned whole. Otherwise
    ``len(tokens) - n_ctx`` tokens are dropped starting right after the first
    ``keep`` (``keep`` from :func:`effective_keep`), plus the rest of a
    same-batch group the cut would split. See :func:`truncate_indices` for the
    index form, the parameters and the errors.

    Returns
    -------
    list of int
        The kept tokens, as a new list of Python ints.
    """
    keep, start = _truncation(len(tokens), n_ctx, n_keep, same_batch, truncate)
    if start == keep:
        return [int(t) for t in tokens]
    return [int(t) for t in tokens[:keep]] + [int(t) for t in tokens[start:]]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading elements ``a`` and ``b`` have in common.

    Compares in numpy chunks that grow geometrically, so a short match on a
    long list costs little and a long match costs one vectorised pass.
    """
    n = min(len(a), len(b))
    lo, chunk = 0, 64
    while lo < n:
        hi = min(n, lo + chunk)
        diff = np.asarray(a[lo:hi]) != np.asarray(b[lo:hi])
        if diff.any():
            return lo + int(np.argmax(diff))
        lo, chunk = hi, chunk * 4
    return n


# --------------------------------------------------------------------------- slots


@dataclass
class Slot:
    """One cache sequence and what it holds.

    Attributes
    ----------
    id : int
        Cache sequence id (slot ``i`` is sequence ``i``).
    tokens : list of int
        The tokens the KV cache holds for this sequence, in position order: the one record of them (the
        runner appends to it as it forms batches). ``-1`` stands for a token still being sampled.
    same_batch : list of int
        The same-batch markers of ``tokens`` (see the module docstring), one per token, so a context
        shift never keeps half a group.
    in_use : bool
        Whether a running request owns the slot.
    last_used : float
        Clock reading at the last :meth:`SlotTable.load`; ``-inf`` if never used.
    """

    id: int
    tokens: list[int] = field(default_factory=list)
    same_batch: list[int] = field(default_factory=list)
    in_use: bool = False
    last_used: float = -math.inf


@dataclass(frozen=True)
class LoadPlan:
    """Where a prompt goes and how much of it the cache already holds.

    Attributes
    ----------
    slot : int
        The slot (cache sequence id) the request now owns.
    n_past : int
        Leading prompt tokens already in the cache for ``slot`` (after a fork,
        if any); they are not evaluated again. Always ``< len(prompt)``.
    fork_from : int or None
        When set, first copy the first ``n_past`` positions of that slot into
        ``slot`` (``cache.copy_prefix(fork_from, slot, n_past)``, which also
        drops what ``slot`` held).
    remaining : list of int
        The prompt tokens to evaluate, ``prompt[n_past:]``.

    Notes
    -----
    :meth:`SlotTable.load_slot` applies the plan to the cache as Ollama's ``LoadCacheSlot`` does:

    1. if ``fork_from`` is set, ``cache.copy_prefix(fork_from, slot, n_past)``;
    2. if ``n_past > 0``, go back to where the cache can resume: ``n_past`` when
       ``cache.can_resume(slot, n_past)``, else 0; a cache with recurrent states
       goes back to its last checkpoint at or before ``n_past``
       (``cache.resume_point``; :meth:`SlotTable.rewind`);
    3. ``cache.remove(slot, n_past, None)`` (after a fork, only when step 2 went
       back from the copied length); if that fails, remove everything and
       rewind to 0.
    """

    slot: int
    n_past: int
    fork_from: Optional[int]
    remaining: list[int]


class SlotTable:
    """Which prompt goes into which cache slot, reusing cached prefixes (Ollama ``InputCache``).

    Parameters
    ----------
    n_slots : int
        Number of slots, one per parallel sequence (``>= 1``).
    multi_user : bool
        ``False``: Ollama's default single-user policy, the free slot with the
        longest common prefix (ties: lowest id). ``True``
        (``OLLAMA_MULTIUSER_CACHE``): reuse the slot with the longest prefix
        only if the prompt covers all of its contents and it is free;
        otherwise take the least recently used free slot and, if another slot
        (busy or not) shares a prefix with the prompt, fork that prefix.
    clock : callable
        Returns the current time as a float; :attr:`Slot.last_used` records it.
    cache : ggmlpy.kvcache cache, optional
        The cache whose sequences the slots are. With it the table makes the cache calls that change
        what a sequence holds, each with the matching change of its record (:meth:`load_slot`,
        :meth:`shift`, :meth:`clear`, :meth:`free`, :meth:`save`, :meth:`restore`); without it the
        table is bookkeeping only.

    Notes
    -----
    The table is the one record of what each cache sequence holds (the runner keeps no copy). Inputs
    enter the cache through the runner's forward graphs, so the runner calls :meth:`committed` as it
    puts them in a batch, and :meth:`reset` when the record no longer says what the cache holds (a
    direct batch that did not continue it). Every other change goes through a method that makes the
    cache call too.
    """

    def __init__(self, n_slots: int, multi_user: bool = True,
                 clock: Callable[[], float] = time.monotonic, cache=None) -> None:
        n_slots = _int("n_slots", n_slots)
        if n_slots < 1:
            raise GGMLValueError(f"n_slots must be >= 1, got {n_slots}")
        self.slots: list[Slot] = [Slot(i) for i in range(n_slots)]
        self.multi_user = bool(multi_user)
        self._clock = clock
        self.cache = cache

    def __len__(self) -> int:
        return len(self.slots)

    def __getitem__(self, slot: int) -> Slot:
        return self._slot(slot)

    def __repr__(self) -> str:
        busy = sum(s.in_use for s in self.slots)
        return (f"SlotTable(n_slots={len(self.slots)}, multi_user={self.multi_user}, "
                f"in_use={busy})")

    def _slot(self, slot: int) -> Slot:
        i = _int("slot", slot)
        if not 0 <= i < len(self.slots):
            raise SlotIndexError(f"slot {i} out of range for {len(self.slots)} slots")
        return self.slots[i]

    # ----------------------------------------------------------------- choice

    def _find_longest(self, prompt: list[int]) -> tuple[Slot, int]:
        best: Optional[Slot] = None
        longest = -1
        for s in self.slots:
            if s.in_use:
                continue
            n = common_prefix(s.tokens, prompt)
            if n > longest:
                best, longest = s, n
        if best is None:
            raise NoFreeSlot(f"no available cache slots (all {len(self.slots)} in use)")
        return best, longest

    def _find_best(self, prompt: list[int]) -> tuple[Slot, int, Optional[int]]:
        longest_slot: Optional[Slot] = None
        longest = -1
        oldest: Optional[Slot] = None
        for s in self.slots:
            n = common_prefix(s.tokens, prompt)
            if n > longest:
                longest_slot, longest = s, n
            if not s.in_use and (oldest is None or s.last_used < oldest.last_used):
                oldest = s
        assert longest_slot is not None
        if longest == len(longest_slot.tokens) and not longest_slot.in_use:
            return longest_slot, longest, None
        if oldest is None:
            raise NoFreeSlot(f"no available cache slots (all {len(self.slots)} in use)")
        fork = longest_slot.id if longest > 0 and longest_slot is not oldest else None
        return oldest, longest, fork

    def find(self, prompt: Sequence[int]) -> tuple[int, int, Optional[int]]:
        """The slot :meth:`load` would choose, without changing anything.

        Returns
        -------
        tuple
            ``(slot, n_prefix, fork_from)``: the slot id, how many leading
            prompt tokens it would hold (before :meth:`load` gives one back
            when that is the whole prompt), and the slot to fork them from
            (multi-user mode only) or None.

        Raises
        ------
        NoFreeSlot
            If every slot is in use.
        """
        prompt = [int(t) for t in prompt]
        if self.multi_user:
            slot, n, fork = self._find_best(prompt)
        else:
            (slot, n), fork = self._find_longest(prompt), None
        return slot.id, n, fork

    def load(self, prompt: Sequence[int], cache_prompt: bool = True,
             same_batch: Sequence[int] | None = None) -> LoadPlan:
        """Choose a slot for ``prompt``, mark it in use and say what to evaluate.

        Parameters
        ----------
        prompt : sequence of int
            The (already truncated) prompt, at least one token.
        cache_prompt : bool
            ``False`` (embeddings) reuses nothing: ``n_past = 0``, no fork.
        same_batch : sequence of int, optional
            The prompt's same-batch markers: the reused prefix never ends inside a group (it stops at
            the group's start, and the group is evaluated whole).

        Returns
        -------
        LoadPlan
            If the whole prompt is cached, ``n_past = len(prompt) - 1`` so the
            last token is evaluated again and yields logits. The slot's
            ``tokens`` become ``prompt[:n_past]``.

        Raises
        ------
        NoFreeSlot
            If every slot is in use.
        ValueError
            If the prompt is empty.
        """
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise GGMLValueError("no input provided: the prompt is empty")
        fork: Optional[int] = None
        if self.multi_user:
            slot, n_past, fork = self._find_best(prompt)
        else:
            slot, n_past = self._find_longest(prompt)
        if not cache_prompt:
            n_past, fork = 0, None
        if n_past == len(prompt):
            n_past -= 1  # leave one token to evaluate so there are logits to sample
        sb = [0] * len(prompt) if same_batch is None else [int(x) for x in same_batch]
        n_past = group_boundary(sb, n_past)
        if n_past == 0:
            fork = None
        slot.in_use = True
        slot.last_used = float(self._clock())
        slot.tokens, slot.same_batch = prompt[:n_past], sb[:n_past]
        return LoadPlan(slot.id, n_past, fork, prompt[n_past:])

    def rewind(self, plan: LoadPlan, n_past: int) -> LoadPlan:
        """Resume ``plan`` at a smaller ``n_past`` (the cache could not resume there).

        Truncates the slot's tokens to ``n_past`` and returns the plan with the
        longer ``remaining``. ``fork_from`` is kept: the copy it describes
        (of the original ``plan.n_past`` tokens) may already have happened.
        """
        n_past = _int("n_past", n_past)
        if not 0 <= n_past <= plan.n_past:
            raise GGMLValueError(f"n_past must be in [0, {plan.n_past}], got {n_past}")
        s = self._slot(plan.slot)
        restored = s.tokens[n_past:plan.n_past]
        del s.tokens[n_past:], s.same_batch[n_past:]
        return replace(plan, n_past=n_past, remaining=restored + list(plan.remaining))

    # ----------------------------------------------------------------- upkeep

    def committed(self, slot: int, tokens: Sequence[int], same_batch: Sequence[int] | None = None) -> None:
        """Record that ``tokens`` (with their same-batch markers) now sit in the cache after the rest."""
        s = self._slot(slot)
        n = len(s.tokens)
        s.tokens.extend(int(t) for t in tokens)
        s.same_batch.extend([0] * (len(s.tokens) - n) if same_batch is None else (int(x) for x in same_batch))
        if len(s.same_batch) != len(s.tokens):
            del s.tokens[n:], s.same_batch[n:]
            raise GGMLValueError(f"committed: {len(tokens)} tokens but {len(same_batch)} same_batch markers")

    def set_tokens(self, slot: int, tokens: Sequence[int], same_batch: Sequence[int] | None = None) -> None:
        """Replace what the slot is recorded to hold."""
        s = self._slot(slot)
        tokens = [int(t) for t in tokens]
        sb = [0] * len(tokens) if same_batch is None else [int(x) for x in same_batch]
        if len(sb) != len(tokens):
            raise GGMLValueError(f"set_tokens: {len(tokens)} tokens but {len(sb)} same_batch markers")
        s.tokens, s.same_batch = tokens, sb

    def remove(self, slot: int, begin: int, end: Optional[int] = None) -> None:
        """Drop tokens ``[begin, end)`` (``end=None``: to the end), as ``cache.remove`` does.

        After a context shift the later tokens move down, matching the cache.
        """
        s = self._slot(slot)
        begin = _int("begin", begin)
        stop = len(s.tokens) if end is None else _int("end", end)
        if not 0 <= begin <= stop:
            raise GGMLValueError(f"invalid range [{begin}, {stop})")
        del s.tokens[begin:stop], s.same_batch[begin:stop]

    def reset(self, slot: int) -> None:
        """Forget the slot's contents (the cache sequence was cleared)."""
        s = self._slot(slot)
        s.tokens, s.same_batch = [], []

    def release(self, slot: int) -> None:
        """The request owning the slot ended; its tokens stay for prefix reuse."""
        self._slot(slot).in_use = False

    # ----------------------------------------------------------------- slot <-> cache

    def load_slot(self, prompt: Sequence[int], cache_prompt: bool = True,
                  same_batch: Sequence[int] | None = None) -> tuple[int, int]:
        """Take a slot for ``prompt`` and trim its cache sequence to the prefix it reuses (Ollama
        ``LoadCacheSlot``): :meth:`load`, then the plan's fork, resume check and removal (see
        :class:`LoadPlan`). Returns ``(slot, n_past)``: the slot, now in use, holds ``prompt[:n_past]``
        in the cache and in its record.

        On any error the slot is cleared, released, and the error raised.
        """
        cache = self.cache
        lp = self.load(prompt, cache_prompt=cache_prompt, same_batch=same_batch)
        slot, n_past = lp.slot, lp.n_past
        try:
            fork = lp.fork_from is not None and n_past > 0
            if fork:
                cache.clear(slot)
                cache.copy_prefix(lp.fork_from, slot, n_past)
            if n_past > 0:
                # e.g. a sliding window evicted what the prompt needs (0); a recurrent state goes on only from
                # its end or a checkpoint (the most tokens <= n_past it holds)
                n_past = resume_point(cache, slot, n_past)
            if n_past == 0:
                cache.clear(slot)
            elif not fork or n_past < lp.n_past:
                # (a fork copied lp.n_past positions: the caches that hold more than the resume point drop them)
                try:
                    cache.remove(slot, n_past, None)
                except NotSupported:
                    cache.clear(slot)
                    n_past = 0
        except BaseException:
            try:
                self.clear(slot)
            finally:
                self.release(slot)
            raise
        if n_past < lp.n_past:
            self.rewind(lp, n_past)
        return slot, n_past

    def shift(self, slot: int, keep: int, discard: int) -> Optional[tuple[list[int], list[int]]]:
        """Drop positions ``[keep, keep + discard)`` from the slot's sequence, the later ones moving down
        (Ollama ``ShiftCacheSlot``). When the cache cannot shift (no shift function, cells shared with
        another sequence) the sequence is cleared instead, and what it kept is returned,
        ``(tokens, same_batch)``, to be computed again; None after a shift."""
        try:
            self.cache.remove(slot, keep, keep + discard)
        except NotSupported:
            s = self._slot(slot)
            kept = (s.tokens[:keep] + s.tokens[keep + discard:], s.same_batch[:keep] + s.same_batch[keep + discard:])
            self.clear(slot)
            return kept
        self.remove(slot, keep, keep + discard)
        return None

    def clear(self, slot: Optional[int] = None) -> None:
        """Empty one slot's cache sequence and record (every slot's with None)."""
        self.cache.clear(slot)
        for i in range(len(self.slots)) if slot is None else (slot,):
            self.reset(i)

    def free(self, slot: int, failed: bool = False) -> None:
        """The request owning ``slot`` ended; a ``failed`` one's sequence may hold half-written cells, so it
        is cleared, otherwise its tokens stay for prefix reuse."""
        try:
            if failed:
                self.clear(slot)
        finally:
            self.release(slot)

    def save(self, slot: int, path, meta: dict) -> int:
        """Save the slot's cache sequence with ``meta`` and its token record (``meta["tokens"]``); returns
        the bytes written (:func:`ggmlpy.kvcache.state.save_seq`)."""
        return self.cache.save_seq(slot, path, meta={**meta, "tokens": list(self._slot(slot).tokens)})

    def restore(self, slot: int, path, check: Callable[[dict, list], list]) -> list[int]:
        """Replace the slot's cache sequence and record with a saved state. ``check(meta, positions)``
        validates the state before anything changes and returns the token record to keep (raising to
        refuse it). Returns that record. On failure after the sequence was cleared, the record goes too.
        """
        kept: list = []
        try:
            self.cache.load_seq(slot, path, check=lambda meta, positions: kept.append(check(meta, positions)))
        except BaseException:
            if self.cache.seq_pos_max(slot) < 0:
                self.reset(slot)
            raise
        self.set_tokens(slot, kept[0])
        return kept[0]
