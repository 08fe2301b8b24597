"""Typed, checked GGUF metadata: :func:`meta_int`, :func:`meta_float`, :func:`meta_str` and the errors that
name the file and the key (:class:`MetadataError`, :class:`MetadataTypeError`, :class:`GGUFKeyError`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ggmlpy._core import GGMLError, GGMLTypeError, GGUFError

from ._types import _is_float, _is_int, _type_name_of


class GGUFKeyError(KeyError, GGMLError):
    """A metadata key or tensor name the file does not have (``reader[key]``, ``tensor_info``...)."""


class MetadataError(GGUFError):
    """A metadata value of a GGUF file is missing, malformed or out of range.

    The message names the file and the key; both are also attributes.

    Attributes
    ----------
    path : str
    key : str
    """

    def __init__(self, path: str, key: str, message: str) -> None:
        super().__init__(f"{path}: metadata {key!r}: {message}" if path else f"metadata {key!r}: {message}")
        self.path = path
        self.key = key


class MetadataTypeError(MetadataError, GGMLTypeError):
    """A metadata value has the wrong type (a string where a number is needed, a float for a count...).

    Both a :class:`MetadataError` (so a ``ValueError``) and a ``TypeError``.
    """


_REQUIRED: Any = object()


def _meta_raw(md: Any, key: str, default: Any, path: str, per_layer: bool) -> Any:
    """The value of ``key``, or ``default`` (``_REQUIRED``: raise). A per-layer array gives its one value."""
    if key not in md:
        if default is _REQUIRED:
            raise MetadataError(path, key, "is missing")
        return default
    v = md[key]
    if isinstance(v, (np.ndarray, list)):
        if not per_layer:
            raise MetadataTypeError(path, key, f"expected a single value, got an array of {len(v)}")
        if len(v) == 0:
            raise MetadataError(path, key, "is an empty array")
        first = v[0]
        # per-layer arrays (llama.cpp allows them for head counts ...) are supported only when uniform
        if any(x != first for x in v[1:]):
            raise MetadataError(path, key, f"per-layer values differ ({_short(v)}); not supported")
        v = first.item() if isinstance(first, np.generic) else first
    return v


def _short(v: Any) -> str:
    items = list(v[:6])
    return "[" + ", ".join(repr(x.item() if isinstance(x, np.generic) else x) for x in items) + \
        (", ...]" if len(v) > 6 else "]")


def meta_int(md: Any, key: str, default: Any = _REQUIRED, *, lo: int | None = None, hi: int | None = None,
             path: str = "", per_layer: bool = False) -> Any:
    """Integer metadata value ``md[key]``, checked.

    Parameters
    ----------
    md : mapping
        Metadata as :attr:`GGUFReader.metadata` holds it.
    key : str
    default
        Returned when the key is absent (unchecked); without it an absent key raises.
    lo, hi : int, optional
        Inclusive bounds.
    path : str
        The file, for the message.
    per_layer : bool
        Accept an array of identical integers (one per layer) and return its value.

    Raises
    ------
    MetadataError
        Missing, out of ``[lo, hi]``, or a per-layer array whose values differ.
    MetadataTypeError
        Not an integer (bools, floats and strings are refused, not converted).
    """
    if key not in md and default is not _REQUIRED:
        return default
    v = _meta_raw(md, key, default, path, per_layer)
    if not _is_int(v):
        raise MetadataTypeError(path, key, f"expected an integer, got {_type_name_of(v)} {v!r:.80}")
    v = int(v)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise MetadataError(path, key, f"{v} is out of range [{lo if lo is not None else '-inf'}, "
                                       f"{hi if hi is not None else 'inf'}]")
    return v


def meta_float(md: Any, key: str, default: Any = _REQUIRED, *, lo: float | None = None, hi: float | None = None,
               lo_open: bool = False, path: str = "", per_layer: bool = False) -> Any:
    """Finite real metadata value ``md[key]`` (integers are accepted), checked.

    As :func:`meta_int`; NaN and infinities are always refused, ``lo_open``
    makes the lower bound exclusive (``lo=0, lo_open=True``: strictly positive).
    """
    if key not in md and default is not _REQUIRED:
        return default
    v = _meta_raw(md, key, default, path, per_layer)
    if not (_is_int(v) or _is_float(v)):
        raise MetadataTypeError(path, key, f"expected a number, got {_type_name_of(v)} {v!r:.80}")
    v = float(v)
    if not np.isfinite(v):
        raise MetadataError(path, key, f"{v} is not a finite number")
    if lo is not None and (v <= lo if lo_open else v < lo) or hi is not None and v > hi:
        raise MetadataError(path, key, f"{v:g} is out of range {'(' if lo_open else '['}"
                                       f"{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]")
    return v


def meta_str(md: Any, key: str, default: Any = _REQUIRED, *, path: str = "") -> Any:
    """String metadata value ``md[key]``; :class:`MetadataTypeError` if it is not a string."""
    if key not in md and default is not _REQUIRED:
        return default
    v = _meta_raw(md, key, default, path, False)
    if not isinstance(v, str):
        raise MetadataTypeError(path, key, f"expected a string, got {_type_name_of(v)} {v!r:.80}")
    return v
