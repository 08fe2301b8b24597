"""Corrupted GGUF model files against GGUFReader and load_model, in child processes.

Two tiny synthetic llama models (F16 and Q8_0, written by
``ggmlpy.models.synthetic``) are the bases. Case ``i`` of a run is a pure
function of ``(base, seed, i)``, so any case can be written out again
(``--write-case``). Each case is one edit of a base file:

* structural (anything may happen but a crash or a hang): truncations, bit
  flips and random bytes in the header, inserted / deleted bytes, huge key,
  tensor, string and array counts, duplicated keys and tensor infos, tensor
  offsets out of range, ``n_dims > 4``, unknown tensor and value types, huge
  or negative dimensions, random bytes in the tensor data;
* semantic (the file stays well-formed, the model does not make sense; each
  must be *rejected*, a load is a "silent garbage load"): one tensor fewer in
  the header's count, ``rms_eps`` inf/NaN/<= 0, ``block_count`` other than the
  layers present (1, 0, 3, 2**31 - 1 ...), F16 data re-typed as BF16 (or F32
  as I32), hyperparameters that contradict the tensor shapes or are out of
  range, metadata of the wrong type, a tensor info dropped, a layer renamed
  out of range, NaN weights, token ids outside the vocabulary.

Each case goes through ``GGUFReader`` (metadata, every tensor's data, mapped
and copied) and, when that works, ``load_model`` plus one decode step of a
``Runner``.

``--target mmproj`` fuzzes vision encoder (mmproj) files the same way. The bases
are four tiny encoders in the layout llama.cpp's converter writes (gemma3 and
idefics3 projectors; F32, F16 and Q8_0 matrices, :func:`write_mmproj`); the
structural edits are the same, the semantic ones are the ``clip.*`` metadata
(eps inf/NaN/<= 0, a block count, image/patch/embedding sizes, head count,
projection width, scale factor that contradict the tensors or are out of range,
values of the wrong type, mean/std arrays of the wrong length or not finite or
outside the pixel range, a quick-GELU or SiLU file, a projector type the tensors
are not, a second projector type that disagrees), a tensor dropped, added,
renamed to a layer out of range or re-typed, and NaN weights. Each case goes
through ``GGUFReader``, ``load_mmproj``, one ``encode`` and a ``Runner`` over a
tiny text model with the encoder (which reserves for the largest image); every
error must also name the case's file. Edits a loader cannot tell from a real
file (a head count that divides the width, a gemma3 pooling factor that divides
the patch grid, other plausible mean/std values) are not made. An error must be a
``ggmlpy.GGMLError`` (or OSError); anything else is reported as a failure. Children handle a
batch of cases each; the
parent watches them: a negative return code is an abort (the case is named),
a case that makes no progress for ``--case-timeout`` seconds (20) is a hang
(the pool of children is ``tests/fuzz_pool.py``, shared with the other fuzzers).

Usage::

    python tests/gguf_fuzz.py --cases 10000 --jobs 2            # the long run (about 2 minutes on 2 cores)
    python tests/gguf_fuzz.py --cases 300 --seed 7              # a sample
    python tests/gguf_fuzz.py --write-case 123 --seed 7 --out case.gguf   # reproduce one case
    python tests/gguf_fuzz.py --target mmproj --cases 5000 --jobs 2  # mmproj files

The last line on stdout is a JSON summary: counts per outcome and per kind,
wall time, and the failures (aborts, hangs, silent loads of semantic edits,
exceptions of the wrong class). Exit status 0 when there are none.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import struct
import sys
import tempfile
import time

import fuzz_pool

# --- the GGUF header, parsed in pure Python (positions of every field) -------------------------------

_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
F32, F16, I32, BF16 = 0, 1, 26, 30


class Header:
    """A GGUF file split into raw chunks: the fixed head, each KV, each tensor info, the data section.

    Only well-formed files are parsed (the bases); edits work on the chunks and :meth:`build` joins
    them again, padding the header to the alignment so the data section keeps its relative offsets.
    """

    def __init__(self, data: bytes) -> None:
        self.data = data
        assert data[:4] == b"GGUF"
        self.version = struct.unpack_from("<I", data, 4)[0]
        n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
        pos = 24
        self.kvs = []               # (key, type, raw chunk, value offset within chunk)
        for _ in range(n_kv):
            start = pos
            klen = struct.unpack_from("<Q", data, pos)[0]
            key = data[pos + 8:pos + 8 + klen].decode()
            pos += 8 + klen
            t = struct.unpack_from("<I", data, pos)[0]
            pos += 4
            vpos = pos
            pos = self._skip(t, pos)
            self.kvs.append((key, t, data[start:pos], vpos - start))
        self.tinfos = []            # (name, raw chunk)
        for _ in range(n_tensors):
            start = pos
            nlen = struct.unpack_from("<Q", data, pos)[0]
            name = data[pos + 8:pos + 8 + nlen].decode()
            pos += 8 + nlen
            nd = struct.unpack_from("<I", data, pos)[0]
            pos += 4 + 8 * nd + 4 + 8
            self.tinfos.append((name, data[start:pos]))
        self.header_end = pos
        self.alignment = 32
        for key, _t, chunk, vo in self.kvs:
            if key == "general.alignment":
                self.alignment = struct.unpack_from("<I", chunk, vo)[0]
        self.data_start = pos + (-pos % self.alignment)
        self.section = data[self.data_start:]

    def _skip(self, t: int, pos: int) -> int:
        if t == STRING:
            return pos + 8 + struct.unpack_from("<Q", self.data, pos)[0]
        if t == ARRAY:
            et, n = struct.unpack_from("<IQ", self.data, pos)
            pos += 12
            for _ in range(n):
                pos = self._skip(et, pos)
            return pos
        return pos + struct.calcsize(_SCALAR[t])

    def kv_index(self, key: str) -> int:
        return [k for k, *_ in self.kvs].index(key)

    def tensor_index(self, name: str) -> int:
        return [n for n, _ in self.tinfos].index(name)

    def tinfo_fields(self, i: int) -> dict:
        """Offsets (within tensor info ``i``'s chunk) of n_dims, ne[0], type and offset, and their values."""
        name, chunk = self.tinfos[i]
        p = 8 + len(name.encode())
        nd = struct.unpack_from("<I", chunk, p)[0]
        ne = struct.unpack_from(f"<{nd}q", chunk, p + 4)
        tp = p + 4 + 8 * nd
        return {"n_dims_at": p, "ne_at": p + 4, "n_dims": nd, "ne": ne, "type_at": tp,
                "type": struct.unpack_from("<I", chunk, tp)[0], "offset_at": tp + 4,
                "offset": struct.unpack_from("<Q", chunk, tp + 4)[0]}

    def build(self, kvs=None, tinfos=None, n_kv=None, n_tensors=None, section=None) -> bytes:
        kvs = self.kvs if kvs is None else kvs
        tinfos = self.tinfos if tinfos is None else tinfos
        head = (b"GGUF" + struct.pack("<IQQ", self.version, len(tinfos) if n_tensors is None else n_tensors,
                                      len(kvs) if n_kv is None else n_kv)
                + b"".join(c for _, _, c, _ in kvs) + b"".join(c for _, c in tinfos))
        head += b"\0" * (-len(head) % self.alignment)
        return head + (self.section if section is None else section)


def kv_chunk(key: str, t: int, value) -> tuple:
    """A KV as (key, type, raw chunk, value offset); ``value`` for ARRAY is (element type, list)."""
    k = key.encode()
    head = struct.pack("<Q", len(k)) + k + struct.pack("<I", t)
    return key, t, head + _value(t, value), len(head)


def _value(t: int, v) -> bytes:
    if t == STRING:
        b = v.encode()
        return struct.pack("<Q", len(b)) + b
    if t == ARRAY:
        et, items = v
        return struct.pack("<IQ", et, len(items)) + b"".join(_value(et, x) for x in items)
    return struct.pack(_SCALAR[t], v)


def _put(buf: bytes, pos: int, b: bytes) -> bytes:
    return buf[:pos] + b + buf[pos + len(b):]


# --- the cases ---------------------------------------------------------------------------------------

EDGES = [0, 1, 2, 3, 4, 5, 63, 64, 255, 2**16, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**62, 2**63 - 1, 2**63,
         2**64 - 1]

# "tokenid" (a special token id outside the vocabulary) may load: like llama.cpp, the loader drops
# such an id with a warning; it can never be sampled
STRUCTURAL = ["truncate", "flip", "bytes", "insert", "delete", "count", "strlen", "arrlen", "dupkey",
              "duptensor", "offset", "ndims", "ttype", "kvtype", "ne", "data", "tokenid"]
SEMANTIC = ["count-1", "eps", "block_count", "retype", "hparam", "wrongtype", "droptensor", "rename", "nan"]


# mmproj files: the same structural edits (no tokenizer), semantic edits of the clip.* metadata and tensors
STRUCTURAL_MMPROJ = [k for k in STRUCTURAL if k != "tokenid"]
SEMANTIC_MMPROJ = ["count-1", "retype", "droptensor", "nan", "mm-eps", "mm-block_count", "mm-hparam",
                   "mm-wrongtype", "mm-meanstd", "mm-act", "mm-projector", "mm-rename", "mm-extratensor"]
KINDS = {"model": (STRUCTURAL, SEMANTIC), "mmproj": (STRUCTURAL_MMPROJ, SEMANTIC_MMPROJ)}


def make_case(base: bytes, hdr: Header, seed: int, i: int, target: str = "model") -> tuple[str, str, bytes, bool]:
    """Case ``i``: ``(kind, description, file bytes, semantic)``; a pure function of its arguments."""
    rng = random.Random(f"{seed}:{i}")
    structural, semantic_kinds = KINDS[target]
    # about one case in three is a semantic edit
    semantic = rng.random() < 0.35
    kind = rng.choice(semantic_kinds if semantic else structural)
    desc, data = globals()["_case_" + kind.replace("-", "_")](base, hdr, rng)
    return kind, desc, data, semantic


def _case_truncate(base, hdr, rng):
    n = rng.randrange(hdr.data_start + 64) if rng.random() < 0.6 else rng.randrange(len(base))
    return f"truncate at {n}", base[:n]


def _case_flip(base, hdr, rng):
    out, what = base, []
    for _ in range(rng.randint(1, 4)):
        p, b = rng.randrange(hdr.header_end), rng.randrange(8)
        out = _put(out, p, bytes([out[p] ^ (1 << b)]))
        what.append(f"{p}.{b}")
    return f"flip bits {' '.join(what)}", out


def _case_bytes(base, hdr, rng):
    out, what = base, []
    for _ in range(rng.randint(1, 4)):
        p, v = rng.randrange(hdr.header_end), rng.randrange(256)
        out = _put(out, p, bytes([v]))
        what.append(f"{p}={v}")
    return f"bytes {' '.join(what)}", out


def _case_insert(base, hdr, rng):
    p = rng.randrange(hdr.header_end)
    junk = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    return f"insert {junk.hex()} at {p}", base[:p] + junk + base[p:]


def _case_delete(base, hdr, rng):
    p, n = rng.randrange(hdr.header_end), rng.randint(1, 16)
    return f"delete {n} bytes at {p}", base[:p] + base[p + n:]


def _case_count(base, hdr, rng):
    which, v = rng.choice(("n_tensors", "n_kv")), rng.choice(EDGES + [len(hdr.tinfos) + 1, len(hdr.kvs) + 1])
    return f"{which} = {v}", _put(base, 8 if which == "n_tensors" else 16, struct.pack("<Q", v))


def _case_strlen(base, hdr, rng):
    # a key's length, a string value's length or a tensor name's length
    v = rng.choice(EDGES)
    if rng.random() < 0.5:
        i = rng.randrange(len(hdr.kvs))
        key, t, chunk, vo = hdr.kvs[i]
        if t == STRING and rng.random() < 0.5:
            kvs = list(hdr.kvs)
            kvs[i] = (key, t, _put(chunk, vo, struct.pack("<Q", v)), vo)
            return f"string length of {key} = {v}", hdr.build(kvs=kvs)
        kvs = list(hdr.kvs)
        kvs[i] = (key, t, _put(chunk, 0, struct.pack("<Q", v)), vo)
        return f"key length of {key} = {v}", hdr.build(kvs=kvs)
    i = rng.randrange(len(hdr.tinfos))
    tinfos = list(hdr.tinfos)
    tinfos[i] = (tinfos[i][0], _put(tinfos[i][1], 0, struct.pack("<Q", v)))
    return f"name length of tensor {hdr.tinfos[i][0]} = {v}", hdr.build(tinfos=tinfos)


def _case_arrlen(base, hdr, rng):
    v = rng.choice(EDGES)
    key = rng.choice(["test.array.ints", "test.array.strings"])
    extra = (kv_chunk("test.array.ints", ARRAY, (5, [1, 2, 3])) if key.endswith("ints") else
             kv_chunk("test.array.strings", ARRAY, (STRING, ["a", "bc"])))
    k, t, chunk, vo = extra
    kvs = list(hdr.kvs) + [(k, t, _put(chunk, vo + 4, struct.pack("<Q", v)), vo)]
    return f"array {key} of {v} elements", hdr.build(kvs=kvs)


def _case_dupkey(base, hdr, rng):
    i = rng.randrange(len(hdr.kvs))
    kvs = list(hdr.kvs)
    kvs.insert(rng.randrange(len(kvs) + 1), hdr.kvs[i])
    return f"duplicate key {hdr.kvs[i][0]}", hdr.build(kvs=kvs)


def _case_duptensor(base, hdr, rng):
    i = rng.randrange(len(hdr.tinfos))
    tinfos = list(hdr.tinfos) + [hdr.tinfos[i]]
    return f"duplicate tensor info {hdr.tinfos[i][0]}", hdr.build(tinfos=tinfos)


def _tinfo_edit(hdr, i, at, b):
    tinfos = list(hdr.tinfos)
    tinfos[i] = (tinfos[i][0], _put(tinfos[i][1], at, b))
    return hdr.build(tinfos=tinfos)


def _case_offset(base, hdr, rng):
    i = rng.randrange(len(hdr.tinfos))
    f = hdr.tinfo_fields(i)
    v = rng.choice(EDGES + [f["offset"] + hdr.alignment, max(0, f["offset"] - hdr.alignment), len(hdr.section)])
    return f"offset of {hdr.tinfos[i][0]} = {v}", _tinfo_edit(hdr, i, f["offset_at"], struct.pack("<Q", v))


def _case_ndims(base, hdr, rng):
    i = rng.randrange(len(hdr.tinfos))
    v = rng.choice([0, 5, 6, 8, 255, 2**16, 2**31, 2**32 - 1])
    return f"n_dims of {hdr.tinfos[i][0]} = {v}", _tinfo_edit(hdr, i, hdr.tinfo_fields(i)["n_dims_at"],
                                                             struct.pack("<I", v))


def _case_ttype(base, hdr, rng):
    i = rng.randrange(len(hdr.tinfos))
    v = rng.choice([4, 5, 31, 32, 33, 36, 39, 40, 41, 64, 255, 2**31 - 1, 2**31, 2**32 - 1] + list(range(0, 40)))
    return f"type of {hdr.tinfos[i][0]} = {v}", _tinfo_edit(hdr, i, hdr.tinfo_fields(i)["type_at"],
                                                           struct.pack("<I", v))


def _case_kvtype(base, hdr, rng):
    i = rng.randrange(len(hdr.kvs))
    key, t, chunk, vo = hdr.kvs[i]
    v = rng.choice([13, 14, 255, 2**31, 2**32 - 1] + list(range(13)))
    kvs = list(hdr.kvs)
    kvs[i] = (key, t, _put(chunk, vo - 4, struct.pack("<I", v)), vo)
    return f"value type of {key} = {v}", hdr.build(kvs=kvs)


def _case_ne(base, hdr, rng):
    i = rng.randrange(len(hdr.tinfos))
    f = hdr.tinfo_fields(i)
    d = rng.randrange(f["n_dims"])
    v = rng.choice(EDGES[:-3] + [-1, -2**63, f["ne"][d] + 1, f["ne"][d] * 2, max(f["ne"][d] - 1, 0)])
    return (f"ne[{d}] of {hdr.tinfos[i][0]} = {v}",
            _tinfo_edit(hdr, i, f["ne_at"] + 8 * d, struct.pack("<q", v)))


def _case_data(base, hdr, rng):
    out, what = base, []
    for _ in range(rng.randint(1, 8)):
        p, v = rng.randrange(hdr.data_start, len(base)), rng.randrange(256)
        out = _put(out, p, bytes([v]))
        what.append(f"{p}={v}")
    return f"data bytes {' '.join(what)}", out


# semantic edits: each leaves a well-formed file that no model loader should accept

def _set_kv(hdr, key, t, value):
    kvs = list(hdr.kvs)
    kvs[hdr.kv_index(key)] = kv_chunk(key, t, value)
    return hdr.build(kvs=kvs)


def _case_count_1(base, hdr, rng):
    return "n_tensors one fewer", _put(base, 8, struct.pack("<Q", len(hdr.tinfos) - 1))


def _case_eps(base, hdr, rng):
    v = rng.choice([math.inf, -math.inf, math.nan, 0.0, -1e-5, 5.0])
    return f"rms_eps = {v}", _set_kv(hdr, "llama.attention.layer_norm_rms_epsilon", 6, v)


def _case_block_count(base, hdr, rng):
    v = rng.choice([0, 1, 3, 4, 64, 2**28, 2**31 - 1, 2**32 - 1])
    return f"block_count = {v}", _set_kv(hdr, "llama.block_count", 4, v)


def _case_retype(base, hdr, rng):
    f16 = [i for i in range(len(hdr.tinfos)) if hdr.tinfo_fields(i)["type"] == F16]
    if f16:
        i = rng.choice(f16)
        return (f"{hdr.tinfos[i][0]} F16 -> BF16",
                _tinfo_edit(hdr, i, hdr.tinfo_fields(i)["type_at"], struct.pack("<I", BF16)))
    f32 = [i for i in range(len(hdr.tinfos)) if hdr.tinfo_fields(i)["type"] == F32]
    i = rng.choice(f32)
    return f"{hdr.tinfos[i][0]} F32 -> I32", _tinfo_edit(hdr, i, hdr.tinfo_fields(i)["type_at"], struct.pack("<I", I32))


# values that contradict the tiny model's tensors (n_embd 64, 4 heads / 2 kv heads of 16, ff 192,
# vocab 512) or are out of any sane range
_HPARAM = {
    "llama.embedding_length": [32, 63, 65, 128, 0, 2**31],
    "llama.attention.head_count": [2, 8, 0, 3, 2**20],
    "llama.attention.head_count_kv": [1, 4, 0, 3, 2**20],
    "llama.feed_forward_length": [191, 96, 0, 2**31],
    "llama.vocab_size": [511, 513, 0, 2**31 - 1, 2**32 - 1],
    "llama.context_length": [0, 2**31, 2**32 - 1],
    "llama.rope.dimension_count": [0, 17, 18, 2**31],
    "llama.rope.freq_base": [math.nan, math.inf, 0.0, -10000.0],
    "llama.attention.key_length": [8, 32, 0, 2**31],
}


def _case_hparam(base, hdr, rng):
    key = rng.choice(sorted(_HPARAM))
    v = rng.choice(_HPARAM[key])
    t = 6 if isinstance(v, float) else 4
    if key in [k for k, *_ in hdr.kvs]:
        return f"{key} = {v}", _set_kv(hdr, key, t, v)
    return f"{key} = {v} (added)", hdr.build(kvs=list(hdr.kvs) + [kv_chunk(key, t, v)])


def _case_wrongtype(base, hdr, rng):
    key, t, v = rng.choice([
        ("llama.block_count", STRING, "2"), ("llama.block_count", 6, 2.0),
        ("llama.block_count", ARRAY, (STRING, ["2"])),
        ("llama.block_count", 7, True), ("llama.embedding_length", 6, 64.0), ("llama.embedding_length", STRING, "64"),
        ("llama.attention.layer_norm_rms_epsilon", STRING, "1e-5"), ("llama.attention.head_count", 12, 4.0),
        ("llama.vocab_size", ARRAY, (4, [512, 512])), ("llama.context_length", STRING, "2048"),
        ("llama.attention.head_count", ARRAY, (4, [4, 2])), ("general.architecture", 4, 7),
        ("llama.rope.freq_base", STRING, "10000"),
    ])
    return f"{key} as type {t} = {v!r}", _set_kv(hdr, key, t, v)


def _case_droptensor(base, hdr, rng):
    names = [n for n, _ in hdr.tinfos if n != "output.weight"]
    n = rng.choice(names)
    tinfos = [x for x in hdr.tinfos if x[0] != n]
    return f"drop tensor info {n}", hdr.build(tinfos=tinfos)


def _case_rename(base, hdr, rng):
    # a layer tensor moved to a layer index the block count does not have (same name length)
    i = rng.choice([j for j, (n, _) in enumerate(hdr.tinfos) if n.startswith("blk.1.")])
    name = hdr.tinfos[i][0]
    new = "blk." + str(rng.choice([2, 3, 7, 9])) + name[5:]
    chunk = hdr.tinfos[i][1]
    chunk = chunk[:8] + new.encode() + chunk[8 + len(name):]
    tinfos = list(hdr.tinfos)
    tinfos[i] = (new, chunk)
    return f"rename {name} -> {new}", hdr.build(tinfos=tinfos)


def _case_nan(base, hdr, rng):
    i = rng.choice([j for j in range(len(hdr.tinfos)) if hdr.tinfo_fields(j)["type"] in (F32, F16, 8)])
    f = hdr.tinfo_fields(i)
    at = hdr.data_start + f["offset"]
    v = rng.choice(["nan", "inf"])
    if f["type"] == F32:
        b = struct.pack("<f", math.nan if v == "nan" else math.inf)
    else:   # F16, or the F16 scale that starts a Q8_0 block
        b = struct.pack("<H", 0x7E00 if v == "nan" else 0x7C00)
    return f"{v} at the start of {hdr.tinfos[i][0]}", _put(base, at, b)


def _case_tokenid(base, hdr, rng):
    key = rng.choice(["tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"])
    v = rng.choice([512, 513, 2**31 - 1, 2**32 - 1])
    return f"{key} = {v}", hdr.build(kvs=list(hdr.kvs) + [kv_chunk(key, 4, v)])


# --- mmproj (vision encoder) files: the bases and the semantic edits of their clip.* metadata ---------------

def write_mmproj(path, projector: str = "gemma3", type: str = "F32", seed: int = 0, n_embd: int = 64,
                 n_ff: int = 128, n_layer: int = 2, n_head: int = 4, image_size: int = 64, patch_size: int = 8,
                 n_embd_text: int = 64, scale_factor: int = 2):
    """A tiny random-weight mmproj file in the layout llama.cpp's converter writes (the keys and tensors
    of tests/vision_helpers.py's converted fixtures; torch-free).

    ``type`` is the matrices' type (``F32``, ``F16`` or ``Q8_0``); as the converter does, biases, norms
    and the position embeddings stay F32, the patch embedding is F16 only in an F16 file, gemma3's
    projection is always F16. The default sizes give 64 patches and 16 tokens per image of width 64 (the
    tiny synthetic text model's ``n_embd``); idefics3's ``preproc_image_size`` is ``2 * image_size``.
    """
    import numpy as np

    from ggmlpy import gguf
    from ggmlpy.gguf import Type, ValueType

    rng = np.random.default_rng(seed)

    def w(*shape, s=0.02):
        return (rng.standard_normal(shape) * s).astype(np.float32)
    mat = {"F32": None, "F16": Type.F16, "Q8_0": Type.Q8_0}[type]
    e, p = n_embd, patch_size
    with gguf.GGUFWriter(path, arch="clip") as g:
        g.add("general.type", "mmproj")
        g.add("general.name", f"tiny {projector} encoder")
        g.add("clip.has_vision_encoder", True)
        g.add("clip.projector_type", projector)
        g.add("clip.use_gelu", True)
        for k, v in (("image_size", image_size), ("patch_size", p), ("embedding_length", e),
                     ("feed_forward_length", n_ff), ("block_count", n_layer), ("attention.head_count", n_head),
                     ("projection_dim", n_embd_text), ("projector.scale_factor", scale_factor)):
            g.add(f"clip.vision.{k}", v, ValueType.UINT32)
        g.add("clip.vision.attention.layer_norm_epsilon", 1e-6, ValueType.FLOAT32)
        g.add_array("clip.vision.image_mean", np.full(3, 0.5, np.float32))
        g.add_array("clip.vision.image_std", np.full(3, 0.5, np.float32))
        if projector == "idefics3":
            g.add("clip.vision.preproc_image_size", 2 * image_size, ValueType.UINT32)
        g.add_tensor("v.patch_embd.weight", w(e, 3, p, p), type=Type.F16 if type == "F16" else None)
        g.add_tensor("v.patch_embd.bias", w(e))
        g.add_tensor("v.position_embd.weight", w((image_size // p) ** 2, e))
        for i in range(n_layer):
            b = f"v.blk.{i}."
            for x in ("q", "k", "v", "out"):
                g.add_tensor(f"{b}attn_{x}.weight", w(e, e), type=mat)
                g.add_tensor(f"{b}attn_{x}.bias", w(e))
            for x in ("ln1", "ln2"):
                g.add_tensor(f"{b}{x}.weight", 1 + w(e))
                g.add_tensor(f"{b}{x}.bias", w(e))
            g.add_tensor(f"{b}ffn_up.weight", w(n_ff, e), type=mat)
            g.add_tensor(f"{b}ffn_up.bias", w(n_ff))
            g.add_tensor(f"{b}ffn_down.weight", w(e, n_ff), type=mat)
            g.add_tensor(f"{b}ffn_down.bias", w(e))
        g.add_tensor("v.post_ln.weight", 1 + w(e))
        g.add_tensor("v.post_ln.bias", w(e))
        if projector == "gemma3":
            g.add_tensor("mm.soft_emb_norm.weight", 1 + w(e))
            g.add_tensor("mm.input_projection.weight", w(e, n_embd_text), type=Type.F16)
        else:
            g.add_tensor("mm.model.fc.weight", w(n_embd_text, e * scale_factor ** 2), type=mat)
    return path


def _projector(hdr) -> str:
    key, t, chunk, vo = hdr.kvs[hdr.kv_index("clip.projector_type")]
    return chunk[vo + 8:].decode()


def _set_or_add_kv(hdr, key, t, value):
    kvs = list(hdr.kvs)
    if key in [k for k, *_ in kvs]:
        kvs[hdr.kv_index(key)] = kv_chunk(key, t, value)
    else:
        kvs.append(kv_chunk(key, t, value))
    return hdr.build(kvs=kvs)


def _case_mm_eps(base, hdr, rng):
    v = rng.choice([math.inf, -math.inf, math.nan, 0.0, -1e-6, 5.0])
    return f"clip eps = {v}", _set_kv(hdr, "clip.vision.attention.layer_norm_epsilon", 6, v)


def _case_mm_block_count(base, hdr, rng):
    v = rng.choice([0, 1, 3, 4, 64, 513, 2**31 - 1, 2**32 - 1])
    return f"clip block_count = {v}", _set_kv(hdr, "clip.vision.block_count", 4, v)


# values that contradict the bases' tensors (image 64 / patch 8, width 64, 4 heads, ff 128, projection 64,
# scale 2) or are out of any sane range; a head count that divides the width, or a gemma3 pooling factor
# that divides the patch grid, cannot be told from the tensors and is not among them
_MM_HPARAM = {
    "clip.vision.image_size": [32, 128, 72, 0, 2**31 - 1, 2**32 - 1],
    "clip.vision.patch_size": [4, 16, 7, 0, 65, 2**31],
    "clip.vision.embedding_length": [32, 48, 128, 0, 2**31],
    "clip.vision.feed_forward_length": [64, 256, 127, 0, 2**31],
    "clip.vision.attention.head_count": [0, 3, 5, 7, 128, 2**20],
    "clip.vision.projection_dim": [32, 128, 63, 0, 2**31],
    "clip.vision.projector.scale_factor": [3, 5, 16, 0, 2**31],
    "clip.vision.preproc_image_size": [0, 5000, 1 << 20, 2**31 - 1, 2**32 - 1],
}


def _case_mm_hparam(base, hdr, rng):
    proj = _projector(hdr)
    keys = sorted(k for k in _MM_HPARAM if proj == "idefics3" or "preproc" not in k)
    key = rng.choice(keys)
    values = list(_MM_HPARAM[key])
    if key.endswith("scale_factor") and proj == "idefics3":
        values += [1, 4, 8]         # the pixel shuffle's width is in mm.model.fc's shape
    v = rng.choice(values)
    return f"{key} = {v}", _set_or_add_kv(hdr, key, 4, v)


def _case_mm_wrongtype(base, hdr, rng):
    key, t, v = rng.choice([
        ("clip.vision.block_count", STRING, "2"), ("clip.vision.block_count", 6, 2.0),
        ("clip.vision.block_count", 7, True), ("clip.vision.block_count", ARRAY, (4, [2])),
        ("clip.vision.image_size", 6, 64.0), ("clip.vision.embedding_length", STRING, "64"),
        ("clip.vision.attention.layer_norm_epsilon", STRING, "1e-6"), ("clip.projector_type", 4, 7),
        ("clip.projector_type", ARRAY, (STRING, ["gemma3"])), ("clip.vision.image_mean", STRING, "000"),
        ("clip.vision.image_std", STRING, "111"), ("clip.vision.image_mean", ARRAY, (STRING, ["0.5"] * 3)),
        ("clip.vision.image_std", ARRAY, (7, [True] * 3)), ("clip.vision.image_mean", 6, 0.5),
        ("clip.has_vision_encoder", 4, 1), ("clip.has_vision_encoder", STRING, "true"),
        ("clip.use_gelu", STRING, "true"), ("clip.use_gelu", 4, 1),
        ("clip.vision.projector.scale_factor", 6, 2.0), ("clip.vision.attention.head_count", 12, 4.0),
        ("general.architecture", 4, 7), ("clip.vision.patch_size", STRING, "8"),
    ])
    return f"{key} as type {t} = {v!r}", _set_or_add_kv(hdr, key, t, v)


def _case_mm_meanstd(base, hdr, rng):
    key = rng.choice(["clip.vision.image_mean", "clip.vision.image_std"])
    v = rng.choice([[0.5, 0.5], [0.5] * 4, [], [math.nan, 0.5, 0.5], [0.5, math.inf, 0.5], [-math.inf] * 3,
                    [1e30] * 3, [-0.5, 0.5, 0.5] if key.endswith("mean") else [0.5, 0.0, 0.5],
                    [0.5, 2.0, 0.5] if key.endswith("mean") else [0.5, -0.5, 0.5],
                    [0.5, 0.5, 1e-9] if key.endswith("std") else [0.5, 0.5, 7.0]])
    return f"{key} = {v}", _set_kv(hdr, key, ARRAY, (6, v))


def _case_mm_act(base, hdr, rng):
    what = rng.choice(["gelu-false", "gelu-missing", "silu"])
    if what == "gelu-false":
        return "clip.use_gelu = false (quick GELU)", _set_kv(hdr, "clip.use_gelu", 7, False)
    if what == "gelu-missing":
        kvs = [x for x in hdr.kvs if x[0] != "clip.use_gelu"]
        return "clip.use_gelu removed (quick GELU)", hdr.build(kvs=kvs)
    return "clip.use_silu = true", _set_or_add_kv(hdr, "clip.use_silu", 7, True)


def _case_mm_projector(base, hdr, rng):
    proj = _projector(hdr)
    other = "idefics3" if proj == "gemma3" else "gemma3"
    what = rng.choice(["swap", "unknown", "vision-key", "no-vision"])
    if what == "swap":
        return f"clip.projector_type = {other}", _set_kv(hdr, "clip.projector_type", STRING, other)
    if what == "unknown":
        v = rng.choice(["", "mlp", "idefics2", "gemma3 ", "GEMMA3", "qwen2vl_merger"])
        return f"clip.projector_type = {v!r}", _set_kv(hdr, "clip.projector_type", STRING, v)
    if what == "vision-key":
        # mixed-modality files name the vision projector here, and it wins (as in llama.cpp)
        return (f"clip.vision.projector_type = {other} (clip.projector_type {proj})",
                _set_or_add_kv(hdr, "clip.vision.projector_type", STRING, other))
    return "clip.has_vision_encoder = false", _set_kv(hdr, "clip.has_vision_encoder", 7, False)


def _case_mm_rename(base, hdr, rng):
    i = rng.choice([j for j, (n, _) in enumerate(hdr.tinfos) if n.startswith("v.blk.1.")])
    name = hdr.tinfos[i][0]
    new = "v.blk." + str(rng.choice([2, 3, 7, 9])) + name[7:]
    chunk = hdr.tinfos[i][1]
    tinfos = list(hdr.tinfos)
    tinfos[i] = (new, chunk[:8] + new.encode() + chunk[8 + len(name):])
    return f"rename {name} -> {new}", hdr.build(tinfos=tinfos)


def _case_mm_extratensor(base, hdr, rng):
    # a weight the encoder would not apply: CLIP's pre-LayerNorm, a projector bias, QK norms, a third layer
    name, n = rng.choice([("v.pre_ln.weight", 64), ("mm.model.fc.bias", 64), ("mm.input_projection.bias", 64),
                          ("v.blk.0.attn_q_norm.weight", 64), ("v.blk.2.ln1.weight", 64),
                          ("v.patch_embd.weight.1", 64), ("v.blk.0.ffn_gate.weight", 64 * 128)])
    raw = name.encode()
    info = struct.pack("<Q", len(raw)) + raw + struct.pack("<I", 1) + struct.pack("<q", n) + struct.pack("<I", F32)
    off = len(hdr.section) + (-len(hdr.section) % hdr.alignment)
    section = hdr.section + b"\0" * (off - len(hdr.section)) + struct.pack(f"<{n}f", *([0.01] * n))
    tinfos = list(hdr.tinfos) + [(name, info + struct.pack("<Q", off))]
    return f"extra tensor {name}", hdr.build(tinfos=tinfos, section=section)


# --- the child: runs cases, one JSON line each ---------------------------------------------------------

def run_cases(bases: list[str], seed: int, start: int, stop: int, work: str, target: str = "model") -> None:
    """Run cases ``start .. stop - 1``, printing ``start i`` before and a JSON result after each."""
    import numpy as np

    from ggmlpy import GGMLError, gguf
    from ggmlpy.models import load_model
    from ggmlpy.runner import Runner

    blobs = [open(b, "rb").read() for b in bases]
    hdrs = [Header(b) for b in blobs]
    path = os.path.join(work, f"case-{os.getpid()}.gguf")
    text = load_model(os.path.join(work, TEXT_MODEL), devices="cpu") if target == "mmproj" else None
    for i in range(start, stop):
        b = i % len(blobs)
        kind, desc, data, semantic = make_case(blobs[b], hdrs[b], seed, i, target)
        with open(path, "wb") as f:
            f.write(data)
        fuzz_pool.case_start(i)
        res = {"i": i, "base": b, "kind": kind, "desc": desc, "semantic": semantic}
        stage = "read"
        try:
            with gguf.GGUFReader(path) as r:
                for t in r.tensors:
                    a = r.tensor_data(t.name)
                    c = r.tensor_data(t.name, copy=True)
                    if a.tobytes() != c.tobytes():
                        raise AssertionError(f"mapped and copied data of {t.name} differ")
                for k in r.metadata:
                    r.kv_type(k)
            stage = "load"
            if target == "mmproj":
                stage, res["finite"] = _run_mmproj(path, text)
            else:
                with load_model(path, devices="cpu") as m:
                    stage = "decode"
                    with Runner(m, n_ctx=16) as rt:
                        logits = rt.decode([1, 2, 3])
                    if logits is None or logits.shape[-1] != m.n_vocab:
                        raise AssertionError(f"decode gave {None if logits is None else logits.shape} logits")
                # random bytes in the data may hold NaNs outside the rows the loader samples: noted, allowed
                res["finite"] = bool(np.all(np.isfinite(logits)))
            res["outcome"] = "loaded"
        except _Stage as st:
            e = st.__cause__
            res["stage"] = st.stage
            res["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            # an mmproj error must name the file (the reader's, the loader's and the runner's alike)
            res["outcome"] = ("rejected" if isinstance(e, (GGMLError, OSError)) and path in str(e)
                              else "unnamed-error" if isinstance(e, (GGMLError, OSError)) else "bad-exception")
        except (GGMLError, OSError) as e:
            res["outcome"] = "rejected"
            res["stage"] = stage
            res["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        except Exception as e:  # noqa: BLE001 -- the point: report any other class as a failure
            res["outcome"] = "bad-exception"
            res["stage"] = stage
            res["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        fuzz_pool.case_result(res)
    if text is not None:
        text.close()
    try:
        os.unlink(path)
    except OSError:
        pass


class _Stage(Exception):
    """An error of an mmproj case, raised from ``stage`` (the error itself is the cause)."""

    def __init__(self, stage: str) -> None:
        super().__init__(stage)
        self.stage = stage


def _run_mmproj(path: str, text) -> tuple[str, bool]:
    """Load the encoder, encode one image, and reserve a runner over ``text`` with it: (last stage, finite)."""
    import numpy as np

    from ggmlpy.runner import Runner
    from ggmlpy.vision import load_mmproj

    stage = "load"
    try:
        with load_mmproj(path) as vm:
            stage = "encode"
            c = vm.config
            px = np.random.default_rng(0).uniform(-1, 1, (1, 3, c.image_size, c.image_size)).astype(np.float32)
            out = vm.encode(px)
            if out.shape != (1, c.tokens_per_image, c.n_embd_text):
                raise AssertionError(f"encode gave {out.shape}")
            stage = "runner"
            with Runner(text, vision=vm, n_ctx=64, n_ubatch=64, n_batch=64):
                pass
            return stage, bool(np.all(np.isfinite(out)))
    except AssertionError:
        raise
    except Exception as e:
        raise _Stage(stage) from e


# --- the parent: batches, watchdog, summary -------------------------------------------------------------

#: the text model an mmproj case's runner takes (n_embd 64, the bases' projection width)
TEXT_MODEL = "text-F16.gguf"


def make_bases(folder: str, target: str = "model") -> list[str]:
    from ggmlpy.models.synthetic import write_synthetic

    out = []
    if target == "mmproj":
        text = os.path.join(folder, TEXT_MODEL)
        if not os.path.exists(text):
            write_synthetic(text, size="tiny", type="F16", seed=5)
        for proj, t in (("gemma3", "F32"), ("idefics3", "F16"), ("gemma3", "Q8_0"), ("idefics3", "F32")):
            p = os.path.join(folder, f"mmproj-{proj}-{t}.gguf")
            if not os.path.exists(p):
                write_mmproj(p, proj, t, seed=len(out))
            out.append(p)
        return out
    for t in ("F16", "Q8_0"):
        p = os.path.join(folder, f"base-{t}.gguf")
        if not os.path.exists(p):
            write_synthetic(p, size="tiny", type=t, seed=5)
        out.append(p)
    return out


def run(cases: int, seed: int = 0, jobs: int = 1, batch: int = 250, case_timeout: float = 20.0,
        work: str | None = None, start: int = 0, log=None, target: str = "model") -> dict:
    """Run ``cases`` cases (numbered from ``start``) in child processes; returns the summary dict.

    ``target``: ``"model"`` (text model files) or ``"mmproj"`` (vision encoder files)."""
    t0 = time.monotonic()
    with fuzz_pool.work_dir(work, "gguf-fuzz-") as work:
        bases = make_bases(work, target)
        summary = {"target": target, "cases": 0, "loaded": 0, "rejected": 0, "aborts": 0, "hangs": 0,
                   "bad_exceptions": 0, "unnamed_errors": 0, "silent_semantic_loads": 0, "semantic": 0,
                   "semantic_rejected": 0, "by_kind": {}, "failures": []}

        def record(res):
            summary["cases"] += 1
            k = summary["by_kind"].setdefault(res["kind"], {})
            k[res["outcome"]] = k.get(res["outcome"], 0) + 1
            if res["semantic"]:
                summary["semantic"] += 1
            out = res["outcome"]
            if out == "loaded":
                summary["loaded"] += 1
                if res["semantic"]:
                    summary["silent_semantic_loads"] += 1
                    summary["failures"].append(f"case {res['i']} ({res['desc']}): semantic edit loaded silently")
            elif out == "rejected":
                summary["rejected"] += 1
                if res["semantic"]:
                    summary["semantic_rejected"] += 1
            else:
                key = {"abort": "aborts", "hang": "hangs", "bad-exception": "bad_exceptions",
                       "unnamed-error": "unnamed_errors"}[out]
                summary[key] += 1
                summary["failures"].append(f"case {res['i']} ({res.get('desc', '?')}): {out} "
                                           f"{res.get('error', '')}".rstrip())
            if log is not None:
                log.write(json.dumps(res) + "\n")

        fuzz_pool.run_ranges(__file__, fuzz_pool.ranges(start, cases, batch), seed=seed, work=work,
                             jobs=jobs, case_timeout=case_timeout,
                             args=["--target", target, *bases], summary=summary, record=record,
                             describe=lambda i: _describe(bases, seed, i, target))
        return fuzz_pool.finish(summary, t0)


def _describe(bases, seed, i, target="model"):
    blob = open(bases[i % len(bases)], "rb").read()
    kind, desc, _, semantic = make_case(blob, Header(blob), seed, i, target)
    return {"i": i, "base": i % len(bases), "kind": kind, "desc": desc, "semantic": semantic}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", choices=sorted(KINDS), default="model",
                    help="model: text model files; mmproj: vision encoder files")
    fuzz_pool.add_options(ap, cases=300, batch=250, case_timeout=20.0, out="case.gguf",
                          work_help="folder for the base models and case files (default: a "
                                    "temporary one)")
    ap.add_argument("bases", nargs="*", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        run_cases(a.bases, a.seed, *fuzz_pool.child_range(a), a.work, a.target)
        return 0
    if a.write_case is not None:
        work = a.work or tempfile.mkdtemp(prefix="gguf-fuzz-")
        bases = make_bases(work, a.target)
        blob = open(bases[a.write_case % len(bases)], "rb").read()
        kind, desc, data, semantic = make_case(blob, Header(blob), a.seed, a.write_case, a.target)
        with open(a.out, "wb") as f:
            f.write(data)
        print(json.dumps({"case": a.write_case, "kind": kind, "desc": desc, "semantic": semantic, "out": a.out}))
        return 0

    def go(log):
        return run(a.cases, a.seed, a.jobs, a.batch, a.case_timeout, a.work, a.start, log, a.target)

    return fuzz_pool.run_main(a.log, go)


if __name__ == "__main__":
    sys.exit(main())
