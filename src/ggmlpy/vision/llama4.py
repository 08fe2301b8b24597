"""The ``llama4`` encoder (Llama 4's vision tower): its tensors and its ViT, for
:class:`~ggmlpy.vision.encoder.VisionModel` (the pixel shuffle and adapter are the encoder's ``_project``)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from ggmlpy._core import Context, Tensor, Type

from .layers import _layer_norm, _linear, _vit_layer

if TYPE_CHECKING:
    from .encoder import VisionModel

__all__ = ["expected", "transformer"]

#: the 2D RoPE base (llama.cpp fixes it; the converter writes none, transformers' default)
ROPE_THETA = 10000.0


def expected(vm: VisionModel):
    """Llama 4's tensors: the patch embedding a linear map without bias, the class embedding (placed
    after the patches), pre- and post-norms, layers whose pre-FFN norm the converter names
    ``attn_post_norm`` (transformers' ``post_attention_layernorm``; ``ln2`` in older files, read as
    the same norm), the adapter's two linear maps and the projection, none with a bias."""
    c = vm.config
    f32 = (Type.F32,)
    p, e, ff, s = c.patch_size, c.n_embd, c.n_ff, c.scale_factor
    # files converted before llama.cpp's tensor map sent that norm to attn_post_norm call it ln2
    vm._llama4_ln2 = "ln2" if "v.blk.0.ln2.weight" in vm._reader else "attn_post_norm"
    yield "v.patch_embd.weight", (3 * p * p, e), (Type.F32, Type.F16)
    yield "v.class_embd", (e,), f32
    yield "v.position_embd.weight", (e, c.n_patches + 1), f32
    for x in ("pre_ln", "post_ln"):
        yield f"v.{x}.weight", (e,), f32
        yield f"v.{x}.bias", (e,), f32
    for i in range(c.n_layer):
        b = f"v.blk.{i}."
        yield from _vit_layer(b, e, ff, vm._llama4_ln2)
    info = vm._reader.tensor_info("mm.model.mlp.1.weight") if "mm.model.mlp.1.weight" in vm._reader \
        else None
    hidden = info.ne[1] if info is not None and len(info.ne) == 2 else c.n_embd_text
    yield "mm.model.mlp.1.weight", (e * s * s, hidden), None
    yield "mm.model.mlp.2.weight", (hidden, hidden), None
    yield "mm.model.fc.weight", (hidden, c.n_embd_text), None


def transformer(vm: VisionModel, ctx: Context, pixels: Tensor, n: int) -> tuple[Tensor, tuple]:
    """Llama 4's ViT: the patches' final hidden states ``ne = (n_embd, n_patches, n)`` (the class token
    dropped), and the position inputs to set. As transformers computes it: the patches then the class
    token, learned positions, a pre-norm, layers with 2D RoPE on Q and K (the first half of each head
    rotated by the patch's column + 1, the second by its row + 1, pairs of adjacent values; the class
    token not rotated) and an exact GELU, a post-norm."""
    c, w = vm.config, vm.weights
    e, npatch, hd, p, side = c.n_embd, c.n_patches, c.head_dim, c.patch_size, c.patches_per_side
    npos = npatch + 1
    kern = w["v.patch_embd.weight"]                                                   # (3 p p, e)
    cols = ctx.im2col(ctx.reshape_4d(kern, p, p, 3, e), pixels, p, p, 0, 0, 1, 1, True, Type.F32)
    x = ctx.mul_mat(kern, ctx.reshape_2d(cols, cols.ne[0], npatch * n))
    x = ctx.reshape_3d(x, e, npatch, n)
    cls = ctx.reshape_3d(w["v.class_embd"], e, 1, 1)
    if n > 1:
        cls = ctx.repeat(cls, ctx.view_3d(x, e, 1, n, x.nb[1], x.nb[2], 0))
    x = ctx.concat(x, cls, 1)                                                         # (e, npos, n)
    x = ctx.add(x, w["v.position_embd.weight"])
    x = _layer_norm(ctx, x, w, "v.pre_ln", c.eps)
    pos_x = ctx.new_tensor(Type.I32, (npos,), name="inp_pos_x").set_input()
    pos_y = ctx.new_tensor(Type.I32, (npos,), name="inp_pos_y").set_input()
    k = np.arange(npatch)
    px = np.append(k % side + 1, 0).astype(np.int32)
    py = np.append(k // side + 1, 0).astype(np.int32)

    def rope2d(t: Tensor) -> Tensor:
        t = ctx.reshape_4d(t, hd, c.n_head, npos, n)
        half = hd // 2
        parts = [ctx.rope_ext(ctx.view_4d(t, half, c.n_head, npos, n, t.nb[1], t.nb[2], t.nb[3], off * 4),
                              pos, n_dims=half, mode=0, freq_base=ROPE_THETA)
                 for off, pos in ((0, pos_x), (half, pos_y))]
        return ctx.concat(parts[0], parts[1], 0)                                       # (hd, head, npos, n)

    scale = 1.0 / math.sqrt(hd)
    for i in range(c.n_layer):
        b = f"v.blk.{i}."
        cur = _layer_norm(ctx, x, w, b + "ln1", c.eps)
        q = ctx.permute(rope2d(_linear(ctx, w, b + "attn_q", cur)), 0, 2, 1, 3)       # (hd, npos, head, n)
        kk = ctx.permute(rope2d(_linear(ctx, w, b + "attn_k", cur)), 0, 2, 1, 3)
        v = ctx.reshape_4d(_linear(ctx, w, b + "attn_v", cur), hd, c.n_head, npos, n)
        x = ctx.add(x, _linear(ctx, w, b + "attn_out", vm._attention(ctx, q, kk, v, scale)))
        cur = _layer_norm(ctx, x, w, b + vm._llama4_ln2, c.eps)
        cur = vm._gelu_erf(ctx, _linear(ctx, w, b + "ffn_up", cur))
        x = ctx.add(x, _linear(ctx, w, b + "ffn_down", cur))
    x = _layer_norm(ctx, x, w, "v.post_ln", c.eps)
    x = ctx.view_3d(x, e, npatch, n, x.nb[1], x.nb[2], 0)                             # the class token dropped
    return ctx.cont(x), ((pos_x, px), (pos_y, py))
