"""Qwen 3 from GGUF: qwen3 (dense) and qwen3moe (mixture of experts).

Qwen 3 is the llama layer (:class:`~ggmlpy.models.llama.LlamaModel`) with two changes, as llama.cpp's
``qwen3``/``qwen3moe`` graphs build it: each head of Q and K goes through an RMSNorm of its own
(``attn_q_norm``/``attn_k_norm``, ``ne = (head_dim,)``, shared by the heads) before RoPE, and RoPE is
NEOX-style (halves; the converter does not permute the Q/K rows). The head size is
``attention.key_length`` (Qwen 3's ``head_dim``, not ``embedding_length / head_count``); the output
head is ``output.weight`` or the tied ``token_embd.weight``; Q/K/V biases are read where the file has
them, as llama.cpp does (Qwen 3 itself has none).

qwen3moe replaces every feed-forward with a mixture of experts (see :class:`~ggmlpy.models.llama.LlamaConfig`
for the keys): softmax routing, the ``expert_used_count`` most probable experts, weights renormalised.
Each expert's hidden size is ``expert_feed_forward_length`` (the HF config's ``moe_intermediate_size``),
else, as llama.cpp, ``feed_forward_length / expert_used_count``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ggmlpy._core import Context, RopeType, Tensor
from ggmlpy.gguf import meta_int
from ggmlpy.weights import MetaReader

from . import blocks
from .base import register
from .config import _MAX_EMBD
from .llama import LlamaConfig, LlamaModel

__all__ = ["Qwen3Config", "Qwen3Model"]


@dataclass(frozen=True)
class Qwen3Config(LlamaConfig):
    """Hyperparameters of qwen3 and qwen3moe files (see :class:`~ggmlpy.models.llama.LlamaConfig`)."""

    ROPE_TYPES = {"qwen3": RopeType.NEOX, "qwen3moe": RopeType.NEOX}
    EXPERTS = {"qwen3moe": True}

    @classmethod
    def _n_ff_exp(cls, m: MetaReader, n_ff: int, n_expert_used: int) -> int:
        """``expert_feed_forward_length`` (a value or a uniform per-layer array), else llama.cpp's
        ``feed_forward_length / expert_used_count``."""
        n = meta_int(m.md, m.key("expert_feed_forward_length"), 0, lo=0, hi=_MAX_EMBD * 8, per_layer=True,
                     path=m.path)
        return n or n_ff // n_expert_used


@register(*Qwen3Config.ROPE_TYPES)
class Qwen3Model(LlamaModel):
    """A qwen3 or qwen3moe model: the llama layer with per-head Q/K RMSNorm (see the module docstring)."""

    config_class = Qwen3Config
    config: Qwen3Config

    def _expected(self):
        yield from super()._expected()
        c = self.config
        for i in range(c.n_layer):
            yield self._expected_norm(i, "attn_q_norm", c.head_dim)
            yield self._expected_norm(i, "attn_k_norm", c.head_dim)

    def _qk(self, ctx: Context, layer: int, q: Tensor, k: Tensor, pos: Tensor, memory) -> tuple[Tensor, Tensor]:
        w, eps, p = self.weights, self.config.rms_eps, f"blk.{layer}."
        q = blocks.rms_norm(ctx, q, w[p + "attn_q_norm.weight"], eps)
        k = blocks.rms_norm(ctx, k, w[p + "attn_k_norm.weight"], eps)
        return super()._qk(ctx, layer, q, k, pos, memory)
