"""Generate src/ggmlpy/_core.pyi from the compiled extension.

The extension is compiled with ``embedsignature``, so every function's first
docstring line is its Python signature; this script turns those into a stub
file, adding return types from a small table. tests/project/test_source.py checks the
committed stub equals a fresh generation, so stubs cannot drift from the code.

    python tools/gen_stubs.py [--check]
"""

from __future__ import annotations

import enum
import inspect
import re
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "src/ggmlpy/_core.pyi"
WIDTH = 100  # the project's target line length (pyproject.toml); ruff's E501 cap is 120

RETURNS = {
    # Context
    "new_graph": "Graph", "tensors": "list[Tensor]", "get_tensor": "Tensor | None", "free": "None",
    "close": "None", "reset": "None", "for_tensors": "Context", "__enter__": "Context", "__exit__": "bool",
    # Tensor
    "numpy": "np.ndarray", "get": "np.ndarray", "set": "None", "__array__": "np.ndarray",
    "set_name": "Tensor", "set_input": "Tensor", "set_output": "Tensor", "set_param": "Tensor",
    "__dlpack__": "Any", "__dlpack_device__": "tuple[int, int]",
    # Graph
    "build_forward_expand": "None", "compute": "None", "clear": "None", "cancel": "None", "node": "Tensor",
    "print": "None", "summary": "str", "dump_dot": "None",
    # module
    "quantize": "bytes", "dequantize": "np.ndarray", "type_name": "str", "blck_size": "int", "type_size": "int",
    "row_size": "int", "is_quantized": "bool", "tensor_overhead": "int", "graph_overhead": "int",
    "set_log_level": "None", "devices": "list[Device]", "device": "Device", "backend_init": "Backend",
    "alloc_ctx_tensors": "Buffer", "rpc_add_server": "list[Device]", "rpc_start_server": "None",
    "init": "Backend", "buffer_type": "BufferType", "host_buffer_type": "BufferType | None", "alloc_buffer": "Buffer",
    "memory": "tuple[int, int]", "supports_op": "bool", "supports_buft": "bool", "offload_op": "bool",
    "alloc_size": "int", "graph_compute": "None", "synchronize": "None", "set_n_threads": "None",
    "is_allocated": "bool", "advise_huge_pages": "bool",
    "reserve": "None", "reserve_size": "dict[str, int]", "alloc_graph": "None", "set_tensor_backend": "None",
    "tensor_backend": "Backend | None", "buffer_size": "int", "_live_objects": "dict[str, int]",
    "_ggml_version": "tuple[str, str]",
    "_cpu_features": "list[str]", "_backends": "list[str]", "_devices": "list[dict[str, Any]]",
    "_cpu_variant": "tuple[str, str] | None", "_load_backends": "None",
}
PROPS = {
    "ne": "tuple[int, int, int, int]", "nb": "tuple[int, int, int, int]", "shape": "tuple[int, ...]",
    "type": "Type", "op": "Op", "src": "tuple[Tensor | None, ...]", "view_src": "Tensor | None",
    "name": "str", "context": "Context", "op_params": "tuple[int, ...]", "op_desc": "str",
    "closed": "bool", "no_alloc": "bool", "backends": "list[Backend]", "description": "str",
    "endpoint": "str | None", "caps": "dict[str, bool]", "device_id": "str | None", "device": "Device",
    "usage": "BufferUsage", "device_name": "str", "buffer_type": "BufferType", "nodes": "list[Tensor]",
    "leafs": "list[Tensor]", "has_data": "bool",
}


def _sig(obj, name: str) -> str:
    doc = (obj.__doc__ or "").splitlines()
    first = doc[0] if doc else ""
    m = re.match(rf"{re.escape(name)}\((.*)\)\s*(->.*)?$", first)
    params = m.group(1) if m else "*args, **kwargs"
    params = re.sub(r"(\w+): (\w+) = None", r"\1: \2 | None = None", params)
    params = re.sub(r": (Tensor|Type|int|float|bool|str|size_t) = (SortOrder|ScaleMode|TriType|Type)\.\w+",
                    r": Any = ...", params)
    params = re.sub(r"= (SortOrder|ScaleMode|TriType|Type)\.(\w+)", r"= ...", params)
    params = re.sub(r"=\s*[^,)]+", "= ...", params)
    params = params.replace(": size_t", ": int")
    if not params.startswith("self") and "self" not in params.split(",")[0] and inspect.ismethoddescriptor(obj):
        params = "self, " + params if params else "self"
    return f"def {name}({params}) -> {RETURNS.get(name, 'Any' if name.startswith('_') else 'Tensor')}: ..."


def _split_params(params: str) -> list[str]:
    """Split a parameter list at its top-level commas (``tuple[int, int]`` stays whole)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(params):
        if ch in "[(":
            depth += 1
        elif ch in "])":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(params[start:i].strip())
            start = i + 1
    parts.append(params[start:].strip())
    return parts


def _wrap(line: str) -> str:
    """Wrap a ``def`` longer than WIDTH: its parameters packed on indented lines, the return on its own."""
    m = re.match(r"(\s*)def (\w+)\((.*)\)( -> .*)$", line)
    if len(line) <= WIDTH or not m:
        return line
    indent, name, params, tail = m.groups()
    out, cur = [f"{indent}def {name}("], indent + "    "
    for p in _split_params(params):
        if cur.strip() and len(cur) + len(p) + 2 > WIDTH:
            out.append(cur.rstrip())
            cur = indent + "    "
        cur += p + ", "
    out.append(cur.rstrip().rstrip(","))
    out.append(f"{indent}){tail}")
    return "\n".join(out)


def generate() -> str:
    from ggmlpy import _core

    lines = ['"""Type stubs for ggmlpy._core (generated by tools/gen_stubs.py; do not edit)."""', "",
             "import enum", "from typing import Any", "", "import numpy as np", ""]
    enums, classes, funcs, excs = [], [], [], []
    for name, obj in sorted(vars(_core).items()):
        if (isinstance(obj, type) and issubclass(obj, enum.Enum) and obj.__module__ in ("ggmlpy", "ggmlpy._core")
                and len(obj)):
            enums.append((name, obj))
        elif isinstance(obj, type) and issubclass(obj, BaseException) and obj.__module__ == "ggmlpy._core":
            excs.append((name, obj))
        elif isinstance(obj, type) and obj.__module__ == "ggmlpy._core" and not name.startswith("_"):
            classes.append((name, obj))
        elif callable(obj) and not isinstance(obj, type) and getattr(obj, "__module__", "") == "ggmlpy._core":
            funcs.append((name, obj))
    for name, obj in sorted(excs, key=lambda x: len(x[1].__mro__)):
        bases = ", ".join(b.__name__ for b in obj.__bases__)
        lines += [f"class {name}({bases}):", "    report: Any" if name == "GGMLMemoryError" else "    ...", ""]
    for name, obj in enums:
        base = "enum.IntEnum"
        lines.append(f"class {name}({base}):")
        for m in obj:
            lines.append(f"    {m.name} = {int(m)}")
        if name == "Type":
            lines += ["    @property", "    def block_size(self) -> int: ...", "    @property",
                      "    def type_size(self) -> int: ...", "    @property", "    def is_quantized(self) -> bool: ...",
                      "    @property", "    def numpy_dtype(self) -> np.dtype | None: ...",
                      "    def row_size(self, ne0: int) -> int: ..."]
        lines.append("")
    for name, cls in classes:
        lines.append(f"class {name}:")
        members = {}
        for klass in reversed(cls.__mro__[:-1]):
            members.update({k: v for k, v in vars(klass).items()})
        init = {
            "Context": "def __init__(self, mem_size: int = ..., *, no_alloc: bool = ...) -> None: ...",
            "Gallocr": "def __init__(self, buft: BufferType) -> None: ...",
            "Scheduler": ("def __init__(self, backends: list[Backend], bufts: list[BufferType] | None = ..., "
                          "graph_size: int = ..., parallel: bool = ..., op_offload: bool = ...) -> None: ..."),
        }
        if name in init:
            lines.append("    " + init[name])
        body = []
        for k, v in sorted(members.items()):
            if k.startswith("__") and k not in ("__enter__", "__exit__", "__array__", "__dlpack__",
                                                "__dlpack_device__", "__len__"):
                continue
            if k.startswith("_") and not k.startswith("__"):
                continue
            if isinstance(v, (property,)) or type(v).__name__ == "getset_descriptor":
                ret = PROPS.get(k, "bool" if k.startswith("is_") else "int")
                body.append(f"    @property\n    def {k}(self) -> {ret}: ...")
            elif isinstance(v, staticmethod) or type(v).__name__ == "staticmethod":
                body.append(f"    @staticmethod\n    {_sig(getattr(cls, k), k)}")
            elif callable(v):
                s = _sig(v, k)
                if k == "__len__":
                    s = "def __len__(self) -> int: ..."
                body.append("    " + s)
            elif k in ("mem_size",):
                body.append(f"    {k}: int")
        lines += body or ["    ..."]
        lines.append("")
    for name, f in funcs:
        lines.append(_sig(f, name))
    return "\n".join(_wrap(line) for line in "\n".join(lines).splitlines()) + "\n"


if __name__ == "__main__":
    text = generate()
    if "--check" in sys.argv:
        sys.exit(0 if OUT.read_text() == text else 1)
    OUT.write_text(text)
    print(f"wrote {OUT}")
