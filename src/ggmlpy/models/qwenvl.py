"""The text models of Qwen2.5-VL (``qwen2vl``) and Qwen3-VL (``qwen3vl``) from GGUF: M-RoPE and deepstack.

Both are their text family's layer (``qwen2vl``: qwen2's, Q/K/V biases; ``qwen3vl``: qwen3's, per-head Q/K
norms) with multi-section rotary positions, as transformers computes them and llama.cpp's converter writes
them (``rope.dimension_sections``):

- each token has four positions (time, height, width and a fourth, ggml's ``e``); a text token has its
  position in all four, an image token at merged-grid cell ``(row, col)`` of an image whose first token is at
  ``t`` has ``(t, t + row, t + col, t)``, and an image takes ``max(rows, cols)`` positions, not one per
  token: the tokens after it continue from there (transformers' ``get_rope_index``; the runner computes them,
  :mod:`ggmlpy.runner.mrope`);
- the head's frequency pairs are split between the positions by the sections: ``qwen2vl`` contiguously
  (ggml's MROPE: time, height, width, in that order), ``qwen3vl`` interleaved (IMROPE: pair ``i`` height when
  ``i % 3 == 1``, width when ``i % 3 == 2``, within three times their sections; time otherwise). Pairs past
  the sections take the fourth position, which is the time position here, as transformers rotates them
  (llama.cpp's mtmd gives image tokens 0 there: a small difference for Qwen3-VL's last pairs).

The K/V cache cannot shift these positions (the keys hold four rotations): a context shift clears the
sequence and computes what it keeps again, as for a recurrent model.

Qwen3-VL's deepstack: an image token's embedding row carries ``1 + n_deepstack_layers`` slices of ``n_embd``
(the encoder's merger and deepstack mergers); the first enters as the token's embedding, slice ``k`` is added
to the token's hidden state after layer ``k - 1``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from ggmlpy._core import Context, RopeType, Tensor
from ggmlpy.gguf import MetadataError
from ggmlpy.weights import MetaReader

from .base import register
from .llama import LlamaConfig, LlamaModel
from .qwen3 import Qwen3Config, Qwen3Model

__all__ = ["Qwen2VLConfig", "Qwen2VLModel", "Qwen3VLConfig", "Qwen3VLModel"]


def _read_sections(m: MetaReader, rope_dim: int) -> tuple:
    key = m.key("rope.dimension_sections")
    v = m.md.get(key)
    if v is None:
        raise MetadataError(m.path, key, "missing: a multi-section RoPE model needs its sections")
    try:
        sec = tuple(int(x) for x in v)
    except (TypeError, ValueError):
        raise MetadataError(m.path, key, f"{v!r:.80}: expected 4 integers") from None
    if len(sec) != 4 or min(sec) < 0 or not 0 < sum(sec) <= rope_dim // 2 or not any(sec[:3]):
        raise MetadataError(m.path, key, f"{sec}: expected 4 integers >= 0, one of the first three > 0, summing to "
                                         f"at most {rope_dim // 2} (half the rotated dimensions)")
    return sec


class _MRope:
    """The M-RoPE part of both models: four positions a token, a rotation by sections, no shift."""

    #: positions per token in the graph's ``inp_pos`` (time, height, width, the fourth)
    POS_PER_TOKEN: ClassVar[int] = 4
    #: the keys hold four rotations: the cache cannot shift them (a shift clears and recomputes instead)
    shift_fn = None

    def rope(self, ctx: Context, x: Tensor, pos: Tensor, layer: int) -> Tensor:
        c = self.config
        return ctx.rope_multi(x, pos, n_dims=c.rope_dim, sections=list(c.rope_sections), mode=c.rope_mode,
                              n_ctx_orig=c.n_ctx_orig, freq_base=c.rope_base, freq_scale=c.rope_freq_scale,
                              ext_factor=c.rope_ext_factor, attn_factor=c.rope_attn_factor)


@dataclass(frozen=True)
class Qwen2VLConfig(LlamaConfig):
    """Hyperparameters of qwen2vl files: llama's, and ``rope.dimension_sections``."""

    ROPE_TYPES = {"qwen2vl": RopeType.MROPE}
    EXPERTS = {}

    rope_sections: tuple = ()

    @classmethod
    def _read(cls, m: MetaReader, n_vocab: Optional[int]):
        d = super()._read(m, n_vocab)
        return dict(d, rope_sections=_read_sections(m, d["rope_dim"]))


@dataclass(frozen=True)
class Qwen3VLConfig(Qwen3Config):
    """Hyperparameters of qwen3vl files: qwen3's, ``rope.dimension_sections`` and ``n_deepstack_layers``."""

    ROPE_TYPES = {"qwen3vl": RopeType.IMROPE}
    EXPERTS = {}

    rope_sections: tuple = ()
    n_deepstack: int = 0

    @classmethod
    def _read(cls, m: MetaReader, n_vocab: Optional[int]):
        d = super()._read(m, n_vocab)
        # the deepstack slices are added after the first layers, each before the next layer runs (the last
        # layer's rows are cut to the outputs, so it takes none)
        nds = m.geti("n_deepstack_layers", 0, lo=0, hi=max(0, d["n_layer"] - 1))
        return dict(d, rope_sections=_read_sections(m, d["rope_dim"]), n_deepstack=nds)


@register(*Qwen2VLConfig.ROPE_TYPES)
class Qwen2VLModel(_MRope, LlamaModel):
    """Qwen2.5-VL's (and Qwen2-VL's) text model: qwen2 with M-RoPE (see the module docstring)."""

    config_class = Qwen2VLConfig
    config: Qwen2VLConfig


@register(*Qwen3VLConfig.ROPE_TYPES)
class Qwen3VLModel(_MRope, Qwen3Model):
    """Qwen3-VL's text model: qwen3 with interleaved M-RoPE and deepstack (see the module docstring)."""

    config_class = Qwen3VLConfig
    config: Qwen3VLConfig

    @property
    def embd_width(self) -> int:
        """Values of an input embedding row: ``n_embd`` times ``1 + n_deepstack``."""
        return self.config.n_embd * (1 + self.config.n_deepstack)

    def embed_tokens(self, ctx: Context, tokens: Tensor, embd: Optional[tuple] = None,
                     scale: Optional[float] = None) -> Tensor:
        if embd is not None and self.config.n_deepstack:
            vals, rows = embd
            embd = (ctx.view_2d(vals, self.config.n_embd, vals.ne[1], vals.nb[1], 0), rows)
        return super().embed_tokens(ctx, tokens, embd, scale)

    def _layer_out(self, ctx: Context, layer: int, x: Tensor, embd: Optional[tuple]) -> Tensor:
        """After layer ``k - 1``: the image rows' deepstack slice ``k`` added to their hidden states."""
        c = self.config
        if embd is None or layer >= c.n_deepstack:
            return x
        vals, rows = embd
        e = c.n_embd
        ds = ctx.view_2d(vals, e, vals.ne[1], vals.nb[1], (layer + 1) * e * vals.nb[0])
        # (get_rows takes I32 rows, the embedding rows are I64 for set_rows: the slice is scattered over zeros)
        return ctx.add(x, ctx.set_rows(ctx.scale(x, 0.0), ds, rows))
