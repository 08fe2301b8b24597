"""IBM Granite 4.0 H from GGUF: granitehybrid, Mamba-2 layers and attention layers, experts where the file has them.

As llama.cpp's ``granitehybrid`` graph builds Hugging Face's ``GraniteMoeHybridForCausalLM`` (the file says
which layer is which: ``granitehybrid.attention.head_count_kv`` is an array, 0 for a Mamba-2 layer):

* every layer is pre-norm (``attn_norm``), then its mixer, then a pre-norm (``ffn_norm``) feed-forward; both
  outputs are scaled by ``residual_scale`` before the residual adds, the embeddings by ``embedding_scale``,
  the logits divided by ``logit_scale`` (Granite's multipliers; each optional, 0 meaning unset);
* a **Mamba-2** layer (``ssm.*`` keys: ``conv_kernel``, ``inner_size``, ``state_size``, ``time_step_rank``
  the number of heads, ``group_count``): ``ssm_in`` gives ``z``, ``xBC`` and ``dt``; ``xBC`` goes through a
  causal depthwise convolution (``ssm_conv1d``, its bias) and SiLU, then the selective scan
  (``ssm_scan``: ``dt`` plus ``ssm_dt.bias``, ``ssm_a``, the groups' ``B`` and ``C``), plus ``x * ssm_d``;
  the result gated by ``SiLU(z)``, normed per group (``ssm_norm``) and projected (``ssm_out``). Two states
  per sequence (:class:`~ggmlpy.kvcache.Recurrent`): the convolution's last ``conv_kernel - 1`` inputs and
  the scan's ``state_size x head x heads`` matrix;
* an **attention** layer: grouped-query attention (Q/K/V and output biases where the file has them) with
  ``attention.scale`` (else ``1 / sqrt(head_dim)``), and RoPE only where ``rope.scaling.finetuned`` is true
  (Granite 4.0 H has none; the converter writes false);
* the feed-forward: a SwiGLU (``ffn_gate``/``ffn_up``/``ffn_down``), or with experts (``expert_count``)
  softmax routing to ``expert_used_count`` of them, weights renormalised, plus the shared expert
  (``ffn_*_shexp``, ``expert_shared_feed_forward_length`` wide) where the file has one.

The cache is a :class:`~ggmlpy.kvcache.Wrapper` of a :class:`~ggmlpy.kvcache.Causal` for the attention layers
and a :class:`~ggmlpy.kvcache.Recurrent` for the Mamba-2 layers (see :mod:`ggmlpy.models.lfm2` for what the
runner does with a state that cannot shift). Refused, naming the key: a sliding window, routing other than
softmax, experts in a file without them per layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ggmlpy._core import Context, RopeType, Tensor, Type
from ggmlpy.gguf import MetadataError, MetadataTypeError, meta_int
from ggmlpy.weights import MetaReader, check_expert_shapes

from . import blocks
from .base import register
from .config import _MAX_EMBD, _MAX_HEADS, _MAX_LAYERS, DecoderConfig, layer_kv_heads, read_routing
from .decoder import DecoderModel

__all__ = ["GraniteHybridConfig", "GraniteHybridModel"]

#: The routing keys and the values that mean what this graph builds (softmax over every expert).
_ROUTING = {"expert_gating_func": (0, 1), "expert_group_count": (0, 1), "expert_shared_count": (0, 1)}


@dataclass(frozen=True)
class GraniteHybridConfig(DecoderConfig):
    """Hyperparameters of granitehybrid files (see :class:`~ggmlpy.models.config.DecoderConfig` and the module
    docstring).

    Attributes
    ----------
    recurrent_layers : tuple of bool
        Per layer: Mamba-2 (True) or attention.
    ssm_d_conv, ssm_d_inner, ssm_d_state, ssm_n_head, ssm_n_group : int
        The Mamba-2 layers' convolution taps, inner width, state size, heads and groups.
    n_expert, n_expert_used, n_ff_shexp : int
        Experts, used per token, the shared expert's width (0: none).
    """

    ROPE_TYPES = {"granitehybrid": RopeType.NORMAL}
    READS_EXPERTS = True

    recurrent_layers: tuple = ()
    use_rope: bool = False
    logit_scale: float = 1.0
    embedding_scale: float = 1.0
    residual_scale: float = 1.0
    attention_scale: Optional[float] = None
    ssm_d_conv: int = 4
    ssm_d_inner: int = 0
    ssm_d_state: int = 0
    ssm_n_head: int = 0
    ssm_n_group: int = 1
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_shexp: int = 0

    @classmethod
    def _read(cls, m: MetaReader, n_vocab: Optional[int]) -> dict[str, Any]:
        n_layer = m.geti("block_count", lo=1, hi=_MAX_LAYERS)
        kv = layer_kv_heads(m, n_layer)
        attn = [k for k in kv if k]
        md = dict(m.md)
        md[m.key("attention.head_count_kv")] = attn[0] if attn else m.geti("attention.head_count", lo=1)
        d = super()._read(MetaReader(md, m.arch, m.path), n_vocab)
        if d["sliding_window"]:
            raise MetadataError(m.path, m.key("attention.sliding_window"), f"{d['sliding_window']}: sliding-window "
                                                                           "attention is not supported")
        rope = m.md.get(m.key("rope.scaling.finetuned"), True)
        if not isinstance(rope, (bool, np.bool_)):
            raise MetadataTypeError(m.path, m.key("rope.scaling.finetuned"), f"expected a bool, got {rope!r:.80}")
        d.update(recurrent_layers=tuple(k == 0 for k in kv), use_rope=bool(rope),
                 logit_scale=m.getf("logit_scale", 0.0, lo=0.0) or 1.0,
                 embedding_scale=m.getf("embedding_scale", 0.0, lo=0.0) or 1.0,
                 residual_scale=m.getf("residual_scale", 0.0, lo=0.0) or 1.0,
                 attention_scale=m.getf("attention.scale", 0.0, lo=0.0) or None)
        if 0 in kv:
            d.update(ssm_d_conv=m.geti("ssm.conv_kernel", lo=2, hi=1024), ssm_d_inner=m.geti("ssm.inner_size", lo=1,
                                                                                            hi=_MAX_EMBD * 8),
                     ssm_d_state=m.geti("ssm.state_size", lo=1, hi=1 << 16),
                     ssm_n_head=m.geti("ssm.time_step_rank", lo=1, hi=_MAX_HEADS),
                     ssm_n_group=m.geti("ssm.group_count", 1, lo=1, hi=_MAX_HEADS))
        n_expert = m.geti("expert_count", 0, lo=0, hi=1 << 12)
        used = meta_int(m.md, m.key("expert_used_count"), 0, lo=0, per_layer=True, path=m.path)
        if used and not n_expert:
            # (llama.cpp aborts on such a file)
            raise MetadataError(m.path, m.key("expert_used_count"), f"{used}, but {m.arch}.expert_count is 0 "
                                                                    "(no experts)")
        if n_expert:
            read_routing(m, m.arch, _ROUTING, norm_default=True)
            d.update(n_expert=n_expert, n_expert_used=meta_int(m.md, m.key("expert_used_count"), lo=1, hi=n_expert,
                                                               per_layer=True, path=m.path))
        # the shared expert (or none): llama.cpp reads its width where the file has experts
        d["n_ff_shexp"] = m.geti("expert_shared_feed_forward_length", 0, lo=0, hi=_MAX_EMBD * 8) if n_expert else 0
        return d

    def _problems(self) -> list[str]:
        bad = super()._problems()
        a = self.arch
        if len(self.recurrent_layers) != self.n_layer:
            bad.append(f"{a}.attention.head_count_kv gives {len(self.recurrent_layers)} layers, block_count "
                       f"{self.n_layer}")
        if any(self.recurrent_layers):
            di, nh, ng = self.ssm_d_inner, self.ssm_n_head, self.ssm_n_group
            if nh < 1 or di % nh or ng < 1 or di % ng or nh % ng:
                bad.append(f"{a}.ssm.inner_size {di} must be a multiple of ssm.time_step_rank {nh} (the heads) and "
                           f"of ssm.group_count {ng}, which must divide the heads")
        for key, v in (("logit_scale", self.logit_scale), ("embedding_scale", self.embedding_scale),
                       ("residual_scale", self.residual_scale), ("attention.scale", self.attention_scale)):
            if v is not None and not (math.isfinite(v) and v > 0):
                bad.append(f"{a}.{key} {v} must be finite and > 0")
        return bad

    @property
    def ssm_head_dim(self) -> int:
        return self.ssm_d_inner // self.ssm_n_head

    @property
    def ssm_conv_dim(self) -> int:
        """Channels of the convolution: x, B and C."""
        return self.ssm_d_inner + 2 * self.ssm_n_group * self.ssm_d_state


@register(*GraniteHybridConfig.ROPE_TYPES)
class GraniteHybridModel(DecoderModel):
    """A granitehybrid model (see the module docstring and :class:`~ggmlpy.models.decoder.DecoderModel`).

    Attributes
    ----------
    qkv_bias, out_bias, conv_bias : bool
        The file has Q/K/V biases, output-projection biases, convolution biases.
    """

    config_class = GraniteHybridConfig
    config: GraniteHybridConfig
    #: the Mamba-2 layer's views, convolution, scan, gate and group norm; the experts' routing
    NODES_PER_LAYER = 96

    @classmethod
    def read_config(cls, reader, path: str = "") -> GraniteHybridConfig:
        """As :meth:`DecoderModel.read_config`, the layer kinds checked against the tensors, and with experts their
        count and width against the first layer's router and experts."""
        cfg = super().read_config(reader, path)
        for i, rec in enumerate(cfg.recurrent_layers):
            other = f"blk.{i}.{'attn_q' if rec else 'ssm_in'}.weight"
            if other in reader:
                raise MetadataError(path, f"{cfg.arch}.attention.head_count_kv", f"layer {i} is "
                                    f"{'Mamba-2' if rec else 'attention'} by it, but the file has {other}")
        if cfg.n_expert:
            check_expert_shapes(reader, _Experts(cfg), path, f"{cfg.arch}.feed_forward_length")
        return cfg

    def _inspect(self, reader) -> None:
        super()._inspect(reader)
        first = next((i for i, r in enumerate(self.config.recurrent_layers) if not r), None)
        rec = next((i for i, r in enumerate(self.config.recurrent_layers) if r), None)
        self.qkv_bias = first is not None and f"blk.{first}.attn_q.bias" in reader
        self.out_bias = first is not None and f"blk.{first}.attn_output.bias" in reader
        self.conv_bias = rec is not None and f"blk.{rec}.ssm_conv1d.bias" in reader

    def _expected(self):
        c = self.config
        yield from self._expected_io()
        f32 = (Type.F32,)
        for i, rec in enumerate(c.recurrent_layers):
            p = f"blk.{i}."
            yield self._expected_norm(i, "attn_norm")
            if rec:
                d_in_proj = 2 * c.ssm_d_inner + 2 * c.ssm_n_group * c.ssm_d_state + c.ssm_n_head
                yield p + "ssm_in.weight", (c.n_embd, d_in_proj), i, None, "mul_mat"
                # ggml's ssm_conv and ssm_scan read F32 (the converter and llama-quantize keep these so)
                yield p + "ssm_conv1d.weight", (c.ssm_d_conv, c.ssm_conv_dim), i, f32, None
                if self.conv_bias:
                    yield p + "ssm_conv1d.bias", (c.ssm_conv_dim,), i, f32, None
                yield p + "ssm_dt.bias", (c.ssm_n_head,), i, f32, None
                yield p + "ssm_a", (1, c.ssm_n_head), i, f32, None
                yield p + "ssm_d", (1, c.ssm_n_head), i, f32, None
                yield p + "ssm_norm.weight", (c.ssm_d_inner // c.ssm_n_group, c.ssm_n_group), i, f32, None
                yield p + "ssm_out.weight", (c.ssm_d_inner, c.n_embd), i, None, "mul_mat"
            else:
                yield from self._expected_attention(i, bias=self.qkv_bias, out_bias=self.out_bias)
            yield self._expected_norm(i, "ffn_norm")
            if c.n_expert:
                yield p + "ffn_gate_inp.weight", (c.n_embd, c.n_expert), i, None, "mul_mat"
                for part, ne in (("gate", (c.n_embd, c.n_ff, c.n_expert)), ("up", (c.n_embd, c.n_ff, c.n_expert)),
                                 ("down", (c.n_ff, c.n_embd, c.n_expert))):
                    yield p + f"ffn_{part}_exps.weight", ne, i, None, "mul_mat_id"
                if c.n_ff_shexp:
                    for part, ne in (("gate", (c.n_embd, c.n_ff_shexp)), ("up", (c.n_embd, c.n_ff_shexp)),
                                     ("down", (c.n_ff_shexp, c.n_embd))):
                        yield p + f"ffn_{part}_shexp.weight", ne, i, None, "mul_mat"
            else:
                yield from self._expected_ffn(i)

    def graph_size(self) -> int:
        c = self.config
        return self.NODES_PER_LAYER * c.n_layer + 256 + (c.n_layer * 2 * c.n_expert_used if c.n_expert else 0)

    def shift_fn(self, ctx: Context, layer: int, k: Tensor, offsets: Tensor) -> Tensor:
        """The keys' shift: a rotation with RoPE, none without (positions do not enter the keys then)."""
        return blocks.rope_shift(ctx, k, offsets, self.config) if self.config.use_rope else k

    def new_cache(self, type_k=Type.F16, type_v=Type.F16, *, flash_attn: bool = True):
        """The K/V of the attention layers (:class:`~ggmlpy.kvcache.Causal`) and the Mamba-2 layers' two states
        (:class:`~ggmlpy.kvcache.Recurrent`) behind a :class:`~ggmlpy.kvcache.Wrapper`; one alone for a file
        of one kind of layer."""
        c = self.config
        states = {"conv": (c.ssm_d_conv - 1, c.ssm_conv_dim), "ssm": (c.ssm_d_state, c.ssm_head_dim, c.ssm_n_head)}
        return self.hybrid_cache(states, type_k, type_v, flash_attn=flash_attn)

    # ------------------------------------------------------------------ graph

    def _mamba2(self, ctx: Context, memory, il: int, cur: Tensor) -> Tensor:
        """Layer ``il``'s Mamba-2 mixer on the normed ``cur`` (``ne = (n_embd, n)``), as llama.cpp's
        ``build_mamba2_layer``."""
        c, w, p = self.config, self.weights, f"blk.{il}."
        di, ds, nh, ng, hd = c.ssm_d_inner, c.ssm_d_state, c.ssm_n_head, c.ssm_n_group, c.ssm_head_dim
        n = cur.ne[1]
        memory.set_layer(il)
        t, s = memory.n_seq_tokens, memory.n_seqs
        zxbcdt = blocks.linear(ctx, w[p + "ssm_in.weight"], cur)           # (2 di + 2 ng ds + nh, n): z, xBC, dt
        row, es = zxbcdt.nb[1], zxbcdt.nb[0]
        z = ctx.view(zxbcdt, (hd, nh, t, s), (hd * es, row, row * t), 0)
        xbc = ctx.view(zxbcdt, (c.ssm_conv_dim, n), (row,), di * es)
        dt = ctx.view(zxbcdt, (nh, t, s), (row, row * t), (2 * di + 2 * ng * ds) * es)
        xbc = memory.conv(xbc, w[p + "ssm_conv1d.weight"])               # (conv_dim, t, s)
        if self.conv_bias:
            xbc = ctx.add(xbc, w[p + "ssm_conv1d.bias"])
        xbc = ctx.silu(xbc)
        nb = (xbc.nb[1], xbc.nb[2])
        x = ctx.view(xbc, (hd, nh, t, s), (hd * 4, *nb), 0)
        b = ctx.view(xbc, (ds, ng, t, s), (ds * 4, *nb), di * 4)
        cm = ctx.view(xbc, (ds, ng, t, s), (ds * 4, *nb), (di + ng * ds) * 4)
        dt = ctx.add(ctx.cont(dt), w[p + "ssm_dt.bias"])
        y = memory.scan(x, dt, w[p + "ssm_a"], b, cm)                      # (hd, nh, t, s)
        y = ctx.add(y, ctx.mul(x, w[p + "ssm_d"]))
        y = ctx.swiglu_split(ctx.cont(z), y)                               # SiLU(z) * y
        y = blocks.rms_norm(ctx, ctx.reshape(y, (di // ng, ng, t, s)), w[p + "ssm_norm.weight"], c.rms_eps)
        return blocks.linear(ctx, w[p + "ssm_out.weight"], ctx.reshape(y, (di, n)))

    def _attention(self, ctx: Context, memory, il: int, cur: Tensor, pos: Tensor, flash_attn: bool) -> Tensor:
        c, w, p = self.config, self.weights, f"blk.{il}."
        q, k, v = blocks.qkv(ctx, w, p, cur, c.n_head, c.n_head_kv, c.head_dim)
        if c.use_rope:
            q, k = self.rope(ctx, q, pos, il), self.rope(ctx, k, pos, il)
        scale = c.attention_scale if c.attention_scale is not None else 1.0 / math.sqrt(c.head_dim)
        o = blocks.attention(ctx, memory, il, q, k, v, scale=scale, flash_attn=flash_attn, on_cpu=self.on_cpu(il))
        o = blocks.linear(ctx, w[p + "attn_output.weight"], o)
        return ctx.add(o, w[p + "attn_output.bias"]) if self.out_bias else o

    def _ffn(self, ctx: Context, p: str, cur: Tensor) -> Tensor:
        c, w = self.config, self.weights
        if not c.n_expert:
            return blocks.ffn_glu(ctx, w, p, cur)
        out = blocks.moe_ffn(ctx, w, p, cur, n_expert_used=c.n_expert_used, norm_weights=True)
        if c.n_ff_shexp:
            h = ctx.swiglu_split(blocks.linear(ctx, w[p + "ffn_gate_shexp.weight"], cur),
                                 blocks.linear(ctx, w[p + "ffn_up_shexp.weight"], cur))
            out = ctx.add(out, blocks.linear(ctx, w[p + "ffn_down_shexp.weight"], h))
        return out

    def _residual(self, ctx: Context, x: Tensor, out: Tensor) -> Tensor:
        s = self.config.residual_scale
        return ctx.add(x, out if s == 1.0 else ctx.scale(out, s))

    def _forward(self, ctx: Context, tokens: Tensor, pos: Tensor, memory, out_ids: Tensor, *, flash_attn: bool,
                 embeddings: bool) -> Tensor:
        c, w = self.config, self.weights
        x = self.embed_tokens(ctx, tokens, scale=None if c.embedding_scale == 1.0 else c.embedding_scale)
        for il, rec in enumerate(c.recurrent_layers):
            p = f"blk.{il}."
            cur = blocks.rms_norm(ctx, x, w[p + "attn_norm.weight"], c.rms_eps)
            o = self._mamba2(ctx, memory, il, cur) if rec else self._attention(ctx, memory, il, cur, pos, flash_attn)
            if il == c.n_layer - 1:
                # only the rows that produce output go further
                o, x = ctx.get_rows(o, out_ids), ctx.get_rows(x, out_ids)
            x = self._residual(ctx, x, o)
            cur = blocks.rms_norm(ctx, x, w[p + "ffn_norm.weight"], c.rms_eps)
            x = self._residual(ctx, x, self._ffn(ctx, p, cur))
        out = blocks.output(ctx, w, x, c.rms_eps, embeddings=embeddings)
        return out if embeddings or c.logit_scale == 1.0 else ctx.scale(out, 1.0 / c.logit_scale)


class _Experts:
    """What :func:`~ggmlpy.weights.check_expert_shapes` reads of a config: the experts are ``feed_forward_length``
    wide (llama.cpp's granitehybrid)."""

    def __init__(self, cfg: GraniteHybridConfig) -> None:
        self.arch, self.n_expert, self.n_ff_exp = cfg.arch, cfg.n_expert, cfg.n_ff
