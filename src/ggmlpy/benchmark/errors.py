"""BenchError, the one error class of the harness, importable by both of its processes.

In the driver (``ggmlpy bench``) it is a :class:`ggmlpy.GGMLValueError`, so an
``except ggmlpy.GGMLError`` catches it. The llama.cpp worker (:mod:`.worker`)
imports this folder without ggmlpy, whose ggml must not load next to
llama.cpp's; there the import below fails, and a plain ValueError base is
enough: the worker's errors only travel to the driver as text.
"""

from __future__ import annotations

try:
    from ggmlpy._core import GGMLValueError as _BenchErrorBase
except ImportError:                     # the llama.cpp worker, where ggmlpy is blocked (see worker.py)
    _BenchErrorBase = ValueError        # type: ignore[misc,assignment]

__all__ = ["BenchError", "UnsupportedTest"]


class BenchError(_BenchErrorBase):
    """A bad option value or an engine that cannot run (a :class:`ggmlpy.GGMLError` and a ValueError)."""


class UnsupportedTest(BenchError):
    """A test an engine cannot run at all (llama.cpp's image tests without a usable ``libmtmd``): reported
    as skipped, not as a failure."""
