"""Devices, device choice, weight placement, scheduling with worst-case reservation, memory report.

The runtime layer over ``ggmlpy._core``'s backend handles, after Ollama's
``ml`` package and llama.cpp's ``llama-context``:

* :func:`choose_devices` picks devices (``"auto"``: GPUs first, then the CPU;
  explicit names; RPC servers by ``host:port``), and :func:`split_layers`
  assigns each layer to a device (``n_gpu_layers`` style, split by free
  memory).
* :class:`Weights` creates a model's tensors on their devices and allocates one
  buffer per device (:meth:`Weights.allocate`) *before* any data is read, so
  memory can be reported and refused early; :meth:`Weights.load` then fills
  them, reporting progress.
* :class:`Runtime` owns one backend per device and a scheduler, and
  :meth:`Runtime.reserve` reserves the worst-case graphs (prompt batch, one
  token, prompt batch again) so that later computes never allocate.
* :class:`MemoryReport` says what every device holds, per layer, and whether
  each allocation succeeded; a failed allocation raises
  :class:`~ggmlpy.GGMLMemoryError` carrying it.

Nothing here touches a C pointer: everything goes through ``_core``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import threading
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Union

import numpy as np

from ggmlpy import _core
from ggmlpy._core import (
    Backend,
    BufferUsage,
    Context,
    Device,
    GGMLMemoryError,
    GGMLValueError,
    Graph,
    Tensor,
    Type,
)

log = logging.getLogger("ggmlpy")

#: A layer group: ``"input"`` (embeddings, always on the CPU), a layer index, or ``"output"``.
Group = Union[str, int]

__all__ = [
    "DeviceMemory", "MemoryReport", "Placement", "ProgressBar", "Runtime", "Weights", "choose_devices",
    "devices", "main_accelerator", "n_cpu_moe_overrides", "parse_tensor_overrides", "split_layers",
]


def devices() -> list[Device]:
    """Every device ggml knows (compiled-in ones and added RPC servers), CPU last."""
    return _core.devices()


def choose_devices(spec: str | Sequence[str] = "auto", rpc: Iterable[str] = ()) -> list[Device]:
    """Pick devices.

    Parameters
    ----------
    spec : ``"auto"``, ``"cpu"``, or a list (or comma-separated string) of device names
        ``"auto"`` takes every local GPU and the devices of the RPC servers given
        in ``rpc`` (ggml reports them as GPUs), then the CPU; names are case-insensitive (``"CUDA0"``,
        ``"RPC0"``, ``"CPU"``).
    rpc : endpoints ``"host:port"`` of ``ggmlpy rpc-server`` processes to add first

    Returns
    -------
    list of Device, the CPU always last (ggml's scheduler needs it as fallback).

    Raises
    ------
    BackendUnavailable
        A named device is not in this build; the message gives the rebuild option.
    ConnectionError
        An RPC endpoint does not answer.
    """
    rpc_devs = [d for ep in rpc for d in _core.rpc_add_server(ep)]
    if isinstance(spec, str) and spec.lower() == "auto":
        # local accelerators, plus the RPC servers named in this call (not every
        # server added earlier in the process, which may be gone by now)
        chosen = [d for d in devices() if d.type in ("GPU", "IGPU") and d.endpoint is None] + rpc_devs
    elif isinstance(spec, str) and spec.lower() == "cpu":
        chosen = list(rpc_devs)
    else:
        names = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else list(spec)
        chosen = [_core.device(n) for n in names if n]
        chosen += [d for d in rpc_devs if d not in chosen]
    cpu = _core.device("CPU")
    out: list[Device] = []
    for d in chosen:
        if d not in out and d != cpu:
            out.append(d)
    return out + [cpu]


def main_accelerator(spec: str | Sequence[str] = "auto", index: int = 0, rpc: Iterable[str] = ()) -> list[str] | str:
    """The command lines' ``-sm none -mg INDEX`` (llama.cpp's split mode none): the ``index``-th
    accelerator of :func:`choose_devices` takes every offloaded layer. Returns the ``devices`` argument
    for :func:`ggmlpy.models.load_model`: that device's name in a list, or ``"cpu"`` when there is no
    accelerator (then ``index`` must be 0)."""
    accels = [d for d in choose_devices(spec, rpc=rpc) if d.type != "CPU"]
    if not 0 <= index < max(len(accels), 1):
        raise GGMLValueError(f"-mg {index}: there are {len(accels)} accelerators "
                             f"({', '.join(d.name for d in accels) or 'none'})")
    return [accels[index].name] if accels else "cpu"


def _override_device(name: str, option: str) -> Device:
    """The device a tensor override names: a device (``CPU``, ``Vulkan0``, ``RPC0``) or its buffer type's
    name (llama.cpp's ``-ot`` takes those: ``CUDA0``, ``RPC0[host:port]``), any case."""
    want = name.strip().lower()
    for d in devices():
        if want in (d.name.lower(), d.buffer_type().name.lower()):
            return d
    names = ", ".join(d.name for d in devices())
    raise GGMLValueError(f"{option}: unknown device or buffer type {name.strip()!r} (this process has: {names}; "
                         f"an RPC server's device exists once -rpc adds it)")


def parse_tensor_overrides(spec: str | Sequence[str | tuple[str, str | Device]] | None,
                           option: str = "tensor_overrides") -> tuple[tuple[str, Device], ...]:
    """Tensor overrides as llama.cpp's ``-ot``/``--override-tensor``: ``PATTERN=DEVICE``, comma-separated in
    a string (``"ffn_.*_exps=CPU,attn=Vulkan0"``), or a list of such strings or ``(pattern, device)`` pairs.

    A weight whose name (or, for a fused weight, a part's file name) matches ``PATTERN`` (a regular
    expression, searched as llama.cpp does) goes to ``DEVICE`` instead of its layer's device; the first
    match wins. The device is a device name or its buffer type's name, case-insensitive. Returns
    ``((pattern, Device), ...)``; every pattern is compiled and every device looked up first, so a bad one
    is refused before anything is allocated (:class:`~ggmlpy.GGMLValueError` naming it).
    """
    if spec is None:
        return ()
    items = [x for x in spec.split(",") if x.strip()] if isinstance(spec, str) else list(spec)
    out = []
    for item in items:
        if isinstance(item, str):
            pattern, eq, dev = item.partition("=")
            if not eq or not pattern or not dev.strip():
                raise GGMLValueError(f"{option}: {item!r} is not PATTERN=DEVICE (e.g. 'ffn_.*_exps=CPU')")
        else:
            pattern, dev = item
        try:
            re.compile(pattern)
        except re.error as e:
            raise GGMLValueError(f"{option}: pattern {pattern!r} is not a regular expression: {e}") from None
        out.append((pattern, dev if isinstance(dev, Device) else _override_device(str(dev), option)))
    return tuple(out)


#: The override :func:`n_cpu_moe_overrides` makes for layer ``{}`` (llama.cpp's, for --n-cpu-moe).
N_CPU_MOE_PATTERN = r"blk\.{}\.ffn_(up|down|gate|gate_up)_(ch|)exps"


def n_cpu_moe_overrides(n: int, n_layers: int) -> tuple[tuple[str, Device], ...]:
    """llama.cpp's ``--n-cpu-moe N``: the expert weights (``ffn_{up,down,gate,gate_up}_exps`` and their
    biases) of the first ``n`` of ``n_layers`` layers stay on the CPU, as overrides
    (:func:`parse_tensor_overrides`), one per layer. ``n >= n_layers``: every layer (``--cpu-moe``)."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise GGMLValueError(f"n_cpu_moe must be an integer >= 0 (got {n!r})")
    cpu = _core.device("CPU")
    return tuple((N_CPU_MOE_PATTERN.format(i), cpu) for i in range(min(int(n), n_layers)))


@dataclass
class Placement:
    """Which device holds each layer group: input (CPU), layers ``0..n_layers-1``, output; and the tensor
    overrides (:func:`parse_tensor_overrides`): weights by name on another device than their group's."""

    layers: list[Device]
    output: Device
    input: Device
    #: ``((pattern, Device), ...)``: the first pattern found in a weight's name sends it to its device
    overrides: tuple = ()

    def override_of(self, names: Sequence[str]) -> Device | None:
        """The device the first override matching any of ``names`` names (None: no override)."""
        for pattern, dev in self.overrides:
            if any(re.search(pattern, n) for n in names):
                return dev
        return None

    def device_for(self, group: Group, names: Sequence[str] = ()) -> Device:
        """Where a weight of ``group`` named ``names`` goes: its override's device, else the group's."""
        dev = self.override_of(names) if self.overrides else None
        return dev if dev is not None else self.device_of(group)

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def device_of(self, group: Group) -> Device:
        if group == "input":
            return self.input
        if group in ("output", "vision"):
            # a vision encoder (mmproj) runs where the output layer does, as in Ollama's engine
            return self.output
        if isinstance(group, int) and 0 <= group < len(self.layers):
            return self.layers[group]
        raise GGMLValueError(f"placement: no layer group {group!r} (layers 0..{len(self.layers) - 1}, input, output, "
                             f"vision)")

    def devices(self) -> list[Device]:
        """The distinct devices used, in scheduler order (CPU last)."""
        seen: list[Device] = []
        for d in [*self.layers, self.output, self.input, *(dev for _, dev in self.overrides)]:
            if d not in seen:
                seen.append(d)
        return sorted(seen, key=lambda d: d.type == "CPU")

    def summary(self) -> str:
        """llama.cpp-style one-liner: how many repeating layers each device got."""
        counts: dict[str, int] = {}
        for d in self.layers:
            counts[d.name] = counts.get(d.name, 0) + 1
        parts = [f"{n} on {name}" for name, n in counts.items()]
        ot = ""
        if self.overrides:          # (n_cpu_moe makes one per layer: counted, not listed, beyond a few)
            listed = ", ".join(f"{p}={d.name}" for p, d in self.overrides)
            ot = f"; tensor overrides {listed}" if len(self.overrides) <= 3 else \
                f"; {len(self.overrides)} tensor overrides"
        return f"{self.n_layers} layers: {', '.join(parts)}; output on {self.output.name}{ot}"


def split_layers(n_layers: int, devs: Sequence[Device], n_gpu_layers: int = -1,
                 split: str | Sequence[float] = "memory") -> Placement:
    """Assign ``n_layers`` repeating layers, the input and the output to ``devs``.

    As llama.cpp's ``-ngl``: the *last* ``n_gpu_layers`` layers go to the
    non-CPU devices (``-1``: all of them, and the output too when every layer
    is offloaded); the rest and the input embeddings stay on the CPU. Among
    several accelerators the layers are split by free memory (``"memory"``),
    evenly (``"count"``), or by explicit proportions (a list of floats).
    """
    if n_layers < 0:
        raise GGMLValueError(f"split_layers: n_layers must be >= 0 (got {n_layers})")
    cpu = _core.device("CPU")
    accel = [d for d in devs if d != cpu]
    n_off = n_layers if n_gpu_layers < 0 else min(n_gpu_layers, n_layers + 1)
    if not accel:
        if n_gpu_layers > 0:
            # llama.cpp ignores -ngl without a GPU too, but says so: the user expected offloading
            warnings.warn(f"split_layers: n_gpu_layers={n_gpu_layers} ignored: no accelerator among the devices "
                          f"({', '.join(d.name for d in devs)}); devices='auto' or ['CUDA0'] picks a GPU, and "
                          f"ggmlpy.system_info()['backends'] says which backends this build has", stacklevel=2)
        n_off = 0
    n_rep = min(n_off, n_layers)
    if isinstance(split, str):
        if split == "memory":
            weights = [max(d.memory()[0], 1) for d in accel]
        elif split == "count":
            weights = [1.0] * len(accel)
        else:
            raise GGMLValueError(f"split_layers: split must be 'memory', 'count' or a list (got {split!r})")
    elif not accel:
        weights = []                # nothing to divide (the n_gpu_layers warning above says why)
    else:
        weights = list(split)
        if len(weights) != len(accel) or any(w < 0 for w in weights) or not sum(weights) > 0:
            raise GGMLValueError(f"split_layers: need {len(accel)} non-negative proportions (got {weights!r})")
    layers = [cpu] * (n_layers - n_rep)
    if n_rep:
        total = float(sum(weights))
        bounds = np.cumsum([w / total for w in weights])
        for j in range(n_rep):
            k = int(np.searchsorted(bounds, (j + 0.5) / n_rep))
            layers.append(accel[min(k, len(accel) - 1)])
    output = layers[-1] if (n_off > n_layers or (n_gpu_layers < 0 and accel)) and layers else cpu
    if n_layers == 0 and accel and n_off:
        output = accel[0]
    return Placement(layers=layers, output=output, input=cpu)


@dataclass
class DeviceMemory:
    """What one device holds: bytes per layer group for weights and cache, the compute graph, and outcomes."""

    name: str
    description: str
    n_layers: int
    weights: dict[Group, int] = field(default_factory=dict)
    cache: dict[Group, int] = field(default_factory=dict)
    #: weight bytes per buffer type (``"CPU"``, ``"CPU_REPACK"``...)
    weight_buffers: dict[str, int] = field(default_factory=dict)
    graph: int = 0
    #: what each reserved graph needs here (``pp``, ``tg``, ``vision``...); the compute buffer holds the largest
    graphs: dict[str, int] = field(default_factory=dict)
    weights_ok: bool | None = None       # None: not attempted
    cache_ok: bool | None = None
    graph_ok: bool | None = None
    free: int = 0
    total: int = 0

    @property
    def weights_total(self) -> int:
        return sum(self.weights.values())

    @property
    def cache_total(self) -> int:
        return sum(self.cache.values())

    @property
    def self_total(self) -> int:
        """model + context + compute, in llama.cpp's words."""
        return self.weights_total + self.cache_total + self.graph

    @property
    def unaccounted(self) -> int:
        """``total - free - self``, signed: memory in use on the device that this report does not explain.

        Positive: other processes, the driver, this process's other allocations.
        Negative: the report counts more than the device shows as used. That is
        normal on the CPU device, whose ``free`` is the system's available
        memory: ggml's host buffers are reserved but their pages are only
        taken when first written, so untouched parts of the cache and compute
        buffers still look free; it also happens when ``free`` was read before
        an allocation (the figures are read when each part is recorded).
        """
        return self.total - self.free - self.self_total

    def to_dict(self) -> dict:
        return {
            "name": self.name, "description": self.description,
            "weights": {str(k): v for k, v in self.weights.items()},
            "cache": {str(k): v for k, v in self.cache.items()},
            "weight_buffers": dict(self.weight_buffers),
            "graph": self.graph, "graphs": dict(self.graphs),
            "weights_total": self.weights_total, "cache_total": self.cache_total,
            "self": self.self_total, "free": self.free, "total": self.total, "unaccounted": self.unaccounted,
            "allocated": {"weights": self.weights_ok, "cache": self.cache_ok, "graph": self.graph_ok},
        }


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def _status(ok: bool | None) -> str:
    return {None: "", True: "", False: " FAILED"}[ok]


class MemoryReport:
    """Memory per device and per purpose (weights, KV cache, compute graph), per layer.

    ``str(report)`` is an aligned table in MiB with one row per device and a
    llama.cpp-style breakdown ``total = free + (self = model + context +
    compute) + unaccounted``; :meth:`to_dict` / :meth:`to_json` give the same
    numbers. A device whose allocation failed still shows what it needed.
    ``unaccounted`` may be negative (see :attr:`DeviceMemory.unaccounted`); the
    table then says why in a note.
    """

    def __init__(self, n_layers: int = 0):
        self.n_layers = n_layers
        self.devices: dict[str, DeviceMemory] = {}
        #: how the placement was chosen (``load_model(..., n_gpu_layers="auto")``: a FitResult), else None
        self.fit: Any = None

    def device(self, dev: Device) -> DeviceMemory:
        m = self.devices.get(dev.name)
        if m is None:
            m = self.devices[dev.name] = DeviceMemory(dev.name, dev.description, self.n_layers)
        m.free, m.total = dev.memory()
        return m

    def add_weights(self, dev: Device, group: Group, nbytes: int) -> None:
        m = self.device(dev)
        m.weights[group] = m.weights.get(group, 0) + int(nbytes)

    def add_cache(self, dev: Device, group: Group, nbytes: int) -> None:
        m = self.device(dev)
        m.cache[group] = m.cache.get(group, 0) + int(nbytes)

    def set_graph(self, dev: Device, nbytes: int, ok: bool = True) -> None:
        m = self.device(dev)
        m.graph = int(nbytes)
        m.graph_ok = ok

    def note_graph(self, dev: Device, label: str, nbytes: int) -> None:
        """Record what the graph ``label`` needs on ``dev`` (the largest of its reservations)."""
        m = self.device(dev)
        m.graphs[label] = max(m.graphs.get(label, 0), int(nbytes))

    @property
    def total(self) -> int:
        return sum(m.self_total for m in self.devices.values())

    def to_dict(self) -> dict:
        out = {"n_layers": self.n_layers, "devices": {k: m.to_dict() for k, m in self.devices.items()},
               "total": self.total}
        if self.fit is not None:
            out["fit"] = self.fit.to_dict()
        return out

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def layer_table(self) -> str:
        """Weights and cache per layer group and device, in MiB."""
        groups: list[Group] = ["input", *range(self.n_layers), "output"]
        names = list(self.devices)
        rows = [["layer", *[f"{n} weights" for n in names], *[f"{n} cache" for n in names]]]
        for gname in groups:
            w = [self.devices[n].weights.get(gname, 0) for n in names]
            cch = [self.devices[n].cache.get(gname, 0) for n in names]
            if any(w) or any(cch):
                rows.append([str(gname), *map(_mib, w), *map(_mib, cch)])
        return _table(rows)

    def __str__(self) -> str:
        rows = [["device", "weights", "cache", "graph", "self", "free", "total"]]
        for m in self.devices.values():
            rows.append([m.name, _mib(m.weights_total) + _status(m.weights_ok), _mib(m.cache_total) + _status(m.cache_ok),
                         _mib(m.graph) + _status(m.graph_ok), _mib(m.self_total), _mib(m.free), _mib(m.total)])
        rows.append(["total", _mib(sum(m.weights_total for m in self.devices.values())),
                     _mib(sum(m.cache_total for m in self.devices.values())),
                     _mib(sum(m.graph for m in self.devices.values())), _mib(self.total), "", ""])
        lines = ["memory [MiB]", _table(rows), "", "memory breakdown [MiB] | total = free + (self = model + context + "
                 "compute) + unaccounted"]
        for m in self.devices.values():
            lines.append(f"  - {m.name} ({m.description}) | {_mib(m.total)} = {_mib(m.free)} + ({_mib(m.self_total)} = "
                         f"{_mib(m.weights_total)} + {_mib(m.cache_total)} + {_mib(m.graph)}) + {_mib(m.unaccounted)}"
                         + (" *" if m.unaccounted < 0 else ""))
        if any(m.unaccounted < 0 for m in self.devices.values()):
            lines.append("  * unaccounted < 0: this report counts more than the device shows as used; host "
                         "buffers take\n    their pages only when first written (untouched cache and compute "
                         "memory still\n    looks free), or free memory was read before an allocation")
        vision = [m for m in self.devices.values() if "vision" in m.weights or "vision" in m.graphs]
        if vision:
            # in the figures above too: the encoder's weights are in "weights", its graph shares the compute buffer
            rows = [["device", "weights", "graph"]]
            rows += [[m.name, _mib(m.weights.get("vision", 0)), _mib(m.graphs.get("vision", 0))] for m in vision]
            lines += ["", "vision encoder [MiB] (included above; its graph shares the compute buffer)", _table(rows)]
        if self.fit is not None:
            lines += ["", str(self.fit)]
        return "\n".join(lines)


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for j, r in enumerate(rows):
        out.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if j == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


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
                    r = subprocess.run([sys.executable, "-c", _AMX_CHECK], env={**os.environ, "GGMLPY_AMX": "1", "GGMLPY_KERNELS": "own"},
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


class ProgressBar:
    """A text progress bar for ``Weights.load(progress=...)`` and other long work.

    ``bar(done, total)`` redraws one line on ``stream`` (stderr by default):
    ``loading [##########..........]  50%  12.0/24.0 MiB``; the line ends when
    ``done == total``. On a stream that is not a terminal it prints one line
    per 10% step reached (each step once) and the final line once, however
    often the caller reports the same figures, so logs stay short.

    Parameters
    ----------
    label : str
        Text before the bar.
    width : int
        Characters of the bar.
    stream : text stream, optional
        Where to draw (default ``sys.stderr``).
    unit : str
        What ``done`` and ``total`` count: ``"bytes"`` (shown in MiB, the
        default) or the name of anything else (``"params"``), shown in
        millions: ``1.2/24.5 M params``.
    """

    def __init__(self, label: str = "loading", width: int = 30, stream=None, unit: str = "bytes"):
        import sys

        self.label, self.width, self.unit = label, width, unit
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last_tenth = -1
        self._ended = False

    def _amount(self, done: int, total: int) -> str:
        if self.unit == "bytes":
            return f"{done / 2**20:.1f}/{total / 2**20:.1f} MiB"
        return f"{done / 1e6:.1f}/{total / 1e6:.1f} M {self.unit}"

    def __call__(self, done: int, total: int) -> None:
        frac = 1.0 if total <= 0 else min(max(done / total, 0.0), 1.0)
        end = done >= total
        if end and self._ended:
            return                        # the final line is drawn once, however often it is reported
        if not end:
            if self._ended:               # a new run with the same bar
                self._ended, self._last_tenth = False, -1
            tenth = int(frac * 10)
            if not self.tty and tenth == self._last_tenth:
                return
            self._last_tenth = tenth
        self._ended = end
        filled = int(round(frac * self.width))
        pct = frac * 100 if end else min(frac * 100, 99.0)   # "100%" only on the final line
        line = (f"{self.label} [{'#' * filled}{'.' * (self.width - filled)}] {pct:3.0f}%  "
                f"{self._amount(done, total)}")
        if self.tty:
            self.stream.write("\r" + line + ("\n" if end else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


class GraphPool:
    """Built graphs kept for reuse by shape, as llama.cpp reuses its graph when only the inputs change.

    A graph is keyed by what its topology depends on (batch size, output rows, the cache plan's
    :attr:`key`, the kind of output). :meth:`take` hands out a pooled graph of that key or builds one;
    :meth:`give` returns it after compute: ``keep`` per key (two: one computing while the next is
    built), the ``shapes`` most recent keys. Thread-safe: the loop thread takes while the compute
    thread gives.

    Items need ``free()``; the pool sets their ``key``.
    """

    def __init__(self, enabled: bool = True, keep: int = 2, shapes: int = 16) -> None:
        self.enabled = bool(enabled)
        self.keep, self.shapes = int(keep), int(shapes)
        self.built = 0                          # graphs built (not taken from the pool)
        self._pools: dict = {}
        self._lock = threading.Lock()

    def take(self, key: tuple, build: Callable[[], Any]):
        """A pooled graph of ``key``, or ``build()``'s."""
        with self._lock:
            pool = self._pools.get(key)
            item = pool.pop() if pool else None
        if item is None:
            item = build()
            item.key = key
            self.built += 1
        return item

    def give(self, item) -> None:
        """Keep a computed graph for reuse (or free it when the pool is full or disabled)."""
        with self._lock:
            pool = self._pools.setdefault(item.key, [])
            if len(pool) < self.keep and self.enabled:
                pool.append(item)
                item = None
            old = []
            if len(self._pools) > self.shapes:  # shapes seen long ago
                for key in list(self._pools)[:-self.shapes]:
                    old += self._pools.pop(key)
        for b in ([item] if item is not None else []) + old:
            b.free()

    def clear(self) -> None:
        """Free every pooled graph (each one tried; the first error raised after)."""
        with self._lock:
            pools, self._pools = self._pools, {}
        errors = []
        for pool in pools.values():
            for b in pool:
                try:
                    b.free()
                except Exception as e:
                    errors.append(e)
        if errors:
            raise errors[0]


class Runtime:
    """One backend per device plus a scheduler over them, with worst-case reservation.

    Every graph computes through :meth:`run` (allocation through the scheduler, inputs, compute),
    the forward graphs and the cache's maintenance (shift, defragmentation) alike, so both work for
    any device; :attr:`graphs` is the pool of forward graphs kept for reuse.

    Parameters
    ----------
    devs : the devices (CPU last), e.g. ``placement.devices()``
    n_threads : CPU threads (default: all cores)
    graph_size : scheduler capacity for nodes + leafs (twice the largest graph's)
    report : MemoryReport to record compute-graph bytes in
    threadpool : give the CPU backend a persistent threadpool (:meth:`ggmlpy.Backend.set_threadpool`), as
        llama.cpp's tools do, instead of ggml starting its threads for every graph
    poll : how eagerly the pool's idle threads poll for the next graph (0-100, llama-bench's ``--poll``)
    reuse_graphs : keep built forward graphs for reuse (:class:`GraphPool`)
    """

    def __init__(self, devs: Sequence[Device], n_threads: int = 0, graph_size: int = 8192,
                 report: MemoryReport | None = None, parallel: bool = False, op_offload: bool = True,
                 threadpool: bool = True, poll: int = 50, reuse_graphs: bool = True):
        self.graphs = GraphPool(enabled=reuse_graphs)
        self.graph_size = int(graph_size)
        self.devices = list(devs)
        if not self.devices or self.devices[-1].type != "CPU":
            self.devices = [d for d in self.devices if d.type != "CPU"] + [_core.device("CPU")]
        self.backends: list[Backend] = []
        self.sched = None
        try:
            for d in self.devices:
                self.backends.append(d.init())
            cpu = self.backends[-1]
            n = n_threads if n_threads > 0 else _core.default_n_threads()
            self.n_threads = n
            if threadpool:
                cpu.set_threadpool(n, poll=poll)        # also sets the backend's thread count
            else:
                cpu.set_n_threads(n)
            self.sched = _core.Scheduler(self.backends, graph_size=graph_size, parallel=parallel,
                                         op_offload=op_offload)
        except BaseException:
            self.close()              # the backends made so far: a failed start holds nothing
            raise
        self.report = report if report is not None else MemoryReport()
        self.reserved: dict[str, int] = {}
        self.stats: dict[str, tuple[int, int]] = {}
        self.reallocations = 0

    def buffer_sizes(self) -> dict[str, int]:
        """Bytes of each backend's compute buffer now."""
        return {d.name: self.sched.buffer_size(b) for d, b in zip(self.devices, self.backends)}

    def reserve(self, build: Callable[[int], Graph], n_prompt: int, n_decode: int = 1,
                extra: Sequence[tuple[str, Callable[[], Graph]]] = ()) -> dict[str, int]:
        """Reserve compute buffers for the worst case, as llama.cpp's context does.

        ``build(n_tokens)`` returns a graph at full context for a batch of
        ``n_tokens``; it is called for the prompt batch, a decode batch, and
        the prompt batch again (so the final allocation is the prompt-sized
        one). ``extra`` are other graphs the buffers must hold, ``(label,
        build())``, reserved before the last prompt batch: the largest image
        batch of a vision encoder. Logs node and split counts. Returns the bytes per device.

        Raises
        ------
        GGMLMemoryError
            A compute buffer could not be allocated; ``.report`` has the figures.
        """
        steps = [("pp", lambda: build(n_prompt)), ("tg", lambda: build(n_decode)), *extra,
                 ("pp", lambda: build(n_prompt))]
        for d in self.devices:
            self.report.device(d).graphs.clear()
        for label, make in steps:
            gf = make()
            # measured without allocating, for the report; keyed by backend name ("RPC0[host:port]")
            by_backend = self.sched.reserve_size(gf)
            need = {d.name: by_backend.get(b.name, 0) for d, b in zip(self.devices, self.backends)}
            for d in self.devices:
                self.report.note_graph(d, label, need[d.name])
            try:
                self.sched.reserve(gf)
            except MemoryError as e:
                for d in self.devices:
                    self.report.set_graph(d, need.get(d.name, 0), ok=False)
                raise GGMLMemoryError(f"reserve: {e}\n{self.report}", self.report) from None
            self.sched.alloc_graph(gf)
            self.stats[label] = (gf.n_nodes, self.sched.n_splits)
        self.sched.reset()
        log.info("graph nodes/splits = %d/%d (with bs=%d), %d/%d (with bs=%d)",
                 *self.stats["pp"], n_prompt, *self.stats["tg"], n_decode)
        self.reserved = self.buffer_sizes()
        for d in self.devices:
            self.report.set_graph(d, self.reserved[d.name], ok=True)
            log.info("%s compute buffer size = %.2f MiB", d.name, self.reserved[d.name] / 2**20)
        return dict(self.reserved)

    def pin(self, pins) -> None:
        """Keep each ``(node, device)`` of a graph on that device's backend (until the graph is freed):
        for a node ggml's scheduler would otherwise give its neighbours' device."""
        for node, dev in pins:
            i = next(i for i, d in enumerate(self.devices) if d.name == dev.name)
            self.sched.set_tensor_backend(node, self.backends[i])

    def run(self, graph: Graph, fill: Callable[[], None] | None = None) -> None:
        """Allocate ``graph`` through the scheduler (unless it keeps an allocation), ``fill()`` its
        inputs, compute it."""
        if not self.sched.is_allocated(graph):      # a reused graph keeps its allocation
            self.sched.alloc_graph(graph)
        if fill is not None:
            fill()
        self.compute(graph)

    def compute(self, graph: Graph) -> None:
        """Allocate and compute ``graph``; counts any growth of the compute buffers past the reservation."""
        self.sched.compute(graph)
        if self.reserved and self.buffer_sizes() != self.reserved:
            self.reallocations += 1
            self.reserved = self.buffer_sizes()
            log.warning("compute buffers grew past the reservation: %s", self.reserved)

    def close(self) -> None:
        """Free the pooled graphs, the scheduler (its compute buffers) and the backends; safe to call twice."""
        try:
            self.graphs.clear()
        finally:
            self._close_sched()

    def _close_sched(self) -> None:
        if self.sched is not None:
            self.sched.free()
            self.sched = None
        for b in self.backends:
            b.free()
        self.backends = []

