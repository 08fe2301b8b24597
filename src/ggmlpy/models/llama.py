"""The llama family from GGUF: llama (Llama 2/3, TinyLlama), mistral (sliding window), qwen2 (QKV bias).

:class:`LlamaModel` is a :class:`~ggmlpy.models.decoder.DecoderModel` (which creates, places and
loads the weights; :func:`~ggmlpy.models.load_model` does both steps). Its graph is the usual pre-norm
decoder, built of :mod:`~ggmlpy.models.blocks`: token embedding, per layer RMSNorm → attention (RoPE
on Q and K, grouped-query attention through the cache, with ``flash_attn_ext`` or ``mul_mat`` +
``soft_max_ext``) → residual → RMSNorm → SwiGLU feed-forward → residual; then the output norm and
the output head (``token_embd`` again when the file has no ``output.weight``). Rows that need no
output are dropped after the last layer's attention.

Weights follow llama.cpp's converter: for ``llama``/``mistral`` the Q and K rows are permuted so
that ggml's "normal" RoPE (adjacent pairs) applies; for ``qwen2`` they are not and RoPE is
NEOX-style (halves).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from ggmlpy._core import Context, RopeType, Tensor, Type

from . import blocks
from .base import UnknownArchitecture, register
from .decoder import DecoderConfig, DecoderModel, MetaReader, MissingTensor

__all__ = ["LlamaConfig", "LlamaModel", "MissingTensor"]


@dataclass(frozen=True)
class LlamaConfig(DecoderConfig):
    """Hyperparameters read from GGUF metadata (``{arch}.*`` keys); see :class:`DecoderConfig`."""

    ROPE_TYPES = {"llama": RopeType.NORMAL, "mistral": RopeType.NORMAL, "qwen2": RopeType.NEOX}

    @classmethod
    def _read(cls, m: MetaReader, n_vocab: Optional[int]) -> dict[str, Any]:
        # mixtral files say "llama" too; their experts need another feed-forward
        if m.geti("expert_count", 0, lo=0) > 0:
            raise UnknownArchitecture(f"{m.path}: mixture-of-experts {m.arch} models are not supported")
        return super()._read(m, n_vocab)


@register(*LlamaConfig.ROPE_TYPES)
class LlamaModel(DecoderModel):
    """A llama-family model: weights on their devices plus the graph builder (see :class:`DecoderModel`).

    Attributes
    ----------
    qkv_bias : bool
        The file has Q/K/V biases (qwen2).
    """

    config_class = LlamaConfig
    config: LlamaConfig

    def _inspect(self, reader) -> None:
        super()._inspect(reader)
        self.qkv_bias = "blk.0.attn_q.bias" in reader

    def _expected(self):
        c = self.config
        n_q, n_kv = c.n_head * c.head_dim, c.n_head_kv * c.head_dim
        yield from self._expected_io()
        for i in range(c.n_layer):
            p = f"blk.{i}."
            yield p + "attn_norm.weight", (c.n_embd,), i, (Type.F32,), None
            yield p + "attn_q.weight", (c.n_embd, n_q), i, None, "mul_mat"
            yield p + "attn_k.weight", (c.n_embd, n_kv), i, None, "mul_mat"
            yield p + "attn_v.weight", (c.n_embd, n_kv), i, None, "mul_mat"
            if self.qkv_bias:
                yield p + "attn_q.bias", (n_q,), i, (Type.F32,), None
                yield p + "attn_k.bias", (n_kv,), i, (Type.F32,), None
                yield p + "attn_v.bias", (n_kv,), i, (Type.F32,), None
            yield p + "attn_output.weight", (n_q, c.n_embd), i, None, "mul_mat"
            yield p + "ffn_norm.weight", (c.n_embd,), i, (Type.F32,), None
            yield p + "ffn_gate.weight", (c.n_embd, c.n_ff), i, None, "mul_mat"
            yield p + "ffn_up.weight", (c.n_embd, c.n_ff), i, None, "mul_mat"
            yield p + "ffn_down.weight", (c.n_ff, c.n_embd), i, None, "mul_mat"

    def _forward(self, ctx: Context, tokens: Tensor, pos: Tensor, memory, out_ids: Tensor, *, flash_attn: bool,
                 embeddings: bool) -> Tensor:
        c, w = self.config, self.weights
        scale = 1.0 / math.sqrt(c.head_dim)
        x = ctx.get_rows(w["token_embd.weight"], tokens)
        for il in range(c.n_layer):
            p = f"blk.{il}."
            cur = blocks.rms_norm(ctx, x, w[p + "attn_norm.weight"], c.rms_eps)
            q, k, v = blocks.qkv(ctx, w, p, cur, c.n_head, c.n_head_kv, c.head_dim)
            q, k = self.rope(ctx, q, pos), self.rope(ctx, k, pos)
            o = blocks.attention(ctx, memory, il, q, k, v, scale=scale, flash_attn=flash_attn)
            o = ctx.mul_mat(w[p + "attn_output.weight"], o)
            if il == c.n_layer - 1:
                # only the rows that produce output go further
                o, x = ctx.get_rows(o, out_ids), ctx.get_rows(x, out_ids)
            x = ctx.add(x, o)
            cur = blocks.rms_norm(ctx, x, w[p + "ffn_norm.weight"], c.rms_eps)
            x = ctx.add(x, blocks.ffn_glu(ctx, w, p, cur))
        return blocks.output(ctx, w, x, c.rms_eps, embeddings=embeddings)
