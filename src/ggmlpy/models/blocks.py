"""Graph building blocks the architectures compose: norms, RoPE, Q/K/V, attention through the cache,
feed-forward (gated, mixture of experts) and the output head.

Each block is a plain function of a :class:`~ggmlpy.Context` and tensors that adds ops to the graph
and returns the result; nothing here holds state. Tensors are in ggml's ``ne`` order: activations
are ``ne = (n_embd, n)`` for ``n`` tokens, heads ``ne = (head_dim, n_head, n)``. Blocks that read
weights by name take ``w``, any mapping from GGUF tensor names to tensors that supports ``in``
(:class:`ggmlpy.weights.Weights`, or a dict in tests), and ``prefix``, the layer's ``"blk.{i}."``;
they accept the file's separate weights and the fused ones
:class:`~ggmlpy.models.decoder.DecoderModel` makes (``attn_qkv``, ``ffn_gate_up``).

Examples
--------
>>> import numpy as np, ggmlpy
>>> from ggmlpy.models import blocks
>>> with ggmlpy.Context(1 << 20) as ctx:
...     x = ctx.from_numpy(np.array([3.0, 4.0], np.float32))         # one token of n_embd = 2
...     y = blocks.rms_norm(ctx, x, ctx.from_numpy(np.array([1.0, 2.0], np.float32)), 1e-6)
...     gf = ctx.new_graph(); gf.build_forward_expand(y); gf.compute(1)
...     np.round(y.numpy(), 3)
array([0.849, 2.263], dtype=float32)
"""

from __future__ import annotations

import math
import os
from typing import Any, Optional

from ggmlpy import _core
from ggmlpy._core import Context, GGMLValueError, Tensor, Type

from . import kernels

__all__ = ["GATINGS", "GLU", "SWIGLU_OAI", "attention", "ffn_glu", "mla", "mla_heads_pay", "moe_ffn", "norm",
           "output", "qkv", "rms_norm", "rope", "softcap"]

#: Activations of the gated feed-forward: name -> (op on the fused gate-and-up rows, op on separate
#: gate and up). Both apply the activation to the gate and multiply by up; "gelu" is the tanh
#: approximation (gemma's ``gelu_pytorch_tanh``).
GLU = {"silu": (Context.swiglu, Context.swiglu_split), "gelu": (Context.geglu, Context.geglu_split)}


def rms_norm(ctx: Context, x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of each row of ``x`` times ``weight``: ``x / sqrt(mean(x**2) + eps) * weight``."""
    return ctx.mul(ctx.rms_norm(x, eps), weight)


def norm(ctx: Context, x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, eps: float = 1e-5) -> Tensor:
    """LayerNorm of each row of ``x``: ``(x - mean) / sqrt(var + eps) * weight (+ bias)``."""
    y = ctx.mul(ctx.norm(x, eps), weight)
    return y if bias is None else ctx.add(y, bias)


def rope(ctx: Context, x: Tensor, pos: Tensor, cfg: Any, freq_factors: Optional[Tensor] = None) -> Tensor:
    """Rotary embedding of ``x`` (``ne = (head_dim, n_head, n)``) at the I32 positions ``pos`` (``ne = (n,)``).

    ``cfg`` holds the settings, as :class:`~ggmlpy.models.config.DecoderConfig` names them
    (``rope_dim``, ``rope_mode``, ``n_ctx_orig``, ``rope_base``, ``rope_freq_scale``,
    ``rope_ext_factor``, ``rope_attn_factor``); ``freq_factors`` divides each frequency
    (``rope_freqs.weight``, ``ne = (rope_dim / 2,)``).
    """
    return ctx.rope_ext(x, pos, freq_factors, n_dims=cfg.rope_dim, mode=cfg.rope_mode, n_ctx_orig=cfg.n_ctx_orig,
                        freq_base=cfg.rope_base, freq_scale=cfg.rope_freq_scale, ext_factor=cfg.rope_ext_factor,
                        attn_factor=cfg.rope_attn_factor)


def rope_shift(ctx: Context, k: Tensor, delta: Tensor, cfg: Any, freq_factors: Optional[Tensor] = None) -> Tensor:
    """Keys already rotated by :func:`rope`, rotated further by ``delta`` positions (a cache's shift).

    The same frequencies as :func:`rope`, but a pure rotation: the magnitude scale the forward pass
    applied once (``rope_attn_factor``, and YaRN's ``1 + 0.1 ln(1 / freq_scale)``, which ggml multiplies in
    whenever ``ext_factor`` is set) is not applied again, or every shift would grow the keys by it.
    """
    yarn = 1.0 + 0.1 * math.log(1.0 / cfg.rope_freq_scale) if cfg.rope_ext_factor != 0.0 else 1.0
    return ctx.rope_ext(k, delta, freq_factors, n_dims=cfg.rope_dim, mode=cfg.rope_mode, n_ctx_orig=cfg.n_ctx_orig,
                        freq_base=cfg.rope_base, freq_scale=cfg.rope_freq_scale, ext_factor=cfg.rope_ext_factor,
                        attn_factor=1.0 / yarn)


def qkv(ctx: Context, w, prefix: str, cur: Tensor, n_head: int, n_head_kv: int,
        head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """The query, key and value heads of the normed activations ``cur`` (``ne = (n_embd, n)``).

    Reads ``{prefix}attn_qkv.weight`` (the Q, K and V rows in one matrix, fused or as the file has
    it) or ``attn_q``/``attn_k``/``attn_v``, and adds the matching ``.bias`` tensors where ``w`` has
    them.

    Returns
    -------
    q, k, v : Tensor
        ``ne = (head_dim, n_head, n)`` and ``(head_dim, n_head_kv, n)`` twice. From a fused matrix they
        are strided views of its product (the token stride is the fused row), which RoPE and the cache
        take as they are.
    """
    n = cur.ne[1]
    if prefix + "attn_qkv.weight" in w:
        fused = linear(ctx, w[prefix + "attn_qkv.weight"], cur)          # (n_q + 2 n_kv, n): q, k, v rows
        if prefix + "attn_qkv.bias" in w:
            fused = ctx.add(fused, w[prefix + "attn_qkv.bias"])
        es, row = fused.nb[0], fused.nb[1]
        n_q, n_kv = n_head * head_dim, n_head_kv * head_dim
        q = ctx.view(fused, (head_dim, n_head, n), (head_dim * es, row), 0)
        k = ctx.view(fused, (head_dim, n_head_kv, n), (head_dim * es, row), n_q * es)
        v = ctx.view(fused, (head_dim, n_head_kv, n), (head_dim * es, row), (n_q + n_kv) * es)
        return q, k, v
    q, k, v = (linear(ctx, w[f"{prefix}attn_{x}.weight"], cur) for x in "qkv")
    q, k, v = (ctx.add(t, w[f"{prefix}attn_{x}.bias"]) if f"{prefix}attn_{x}.bias" in w else t
               for t, x in zip((q, k, v), "qkv"))
    return (ctx.reshape(q, (head_dim, n_head, n)), ctx.reshape(k, (head_dim, n_head_kv, n)),
            ctx.reshape(v, (head_dim, n_head_kv, n)))


def attention(ctx: Context, memory, layer: int, q: Tensor, k: Tensor, v: Optional[Tensor], *, scale: float,
              flash_attn: bool, logit_softcap: float = 0.0, sinks: Optional[Tensor] = None,
              on_cpu: bool = False) -> Tensor:
    """Write this batch's ``k`` and ``v`` into the cache and attend ``q`` over what the cache shows.

    ``memory`` is the graph's view of the cache (``cache.forward(ctx, plan)``): the layer's K/V go in
    with ``put`` and come back, with the mask (causal, window), from ``get``. Grouped-query attention
    (``n_head`` a multiple of ``n_head_kv``) is broadcast by the ops. ``flash_attn`` uses
    ``flash_attn_ext``; otherwise ``mul_mat`` + ``soft_max_ext`` + ``mul_mat``, reading V transposed
    where the cache stores it so (``memory.v_trans``).

    Parameters
    ----------
    q : Tensor
        ``ne = (head_dim, n_head, n)``, RoPE applied.
    k, v : Tensor
        ``ne = (head_dim, n_head_kv, n)``; ``v`` is None for a K-only cache (``v_in_k``: V is the first
        values of each K head, multi-head latent attention's compressed latent).
    scale : float
        Applied to ``q·k`` before the softmax (usually ``1 / sqrt(head_dim)``).
    logit_softcap : float
        When non-zero, the scaled logits are capped to ``logit_softcap * tanh(logits / logit_softcap)``
        before the mask and the softmax (gemma2; :func:`softcap`).
    sinks : Tensor, optional
        Attention sinks (gpt-oss): F32 ``ne = (n_head,)``, one learned logit per head that joins every
        query's softmax as if it were one more key, with no value: ``softmax([logits, sink])`` with the
        sink's share dropped, so a head may attend to nothing.

    With ``flash_attn``, ``on_cpu`` (the layer computes on the CPU backend: the caller's placement
    says so), a float16/float32 cache in host memory and no sinks, ggmlpy's own CPU kernels run
    instead of ``flash_attn_ext``: :meth:`~ggmlpy.Context.attn_decode` for fewer than
    :data:`DECODE_MAX_ROWS` tokens without soft-capping (generation; faster than ggml's at depth),
    and :meth:`~ggmlpy.Context.attn_prefill` from there on (prompts; about 3x ggml's).
    ``blocks.decode_kernel = False`` and ``blocks.prefill_kernel = False`` turn them off.

    Returns
    -------
    Tensor
        ``ne = (head_dim * n_head, n)``, before the output projection.
    """
    head_dim, n_head, n = q.ne[0], q.ne[1], q.ne[2]
    memory.set_layer(layer).put(k, v)
    kv_k, kv_v, mask = memory.get()
    if flash_attn and on_cpu and sinks is None and _kernel_ok(kv_k, kv_v):
        site = kernels.attn_site("attn_decode", kv_k, kv_v, n_head)
        if n < DECODE_MAX_ROWS and decode_kernel and not logit_softcap \
                and _core._attn_decode_vectorized(kv_k.ne[0], kv_v.ne[0]) and kernels.use(site):
            chunks = _decode_chunks(kv_k.ne[1])
            o = ctx.attn_decode(q, kv_k, kv_v, mask, scale=scale, n_chunks=chunks,
                                avx512=kernels.variant(site) != "avx2")              # (head_dim, n_head, n)
            return ctx.reshape(o, (head_dim * n_head, n))
        if n >= DECODE_MAX_ROWS and prefill_kernel and _core._attn_prefill_vectorized(kv_k.ne[0], kv_v.ne[0]) \
                and kernels.use(kernels.attn_site("attn_prefill", kv_k, kv_v, n_head)):
            o = ctx.attn_prefill(q, kv_k, kv_v, mask, scale=scale, logit_softcap=logit_softcap)
            return ctx.reshape(o, (head_dim * n_head, n))                              # o: (head_dim, n_head, n)
    qp = ctx.permute(q, 0, 2, 1, 3)                      # (head_dim, n, n_head)
    if flash_attn:
        o = ctx.flash_attn_ext(qp, kv_k, kv_v, mask, scale=scale, logit_softcap=logit_softcap,
                               sinks=sinks)                                      # (head_dim, n_head, n)
        return ctx.reshape(o, (head_dim * n_head, n))
    kq = ctx.mul_mat(kv_k, qp)                                      # (n_kv, n, n_head)
    if logit_softcap:
        kq, scale = softcap(ctx, kq, logit_softcap, scale), 1.0      # capped before the mask is added
    kq = ctx.soft_max_ext(kq, mask, scale=scale, sinks=sinks)
    if memory.v_trans:
        o = ctx.mul_mat(kv_v, kq)                                   # (head_dim, n, n_head)
    else:
        o = ctx.mul_mat(ctx.cont(ctx.permute(kv_v, 1, 0, 2, 3)), kq)
    return ctx.cont(ctx.permute(o, 0, 2, 1, 3), (head_dim * n_head, n))


def mla(ctx: Context, w, prefix: str, cur: Tensor, pos: Tensor, memory, layer: int, cfg: Any, *, n_head: int,
        kv_lora: int, head_dim: int, eps: float, scale: float, flash_attn: bool, on_cpu: bool = False) -> Tensor:
    """Multi-head latent attention (DeepSeek-V2/V3) of the normed ``cur`` (``ne = (n_embd, n)``). The cache holds
    per token one row of the compressed latent and the RoPE'd key part (a K-only
    :class:`~ggmlpy.kvcache.Causal`, ``v_in_k``), not each head's K and V.

    * Q: ``{prefix}attn_q_a`` → RMSNorm (``attn_q_a_norm``) → ``attn_q_b``, or ``attn_q`` where ``w`` has it
      (no query compression: V2-Lite); ``head_dim`` values per head, the first ``head_dim - rope_dim`` without
      position (``q_nope``), the rest rotated (``q_pe``);
    * ``attn_kv_a_mqa`` gives per token the latent (``kv_lora`` values, RMSNorm'd by ``attn_kv_a_norm``) and
      one key part shared by every head (``rope_dim`` values, rotated);
    * **absorbed** (llama.cpp's graph, always taken for generation): each head's ``q_nope`` times its
      ``attn_k_b`` (``ne = (head_dim - rope_dim, kv_lora, n_head)``) is a query against the latent, so a
      head's query is ``[q_nope · k_b, q_pe]`` and the key ``[latent, k_pe]`` (``kv_lora + rope_dim`` values,
      one head): multi-query attention whose value is the latent; each head's output goes through its
      ``attn_v_b`` (``ne = (kv_lora, head_dim_v, n_head)``);
    * **decompressed heads** (prompts, as DeepSeek's reference and vLLM compute them): every visible cell's
      latent goes through ``attn_k_b`` and ``attn_v_b`` into each head's own key (``[k_nope, k_pe]``,
      ``head_dim`` values) and value (``head_dim_v``), and the heads attend as in a plain multi-head layer.
      Decompressing costs per cell what the absorbed path spends per query row and cell on its wide heads
      (``2 kv_lora + rope_dim`` values against ``head_dim + head_dim_v``), so it pays from about a hundred
      rows on (DeepSeek-V3's widths: about half the attention's arithmetic for a 512-token prompt). Taken
      where :func:`mla_heads_pay` says so, with ``flash_attn`` on the CPU (``on_cpu``) over a float cache
      in host memory, by ggmlpy's :meth:`~ggmlpy.Context.attn_prefill` where it is vectorised and measured
      faster (else ggml's ``flash_attn_ext`` over the same heads); ``blocks.mla_heads = False`` turns it off.

    ``cfg`` holds the RoPE settings as :func:`rope` reads them (``rope_dim``: the rotated part). ``scale``
    multiplies ``q·k`` (``1 / sqrt(head_dim)``, with YaRN's ``mscale`` squared). Returns
    ``ne = (head_dim_v * n_head, n)``, before the output projection.
    """
    n, rd = cur.ne[1], cfg.rope_dim
    nope = head_dim - rd
    if prefix + "attn_q.weight" in w:
        q = linear(ctx, w[prefix + "attn_q.weight"], cur)
    else:
        q = rms_norm(ctx, linear(ctx, w[prefix + "attn_q_a.weight"], cur), w[prefix + "attn_q_a_norm.weight"], eps)
        q = linear(ctx, w[prefix + "attn_q_b.weight"], q)
    q = ctx.reshape(q, (head_dim, n_head, n))
    es = q.nb[0]
    q_nope = ctx.view(q, (nope, n_head, n), (q.nb[1], q.nb[2]), 0)
    q_pe = rope(ctx, ctx.view(q, (rd, n_head, n), (q.nb[1], q.nb[2]), nope * es), pos, cfg)
    kv = linear(ctx, w[prefix + "attn_kv_a_mqa.weight"], cur)                     # (kv_lora + rd, n)
    row = kv.nb[1]
    latent = rms_norm(ctx, ctx.view(kv, (kv_lora, n), (row,), 0), w[prefix + "attn_kv_a_norm.weight"], eps)
    k_pe = rope(ctx, ctx.view(kv, (rd, 1, n), (row, row), kv_lora * kv.nb[0]), pos, cfg)
    # the latent first and the rotated part last, as llama.cpp lays a cache row out (its shift rotates the end)
    memory.set_layer(layer).put(ctx.concat(ctx.reshape(latent, (kv_lora, 1, n)), k_pe, 0), None)
    kv_k, kv_v, mask = memory.get()                                    # (kv_lora + rd | kv_lora, n_kv, 1)
    k_b, v_b = w[prefix + "attn_k_b.weight"], w[prefix + "attn_v_b.weight"]
    plan = getattr(memory, "plan", None)
    if mla_heads and flash_attn and on_cpu and plan is not None and _kernel_ok(kv_k, kv_v) \
            and mla_heads_pay(n, kv_k.ne[1], plan.n_cells, n_head=n_head, kv_lora=kv_lora, head_dim=head_dim,
                              head_dim_v=v_b.ne[1], rope_dim=rd):
        return _mla_heads(ctx, ctx.concat(q_nope, q_pe, 0), kv_k, kv_v, mask, k_b, v_b, scale=scale)
    # each head's query against the latent: (nope, n, n_head) through its k_b -> (kv_lora, n, n_head)
    q_abs = ctx.mul_mat(k_b, ctx.permute(q_nope, 0, 2, 1, 3))
    qk = ctx.concat(ctx.permute(q_abs, 0, 2, 1, 3), q_pe, 0)                      # (kv_lora + rd, n_head, n)
    return _mla_absorbed(ctx, qk, kv_k, kv_v, mask, v_b, scale=scale, flash_attn=flash_attn)


def mla_heads_pay(n: int, n_kv: int, n_cells: int, *, n_head: int, kv_lora: int, head_dim: int, head_dim_v: int,
                  rope_dim: int) -> bool:
    """Whether :func:`mla` attends over decompressed heads for a batch of ``n`` rows over ``n_kv`` cells of a
    cache of ``n_cells``: where it takes fewer multiply-adds than the absorbed path, counting ``n_kv - n / 2``
    cells seen per row (a causal batch after its history), and where the decompressed keys and values of
    the whole cache (float32, one layer's at a time) fit in :data:`MLA_HEADS_MAX_BYTES`, so that the
    reservation at full context (which takes this path or not by the same rule) holds every graph's.
    The rule depends on the graph's shape only, never on its mask: graphs are reused."""
    nope = head_dim - rope_dim
    seen = max(n_kv - n / 2, n / 2)
    absorbed = n * seen * (2 * kv_lora + rope_dim) + n * kv_lora * (nope + head_dim_v)
    heads = n_kv * kv_lora * (nope + head_dim_v) + n * seen * (head_dim + head_dim_v)
    return heads < absorbed and n_cells * n_head * (head_dim + head_dim_v) * 4 <= MLA_HEADS_MAX_BYTES


def _mla_heads(ctx: Context, q: Tensor, kv_k: Tensor, kv_v: Tensor, mask: Tensor, k_b: Tensor, v_b: Tensor, *,
               scale: float) -> Tensor:
    """:func:`mla`'s decompressed heads: ``q`` ``ne = (head_dim, n_head, n)`` over each cell's latent (``kv_v``,
    ``ne = (kv_lora, n_kv, 1)``) through ``k_b`` and ``v_b``, with the cell's rotated key part (the end of
    its ``kv_k`` row) shared by every head."""
    nope, kv_lora, n_head = k_b.ne[0], k_b.ne[1], k_b.ne[2]
    head_dim, n = q.ne[0], q.ne[2]
    dv, n_kv, rd = v_b.ne[1], kv_k.ne[1], q.ne[0] - nope
    lat = ctx.reshape(ctx.cast(kv_v, Type.F32), (kv_lora, n_kv))     # mul_mat reads float32 columns
    # k_b is stored for the absorbed product (rows of nope values); decompressing reads it transposed, which a
    # quantized matrix cannot be by a view: converted here, a small fraction of the layer's work per prompt
    wk = ctx.cast(k_b, Type.F32) if _core.is_quantized(k_b.type) else k_b
    wk = ctx.reshape(ctx.cont(ctx.permute(wk, 1, 0, 2, 3)), (kv_lora, nope * n_head))
    k_nope = ctx.reshape(ctx.mul_mat(wk, lat), (nope, n_head, n_kv))            # each cell's heads together
    v = ctx.mul_mat(ctx.reshape(v_b, (kv_lora, dv * n_head)), lat)               # (dv * n_head, n_kv)
    k_pe = ctx.view(kv_k, (rd, 1, n_kv), (kv_k.nb[1], kv_k.nb[1]), kv_lora * kv_k.nb[0])
    k_pe = ctx.repeat_4d(ctx.cast(k_pe, Type.F32), rd, n_head, n_kv, 1)
    k = ctx.concat(k_nope, k_pe, 0)                                              # (head_dim, n_head, n_kv)
    k = ctx.view(k, (head_dim, n_kv, n_head), (k.nb[2], k.nb[1]), 0)             # the cache's layout
    v = ctx.view(v, (dv, n_kv, n_head), (v.nb[1], dv * v.nb[0]), 0)
    if prefill_kernel and _core._attn_prefill_vectorized(head_dim, dv) \
            and kernels.use(kernels.attn_site("attn_prefill", k, v, n_head)):
        o = ctx.attn_prefill(q, k, v, mask, scale=scale)                          # (dv, n_head, n)
    else:
        o = ctx.flash_attn_ext(ctx.permute(q, 0, 2, 1, 3), k, v, mask, scale=scale)
    return ctx.reshape(o, (dv * n_head, n))


def _mla_absorbed(ctx: Context, q: Tensor, kv_k: Tensor, kv_v: Tensor, mask: Tensor, v_b: Tensor, *,
                  scale: float, flash_attn: bool) -> Tensor:
    """:func:`mla`'s absorbed attention: every head of ``q`` attends to the one cached head (MQA), and each
    head's mix of latents goes through its own ``v_b`` matrix (llama.cpp's ``build_attn_mha`` with ``v_mla``).
    ggml's attention only: ggmlpy's CPU kernels read heads of one size whose V rows are their own."""
    n_head, n = q.ne[1], q.ne[2]
    qp = ctx.permute(q, 0, 2, 1, 3)                      # (dk, n, n_head)
    if flash_attn:
        o = ctx.flash_attn_ext(qp, kv_k, kv_v, mask, scale=scale)             # (dv, n_head, n)
        o = ctx.permute(o, 0, 2, 1, 3)                                        # (dv, n, n_head): a view
    else:
        kq = ctx.soft_max_ext(ctx.mul_mat(kv_k, qp), mask, scale=scale)      # (n_kv, n, n_head)
        o = ctx.mul_mat(ctx.cont(ctx.permute(kv_v, 1, 0, 2, 3)), kq)          # (dv, n, n_head)
    o = ctx.mul_mat(v_b, o)                                                   # (d_out, n, n_head)
    return ctx.cont(ctx.permute(o, 0, 2, 1, 3), (v_b.ne[1] * n_head, n))


#: Whether :func:`attention` uses :meth:`~ggmlpy.Context.attn_decode` where it can (module-wide, read when a
#: graph is built; for measuring one kernel against the other).
decode_kernel = True
#: The same for :meth:`~ggmlpy.Context.attn_prefill` (prompts).
prefill_kernel = True
#: Below this many query rows :func:`attention` may take :meth:`~ggmlpy.Context.attn_decode`, from here on
#: :meth:`~ggmlpy.Context.attn_prefill`, whose tiles are 64 rows.
DECODE_MAX_ROWS = 64
_KV_FLOAT = (Type.F16, Type.F32)
#: Whether :func:`mla` may attend over decompressed heads (prompts; :func:`mla_heads_pay`). False: always absorbed.
mla_heads = True
#: The most bytes the decompressed keys and values of a whole cache may take (one layer's; float32) for
#: :func:`mla` to decompress: beyond it the absorbed path, which needs no more than the cache.
MLA_HEADS_MAX_BYTES = 1 << 30


#: Whether :func:`linear` uses :meth:`~ggmlpy.Context.mul_mat_vec` where it can (module-wide, read when a
#: graph is built).
matvec_kernel = True
#: The most tokens :func:`linear` hands to :meth:`~ggmlpy.Context.mul_mat_vec` (its bound).
MATVEC_MAX_COLS = 4
#: Whether :func:`moe_ffn` uses :meth:`~ggmlpy.Context.mul_mat_id_rq` for prompts where it can.
experts_kernel = True
#: Whether :func:`linear` uses :meth:`~ggmlpy.Context.mul_mat_rq4k` for prompts where it can.
gemm_kernel = True


def linear(ctx: Context, w: Tensor, x: Tensor) -> Tensor:
    """``x`` through the weight matrix ``w``: ``mul_mat(w, x)``, ``ne = (w.ne[1], x.ne[1])``.

    For at most :data:`MATVEC_MAX_COLS` tokens (generation) and a ``w`` of plain rows in host
    memory (a layer computing on the CPU), :meth:`~ggmlpy.Context.mul_mat_vec` (ggmlpy's CPU
    kernel: each thread streams its own run of rows with prefetches ahead; ~1.1x ggml's on the 110M
    model's weights; Q8_0 through a VNNI kernel of its own, 1.26-1.42x) runs instead where it can
    (``_core._mul_mat_vec_ok``); so does it for Q4_0 and Q4_K weights ggml repacked, up to 3 tokens,
    where the CPU has AVX-512 VNNI (its own kernel for that layout: 1.2-1.4x ggml's), and for Q4_K ones
    where it has AVX2 alone (that kernel's arithmetic in 256-bit registers).
    ``blocks.matvec_kernel = False`` turns that off.

    For more tokens (a prompt) and a Q4_K ``w`` ggml repacked on a CPU with AVX2,
    :meth:`~ggmlpy.Context.mul_mat_rq4k` (ggmlpy's kernel for that layout: the same values, ~2x
    ggml's at 512 tokens on a Zen 3) where it measured faster; ``blocks.gemm_kernel = False`` turns
    that off.
    """
    if gemm_kernel and x.type == Type.F32 and x.ne[1] > MATVEC_MAX_COLS and x.ne[2] == 1 and x.ne[3] == 1 \
            and _core._mul_mat_rq4k_ok(w):
        if kernels.use(kernels.gemm_site(w), w):
            return ctx.mul_mat_rq4k(w, x)
    if matvec_kernel and x.type == Type.F32 and x.ne[1] <= MATVEC_MAX_COLS and x.ne[2] == 1 and x.ne[3] == 1 \
            and _core._mul_mat_vec_ok(w, x.ne[1]):
        site = kernels.matvec_site(w)
        if kernels.use(site, w):
            return ctx.mul_mat_vec(w, x, own_rows=kernels.variant(site) != "dot")
    return ctx.mul_mat(w, x)


def _kernel_ok(k: Tensor, v: Tensor) -> bool:
    # ggmlpy's attention ops run on the CPU backend only (a cache on another device keeps ggml's
    # kernel, and so does a layer on another device: the caller's on_cpu); each is taken only where
    # it is vectorised (elsewhere ggml's is faster)
    return k.type in _KV_FLOAT and v.type in _KV_FLOAT and k.ne[3] == 1 and k.is_host and v.is_host


def _decode_chunks(n_kv: int) -> int:
    """How many pieces :meth:`~ggmlpy.Context.attn_decode` cuts the positions into: one per core (each
    thread then streams its own run of cache cells, every head at once, which the memory system
    serves fastest), no piece under 128 cells."""
    return max(1, min(os.cpu_count() or 1, n_kv // 128))


def softcap(ctx: Context, x: Tensor, cap: float, scale: float = 1.0) -> Tensor:
    """Soft-capping: ``cap * tanh(scale * x / cap)``, elementwise (gemma2's attention and final logits).

    Examples
    --------
    >>> import numpy as np, ggmlpy
    >>> from ggmlpy.models import blocks
    >>> with ggmlpy.Context(1 << 20) as ctx:
    ...     y = blocks.softcap(ctx, ctx.from_numpy(np.array([1.0, 100.0], np.float32)), 30.0)
    ...     gf = ctx.new_graph(); gf.build_forward_expand(y); gf.compute(1)
    ...     np.round(y.numpy(), 3)
    array([ 1.   , 29.924], dtype=float32)
    """
    return ctx.scale(ctx.tanh(ctx.scale(x, scale / cap)), cap)


def _glu(act: str) -> tuple:
    ops = GLU.get(act)
    if ops is None:
        raise GGMLValueError(f"feed-forward activation {act!r} is not supported ({', '.join(GLU)})")
    return ops


#: Whether :func:`ffn_glu` uses :meth:`~ggmlpy.Context.geglu_tanh` for ``act="gelu"`` on a CPU layer
#: (module-wide, read when a graph is built).
glu_kernel = True


def ffn_glu(ctx: Context, w, prefix: str, cur: Tensor, act: str = "silu", on_cpu: bool = False,
            suffix: str = "") -> Tensor:
    """Gated feed-forward of ``cur`` (``ne = (n_embd, n)``): ``down(act(gate(cur)) * up(cur))``.

    Reads ``{prefix}ffn_gate_up.weight`` (gate rows then up rows) or ``ffn_gate`` and ``ffn_up``, and
    ``ffn_down``; each name with ``suffix`` after ``ffn_gate``/``ffn_up``/``ffn_down`` (``"_shexp"``: a
    mixture of experts' shared experts, ``ffn_gate_shexp``...). ``act``: ``"silu"`` (SwiGLU: llama, qwen,
    mistral) or ``"gelu"`` (GeGLU: gemma); see :data:`GLU`. Returns ``ne = (n_embd, n)``.

    GeGLU on a layer computing on the CPU (``on_cpu``, the caller's placement) where the CPU has
    AVX-512 takes :meth:`~ggmlpy.Context.geglu_tanh` (ggmlpy's kernel: GELU evaluated, not read
    from ggml's float16 table; 6x faster than ggml's ``geglu``, errors ~1e-6 instead of ~5e-3);
    ``blocks.glu_kernel = False`` turns that off.
    """
    fused, split = _glu(act)
    down = f"{prefix}ffn_down{suffix}.weight"
    if act == "gelu" and on_cpu and glu_kernel and _core._geglu_vectorized() \
            and kernels.use(kernels.geglu_site(w[down].ne[0], cur.ne[1])):
        fused, split = Context.geglu_tanh, Context.geglu_tanh
    if f"{prefix}ffn_gate_up{suffix}.weight" in w:
        h = fused(ctx, linear(ctx, w[f"{prefix}ffn_gate_up{suffix}.weight"], cur))
    else:
        h = split(ctx, linear(ctx, w[f"{prefix}ffn_gate{suffix}.weight"], cur),
                  linear(ctx, w[f"{prefix}ffn_up{suffix}.weight"], cur))
    return linear(ctx, w[down], h)


#: Activations of experts without a gate (:func:`moe_ffn`): name -> op.
_PLAIN_ACT = {"gelu_erf": Context.gelu_erf, "gelu": Context.gelu, "silu": Context.silu}

#: gpt-oss's clamped SwiGLU (``act="swiglu_oai"`` of :func:`moe_ffn`): (alpha, limit). llama.cpp builds it with
#: these constants; the HF config's ``swiglu_alpha`` and ``swiglu_limit`` default to them.
SWIGLU_OAI = (1.702, 7.0)


#: The routings :func:`moe_ffn` builds (its ``gating``), as llama.cpp's ``expert_gating_func`` numbers them.
GATINGS = {1: "softmax", 2: "sigmoid", 3: "softmax_weight"}


def moe_ffn(ctx: Context, w, prefix: str, cur: Tensor, *, n_expert_used: int, norm_weights: bool = True,
            act: str = "silu", gating: str = "softmax", swiglu_oai: tuple = SWIGLU_OAI, weights_scale: float = 0.0,
            n_group: int = 0, n_group_used: int = 0, weight_before: bool = False) -> Tensor:
    """Mixture-of-experts feed-forward of ``cur`` (``ne = (n_embd, n)``): mixtral, qwen3moe, gpt-oss, llama4,
    deepseek2, glm4moe (llama.cpp's ``build_moe_ffn``).

    Each token's router logits (``{prefix}ffn_gate_inp.weight``, ``ne = (n_embd, n_expert)``, plus
    ``ffn_gate_inp.bias`` where ``w`` has it) choose ``n_expert_used`` experts, each a gated feed-forward
    (``ffn_gate_exps``, ``ffn_up_exps``: ``ne = (n_embd, n_ff, n_expert)``; ``ffn_down_exps``:
    ``(n_ff, n_embd, n_expert)``; each plus its ``.bias``, ``ne = (rows, n_expert)``, where ``w`` has it,
    added per chosen expert with ``add_id``) run through ``mul_mat_id``; their outputs are summed, weighted.

    ``gating``:

    * ``"softmax"`` (mixtral, qwen3moe): the softmax over all experts; the most probable are chosen and
      weighted by their probabilities, renormalised to sum to 1 with ``norm_weights``;
    * ``"softmax_weight"`` (gpt-oss): the largest logits are chosen and weighted by the softmax over
      the chosen ones only (llama.cpp's ``SOFTMAX_WEIGHT``; they sum to 1 already);
    * ``"sigmoid"`` (DeepSeek-V3, GLM-4.5): each expert's sigmoid of its logit; the largest are chosen
      and weighted by it (renormalised with ``norm_weights``).

    Where ``w`` has ``{prefix}exp_probs_b.bias`` (``ne = (n_expert,)``, DeepSeek-V3's correction bias) it is
    added to the probabilities that choose the experts, not to the weights. With ``n_group > 1`` the experts
    are ``n_group`` groups of consecutive experts, each scored by the sum of its two largest (biased)
    probabilities; only the ``n_group_used`` best groups' experts may be chosen (DeepSeek-V3's group-limited
    routing, as llama.cpp builds it for every gating). A ``weights_scale`` other than 0 and 1 multiplies
    the weights (DeepSeek's ``routed_scaling_factor``). With ``weight_before`` (Llama 4) each chosen expert's
    input is scaled by its weight and its output left as it is (llama.cpp's ``weight_before_ffn``).
    Renormalised sums are clamped at float16's smallest normal number first, as llama.cpp does.

    ``act``: ``"silu"`` or ``"gelu"`` (:data:`GLU`), or ``"swiglu_oai"``: gpt-oss's SwiGLU with the gate
    clamped above and up on both sides at ``limit``, ``gate * sigmoid(alpha * gate) * (up + 1)``, with
    ``swiglu_oai = (alpha, limit)``. Experts without a gate (no ``ffn_gate_exps`` in ``w``: nomic-bert-moe)
    are ``down(act(up x))`` with ``act`` one of :data:`_PLAIN_ACT` (``"gelu_erf"``, ``"gelu"``, ``"silu"``).

    The experts' products run ggmlpy's CPU kernels where they can and measured faster: for a few tokens
    :meth:`~ggmlpy.Context.mul_mat_id_vec` (as :func:`linear`), for a prompt on a stack ggml repacked
    :meth:`~ggmlpy.Context.mul_mat_id_rq` (each expert's rows read once per three of its tokens, not once
    per token; ``blocks.experts_kernel = False`` turns it off).

    Returns
    -------
    Tensor
        ``ne = (n_embd, n)``.
    """
    if act == "swiglu_oai":
        alpha, limit = swiglu_oai

        def split(ctx, g, u):
            return ctx.swiglu_oai(g, u, alpha, limit)
    elif prefix + "ffn_gate_exps.weight" not in w:
        split = None                     # experts without a gate: act(up), act one of _PLAIN_ACT
        if act not in _PLAIN_ACT:
            raise GGMLValueError(f"moe_ffn: activation {act!r} of gate-less experts is not supported "
                                 f"({', '.join(_PLAIN_ACT)})")
    else:
        _, split = _glu(act)
    if gating not in GATINGS.values():
        raise GGMLValueError(f"moe_ffn: gating {gating!r} is not supported ({', '.join(GATINGS.values())})")
    n_embd, n = cur.ne[0], cur.ne[1]
    k = int(n_expert_used)
    logits = ctx.mul_mat(w[prefix + "ffn_gate_inp.weight"], cur)                   # (n_expert, n)
    if prefix + "ffn_gate_inp.bias" in w:
        logits = ctx.add(logits, w[prefix + "ffn_gate_inp.bias"])
    n_expert = logits.ne[0]
    if not 1 <= k <= n_expert:
        raise GGMLValueError(f"moe_ffn: n_expert_used must be in [1, {n_expert}] (got {k})")
    probs = {"softmax": ctx.soft_max, "sigmoid": ctx.sigmoid}.get(gating, lambda t: t)(logits)
    select = probs
    if prefix + "exp_probs_b.bias" in w:
        select = ctx.add(probs, w[prefix + "exp_probs_b.bias"])
    if n_group > 1:
        select = _group_limited(ctx, select, int(n_group), int(n_group_used), k)
    chosen = ctx.top_k(select, k)                                                    # (k, n) i32
    weights = ctx.get_rows(ctx.reshape(probs, (1, n_expert, n)), chosen)            # (1, k, n)
    if gating == "softmax_weight":
        weights = ctx.reshape(ctx.soft_max(ctx.reshape(weights, (k, n))), (1, k, n))
    elif norm_weights:
        weights = ctx.reshape(weights, (k, n))
        # float16's smallest normal number, as llama.cpp: a sum of sigmoids can underflow to 0
        total = ctx.clamp(ctx.sum_rows(weights), 6.103515625e-5, math.inf)
        weights = ctx.reshape(ctx.div(weights, total), (1, k, n))
    if weights_scale not in (0.0, 1.0):
        weights = ctx.scale(weights, float(weights_scale))
    x = ctx.reshape(cur, (n_embd, 1, n))            # one input row per token, shared by its experts
    if weight_before:
        # each chosen expert gets its own copy of the row, scaled by its weight
        x = ctx.mul(ctx.repeat_4d(x, n_embd, k, n, 1), weights)

    def experts_of(name, inp):
        exps = w[f"{prefix}{name}.weight"]
        if (matvec_kernel and n <= MATVEC_MAX_COLS
                and _core._mul_mat_id_vec_ok(exps, inp.ne[1] * inp.ne[2])
                and kernels.use(kernels.matvec_site(exps), exps)):
            y = ctx.mul_mat_id_vec(exps, inp, chosen)        # generation: linear()'s schedule for experts
        elif (experts_kernel and n > MATVEC_MAX_COLS and _core._mul_mat_id_rq_ok(exps)
                and kernels.use(kernels.experts_site(exps), exps)):
            y = ctx.mul_mat_id_rq(exps, inp, chosen)          # a prompt on a repacked stack: grouped by expert
        else:
            y = ctx.mul_mat_id(exps, inp, chosen)                                   # (rows, k, n)
        return ctx.add_id(y, w[f"{prefix}{name}.bias"], chosen) if f"{prefix}{name}.bias" in w else y

    if split is None:
        h = _PLAIN_ACT[act](ctx, experts_of("ffn_up_exps", x))                        # (n_ff, k, n)
    else:
        h = split(ctx, experts_of("ffn_gate_exps", x), experts_of("ffn_up_exps", x))  # (n_ff, k, n)
    experts = experts_of("ffn_down_exps", h)                                         # (n_embd, k, n)
    if not weight_before:
        experts = ctx.mul(experts, weights)
    # the sum over the k experts: views of one expert's rows across the tokens, added
    out = None
    for i in range(k):
        e = ctx.view(experts, (n_embd, n), (experts.nb[2],), i * experts.nb[1])
        out = e if out is None else ctx.add(out, e)
    return ctx.cont(out) if k == 1 else out


def _group_limited(ctx: Context, probs: Tensor, n_group: int, n_group_used: int, k: int) -> Tensor:
    """``probs`` (``ne = (n_expert, n)``) with every expert outside each token's ``n_group_used`` best groups
    at -inf: groups of ``n_expert / n_group`` consecutive experts, each scored by the sum of its two largest
    probabilities (DeepSeek-V3's ``noaux_tc`` routing; llama.cpp scores every model's groups so)."""
    n_expert, n = probs.ne[0], probs.ne[1]
    if n_expert % n_group or not 0 < n_group_used < n_group or n_expert // n_group < 2 \
            or k > n_group_used * (n_expert // n_group):
        raise GGMLValueError(f"moe_ffn: {n_expert} experts in {n_group} groups, {n_group_used} of them used, "
                             f"{k} experts chosen: the groups must divide the experts (2 or more each), "
                             "0 < groups used < groups, and the used groups hold the chosen experts")
    per = n_expert // n_group
    groups = ctx.reshape(probs, (per, n_group, n))
    top2 = ctx.top_k(groups, 2)                                                       # (2, n_group, n)
    best = ctx.get_rows(ctx.reshape(groups, (1, per, n_group, n)), top2)             # (1, 2, n_group, n)
    scores = ctx.reshape(ctx.sum_rows(ctx.reshape(best, (2, n_group, n))), (n_group, n))
    kept = ctx.top_k(scores, n_group_used)                                            # (n_group_used, n)
    masked = ctx.set_rows(ctx.fill(groups, -math.inf), ctx.get_rows(groups, kept), kept)
    return ctx.reshape(masked, (n_expert, n))


def output(ctx: Context, w, x: Tensor, eps: float, *, embeddings: bool = False) -> Tensor:
    """The head: RMSNorm by ``output_norm.weight``, then ``output.weight`` (or the tied
    ``token_embd.weight`` when ``w`` has no ``output.weight``).

    Returns the logits ``ne = (n_vocab, n)``, or with ``embeddings`` the normed hidden states
    ``ne = (n_embd, n)``. A final logit softcap (gemma2: :func:`softcap`) or logit scale (granite) follows
    the product in the architecture's forward.
    """
    x = rms_norm(ctx, x, w["output_norm.weight"], eps)
    if embeddings:
        return x
    return linear(ctx, w["output.weight"] if "output.weight" in w else w["token_embd.weight"], x)
