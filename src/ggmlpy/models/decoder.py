"""The GGUF decoder model, whatever its architecture: weights on their devices, loading, the graph's frame
and the cache recipe.

An architecture module (``models/llama.py``, ...) subclasses a config and a model and registers the model:

* its config subclasses :class:`~ggmlpy.models.config.DecoderConfig` (``models/config.py``: the
  hyperparameters every decoder reads, checked);
* :class:`DecoderModel` reads and checks the config against the file's tensors, creates every weight
  on its device and allocates the buffers (so :attr:`DecoderModel.report` exists before any data is
  read), fuses Q/K/V and gate/up where it can, and loads the data with progress and finite checks.
  It builds the graph's inputs and hands the body to the subclass: a subclass yields its tensors
  (:meth:`DecoderModel._expected`) and composes its forward pass of :mod:`ggmlpy.models.blocks`
  (:meth:`DecoderModel._forward`). It makes the model's cache (:meth:`DecoderModel.new_cache`).
* :class:`PreNormDecoder` is that forward pass for the usual pre-norm layer (llama, qwen3, phi3, Mixtral),
  with two hooks where architectures differ: what Q and K go through (:meth:`PreNormDecoder._qk`) and
  the feed-forward (:meth:`PreNormDecoder._ffn`).
* :class:`LocalGlobalDecoder` is the frame of models whose layers are local (a sliding window) or global
  (gemma2, gemma3, gpt-oss): each layer's RoPE and a cache for each kind.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Iterator
from typing import Any, ClassVar, Optional

import numpy as np

from ggmlpy._core import Context, GGMLValueError, Tensor, Type
from ggmlpy.backend import N_CPU_MOE_PATTERN, Placement, choose_devices, split_layers
from ggmlpy.gguf import MetadataError
from ggmlpy.kvcache import Causal, Recurrent, Wrapper
from ggmlpy.memory import MemoryReport
from ggmlpy.weights import (
    MetaReader,
    MissingTensor,
    WeightLoader,
    Weights,
    check_all_used,
    check_tensor,
)

from . import blocks
from .base import BuiltGraph
from .config import DecoderConfig, read_pooling

# DecoderConfig, MetaReader and MissingTensor are re-exported for callers of this module's old names
__all__ = ["DecoderConfig", "DecoderModel", "MetaReader", "MissingTensor", "PreNormDecoder"]

# llama.cpp's LLAMA_FTYPE numbers (general.file_type) and the names llama-bench prints.
_FTYPE_NAMES = {0: "all F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K - Medium",
                11: "Q3_K - Small", 12: "Q3_K - Medium", 13: "Q3_K - Large", 14: "Q4_K - Small",
                15: "Q4_K - Medium", 16: "Q5_K - Small", 17: "Q5_K - Medium", 18: "Q6_K", 32: "BF16"}


def _size_label(n: int) -> str:
    """``110M``, ``1.1B``, ``7B``; one decimal below 10 of the unit."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale or unit == "K":
            v = n / scale
            return (f"{v:.1f}" if v < 10 else f"{v:.0f}").replace(".0", "") + unit
    return str(n)


_LAYER_RE = re.compile(r"blk\.(\d+)\.")

#: Checkpoints of the recurrent states kept per sequence by a hybrid model's cache (see
#: :class:`~ggmlpy.kvcache.rows.StateRows`): one at a prompt's end and one a token before it.
RECURRENT_CHECKPOINTS = 2

#: One weight the model reads: (name, ne, layer group, allowed types or None, op). ``op`` is
#: ``"mul_mat"`` for weights only a matrix product reads, ``"mul_mat_id"`` for a stack of experts only
#: ``mul_mat_id`` reads (either may be repacked), else None.
Expected = tuple[str, tuple, Any, Optional[tuple], Optional[str]]


class DecoderModel(WeightLoader):
    """A decoder from a GGUF file: weights on their devices, loading, and the frame of the graph.

    Subclasses set :attr:`config_class`, yield their tensors from :meth:`_expected` and build their
    forward pass in :meth:`_forward`; :meth:`_inspect` notes which optional tensors the file has.

    Parameters
    ----------
    reader : ggmlpy.gguf.GGUFReader
        The open file (metadata and tensor infos; data is read by :meth:`load`).
    placement : ggmlpy.backend.Placement, optional
        Which device holds each layer; default: everything on the CPU.
    repack : bool
        Put the matrix weights in the devices' extra buffer types where ggml supports them (CPU_REPACK,
        AMX...: faster prompts; the weights can then not be read back). See :class:`ggmlpy.weights.Weights`.
    fuse : bool
        Concatenate each layer's Q, K and V weights into one ``attn_qkv`` matrix and its gate and up
        weights into one ``ffn_gate_up`` matrix (biases likewise) when the parts share a type
        (:attr:`FUSIONS`), so a layer runs four matrix products instead of seven: fewer ops, one
        quantization of the activations instead of three, larger products for the threads to share.
        The results are the same (every output row is the same dot product); :attr:`fused` names what
        was fused.

    Attributes
    ----------
    config : DecoderConfig
    weights : ggmlpy.weights.Weights
    report : ggmlpy.memory.MemoryReport
        Weight bytes per device and layer (cache and graph are added by the runner).
    desc : str
        llama-bench's model description, e.g. ``"llama 110M F16"``.
    size, n_params, n_vocab : int
        Bytes and number of weight values; vocabulary size.
    fused : dict of str to tuple of str
        Each fused weight and the file tensors it holds, in row order.
    tied_output : bool
        The file has no ``output.weight``: the head reuses ``token_embd.weight``.
    copies : set of str
        Weights that are a second copy of a file tensor (a tied head placed apart from the
        embeddings, named ``output.weight``); :attr:`n_params` and :attr:`size` count the file's.
    has_rope_freqs : bool
        The file has ``rope_freqs.weight`` (RoPE frequency factors, llama 3.1).

    Raises
    ------
    As :func:`ggmlpy.models.load_model`.
    """

    #: The hyperparameters' class (its ``from_metadata`` reads the file).
    config_class: ClassVar[type[DecoderConfig]] = DecoderConfig
    #: What :meth:`_fuse` concatenates in each layer: the fused name and its parts, in row order. The
    #: blocks :func:`~ggmlpy.models.blocks.qkv` and :func:`~ggmlpy.models.blocks.ffn_glu` read either form.
    FUSIONS: ClassVar[tuple] = (("attn_qkv", ("attn_q", "attn_k", "attn_v")), ("ffn_gate_up", ("ffn_gate", "ffn_up")))
    #: Tensors of the input group that every layer reads: a device running layers gets its own copy
    #: (:meth:`_copy_to_layer_devices`).
    LAYER_SHARED: ClassVar[tuple[str, ...]] = ("rope_freqs.weight", "rope_factors_short.weight",
                                               "rope_factors_long.weight")
    #: Graph nodes a layer may use (sizes the graph, see :meth:`graph_size`).
    NODES_PER_LAYER: ClassVar[int] = 64
    #: The image encoder loaded with the model (``load_model(..., mmproj=...)``), closed with it.
    vision: Any = None
    #: Whether attention is causal (an encoder's is not: :class:`~ggmlpy.models.bert.BertModel`).
    causal: ClassVar[bool] = True
    #: Whether the model has a language-model head to generate with (an encoder has none).
    can_generate: ClassVar[bool] = True
    #: Scores a classification head gives per input (0: no head; a reranker has one).
    n_cls_out: int = 0

    def __init__(self, reader, placement: Optional[Placement] = None, repack: bool = True,
                 fuse: bool = True) -> None:
        self.path = str(reader.path)
        self.config = cfg = self.read_config(reader, self.path)
        if placement is None:
            placement = split_layers(cfg.n_layer, choose_devices("cpu"))
        if placement.n_layers != cfg.n_layer:
            raise GGMLValueError(f"{self.path}: placement has {placement.n_layers} layers, the model {cfg.n_layer}")
        self.placement = placement
        self._reader = reader
        #: the file's ``general.sampling.*`` keys: the model maker's recommended sampling (the runner reads them)
        self.sampling_metadata = {k: v for k, v in reader.metadata.items() if k.startswith("general.sampling.")}
        self._file_pooling = read_pooling(reader.metadata, cfg.arch, self.path)
        self._inspect(reader)
        expected = list(self._expected())
        self.weights = Weights(placement, max_tensors=len(expected) + 8, repack=repack)
        self.report: MemoryReport = self.weights.report
        self.fused: dict[str, tuple[str, ...]] = {}
        self.copies: set[str] = set()
        self._on_device: dict[str, dict[str, str]] = {}
        try:
            for name, ne, _group, types, _op in expected:
                self._check(reader, name, ne, types)
            # a NextN layer's tensors (after the layers run) are not loaded, as llama.cpp skips them
            used = {e[0] for e in expected} | {t.name for t in reader.tensors if (m := _LAYER_RE.match(t.name))
                                               and int(m.group(1)) >= cfg.n_layer}
            for name, ne, group, _types, op in self._fuse(reader, expected) if fuse else expected:
                parts = self.fused.get(name, (name,))
                self.weights.add(name, reader.tensor_info(parts[0]).type, ne, group, op=op, names=parts)
            self._copy_tied_head(reader)
            self._copy_to_layer_devices(reader, self.LAYER_SHARED)
            check_all_used(reader, self.path, used, cfg.arch, cfg.n_layer)
            self._warn_idle_overrides()
            self.weights.allocate()
        except BaseException:
            self.weights.close()
            raise
        # the file's weights (llama.cpp's model size and parameter count): a copied head is not one
        stored = [t for name, (t, _) in self.weights.tensors.items() if name not in self.copies]
        self.n_params = sum(int(np.prod(t.ne)) for t in stored)
        self.size = sum(t.nbytes for t in stored)
        self.n_vocab = cfg.n_vocab
        ft = _FTYPE_NAMES.get(cfg.file_type) if cfg.file_type is not None else None
        if ft is None:
            # the type of layer 0's first matrix names the file's quantization
            ft = reader.tensor_info(next(e[0] for e in expected if e[2] == 0 and e[4] == "mul_mat")).type.name
        self.desc = f"{cfg.arch} {_size_label(self.n_params)} {ft}"
        self.loaded = False
        self._closed = False

    @classmethod
    def read_config(cls, reader, path: str = "") -> DecoderConfig:
        """The hyperparameters of an open file, checked against its tensors (before anything is sized).

        They must agree with the tensors the file holds: ``block_count`` with the ``blk.N`` layers
        present, the embedding length and vocabulary size with ``token_embd.weight``, and (where the
        file has these tensors) head counts, head size and feed-forward length with layer 0's
        ``attn_q``, ``attn_k`` and ``ffn_gate``. Each error names the key, the value and the tensor it
        contradicts.
        """
        emb = reader.tensor_info("token_embd.weight") if "token_embd.weight" in reader else None
        if emb is None:
            raise MissingTensor(f"{path}: tensor 'token_embd.weight' is missing")
        if len(emb.ne) != 2:
            raise MissingTensor(f"{path}: tensor 'token_embd.weight' has ne={emb.ne}, expected 2 dimensions")
        cfg = cls.config_class.from_metadata(reader.metadata, path, n_vocab=emb.ne[1])
        cfg.validate(path)
        a = cfg.arch
        layers = {int(m.group(1)) for t in reader.tensors if (m := _LAYER_RE.match(t.name))}
        n_file = max(layers) + 1 if layers else 0
        n_all = cfg.n_layer + cfg.n_layer_nextn           # NextN layers follow the ones run
        if n_all != n_file and not (cfg.n_layer_nextn and n_file == cfg.n_layer):
            raise MetadataError(path, f"{a}.block_count", f"{n_all}, but the file has tensors for {n_file} "
                                                         f"layers (blk.0 .. blk.{n_file - 1})" if n_file else
                                f"{n_all}, but the file has no blk.N tensors")
        if len(layers) != n_file:
            missing = sorted(set(range(n_file)) - layers)[:5]
            raise MissingTensor(f"{path}: no tensors for layers {missing} of {n_file}")

        def rows(name):
            info = reader.tensor_info(name) if name in reader else None
            return info.ne[1] if info is not None and len(info.ne) == 2 else None

        vocab_key = f"{a}.vocab_size" if f"{a}.vocab_size" in reader.metadata else "tokenizer.ggml.tokens"
        checks = [
            (f"{a}.embedding_length", cfg.n_embd, "token_embd.weight", emb.ne[0], "ne[0]"),
            (vocab_key, cfg.n_vocab, "token_embd.weight", emb.ne[1], "ne[1]"),
            (f"{a}.attention.head_count", cfg.n_head * cfg.head_dim, "blk.0.attn_q.weight",
             rows("blk.0.attn_q.weight"), "rows (head_count x head size)"),
            (f"{a}.attention.head_count_kv", cfg.n_head_kv * cfg.head_dim, "blk.0.attn_k.weight",
             rows("blk.0.attn_k.weight"), "rows (head_count_kv x head size)"),
            (f"{a}.feed_forward_length", cfg.n_ff, "blk.0.ffn_gate.weight", rows("blk.0.ffn_gate.weight"), "rows"),
        ]
        for key, want, tname, got, what in checks:
            if got is not None and got != want:
                raise MetadataError(path, key, f"the metadata gives {want} {what}, but {tname} has "
                                               f"ne={reader.tensor_info(tname).ne}")
        return cfg

    # ------------------------------------------------------------------ weights

    def _inspect(self, reader) -> None:
        """Note which optional tensors the file has (before :meth:`_expected`); a subclass adds its own."""
        self.tied_output = "output.weight" not in reader
        self.has_rope_freqs = "rope_freqs.weight" in reader

    def _expected(self) -> Iterator[Expected]:
        """Every tensor this model reads, as :data:`Expected` tuples, in the order they are created."""
        raise NotImplementedError(f"{type(self).__name__} must yield its tensors from _expected()")

    def _expected_norm(self, i: int, name: str, n: Optional[int] = None) -> Expected:
        """Layer ``i``'s F32 norm weight ``name`` of ``n`` values (default ``n_embd``)."""
        return f"blk.{i}.{name}.weight", (n or self.config.n_embd,), i, (Type.F32,), None

    def _expected_attention(self, i: int, *, bias: bool = False, out_bias: bool = False,
                            qk_norm: Optional[tuple[int, int]] = None) -> Iterator[Expected]:
        """Layer ``i``'s attention weights: Q, K, V (and their biases), Q/K norms of ``qk_norm = (n_q, n_k)``
        values, the output projection (and its bias)."""
        c = self.config
        p = f"blk.{i}."
        n_q, n_kv = c.n_head * c.head_dim, c.n_head_kv * c.head_dim
        parts = (("q", n_q), ("k", n_kv), ("v", n_kv))
        for x, rows in parts:
            yield f"{p}attn_{x}.weight", (c.n_embd, rows), i, None, "mul_mat"
        for x, rows in parts if bias else ():
            yield f"{p}attn_{x}.bias", (rows,), i, (Type.F32,), None
        if qk_norm is not None:
            yield self._expected_norm(i, "attn_q_norm", qk_norm[0])
            yield self._expected_norm(i, "attn_k_norm", qk_norm[1])
        yield p + "attn_output.weight", (n_q, c.n_embd), i, None, "mul_mat"
        if out_bias:
            yield p + "attn_output.bias", (c.n_embd,), i, (Type.F32,), None

    def _expected_ffn(self, i: int) -> Iterator[Expected]:
        """Layer ``i``'s gated feed-forward: gate, up and down matrices."""
        c, p = self.config, f"blk.{i}."
        yield p + "ffn_gate.weight", (c.n_embd, c.n_ff), i, None, "mul_mat"
        yield p + "ffn_up.weight", (c.n_embd, c.n_ff), i, None, "mul_mat"
        yield p + "ffn_down.weight", (c.n_ff, c.n_embd), i, None, "mul_mat"

    def _expected_io(self) -> Iterator[Expected]:
        """The tensors outside the layers: the embeddings, the output norm and head, RoPE factors."""
        c = self.config
        yield "token_embd.weight", (c.n_embd, c.n_vocab), "input", None, None
        yield "output_norm.weight", (c.n_embd,), "output", (Type.F32,), None
        if not self.tied_output:
            yield "output.weight", (c.n_embd, c.n_vocab), "output", None, "mul_mat"
        if self.has_rope_freqs:
            yield "rope_freqs.weight", (c.rope_dim // 2,), "input", (Type.F32,), None

    def _warn_idle_overrides(self) -> None:
        """A tensor override that matches none of the file's weights is most likely a typo (llama.cpp
        ignores it silently)."""
        if not self.placement.overrides:
            return
        names = [n for name in self.weights.tensors for n in self.fused.get(name, (name,))]
        idle = [p for p, _ in self.placement.overrides if not any(re.search(p, n) for n in names)]
        ncmoe = {N_CPU_MOE_PATTERN.format(i) for i in range(self.config.n_layer)}
        if any(p in ncmoe for p in idle) and not any("_exps" in n for n in names):
            warnings.warn(f"{self.path}: n_cpu_moe (--cpu-moe, -ncmoe): this {self.config.arch} model has no expert "
                          f"weights", stacklevel=4)
        idle = [p for p in idle if p not in ncmoe]       # (a layer without experts: nothing to keep, as llama.cpp)
        if idle:
            more = f" and {len(idle) - 3} more" if len(idle) > 3 else ""
            warnings.warn(f"{self.path}: tensor override pattern(s) {', '.join(idle[:3])}{more} match no weight "
                          f"of this {self.config.arch} model", stacklevel=4)

    def _copy_tied_head(self, reader) -> None:
        """With tied embeddings, give the head its own copy of ``token_embd.weight`` where the product
        would run elsewhere: on another device, or from an extra buffer type (a repacked Q4_0 head is
        1.2x a token's generation on AVX-512). The embedding lookup (``get_rows``) keeps the plain
        tensor. llama.cpp's loader duplicates a tied head the same way."""
        if not self.tied_output:
            return
        c = self.config
        ne, t = (c.n_embd, c.n_vocab), reader.tensor_info("token_embd.weight").type
        if (self.weights.where(t, ne, "output", "mul_mat", names=("output.weight",))
                == self.weights.where(t, ne, "input", names=("token_embd.weight",))):
            return
        self.weights.add("output.weight", t, ne, "output", op="mul_mat")
        self.fused["output.weight"] = ("token_embd.weight",)
        self.copies.add("output.weight")

    def _copy_to_layer_devices(self, reader, names) -> None:
        """Give every device that runs layers, other than the input's, its own copy of these small
        tensors that every layer reads (RoPE factors), so that no layer's graph reaches back to the input
        device: each such read would cut the layer into another split there (phi3 over RPC: several per
        layer). llama.cpp's loader duplicates them per layer; one copy per device is enough. The copy is
        named ``name@device`` and listed in :attr:`copies`; :meth:`layer_weight` picks it."""
        home = self.placement.device_of("input").name
        for name in names:
            if name not in self.weights:
                continue
            t = self.weights[name]
            for il in range(self.config.n_layer):
                dev = self.placement.device_of(il).name
                if dev == home or dev in self._on_device.get(name, {}):
                    continue
                copy = f"{name}@{dev}"
                self.weights.add(copy, t.type, (t.ne[0],), il, names=())  # vectors; a copy is never overridden
                self.fused[copy] = (name,)
                self.copies.add(copy)
                self._on_device.setdefault(name, {})[dev] = copy

    def _fuse(self, reader, expected: list) -> list:
        """``expected`` with each layer's fusable weights (and biases) replaced by their concatenation.

        Parts fuse when each is present, all have one type (their rows are as wide, checked against
        the hyperparameters already) and no tensor override sends them to different devices; biases only
        where their weights fused, as the graph adds the fused
        bias to the fused product. The fused tensor takes the first part's place and is recorded in
        :attr:`fused`.
        """
        by_name = {e[0]: e for e in expected}
        out, skip = [], set()
        for entry in expected:
            name, ne, group, types, op = entry
            if name in skip:
                continue
            for fused, parts in self.FUSIONS:
                pre, dot, kind = name.partition(f".{parts[0]}.")
                if not (dot and pre.startswith("blk.")):
                    continue
                names = [f"{pre}.{q}.{kind}" for q in parts]
                if (all(n in by_name for n in names)
                        and len({reader.tensor_info(n).type for n in names}) == 1     # not Q4_K_M's Q6_K attn_v
                        # parts a tensor override sends to different devices stay apart
                        and len({self.placement.device_for(group, (n,)) for n in names}) == 1
                        and (kind == "weight" or f"{pre}.{fused}.weight" in self.fused)):
                    rows = [by_name[n][1][-1] for n in names]
                    fname = f"{pre}.{fused}.{kind}"
                    self.fused[fname] = tuple(names)
                    skip.update(names)
                    entry = (fname, (*ne[:-1], sum(rows)), group, types, op)
                break
            out.append(entry)
        return out

    def _check(self, reader, name, ne, types) -> None:
        check_tensor(reader, self.path, self.config.arch, name, ne, types)

    # ------------------------------------------------------------------ graph

    @property
    def pooling(self) -> Optional[str]:
        """How an embedding request pools by default: the file's ``{arch}.pooling_type`` (a name of
        :data:`~ggmlpy.models.config.POOLING`), or None where the file has none (the runner then means)."""
        return self._file_pooling

    def rope(self, ctx: Context, x: Tensor, pos: Tensor, layer: int) -> Tensor:
        """RoPE of ``x`` at ``pos`` in ``layer`` with the model's settings (and ``rope_freqs.weight`` if the file
        has it)."""
        ff = self.layer_weight("rope_freqs.weight", layer) if self.has_rope_freqs else None
        return blocks.rope(ctx, x, pos, self.config, ff)

    def shift_fn(self, ctx: Context, layer: int, k: Tensor, offsets: Tensor) -> Tensor:
        """The cache's key shift: a rotation by the position delta, with the forward pass's frequencies."""
        ff = self.layer_weight("rope_freqs.weight", layer) if self.has_rope_freqs else None
        return blocks.rope_shift(ctx, k, offsets, self.config, ff)

    def layer_weight(self, name: str, layer: int) -> Tensor:
        """Weight ``name`` as ``layer`` reads it: the copy on the layer's device where it has one
        (:meth:`_copy_to_layer_devices`), else the weight itself."""
        copy = self._on_device.get(name, {}).get(self.placement.device_of(layer).name)
        return self.weights[copy or name]

    def graph_size(self) -> int:
        """Nodes plus leafs a forward graph may use (with headroom)."""
        return self.NODES_PER_LAYER * self.config.n_layer + 256

    def on_cpu(self, layer: int) -> bool:
        """Whether ``layer`` computes on the CPU backend (its weights are there), which lets attention
        take ggmlpy's CPU decode kernel (:func:`~ggmlpy.models.blocks.attention`)."""
        return self.placement.device_of(layer).type == "CPU"

    def new_cache(self, type_k=Type.F16, type_v=Type.F16, *, flash_attn: bool = True) -> Causal:
        """This model's cache, not yet allocated (the caller sizes it with ``cache.init(...)``).

        One :class:`~ggmlpy.kvcache.Causal` for every layer, with the model's sliding window (mistral)
        and its RoPE as the key shift. ``flash_attn`` picks the layout the attention path reads: V in
        rows (flash attention; the visible range padded to 256 cells) or V transposed for ``mul_mat``
        (padded to 32). An architecture with mixed window and full layers overrides this.
        """
        c = self.config
        window = c.sliding_window - 1 if c.sliding_window else None   # the cache's window excludes the token
        return Causal(c.n_layer, c.head_dim * c.n_head_kv, c.head_dim * c.n_head_kv, type_k, dtype_v=type_v,
                      window=window, padding=256 if flash_attn else 32, n_head_kv=c.n_head_kv,
                      shift_fn=self.shift_fn, v_trans=not flash_attn)

    def hybrid_cache(self, states: dict, type_k=Type.F16, type_v=Type.F16, *, flash_attn: bool = True):
        """The cache of a model with recurrent layers (``config.recurrent_layers``): the K/V of its attention
        layers (a :class:`~ggmlpy.kvcache.Causal` as :meth:`new_cache` makes, no window) and the recurrent
        layers' ``states`` (name -> shape, a :class:`~ggmlpy.kvcache.Recurrent`), behind a
        :class:`~ggmlpy.kvcache.Wrapper`; one of them alone for a file of one kind of layer."""
        c = self.config
        n_rec = sum(c.recurrent_layers)
        caches, index = [], {}
        if c.n_layer - n_rec:
            kv = c.head_dim * c.n_head_kv
            index[False] = len(caches)
            caches.append(Causal(c.n_layer - n_rec, kv, kv, type_k, dtype_v=type_v, padding=256 if flash_attn else 32,
                                 n_head_kv=c.n_head_kv, shift_fn=self.shift_fn, v_trans=not flash_attn))
        if n_rec:
            index[True] = len(caches)
            caches.append(Recurrent(n_rec, states, checkpoints=RECURRENT_CHECKPOINTS))
        if len(caches) == 1:
            return caches[0]
        return Wrapper(caches, [index[r] for r in c.recurrent_layers])

    #: The graph can take input embeddings for some rows (an image's, :meth:`embed_tokens`) in place of
    #: their tokens' (``build(..., n_embd_rows=k)``); an architecture whose ``_forward`` reads them sets it.
    EMBD_INPUT: ClassVar[bool] = False
    #: Positions per token in ``inp_pos``: 1, or 4 for multi-section RoPE (:mod:`~ggmlpy.models.qwenvl`),
    #: laid out as ggml's ``rope_multi`` reads them (each position kind for all tokens, in turn)
    POS_PER_TOKEN: ClassVar[int] = 1

    @property
    def embd_width(self) -> int:
        """Values of one input embedding row (``inp_embd``): ``n_embd`` (Qwen3-VL's rows carry deepstack too)."""
        return self.config.n_embd

    def build(self, cache, plan, n_tokens: int, n_out: int, *, flash_attn: bool = False,
              embeddings: bool = False, n_embd_rows: int = 0) -> BuiltGraph:
        """Build the forward graph for a batch of ``n_tokens`` through ``cache`` with ``plan``.

        ``n_out`` rows produce output (selected by the ``out_ids`` input). The result is the logits ``ne = (n_vocab,
        n_out)``, or with ``embeddings`` the final-normed hidden states
        ``ne = (n_embd, n_out)``. ``n_embd_rows`` rows take their input embedding from the ``inp_embd``
        input (``ne = (n_embd, n_embd_rows)``, the rows named by ``inp_embd_rows``) instead of from their
        token: an image's embeddings (models with :attr:`EMBD_INPUT`). Inputs are created unallocated:
        allocate the graph with the scheduler, then :meth:`BuiltGraph.set_inputs`.
        """
        n = int(n_tokens)
        if not 1 <= n_out <= n:
            raise GGMLValueError(f"build: n_out {n_out} must be in [1, n_tokens={n}]")
        n_embd_rows = int(n_embd_rows)
        if n_embd_rows and not self.EMBD_INPUT:
            raise GGMLValueError(f"build: {self.config.arch} takes no input embeddings (n_embd_rows={n_embd_rows})")
        if not 0 <= n_embd_rows <= n:
            raise GGMLValueError(f"build: n_embd_rows {n_embd_rows} must be in [0, n_tokens={n}]")
        size = self.graph_size()
        ctx = Context.for_tensors(size, graph_size=size, no_alloc=True)
        tokens = ctx.new_tensor(Type.I32, (n,), name="inp_tokens").set_input()
        pos = ctx.new_tensor(Type.I32, (n * self.POS_PER_TOKEN,), name="inp_pos").set_input()
        memory = cache.forward(ctx, plan)           # the cache's own inputs: destination rows, mask
        # always present (even when every row is output) so that every graph has the topology the
        # worst-case reservation measured
        out_ids = ctx.new_tensor(Type.I32, (n_out,), name="inp_out_ids").set_input()
        kw = {}
        if n_embd_rows:
            kw["embd"] = (ctx.new_tensor(Type.F32, (self.embd_width, n_embd_rows), name="inp_embd").set_input(),
                          ctx.new_tensor(Type.I64, (n_embd_rows,), name="inp_embd_rows").set_input())
        out = self._forward(ctx, tokens, pos, memory, out_ids, flash_attn=flash_attn, embeddings=embeddings, **kw)
        out.set_output()
        gf = ctx.new_graph(size)
        for t in memory.pending:          # cache writes before anything reads the cache
            gf.build_forward_expand(t)
        # the positions are an input of every graph, also one no layer reads (recurrent layers only)
        gf.build_forward_expand(pos)
        gf.build_forward_expand(out)
        built = BuiltGraph(ctx, gf, tokens, pos, memory, out_ids, out, n, n_out)
        if n_embd_rows:
            built.embd, built.embd_rows = kw["embd"]
            # set_rows writes into the token embeddings, computed on the input's device; left alone,
            # ggml's scheduler gives it the next layer's device, which then writes into memory it does
            # not own (a segfault in ggml-vulkan with every layer on a Vulkan device)
            built.pins = [(gf.get_tensor("inp_embd_set"), self.placement.input)]
        return built

    def embed_tokens(self, ctx: Context, tokens: Tensor, embd: Optional[tuple] = None,
                     scale: Optional[float] = None) -> Tensor:
        """The input embeddings of a batch: ``token_embd`` rows of ``tokens`` (times ``scale``), where
        ``embd = (values, rows)`` is given with ``values`` (``ne = (n_embd, k)``) written over rows
        ``rows`` (an image's embeddings enter unscaled, as in transformers and llama.cpp)."""
        x = ctx.get_rows(self.weights["token_embd.weight"], tokens)
        if scale is not None:
            x = ctx.scale(x, scale)
        if embd is not None:
            x = ctx.set_rows(x, embd[0], embd[1])
            x.name = "inp_embd_set"    # pinned to the input's device: build()
        return x

    def _forward(self, ctx: Context, tokens: Tensor, pos: Tensor, memory, out_ids: Tensor, *, flash_attn: bool,
                 embeddings: bool) -> Tensor:
        """The body of :meth:`build`: from the I32 ``tokens`` and ``pos`` (``ne = (n,)``) through the layers
        (K/V through ``memory``, the cache's view) to the logits of the rows ``out_ids``, or with
        ``embeddings`` their final-normed hidden states."""
        raise NotImplementedError(f"{type(self).__name__} must build its graph in _forward()")

    # ------------------------------------------------------------------ misc

    @property
    def backend_names(self) -> str:
        """llama-bench's backend column: the non-CPU device kinds used, or ``CPU``."""
        names = []
        for d in self.placement.devices():
            kind = "RPC" if d.name.upper().startswith("RPC") else d.name.rstrip("0123456789")
            if d.type != "CPU" and kind not in names:
                names.append(kind)
        return ",".join(names) if names else "CPU"

    @property
    def tokenizer(self):
        """The file's :class:`~ggmlpy.tokenizer.Tokenizer`, made on first use from its metadata (kept
        after :meth:`close`).

        Raises
        ------
        TokenizerError
            The file has no tokenizer (``tokenizer.ggml.model`` missing or ``none``, as in the synthetic
            models) or one this library does not support.
        """
        tok = self.__dict__.get("_tokenizer")
        if tok is None:
            from ggmlpy.tokenizer import Tokenizer

            tok = self.__dict__["_tokenizer"] = Tokenizer(self._reader.metadata, self.path)
        return tok

    def close(self) -> None:
        """Free the weights, the vision encoder's too (and close the file readers)."""
        if self.vision is not None:
            self.vision.close()
        super().close()

    def __enter__(self) -> DecoderModel:
        return self

    def __repr__(self) -> str:
        c = self.config
        return (f"{type(self).__name__}({getattr(self, 'desc', self.path)!r}, n_layer={c.n_layer}, "
                f"n_embd={c.n_embd}, n_head={c.n_head}/{c.n_head_kv}, n_vocab={c.n_vocab}, "
                f"{self.placement.summary()})")


class PreNormDecoder(DecoderModel):
    """The usual pre-norm decoder (llama, qwen, phi3, Mixtral): per layer RMSNorm → attention (Q and K through
    :meth:`_qk`, grouped-query attention through the cache) → residual → RMSNorm → :meth:`_ffn` → residual;
    rows that need no output are dropped after the last layer's attention.

    A subclass lists its tensors and changes the two hooks where its architecture differs.
    """

    EMBD_INPUT = True

    def _qk(self, ctx: Context, layer: int, q: Tensor, k: Tensor, pos: Tensor, memory) -> tuple[Tensor, Tensor]:
        """Q and K (``ne = (head_dim, heads, n)``) of ``layer`` as attention takes them: with RoPE at ``pos``."""
        return self.rope(ctx, q, pos, layer), self.rope(ctx, k, pos, layer)

    def _ffn(self, ctx: Context, prefix: str, cur: Tensor) -> Tensor:
        """The feed-forward of the normed ``cur``: SwiGLU."""
        return blocks.ffn_glu(ctx, self.weights, prefix, cur)

    def _forward(self, ctx: Context, tokens: Tensor, pos: Tensor, memory, out_ids: Tensor, *, flash_attn: bool,
                 embeddings: bool, embd: Optional[tuple] = None) -> Tensor:
        c, w = self.config, self.weights
        scale = 1.0 / math.sqrt(c.head_dim)
        x = self.embed_tokens(ctx, tokens, embd)
        for il in range(c.n_layer):
            p = f"blk.{il}."
            cur = blocks.rms_norm(ctx, x, w[p + "attn_norm.weight"], c.rms_eps)
            q, k, v = blocks.qkv(ctx, w, p, cur, c.n_head, c.n_head_kv, c.head_dim)
            q, k = self._qk(ctx, il, q, k, pos, memory)
            o = blocks.attention(ctx, memory, il, q, k, v, scale=scale, flash_attn=flash_attn,
                                 on_cpu=self.on_cpu(il))
            o = blocks.linear(ctx, w[p + "attn_output.weight"], o)
            if il == c.n_layer - 1:
                # only the rows that produce output go further
                o, x = ctx.get_rows(o, out_ids), ctx.get_rows(x, out_ids)
            x = ctx.add(x, o)
            cur = blocks.rms_norm(ctx, x, w[p + "ffn_norm.weight"], c.rms_eps)
            x = self._layer_out(ctx, il, ctx.add(x, self._ffn(ctx, p, cur)), embd)
        return blocks.output(ctx, w, x, c.rms_eps, embeddings=embeddings)

    def _layer_out(self, ctx: Context, layer: int, x: Tensor, embd: Optional[tuple]) -> Tensor:
        """A layer's output as the next layer takes it (Qwen3-VL adds its image rows' deepstack slices)."""
        return x


class LocalGlobalDecoder(DecoderModel):
    """A decoder whose layers are local (a sliding window, their own RoPE) or global: gemma2, gemma3,
    gpt-oss. The config says which (``swa_layers``: one bool per layer) and gives a local layer's RoPE
    settings (``rope_of(layer)``).

    The cache is a :class:`~ggmlpy.kvcache.Wrapper` of a sliding-window :class:`~ggmlpy.kvcache.Causal`
    (the local layers; it keeps only the window) and a full one (the global layers), each shifting keys
    with its layers' own RoPE; with one kind of layer only, that cache alone.
    """

    def _inspect(self, reader) -> None:
        super()._inspect(reader)
        local = None
        self._rope = []                   # each layer's RoPE settings (the local ones made once)
        for il, swa in enumerate(self.config.swa_layers):
            if swa and local is None:
                local = self.config.rope_of(il)
            self._rope.append(local if swa else self.config)

    def rope(self, ctx: Context, x: Tensor, pos: Tensor, layer: int) -> Tensor:
        """RoPE of ``x`` at ``pos`` with ``layer``'s settings (local or global base and scale)."""
        return blocks.rope(ctx, x, pos, self._rope[layer])

    def shift_fn(self, ctx: Context, layer: int, k: Tensor, offsets: Tensor) -> Tensor:
        """The cache's key shift for model layer ``layer``: RoPE by the position delta, with that layer's base."""
        return blocks.rope_shift(ctx, k, offsets, self._rope[layer])

    def new_cache(self, type_k=Type.F16, type_v=Type.F16, *, flash_attn: bool = True):
        """This model's cache, not yet allocated (see :meth:`DecoderModel.new_cache` and the class)."""
        c = self.config
        kv = c.head_dim * c.n_head_kv
        caches, index = [], {}
        for local in (True, False):
            n = sum(1 for s in c.swa_layers if s == local)
            if n:
                index[local] = len(caches)
                # the cache's window excludes the token itself
                caches.append(Causal(n, kv, kv, type_k, dtype_v=type_v, window=c.sliding_window - 1 if local else None,
                                     padding=256 if flash_attn else 32, n_head_kv=c.n_head_kv,
                                     shift_fn=self.shift_fn, v_trans=not flash_attn))
        if len(caches) == 1:
            return caches[0]
        return Wrapper(caches, [index[s] for s in c.swa_layers])
