"""LiquidAI LFM2 from GGUF: lfm2, a hybrid of short convolutions and attention.

Every layer is pre-norm (``attn_norm``, llama.cpp's "operator norm") with a SwiGLU feed-forward
(``ffn_norm``, ``ffn_gate``/``ffn_up``/``ffn_down``); its operator is one of two, as llama.cpp's ``lfm2``
graph builds them (the file says which: ``lfm2.attention.head_count_kv`` is an array, 0 for a
convolution layer):

* a **short convolution** (``shortconv``): ``in_proj`` gives three rows per channel, ``B``, ``C`` and
  ``x``; ``B * x`` goes through a causal depthwise convolution of ``shortconv.l_cache`` taps
  (``shortconv.conv``, F32, no bias), which needs the last ``l_cache - 1`` inputs of the sequence: a
  recurrent state per sequence (:class:`~ggmlpy.kvcache.Recurrent`, ``ssm_conv``); then ``C * conv``
  through ``out_proj``;
* **grouped-query attention** with an RMSNorm on each head of Q and K (``attn_q_norm``,
  ``attn_k_norm``) before NEOX RoPE, through a :class:`~ggmlpy.kvcache.Causal`.

The output norm is the tensor llama.cpp calls ``token_embd_norm`` (its "fix for a wrong tensor name"), the
head ``output.weight`` or the tied embeddings.

The cache is a :class:`~ggmlpy.kvcache.Wrapper` of the two (one of them alone for a file of one kind of
layer). The convolution state cannot be shifted or cut back: a context shift clears the sequence and
computes what it kept again (the runner's fallback), and a prompt is reused from its start or from a
checkpoint (the runner keeps them at the end of each prompt).

Refused, naming the key: a sliding window (``attention.sliding_window``, LFM2-VL's llama.cpp iSWA
variant), bidirectional attention (``attention.causal = false``, the embedding models), a different
number of KV heads in two attention layers; and by their tensors, ColBERT's dense output and biases.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ggmlpy._core import Context, RopeType, Tensor, Type
from ggmlpy.gguf import MetadataError, MetadataTypeError
from ggmlpy.weights import MetaReader

from . import blocks
from .base import register
from .config import _MAX_LAYERS, DecoderConfig, layer_kv_heads
from .decoder import RECURRENT_CHECKPOINTS, DecoderModel

__all__ = ["Lfm2Config", "Lfm2Model"]

CHECKPOINTS = RECURRENT_CHECKPOINTS   # (the tests read it here)


@dataclass(frozen=True)
class Lfm2Config(DecoderConfig):
    """Hyperparameters of lfm2 files (see :class:`~ggmlpy.models.config.DecoderConfig` and the module docstring).

    Attributes
    ----------
    recurrent_layers : tuple of bool
        Per layer: a short convolution (True) or attention.
    conv_l_cache : int
        Taps of each convolution (``shortconv.l_cache``); its state keeps ``conv_l_cache - 1`` inputs.
    """

    ROPE_TYPES = {"lfm2": RopeType.NEOX}

    recurrent_layers: tuple = ()
    conv_l_cache: int = 3

    @classmethod
    def _read(cls, m: MetaReader, n_vocab: Optional[int]) -> dict[str, Any]:
        n_layer = m.geti("block_count", lo=1, hi=_MAX_LAYERS)
        kv = layer_kv_heads(m, n_layer)
        attn = [k for k in kv if k]
        # the common reader takes one head count: the attention layers' (any, when there are none)
        md = dict(m.md)
        md[m.key("attention.head_count_kv")] = attn[0] if attn else m.geti("attention.head_count", lo=1)
        d = super()._read(MetaReader(md, m.arch, m.path), n_vocab)
        if d["sliding_window"]:
            raise MetadataError(m.path, m.key("attention.sliding_window"),
                                f"{d['sliding_window']}: sliding-window lfm2 attention is not supported")
        causal = m.md.get(m.key("attention.causal"), True)
        if not isinstance(causal, (bool, np.bool_)):
            raise MetadataTypeError(m.path, m.key("attention.causal"), f"expected a bool, got {causal!r:.40}")
        if not causal:
            raise MetadataError(m.path, m.key("attention.causal"), "false: bidirectional lfm2 (an embedding "
                                                                   "model) is not supported")
        d["recurrent_layers"] = tuple(k == 0 for k in kv)
        d["conv_l_cache"] = m.geti("shortconv.l_cache", lo=2, hi=1024) if 0 in kv else \
            m.geti("shortconv.l_cache", 3, lo=2, hi=1024)
        return d

    def _problems(self) -> list[str]:
        bad = super()._problems()
        if len(self.recurrent_layers) != self.n_layer:
            bad.append(f"{self.arch}.attention.head_count_kv gives {len(self.recurrent_layers)} layers, block_count "
                       f"{self.n_layer}")
        if not 2 <= self.conv_l_cache <= 1024:
            bad.append(f"{self.arch}.shortconv.l_cache {self.conv_l_cache} must be in [2, 1024]")
        return bad


@register(*Lfm2Config.ROPE_TYPES)
class Lfm2Model(DecoderModel):
    """An lfm2 model (see the module docstring and :class:`~ggmlpy.models.decoder.DecoderModel`)."""

    config_class = Lfm2Config
    config: Lfm2Config
    #: the convolution's split, concat, transposes and state copy, the Q/K norms
    NODES_PER_LAYER = 72

    @classmethod
    def read_config(cls, reader, path: str = "") -> Lfm2Config:
        """As :meth:`DecoderModel.read_config`, the head counts checked against the first attention layer (layer
        0 may be a convolution)."""
        cfg = super().read_config(reader, path)
        a = cfg.arch
        first = next((i for i, r in enumerate(cfg.recurrent_layers) if not r), None)
        for i, rec in enumerate(cfg.recurrent_layers):
            # a layer of the other kind's tensors: a head count that says otherwise than the file
            other = f"blk.{i}.{'attn_q' if rec else 'shortconv.in_proj'}.weight"
            if other in reader:
                raise MetadataError(path, f"{a}.attention.head_count_kv", f"layer {i} is "
                                    f"{'a convolution' if rec else 'attention'} by it, but the file has {other}")
        if first is not None:
            for key, want, name in ((f"{a}.attention.head_count", cfg.n_head * cfg.head_dim, "attn_q"),
                                    (f"{a}.attention.head_count_kv", cfg.n_head_kv * cfg.head_dim, "attn_k")):
                t = f"blk.{first}.{name}.weight"
                info = reader.tensor_info(t) if t in reader else None
                if info is not None and (len(info.ne) != 2 or info.ne[1] != want):
                    raise MetadataError(path, key, f"the metadata gives {want} rows (heads x head size), but {t} "
                                                   f"has ne={info.ne}")
        return cfg

    def _expected(self):
        c = self.config
        yield "token_embd.weight", (c.n_embd, c.n_vocab), "input", None, None
        yield "token_embd_norm.weight", (c.n_embd,), "output", (Type.F32,), None       # the output norm
        if not self.tied_output:
            yield "output.weight", (c.n_embd, c.n_vocab), "output", None, "mul_mat"
        for i, rec in enumerate(c.recurrent_layers):
            p = f"blk.{i}."
            yield self._expected_norm(i, "attn_norm")
            if rec:
                yield p + "shortconv.in_proj.weight", (c.n_embd, 3 * c.n_embd), i, None, "mul_mat"
                # ggml's ssm_conv reads an F32 kernel (the converter and llama-quantize keep it so)
                yield p + "shortconv.conv.weight", (c.conv_l_cache, c.n_embd), i, (Type.F32,), None
                yield p + "shortconv.out_proj.weight", (c.n_embd, c.n_embd), i, None, "mul_mat"
            else:
                yield from self._expected_attention(i, qk_norm=(c.head_dim, c.head_dim))
            yield self._expected_norm(i, "ffn_norm")
            yield from self._expected_ffn(i)

    def new_cache(self, type_k=Type.F16, type_v=Type.F16, *, flash_attn: bool = True):
        """The K/V of the attention layers (a :class:`~ggmlpy.kvcache.Causal`, shifting keys with RoPE) and the
        convolution states of the others (a :class:`~ggmlpy.kvcache.Recurrent`), behind a
        :class:`~ggmlpy.kvcache.Wrapper`; one of them alone for a file of one kind of layer."""
        c = self.config
        return self.hybrid_cache({"conv": (c.conv_l_cache - 1, c.n_embd)}, type_k, type_v, flash_attn=flash_attn)

    def shift_fn(self, ctx: Context, layer: int, k: Tensor, offsets: Tensor) -> Tensor:
        return blocks.rope_shift(ctx, k, offsets, self.config)

    def graph_size(self) -> int:
        return self.NODES_PER_LAYER * self.config.n_layer + 256

    def _shortconv(self, ctx: Context, memory, il: int, cur: Tensor) -> Tensor:
        """The convolution operator of layer ``il`` on the normed ``cur`` (``ne = (n_embd, n)``)."""
        w, n_embd = self.weights, self.config.n_embd
        p = f"blk.{il}.shortconv."
        memory.set_layer(il)
        bcx = blocks.linear(ctx, w[p + "in_proj.weight"], cur)            # (3 n_embd, n): B, C, x rows
        row, es = bcx.nb[1], bcx.nb[0]
        n = cur.ne[1]
        b, x = (ctx.view(bcx, (n_embd, n), (row,), k * n_embd * es) for k in (0, 2))
        conv = memory.conv(ctx.mul(b, x), w[p + "conv.weight"])              # (n_embd, n_seq_tokens, n_seqs)
        t, s = conv.ne[1], conv.ne[2]
        c = ctx.view(bcx, (n_embd, t, s), (row, row * t), n_embd * es)      # the batch's rows, by sequence
        y = ctx.mul(c, conv)
        return blocks.linear(ctx, w[p + "out_proj.weight"], ctx.reshape(y, (n_embd, n)))

    def _attention(self, ctx: Context, memory, il: int, cur: Tensor, pos: Tensor, flash_attn: bool) -> Tensor:
        c, w, p = self.config, self.weights, f"blk.{il}."
        q, k, v = blocks.qkv(ctx, w, p, cur, c.n_head, c.n_head_kv, c.head_dim)
        q = blocks.rms_norm(ctx, q, w[p + "attn_q_norm.weight"], c.rms_eps)
        k = blocks.rms_norm(ctx, k, w[p + "attn_k_norm.weight"], c.rms_eps)
        q, k = self.rope(ctx, q, pos, il), self.rope(ctx, k, pos, il)
        o = blocks.attention(ctx, memory, il, q, k, v, scale=1.0 / math.sqrt(c.head_dim), flash_attn=flash_attn,
                             on_cpu=self.on_cpu(il))
        return blocks.linear(ctx, w[p + "attn_output.weight"], o)

    def _forward(self, ctx: Context, tokens: Tensor, pos: Tensor, memory, out_ids: Tensor, *, flash_attn: bool,
                 embeddings: bool) -> Tensor:
        c, w = self.config, self.weights
        x = self.embed_tokens(ctx, tokens)
        for il, rec in enumerate(c.recurrent_layers):
            p = f"blk.{il}."
            cur = blocks.rms_norm(ctx, x, w[p + "attn_norm.weight"], c.rms_eps)
            if rec:
                o = self._shortconv(ctx, memory, il, cur)
            else:
                o = self._attention(ctx, memory, il, cur, pos, flash_attn)
            if il == c.n_layer - 1:
                # only the rows that produce output go further
                o, x = ctx.get_rows(o, out_ids), ctx.get_rows(x, out_ids)
            x = ctx.add(x, o)
            cur = blocks.rms_norm(ctx, x, w[p + "ffn_norm.weight"], c.rms_eps)
            x = ctx.add(x, blocks.ffn_glu(ctx, w, p, cur))
        x = blocks.rms_norm(ctx, x, w["token_embd_norm.weight"], c.rms_eps)
        if embeddings:
            return x
        return blocks.linear(ctx, w["output.weight"] if "output.weight" in w else w["token_embd.weight"], x)
