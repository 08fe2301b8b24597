"""Source hygiene as tests: lint, generated stubs in step, the C-boundary rule."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"


def test_stubs_match_the_extension():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import gen_stubs
    finally:
        sys.path.pop(0)
    assert (ROOT / "src/ggmlpy/_core.pyi").read_text() == gen_stubs.generate(), \
        "src/ggmlpy/_core.pyi is stale: run python tools/gen_stubs.py"


@pytest.mark.skipif(shutil.which("ruff") is None and subprocess.run(
    [sys.executable, "-m", "ruff", "--version"], capture_output=True).returncode != 0, reason="ruff not installed")
def test_ruff_clean():
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "src", "tests", "bench", "tools",
                          "vendor/ggml/fetch.py"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_only_core_touches_the_c_boundary():
    # _ggml.pxd is cimported by _core alone; Python layers never see a pointer.
    for path in (ROOT / "src/ggmlpy").rglob("*"):
        if path.suffix in (".py", ".pyx", ".pxd", ".pxi") and path.name not in ("_core.pyx", "_core.pxd", "_ggml.pxd"):
            text = path.read_text()
            assert "cimport ggmlpy._ggml" not in text and "_ggml.pxd" not in text, \
                f"{path} reaches into the C declarations"


def test_pxi_files_stay_small():
    for path in (ROOT / "src/ggmlpy/_pxi").glob("*.pxi"):
        assert len(path.read_text().splitlines()) <= 1500, f"{path.name} is over 1500 lines: split it by concept"


def test_python_and_c_files_stay_small():
    """One job per room: no Python or C file of the package over 800 lines (the .pxi, which mirror ggml.h
    concept by concept, have their own bound above)."""
    big = []
    for pattern in ("*.py", "*.c", "*.h", "*.inc"):
        for path in (ROOT / "src/ggmlpy").rglob(pattern):
            n = len(path.read_text().splitlines())
            if n > 800:
                big.append(f"{path.relative_to(ROOT)} ({n} lines)")
    assert not big, f"over 800 lines, split by job: {big}"


#: The floors of src/ggmlpy, lowest first: a module imports only from its own floor or below (function-local
#: imports included). docs/architecture.md describes the rooms.
FLOORS = [
    ["_core", "_libs", "_system", "_version", "_files", "_progress", "_cache", "defaults"],
    ["gguf", "memory", "hub"],                # hub: hf:// references to files in huggingface_hub's cache
    ["backend"],
    ["weights"],
    ["kvcache"],
    ["tokenizer", "chat_template", "chat"],   # chat_template: the old path of tokenizer.chat_template, re-exported
    ["models"],
    ["vision"],
    ["sampling"],
    ["runner", "sequences"],
    ["load", "api"],
    ["benchmark", "_cliargs", "server"],      # _cliargs: the flags' checks and errors bench and the CLI share
    ["cli", "_cliembed", "__main__", "__init__"],     # _cliembed: `ggmlpy embed`
]
#: The upward imports allowed, each a lazy re-export kept for callers of the old place (a module
#: __getattr__: nothing runs it at import): (module, imported room).
UPWARD_REEXPORTS = {("ggmlpy.backend", "weights"), ("ggmlpy.models", "load")}


def _imports(path: Path, module: str):
    """(line, imported module) for every import of ggmlpy in ``path``, at any depth."""
    import ast

    pkg = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    src = SRC / "ggmlpy"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "ggmlpy":
                # `from ggmlpy import gguf` names a module; `from ggmlpy import GGMLError` the package's face
                for a in node.names:
                    sub = (src / a.name).is_dir() or any((src / (a.name + e)).exists() for e in (".py", ".pyx"))
                    yield node.lineno, f"ggmlpy.{a.name}" if sub else "ggmlpy"
            else:
                yield node.lineno, target


def test_imports_never_run_up_a_floor():
    floor = {room: i for i, rooms in enumerate(FLOORS) for room in rooms}

    def room(mod: str) -> str:
        return mod.split(".")[1] if "." in mod else "__init__"

    bad = []
    for path in sorted((SRC / "ggmlpy").rglob("*.py")):
        module = ".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
        here = room(module)
        assert here in floor, f"{module}: a room no floor lists (add it to FLOORS)"
        for line, target in _imports(path, module):
            if not target.startswith("ggmlpy"):
                continue
            to = room(target)
            assert to in floor, f"{module}:{line} imports {target}: a room no floor lists"
            if floor[to] > floor[here] and (module, to) not in UPWARD_REEXPORTS:
                bad.append(f"{module}:{line} imports {target} ({here} is floor {floor[here]}, {to} floor {floor[to]})")
    assert not bad, "imports up a floor:\n" + "\n".join(bad)


@pytest.mark.parametrize("dl", [0, 1])
def test_the_glue_compiles_in_both_kinds_of_build(dl, tmp_path):
    """The glue headers that differ between a native build and a portable one (GGMLPY_BACKEND_DL: ggml's
    CPU and RPC libraries loaded as modules, their functions looked up with dlsym) compile in both, with
    undeclared functions an error: a native build never compiles the portable branch, and a dlsym left
    undeclared there once made every portable wheel crash at import."""
    cc = shutil.which("gcc") or shutil.which("cc")
    ggml = ROOT / "vendor/ggml/src"
    if cc is None or not (ggml / "include/ggml-backend.h").is_file():
        pytest.skip("no C compiler, or ggml's source not fetched (the build fetches it)")
    src = tmp_path / "glue.c"
    src.write_text('#include "ggmlpy_rpc.h"\n#include "ggmlpy_cpu.h"\nint main(void) { return 0; }\n')
    flags = [f"-DGGMLPY_BACKEND_DL={dl}", "-DGGMLPY_HAVE_RPC=1", "-DGGMLPY_RPC_ERRORS=1",
             "-DGGMLPY_RPC_SERVER_LIMITS=1", "-Werror=implicit-function-declaration", "-Wall"]
    r = subprocess.run([cc, "-fsyntax-only", *flags, f"-I{SRC / 'ggmlpy/_c/glue'}", f"-I{ggml / 'include'}",
                        f"-I{ggml / 'src'}", str(src)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]

