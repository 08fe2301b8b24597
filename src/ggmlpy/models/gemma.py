"""Gemma 2 and Gemma 3 (text) from GGUF: gemma2, gemma3.

Both are pre-norm decoders built of :mod:`~ggmlpy.models.blocks`, as llama.cpp's ``gemma2``/``gemma3``
graphs build them:

* the token embeddings are scaled by ``sqrt(n_embd)``;
* every layer normalises four times: RMSNorm before attention (``attn_norm``) and after it
  (``post_attention_norm``, before the residual add), before the feed-forward (``ffn_norm``) and after
  it (``post_ffw_norm``). Gemma's RMSNorm multiplies by ``1 + w``; llama.cpp's converter stores
  ``1 + w`` in the file, so the weights are used as they are (plain :func:`~ggmlpy.models.blocks.rms_norm`);
* the feed-forward is GeGLU with the tanh approximation of GELU (``gelu_pytorch_tanh``);
* RoPE is NEOX-style (halves); gemma3 normalises each head of Q and K first (``attn_q_norm``,
  ``attn_k_norm``, ``ne = (head_dim,)``);
* attention scales ``q·k`` by ``1 / sqrt(query_pre_attn_scalar)``. The file has no key for it: as
  llama.cpp, the 27B models (46 layers for gemma2, 62 for gemma3, whose ``query_pre_attn_scalar`` is
  ``n_embd / n_head``) use ``n_embd / n_head``, every other size the head size;
* gemma2 soft-caps the attention logits (``attn_logit_softcapping``, default 50) and both cap the final
  logits (``final_logit_softcapping``: gemma2 default 30, gemma3 only when the file has it):
  ``cap * tanh(x / cap)`` (:func:`~ggmlpy.models.blocks.softcap`).

**Local and global layers.** Layer ``il`` attends through a sliding window of
``attention.sliding_window`` positions (itself included) when it is a local layer. The pattern is
``attention.sliding_window_pattern`` when the file has it (a period ``n``: the first ``n - 1`` layers of
every ``n`` are local; ``0``: all of them; or one bool per layer), else llama.cpp's assumption: ``2``
for gemma2 (even layers local) and ``6`` for gemma3 (five local, then one global); llama.cpp's converter
writes no pattern. A gemma3 file without a window has only global layers. Local layers rotate with
``rope.freq_base_swa`` (gemma3: the HF config's ``rope_local_base_freq``, default 10000, and no RoPE
scaling; gemma2: the global settings), global ones with ``rope.freq_base`` and the file's scaling.

The cache recipe (:class:`~ggmlpy.models.decoder.LocalGlobalDecoder`) follows: a :class:`~ggmlpy.kvcache.Wrapper` of a
sliding-window :class:`~ggmlpy.kvcache.Causal` for the local layers (memory: the window, so long
prompts evict) and a full one for the global layers, each shifting keys with its layers' own RoPE.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ggmlpy._core import Context, RopeType, Tensor
from ggmlpy.gguf import MetadataError, MetadataTypeError
from ggmlpy.weights import MetaReader

from . import blocks
from .base import register
from .config import _MAX_LAYERS, DecoderConfig
from .decoder import LocalGlobalDecoder

__all__ = ["GemmaConfig", "GemmaModel"]

#: Per architecture: (the sliding-window pattern llama.cpp assumes, the layer count of the 27B model,
#: whose attention scale is n_embd / n_head).
_GEMMA = {"gemma2": (2, 46), "gemma3": (6, 62)}


@dataclass(frozen=True)
class GemmaConfig(DecoderConfig):
    """Hyperparameters of gemma2 and gemma3 files (see :class:`~ggmlpy.models.config.DecoderConfig`
    and the module docstring).

    Attributes
    ----------
    swa_layers : tuple of bool
        Per layer: attends through the sliding window (``sliding_window`` positions, itself included).
    rope_base_swa, rope_freq_scale_swa : float
        RoPE base and frequency scale of the local layers.
    attn_scale : float
        Applied to ``q·k`` (``1 / sqrt(query_pre_attn_scalar)``).
    attn_softcap, final_softcap : float
        Soft-cap of the attention logits and of the output logits; 0: none.
    """

    ROPE_TYPES = {"gemma2": RopeType.NEOX, "gemma3": RopeType.NEOX}

    swa_layers: tuple = ()
    rope_base_swa: float = 10000.0
    rope_freq_scale_swa: float = 1.0
    attn_scale: float = 1.0
    attn_softcap: float = 0.0
    final_softcap: float = 0.0

    @classmethod
    def _read(cls, m: MetaReader, n_vocab: Optional[int]) -> dict[str, Any]:
        d = super()._read(m, n_vocab)
        arch, n_layer = m.arch, d["n_layer"]
        # per-layer head sizes and RoPE dimensions (gemma3n, gemma4) are not built here
        for key, full in (("attention.key_length_swa", d["head_dim"]), ("attention.value_length_swa", d["head_dim"]),
                          ("rope.dimension_count_swa", d["rope_dim"])):
            v = m.geti(key, full, lo=1)
            if v != full:
                raise MetadataError(m.path, m.key(key), f"{v} differs from the global layers' {full}; not supported")
        default_pattern, n_layer_27b = _GEMMA[arch]
        window = d["sliding_window"]
        if arch == "gemma2":
            window = m.geti("attention.sliding_window", 4096, lo=1)     # llama.cpp's default: Gemma 2's window
            d["rope_base_swa"] = m.getf("rope.freq_base_swa", d["rope_base"], lo=0.0, lo_open=True)
            d["rope_freq_scale_swa"] = d["rope_freq_scale"]
            d["attn_softcap"] = m.getf("attn_logit_softcapping", 50.0, lo=0.0, lo_open=True)
            d["final_softcap"] = m.getf("final_logit_softcapping", 30.0, lo=0.0, lo_open=True)
        else:
            d["rope_base_swa"] = m.getf("rope.freq_base_swa", 10000.0, lo=0.0, lo_open=True)
            d["final_softcap"] = m.getf("final_logit_softcapping", 0.0, lo=0.0)
        d["sliding_window"] = window
        d["swa_layers"] = cls._swa_pattern(m, n_layer, default_pattern) if window else (False,) * n_layer
        q_dim = d["n_embd"] // d["n_head"] if n_layer == n_layer_27b else d["head_dim"]
        d["attn_scale"] = 1.0 / math.sqrt(q_dim)
        return d

    @staticmethod
    def _swa_pattern(m: MetaReader, n_layer: int, default: int) -> tuple:
        """Which layers are local: ``attention.sliding_window_pattern`` (a period or one bool per layer)."""
        key = "attention.sliding_window_pattern"
        v = m.md.get(m.key(key))
        if isinstance(v, (list, np.ndarray)):
            if len(v) != n_layer:
                raise MetadataError(m.path, m.key(key), f"an array of {len(v)} values for {n_layer} layers")
            if not all(isinstance(x, (bool, np.bool_)) for x in v):
                raise MetadataTypeError(m.path, m.key(key), "expected one bool per layer or an integer period")
            return tuple(bool(x) for x in v)
        n = m.geti(key, default, lo=0, hi=_MAX_LAYERS)
        return tuple(n == 0 or il % n < n - 1 for il in range(n_layer))

    def _problems(self) -> list[str]:
        bad = super()._problems()
        if len(self.swa_layers) != self.n_layer:
            bad.append(f"{self.arch}.attention.sliding_window_pattern gives {len(self.swa_layers)} layers, "
                       f"block_count {self.n_layer}")
        if any(self.swa_layers) and not (self.sliding_window or 0) >= 2:
            # a window of 1 (each token sees only itself) would be a cache window of 0: unlimited
            bad.append(f"{self.arch}.attention.sliding_window {self.sliding_window} must be >= 2 with local layers")
        return bad

    def rope_of(self, layer: int) -> DecoderConfig:
        """The RoPE settings of ``layer``: this config, or for a local layer a copy with the local base and scale."""
        if not self.swa_layers[layer]:
            return self
        return dataclasses.replace(self, rope_base=self.rope_base_swa, rope_freq_scale=self.rope_freq_scale_swa)


@register(*GemmaConfig.ROPE_TYPES)
class GemmaModel(LocalGlobalDecoder):
    """A gemma2 or gemma3 model (see the module docstring and :class:`~ggmlpy.models.decoder.DecoderModel`).

    Attributes
    ----------
    qk_norm : bool
        Q and K are normalised per head before RoPE (gemma3).
    """

    config_class = GemmaConfig
    config: GemmaConfig
    #: four norms, Q/K norms, soft-capping and the scaled embeddings add to the llama layer's nodes
    NODES_PER_LAYER = 96
    EMBD_INPUT = True

    def _inspect(self, reader) -> None:
        super()._inspect(reader)
        self.qk_norm = self.config.arch == "gemma3"

    def _expected(self):
        c = self.config
        yield from self._expected_io()
        for i in range(c.n_layer):
            yield self._expected_norm(i, "attn_norm")
            yield from self._expected_attention(i, qk_norm=(c.head_dim, c.head_dim) if self.qk_norm else None)
            yield self._expected_norm(i, "post_attention_norm")
            yield self._expected_norm(i, "ffn_norm")
            yield from self._expected_ffn(i)
            yield self._expected_norm(i, "post_ffw_norm")

    def _forward(self, ctx: Context, tokens: Tensor, pos: Tensor, memory, out_ids: Tensor, *, flash_attn: bool,
                 embeddings: bool, embd: Optional[tuple] = None) -> Tensor:
        c, w, eps = self.config, self.weights, self.config.rms_eps
        x = self.embed_tokens(ctx, tokens, embd, scale=math.sqrt(c.n_embd))
        for il in range(c.n_layer):
            p = f"blk.{il}."
            cur = blocks.rms_norm(ctx, x, w[p + "attn_norm.weight"], eps)
            q, k, v = blocks.qkv(ctx, w, p, cur, c.n_head, c.n_head_kv, c.head_dim)
            if self.qk_norm:
                q = blocks.rms_norm(ctx, q, w[p + "attn_q_norm.weight"], eps)
                k = blocks.rms_norm(ctx, k, w[p + "attn_k_norm.weight"], eps)
            q, k = self.rope(ctx, q, pos, il), self.rope(ctx, k, pos, il)
            o = blocks.attention(ctx, memory, il, q, k, v, scale=c.attn_scale, flash_attn=flash_attn,
                                 on_cpu=self.on_cpu(il), logit_softcap=c.attn_softcap)
            o = blocks.linear(ctx, w[p + "attn_output.weight"], o)
            if il == c.n_layer - 1:
                # only the rows that produce output go further
                o, x = ctx.get_rows(o, out_ids), ctx.get_rows(x, out_ids)
            x = ctx.add(x, blocks.rms_norm(ctx, o, w[p + "post_attention_norm.weight"], eps))
            cur = blocks.rms_norm(ctx, x, w[p + "ffn_norm.weight"], eps)
            cur = blocks.ffn_glu(ctx, w, p, cur, act="gelu", on_cpu=self.on_cpu(il))
            x = ctx.add(x, blocks.rms_norm(ctx, cur, w[p + "post_ffw_norm.weight"], eps))
        out = blocks.output(ctx, w, x, eps, embeddings=embeddings)
        if c.final_softcap and not embeddings:
            out = blocks.softcap(ctx, out, c.final_softcap)
        return out
