"""Token sampling and log-probabilities over a vocabulary of logits (numpy only).

This module is the decision logic the model runner applies to one row of
logits: pick the next token (:class:`Sampler`) and, when asked, report the
log-probability of that token and of the most likely alternatives
(:func:`logprobs`). It touches no ggml object.

The sampling pipeline follows Ollama's Go engine (``sample/samplers.go``):

1. ``temperature == 0``: greedy, the arg-max (ties go to the lowest token id).
   Nothing else runs and the random generator is not used.
2. ``top_k`` (when ``0 < top_k < vocab``): keep the ``top_k`` largest logits
   (ties at the boundary go to the lower ids).
3. temperature and softmax over what is left: ``p_i ∝ exp((l_i - l_max) / T)``.
4. ``top_p`` (when ``< 1``): keep the smallest set of most likely tokens whose
   probability mass is ``>= top_p`` (mass measured after step 2's
   renormalisation).
5. ``min_p`` (when ``> 0``): drop tokens with ``p_i < min_p * p_max``.
6. a weighted draw among the survivors with the sampler's own
   :class:`numpy.random.Generator`.

Because temperature runs *before* ``top_p`` and ``min_p``, and ``top_k`` runs
before the softmax, the set of tokens that can be drawn depends on the
temperature and on ``top_k``; see the tests for constructed examples.

Differences from Ollama, all deliberate:

* ``top_p`` keeps the smallest prefix with mass ``>= top_p``; Ollama's loop
  stops at the first prefix with mass ``> top_p``, which keeps one more token
  when the mass hits ``top_p`` exactly.
* The weights ``exp((l - l_max) / T)`` are computed in the logits' precision
  (float32 for float32 logits, as Ollama does) but summed in float64, and the
  draw uses numpy's PCG64 generator, not Go's PCG: a seed reproduces ggmlpy's
  own results, not Ollama's.
* Invalid parameters raise :class:`ggmlpy.GGMLValueError` (a ValueError) instead of being clamped.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import numpy as np

from ggmlpy._core import GGMLTypeError, GGMLValueError
from ggmlpy.defaults import DEFAULTS

__all__ = [
    "MAX_TOP_LOGPROBS",
    "Logprobs",
    "Sampler",
    "SamplingParams",
    "TokenLogprob",
    "log_softmax",
    "logprobs",
    "sampling_params",
]

#: Largest accepted :attr:`SamplingParams.top_logprobs` (the OpenAI/Ollama limit).
MAX_TOP_LOGPROBS = 20


def _real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise GGMLValueError(f"{name} must be a real number, got {value!r}")
    out = float(value)
    if not math.isfinite(out):
        raise GGMLValueError(f"{name} must be finite, got {value!r}")
    return out


def _integer(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise GGMLValueError(f"{name} must be an integer, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence picks its next token.

    The defaults are :data:`ggmlpy.defaults.DEFAULTS`' (llama.cpp's, llama-cpp-python's and Ollama's:
    temperature 0.8, top-k 40, top-p 0.95, min-p 0.05, a fresh seed), the same as the keyword arguments
    of :meth:`Runner.generate <ggmlpy.runner.Runner.generate>` and ``ggmlpy run``'s options.
    ``SamplingParams(temperature=0)`` is greedy decoding.

    Parameters
    ----------
    temperature : float
        ``0`` is greedy decoding: the arg-max, ties to the lowest token id, and
        every other field is ignored. Otherwise the logits are divided by it
        before the softmax. Must be finite and ``>= 0``. Default 0.8.
    top_k : int
        Keep only the ``top_k`` most likely tokens; ``0`` or negative turns it off.
        Default 40.
    top_p : float
        Nucleus sampling: keep the smallest set of most likely tokens whose mass
        is ``>= top_p``. In ``(0, 1]``; ``1`` turns it off. Default 0.95.
    min_p : float
        Drop tokens whose probability is below ``min_p`` times the largest one.
        In ``[0, 1]``; ``0`` turns it off. Default 0.05.
    seed : int or None
        Seed of the sampler's random generator (``>= 0``); ``None`` (the default)
        draws fresh entropy from the OS, so results are not reproducible.
    logprobs : bool
        Whether the runner should report the chosen token's log-probability.
    top_logprobs : int
        How many most likely alternatives to report with it, ``0`` to
        :data:`MAX_TOP_LOGPROBS`. Applied by the runner; this class only
        validates it.

    Raises
    ------
    ValueError
        For any out-of-range or wrongly typed field, naming the field.
    """

    temperature: float = DEFAULTS["temperature"]
    top_k: int = DEFAULTS["top_k"]
    top_p: float = DEFAULTS["top_p"]
    min_p: float = DEFAULTS["min_p"]
    seed: int | None = DEFAULTS["seed"]
    logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        temperature = _real("temperature", self.temperature)
        if temperature < 0:
            raise GGMLValueError(f"temperature must be >= 0, got {self.temperature!r}")
        top_k = _integer("top_k", self.top_k)
        top_p = _real("top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise GGMLValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        min_p = _real("min_p", self.min_p)
        if not 0.0 <= min_p <= 1.0:
            raise GGMLValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        seed = self.seed
        if seed is not None:
            seed = _integer("seed", seed)
            if seed < 0:
                raise GGMLValueError(f"seed must be >= 0 (None for a random seed), got {seed}")
        if not isinstance(self.logprobs, (bool, np.bool_)):
            raise GGMLValueError(f"logprobs must be a bool, got {self.logprobs!r}")
        top_logprobs = _integer("top_logprobs", self.top_logprobs)
        if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise GGMLValueError(
                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}"
            )
        # Normalise numpy scalars and ints-for-floats to plain Python types.
        object.__setattr__(self, "temperature", temperature)
        object.__setattr__(self, "top_k", top_k)
        object.__setattr__(self, "top_p", top_p)
        object.__setattr__(self, "min_p", min_p)
        object.__setattr__(self, "seed", seed)
        object.__setattr__(self, "logprobs", bool(self.logprobs))
        object.__setattr__(self, "top_logprobs", top_logprobs)

    @property
    def greedy(self) -> bool:
        """True when sampling is the plain arg-max (``temperature == 0``)."""
        return self.temperature == 0.0


def sampling_params(where: str, sampling: SamplingParams | None = None, **settings) -> SamplingParams:
    """A request's :class:`SamplingParams`: ``sampling``, or the keyword ``settings`` that are not None over
    the defaults (``Runner.generate(..., temperature=0.2)``); both together is an error.

    Raises
    ------
    GGMLValueError
        ``sampling`` and a setting given together (the message names both), or a setting out of range.
    GGMLTypeError
        ``sampling`` is not a SamplingParams.

    Examples
    --------
    >>> sampling_params("generate", temperature=0, seed=1).greedy
    True
    >>> sampling_params("generate", SamplingParams(top_k=5)).top_k
    5
    """
    given = {k: v for k, v in settings.items() if v is not None}
    if sampling is None:
        return SamplingParams(**given)
    if not isinstance(sampling, SamplingParams):
        raise GGMLTypeError(f"{where}: sampling must be a SamplingParams, got {type(sampling).__name__}")
    if given:
        names = ", ".join(f"{k}=" for k in given)
        raise GGMLValueError(f"{where}: sampling= and {names} given together: put every setting in one place, "
                             f"SamplingParams({names.replace('=, ', '=..., ')}...) or the keywords alone")
    return sampling


# --------------------------------------------------------------------------- helpers


def _as_logits(logits: object) -> np.ndarray:
    x = np.asarray(logits)
    if x.ndim != 1:
        raise GGMLValueError(f"logits must be 1-D (one row over the vocabulary), got shape {x.shape}")
    if x.size == 0:
        raise GGMLValueError("logits are empty: no token to choose from")
    if x.dtype.kind != "f":
        if x.dtype.kind in "iub":
            x = x.astype(np.float64)
        else:
            raise GGMLValueError(f"logits must be floating point, got dtype {x.dtype}")
    return x


def _bad_logits(x: np.ndarray) -> GGMLValueError:
    n_nan = int(np.count_nonzero(np.isnan(x)))
    n_pos = int(np.count_nonzero(np.isposinf(x)))
    if n_nan or n_pos:
        parts = []
        if n_nan:
            parts.append(f"{n_nan} NaN")
        if n_pos:
            parts.append(f"{n_pos} +inf")
        first = int(np.flatnonzero(np.isnan(x) | np.isposinf(x))[0])
        return GGMLValueError(
            f"logits contain {' and '.join(parts)} value(s) (first at token {first}) "
            f"out of {x.size}; check the model output"
        )
    return GGMLValueError(f"all {x.size} logits are -inf: every token is masked")


def _argmax_checked(x: np.ndarray) -> int:
    """Index of the largest logit; ValueError for NaN, +inf or all -inf.

    ``np.argmax`` returns the first NaN when there is one, so a single pass
    both finds the maximum and detects every invalid case.
    """
    best = int(np.argmax(x))
    if not math.isfinite(float(x[best])):
        raise _bad_logits(x)
    return best


def _top_ids(x: np.ndarray, k: int) -> np.ndarray:
    """Ids of the ``k`` largest entries of ``x``, descending, ties by lower id.

    ``x`` must hold no NaN. O(n) selection plus an O(k log k) sort.
    """
    n = x.size
    if k >= n:
        return np.argsort(-x, kind="stable")
    # numpy's introselect slows down ~10x on arrays dominated by one repeated
    # value, which is what masking many tokens with -inf produces: select among
    # the finite entries only.
    finite = x > -np.inf
    n_finite = int(np.count_nonzero(finite))
    if n_finite < n:
        fid = np.flatnonzero(finite)
        if k >= n_finite:
            head = fid[np.argsort(-x[fid], kind="stable")]
            return np.concatenate((head, np.flatnonzero(~finite)[: k - n_finite]))
        return fid[_top_ids(x[fid], k)]
    kth = np.partition(x, n - k)[n - k]  # the k-th largest value
    above = np.flatnonzero(x > kth)
    tied = np.flatnonzero(x == kth)[: k - above.size]
    ids = np.concatenate((above, tied))
    # Both parts are in ascending id order, so a stable sort keeps ties by id.
    return ids[np.argsort(-x[ids], kind="stable")]


# --------------------------------------------------------------------------- sampler


class Sampler:
    """Picks tokens from logits according to :class:`SamplingParams`.

    Each sampler owns a :class:`numpy.random.Generator` seeded from
    ``params.seed``, so two samplers with the same seed fed the same logits
    produce the same tokens, and one sequence's draws never disturb another's.

    Parameters
    ----------
    params : SamplingParams, optional
        Default ``SamplingParams()`` (:data:`ggmlpy.defaults.DEFAULTS`; ``temperature=0`` is greedy).
    """

    def __init__(self, params: SamplingParams | None = None) -> None:
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise GGMLTypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        self.params = params
        self._rng = np.random.default_rng(params.seed)

    def __repr__(self) -> str:
        return f"Sampler({self.params!r})"

    def sample(self, logits: np.ndarray) -> int:
        """Choose the next token.

        Parameters
        ----------
        logits : numpy.ndarray
            1-D logits over the vocabulary (float32 from the model; any float
            dtype works). ``-inf`` marks a masked token; at least one entry
            must be finite.

        Returns
        -------
        int
            The token id.

        Raises
        ------
        ValueError
            If the logits are not 1-D, are empty, contain NaN or ``+inf``, or
            are all ``-inf``.
        """
        x = _as_logits(logits)
        best = _argmax_checked(x)
        p = self.params
        if p.temperature == 0.0:
            return best
        n = x.size
        # Weights exp((l - l_max) / T): the best token weighs exactly 1 and -inf
        # logits weigh 0. exp runs in float32 for float32 logits (float64 exp is
        # ~10x slower and adds nothing to a draw); sums are taken in float64.
        dt = np.float32 if x.dtype.itemsize <= 4 else np.float64
        top = dt(x[best])
        t = dt(max(p.temperature, 1e-30))  # below that everything is greedy anyway

        def weights(values: np.ndarray) -> np.ndarray:
            with np.errstate(over="ignore", under="ignore", divide="ignore"):
                return np.exp((values.astype(dt, copy=False) - top) / t)

        # ids: candidate token ids for the entries of w; None means w covers the
        # whole vocabulary in id order.
        ids: np.ndarray | None
        if 0 < p.top_k < n:
            ids = _top_ids(x, p.top_k)  # sorted by probability, descending
            w = weights(x[ids])
            total = float(w.sum(dtype=np.float64))
        else:
            ids, xs = None, x
            masked = x == -np.inf
            if masked.any():  # skip masked tokens altogether
                ids = np.flatnonzero(~masked)
                xs = x[ids]
            w = weights(xs)
            total = float(w.sum(dtype=np.float64))
            if p.top_p < 1.0:
                # Only the head of the sorted order matters for top_p. Tokens
                # lighter than eps weigh less than (1 - top_p) * total / 2 all
                # together, so the heavier ones hold the cut-off: sort only them.
                # (They all outweigh the rest, so their order is the head of the
                # full order; flatnonzero + stable sort keeps ties by id.)
                eps = 0.5 * (1.0 - p.top_p) * total / w.size
                loc = np.flatnonzero(w >= eps)
                loc = loc[np.argsort(-xs[loc], kind="stable")]
                ids = loc if ids is None else ids[loc]
                w = w[loc]

        if p.top_p < 1.0:
            cum = np.cumsum(w, dtype=np.float64)
            cut = int(np.searchsorted(cum, p.top_p * total, side="left")) + 1
            if cut < w.size:
                w = w[:cut]
                ids = ids[:cut] if ids is not None else None

        if p.min_p > 0.0:
            # p_i >= min_p * p_max  <=>  w_i >= min_p * w_max, and w_max == 1.
            keep = w >= p.min_p
            if ids is None:
                ids = np.flatnonzero(keep)
                w = w[ids]
            else:
                ids, w = ids[keep], w[keep]

        cum = np.cumsum(w, dtype=np.float64)
        r = self._rng.random() * float(cum[-1])
        # First index whose cumulative weight exceeds r: token i is chosen with
        # probability w_i / sum(w); zero-weight tokens are never chosen.
        i = min(int(np.searchsorted(cum, r, side="right")), cum.size - 1)
        return int(ids[i]) if ids is not None else i


# --------------------------------------------------------------------------- logprobs


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Numerically stable log-softmax of 1-D logits, computed in float64.

    ``-inf`` logits give ``-inf``; NaN, ``+inf`` or all ``-inf`` raise
    :class:`ValueError`.

    Parameters
    ----------
    logits : numpy.ndarray
        1-D logits over the vocabulary.

    Returns
    -------
    numpy.ndarray
        float64 log-probabilities, same length as ``logits``.
    """
    x = _as_logits(logits)
    best = _argmax_checked(x)
    shifted = x.astype(np.float64) - float(x[best])
    with np.errstate(under="ignore"):
        lse = math.log(float(np.exp(shifted).sum()))
    return shifted - lse


@dataclass
class TokenLogprob:
    """One token and its log-probability."""

    token: int
    logprob: float


@dataclass
class Logprobs:
    """The chosen token's log-probability and the most likely alternatives.

    ``top`` is sorted by descending log-probability, ties by lower token id.
    """

    token: int
    logprob: float
    top: list[TokenLogprob] = field(default_factory=list)


def logprobs(logits: np.ndarray, token: int, top_n: int = 0) -> Logprobs:
    """Log-probability of ``token`` and the ``top_n`` most likely tokens.

    As in Ollama (``runner/common/logprob.go``) this is a log-softmax over the
    **full** vocabulary of the raw logits: temperature, ``top_k``, ``top_p``
    and ``min_p`` do not change it.

    Parameters
    ----------
    logits : numpy.ndarray
        1-D logits over the vocabulary.
    token : int
        The token that was chosen, ``0 <= token < len(logits)``.
    top_n : int
        Number of alternatives to list (``>= 0``; more than the vocabulary
        lists all of it).

    Returns
    -------
    Logprobs

    Raises
    ------
    ValueError
        For invalid logits (see :func:`log_softmax`), a token out of range or a
        negative ``top_n``.
    """
    lp = log_softmax(logits)
    token = _integer("token", token)
    if not 0 <= token < lp.size:
        raise GGMLValueError(f"token {token} is out of range for a vocabulary of {lp.size}")
    top_n = _integer("top_n", top_n)
    if top_n < 0:
        raise GGMLValueError(f"top_n must be >= 0, got {top_n}")
    top: list[TokenLogprob] = []
    if top_n:
        ids = _top_ids(lp, min(top_n, lp.size))
        top = [TokenLogprob(int(i), float(lp[i])) for i in ids]
    return Logprobs(token, float(lp[token]), top)
