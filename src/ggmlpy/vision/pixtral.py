"""The ``pixtral`` encoder (Pixtral-12B, Mistral Small 3.x): its tensors and its graph, for
:class:`~ggmlpy.vision.encoder.VisionModel`.

As transformers' ``PixtralVisionModel`` computes it, on one image of its own size (``H x W``, multiples of
the patch side times the merge size; the batch of images transformers packs with a block-diagonal mask is
the same as one image at a time):

- the patch convolution (no bias), patches in row-major order; an RMSNorm (``ln_pre``); no position
  embedding, no class token;
- layers of RMSNorm, attention with 2D rotary positions on Q and K, RMSNorm, a gated MLP (GELU or SiLU:
  ``clip.use_silu``), no biases; no final norm;
- Mistral 3 only (the file has ``mm.patch_merger.weight``): an RMSNorm and the patch merger, each
  ``s x s`` block of patches concatenated (channel, row, column) and projected;
- the projector: a linear map, GELU, a linear map (Pixtral-12B with biases).

The 2D rotary positions, on the weights as llama.cpp's converter writes them (Q and K rows permuted so that
transformers' rotate-half pairs become adjacent pairs): the first half of each head is rotated by the
patch's row with the frequencies ``theta^(-4i/hd)``, the second half by its column with
``theta^(-(4i+2)/hd)``, positions from 0, ``theta`` = 10000 (llama.cpp's; the file has no key for it).

Precision as the other encoders: ``exact`` computes GELU with ``gelu_erf`` (transformers' "gelu") and
attention in F32; ``fast`` takes ggml's GELU and flash attention.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from ggmlpy._core import Context, GGMLValueError, Tensor, Type

if TYPE_CHECKING:
    from .encoder import VisionModel

#: the 2D RoPE base (llama.cpp fixes it; transformers' default, what the published models use)
ROPE_THETA = 10000.0
#: the merger's output and the projector's names
MERGER, INPUT_NORM = "mm.patch_merger.weight", "mm.input_norm.weight"


def expected(vm: VisionModel):
    """Pixtral's tensors: ``(name, ne, types)``, types None for any weight type."""
    c = vm.config
    f32 = (Type.F32,)
    p, e, ff = c.patch_size, c.n_embd, c.n_ff
    reader = vm._reader
    yield "v.patch_embd.weight", (p, p, 3, e), (Type.F32, Type.F16)
    yield "v.pre_ln.weight", (e,), f32
    for i in range(c.n_layer):
        b = f"v.blk.{i}."
        for x in ("q", "k", "v", "out"):
            yield f"{b}attn_{x}.weight", (e, e), None
        yield f"{b}ln1.weight", (e,), f32
        yield f"{b}ln2.weight", (e,), f32
        yield f"{b}ffn_gate.weight", (e, ff), None
        yield f"{b}ffn_up.weight", (e, ff), None
        yield f"{b}ffn_down.weight", (ff, e), None
    if MERGER in reader:
        s = c.scale_factor
        yield INPUT_NORM, (e,), f32
        yield MERGER, (e * s * s, e), (Type.F32, Type.F16)
    elif c.scale_factor != 1:
        raise GGMLValueError(f"{vm.path}: clip.vision.spatial_merge_size is {c.scale_factor} but the file has no "
                             f"{MERGER}")
    hidden = reader.tensor_info("mm.1.weight").ne[1] if "mm.1.weight" in reader else c.n_embd_text
    yield "mm.1.weight", (e, hidden), None
    if "mm.1.bias" in reader:
        yield "mm.1.bias", (hidden,), f32
    yield "mm.2.weight", (hidden, c.n_embd_text), None
    if "mm.2.bias" in reader:
        yield "mm.2.bias", (c.n_embd_text,), f32


def positions(gh: int, gw: int) -> tuple[np.ndarray, np.ndarray]:
    """Each patch's row and column (0-based), in row-major order: the RoPE positions."""
    k = np.arange(gh * gw)
    return (k // gw).astype(np.int32), (k % gw).astype(np.int32)


def transformer(vm: VisionModel, ctx: Context, pixels: Tensor, gh: int, gw: int) -> tuple[Tensor, tuple]:
    """The patches' final hidden states ``ne = (n_embd, gh * gw)`` of one image ``ne = (W, H, 3, 1)`` of
    ``gh x gw`` patches, and the position inputs to set."""
    c, w = vm.config, vm.weights
    e, hd, nh, p = c.n_embd, c.head_dim, c.n_head, c.patch_size
    n = gh * gw
    kern = w["v.patch_embd.weight"]                                                       # (p, p, 3, e)
    cols = ctx.im2col(kern, pixels, p, p, 0, 0, 1, 1, True, Type.F32)                    # (3 p p, gw, gh, 1)
    x = ctx.mul_mat(ctx.reshape_2d(kern, 3 * p * p, e), ctx.reshape_2d(cols, cols.ne[0], n))   # (e, n)
    x = _rms(ctx, x, w["v.pre_ln.weight"], c.eps)
    pos_h = ctx.new_tensor(Type.I32, (n,), name="inp_pos_h").set_input()
    pos_w = ctx.new_tensor(Type.I32, (n,), name="inp_pos_w").set_input()
    half = hd // 2
    # the second half's frequencies are the first half's times theta^(-2/hd)
    odd = ROPE_THETA ** (-2.0 / hd)

    def rope2d(t: Tensor) -> Tensor:
        t = ctx.reshape_3d(t, hd, nh, n)
        parts = [ctx.rope_ext(ctx.view_3d(t, half, nh, n, t.nb[1], t.nb[2], off * t.nb[0]), pos, n_dims=half,
                              mode=0, freq_base=ROPE_THETA, freq_scale=fs)
                 for off, pos, fs in ((0, pos_h, 1.0), (half, pos_w, odd))]
        return ctx.concat(parts[0], parts[1], 0)                                           # (hd, nh, n)

    scale = 1.0 / math.sqrt(hd)
    for i in range(c.n_layer):
        b = f"v.blk.{i}."
        cur = _rms(ctx, x, w[b + "ln1.weight"], c.eps)
        q, k = (ctx.permute(ctx.reshape_4d(rope2d(ctx.mul_mat(w[f"{b}attn_{qk}.weight"], cur)), hd, nh, n, 1),
                            0, 2, 1, 3) for qk in "qk")                                     # (hd, n, nh, 1)
        v = ctx.reshape_4d(ctx.mul_mat(w[b + "attn_v.weight"], cur), hd, nh, n, 1)
        o = ctx.reshape_2d(vm._attention(ctx, q, k, v, scale), e, n)
        x = ctx.add(x, ctx.mul_mat(w[b + "attn_out.weight"], o))
        cur = _rms(ctx, x, w[b + "ln2.weight"], c.eps)
        gate = ctx.mul_mat(w[b + "ffn_gate.weight"], cur)
        if c.act == "silu":
            gate = ctx.silu(gate)
        else:
            gate = ctx.gelu(gate) if vm.precision == "fast" else ctx.gelu_erf(gate)
        x = ctx.add(x, ctx.mul_mat(w[b + "ffn_down.weight"], ctx.mul(gate, ctx.mul_mat(w[b + "ffn_up.weight"], cur))))
    ph, pw = positions(gh, gw)
    return x, ((pos_h, ph), (pos_w, pw))


def project(vm: VisionModel, ctx: Context, x: Tensor, gh: int, gw: int) -> Tensor:
    """The merger (Mistral 3) and the projector: ``ne = (n_embd_text, tokens)``, tokens row-major."""
    c, w = vm.config, vm.weights
    e, s = c.n_embd, c.scale_factor
    if MERGER in w:
        x = _rms(ctx, x, w[INPUT_NORM], c.eps)
        # each s x s block of patches as one vector ordered (channel, row, column), as transformers'
        # unfold: im2col over the patch grid as an image of e channels, with an s x s kernel of stride s
        img = ctx.cont(ctx.permute(ctx.reshape_3d(x, e, gw, gh), 2, 0, 1, 3))            # (gw, gh, e)
        img = ctx.reshape_4d(img, gw, gh, e, 1)
        shape = ctx.new_tensor(Type.F32, (s, s, e, 1), name="merger_kernel_shape")
        blocks = ctx.im2col(shape, img, s, s, 0, 0, 1, 1, True, Type.F32)                 # (e s s, gw/s, gh/s)
        x = ctx.mul_mat(w[MERGER], ctx.reshape_2d(blocks, e * s * s, (gw // s) * (gh // s)))
    x = _linear(ctx, w, "mm.1", x)
    x = ctx.gelu(x) if vm.precision == "fast" else ctx.gelu_erf(x)
    return _linear(ctx, w, "mm.2", x)


def _linear(ctx: Context, w, name: str, x: Tensor) -> Tensor:
    y = ctx.mul_mat(w[name + ".weight"], x)
    return ctx.add(y, w[name + ".bias"]) if name + ".bias" in w else y


def _rms(ctx: Context, x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return ctx.mul(ctx.rms_norm(x, eps), weight)
