"""Multi-head latent attention over decompressed heads (models/blocks.py ``_mla_heads``, ``mla_heads_pay``):
the prompt path of deepseek2 against numpy, and the rule that chooses it. The model-level checks (logits against
transformers through files written by llama.cpp's converter) are in test_arch_deepseek.py."""

from __future__ import annotations

import numpy as np
import pytest

import ggmlpy
from ggmlpy import Op, Type, _core
from ggmlpy.models import blocks


def softmax_rows(s: np.ndarray) -> np.ndarray:
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def dequantized(ctx, t):
    """``t``'s values as float32 numpy (``t`` computed already)."""
    f = ctx.cast(t, Type.F32)
    gf = ctx.new_graph()
    gf.build_forward_expand(f)
    gf.compute(1)
    return f.numpy().copy()


@pytest.mark.parametrize("wtype", ["F32", "F16", "Q8_0"])
@pytest.mark.parametrize("ctype", ["F16", "F32"])
@pytest.mark.parametrize("dv", [32, 40])
def test_decompressed_heads_match_numpy(wtype, ctype, dv):
    """A batch of 96 rows after 40 cells of history, in a window of 192 cells whose last 56 hold garbage
    (hidden cells must not leak): each head's keys ``[latent · k_b^T, k_pe]`` and values ``latent · v_b^T``
    from the cached rows, attended causally. ``dv`` 32 runs ggmlpy's ``attn_prefill`` where it is
    vectorised, 40 ggml's ``flash_attn_ext``; the per-head matrices in the model's types (Q8_0: the
    products read the activations rounded to 8 bits, as every Q8_0 product does)."""
    rng = np.random.default_rng(1)
    nope, rd, lora, n_head, hist, n, n_kv = 32, 16, 64, 4, 40, 96, 192
    dk = nope + rd
    kb = rng.standard_normal((n_head, lora, nope)).astype(np.float32) * 0.2     # ne (nope, lora, n_head)
    vb = rng.standard_normal((n_head, dv, lora)).astype(np.float32) * 0.2       # ne (lora, dv, n_head)
    cache = rng.standard_normal((n_kv, lora + rd)).astype(np.float32)
    cache[hist + n:] = 300.0
    cache = cache.astype(np.float16 if ctype == "F16" else np.float32)
    q = rng.standard_normal((n, n_head, dk)).astype(np.float32)
    mask = np.zeros((n, n_kv), np.float16)
    mask[:, hist + n:] = -np.inf
    mask[:, hist:hist + n][np.triu_indices(n, 1)] = -np.inf
    with ggmlpy.Context(1 << 26) as ctx:
        tkb, tvb = ctx.from_numpy(kb), ctx.from_numpy(vb)
        if wtype != "F32":
            tkb, tvb = ctx.cast(tkb, Type[wtype]), ctx.cast(tvb, Type[wtype])
            gf = ctx.new_graph()
            gf.build_forward_expand(tkb)
            gf.build_forward_expand(tvb)
            gf.compute(1)
            kb, vb = dequantized(ctx, tkb), dequantized(ctx, tvb)
        tc, tq, tm = ctx.from_numpy(cache), ctx.from_numpy(q), ctx.from_numpy(mask)
        kv_k = ctx.view(tc, (lora + rd, n_kv, 1), (tc.nb[1], tc.nb[1] * n_kv), 0)
        kv_v = ctx.view(tc, (lora, n_kv, 1), (tc.nb[1], tc.nb[1] * n_kv), 0)
        out = blocks._mla_heads(ctx, tq, kv_k, kv_v, tm, tkb, tvb, scale=0.15)
        attn = out.src[0].op                                # out is a reshape of the attention's result
        gf = ctx.new_graph(256)
        gf.build_forward_expand(out)
        gf.compute(2)
        got = out.numpy().reshape(n, n_head, dv)
    assert attn == (Op.CUSTOM if _core._attn_prefill_vectorized(dk, dv) else Op.FLASH_ATTN_EXT)
    lat, kpe = cache[:, :lora].astype(np.float32), cache[:, lora:].astype(np.float32)
    want = np.empty((n, n_head, dv), np.float32)
    seen = slice(0, hist + n)
    for h in range(n_head):
        k = np.concatenate([lat[seen] @ kb[h], kpe[seen]], 1)
        v = lat[seen] @ vb[h].T
        want[:, h] = softmax_rows(q[:, h] @ k.T * 0.15 + mask[:, seen]) @ v
    # float16 rounds the latent (the cache) or the product's input (float16 weights)
    tol = 1e-2 if wtype == "Q8_0" else 2e-5 if ctype == wtype == "F32" else 1e-3
    assert np.isfinite(got).all()
    assert np.abs(got - want).max() <= tol * np.abs(want).max()


# DeepSeek-V3's widths, and the synthetic 110M model's
V3 = dict(n_head=128, kv_lora=512, head_dim=192, head_dim_v=128, rope_dim=64)
S110 = dict(n_head=12, kv_lora=256, head_dim=96, head_dim_v=64, rope_dim=32)


def test_the_heads_are_taken_where_they_take_fewer_operations():
    pay = blocks.mla_heads_pay
    for w in (V3, S110):
        assert pay(512, 512, 4096, **w)                      # a prompt
        assert pay(512, 4096, 4096, **w)                     # a prompt's last micro-batch, deep in the context
        assert not pay(1, 512, 4096, **w)                    # generation
        assert not pay(32, 4096, 4096, **w)                  # a few rows over a long history
    # the break-even rows: about kv_lora (nope + dv) / (2 kv_lora + rd - head_dim - head_dim_v)
    assert pay(256, 256, 4096, **V3) and not pay(128, 4096, 4096, **V3)
    assert pay(128, 256, 4096, **S110) and not pay(64, 256, 4096, **S110)


def test_the_heads_stay_within_their_memory_budget(monkeypatch):
    """The decompressed keys and values of the whole cache (float32) bound the choice, so the reservation at
    full context holds every graph's; beyond the budget, the absorbed path."""
    per_cell = V3["n_head"] * (V3["head_dim"] + V3["head_dim_v"]) * 4
    cells = blocks.MLA_HEADS_MAX_BYTES // per_cell
    assert blocks.mla_heads_pay(512, 512, cells, **V3)
    assert not blocks.mla_heads_pay(512, 512, cells + 1, **V3)
    monkeypatch.setattr(blocks, "MLA_HEADS_MAX_BYTES", per_cell * 1000)
    assert not blocks.mla_heads_pay(512, 512, 1024, **V3)
