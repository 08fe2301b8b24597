"""The Qwen-VL encoders (``qwen2vl_merger``: Qwen2-VL; ``qwen2.5vl_merger``: Qwen2.5-VL; ``qwen3vl_merger``:
Qwen3-VL): their tensors and
their graphs, for :class:`~ggmlpy.vision.encoder.VisionModel`.

As transformers' ``Qwen2_5_VisionTransformerPretrainedModel`` and ``Qwen3VLVisionModel`` compute them, on one
image of its own size (``H x W``, multiples of twice the patch side), which llama.cpp's converter stores as:

- the patch embedding: transformers' Conv3d over two frames (a still image is its own second frame) split
  into ``v.patch_embd.weight`` and ``.weight.1``; a patch's embedding is their sum applied to it (Qwen3:
  plus ``v.patch_embd.bias``);
- the patches in *merge-block order* (each 2 x 2 block of patches together, blocks row-major), which the
  merger at the end reads four at a time; the graph reorders the row-major patches once;
- Qwen3: learned positions ``v.position_embd`` resampled to the patch grid (bilinear, align_corners), each
  patch the weighted sum of four table rows (transformers' taps and float32 weights);
- layers of a norm (Qwen2.5: RMSNorm; Qwen2, Qwen3: LayerNorm), attention with biases and a 2D rotary
  position on Q and K (the first quarter of each head's pairs by the patch's row, the second by its column,
  halves rotated as in NEOX: ggml's VISION mode, theta 10000), a norm and an MLP (Qwen2.5: SwiGLU; Qwen2:
  QuickGELU; Qwen3: GELU, tanh form), both with biases;
- Qwen2.5 attends within windows of 8 x 8 patches (112 pixels; a partial window at the right and bottom
  edges) except in every ``clip.vision.n_wa_pattern``-th layer, which attends over the whole image.
  transformers reorders the patches window by window; here each window's patches are gathered into a
  padded block of 64 (``get_rows``), attention runs per block with the padding masked, and the result is
  gathered back: the same sums, no ``n x n`` mask;
- Qwen3's deepstack: after each layer the file marks (``clip.vision.is_deepstack_layers``), its hidden
  states go through a merger of their own (``v.deepstack.N``: four patches concatenated, LayerNorm, linear,
  GELU, linear); those features are appended to each token's row: ``n_embd_text * (1 + deepstack)`` values,
  which the text model adds after its first layers;
- the merger: the norm (``v.post_ln``), four patches concatenated, ``mm.0``, GELU, ``mm.2``.

GELU in the mergers is exact (transformers' ``nn.GELU()``; llama.cpp computes the tanh form there), the
Qwen3 MLP's the tanh form in F32 (``gelu_pytorch_tanh``). ``fast`` precision takes ggml's GELU and flash
attention, as llama.cpp's mtmd does.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from ggmlpy._core import Context, GGMLValueError, RopeType, Tensor, Type

from .layers import _gelu_tanh, _linear

if TYPE_CHECKING:
    from .encoder import VisionModel

__all__ = ["QWEN2", "QWEN25", "QWEN3", "expected", "largest_grid", "project", "transformer", "window_index"]

QWEN2, QWEN25, QWEN3 = "qwen2vl_merger", "qwen2.5vl_merger", "qwen3vl_merger"
#: the 2D RoPE base (llama.cpp fixes it; transformers' default, what the published models use)
ROPE_THETA = 10000.0
#: patches merged per side into one token (llama.cpp fixes it for Qwen2.5; Qwen3 files write it)
MERGE = 2
#: Qwen2.5's attention window side, in merged tokens: 112 pixels / 14 / 2 (llama.cpp fixes 112 px)
WINDOW = 4
#: the patches of one (full) window, the padded block each window's attention runs in
WINDOW_PATCHES = (WINDOW * MERGE) ** 2


def expected(vm: VisionModel):
    """The tensors: ``(name, ne, types)``, types None for any weight type."""
    c = vm.config
    f32 = (Type.F32,)
    p, e, ff, m = c.patch_size, c.n_embd, c.n_ff, MERGE
    q3 = c.projector == QWEN3
    ln = c.projector != QWEN25            # LayerNorms (with biases); Qwen2.5's are RMSNorms
    if c.projector == QWEN2 and "v.blk.0.ffn_up.weight" in vm._reader:
        # llama.cpp's converter writes the text width as Qwen2-VL's feed_forward_length: the tensor says
        ff = vm._reader.tensor_info("v.blk.0.ffn_up.weight").ne[1]
    mlp = c.projector != QWEN25           # up/down; Qwen2.5's is gated
    for x in ("", ".1"):
        yield f"v.patch_embd.weight{x}", (p, p, 3, e), (Type.F32, Type.F16)
    if q3:
        yield "v.patch_embd.bias", (e,), f32
        yield "v.position_embd.weight", (e, vm._reader.tensor_info("v.position_embd.weight").ne[1]
                                         if "v.position_embd.weight" in vm._reader else 1), f32
    for i in range(c.n_layer):
        b = f"v.blk.{i}."
        if q3:
            yield f"{b}attn_qkv.weight", (e, 3 * e), None
            yield f"{b}attn_qkv.bias", (3 * e,), f32
        else:
            for x in "qkv":
                yield f"{b}attn_{x}.weight", (e, e), None
                yield f"{b}attn_{x}.bias", (e,), f32
        yield f"{b}attn_out.weight", (e, e), None
        yield f"{b}attn_out.bias", (e,), f32
        for x in ("ln1", "ln2"):
            yield f"{b}{x}.weight", (e,), f32
            if ln:
                yield f"{b}{x}.bias", (e,), f32
        for x in (("up",) if mlp else ("gate", "up")):
            yield f"{b}ffn_{x}.weight", (e, ff), None
            yield f"{b}ffn_{x}.bias", (ff,), f32
        yield f"{b}ffn_down.weight", (ff, e), None
        yield f"{b}ffn_down.bias", (e,), f32
    wide, out = e * m * m, c.n_embd_text
    for il in c.deepstack:
        b = f"v.deepstack.{il}."
        yield b + "norm.weight", (wide,), f32
        yield b + "norm.bias", (wide,), f32
        yield b + "fc1.weight", (wide, wide), None
        yield b + "fc1.bias", (wide,), f32
        yield b + "fc2.weight", (wide, out), None
        yield b + "fc2.bias", (out,), f32
    yield "v.post_ln.weight", (e,), f32
    if ln:
        yield "v.post_ln.bias", (e,), f32
    yield "mm.0.weight", (wide, wide), None
    yield "mm.0.bias", (wide,), f32
    yield "mm.2.weight", (wide, out), None
    yield "mm.2.bias", (out,), f32


def check_pos_table(vm: VisionModel) -> None:
    """Qwen3's learned positions are a square table (transformers' ``num_position_embeddings``)."""
    n = vm._reader.tensor_info("v.position_embd.weight").ne[1]
    side = math.isqrt(n)
    if side * side != n or side < 1:
        raise GGMLValueError(f"{vm.path}: v.position_embd.weight has {n} rows; Qwen3-VL's position table is square")
    vm._pos_side = side


# ---------------------------------------------------------------------- index arithmetic (numpy)

def merge_order(gh: int, gw: int) -> tuple[np.ndarray, np.ndarray]:
    """Each patch's (row, col) in merge-block order: 2 x 2 blocks row-major, the block's patches row-major."""
    k = np.arange(gh * gw)
    bw = gw // MERGE
    dx, dy = k % MERGE, (k // MERGE) % MERGE
    bx, by = (k // (MERGE * MERGE)) % bw, k // (MERGE * MERGE * bw)
    return (by * MERGE + dy).astype(np.int32), (bx * MERGE + dx).astype(np.int32)


def window_index(gh: int, gw: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Qwen2.5's windows over an image of ``gh x gw`` patches in merge-block order: ``(gather, scatter,
    counts)``. ``gather`` (``n_windows * 64``) names the patch at each place of the padded blocks (0 for
    padding), ``scatter`` (``gh * gw``) each patch's place in them, ``counts`` each window's patches (the
    windows in transformers' order: row-major over the merged grid, each ``4 x 4`` merged tokens)."""
    mh, mw = gh // MERGE, gw // MERGE
    nwh, nww = -(-mh // WINDOW), -(-mw // WINDOW)
    tok = np.arange(mh * mw).reshape(mh, mw)
    gather = np.zeros((nwh * nww, WINDOW_PATCHES), np.int32)
    scatter = np.zeros(gh * gw, np.int32)
    counts = np.zeros(nwh * nww, np.int32)
    four = np.arange(MERGE * MERGE)
    for wy in range(nwh):
        for wx in range(nww):
            w = wy * nww + wx
            toks = tok[wy * WINDOW:(wy + 1) * WINDOW, wx * WINDOW:(wx + 1) * WINDOW].reshape(-1)
            patches = (toks[:, None] * MERGE * MERGE + four).reshape(-1)
            counts[w] = len(patches)
            gather[w, :len(patches)] = patches
            scatter[patches] = w * WINDOW_PATCHES + np.arange(len(patches))
    return gather.reshape(-1), scatter, counts


def window_mask(counts: np.ndarray) -> np.ndarray:
    """The additive mask of the padded blocks, numpy ``(n_windows, 1, 64, 64)`` (ggml ``ne = (64 keys, 64
    queries, 1, n_windows)``): a window's padding hidden from every query."""
    keys = np.arange(WINDOW_PATCHES)
    hide = keys[None, :] >= counts[:, None]                                        # (n_windows, 64 keys)
    m = np.where(hide, -np.inf, 0.0).astype(np.float32)
    return np.ascontiguousarray(np.broadcast_to(m[:, None, None, :], (len(counts), 1, WINDOW_PATCHES, WINDOW_PATCHES)))


def pos_taps(gh: int, gw: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Qwen3's position-table taps in merge-block order: indices ``(4, n)`` int32 and weights ``(4, n)``
    float32, as transformers computes them (align_corners bilinear, float32)."""
    row, col = merge_order(gh, gw)

    def axis(idx: np.ndarray, size: int):
        f = np.float32
        src = idx.astype(f) * f(side - 1) / f(max(size - 1, 1))
        lo = np.floor(src)
        taps = [np.clip(lo + o, 0, side - 1).astype(np.int64) for o in (0, 1)]
        wts = [np.maximum(f(1) - np.abs(src - lo - f(o)), f(0)).astype(f) for o in (0, 1)]
        return taps, wts

    (h0, h1), (hw0, hw1) = axis(row, gh)
    (w0, w1), (ww0, ww1) = axis(col, gw)
    idx = np.stack([h * side + w for h in (h0, h1) for w in (w0, w1)]).astype(np.int32)
    wts = np.stack([a * b for a in (hw0, hw1) for b in (ww0, ww1)]).astype(np.float32)
    return idx, wts


def largest_grid(max_tokens: int, windowed: bool) -> tuple[int, int]:
    """The merged grid ``(rows, cols)`` of at most ``max_tokens`` tokens (aspect ratio at most 200, as the
    processor allows) whose graph is the largest: the most tokens, and with windows the most padded
    window patches besides (a thin image fills its edge windows least)."""
    best, key = (1, 1), (-1, -1)
    for r in range(1, max_tokens + 1):
        c = max_tokens // r
        if c < 1 or max(r, c) > 200 * min(r, c):
            continue
        n = r * c
        pad = (-(-r // WINDOW)) * (-(-c // WINDOW)) * WINDOW_PATCHES if windowed else 0
        k = (4 * n + pad, n)
        if k > key:
            best, key = (r, c), k
    return best


# ---------------------------------------------------------------------- graph

def transformer(vm: VisionModel, ctx: Context, pixels: Tensor, gh: int, gw: int) -> tuple[Tensor, list, tuple]:
    """The patches' final hidden states ``ne = (n_embd, gh * gw)`` in merge-block order of one image ``ne =
    (W, H, 3, 1)`` of ``gh x gw`` patches, the deepstack layers' outputs (Qwen3) and the inputs to set."""
    c, w = vm.config, vm.weights
    e, hd, nh, p = c.n_embd, c.head_dim, c.n_head, c.patch_size
    q3 = c.projector == QWEN3
    n = gh * gw
    kern = ctx.add(w["v.patch_embd.weight"], w["v.patch_embd.weight.1"])                 # both frames: one image
    cols = ctx.im2col(kern, pixels, p, p, 0, 0, 1, 1, True, Type.F32)                    # (3 p p, gw, gh, 1)
    x = ctx.mul_mat(ctx.reshape_2d(kern, 3 * p * p, e), ctx.reshape_2d(cols, cols.ne[0], n))   # (e, n) row-major
    # row-major -> merge-block order: (e dx, bx, dy, by) -> (e dx, dy, bx, by)
    x = ctx.reshape_4d(x, e * MERGE, gw // MERGE, MERGE, gh // MERGE)
    x = ctx.cont_2d(ctx.permute(x, 0, 2, 1, 3), e, n)
    consts = []
    if q3:
        x = ctx.add(x, w["v.patch_embd.bias"])
        taps = ctx.new_tensor(Type.I32, (n, 4), name="inp_pos_taps").set_input()
        wts = ctx.new_tensor(Type.F32, (n, 4), name="inp_pos_weights").set_input()
        idx, wv = pos_taps(gh, gw, vm._pos_side)
        consts += [(taps, idx), (wts, wv)]
        table = w["v.position_embd.weight"]
        pos = None
        for t in range(4):
            tap = ctx.view_1d(taps, n, t * taps.nb[1])
            wt = ctx.view_2d(wts, 1, n, 4, t * wts.nb[1])
            term = ctx.mul(ctx.get_rows(table, tap), wt)
            pos = term if pos is None else ctx.add(pos, term)
        x = ctx.add(x, pos)
    rows, cols_ = merge_order(gh, gw)
    pos_rope = ctx.new_tensor(Type.I32, (4 * n,), name="inp_pos_2d").set_input()
    consts.append((pos_rope, np.concatenate([rows, cols_, rows, cols_]).astype(np.int32)))
    windows = pos_win = None
    if c.projector == QWEN25:
        gather, scatter, counts = window_index(gh, gw)
        g_t = ctx.new_tensor(Type.I32, (len(gather),), name="inp_win_gather").set_input()
        s_t = ctx.new_tensor(Type.I32, (n,), name="inp_win_scatter").set_input()
        nwin = len(counts)
        mask_type = Type.F16 if vm.precision == "fast" else Type.F32
        m_t = ctx.new_tensor(mask_type, (WINDOW_PATCHES, WINDOW_PATCHES, 1, nwin), name="inp_win_mask").set_input()
        mask = window_mask(counts)
        consts += [(g_t, gather), (s_t, scatter), (m_t, mask.astype(np.float16) if mask_type == Type.F16 else mask)]
        windows = (g_t, s_t, m_t, nwin)
        pos_win = ctx.new_tensor(Type.I32, (4 * len(gather),), name="inp_pos_2d_win").set_input()
        wr, wc = rows[gather], cols_[gather]
        consts.append((pos_win, np.concatenate([wr, wc, wr, wc]).astype(np.int32)))
    sections = [hd // 4] * 4
    scale = 1.0 / math.sqrt(hd)

    def rope(t: Tensor, pos: Tensor) -> Tensor:
        return ctx.rope_multi(t, pos, n_dims=hd // 2, sections=sections, mode=RopeType.VISION, freq_base=ROPE_THETA)

    def norm(t: Tensor, name: str) -> Tensor:
        if c.projector != QWEN25:
            return ctx.add(ctx.mul(ctx.norm(t, c.eps), w[name + ".weight"]), w[name + ".bias"])
        return ctx.mul(ctx.rms_norm(t, c.eps), w[name + ".weight"])

    deep = []
    for i in range(c.n_layer):
        b = f"v.blk.{i}."
        cur = norm(x, b + "ln1")
        windowed = windows is not None and (i + 1) % c.wa_pattern != 0
        m = n
        if windowed:
            cur = ctx.get_rows(cur, windows[0])                                          # (e, nwin * 64)
            m = windows[3] * WINDOW_PATCHES
        if q3:
            qkv = _linear(ctx, w, b + "attn_qkv", cur)                                   # (3e, m)
            q, k, v = (ctx.view_3d(qkv, hd, nh, m, hd * 4, qkv.nb[1], j * e * 4) for j in range(3))
        else:
            q, k, v = (ctx.reshape_3d(_linear(ctx, w, f"{b}attn_{x_}", cur), hd, nh, m) for x_ in "qkv")
        pos = pos_win if windowed else pos_rope
        q, k = rope(q, pos), rope(k, pos)
        if windowed:
            nwin = windows[3]
            q4 = ctx.permute(ctx.reshape_4d(q, hd, nh, WINDOW_PATCHES, nwin), 0, 2, 1, 3)    # (hd, 64, head, win)
            k4 = ctx.permute(ctx.reshape_4d(k, hd, nh, WINDOW_PATCHES, nwin), 0, 2, 1, 3)
            v4 = ctx.reshape_4d(ctx.cont(v), hd, nh, WINDOW_PATCHES, nwin)
            o = vm._attention(ctx, q4, k4, v4, scale, mask=windows[2])                    # (e, 64, win)
            o = ctx.get_rows(ctx.reshape_2d(o, e, m), windows[1])                         # (e, n)
        else:
            q4 = ctx.permute(ctx.reshape_4d(q, hd, nh, n, 1), 0, 2, 1, 3)
            k4 = ctx.permute(ctx.reshape_4d(k, hd, nh, n, 1), 0, 2, 1, 3)
            v4 = ctx.reshape_4d(ctx.cont(v), hd, nh, n, 1)
            o = ctx.reshape_2d(vm._attention(ctx, q4, k4, v4, scale), e, n)
        x = ctx.add(x, _linear(ctx, w, b + "attn_out", o))
        cur = norm(x, b + "ln2")
        if q3:
            cur = _linear(ctx, w, b + "ffn_up", cur)
            cur = ctx.gelu(cur) if vm.precision == "fast" else _gelu_tanh(ctx, cur)
        elif c.projector == QWEN2:
            cur = _linear(ctx, w, b + "ffn_up", cur)
            # transformers' QuickGELU, x sigmoid(1.702 x), in F32 (ggml's reads an F16 table on the CPU)
            cur = ctx.gelu_quick(cur) if vm.precision == "fast" else ctx.mul(cur, ctx.sigmoid(ctx.scale(cur, 1.702)))
        else:
            cur = ctx.mul(ctx.silu(_linear(ctx, w, b + "ffn_gate", cur)), _linear(ctx, w, b + "ffn_up", cur))
        x = ctx.add(x, _linear(ctx, w, b + "ffn_down", cur))
        if i in c.deepstack:
            d = ctx.reshape_2d(x, e * MERGE * MERGE, n // (MERGE * MERGE))
            pre = f"v.deepstack.{i}."
            d = ctx.add(ctx.mul(ctx.norm(d, c.eps), w[pre + "norm.weight"]), w[pre + "norm.bias"])
            deep.append(_mlp(vm, ctx, d, pre + "fc1", pre + "fc2"))
    return x, deep, tuple(consts)


def project(vm: VisionModel, ctx: Context, x: Tensor, deep: list, n: int) -> Tensor:
    """The merger: ``ne = (n_embd_text * (1 + deepstack), n / 4)``, tokens row-major over the merged grid."""
    c, w = vm.config, vm.weights
    e = c.n_embd
    if c.projector != QWEN25:
        x = ctx.add(ctx.mul(ctx.norm(x, c.eps), w["v.post_ln.weight"]), w["v.post_ln.bias"])
    else:
        x = ctx.mul(ctx.rms_norm(x, c.eps), w["v.post_ln.weight"])
    x = _mlp(vm, ctx, ctx.reshape_2d(x, e * MERGE * MERGE, n // (MERGE * MERGE)), "mm.0", "mm.2")
    for d in deep:
        x = ctx.concat(x, d, 0)
    return x


def _mlp(vm: VisionModel, ctx: Context, x: Tensor, fc1: str, fc2: str) -> Tensor:
    x = _linear(ctx, vm.weights, fc1, x)
    x = ctx.gelu(x) if vm.precision == "fast" else ctx.gelu_erf(x)
    return _linear(ctx, vm.weights, fc2, x)
