"""llama.cpp's samplers restated in plain Python, from ``src/llama-sampler.cpp`` and ``common/sampling.cpp``
of the pinned llama.cpp (llama-cpp-python 0.3.36's vendor/llama.cpp), for the tests of ggmlpy.sampling.

One function per sampler, each acting on a :class:`Cands` (llama.cpp's ``llama_token_data_array``: the
candidates in their current order, a logit and a probability each, and the ``sorted`` flag), in the same
steps as the C++ and with the same conventions: which samplers sort, which softmax they take (all of the
current candidates, ``-inf`` ones included with probability 0), ``>=`` against ``>``, where ``min_keep``
enters. Loops over lists, float64, no shortcuts: written to be checked by reading it beside the C++.

What it does not copy is llama.cpp's float32 arithmetic. Where a decision (a cumulative mass against
``top_p``, a logit against ``min_p``'s cut, a tie across a cut of a sort llama.cpp does not keep stable)
lies within rounding of its threshold, float32 and float64 may both be right and still differ: the
function raises :class:`Ambiguous`, and a test drawing random logits draws others. Where llama.cpp's
own result is undefined (a NaN entropy, an ``int`` conversion out of range) it raises :class:`Undefined`.

Conventions of the restatement that are choices, not llama.cpp's:

* Sorting is by logit, descending, ties by lower id (``std::sort`` and ``std::partial_sort`` are not
  stable; a tie that crosses a cut raises Ambiguous).
* The result of a chain (:func:`chain`) is the candidates with a finite logit and their probabilities:
  llama.cpp keeps masked (``-inf``) candidates in the array with probability 0; a draw never picks them.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Callable, Optional

# rounding margin of a decision: llama.cpp adds and compares in float32 (eps 1.2e-7), over up to
# ~150k terms for a cumulative mass
REL = 1e-5

DEFAULT_SAMPLERS = ("penalties", "dry", "top_n_sigma", "top_k", "typical_p", "top_p", "min_p", "xtc",
                    "temperature")


class Ambiguous(Exception):
    """A decision within float rounding of its threshold: float32 (llama.cpp) and float64 may differ."""


class Undefined(Exception):
    """llama.cpp's own result is undefined for this input (NaN arithmetic, undefined behaviour)."""


def _near(a: float, b: float, tol: float = REL) -> bool:
    if not (math.isfinite(a) and math.isfinite(b)):
        return False
    return abs(a - b) <= tol * max(1.0, abs(a), abs(b))


class Cands:
    """``llama_token_data_array``: ids, logits, probabilities in the current order, and ``sorted``."""

    def __init__(self, logits: Sequence[float], ids: Optional[Sequence[int]] = None) -> None:
        self.ids = list(range(len(logits))) if ids is None else [int(i) for i in ids]
        self.logit = [float(x) for x in logits]
        self.p = [0.0] * len(self.logit)
        self.sorted = False

    def __len__(self) -> int:
        return len(self.ids)

    def take(self, order: Sequence[int]) -> None:
        """Keep the candidates at positions ``order``, in that order."""
        self.ids = [self.ids[i] for i in order]
        self.logit = [self.logit[i] for i in order]
        self.p = [self.p[i] for i in order]

    def sort(self) -> None:
        """Descending logits, ties by lower id (llama_token_data_array_partial_sort_inplace)."""
        self.take(sorted(range(len(self)), key=lambda i: (-self.logit[i], self.ids[i])))
        self.sorted = True

    def check_cut(self, k: int) -> None:
        """A sorted array cut after its first k: a tie (within rounding) across the cut is Ambiguous."""
        if 0 < k < len(self) and _near(self.logit[k - 1], self.logit[k]):
            raise Ambiguous(f"tie across a cut at {k}: {self.logit[k - 1]!r} / {self.logit[k]!r}")

    def finite(self) -> tuple[list[int], list[float]]:
        """(ids, probabilities) of the candidates with a finite logit, by softmax over them."""
        keep = [i for i in range(len(self)) if self.logit[i] > -math.inf]
        if not keep:
            raise Undefined("every candidate is -inf")
        top = max(self.logit[i] for i in keep)
        w = [math.exp(self.logit[i] - top) for i in keep]
        s = sum(w)
        return [self.ids[i] for i in keep], [x / s for x in w]


# ---------------------------------------------------------------------------------------------- helpers


def softmax(c: Cands, do_sort: bool) -> None:
    """llama_sampler_softmax_impl: optionally sort, then p over all current candidates (-inf -> 0)."""
    if not len(c):
        raise Undefined("softmax of no candidates")
    if do_sort and not c.sorted:
        c.sort()
    top = max(c.logit)
    if top == -math.inf:
        raise Undefined("softmax of all -inf")
    w = [math.exp(x - top) for x in c.logit]
    s = sum(w)
    c.p = [x / s for x in w]


def temp_impl(c: Cands, t: float) -> None:
    """llama_sampler_temp_impl: t <= 0 keeps the first maximum (in the current order) and sets the rest
    to -inf; else divides the logits by t."""
    if not len(c):
        return
    if t <= 0.0:
        best = 0
        for i in range(1, len(c)):
            if c.logit[i] > c.logit[best]:
                best = i
        c.logit = [x if i == best else -math.inf for i, x in enumerate(c.logit)]
        return
    c.logit = [x / t for x in c.logit]


# ---------------------------------------------------------------------------------------------- samplers


def logit_bias(c: Cands, bias: dict) -> None:
    """llama_sampler_logit_bias_apply: logit += bias for each listed id present (-inf bans it)."""
    for i, tok in enumerate(c.ids):
        if tok in bias:
            c.logit[i] += float(bias[tok])


def penalties(c: Cands, history: Sequence[int], last_n: int, repeat: float, freq: float, present: float) -> None:
    """llama_sampler_penalties_apply over the last ``last_n`` tokens of ``history`` (``last_n`` < 0 is 0
    in llama_sampler_init_penalties: disabled). For a token seen ``count`` times there: a logit <= 0 is
    multiplied by ``repeat``, a positive one divided by it; then ``count * freq + present`` is
    subtracted."""
    last_n = max(last_n, 0)
    if last_n == 0 or (repeat == 1.0 and freq == 0.0 and present == 0.0):
        return
    counts = Counter(list(history)[-last_n:])
    for i, tok in enumerate(c.ids):
        n = counts.get(tok, 0)
        if n == 0:
            continue
        if c.logit[i] <= 0:
            c.logit[i] *= repeat
        else:
            c.logit[i] /= repeat
        c.logit[i] -= n * freq + present
    c.sorted = False


def dry_breakers(vocab: Sequence[str], breakers: Sequence[str],
                 tokenize: Optional[Callable[[str], list]] = None) -> dict:
    """llama_sampler_init_dry's processing of the sequence breakers (get_overlapping_token_sequences):
    ``{head token: [tail token lists]}``. A token whose text contains a breaker is a single-token breaker
    (tail ``[]``); a token whose text *ends* with a proper prefix of one is the head of a multi-token
    breaker whose tail is ``tokenize(the rest)`` (at most 20 tokens). Breakers are cut to 40 characters;
    empty ones are skipped."""
    out: dict = {}
    for s in breakers:
        if not s:
            continue
        s = s[:40]
        for tok, word in enumerate(vocab):
            if s in word:
                out.setdefault(tok, [])
                if [] not in out[tok]:
                    out[tok].append([])
                continue
            pos = word.find(s[0])
            while pos != -1:
                i, match = 1, True
                while i < len(s) and i + pos < len(word):
                    if word[pos + i] != s[i]:
                        match = False
                        break
                    i += 1
                if match:
                    if tokenize is None:
                        raise ValueError(f"breaker {s!r} needs a tokenizer for its tail {s[i:]!r}")
                    tail = list(tokenize(s[i:]))[:20]
                    out.setdefault(tok, [])
                    if tail not in out[tok]:
                        out[tok].append(tail)
                pos = word.find(s[0], pos + 1)
    return out


def dry_max_repeat(history: Sequence[int], allowed_length: int, last_n: int, breakers: dict) -> dict:
    """DRY's steps 1 to 3: ``{token: the longest repeat its emission would extend}``, counting only
    repeats of at least ``allowed_length`` tokens, over the last ``last_n`` tokens of ``history``.

    A repeat is a suffix of the context that also ends at an earlier position j; the token after j would
    extend it. Its length is capped at ``rep_limit``: how far back the nearest sequence breaker is (a
    breaker in the suffix ends the repetition)."""
    tokens = list(history)[-last_n:] if last_n > 0 else []
    n = len(tokens)
    if n <= allowed_length:
        return {}
    # step 1: the nearest breaker, scanning back from the last token (i tokens from the end)
    rep_limit = n
    for i in range(n):
        tails = breakers.get(tokens[n - 1 - i])
        if tails is None:
            continue
        longest = -1
        for tail in tails:
            if longest < len(tail) <= i and all(tail[o] == tokens[n - 1 - (i - o - 1)] for o in range(len(tail))):
                longest = len(tail)
        if longest >= 0:
            rep_limit = i - longest
            break
    if rep_limit < allowed_length:
        return {}
    # step 2: at each earlier position j, the longest common suffix of tokens[:j+1] and tokens (capped)
    out: dict = {}
    for j in range(n - 1):
        m = 0
        while m < j + 1 and tokens[j - m] == tokens[n - 1 - m]:
            m += 1
        m = min(m, rep_limit)
        # step 3: the token after j would extend that repeat
        if m >= allowed_length:
            nxt = tokens[j + 1]
            out[nxt] = max(out.get(nxt, 0), m)
    return out


def dry(c: Cands, history: Sequence[int], multiplier: float, base: float, allowed_length: int, last_n: int,
        breakers: dict) -> None:
    """llama_sampler_dry_apply: logit -= multiplier * base ** (repeat - allowed_length) for each token that
    would extend a repeat (not a single-token breaker itself); the exponent is capped so that base ** exp
    stays below FLT_MAX. ``last_n`` < 0 is 0 (llama_sampler_init_dry clamps it): disabled."""
    last_n = max(last_n, 0)
    if multiplier == 0.0 or base < 1.0 or last_n == 0:
        return
    rep = dry_max_repeat(history, allowed_length, last_n, breakers)
    max_exponent = int(88.7228391 / math.log(base)) if base > 1.000001 else 0
    for i, tok in enumerate(c.ids):
        if tok not in rep:
            continue
        if [] in breakers.get(tok, []):
            continue
        e = rep[tok] - allowed_length
        if max_exponent > 0 and e > max_exponent:
            e = max_exponent
        c.logit[i] -= multiplier * base ** e
    c.sorted = False


def top_n_sigma(c: Cands, n: float) -> None:
    """llama_sampler_top_n_sigma_apply: mean and (population) std over the finite logits; logits below
    max - n * std become -inf (they stay in the array). Off for n <= 0 or a single candidate."""
    if n <= 0.0 or len(c) <= 1:
        return
    fin = [x for x in c.logit if x != -math.inf]
    if not fin:
        return
    top = max(fin)
    mean = sum(fin) / len(fin)
    std = math.sqrt(sum((x - mean) ** 2 for x in fin) / len(fin))
    cut = top - n * std
    for i, x in enumerate(c.logit):
        if _near(x, cut) and x != top:
            raise Ambiguous(f"top_n_sigma: logit {x!r} at the cut {cut!r}")
        if x < cut:
            c.logit[i] = -math.inf


def top_k(c: Cands, k: int) -> None:
    """llama_sampler_top_k_impl: the k largest logits, sorted (k <= 0: off)."""
    if k <= 0:
        return
    k = min(k, len(c))
    if not c.sorted:
        c.sort()
    if k < len(c) and c.logit[k] > -math.inf:
        c.check_cut(k)
    c.take(range(k))


def typical(c: Cands, p: float, min_keep: int) -> None:
    """llama_sampler_typical_apply: sorted softmax, entropy H = -sum p log p; order the candidates by
    |-log p - H| ascending and keep the shortest prefix whose mass is *greater than* p (and at least
    min_keep long). The result is in that order (unsorted)."""
    if p >= 1.0:
        return
    softmax(c, True)
    if any(q == 0.0 for q in c.p):
        # 0 * log(0) is NaN in C: the entropy and every score are NaN, and the order is unspecified
        raise Undefined("typical_p over a zero-probability candidate")
    h = -sum(q * math.log(q) for q in c.p)
    score = [abs(-math.log(q) - h) for q in c.p]
    order = sorted(range(len(c)), key=lambda i: score[i])
    last = len(order)
    cum = 0.0
    for i, idx in enumerate(order):
        cum += c.p[idx]
        if _near(cum, p):
            raise Ambiguous(f"typical: mass {cum!r} at p={p!r}")
        if cum > p and (min_keep == 0 or i >= min_keep - 1):
            last = i + 1
            break
    if last < len(order) and _near(score[order[last - 1]], score[order[last]]):
        raise Ambiguous("typical: tie of scores across the cut")
    c.take(order[:last])
    c.sorted = False


def top_p(c: Cands, p: float, min_keep: int) -> None:
    """llama_sampler_top_p_apply: softmax over the current candidates, sort, keep the shortest prefix
    whose cumulative mass is *at least* p and whose length is at least min_keep."""
    if p >= 1.0:
        return
    softmax(c, False)
    if not c.sorted:
        c.sort()
    last = len(c)
    cum = 0.0
    for i in range(len(c)):
        cum += c.p[i]
        if i + 1 >= min_keep and _near(cum, p):
            raise Ambiguous(f"top_p: mass {cum!r} at p={p!r}")
        if cum >= p and i + 1 >= min_keep:
            last = i + 1
            break
    if last < len(c) and c.logit[last] > -math.inf:
        c.check_cut(last)
    c.take(range(last))


def min_p(c: Cands, p: float, min_keep: int) -> None:
    """llama_sampler_min_p_apply: keep logits >= max + log(p) (p_i >= p * p_max, on logits: no softmax);
    when that keeps fewer than min_keep, the top min_keep by logit instead."""
    if p <= 0.0 or not len(c):
        return
    top = max(c.logit)
    cut = top + math.log(p)
    for x in c.logit:
        if x != top and _near(x, cut):
            raise Ambiguous(f"min_p: logit {x!r} at the cut {cut!r}")
    if not c.sorted:
        keep = [i for i in range(len(c)) if c.logit[i] >= cut]
        if keep and len(keep) >= min_keep:
            c.take(keep)
            return
        c.sort()
    i = 1
    while i < len(c):
        if c.logit[i] < cut and i >= min_keep:
            break
        i += 1
    if i < len(c) and c.logit[i] > -math.inf:
        c.check_cut(i)
    c.take(range(i))


def xtc(c: Cands, applies: bool, threshold: float, min_keep: int) -> None:
    """llama_sample_xtc_apply once its coin came up (``applies``: uniform [0, 1) <= probability): sorted
    softmax; of the leading candidates with p >= threshold, remove all but the last, unless fewer than
    min_keep would remain. Off for threshold > 0.5 or fewer than 2 candidates."""
    if not applies or threshold > 0.5 or len(c) < 2:
        return
    softmax(c, True)
    pos_last = 0
    for i in range(len(c)):
        if _near(c.p[i], threshold, 1e-4):
            raise Ambiguous(f"xtc: p {c.p[i]!r} at the threshold {threshold!r}")
        if c.p[i] >= threshold:
            pos_last = i
        else:
            break
    if len(c) - pos_last >= min_keep and pos_last > 0:
        c.check_cut(pos_last)
        c.take(range(pos_last, len(c)))


def temp_ext(c: Cands, t: float, delta: float, exponent: float) -> None:
    """llama_sampler_temp_ext_apply: with delta > 0 the temperature is
    ``max(0, t - delta) + 2 delta' * (H / log n) ** exponent`` (H the entropy of the sorted softmax over
    the n current candidates, -inf ones included in n), else t; then temp_impl."""
    if delta > 0:
        lo, hi = max(0.0, t - delta), t + delta
        if len(c) <= 1:
            return
        max_entropy = -math.log(1.0 / len(c))
        softmax(c, True)
        h = -sum(q * math.log(q) for q in c.p if q > 0.0)
        dyn = lo + (hi - lo) * (h / max_entropy) ** exponent
        temp_impl(c, dyn)
    else:
        temp_impl(c, t)


def dynamic_temperature(logits: Sequence[float], t: float, delta: float, exponent: float) -> float:
    """The temperature temp_ext picks for these candidates (all finite) with delta > 0."""
    c = Cands(logits)
    lo, hi = max(0.0, t - delta), t + delta
    softmax(c, True)
    h = -sum(q * math.log(q) for q in c.p if q > 0.0)
    return lo + (hi - lo) * (h / math.log(len(c))) ** exponent


def mirostat_v1(c: Cands, n_vocab: int, tau: float, eta: float, m: int, mu: float) -> None:
    """llama_sampler_mirostat_apply's truncation: sorted softmax; s_hat, the Zipf exponent fitted by least
    squares to log(p_i / p_i+1) against log((i+2)/(i+1)) over the top m; then top-k with
    ``k = ((s_hat - 1) 2^mu / (1 - n_vocab^(1 - s_hat)))^(1 / s_hat)``, at least 1; then softmax."""
    softmax(c, True)
    sum_tb = sum_tt = 0.0
    i = 0
    while i < m - 1 and i < len(c) - 1:
        t_i = math.log((i + 2) / (i + 1))
        b_i = math.log(c.p[i] / c.p[i + 1])
        sum_tb += t_i * b_i
        sum_tt += t_i * t_i
        i += 1
    if sum_tt == 0.0:
        raise Undefined("mirostat: s_hat of a single candidate is 0/0")
    s_hat = sum_tb / sum_tt
    eps = s_hat - 1
    try:
        k = (eps * 2.0 ** mu / (1 - float(n_vocab) ** (-eps))) ** (1 / s_hat)
    except (ZeroDivisionError, OverflowError) as e:
        raise Undefined(f"mirostat: k undefined ({e})") from None
    if isinstance(k, complex) or not math.isfinite(k) or k >= 2.0 ** 31:
        # int(k) of a NaN or out of int's range is undefined behaviour in C++ (x86 gives INT_MIN -> 1)
        raise Undefined(f"mirostat: k = {k!r} is out of int's range")
    if k >= 1.0 and abs(k - round(k)) <= 1e-5 * k:
        raise Ambiguous(f"mirostat: k = {k!r} at an integer")
    top_k(c, max(int(k), 1))
    softmax(c, True)


def mirostat_v2(c: Cands, mu: float) -> None:
    """llama_sampler_mirostat_v2_apply's truncation: sorted softmax; cut before the first candidate whose
    surprise -log2 p exceeds mu (keep at least one); then softmax."""
    softmax(c, True)
    k = len(c)
    for i in range(len(c)):
        s = -math.log2(c.p[i]) if c.p[i] > 0 else math.inf
        if _near(s, mu):
            raise Ambiguous(f"mirostat v2: surprise {s!r} at mu={mu!r}")
        if s > mu:
            k = i
            break
    c.take(range(max(k, 1)))
    softmax(c, True)


def mirostat_update(mu: float, p_selected: float, tau: float, eta: float) -> float:
    """Both mirostats after the draw: mu -= eta * (-log2 p(selected) - tau), p after the truncation."""
    return mu - eta * (-math.log2(p_selected) - tau)


# ---------------------------------------------------------------------------------------------- the chain


@dataclass
class Params:
    """The settings common_sampler_init reads (names as ggmlpy's SamplingParams)."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    typical_p: float = 1.0
    top_n_sigma: float = -1.0
    min_keep: int = 0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: Optional[dict] = None
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    samplers: tuple = DEFAULT_SAMPLERS
    extra: dict = field(default_factory=dict)


def chain(logits: Sequence[float], prm: Params, history: Sequence[int] = (), *, n_ctx: Optional[int] = None,
          breakers: Optional[dict] = None, xtc_applies: Optional[bool] = None,
          mu: Optional[float] = None) -> tuple[list[int], list[float]]:
    """common_sampler_init's chain on one row of logits, up to (not including) the draw: the candidates
    the draw picks from and their probabilities.

    logit bias first; then, without mirostat, ``prm.samplers`` in order (temperature is temp_ext), else
    temp and mirostat (no penalties, no DRY: llama.cpp's mirostat chains have none). -1 lengths
    (repeat_last_n, dry_penalty_last_n) mean ``n_ctx`` (ggmlpy's convention; the pinned llama.cpp clamps
    them to 0). ``xtc_applies`` is XTC's coin (default: applies when xtc_probability >= 1).
    ``mu`` is mirostat's state (default 2 tau)."""
    c = Cands(logits)
    if prm.logit_bias:
        logit_bias(c, prm.logit_bias)

    def length(n: int) -> int:
        return (n_ctx if n_ctx is not None else len(history)) if n == -1 else n

    if prm.mirostat:
        temp_impl(c, prm.temperature)
        mu = 2.0 * prm.mirostat_tau if mu is None else mu
        if prm.mirostat == 1:
            mirostat_v1(c, len(logits), prm.mirostat_tau, prm.mirostat_eta, 100, mu)
        else:
            mirostat_v2(c, mu)
        return c.finite()
    for name in prm.samplers:
        if name == "penalties":
            penalties(c, history, length(prm.repeat_last_n), prm.repeat_penalty, prm.frequency_penalty,
                      prm.presence_penalty)
        elif name == "dry":
            dry(c, history, prm.dry_multiplier, prm.dry_base, prm.dry_allowed_length,
                length(prm.dry_penalty_last_n), breakers or {})
        elif name == "top_n_sigma":
            top_n_sigma(c, prm.top_n_sigma)
        elif name == "top_k":
            top_k(c, prm.top_k)
        elif name == "typical_p":
            typical(c, prm.typical_p, prm.min_keep)
        elif name == "top_p":
            top_p(c, prm.top_p, prm.min_keep)
        elif name == "min_p":
            min_p(c, prm.min_p, prm.min_keep)
        elif name == "xtc":
            applies = prm.xtc_probability >= 1.0 if xtc_applies is None else xtc_applies
            if prm.xtc_probability > 0.0:
                xtc(c, applies, prm.xtc_threshold, prm.min_keep)
        elif name == "temperature":
            temp_ext(c, prm.temperature, prm.dynatemp_range, prm.dynatemp_exponent)
        else:
            raise ValueError(f"unknown sampler {name!r}")
    if prm.temperature <= 0.0 and prm.dynatemp_range <= 0.0 and "temperature" not in prm.samplers:
        raise Undefined("temperature 0 without the temperature sampler: llama.cpp draws from the softmax")
    return c.finite()
