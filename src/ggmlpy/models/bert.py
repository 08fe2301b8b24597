"""Encoders for embeddings and reranking from GGUF: bert, nomic-bert, nomic-bert-moe.

What llama.cpp's converter writes for ``BertModel``/``BertForSequenceClassification``, ``RobertaModel``/
``XLMRobertaModel`` and their ``ForSequenceClassification`` rerankers (all ``bert``), and nomic's
``NomicBertModel`` (``nomic-bert``; ``nomic-bert-moe`` with ``moe_every_n_layers``), built as llama.cpp's
``bert`` graph builds them (``src/models/bert.cpp``):

* input: the token's embedding, plus row 0 of ``token_types`` (every token is of type 0, "sentence A",
  as in llama.cpp), plus for ``bert`` the learned ``position_embd`` row of its position; then a LayerNorm
  (``token_embd_norm``);
* each layer post-norm: attention (Q/K/V with biases where the file has them; NEOX RoPE on Q and K for
  the nomic architectures), **non-causal**: every token sees every token of its own sequence in the
  micro-batch, through the :class:`~ggmlpy.kvcache.Encoder` cache (nothing is kept between calls);
  ``LN(x + attn)``; the feed-forward (``bert``: ``down(gelu(up x))`` with biases; ``nomic-bert``:
  SwiGLU; ``nomic-bert-moe``: every ``moe_every_n_layers``-th layer from the second a mixture of
  gate-less GELU experts, the others ``bert``'s); ``LN(h + ffn)``;
* output: the last layer's hidden states of the rows asked for (no final norm); the runner pools them
  as the file's ``{arch}.pooling_type`` says (:data:`POOLING`: none, mean, cls, last), or, for ``rank``,
  the classification head runs on each sequence's first row (``cls``: dense + tanh, as RoBERTa's
  ``classifier.dense``, where the file has it; then ``cls.output``, the scores), as llama.cpp's
  ``build_pooling`` does.

GELU is the exact (erf) one, as BERT's ``hidden_act="gelu"`` and nomic's are; llama.cpp takes ggml's tanh
approximation (``ggml_gelu``), whose difference is part of llama.cpp's own error against transformers.

An encoder has no language-model head: asked for logits (``build(..., embeddings=False)``) it refuses, and
the runner refuses to generate with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import numpy as np

from ggmlpy._core import Context, GGMLValueError, RopeType, Tensor, Type
from ggmlpy.gguf import MetadataError, MetadataTypeError, meta_int
from ggmlpy.kvcache import Encoder
from ggmlpy.weights import MetaReader

from . import blocks, kernels
from .base import register
from .config import POOLING, DecoderConfig
from .decoder import DecoderModel

__all__ = ["POOLING", "BertConfig", "BertModel"]

_MAX_EXPERTS = 1 << 12


@dataclass(frozen=True)
class BertConfig(DecoderConfig):
    """Hyperparameters of bert, nomic-bert and nomic-bert-moe files (see :class:`DecoderConfig`).

    ``rms_eps`` holds the LayerNorms' epsilon (``attention.layer_norm_epsilon``). ``pooling`` is the
    file's ``pooling_type`` (``"none"`` when it has none, as llama.cpp); ``causal`` its
    ``attention.causal`` (the converter writes false). ``cls_labels`` are the classifier's labels
    (``classifier.output_labels``), where the file names them. With experts (nomic-bert-moe) layer ``i``
    is a mixture of ``n_expert`` experts, ``n_expert_used`` per token, where ``i % moe_every == 1``.
    """

    ROPE_TYPES = {"bert": RopeType.NEOX, "nomic-bert": RopeType.NEOX, "nomic-bert-moe": RopeType.NEOX}
    EPS_KEY = "attention.layer_norm_epsilon"
    READS_EXPERTS = True

    pooling: str = "none"
    causal: bool = False
    cls_labels: tuple = ()
    n_expert: int = 0
    n_expert_used: int = 0
    moe_every: int = 0

    @property
    def rope(self) -> bool:
        """Whether Q and K are rotated (nomic's); ``bert`` has learned absolute positions instead."""
        return self.arch != "bert"

    @classmethod
    def _read(cls, m: MetaReader, n_vocab: Optional[int]) -> dict[str, Any]:
        d = super()._read(m, n_vocab)
        pooling = POOLING[m.geti("pooling_type", 0, lo=0, hi=len(POOLING) - 1)]
        causal = m.md.get(m.key("attention.causal"), False)
        if not isinstance(causal, (bool, np.bool_)):
            raise MetadataTypeError(m.path, m.key("attention.causal"), f"expected a bool, got {causal!r:.80}")
        labels = m.md.get(m.key("classifier.output_labels"), [])
        if not isinstance(labels, list) or not all(isinstance(x, str) for x in labels):
            raise MetadataTypeError(m.path, m.key("classifier.output_labels"), "expected an array of strings")
        # llama.cpp's classifier pooling (modern-bert's mean) is not one these architectures build
        cls_pool = m.geti("classifier.pooling_type", 2, lo=0, hi=len(POOLING) - 1)
        if POOLING[cls_pool] != "cls":
            raise MetadataError(m.path, m.key("classifier.pooling_type"),
                                f"{POOLING[cls_pool]} is not supported for {m.arch} (the head reads the first row)")
        moe = {}
        n_expert = m.geti("expert_count", 0, lo=0, hi=_MAX_EXPERTS)
        if m.arch == "nomic-bert-moe":
            every = m.geti("moe_every_n_layers", 0, lo=0, hi=1 << 12)
            if every and not n_expert:
                raise MetadataError(m.path, m.key("expert_count"), f"is {'0' if 'expert_count' in m else 'missing'}"
                                                                   f", but moe_every_n_layers = {every}")
            if every:
                used = meta_int(m.md, m.key("expert_used_count"), lo=1, hi=n_expert, per_layer=True, path=m.path)
                moe = dict(n_expert=n_expert, n_expert_used=used, moe_every=every)
        elif n_expert:
            raise MetadataError(m.path, m.key("expert_count"), f"{n_expert}: a {m.arch} model has no experts "
                                                               "(nomic-bert-moe does)")
        return dict(d, pooling=pooling, causal=bool(causal), cls_labels=tuple(labels), **moe)

    def is_moe(self, layer: int) -> bool:
        """Whether layer ``layer``'s feed-forward is the mixture of experts (llama.cpp's rule)."""
        return self.moe_every > 0 and layer % self.moe_every == 1


@register(*BertConfig.ROPE_TYPES)
class BertModel(DecoderModel):
    """A bert-family encoder: weights on their devices and the graph (see the module docstring).

    Attributes
    ----------
    causal : bool
        False: attention over the whole input (the file's ``attention.causal``).
    can_generate : bool
        False: no language-model head.
    pooling : str
        The file's pooling type, one of :data:`POOLING`.
    n_cls_out : int
        Scores the classification head gives per input (``cls.output``'s rows; 0: no head, not a reranker).
    """

    config_class = BertConfig
    config: BertConfig
    can_generate = False
    NODES_PER_LAYER: ClassVar[int] = 48

    @property
    def causal(self) -> bool:
        return self.config.causal

    @property
    def pooling(self) -> str:
        return self.config.pooling

    @classmethod
    def read_config(cls, reader, path: str = "") -> BertConfig:
        """As :meth:`DecoderModel.read_config`, and: the classifier's labels against ``cls.output``'s rows,
        the experts against layer 1's router."""
        cfg = super().read_config(reader, path)
        a = cfg.arch
        if cfg.cls_labels and "cls.output.weight" in reader:
            ne = reader.tensor_info("cls.output.weight").ne
            if (ne[1] if len(ne) > 1 else 1) != len(cfg.cls_labels):
                raise MetadataError(path, f"{a}.classifier.output_labels", f"{len(cfg.cls_labels)} labels, but "
                                                                           f"cls.output.weight has ne={tuple(ne)}")
        if cfg.n_expert and cfg.n_layer > 1 and "blk.1.ffn_gate_inp.weight" in reader:
            ne = reader.tensor_info("blk.1.ffn_gate_inp.weight").ne
            if len(ne) == 2 and ne[1] != cfg.n_expert:
                raise MetadataError(path, f"{a}.expert_count", f"{cfg.n_expert}, but blk.1.ffn_gate_inp.weight has "
                                                               f"ne={tuple(ne)}")
        return cfg

    def _inspect(self, reader) -> None:
        super()._inspect(reader)
        self._has = {t.name for t in reader.tensors}
        self.tied_output = False           # no language-model head to tie (DecoderModel would copy one)
        out = reader.tensor_info("cls.output.weight") if "cls.output.weight" in reader else None
        # a single score's head is ne = (n_embd,) in the file (GGUF drops trailing 1s)
        self.n_cls_out = 0 if out is None else int(out.ne[1]) if len(out.ne) > 1 else 1
        if "cls.weight" in reader and not self.n_cls_out:
            # llama.cpp's head without cls.output (jina-reranker-v1) gives the dense layer's n_embd values;
            # no bert/nomic converter writes one
            raise MetadataError(self.path, "cls.output.weight", "missing: the file has a classifier's dense layer "
                                                                "(cls.weight) but no output layer")

    def _optional(self, name: str, ne: tuple, group, types=(Type.F32,), op=None):
        return [(name, ne, group, types, op)] if name in self._has else []

    def _expected(self):
        c = self.config
        e = c.n_embd
        yield "token_embd.weight", (e, c.n_vocab), "input", None, None
        if "token_types.weight" in self._has:
            n_types = self._reader.tensor_info("token_types.weight").ne
            yield "token_types.weight", (e, n_types[1] if len(n_types) > 1 else 1), "input", (Type.F32,), None
        if c.arch == "bert":
            yield "position_embd.weight", (e, c.n_ctx_train), "input", None, None
        yield "token_embd_norm.weight", (e,), "input", (Type.F32,), None
        yield "token_embd_norm.bias", (e,), "input", (Type.F32,), None
        if self.n_cls_out:
            yield from self._optional("cls.weight", (e, e), "output", None, "mul_mat")
            yield from self._optional("cls.bias", (e,), "output")
            yield "cls.output.weight", (e, self.n_cls_out), "output", None, "mul_mat"
            yield from self._optional("cls.output.bias", (self.n_cls_out,), "output")
        for i in range(c.n_layer):
            p = f"blk.{i}."
            if p + "attn_qkv.weight" in self._has:
                # nomic's Wqkv, as the file has it
                n_qkv = (c.n_head + 2 * c.n_head_kv) * c.head_dim
                yield p + "attn_qkv.weight", (e, n_qkv), i, None, "mul_mat"
                yield from self._optional(p + "attn_qkv.bias", (n_qkv,), i)
                yield p + "attn_output.weight", (c.n_head * c.head_dim, e), i, None, "mul_mat"
                yield from self._optional(p + "attn_output.bias", (e,), i)
            else:
                yield from self._expected_attention(i, bias=p + "attn_q.bias" in self._has,
                                                    out_bias=p + "attn_output.bias" in self._has)
            for norm in ("attn_output_norm", "layer_output_norm"):
                yield self._expected_norm(i, norm)
                yield p + f"{norm}.bias", (e,), i, (Type.F32,), None
            if c.is_moe(i):
                yield p + "ffn_gate_inp.weight", (e, c.n_expert), i, None, "mul_mat"
                yield p + "ffn_up_exps.weight", (e, c.n_ff, c.n_expert), i, None, "mul_mat_id"
                yield p + "ffn_down_exps.weight", (c.n_ff, e, c.n_expert), i, None, "mul_mat_id"
                continue
            if c.arch == "nomic-bert":
                yield p + "ffn_gate.weight", (e, c.n_ff), i, None, "mul_mat"
            yield p + "ffn_up.weight", (e, c.n_ff), i, None, "mul_mat"
            yield from self._optional(p + "ffn_up.bias", (c.n_ff,), i)
            yield p + "ffn_down.weight", (c.n_ff, e), i, None, "mul_mat"
            yield from self._optional(p + "ffn_down.bias", (e,), i)

    def graph_size(self) -> int:
        c = self.config
        return super().graph_size() + (c.n_layer * (32 + 2 * c.n_expert_used) if c.n_expert else 0)

    def new_cache(self, type_k=Type.F16, type_v=Type.F16, *, flash_attn: bool = True) -> Encoder:
        """An :class:`~ggmlpy.kvcache.Encoder`: nothing stored (``type_k``/``type_v`` have nothing to apply
        to), positions bounded by ``position_embd``'s rows for ``bert``."""
        c = self.config
        return Encoder(c.n_layer, n_pos=c.n_ctx_train if c.arch == "bert" else None, causal=c.causal)

    # ------------------------------------------------------------------ graph

    def _norm(self, ctx: Context, x: Tensor, name: str) -> Tensor:
        w = self.weights
        return blocks.norm(ctx, x, w[name + ".weight"], w[name + ".bias"], self.config.rms_eps)

    def _linear(self, ctx: Context, name: str, x: Tensor) -> Tensor:
        w = self.weights
        y = blocks.linear(ctx, w[name + ".weight"], x)
        return ctx.add(y, w[name + ".bias"]) if name + ".bias" in w else y

    def _attention(self, ctx: Context, memory, il: int, q: Tensor, k: Tensor, v: Tensor, flash_attn: bool) -> Tensor:
        """Attention of ``q`` over this batch's ``k``/``v`` (the cache's mask: each row its own sequence).

        On a CPU layer with flash attention, ggmlpy's prompt kernel reads K and V where they are, in float32
        (:meth:`~ggmlpy.Context.attn_prefill`; it skips the blocks the mask hides, i.e. other sequences);
        where that kernel is not vectorised (no AVX-512, odd head sizes) ``mul_mat`` + ``soft_max_ext`` in
        float32, as without flash attention: ggml's CPU ``flash_attn_ext`` wants K and V in float16, and
        rounding them put a tiny reranker's scores 1e-3 from transformers' (llama.cpp's own embeddings
        were closer). Elsewhere (the own kernel switched off or measured slower, a layer on another
        device) ggml's ``flash_attn_ext`` on K and V rounded to F16, as llama.cpp's.
        """
        hd, nh, n = q.ne[0], q.ne[1], q.ne[2]
        scale = 1.0 / math.sqrt(hd)
        memory.set_layer(il).put(k, v)
        kk, vv, mask = memory.get()                                           # (hd, n, nh_kv), F16 (n, n)
        if flash_attn and self.on_cpu(il) and not _own_prefill_ok(hd):
            flash_attn = False                                                # float32, not K/V in F16
        if flash_attn:
            if self.on_cpu(il) and blocks.prefill_kernel and kernels.use(kernels.attn_site("attn_prefill", kk, vv, nh)):
                return ctx.reshape(ctx.attn_prefill(q, kk, vv, mask, scale=scale), (hd * nh, n))
            o = ctx.flash_attn_ext(ctx.permute(q, 0, 2, 1, 3), ctx.cast(kk, Type.F16), ctx.cast(vv, Type.F16), mask,
                                   scale=scale)                              # (hd, nh, n)
            return ctx.reshape(o, (hd * nh, n))
        kq = ctx.mul_mat(kk, ctx.permute(q, 0, 2, 1, 3))                     # (n_kv, n, nh)
        kq = ctx.soft_max_ext(kq, mask, scale=scale)
        o = ctx.mul_mat(ctx.cont(ctx.permute(vv, 1, 0, 2, 3)), kq)           # (hd, n, nh)
        return ctx.cont(ctx.permute(o, 0, 2, 1, 3), (hd * nh, n))

    def _ffn(self, ctx: Context, il: int, cur: Tensor) -> Tensor:
        c, p = self.config, f"blk.{il}."
        if c.is_moe(il):
            return blocks.moe_ffn(ctx, self.weights, p, cur, n_expert_used=c.n_expert_used, norm_weights=False,
                                  act="gelu_erf")
        if c.arch == "nomic-bert":
            return blocks.ffn_glu(ctx, self.weights, p, cur)
        return self._linear(ctx, p + "ffn_down", ctx.gelu_erf(self._linear(ctx, p + "ffn_up", cur)))

    def _forward(self, ctx: Context, tokens: Tensor, pos: Tensor, memory, out_ids: Tensor, *, flash_attn: bool,
                 embeddings) -> Tensor:
        """The encoder (see the module docstring): the rows ``out_ids``' last hidden states, or with
        ``embeddings="rank"`` their classification scores ``ne = (n_cls_out, n_out)``."""
        c, w = self.config, self.weights
        if not embeddings:
            raise GGMLValueError(f"build: {c.arch} is an encoder (embeddings and reranking): it has no output head "
                                 "to give logits; build with embeddings=True")
        if embeddings == "rank" and not self.n_cls_out:
            raise GGMLValueError(f"build: this {c.arch} model has no classification head (cls.output): it cannot "
                                 "rank")
        x = ctx.get_rows(w["token_embd.weight"], tokens)
        if "token_types.weight" in w:
            types = w["token_types.weight"]
            x = ctx.add(x, ctx.view_1d(types, c.n_embd, 0))                 # every token is of type 0
        if "position_embd.weight" in w:
            x = ctx.add(ctx.get_rows(w["position_embd.weight"], pos), x)
        x = self._norm(ctx, x, "token_embd_norm")
        for il in range(c.n_layer):
            p = f"blk.{il}."
            q, k, v = blocks.qkv(ctx, w, p, x, c.n_head, c.n_head_kv, c.head_dim)
            if c.rope:
                q, k = self.rope(ctx, q, pos, il), self.rope(ctx, k, pos, il)
            o = self._linear(ctx, p + "attn_output", self._attention(ctx, memory, il, q, k, v, flash_attn))
            if il == c.n_layer - 1:
                # only the rows that produce output go further
                o, x = ctx.get_rows(o, out_ids), ctx.get_rows(x, out_ids)
            cur = self._norm(ctx, ctx.add(o, x), p + "attn_output_norm")
            x = self._norm(ctx, ctx.add(self._ffn(ctx, il, cur), cur), p + "layer_output_norm")
        if embeddings == "rank":
            if "cls.weight" in w:
                x = ctx.tanh(self._linear(ctx, "cls", x))
            x = self._linear(ctx, "cls.output", x)
        return x


def _own_prefill_ok(head_dim: int) -> bool:
    # ggmlpy's prompt kernel takes f32 K/V; where it is not vectorised (head sizes not multiples of 16,
    # no AVX-512) ggml's kernel is faster
    from ggmlpy import _core

    return _core._attn_prefill_vectorized(head_dim, head_dim)
