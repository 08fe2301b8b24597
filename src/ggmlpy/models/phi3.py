"""Phi-3 from GGUF: phi3 (Phi-3 and Phi-3.5 mini/medium, Phi-4, Phi-4-mini).

The layer is the llama layer (RMSNorm → attention → residual → RMSNorm → SwiGLU → residual) with the
file's own fusions, as llama.cpp's converter writes them from Hugging Face's ``Phi3ForCausalLM``:
Q, K and V are one matrix (``attn_qkv``, rows Q then K then V; separate ``attn_q``/``attn_k``/
``attn_v`` are read too), and ``ffn_up`` holds the gate rows and then the up rows
(``ne = (n_embd, 2 n_ff)``; there is no ``ffn_gate``), which is what
:func:`~ggmlpy.models.blocks.ffn_glu` reads as ``ffn_gate_up``. RoPE is NEOX-style (halves) over the
first ``rope.dimension_count`` values of each head (Phi-4-mini rotates 3/4 of them).

LongRoPE (the 128k models): the file holds two sets of frequency factors, ``rope_factors_short`` and
``rope_factors_long`` (``ne = (rope_dim / 2,)``), that divide RoPE's frequencies, and RoPE's cos and sin are
multiplied by ``rope.scaling.attn_factor`` (the converter writes LongRoPE's
``sqrt(1 + ln(context_length / original_context_length) / ln(original_context_length))`` there, and no
``rope.scaling.type``). Which set applies is llama.cpp's choice (``llama_model::get_rope_factors``): the
long factors when the context per sequence, the runner's ``n_ctx``, exceeds
``rope.scaling.original_context_length``, else the short ones; it is fixed for a cache
(:class:`ContextCache` remembers the size), so every position of every sequence uses the same set.
Hugging Face picks by the length of the sequence instead (long once a forward pass reaches past the
original context), so the two agree when the prompt and the context are on the same side of it.
(llama.cpp sizes ``n_ctx`` in multiples of 256; for the real models, whose original context is a multiple
of 256, the choice is the same.)

A sliding window (``attention.sliding_window > 0``, Phi-3-mini-4k's 2047) applies to every layer, as
Hugging Face's ``Phi3ForCausalLM`` applies it. llama.cpp reads the key but has ignored it since 2025
(ggml-org/llama.cpp#13676: the configs do not say which layers use it); the converter writes 0 for
Phi-4, which has none.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Optional

from ggmlpy._core import Context, RopeType, Tensor, Type
from ggmlpy.kvcache import Causal
from ggmlpy.weights import MetaReader

from . import blocks
from .base import register
from .config import DecoderConfig
from .decoder import PreNormDecoder

__all__ = ["ContextCache", "Phi3Config", "Phi3Model"]


@dataclass(frozen=True)
class Phi3Config(DecoderConfig):
    """Hyperparameters of phi3 files (see :class:`~ggmlpy.models.config.DecoderConfig`).

    ``rope_attn_factor`` is ``rope.scaling.attn_factor`` whatever the scaling type (llama.cpp multiplies
    RoPE by it for every type; phi3 files carry LongRoPE's attention factor there). ``rope.scaling.type``
    may also be ``longrope``, which changes nothing else: the factors are tensors.
    """

    ROPE_TYPES = {"phi3": RopeType.NEOX}
    ROPE_SCALINGS = ("none", "linear", "yarn", "longrope")

    @classmethod
    def _read(cls, m: MetaReader, n_vocab: Optional[int]) -> dict[str, Any]:
        d = super()._read(m, n_vocab)
        d["rope_attn_factor"] = m.getf("rope.scaling.attn_factor", 1.0, lo=0.0, lo_open=True)
        return d


class ContextCache(Causal):
    """A :class:`~ggmlpy.kvcache.Causal` cache that remembers the context per sequence it was sized for.

    ``n_ctx_seq`` is the ``capacity`` of :meth:`init` (the runner's ``n_ctx``), None before; LongRoPE
    picks its frequency factors by it (see :mod:`ggmlpy.models.phi3`).
    """

    n_ctx_seq: Optional[int] = None

    def init(self, capacity: int, n_seq_max: int, max_batch: int, **kw) -> None:
        super().init(capacity, n_seq_max, max_batch, **kw)
        self.n_ctx_seq = int(capacity)


@register(*Phi3Config.ROPE_TYPES)
class Phi3Model(PreNormDecoder):
    """A phi3 model: weights on their devices plus the graph builder (see the module docstring).

    Attributes
    ----------
    longrope : tuple of str
        The LongRoPE factor tensors the file has (``rope_factors_short.weight``, ``rope_factors_long.weight``).
    """

    config_class = Phi3Config
    config: Phi3Config

    def _inspect(self, reader) -> None:
        super()._inspect(reader)
        self.has_rope_freqs = False        # llama.cpp's phi3 never reads rope_freqs: it is left unused, an error
        self.qkv_in_file = "blk.0.attn_qkv.weight" in reader
        self.longrope = tuple(n for n in ("rope_factors_short.weight", "rope_factors_long.weight") if n in reader)

    def _expected(self):
        c = self.config
        n_q, n_kv = c.n_head * c.head_dim, c.n_head_kv * c.head_dim
        yield from self._expected_io()
        for name in self.longrope:
            yield name, (c.rope_dim // 2,), "input", (Type.F32,), None
        for i in range(c.n_layer):
            p = f"blk.{i}."
            yield self._expected_norm(i, "attn_norm")
            if self.qkv_in_file:
                yield p + "attn_qkv.weight", (c.n_embd, n_q + 2 * n_kv), i, None, "mul_mat"
                yield p + "attn_output.weight", (n_q, c.n_embd), i, None, "mul_mat"
            else:
                yield from self._expected_attention(i)
            yield self._expected_norm(i, "ffn_norm")
            yield p + "ffn_up.weight", (c.n_embd, 2 * c.n_ff), i, None, "mul_mat"      # gate rows, then up rows
            yield p + "ffn_down.weight", (c.n_ff, c.n_embd), i, None, "mul_mat"

    # ------------------------------------------------------------------ RoPE

    def rope_factors(self, cache, layer: int) -> Optional[Tensor]:
        """The LongRoPE factors for ``cache``: long when its context per sequence (:attr:`ContextCache.n_ctx_seq`)
        exceeds ``rope.scaling.original_context_length``, else short (short too for a cache that does not
        say); None when the file has not that set. The copy on ``layer``'s device where it has one."""
        n_ctx = getattr(cache, "n_ctx_seq", None)
        name = ("rope_factors_long.weight" if n_ctx is not None and n_ctx > self.config.n_ctx_orig
                else "rope_factors_short.weight")
        return self.layer_weight(name, layer) if name in self.longrope else None

    def new_cache(self, type_k=Type.F16, type_v=Type.F16, *, flash_attn: bool = True) -> ContextCache:
        """A :class:`ContextCache` over every layer, with the model's sliding window (see
        :meth:`DecoderModel.new_cache`).

        Its key shift rotates the keys by the position delta with the factors of that cache's context, as a
        pure rotation (:func:`~ggmlpy.models.blocks.rope_shift`: the attention factor is not applied again;
        llama.cpp's shift applies it again).
        """
        c = self.config
        window = c.sliding_window - 1 if c.sliding_window else None   # the cache's window excludes the token
        cache = ContextCache(c.n_layer, c.head_dim * c.n_head_kv, c.head_dim * c.n_head_kv, type_k, dtype_v=type_v,
                             window=window, padding=256 if flash_attn else 32, n_head_kv=c.n_head_kv,
                             v_trans=not flash_attn)
        ref = weakref.ref(cache)        # the cache holds its shift function: no reference cycle
        cache.shift_fn = lambda ctx, layer, k, offsets: blocks.rope_shift(ctx, k, offsets, c,
                                                                          self.rope_factors(ref(), layer))
        return cache

    # ------------------------------------------------------------------ graph

    def _qk(self, ctx: Context, layer: int, q: Tensor, k: Tensor, pos: Tensor, memory) -> tuple[Tensor, Tensor]:
        factors = self.rope_factors(getattr(memory, "cache", None), layer)
        return blocks.rope(ctx, q, pos, self.config, factors), blocks.rope(ctx, k, pos, self.config, factors)

    def _ffn(self, ctx: Context, prefix: str, cur: Tensor) -> Tensor:
        # the file's ffn_up is the gate and up rows in one matrix: ffn_glu's fused ffn_gate_up
        w = self.weights
        ffn = {prefix + "ffn_gate_up.weight": w[prefix + "ffn_up.weight"],
               prefix + "ffn_down.weight": w[prefix + "ffn_down.weight"]}
        return blocks.ffn_glu(ctx, ffn, prefix, cur)
