"""OLMo 2 from GGUF: olmo2.

OLMo 2 normalises the outputs of its sublayers instead of their inputs, as llama.cpp's ``olmo2`` graph
builds it from Hugging Face's ``Olmo2ForCausalLM``: per layer, attention of the unnormed residual
stream → RMSNorm (``post_attention_norm``) → residual; feed-forward (SwiGLU) → RMSNorm
(``post_ffw_norm``) → residual; there are no pre-norms. Q and K are RMSNormed right after their
projections over the whole projection (``attn_q_norm``: ``ne = (n_head * head_dim,)``, ``attn_k_norm``:
``(n_head_kv * head_dim,)``; one mean over all heads, unlike qwen3's per-head norm), then RoPE,
NEOX-style (the converter does not permute the Q/K rows). The output head is ``output.weight``
(llama.cpp requires it).

A file with ``olmo2.attention.sliding_window > 0`` is OLMo 3 (window layers with their own RoPE
settings); it is refused, naming the key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from ggmlpy._core import Context, GGMLValueError, RopeType, Tensor
from ggmlpy.weights import MetaReader

from . import blocks
from .base import register
from .config import DecoderConfig
from .decoder import DecoderModel

__all__ = ["Olmo2Config", "Olmo2Model"]


@dataclass(frozen=True)
class Olmo2Config(DecoderConfig):
    """Hyperparameters of olmo2 files (see :class:`~ggmlpy.models.config.DecoderConfig`)."""

    ROPE_TYPES = {"olmo2": RopeType.NEOX}

    @classmethod
    def _read(cls, m: MetaReader, n_vocab: Optional[int]) -> dict[str, Any]:
        d = super()._read(m, n_vocab)
        if d["sliding_window"]:
            raise GGMLValueError(f"{m.path}: {m.key('attention.sliding_window')} = {d['sliding_window']}: OLMo 3's "
                                 "sliding-window layers are not supported")
        return d


def _flat_rms_norm(ctx: Context, x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of each token's heads ``x`` (``ne = (head_dim, n_head, n)``, rows possibly strided views of a
    fused product) as one vector of ``head_dim * n_head`` values; the same shape back."""
    hd, nh, n = x.ne[0], x.ne[1], x.ne[2]
    flat = ctx.view(x, (hd * nh, n), (x.nb[2],), 0)      # each token's heads are contiguous
    return ctx.reshape(blocks.rms_norm(ctx, flat, weight, eps), (hd, nh, n))


@register(*Olmo2Config.ROPE_TYPES)
class Olmo2Model(DecoderModel):
    """An olmo2 model: weights on their devices plus the graph builder (see the module docstring)."""

    config_class = Olmo2Config
    config: Olmo2Config

    def _inspect(self, reader) -> None:
        super()._inspect(reader)
        self.tied_output = False            # llama.cpp's olmo2 requires output.weight

    def _expected(self):
        c = self.config
        yield from self._expected_io()
        for i in range(c.n_layer):
            # Q/K norms over the whole projection, not per head
            yield from self._expected_attention(i, qk_norm=(c.n_head * c.head_dim, c.n_head_kv * c.head_dim))
            yield self._expected_norm(i, "post_attention_norm")
            yield from self._expected_ffn(i)
            yield self._expected_norm(i, "post_ffw_norm")

    def _forward(self, ctx: Context, tokens: Tensor, pos: Tensor, memory, out_ids: Tensor, *, flash_attn: bool,
                 embeddings: bool) -> Tensor:
        c, w = self.config, self.weights
        scale = 1.0 / math.sqrt(c.head_dim)
        x = ctx.get_rows(w["token_embd.weight"], tokens)
        for il in range(c.n_layer):
            p = f"blk.{il}."
            q, k, v = blocks.qkv(ctx, w, p, x, c.n_head, c.n_head_kv, c.head_dim)
            q = _flat_rms_norm(ctx, q, w[p + "attn_q_norm.weight"], c.rms_eps)
            k = _flat_rms_norm(ctx, k, w[p + "attn_k_norm.weight"], c.rms_eps)
            q, k = self.rope(ctx, q, pos, il), self.rope(ctx, k, pos, il)
            o = blocks.attention(ctx, memory, il, q, k, v, scale=scale, flash_attn=flash_attn,
                                 on_cpu=self.on_cpu(il))
            o = blocks.linear(ctx, w[p + "attn_output.weight"], o)
            if il == c.n_layer - 1:
                o, x = ctx.get_rows(o, out_ids), ctx.get_rows(x, out_ids)
            x = ctx.add(x, blocks.rms_norm(ctx, o, w[p + "post_attention_norm.weight"], c.rms_eps))
            f = blocks.ffn_glu(ctx, w, p, x)
            x = ctx.add(x, blocks.rms_norm(ctx, f, w[p + "post_ffw_norm.weight"], c.rms_eps))
        return blocks.output(ctx, w, x, c.rms_eps, embeddings=embeddings)
