"""IBM Granite (3.x) from GGUF: granite.

The layer is the llama layer with four multipliers, as llama.cpp's ``granite`` graph builds it from
Hugging Face's ``GraniteForCausalLM`` (the converter renames the ``*_multiplier`` settings ``*_scale``):

* ``granite.embedding_scale`` multiplies the token embeddings (``embedding_multiplier``);
* ``granite.residual_scale`` multiplies the attention and feed-forward outputs before each residual add
  (``residual_multiplier``);
* ``granite.attention.scale`` is the attention's ``q·k`` scale in place of ``1 / sqrt(head_dim)``
  (``attention_multiplier``);
* ``granite.logit_scale`` divides the logits (``logits_scaling``); llama.cpp requires it.

Each of the first three is optional, and 0 means "not set" (no scaling, or ``1 / sqrt(head_dim)``), as
llama.cpp reads them; the converter writes none that is 0. Q/K/V and output-projection biases are read
where the file has them (``attention_bias``); the converter permutes the Q/K rows (and biases) for ggml's
normal RoPE, as for llama. Refused, naming the key or tensor: ``granite.rope.scaling.finetuned = false``
(llama.cpp's switch that turns RoPE off, for NoPE variants; the granite converter never writes it),
experts (``granite.expert_count > 0``), feed-forward biases (``mlp_bias``) and the vision deepstack
inputs (``granite.deepstack_mapping``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ggmlpy._core import Context, GGMLValueError, RopeType, Tensor
from ggmlpy.gguf import MetadataTypeError
from ggmlpy.weights import MetaReader, MissingTensor

from . import blocks
from .base import register
from .config import DecoderConfig
from .decoder import DecoderModel

__all__ = ["GraniteConfig", "GraniteModel"]


@dataclass(frozen=True)
class GraniteConfig(DecoderConfig):
    """Hyperparameters of granite files (see :class:`~ggmlpy.models.config.DecoderConfig`).

    ``embedding_scale`` and ``residual_scale`` are 1.0 and ``attention_scale`` None where the file
    leaves them unset (or 0).
    """

    ROPE_TYPES = {"granite": RopeType.NORMAL}

    logit_scale: float = 1.0
    embedding_scale: float = 1.0
    residual_scale: float = 1.0
    attention_scale: Optional[float] = None

    @classmethod
    def _read(cls, m: MetaReader, n_vocab: Optional[int]) -> dict[str, Any]:
        if m.key("deepstack_mapping") in m.md:
            raise GGMLValueError(f"{m.path}: {m.key('deepstack_mapping')}: Granite Vision's deepstack inputs are not "
                                 "supported")
        d = super()._read(m, n_vocab)
        rope = m.md.get(m.key("rope.scaling.finetuned"), True)
        if not isinstance(rope, (bool, np.bool_)):
            raise MetadataTypeError(m.path, m.key("rope.scaling.finetuned"), f"expected a bool, got {rope!r:.80}")
        if not rope:
            raise GGMLValueError(f"{m.path}: {m.key('rope.scaling.finetuned')} = false: granite models without "
                                 "RoPE are not supported")
        return dict(d, logit_scale=m.getf("logit_scale", lo=0.0, lo_open=True),
                    embedding_scale=m.getf("embedding_scale", 0.0, lo=0.0) or 1.0,
                    residual_scale=m.getf("residual_scale", 0.0, lo=0.0) or 1.0,
                    attention_scale=m.getf("attention.scale", 0.0, lo=0.0) or None)

    def _problems(self) -> list[str]:
        bad = super()._problems()
        for key, v in (("logit_scale", self.logit_scale), ("embedding_scale", self.embedding_scale),
                       ("residual_scale", self.residual_scale), ("attention.scale", self.attention_scale)):
            if v is not None and not (math.isfinite(v) and v > 0):
                bad.append(f"{self.arch}.{key} {v} must be finite and > 0")
        return bad


@register(*GraniteConfig.ROPE_TYPES)
class GraniteModel(DecoderModel):
    """A granite model: weights on their devices plus the graph builder (see the module docstring).

    Attributes
    ----------
    qkv_bias, out_bias : bool
        The file has Q/K/V biases, an output-projection bias (``attention_bias``).
    """

    config_class = GraniteConfig
    config: GraniteConfig

    def _inspect(self, reader) -> None:
        super()._inspect(reader)
        for part in ("gate", "up", "down"):
            if f"blk.0.ffn_{part}.bias" in reader:
                raise MissingTensor(f"{self.path}: tensor 'blk.0.ffn_{part}.bias': feed-forward biases (mlp_bias) "
                                    "are not supported")
        self.qkv_bias = "blk.0.attn_q.bias" in reader
        self.out_bias = "blk.0.attn_output.bias" in reader

    def _expected(self):
        c = self.config
        yield from self._expected_io()
        for i in range(c.n_layer):
            yield self._expected_norm(i, "attn_norm")
            yield from self._expected_attention(i, bias=self.qkv_bias, out_bias=self.out_bias)
            yield self._expected_norm(i, "ffn_norm")
            yield from self._expected_ffn(i)

    def _residual(self, ctx: Context, x: Tensor, out: Tensor) -> Tensor:
        s = self.config.residual_scale
        return ctx.add(x, out if s == 1.0 else ctx.scale(out, s))

    def _forward(self, ctx: Context, tokens: Tensor, pos: Tensor, memory, out_ids: Tensor, *, flash_attn: bool,
                 embeddings: bool) -> Tensor:
        c, w = self.config, self.weights
        scale = c.attention_scale if c.attention_scale is not None else 1.0 / math.sqrt(c.head_dim)
        x = ctx.get_rows(w["token_embd.weight"], tokens)
        if c.embedding_scale != 1.0:
            x = ctx.scale(x, c.embedding_scale)
        for il in range(c.n_layer):
            p = f"blk.{il}."
            cur = blocks.rms_norm(ctx, x, w[p + "attn_norm.weight"], c.rms_eps)
            q, k, v = blocks.qkv(ctx, w, p, cur, c.n_head, c.n_head_kv, c.head_dim)
            q, k = self.rope(ctx, q, pos, il), self.rope(ctx, k, pos, il)
            o = blocks.attention(ctx, memory, il, q, k, v, scale=scale, flash_attn=flash_attn,
                                 on_cpu=self.on_cpu(il))
            o = blocks.linear(ctx, w[p + "attn_output.weight"], o)
            if self.out_bias:
                o = ctx.add(o, w[p + "attn_output.bias"])
            if il == c.n_layer - 1:
                o, x = ctx.get_rows(o, out_ids), ctx.get_rows(x, out_ids)
            x = self._residual(ctx, x, o)
            cur = blocks.rms_norm(ctx, x, w[p + "ffn_norm.weight"], c.rms_eps)
            x = self._residual(ctx, x, blocks.ffn_glu(ctx, w, p, cur))
        out = blocks.output(ctx, w, x, c.rms_eps, embeddings=embeddings)
        return out if embeddings else ctx.scale(out, 1.0 / c.logit_scale)
