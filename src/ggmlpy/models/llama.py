"""The llama family from GGUF: llama (Llama 2/3, TinyLlama), mistral (sliding window), qwen2 (QKV bias).

A :class:`LlamaModel` is made in two steps, as in Ollama: the constructor
creates every weight tensor on its device and allocates the buffers (so
:attr:`LlamaModel.report` says what each device holds before any data is
read), then :meth:`LlamaModel.load` streams the data from the file straight
into the tensors' memory, reporting progress. :func:`load_model` does both.

The graph (:meth:`LlamaModel.build`) is the usual pre-norm decoder: token
embedding, per layer RMSNorm → attention (RoPE on Q and K, grouped-query
attention through a :class:`ggmlpy.kvcache.Causal` cache, with
``flash_attn_ext`` or ``mul_mat`` + ``soft_max_ext``) → residual → RMSNorm →
SwiGLU feed-forward → residual; then the output norm and the output head
(``token_embd`` again when the file has no ``output.weight``). Rows that need
no output are dropped after the last layer's attention.

Weights follow llama.cpp's converter: for ``llama``/``mistral`` the Q and K
rows are permuted so that ggml's "normal" RoPE (adjacent pairs) applies; for
``qwen2`` they are not and RoPE is NEOX-style (halves).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from ggmlpy._core import Context, GGMLValueError, Graph, RopeType, Tensor, Type
from ggmlpy.backend import MemoryReport, Placement, Weights, choose_devices, split_layers

__all__ = ["ARCHITECTURES", "BuiltGraph", "LlamaConfig", "LlamaModel", "MissingTensor", "UnknownArchitecture",
           "load_model"]

#: Supported ``general.architecture`` values and their RoPE layout.
ARCHITECTURES = {"llama": RopeType.NORMAL, "mistral": RopeType.NORMAL, "qwen2": RopeType.NEOX}

# llama.cpp's LLAMA_FTYPE numbers (general.file_type) and the names llama-bench prints.
_FTYPE_NAMES = {0: "all F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K - Medium",
                11: "Q3_K - Small", 12: "Q3_K - Medium", 13: "Q3_K - Large", 14: "Q4_K - Small",
                15: "Q4_K - Medium", 16: "Q5_K - Small", 17: "Q5_K - Medium", 18: "Q6_K", 32: "BF16"}


class UnknownArchitecture(GGMLValueError):
    """The GGUF file's ``general.architecture`` is not one this module builds."""


class MissingTensor(GGMLValueError):
    """A tensor the architecture needs is not in the file, or has the wrong shape or type."""


def _md(md: dict, key: str, default=None, required: bool = False, path: str = ""):
    if key in md:
        v = md[key]
        if isinstance(v, np.ndarray):       # per-layer arrays: llama.cpp takes the first value
            if v.size == 0:
                raise GGMLValueError(f"{path}: metadata {key} is an empty array")
            v = v.flat[0].item()
        return v
    if required:
        raise GGMLValueError(f"{path}: metadata key {key!r} is missing")
    return default


@dataclass(frozen=True)
class LlamaConfig:
    """Hyperparameters read from GGUF metadata (``{arch}.*`` keys)."""

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

    @classmethod
    def from_metadata(cls, md: dict, path: str = "", n_vocab: Optional[int] = None) -> LlamaConfig:
        """Read the configuration; raises :class:`UnknownArchitecture` or a ValueError naming the key."""
        arch = md.get("general.architecture")
        if not isinstance(arch, str):
            raise UnknownArchitecture(f"{path}: no general.architecture in the file")
        if arch not in ARCHITECTURES:
            raise UnknownArchitecture(f"{path}: architecture {arch!r} is not supported "
                                      f"(supported: {', '.join(sorted(ARCHITECTURES))})")

        def get(key, default=None, required=False):
            return _md(md, f"{arch}.{key}", default, required, path)

        n_embd = int(get("embedding_length", required=True))
        n_head = int(get("attention.head_count", required=True))
        if n_head < 1 or n_embd < 1:
            raise GGMLValueError(f"{path}: embedding_length and head_count must be >= 1")
        head_dim = int(get("attention.key_length", n_embd // n_head))
        if int(get("attention.value_length", head_dim)) != head_dim:
            raise GGMLValueError(f"{path}: key and value head sizes differ "
                                 f"({head_dim} != {get('attention.value_length')}); not supported")
        if int(get("expert_count", 0) or 0) > 0:
            raise UnknownArchitecture(f"{path}: mixture-of-experts {arch} models are not supported")
        vocab = get("vocab_size")
        if vocab is None:
            tokens = md.get("tokenizer.ggml.tokens")
            vocab = len(tokens) if tokens is not None else n_vocab
        if vocab is None:
            raise GGMLValueError(f"{path}: no vocabulary size ({arch}.vocab_size or tokenizer.ggml.tokens)")
        scaling = str(get("rope.scaling.type", "none"))
        factor = float(get("rope.scaling.factor", 0.0) or 0.0)
        freq_scale, ext_factor, attn_factor = 1.0, 0.0, 1.0
        if scaling == "linear" and factor > 0:
            freq_scale = 1.0 / factor
        elif scaling == "yarn" and factor > 0:
            freq_scale, ext_factor = 1.0 / factor, 1.0
            attn_factor = float(get("rope.scaling.attn_factor", 1.0))
        elif scaling not in ("none", "linear", "yarn"):
            raise GGMLValueError(f"{path}: rope scaling {scaling!r} is not supported (none, linear, yarn)")
        eos = md.get("tokenizer.ggml.eos_token_id")
        eos_ids = () if eos is None else (int(eos),)
        extra = md.get("tokenizer.ggml.eot_token_id")
        if extra is not None and int(extra) not in eos_ids:
            eos_ids += (int(extra),)
        window = get("attention.sliding_window")
        n_ctx_train = int(get("context_length", required=True))
        bos = md.get("tokenizer.ggml.bos_token_id")
        ft = md.get("general.file_type")
        return cls(
            arch=arch, n_vocab=int(vocab), n_ctx_train=n_ctx_train, n_embd=n_embd,
            n_layer=int(get("block_count", required=True)), n_head=n_head,
            n_head_kv=int(get("attention.head_count_kv", n_head)), head_dim=head_dim,
            n_ff=int(get("feed_forward_length", required=True)),
            rms_eps=float(get("attention.layer_norm_rms_epsilon", required=True)),
            rope_base=float(get("rope.freq_base", 10000.0)), rope_dim=int(get("rope.dimension_count", head_dim)),
            rope_mode=int(ARCHITECTURES[arch]), rope_scaling=scaling, rope_freq_scale=freq_scale,
            rope_ext_factor=ext_factor, rope_attn_factor=attn_factor,
            n_ctx_orig=int(get("rope.scaling.original_context_length", n_ctx_train)),
            sliding_window=int(window) if window else None, eos_token_ids=eos_ids,
            bos_token_id=None if bos is None else int(bos), file_type=None if ft is None else int(ft))

    def validate(self, path: str = "") -> None:
        bad = []
        if self.n_layer < 1:
            bad.append(f"block_count {self.n_layer} < 1")
        if self.n_head_kv < 1 or self.n_head % self.n_head_kv:
            bad.append(f"head_count_kv {self.n_head_kv} must divide head_count {self.n_head}")
        if self.head_dim < 1 or self.head_dim % 2:
            bad.append(f"head dimension {self.head_dim} must be even and >= 1")
        if not 0 < self.rope_dim <= self.head_dim or self.rope_dim % 2:
            bad.append(f"rope.dimension_count {self.rope_dim} must be even and in (0, {self.head_dim}]")
        if self.n_vocab < 1 or self.n_ff < 1:
            bad.append("vocab_size and feed_forward_length must be >= 1")
        if not self.rms_eps > 0:
            bad.append(f"layer_norm_rms_epsilon {self.rms_eps} must be > 0")
        if bad:
            raise GGMLValueError(f"{path}: bad hyperparameters: " + "; ".join(bad))


@dataclass
class BuiltGraph:
    """One forward graph and its input tensors (set them after the scheduler allocated the graph)."""

    ctx: Context
    graph: Graph
    tokens: Tensor
    positions: Tensor
    kv_idx: Tensor
    kv_mask: Tensor
    out_ids: Tensor
    output: Tensor           # logits (n_vocab, n_out) or hidden states (n_embd, n_out) for embeddings
    n_tokens: int
    n_out: int
    key: tuple = ()

    def set_inputs(self, tokens, positions, plan, out_ids) -> None:
        """Fill the inputs: token ids, positions, the cache plan's slots and mask, the output rows."""
        self.tokens.set(np.asarray(tokens, dtype=np.int32))
        self.positions.set(np.asarray(positions, dtype=np.int32))
        self.kv_idx.set(np.asarray(plan.slots, dtype=np.int64))
        self.kv_mask.set(plan.mask)
        self.out_ids.set(np.asarray(out_ids, dtype=np.int32))

    def free(self) -> None:
        self.ctx.free()


def _size_label(n: int) -> str:
    """``110M``, ``1.1B``, ``7B``; one decimal below 10 of the unit."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale or unit == "K":
            v = n / scale
            return (f"{v:.1f}" if v < 10 else f"{v:.0f}").replace(".0", "") + unit
    return str(n)


class LlamaModel:
    """A llama-family model: weights on their devices plus the graph builder.

    Parameters
    ----------
    reader : ggmlpy.gguf.GGUFReader
        The open file (metadata and tensor infos; data is read by :meth:`load`).
    placement : ggmlpy.backend.Placement, optional
        Which device holds each layer; default: everything on the CPU.

    Attributes
    ----------
    config : LlamaConfig
    weights : ggmlpy.backend.Weights
    report : ggmlpy.backend.MemoryReport
        Weight bytes per device and layer (cache and graph are added by the runner).
    desc : str
        llama-bench's model description, e.g. ``"llama 110M F16"``.
    size, n_params, n_vocab : int
        Bytes and number of weight values; vocabulary size.
    """

    def __init__(self, reader, placement: Optional[Placement] = None) -> None:
        self.path = str(reader.path)
        self.config = cfg = _config(reader, self.path)
        if placement is None:
            placement = split_layers(cfg.n_layer, choose_devices("cpu"))
        if placement.n_layers != cfg.n_layer:
            raise GGMLValueError(f"{self.path}: placement has {placement.n_layers} layers, the model {cfg.n_layer}")
        self.placement = placement
        self._reader = reader
        self.tied_output = "output.weight" not in reader
        self.has_rope_freqs = "rope_freqs.weight" in reader
        self.qkv_bias = "blk.0.attn_q.bias" in reader
        self.weights = Weights(placement, max_tensors=16 * cfg.n_layer + 8)
        self.report: MemoryReport = self.weights.report
        try:
            for name, ne, group, types in self._expected():
                self._add(reader, name, ne, group, types)
            self.weights.allocate()
        except BaseException:
            self.weights.close()
            raise
        self.n_params = sum(int(np.prod(t.ne)) for t, _ in self.weights.tensors.values())
        self.size = sum(t.nbytes for t, _ in self.weights.tensors.values())
        self.n_vocab = cfg.n_vocab
        ft = _FTYPE_NAMES.get(cfg.file_type) if cfg.file_type is not None else None
        if ft is None:
            ft = self.weights["blk.0.attn_q.weight"].type.name
        self.desc = f"{cfg.arch} {_size_label(self.n_params)} {ft}"
        self.loaded = False
        self._closed = False

    # ------------------------------------------------------------------ weights

    def _expected(self):
        """(name, ne, group, allowed types or None) of every tensor this model reads."""
        c = self.config
        n_q, n_kv = c.n_head * c.head_dim, c.n_head_kv * c.head_dim
        yield "token_embd.weight", (c.n_embd, c.n_vocab), "input", None
        yield "output_norm.weight", (c.n_embd,), "output", (Type.F32,)
        if not self.tied_output:
            yield "output.weight", (c.n_embd, c.n_vocab), "output", None
        if self.has_rope_freqs:
            yield "rope_freqs.weight", (c.rope_dim // 2,), "input", (Type.F32,)
        for i in range(c.n_layer):
            p = f"blk.{i}."
            yield p + "attn_norm.weight", (c.n_embd,), i, (Type.F32,)
            yield p + "attn_q.weight", (c.n_embd, n_q), i, None
            yield p + "attn_k.weight", (c.n_embd, n_kv), i, None
            yield p + "attn_v.weight", (c.n_embd, n_kv), i, None
            if self.qkv_bias:
                yield p + "attn_q.bias", (n_q,), i, (Type.F32,)
                yield p + "attn_k.bias", (n_kv,), i, (Type.F32,)
                yield p + "attn_v.bias", (n_kv,), i, (Type.F32,)
            yield p + "attn_output.weight", (n_q, c.n_embd), i, None
            yield p + "ffn_norm.weight", (c.n_embd,), i, (Type.F32,)
            yield p + "ffn_gate.weight", (c.n_embd, c.n_ff), i, None
            yield p + "ffn_up.weight", (c.n_embd, c.n_ff), i, None
            yield p + "ffn_down.weight", (c.n_ff, c.n_embd), i, None

    def _add(self, reader, name, ne, group, types) -> None:
        if name not in reader:
            raise MissingTensor(f"{self.path}: tensor {name!r} is missing ({self.config.arch} needs it)")
        info = reader.tensor_info(name)
        got = tuple(info.ne) + (1,) * (len(ne) - len(info.ne))
        if got[:len(ne)] != tuple(ne) or any(d != 1 for d in got[len(ne):]):
            raise MissingTensor(f"{self.path}: tensor {name!r} has ne={tuple(info.ne)}, expected {tuple(ne)}")
        if types is not None and info.type not in types:
            raise MissingTensor(f"{self.path}: tensor {name!r} is {info.type.name}, expected "
                                f"{'/'.join(t.name for t in types)}")
        self.weights.add(name, info.type, ne, group)

    def load(self, progress: Optional[Callable[[int, int], None]] = None) -> None:
        """Read every tensor's data from the file into its buffer.

        Host tensors are filled with ``readinto`` straight into their memory
        (no intermediate copy, so peak RSS stays near the model's size); device
        tensors are written in chunks. ``progress(done_bytes, total_bytes)``
        is called as data arrives.
        """
        total = self.size
        done = 0
        chunk = 16 << 20
        with open(self.path, "rb", buffering=0) as f:
            for name, (t, _grp) in self.weights.tensors.items():
                info = self._reader.tensor_info(name)
                if info.nbytes != t.nbytes:
                    raise MissingTensor(f"{self.path}: tensor {name!r} holds {info.nbytes} bytes, expected {t.nbytes}")
                f.seek(info.offset)
                if t.is_host:
                    dst = memoryview(t.numpy()).cast("B")
                    pos = 0
                    while pos < t.nbytes:
                        n = f.readinto(dst[pos:pos + chunk])
                        if not n:
                            raise GGMLValueError(f"{self.path}: file ends inside tensor {name!r}")
                        pos += n
                        if progress is not None:
                            progress(done + pos, total)
                    del dst
                else:
                    buf = bytearray(min(chunk, t.nbytes))
                    pos = 0
                    while pos < t.nbytes:
                        view = memoryview(buf)[:min(chunk, t.nbytes - pos)]
                        n = f.readinto(view)
                        if n != len(view):
                            raise GGMLValueError(f"{self.path}: file ends inside tensor {name!r}")
                        t.set_bytes(view, pos)
                        pos += n
                        if progress is not None:
                            progress(done + pos, total)
                done += t.nbytes
                if progress is not None:
                    progress(done, total)
        self.loaded = True

    # ------------------------------------------------------------------ graph

    def rope(self, ctx: Context, x: Tensor, pos: Tensor, freq_factors: Optional[Tensor]) -> Tensor:
        c = self.config
        return ctx.rope_ext(x, pos, freq_factors, n_dims=c.rope_dim, mode=c.rope_mode, n_ctx_orig=c.n_ctx_orig,
                            freq_base=c.rope_base, freq_scale=c.rope_freq_scale, ext_factor=c.rope_ext_factor,
                            attn_factor=c.rope_attn_factor)

    def shift_fn(self, ctx: Context, layer: int, k: Tensor, offsets: Tensor) -> Tensor:
        """The cache's key shift: RoPE by the position delta (same settings as the forward pass)."""
        ff = self.weights["rope_freqs.weight"] if self.has_rope_freqs else None
        return self.rope(ctx, k, offsets, ff)

    def graph_size(self) -> int:
        """Nodes plus leafs a forward graph may use (with headroom)."""
        return 64 * self.config.n_layer + 256

    def build(self, cache, plan, n_tokens: int, n_out: int, *, flash_attn: bool = False,
              embeddings: bool = False) -> BuiltGraph:
        """Build the forward graph for a batch of ``n_tokens`` through ``cache`` with ``plan``.

        ``n_out`` rows produce output (selected by the ``out_ids`` input). The result is the logits ``ne = (n_vocab,
        n_out)``, or with ``embeddings`` the final-normed hidden states
        ``ne = (n_embd, n_out)``. Inputs are created unallocated: allocate
        the graph with the scheduler, then :meth:`BuiltGraph.set_inputs`.
        """
        c = self.config
        w = self.weights
        n = int(n_tokens)
        if not 1 <= n_out <= n:
            raise GGMLValueError(f"build: n_out {n_out} must be in [1, n_tokens={n}]")
        size = self.graph_size()
        ctx = Context.for_tensors(size, graph_size=size, no_alloc=True)
        tokens = ctx.new_tensor(Type.I32, (n,), name="inp_tokens").set_input()
        pos = ctx.new_tensor(Type.I32, (n,), name="inp_pos").set_input()
        kv_idx = ctx.new_tensor(Type.I64, (n,), name="kv_slots").set_input()
        kv_mask = ctx.new_tensor(Type.F16, (plan.n_kv, n), name="kv_mask").set_input()
        # always present (even when every row is output) so that every graph has the topology the
        # worst-case reservation measured
        out_ids = ctx.new_tensor(Type.I32, (n_out,), name="inp_out_ids").set_input()
        ff = w["rope_freqs.weight"] if self.has_rope_freqs else None
        scale = 1.0 / math.sqrt(c.head_dim)
        pending = []
        x = ctx.get_rows(w["token_embd.weight"], tokens)
        for il in range(c.n_layer):
            p = f"blk.{il}."
            cur = ctx.mul(ctx.rms_norm(x, c.rms_eps), w[p + "attn_norm.weight"])
            q = ctx.mul_mat(w[p + "attn_q.weight"], cur)
            k = ctx.mul_mat(w[p + "attn_k.weight"], cur)
            v = ctx.mul_mat(w[p + "attn_v.weight"], cur)
            if self.qkv_bias:
                q = ctx.add(q, w[p + "attn_q.bias"])
                k = ctx.add(k, w[p + "attn_k.bias"])
                v = ctx.add(v, w[p + "attn_v.bias"])
            q = self.rope(ctx, ctx.reshape(q, (c.head_dim, c.n_head, n)), pos, ff)
            k = self.rope(ctx, ctx.reshape(k, (c.head_dim, c.n_head_kv, n)), pos, ff)
            v = ctx.reshape(v, (c.head_dim, c.n_head_kv, n))
            pending.extend(cache.put(ctx, il, plan, k, v, idx=kv_idx))
            kv_k, kv_v, mask = cache.get(ctx, il, plan, mask=kv_mask)
            qp = ctx.permute(q, 0, 2, 1, 3)                      # (head_dim, n, n_head)
            if flash_attn:
                o = ctx.flash_attn_ext(qp, kv_k, kv_v, mask, scale=scale)     # (head_dim, n_head, n)
                o = ctx.reshape(o, (c.head_dim * c.n_head, n))
            else:
                kq = ctx.soft_max_ext(ctx.mul_mat(kv_k, qp), mask, scale=scale)   # (n_kv, n, n_head)
                if cache.v_trans:
                    o = ctx.mul_mat(kv_v, kq)                                   # (head_dim, n, n_head)
                else:
                    o = ctx.mul_mat(ctx.cont(ctx.permute(kv_v, 1, 0, 2, 3)), kq)
                o = ctx.cont(ctx.permute(o, 0, 2, 1, 3), (c.head_dim * c.n_head, n))
            o = ctx.mul_mat(w[p + "attn_output.weight"], o)
            if il == c.n_layer - 1:
                # only the rows that produce output go further
                o = ctx.get_rows(o, out_ids)
                x = ctx.get_rows(x, out_ids)
            x = ctx.add(x, o)
            cur = ctx.mul(ctx.rms_norm(x, c.rms_eps), w[p + "ffn_norm.weight"])
            gate = ctx.mul_mat(w[p + "ffn_gate.weight"], cur)
            up = ctx.mul_mat(w[p + "ffn_up.weight"], cur)
            x = ctx.add(x, ctx.mul_mat(w[p + "ffn_down.weight"], ctx.swiglu_split(gate, up)))
        x = ctx.mul(ctx.rms_norm(x, c.rms_eps), w["output_norm.weight"])
        if embeddings:
            out = x
        else:
            out = ctx.mul_mat(w["token_embd.weight" if self.tied_output else "output.weight"], x)
        out.set_output()
        gf = ctx.new_graph(size)
        for t in pending:                 # cache writes before anything reads the cache
            gf.build_forward_expand(t)
        gf.build_forward_expand(out)
        return BuiltGraph(ctx, gf, tokens, pos, kv_idx, kv_mask, out_ids, out, n, n_out)

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

    def close(self) -> None:
        """Free the weights (and close the file reader)."""
        if self._closed:
            return
        self._closed = True
        self.weights.close()
        close = getattr(self._reader, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> LlamaModel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        c = self.config
        return (f"LlamaModel({getattr(self, 'desc', self.path)!r}, n_layer={c.n_layer}, n_embd={c.n_embd}, n_head={c.n_head}/"
                f"{c.n_head_kv}, n_vocab={c.n_vocab}, {self.placement.summary()})")


def _config(reader, path: str) -> LlamaConfig:
    """The checked configuration of an open GGUF file (vocabulary size from ``token_embd`` if needed)."""
    emb = reader.tensor_info("token_embd.weight") if "token_embd.weight" in reader else None
    cfg = LlamaConfig.from_metadata(reader.metadata, path, n_vocab=emb.ne[1] if emb else None)
    cfg.validate(path)
    return cfg


def load_model(path: str | os.PathLike, devices: str | Sequence[str] = "cpu", n_gpu_layers: int = -1,
               progress: Optional[Callable[[int, int], None]] = None, rpc: Sequence[str] = (),
               load: bool = True) -> LlamaModel:
    """Open a GGUF file, place and allocate its weights, and load them.

    Parameters
    ----------
    path : the GGUF file
    devices : ``"cpu"``, ``"auto"`` or device names (see :func:`ggmlpy.backend.choose_devices`)
    n_gpu_layers : how many of the last layers go to accelerators (-1: all)
    progress : ``progress(done_bytes, total_bytes)`` while loading (e.g. ``backend.ProgressBar()``)
    rpc : RPC server endpoints to add
    load : False to stop after allocation (the memory report is then available; call ``model.load()``)

    Raises
    ------
    FileNotFoundError, ggmlpy.gguf.GGUFError
        No file, or not a valid GGUF file.
    UnknownArchitecture, MissingTensor, GGMLValueError
        The file is not a llama-family model this module can build.
    GGMLMemoryError
        A device has no room for its weights (``.report`` says what was needed).
    """
    from ggmlpy import gguf

    reader = gguf.GGUFReader(path)
    try:
        n_layer = _config(reader, str(path)).n_layer      # the placement needs the layer count first
        devs = choose_devices(devices, rpc=rpc)
        placement = split_layers(n_layer, devs, n_gpu_layers)
        model = LlamaModel(reader, placement)
    except BaseException:
        reader.close()
        raise
    if load:
        try:
            model.load(progress)
        except BaseException:
            model.close()
            raise
    return model



