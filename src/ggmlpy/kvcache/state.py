"""Save and load the K/V of one sequence: :func:`save_seq`, :func:`load_seq` (``Causal.save_seq`` and friends).

The file holds what one sequence has stored in a cache (a :class:`~ggmlpy.kvcache.Causal`, or every cache
of a :class:`~ggmlpy.kvcache.Wrapper`), with the cache configuration it is only meaningful in and a
caller's ``meta`` dict (a runner puts its token ids and a model fingerprint there). It is loaded into the
same or another cache of the same configuration, under the same or another sequence id.

File format (version 2; version 1, without recurrent sections, is read too)
--------------------------------------------------------------------------
All integers little-endian; K/V data as the cache stores it (ggml's in-memory layout).

=============  ====================================================================================
bytes          content
=============  ====================================================================================
8              magic ``b"GGMLKVSQ"``
4              ``uint32`` format version (:data:`VERSION`)
4              ``uint32`` length ``H`` of the header
``H``          header: a UTF-8 JSON object (below)
per cache      a section for each entry of ``header["caches"]``, in order (below)
32             SHA-256 of every byte before it
=============  ====================================================================================

The header::

    {"format": "ggmlpy.kvcache.seq", "kind": "Causal" | "Recurrent" | "Wrapper", "seq": <saved sequence id>,
     "layer_to_cache": [...] (Wrapper only), "meta": {... the caller's dict ...},
     "caches": [{"n_layers", "n_embd_k", "n_embd_v", "n_head_kv", "type_k", "type_v" (ggml type names),
                 "v_trans", "window", "memory", "k_row_bytes", "v_row_bytes", "count"}        (a K/V section)
                | {"kind": "recurrent", "n_layers", "states": [[name, [sizes...]], ...], "count"}, ...]}

``count`` is the number of cells the sequence holds in that cache. A section is then, with ``n =
count`` and the sequence's cells in increasing position order:

* ``int32[n]``: their positions, strictly increasing;
* for every layer ``0 .. n_layers - 1``: K, ``n`` rows of ``k_row_bytes`` (each a cell's ``n_embd_k``
  values in ``type_k``), then V: ``n`` rows of ``v_row_bytes`` or, with ``v_trans``, the
  sequence's columns of the transposed V, ``n_embd_v`` rows (one per channel) of ``n`` elements. A K-only
  cache (``v_in_k``: V is part of K's rows) has ``v_row_bytes`` 0 and no V rows.

Cells shared with other sequences (a forked prefix) are saved as the sequence's own.

A recurrent section (a :class:`~ggmlpy.kvcache.Recurrent`: version 2) holds the sequence's live state:
``count`` is 1 (0: the sequence holds nothing), then ``int32[count]``: the last position the state
covers, then for every layer and every state (in the header's order) its F32 values (``4 * prod(sizes)``
bytes). Its checkpoints are not saved: a loaded sequence goes on from its end.

Loading
-------
:func:`load_seq` validates the whole file before the first byte of the cache or its cell table changes:
the magic and version; the header's size (at most :data:`MAX_HEADER` bytes) and JSON nesting (at most
:data:`MAX_DEPTH` levels), both bounded before it is parsed; its schema (exactly the keys above, each of
its JSON type and in range: ``count``, sizes and ids non-negative 32-bit integers, ``v_trans`` a
boolean, ``window``/``memory`` null or positive; a recurrent section's states a list of names and sizes,
its ``count`` 0 or 1); the configuration (every key but ``memory`` and ``count`` must equal the cache's,
types included, a recurrent section's states their names and sizes; for a Wrapper also the layer
routing); the exact size; the checksum; the positions (non-negative, strictly increasing; for a Wrapper
every cache's last position the same); ``expect_meta`` (equal as JSON: ``1`` is not ``1.0`` nor ``true``); and the
caller's ``check(meta, positions)``; then that the cells fit (the sequence's current cells, unless
shared, count as free). Any problem raises :class:`StateError` (:class:`KVCacheFull` when the cells do
not fit) naming what is wrong, and nothing has changed. Then the sequence is cleared, its cells are
found anywhere with :meth:`Cells.find_free`, the rows written there (the file is read a second time, its
positions compared and its rows' CRC-32: a file that changed in between leaves the sequence cleared,
and says so) and the metadata committed last.

A cache whose sliding window evicts (``memory`` set after ``init``) gets only what it could hold itself
after a batch ending at the sequence's last position: ``pos >= max(pos) + 1 - memory - max_batch``
(older positions are dropped, so a state saved from a cache of more memory fits; the same configuration
loads everything). The window and the head layout must match; the memory need not (it follows
``init``'s sizing).

Host caches (and caches placed on the CPU) are read and written in place. A cache in device memory is
read with ``Tensor.get_bytes`` and written with ``Tensor.set_bytes``, bytes as stored (any type), one
transfer per run of consecutive cells (a transposed V: the whole tensor).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import struct
import zlib
from contextlib import contextmanager
from typing import Callable, Optional

import numpy as np

from ggmlpy._core import GGMLTypeError, GGMLValueError, Tensor
from ggmlpy._files import replacing

from .causal import Causal
from .cells import _INT32_MAX, NotSupported
from .forward import KVCacheFull
from .recurrent import Recurrent
from .rows import StateRows

__all__ = ["MAGIC", "MAX_DEPTH", "MAX_HEADER", "VERSION", "StateError", "load_seq", "save_seq"]

#: First bytes of a sequence state file.
MAGIC = b"GGMLKVSQ"
#: Format version written when a state has a recurrent section (1 otherwise: what older ggmlpy reads); a
#: loader refuses a newer one.
VERSION = 2

#: Largest header (its JSON, the caller's ``meta`` included) written or read: a runner's record of a
#: million tokens takes about 7 MiB. Checked before the header is read.
MAX_HEADER = 16 << 20
#: Deepest nesting of JSON arrays and objects in the header (its own structure takes 3 levels, a runner's
#: meta 2 more); checked on the raw bytes before parsing, so no hostile header reaches a recursive parser.
MAX_DEPTH = 32

_PRE = struct.Struct("<8sII")       # magic, version, header length
_DIGEST = hashlib.sha256().digest_size
_CHUNK = 1 << 24
_FORMAT = "ggmlpy.kvcache.seq"
# configuration keys that must equal the loading cache's (memory follows init's sizing, count is data)
_COMPARED = ("n_layers", "n_embd_k", "n_embd_v", "n_head_kv", "type_k", "type_v", "v_trans", "window",
             "k_row_bytes", "v_row_bytes")
_INTS = ("n_layers", "n_embd_k", "n_embd_v", "n_head_kv", "k_row_bytes", "v_row_bytes", "count")
_CACHE_KEYS = frozenset(_INTS + ("type_k", "type_v", "v_trans", "window", "memory"))
# written only by a chunked cache (Llama 4's local layers), so files of every other cache read as before
_OPTIONAL_KEYS = frozenset(("chunk",))
_TOP_KEYS = frozenset(("format", "kind", "seq", "meta", "caches"))
_RS_KEYS = frozenset(("kind", "n_layers", "states", "count"))
_MAX_STATES = 16            # states per recurrent layer (a convolution's, a scan's...)
_MAX_CACHES = 256           # a Wrapper routes layers to a few caches
_MAX_LAYERS = 1 << 16       # layer_to_cache entries


class StateError(GGMLValueError):
    """A sequence state file is damaged, of another format version, or made for another configuration.

    Raised by :func:`load_seq` before anything changed (and by :func:`save_seq` for a sequence that holds
    a position twice); the message names what is wrong.
    """


# ---------------------------------------------------------------------------------------------- caches


def _caches(cache) -> tuple[str, list, Optional[list]]:
    """``(kind, the Causal and Recurrent caches, layer routing or None)`` of a Causal, a Recurrent or a Wrapper."""
    if isinstance(cache, Causal):
        return "Causal", [cache], None
    if isinstance(cache, Recurrent):
        return "Recurrent", [cache], None
    from .composite import Wrapper

    if isinstance(cache, Wrapper):
        bad = [type(c).__name__ for c in cache.caches if not isinstance(c, (Causal, Recurrent))]
        if bad:
            raise NotSupported(f"sequence state: a Wrapper of {', '.join(bad)} has no per-sequence state to save")
        return "Wrapper", list(cache.caches), list(cache.layer_to_cache)
    raise GGMLTypeError(f"sequence state: a Causal, Recurrent or Wrapper cache, not {type(cache).__name__}")


def _config(c) -> dict:
    if isinstance(c, Recurrent):
        return {"kind": "recurrent", "n_layers": c.n_layers, "states": [[n, list(sh)] for n, sh in c.states.items()]}
    # a K-only cache (v_in_k: V read from K's rows) stores no V: v_row_bytes 0, which no other cache has
    return {"n_layers": c.n_layers, "n_embd_k": c.n_embd_k, "n_embd_v": c.n_embd_v, "n_head_kv": c.n_head_kv,
            "type_k": c.dtype.name, "type_v": c.dtype_v.name, "v_trans": c.v_trans, "window": c.window,
            "memory": c.memory, "k_row_bytes": c.dtype.row_size(c.n_embd_k),
            "v_row_bytes": c._v_row_bytes(), **({"chunk": c.chunk} if c.chunk is not None else {})}


def _state_bytes(cfg: dict) -> int:
    """Bytes of one layer's states in a recurrent section (F32 values)."""
    return sum(4 * int(np.prod(shape)) for _name, shape in cfg["states"])


def _section_bytes(cfg: dict) -> int:
    if "kind" in cfg:
        return cfg["count"] * (4 + cfg["n_layers"] * _state_bytes(cfg))
    return cfg["count"] * (4 + cfg["n_layers"] * (cfg["k_row_bytes"] + cfg["v_row_bytes"]))


def _runs(cell_ids: np.ndarray):
    """``(index, first cell, length)`` of each run of consecutive cells in ascending ``cell_ids``."""
    brk = np.flatnonzero(np.diff(cell_ids) != 1) + 1
    starts = np.concatenate(([0], brk))
    ends = np.concatenate((brk, [cell_ids.size]))
    return [(int(a), int(cell_ids[a]), int(b - a)) for a, b in zip(starts, ends)]


# ------------------------------------------------------------------------------------- tensor rows


def _host_raw(t: Tensor) -> np.ndarray:
    """The host tensor's memory as a writable ``uint8[ne1, row bytes]`` view."""
    a = t.numpy()
    return a.view(np.uint8).reshape(a.shape[0], -1)


def _device_raw(t: Tensor, rows=None) -> np.ndarray:
    """Bytes ``uint8[len(rows), row bytes]`` of rows of a device tensor (all rows when ``rows`` is None),
    as stored: one read per run of consecutive rows."""
    row = t.nb[1]
    if rows is None:
        return t.get_bytes().reshape(-1, row)
    rows = np.asarray(rows, np.int64)
    out = np.empty((rows.size, row), np.uint8)
    for i, first, n in _runs(rows):
        out[i:i + n] = t.get_bytes(first * row, n * row).reshape(n, row)
    return out


def _read(t: Tensor, cells: np.ndarray, trans: bool, es: int) -> np.ndarray:
    """The stored bytes of ``cells``: ``uint8[n, row]``, or for a transposed V ``uint8[channels, n * es]``."""
    if trans:
        raw = _host_raw(t) if t.is_host else _device_raw(t)
        return raw.reshape(raw.shape[0], -1, es)[:, cells, :].reshape(raw.shape[0], cells.size * es)
    if t.is_host:
        return _host_raw(t)[cells]
    return _device_raw(t, cells)


def _write(t: Tensor, cell_ids: np.ndarray, data: np.ndarray, trans: bool, es: int) -> None:
    """Store ``data`` (as :func:`_read` returns it) at cells ``cell_ids``."""
    if t.is_host:
        raw = _host_raw(t)
        if trans:
            raw.reshape(raw.shape[0], -1, es)[:, cell_ids, :] = data.reshape(raw.shape[0], -1, es)
        else:
            raw[cell_ids] = data
        return
    if trans:                       # cells are columns: rewrite the whole tensor
        raw = _device_raw(t)
        raw.reshape(raw.shape[0], -1, es)[:, cell_ids, :] = data.reshape(raw.shape[0], -1, es)
        t.set_bytes(raw, 0)
        return
    row = data.shape[1]
    for i, first, n in _runs(cell_ids):
        t.set_bytes(np.ascontiguousarray(data[i:i + n]), first * row)


def _layers(c):
    """``(tensor, transposed, element bytes)`` of K then V of every layer, in file order (K alone for a K-only
    cache; a recurrent cache: each state of every layer)."""
    if isinstance(c, Recurrent):
        for states in c.tensors:
            for name in c.states:
                yield states[name], False, 0
        return
    es = c.dtype_v.type_size
    for i, k in enumerate(c.keys):
        yield k, False, 0
        if not c.v_in_k:
            yield c.values[i], c.v_trans, es


# ------------------------------------------------------------------------------------------ saving


def _check_file(file, method: str) -> None:
    if not hasattr(file, method) or isinstance(file, io.TextIOBase):
        raise GGMLTypeError(f"file must be a path or a binary file object, got {type(file).__name__}")


class _Out:
    """A file being written: counts the bytes and hashes them."""

    def __init__(self, f) -> None:
        self.f, self.n, self.hash = f, 0, hashlib.sha256()

    def write(self, data) -> None:
        if isinstance(data, np.ndarray):
            data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        mv = memoryview(data)
        self.hash.update(mv)
        self.f.write(mv)
        self.n += mv.nbytes


def _meta_json(meta) -> dict:
    if meta is None:
        return {}
    if not isinstance(meta, dict):
        raise GGMLTypeError(f"meta must be a dict, got {type(meta).__name__}")
    try:
        return json.loads(json.dumps(meta, allow_nan=False))
    except (TypeError, ValueError, RecursionError) as e:
        raise GGMLTypeError(f"meta must be JSON-serializable: {e}") from None


def _too_deep(raw: bytes) -> bool:
    """Whether JSON text ``raw`` nests arrays and objects deeper than :data:`MAX_DEPTH` (exact for valid
    JSON; some answer for invalid text, which the parser then refuses), in linear time and bounded memory,
    without parsing it."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_DEPTH:
        return False
    # drop escaped backslashes, then escaped quotes: every quote left opens or closes a string
    a = np.frombuffer(raw.replace(b"\\\\", b"").replace(b'\\"', b""), np.uint8)
    depth = inside = 0
    for i in range(0, a.size, 1 << 20):
        c = a[i:i + (1 << 20)]
        # parity of the quotes so far: 1 inside a string (a wrapping uint8 sum keeps the parity)
        par = (np.cumsum(c == 34, dtype=np.uint8) + inside) & 1
        d = ((c == 91) | (c == 123)).astype(np.int32) - ((c == 93) | (c == 125))
        d[par == 1] = 0
        run = np.cumsum(d) + depth
        if run.max() > MAX_DEPTH:
            return True
        depth, inside = int(run[-1]), int(par[-1])
    return False


def save_seq(cache, seq: int, file, meta: Optional[dict] = None) -> int:
    """Write what sequence ``seq`` holds in ``cache`` (a :class:`Causal` or :class:`Wrapper`) to ``file``.

    Parameters
    ----------
    cache : Causal or Wrapper
        An initialised cache.
    seq : int
        The sequence.
    file : str, os.PathLike or binary file object
        A path is written to a temporary file beside it and renamed over it at the end (an error leaves
        no partial file); a file object is written at its position (an error may leave part of a state).
    meta : dict, optional
        JSON-serializable data stored with the state and returned by :func:`load_seq`.

    Returns
    -------
    int
        Bytes written.
    """
    kind, caches, routing = _caches(cache)
    picked = []
    for c in caches:
        if isinstance(c, Recurrent):
            rows = c.rows
            s = rows.check_seq(seq)
            held = np.array([rows.tail[s]] if rows.tail[s] >= 0 else [], np.int64)
            picked.append((held, np.array([rows.length[s] - 1] if held.size else [], np.int64)))
            continue
        cells = c.cells
        s = cells._check_seq(seq)
        held = np.flatnonzero(cells.seqs[:, s])
        pos = cells.pos[held]
        order = np.argsort(pos, kind="stable")
        held, pos = held[order], pos[order]
        if pos.size > 1 and (np.diff(pos) == 0).any():
            raise StateError(f"sequence {s} holds position {int(pos[np.flatnonzero(np.diff(pos) == 0)[0]])} "
                             "in two cells; such a state cannot be saved")
        picked.append((held, pos))
    header = {"format": _FORMAT, "kind": kind, "seq": int(seq), "meta": _meta_json(meta),
              "caches": [dict(_config(c), count=int(h.size)) for c, (h, _p) in zip(caches, picked)]}
    # version 1 where it says everything (older ggmlpy reads those), 2 for a recurrent section
    version = VERSION if any(isinstance(c, Recurrent) for c in caches) else 1
    if routing is not None:
        header["layer_to_cache"] = routing
    head = json.dumps(header, separators=(",", ":")).encode()
    if len(head) > MAX_HEADER:
        raise StateError(f"sequence state header would take {len(head)} bytes, more than {MAX_HEADER} "
                         "(MAX_HEADER): meta is too large")
    if _too_deep(head):
        raise StateError(f"sequence state meta is nested deeper than the header allows ({MAX_DEPTH} levels "
                         "in all, MAX_DEPTH)")

    def dump(f) -> int:
        out = _Out(f)
        out.write(_PRE.pack(MAGIC, version, len(head)))
        out.write(head)
        for c, (held, pos) in zip(caches, picked):
            out.write(pos.astype("<i4"))
            for t, trans, es in _layers(c):
                out.write(_read(t, held, trans, es))
        f.write(out.hash.digest())
        return out.n + _DIGEST

    if not isinstance(file, (str, os.PathLike)):
        _check_file(file, "write")
        return dump(file)
    with replacing(file) as tmp, open(tmp, "wb") as f:
        return dump(f)


# ----------------------------------------------------------------------------------------- loading


@contextmanager
def _source(file):
    """``(binary file, bytes available from its position or None for a stream, whether they must all be
    ours)``."""
    if isinstance(file, (str, os.PathLike)):
        with open(file, "rb") as f:
            yield f, os.fstat(f.fileno()).st_size, True
        return
    _check_file(file, "read")
    if getattr(file, "seekable", lambda: False)():
        start = file.tell()
        end = file.seek(0, io.SEEK_END)
        file.seek(start)
        yield file, end - start, False
        return
    yield file, None, True


def _slurp(f, head: bytes, n: int) -> io.BytesIO:
    """A stream's next ``n`` bytes at most (fewer at its end), after ``head``, as a file positioned after
    ``head``: read in pieces, so a stream shorter than its header says costs what it holds."""
    out = io.BytesIO()
    out.write(head)
    left = n
    while left:
        chunk = f.read(min(left, _CHUNK))
        if not chunk:
            break
        out.write(chunk)
        left -= len(chunk)
    out.seek(len(head))
    return out


def _read_exact(f, n: int, what: str) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise StateError(f"sequence state truncated in {what}: {len(data)} of {n} bytes")
    return data


def _show(v) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def _is_int(v, lo: int = 0, hi: int = _INT32_MAX) -> bool:
    return type(v) is int and lo <= v <= hi


def _no_constant(name: str):
    raise StateError(f"{name} is not a JSON number")   # json.loads passes it on; _header names the header


def _header(f, avail: Optional[int]) -> tuple[dict, bytes]:
    """Read and check magic, version and the header: its size and nesting before parsing, then its schema
    (every key, its JSON type and range). Returns ``(header, bytes read)``."""
    pre = f.read(_PRE.size)
    if not pre:
        raise StateError("sequence state is empty")
    if not MAGIC.startswith(pre[:len(MAGIC)]):
        raise StateError("not a ggmlpy sequence state (bad magic)")
    if len(pre) < _PRE.size:
        raise StateError(f"sequence state truncated in the preamble: {len(pre)} of {_PRE.size} bytes")
    _magic, version, size = _PRE.unpack(pre)
    if version > VERSION:
        raise StateError(f"sequence state format version {version} is newer than this ggmlpy reads ({VERSION})")
    if version < 1:
        raise StateError(f"sequence state format version {version} is not a valid version")
    if avail is not None and size > avail - _PRE.size:
        raise StateError(f"sequence state truncated: the header needs {size} bytes, "
                         f"{max(0, avail - _PRE.size)} follow")
    if size > MAX_HEADER:
        raise StateError(f"sequence state header of {size} bytes is larger than {MAX_HEADER} (MAX_HEADER)")
    raw = _read_exact(f, size, "the header")
    if _too_deep(raw):
        raise StateError(f"sequence state header: its JSON nests deeper than {MAX_DEPTH} levels (MAX_DEPTH)")
    try:
        header = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise StateError(f"sequence state header is not valid JSON: {e}") from None
    _check_schema(header, version)
    return header, pre + raw


def _check_states(i: int, states) -> None:
    """A recurrent section's ``states``: ``[[name, [sizes...]], ...]``, 1 to :data:`_MAX_STATES`, distinct names."""
    ok = isinstance(states, list) and 0 < len(states) <= _MAX_STATES and all(
        isinstance(e, list) and len(e) == 2 and isinstance(e[0], str) and 0 < len(e[0]) <= 64
        and isinstance(e[1], list) and 1 <= len(e[1]) <= 3 and all(_is_int(d, 1) for d in e[1]) for e in states)
    if not ok or len({e[0] for e in states}) != len(states):
        raise StateError(f"sequence state header: cache {i} has bad 'states' (a list of [name, [sizes]]): "
                         f"{_show(states)}")


def _check_schema(header, version: int = VERSION) -> None:
    """Every key of the header present, of its JSON type and in range; no other key."""
    if not isinstance(header, dict) or header.get("format") != _FORMAT:
        raise StateError("sequence state header is not a ggmlpy.kvcache.seq header")
    kind = header.get("kind")
    if kind not in ("Causal", "Recurrent", "Wrapper"):
        raise StateError(f"sequence state header: 'kind' must be 'Causal', 'Recurrent' or 'Wrapper', not {_show(kind)}")
    want = _TOP_KEYS | ({"layer_to_cache"} if kind == "Wrapper" else set())
    if set(header) != want:
        extra, missing = sorted(set(header) - want), sorted(want - set(header))
        raise StateError(f"sequence state header: {'unknown keys ' + _show(extra) if extra else ''}"
                         f"{'; ' if extra and missing else ''}{'missing keys ' + _show(missing) if missing else ''}")
    if not _is_int(header["seq"]):
        raise StateError(f"sequence state header: 'seq' must be a sequence id, not {_show(header['seq'])}")
    if not isinstance(header["meta"], dict):
        raise StateError("sequence state header: 'meta' must be an object")
    caches = header["caches"]
    if not isinstance(caches, list) or not 0 < len(caches) <= _MAX_CACHES \
            or not all(isinstance(c, dict) for c in caches):
        raise StateError(f"sequence state header: 'caches' must be a list of 1 to {_MAX_CACHES} objects")
    if kind == "Wrapper":
        routing = header["layer_to_cache"]
        if not isinstance(routing, list) or len(routing) > _MAX_LAYERS \
                or not all(_is_int(i, 0, len(caches) - 1) for i in routing):
            raise StateError(f"sequence state header: 'layer_to_cache' must be a list of cache indices, not "
                             f"{_show(routing)}")
    for i, cfg in enumerate(caches):
        if "kind" in cfg:
            # a recurrent section: version 2 files only
            if set(cfg) != _RS_KEYS or cfg["kind"] != "recurrent" or version < 2:
                raise StateError(f"sequence state header: cache {i} is not a K/V section nor a recurrent one of "
                                 f"version 2 (keys {_show(sorted(cfg))}, kind {_show(cfg['kind'])}, version {version})")
            if not _is_int(cfg["n_layers"]) or not _is_int(cfg["count"], 0, 1):
                raise StateError(f"sequence state header: cache {i} has a bad 'n_layers' or 'count' (0 or 1): "
                                 f"{_show(cfg['n_layers'])}, {_show(cfg['count'])}")
            _check_states(i, cfg["states"])
            continue
        if not _CACHE_KEYS <= set(cfg) <= _CACHE_KEYS | _OPTIONAL_KEYS:
            extra, missing = sorted(set(cfg) - _CACHE_KEYS - _OPTIONAL_KEYS), sorted(_CACHE_KEYS - set(cfg))
            raise StateError(f"sequence state header: cache {i} has "
                             f"{'unknown keys ' + _show(extra) if extra else 'no ' + _show(missing)}")
        for key in _INTS:
            if not _is_int(cfg[key]):
                raise StateError(f"sequence state header: cache {i} has a bad {key!r}: {_show(cfg[key])}")
        for key in ("type_k", "type_v"):
            if not isinstance(cfg[key], str) or not 0 < len(cfg[key]) <= 32:
                raise StateError(f"sequence state header: cache {i} has a bad {key!r}: {_show(cfg[key])}")
        if type(cfg["v_trans"]) is not bool:
            raise StateError(f"sequence state header: cache {i} has a bad 'v_trans': {_show(cfg['v_trans'])}")
        for key in ("window", "memory", "chunk"):
            if cfg.get(key) is not None and not _is_int(cfg[key], 1):
                raise StateError(f"sequence state header: cache {i} has a bad {key!r}: {_show(cfg[key])}")


def _check_config(header: dict, kind: str, caches: list, routing) -> None:
    if header["kind"] != kind:
        raise StateError(f"sequence state of a {header['kind']!r} cache, loading into a {kind}")
    saved = header["caches"]
    if len(saved) != len(caches):
        raise StateError(f"sequence state of {len(saved)} caches, this {kind} has {len(caches)}")
    if routing is not None and header["layer_to_cache"] != routing:
        raise StateError(f"sequence state layer routing {_show(header['layer_to_cache'])} differs from this "
                         f"Wrapper's {routing}")
    for i, (cfg, c) in enumerate(zip(saved, caches)):
        where = "" if len(caches) == 1 else f" of cache {i}"
        if ("kind" in cfg) != isinstance(c, Recurrent):
            have = "a recurrent" if "kind" in cfg else "a K/V"
            raise StateError(f"sequence state: {have} section{where}, where this cache has "
                             f"{'a recurrent' if isinstance(c, Recurrent) else 'a K/V'} one")
        if isinstance(c, Recurrent):
            mine = _config(c)
            if cfg["n_layers"] != mine["n_layers"] or cfg["states"] != mine["states"]:
                raise StateError(f"sequence state configuration{where} differs: recurrent states of "
                                 f"{cfg['n_layers']} layers {_show(cfg['states'])} in the file, {mine['n_layers']} "
                                 f"layers {mine['states']} here")
            continue
        mine = _config(c)
        # the schema fixed every value's JSON type, so == compares like with like
        diff = [f"{k} {cfg.get(k)!r} in the file, {mine.get(k)!r} here" for k in _COMPARED + ("chunk",)
                if cfg.get(k) != mine.get(k)]
        if diff:
            raise StateError(f"sequence state configuration{where} differs: {'; '.join(diff)}")


def _canon(v) -> str:
    return json.dumps(v, sort_keys=True)


def _check_meta(meta: dict, want: dict) -> None:
    for key, value in want.items():
        if key not in meta:
            raise StateError(f"sequence state meta has no {key!r}")
        if _canon(meta[key]) != _canon(value):        # as JSON: 1, 1.0 and true differ
            raise StateError(f"sequence state meta {key!r} is {_show(meta[key])}, expected {_show(value)}")


def _check_positions(positions: list, kind: str) -> None:
    for i, pos in enumerate(positions):
        where = "" if len(positions) == 1 else f" of cache {i}"
        if pos.size and pos.min() < 0:
            raise StateError(f"sequence state positions{where} must be >= 0, found {int(pos.min())}")
        if pos.size > 1 and (np.diff(pos) <= 0).any():
            j = int(np.flatnonzero(np.diff(pos) <= 0)[0])
            raise StateError(f"sequence state positions{where} must increase: {int(pos[j])} then "
                             f"{int(pos[j + 1])}")
    if kind == "Wrapper":
        # every cache of a Wrapper stores each batch, so all hold the sequence up to the same position
        last = [int(p[-1]) if p.size else -1 for p in positions]
        if len(set(last)) > 1:
            raise StateError(f"sequence state caches end at different positions {last}: they must hold the "
                             "sequence up to the same one")


def load_seq(cache, seq: int, file, expect_meta: Optional[dict] = None,
             check: Optional[Callable[[dict, list], None]] = None) -> dict:
    """Replace what sequence ``seq`` holds in ``cache`` with a state written by :func:`save_seq`.

    Parameters
    ----------
    cache : Causal or Wrapper
        An initialised cache of the configuration the state was saved from.
    seq : int
        The sequence to load into (any id; it need not be the saved one).
    file : str, os.PathLike or binary file object
        A path must hold exactly one state. A seekable file object is read from its position and left just
        after the state (more data may follow); a non-seekable one is read up to the size its header
        declares (at most one byte more, to tell extra data, which is refused).
    expect_meta : dict, optional
        Entries the file's meta must hold with equal values (as JSON; e.g. a model fingerprint), checked
        before anything changes.
    check : callable, optional
        ``check(meta, positions)``, called once the whole file is validated and before anything changes
        (``positions``: an ``int64`` array per cache, the saved ones, increasing); it refuses the state
        by raising (a :class:`StateError` naming what is wrong), and nothing changes.

    Returns
    -------
    dict
        The ``meta`` given to :func:`save_seq`.

    Raises
    ------
    StateError
        The file is damaged or truncated, of a newer format, of another configuration, has a malformed
        header or bad positions, ``expect_meta`` does not match, or ``check`` refused it. Nothing has
        changed. (Only if the file changes between the validating read and the loading one is the
        sequence left cleared; the message says so.)
    KVCacheFull
        The sequence's cells do not fit. Nothing has changed.
    """
    kind, caches, routing = _caches(cache)
    cells = [c.rows if isinstance(c, Recurrent) else c.cells for c in caches]
    seq = cells[0].check_seq(seq) if isinstance(caches[0], Recurrent) else cells[0]._check_seq(seq)
    want = _meta_json(expect_meta)
    if check is not None and not callable(check):
        raise GGMLTypeError(f"check must be callable, got {type(check).__name__}")
    with _source(file) as (f, avail, exact):
        header, head = _header(f, avail)
        _check_config(header, kind, caches, routing)
        saved = header["caches"]
        body = sum(_section_bytes(cfg) for cfg in saved)
        total = len(head) + body + _DIGEST
        if avail is None:
            f = _slurp(f, head, total - len(head) + 1)
            avail = len(f.getbuffer())
        if avail < total or (exact and avail != total):
            raise StateError(f"sequence state {'truncated' if avail < total else 'has extra bytes'}: the header "
                             f"describes {total} bytes, {avail} are there")
        start = f.tell()
        # pass 1: the checksum over everything, keeping the positions (and a CRC-32 of the body, which the
        # second pass compares: cheaper than hashing again, and enough to see a file changed in between)
        digest = hashlib.sha256(head)
        crc = 0
        positions = []
        for cfg in saved:
            raw = _read_exact(f, 4 * cfg["count"], "the positions")
            digest.update(raw)
            positions.append(np.frombuffer(raw, "<i4").astype(np.int64))
            positions[-1].flags.writeable = False        # handed to check(): what pass 2 compares with
            left = _section_bytes(cfg) - len(raw)
            while left:
                chunk = _read_exact(f, min(left, _CHUNK), "the K/V data")
                digest.update(chunk)
                crc = zlib.crc32(chunk, crc)
                left -= len(chunk)
        if _read_exact(f, _DIGEST, "the checksum") != digest.digest():
            raise StateError("sequence state checksum mismatch: the file is damaged")
        end = f.tell()
        _check_positions(positions, kind)
        meta = header["meta"]
        _check_meta(meta, want)
        if check is not None:
            check(meta, positions)
        # plan every cache before touching any: the cells kept (a sliding window's memory) and their cell_ids
        plans = []
        for c, cl, pos in zip(caches, cells, positions):
            if isinstance(c, Recurrent):
                # one row, free once the sequence is cleared (its checkpoints go too: it goes on from its end)
                trial = cl.copy()
                trial.clear(seq)
                free = [r for r, k in enumerate(trial.refs) if k == 0]
                plans.append((0, np.array(free[:pos.size], np.int64)))
                continue
            first = 0
            if c.memory is not None and pos.size:
                first = int(np.searchsorted(pos, int(pos[-1]) + 1 - c.memory - c.max_batch))
            trial = cl.copy()
            trial.clear(seq)
            cell_ids = trial.find_free(pos.size - first)
            if cell_ids is None:
                raise KVCacheFull(f"sequence state needs {pos.size - first} cells, {cl.n_cells - trial.used} are "
                                  f"free for sequence {seq} (cache: {cl.n_cells})")
            plans.append((first, cell_ids))
        # pass 2: the rows, into cells that are free once the sequence is cleared; metadata last. What is
        # written must be what was checked: the positions are compared, the rows' CRC-32 at the end
        f.seek(start)
        again = 0
        try:
            for c, cfg, pos, (first, cell_ids) in zip(caches, saved, positions, plans):
                n = cfg["count"]
                raw = _read_exact(f, 4 * n, "the positions")
                if not np.array_equal(np.frombuffer(raw, "<i4"), pos):
                    raise StateError("its positions differ")
                for t, trans, es in _layers(c):
                    row = t.type.row_size(t.ne[1] if trans else t.ne[0])
                    raw = _read_exact(f, n * row, "the K/V data")
                    again = zlib.crc32(raw, again)
                    data = np.frombuffer(raw, np.uint8)
                    if trans:
                        data = data.reshape(t.ne[1], n, es)[:, first:, :].reshape(t.ne[1], (n - first) * es)
                    else:
                        data = data.reshape(n, row)[first:]
                    if cell_ids.size:
                        _write(t, cell_ids, data, trans, es)
            if again != crc:
                raise StateError("its data differs")
        except BaseException as e:
            for cl in cells:        # the sequence's own cells may be half overwritten: drop it
                cl.clear(seq)
            if isinstance(e, StateError):
                raise StateError(f"sequence state changed while it was loaded ({e}); sequence {seq} was "
                                 "cleared") from None
            raise
        f.seek(end)
    for cl, pos, (first, cell_ids) in zip(cells, positions, plans):
        if isinstance(cl, StateRows):
            cl.clear(seq)
            if pos.size:
                cl.load(seq, int(pos[-1]) + 1, int(cell_ids[0]))
            continue
        cl.clear(seq)
        cl.apply(cell_ids, pos[first:], np.full(cell_ids.size, seq))
    return meta
