"""Log-probabilities over a row of logits (:func:`logprobs`), and the checks every sampler makes of a row."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ggmlpy._core import GGMLValueError

from .params import _integer

__all__ = ["Logprobs", "TokenLogprob", "log_softmax", "logprobs"]



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
    if n >= 8192 and k * 64 <= n:
        # a threshold from a strided sample, then the selection among the few entries above it: one
        # comparison pass over the row instead of introselect's copy and partition (~4x faster at 152k)
        sample = x[:: n // 4096]
        r = min(sample.size, 4 * (k * sample.size // n + 1) + 8)      # ~4x more expected above than k
        guess = np.partition(sample, sample.size - r)[sample.size - r]
        if guess > -np.inf:
            cand = np.flatnonzero(x >= guess)
            if k <= cand.size <= n // 2:                   # else ties at the guess: the plain way
                return cand[_top_ids(x[cand], k)]        # cand ascends: ties still go to the lower id
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
