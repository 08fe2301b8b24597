"""Versions and the capabilities of this build (``ggmlpy.system_info()``, ``ggmlpy info``)."""

from __future__ import annotations

import os
import platform

from ggmlpy import _core
from ggmlpy._version import __version__


def ggml_version() -> str:
    """The version of the ggml ggmlpy was built with (``'0.25.3'``)."""
    return _core._ggml_version()[0]


def ggml_commit() -> str:
    """The ggml commit ggmlpy was built with, as ggml reports it (may be ``'unknown'``)."""
    return _core._ggml_version()[1]


def cpu_model_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``'s, else the platform's): a key of the per-machine caches.
    (The benchmark's llama.cpp worker, which must not load ggmlpy, keeps a copy of its own.)"""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def available_host_memory() -> int | None:
    """Bytes of host memory the machine has available now (Linux ``MemAvailable``; cgroup limits are not read),
    or None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def cpu_variant() -> tuple[str, str] | None:
    """The CPU backend variant ggml chose at import, in a portable build.

    A portable build (``GGML_NATIVE=OFF``, every wheel) carries one CPU backend
    per CPU generation and ggml loads the best one this CPU supports.

    Returns
    -------
    tuple of (str, str) or None
        The variant's name and its library's path, e.g.
        ``('zen4', '.../ggmlpy/libggml-cpu-zen4.so')``; ``None`` in a native
        build (``pip install .`` from source), whose one CPU backend is tuned
        for the machine that built it.

    Examples
    --------
    >>> import ggmlpy
    >>> v = ggmlpy.cpu_variant()
    >>> v is None or "libggml-cpu-" in v[1]
    True
    """
    return _core._cpu_variant()


def system_info() -> dict:
    """What this build of ggmlpy can do on this machine.

    Returns a dict with ``ggmlpy`` and ``ggml`` versions, the Python and
    platform, ``cpu_variant`` (``None`` in a native build, else the variant's
    name and library: see ``cpu_variant()``), ``cpu_features`` (instruction sets
    ggml's CPU backend uses), ``cpu_weight_buffers`` (the CPU's extra buffer
    types that repacked weights go to, e.g. ``['CPU_REPACK']``),
    ``backends`` (compiled in, e.g. ``['CPU', 'RPC']``) and ``devices`` (each a
    dict of name, description, type, backend, free and total memory).

    Examples
    --------
    >>> import ggmlpy
    >>> "CPU" in ggmlpy.system_info()["backends"]
    True
    """
    return {
        "ggmlpy": __version__,
        "ggml": ggml_version(),
        "ggml_commit": ggml_commit(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "library_dir": os.path.dirname(_core.__file__),
        "cpu_variant": cpu_variant(),
        "cpu_features": _core._cpu_features(),
        "cpu_weight_buffers": [b.name for b in _core.device("CPU").extra_buffer_types()],
        "backends": _core._backends(),
        "devices": _core._devices(),
    }


def format_system_info(info: dict | None = None) -> str:
    """``system_info()`` as readable text (what ``ggmlpy info`` prints)."""
    info = info or system_info()
    lines = [
        f"ggmlpy {info['ggmlpy']} (ggml {info['ggml']}, commit {info['ggml_commit']})",
        f"python {info['python']} on {info['platform']}",
        f"libraries: {info['library_dir']}",
        f"cpu variant: {_variant_text(info['cpu_variant'])}",
        f"CPU features: {' '.join(info['cpu_features']) or '(none)'}",
        f"CPU weight repacking: {', '.join(info['cpu_weight_buffers']) or '(none)'}",
        f"backends: {', '.join(info['backends'])}",
        "devices:",
    ]
    rows = [("#", "name", "type", "backend", "free", "total", "description")]
    for d in info["devices"]:
        rows.append((str(d["index"]), d["name"], d["type"], d["backend"], _gib(d["memory_free"]),
                     _gib(d["memory_total"]), d["description"]))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        lines.append("  " + "  ".join(c.ljust(w) if i in (1, 2, 3, 6) else c.rjust(w)
                                      for i, (c, w) in enumerate(zip(r, widths))).rstrip())
    # A GPU backend without devices (a CUDA build on a machine without a GPU or driver) would
    # otherwise only show as a missing row.
    for b in info["backends"]:
        if b not in ("CPU", "RPC") and not any(d["backend"] == b for d in info["devices"]):
            lines.append(f"  ({b}: compiled in, no device found{_hidden_hint(b)})")
    for d in info["devices"]:
        if d["backend"] == "Vulkan" and any(w in d["description"].lower() for w in _SOFTWARE_VULKAN):
            lines.append(f"  ({d['name']} is a software device (Mesa's lavapipe): it runs on the CPU's cores, "
                         "a correctness check far slower than the CPU backend)")
    return "\n".join(lines)


#: Words in a Vulkan device's description that mark Mesa's software driver (lavapipe; its device
#: calls itself llvmpipe).
_SOFTWARE_VULKAN = ("llvmpipe", "lavapipe")


def _hidden_hint(backend: str) -> str:
    """Why a compiled-in backend may list no device although the machine has one: ggml's Vulkan
    backend skips CPU-type (software) devices unless ``GGML_VK_VISIBLE_DEVICES`` names them."""
    if backend == "Vulkan" and not os.environ.get("GGML_VK_VISIBLE_DEVICES"):
        return ("; ggml hides software Vulkan devices such as Mesa's lavapipe: "
                "GGML_VK_VISIBLE_DEVICES=0 shows the first")
    return ""


def _variant_text(v) -> str:
    if v is None:
        return "native build (ggml-cpu tuned for the machine that built it)"
    return f"{v[0]} ({os.path.basename(v[1])})"


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"
