"""Source hygiene as tests: lint, generated stubs in step, the C-boundary rule."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


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
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "src", "tests", "bench", "tools", "vendor/ggml/fetch.py"],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_only_core_touches_the_c_boundary():
    # _ggml.pxd is cimported by _core alone; Python layers never see a pointer.
    for path in (ROOT / "src/ggmlpy").rglob("*"):
        if path.suffix in (".py", ".pyx", ".pxd", ".pxi") and path.name not in ("_core.pyx", "_core.pxd", "_ggml.pxd"):
            assert "cimport ggmlpy._ggml" not in path.read_text() and "_ggml.pxd" not in path.read_text(), f"{path} reaches into the C declarations"


def test_pxi_files_stay_small():
    for path in (ROOT / "src/ggmlpy/_pxi").glob("*.pxi"):
        assert len(path.read_text().splitlines()) <= 1500, f"{path.name} is over 1500 lines: split it by concept"
