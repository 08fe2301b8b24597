"""WPM (BERT): llama.cpp's word splitting and greedy longest match (:class:`_WpmMethods`), and the
character tables of its normalisation."""

from __future__ import annotations

import itertools
import unicodedata
from typing import Any

from ._common import (
    _ESCAPED_SPACE,
    _HANGUL,
    _HANGUL_LEAD,
    _LONG_WORD,
    _MAX_PIECE,
    TokenizerError,
    _engine_model,
)

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


class _WpmMethods:
    """The WPM methods of :class:`~ggmlpy.tokenizer.vocab.Tokenizer` (a base class of it): they read
    its vocabulary, its BERT normaliser flags and, once :meth:`_build_wpm` made it, its engine."""

    _texts: list[str]
    _ids: dict[str, int]
    source: str
    unk: int | None
    lowercase: bool
    strip_accents: bool
    _hf: Any

    def _build_wpm(self) -> None:
        """The WordPiece engine (``_hf``) and the table of words already encoded; no engine where
        WordPiece cannot hold the vocabulary (a bare word-start token, two tokens that spell one of its
        entries, no unknown token): :meth:`_wpm` then takes :meth:`_wpm_slow`."""
        self._max_token_len = max(len(t) for t in self._texts)
        if _ESCAPED_SPACE in self._ids:   # a bare word-start token: WordPiece cannot hold it
            return
        from tokenizers import Tokenizer as _HFTokenizer
        from tokenizers.models import WordPiece

        # WordPiece spells word starts bare and continuations "##x"; the GGUF, "▁x" and "x"
        wp = {(t[1:] if t.startswith(_ESCAPED_SPACE) else "##" + t): i for t, i in self._ids.items()}
        if len(wp) == len(self._ids) and self.unk is not None:
            # the engine looks its unknown token up by name; "[UNK]" can never be a word here
            # (brackets are words of their own), so the extra entry changes no match
            unk = self._texts[self.unk]
            wp.setdefault(unk, self.unk)
            self._hf = _HFTokenizer(_engine_model(self.source, "WPM", WordPiece, wp, unk_token=unk,
                                                  max_input_chars_per_word=1 << 30))
            # whole words found in the vocabulary, and (up to a bound) the pieces of others seen
            self._wpm_known = {t[1:]: (i,) for t, i in self._ids.items() if t.startswith(_ESCAPED_SPACE)}
            self._wpm_limit = len(self._wpm_known) + (1 << 17)

    def _wpm_split(self, text: str) -> list[str]:
        """llama.cpp's BERT pre-processing: NFD and removal of combining marks, lower case, split on
        whitespace; punctuation, ASCII symbols and CJK ideographs are words of their own; control,
        format and private-use characters dropped (what llama.cpp's Unicode tables say, checked
        against it category by category)."""
        if self.strip_accents:
            # llama.cpp's NFD table maps a Hangul syllable to its leading consonant alone (checked
            # against it: 퀢 and 킯 both give ▁ᄏ); the rest is Unicode's NFD
            text = unicodedata.normalize("NFD", text.translate(_HANGUL_LEAD)) if _HANGUL.search(text) \
                else unicodedata.normalize("NFD", text)
        words: list[str] = []
        cur: list[str] = []
        cat = unicodedata.category
        for ch in text:
            c = cat(ch)
            cp = ord(ch)
            # Unicode's White_Space: str.isspace() also counts the separators U+001C..U+001F
            if ch.isspace() and not 0x1C <= cp <= 0x1F:
                if cur:
                    words.append("".join(cur))
                    cur = []
                continue
            if cp == 0 or cp == 0xFFFD or c in ("Cc", "Cf", "Co"):
                continue
            if self.strip_accents and c[0] == "M":
                continue
            if self.lowercase:
                ch = ch.lower()
            if c[0] == "P" or (cp < 0x7F and c[0] == "S") or _is_cjk(cp):
                if cur:
                    words.append("".join(cur))
                    cur = []
                words.append(ch)
            else:
                cur.append(ch)
        if cur:
            words.append("".join(cur))
        return words

    def _wpm(self, text: str) -> list[int]:
        """Greedy longest match of each word, with the word-start marker, as llama.cpp's WPM session:
        the words split by regular expressions built from Python's Unicode tables, the matching in
        the engine's WordPiece (same rule: a word with an unmatched rest is one unknown token)."""
        if self._hf is None:
            return self._wpm_slow(text)
        if self.strip_accents:
            text = unicodedata.normalize("NFD", text.translate(_HANGUL_LEAD) if _HANGUL.search(text) else text)
        # controls (and marks) deleted, one-character words spaced out, then split on White_Space
        # (str.split's whitespace less U+001C..U+001F, which the table deleted)
        text = text.translate(_wpm_tables()[1 if self.strip_accents else 0])
        if self.lowercase:
            text = text.lower()
        words = text.split()
        known = self._wpm_known
        missing = list({w for w in words if w not in known})
        if missing:
            # the engine's WordPiece tries every length of the rest of a word (quadratic): long words
            # take the loop bounded by the longest token instead
            found = {w: tuple(self._wpm_greedy(w)) for w in missing if len(w) > _LONG_WORD}
            missing = [w for w in missing if len(w) <= _LONG_WORD]
            for k in range(0, len(missing), 1 << 14):
                part = missing[k:k + (1 << 14)]
                encs = self._hf.encode_batch_fast([[w] for w in part], is_pretokenized=True, add_special_tokens=False)
                found.update(zip(part, (tuple(e.ids) for e in encs)))
            if len(known) + len(found) <= self._wpm_limit:
                known.update(found)     # kept: words repeat, and a dictionary hit is the fast path
            else:
                known = {**known, **found}
        return list(itertools.chain.from_iterable(map(known.__getitem__, words)))

    def _wpm_slow(self, text: str) -> list[int]:
        out: list[int] = []
        for word in self._wpm_split(text):
            out.extend(self._wpm_greedy(word))
        return out

    def _wpm_greedy(self, word: str) -> list[int]:
        """One word's ids: the longest vocabulary entry at each place, starting with the word-start
        marker; the unknown token if some place has none (llama.cpp's WPM session)."""
        if len(word) > _MAX_PIECE:
            raise TokenizerError(f"encode: the text has a word of {len(word)} characters, with no place where it "
                                 f"can be split; at most {_MAX_PIECE} are encoded in one piece: encode it in parts")
        ids, maxlen = self._ids, self._max_token_len
        w = _ESCAPED_SPACE + word
        n = len(w)
        out: list[int] = []
        i = 0
        while i < n:
            for j in range(min(n, i + maxlen + 1), i, -1):
                tid = ids.get(w[i:j])
                if tid is not None:
                    out.append(tid)
                    i = j
                    break
            else:
                out = []
                break
        if not out:
            if self.unk is None:
                raise TokenizerError(f"encode: no tokens for the word {word[:40]!r} and no unknown token")
            out.append(self.unk)
        return out
