"""Split GGUF models: one model in several files, as llama.cpp's ``gguf-split`` writes them and its loader
reads them.

A split set is ``PREFIX-00001-of-0000N.gguf`` ... ``PREFIX-0000N-of-0000N.gguf``. Each shard is a complete
GGUF file holding some of the tensors; the first holds every metadata key of the model, the others only
the three ``split.*`` keys, which every shard has:

* ``split.no`` (UINT16): the shard's index, from 0;
* ``split.count`` (UINT16): how many shards;
* ``split.tensors.count`` (INT32): how many tensors in all.

:func:`open_reader` opens a model file: a plain file as a :class:`~ggmlpy.gguf.GGUFReader`, the first
shard of a set as a :class:`GGUFSplitReader` over every shard (what llama.cpp loads when given the first
one). :class:`~ggmlpy.gguf.GGUFWriter` writes a set with ``split_max_tensors`` or ``split_max_bytes``.
"""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np

from ggmlpy._core import GGUFError

from ._types import TensorInfo
from .reader import GGUFReader

__all__ = ["SPLIT_COUNT", "SPLIT_NO", "SPLIT_TENSORS_COUNT", "GGUFSplitReader", "open_reader", "parse_split_name",
           "split_path", "split_paths"]

SPLIT_NO = "split.no"
SPLIT_COUNT = "split.count"
SPLIT_TENSORS_COUNT = "split.tensors.count"

#: llama.cpp's ``llama_split_path`` pattern; the indices have five digits (gguf-split's ``%05d``)
_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def split_path(prefix: str | os.PathLike, no: int, count: int) -> str:
    """The file name of shard ``no`` (from 0) of ``count``: ``PREFIX-0000{no+1}-of-0000{count}.gguf``
    (llama.cpp's ``llama_split_path``)."""
    return f"{os.fspath(prefix)}-{no + 1:05d}-of-{count:05d}.gguf"


def parse_split_name(name: str | os.PathLike) -> tuple[str, int, int] | None:
    """``(prefix, number, count)`` of a shard's name (``number`` from 1, as in the name), or None for a
    name that is not a shard's: ``"m-00002-of-00003.gguf"`` -> ``("m", 2, 3)``."""
    m = _NAME.match(os.fspath(name))
    if m is None:
        return None
    return m["prefix"], int(m["no"]), int(m["count"])


def split_paths(first: str | os.PathLike) -> list[str]:
    """Every shard's path of the set whose first shard is ``first`` (``[first]`` for a name that is not a
    shard's)."""
    parsed = parse_split_name(first)
    if parsed is None:
        return [os.fspath(first)]
    prefix, _no, count = parsed
    return [split_path(prefix, k, count) for k in range(count)]


def _count(reader: GGUFReader, key: str) -> int | None:
    v = reader.metadata.get(key)
    if v is None:
        return None
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise GGUFError(f"{reader.path}: {key} is {v!r}, not an integer")
    return int(v)


def open_reader(path: str | os.PathLike) -> GGUFReader:
    """A reader of the model in ``path``: a :class:`GGUFReader`, or a :class:`GGUFSplitReader` over every
    shard when ``path`` is the first of a split set (``split.count`` above 1).

    Raises
    ------
    FileNotFoundError, GGUFError
        As :class:`GGUFReader`, and as :class:`GGUFSplitReader` for a split set.
    """
    first = GGUFReader(path)
    try:
        count = _count(first, SPLIT_COUNT)
    except BaseException:
        first.close()
        raise
    if count is None or count <= 1:
        return first
    return GGUFSplitReader(path, first=first)


class GGUFSplitReader(GGUFReader):
    """The shards of a split model read as one GGUF file (llama.cpp's loader's rules).

    The metadata is the first shard's (the others hold only the ``split.*`` keys); the tensors are every
    shard's, in shard order. A :class:`~ggmlpy.gguf.TensorInfo`'s ``offset`` counts in the shards' bytes
    laid end to end (shard 0's bytes, then shard 1's ...), the address :meth:`open_data` reads: the
    loaders seek and read a split model as they do one file. ``tensor_data`` reads from the shard.

    Checked when it is made, each error naming the file: ``path`` is the first shard (``split.no`` 0) and
    named as gguf-split names it; every shard is there; each says its own index and the same count;
    no tensor is in two shards; the shards hold ``split.tensors.count`` tensors in all.

    Parameters
    ----------
    path : str or os.PathLike
        The first shard, ``PREFIX-00001-of-0000N.gguf``.
    first : GGUFReader, optional
        That shard already open (this reader then owns it).

    Attributes
    ----------
    files : tuple of str
        The shards' paths, in order (``path`` is the first).
    shards : list of GGUFReader
        One reader per shard.

    Raises
    ------
    GGUFError
        A shard missing (all the missing ones named), one that is not a valid GGUF file, an index or
        count that disagrees, a duplicate tensor, a tensor count that disagrees with ``split.tensors.count``.
    """

    def __init__(self, path: str | os.PathLike, first: GGUFReader | None = None) -> None:   # noqa: D107
        first = first if first is not None else GGUFReader(path)
        self.shards: list[GGUFReader] = [first]
        try:
            self._open_shards(first)
        except BaseException:
            for r in self.shards:
                r.close()
            raise
        self._closed = False
        self._mm = None

    def _open_shards(self, first: GGUFReader) -> None:
        path = first.path
        count = _count(first, SPLIT_COUNT) or 1
        no = _count(first, SPLIT_NO) or 0
        parsed = parse_split_name(os.path.basename(path))
        if no != 0:
            hint = (f": load the first, {os.path.basename(split_path(parsed[0], 0, count))}"
                    if parsed is not None else "")
            raise GGUFError(f"{path}: shard {no + 1} of a model split in {count} files (split.no {no}); a split "
                            f"model is loaded from its first shard{hint}")
        if parsed is None or parsed[1:] != (1, count):
            raise GGUFError(f"{path}: split.count is {count} (a model split in {count} files), but the file name "
                            f"does not end in -00001-of-{count:05d}.gguf, as gguf-split names the first shard: "
                            "the other shards cannot be found")
        files = split_paths(path)
        missing = [f for f in files[1:] if not os.path.isfile(f)]
        if missing:
            names = ", ".join(os.path.basename(f) for f in missing)
            raise GGUFError(f"{path}: the model is split in {count} files and {len(missing)} of them "
                            f"{'is' if len(missing) == 1 else 'are'} missing from {os.path.dirname(path) or '.'}: "
                            f"{names}")
        for k, f in enumerate(files[1:], 1):
            r = GGUFReader(f)
            self.shards.append(r)
            got_no, got_count = _count(r, SPLIT_NO), _count(r, SPLIT_COUNT)
            if got_no != k:
                raise GGUFError(f"{f}: split.no is {got_no}, expected {k} (shard {k + 1} of {count}): not a "
                                f"shard of {os.path.basename(path)}'s set")
            if got_count != count:
                raise GGUFError(f"{f}: split.count is {got_count}, but the first shard {os.path.basename(path)} "
                                f"says {count}")
        # the first shard's metadata and header, every shard's tensors at their offset in the shards laid end
        # to end
        self.path, self.version, self.alignment = first.path, first.version, first.alignment
        self.data_offset = first.data_offset
        self.metadata: dict[str, Any] = first.metadata
        self._types = first._types
        self.files: tuple[str, ...] = tuple(r.path for r in self.shards)
        self.tensors: list[TensorInfo] = []
        self._by_name: dict[str, TensorInfo] = {}
        self._shard_of: dict[str, int] = {}
        base = 0
        for k, r in enumerate(self.shards):
            for t in r.tensors:
                if t.name in self._by_name:
                    other = self.files[self._shard_of[t.name]]
                    raise GGUFError(f"{r.path}: tensor {t.name!r} is in {os.path.basename(other)} too: a tensor "
                                    "of a split model is in one shard only")
                ti = TensorInfo(t.name, t.type, t.ne, base + t.offset, t.nbytes)
                self.tensors.append(ti)
                self._by_name[t.name] = ti
                self._shard_of[t.name] = k
            base += r.file_size
        self.file_size = base
        want = _count(first, SPLIT_TENSORS_COUNT)
        if want is None:
            raise GGUFError(f"{path}: a split model's first shard without {SPLIT_TENSORS_COUNT}")
        if want != len(self.tensors):
            raise GGUFError(f"{path}: {SPLIT_TENSORS_COUNT} is {want}, but the {count} shards hold "
                            f"{len(self.tensors)} tensors")

    def shard_of(self, name: str) -> str:
        """The path of the shard that holds tensor ``name``."""
        self.tensor_info(name)
        return self.files[self._shard_of[name]]

    def tensor_data(self, name: str, copy: bool = False) -> np.ndarray:
        """As :meth:`GGUFReader.tensor_data`, read from the shard that holds ``name``."""
        self.tensor_info(name)
        if self._closed:
            raise GGUFError(f"{self.path}: the reader is closed")
        return self.shards[self._shard_of[name]].tensor_data(name, copy=copy)

    def _check_layout(self) -> None:
        pass        # each shard's reader checked its own

    def close(self) -> None:
        """Drop every shard's file mapping; ``tensor_data`` raises afterwards (metadata stays)."""
        for r in self.shards:
            r.close()
        self._closed = True

    def __repr__(self) -> str:
        return (f"GGUFSplitReader({self.path!r}, {len(self.files)} shards, {len(self.metadata)} keys, "
                f"{len(self.tensors)} tensors)")
