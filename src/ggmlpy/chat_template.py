"""The old place of :mod:`ggmlpy.tokenizer.chat_template` (chat templates, rendered in a bounded
sandbox), kept for callers of ``ggmlpy.chat_template``: its public names, re-exported."""

from __future__ import annotations

from ggmlpy.tokenizer._limits import (  # noqa: F401  (the old module's public limits)
    DEFAULT_MAX_SECONDS,
    DEFAULT_MAX_STEPS,
    MAX_INT_BITS,
)
from ggmlpy.tokenizer.chat_template import MAX_INPUT_DEPTH, ChatTemplate, ChatTemplateError  # noqa: F401

__all__ = ["ChatTemplate", "ChatTemplateError"]
