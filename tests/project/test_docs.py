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
    # Context's methods live in its private bases (context.pxi says why): search each.
    for cls in _core.Context.__mro__[1:-1]:
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

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "load_model" in b]
    assert len(blocks) == 1
    path = write_synthetic(tmp_path / "tiny.gguf", size="tiny", type="F16")
    code = blocks[0].replace('"model.gguf"', repr(str(path)))
    exec(compile(code, "README.md", "exec"), {})
    out = capsys.readouterr()
    assert "CPU" in out.out and "length" in out.out


def _readme_blocks():
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    return re.findall(r"```python\n(.*?)```", readme, re.S)


def test_readme_blocks_are_all_tested():
    # every python block of the README runs in one of the tests here
    blocks = _readme_blocks()
    assert len(blocks) == 3
    assert "load_model" in blocks[2] and "Weights" in blocks[1] and "Context" in blocks[0]


def test_readme_core_example_runs_and_raises_what_it_says(capsys):
    """The first example: runs, prints the result, and its last line raises the error it shows."""
    block = _readme_blocks()[0]
    lines = block.rstrip("\n").split("\n")
    raising = [i for i, ln in enumerate(lines) if "# GGMLValueError:" in ln]
    assert raising == [len(lines) - 1]
    code, message = lines[-1].split("# GGMLValueError:")
    env: dict = {}
    exec(compile("\n".join(lines[:-1]), "README.md", "exec"), env)
    assert np.allclose(env["y"].numpy(), (lambda z: z / (1 + np.exp(-z)))(env["x"].numpy() @ env["w"].numpy().T),
                       rtol=1e-5, atol=1e-6)
    with pytest.raises(ggmlpy.GGMLValueError) as e:
        exec(code, env)
    shown = message.strip()
    assert shown.endswith("; ...)")                      # the README shows the message up to "; ..."
    assert str(e.value).startswith(shown[:-len("...)")])


def test_readme_backend_example_runs(capsys):
    env: dict = {}
    exec(compile(_readme_blocks()[1], "README.md", "exec"), env)
    assert "memory" in capsys.readouterr().out
    assert not env["weights"].allocated and not env["weights"].buffers      # closed at the end
    assert env["placement"].device_of(1).type == "CPU"
