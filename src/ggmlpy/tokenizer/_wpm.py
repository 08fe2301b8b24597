"""WPM (BERT): the character tables of llama.cpp's normalisation."""

from __future__ import annotations

import unicodedata

_wpm_cache: list = []


def _wpm_tables() -> tuple[dict, dict]:
    """``str.translate`` tables for llama.cpp's BERT pre-processing, from Python's Unicode tables
    (built once, on first use: a pass over every code point). Control, format and private-use
    characters that are not whitespace, NUL and U+FFFD are deleted; punctuation, ASCII symbols and
    CJK ideographs get a space on each side (words of their own). The second table also deletes
    combining marks (for ``strip_accents``)."""
    if _wpm_cache:
        return _wpm_cache[0]
    keep: dict[int, str | None] = {0: None, 0xFFFD: None}
    marks: dict[int, str | None] = {}
    cat = unicodedata.category
    for cp in range(1, 0x110000):
        if 0xD800 <= cp <= 0xDFFF:
            continue
        ch = chr(cp)
        c = cat(ch)
        if c in ("Cc", "Cf", "Co") and not (ch.isspace() and not 0x1C <= cp <= 0x1F):
            keep[cp] = None
        elif c[0] == "M":
            marks[cp] = None
        elif c[0] == "P" or (cp < 0x7F and c[0] == "S") or _is_cjk(cp):
            keep[cp] = f" {ch} "
    # every other BMP character maps to itself: str.translate then finds each character it looks up
    # (a miss costs a raised and cleared KeyError), twice as fast on mixed text
    both = {**keep, **marks}
    for table in (keep, both):
        for cp in range(0x10000):
            table.setdefault(cp, cp)
    _wpm_cache.append((keep, both))
    return _wpm_cache[0]


def _is_cjk(cp: int) -> bool:
    return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF or
            0x2A700 <= cp <= 0x2B73F or 0x2B740 <= cp <= 0x2B81F or 0x2B920 <= cp <= 0x2CEAF or
            0xF900 <= cp <= 0xFAFF or 0x2F800 <= cp <= 0x2FA1F)
