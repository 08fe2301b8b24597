"""Hostile KV-state files (``ggmlpy.kvcache.state``) against ``Runner.load_state``, in child processes.

The bases are states saved by ``Runner.save_state`` from tiny synthetic models (written by
``ggmlpy.models.synthetic``): a llama (one :class:`~ggmlpy.kvcache.Causal` cache) and a 6-layer gemma3
(a :class:`~ggmlpy.kvcache.Wrapper` of a sliding-window cache that drops old positions and a full
cache), plus a state of a second llama
of the same shape and other weights. Case ``i`` of a run is a pure function of ``(base, seed, i)``, so
any case can be written out again (``--write-case``). Each case is one edit of a base state:

* structural, without fixing the checksum (every one must be refused): truncations, bit flips, random
  bytes, inserted / deleted / appended bytes, the header length, version and magic set to edge values;
* semantic, checksum fixed (the file is well-formed; each must be refused): tokens of the wrong JSON
  type, outside the vocabulary, one too many or few, missing; the model fingerprint edited (weights,
  desc, sizes, types, keys) or of the older format; the state of the other model; unknown, missing or
  mistyped header and cache keys, ints out of range, huge counts, other types and layouts, the Wrapper's
  routing; JSON nested past the bound, NaN, non-UTF-8 or broken JSON; positions negative, not
  increasing, beyond the context, with a gap; a cell dropped from a section;
* benign, checksum fixed (must load, exactly): the header re-serialized (spaces, key order), another
  saved sequence id, another ``memory``, the token record emptied, an image row among the tokens (then
  the record is dropped).

Each case is loaded into sequence 0 of a runner over the base's model whose sequences 0 and 1 both hold
tokens (every fourth case through a non-seekable stream). A refusal must be a ``StateError`` or
``KVCacheFull`` and leave every cache cell, every K/V byte of both sequences and the slot table as they
were; a load must put exactly the base's rows under sequence 0, leave sequence 1 alone and record the
file's tokens. Children handle a batch of cases each; the parent watches them: a negative return code
is an abort (the case is named), a case that makes no progress for ``--case-timeout`` seconds is a hang
(the pool of children is ``tests/fuzz_pool.py``, shared with the other fuzzers).

Usage::

    python tests/state_fuzz.py --cases 5000 --jobs 2            # the long run
    python tests/state_fuzz.py --cases 300 --seed 7              # a sample
    python tests/state_fuzz.py --write-case 123 --seed 7 --out case.state   # reproduce one case

The last line on stdout is a JSON summary: counts per outcome and per kind, wall time and the failures.
Exit status 0 when there are none. The suite runs a sample (``GGMLPY_STATE_FUZZ_CASES``, default 120).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import io
import json
import os
import random
import struct
import sys
import tempfile
import time

import fuzz_pool

MAGIC = b"GGMLKVSQ"
PRE = struct.Struct("<8sII")
EDGES = [0, 1, 2, 3, 15, 16, 17, 255, 2**16, 2**24, 2**31 - 1, 2**31, 2**32 - 1]
BIG = [2**31 - 1, 2**31, 2**32, 2**53, 2**63, 10**30, -1, -2**31, -2**31 - 1]
N_CTX = 32
# batches of 4: the sliding-window cache keeps its memory (4) plus a batch, so a state of PREFIX holds
# positions 8 .. 15 there
RUNNER = dict(n_ctx=N_CTX, n_seq_max=2, n_batch=4, n_ubatch=4, type_k="f16", type_v="f16")
# the base runners' fills: sequence 0 saved after PREFIX, then MORE added; sequence 1 holds OTHER
PREFIX = [5, 17, 250, 3, 99, 42, 7, 300, 128, 64, 11, 200, 1, 2, 3, 4]
MORE = [11, 12]
OTHER = [9, 8, 7, 6, 5]
# the models' vocabulary (synthetic "tiny")
N_VOCAB = 512


# --- a state file, parsed (well-formed bases only) ----------------------------------------------------

class State:
    """A well-formed state split into its parts: version, header (parsed), body, per-cache section spans."""

    def __init__(self, data: bytes) -> None:
        magic, self.version, n = PRE.unpack_from(data)
        assert magic == MAGIC
        self.data = data
        self.raw_header = data[PRE.size:PRE.size + n]
        self.header = json.loads(self.raw_header)
        self.body = data[PRE.size + n:-32]
        self.sections = []          # (start in body, count, row bytes per layer [(k, v)])
        at = 0
        for cfg in self.header["caches"]:
            n, layer = cfg["count"], cfg["k_row_bytes"] + cfg["v_row_bytes"]
            self.sections.append((at, cfg))
            at += n * (4 + cfg["n_layers"] * layer)
        assert at == len(self.body)

    def build(self, header=None, body=None, raw_header: bytes | None = None, version=None,
              rehash: bool = True) -> bytes:
        if raw_header is None:
            raw_header = json.dumps(self.header if header is None else header, separators=(",", ":")).encode()
        d = PRE.pack(MAGIC, self.version if version is None else version, len(raw_header)) + raw_header + \
            (self.body if body is None else body)
        return d + (hashlib.sha256(d).digest() if rehash else self.data[-32:])

    def positions(self, k: int) -> list:
        at, cfg = self.sections[k]
        return list(struct.unpack_from(f"<{cfg['count']}i", self.body, at))

    def with_positions(self, k: int, pos) -> bytes:
        at, cfg = self.sections[k]
        raw = struct.pack(f"<{cfg['count']}i", *pos)
        return self.build(body=self.body[:at] + raw + self.body[at + len(raw):])

    def drop_cell(self, k: int, which: int) -> bytes:
        """Section ``k`` without its first (0) or last (-1) cell: count, positions and every row."""
        at, cfg = self.sections[k]
        n = cfg["count"]
        keep = list(range(1, n)) if which == 0 else list(range(n - 1))
        out = [struct.pack(f"<{n - 1}i", *[self.positions(k)[j] for j in keep])]
        pos = at + 4 * n
        krb, vrb = cfg["k_row_bytes"], cfg["v_row_bytes"]
        for _layer in range(cfg["n_layers"]):
            kb = self.body[pos:pos + n * krb]
            out.append(b"".join(kb[j * krb:(j + 1) * krb] for j in keep))
            vb = self.body[pos + n * krb:pos + n * (krb + vrb)]
            if cfg["v_trans"]:          # one row per channel, of n elements
                es = vrb // cfg["n_embd_v"]
                out.append(b"".join(vb[c * n * es + keep[0] * es:c * n * es + (keep[-1] + 1) * es]
                                    for c in range(cfg["n_embd_v"])) if keep else b"")
            else:
                out.append(b"".join(vb[j * vrb:(j + 1) * vrb] for j in keep))
            pos += n * (krb + vrb)
        header = copy.deepcopy(self.header)
        header["caches"][k]["count"] = n - 1
        body = self.body[:at] + b"".join(out) + self.body[pos:]
        return self.build(header=header, body=body)


def _put(buf: bytes, pos: int, b: bytes) -> bytes:
    return buf[:pos] + b + buf[pos + len(b):]


# --- the cases ------------------------------------------------------------------------------------------

STRUCTURAL = ["truncate", "flip", "bytes", "insert", "delete", "append", "hlen", "version", "magic"]
SEMANTIC = ["tokens-type", "tokens-range", "tokens-count", "tokens-missing", "model", "old-format", "foreign",
            "meta", "top", "cache", "caches", "routing", "nesting", "json", "positions", "drop-cell"]
BENIGN = ["reformat", "seq-id", "memory", "tokens-empty", "tokens-image"]


def make_case(bases: list, seed: int, i: int) -> tuple[int, str, str, bytes, str]:
    """Case ``i``: ``(base, kind, description, file bytes, expect)``, expect one of ``reject``/``load``."""
    rng = random.Random(f"{seed}:{i}")
    b = i % 2
    st, foreign = bases[b], bases[2]
    r = rng.random()
    group = STRUCTURAL if r < 0.4 else SEMANTIC if r < 0.9 else BENIGN
    kind = rng.choice(group)
    desc, data = globals()["_case_" + kind.replace("-", "_")](st, foreign, rng)
    expect = "load" if group is BENIGN or data == st.data else "reject"
    return b, kind, desc, data, expect


def _case_truncate(st, _f, rng):
    d = st.data
    marks = [0, 1, 8, 15, 16, PRE.size + len(st.raw_header) - 1, PRE.size + len(st.raw_header),
             len(d) - 33, len(d) - 32, len(d) - 1]
    at = rng.choice(marks) if rng.random() < 0.4 else rng.randrange(len(d))
    return f"cut at {at}", d[:at]


def _case_flip(st, _f, rng):
    at = rng.randrange(len(st.data))
    bit = rng.randrange(8)
    return f"flip bit {bit} at {at}", _put(st.data, at, bytes([st.data[at] ^ (1 << bit)]))


def _case_bytes(st, _f, rng):
    n = rng.randint(1, 16)
    at = rng.randrange(len(st.data) - n)
    return f"{n} random bytes at {at}", _put(st.data, at, rng.randbytes(n))


def _case_insert(st, _f, rng):
    n, at = rng.randint(1, 16), rng.randrange(len(st.data))
    return f"{n} bytes inserted at {at}", st.data[:at] + rng.randbytes(n) + st.data[at:]


def _case_delete(st, _f, rng):
    n = rng.randint(1, 16)
    at = rng.randrange(len(st.data) - n)
    return f"{n} bytes deleted at {at}", st.data[:at] + st.data[at + n:]


def _case_append(st, _f, rng):
    n = rng.randint(1, 64)
    return f"{n} bytes appended", st.data + rng.randbytes(n)


def _case_hlen(st, _f, rng):
    v = rng.choice(EDGES + [len(st.raw_header) + rng.randint(-8, 8)])
    return f"header length {v}", _put(st.data, 12, struct.pack("<I", v & 0xFFFFFFFF))


def _case_version(st, _f, rng):
    v = rng.choice([0, 2, 3, 255, 2**31, 2**32 - 1])
    return f"version {v}", _put(st.data, 8, struct.pack("<I", v))


def _case_magic(st, _f, rng):
    at = rng.randrange(8)
    return f"magic byte {at}", _put(st.data, at, bytes([st.data[at] ^ (1 + rng.randrange(255))]))


WRONG_TYPES = ["5", 5.0, True, False, None, [5], {"t": 5}, "", "x" * 3]


def _with(st, fn) -> bytes:
    h = copy.deepcopy(st.header)
    fn(h)
    return st.build(header=h)


def _case_tokens_type(st, _f, rng):
    v = rng.choice(WRONG_TYPES)
    if rng.random() < 0.3:
        return f"every token {v!r}", _with(st, lambda h: h["meta"].update(tokens=[v] * len(h["meta"]["tokens"])))
    j = rng.randrange(len(PREFIX))
    return f"token {j} = {v!r}", _with(st, lambda h: h["meta"]["tokens"].__setitem__(j, v))


def _case_tokens_range(st, _f, rng):
    # ids -2 .. -2**31 are image rows (benign: see _case_tokens_image)
    v = rng.choice([N_VOCAB, N_VOCAB + 1, 2 * N_VOCAB, -1] + [b for b in BIG if not -2**31 <= b <= -2])
    j = rng.randrange(len(PREFIX))
    return f"token {j} = {v}", _with(st, lambda h: h["meta"]["tokens"].__setitem__(j, v))


def _case_tokens_count(st, _f, rng):
    how = rng.choice(["drop", "add", "double", "one"])
    edits = {"drop": lambda t: t[:-1], "add": lambda t: t + [1], "double": lambda t: t + t, "one": lambda t: t[:1]}
    return f"tokens: {how}", _with(st, lambda h: h["meta"].update(tokens=edits[how](h["meta"]["tokens"])))


def _case_tokens_missing(st, _f, rng):
    v = rng.choice(["drop", "1,2,3", 3, {"0": 5}, None])
    if v == "drop":
        return "no tokens", _with(st, lambda h: h["meta"].pop("tokens"))
    return f"tokens = {v!r}", _with(st, lambda h: h["meta"].update(tokens=v))


def _case_model(st, _f, rng):
    key = rng.choice(sorted(st.header["meta"]["model"]) + ["*add", "*drop", "*whole"])
    if key == "*add":
        return "fingerprint key added", _with(st, lambda h: h["meta"]["model"].update(extra=1))
    if key == "*drop":
        k = rng.choice(sorted(st.header["meta"]["model"]))
        return f"fingerprint without {k}", _with(st, lambda h: h["meta"]["model"].pop(k))
    if key == "*whole":
        v = rng.choice([None, [], "llama", 0])
        return f"model = {v!r}", _with(st, lambda h: h["meta"].update(model=v))
    old = st.header["meta"]["model"][key]
    if isinstance(old, str):
        v = rng.choice([old[:-1] + ("0" if old[-1:] != "0" else "1"), old.upper() if old.upper() != old else old + "x",
                        None, 1, ""])
    else:
        v = rng.choice([old + 1, old - 1, str(old), float(old), None, True, [old]])
    return f"fingerprint {key} = {v!r}", _with(st, lambda h: h["meta"]["model"].__setitem__(key, v))


def _case_old_format(st, _f, rng):
    return "fingerprint without weights (older ggmlpy)", _with(st, lambda h: h["meta"]["model"].pop("weights", None))


def _case_foreign(st, foreign, rng):
    return "the state of another model of the same shape", foreign.data


def _case_meta(st, _f, rng):
    how = rng.choice(["key", "list", "null", "empty"])
    if how == "key":
        return "meta key added", _with(st, lambda h: h["meta"].update(note="x"))
    v = {"list": [], "null": None, "empty": {}}[how]
    return f"meta = {v!r}", _with(st, lambda h: h.update(meta=v))


def _case_top(st, _f, rng):
    how = rng.choice(["unknown", "drop", "format", "kind", "seq"])
    if how == "unknown":
        return "unknown header key", _with(st, lambda h: h.update(extra=rng.choice([1, None, "x"])))
    if how == "drop":
        k = rng.choice(sorted(st.header))
        return f"header without {k}", _with(st, lambda h: h.pop(k))
    if how == "format":
        return "another format", _with(st, lambda h: h.update(format=rng.choice(["x", None, 1, "ggmlpy.kvcache"])))
    if how == "kind":
        v = rng.choice(["Wrapper" if st.header["kind"] == "Causal" else "Causal", "causal", None, 1, "Encoder"])
        return f"kind = {v!r}", _with(st, lambda h: h.update(kind=v))
    v = rng.choice([-1, 2**31, True, 1.0, "0", None, [0]])
    return f"seq = {v!r}", _with(st, lambda h: h.update(seq=v))


INT_KEYS = ["n_layers", "n_embd_k", "n_embd_v", "n_head_kv", "k_row_bytes", "v_row_bytes", "count"]


def _case_cache(st, _f, rng):
    k = rng.randrange(len(st.header["caches"]))
    key = rng.choice(INT_KEYS + ["type_k", "type_v", "v_trans", "window", "*add", "*drop"])
    if key == "*add":
        return f"cache {k}: key added", _with(st, lambda h: h["caches"][k].update(extra=0))
    if key == "*drop":
        d = rng.choice(sorted(st.header["caches"][k]))
        return f"cache {k} without {d}", _with(st, lambda h: h["caches"][k].pop(d))
    old = st.header["caches"][k][key]
    if key in INT_KEYS:
        v = rng.choice([old + 1, old - 1, 0, old * 2, float(old), str(old), True, None] + BIG)
        if v == old and type(v) is type(old):
            v = old + 1
    elif key in ("type_k", "type_v"):
        v = rng.choice(["F32", "Q8_0", "BF16", "f16", "", None, 1, "F16 "])
        if v == old:
            v = "Q4_0"
    elif key == "v_trans":
        v = rng.choice([not old, int(old), None, "true"])
    else:
        v = rng.choice([0, -1, 4, 511 if old != 511 else 512, "4", 4.0, True]) if old is not None else \
            rng.choice([4, 0, -1, "x", True])
    return f"cache {k}: {key} = {v!r}", _with(st, lambda h: h["caches"][k].__setitem__(key, v))


def _case_caches(st, _f, rng):
    how = rng.choice(["empty", "dup", "drop", "notlist", "item"])
    if how == "empty":
        return "caches = []", _with(st, lambda h: h.update(caches=[]))
    if how == "dup":
        return "a cache twice", _with(st, lambda h: h["caches"].append(copy.deepcopy(h["caches"][0])))
    if how == "drop":
        return "last cache dropped", _with(st, lambda h: h["caches"].pop())
    if how == "notlist":
        return "caches an object", _with(st, lambda h: h.update(caches=h["caches"][0]))
    return "a cache a list", _with(st, lambda h: h["caches"].__setitem__(0, [1, 2]))


def _case_routing(st, _f, rng):
    if st.header["kind"] == "Causal":
        return "routing on a Causal", _with(st, lambda h: h.update(layer_to_cache=[0, 0]))
    n = len(st.header["layer_to_cache"])
    how = rng.choice(["swap", "drop", "shorter", "bool", "range", "null"])
    if how == "swap":
        return "routing changed", _with(st, lambda h: h["layer_to_cache"].__setitem__(
            0, 1 - h["layer_to_cache"][0]))
    if how == "drop":
        return "no routing", _with(st, lambda h: h.pop("layer_to_cache"))
    if how == "shorter":
        return "routing one layer short", _with(st, lambda h: h["layer_to_cache"].pop())
    if how == "bool":
        return "routing of bools", _with(st, lambda h: h.update(layer_to_cache=[bool(x) for x in h["layer_to_cache"]]))
    if how == "range":
        return "routing to cache 2", _with(st, lambda h: h["layer_to_cache"].__setitem__(n - 1, 2))
    return "routing null", _with(st, lambda h: h.update(layer_to_cache=None))


def _case_nesting(st, _f, rng):
    depth = rng.choice([30, 40, 100, 1000, 10_000, 200_000])
    where = rng.choice(["token", "meta", "model"])
    mark = "@NESTED@"
    edit = {"token": lambda h: h["meta"]["tokens"].__setitem__(0, mark),
            "meta": lambda h: h["meta"].update(deep=mark),
            "model": lambda h: h["meta"]["model"].update(weights=mark)}[where]
    h = copy.deepcopy(st.header)
    edit(h)
    # written as text: json.dumps itself would recurse that deep
    raw = json.dumps(h, separators=(",", ":")).encode().replace(f'"{mark}"'.encode(),
                                                                 b"[" * depth + b"0" + b"]" * depth)
    return f"{where} nested {depth} deep", st.build(raw_header=raw)


def _case_json(st, _f, rng):
    raw = st.raw_header
    how = rng.choice(["nan", "inf", "utf8", "cut", "array", "trailing", "brackets", "strings"])
    if how == "nan":
        raw = raw.replace(b'"tokens":[', b'"tokens":[NaN,', 1)
    elif how == "inf":
        raw = raw.replace(b'"tokens":[', b'"tokens":[-Infinity,', 1)
    elif how == "utf8":
        raw = raw.replace(b'"desc":"', b'"desc":"\xff\xfe', 1)
    elif how == "cut":
        raw = raw[:rng.randrange(len(raw))]
    elif how == "array":
        raw = b"[" + raw + b"]"
    elif how == "trailing":
        raw = raw + b" x"
    elif how == "brackets":
        raw = b"[" * 50 + b"]" * 50
    else:      # brackets inside strings do not nest: an unknown key holding them is refused for the key
        raw = raw[:-1] + b',"s":"' + b"[" * 100 + b'\\"\\\\' + b"{" * 100 + b'"}'
    return f"header JSON: {how}", st.build(raw_header=raw)


def _case_positions(st, _f, rng):
    k = rng.randrange(len(st.header["caches"]))
    pos = st.positions(k)
    how = rng.choice(["negative", "swap", "repeat", "shift", "last", "beyond", "gap"])
    if how == "negative":
        pos[0] = -1 - rng.randrange(5)
    elif how == "swap":
        j = rng.randrange(len(pos) - 1)
        pos[j], pos[j + 1] = pos[j + 1], pos[j]
    elif how == "repeat":
        j = rng.randrange(len(pos) - 1)
        pos[j + 1] = pos[j]
    elif how == "shift":
        d = rng.randint(1, 3)
        pos = [p + d for p in pos]
    elif how == "last":
        pos[-1] += rng.randint(1, 3)
    elif how == "beyond":
        pos = [N_CTX - len(pos) + j + rng.randint(0, 2**20) for j in range(len(pos))]
    else:
        j = rng.randrange(1, len(pos))
        pos = pos[:j] + [p + 1 for p in pos[j:]]
    return f"cache {k} positions {how}", st.with_positions(k, pos)


def _case_drop_cell(st, _f, rng):
    k = rng.randrange(len(st.header["caches"]))
    # a sliding window's first cell is one the next token does not see: without it the state is valid
    which = rng.choice([0, -1]) if st.header["caches"][k]["window"] is None else -1
    return f"cache {k} without its {'first' if which == 0 else 'last'} cell", st.drop_cell(k, which)


def _case_reformat(st, _f, rng):
    raw = json.dumps(st.header, indent=rng.choice([None, 1, 2]), sort_keys=rng.random() < 0.5,
                     ensure_ascii=rng.random() < 0.5).encode()
    return "header re-serialized", st.build(raw_header=raw)


def _case_seq_id(st, _f, rng):
    v = rng.choice([0, 1, 7, 2**31 - 1])
    return f"saved seq {v}", _with(st, lambda h: h.update(seq=v))


def _case_memory(st, _f, rng):
    k = rng.randrange(len(st.header["caches"]))
    v = rng.choice([None, 1, 64, 2**31 - 1])
    return f"cache {k}: memory {v}", _with(st, lambda h: h["caches"][k].update(memory=v))


def _case_tokens_image(st, _f, rng):
    v, j = rng.choice([-2, -3, -1000, -2**31]), rng.randrange(len(PREFIX))
    return f"token {j} = {v} (an image row: the record is dropped)", \
        _with(st, lambda h: h["meta"]["tokens"].__setitem__(j, v))


def _case_tokens_empty(st, _f, rng):
    return "token record emptied", _with(st, lambda h: h["meta"].update(tokens=[]))


# --- what a runner holds -------------------------------------------------------------------------------

def caches_of(rt) -> list:
    return list(getattr(rt.cache, "caches", [rt.cache]))


def tensor_bytes(t) -> bytes:
    return t.numpy(copy=True).tobytes() if t.is_host else bytes(t.get_bytes())


def snapshot(rt) -> tuple:
    """Everything a load may change: every cache's cell table and K/V bytes, and the slot table."""
    out = []
    for c in caches_of(rt):
        out.append((c.cells.pos.tobytes(), c.cells.seqs.tobytes(),
                    tuple(tensor_bytes(t) for t in (*c.keys, *c.values))))
    slots = tuple((tuple(s.tokens), tuple(s.same_batch)) for s in rt.slots)
    return tuple(out), slots


def seq_rows(rt, seq: int) -> list:
    """Per cache ``{position: every layer's K row and V row (column when transposed)}`` of ``seq``."""
    out = []
    for c in caches_of(rt):
        es = c.dtype_v.type_size
        raws = []
        for k, v in zip(c.keys, c.values):
            ka = k.numpy(copy=True) if k.is_host else None
            va = v.numpy(copy=True) if v.is_host else None
            raws.append((ka.view("u1").reshape(ka.shape[0], -1), va.view("u1").reshape(va.shape[0], -1)))
        rows = {}
        for cell in c.cells.seqs[:, seq].nonzero()[0]:
            parts = []
            for ka, va in raws:
                parts.append(ka[cell].tobytes())
                parts.append((va[:, cell * es:(cell + 1) * es] if c.v_trans else va[cell]).tobytes())
            rows[int(c.cells.pos[cell])] = b"".join(parts)
        out.append(rows)
    return out


def fill(rt) -> None:
    """The runner's state before each case: sequence 0 holds PREFIX + MORE, sequence 1 OTHER."""
    rt.clear()
    rt.decode(PREFIX + MORE, seq=0, logits=None)
    rt.decode(OTHER, seq=1, logits=None)


class Stream(io.RawIOBase):
    """A non-seekable binary stream over bytes (a pipe's behaviour)."""

    def __init__(self, data: bytes) -> None:
        self._b = io.BytesIO(data)

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        return self._b.readinto(buf)


# --- the child: runs cases, one JSON line each ---------------------------------------------------------

def open_runners(models: list):
    from ggmlpy.models import load_model
    from ggmlpy.runner import Runner

    ms = [load_model(p, devices="cpu") for p in models[:2]]
    rts = [Runner(m, **RUNNER) for m in ms]
    return ms, rts


def run_cases(work: str, seed: int, start: int, stop: int) -> None:
    """Run cases ``start .. stop - 1``, printing ``start i`` before and a JSON result after each."""
    from ggmlpy.kvcache import KVCacheFull, StateError

    models, states = base_paths(work)
    bases = [State(open(p, "rb").read()) for p in states]
    ms, rts = open_runners(models)
    refs = []
    for st, rt in zip(bases, rts):
        rt.clear()
        assert rt.load_state(0, io.BytesIO(st.data)) == PREFIX
        refs.append(seq_rows(rt, 0))
        fill(rt)
    path = os.path.join(work, f"case-{os.getpid()}.state")
    try:
        for i in range(start, stop):
            b, kind, desc, data, expect = make_case(bases, seed, i)
            rt = rts[b]
            with open(path, "wb") as f:
                f.write(data)
            fuzz_pool.case_start(i)
            res = {"i": i, "base": b, "kind": kind, "desc": desc, "expect": expect}
            before = snapshot(rt)
            other = seq_rows(rt, 1)
            src = Stream(data) if i % 4 == 3 else path
            try:
                tokens = rt.load_state(0, src)
                res["outcome"] = "loaded"
                meta = json.loads(data[PRE.size:PRE.size + struct.unpack_from("<I", data, 12)[0]])["meta"]
                want = meta.get("tokens") if isinstance(meta, dict) else None
                if isinstance(want, list) and all(type(t) is int for t in want) and any(t < 0 for t in want):
                    want = []                       # image rows: the record is dropped
                problems = []
                if seq_rows(rt, 0) != refs[b]:
                    problems.append("sequence 0 does not hold the saved rows")
                if seq_rows(rt, 1) != other:
                    problems.append("sequence 1 changed")
                if tokens != want or list(rt.slots[0].tokens) != want:
                    problems.append(f"tokens {tokens} recorded, the file has {want}")
                if problems:
                    res["outcome"] = "inexact-load"
                    res["error"] = "; ".join(problems)
                fill(rt)
            except (StateError, KVCacheFull) as e:
                res["outcome"] = "rejected"
                res["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                if snapshot(rt) != before:
                    res["outcome"] = "changed-on-refusal"
                    fill(rt)
            except Exception as e:  # noqa: BLE001 -- the point: report any other class as a failure
                res["outcome"] = "bad-exception"
                res["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                fill(rt)
            fuzz_pool.case_result(res)
    finally:
        for rt in rts:
            rt.close()
        for m in ms:
            m.close()
        try:
            os.unlink(path)
        except OSError:
            pass


# --- the parent: bases, batches, watchdog, summary ------------------------------------------------------

def base_paths(work: str) -> tuple[list, list]:
    models = [os.path.join(work, n) for n in ("llama-a.gguf", "gemma3.gguf", "llama-b.gguf")]
    return models, [m[:-5] + ".state" for m in models]


def make_bases(work: str) -> None:
    """The three models and a state of each (sequence 0 after PREFIX)."""
    from dataclasses import replace

    from ggmlpy.models import load_model
    from ggmlpy.models.synthetic import SIZES, for_arch, write_synthetic
    from ggmlpy.runner import Runner

    models, states = base_paths(work)
    if all(os.path.exists(p) for p in states):
        return
    write_synthetic(models[0], "tiny", seed=21)
    # 6 layers: 5 sliding-window ones (a window of 4, so the cache drops old positions) and a global one
    write_synthetic(models[1], replace(for_arch(SIZES["tiny"], "gemma3"), n_layer=6, sliding_window=4), seed=22)
    write_synthetic(models[2], "tiny", seed=23)
    for m, s in zip(models, states):
        with load_model(m, devices="cpu") as model, Runner(model, **RUNNER) as rt:
            rt.decode(PREFIX, seq=1, logits=None)
            rt.save_state(1, s)


def _describe(work: str, seed: int, i: int) -> dict:
    bases = [State(open(p, "rb").read()) for p in base_paths(work)[1]]
    b, kind, desc, _data, expect = make_case(bases, seed, i)
    return {"i": i, "base": b, "kind": kind, "desc": desc, "expect": expect}


def run(cases: int, seed: int = 0, jobs: int = 1, batch: int = 500, case_timeout: float = 30.0,
        work: str | None = None, start: int = 0, log=None) -> dict:
    """Run ``cases`` cases (numbered from ``start``) in child processes; returns the summary dict."""
    t0 = time.monotonic()
    with fuzz_pool.work_dir(work, "state-fuzz-") as work:
        make_bases(work)
        summary = {"cases": 0, "loaded": 0, "rejected": 0, "expected_rejects": 0, "expected_loads": 0,
                   "silent_loads": 0, "refused_valid": 0, "changed_on_refusal": 0, "inexact_loads": 0,
                   "aborts": 0, "hangs": 0, "bad_exceptions": 0, "by_kind": {}, "failures": []}

        def record(res):
            summary["cases"] += 1
            out = res["outcome"]
            k = summary["by_kind"].setdefault(res["kind"], {})
            k[out] = k.get(out, 0) + 1
            summary["expected_rejects" if res["expect"] == "reject" else "expected_loads"] += 1
            fail = None
            if out in ("loaded", "inexact-load"):
                summary["loaded"] += 1
                if res["expect"] == "reject":
                    summary["silent_loads"] += 1
                    fail = "loaded, must be refused;"
                elif out == "inexact-load":
                    summary["inexact_loads"] += 1
                    fail = out
            elif out == "rejected":
                summary["rejected"] += 1
                if res["expect"] == "load":
                    summary["refused_valid"] += 1
                    fail = "refused, must load"
            else:
                key = {"abort": "aborts", "hang": "hangs", "bad-exception": "bad_exceptions",
                       "changed-on-refusal": "changed_on_refusal"}[out]
                summary[key] += 1
                fail = out
            if fail:
                summary["failures"].append(f"case {res['i']} ({res['kind']}: {res['desc']}): {fail} "
                                           f"{res.get('error', '')}".rstrip())
            if log is not None:
                log.write(json.dumps(res) + "\n")

        fuzz_pool.run_ranges(__file__, fuzz_pool.ranges(start, cases, batch), seed=seed, work=work,
                             jobs=jobs, case_timeout=case_timeout, summary=summary, record=record,
                             describe=lambda i: _describe(work, seed, i))
        return fuzz_pool.finish(summary, t0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    fuzz_pool.add_options(ap, cases=300, batch=500, case_timeout=30.0, out="case.state",
                          work_help="folder for the base models, states and case files (default: a "
                                    "temporary one)")
    a = ap.parse_args(argv)
    if a.child:
        run_cases(a.work, a.seed, *fuzz_pool.child_range(a))
        return 0
    if a.write_case is not None:
        work = a.work or tempfile.mkdtemp(prefix="state-fuzz-")
        make_bases(work)
        bases = [State(open(p, "rb").read()) for p in base_paths(work)[1]]
        b, kind, desc, data, expect = make_case(bases, a.seed, a.write_case)
        with open(a.out, "wb") as f:
            f.write(data)
        print(json.dumps({"case": a.write_case, "base": b, "model": base_paths(work)[0][b], "kind": kind,
                          "desc": desc, "expect": expect, "out": a.out}))
        return 0

    def go(log):
        return run(a.cases, a.seed, a.jobs, a.batch, a.case_timeout, a.work, a.start, log)

    return fuzz_pool.run_main(a.log, go)


if __name__ == "__main__":
    sys.exit(main())
