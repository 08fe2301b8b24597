"""Qwen3-Next and Qwen3.5 from GGUF: qwen3next, qwen35 and qwen35moe, gated DeltaNet layers and gated attention
layers.

As llama.cpp's ``qwen3next`` graph builds Hugging Face's ``Qwen3NextForCausalLM`` (the file says which layer is
which: ``qwen3next.attention.recurrent_layers``, else every ``full_attention_interval``-th layer, default 4, is
attention):

* every layer is pre-norm (``attn_norm``), then its mixer, then a pre-norm (``post_attention_norm``) feed-forward,
  each added to the residual;
* a **gated DeltaNet** layer (``ssm.*`` keys: ``conv_kernel``, ``state_size`` the key head size,
  ``group_count`` the key heads, ``time_step_rank`` the value heads, ``inner_size`` their width): ``attn_qkv``
  gives q, k and v (every key head's q, then k, then v), ``attn_gate`` the output gate ``z``, ``ssm_ba`` per key
  head its value heads' ``b`` then ``a``; q, k and v go through a causal depthwise convolution (``ssm_conv1d``, no
  bias) and SiLU, q and k are L2-normalised per head and repeated for the value heads that share them; then
  the gated delta rule (``gated_delta_net``) with ``beta = sigmoid(b)`` and the log decay
  ``softplus(a + ssm_dt.bias) * ssm_a`` (the converter stores ``ssm_a = -exp(A_log)``); its output RMS-normed
  per head (``ssm_norm``), times ``SiLU(z)``, projected (``ssm_out``). Two states per sequence
  (:class:`~ggmlpy.kvcache.Recurrent`): the convolution's last ``conv_kernel - 1`` inputs and the delta rule's
  ``S x S`` matrix per value head;
* a **gated attention** layer: ``attn_q`` gives per head the query and an output gate, Q/K RMS norms per head,
  NEOX RoPE over the first ``rope.dimension_count`` values of each head (partial rotary), grouped-query
  attention through a :class:`~ggmlpy.kvcache.Causal`, the output times ``sigmoid(gate)`` before ``attn_output``;
* the feed-forward: softmax routing to ``expert_used_count`` experts (weights renormalised unless the file says
  ``expert_weights_norm = false``) plus the shared expert (``ffn_*_shexp``) scaled by
  ``sigmoid(ffn_gate_inp_shexp . x)``.

The cache is a :class:`~ggmlpy.kvcache.Wrapper` of the two (see :mod:`ggmlpy.models.lfm2` for what the runner
does with a state that cannot shift). Multi-token-prediction layers (``nextn_predict_layers``, the last
layers of ``block_count``: what the converter writes from a checkpoint's ``mtp.*`` unless given ``--no-mtp``)
are left in the file unread, as llama.cpp does unless asked for MTP: the model runs the others. Refused, naming
the key: key and value heads of different sizes (ggml's ``gated_delta_net`` takes one), value heads not a
multiple of the key heads, a sliding window, routing other than softmax.

qwen35 (Qwen3.5's text model, :class:`Qwen35Model`) has the same layers with three differences, as llama.cpp's
``qwen35`` graph: ``ssm_beta`` and ``ssm_alpha`` are two projections (one value per value head each); the
converter orders the value heads so that head ``h`` reads key head ``h % n_key_heads`` (ggml's own pairing, no
repeat); a SwiGLU feed-forward (``ffn_gate``/``ffn_up``/``ffn_down``) instead of experts. Its multimodal RoPE
sections are NEOX RoPE for a text token (the same position in every section) when they give every rotated pair
the temporal, height or width position, as the released files' do; other sections are refused, naming the key.

qwen35moe (Qwen3.5 MoE, :class:`Qwen35MoeModel`) is qwen35's layers with qwen3next's feed-forward (experts and
the gated shared expert); its converter writes no ``feed_forward_length`` (llama.cpp needs it only as the
experts' fallback width).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ggmlpy._core import Context, RopeType, Tensor, Type
from ggmlpy.gguf import MetadataError, MetadataTypeError, meta_int
from ggmlpy.weights import MetaReader

from . import blocks
from .base import register
from .config import _MAX_EMBD, _MAX_HEADS, _MAX_LAYERS, DecoderConfig, read_routing
from .decoder import RECURRENT_CHECKPOINTS, DecoderModel

__all__ = ["Qwen35Config", "Qwen35Model", "Qwen3NextConfig", "Qwen3NextModel"]

CHECKPOINTS = RECURRENT_CHECKPOINTS   # (the tests read it here)
#: The routing keys and the values that mean what this graph builds (softmax over every expert).
_ROUTING = {"expert_gating_func": (0, 1), "expert_group_count": (0, 1)}


@dataclass(frozen=True)
class Qwen3NextConfig(DecoderConfig):
    """Hyperparameters of qwen3next files (see :class:`~ggmlpy.models.config.DecoderConfig` and the module
    docstring).

    Attributes
    ----------
    recurrent_layers : tuple of bool
        Per layer: gated DeltaNet (True) or attention.
    ssm_d_conv, ssm_d_state, ssm_n_group, ssm_n_head, ssm_d_inner : int
        The DeltaNet layers' convolution taps, head size, key heads, value heads, value width.
    n_expert, n_expert_used, n_ff_exp, n_ff_shexp : int
        Experts, used per token, an expert's width, the shared expert's width.
    expert_norm : bool
        Renormalise the chosen experts' weights to sum to 1.
    """

    ROPE_TYPES = {"qwen3next": RopeType.NEOX}
    READS_EXPERTS = True

    recurrent_layers: tuple = ()
    ssm_d_conv: int = 4
    ssm_d_state: int = 0
    ssm_n_group: int = 1
    ssm_n_head: int = 1
    ssm_d_inner: int = 0
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0
    expert_norm: bool = True

    @classmethod
    def _read(cls, m: MetaReader, n_vocab: Optional[int]) -> dict[str, Any]:
        if cls.READS_EXPERTS and "feed_forward_length" not in m:
            # qwen35moe's converter writes no dense width; llama.cpp needs it only as the experts' fallback
            n_ff_exp = meta_int(m.md, m.key("expert_feed_forward_length"), lo=1, hi=_MAX_EMBD * 8, per_layer=True,
                                path=m.path)
            m = MetaReader({**m.md, m.key("feed_forward_length"): n_ff_exp}, m.arch, m.path)
        d = super()._read(m, n_vocab)
        if m.arch in ("qwen35", "qwen35moe"):
            _check_text_rope_sections(m, d["rope_dim"])
        n_layer = d["n_layer"]
        if d["sliding_window"]:
            raise MetadataError(m.path, m.key("attention.sliding_window"), f"{d['sliding_window']}: sliding-window "
                                                                           "attention is not supported")
        # block_count counts the MTP layers the converter appends (llama.cpp runs the others and, unless asked
        # for MTP, skips their tensors); the recurrent_layers array covers them all (they are attention layers)
        n_all = n_layer
        nextn = m.geti("nextn_predict_layers", 0, lo=0, hi=n_all - 1)
        n_layer = n_all - nextn
        d.update(n_layer=n_layer, n_layer_nextn=nextn)
        rec = m.md.get(m.key("attention.recurrent_layers"))
        if rec is None:
            every = m.geti("full_attention_interval", 4, lo=1, hi=_MAX_LAYERS)
            recurrent = tuple((i + 1) % every != 0 for i in range(n_layer))
        else:
            arr = np.asarray(rec)
            if arr.dtype != np.bool_ or arr.ndim != 1:
                raise MetadataTypeError(m.path, m.key("attention.recurrent_layers"),
                                        f"expected an array of bools, got {rec!r:.80}")
            if len(arr) != n_all:
                raise MetadataError(m.path, m.key("attention.recurrent_layers"), f"{len(arr)} values for "
                                                                                f"{n_all} layers")
            if arr[n_layer:].any():
                raise MetadataError(m.path, m.key("attention.recurrent_layers"), "a multi-token-prediction layer "
                                    f"(the last {nextn} of {n_all}) is marked recurrent")
            recurrent = tuple(bool(x) for x in arr[:n_layer])
        d["recurrent_layers"] = recurrent
        if any(recurrent):
            d.update(ssm_d_conv=m.geti("ssm.conv_kernel", lo=2, hi=1024),
                     ssm_d_state=m.geti("ssm.state_size", lo=1, hi=1 << 12),
                     ssm_n_group=m.geti("ssm.group_count", lo=1, hi=_MAX_HEADS),
                     ssm_n_head=m.geti("ssm.time_step_rank", lo=1, hi=_MAX_HEADS),
                     ssm_d_inner=m.geti("ssm.inner_size", lo=1, hi=_MAX_EMBD * 8))
        if not cls.READS_EXPERTS:
            return d
        n_expert = m.geti("expert_count", lo=1, hi=1 << 12)
        used = meta_int(m.md, m.key("expert_used_count"), lo=1, hi=n_expert, per_layer=True, path=m.path)
        norm = read_routing(m, m.arch, _ROUTING, norm_default=True)
        n_ff_exp = meta_int(m.md, m.key("expert_feed_forward_length"), 0, lo=0, hi=_MAX_EMBD * 8, per_layer=True,
                            path=m.path) or d["n_ff"] // used
        d.update(n_expert=n_expert, n_expert_used=used, n_ff_exp=n_ff_exp, expert_norm=norm,
                 n_ff_shexp=m.geti("expert_shared_feed_forward_length", 0, lo=0, hi=_MAX_EMBD * 8) or d["n_ff"])
        return d

    def _problems(self) -> list[str]:
        bad = super()._problems()
        a = self.arch
        if any(self.recurrent_layers):
            ds, nk, nv, di = self.ssm_d_state, self.ssm_n_group, self.ssm_n_head, self.ssm_d_inner
            if nv % nk:
                bad.append(f"{a}.ssm.time_step_rank {nv} (value heads) must be a multiple of ssm.group_count {nk} "
                           f"(key heads)")
            if di != nv * ds:
                # ggml's gated_delta_net takes keys and values of one head size
                bad.append(f"{a}.ssm.inner_size {di} must be ssm.time_step_rank {nv} x ssm.state_size {ds} (value "
                           f"heads of the key heads' size)")
        return bad

    @property
    def ssm_conv_dim(self) -> int:
        """Channels of the convolution: q, k and v."""
        return 2 * self.ssm_n_group * self.ssm_d_state + self.ssm_d_inner


@register(*Qwen3NextConfig.ROPE_TYPES)
class Qwen3NextModel(DecoderModel):
    """A qwen3next model (see the module docstring and :class:`~ggmlpy.models.decoder.DecoderModel`)."""

    config_class = Qwen3NextConfig
    config: Qwen3NextConfig
    #: the DeltaNet layer's views, convolution, norms, repeats, delta rule and gate; the experts' routing
    NODES_PER_LAYER = 128
    #: value head ``h`` reads key head ``h % n_key_heads`` (qwen35's converter orders the value heads so), not
    #: ``h // (n_v_heads / n_key_heads)``
    TILED_KEY_HEADS = False

    @classmethod
    def read_config(cls, reader, path: str = "") -> Qwen3NextConfig:
        """As :meth:`DecoderModel.read_config`, the layer kinds checked against the tensors."""
        cfg = super().read_config(reader, path)
        for i, rec in enumerate(cfg.recurrent_layers):
            other = f"blk.{i}.{'attn_q' if rec else 'attn_qkv'}.weight"
            if other in reader:
                raise MetadataError(path, f"{cfg.arch}.attention.recurrent_layers", f"layer {i} is "
                                    f"{'gated DeltaNet' if rec else 'attention'} by it, but the file has {other}")
        return cfg

    def _expected(self):
        c = self.config
        yield from self._expected_io()
        f32 = (Type.F32,)
        nv, di = c.ssm_n_head, c.ssm_d_inner
        n_q = c.n_head * c.head_dim
        for i, rec in enumerate(c.recurrent_layers):
            p = f"blk.{i}."
            yield self._expected_norm(i, "attn_norm")
            if rec:
                yield p + "attn_qkv.weight", (c.n_embd, c.ssm_conv_dim), i, None, "mul_mat"
                yield p + "attn_gate.weight", (c.n_embd, di), i, None, "mul_mat"
                yield from self._expected_beta_alpha(i)
                # ggml's ssm_conv reads an F32 kernel (the converter and llama-quantize keep these so)
                yield p + "ssm_conv1d.weight", (c.ssm_d_conv, c.ssm_conv_dim), i, f32, None
                yield p + "ssm_dt.bias", (nv,), i, f32, None
                yield p + "ssm_a", (nv,), i, f32, None
                yield p + "ssm_norm.weight", (di // nv,), i, f32, None
                yield p + "ssm_out.weight", (di, c.n_embd), i, None, "mul_mat"
            else:
                kv = c.n_head_kv * c.head_dim
                yield p + "attn_q.weight", (c.n_embd, 2 * n_q), i, None, "mul_mat"
                yield p + "attn_k.weight", (c.n_embd, kv), i, None, "mul_mat"
                yield p + "attn_v.weight", (c.n_embd, kv), i, None, "mul_mat"
                yield self._expected_norm(i, "attn_q_norm", c.head_dim)
                yield self._expected_norm(i, "attn_k_norm", c.head_dim)
                yield p + "attn_output.weight", (n_q, c.n_embd), i, None, "mul_mat"
            yield self._expected_norm(i, "post_attention_norm")
            yield from self._expected_moe(i)

    def _expected_beta_alpha(self, i: int):
        yield f"blk.{i}.ssm_ba.weight", (self.config.n_embd, 2 * self.config.ssm_n_head), i, None, "mul_mat"

    def _expected_moe(self, i: int):
        c, p = self.config, f"blk.{i}."
        yield p + "ffn_gate_inp.weight", (c.n_embd, c.n_expert), i, None, "mul_mat"
        for part, ne in (("gate", (c.n_embd, c.n_ff_exp, c.n_expert)), ("up", (c.n_embd, c.n_ff_exp, c.n_expert)),
                         ("down", (c.n_ff_exp, c.n_embd, c.n_expert))):
            yield p + f"ffn_{part}_exps.weight", ne, i, None, "mul_mat_id"
        yield p + "ffn_gate_inp_shexp.weight", (c.n_embd,), i, None, "mul_mat"
        for part, ne in (("gate", (c.n_embd, c.n_ff_shexp)), ("up", (c.n_embd, c.n_ff_shexp)),
                         ("down", (c.n_ff_shexp, c.n_embd))):
            yield p + f"ffn_{part}_shexp.weight", ne, i, None, "mul_mat"

    def graph_size(self) -> int:
        c = self.config
        return self.NODES_PER_LAYER * c.n_layer + 256 + c.n_layer * 2 * c.n_expert_used

    def shift_fn(self, ctx: Context, layer: int, k: Tensor, offsets: Tensor) -> Tensor:
        return blocks.rope_shift(ctx, k, offsets, self.config)

    def new_cache(self, type_k=Type.F16, type_v=Type.F16, *, flash_attn: bool = True):
        """The K/V of the attention layers (:class:`~ggmlpy.kvcache.Causal`) and the DeltaNet layers' two states
        (:class:`~ggmlpy.kvcache.Recurrent`) behind a :class:`~ggmlpy.kvcache.Wrapper`; one alone for a file
        of one kind of layer."""
        c = self.config
        states = {"conv": (c.ssm_d_conv - 1, c.ssm_conv_dim), "ssm": (c.ssm_d_state, c.ssm_d_state, c.ssm_n_head)}
        return self.hybrid_cache(states, type_k, type_v, flash_attn=flash_attn)

    # ------------------------------------------------------------------ graph

    def _l2_norm(self, ctx: Context, x: Tensor) -> Tensor:
        """Each row over its L2 norm, ``x / sqrt(sum(x**2) + eps)`` (transformers' ``l2norm``), as llama.cpp
        writes it: an RMS norm with ``eps / n``, scaled by ``1 / sqrt(n)``."""
        n = x.ne[0]
        return ctx.scale(ctx.rms_norm(x, self.config.rms_eps / n), 1.0 / math.sqrt(n))

    def _delta_net(self, ctx: Context, memory, il: int, cur: Tensor) -> Tensor:
        """Layer ``il``'s gated DeltaNet on the normed ``cur`` (``ne = (n_embd, n)``), as llama.cpp's
        ``build_layer_attn_linear``."""
        c, w, p = self.config, self.weights, f"blk.{il}."
        ds, nk, nv = c.ssm_d_state, c.ssm_n_group, c.ssm_n_head
        r = nv // nk
        n = cur.ne[1]
        memory.set_layer(il)
        t, s = memory.n_seq_tokens, memory.n_seqs
        qkv = blocks.linear(ctx, w[p + "attn_qkv.weight"], cur)              # (conv_dim, n): q, k, v
        z = blocks.linear(ctx, w[p + "attn_gate.weight"], cur)               # (nv ds, n)
        b, a = self._beta_alpha(ctx, p, cur, t, s)
        beta = ctx.reshape(ctx.sigmoid(b), (1, nv, t, s))
        alpha = ctx.add(a, w[p + "ssm_dt.bias"])
        gate = ctx.reshape(ctx.mul(ctx.softplus(alpha), w[p + "ssm_a"]), (1, nv, t, s))
        conv = ctx.silu(memory.conv(qkv, w[p + "ssm_conv1d.weight"]))       # (conv_dim, t, s)
        nb = (conv.nb[1], conv.nb[2])
        q = ctx.view(conv, (ds, nk, t, s), (ds * 4, *nb), 0)
        k = ctx.view(conv, (ds, nk, t, s), (ds * 4, *nb), nk * ds * 4)
        v = ctx.view(conv, (ds, nv, t, s), (ds * 4, *nb), 2 * nk * ds * 4)
        q, k = self._l2_norm(ctx, q), self._l2_norm(ctx, k)
        if r > 1 and not self.TILED_KEY_HEADS:
            # value head h reads key head h // r (transformers' repeat_interleave); ggml's op would tile them
            q, k = (ctx.reshape(ctx.repeat_4d(ctx.reshape(x, (ds, 1, nk, t * s)), ds, r, nk, t * s), (ds, nv, t, s))
                    for x in (q, k))
        y = memory.delta(q, k, v, gate, beta)                                # (ds, nv, t, s)
        y = blocks.rms_norm(ctx, y, w[p + "ssm_norm.weight"], c.rms_eps)
        y = ctx.swiglu_split(ctx.reshape(z, (ds, nv, t, s)), y)              # SiLU(z) * norm(y)
        return blocks.linear(ctx, w[p + "ssm_out.weight"], ctx.reshape(y, (nv * ds, n)))

    def _beta_alpha(self, ctx: Context, p: str, cur: Tensor, t: int, s: int) -> tuple[Tensor, Tensor]:
        """The DeltaNet layer's ``b`` and ``a``, ``ne = (n_v_heads, t, s)`` each, contiguous: ``ssm_ba`` holds per
        key head its value heads' ``b``, then their ``a``."""
        c = self.config
        nk, nv = c.ssm_n_group, c.ssm_n_head
        r = nv // nk
        ba = ctx.reshape(blocks.linear(ctx, self.weights[p + "ssm_ba.weight"], cur), (2 * r, nk, t, s))
        b = ctx.view(ba, (r, nk, t, s), ba.nb[1:], 0)
        a = ctx.view(ba, (r, nk, t, s), ba.nb[1:], r * ba.nb[0])
        return ctx.cont_3d(b, nv, t, s), ctx.cont_3d(a, nv, t, s)

    def _attention(self, ctx: Context, memory, il: int, cur: Tensor, pos: Tensor, flash_attn: bool) -> Tensor:
        c, w, p = self.config, self.weights, f"blk.{il}."
        hd, nh, nkv, n = c.head_dim, c.n_head, c.n_head_kv, cur.ne[1]
        if p + "attn_qkv.weight" in w:
            # the loader fused attn_q (per head: the query, then its gate), attn_k and attn_v
            f = blocks.linear(ctx, w[p + "attn_qkv.weight"], cur)
            es, row = f.nb[0], f.nb[1]
            q, g = (ctx.view(f, (hd, nh, n), (2 * hd * es, row), o * hd * es) for o in (0, 1))
            k, v = (ctx.view(f, (hd, nkv, n), (hd * es, row), (2 * nh + o * nkv) * hd * es) for o in (0, 1))
        else:
            qg = ctx.reshape(blocks.linear(ctx, w[p + "attn_q.weight"], cur), (2 * hd, nh, n))   # per head: q, gate
            q = ctx.view(qg, (hd, nh, n), qg.nb[1:3], 0)
            g = ctx.view(qg, (hd, nh, n), qg.nb[1:3], hd * qg.nb[0])
            k = ctx.reshape(blocks.linear(ctx, w[p + "attn_k.weight"], cur), (hd, nkv, n))
            v = ctx.reshape(blocks.linear(ctx, w[p + "attn_v.weight"], cur), (hd, nkv, n))
        q = blocks.rms_norm(ctx, q, w[p + "attn_q_norm.weight"], c.rms_eps)
        k = blocks.rms_norm(ctx, k, w[p + "attn_k_norm.weight"], c.rms_eps)
        q, k = self.rope(ctx, q, pos, il), self.rope(ctx, k, pos, il)
        o = blocks.attention(ctx, memory, il, q, k, v, scale=1.0 / math.sqrt(hd), flash_attn=flash_attn,
                             on_cpu=self.on_cpu(il))
        o = ctx.mul(ctx.reshape(o, (hd * nh, n)), ctx.sigmoid(ctx.cont_2d(g, hd * nh, n)))
        return blocks.linear(ctx, w[p + "attn_output.weight"], o)

    def _ffn(self, ctx: Context, p: str, cur: Tensor) -> Tensor:
        c, w = self.config, self.weights
        out = blocks.moe_ffn(ctx, w, p, cur, n_expert_used=c.n_expert_used, norm_weights=c.expert_norm)
        h = ctx.swiglu_split(blocks.linear(ctx, w[p + "ffn_gate_shexp.weight"], cur),
                             blocks.linear(ctx, w[p + "ffn_up_shexp.weight"], cur))
        shared = blocks.linear(ctx, w[p + "ffn_down_shexp.weight"], h)
        gate = ctx.sigmoid(ctx.mul_mat(w[p + "ffn_gate_inp_shexp.weight"], cur))     # (1, n): one per token
        return ctx.add(out, ctx.mul(shared, gate))

    def _forward(self, ctx: Context, tokens: Tensor, pos: Tensor, memory, out_ids: Tensor, *, flash_attn: bool,
                 embeddings: bool) -> Tensor:
        c, w = self.config, self.weights
        x = self.embed_tokens(ctx, tokens)
        for il, rec in enumerate(c.recurrent_layers):
            p = f"blk.{il}."
            cur = blocks.rms_norm(ctx, x, w[p + "attn_norm.weight"], c.rms_eps)
            o = self._delta_net(ctx, memory, il, cur) if rec else self._attention(ctx, memory, il, cur, pos,
                                                                                  flash_attn)
            if il == c.n_layer - 1:
                # only the rows that produce output go further
                o, x = ctx.get_rows(o, out_ids), ctx.get_rows(x, out_ids)
            x = ctx.add(x, o)
            cur = blocks.rms_norm(ctx, x, w[p + "post_attention_norm.weight"], c.rms_eps)
            x = ctx.add(x, self._ffn(ctx, p, cur))
        return blocks.output(ctx, w, x, c.rms_eps, embeddings=embeddings)


def _check_text_rope_sections(m: MetaReader, rope_dim: int) -> None:
    """Qwen3.5's interleaved multimodal RoPE (``rope.dimension_sections``, ggml's IMROPE) is NEOX RoPE for text only
    when every rotated pair takes the temporal, height or width position (all the token's position): a pair
    whose sector falls to the fourth section rotates by llama.cpp's fourth position instead (0 for text).
    Sections that leave such a pair (none in the released files: 11/11/10/0 over 32 pairs) are refused."""
    key = m.key("rope.dimension_sections")
    raw = m.md.get(key)
    if raw is None:
        return
    sec = np.asarray(raw).ravel()
    if sec.size != 4 or sec.dtype.kind not in "iu" or (sec < 0).any() or sec.sum() < 1 or sec.sum() > 1 << 16:
        raise MetadataError(m.path, key, f"{sec.tolist()[:8]}: expected 4 non-negative section sizes, not all 0")
    t, h, w, _ = (int(x) for x in sec)
    total = int(sec.sum())
    left = [k for k in range(min(total, rope_dim // 2))
            if not ((k % 3 == 0 and k < 3 * t) or (k % 3 == 1 and k < 3 * h) or (k % 3 == 2 and k < 3 * w))]
    if left:
        raise MetadataError(m.path, key, f"{sec.tolist()}: rotated pairs {left[:8]} take the fourth position, which "
                                         "text does not have; only sections that give every pair the temporal, "
                                         "height or width position are supported")


@dataclass(frozen=True)
class Qwen35Config(Qwen3NextConfig):
    """Hyperparameters of qwen35 files: qwen3next's, with a dense feed-forward (``feed_forward_length``) instead
    of experts. ``rope.dimension_sections`` (Qwen3.5's interleaved multimodal RoPE) is not read: for text every
    section has the token's position, which makes it NEOX RoPE over ``rope.dimension_count`` values."""

    ROPE_TYPES = {"qwen35": RopeType.NEOX}
    READS_EXPERTS = False


@register(*Qwen35Config.ROPE_TYPES)
class Qwen35Model(Qwen3NextModel):
    """A qwen35 model (Qwen3.5, text): qwen3next's layers with separate ``ssm_beta`` / ``ssm_alpha`` projections,
    value heads in the order ggml's ``gated_delta_net`` pairs with the key heads (no repeat), a SwiGLU
    feed-forward (``ffn_gate``/``ffn_up``/``ffn_down``), as llama.cpp's ``qwen35`` graph builds them."""

    config_class = Qwen35Config
    config: Qwen35Config
    TILED_KEY_HEADS = True

    def _expected_beta_alpha(self, i: int):
        for name in ("ssm_beta", "ssm_alpha"):
            yield f"blk.{i}.{name}.weight", (self.config.n_embd, self.config.ssm_n_head), i, None, "mul_mat"

    def _expected_moe(self, i: int):
        yield from self._expected_ffn(i)

    def _beta_alpha(self, ctx: Context, p: str, cur: Tensor, t: int, s: int) -> tuple[Tensor, Tensor]:
        nv = self.config.ssm_n_head
        return tuple(ctx.reshape(blocks.linear(ctx, self.weights[p + f"ssm_{x}.weight"], cur), (nv, t, s))
                     for x in ("beta", "alpha"))

    def _ffn(self, ctx: Context, p: str, cur: Tensor) -> Tensor:
        return blocks.ffn_glu(ctx, self.weights, p, cur)


@dataclass(frozen=True)
class Qwen35MoeConfig(Qwen3NextConfig):
    """Hyperparameters of qwen35moe files: qwen35's layers with qwen3next's experts (``expert_count``,
    ``expert_used_count``, ``expert_feed_forward_length``, ``expert_shared_feed_forward_length``)."""

    ROPE_TYPES = {"qwen35moe": RopeType.NEOX}


@register(*Qwen35MoeConfig.ROPE_TYPES)
class Qwen35MoeModel(Qwen35Model):
    """A qwen35moe model (Qwen3.5 MoE, text): :class:`Qwen35Model`'s layers with :class:`Qwen3NextModel`'s
    feed-forward (softmax routing, the shared expert scaled by its sigmoid gate), as llama.cpp's ``qwen35moe``
    graph builds them."""

    config_class = Qwen35MoeConfig
    config: Qwen35MoeConfig
    _expected_moe = Qwen3NextModel._expected_moe
    _ffn = Qwen3NextModel._ffn
