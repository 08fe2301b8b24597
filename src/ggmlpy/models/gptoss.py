"""gpt-oss (OpenAI's open-weight mixture of experts) from GGUF: ``general.architecture = "gpt-oss"``.

The layer is a pre-norm decoder built of :mod:`~ggmlpy.models.blocks`, as llama.cpp's ``openai-moe`` graph
builds it (``LLM_ARCH_OPENAI_MOE``) from the files its converter writes from Hugging Face's
``GptOssForCausalLM``:

* RMSNorm (``attn_norm``) → attention → residual → RMSNorm (``post_attention_norm``: the norm before the
  feed-forward, named so in the file) → mixture of experts → residual; the output norm and head
  (``output.weight``) at the end;
* attention has biases on Q, K, V (read where the file has them, as llama.cpp) and on the output
  projection (``attn_output.bias``), NEOX RoPE (halves), the scale ``1 / sqrt(head_dim)`` (the head size is
  ``attention.key_length``, 64 in the real models where ``n_embd / n_head`` is 45), and **attention
  sinks**: ``attn_sinks.weight`` (``ne = (n_head,)``) holds one logit per head that joins each query's
  softmax as a key without a value (:func:`~ggmlpy.models.blocks.attention`);
* **local and global layers**: layer ``il`` attends through a sliding window of
  ``attention.sliding_window`` positions (itself included) when it is local; the pattern is
  ``attention.sliding_window_pattern`` when the file has it (a period or one bool per layer, as for gemma),
  else llama.cpp's default period 2: even layers local, odd ones global, which is also Hugging Face's
  default ``layer_types``. Local layers rotate with ``rope.freq_base_swa`` when the file has it (llama.cpp),
  else with the global base; both use the file's RoPE scaling;
* RoPE scaling is YaRN in the real models (``rope.scaling.type = yarn``, ``factor`` 32 from an original
  context of 4096). ggml's YaRN takes its ramp between whole dimensions (floor of the low bound, ceil of
  the high one) and ``beta_fast`` 32, ``beta_slow`` 1, as llama.cpp builds gpt-oss (it reads no YaRN
  key beyond the factor and the original context). The real models' HF config says ``truncate: false``
  (the ramp between the exact bounds): on those, llama.cpp and so this module follow ggml, not HF; a file
  whose ``rope.scaling.yarn_*`` keys ask for other values is refused, naming the key;
* **the feed-forward** is a mixture of ``expert_count`` experts, ``expert_used_count`` per token, each
  ``expert_feed_forward_length`` wide (:func:`~ggmlpy.models.blocks.moe_ffn` with ``gating="softmax_weight"``
  and ``act="swiglu_oai"``): router logits ``ffn_gate_inp`` plus its bias; the largest logits choose the
  experts, weighted by the softmax over the chosen ones only (llama.cpp's ``SOFTMAX_WEIGHT``, HF's
  softmax of the top-k values); each expert's gate, up and down products add that expert's bias
  (``ffn_{gate,up,down}_exps.bias``, ``add_id``); the activation is the clamped SwiGLU
  ``min(g, 7) * sigmoid(1.702 min(g, 7)) * (clamp(u, -7, 7) + 1)`` (llama.cpp's constants, HF's
  ``swiglu_alpha`` and ``swiglu_limit`` defaults). No shared expert, no renormalisation, no weight scale:
  llama.cpp builds gpt-oss so whatever the ``expert_*`` keys say, and a file whose keys ask for another
  routing is refused here, naming the key.

Expert weights: the released models store them in MXFP4, which the converter copies as they are; from
float weights (a random model) it writes them in the ``--outtype`` (F32, F16, Q8_0), biases, sinks and
router in F32. Any type ggml's ``mul_mat_id`` takes is read.

The cache recipe (:class:`~ggmlpy.models.decoder.LocalGlobalDecoder`) is gemma's: a
:class:`~ggmlpy.kvcache.Wrapper` of a sliding-window :class:`~ggmlpy.kvcache.Causal` for the local
layers (it keeps only the window) and a full one for the global layers, each shifting keys with its
layers' own RoPE.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

from ggmlpy._core import Context, RopeType, Tensor, Type
from ggmlpy.gguf import MetadataError, meta_int
from ggmlpy.weights import MetaReader, check_expert_shapes

from . import blocks
from .base import register
from .config import _MAX_CTX, _MAX_EMBD, DecoderConfig, read_routing
from .decoder import LocalGlobalDecoder
from .gemma import GemmaConfig

__all__ = ["GptOssConfig", "GptOssModel"]

_MAX_EXPERTS = 1 << 12          # llama.cpp allows 1024 (LLAMA_MAX_EXPERTS)

#: Expert keys and the values that mean the routing built here (llama.cpp's gpt-oss graph reads none of
#: them but the group count, and builds exactly this): the first value is the default when absent.
_EXPERT_KEYS_BUILT = {
    "expert_gating_func": (0, 3),                      # none (the architecture's own), softmax_weight
    "expert_group_count": (0, 1),
    "expert_shared_count": (0,),
    "expert_shared_feed_forward_length": (0,),
}

#: YaRN keys llama.cpp's gpt-oss does not read, and the values it builds (ggml's defaults); None: the
#: value is derived (the attention factor YaRN computes from the scaling factor).
_YARN_KEYS_BUILT = {
    "rope.scaling.yarn_beta_fast": 32.0,
    "rope.scaling.yarn_beta_slow": 1.0,
    "rope.scaling.yarn_ext_factor": 1.0,
    "rope.scaling.yarn_log_multiplier": 0.0,
    "rope.scaling.yarn_attn_factor": None,
}


@dataclass(frozen=True)
class GptOssConfig(DecoderConfig):
    """Hyperparameters of gpt-oss files (see :class:`~ggmlpy.models.config.DecoderConfig` and the module
    docstring).

    Attributes
    ----------
    n_expert, n_expert_used, n_ff_exp : int
        Experts, experts per token, and each expert's hidden size (``expert_feed_forward_length``).
    swa_layers : tuple of bool
        Per layer: attends through the sliding window (``sliding_window`` positions, itself included).
    rope_base_swa, rope_freq_scale_swa : float
        RoPE base and frequency scale of the local layers.
    """

    ROPE_TYPES = {"gpt-oss": RopeType.NEOX}
    READS_EXPERTS = True

    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    swa_layers: tuple = ()
    rope_base_swa: float = 10000.0
    rope_freq_scale_swa: float = 1.0

    @classmethod
    def _read(cls, m: MetaReader, n_vocab: Optional[int]) -> dict[str, Any]:
        path = m.path
        # each expert's width: llama.cpp requires it (a value or a uniform per-layer array)
        n_ff_exp = meta_int(m.md, m.key("expert_feed_forward_length"), lo=1, hi=_MAX_EMBD * 8, per_layer=True,
                            path=path)
        if "feed_forward_length" not in m:
            # llama.cpp does not need the dense width here (there is no dense feed-forward)
            m = MetaReader({**m.md, m.key("feed_forward_length"): n_ff_exp}, m.arch, path)
        d = super()._read(m, n_vocab)
        n_layer = d["n_layer"]
        n_expert = m.geti("expert_count", lo=1, hi=_MAX_EXPERTS)
        n_used = meta_int(m.md, m.key("expert_used_count"), lo=1, hi=n_expert, per_layer=True, path=path)
        if read_routing(m, "gpt-oss", _EXPERT_KEYS_BUILT, norm_default=False):
            raise MetadataError(path, m.key("expert_weights_norm"), "true is not supported for gpt-oss (the "
                                                                    "softmax over the chosen experts sums to 1)")
        if d["rope_scaling"] == "yarn":
            cls._check_yarn(m, 1.0 / d["rope_freq_scale"])
        # llama.cpp requires the window; the pattern defaults to 2 (even layers local)
        window = m.geti("attention.sliding_window", lo=1, hi=_MAX_CTX)
        d.update(n_expert=n_expert, n_expert_used=n_used, n_ff_exp=n_ff_exp, sliding_window=window,
                 swa_layers=GemmaConfig._swa_pattern(m, n_layer, 2),
                 rope_base_swa=m.getf("rope.freq_base_swa", d["rope_base"], lo=0.0, lo_open=True),
                 rope_freq_scale_swa=d["rope_freq_scale"])
        return d

    @staticmethod
    def _check_yarn(m: MetaReader, factor: float) -> None:
        """Refuse the YaRN keys whose values ask for another rotation than ggml's defaults build."""
        for key, built in _YARN_KEYS_BUILT.items():
            if key not in m:
                continue
            v = m.getf(key)
            if built is None:
                # HF's attention_factor replaces YaRN's 0.1 ln(factor) + 1, which ggml applies
                built = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
            if not math.isclose(v, built, rel_tol=1e-6, abs_tol=1e-9):
                raise MetadataError(m.path, m.key(key), f"{v:g} is not supported for gpt-oss (llama.cpp builds "
                                                        f"{built:g})")

    def _problems(self) -> list[str]:
        bad = super()._problems()
        a = self.arch
        if not (1 <= self.n_expert_used <= self.n_expert and self.n_ff_exp >= 1):
            bad.append(f"{a}.expert_used_count {self.n_expert_used} must be in [1, expert_count {self.n_expert}] "
                       f"and {a}.expert_feed_forward_length {self.n_ff_exp} >= 1")
        if len(self.swa_layers) != self.n_layer:
            bad.append(f"{a}.attention.sliding_window_pattern gives {len(self.swa_layers)} layers, "
                       f"block_count {self.n_layer}")
        if any(self.swa_layers) and not (self.sliding_window or 0) >= 2:
            # a window of 1 (each token sees only itself) would be a cache window of 0: unlimited
            bad.append(f"{a}.attention.sliding_window {self.sliding_window} must be >= 2 with local layers")
        return bad

    def rope_of(self, layer: int) -> DecoderConfig:
        """The RoPE settings of ``layer``: this config, or for a local layer a copy with the local base and scale."""
        if not self.swa_layers[layer]:
            return self
        return dataclasses.replace(self, rope_base=self.rope_base_swa, rope_freq_scale=self.rope_freq_scale_swa)


@register(*GptOssConfig.ROPE_TYPES)
class GptOssModel(LocalGlobalDecoder):
    """A gpt-oss model (see the module docstring and :class:`~ggmlpy.models.decoder.DecoderModel`).

    Attributes
    ----------
    qkv_bias : bool
        The file has Q/K/V biases (the released models do).
    """

    config_class = GptOssConfig
    config: GptOssConfig
    #: biases, sinks and the routing add to the llama layer's nodes (one view and add per expert used more)
    NODES_PER_LAYER = 96

    @classmethod
    def read_config(cls, reader, path: str = "") -> GptOssConfig:
        """As :meth:`DecoderModel.read_config`, and ``expert_count`` and ``expert_feed_forward_length``
        checked against layer 0's ``ffn_gate_inp`` and ``ffn_gate_exps``."""
        cfg = super().read_config(reader, path)
        check_expert_shapes(reader, cfg, path, f"{cfg.arch}.expert_feed_forward_length")
        return cfg

    def _inspect(self, reader) -> None:
        super()._inspect(reader)
        self.qkv_bias = "blk.0.attn_q.bias" in reader

    def _expected(self):
        c = self.config
        f32 = (Type.F32,)
        yield from self._expected_io()
        for i in range(c.n_layer):
            p = f"blk.{i}."
            yield self._expected_norm(i, "attn_norm")
            yield from self._expected_attention(i, bias=self.qkv_bias, out_bias=True)
            yield p + "attn_sinks.weight", (c.n_head,), i, f32, None
            yield self._expected_norm(i, "post_attention_norm")
            # the router stays a plain matrix product; the experts are read by mul_mat_id
            yield p + "ffn_gate_inp.weight", (c.n_embd, c.n_expert), i, None, "mul_mat"
            yield p + "ffn_gate_inp.bias", (c.n_expert,), i, f32, None
            for name, rows, cols in (("gate", c.n_embd, c.n_ff_exp), ("up", c.n_embd, c.n_ff_exp),
                                     ("down", c.n_ff_exp, c.n_embd)):
                yield f"{p}ffn_{name}_exps.weight", (rows, cols, c.n_expert), i, None, "mul_mat_id"
                yield f"{p}ffn_{name}_exps.bias", (cols, c.n_expert), i, f32, None

    def graph_size(self) -> int:
        # the sum over the experts adds one view and add per expert used
        return super().graph_size() + self.config.n_layer * 2 * self.config.n_expert_used

    def _forward(self, ctx: Context, tokens: Tensor, pos: Tensor, memory, out_ids: Tensor, *, flash_attn: bool,
                 embeddings: bool) -> Tensor:
        c, w, eps = self.config, self.weights, self.config.rms_eps
        scale = 1.0 / math.sqrt(c.head_dim)
        x = ctx.get_rows(w["token_embd.weight"], tokens)
        for il in range(c.n_layer):
            p = f"blk.{il}."
            cur = blocks.rms_norm(ctx, x, w[p + "attn_norm.weight"], eps)
            q, k, v = blocks.qkv(ctx, w, p, cur, c.n_head, c.n_head_kv, c.head_dim)
            q, k = self.rope(ctx, q, pos, il), self.rope(ctx, k, pos, il)
            o = blocks.attention(ctx, memory, il, q, k, v, scale=scale, flash_attn=flash_attn,
                                 on_cpu=self.on_cpu(il), sinks=w[p + "attn_sinks.weight"])
            o = ctx.add(blocks.linear(ctx, w[p + "attn_output.weight"], o), w[p + "attn_output.bias"])
            if il == c.n_layer - 1:
                # only the rows that produce output go further
                o, x = ctx.get_rows(o, out_ids), ctx.get_rows(x, out_ids)
            x = ctx.add(x, o)
            cur = blocks.rms_norm(ctx, x, w[p + "post_attention_norm.weight"], eps)
            x = ctx.add(x, blocks.moe_ffn(ctx, w, p, cur, n_expert_used=c.n_expert_used, norm_weights=False,
                                          act="swiglu_oai", gating="softmax_weight"))
        return blocks.output(ctx, w, x, eps, embeddings=embeddings)
