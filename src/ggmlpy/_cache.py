"""The one folder ggmlpy writes its own files to, what is in it, and clearing it (``ggmlpy cache``).

ggmlpy writes, on its own account, only caches that it can make again:

* ``synthetic-*.gguf``: the benchmark's built-in models (``ggmlpy bench`` without ``-m``;
  from 0.3 MB for ``tiny`` to 5 GB for the 8B shape in Q4_K_M);
* ``roofline.json``: this machine's measured bandwidth and matmul peak (``ggmlpy bench --roofline``);
* ``kernels.json``: the own CPU kernels' timings against ggml's (``--kernels measure``, the default);
* ``converter/``: llama.cpp's converter and the tokenizers made with it (the test suite);
* ``bench-arch/``: the models of ``bench/architectures.py``.

Every writer asks :func:`cache_dir` for the folder; nothing else computes it. It is, the first that is
set: ``$GGMLPY_CACHE``, ``$XDG_CACHE_HOME/ggmlpy`` (an absolute path, as the XDG base directory
specification requires), ``~/.cache/ggmlpy``. Anything else found there is not ggmlpy's:
:func:`cache_entries` lists it as such and :func:`clear_cache` leaves it alone, so a ``GGMLPY_CACHE``
pointed at a folder with other files in it loses none of them.

This module imports nothing of ggmlpy: ``ggmlpy cache`` lists and clears without loading ggml.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CacheEntry", "cache_dir", "cache_dir_source", "cache_entries", "clear_cache"]


def cache_dir() -> Path:
    """The folder ggmlpy keeps its caches in: ``$GGMLPY_CACHE``, else ``$XDG_CACHE_HOME/ggmlpy``, else
    ``~/.cache/ggmlpy`` (not created here: each writer makes it when it first writes)."""
    env = os.environ.get("GGMLPY_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):              # a relative one is invalid (XDG spec) and ignored
        return Path(xdg) / "ggmlpy"
    return Path.home() / ".cache" / "ggmlpy"


def cache_dir_source() -> str:
    """What chose :func:`cache_dir`: ``"GGMLPY_CACHE"``, ``"XDG_CACHE_HOME"`` or ``"default"``."""
    if os.environ.get("GGMLPY_CACHE"):
        return "GGMLPY_CACHE"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return "XDG_CACHE_HOME" if xdg and os.path.isabs(xdg) else "default"


#: ggmlpy's own entries of the folder: a pattern on the name, whether it is a folder, what it is. A file
#: being written has a temporary name beside it (``ggmlpy._files.replacing``): ``NAME.PID.HEX.tmp``.
_OWN_FILES = r"synthetic-[A-Za-z0-9._-]+\.gguf|roofline\.json|kernels\.json"
_OWN: tuple[tuple[re.Pattern, bool, str], ...] = (
    (re.compile(r"synthetic-[A-Za-z0-9._-]+\.gguf"), False, "built-in benchmark model (ggmlpy bench)"),
    (re.compile(r"roofline\.json"), False, "this machine's bounds (ggmlpy bench --roofline)"),
    (re.compile(r"kernels\.json"), False, "own CPU kernels' timings (--kernels measure)"),
    (re.compile(r"converter"), True, "llama.cpp's converter and tokenizers (tests)"),
    (re.compile(r"bench-arch"), True, "bench/architectures.py's models"),
    (re.compile(rf"(?:{_OWN_FILES})\.\d+\.[0-9a-f]+\.tmp"), False, "unfinished write"),
)


@dataclass(frozen=True)
class CacheEntry:
    """One entry of the cache folder.

    Attributes
    ----------
    path : pathlib.Path
    size : int
        Bytes (a folder: every file under it; links are not followed).
    what : str
        What it is (ggmlpy's), or why it is left alone.
    own : bool
        ggmlpy's own (:func:`clear_cache` removes it).
    """

    path: Path
    size: int
    what: str
    own: bool


def _size(path: Path) -> int:
    try:
        st = path.lstat()
    except OSError:
        return 0
    if not path.is_dir() or path.is_symlink():
        return st.st_size
    total = 0
    for root, _dirs, files in os.walk(path):          # (os.walk does not follow links to folders)
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def _kind(path: Path) -> tuple[bool, str]:
    is_dir = path.is_dir() and not path.is_symlink()
    for pattern, want_dir, what in _OWN:
        if pattern.fullmatch(path.name) and is_dir == want_dir:
            return True, what
    return False, "not ggmlpy's: left alone"


def cache_entries(folder: str | os.PathLike | None = None) -> list[CacheEntry]:
    """What the cache folder holds, by name (none where it does not exist).

    Parameters
    ----------
    folder : path, optional
        Default :func:`cache_dir`.
    """
    folder = Path(folder) if folder is not None else cache_dir()
    try:
        names = sorted(os.listdir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for name in names:
        p = folder / name
        own, what = _kind(p)
        out.append(CacheEntry(p, _size(p), what, own))
    return out


def clear_cache(folder: str | os.PathLike | None = None) -> tuple[int, int]:
    """Remove ggmlpy's own entries of the cache folder (nothing else in it); the folder too if that
    leaves it empty.

    Returns
    -------
    (int, int)
        The entries removed and their bytes.

    Raises
    ------
    OSError
        An entry could not be removed (those before it are gone).
    """
    folder = Path(folder) if folder is not None else cache_dir()
    n = size = 0
    for e in cache_entries(folder):
        if not e.own:
            continue
        if e.path.is_dir() and not e.path.is_symlink():
            shutil.rmtree(e.path)
        else:
            e.path.unlink(missing_ok=True)
        n += 1
        size += e.size
    try:
        folder.rmdir()                  # only if empty
    except OSError:
        pass
    return n, size
