"""Former home of the runner's slot bookkeeping, now :mod:`ggmlpy.runner.slots` (kept importable)."""

from ggmlpy.runner.slots import (
    InputTooLong,
    LoadPlan,
    NoFreeSlot,
    Slot,
    SlotIndexError,
    SlotTable,
    common_prefix,
    effective_keep,
    group_boundary,
    group_sizes,
    shift_discard,
    truncate_indices,
    truncate_prompt,
)

__all__ = ["InputTooLong", "LoadPlan", "NoFreeSlot", "Slot", "SlotIndexError", "SlotTable", "common_prefix",
           "effective_keep", "group_boundary", "group_sizes", "shift_discard", "truncate_indices", "truncate_prompt"]
