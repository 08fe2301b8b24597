"""A model's weights fingerprint: what tells a KV state saved from one model from another's.

Two models of the same architecture and shape (a base model and its fine-tune, two seeds of a synthetic
model) have the same hyperparameters, parameter count and file size; a KV state saved from one loads
into the other without an error and decoding goes on over a foreign cache. :func:`weights_fingerprint`
is a SHA-256 over

* the file's tensor table: every tensor's name, type, shape, offset in the data section and size, in
  file order (a split model's tensors at the offsets one file would give them);
* sampled data: from every tensor, up to :data:`SAMPLE_ROWS` rows (the first, the last and evenly
  spaced ones between), the first :data:`SAMPLE_BYTES` bytes of each.

It is computed once when :func:`~ggmlpy.models.load_model` opens the file (and stored on the model as
``weights_fingerprint``) with ordinary reads of those rows only: a few KiB per tensor, never the whole
file, so its cost does not grow with the weights' size and a memory-mapped load pages in nothing more.

What it guarantees: two files with a different tensor table, or different bytes anywhere in the
sampled rows, have different fingerprints (up to SHA-256 collisions), whatever the load options
(placement, ``mmap``, ``repack``, ``fuse``); training or fine-tuning changes (nearly) every row of a
matrix, so two such models differ in the sample. What it does not: two files that differ only in rows (or the tail of
rows) outside the sample, e.g. a vocabulary with one embedding row edited in the middle, have the same
fingerprint; it is a guard against accidents, not an authentication of the weights (a forged state can
copy any fingerprint). Metadata (names, tokenizer) is not covered: a renamed copy of a model shares its
states.
"""

from __future__ import annotations

import hashlib
from typing import Any, Optional

from ggmlpy._core import GGMLValueError
from ggmlpy.gguf import open_data

__all__ = ["SAMPLE_BYTES", "SAMPLE_ROWS", "model_fingerprint", "weights_fingerprint"]

#: Rows sampled from each tensor.
SAMPLE_ROWS = 4
#: Bytes read from the start of each sampled row.
SAMPLE_BYTES = 4096


def _sample(info) -> list[tuple[int, int]]:
    """``(absolute offset, bytes)`` of the sampled pieces of tensor ``info``."""
    rs = info.type.row_size(info.ne[0]) if info.ne else 0
    if not rs or info.nbytes < rs:
        return [(info.offset, min(info.nbytes, SAMPLE_BYTES))] if info.nbytes else []
    n_rows = info.nbytes // rs
    rows = sorted({(n_rows - 1) * k // (SAMPLE_ROWS - 1) for k in range(SAMPLE_ROWS)})
    return [(info.offset + r * rs, min(rs, SAMPLE_BYTES)) for r in rows]


def weights_fingerprint(reader, f=None) -> str:
    """The weights fingerprint (hex SHA-256, see the module docstring) of the file ``reader`` opened.

    Parameters
    ----------
    reader : ggmlpy.gguf.GGUFReader
        An open reader (its tensor table is read; its file must not have changed since).
    f : binary file object, optional
        The file's data to read the samples from (default: the file at ``reader.path``, opened here; a
        split model's shards one after the other).

    Raises
    ------
    GGMLValueError
        The file ends inside a sampled row (it changed since the reader checked it).
    """
    if f is None:
        files = getattr(reader, "files", ())
        # a split model's shards, read as one (the offsets of GGUFSplitReader's tensors count that way)
        with open_data(files) if len(files) > 1 else open(reader.path, "rb") as own:
            return weights_fingerprint(reader, own)
    h = hashlib.sha256(b"ggmlpy weights fingerprint 1\0")
    pieces = []
    # a tensor's offset in the data section, counted as one file lays the table out (each tensor padded to
    # the alignment: GGUFReader checks a file's table tiles its data section so), so that a split model and
    # the same model in one file have one fingerprint
    at = 0
    for info in reader.tensors:
        h.update(f"{info.name}\0{info.type.name}\0{','.join(map(str, info.ne))}\0"
                 f"{at}\0{info.nbytes}\n".encode())
        at += info.nbytes + (-info.nbytes % reader.alignment)
        pieces.extend((info.name, off, n) for off, n in _sample(info))
    for name, off, n in sorted(pieces, key=lambda p: p[1]):     # in file order: forward reads
        f.seek(off)
        data = f.read(n)
        if len(data) != n:
            raise GGMLValueError(f"{reader.path}: file ends inside tensor {name!r} (it changed after it was "
                                 "opened)")
        h.update(data)
    return h.hexdigest()


def model_fingerprint(model: Any) -> Optional[str]:
    """``model.weights_fingerprint``; for a model made without :func:`~ggmlpy.models.load_model` but with
    an open reader (``model._reader``), computed now and stored; None for a model without a file."""
    fp = getattr(model, "weights_fingerprint", None)
    if fp is None:
        reader = getattr(model, "_reader", None)
        if reader is None or not hasattr(reader, "tensors"):
            return None
        fp = model.weights_fingerprint = weights_fingerprint(reader)
    return fp
