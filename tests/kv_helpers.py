"""Helpers shared by the KV cache tests: mask literals, small caches, one forward step."""

from __future__ import annotations

import numpy as np

import ggmlpy
from ggmlpy import Type
from ggmlpy.kvcache import Causal

X = -np.inf


def _m(*rows: str) -> np.ndarray:
    """Mask from strings: 'o' = visible (0.0), 'x' = masked (-inf)."""
    return np.array([[0.0 if ch == "o" else X for ch in r] for r in rows], dtype=np.float32)


def _cache(capacity=16, n_seq=1, max_batch=8, dtype=Type.F32, *, head_dim=1, n_head_kv=1,
           n_layers=1, **kw) -> Causal:
    c = Causal(n_layers, head_dim * n_head_kv, head_dim * n_head_kv, dtype, n_head_kv=n_head_kv, **kw)
    c.init(capacity, n_seq, max_batch)
    return c


def _vnp(vv, v_trans: bool) -> np.ndarray:
    """A V view read back as numpy (n_head_kv, n_kv, head_dim) whatever the layout."""
    a = vv.get().reshape(vv.ne[2], vv.ne[1], vv.ne[0])
    return a.transpose(0, 2, 1) if v_trans else a


def _expand_put(ctx, gf, cache, layer, plan, k, v) -> None:
    """Expand into ``gf`` the cache write of ``k``/``v`` (numpy ``(n, n_head_kv, head_dim)``, F32)."""
    kt = ctx.new_tensor(Type.F32, k.shape[::-1])
    kt.set(k)
    vt = ctx.new_tensor(Type.F32, v.shape[::-1])
    vt.set(v)
    for t in cache.put(ctx, layer, plan, kt, vt):
        gf.build_forward_expand(t)


def _step(cache, positions, seqs, k=None, v=None, layer=0, **kw):
    """One forward: put, get, compute, apply. Views as numpy (n_head_kv, n_kv, head_dim)."""
    plan = cache.start_forward(positions, seqs, **kw)
    n = plan.n_batch
    if k is None:
        k = (np.asarray(positions, dtype=np.float32) + 1).reshape(n, 1, 1)
    if v is None:
        v = k
    with ggmlpy.Context(1 << 20) as ctx:
        gf = ctx.new_graph(64)
        _expand_put(ctx, gf, cache, layer, plan, k, v)
        kv, vv, mask = cache.get(ctx, layer, plan)
        kc, vc = ctx.cont(kv), ctx.cont(vv)
        gf.build_forward_expand(kc)
        gf.build_forward_expand(vc)
        gf.compute(2)
        out = (kc.get().reshape(kv.ne[2], kv.ne[1], kv.ne[0]), _vnp(vc, cache.v_trans),
               mask.get().astype(np.float32).reshape(n, -1))
    cache.apply(plan)
    return (*out, plan)


def _flat(a) -> list:
    return np.asarray(a).reshape(-1).tolist()
