"""DRY ("don't repeat yourself"): the penalty on tokens that would extend a repetition, as llama.cpp's
``llama_sampler_dry`` computes it (originally koboldcpp's), and its sequence breakers read from the
vocabulary."""

from __future__ import annotations

import math
import threading
import weakref
from typing import Optional

import numpy as np

__all__ = ["DryBreakers", "dry_penalties"]

#: a breaker's tail (the tokens after its head token) is cut to this many tokens (llama.cpp's MAX_SEQ_LEN)
MAX_TAIL = 20
#: log of float32's largest value: the exponent is clamped so the penalty stays finite
_FLOAT_MAX_LOG = 88.7228391


class DryBreakers:
    """The sequence breakers as tokens: ``heads[token]`` is the set of tails (tuples of token ids,
    possibly empty) that, after ``token``, complete a breaker string.

    A token whose text holds a breaker is a breaker on its own (empty tail). A token whose text ends
    with the start of a breaker is a head, and the tokenization of the breaker's rest is its tail
    (llama.cpp's ``get_overlapping_token_sequences``). Built once per tokenizer and breaker list (a
    pass over the vocabulary's pieces) and shared.
    """

    _cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    _lock = threading.Lock()

    def __init__(self, heads: dict) -> None:
        self.heads = heads

    @classmethod
    def of(cls, tokenizer, breakers: tuple) -> DryBreakers:
        if tokenizer is None or not breakers:
            return cls({})
        with cls._lock:
            per = cls._cache.setdefault(tokenizer, {})
            hit = per.get(breakers)
        if hit is not None:
            return hit
        made = cls(_heads(tokenizer, breakers))
        with cls._lock:
            per[breakers] = made
        return made


def _heads(tokenizer, breakers: tuple) -> dict:
    heads: dict[int, set] = {}
    n = len(tokenizer)
    pieces = [tokenizer.token_to_piece(t, True) for t in range(n)]
    for text in breakers:
        b = text.encode("utf-8")
        first = b[:1]
        for tid, word in enumerate(pieces):
            if b in word:
                heads.setdefault(tid, set()).add(())
                continue
            pos = word.find(first)
            while pos >= 0:
                # the word's end overlaps the breaker's start: word[pos:] == b[:len(word) - pos]
                i = len(word) - pos
                if i < len(b) and word[pos:] == b[:i]:
                    tail = tuple(tokenizer.encode(b[i:], add_special=False, parse_special=False)[:MAX_TAIL])
                    heads.setdefault(tid, set()).add(tail)
                pos = word.find(first, pos + 1)
    return heads


def _z_reverse(rev: list) -> list:
    """z[k]: the length of the longest common prefix of ``rev`` and ``rev[k:]`` (z[0] unused)."""
    n = len(rev)
    z = [0] * n
    lt = rt = 0
    for k in range(1, n):
        if k <= rt:
            z[k] = min(rt - k + 1, z[k - lt])
        while k + z[k] < n and rev[z[k]] == rev[k + z[k]]:
            z[k] += 1
        if k + z[k] - 1 > rt:
            lt, rt = k, k + z[k] - 1
    return z


def dry_penalties(window: list, breakers: Optional[DryBreakers], multiplier: float, base: float,
                  allowed_length: int) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, float32 penalties to subtract from their logits) for the history ``window`` (the last
    ``dry_penalty_last_n`` tokens, oldest first), as llama.cpp's ``llama_sampler_dry_apply``."""
    none = (np.empty(0, np.int64), np.empty(0, np.float32))
    n = len(window)
    if multiplier == 0.0 or base < 1.0 or n <= allowed_length:
        return none
    rev = window[::-1]                       # rev[i]: the token i places from the end
    heads = breakers.heads if breakers is not None else {}
    # 1. the nearest breaker limits how far back a repetition may reach
    rep_limit = n
    for i, tok in enumerate(rev):
        tails = heads.get(tok)
        if not tails:
            continue
        longest = -1
        for tail in tails:
            m = len(tail)
            if longest < m <= i and all(tail[o] == rev[i - o - 1] for o in range(m)):
                longest = m
        if longest >= 0:
            rep_limit = i - longest
            break
    if rep_limit < allowed_length:
        return none
    # 2. for each earlier place, how long a suffix of the history repeats there
    z = _z_reverse(rev)
    # 3. the token after such a place would extend the repetition
    best: dict[int, int] = {}
    for k in range(1, n):
        length = min(z[k], rep_limit)
        if length >= allowed_length:
            tok = rev[k - 1]
            if best.get(tok, -1) < length:
                best[tok] = length
    # 4. a single-token breaker is never penalised; the exponent is clamped to keep float32 finite
    # float32 operands, as llama.cpp's (its settings are floats): the same penalty to the bit
    m32, b32 = float(np.float32(multiplier)), float(np.float32(base))
    max_exp = int(np.float32(_FLOAT_MAX_LOG) / np.float32(math.log(b32))) if b32 > 1.000001 else 0
    toks, pens = [], []
    for tok, length in best.items():
        if () in heads.get(tok, ()):
            continue
        e = length - allowed_length
        if max_exp > 0 and e > max_exp:
            e = max_exp
        toks.append(tok)
        pens.append(np.float32(m32 * b32 ** e))
    return np.asarray(toks, dtype=np.int64), np.asarray(pens, dtype=np.float32)
