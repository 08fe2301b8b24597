"""DeepSeek-V2/V3 (R1, Kimi K2 and the models on their layout) from GGUF: ``general.architecture = "deepseek2"``.

The layer is a pre-norm decoder built of :mod:`~ggmlpy.models.blocks`, as llama.cpp's ``deepseek2`` graph builds
it (``src/models/deepseek2.cpp`` at the pinned commit) from the files its converter writes from Hugging Face's
``DeepseekV3ForCausalLM`` and ``DeepseekV2ForCausalLM``:

* RMSNorm (``attn_norm``) → multi-head latent attention → residual → RMSNorm (``ffn_norm``) → feed-forward
  → residual; the output norm and head (``output.weight``, or the tied ``token_embd.weight``) at the end;
* **multi-head latent attention** (:func:`~ggmlpy.models.blocks.mla`): the converter splits HF's
  ``kv_b_proj`` into ``attn_k_b`` (transposed, ``ne = (qk_nope, kv_lora, n_head)``) and ``attn_v_b`` and
  writes ``attention.key_length = kv_lora + rope_dim``, ``value_length = kv_lora`` and ``head_count_kv = 1``
  (multi-query attention over the latent), with HF's head sizes in ``attention.key_length_mla`` /
  ``value_length_mla``. The query is compressed (``attn_q_a`` → ``attn_q_a_norm`` → ``attn_q_b``,
  ``attention.q_lora_rank``) or not (``attn_q``: V2-Lite).
  **The cache stores the latent, not K and V**: per token and layer one row of ``kv_lora + rope_dim``
  values (the normed latent, then the rotated key part), read as K and, its first ``kv_lora`` values, as V
  (:class:`~ggmlpy.kvcache.Causal` with ``v_in_k``): DeepSeek-V3 keeps 576 values per token and layer where
  full K and V would take 128 heads x (192 + 128) = 40960. Generation attends absorbed, as llama.cpp always
  does; a prompt on the CPU, where that takes fewer operations, over each head's keys and values decompressed
  from the cached latents (:func:`~ggmlpy.models.blocks.mla_heads_pay`). A file from before the split
  (``attn_kv_b``, no ``key_length_mla``) is refused, naming the key: convert it again;
* RoPE in normal mode (adjacent pairs; HF's ``rope_interleave``) on the last ``rope.dimension_count`` values of
  each query head and the shared key part. YaRN as llama.cpp builds deepseek2: ``rope.scaling.yarn_log_multiplier``
  (the converter writes ``0.1 * mscale_all_dim``) scales ``q·k`` by ``mscale² / sqrt(key_length_mla)`` with
  ``mscale = 1 + 0.1 * mscale_all_dim * ln(factor)``, and the rotation itself is unscaled (HF's
  ``attention_factor`` is 1 when ``mscale`` equals ``mscale_all_dim``, as in the released models); without
  the multiplier the rotation is scaled by YaRN's ``1 + 0.1 ln(factor)`` and ``q·k`` by its square. The
  ramp is ggml's (``beta_fast`` 32, ``beta_slow`` 1); a file whose ``rope.scaling.yarn_*`` keys ask for
  other values is refused, naming the key;
* **the feed-forward**: the first ``leading_dense_block_count`` layers are dense (SwiGLU of
  ``feed_forward_length``); the others a mixture of ``expert_count`` experts of which ``expert_used_count``
  run per token (:func:`~ggmlpy.models.blocks.moe_ffn`), plus ``expert_shared_count`` shared experts every
  token runs (``ffn_{gate,up,down}_shexp``, ``expert_feed_forward_length x expert_shared_count`` wide).
  The routing (:class:`DeepseekMoeConfig`): softmax (V2) or sigmoid (V3) over the router logits
  (``expert_gating_func``; absent: softmax, as llama.cpp assumes for the V2 files that predate the key),
  ``exp_probs_b.bias`` added to choose the experts only (V3), expert groups (``expert_group_count``, of which
  ``expert_group_used_count`` are kept, each scored by its two best experts), the chosen weights renormalised
  (``expert_weights_norm``) and scaled (``expert_weights_scale``: ``routed_scaling_factor``).

NextN (multi-token prediction) layers a file may hold after the others (``nextn_predict_layers``) are not
loaded, as llama.cpp skips them (the converter does not write them for deepseek2). Unsupported metadata
(attention temperature tuning, a routing function this module does not build, ...) is refused, naming the key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import numpy as np

from ggmlpy._core import Context, GGMLValueError, RopeType, Tensor, Type, is_quantized
from ggmlpy.gguf import MetadataError, MetadataTypeError, meta_int
from ggmlpy.kvcache import Causal
from ggmlpy.weights import MetaReader

from . import blocks
from .base import register
from .config import _MAX_EMBD, DecoderConfig
from .decoder import DecoderModel

__all__ = ["DeepseekConfig", "DeepseekModel", "DeepseekMoeConfig"]

_MAX_EXPERTS = 1 << 12          # llama.cpp allows 1024 (LLAMA_MAX_EXPERTS)

#: YaRN keys llama.cpp's deepseek2 does not read, and the values it builds (ggml's defaults); None: the
#: rotation's scale, which depends on the factor and the log multiplier (:meth:`DeepseekConfig._check_yarn`).
_YARN_KEYS_BUILT = {
    "rope.scaling.yarn_beta_fast": 32.0,
    "rope.scaling.yarn_beta_slow": 1.0,
    "rope.scaling.yarn_ext_factor": 1.0,
    "rope.scaling.yarn_attn_factor": None,
}


def _get_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude scale (HF's ``yarn_get_mscale``, llama.cpp's ``get_mscale``)."""
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class DeepseekMoeConfig(DecoderConfig):
    """The DeepSeek-style mixture of experts, as llama.cpp reads it for deepseek2 and glm4moe: leading dense
    layers, routed experts with shared ones, the routing function, the correction bias, expert groups, and
    the weights' renormalisation and scale. A subclass sets :attr:`DEFAULT_GATING` and :attr:`SHARED_REQUIRED`.

    Attributes
    ----------
    n_dense_lead : int
        ``leading_dense_block_count``: the first layers have a dense feed-forward (``feed_forward_length``).
    n_expert, n_expert_used, n_ff_exp, n_expert_shared : int
        Experts, experts per token, each expert's width (``expert_feed_forward_length``), shared experts.
    gating : str
        ``"softmax"``, ``"sigmoid"`` or ``"softmax_weight"`` (:data:`~ggmlpy.models.blocks.GATINGS`).
    expert_weights_norm : bool
    expert_weights_scale : float
        0 or 1: unscaled.
    n_group, n_group_used : int
        Expert groups and the groups kept per token (0: no groups).
    """

    READS_EXPERTS = True
    #: The routing of a file without ``expert_gating_func``: llama.cpp's default for the architecture.
    DEFAULT_GATING: ClassVar[str] = "softmax"
    #: Whether a mixture-of-experts layer must have shared experts (llama.cpp's deepseek2 creates them always).
    SHARED_REQUIRED: ClassVar[bool] = True

    n_dense_lead: int = 0
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_expert_shared: int = 0
    gating: str = "softmax"
    expert_weights_norm: bool = False
    expert_weights_scale: float = 0.0
    n_group: int = 0
    n_group_used: int = 0

    @classmethod
    def _read(cls, m: MetaReader, n_vocab: Optional[int]) -> dict[str, Any]:
        path = m.path
        n_ff_exp = meta_int(m.md, m.key("expert_feed_forward_length"), lo=1, hi=_MAX_EMBD * 8, per_layer=True,
                            path=path)
        if "feed_forward_length" not in m:
            # llama.cpp does not need the dense width when no layer is dense
            m = MetaReader({**m.md, m.key("feed_forward_length"): n_ff_exp}, m.arch, path)
        d = super()._read(m, n_vocab)
        n_layer_all = d["n_layer"]
        nextn = m.geti("nextn_predict_layers", 0, lo=0, hi=n_layer_all - 1)
        n_layer = n_layer_all - nextn
        n_dense = m.geti("leading_dense_block_count", 0, lo=0, hi=n_layer_all)
        n_expert = m.geti("expert_count", 0, lo=0, hi=_MAX_EXPERTS)
        if n_expert == 0 and n_dense < n_layer:
            raise MetadataError(path, m.key("expert_count"), f"{'is 0' if 'expert_count' in m else 'is missing'}, "
                                f"but layers {n_dense} .. {n_layer - 1} are not dense "
                                f"({m.key('leading_dense_block_count')} = {n_dense})")
        # without experts llama.cpp requires expert_used_count 0 (or absent)
        n_used = meta_int(m.md, m.key("expert_used_count"), *(() if n_expert else (0,)), lo=min(n_expert, 1),
                          hi=n_expert, per_layer=True, path=path)
        n_shared = m.geti("expert_shared_count", lo=1 if cls.SHARED_REQUIRED and n_expert else 0, hi=_MAX_EXPERTS)
        func = m.geti("expert_gating_func", 0, lo=0)
        if func == 0:
            gating = cls._default_gating(n_layer, d["n_vocab"])
        elif func in blocks.GATINGS:
            gating = blocks.GATINGS[func]
        else:
            raise MetadataError(path, m.key("expert_gating_func"), f"{func} is not supported (this model builds "
                                f"{', '.join(f'{k} ({v})' for k, v in blocks.GATINGS.items())})")
        scale = m.getf("expert_weights_scale", 0.0, lo=0.0)
        norm = m.md.get(m.key("expert_weights_norm"), False)
        if not isinstance(norm, (bool, np.bool_)):
            raise MetadataTypeError(path, m.key("expert_weights_norm"), f"expected a bool, got {norm!r:.80}")
        n_group = m.geti("expert_group_count", 0, lo=0, hi=_MAX_EXPERTS)
        n_group_used = m.geti("expert_group_used_count", 0, lo=0, hi=_MAX_EXPERTS)
        if n_group > 1:
            per = n_expert // n_group
            if n_expert % n_group or per < 2:
                raise MetadataError(path, m.key("expert_group_count"), f"{n_group} groups of {n_expert} experts: "
                                    "they must divide the experts, two or more in each")
            if not 0 < n_group_used < n_group or n_used > n_group_used * per:
                raise MetadataError(path, m.key("expert_group_used_count"), f"{n_group_used} must be in "
                                    f"[1, {n_group - 1}] and its groups hold the {n_used} experts used per token")
        d.update(n_layer=n_layer, n_layer_nextn=nextn, n_dense_lead=min(n_dense, n_layer), n_expert=n_expert,
                 n_expert_used=n_used, n_ff_exp=n_ff_exp, n_expert_shared=n_shared, gating=gating,
                 expert_weights_norm=bool(norm), expert_weights_scale=scale,
                 n_group=n_group if n_group > 1 else 0, n_group_used=n_group_used if n_group > 1 else 0)
        return d

    @classmethod
    def _default_gating(cls, n_layer: int, n_vocab: int) -> str:
        """The routing llama.cpp assumes when the file has no ``expert_gating_func``."""
        return cls.DEFAULT_GATING

    @property
    def moe_layers(self) -> range:
        """The layers whose feed-forward is the mixture of experts."""
        return range(self.n_dense_lead if self.n_expert else self.n_layer, self.n_layer)

    def moe_kwargs(self) -> dict:
        """:func:`~ggmlpy.models.blocks.moe_ffn`'s routing arguments."""
        return dict(n_expert_used=self.n_expert_used, norm_weights=self.expert_weights_norm, gating=self.gating,
                    weights_scale=self.expert_weights_scale, n_group=self.n_group, n_group_used=self.n_group_used)

    def _problems(self) -> list[str]:
        bad = super()._problems()
        if self.n_expert and not (1 <= self.n_expert_used <= self.n_expert and self.n_ff_exp >= 1):
            bad.append(f"{self.arch}.expert_used_count {self.n_expert_used} must be in [1, expert_count "
                       f"{self.n_expert}] and {self.arch}.expert_feed_forward_length {self.n_ff_exp} >= 1")
        return bad


@dataclass(frozen=True)
class DeepseekConfig(DeepseekMoeConfig):
    """Hyperparameters of deepseek2 files (see the module docstring and :class:`DeepseekMoeConfig`).

    ``head_dim`` is a query head's size (``attention.key_length_mla``: HF's ``qk_nope_head_dim +
    qk_rope_head_dim``), ``rope_dim`` its rotated part; the file's ``attention.key_length`` is the cache row
    (``kv_lora + rope_dim``).

    Attributes
    ----------
    n_lora_q, n_lora_kv : int
        The query's compressed size (0: no compression) and the latent's.
    head_dim_v : int
        A head's output size (``attention.value_length_mla``).
    kq_scale : float
        ``q·k``'s scale: ``mscale² / sqrt(head_dim)`` (see the module docstring).
    """

    ROPE_TYPES = {"deepseek2": RopeType.NORMAL}

    n_lora_q: int = 0
    n_lora_kv: int = 0
    head_dim_v: int = 0
    kq_scale: float = 1.0

    @classmethod
    def _read(cls, m: MetaReader, n_vocab: Optional[int]) -> dict[str, Any]:
        path = m.path
        for key in ("attention.key_length_mla", "attention.value_length_mla"):
            if key not in m:
                raise MetadataError(path, m.key(key), "is missing: a deepseek2 file from before llama.cpp's converter "
                                    "split attn_kv_b for multi-head latent attention is not supported (convert the "
                                    "model again)")
        k_mla = m.geti("attention.key_length_mla", lo=1, hi=_MAX_EMBD)
        v_mla = m.geti("attention.value_length_mla", lo=1, hi=_MAX_EMBD)
        kv_lora = m.geti("attention.kv_lora_rank", lo=1, hi=_MAX_EMBD)
        key_len = m.geti("attention.key_length", lo=1, hi=_MAX_EMBD)
        v_len = m.geti("attention.value_length", kv_lora, lo=1, hi=_MAX_EMBD)
        # the base reads one head size for Q, K and V: give it the query head's (its Q-rows check holds)
        md = {**m.md, m.key("attention.key_length"): k_mla, m.key("attention.value_length"): k_mla}
        d = super()._read(MetaReader(md, m.arch, path), n_vocab)
        rope_dim = d["rope_dim"]
        if not rope_dim < k_mla:
            raise MetadataError(path, m.key("rope.dimension_count"), f"{rope_dim} must be less than "
                                f"{m.key('attention.key_length_mla')} {k_mla} (a head has a part without position)")
        if key_len != kv_lora + rope_dim:
            raise MetadataError(path, m.key("attention.key_length"), f"{key_len}, but a latent cache row is "
                                f"kv_lora_rank + rope.dimension_count = {kv_lora + rope_dim}")
        if v_len != kv_lora:
            raise MetadataError(path, m.key("attention.value_length"), f"{v_len}, but the latent is "
                                f"{m.key('attention.kv_lora_rank')} = {kv_lora}")
        if d["n_head_kv"] != 1:
            raise MetadataError(path, m.key("attention.head_count_kv"), f"{d['n_head_kv']}, but multi-head latent "
                                "attention caches one head (1)")
        for key in ("attention.temperature_scale", "attention.temperature_length"):
            if m.getf(key, 0.0) != 0.0:
                raise MetadataError(path, m.key(key), f"{m.getf(key):g}: attention temperature tuning is not "
                                    "supported")
        factor = 1.0 / d["rope_freq_scale"]
        log_mul = m.getf("rope.scaling.yarn_log_multiplier", 0.0) / 0.1   # the converter writes 0.1 x mscale_all_dim
        # the rotation's scale as llama.cpp passes it to ggml (cparams.yarn_attn_factor), whose YaRN then
        # multiplies it by 1 + 0.1 ln(factor)
        rope_attn = d["rope_attn_factor"]
        if d["rope_ext_factor"] != 0.0:
            cls._check_yarn(m, factor, rope_attn if log_mul else rope_attn * _get_mscale(factor))
            ggml_yarn = 1.0 + 0.1 * math.log(factor)
            rope_attn *= (1.0 if log_mul else _get_mscale(factor)) / ggml_yarn
        # llama.cpp's kq_scale: the scale ggml's rotation ends with, times mscale(factor, mscale_all_dim), squared
        mscale = rope_attn * (1.0 + 0.1 * math.log(factor)) * (1.0 + 0.1 * log_mul * math.log(factor))
        d.update(rope_attn_factor=rope_attn, n_lora_q=m.geti("attention.q_lora_rank", 0, lo=0, hi=_MAX_EMBD),
                 n_lora_kv=kv_lora, head_dim_v=v_mla, kq_scale=mscale * mscale / math.sqrt(k_mla))
        return d

    @classmethod
    def _default_gating(cls, n_layer: int, n_vocab: int) -> str:
        # llama.cpp: GLM-4.7-Lite files (deepseek2 layout) predate the key and route by sigmoid
        return "sigmoid" if n_layer in (47, 48) and n_vocab == 154880 else "softmax"

    @staticmethod
    def _check_yarn(m: MetaReader, factor: float, rotation_scale: float) -> None:
        """Refuse the YaRN keys whose values ask for another rotation than llama.cpp's deepseek2 builds."""
        for key, built in _YARN_KEYS_BUILT.items():
            if key not in m:
                continue
            v = m.getf(key)
            if built is None:
                built = rotation_scale   # HF's attention_factor multiplies the rotated values
            if not math.isclose(v, built, rel_tol=1e-6, abs_tol=1e-9):
                raise MetadataError(m.path, m.key(key), f"{v:g} is not supported for deepseek2 (llama.cpp builds "
                                                        f"{built:g})")

    @property
    def cache_row(self) -> int:
        """Values one token takes in a layer's cache: the latent and the rotated key part."""
        return self.n_lora_kv + self.rope_dim

    def cache_rows(self) -> tuple[int, int]:
        """The latent cache's row as K; no V apart (see :meth:`DecoderConfig.cache_rows`)."""
        return self.cache_row, 0


@register(*DeepseekConfig.ROPE_TYPES)
class DeepseekModel(DecoderModel):
    """A deepseek2 model (see the module docstring and :class:`~ggmlpy.models.decoder.DecoderModel`).

    Attributes
    ----------
    probs_bias : frozenset of int
        The layers whose file has the routing correction bias ``exp_probs_b.bias`` (V3).
    """

    config_class = DeepseekConfig
    config: DeepseekConfig
    #: the shared experts' gate and up are fused like a dense layer's
    FUSIONS = DecoderModel.FUSIONS + (("ffn_gate_up_shexp", ("ffn_gate_shexp", "ffn_up_shexp")),)
    #: latent attention (two compressions, absorption, concatenations) and the routing with groups
    NODES_PER_LAYER = 128

    @classmethod
    def read_config(cls, reader, path: str = "") -> DeepseekConfig:
        """As :meth:`DecoderModel.read_config`, and the expert count and widths checked against the first
        mixture-of-experts layer's router, gate experts and shared experts."""
        cfg = super().read_config(reader, path)
        _check_moe_shapes(reader, cfg, path)
        return cfg

    def _inspect(self, reader) -> None:
        super()._inspect(reader)
        self.probs_bias = frozenset(i for i in self.config.moe_layers if f"blk.{i}.exp_probs_b.bias" in reader)

    def _expected(self):
        c = self.config
        f32 = (Type.F32,)
        yield from self._expected_io()
        nope = c.head_dim - c.rope_dim
        for i in range(c.n_layer):
            p = f"blk.{i}."
            yield self._expected_norm(i, "attn_norm")
            if c.n_lora_q:
                yield p + "attn_q_a.weight", (c.n_embd, c.n_lora_q), i, None, "mul_mat"
                yield self._expected_norm(i, "attn_q_a_norm", c.n_lora_q)
                yield p + "attn_q_b.weight", (c.n_lora_q, c.n_head * c.head_dim), i, None, "mul_mat"
            else:
                yield p + "attn_q.weight", (c.n_embd, c.n_head * c.head_dim), i, None, "mul_mat"
            yield p + "attn_kv_a_mqa.weight", (c.n_embd, c.cache_row), i, None, "mul_mat"
            yield self._expected_norm(i, "attn_kv_a_norm", c.n_lora_kv)
            # per-head matrices (a batched product, not a plain one: kept out of the repacked buffers)
            yield p + "attn_k_b.weight", (nope, c.n_lora_kv, c.n_head), i, None, None
            yield p + "attn_v_b.weight", (c.n_lora_kv, c.head_dim_v, c.n_head), i, None, None
            yield p + "attn_output.weight", (c.n_head * c.head_dim_v, c.n_embd), i, None, "mul_mat"
            yield self._expected_norm(i, "ffn_norm")
            if i not in c.moe_layers:
                yield from self._expected_ffn(i)
                continue
            yield p + "ffn_gate_inp.weight", (c.n_embd, c.n_expert), i, None, "mul_mat"
            if i in self.probs_bias:
                yield p + "exp_probs_b.bias", (c.n_expert,), i, f32, None
            yield p + "ffn_gate_exps.weight", (c.n_embd, c.n_ff_exp, c.n_expert), i, None, "mul_mat_id"
            yield p + "ffn_up_exps.weight", (c.n_embd, c.n_ff_exp, c.n_expert), i, None, "mul_mat_id"
            yield p + "ffn_down_exps.weight", (c.n_ff_exp, c.n_embd, c.n_expert), i, None, "mul_mat_id"
            yield from _expected_shared(self, i)

    def graph_size(self) -> int:
        # the sum over the experts adds one view and add per expert used
        return super().graph_size() + self.config.n_layer * 2 * self.config.n_expert_used

    def new_cache(self, type_k=Type.F16, type_v=Type.F16, *, flash_attn: bool = True) -> Causal:
        """This model's cache, not yet allocated: the latent cache (see the module docstring), one row of
        ``kv_lora + rope_dim`` values per token and layer in ``type_k``, read as K and (its first ``kv_lora``)
        as V. ``type_v`` is not used: V is part of K, as in llama.cpp.

        Raises
        ------
        GGMLValueError
            A quantized ``type_k`` without flash attention: the ``mul_mat`` path reads V transposed, which
            a quantized row cannot be.
        """
        c = self.config
        if not flash_attn and is_quantized(Type(type_k)):
            raise GGMLValueError(f"{c.arch}: a {Type(type_k).name.lower()} K cache needs flash attention "
                                 "(flash_attn=True): the latent cache's V is part of K, and without flash attention "
                                 "V is read transposed, which a quantized row cannot be")
        return Causal(c.n_layer, c.cache_row, c.n_lora_kv, type_k, n_head_kv=1, v_in_k=True,
                      padding=256 if flash_attn else 32, shift_fn=self.shift_fn)

    def shift_fn(self, ctx: Context, layer: int, k: Tensor, offsets: Tensor) -> Tensor:
        """The cache's key shift: the rotated part at the end of each row (after the latent) turned by the
        position delta, the latent unchanged."""
        c, es = self.config, k.nb[0]
        latent = ctx.view(k, (c.n_lora_kv, k.ne[1], k.ne[2]), (k.nb[1], k.nb[2]), 0)
        pe = ctx.view(k, (c.rope_dim, k.ne[1], k.ne[2]), (k.nb[1], k.nb[2]), c.n_lora_kv * es)
        return ctx.concat(latent, blocks.rope_shift(ctx, pe, offsets, c), 0)

    def _forward(self, ctx: Context, tokens: Tensor, pos: Tensor, memory, out_ids: Tensor, *, flash_attn: bool,
                 embeddings: bool) -> Tensor:
        c, w, eps = self.config, self.weights, self.config.rms_eps
        x = self.embed_tokens(ctx, tokens)
        for il in range(c.n_layer):
            p = f"blk.{il}."
            cur = blocks.rms_norm(ctx, x, w[p + "attn_norm.weight"], eps)
            o = blocks.mla(ctx, w, p, cur, pos, memory, il, c, n_head=c.n_head, kv_lora=c.n_lora_kv,
                           head_dim=c.head_dim, eps=eps, scale=c.kq_scale, flash_attn=flash_attn,
                           on_cpu=self.on_cpu(il))
            o = blocks.linear(ctx, w[p + "attn_output.weight"], o)
            if il == c.n_layer - 1:
                # only the rows that produce output go further
                o, x = ctx.get_rows(o, out_ids), ctx.get_rows(x, out_ids)
            x = ctx.add(x, o)
            cur = blocks.rms_norm(ctx, x, w[p + "ffn_norm.weight"], eps)
            x = ctx.add(x, moe_shared_ffn(ctx, w, p, cur, c, il))
        return blocks.output(ctx, w, x, eps, embeddings=embeddings)


def moe_shared_ffn(ctx: Context, w, prefix: str, cur: Tensor, c: DeepseekMoeConfig, layer: int) -> Tensor:
    """Layer ``layer``'s feed-forward: dense SwiGLU in the leading dense layers, else the routed experts plus
    the shared ones (where the layer has them)."""
    if layer not in c.moe_layers:
        return blocks.ffn_glu(ctx, w, prefix, cur)
    out = blocks.moe_ffn(ctx, w, prefix, cur, **c.moe_kwargs())
    if c.n_expert_shared:
        out = ctx.add(out, blocks.ffn_glu(ctx, w, prefix, cur, suffix="_shexp"))
    return out


def _expected_shared(model: DecoderModel, i: int):
    """Layer ``i``'s shared experts (one gated feed-forward ``n_ff_exp x n_expert_shared`` wide)."""
    c, p = model.config, f"blk.{i}."
    if not c.n_expert_shared:
        return
    n = c.n_ff_exp * c.n_expert_shared
    yield p + "ffn_gate_shexp.weight", (c.n_embd, n), i, None, "mul_mat"
    yield p + "ffn_up_shexp.weight", (c.n_embd, n), i, None, "mul_mat"
    yield p + "ffn_down_shexp.weight", (n, c.n_embd), i, None, "mul_mat"


def _check_moe_shapes(reader, cfg: DeepseekMoeConfig, path: str) -> None:
    """The expert keys against the first mixture-of-experts layer's tensors (before anything is sized)."""
    if not cfg.n_expert:
        return
    a, i = cfg.arch, cfg.moe_layers.start
    for key, want, tname, dim in (
            (f"{a}.expert_count", cfg.n_expert, f"blk.{i}.ffn_gate_inp.weight", 1),
            (f"{a}.expert_feed_forward_length", cfg.n_ff_exp, f"blk.{i}.ffn_gate_exps.weight", 1),
            (f"{a}.expert_count", cfg.n_expert, f"blk.{i}.ffn_gate_exps.weight", 2),
            (f"{a}.expert_shared_count", cfg.n_ff_exp * cfg.n_expert_shared, f"blk.{i}.ffn_gate_shexp.weight", 1)):
        ne = reader.tensor_info(tname).ne if tname in reader else None
        if ne is not None and len(ne) > dim and ne[dim] != want:
            raise MetadataError(path, key, f"the metadata gives {want // cfg.n_ff_exp if 'shared' in key else want}"
                                f"{' (x expert_feed_forward_length)' if 'shared' in key else ''}, but {tname} has "
                                f"ne={tuple(ne)}")
