"""Tests for Causal's K shift on remove, defrag and fragmentation (ggmlpy.kvcache)."""

from __future__ import annotations

import numpy as np
import pytest

import ggmlpy
from ggmlpy import RopeType, Type
from ggmlpy.kvcache import Causal, NotSupported

HEAD_DIM = 32  # a Q8_0 block
N_HEAD = 2
BASE = 10000.0


def _rope_np(x: np.ndarray, pos: np.ndarray, mode: int = RopeType.NEOX) -> np.ndarray:
    """RoPE of x (n_tokens, n_head, head_dim) at positions pos (n_tokens,), all dims rotated."""
    d = x.shape[-1]
    half = d // 2
    theta = pos.astype(np.float64)[:, None] * BASE ** (-2.0 * np.arange(half) / d)[None, :]
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    x = x.astype(np.float64)
    out = np.empty_like(x)
    if mode == RopeType.NEOX:
        a, b = x[..., :half], x[..., half:]
        out[..., :half] = a * cos - b * sin
        out[..., half:] = a * sin + b * cos
    else:
        a, b = x[..., 0::2], x[..., 1::2]
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = a * sin + b * cos
    return out.astype(np.float32)


def _shift_fn(mode):
    def fn(ctx, layer, k, offsets):
        return ctx.rope_ext(k, offsets, n_dims=HEAD_DIM, mode=mode, freq_base=BASE)
    return fn


def _cache(capacity=16, n_seq=1, max_batch=4, dtype=Type.F32, n_layers=2, **kw) -> Causal:
    c = Causal(n_layers, HEAD_DIM * N_HEAD, HEAD_DIM * N_HEAD, dtype, n_head_kv=N_HEAD, **kw)
    c.init(capacity, n_seq, max_batch)
    return c


def _write(cache: Causal, positions, seqs, ks, vs) -> None:
    """One forward that only writes K/V; ks/vs: per layer (n_batch, n_head, head_dim)."""
    plan = cache.start_forward(positions, seqs)
    with ggmlpy.Context(1 << 20) as ctx:
        gf = ctx.new_graph(256)
        idx = cache.index_tensor(ctx, plan)
        for layer in range(cache.n_layers):
            kt = ctx.new_tensor(Type.F32, ks[layer].shape[::-1])
            kt.set(ks[layer])
            vt = ctx.new_tensor(Type.F32, vs[layer].shape[::-1])
            vt.set(vs[layer])
            for t in cache.put(ctx, layer, plan, kt, vt, idx=idx):
                gf.build_forward_expand(t)
        gf.compute(1)
    cache.apply(plan)


def _rows(t) -> np.ndarray:
    return t.get().astype(np.float32).reshape(-1, N_HEAD, HEAD_DIM)


def _fill_seq(cache, seq, n, rng, mode=RopeType.NEOX):
    """Write positions 0..n-1 of seq (in batches of max_batch); K already rotated.

    Returns (raw_k, raw_v): per layer (n, n_head, head_dim), unrotated.
    """
    raw_k = [rng.standard_normal((n, N_HEAD, HEAD_DIM)).astype(np.float32)
             for _ in range(cache.n_layers)]
    raw_v = [rng.standard_normal((n, N_HEAD, HEAD_DIM)).astype(np.float32)
             for _ in range(cache.n_layers)]
    for a in range(0, n, cache.max_batch):
        pos = np.arange(a, min(n, a + cache.max_batch))
        ks = [_rope_np(rk[pos], pos, mode) for rk in raw_k]
        vs = [rv[pos] for rv in raw_v]
        _write(cache, pos, [seq] * pos.size, ks, vs)
    return raw_k, raw_v


# ---------------------------------------------------------------------- shift


@pytest.mark.parametrize("dtype,tol", [(Type.F32, 1e-3), (Type.F16, 2e-2), (Type.Q8_0, 0.1)])
@pytest.mark.parametrize("mode", [RopeType.NEOX, RopeType.NORMAL])
def test_remove_middle_rerotates_keys(dtype, tol, mode):
    rng = np.random.default_rng(0)
    c = _cache(16, 1, 4, dtype, shift_fn=_shift_fn(mode))
    raw_k, raw_v = _fill_seq(c, 0, 10, rng, mode)
    c.remove(0, 3, 5)
    assert c.seq_pos_min(0) == 0 and c.seq_pos_max(0) == 7
    pos = c.cells.pos
    held = c.cells.seqs[:, 0]
    assert sorted(pos[held].tolist()) == list(range(8))
    for layer in range(c.n_layers):
        k, v = _rows(c.keys[layer]), _rows(c.values[layer])
        for cell in np.flatnonzero(held):
            p = int(pos[cell])
            orig = p if p < 3 else p + 2
            want = _rope_np(raw_k[layer][orig:orig + 1], np.array([p]), mode)[0]
            np.testing.assert_allclose(k[cell], want, atol=tol, rtol=0)
            np.testing.assert_allclose(v[cell], raw_v[layer][orig], atol=tol, rtol=0)


def test_shift_skips_other_sequences_in_the_span():
    """Interleaved sequences: cells of seq 1 inside the shifted span are untouched."""
    rng = np.random.default_rng(1)
    c = _cache(16, 2, 4, Type.F32, shift_fn=_shift_fn(RopeType.NEOX))
    raw_k = {s: [rng.standard_normal((8, N_HEAD, HEAD_DIM)).astype(np.float32)
                 for _ in range(c.n_layers)] for s in (0, 1)}
    for p in range(0, 8, 2):  # batch: seq0 p, seq1 p, seq0 p+1, seq1 p+1
        positions = np.array([p, p, p + 1, p + 1])
        seqs = np.array([0, 1, 0, 1])
        ks = [np.stack([_rope_np(raw_k[s][layer][q:q + 1], np.array([q]))[0]
                        for q, s in zip(positions, seqs)]) for layer in range(c.n_layers)]
        _write(c, positions, seqs, ks, ks)
    before = [_rows(t).copy() for t in c.keys]
    c.remove(0, 1, 3)
    assert c.seq_pos_max(0) == 5 and c.seq_pos_max(1) == 7
    pos, seqs = c.cells.pos, c.cells.seqs
    for layer in range(c.n_layers):
        k = _rows(c.keys[layer])
        for cell in np.flatnonzero(seqs[:, 1]):
            np.testing.assert_array_equal(k[cell], before[layer][cell])
        for cell in np.flatnonzero(seqs[:, 0]):
            p = int(pos[cell])
            orig = p if p < 1 else p + 2
            want = _rope_np(raw_k[0][layer][orig:orig + 1], np.array([p]))[0]
            np.testing.assert_allclose(k[cell], want, atol=1e-3, rtol=0)


def test_remove_without_shift_fn_still_not_supported():
    rng = np.random.default_rng(2)
    c = _cache(16, 1, 4)
    _fill_seq(c, 0, 6, rng)
    pos = c.cells.pos.copy()
    k = _rows(c.keys[0]).copy()
    with pytest.raises(NotSupported):
        c.remove(0, 1, 2)
    np.testing.assert_array_equal(c.cells.pos, pos)
    np.testing.assert_array_equal(_rows(c.keys[0]), k)


def test_shift_of_shared_cells_not_supported_and_unchanged():
    rng = np.random.default_rng(3)
    c = _cache(16, 2, 4, shift_fn=_shift_fn(RopeType.NEOX))
    _fill_seq(c, 0, 6, rng)
    c.copy_prefix(0, 1, 6)
    pos, seqs = c.cells.pos.copy(), c.cells.seqs.copy()
    k = _rows(c.keys[0]).copy()
    with pytest.raises(NotSupported):
        c.remove(0, 1, 2)
    np.testing.assert_array_equal(c.cells.pos, pos)
    np.testing.assert_array_equal(c.cells.seqs, seqs)
    np.testing.assert_array_equal(_rows(c.keys[0]), k)


def test_remove_to_end_and_empty_range_never_shift():
    calls = []

    def fn(ctx, layer, k, offsets):
        calls.append(layer)
        return k

    rng = np.random.default_rng(4)
    c = _cache(16, 1, 4, shift_fn=fn)
    _fill_seq(c, 0, 6, rng)
    c.remove(0, 4, 4)
    c.remove(0, 4, None)
    c.remove(0, 3, 2**31 - 1)
    assert calls == []
    assert c.seq_pos_max(0) == 2
    c.remove(0, 0, 1)
    assert calls == [0, 1]  # one chunk, every layer
    assert c.seq_pos_max(0) == 1


def test_shift_fn_must_be_callable():
    with pytest.raises(TypeError):
        Causal(1, 8, 8, Type.F32, shift_fn=3)


# ---------------------------------------------------------------------- defrag


def _snapshot(c: Causal) -> dict:
    """(seq, pos) -> (K rows, V rows) of every layer."""
    out = {}
    ks = [_rows(t) for t in c.keys]
    vs = [_rows(t) for t in c.values]
    pos, seqs = c.cells.pos, c.cells.seqs
    for cell in np.flatnonzero(seqs.any(axis=1)):
        for s in np.flatnonzero(seqs[cell]):
            out[(int(s), int(pos[cell]))] = ([k[cell].copy() for k in ks],
                                             [v[cell].copy() for v in vs])
    return out


@pytest.mark.parametrize("dtype", [Type.F32, Type.F16, Type.Q8_0])
@pytest.mark.parametrize("max_nodes", [2048, 1])
def test_defrag_keeps_data_and_compacts(dtype, max_nodes):
    rng = np.random.default_rng(5)
    n_seq = 4
    c = _cache(8, n_seq, 4, dtype, n_layers=3)
    for p in range(0, 8, 2):  # the four sequences interleaved cell by cell
        for half in range(2):
            seqs = np.array([2 * half, 2 * half + 1, 2 * half, 2 * half + 1])
            pos = np.array([p, p, p + 1, p + 1])
            ks = [rng.standard_normal((4, N_HEAD, HEAD_DIM)).astype(np.float32)
                  for _ in range(c.n_layers)]
            vs = [rng.standard_normal((4, N_HEAD, HEAD_DIM)).astype(np.float32)
                  for _ in range(c.n_layers)]
            _write(c, pos, seqs, ks, vs)
    c.clear(1)
    c.remove(2, 5)
    c.clear(3)
    assert c.fragmentation() > 0
    before = _snapshot(c)
    used = c.cells.used
    moves = c.defrag()
    assert moves
    live = np.flatnonzero(c.cells.seqs.any(axis=1))
    np.testing.assert_array_equal(live, np.arange(used))
    assert c.cells.used == used
    assert c.fragmentation() == 0.0
    after = _snapshot(c)
    assert after.keys() == before.keys()
    for key, (k0, v0) in before.items():
        k1, v1 = after[key]
        for a, b in zip(k0 + v0, k1 + v1):
            np.testing.assert_array_equal(a, b)
    assert c.defrag() == []  # already compact


def test_defrag_many_moves_small_node_budget():
    """Every other cell a hole: many single-cell moves, split over several graphs."""
    rng = np.random.default_rng(6)
    c = _cache(16, 2, 8, Type.F32, n_layers=2)
    for p in range(0, 16, 4):  # cells alternate seq 0 / seq 1
        pos = np.repeat(np.arange(p, p + 4), 2)
        seqs = np.tile([0, 1], 4)
        ks = [rng.standard_normal((8, N_HEAD, HEAD_DIM)).astype(np.float32) for _ in range(2)]
        _write(c, pos, seqs, ks, ks)
    c.clear(0)
    assert c.fragmentation() == pytest.approx(1 - 16 / 32)
    before = _snapshot(c)
    moves = c.defrag(max_nodes=2 * 2 + 6 * 2 * 3)  # three moves per graph
    assert len(moves) == 8  # live cells 17, 19, .., 31 fill holes 0, 2, .., 14, one each
    np.testing.assert_array_equal(np.flatnonzero(c.cells.seqs.any(axis=1)), np.arange(16))
    after = _snapshot(c)
    assert after.keys() == before.keys()
    for key, (k0, v0) in before.items():
        k1, v1 = after[key]
        for x, y in zip(k0 + v0, k1 + v1):
            np.testing.assert_array_equal(x, y)


def test_fragmentation_empty_and_compact():
    c = _cache(8, 1, 4)
    assert c.fragmentation() == 0.0
    _fill_seq(c, 0, 4, np.random.default_rng(7))
    assert c.fragmentation() == 0.0
