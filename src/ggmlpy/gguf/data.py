"""Reading tensor data in bulk: :func:`open_data` gives a plain unbuffered file or a :class:`MappedFile`
(reads copied from a memory map, llama.cpp's ``mmap`` load mode), with the same file interface; for a
split model's shards, a :class:`ConcatFile` reading them as one."""

from __future__ import annotations

import bisect
import contextlib
import io
import mmap
import os
from collections.abc import Sequence

from ggmlpy._core import GGUFError


class _Positioned(io.RawIOBase):
    """A read-only, seekable stream of ``_size`` bytes whose position is ``_pos``: the seeking both
    readers share (each defines ``readinto``)."""

    _size = 0
    _pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self._checkClosed()
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._size}.get(whence)
        if base is None:
            raise ValueError(f"seek: invalid whence {whence}")
        if base + offset < 0:
            raise ValueError(f"seek: negative position {base + offset}")
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        self._checkClosed()
        return self._pos


class MappedFile(_Positioned):
    """A read-only, seekable file object that reads through a memory map of the file.

    ``read``/``readinto`` copy from the mapping, so the data comes from the
    page cache by page faults rather than by ``read(2)`` calls: llama.cpp's
    ``mmap`` load mode for weights that are copied into their buffers. The
    mapping lives until :meth:`close`.

    Warnings
    --------
    Touching a page past the end of a file that shrank after it was mapped
    kills the process with SIGBUS, which Python cannot catch. The file's size
    is checked before every read (a read past the current end raises
    :class:`GGUFError`), which leaves only a truncation *during* one read's
    copy; read files that another process may rewrite with ``open_data(path,
    mmap=False)``.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__()
        self.name = os.fspath(path)
        self._f = open(self.name, "rb", buffering=0)
        try:
            self._size = os.fstat(self._f.fileno()).st_size
            # mmap refuses an empty file; there is nothing to read from one anyway
            self._mm = mmap.mmap(self._f.fileno(), 0, access=mmap.ACCESS_READ) if self._size else None
        except BaseException:
            self._f.close()
            raise
        self._view = memoryview(self._mm) if self._mm is not None else memoryview(b"")
        self._pos = 0
        if self._mm is not None and hasattr(self._mm, "madvise") and hasattr(mmap, "MADV_SEQUENTIAL"):
            with contextlib.suppress(OSError):       # a hint for readahead, nothing depends on it
                self._mm.madvise(mmap.MADV_SEQUENTIAL)

    def readinto(self, b) -> int:
        self._checkClosed()
        dst = memoryview(b).cast("B")
        n = max(0, min(len(dst), self._size - self._pos))
        if n and os.fstat(self._f.fileno()).st_size < self._pos + n:
            raise GGUFError(f"{self.name}: the file shrank below {self._pos + n} bytes while it was mapped "
                            "(rewritten by another process?); not reading it")
        dst[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n

    def close(self) -> None:
        if not self.closed:
            self._view.release()
            if self._mm is not None:
                self._mm.close()
            self._f.close()
        super().close()


class ConcatFile(_Positioned):
    """Several files read as one, laid end to end (a split model's shards, whose tensor offsets
    :class:`~ggmlpy.gguf.GGUFSplitReader` counts this way): read-only and seekable, each part opened
    with :func:`open_data` (so ``mmap`` reads every part through a memory map). A read that reaches the
    end of a part goes on in the next.
    """

    def __init__(self, paths: Sequence[str | os.PathLike], mmap: bool = False) -> None:
        super().__init__()
        self.name = os.fspath(paths[0]) if paths else ""
        self._parts: list[io.RawIOBase] = []
        self._starts: list[int] = []
        size = 0
        try:
            for p in paths:
                f = open_data(p, mmap=mmap)
                self._parts.append(f)
                self._starts.append(size)
                size += f.seek(0, os.SEEK_END)
                f.seek(0)
        except BaseException:
            for f in self._parts:
                f.close()
            raise
        self._size = size
        self._pos = 0

    def readinto(self, b) -> int:
        self._checkClosed()
        dst = memoryview(b).cast("B")
        done = 0
        while done < len(dst) and self._pos < self._size:
            k = bisect.bisect_right(self._starts, self._pos) - 1
            part = self._parts[k]
            part.seek(self._pos - self._starts[k])
            n = part.readinto(dst[done:])
            if not n:
                break           # the part is shorter than it was (truncated since): a short read
            done += n
            self._pos += n
        return done

    def close(self) -> None:
        if not self.closed:
            for f in self._parts:
                f.close()
        super().close()


def open_data(path: str | os.PathLike | Sequence[str | os.PathLike], mmap: bool = False) -> io.RawIOBase:
    """A binary file object for reading tensor data: a plain unbuffered file, or a :class:`MappedFile`;
    for a list of paths (a split model's ``reader.files``) a :class:`ConcatFile` of them.

    Each offers ``seek``, ``read`` and ``readinto`` and closes with ``with``.
    """
    if not isinstance(path, (str, bytes, os.PathLike)):
        return ConcatFile(list(path), mmap=mmap)
    return MappedFile(path) if mmap else open(os.fspath(path), "rb", buffering=0)
