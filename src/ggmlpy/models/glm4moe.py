"""GLM-4.5 / GLM-4.6 (Zhipu's mixture of experts) from GGUF: ``general.architecture = "glm4moe"``.

The layer is a pre-norm decoder built of :mod:`~ggmlpy.models.blocks`, as llama.cpp's ``glm4moe`` graph builds it
(``src/models/glm4-moe.cpp`` at the pinned commit) from the files its converter writes from Hugging Face's
``Glm4MoeForCausalLM``:

* RMSNorm (``attn_norm``) → attention → residual → RMSNorm (``post_attention_norm``: the norm before the
  feed-forward, named so in the file) → feed-forward → residual; the output norm and head at the end;
* attention: grouped-query, Q/K/V biases and per-head Q/K RMSNorm (``attn_q_norm``/``attn_k_norm``) where the
  file has them (GLM-4.5 has the biases; its Q/K norm is ``use_qk_norm``), NEOX RoPE on the first
  ``rope.dimension_count`` values of each head only (``partial_rotary_factor``: half of them in the released
  models), the scale ``1 / sqrt(key_length)``; the output projection accumulates in F32 on backends that
  would otherwise use F16 (llama.cpp: GLM's numbers overflow F16 there);
* the feed-forward: DeepSeek's layout (:class:`~ggmlpy.models.deepseek.DeepseekMoeConfig`): the first
  ``leading_dense_block_count`` layers dense, the others routed experts plus shared experts, sigmoid routing
  (llama.cpp's default for glm4moe when the file does not say) with the correction bias ``exp_probs_b``, expert
  groups, renormalised weights scaled by ``expert_weights_scale`` (``routed_scaling_factor``);
* **NextN (multi-token prediction) layers**: the converter counts them in ``block_count`` and writes
  ``nextn_predict_layers`` (their tensors too, when the HF checkpoint has them: ``blk.N.nextn.*`` and a whole
  layer's weights after the last one run). They are for speculative decoding; llama.cpp skips them unless
  asked, and so does this module: the model runs ``block_count - nextn_predict_layers`` layers and leaves
  the NextN tensors in the file.

The cache recipe is the plain :class:`~ggmlpy.kvcache.Causal` (the key shift rotates the partial RoPE part).
M-RoPE files (GLM-4.5V: ``rope.dimension_sections``) are refused, naming the key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from ggmlpy._core import Context, Prec, RopeType, Tensor, Type
from ggmlpy.gguf import MetadataError
from ggmlpy.weights import MetaReader

from . import blocks
from .base import register
from .decoder import DecoderModel
from .deepseek import DeepseekMoeConfig, _check_moe_shapes, _expected_shared, moe_shared_ffn

__all__ = ["Glm4MoeConfig", "Glm4MoeModel"]


@dataclass(frozen=True)
class Glm4MoeConfig(DeepseekMoeConfig):
    """Hyperparameters of glm4moe files (see the module docstring and
    :class:`~ggmlpy.models.deepseek.DeepseekMoeConfig`)."""

    ROPE_TYPES = {"glm4moe": RopeType.NEOX}
    DEFAULT_GATING = "sigmoid"

    @classmethod
    def _read(cls, m: MetaReader, n_vocab: Optional[int]) -> dict[str, Any]:
        if "rope.dimension_sections" in m:
            raise MetadataError(m.path, m.key("rope.dimension_sections"), "is set: multi-section RoPE (GLM-4.5V's "
                                "M-RoPE) is not supported")
        return super()._read(m, n_vocab)


@register(*Glm4MoeConfig.ROPE_TYPES)
class Glm4MoeModel(DecoderModel):
    """A glm4moe model (see the module docstring and :class:`~ggmlpy.models.decoder.DecoderModel`).

    Attributes
    ----------
    qkv_bias, qk_norm : bool
        The file has Q/K/V biases; per-head Q/K norms.
    probs_bias : frozenset of int
        The layers whose file has the routing correction bias ``exp_probs_b.bias``.
    """

    config_class = Glm4MoeConfig
    config: Glm4MoeConfig
    #: the shared experts' gate and up are fused like a dense layer's
    FUSIONS = DecoderModel.FUSIONS + (("ffn_gate_up_shexp", ("ffn_gate_shexp", "ffn_up_shexp")),)
    #: biases, Q/K norms and the routing with groups add to the llama layer's nodes
    NODES_PER_LAYER = 112
    EMBD_INPUT = False

    @classmethod
    def read_config(cls, reader, path: str = "") -> Glm4MoeConfig:
        """As :meth:`DecoderModel.read_config`, and the expert keys checked against the first expert layer."""
        cfg = super().read_config(reader, path)
        _check_moe_shapes(reader, cfg, path)
        return cfg

    def _inspect(self, reader) -> None:
        super()._inspect(reader)
        self.qkv_bias = "blk.0.attn_q.bias" in reader
        self.qk_norm = "blk.0.attn_q_norm.weight" in reader
        self.probs_bias = frozenset(i for i in self.config.moe_layers if f"blk.{i}.exp_probs_b.bias" in reader)

    def _expected(self):
        c = self.config
        yield from self._expected_io()
        for i in range(c.n_layer):
            p = f"blk.{i}."
            yield self._expected_norm(i, "attn_norm")
            yield from self._expected_attention(i, bias=self.qkv_bias,
                                                qk_norm=(c.head_dim, c.head_dim) if self.qk_norm else None)
            yield self._expected_norm(i, "post_attention_norm")
            if i not in c.moe_layers:
                yield from self._expected_ffn(i)
                continue
            yield p + "ffn_gate_inp.weight", (c.n_embd, c.n_expert), i, None, "mul_mat"
            if i in self.probs_bias:
                yield p + "exp_probs_b.bias", (c.n_expert,), i, (Type.F32,), None
            yield p + "ffn_gate_exps.weight", (c.n_embd, c.n_ff_exp, c.n_expert), i, None, "mul_mat_id"
            yield p + "ffn_up_exps.weight", (c.n_embd, c.n_ff_exp, c.n_expert), i, None, "mul_mat_id"
            yield p + "ffn_down_exps.weight", (c.n_ff_exp, c.n_embd, c.n_expert), i, None, "mul_mat_id"
            yield from _expected_shared(self, i)

    def graph_size(self) -> int:
        # the sum over the experts adds one view and add per expert used
        return super().graph_size() + self.config.n_layer * 2 * self.config.n_expert_used

    def _forward(self, ctx: Context, tokens: Tensor, pos: Tensor, memory, out_ids: Tensor, *, flash_attn: bool,
                 embeddings: bool) -> Tensor:
        c, w, eps = self.config, self.weights, self.config.rms_eps
        scale = 1.0 / math.sqrt(c.head_dim)
        x = self.embed_tokens(ctx, tokens)
        for il in range(c.n_layer):
            p = f"blk.{il}."
            cur = blocks.rms_norm(ctx, x, w[p + "attn_norm.weight"], eps)
            q, k, v = blocks.qkv(ctx, w, p, cur, c.n_head, c.n_head_kv, c.head_dim)
            if self.qk_norm:
                q = blocks.rms_norm(ctx, q, w[p + "attn_q_norm.weight"], eps)
                k = blocks.rms_norm(ctx, k, w[p + "attn_k_norm.weight"], eps)
            q, k = self.rope(ctx, q, pos, il), self.rope(ctx, k, pos, il)
            o = blocks.attention(ctx, memory, il, q, k, v, scale=scale, flash_attn=flash_attn, on_cpu=self.on_cpu(il))
            # F32 accumulation as llama.cpp asks for GLM's output projection (no effect on the CPU)
            o = ctx.mul_mat(w[p + "attn_output.weight"], o, prec=Prec.F32) if not self.on_cpu(il) else \
                blocks.linear(ctx, w[p + "attn_output.weight"], o)
            if il == c.n_layer - 1:
                # only the rows that produce output go further
                o, x = ctx.get_rows(o, out_ids), ctx.get_rows(x, out_ids)
            x = ctx.add(x, o)
            cur = blocks.rms_norm(ctx, x, w[p + "post_attention_norm.weight"], eps)
            x = ctx.add(x, moe_shared_ffn(ctx, w, p, cur, c, il))
        return blocks.output(ctx, w, x, eps, embeddings=embeddings)
