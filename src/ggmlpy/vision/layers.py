"""The layers the vision encoders share: a ViT layer's tensors, linear maps, norms, GELU in F32."""

from __future__ import annotations

import math

from ggmlpy._core import Context, Tensor, Type

__all__: list = []


def _vit_layer(b: str, e: int, ff: int, ln2: str):
    """A pre-norm ViT layer's tensors (LayerNorms, attention and MLP, all with biases), named as llama.cpp's
    converter writes them; ``ln2`` the pre-FFN norm's name."""
    f32 = (Type.F32,)
    for x in ("q", "k", "v", "out"):
        yield f"{b}attn_{x}.weight", (e, e), None
        yield f"{b}attn_{x}.bias", (e,), f32
    for x in ("ln1", ln2):
        yield f"{b}{x}.weight", (e,), f32
        yield f"{b}{x}.bias", (e,), f32
    yield f"{b}ffn_up.weight", (e, ff), None
    yield f"{b}ffn_up.bias", (ff,), f32
    yield f"{b}ffn_down.weight", (ff, e), None
    yield f"{b}ffn_down.bias", (e,), f32


def _linear(ctx: Context, w, name: str, x: Tensor) -> Tensor:
    return ctx.add(ctx.mul_mat(w[name + ".weight"], x), w[name + ".bias"])


def _gelu_tanh(ctx: Context, x: Tensor) -> Tensor:
    """GELU, tanh approximation, in F32 throughout: ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``.

    ggml's own GELU reads an F16 lookup table on the CPU, which moves the image features by ~5e-4 of
    their largest value (llama.cpp's figure too); these six element-wise ops cost ~1% of the encoder.
    """
    inner = ctx.add(x, ctx.scale(ctx.mul(ctx.sqr(x), x), 0.044715))
    return ctx.mul(x, ctx.scale_bias(ctx.tanh(ctx.scale(inner, math.sqrt(2.0 / math.pi))), 0.5, 0.5))


def _layer_norm(ctx: Context, x: Tensor, w, name: str, eps: float) -> Tensor:
    return ctx.add(ctx.mul(ctx.norm(x, eps), w[name + ".weight"]), w[name + ".bias"])
