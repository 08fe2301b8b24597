"""Saving and loading one sequence of a KV cache (ggmlpy.kvcache.state: Causal/Wrapper save_seq, load_seq).

Round trips into fresh and busy caches (the other sequences' cells and bytes untouched), attention through
the loaded cache, meta, every damaged or mismatched file refused with the cache unchanged, sliding-window
memory, caches placed on the CPU and on an RPC device, and a hypothesis property over random fills.
"""

from __future__ import annotations

import hashlib
import io
import struct

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from kv_helpers import _expand_put
from test_core_backend import rpc_server  # noqa: F401  (the loopback server fixture)

import ggmlpy as gp
from ggmlpy import GGMLTypeError, GGMLValueError, Type
from ggmlpy import backend as bk
from ggmlpy.kvcache import (
    CacheStateError,
    Causal,
    KVCacheFull,
    StateError,
    Wrapper,
)
from ggmlpy.kvcache import state as kvstate

L, HD, NH, NQ = 2, 32, 2, 4           # layers, head dim (a Q8_0 block), KV heads, query heads
E = HD * NH

# (K type, V type, v_trans)
CONFIGS = [(Type.F32, Type.F32, False), (Type.F32, Type.F32, True), (Type.F16, Type.F16, False),
           (Type.F16, Type.F16, True), (Type.Q8_0, Type.Q8_0, False), (Type.Q8_0, Type.F16, True),
           (Type.BF16, Type.BF16, True)]
CFG = pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c[0].name}-{c[1].name}{'-vt' if c[2] else ''}")


def _make(cfg=CONFIGS[2], n_seq=4, capacity=16, max_batch=8, placement=None, n_layers=L, n_head_kv=NH,
          **kw) -> Causal:
    kt, vt, trans = cfg
    c = Causal(n_layers, HD * n_head_kv, HD * n_head_kv, kt, dtype_v=vt, v_trans=trans, n_head_kv=n_head_kv,
               **kw)
    c.init(capacity, n_seq, max_batch, placement=placement)
    return c


def _fill(c, positions, seqs, rng) -> None:
    """One forward writing random K/V for every layer, committed."""
    plan = c.start_forward(positions, seqs)
    n = plan.n_batch
    with gp.Context(1 << 22) as ctx:
        gf = ctx.new_graph(64)
        for layer in range(c.n_layers):
            nh = c.n_head_kv
            _expand_put(ctx, gf, c, layer, plan, rng.standard_normal((n, nh, c.head_dim_k)).astype(np.float32),
                        rng.standard_normal((n, nh, c.head_dim_v)).astype(np.float32))
        gf.compute(1)
    c.apply(plan)


def _busy(c, rng) -> None:
    """Sequences 0, 2, 3 interleaved over scattered cells, with holes; 1 holds a few cells of its own."""
    _fill(c, [0, 0, 1, 1, 0], [0, 2, 0, 2, 3], rng)
    _fill(c, [2, 0, 2, 1, 3], [0, 1, 2, 1, 0], rng)
    _fill(c, [3, 4, 1, 2], [2, 0, 3, 3], rng)
    c.remove(2, 2)                  # holes where sequence 2 was
    c.remove(0, 4)


def _src(cfg, rng, n_seq=4, **kw) -> Causal:
    """A cache where sequence 1 holds positions 0..9 interleaved with sequences 0 and 2."""
    c = _make(cfg, n_seq=n_seq, **kw)
    _fill(c, [0, 0, 1, 1, 2, 0], [1, 0, 1, 0, 1, 2], rng)
    _fill(c, [3, 4, 5, 2, 6], [1, 1, 1, 0, 1], rng)
    _fill(c, [7, 8, 9, 1], [1, 1, 1, 2], rng)
    return c


def _raw(t) -> np.ndarray:
    a = t.numpy(copy=True)
    return a.view(np.uint8).reshape(a.shape[0], -1)


def _rows(c, seq) -> dict:
    """``{pos: bytes}`` of a sequence: every layer's K row and V row (column when transposed) of each cell."""
    raws = [(_raw(k), _raw(v)) for k, v in zip(c.keys, c.values)]
    es = c.dtype_v.type_size
    out = {}
    for cell in np.flatnonzero(c.cells.seqs[:, seq]):
        parts = []
        for k, v in raws:
            parts.append(k[cell].tobytes())
            parts.append((v[:, cell * es:(cell + 1) * es] if c.v_trans else v[cell]).tobytes())
        out[int(c.cells.pos[cell])] = b"".join(parts)
    return out


def _snapshot(c):
    return (c.cells.pos.copy(), c.cells.seqs.copy(), [_raw(t).tobytes() for t in (*c.keys, *c.values)])


def _same(a, b) -> None:
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]


def _others(c, seq):
    """What must survive a load into ``seq``: the other sequences' cells, positions and row bytes."""
    keep = [s for s in range(c.cells.n_seq_max) if s != seq]
    held = c.cells.seqs[:, keep]
    return held.copy(), np.where(held.any(axis=1), c.cells.pos, -1), [_rows(c, s) for s in keep]


def _saved(c, seq=1, meta=None) -> bytes:
    b = io.BytesIO()
    n = c.save_seq(seq, b, meta=meta)
    assert n == len(b.getvalue())
    return b.getvalue()


def _rehash(data: bytes) -> bytes:
    body = data[:-32]
    return body + hashlib.sha256(body).digest()


def _header_len(data: bytes) -> int:
    return struct.unpack_from("<I", data, 12)[0]


# ---------------------------------------------------------------------------------------- round trips


@CFG
def test_round_trip_into_a_fresh_cache_under_another_id(cfg, tmp_path):
    rng = np.random.default_rng(0)
    src = _src(cfg, rng)
    path = tmp_path / "seq.kv"
    n = src.save_seq(1, path, meta={"tokens": list(range(10)), "model": "abc"})
    assert n == path.stat().st_size
    assert not list(tmp_path.glob("*.tmp*"))
    dst = _make(cfg)
    assert dst.load_seq(3, path) == {"tokens": list(range(10)), "model": "abc"}
    assert _rows(dst, 3) == _rows(src, 1)
    assert (dst.seq_pos_min(3), dst.seq_pos_max(3)) == (0, 9)
    assert dst.cells.used == 10 and not dst.cells.seqs[:, :3].any()
    assert dst.load_seq(3, io.BytesIO(path.read_bytes())) == {"tokens": list(range(10)), "model": "abc"}
    assert _rows(dst, 3) == _rows(src, 1) and dst.cells.used == 10      # loading again replaces


@CFG
def test_round_trip_into_a_busy_cache_leaves_the_others_alone(cfg):
    rng = np.random.default_rng(1)
    src = _src(cfg, rng)
    data = _saved(src)
    dst = _make(cfg)
    _busy(dst, rng)
    dst.copy_prefix(0, 1, 2)        # sequence 1 shares two cells of 0 and will be replaced
    assert dst.cells.seqs[:, 1].sum() == 2
    before = _others(dst, 1)
    dst.load_seq(1, io.BytesIO(data))
    after = _others(dst, 1)
    assert np.array_equal(before[0], after[0]) and np.array_equal(before[1], after[1])
    assert before[2] == after[2]
    assert _rows(dst, 1) == _rows(src, 1)
    assert not (dst.cells.seqs[:, 1] & dst.cells.seqs[:, [0, 2, 3]].any(axis=1)).any()


def test_a_forked_prefix_is_saved_as_the_sequences_own():
    rng = np.random.default_rng(2)
    src = _make()
    _fill(src, [0, 1, 2, 3, 4, 5], [0] * 6, rng)
    src.copy_prefix(0, 1, 4)
    _fill(src, [4, 5, 6], [1, 1, 1], rng)
    dst = _make()
    dst.load_seq(1, io.BytesIO(_saved(src, 1)))
    assert sorted(_rows(dst, 1)) == list(range(7)) and _rows(dst, 1) == _rows(src, 1)
    assert dst.cells.used == 7 and dst.cells.seqs[:, 1].sum() == 7


@pytest.mark.parametrize("cfg", [CONFIGS[2], CONFIGS[3]], ids=["F16", "F16-vt"])
def test_an_empty_sequence_round_trips_and_clears(cfg):
    src, dst = _make(cfg), _make(cfg)
    data = _saved(src, 2, meta={"tokens": []})
    _fill(dst, [0, 1, 0], [2, 2, 1], np.random.default_rng(3))
    assert dst.load_seq(2, io.BytesIO(data)) == {"tokens": []}
    assert dst.seq_pos_max(2) == -1 and dst.cells.used == 1


def test_several_states_in_one_stream_and_a_non_seekable_one():
    rng = np.random.default_rng(4)
    src = _src(CONFIGS[0], rng)
    b = io.BytesIO()
    src.save_seq(1, b, meta={"n": 1})
    src.save_seq(0, b, meta={"n": 0})
    b.seek(0)
    dst = _make(CONFIGS[0])
    assert dst.load_seq(2, b) == {"n": 1}
    assert dst.load_seq(3, b) == {"n": 0}
    assert b.tell() == len(b.getvalue())
    assert _rows(dst, 2) == _rows(src, 1) and _rows(dst, 3) == _rows(src, 0)

    class Pipe(io.RawIOBase):                 # read() only, no seek
        def __init__(self, data):
            self._b = io.BytesIO(data)

        def readable(self):
            return True

        def readinto(self, buf):
            return self._b.readinto(buf)

    dst.load_seq(0, io.BufferedReader(Pipe(_saved(src, 1))))
    assert _rows(dst, 0) == _rows(src, 1)


def _attend(c, seq, q, k_new, v_new):
    """Every layer's attention output of one query token of ``seq`` at its next position (K/V of that token
    written, the plan not committed)."""
    plan = c.start_forward([c.seq_pos_max(seq) + 1], [seq])
    flash = not c.v_trans
    outs = []
    with gp.Context(1 << 22) as ctx:
        gf = ctx.new_graph(256)
        for layer in range(c.n_layers):
            _expand_put(ctx, gf, c, layer, plan, k_new, v_new)
        qt = ctx.new_tensor(Type.F32, (HD, NQ, 1))
        qt.set(q)
        qp = ctx.permute(qt, 0, 2, 1, 3)                    # (d, 1, n_head)
        for layer in range(c.n_layers):
            kv, vv, mask = c.get(ctx, layer, plan, mask_type=Type.F16 if flash else Type.F32)
            if flash:
                o = ctx.flash_attn_ext(qp, kv, vv, mask, 1 / np.sqrt(HD))
            else:
                kq = ctx.soft_max_ext(ctx.mul_mat(kv, qp), mask, 1 / np.sqrt(HD))
                o = ctx.mul_mat(vv, kq)
            gf.build_forward_expand(o)
            outs.append(o)
        gf.compute(1)
        return [o.get() for o in outs]


@CFG
def test_attention_through_the_loaded_cache_equals_the_original(cfg):
    rng = np.random.default_rng(5)
    src = _src(cfg, rng)
    dst = _make(cfg)
    _busy(dst, rng)
    dst.load_seq(0, io.BytesIO(_saved(src, 1)))
    q = rng.standard_normal((1, NQ, HD)).astype(np.float32)
    k_new = rng.standard_normal((1, NH, HD)).astype(np.float32)
    v_new = rng.standard_normal((1, NH, HD)).astype(np.float32)
    want = _attend(src, 1, q, k_new, v_new)
    got = _attend(dst, 0, q, k_new, v_new)
    for w, g in zip(want, got):
        assert np.abs(w).max() > 0.01
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)     # the cells sit elsewhere: sums may reorder


# ---------------------------------------------------------------------------------------- meta


def test_meta_round_trip_and_expect_meta():
    rng = np.random.default_rng(6)
    src = _src(CONFIGS[2], rng)
    meta = {"tokens": [5, 6, 7], "model": {"sha": "f00", "n_ctx": 16}, "note": "ü", "x": None, "f": 0.5}
    data = _saved(src, 1, meta=meta)
    dst = _make()
    assert dst.load_seq(0, io.BytesIO(data), expect_meta={"model": {"sha": "f00", "n_ctx": 16}}) == meta
    before = _snapshot(dst)
    with pytest.raises(StateError, match="'model'"):
        dst.load_seq(2, io.BytesIO(data), expect_meta={"model": {"sha": "bad", "n_ctx": 16}})
    with pytest.raises(StateError, match="no 'fingerprint'"):
        dst.load_seq(2, io.BytesIO(data), expect_meta={"fingerprint": 1})
    _same(before, _snapshot(dst))
    assert dst.load_seq(0, io.BytesIO(_saved(src, 1))) == {}


def test_save_refusals_write_nothing(tmp_path):
    src = _src(CONFIGS[0], np.random.default_rng(7))
    path = tmp_path / "x.kv"
    with pytest.raises(GGMLTypeError, match="JSON"):
        src.save_seq(1, path, meta={"bad": object()})
    with pytest.raises(GGMLTypeError, match="dict"):
        src.save_seq(1, path, meta=[1, 2])
    with pytest.raises(GGMLValueError, match="out of range"):
        src.save_seq(9, path)
    with pytest.raises(GGMLTypeError, match="path or a binary file"):
        src.save_seq(1, 42)
    assert not list(tmp_path.iterdir())
    with pytest.raises(CacheStateError):
        Causal(1, 8, 8).save_seq(0, path)
    with pytest.raises(CacheStateError):
        Causal(1, 8, 8).load_seq(0, path)


def test_save_into_a_path_replaces_it_atomically(tmp_path):
    src = _src(CONFIGS[0], np.random.default_rng(8))
    path = tmp_path / "x.kv"
    path.write_bytes(b"old")
    src.save_seq(1, path)
    assert path.read_bytes()[:8] == kvstate.MAGIC and len(list(tmp_path.iterdir())) == 1


# ---------------------------------------------------------------------------------------- refusals


def _positions_at(data: bytes) -> int:
    return 16 + _header_len(data)


def _set_positions(data: bytes, pos) -> bytes:
    off = _positions_at(data)
    arr = np.asarray(pos, "<i4").tobytes()
    return _rehash(data[:off] + arr + data[off + len(arr):])


def _corrupt_cases():
    def cut(at):
        return lambda d: d[:at(d)]

    def version(v):
        return lambda d: d[:8] + struct.pack("<I", v) + d[12:]

    def flip(at):
        return lambda d: d[:at(d)] + bytes([d[at(d)] ^ 0x40]) + d[at(d) + 1:]

    return [
        ("empty", cut(lambda d: 0), "empty"),
        ("cut in the magic", cut(lambda d: 5), "truncated"),
        ("cut in the preamble", cut(lambda d: 13), "truncated"),
        ("cut in the header", cut(lambda d: 16 + _header_len(d) // 2), "truncated"),
        ("cut in the positions", cut(lambda d: _positions_at(d) + 6), "truncated"),
        ("cut in layer 0", cut(lambda d: _positions_at(d) + 40 + 100), "truncated"),
        ("cut in the last layer", cut(lambda d: len(d) - 40), "truncated"),
        ("cut in the checksum", cut(lambda d: len(d) - 1), "truncated"),
        ("a byte too many", lambda d: d + b"\0", "extra bytes"),
        ("bad magic", lambda d: b"GGUF" + d[4:], "bad magic"),
        ("future version", version(kvstate.VERSION + 1), "newer"),
        ("version 0", version(0), "not a valid version"),
        ("header length beyond the file", lambda d: d[:12] + struct.pack("<I", 1 << 31) + d[16:], "truncated"),
        ("header not JSON", lambda d: _rehash(d[:16] + b"{" * _header_len(d) + d[16 + _header_len(d):]), "JSON"),
        ("a data byte flipped", flip(lambda d: len(d) - 100), "checksum"),
        ("a header byte flipped", lambda d: d.replace(b'"kind":"Causal"', b'"kind":"Causxl"'), "Causxl"),
        ("count changed", lambda d: d.replace(b'"count":10', b'"count":11'), "truncated"),
        ("positions not increasing", lambda d: _set_positions(d, [0, 1, 2, 3, 3, 5, 6, 7, 8, 9]), "increase"),
        ("positions decreasing", lambda d: _set_positions(d, [0, 1, 2, 3, 4, 5, 6, 8, 7, 9]), "increase"),
        ("a negative position", lambda d: _set_positions(d, [-1, 1, 2]), ">= 0"),
    ]


CORRUPT = _corrupt_cases()


@pytest.mark.parametrize("how", ["path", "bytesio"])
@pytest.mark.parametrize("name,mutate,match", CORRUPT, ids=[c[0] for c in CORRUPT])
def test_a_damaged_file_is_refused_and_changes_nothing(name, mutate, match, how, tmp_path):
    rng = np.random.default_rng(9)
    src = _src(CONFIGS[1], rng)
    data = mutate(_saved(src))
    dst = _make(CONFIGS[1])
    _busy(dst, rng)
    before = _snapshot(dst)
    if name == "a byte too many" and how == "bytesio":
        dst.load_seq(1, io.BytesIO(data))    # a stream may go on after the state
        return
    path = tmp_path / "bad.kv"
    path.write_bytes(data)
    with pytest.raises(StateError, match=match):
        dst.load_seq(1, path if how == "path" else io.BytesIO(data))
    _same(before, _snapshot(dst))


MISMATCH = [
    ("n_layers", dict(n_layers=3)),
    ("type_k", dict(dtype=Type.F16, dtype_v=Type.F32)),
    ("type_v", dict(dtype_v=Type.F16)),
    ("v_trans", dict(v_trans=False)),
    ("n_head_kv", dict(n_head_kv=1)),          # the same row size, split otherwise
    ("window", dict(window=4)),
]


@pytest.mark.parametrize("key,kw", MISMATCH, ids=[m[0] for m in MISMATCH])
def test_another_configuration_is_refused_and_changes_nothing(key, kw):
    rng = np.random.default_rng(10)
    data = _saved(_src(CONFIGS[1], rng))
    args = dict(dict(n_layers=L, dtype=Type.F32, v_trans=True, n_head_kv=NH), **kw)
    dst = Causal(args.pop("n_layers"), E, E, **args)
    dst.init(16, 4, 8)
    _fill(dst, [0, 1, 2], [0, 1, 3], rng)
    before = _snapshot(dst)
    with pytest.raises(StateError, match=f"configuration differs: {key} "):
        dst.load_seq(1, io.BytesIO(data))
    _same(before, _snapshot(dst))


def test_too_many_cells_raise_kvcachefull_and_change_nothing():
    rng = np.random.default_rng(11)
    data = _saved(_src(CONFIGS[2], rng))        # 10 cells
    dst = _make(CONFIGS[2], n_seq=2, capacity=8)  # 16 cells
    _fill(dst, [0, 1, 2, 3, 4, 5, 6], [0] * 7, rng)
    _fill(dst, [0, 1, 2, 3, 4, 5], [1] * 6, rng)
    dst.copy_prefix(0, 1, 2)                    # 1 now holds 2 shared + ... its own cells are dropped
    _fill(dst, [2, 3], [1, 1], rng)
    assert dst.cells.used == 9                  # 7 free, 2 of them count for sequence 1
    before = _snapshot(dst)
    with pytest.raises(KVCacheFull, match="needs 10 cells, 9 are free"):
        dst.load_seq(1, io.BytesIO(data))
    _same(before, _snapshot(dst))
    small = _make(CONFIGS[2], n_seq=1, capacity=8)
    with pytest.raises(KVCacheFull):
        small.load_seq(0, io.BytesIO(data))
    assert small.cells.used == 0
    dst.clear(0)
    dst.load_seq(1, io.BytesIO(data))           # fits once sequence 0 is gone


def test_a_bad_sequence_id_or_file_argument_raises():
    dst = _make()
    data = _saved(_src(CONFIGS[2], np.random.default_rng(12)))
    with pytest.raises(GGMLValueError, match="out of range"):
        dst.load_seq(4, io.BytesIO(data))
    with pytest.raises(GGMLTypeError, match="path or a binary file"):
        dst.load_seq(0, data)
    with pytest.raises(GGMLTypeError, match="dict"):
        dst.load_seq(0, io.BytesIO(data), expect_meta=["x"])
    with pytest.raises(GGMLTypeError, match="binary file"):
        dst.load_seq(0, io.StringIO("GGMLKVSQ"))
    with pytest.raises(GGMLTypeError, match="binary file"):
        dst.save_seq(0, io.StringIO())
    assert issubclass(StateError, GGMLValueError) and dst.cells.used == 0


# ---------------------------------------------------------------------------------------- window, wrapper


def test_sliding_window_memory_keeps_what_the_cache_could_hold():
    rng = np.random.default_rng(13)
    src = _make(CONFIGS[2], n_seq=2, capacity=32, window=4, memory=16)
    for a in range(0, 12, 4):
        _fill(src, list(range(a, a + 4)), [0] * 4, rng)
    assert (src.seq_pos_min(0), src.seq_pos_max(0)) == (0, 11)
    data = _saved(src, 0)
    wide = _make(CONFIGS[2], n_seq=2, capacity=32, window=4, max_batch=2)      # memory 5, batches of 2
    assert wide.memory == 5
    wide.load_seq(1, io.BytesIO(data))
    assert sorted(_rows(wide, 1)) == [5, 6, 7, 8, 9, 10, 11]                 # 5 + 2 positions
    assert all(_rows(wide, 1)[p] == _rows(src, 0)[p] for p in range(5, 12))
    assert wide.can_resume(1, 12) and wide.can_resume(1, 10) and not wide.can_resume(1, 2)
    _fill(wide, [12], [1], rng)                                             # the cache's own trim goes on
    assert sorted(_rows(wide, 1)) == [7, 8, 9, 10, 11, 12]
    with pytest.raises(StateError, match="window 4 in the file, 8 here"):
        _make(CONFIGS[2], n_seq=2, capacity=32, window=8).load_seq(1, io.BytesIO(data))
    same = _make(CONFIGS[2], n_seq=3, capacity=32, window=4, max_batch=4)
    for a in range(0, 12, 4):
        _fill(same, list(range(a, a + 4)), [0] * 4, rng)
    assert sorted(_rows(same, 0)) == list(range(3, 12))                     # memory 5 + a batch of 4
    same.load_seq(1, io.BytesIO(_saved(same, 0)))                           # the same cache: all of it
    assert _rows(same, 1) == _rows(same, 0)


def _wrapper(n_seq=3):
    swa = Causal(2, E, E, Type.F16, n_head_kv=NH, window=3)
    full = Causal(1, E, E, Type.Q8_0, n_head_kv=NH)
    w = Wrapper([swa, full], [0, 1, 0])
    w.init(16, n_seq, 8)
    return w


def _wfill(w, positions, seqs, rng):
    for c in w.caches:
        _fill(c, positions, seqs, rng)


def test_wrapper_round_trip_section_per_cache():
    rng = np.random.default_rng(14)
    src = _wrapper()
    for a in range(0, 9, 3):
        _wfill(src, [a, a + 1, a + 2, a], [0, 0, 0, 2], rng)
    assert src.caches[0].seq_pos_min(0) > 0 and src.caches[1].seq_pos_min(0) == 0
    b = io.BytesIO()
    src.save_seq(0, b, meta={"tokens": list(range(9))})
    dst = _wrapper()
    _wfill(dst, [0, 1, 2], [2, 0, 0], rng)
    before = [_rows(c, 2) for c in dst.caches]
    b.seek(0)
    assert dst.load_seq(1, b) == {"tokens": list(range(9))}
    for s, d in zip(src.caches, dst.caches):
        assert _rows(d, 1) == _rows(s, 0)
    assert [_rows(c, 2) for c in dst.caches] == before
    assert dst.can_resume(1, 9)
    # another routing, or a lone Causal, is refused; an encoder has nothing to save
    other = Wrapper([Causal(2, E, E, Type.F16, n_head_kv=NH, window=3), Causal(1, E, E, Type.Q8_0, n_head_kv=NH)],
                    [0, 0, 1])
    other.init(16, 3, 8)
    with pytest.raises(StateError, match="routing"):
        other.load_seq(0, io.BytesIO(b.getvalue()))
    with pytest.raises(StateError, match="'Wrapper' cache, loading into a Causal"):
        _make().load_seq(0, io.BytesIO(b.getvalue()))
    with pytest.raises(StateError, match="of cache 1 differs: type_k 'Q8_0' in the file, 'F16' here"):
        w = Wrapper([Causal(2, E, E, Type.F16, n_head_kv=NH, window=3), Causal(1, E, E, Type.F16, n_head_kv=NH)],
                    [0, 1, 0])
        w.init(16, 3, 8)
        w.load_seq(0, io.BytesIO(b.getvalue()))


def test_wrapper_load_is_all_or_nothing_when_one_cache_is_full():
    rng = np.random.default_rng(15)
    src = _wrapper()
    _wfill(src, [0, 1, 2, 3, 4, 5], [0] * 6, rng)
    dst = _wrapper()
    for a in range(0, 46, 8):                                   # 2 cells left in the full cache
        _fill(dst.caches[1], list(range(a, min(a + 8, 46))), [2] * min(8, 46 - a), rng)
    assert dst.caches[1].cells.used == dst.caches[1].n_cells - 2
    before = [_snapshot(c) for c in dst.caches]
    with pytest.raises(KVCacheFull):
        dst.load_seq(0, io.BytesIO(_saved(src, 0)))
    for b, c in zip(before, dst.caches):
        _same(b, _snapshot(c))


# ---------------------------------------------------------------------------------------- placement


@pytest.mark.parametrize("cfg", [CONFIGS[3], CONFIGS[4]], ids=["F16-vt", "Q8_0"])
def test_cpu_placed_caches_round_trip(cfg):
    rng = np.random.default_rng(16)
    placement = bk.split_layers(L, bk.choose_devices("cpu"))
    placed = _src(cfg, rng, placement=placement)
    host = _make(cfg)
    _busy(host, rng)
    host.load_seq(1, io.BytesIO(_saved(placed)))
    assert _rows(host, 1) == _rows(placed, 1)
    again = _make(cfg, placement=placement)
    _busy(again, rng)
    before = _others(again, 1)
    again.load_seq(1, io.BytesIO(_saved(host)))
    assert _rows(again, 1) == _rows(placed, 1)
    after = _others(again, 1)
    assert np.array_equal(before[1], after[1]) and before[2] == after[2]


@pytest.mark.rpc
@pytest.mark.parametrize("cfg", [CONFIGS[1], CONFIGS[4], CONFIGS[5], CONFIGS[6]],
                         ids=["F32-vt", "Q8_0", "Q8_0-F16-vt", "BF16-vt"])
def test_device_caches_round_trip(cfg, rpc_server):  # noqa: F811
    """Into and out of a cache in RPC device memory (set_bytes in, get out) and back into host memory."""
    rng = np.random.default_rng(17)
    devs = bk.choose_devices("auto", rpc=[rpc_server])
    placement = bk.split_layers(L, devs, n_gpu_layers=1)             # layer 1 on the server
    src = _src(cfg, rng)
    dev = _make(cfg, placement=placement)
    assert dev.keys[0].is_host and not dev.keys[1].is_host
    dev.load_seq(2, io.BytesIO(_saved(src)))
    dev.load_seq(0, io.BytesIO(_saved(src, 0)))
    back = _make(cfg)
    back.load_seq(1, io.BytesIO(_saved(dev, 2)))
    back.load_seq(0, io.BytesIO(_saved(dev, 0)))
    assert _rows(back, 1) == _rows(src, 1) and _rows(back, 0) == _rows(src, 0)


# ---------------------------------------------------------------------------------------- property


batch = st.lists(st.tuples(st.integers(0, 2), st.integers(1, 4)), min_size=1, max_size=4)


@settings(max_examples=40, deadline=None)
@given(src_batches=st.lists(batch, min_size=1, max_size=6), dst_batches=st.lists(batch, max_size=6),
       seq=st.integers(0, 2), into=st.integers(0, 2), fork=st.booleans(), trans=st.booleans())
def test_property_save_load_against_random_fills(src_batches, dst_batches, seq, into, fork, trans):
    """Whatever the fills, a load either puts exactly the saved (position, rows) pairs under ``into`` and
    leaves every other sequence as it was, or raises KVCacheFull with the cache unchanged."""
    cfg = (Type.F16, Type.F16, trans)
    rng = np.random.default_rng(len(src_batches) * 31 + len(dst_batches))

    def run(c, batches):
        next_pos = [0, 0, 0]
        for b in batches:
            positions, seqs = [], []
            for s, n in b:
                for _ in range(n):
                    positions.append(next_pos[s])
                    seqs.append(s)
                    next_pos[s] += 1
            try:
                _fill(c, positions, seqs, rng)
            except KVCacheFull:
                for s in set(seqs):
                    next_pos[s] = c.seq_pos_max(s) + 1
                continue
            if fork and next_pos[0] > 1:
                c.copy_prefix(0, 2, 1)
                next_pos[2] = c.seq_pos_max(2) + 1

    src = _make(cfg, n_seq=3, capacity=5)
    run(src, src_batches)
    dst = _make(cfg, n_seq=3, capacity=3)      # smaller: sometimes too full
    run(dst, dst_batches)
    data = _saved(src, seq, meta={"seq": seq})
    before, keep = _snapshot(dst), _others(dst, into)
    try:
        assert dst.load_seq(into, io.BytesIO(data)) == {"seq": seq}
    except KVCacheFull:
        event("full")
        _same(before, _snapshot(dst))
        return
    event(f"loaded {'no' if src.seq_pos_max(seq) < 0 else 'some'} cells, "
          f"{'no' if dst.cells.used == len(_rows(dst, into)) else 'some'} others")
    assert _rows(dst, into) == _rows(src, seq)
    after = _others(dst, into)
    assert np.array_equal(keep[0], after[0]) and np.array_equal(keep[1], after[1]) and keep[2] == after[2]
