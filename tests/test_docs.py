"""The Examples sections of ggmlpy's docstrings run and give what they show."""

from __future__ import annotations

import doctest

import numpy as np
import pytest

import ggmlpy
from ggmlpy import _core, _system


def _collect():
    finder = doctest.DocTestFinder(exclude_empty=True)
    globs = {"np": np, "ggmlpy": ggmlpy, **{k: getattr(_core, k) for k in dir(_core) if not k.startswith("__")}}
    tests = []
    objs = [getattr(_core, n) for n in ("Context", "Tensor", "Graph", "quantize", "dequantize")]
    objs.append(_system.system_info)
    for obj in objs:
        for t in finder.find(obj, getattr(obj, "__qualname__", obj.__name__), module=False, globs=dict(globs)):
            if t.examples:
                tests.append(t)
    for cls in (_core._CtxBase, _core._CtxOps):
        for name, member in vars(cls).items():
            for t in finder.find(member, f"Context.{name}", module=False, globs=dict(globs)):
                if t.examples:
                    tests.append(t)
    return tests


DOCTESTS = _collect()


def test_there_are_examples():
    assert len(DOCTESTS) >= 8


@pytest.mark.parametrize("test", DOCTESTS, ids=[t.name for t in DOCTESTS])
def test_docstring_example(test):
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    runner.run(test)
    assert runner.failures == 0, f"{test.name}: {runner.failures} example(s) failed"


def test_readme_runner_example_runs(tmp_path, capsys):
    """The README's model/runner example, on the built-in tiny synthetic model."""
    import re
    from pathlib import Path

    from ggmlpy.models.synthetic import write_synthetic

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "load_model" in b]
    assert len(blocks) == 1
    path = write_synthetic(tmp_path / "tiny.gguf", size="tiny", type="F16")
    code = blocks[0].replace('"model.gguf"', repr(str(path)))
    exec(compile(code, "README.md", "exec"), {})
    out = capsys.readouterr()
    assert "CPU" in out.out and "length" in out.out
