"""The hyperparameters every GGUF decoder reads, and the parts of reading them that architectures share.

* :class:`DecoderConfig` reads the hyperparameters every decoder has (sizes, heads, RoPE, window,
  special tokens) through a :class:`~ggmlpy.weights.MetaReader`, which type- and range-checks each value
  and names the key and the file in its errors. An architecture's config subclasses it: it sets
  :attr:`DecoderConfig.ROPE_TYPES` (the ``general.architecture`` values it reads) and extends
  :meth:`DecoderConfig._read` and :meth:`DecoderConfig._problems` for its own keys.
* :func:`read_routing` checks a mixture-of-experts file's routing keys against what a graph builds.
* :func:`layer_kv_heads` reads a hybrid model's KV head count per layer (0: a recurrent layer).
* The ``_MAX_*`` bounds every reader checks sizes against before anything is sized from them.

The model that reads the file's tensors with this config is :class:`~ggmlpy.models.decoder.DecoderModel`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import numpy as np

from ggmlpy._core import GGMLValueError, RopeType
from ggmlpy.gguf import MetadataError, MetadataTypeError
from ggmlpy.weights import MetaReader

from .base import UnknownArchitecture

__all__ = ["POOLING", "DecoderConfig", "layer_kv_heads", "read_pooling", "read_routing"]

_log = logging.getLogger("ggmlpy")

# Sane bounds on hyperparameters, checked before anything is sized from them (a hostile file must not
# make the loader allocate or loop by its numbers). Generous: ten times what large public models use.
_MAX_LAYERS = 4096
_MAX_EMBD = 1 << 20
_MAX_HEADS = 1 << 14
_MAX_VOCAB = 1 << 24
_MAX_CTX = 1 << 27          # token positions are I32; the longest trained contexts are ~1e7

#: llama.cpp's pooling types in the order of their numbers (``LLAMA_POOLING_TYPE_*``, the files'
#: ``{arch}.pooling_type``): how a sequence's hidden states become its embedding.
POOLING = ("none", "mean", "cls", "last", "rank")


@dataclass(frozen=True)
class DecoderConfig:
    """Hyperparameters every decoder reads from GGUF metadata (``{arch}.*`` keys).

    Subclasses set :attr:`ROPE_TYPES` and add their own fields by extending :meth:`_read` (values read)
    and :meth:`_problems` (relations checked).
    """

    #: The ``general.architecture`` values this config reads, and the RoPE layout of each.
    ROPE_TYPES: ClassVar[dict[str, RopeType]] = {}
    #: The ``rope.scaling.type`` values this config reads (a subclass adds those its architecture handles,
    #: phi3's ``longrope``); any other is an error naming the key.
    ROPE_SCALINGS: ClassVar[tuple[str, ...]] = ("none", "linear", "yarn")
    #: Whether the config reads ``{arch}.expert_count`` itself (a mixture-of-experts feed-forward); where it
    #: does not, a file with experts is refused here, naming the key.
    READS_EXPERTS: ClassVar[bool] = False
    #: The key of the norms' epsilon (read into ``rms_eps``): RMSNorm's; a LayerNorm model (BERT) reads
    #: ``attention.layer_norm_epsilon``.
    EPS_KEY: ClassVar[str] = "attention.layer_norm_rms_epsilon"

    arch: str
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    rms_eps: float
    rope_base: float = 10000.0
    rope_dim: int = 0
    rope_mode: int = RopeType.NORMAL
    rope_scaling: str = "none"
    rope_freq_scale: float = 1.0
    rope_ext_factor: float = 0.0
    rope_attn_factor: float = 1.0
    n_ctx_orig: int = 0
    sliding_window: Optional[int] = None
    eos_token_ids: tuple = ()
    bos_token_id: Optional[int] = None
    file_type: Optional[int] = None
    #: Multi-token-prediction (NextN) layers the file holds after the ``n_layer`` it runs (``block_count``
    #: counts both): an architecture that reads ``nextn_predict_layers`` sets it; their tensors are not
    #: loaded, as llama.cpp skips them unless asked for speculative decoding.
    n_layer_nextn: int = 0

    @classmethod
    def from_metadata(cls, md: dict, path: str = "", n_vocab: Optional[int] = None) -> DecoderConfig:
        """Read the configuration.

        Every value is type-checked and range-checked as it is read (see :meth:`validate` for the
        relations between them). ``n_vocab`` is the vocabulary size to use when the metadata has none
        (the rows of ``token_embd.weight``).

        Raises
        ------
        UnknownArchitecture
            No ``general.architecture``, one not in :attr:`ROPE_TYPES`, or a variant the class cannot build.
        ggmlpy.gguf.MetadataError
            A missing key, a value out of range or not finite (names the key and the file).
        ggmlpy.gguf.MetadataTypeError
            A value of the wrong type (a string for a count, a float for an integer...).
        GGMLValueError
            A combination the class does not support (key and value head sizes differ...).
        """
        arch = md.get("general.architecture")
        if not isinstance(arch, str):
            raise UnknownArchitecture(f"{path}: no general.architecture in the file")
        if arch not in cls.ROPE_TYPES:
            raise UnknownArchitecture(f"{path}: architecture {arch!r} is not one {cls.__name__} reads "
                                      f"({', '.join(sorted(cls.ROPE_TYPES))})")
        return cls(**cls._read(MetaReader(md, arch, path), n_vocab))

    @classmethod
    def _read(cls, m: MetaReader, n_vocab: Optional[int]) -> dict[str, Any]:
        """The constructor's arguments, read through ``m``; a subclass adds its keys to the dict."""
        path, arch = m.path, m.arch
        n_expert = 0 if cls.READS_EXPERTS else m.geti("expert_count", 0, lo=0)
        if n_expert:
            raise UnknownArchitecture(f"{path}: mixture-of-experts {arch} models are not supported "
                                      f"({m.key('expert_count')} = {n_expert})")
        n_embd = m.geti("embedding_length", lo=1, hi=_MAX_EMBD)
        n_layer = m.geti("block_count", lo=1, hi=_MAX_LAYERS)
        n_head = m.geti("attention.head_count", lo=1, hi=_MAX_HEADS)
        n_head_kv = m.geti("attention.head_count_kv", n_head, lo=1, hi=_MAX_HEADS)
        head_dim = m.geti("attention.key_length", n_embd // n_head, lo=1, hi=_MAX_EMBD)
        v_dim = m.geti("attention.value_length", head_dim, lo=1, hi=_MAX_EMBD)
        if v_dim != head_dim:
            raise GGMLValueError(f"{path}: key and value head sizes differ ({head_dim} != {v_dim}); not supported")
        n_ff = m.geti("feed_forward_length", lo=1, hi=_MAX_EMBD * 8)
        if "vocab_size" in m:
            vocab = m.geti("vocab_size", lo=1, hi=_MAX_VOCAB)
        elif "tokenizer.ggml.tokens" in m:
            tokens = m.md["tokenizer.ggml.tokens"]
            if not isinstance(tokens, list):
                raise MetadataTypeError(path, "tokenizer.ggml.tokens", "expected an array of strings")
            vocab = len(tokens)
        elif n_vocab is not None:
            vocab = int(n_vocab)
        else:
            raise GGMLValueError(f"{path}: no vocabulary size ({arch}.vocab_size or tokenizer.ggml.tokens)")
        if not 1 <= vocab <= _MAX_VOCAB:
            raise MetadataError(path, "tokenizer.ggml.tokens", f"vocabulary size {vocab} is out of range "
                                                               f"[1, {_MAX_VOCAB}]")
        n_ctx_train = m.geti("context_length", lo=1, hi=_MAX_CTX)
        rms_eps = m.getf(cls.EPS_KEY, lo=0.0, lo_open=True, hi=1.0)
        rope_base = m.getf("rope.freq_base", 10000.0, lo=0.0, lo_open=True)
        rope_dim = m.geti("rope.dimension_count", head_dim, lo=1, hi=_MAX_EMBD)
        scaling = m.gets("rope.scaling.type", "none")
        factor = m.getf("rope.scaling.factor", 0.0, lo=0.0)
        freq_scale, ext_factor, attn_factor = 1.0, 0.0, 1.0
        if scaling == "linear" and factor > 0:
            freq_scale = 1.0 / factor
        elif scaling == "yarn" and factor > 0:
            freq_scale, ext_factor = 1.0 / factor, 1.0
            attn_factor = m.getf("rope.scaling.attn_factor", 1.0, lo=0.0, lo_open=True)
        elif scaling not in cls.ROPE_SCALINGS:
            raise GGMLValueError(f"{path}: rope scaling {scaling!r} ({arch}.rope.scaling.type) is not supported "
                                 f"({', '.join(cls.ROPE_SCALINGS)})")
        n_ctx_orig = m.geti("rope.scaling.original_context_length", n_ctx_train, lo=1, hi=_MAX_CTX)
        window = m.geti("attention.sliding_window", 0, lo=0, hi=_MAX_CTX) or None
        # A special token id outside the vocabulary is dropped with a warning, as llama.cpp does
        # ("bad special token"): it could never be sampled, and as input it would index past the
        # embedding rows.
        tok = {}
        for k in ("eos", "eot", "bos"):
            v = m.geti(f"tokenizer.ggml.{k}_token_id", None, lo=0)
            if v is not None and v >= vocab:
                _log.warning("%s: tokenizer.ggml.%s_token_id = %d is outside the vocabulary of %d; ignored",
                             path, k, v, vocab)
                v = None
            tok[k] = v
        eos_ids = () if tok["eos"] is None else (tok["eos"],)
        if tok["eot"] is not None and tok["eot"] not in eos_ids:
            eos_ids += (tok["eot"],)
        return dict(
            arch=arch, n_vocab=vocab, n_ctx_train=n_ctx_train, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
            n_head_kv=n_head_kv, head_dim=head_dim, n_ff=n_ff, rms_eps=rms_eps, rope_base=rope_base,
            rope_dim=rope_dim, rope_mode=int(cls.ROPE_TYPES[arch]), rope_scaling=scaling, rope_freq_scale=freq_scale,
            rope_ext_factor=ext_factor, rope_attn_factor=attn_factor, n_ctx_orig=n_ctx_orig, sliding_window=window,
            eos_token_ids=eos_ids, bos_token_id=tok["bos"], file_type=m.geti("general.file_type", None, lo=0))

    def cache_rows(self) -> tuple[int, int]:
        """Values one token stores per layer in the K cache and in the V cache (V 0 where V is part of K: a
        latent cache, :class:`~ggmlpy.kvcache.Causal`'s ``v_in_k``)."""
        return self.n_head_kv * self.head_dim, self.n_head_kv * self.head_dim

    def validate(self, path: str = "") -> None:
        """Check the relations between the hyperparameters (and their ranges, for a config made by hand).

        Raises
        ------
        GGMLValueError
            Listing every bad value with its key (:meth:`_problems`).
        """
        bad = self._problems()
        if bad:
            raise GGMLValueError(f"{path}: bad hyperparameters: " + "; ".join(bad))

    def _problems(self) -> list[str]:
        """What :meth:`validate` reports, one string per bad value; a subclass appends its own."""
        a = self.arch
        bad = []
        if not 1 <= self.n_layer <= _MAX_LAYERS:
            bad.append(f"{a}.block_count {self.n_layer} is out of range [1, {_MAX_LAYERS}]")
        if self.n_head_kv < 1 or self.n_head % self.n_head_kv:
            bad.append(f"{a}.attention.head_count_kv {self.n_head_kv} must divide head_count {self.n_head}")
        if self.head_dim < 1 or self.head_dim % 2:
            bad.append(f"head dimension {self.head_dim} ({a}.attention.key_length, or embedding_length / "
                       "head_count) must be even and >= 1")
        if not 0 < self.rope_dim <= self.head_dim or self.rope_dim % 2:
            bad.append(f"{a}.rope.dimension_count {self.rope_dim} must be even and in (0, {self.head_dim}]")
        if self.n_vocab < 1 or self.n_ff < 1:
            bad.append(f"{a}.vocab_size and {a}.feed_forward_length must be >= 1")
        # not (x > 0) is also true for NaN
        if not (math.isfinite(self.rms_eps) and 0 < self.rms_eps < 1):
            bad.append(f"{a}.{self.EPS_KEY} {self.rms_eps} must be finite and in (0, 1)")
        for key, v in (("rope.freq_base", self.rope_base), ("rope.scaling.factor", self.rope_freq_scale),
                       ("rope.scaling.attn_factor", self.rope_attn_factor)):
            if not (math.isfinite(v) and v > 0):
                bad.append(f"{a}.{key} gives {v}, which must be finite and > 0")
        return bad


def read_routing(m: MetaReader, arch: str, built: dict, norm_default: bool) -> bool:
    """Check the mixture-of-experts routing keys against what ``arch``'s graph builds (``built``: key ->
    the values it accepts, the first the default) and the routing weights' scale; return
    ``expert_weights_norm`` (``norm_default`` when the file does not say).

    Raises
    ------
    MetadataError, MetadataTypeError
        Naming the key whose value asks for a routing this model does not build.
    """
    for key, ok in built.items():
        v = m.geti(key, ok[0], lo=0)
        if v not in ok:
            raise MetadataError(m.path, m.key(key), f"{v} is not supported for {arch} (this model builds "
                                                    f"{' or '.join(map(str, ok))})")
    scale = m.getf("expert_weights_scale", 0.0)
    if scale not in (0.0, 1.0):
        raise MetadataError(m.path, m.key("expert_weights_scale"), f"{scale:g} is not supported for {arch} "
                                                                   "(the routing weights are unscaled: 0 or 1)")
    norm = m.md.get(m.key("expert_weights_norm"), norm_default)
    if not isinstance(norm, (bool, np.bool_)):
        raise MetadataTypeError(m.path, m.key("expert_weights_norm"), f"expected a bool, got {norm!r:.80}")
    return bool(norm)


def layer_kv_heads(m: MetaReader, n_layer: int) -> list[int]:
    """``attention.head_count_kv`` per layer, as hybrid models write it (lfm2, granitehybrid): an array with 0
    for a recurrent layer and one head count for every attention layer, or one value for all.

    Raises
    ------
    MetadataError, MetadataTypeError
        Naming the key: missing, an array of another length, values that are not integers, attention layers
        of different head counts.
    """
    key = m.key("attention.head_count_kv")
    raw = m.md.get(key)
    if raw is None:
        raise MetadataError(m.path, key, "is missing (it says which layers are recurrent: 0)")
    vals = list(raw) if isinstance(raw, (list, np.ndarray)) else [raw] * n_layer
    if len(vals) != n_layer:
        raise MetadataError(m.path, key, f"an array of {len(vals)} values for {n_layer} layers")
    if not all(isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) for v in vals):
        raise MetadataTypeError(m.path, key, "expected integers (one per layer)")
    vals = [int(v) for v in vals]
    if any(not 0 <= v <= _MAX_HEADS for v in vals) or len({v for v in vals if v}) > 1:
        raise MetadataError(m.path, key, f"{vals[:8]}{'...' if len(vals) > 8 else ''}: 0 for a recurrent layer, "
                                         "one head count for every attention layer")
    return vals


def read_pooling(md: dict, arch: str, path: str = "") -> Optional[str]:
    """A file's ``{arch}.pooling_type`` by its name in :data:`POOLING`, or None where the file has none.

    Raises
    ------
    MetadataError, MetadataTypeError
        A number that is no pooling type, or not an integer (naming the key).
    """
    from ggmlpy.gguf import meta_int

    key = f"{arch}.pooling_type"
    if key not in md:
        return None
    return POOLING[meta_int(md, key, lo=0, hi=len(POOLING) - 1, path=path)]
