"""Tests for ggmlpy.kvcache.Causal's options: transposed V storage (Ollama's ``PermutedV``), non-causal
spans, the memory-saving sliding window and chunked attention (Llama 4's local layers): what the cache
stores, its masks, and attention computed
through it against numpy. The Wrapper has its own file, test_kvcache_wrapper.py.

Scenarios follow Ollama's ``kvcache/causal_test.go`` (padding 1, K = V).
"""

from __future__ import annotations

import numpy as np
import pytest
from kv_helpers import _cache, _flat, _m, _step

import ggmlpy
from ggmlpy import Type
from ggmlpy.kvcache import Causal, KVCacheFull

X = -np.inf


# ---------------------------------------------------------------- 1. transposed V

VT = pytest.mark.parametrize("v_trans", [False, True])


@VT
@pytest.mark.parametrize("dtype", [Type.F32, Type.F16])
def test_store_v_trans(v_trans, dtype):
    c = _cache(16, 1, 8, dtype, head_dim=2, n_head_kv=3, v_trans=v_trans)
    want_ne = (c.n_cells, 6) if v_trans else (6, c.n_cells)
    assert c.values[0].ne[:2] == want_ne
    x = np.arange(4 * 3 * 2, dtype=np.float32).reshape(4, 3, 2)
    k, v, mask, plan = _step(c, [0, 1, 2, 3], [0] * 4, x, -x)
    assert np.array_equal(k, x.transpose(1, 0, 2)) and np.array_equal(v, -x.transpose(1, 0, 2))
    assert np.array_equal(mask, _m("oxxx", "ooxx", "ooox", "oooo"))
    y = np.full((1, 3, 2), 100, dtype=np.float32)
    k, v, mask, plan = _step(c, [4], [0], y, 2 * y)
    assert np.array_equal(v, np.concatenate([-x, 2 * y]).transpose(1, 0, 2))
    assert np.array_equal(mask, _m("ooooo"))


@VT
def test_sequences_v_trans(v_trans):
    c = _cache(8, 2, 8, v_trans=v_trans)
    _, v, mask, _ = _step(c, [0, 0, 1, 1, 2], [0, 1, 0, 1, 0])
    assert _flat(v) == [1, 1, 2, 2, 3]
    _, v, mask, plan = _step(c, [3, 2], [0, 1])
    assert plan.cell_ids.tolist() == [5, 6]
    assert _flat(v) == [1, 1, 2, 2, 3, 4, 3]
    assert np.array_equal(mask, _m("oxoxoox", "xoxoxxo"))
    # a sub-range starting past cell 0: seq 1 only
    c2 = _cache(8, 2, 8, v_trans=v_trans)
    _step(c2, [0, 1], [0, 0])
    _, v, _, plan = _step(c2, [0, 1], [1, 1])
    assert (plan.lo, plan.hi) == (2, 4) and _flat(v) == [1, 2]


@VT
def test_swa_v_trans(v_trans):
    c = _cache(16, 1, 4, window=1, v_trans=v_trans)
    _step(c, [0, 1, 2, 3], [0] * 4)
    k, v, mask, plan = _step(c, [4, 5], [0, 0])
    assert _flat(k) == _flat(v) == [5, 6, 3, 4]
    assert np.array_equal(mask, _m("oxxo", "ooxx"))


@VT
def test_defrag_v_trans(v_trans):
    x2 = np.arange(4 * 2 * 2, dtype=np.float32).reshape(4, 2, 2) + 50
    c2 = _cache(8, 2, 8, head_dim=2, n_head_kv=2, v_trans=v_trans)
    _step(c2, [0, 0, 1, 1], [0, 1, 0, 1], x2, -x2)
    c2.clear(0)           # holes at 0 and 2
    moves = c2.defrag()   # cell 3 moves into the hole at 0
    assert moves == [(3, 0, 1)] and c2.fragmentation() == 0.0
    k, v, _, _ = _step(c2, [2], [1], np.zeros((1, 2, 2), np.float32), np.zeros((1, 2, 2), np.float32))
    assert np.array_equal(k[:, :2], x2[[3, 1]].transpose(1, 0, 2))
    assert np.array_equal(v[:, :2], -x2[[3, 1]].transpose(1, 0, 2))


def test_v_trans_rejects_quantized():
    with pytest.raises(ValueError):
        Causal(1, 64, 64, Type.Q8_0, v_trans=True)


def _reference(q, hist, positions, seqs, scale, group, window=None, except_rows=(), chunk=None):
    n, n_head, d = q.shape
    out = np.zeros_like(q)
    for i, (p, s) in enumerate(zip(positions, seqs)):
        items = [(pp, kk, vv) for pp, kk, vv in hist[s]
                 if (pp <= p or i in except_rows)
                 and (window is None or pp >= p - window)
                 and (chunk is None or pp >= p - p % chunk)]
        ks = np.stack([it[1] for it in items])
        vs = np.stack([it[2] for it in items])
        for h in range(n_head):
            logits = ks[:, h // group] @ q[i, h] * scale
            w = np.exp(logits - logits.max())
            out[i, h] = (w / w.sum()) @ vs[:, h // group]
    return out


def _attention_run(c, steps, d, n_head, n_head_kv, seed=1, ref_kw=None, fwd_kw=None):
    rng = np.random.default_rng(seed)
    scale = 1 / np.sqrt(d)
    hist = {s: [] for s in range(c.cells.n_seq_max)}
    rnd = (lambda a: a.astype(np.float16).astype(np.float32)) if c.dtype == Type.F16 else (lambda a: a)
    for j, (positions, seqs) in enumerate(steps):
        n = len(positions)
        q = rng.standard_normal((n, n_head, d)).astype(np.float32)
        k = rng.standard_normal((n, n_head_kv, d)).astype(np.float32)
        v = rng.standard_normal((n, n_head_kv, d)).astype(np.float32)
        for i, (p, s) in enumerate(zip(positions, seqs)):
            hist[s].append((p, rnd(k[i]), rnd(v[i])))
        kw = (fwd_kw or {}).get(j, {})
        plan = c.start_forward(positions, seqs, **kw)
        with ggmlpy.Context(1 << 22) as ctx:
            qt = ctx.new_tensor(Type.F32, (d, n_head, n))
            qt.set(q)
            kt = ctx.new_tensor(Type.F32, (d, n_head_kv, n))
            kt.set(k)
            vt = ctx.new_tensor(Type.F32, (d, n_head_kv, n))
            vt.set(v)
            gf = ctx.new_graph(128)
            for t in c.put(ctx, 0, plan, kt, vt):
                gf.build_forward_expand(t)
            kv, vv, mask = c.get(ctx, 0, plan, mask_type=Type.F32)
            qp = ctx.permute(qt, 0, 2, 1, 3)               # (d, n, n_head)
            kq = ctx.mul_mat(kv, qp)                        # (n_kv, n, n_head)
            kq = ctx.soft_max_ext(kq, mask, float(scale))
            if not c.v_trans:
                vv = ctx.cont(ctx.permute(vv, 1, 0, 2, 3))  # (n_kv, d, n_head_kv)
            else:
                assert vv.ne[:3] == (plan.n_kv, d, n_head_kv)
            o = ctx.mul_mat(vv, kq)                         # (d, n, n_head)
            o = ctx.cont(ctx.permute(o, 0, 2, 1, 3))        # (d, n_head, n)
            gf.build_forward_expand(o)
            gf.compute(2)
            got = o.get().reshape(n, n_head, d)
        c.apply(plan)
        rk = dict(ref_kw or {})
        if "except_rows" in kw:
            rk["except_rows"] = set(kw["except_rows"])
        want = _reference(q, hist, positions, seqs, scale, n_head // n_head_kv, **rk)
        np.testing.assert_allclose(got, want, atol=2e-2, rtol=2e-2)


@VT
@pytest.mark.parametrize("dtype", [Type.F32, Type.F16])
def test_mul_mat_attention_over_two_sequences(v_trans, dtype):
    c = _cache(16, 2, 8, dtype, head_dim=8, n_head_kv=2, v_trans=v_trans)
    steps = [([0, 0, 1, 1, 2], [0, 1, 0, 1, 0]), ([3, 2, 3], [0, 1, 1]), ([4, 5, 4], [0, 0, 1])]
    _attention_run(c, steps, 8, 4, 2)


# ---------------------------------------------------------------- 2. non-causal spans


@VT
def test_non_causal_span(v_trans):
    c = _cache(16, 2, 8, v_trans=v_trans)
    _step(c, [0, 1], [0, 0])
    # seq 0 continues with a bidirectional span at batch rows 1..2 (pos 3, 4); seq 1 interleaved
    _, _, mask, plan = _step(c, [2, 3, 4, 5, 0], [0, 0, 0, 0, 1], except_rows=[1, 2])
    assert plan.cell_ids.tolist() == [2, 3, 4, 5, 6]
    assert np.array_equal(mask, _m(
        "oooxxxx",    # pos 2: causal
        "oooooox",    # pos 3: sees 4 and 5 too (own sequence, this batch)
        "oooooox",    # pos 4: likewise
        "oooooox",    # pos 5: causal, sees everything before
        "xxxxxxo",    # seq 1: isolated
    ))
    # the exemption is per batch: the next batch is causal again
    _, _, mask, _ = _step(c, [6, 1], [0, 1], except_rows=[])
    assert np.array_equal(mask, _m("ooooooxox", "xxxxxxoxo"))
    with pytest.raises(ValueError):
        c.start_forward([7], [0], except_rows=[3])


def test_non_causal_span_keeps_window():
    w = _cache(16, 1, 8, window=1)
    _, _, mask, _ = _step(w, [0, 1, 2, 3], [0] * 4, except_rows=[1])
    assert np.array_equal(mask, _m("oxxx", "oooo", "xoox", "xxoo"))


@VT
def test_attention_windowed_and_non_causal(v_trans):
    c = _cache(16, 2, 8, Type.F16, head_dim=8, n_head_kv=2, v_trans=v_trans, window=3)
    steps = [([0, 0, 1, 1, 2], [0, 1, 0, 1, 0]), ([3, 2, 3, 4], [0, 1, 1, 1]), ([4, 5, 5], [0, 0, 1])]
    _attention_run(c, steps, 8, 4, 2, ref_kw={"window": 3}, fwd_kw={1: {"except_rows": [1, 2]}})


# ---------------------------------------------------------------- 3. windowed memory


@VT
def test_swa_mem(v_trans):
    # Ollama TestSWAMem: window 1, memory 3
    c = _cache(16, 1, 4, window=1, memory=3, v_trans=v_trans)
    assert (c.memory, c.n_cells) == (3, 7)
    k, v, mask, _ = _step(c, [0, 1, 2, 3], [0] * 4)
    assert np.array_equal(mask, _m("oxxx", "ooxx", "xoox", "xxoo"))
    k, v, mask, plan = _step(c, [4, 5], [0, 0])
    assert plan.trim == {0: 4} and plan.cell_ids.tolist() == [0, 4]
    assert _flat(k) == _flat(v) == [5, 2, 3, 4, 6]  # pos 0 evicted, 1..3 kept but masked
    assert np.array_equal(mask, _m("oxxox", "oxxxo"))
    assert (c.seq_pos_min(0), c.seq_pos_max(0)) == (1, 5)


def test_swa_mem_sizing_and_validation():
    assert _cache(16, 1, 4, window=2, memory=5).memory == 5
    assert _cache(16, 2, 4, window=2, memory=2).memory == 3  # several sequences: window + 1
    assert _cache(16, 2, 4, window=2, memory=5).memory == 5
    c = _cache(4, 1, 4, window=2, memory=8)  # memory >= capacity: unlimited
    assert (c.memory, c.n_cells) == (None, 4)
    assert _cache(16, 1, 4, window=2, memory=0).memory == 2  # 0 means the window
    with pytest.raises(ValueError):
        Causal(1, 4, 4, Type.F32, window=4, memory=3)
    with pytest.raises(ValueError):
        Causal(1, 4, 4, Type.F32, memory=3)
    with pytest.raises(ValueError):
        Causal(1, 4, 4, Type.F32, window=4, memory=-1)


@pytest.mark.parametrize("memory, want", [
    (None, [True] + [False] * 4 + [True] * 2),      # Ollama TestCanResume (window 4)
    (5, [True] + [False] * 5 + [True] * 2),         # Ollama TestCanResumeSWAMem (window 4, memory 5)
])
def test_can_resume_windowed(memory, want):
    c = _cache(16, 1, 8, window=4, memory=memory)
    first = list(range(7)) if memory else list(range(5))
    _step(c, first, [0] * len(first))
    assert all(c.can_resume(0, p) for p in range(len(first) + 1))
    _step(c, [len(first)], [0])
    got = [c.can_resume(0, p) for p in range(len(want))]
    assert got == want
    assert not c.can_resume(0, len(first) + 2)  # past the last stored position + 1


def test_swa_mem_evicts_idle_sequence_and_fills():
    c = _cache(16, 2, 2, window=1, memory=2)
    assert (c.memory, c.n_cells) == (2, 6)
    _step(c, [0, 1], [0, 0])
    _step(c, [0, 1], [1, 1])
    _step(c, [2, 3], [0, 0])  # lowest 2: seq 0 keeps pos >= 0; seq 1 idle at 2 keeps >= 0
    assert c.cells.used == 6
    _, _, _, plan = _step(c, [4, 5], [0, 0])  # seq 0 drops pos < 2, frees two cells
    assert plan.cell_ids.tolist() == [0, 1]
    with pytest.raises(KVCacheFull):
        c.start_forward([2, 3, 4], [1, 1, 1])


# ---------------------------------------------------------------- 4. K-only cache (V read from K's rows)


def _k_only(n_layers=2, dtype=Type.F32, **kw) -> Causal:
    # rows of 6: a "latent" of 4 (the V) then 2 more values; one KV head, as multi-head latent attention
    c = Causal(n_layers, 6, 4, dtype, n_head_kv=1, v_in_k=True, **kw)
    c.init(16, 2, 8)
    return c


def test_k_only_cache_reads_v_from_k():
    """put writes K alone (v=None); get's V is the first n_embd_v values of each K row, the same memory."""
    c = _k_only()
    assert c.values == [] and [k.ne[:2] for k in c.keys] == [(6, c.n_cells)] * 2
    x = np.arange(3 * 6, dtype=np.float32).reshape(3, 1, 6) + 1
    plan = c.start_forward([0, 1, 2], [0, 0, 0])
    with ggmlpy.Context(1 << 20) as ctx:
        gf = ctx.new_graph(64)
        kt = ctx.new_tensor(Type.F32, (6, 1, 3))
        kt.set(x)
        writes = c.put(ctx, 1, plan, kt, None)
        assert len(writes) == 1
        for t in writes:
            gf.build_forward_expand(t)
        kv, vv, _ = c.get(ctx, 1, plan)
        assert kv.ne[:3] == (6, plan.n_kv, 1) and vv.ne[:3] == (4, plan.n_kv, 1)
        kc, vc = ctx.cont(kv), ctx.cont(vv)
        gf.build_forward_expand(kc)
        gf.build_forward_expand(vc)
        gf.compute(1)
        np.testing.assert_array_equal(kc.numpy().reshape(-1, 6)[:3], x[:, 0])
        np.testing.assert_array_equal(vc.numpy().reshape(-1, 4)[:3], x[:, 0, :4])
        with pytest.raises(ValueError, match="K-only cache"):
            c.put(ctx, 0, plan, kt, kt)
    c.apply(plan)
    assert c.bytes_per_layer() == c.keys[0].nbytes == c.n_cells * 6 * 4


def test_k_only_cache_options_are_checked():
    with pytest.raises(ValueError, match="n_embd_v <= n_embd_k"):
        Causal(1, 4, 6, v_in_k=True)
    with pytest.raises(ValueError, match="K's type"):
        Causal(1, 6, 4, Type.F16, dtype_v=Type.F32, v_in_k=True)
    with pytest.raises(ValueError, match="transposed"):
        Causal(1, 6, 4, v_in_k=True, v_trans=True)
    c = Causal(1, 64, 32, Type.F16, v_in_k=True)
    assert c.dtype_v == Type.F16 and c.host_bytes(16, 1, 4) == Causal(1, 64, 32, Type.F16).host_bytes(16, 1, 4) \
        - 16 * 32 * 2


def test_k_only_cache_placed_reports_k_alone():
    """On a device: one tensor per layer, and the memory report's cache is its bytes (no V)."""
    from ggmlpy import backend as bk

    cpu = bk.choose_devices("cpu")[-1]
    placement = bk.Placement(layers=[cpu] * 2, output=cpu, input=cpu)
    report = bk.MemoryReport(2)
    c = Causal(2, 96, 64, Type.F16, v_in_k=True)
    c.init(capacity=32, n_seq_max=1, max_batch=4, placement=placement, report=report)
    try:
        assert c.values == [] and len(c.keys) == 2
        assert sum(report.devices["CPU"].cache.values()) == 2 * c.n_cells * 96 * 2
    finally:
        c.close()


def test_k_only_cache_state_round_trip(tmp_path):
    """save_seq/load_seq write and read K rows only (v_row_bytes 0); a full cache's file is refused."""
    c = _k_only()
    x = np.random.default_rng(0).standard_normal((5, 1, 6)).astype(np.float32)
    for layer in range(2):
        plan = c.start_forward(list(range(5)), [1] * 5)
        with ggmlpy.Context(1 << 20) as ctx:
            gf = ctx.new_graph(16)
            kt = ctx.new_tensor(Type.F32, (6, 1, 5))
            kt.set(x * (layer + 1))
            for t in c.put(ctx, layer, plan, kt, None):
                gf.build_forward_expand(t)
            gf.compute(1)
        if layer == 1:
            c.apply(plan)
    n = c.save_seq(1, tmp_path / "s.bin")
    assert n < 5 * 2 * 6 * 4 + 4096
    d = _k_only()
    d.load_seq(0, tmp_path / "s.bin")
    cells = np.flatnonzero(d.cells.seqs[:, 0])
    for layer in range(2):
        np.testing.assert_array_equal(d.keys[layer].numpy()[cells], x[:, 0] * (layer + 1))
    full = Causal(2, 6, 4, Type.F32, n_head_kv=1)
    full.init(16, 2, 8)
    from ggmlpy.kvcache import StateError

    with pytest.raises(StateError, match="v_row_bytes"):
        full.load_seq(0, tmp_path / "s.bin")


# ---------------------------------------------------------------- 4. chunked attention


def test_chunk_mask():
    # chunk 3: positions 0-2, 3-5, 6-8 are the chunks; a token sees its own chunk up to itself
    c = _cache(16, 2, 8, chunk=3)
    _, _, mask, _ = _step(c, [0, 1, 2, 3, 4, 0], [0, 0, 0, 0, 0, 1])
    assert np.array_equal(mask, _m("oxxxxx", "ooxxxx", "oooxxx", "xxxoxx", "xxxoox", "xxxxxo"))
    # one token at a time (the planner's one-token path): the chunk's start moves with the position; each
    # sequence keeps its last chunk + 1 positions (two sequences), the older cells are evicted and reused
    assert (c.memory, c.n_cells) == (4, 16)
    for p, seen in ((5, {3, 4, 5}), (6, {6}), (7, {6, 7})):
        plan = c.start_forward([p], [0])
        cells = c.cells.copy() if plan._after is None else plan._after
        pos = np.asarray(cells.pos).copy()
        pos[plan.cell_ids[0]] = p
        visible = np.flatnonzero(plan.mask[0] == 0) + plan.lo
        assert set(pos[visible].tolist()) == seen, (p, pos, plan.mask)
        _step(c, [p], [0])
    assert c.seq_pos_min(0) == 7 - 4 and c.can_resume(0, 8) and not c.can_resume(0, 9)
    # a cache of one sequence keeps chunk positions; as large as the capacity, it keeps everything
    assert _cache(16, 1, 8, chunk=3).memory == 3 and _cache(16, 1, 8, chunk=16).memory is None


def test_chunk_masks_against_a_reference():
    """Random batches of several sequences, one token or many, through caches of chunk 1 to 5: every plan's
    mask is the rule's, computed from the cells (own sequence, not later, not before the row's chunk)."""
    rng = np.random.default_rng(3)
    for chunk in (1, 2, 3, 5):
        c = _cache(64, 3, 8, chunk=chunk)
        nxt = [0, 0, 0]
        for _ in range(20):
            n = int(rng.integers(1, 6))
            seqs = rng.integers(0, 3, n).tolist()
            positions = []
            for s in seqs:
                positions.append(nxt[s])
                nxt[s] += 1
            plan = c.start_forward(positions, seqs)
            after = plan._after if plan._after is not None else None
            pos, owned = (after.pos, after.seqs) if after is not None else (c.cells.pos.copy(), c.cells.seqs.copy())
            if after is None:      # a one-token plan: its cell is written by apply
                pos, owned = pos.copy(), owned.copy()
                pos[plan.cell_ids[0]], owned[plan.cell_ids[0], seqs[0]] = positions[0], True
            cp, co = pos[plan.lo:plan.hi], owned[plan.lo:plan.hi]
            p = np.asarray(positions)[:, None]
            want = co[:, seqs].T & (cp[None, :] <= p) & (cp[None, :] >= p - p % chunk)
            np.testing.assert_array_equal(plan.mask == 0, want)
            c.apply(plan)


@VT
def test_attention_chunked(v_trans):
    c = _cache(16, 2, 8, Type.F16, head_dim=8, n_head_kv=2, v_trans=v_trans, chunk=3)
    steps = [([0, 0, 1, 1, 2], [0, 1, 0, 1, 0]), ([3, 2, 3, 4], [0, 1, 1, 1]), ([4], [0]), ([5, 5, 6], [1, 0, 0])]
    _attention_run(c, steps, 8, 4, 2, ref_kw={"chunk": 3})


def test_chunk_validation_and_state(tmp_path):
    with pytest.raises(ValueError, match="chunk"):
        Causal(1, 8, 8, chunk=0)
    with pytest.raises(ValueError, match="chunk"):
        Causal(1, 8, 8, chunk=4, window=3)
    c = _cache(16, 1, 8, head_dim=8, chunk=4)
    _step(c, list(range(6)), [0] * 6, k=np.ones((6, 1, 8), np.float32))
    path = tmp_path / "seq.bin"
    with open(path, "wb") as f:
        c.save_seq(0, f)
    same = _cache(16, 1, 8, head_dim=8, chunk=4)
    with open(path, "rb") as f:
        same.load_seq(0, f)
    assert same.seq_pos_max(0) == 5
    # the chunk is part of the configuration a state must match
    for other in (_cache(16, 1, 8, head_dim=8, chunk=2), _cache(16, 1, 8, head_dim=8)):
        with open(path, "rb") as f, pytest.raises(Exception, match="chunk"):
            other.load_seq(0, f)
