"""DRY ("don't repeat yourself"): the penalty on tokens that would extend a repetition, as llama.cpp's
``llama_sampler_dry`` computes it (originally koboldcpp's), and its sequence breakers read from the
vocabulary."""

from __future__ import annotations

import math
import re
import threading
import weakref
from collections import OrderedDict
from typing import Optional

import numpy as np

from .params import MAX_BREAKER_BYTES

__all__ = ["DryBreakers", "dry_penalties"]

#: a breaker's tail (the tokens after its head token) is cut to this many tokens (llama.cpp's MAX_SEQ_LEN)
MAX_TAIL = 20
#: breaker lists kept built per tokenizer, and single breakers (least recently used dropped): a server's
#: requests may each name their own, and each costs a pass over the vocabulary
_CACHE_LISTS = 16
_CACHE_BREAKERS = 256
#: log of float32's largest value: the exponent is clamped so the penalty stays finite
_FLOAT_MAX_LOG = 88.7228391


class DryBreakers:
    """The sequence breakers as tokens: ``heads[token]`` is the set of tails (tuples of token ids,
    possibly empty) that, after ``token``, complete a breaker string.

    A token whose text holds a breaker is a breaker on its own (empty tail). A token whose text ends
    with the start of a breaker is a head, and the tokenization of the breaker's rest is its tail
    (llama.cpp's ``get_overlapping_token_sequences``). Built once per tokenizer and breaker (numpy over
    the vocabulary's pieces, joined once per tokenizer) and shared; the caches are bounded.
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
            per = cls._cache.get(tokenizer)
            if per is None:
                per = cls._cache[tokenizer] = _PerTokenizer()
            hit = per.lists.get(breakers)
            if hit is not None:
                per.lists.move_to_end(breakers)
                return hit
        heads: dict[int, set] = {}
        for text in breakers:
            for tid, tails in per.breaker(tokenizer, text).items():
                heads.setdefault(tid, set()).update(tails)
        made = cls(heads)
        with cls._lock:
            made = per.lists.setdefault(breakers, made)
            while len(per.lists) > _CACHE_LISTS:
                per.lists.popitem(last=False)
        return made


class _PerTokenizer:
    """One tokenizer's pieces joined (``blob``, token ``i`` at ``starts[i]:ends[i]``) and its built
    breakers; guarded by ``DryBreakers._lock`` except the building itself (two threads may build the same
    breaker once each: the same result)."""

    def __init__(self) -> None:
        self.lists: OrderedDict = OrderedDict()
        self.singles: OrderedDict = OrderedDict()
        self.pieces: Optional[tuple] = None

    def breaker(self, tokenizer, text: str) -> dict:
        with DryBreakers._lock:
            hit = self.singles.get(text)
            if hit is not None:
                self.singles.move_to_end(text)
                return hit
            pieces = self.pieces
        if pieces is None:
            pieces = _join_pieces(tokenizer)
        made = _heads_of(tokenizer, pieces, text.encode("utf-8")[:MAX_BREAKER_BYTES])
        with DryBreakers._lock:
            self.pieces = pieces
            self.singles[text] = made
            while len(self.singles) > _CACHE_BREAKERS:
                self.singles.popitem(last=False)
        return made


def _join_pieces(tokenizer) -> tuple:
    n = len(tokenizer) if hasattr(tokenizer, "__len__") else int(tokenizer.n_vocab)
    pieces = [tokenizer.token_to_piece(t, True) for t in range(n)]
    lens = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=n)
    ends = np.cumsum(lens)
    blob = b"".join(pieces)
    arr = np.frombuffer(blob, dtype=np.uint8) if blob else np.zeros(0, np.uint8)
    return blob, arr, ends - lens, ends, lens


def _lossy(b: bytes) -> str:
    """``b`` as text the way llama.cpp's tokenizer reads bytes: each byte that does not start a valid UTF-8
    character becomes U+FFFD (a breaker cut inside a character, a token ending inside one)."""
    out, i = [], 0
    while i < len(b):
        try:
            out.append(b[i:].decode("utf-8"))
            break
        except UnicodeDecodeError as e:
            out.append(b[i:i + e.start].decode("utf-8"))
            out.append("\ufffd")
            i += e.start + 1
    return "".join(out)


def _heads_of(tokenizer, pieces: tuple, b: bytes) -> dict:
    """``{token: set of tails}`` for one breaker's bytes ``b`` (non-empty), as llama.cpp's
    ``get_overlapping_token_sequences``: tokens holding ``b``; else tokens ending with ``b[:i]``
    (``0 < i < len(b)``), tail the tokenization of ``b[i:]``."""
    blob, arr, starts, ends, lens = pieces
    heads: dict[int, set] = {}
    # every place b occurs in the joined pieces (overlapping ones too), kept where it lies in one token
    at = np.fromiter((m.start() for m in re.finditer(b"(?=" + re.escape(b) + b")", blob, re.DOTALL)),
                     dtype=np.int64)
    holds = np.zeros(lens.size, dtype=bool)
    if at.size:
        tok = np.searchsorted(starts, at, side="right") - 1
        holds[tok[at + len(b) <= ends[tok]]] = True
    for tid in np.flatnonzero(holds).tolist():
        heads[tid] = {()}
    last = np.where(lens > 0, arr[np.maximum(ends - 1, 0)] if arr.size else 0, -1)
    for i in range(1, len(b)):
        # the token's last i bytes are b[:i]: narrowed on the last byte first, then the others
        cand = np.flatnonzero((last == b[i - 1]) & (lens >= i) & ~holds)
        for j in range(i - 1):
            if not cand.size:
                break
            cand = cand[arr[ends[cand] - i + j] == b[j]]
        if not cand.size:
            continue
        tail = tuple(tokenizer.encode(_lossy(b[i:]), add_special=False, parse_special=False)[:MAX_TAIL])
        for tid in cand.tolist():
            heads.setdefault(tid, set()).add(tail)
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
