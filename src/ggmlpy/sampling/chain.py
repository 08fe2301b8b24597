"""llama.cpp's sampler chain over one row of logits, in numpy: :class:`Sampler`.

Each sampler is llama.cpp's (``src/llama-sampler.cpp`` at the pinned commit), in the order
``common_sampler`` builds them: the grammar's mask, the logit bias, then ``SamplingParams.samplers``
(penalties, DRY, top-n-sigma, top-k, typical-p, top-p, min-p, XTC, temperature by default), then the
weighted draw; or, with Mirostat, the logit bias, the temperature and Mirostat's own draw.

The candidates are a pair (``ids``, ``x``): token ids and their float32 logits. ``ids`` is None while
nothing has been cut (``x`` is then the whole row in id order, and no sampler sorts 150k entries
unless it must: top-k selects, top-p sorts only the tokens that can reach the cut). Logits are moved in
float32 as llama.cpp moves them, so a penalty or a bias gives the same value bit for bit and greedy
decoding the same token; probabilities are summed in float64.

Where this differs from llama.cpp, on purpose: greedy's temperature drops the tokens it sets to
``-inf`` (nothing runs after it that would count them); typical-p leaves tokens of probability 0 out
of its entropy (llama.cpp's ``0 * log 0`` is NaN); ties are broken by the lower token id where
llama.cpp's partial sort leaves them unspecified; ``repeat_last_n=-1`` and ``dry_penalty_last_n=-1``
mean the context size (Ollama's and older llama.cpp's meaning; this llama.cpp turns them off); the
random generator is numpy's PCG64, so a seed reproduces ggmlpy's draws, not llama.cpp's.
"""

from __future__ import annotations

import math
from dataclasses import fields
from types import SimpleNamespace
from typing import Optional

import numpy as np

from ggmlpy._core import GGMLTypeError, GGMLValueError

from .dry import DryBreakers, dry_penalties
from .logprobs import _argmax_checked, _as_logits, _top_ids
from .params import SamplingParams

__all__ = ["Sampler", "sample_batch"]

_F32 = np.float32


def _softmax(x: np.ndarray) -> np.ndarray:
    """Probabilities of logits ``x`` (``x`` holds no NaN and at least one finite value): exp in float32
    (float64's is ~10x slower over a vocabulary and adds nothing to a draw), the sum in float64."""
    with np.errstate(under="ignore", over="ignore"):
        w = np.exp(x - x.max(), dtype=np.float32)
    return w / w.sum(dtype=np.float64)


def _order_desc(x: np.ndarray) -> np.ndarray:
    """Positions of ``x`` by decreasing value, ties in position order."""
    return np.argsort(-x, kind="stable")


class _Cands:
    """The candidates between samplers: ``ids`` (None: the whole row in id order), ``x`` float32 logits,
    ``sorted`` (by decreasing logit)."""

    __slots__ = ("ids", "x", "sorted")

    def __init__(self, x: np.ndarray) -> None:
        self.ids: Optional[np.ndarray] = None
        self.x = x
        self.sorted = False

    @property
    def size(self) -> int:
        return self.x.size

    def take(self, pos: np.ndarray, sorted_: bool) -> None:
        self.ids = pos.astype(np.int64, copy=False) if self.ids is None else self.ids[pos]
        self.x = self.x[pos]
        self.sorted = sorted_

    def sort(self) -> None:
        if not self.sorted:
            self.take(_order_desc(self.x), True)

    def token_ids(self) -> np.ndarray:
        return np.arange(self.x.size, dtype=np.int64) if self.ids is None else self.ids

    def positions_of(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(positions in the candidates, index into ``tokens``) of the ``tokens`` present."""
        if self.ids is None:
            ok = np.flatnonzero(tokens < self.x.size)
            return tokens[ok], ok
        order = np.argsort(tokens)
        st = tokens[order]
        at = np.searchsorted(st, self.ids)
        at = np.minimum(at, st.size - 1)
        hit = np.flatnonzero(st[at] == self.ids)
        return hit, order[at[hit]]


class Sampler:
    """Picks one sequence's tokens from its logits with llama.cpp's sampler chain (:class:`SamplingParams`).

    A sampler is a sequence's state: its random generator (seeded from ``params.seed``, so two samplers
    with the same seed fed the same logits and tokens draw the same), the tokens it has seen (the
    penalties, DRY and the logits processor read them; :meth:`accept` the prompt's, as llama-server
    does), Mirostat's running ``mu``, and the grammar's matcher.

    Parameters
    ----------
    params : SamplingParams, optional
        Default ``SamplingParams()``.
    tokenizer : ggmlpy.tokenizer.Tokenizer, optional
        The vocabulary, for DRY's sequence breakers (strings found in tokens' text); without it DRY
        has no breakers.
    n_ctx : int, optional
        The context size: what ``repeat_last_n=-1`` and ``dry_penalty_last_n=-1`` mean (without it, the
        whole history).
    grammar : optional
        A matcher with ``apply(logits)`` (disallowed tokens to ``-inf`` in place) and ``accept(token)``
        (:class:`ggmlpy.sampling.grammar.GrammarMatcher`): applied before every other sampler.
    """

    def __init__(self, params: Optional[SamplingParams] = None, *, tokenizer=None, n_ctx: Optional[int] = None,
                 grammar=None) -> None:
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise GGMLTypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        self.params = params
        # the chain reads its settings as llama.cpp's floats: 2.6e-268 is 0 (off), 1 - 1e-9 is 1
        self._p = SimpleNamespace(**{f.name: float(np.float32(v)) if type(v) is float else v
                                     for f in fields(params) for v in (getattr(params, f.name),)})
        self.grammar = grammar
        self._rng = np.random.default_rng(params.seed)
        self._history: list[int] = []
        self.mu = 2.0 * self._p.mirostat_tau      # Mirostat's running target (llama.cpp's reset value)
        # adaptive-p: the draw itself when named in samplers; its running average of chosen probabilities
        self._adaptive = "adaptive_p" in params.samplers and params.mirostat == 0
        decay = self._p.adaptive_decay
        self._ada_sum = self._p.adaptive_target / (1.0 - decay)      # llama.cpp's reset values
        self._ada_weight = 1.0 / (1.0 - decay)
        p = params
        self._bias_ids = np.array([t for t, _ in p.logit_bias], dtype=np.int64)
        self._bias = np.array([b for _, b in p.logit_bias], dtype=_F32)

        def window(n: int) -> Optional[int]:
            return None if n < 0 and n_ctx is None else (n_ctx if n < 0 else n)

        self._pen_n = window(p.repeat_last_n)
        self._pen_on = "penalties" in p.samplers and self._pen_n != 0 and not (
            p.repeat_penalty == 1.0 and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0)
        self._dry_n = window(p.dry_penalty_last_n)
        self._dry_on = "dry" in p.samplers and p.dry_multiplier != 0.0 and self._dry_n != 0
        self._dry = DryBreakers.of(tokenizer, p.dry_sequence_breakers) if self._dry_on else None
        typical = p.typical_p < 1.0 and "typical_p" in p.samplers
        xtc = p.xtc_probability > 0.0 and p.xtc_threshold <= 0.5 and "xtc" in p.samplers
        # greedy without running the truncations: none of those left can drop the arg-max
        self._plain_greedy = (p.mirostat == 0 and p.temperature == 0.0 and p.dynatemp_range == 0.0
                              and "temperature" in p.samplers and not typical and not xtc)
        # the arg-max of the raw row: nothing moves a logit (sample() then skips the copy and the chain)
        self._batch_greedy = (self._plain_greedy and not self._pen_on and not self._dry_on and not p.logit_bias
                              and p.logits_processor is None and grammar is None and not self._adaptive)

    def __repr__(self) -> str:
        return f"Sampler({self.params!r})"

    # -- state -------------------------------------------------------------------------------------

    def accept(self, tokens) -> None:
        """Add tokens to the history the penalties, DRY and the logits processor read (a prompt's, in
        order, before generating; :meth:`sample` adds each token it draws). Not the grammar's: the
        grammar constrains what is generated from here on."""
        if isinstance(tokens, (int, np.integer)):
            self._history.append(int(tokens))
        else:
            self._history.extend(int(t) for t in tokens)

    @property
    def history(self) -> list[int]:
        """The tokens accepted so far (a copy)."""
        return list(self._history)

    # -- the chain ---------------------------------------------------------------------------------

    def _prepare(self, logits) -> np.ndarray:
        """The row the chain starts from: a float32 copy, after the logits processor and the grammar."""
        x = _as_logits(logits)
        p = self._p
        x = np.array(x, dtype=_F32, copy=True)
        if p.logits_processor is not None:
            out = p.logits_processor(np.asarray(self._history, dtype=np.int32), x)
            out = np.asarray(out)
            if out.shape != x.shape or out.dtype.kind not in "fiu":
                raise GGMLValueError(f"logits_processor returned {out.dtype} shape {out.shape}; it must return "
                                     f"the logits, shape {x.shape}")
            x = np.array(out, dtype=_F32, copy=True)
        if self.grammar is not None:
            self.grammar.apply(x)
        if self._bias_ids.size:
            ok = self._bias_ids < x.size
            np.add.at(x, self._bias_ids[ok], self._bias[ok])
        _argmax_checked(x)                     # NaN, +inf, or nothing left: a clear error, not a bad draw
        return x

    def _window(self, n: Optional[int]) -> list[int]:
        h = self._history
        return h if n is None or n >= len(h) else h[len(h) - n:]

    def _penalties(self, c: _Cands) -> None:
        win = self._window(self._pen_n)
        if not win:
            return
        p = self._p
        toks, counts = np.unique(np.asarray(win, dtype=np.int64), return_counts=True)
        pos, k = c.positions_of(toks)
        if not pos.size:
            return
        v = c.x[pos]
        v = np.where(v <= 0, v * _F32(p.repeat_penalty), v / _F32(p.repeat_penalty)).astype(_F32)
        v -= counts[k].astype(_F32) * _F32(p.frequency_penalty) + _F32(p.presence_penalty)
        c.x[pos] = v                        # x is the chain's own copy (the row was copied in _prepare)
        c.sorted = False

    def _dry_apply(self, c: _Cands) -> None:
        p = self._p
        toks, pen = dry_penalties(self._window(self._dry_n), self._dry, p.dry_multiplier, p.dry_base,
                                  p.dry_allowed_length)
        if toks.size:
            pos, k = c.positions_of(toks)
            c.x[pos] -= pen[k]
            c.sorted = False

    def _top_n_sigma(self, c: _Cands) -> None:
        n = self._p.top_n_sigma
        if n <= 0 or c.size <= 1:
            return
        fin = c.x[np.isfinite(c.x)]
        top = float(fin.max())
        std = float(fin.astype(np.float64).std())
        # masked to -inf, not dropped, as llama.cpp: the samplers after it count the whole list (XTC's
        # "at least 2" and min_keep, dynamic temperature's maximum entropy)
        below = c.x < _F32(top - n * std)
        if below.any():
            c.x[below] = -np.inf
            c.sorted = False

    def _top_k(self, c: _Cands, k: int) -> None:
        if k <= 0:
            return
        k = min(k, c.size)
        if c.sorted:
            if k < c.size:
                c.take(np.arange(k), True)
            return
        c.take(_top_ids(c.x, k), True)

    def _typical(self, c: _Cands) -> None:
        p = self._p
        if p.typical_p >= 1.0:
            return
        c.sort()
        prob = _softmax(c.x)
        with np.errstate(divide="ignore"):
            logp = np.log(prob)
        nz = prob > 0
        entropy = -float(np.sum(prob[nz] * logp[nz]))
        shifted = np.abs(-logp - entropy)
        order = np.argsort(shifted, kind="stable")
        cum = np.cumsum(prob[order])
        i = np.arange(order.size)
        ok = (cum > p.typical_p) & ((p.min_keep == 0) | (i >= p.min_keep - 1))
        last = int(np.argmax(ok)) + 1 if ok.any() else order.size
        c.take(order[:last], False)

    def _top_p(self, c: _Cands) -> None:
        p = self._p
        if p.top_p >= 1.0:
            return
        prob = _softmax(c.x)
        if not c.sorted:
            # the head of the order only, as llama.cpp's adaptive partial sort: the 256 most likely,
            # then 4x more until they hold the mass (and min_keep) or are the whole vocabulary
            n, k = c.size, min(256, c.size)
            while True:
                head = _top_ids(c.x, k)
                if k == n or (float(prob[head].sum()) >= p.top_p and k >= p.min_keep):
                    break
                k = min(n, 4 * k)
            c.take(head, True)
            prob = prob[head]
        cum = np.cumsum(prob)
        i = np.arange(cum.size)
        ok = (cum >= p.top_p) & (i + 1 >= p.min_keep)
        if ok.any():
            last = int(np.argmax(ok)) + 1
            if last < c.size:
                c.take(np.arange(last), True)

    def _min_p(self, c: _Cands) -> None:
        p = self._p
        if p.min_p <= 0.0 or not c.size:
            return
        min_logit = _F32(c.x.max()) + _F32(math.log(p.min_p))
        keep = c.x >= min_logit
        n = int(np.count_nonzero(keep))
        if n >= max(p.min_keep, 1):
            if n < c.size:
                c.take(np.flatnonzero(keep), c.sorted)
            return
        c.sort()                                     # too few: the min_keep most likely
        c.take(np.arange(min(max(p.min_keep, 1), c.size)), True)

    def _xtc(self, c: _Cands, rng) -> None:
        p = self._p
        if p.xtc_probability <= 0.0 or p.xtc_threshold > 0.5 or c.size < 2:
            return
        if rng.random() > p.xtc_probability:
            return
        c.sort()
        prob = _softmax(c.x)
        above = np.flatnonzero(prob < p.xtc_threshold)
        n_above = int(above[0]) if above.size else c.size
        pos_last = n_above - 1
        if pos_last > 0 and c.size - pos_last >= p.min_keep:
            c.take(np.arange(pos_last, c.size), True)

    @staticmethod
    def _greedy(c: _Cands) -> None:
        c.take(np.array([int(np.argmax(c.x))]), True)

    def _temperature(self, c: _Cands, plain: bool = False) -> None:
        p = self._p
        if not plain and p.dynatemp_range > 0:
            if c.size <= 1:
                return
            lo, hi = max(0.0, p.temperature - p.dynatemp_range), p.temperature + p.dynatemp_range
            c.sort()
            prob = _softmax(c.x)
            nz = prob > 0
            entropy = -float(np.sum(prob[nz] * np.log(prob[nz])))
            t = lo + (hi - lo) * (entropy / math.log(c.size)) ** p.dynatemp_exponent
        else:
            t = p.temperature
        t32 = _F32(t)                            # llama.cpp's temperature is a float: 1e-300 is 0, greedy
        if t32 <= 0:
            self._greedy(c)
            return
        with np.errstate(over="ignore", under="ignore"):
            y = c.x / t32
        if not math.isfinite(float(y.max())):
            # a tiny temperature overflowed the largest logits: shift by the max first (the same softmax)
            with np.errstate(over="ignore", under="ignore"):
                y = ((c.x.astype(np.float64) - float(c.x.max())) / float(t32)).astype(_F32)
        c.x = y

    def _run(self, x: np.ndarray, rng) -> _Cands:
        """The chain up to the draw (Mirostat: up to its truncation)."""
        c = _Cands(x)
        p = self._p
        if p.mirostat:
            self._temperature(c, plain=True)
            return c
        if self._plain_greedy:
            for name in p.samplers:
                if name == "penalties" and self._pen_on:
                    self._penalties(c)
                elif name == "dry" and self._dry_on:
                    self._dry_apply(c)
            self._greedy(c)
            return c
        for name in p.samplers:
            if name == "penalties":
                if self._pen_on:
                    self._penalties(c)
            elif name == "dry":
                if self._dry_on:
                    self._dry_apply(c)
            elif name == "top_n_sigma":
                self._top_n_sigma(c)
            elif name == "top_k":
                self._top_k(c, p.top_k)
            elif name == "typical_p":
                self._typical(c)
            elif name == "top_p":
                self._top_p(c)
            elif name == "min_p":
                self._min_p(c)
            elif name == "xtc":
                self._xtc(c, rng)
            elif name == "temperature":
                self._temperature(c)
            # "adaptive_p" is the draw: it runs after the chain (sample, distribution)
        return c

    def _adaptive_probs(self, c: _Cands) -> tuple[np.ndarray, np.ndarray]:
        """(the candidates' probabilities, adaptive-p's): each finite logit replaced by a peak at the
        adapted target probability (llama.cpp's shape: 5 - 10 d^2 / (1 + d), d = |p - target| / 0.3)."""
        orig = _softmax(c.x)
        p = self._p
        if p.adaptive_target < 0:
            return orig, orig
        target = min(max(p.adaptive_target, 0.0), 1.0)
        adapted = target if self._ada_weight == 0 else 2.0 * target - self._ada_sum / self._ada_weight
        adapted = min(max(adapted, 0.0), 1.0)
        d = np.abs((orig.astype(_F32) - _F32(adapted)) * _F32(1.0 / 0.3))
        y = np.where(np.isfinite(c.x), _F32(5.0) - _F32(10.0) * d * d / (_F32(1.0) + d), -np.inf).astype(_F32)
        return orig, _softmax(y)

    def _mirostat_cut(self, c: _Cands, n_vocab: int) -> None:
        """Mirostat's truncation at the current ``mu`` (v1: an estimated top-k; v2: surprise <= mu)."""
        p = self._p
        if p.mirostat == 1:
            m = 100
            head = _top_ids(c.x, min(m, c.size)) if not c.sorted else np.arange(min(m, c.size))
            xs = c.x[head].astype(np.float64)
            t = np.log(np.arange(2, xs.size + 1) / np.arange(1, xs.size))     # log((i+2)/(i+1))
            b = xs[:-1] - xs[1:]                                               # log(p_i / p_{i+1})
            s_hat = float(np.sum(t * b) / np.sum(t * t)) if xs.size > 1 else 1.0
            eps = s_hat - 1
            with np.errstate(all="ignore"):
                k = ((eps * 2.0 ** self.mu) / (1 - n_vocab ** (-eps))) ** (1 / s_hat)
            k = int(k) if math.isfinite(k) else n_vocab
            self._top_k(c, max(k, 1))
        else:
            prob = _softmax(c.x)
            keep = np.flatnonzero(prob >= 2.0 ** -self.mu)          # surprise -log2(p) <= mu
            if keep.size == 0:
                keep = np.array([int(np.argmax(c.x))])
            c.take(keep, c.sorted)          # unsorted: a draw needs no order (llama.cpp sorts them all)

    def distribution(self, logits) -> tuple[np.ndarray, np.ndarray]:
        """The candidates the next draw picks from and their probabilities, after the whole chain.

        Nothing changes: the history, Mirostat's ``mu`` and the random generator are as before (XTC's
        coin is tossed on a copy of the generator: the set it returns is the one :meth:`sample`
        would draw from next). Ids are in the chain's final order (most likely first once a sampler
        has sorted them); probabilities are float64 and sum to 1.
        """
        rng = np.random.Generator(np.random.PCG64())
        rng.bit_generator.state = self._rng.bit_generator.state
        x = self._prepare(logits)
        c = self._run(x, rng)
        if self._p.mirostat and c.size > 1:
            self._mirostat_cut(c, x.size)
        if self._adaptive:
            return c.token_ids(), self._adaptive_probs(c)[1]
        return c.token_ids(), _softmax(c.x)

    def sample(self, logits) -> int:
        """Choose the next token, add it to the history (and the grammar's state), and return it.

        Parameters
        ----------
        logits : numpy.ndarray
            1-D logits over the vocabulary (float32 from the model; any float or int dtype). ``-inf``
            marks a masked token; at least one entry must be finite.

        Raises
        ------
        ValueError
            If the logits are not 1-D, are empty, contain NaN or ``+inf``, or are all ``-inf`` (after
            the logits processor, the grammar and the bias: a grammar that allows nothing here).
        """
        if self._batch_greedy:                  # nothing moves a logit: the arg-max of the row itself
            tok = _argmax_checked(_as_logits(logits))
            self._history.append(tok)
            return tok
        x = self._prepare(logits)
        c = self._run(x, self._rng)
        p = self._p
        if p.mirostat and c.size > 1:
            self._mirostat_cut(c, x.size)
        if c.size == 1:                          # greedy, or one token left: no draw
            tok, prob_tok, orig_tok = int(c.token_ids()[0]), 1.0, 1.0
        else:
            orig, prob = self._adaptive_probs(c) if self._adaptive else (None, _softmax(c.x))
            cum = np.cumsum(prob)
            r = self._rng.random() * float(cum[-1])
            # the first index whose cumulative weight exceeds r: token i with probability prob[i]
            i = min(int(np.searchsorted(cum, r, side="right")), cum.size - 1)
            tok, prob_tok = int(c.token_ids()[i]), float(prob[i])
            orig_tok = float(orig[i]) if orig is not None else prob_tok
        if self._adaptive and p.adaptive_target >= 0:
            # the chosen token's probability before the transform joins the moving average
            self._ada_sum = orig_tok + p.adaptive_decay * self._ada_sum
            self._ada_weight = 1.0 + p.adaptive_decay * self._ada_weight
        if p.mirostat:
            # the observed surprise moves mu toward tau (llama.cpp's update, after each draw)
            self.mu -= p.mirostat_eta * (-math.log2(prob_tok) - p.mirostat_tau)
        self._history.append(tok)
        if self.grammar is not None:
            self.grammar.accept(tok)
        return tok


def sample_batch(samplers: list, rows: np.ndarray) -> list:
    """One token for each sampler from its row of ``rows`` (a step's sequences): a list of token ids, or,
    where a sampler failed (bad logits, its logits processor raised), the exception, so one sequence's
    failure ends that sequence only.

    Each row runs its own chain: one numpy pass over the step's block does not pay on a CPU. Measured
    (``bench/sampling.py --batch 8``, 152k vocabulary): the arg-max of an 8-row block costs what 8 row
    arg-maxes cost (0.25 ms; the block's copy when only some rows are greedy makes it 3x slower), and the
    default chain's heavy step, top-k's selection, is a pass over each row either way.
    """
    out: list = []
    for s, row in zip(samplers, rows):
        try:
            out.append(s.sample(row))
        except Exception as e:            # noqa: BLE001 - handed back: it ends that sequence only
            out.append(e)
    return out
