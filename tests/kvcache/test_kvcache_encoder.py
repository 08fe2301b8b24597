"""kvcache.Encoder: a non-causal encoder's cache (nothing stored). Its mask against one written out by hand
(llama.cpp's no-cache mask: a row sees the rows of its own sequence), the attention it feeds against numpy, its
refusals (each before ggml could read out of bounds), and the sequence operations that have nothing to do."""

from __future__ import annotations

import numpy as np
import pytest

import ggmlpy
from ggmlpy import GGMLTypeError, GGMLValueError
from ggmlpy.kvcache import CacheStateError, Encoder, EncoderPlan, NotSupported


def cache(**kw) -> Encoder:
    c = Encoder(2, **kw)
    c.init(16, 4, 8)
    return c


def test_mask_is_each_sequence_its_own_rows():
    seqs = np.array([2, 2, 0, 0, 0, 1])
    pos = np.array([0, 1, 0, 1, 2, 0])
    plan = cache().start_forward(pos, seqs)
    want = np.full((6, 6), -np.inf, np.float16)
    for i in range(6):
        for j in range(6):
            if seqs[i] == seqs[j]:
                want[i, j] = 0
    np.testing.assert_array_equal(plan.mask, want)
    assert plan.mask.dtype == np.float16 and plan.key == () and plan.n_kv == 6
    causal = cache(causal=True).start_forward(pos, seqs)
    assert causal.mask[3, 4] == -np.inf and causal.mask[4, 3] == 0 and causal.mask[0, 1] == -np.inf


def test_attention_through_the_cache_matches_numpy():
    """put/get give this batch's K and V as attention reads a cache (ne = (head_dim, n, n_head_kv)); softmax
    over the mask equals numpy's per-sequence attention."""
    rng = np.random.default_rng(0)
    hd, nh, n = 8, 2, 5
    seqs, pos = np.array([0, 0, 1, 1, 1]), np.array([0, 1, 0, 1, 2])
    q, k, v = (rng.standard_normal((n, nh, hd)).astype(np.float32) for _ in range(3))
    c = cache()
    plan = c.start_forward(pos, seqs)
    with ggmlpy.Context(1 << 22) as ctx:
        fw = c.forward(ctx, plan).set_layer(1)
        assert fw.put(ctx.from_numpy(k), ctx.from_numpy(v)) == () and fw.pending == []
        kk, vv, mask = fw.get()
        assert kk.ne[:3] == (hd, n, nh) and vv.ne[:3] == (hd, n, nh) and mask.ne[:2] == (n, n)
        qp = ctx.permute(ctx.from_numpy(q), 0, 2, 1, 3)
        kq = ctx.soft_max_ext(ctx.mul_mat(kk, qp), mask, scale=0.5)                 # (n_kv, n, nh)
        o = ctx.mul_mat(ctx.cont(ctx.permute(vv, 1, 0, 2, 3)), kq)                   # (hd, n, nh)
        gf = ctx.new_graph()
        gf.build_forward_expand(o)
        gf.compute(1)
        got = o.numpy()                                                              # (nh, n, hd)
    for h in range(nh):
        for i in range(n):
            same = seqs == seqs[i]
            s = 0.5 * k[same, h] @ q[i, h]
            w = np.exp(s - s.max())
            np.testing.assert_allclose(got[h, i], (w / w.sum()) @ v[same, h], rtol=1e-5, atol=1e-6)


def test_refusals_name_what_is_wrong():
    c = cache(n_pos=4)
    with pytest.raises(GGMLValueError, match="past the model's 4 positions"):
        c.start_forward([0, 1, 2, 3, 4], [0] * 5)
    with pytest.raises(GGMLValueError, match="sequence 1 starts at position 2"):
        c.start_forward([0, 1, 2, 3], [0, 0, 1, 1])
    with pytest.raises(GGMLValueError, match="sequence id 4 out of range"):
        c.start_forward([0], [4])
    with pytest.raises(GGMLValueError, match="more than the 8"):
        c.start_forward(list(range(9)), [0] * 9)
    with pytest.raises(GGMLValueError, match="differ in length"):
        c.start_forward([0, 1], [0])
    with pytest.raises(GGMLTypeError, match="EncoderPlan"):
        c.apply(object())
    with pytest.raises(CacheStateError):
        Encoder(1).start_forward([0], [0])
    with ggmlpy.Context(1 << 20) as ctx:
        fw = c.forward(ctx, c.start_forward([0, 1], [0, 0]))
        with pytest.raises(GGMLValueError, match="set_layer"):
            fw.put(ctx.new_tensor(ggmlpy.Type.F32, (4, 1, 2)), ctx.new_tensor(ggmlpy.Type.F32, (4, 1, 2)))
        with pytest.raises(GGMLValueError, match="out of range"):
            fw.set_layer(2)
        fw.set_layer(0)
        with pytest.raises(GGMLValueError, match="does not hold the batch's 2 rows"):
            fw.put(ctx.new_tensor(ggmlpy.Type.F32, (4, 1, 3)), ctx.new_tensor(ggmlpy.Type.F32, (4, 1, 3)))


def test_nothing_is_kept():
    c = cache()
    plan = c.start_forward([0, 1, 2], [1, 1, 1])
    c.apply(plan)
    assert c.seq_pos_max(1) == -1 and c.can_resume(1, 0) and not c.can_resume(1, 3)
    c.remove(1, 0)
    c.copy_prefix(1, 2, 3)
    c.clear(1)
    c.clear()
    assert c.fragmentation() == 0.0 and c.defrag() == []
    with pytest.raises(NotSupported):
        c.save_seq(1, "x")
    with pytest.raises(NotSupported):
        c.load_seq(1, "x")
    assert isinstance(c.start_forward([0], [0], reserve=True), EncoderPlan)
    c.close()
    with pytest.raises(CacheStateError):
        c.seq_pos_max(0)
