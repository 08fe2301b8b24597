"""GGUF tensors to placed buffers: the weights of a model or a vision encoder, created, allocated, loaded.

* :class:`Weights` creates each tensor on its device (the layer group's, or a tensor override's; an extra
  buffer type such as ``CPU_REPACK`` or ``AMX`` where a matrix product supports it) and allocates one
  buffer per device and buffer type (:meth:`Weights.allocate`) *before* any data is read, so memory is
  reported and refused early; :func:`weight_buffer_allowed` and :func:`amx_usable` say which extra
  buffer types weights may use.
* :class:`MetaReader` reads a file's hyperparameters with type and range checks; :func:`check_tensor`,
  :func:`check_all_used` and :func:`check_expert_shapes` hold the file's tensor table to them
  (:class:`MissingTensor`).
* :class:`WeightLoader` reads a model's data from its GGUF file into those tensors, sampling every
  tensor for finite, plausible values (:func:`_check_sample`) and, with ``check_tensors``, checking
  every row (:func:`_check_finite`).

Used by the text models (:mod:`ggmlpy.models`) and the vision encoders (:mod:`ggmlpy.vision`).
:mod:`ggmlpy.backend` re-exports :class:`Weights` and its helpers under their older names.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import Any, Callable, Optional

import numpy as np

from ggmlpy import _core
from ggmlpy._core import (
    BufferUsage,
    Context,
    Device,
    GGMLMemoryError,
    GGMLValueError,
    Tensor,
    Type,
    dequantize,
)
from ggmlpy.backend import Placement
from ggmlpy.gguf import (
    _REQUIRED,
    GGUFError,
    MetadataError,
    meta_float,
    meta_int,
    meta_str,
    open_data,
)
from ggmlpy.memory import Group, MemoryReport, advise_huge_pages

log = logging.getLogger("ggmlpy")

__all__ = [
    "KNOWN_BAD_WEIGHT_BUFFERS", "MetaReader", "MissingTensor", "WeightLoader", "Weights", "amx_usable",
    "check_all_used", "check_expert_shapes", "check_tensor", "weight_buffer_allowed",
]


# ---------------------------------------------------------------------------------------------- placed buffers

#: (buffer type, weight type) pairs never used for weights although ggml offers them: on Intel Sapphire
#: Rapids, ggml 0.25.3's AMX matrix product segfaults for Q8_0 weights with any batch of two or more tokens
#: (upstream llama.cpp issue #20824). A weight is placed once for all batch sizes, so Q8_0 stays off AMX.
KNOWN_BAD_WEIGHT_BUFFERS: frozenset[tuple[str, str]] = frozenset({("AMX", "Q8_0")})

#: A child's check that ggml's AMX kernels run here (see :func:`amx_usable`): a tiny Q4_0 model's prompt and
#: one-token steps with its matrices in the AMX buffer.
_AMX_CHECK = """
import sys, tempfile, os, numpy as np
from ggmlpy.models import load_model
from ggmlpy.models.synthetic import write_synthetic
from ggmlpy.runner import Runner
with tempfile.TemporaryDirectory() as d:
    m = load_model(write_synthetic(os.path.join(d, "amx.gguf"), "tiny", "Q4_0"))
    if not any(bt == "AMX" for sizes in m.weights.buffer_sizes().values() for bt in sizes):
        sys.exit(3)
    with m, Runner(m, n_ctx=64, n_threads=1) as rt:
        rt.decode(np.arange(1, 40, dtype=np.int32), seq=0, logits="last")
        rt.decode([7], seq=0, logits="last")
"""

_amx_ok: bool | None = None
_amx_lock = threading.Lock()


def amx_usable() -> bool:
    """Whether ggml's AMX matrix kernels run on this machine; the CPU's ``AMX`` buffer type is used for
    weights only then.

    Some virtual machines report AMX (CPUID, and the kernel grants the tile permission) yet fault on
    tile instructions inside ggml's kernels (SIGILL at ``tileloadd``, seen on a Firecracker guest of a
    Sapphire Rapids host), which would kill the process at its first matrix product. So the first
    model that could use AMX runs ggml's AMX kernels once in a child process (about a second); the
    verdict holds for the process and goes to child processes through ``GGMLPY_AMX``, which a user
    may also set: ``1`` to trust the CPU, ``0`` to never use AMX.
    """
    global _amx_ok
    with _amx_lock:
        if _amx_ok is None:
            env = os.environ.get("GGMLPY_AMX")
            if env in ("0", "1"):
                _amx_ok = env == "1"
            else:
                try:
                    r = subprocess.run([sys.executable, "-c", _AMX_CHECK],
                                       env={**os.environ, "GGMLPY_AMX": "1", "GGMLPY_KERNELS": "own"},
                                       stdin=subprocess.DEVNULL, capture_output=True, timeout=300)
                    _amx_ok = r.returncode == 0
                except (OSError, subprocess.SubprocessError):
                    _amx_ok = False
                if not _amx_ok:
                    log.warning("ggml's AMX kernels fault on this machine (checked in a child process): "
                                "weights stay off the AMX buffer type (GGMLPY_AMX=1 overrides)")
                os.environ["GGMLPY_AMX"] = "1" if _amx_ok else "0"
        return _amx_ok


def weight_buffer_allowed(buffer_type: str, type: str) -> bool:
    """Whether weights of ``type`` may go to the extra buffer type ``buffer_type`` (names): not a pair of
    :data:`KNOWN_BAD_WEIGHT_BUFFERS`, and ``AMX`` only where :func:`amx_usable`."""
    return (buffer_type, type) not in KNOWN_BAD_WEIGHT_BUFFERS and (buffer_type != "AMX" or amx_usable())


#: Rows of the activation matrix in the op a weight is tested with (llama.cpp's loader uses 512 too):
#: large enough that every kernel a buffer type has for a batch is in play.
_PROBE_BATCH = 512


class Weights:
    """A model's weight tensors, created on their devices, allocated, then loaded.

    Creating (:meth:`add`) and allocating (:meth:`allocate`) are separate from
    loading (:meth:`load`), as in Ollama: the memory report exists before any
    data is read, and an allocation failure costs no I/O.

    With ``repack`` (the default, as llama.cpp's ``--repack 1``), a weight that
    a matrix product reads (``add(..., op="mul_mat")``, or a stack of experts that
    ``mul_mat_id`` reads: ``op="mul_mat_id"``) goes to the first of its
    device's extra buffer types (:meth:`ggmlpy.Device.extra_buffer_types`:
    ``AMX``, ``CPU_REPACK``...) that supports that product for its type and
    shape: ggml rearranges it there for its interleaved kernels (Q4_0 on an
    AVX-512 CPU: 1.8x the prompt and 1.6x the generation speed; Q4_K: faster
    generation, but slower prompts than ggml's tiled kernel for plain weights,
    bench/README.md). Such weights cannot be read back
    (:attr:`ggmlpy.Tensor.is_repacked`). Pairs in
    :data:`KNOWN_BAD_WEIGHT_BUFFERS` are never used, nor ``AMX`` where
    :func:`amx_usable` finds ggml's AMX kernels faulting. Every other weight, and
    every weight with ``repack=False``, goes to its device's own memory.

    Parameters
    ----------
    placement : Placement
    max_tensors : int
        Upper bound on the number of tensors (sizes the metadata contexts).
    report : MemoryReport, optional
        Where weight bytes are recorded (a new one by default).
    repack : bool
        Use the devices' extra buffer types for the weights they support.
    overrides : bool
        Apply the placement's tensor overrides (a vision encoder's weights do not: llama.cpp's ``-ot``
        applies to the text model only).

    Attributes
    ----------
    overridden : dict of str to str
        Each weight a tensor override placed, and its device's name.
    """

    def __init__(self, placement: Placement, max_tensors: int, report: MemoryReport | None = None,
                 repack: bool = True, overrides: bool = True):
        self.placement = placement
        self.overrides = bool(overrides)
        self.overridden: dict[str, str] = {}
        self.report = report if report is not None else MemoryReport(placement.n_layers)
        self.repack = bool(repack)
        # one context and one buffer per (device, buffer type)
        self._ctx: dict[tuple[str, str], Context] = {}
        self._bt: dict[tuple[str, str], tuple[Device, _core.BufferType]] = {}
        self._max = max_tensors
        self._extra: dict[str, list[_core.BufferType]] = {}
        self._choice: dict[tuple, _core.BufferType] = {}
        self.tensors: dict[str, tuple[Tensor, Group]] = {}
        self._key: dict[str, tuple[str, str]] = {}          # tensor name -> (device, buffer type)
        self.buffers: dict[tuple[str, str], _core.Buffer] = {}
        self.allocated = False
        self._recorded: list[tuple] = []      # (device, group, buffer type, bytes) put in the report

    def add(self, name: str, type: Type | str, ne: Sequence[int], group: Group, op: str | None = None,
            names: Sequence[str] | None = None) -> Tensor:
        """Create tensor ``name`` (ggml ``ne`` order) on the device of layer group ``group``, or where a
        tensor override matching one of ``names`` (default: ``name``; a fused weight's parts; ``()``
        for none) sends it.

        ``op`` says how the model reads it: ``"mul_mat"`` (as the first operand
        of a matrix product, and nothing else) or ``"mul_mat_id"`` (a 3-d stack
        of experts, as the first operand of ``mul_mat_id``) lets it go to an
        extra buffer type; anything else keeps it in the device's own memory.
        """
        if self.allocated:
            raise GGMLValueError("weights_add: the weights are allocated already; add every tensor first")
        if name in self.tensors:
            raise GGMLValueError(f"weights_add: tensor {name!r} exists already")
        if op not in (None, "mul_mat", "mul_mat_id"):
            raise GGMLValueError(f"weights_add: op must be None, 'mul_mat' or 'mul_mat_id' (got {op!r})")
        dev = self._device(group, (name,) if names is None else names)
        bt = self._buffer_type(dev, Type[type.upper()] if isinstance(type, str) else Type(type), tuple(ne), op)
        if dev != self.placement.device_of(group):
            self.overridden[name] = dev.name
        key = (dev.name, bt.name)
        ctx = self._ctx.get(key)
        if ctx is None:
            ctx = self._ctx[key] = Context.for_tensors(self._max, no_alloc=True)
            self._bt[key] = (dev, bt)
        t = ctx.new_tensor(type, ne, name=name)
        self.tensors[name] = (t, group)
        self._key[name] = key
        return t

    def _device(self, group: Group, names: Sequence[str]) -> Device:
        return self.placement.device_for(group, names) if self.overrides else self.placement.device_of(group)

    def where(self, type: Type | str, ne: Sequence[int], group: Group, op: str | None = None,
              names: Sequence[str] = ()) -> tuple[str, str]:
        """The (device, buffer type) names that :meth:`add` with these arguments would place a tensor in."""
        dev = self._device(group, names)
        return dev.name, self._buffer_type(dev, Type[type.upper()] if isinstance(type, str) else Type(type),
                                           tuple(ne), op).name

    def _buffer_type(self, dev: Device, type: Type, ne: tuple, op: str | None) -> _core.BufferType:
        if not self.repack or (op, len(ne)) not in (("mul_mat", 2), ("mul_mat_id", 3)):
            return dev.buffer_type()
        key = (dev.name, type, ne)
        bt = self._choice.get(key)
        if bt is None:
            bt = self._choice[key] = self._first_supporting(dev, type, ne, op)
        return bt

    def _first_supporting(self, dev: Device, type: Type, ne: tuple, op: str) -> _core.BufferType:
        extra = self._extra.get(dev.name)
        if extra is None:
            extra = self._extra[dev.name] = dev.extra_buffer_types()
        for bt in extra:
            if not weight_buffer_allowed(bt.name, type.name):
                continue
            probe = Context.for_tensors(4, no_alloc=True)
            try:
                w = probe.new_tensor(type, ne)
                if op == "mul_mat":
                    product = probe.mul_mat(w, probe.new_tensor(Type.F32, (ne[0], _PROBE_BATCH)))
                else:       # one input row per token shared by its experts, two experts each (as the models)
                    x = probe.new_tensor(Type.F32, (ne[0], 1, _PROBE_BATCH))
                    product = probe.mul_mat_id(w, x, probe.new_tensor(Type.I32, (min(2, ne[2]), _PROBE_BATCH)))
                if dev.supports_weight(bt, product):
                    return bt
            finally:
                probe.free()
        return dev.buffer_type()

    def __getitem__(self, name: str) -> Tensor:
        return self.tensors[name][0]

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def buffer_sizes(self) -> dict[str, dict[str, int]]:
        """Bytes of weights per device and buffer type, e.g. ``{"CPU": {"CPU": 1024, "CPU_REPACK": 4096}}``
        (what llama.cpp logs as ``CPU_REPACK model buffer size``); allocated or not."""
        out: dict[str, dict[str, int]] = {}
        for (dname, bname), ctx in self._ctx.items():
            _dev, bt = self._bt[(dname, bname)]
            out.setdefault(dname, {})[bname] = sum(self._reserved(bt, t) for t in ctx.tensors())
        return out

    @staticmethod
    def _reserved(bt: _core.BufferType, t: Tensor) -> int:
        # what ggml_backend_alloc_ctx_tensors_from_buft reserves for each tensor
        align = bt.alignment
        return -(-bt.alloc_size(t) // align) * align

    def allocate(self) -> MemoryReport:
        """Allocate one WEIGHTS buffer per device and buffer type.

        Raises
        ------
        GGMLMemoryError
            A device had no room. ``.report`` says what every device needed;
            nothing stays allocated.
        """
        # a retry after a failed allocation starts afresh: what this set recorded before is taken back (a
        # report may be shared, e.g. by a text model and its vision encoder)
        for dev, grp, bname, size in self._recorded:
            m = self.report.device(dev)
            for d, k in ((m.weights, grp), (m.weight_buffers, bname)):
                d[k] -= size
                if not d[k]:
                    del d[k]
        self._recorded = []
        for dev in {d.name: d for d, _bt in self._bt.values()}.values():
            self.report.device(dev).weights_ok = None
        for name, (t, grp) in self.tensors.items():
            dev, bt = self._bt[self._key[name]]
            size = self._reserved(bt, t)
            self.report.add_weights(dev, grp, size)
            m = self.report.device(dev)
            m.weight_buffers[bt.name] = m.weight_buffers.get(bt.name, 0) + size
            self._recorded.append((dev, grp, bt.name, size))
        failed = None
        for key, ctx in self._ctx.items():
            dev, bt = self._bt[key]
            try:
                buf = _core.alloc_ctx_tensors(ctx, bt)
            except MemoryError as e:
                self.report.device(dev).weights_ok = False
                failed = failed or e
                continue
            buf.usage = BufferUsage.WEIGHTS
            advise_huge_pages(buf)              # before the weights are read into it
            self.buffers[key] = buf
            if self.report.device(dev).weights_ok is not False:
                self.report.device(dev).weights_ok = True
        if failed is not None:
            self.close()
            raise GGMLMemoryError(f"weights: allocation failed ({failed})\n{self.report}", self.report)
        self.allocated = True
        for dname in {d.name for d, _bt in self._bt.values()}:
            for bname, n in self.report.devices[dname].weight_buffers.items():
                log.info("%s: %s weight buffer %.2f MiB", dname, bname, n / 2**20)
        return self.report

    def load(self, source: Callable[[str], np.ndarray], progress: Callable[[int, int], None] | None = None) -> None:
        """Fill every tensor from ``source(name)`` (numpy order, float data is converted to the tensor's type).

        ``progress(done_bytes, total_bytes)`` is called after each tensor.
        """
        if not self.allocated:
            raise GGMLValueError("weights_load: call allocate() first")
        total = sum(t.nbytes for t, _ in self.tensors.values())
        done = 0
        for name, (t, _grp) in self.tensors.items():
            t.set(source(name))
            done += t.nbytes
            if progress is not None:
                progress(done, total)

    def close(self) -> None:
        """Free the weights' contexts and buffers."""
        for ctx in self._ctx.values():
            ctx.free()
        for buf in self.buffers.values():
            buf.free()
        self.buffers.clear()
        self.allocated = False


# ---------------------------------------------------------------------------------------------- the file's tensors


class MissingTensor(GGMLValueError):
    """A tensor the architecture needs is not in the file, or has the wrong shape or type."""


class MetaReader:
    """Checked reads of one file's metadata for architecture ``arch``.

    A key is relative to the architecture (``"block_count"`` reads ``{arch}.block_count``) unless it
    starts with ``general.`` or ``tokenizer.``. Every error names the full key and the file.

    Examples
    --------
    >>> m = MetaReader({"general.architecture": "llama", "llama.block_count": 2}, "llama", "m.gguf")
    >>> m.geti("block_count", lo=1), m.getf("rope.freq_base", 10000.0)
    (2, 10000.0)
    >>> m.geti("embedding_length")
    Traceback (most recent call last):
    ...
    ggmlpy.gguf.MetadataError: m.gguf: metadata 'llama.embedding_length': is missing
    """

    #: Keys llama.cpp also takes as an array (one value per layer). The layers built here are uniform,
    #: so such an array must hold one value.
    PER_LAYER = frozenset({"attention.head_count", "attention.head_count_kv", "feed_forward_length"})

    def __init__(self, md: Any, arch: str, path: str = "") -> None:
        self.md, self.arch, self.path = md, arch, path

    def key(self, key: str) -> str:
        """The full key: ``{arch}.{key}``, or ``key`` itself for ``general.*`` and ``tokenizer.*``."""
        return key if key.startswith(("general.", "tokenizer.")) else f"{self.arch}.{key}"

    def __contains__(self, key: str) -> bool:
        return self.key(key) in self.md

    def geti(self, key: str, default: Any = _REQUIRED, lo: Optional[int] = None, hi: Optional[int] = None) -> Any:
        """Integer ``key`` in ``[lo, hi]``, or ``default`` when absent (no default: required).

        Raises
        ------
        ggmlpy.gguf.MetadataError, ggmlpy.gguf.MetadataTypeError
            Missing, out of range, or not an integer.
        """
        return meta_int(self.md, self.key(key), default, lo=lo, hi=hi, path=self.path,
                        per_layer=key in self.PER_LAYER)

    def getf(self, key: str, default: Any = _REQUIRED, lo: Optional[float] = None, hi: Optional[float] = None,
             lo_open: bool = False) -> Any:
        """Finite real ``key`` in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``), or ``default``; raises as
        :meth:`geti`."""
        return meta_float(self.md, self.key(key), default, lo=lo, hi=hi, lo_open=lo_open, path=self.path,
                          per_layer=key in self.PER_LAYER)

    def gets(self, key: str, default: Any = _REQUIRED) -> Any:
        """String ``key``, or ``default``; raises as :meth:`geti`."""
        return meta_str(self.md, self.key(key), default, path=self.path)


def check_expert_shapes(reader, cfg, path: str, ff_key: str) -> None:
    """Check the expert count and width (from ``ff_key``) against layer 0's router and gate experts.

    Raises
    ------
    MetadataError
        Naming the key whose value the tensor's shape contradicts.
    """
    a = cfg.arch
    for key, want, tname, dim in ((f"{a}.expert_count", cfg.n_expert, "blk.0.ffn_gate_inp.weight", 1),
                                  (ff_key, cfg.n_ff_exp, "blk.0.ffn_gate_exps.weight", 1),
                                  (f"{a}.expert_count", cfg.n_expert, "blk.0.ffn_gate_exps.weight", 2)):
        ne = reader.tensor_info(tname).ne if tname in reader else None
        if ne is not None and len(ne) > dim and ne[dim] != want:
            raise MetadataError(path, key, f"the metadata gives {want}, but {tname} has ne={tuple(ne)}")


def check_tensor(reader, path: str, needed_by: str, name: str, ne: tuple, types) -> None:
    """Tensor ``name`` of an open file is there, of shape ``ne`` (trailing 1s aside) and of one of ``types``
    (None: any float or quantized type); else :class:`MissingTensor` naming it and ``needed_by``."""
    if name not in reader:
        raise MissingTensor(f"{path}: tensor {name!r} is missing ({needed_by} needs it)")
    info = reader.tensor_info(name)
    got = tuple(info.ne) + (1,) * (len(ne) - len(info.ne))
    if got[:len(ne)] != tuple(ne) or any(d != 1 for d in got[len(ne):]):
        raise MissingTensor(f"{path}: tensor {name!r} has ne={tuple(info.ne)}, expected {tuple(ne)}")
    if info.type in (Type.I8, Type.I16, Type.I32, Type.I64):
        # no matrix op takes integer weights; ggml would refuse the graph much later
        raise MissingTensor(f"{path}: tensor {name!r} is {info.type.name}: weights must be float or quantized")
    if types is not None and info.type not in types:
        raise MissingTensor(f"{path}: tensor {name!r} is {info.type.name}, expected "
                            f"{'/'.join(t.name for t in types)}")


def check_all_used(reader, path: str, used, user: str, n_layer: int) -> None:
    """Every tensor of the file is in ``used``; else :class:`GGUFError`: one left over means the
    hyperparameters (block_count, a missing bias ...) do not describe the file, and ``user`` would run
    without that weight."""
    unused = [t.name for t in reader.tensors if t.name not in used]
    if unused:
        raise GGUFError(f"{path}: {len(unused)} tensor(s) of the file are not used by {user} with these "
                        f"hyperparameters (block_count {n_layer}): "
                        f"{', '.join(unused[:5])}{' ...' if len(unused) > 5 else ''}")


class WeightLoader:
    """Reading a model's weights from its GGUF file into the tensors :class:`Weights` made.

    Used by :class:`DecoderModel` and the vision encoders (:mod:`ggmlpy.vision`); the class needs
    ``path``, ``size`` (bytes to store), ``weights``, ``fused`` (a stored tensor made of several of the
    file's, in order), ``converted`` and ``_reader`` (the open :class:`~ggmlpy.gguf.GGUFReader`), and sets ``loaded``.
    """

    path: str
    size: int
    weights: Weights
    fused: dict
    _reader: Any
    loaded: bool
    #: weights stored in another form than the file's: name -> f(the file's values as a float array in
    #: numpy order) -> what to store (read only; a class sets its own)
    converted: dict = {}
    _closed: bool = False

    def close(self) -> None:
        """Free the weights (and close the file reader); safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self.weights.close()
        close = getattr(self._reader, "close", None)
        if close is not None:
            close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def load(self, progress: Optional[Callable[[int, int], None]] = None, check_tensors: bool = False,
             mmap: bool = False) -> None:
        """Read every tensor's data from the file into its buffer.

        With ``mmap`` the data is copied out of a memory map of the file (see
        :class:`ggmlpy.gguf.MappedFile`) instead of read with ``read(2)``.

        Host tensors are filled with ``readinto`` straight into their memory
        (no intermediate copy, so peak RSS stays near the model's size); device
        tensors are written in chunks. ``progress(done_bytes, total_bytes)``
        is called as data arrives.

        A few rows of every tensor are decoded first and must be finite, with
        magnitudes some model could have (see :func:`_check_sample`): NaN/inf
        weights, and F16 data re-labelled as BF16 at typical weight scales
        (median |w| below about 0.2; the two types have the same size, so the
        file's layout cannot show it), are an error, not garbage output. The
        other direction (BF16 read as F16) and re-labelled quantized types of
        the same block size are not detected. ``check_tensors=True`` checks every row for non-finite values
        too (as llama.cpp's ``--check-tensors``; it decodes the whole model, so
        it costs about one more pass over the data).

        Raises
        ------
        GGUFError
            Implausible or non-finite data (names the tensor, and the row with ``check_tensors``).
        GGMLValueError, MissingTensor
            The file ends inside a tensor, or a tensor's size disagrees with its type and shape.
        """
        total = self.size
        done = 0
        chunk = 16 << 20
        # a split model's shards are read as one file (their offsets count that way: GGUFSplitReader)
        files = getattr(self._reader, "files", ())
        with open_data(files if len(files) > 1 else self.path, mmap=mmap) as f:
            for name, (t, _grp) in self.weights.tensors.items():
                convert = self.converted.get(name)
                if convert is not None:
                    # stored in another form than the file's (a small weight, read whole)
                    info = self._reader.tensor_info(name)
                    _check_sample(f, info, self.path)
                    f.seek(info.offset)
                    raw = f.read(info.nbytes)
                    if len(raw) != info.nbytes:
                        raise GGMLValueError(f"{self.path}: file ends inside tensor {name!r}")
                    t.set(convert(_decode(raw, info.type, info.ne[0]).reshape(tuple(reversed(info.ne)))))
                    done += t.nbytes
                    continue
                # a fused weight is its parts' bytes one after the other (rows of the same width)
                infos = [self._reader.tensor_info(n) for n in self.fused.get(name, (name,))]
                if sum(i.nbytes for i in infos) != t.nbytes:
                    raise MissingTensor(f"{self.path}: tensor {name!r} holds {sum(i.nbytes for i in infos)} bytes, "
                                        f"expected {t.nbytes}")
                for info in infos:
                    _check_sample(f, info, self.path)
                if t.is_host:
                    dst = memoryview(t.numpy()).cast("B")
                    off = 0
                    for info in infos:
                        self._read_into(f, info, dst[off:off + info.nbytes], check_tensors, chunk,
                                        None if progress is None else lambda n, o=done + off: progress(o + n, total))
                        off += info.nbytes
                    del dst
                elif t.is_repacked or len(infos) > 1:
                    # a repacked weight is written in one piece (ggml converts it whole); a fused one is put
                    # together first
                    buf = bytearray(t.nbytes)
                    off = 0
                    for info in infos:
                        self._read_into(f, info, memoryview(buf)[off:off + info.nbytes], check_tensors, chunk,
                                        None if progress is None else lambda n, o=done + off: progress(o + n, total))
                        off += info.nbytes
                    t.set_bytes(buf, 0)
                    del buf
                else:
                    # whole rows, so each piece can be checked
                    info = infos[0]
                    rs = info.type.row_size(info.ne[0]) or 1
                    step = max(rs, chunk // rs * rs)
                    buf = bytearray(min(step, t.nbytes))
                    f.seek(info.offset)
                    pos = 0
                    while pos < t.nbytes:
                        view = memoryview(buf)[:min(step, t.nbytes - pos)]
                        n = f.readinto(view)
                        if n != len(view):
                            raise GGMLValueError(f"{self.path}: file ends inside tensor {name!r}")
                        if check_tensors:
                            _check_finite_rows(view, info, pos // rs, rs, chunk, self.path)
                        t.set_bytes(view, pos)
                        pos += n
                        if progress is not None:
                            progress(done + pos, total)
                done += t.nbytes
                if progress is not None:
                    progress(done, total)
        self.loaded = True

    def _read_into(self, f, info, dst: memoryview, check_tensors: bool, chunk: int,
                   progress: Optional[Callable[[int], None]]) -> None:
        """Read tensor ``info``'s bytes from ``f`` straight into ``dst`` (``progress(bytes so far)``)."""
        f.seek(info.offset)
        pos = 0
        while pos < info.nbytes:
            n = f.readinto(dst[pos:pos + chunk])
            if not n:
                raise GGMLValueError(f"{self.path}: file ends inside tensor {info.name!r}")
            pos += n
            if progress is not None:
                progress(pos)
        if check_tensors:
            _check_finite_rows(dst, info, 0, info.type.row_size(info.ne[0]) or 1, chunk, self.path)


# ---------------------------------------------------------------------------------------------- data checks

# Weights of any trained or freshly initialised model have a typical magnitude within these bounds;
# data of another type read as F16/BF16/F32 lands far outside (F16 weights of ~0.02 read as BF16 are ~1e-16).
_PLAUSIBLE_MAGNITUDE = (1e-8, 1e8)
_SAMPLE_ROWS = 4


def _decode(raw, t: Type, ne0: int) -> np.ndarray:
    """Whole rows of type ``t`` as a flat float array."""
    if t.numpy_dtype is not None:                 # F32, F16, F64
        return np.frombuffer(raw, t.numpy_dtype)
    if t == Type.BF16:
        return (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
    return dequantize(raw, t, ne0).reshape(-1)


def _check_finite_rows(data, info, first_row: int, row_size: int, chunk: int, path: str) -> None:
    """:func:`_check_finite` over ``data`` (whole rows from ``first_row``) in pieces of about ``chunk`` bytes,
    so the float32 copy a check makes stays that small whatever the tensor's size."""
    step = max(row_size, chunk // row_size * row_size)
    for at in range(0, len(data), step):
        _check_finite(data[at:at + step], info, first_row + at // row_size, path)


def _check_finite(raw, info, first_row: int, path: str) -> None:
    """Every value of the whole rows in ``raw`` (starting at row ``first_row`` of ``info``) is finite."""
    t = info.type
    if t.numpy_dtype is not None and t.numpy_dtype.kind in "iu":
        return
    ne0 = info.ne[0]
    v = _decode(raw, t, ne0)
    bad = np.flatnonzero(~np.isfinite(v))
    if bad.size:
        raise GGUFError(f"{path}: tensor {info.name!r} ({t.name}) holds non-finite values ({bad.size} in rows "
                        f"from {first_row}; the first at row {first_row + bad[0] // ne0}, column {bad[0] % ne0}: "
                        f"{v[bad[0]]}): the data is corrupt")


def _check_sample(f, info, path: str) -> None:
    """Decode a few rows of tensor ``info`` from the open file ``f`` and check they are plausible weights.

    Checked: every value is finite (NaN/inf weights, or quantized blocks with NaN/inf scales, turn every
    output into garbage), and the median magnitude of the non-zero values lies in ``_PLAUSIBLE_MAGNITUDE``.
    Integer tensors are not checked. Rows: the first, the last and some between (cheap: a few KiB each).
    """
    t = info.type
    if t.numpy_dtype is not None and t.numpy_dtype.kind in "iu":
        return
    ne0 = info.ne[0]
    rs = t.row_size(ne0)
    n_rows = info.nbytes // rs if rs else 0
    if not n_rows:
        return
    picks = sorted({(n_rows - 1) * k // (_SAMPLE_ROWS - 1) for k in range(_SAMPLE_ROWS)})
    vals = []
    for r in picks:
        f.seek(info.offset + r * rs)
        raw = f.read(rs)
        if len(raw) != rs:
            raise GGMLValueError(f"{path}: file ends inside tensor {info.name!r}")
        vals.append(_decode(raw, t, ne0))
    v = np.concatenate(vals).astype(np.float64)
    bad = ~np.isfinite(v)
    if bad.any():
        raise GGUFError(f"{path}: tensor {info.name!r} ({t.name}) holds non-finite values ({int(bad.sum())} of "
                        f"{v.size} sampled, e.g. {v[bad][0]}): the data is corrupt")
    nz = np.abs(v[v != 0])
    if nz.size:
        med = float(np.median(nz))
        lo, hi = _PLAUSIBLE_MAGNITUDE
        if not lo <= med <= hi:
            raise GGUFError(f"{path}: tensor {info.name!r} does not look like {t.name} data: the median magnitude "
                            f"of its sampled values is {med:.3g}, outside [{lo:g}, {hi:g}] (data of another type "
                            "labelled as this one?)")
