"""The streaming :class:`Detokenizer`: token ids in, text out as soon as it is whole UTF-8."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._common import _complete_utf8

if TYPE_CHECKING:
    from .vocab import Tokenizer

__all__ = ["Detokenizer"]


class Detokenizer:
    """Tokens in, text out as soon as it is whole UTF-8.

    :meth:`feed` returns the text a token completes: a character split across byte tokens is held
    back until its last byte arrives, never emitted broken. :meth:`flush` returns what is still held
    (an incomplete character as U+FFFD). The text fed piece by piece equals ``decode`` of all the ids
    without the first-space and space clean-up rules, which apply to a whole text only.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special
        self._held = b""

    def feed(self, tid: int) -> str:
        """The text completed by one more token (possibly ``""``)."""
        piece = self._tok.token_to_piece(tid, special=not self._skip)
        if not piece:
            return ""
        data = self._held + piece
        cut = _complete_utf8(data)
        self._held = data[cut:]
        return data[:cut].decode("utf-8", errors="replace")

    def flush(self) -> str:
        """Whatever is held back, as text (an incomplete character as U+FFFD); resets the stream."""
        data, self._held = self._held, b""
        return data.decode("utf-8", errors="replace")

    @property
    def pending(self) -> bytes:
        """Bytes held back: the start of a character not yet complete."""
        return self._held
