"""Checked reading of the ``tokenizer.ggml.*`` metadata: each key the tokenizer reads, its type, length
and range, or a :class:`TokenizerError` that names the key.

The values come from a GGUF file (:attr:`~ggmlpy.gguf.GGUFReader.metadata`: str, int, float, bool,
1-D numpy arrays, lists of str) or from a dict a caller made, which may hold anything; both are held
to the types llama.cpp reads (a token id is an unsigned integer, a flag a bool, scores float32
numbers) with no conversion that could hide a wrong type (``bool("false")``, ``int(1.7)``).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np

from ._common import _MAX_TOKEN, TokenizerError, TokenType

_log = logging.getLogger("ggmlpy")
_N_TYPES = max(TokenType) + 1


def _bad(source: str, key: str, what: str) -> TokenizerError:
    e = TokenizerError(f"{source}: {key} {what}")
    e.key = key
    return e


def _kind(v: Any) -> str:
    if isinstance(v, np.ndarray):
        return f"a numpy array of {v.dtype}" + (f" with shape {v.shape}" if v.ndim != 1 else "")
    return f"{type(v).__name__} {v!r:.60}"


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _sequence(md: dict, key: str, source: str, what: str) -> Any:
    """The array at ``key`` as a list or a 1-D numpy array (None when absent)."""
    v = md.get(key)
    if v is None:
        return None
    if isinstance(v, np.ndarray):
        if v.ndim != 1:
            raise _bad(source, key, f"must be an array of {what}, not {_kind(v)}")
        return v
    if isinstance(v, (list, tuple)):
        return v
    raise _bad(source, key, f"must be an array of {what}, not {_kind(v)}")


def _check_length(v: Any, key: str, n: int, source: str) -> None:
    if len(v) != n:
        raise _bad(source, key, f"has {len(v)} entries for {n} tokens")


def meta_str(md: dict, key: str, source: str) -> str | None:
    """A string key (None when absent)."""
    v = md.get(key)
    if v is not None and not isinstance(v, str):
        raise _bad(source, key, f"must be a string, not {_kind(v)}")
    return v


def meta_bool(md: dict, key: str, source: str, default: bool) -> bool:
    """A flag: GGUF's BOOL (a string, a number or an array is refused, not read as true)."""
    v = md.get(key)
    if v is None:
        return default
    if not isinstance(v, (bool, np.bool_)):
        raise _bad(source, key, f"must be a bool, not {_kind(v)}")
    return bool(v)


def meta_id(md: dict, key: str, n: int, source: str) -> int | None:
    """A special token id (None when absent). An id past the vocabulary is dropped with a warning, as
    llama.cpp does ("bad special token", the type's default kept) and as the model loader does; a
    value that is no unsigned integer is refused (llama.cpp refuses a key of the wrong type)."""
    v = md.get(key)
    if v is None:
        return None
    if not _is_int(v):
        raise _bad(source, key, f"must be an unsigned integer token id, not {_kind(v)}")
    v = int(v)
    if v < 0:
        raise _bad(source, key, f"= {v} is negative; token ids are unsigned")
    if v >= n:
        _log.warning("%s: %s = %d is outside the vocabulary of %d; ignored", source, key, v, n)
        return None
    return v


def _strings(md: dict, key: str, source: str, missing: str) -> list:
    """``key``'s value as a list of strings (a numpy string or object array taken as its list)."""
    v = md.get(key)
    if v is None:
        raise _bad(source, key, missing)
    if isinstance(v, np.ndarray) and v.ndim == 1 and v.dtype.kind in "UO":
        v = v.tolist()
    if not isinstance(v, (list, tuple)):
        raise _bad(source, key, f"must be an array of strings, not {_kind(v)}")
    for i, t in enumerate(v):
        if not isinstance(t, str):
            raise _bad(source, key, f"must be an array of strings; entry {i} is {_kind(t)}")
    return list(v)


def meta_tokens(md: dict, source: str) -> list[str]:
    """``tokenizer.ggml.tokens``: a non-empty array of strings, each at most ``_MAX_TOKEN`` characters
    and with a UTF-8 form (no lone surrogate: a dict may hold one, a file cannot)."""
    key = "tokenizer.ggml.tokens"
    v = _strings(md, key, source, "is missing")
    if not v:
        raise _bad(source, key, "is empty")
    longest = max(map(len, v))
    if longest > _MAX_TOKEN:
        i = next(i for i, t in enumerate(v) if len(t) == longest)
        raise _bad(source, key, f"entry {i} is {longest} characters long; tokens of more than {_MAX_TOKEN} "
                                f"are refused (the longest of any vocabulary llama.cpp ships has 512)")
    try:
        "".join(v).encode("utf-8")
    except UnicodeEncodeError:
        i = next(i for i, t in enumerate(v) if not _encodable(t))
        raise _bad(source, key, f"entry {i} ({v[i]!r:.60}) has a lone surrogate; it has no UTF-8 form") from None
    return v


def _encodable(t: str) -> bool:
    try:
        t.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def meta_scores(md: dict, n: int, source: str) -> np.ndarray | None:
    """``tokenizer.ggml.scores``: ``n`` finite float32 numbers (None when absent)."""
    key = "tokenizer.ggml.scores"
    v = _sequence(md, key, source, "numbers")
    if v is None:
        return None
    _check_length(v, key, n, source)
    if isinstance(v, np.ndarray):
        if v.dtype.kind not in "iuf":
            raise _bad(source, key, f"must be an array of numbers, not {_kind(v)}")
    else:
        for i, x in enumerate(v):
            if not (_is_int(x) or isinstance(x, (float, np.floating))):
                raise _bad(source, key, f"must be an array of numbers; entry {i} is {_kind(x)}")
    try:
        with np.errstate(over="ignore", invalid="ignore"):
            s = np.asarray(v, dtype=np.float64).astype(np.float32)
    except (OverflowError, ValueError, TypeError):      # an int beyond any float
        s = None
    if s is None or not np.isfinite(s).all():
        i = next(i for i, x in enumerate(v) if not _finite32(x))
        raise _bad(source, key, f"entry {i} is {v[i]!r:.40}, not a finite float32 number")
    return s


def _finite32(x: Any) -> bool:
    try:
        with np.errstate(over="ignore"):
            return bool(math.isfinite(float(np.float32(float(x)))))
    except (OverflowError, ValueError, TypeError):
        return False


def meta_token_types(md: dict, n: int, source: str) -> list[int] | None:
    """``tokenizer.ggml.token_type``: ``n`` integers that are :class:`TokenType` values (None when
    absent). llama.cpp reads any other value as UNDEFINED; no converter writes one, so it is refused as
    the sign of a damaged file."""
    key = "tokenizer.ggml.token_type"
    v = _sequence(md, key, source, "integer token types")
    if v is None:
        return None
    _check_length(v, key, n, source)
    if isinstance(v, np.ndarray):
        if v.dtype.kind not in "iu":
            raise _bad(source, key, f"must be an array of integer token types, not {_kind(v)}")
        out = v.tolist()
    else:
        out = list(v)
    for i, x in enumerate(out):
        if not _is_int(x) or not 0 <= x < _N_TYPES:
            what = f"{x}" if _is_int(x) else _kind(x)
            raise _bad(source, key, f"entry {i} is {what}; token types are integers 0..{_N_TYPES - 1} "
                                    f"({', '.join(t.name for t in TokenType)})")
    return [int(x) for x in out]


def meta_merges(md: dict, source: str) -> list[str]:
    """``tokenizer.ggml.merges`` (BPE): strings ``"<left> <right>"``, the space after the first
    character (as llama.cpp splits them)."""
    key = "tokenizer.ggml.merges"
    v = _strings(md, key, source, "is missing (a BPE vocabulary needs its merges)")
    for i, m in enumerate(v):
        if m.find(" ", 1) < 0:
            raise _bad(source, key, f"entry {i} ({m!r:.60}) is not two tokens separated by a space")
    return v


def meta_bytes(md: dict, key: str, source: str) -> bytes | None:
    """A byte array (GGUF's UINT8 or INT8 array; bytes in a dict), None when absent or empty."""
    v = md.get(key)
    if v is None:
        return None
    if isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v) or None
    if isinstance(v, np.ndarray):
        if v.ndim != 1 or v.dtype.kind not in "iu":
            raise _bad(source, key, f"must be an array of bytes, not {_kind(v)}")
        if v.dtype.itemsize == 1:
            return v.tobytes() or None
        if v.size and (int(v.min()) < 0 or int(v.max()) > 255):
            raise _bad(source, key, "must be an array of bytes; it holds values outside 0..255")
        return v.astype(np.uint8).tobytes() or None
    if isinstance(v, (list, tuple)):
        for i, x in enumerate(v):
            if not _is_int(x) or not 0 <= x <= 255:
                raise _bad(source, key, f"must be an array of bytes; entry {i} is {_kind(x)}")
        return bytes(v) or None
    raise _bad(source, key, f"must be an array of bytes, not {_kind(v)}")
