"""Llama 4 (text) from GGUF: ``general.architecture = "llama4"``, as llama.cpp's ``llama4`` graph builds the
files its converter writes from Hugging Face's ``Llama4ForCausalLM`` (or the text part of
``Llama4ForConditionalGeneration``).

A pre-norm decoder built of :mod:`~ggmlpy.models.blocks`:

* RMSNorm (``attn_norm``) → attention → residual → RMSNorm (``ffn_norm``) → feed-forward → residual; the
  output norm and head at the end;
* **RoPE and NoPE layers**: layer ``il`` rotates Q and K ("normal" RoPE, adjacent pairs, with
  ``rope_freqs.weight`` where the file has it: Llama 3 scaling) unless ``(il + 1) % 4 == 0`` (llama.cpp's
  ``n_no_rope_layer_step``, transformers' ``no_rope_layer_interval``; no key holds it). A RoPE layer
  then L2-normalises each head of Q and K (``rms_norm`` without weight, ``rms_eps``) when the model has
  ``use_qk_norm``: llama.cpp decides that by the expert count (every file but 128 experts, Maverick, whose
  HF config says false); a NoPE layer instead scales Q by the **attention temperature**
  ``log(floor((p + 1) / floor_scale) + 1) * attn_scale + 1`` at position ``p`` (computed in the graph from
  the positions);
* **chunked attention** on the local layers (``attention.sliding_window_pattern``, default period 4: three
  local, one global, the global ones the NoPE ones): a token at position ``p`` sees only its own chunk of
  positions, ``[p - p % chunk, p]`` (:class:`~ggmlpy.kvcache.Causal`'s ``chunk``);
* **the feed-forward** is dense (SwiGLU, ``feed_forward_length`` wide) except in every
  ``interleave_moe_layer_step``-th layer, ``(il + 1) % step == 0``, which has ``expert_count`` experts
  (``expert_feed_forward_length`` wide), ``expert_used_count`` per token chosen by the largest router
  logits (``ffn_gate_inp``) and weighted by their sigmoid, the weight scaling each chosen expert's
  *input* (llama.cpp's ``weight_before_ffn``, transformers' ``routed_in``), plus a shared expert
  (``ffn_{gate,up,down}_shexp``, as wide as one expert) on the same normed input.

The converter writes no key for the chunk size, the temperature's floor scale and scale: llama.cpp fixes
them at 8192, 8192 and 0.1 (the released models' values). This module reads them from
``attention.sliding_window``, ``attention.temperature_length`` and ``attention.temperature_scale`` when a
file has them and takes llama.cpp's values otherwise; a file with those keys (the tests' small chunks)
is therefore read differently by llama.cpp, which ignores them. ``attention.sliding_window = 0`` (the
converter's mark of a model without chunked layers, MobileLLM-R1) is refused: llama.cpp's graph for it
reads a temperature scale of 0 and asserts; so is a ``rope.freq_base_swa`` other than ``rope.freq_base``
(llama.cpp would rotate the chunked layers with it; the converter never writes it).

The cache is a :class:`~ggmlpy.kvcache.Wrapper` of a chunked :class:`~ggmlpy.kvcache.Causal` (the local
layers) and a full one (the global layers); the chunked one masks earlier chunks and keeps only the last
``chunk`` positions of each sequence (sized as a sliding-window cache of that memory).
A context shift re-rotates the keys of RoPE layers (their L2 norm is unchanged by a rotation) and leaves
the NoPE layers' keys as they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from ggmlpy._core import Context, RopeType, Tensor, Type
from ggmlpy.gguf import MetadataError, meta_int
from ggmlpy.kvcache import Causal, Wrapper
from ggmlpy.weights import MetaReader

from . import blocks
from .base import register
from .config import _MAX_CTX, _MAX_EMBD, DecoderConfig, read_routing
from .decoder import DecoderModel
from .gemma import GemmaConfig

__all__ = ["Llama4Config", "Llama4Model"]

_MAX_EXPERTS = 1 << 12          # llama.cpp allows 1024 (LLAMA_MAX_EXPERTS)
_NO_ROPE_STEP = 4               # llama.cpp's n_no_rope_layer_step; no key holds it
#: llama.cpp's fixed values where a file has no key (``load_arch_hparams`` of llama4)
_CHUNK, _TEMP_FLOOR, _TEMP_SCALE = 8192, 8192, 0.1

#: Expert keys and the values that mean the routing built here (sigmoid weights, one shared expert or
#: the key absent); the first value is the default when absent.
_EXPERT_KEYS_BUILT = {
    "expert_gating_func": (0, 2),                      # none (the architecture's own: sigmoid), sigmoid
    "expert_group_count": (0, 1),
    "expert_shared_count": (0, 1),
}


@dataclass(frozen=True)
class Llama4Config(DecoderConfig):
    """Hyperparameters of Llama 4 files (see :class:`~ggmlpy.models.config.DecoderConfig` and the module
    docstring).

    Attributes
    ----------
    n_expert, n_expert_used, n_ff_exp : int
        Experts, experts per token, each expert's (and the shared expert's) hidden size.
    moe_layers : tuple of bool
        Per layer: the feed-forward is the mixture of experts (``interleave_moe_layer_step``).
    rope_layers : tuple of bool
        Per layer: RoPE (and the Q/K L2 norm); the others are NoPE with the attention temperature.
    chunk_layers : tuple of bool
        Per layer: chunked attention (``attention.sliding_window_pattern``).
    chunk : int
        Chunk size (``attention.sliding_window``, else 8192).
    temp_floor, temp_scale : int, float
        The attention temperature's floor scale and scale.
    qk_norm : bool
        RoPE layers L2-normalise Q and K (``expert_count != 128``, as llama.cpp).
    """

    ROPE_TYPES = {"llama4": RopeType.NORMAL}
    READS_EXPERTS = True

    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    moe_layers: tuple = ()
    rope_layers: tuple = ()
    chunk_layers: tuple = ()
    chunk: int = _CHUNK
    temp_floor: int = _TEMP_FLOOR
    temp_scale: float = _TEMP_SCALE
    qk_norm: bool = True

    @classmethod
    def _read(cls, m: MetaReader, n_vocab: Optional[int]) -> dict[str, Any]:
        path = m.path
        if m.md.get(m.key("attention.sliding_window"), None) == 0:
            raise MetadataError(path, m.key("attention.sliding_window"),
                                "0 (no chunked layers) is not supported for llama4 (llama.cpp's graph for it "
                                "has no attention temperature)")
        d = super()._read(m, n_vocab)
        chunk = d.pop("sliding_window") or _CHUNK
        d["sliding_window"] = None
        n_layer = d["n_layer"]
        n_expert = m.geti("expert_count", lo=1, hi=_MAX_EXPERTS)
        n_used = meta_int(m.md, m.key("expert_used_count"), lo=1, hi=n_expert, per_layer=True, path=path)
        n_ff_exp = meta_int(m.md, m.key("expert_feed_forward_length"), lo=1, hi=_MAX_EMBD * 8, per_layer=True,
                            path=path)
        step = m.geti("interleave_moe_layer_step", lo=0, hi=1 << 16)
        if read_routing(m, "llama4", _EXPERT_KEYS_BUILT, norm_default=False):
            raise MetadataError(path, m.key("expert_weights_norm"), "true is not supported for llama4 (each "
                                                                    "expert's sigmoid weight is used as it is)")
        if "rope.freq_base_swa" in m and m.getf("rope.freq_base_swa") != d["rope_base"]:
            # llama.cpp would rotate the chunked layers with it; the converter never writes it for llama4
            raise MetadataError(path, m.key("rope.freq_base_swa"), "a local RoPE base other than rope.freq_base is "
                                                                   "not supported for llama4")
        d.update(n_expert=n_expert, n_expert_used=n_used, n_ff_exp=n_ff_exp,
                 moe_layers=tuple(step > 0 and (il + 1) % step == 0 for il in range(n_layer)),
                 rope_layers=tuple((il + 1) % _NO_ROPE_STEP != 0 for il in range(n_layer)),
                 chunk_layers=GemmaConfig._swa_pattern(m, n_layer, _NO_ROPE_STEP),
                 chunk=min(chunk, _MAX_CTX),
                 temp_floor=m.geti("attention.temperature_length", _TEMP_FLOOR, lo=1, hi=1 << 30),
                 temp_scale=m.getf("attention.temperature_scale", _TEMP_SCALE, lo=0.0, lo_open=True),
                 qk_norm=n_expert != 128)
        return d

    def _problems(self) -> list[str]:
        bad = super()._problems()
        a = self.arch
        if not 1 <= self.n_expert_used <= self.n_expert:
            bad.append(f"{a}.expert_used_count {self.n_expert_used} must be in [1, expert_count {self.n_expert}]")
        if len(self.chunk_layers) != self.n_layer:
            bad.append(f"{a}.attention.sliding_window_pattern gives {len(self.chunk_layers)} layers, "
                       f"block_count {self.n_layer}")
        if self.head_dim != self.rope_dim:
            bad.append(f"{a}.rope.dimension_count {self.rope_dim} must be the head size {self.head_dim} (llama.cpp)")
        return bad


@register(*Llama4Config.ROPE_TYPES)
class Llama4Model(DecoderModel):
    """A Llama 4 text model (see the module docstring and :class:`~ggmlpy.models.decoder.DecoderModel`)."""

    config_class = Llama4Config
    config: Llama4Config
    EMBD_INPUT = True
    #: the temperature, Q/K norms and the shared expert add to the llama layer's nodes
    NODES_PER_LAYER = 96

    def _expected(self):
        c = self.config
        yield from self._expected_io()
        for i in range(c.n_layer):
            p = f"blk.{i}."
            yield self._expected_norm(i, "attn_norm")
            yield from self._expected_attention(i)
            yield self._expected_norm(i, "ffn_norm")
            if not c.moe_layers[i]:
                yield from self._expected_ffn(i)
                continue
            # the router stays a plain matrix product; the experts are read by mul_mat_id
            yield p + "ffn_gate_inp.weight", (c.n_embd, c.n_expert), i, None, "mul_mat"
            for name, rows, cols in (("gate", c.n_embd, c.n_ff_exp), ("up", c.n_embd, c.n_ff_exp),
                                     ("down", c.n_ff_exp, c.n_embd)):
                yield f"{p}ffn_{name}_exps.weight", (rows, cols, c.n_expert), i, None, "mul_mat_id"
            for name, rows, cols in (("gate", c.n_embd, c.n_ff_exp), ("up", c.n_embd, c.n_ff_exp),
                                     ("down", c.n_ff_exp, c.n_embd)):
                yield f"{p}ffn_{name}_shexp.weight", (rows, cols), i, None, "mul_mat"

    def graph_size(self) -> int:
        # the sum over the experts adds one view and add per expert used
        return super().graph_size() + self.config.n_layer * 2 * self.config.n_expert_used

    def rope(self, ctx: Context, x: Tensor, pos: Tensor, layer: int) -> Tensor:
        """RoPE of ``x`` at ``pos`` (a NoPE layer's ``x`` as it is)."""
        if not self.config.rope_layers[layer]:
            return x
        return super().rope(ctx, x, pos, layer)

    def shift_fn(self, ctx: Context, layer: int, k: Tensor, offsets: Tensor) -> Tensor:
        """The cache's key shift: a RoPE layer's keys rotated by the delta, a NoPE layer's unchanged."""
        if not self.config.rope_layers[layer]:
            return ctx.cont(k)
        return super().shift_fn(ctx, layer, k, offsets)

    def new_cache(self, type_k=Type.F16, type_v=Type.F16, *, flash_attn: bool = True):
        """This model's cache, not yet allocated: a chunked Causal for the local layers and a full one for
        the global layers behind a Wrapper (one of them alone when every layer is of one kind)."""
        c = self.config
        kv = c.head_dim * c.n_head_kv
        caches, index = [], {}
        for chunked in (True, False):
            if any(s == chunked for s in c.chunk_layers):
                index[chunked] = len(caches)
                caches.append(Causal(sum(1 for s in c.chunk_layers if s == chunked), kv, kv, type_k, dtype_v=type_v,
                                     chunk=c.chunk if chunked else None, padding=256 if flash_attn else 32,
                                     n_head_kv=c.n_head_kv, shift_fn=self.shift_fn, v_trans=not flash_attn))
        if len(caches) == 1:
            return caches[0]
        return Wrapper(caches, [index[s] for s in c.chunk_layers])

    def _temperature(self, ctx: Context, pos: Tensor) -> Tensor:
        """The NoPE layers' scale of Q per position, ``ne = (1, 1, n)``: llama.cpp's ``inp_attn_scale``."""
        c = self.config
        p = ctx.cast(pos, Type.F32)
        t = ctx.floor(ctx.scale_bias(p, 1.0 / c.temp_floor, 1.0 / c.temp_floor))        # floor((p + 1) / floor)
        t = ctx.scale_bias(ctx.log(ctx.scale_bias(t, 1.0, 1.0)), c.temp_scale, 1.0)
        return ctx.reshape(t, (1, 1, pos.ne[0]))

    def _forward(self, ctx: Context, tokens: Tensor, pos: Tensor, memory, out_ids: Tensor, *, flash_attn: bool,
                 embeddings: bool, embd: Optional[tuple] = None) -> Tensor:
        c, w, eps = self.config, self.weights, self.config.rms_eps
        scale = 1.0 / math.sqrt(c.head_dim)
        x = self.embed_tokens(ctx, tokens, embd)
        temp = self._temperature(ctx, pos) if not all(c.rope_layers) else None
        for il in range(c.n_layer):
            p = f"blk.{il}."
            cur = blocks.rms_norm(ctx, x, w[p + "attn_norm.weight"], eps)
            q, k, v = blocks.qkv(ctx, w, p, cur, c.n_head, c.n_head_kv, c.head_dim)
            if c.rope_layers[il]:
                q, k = self.rope(ctx, q, pos, il), self.rope(ctx, k, pos, il)
                if c.qk_norm:
                    # transformers' Llama4TextL2Norm: each head scaled to unit RMS, no weight
                    q, k = ctx.rms_norm(q, eps), ctx.rms_norm(k, eps)
            else:
                q = ctx.mul(q, temp)
            o = blocks.attention(ctx, memory, il, q, k, v, scale=scale, flash_attn=flash_attn,
                                 on_cpu=self.on_cpu(il))
            o = blocks.linear(ctx, w[p + "attn_output.weight"], o)
            if il == c.n_layer - 1:
                # only the rows that produce output go further
                o, x = ctx.get_rows(o, out_ids), ctx.get_rows(x, out_ids)
            x = ctx.add(x, o)
            cur = blocks.rms_norm(ctx, x, w[p + "ffn_norm.weight"], eps)
            if c.moe_layers[il]:
                f = ctx.add(blocks.moe_ffn(ctx, w, p, cur, n_expert_used=c.n_expert_used, norm_weights=False,
                                           gating="sigmoid", weight_before=True),
                            blocks.ffn_glu(ctx, w, p, cur, suffix="_shexp"))
            else:
                f = blocks.ffn_glu(ctx, w, p, cur, on_cpu=self.on_cpu(il))
            x = ctx.add(x, f)
        return blocks.output(ctx, w, x, eps, embeddings=embeddings)
