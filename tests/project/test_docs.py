"""The documentation runs: docstring examples, every code block of the README and of ``docs/``, the site.

* The Examples sections of ggmlpy's docstrings run and give what they show.
* Every fenced block of ``README.md`` and ``docs/*.md`` runs (python blocks in-process, bash blocks as
  ``ggmlpy`` commands), on the small files of tests/docs_helpers.py, unless it says why not
  (``<!-- no-test: REASON -->`` on the line above its fence; docs_helpers' docstring has the rules).
* ``mkdocs build --strict`` builds the site without a warning (skipped only where MkDocs is not
  installed and ``CI`` is not set).
"""

from __future__ import annotations

import builtins
import doctest
import os
import re
import shlex
import subprocess
import sys

import docs_helpers as dh
import numpy as np
import pytest

import ggmlpy
from ggmlpy import _core, _system

# ------------------------------------------------------------------------------------ docstring examples


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


# ------------------------------------------------------------------------------------ README and docs/

BLOCKS = [b for path in dh.doc_files() for b in dh.blocks(path)]
PYTHON = [b for b in BLOCKS if b.lang == "python" and b.skip is None]
BASH = [b for b in BLOCKS if b.lang == "bash" and b.skip is None]
#: a line that shows the exception it raises: ``code   # SomeError: the message's start``
RAISES = re.compile(r"^(?P<code>\S.*?)\s+#\s*(?P<exc>[A-Z]\w*(?:Error|Unavailable|Aborted|Full|TooLong)):\s*"
                    r"(?P<message>.*?)\s*$")


@pytest.fixture(scope="module")
def examples(tmp_path_factory):
    """The folder the blocks run in: model.gguf, mmproj.gguf, cat.png (tests/docs_helpers.py)."""
    return dh.example_folder(tmp_path_factory.mktemp("examples"))


#: the blocks' environment: ggmlpy's cache folder of their own (shared by them: the roofline and kernel
#: timings are measured once), and no AMX probe (ggml's AMX kernels run once per process in a child to
#: see whether they fault, seconds on a machine with AMX; tests/core/test_repack.py tests it)
@pytest.fixture(scope="module")
def docs_env(tmp_path_factory):
    return {"GGMLPY_CACHE": str(tmp_path_factory.mktemp("ggmlpy-cache")), "GGMLPY_AMX": "0"}


@pytest.fixture
def in_examples(examples, docs_env, monkeypatch):
    monkeypatch.chdir(examples)
    for k, v in docs_env.items():
        monkeypatch.setenv(k, v)
    return examples


def test_every_block_runs_or_says_why_not():
    assert dh.doc_files()[0].name == "README.md" and len(dh.doc_files()) >= 12
    for b in BLOCKS:
        assert b.lang in dh.RUN_LANGS + dh.SHOWN_LANGS, \
            f"{b.id}: a ```{b.lang or '(no language)'} block; use python or bash (run) or text (output shown)"
        if b.skip is not None:
            assert b.lang in dh.RUN_LANGS, f"{b.id}: a no-test marker on a text block (text never runs)"
    # a marker is always the line above a fence: one anywhere else would silently mark nothing
    for path in dh.doc_files():
        lines = path.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            if line.lstrip().startswith("<!--") and "test" in line:
                assert dh.NO_TEST.match(line.strip()), f"{path.name}:{i + 1}: write <!-- no-test: REASON -->"
                assert i + 1 < len(lines) and lines[i + 1].lstrip().startswith("```"), \
                    f"{path.name}:{i + 1}: a no-test marker must be the line just above a fence"
    assert len(PYTHON) >= 20 and len(BASH) >= 5


def _exception(name: str) -> type | None:
    """A builtin exception, or one of ggmlpy's by name (they all derive from ``GGMLError``)."""
    found = getattr(builtins, name, None)
    todo = [ggmlpy.GGMLError]
    while found is None and todo:
        cls = todo.pop()
        found = cls if cls.__name__ == name else None
        todo += cls.__subclasses__()
    return found


def _run_python(code: str, where: str) -> dict:
    """Run a block; a line that shows an exception (:data:`RAISES`) must raise it, message included."""
    env: dict = {"__name__": "__docs__"}
    chunk: list[str] = []

    def flush():
        if chunk:
            exec(compile("\n".join(chunk), where, "exec"), env)       # noqa: S102 (the docs' own code)
            chunk.clear()

    for line in code.splitlines():
        m = RAISES.match(line)
        assert m is not None or not RAISES.match(line.strip()), \
            f"{where}: {line.strip()!r}: only a top-level line may show the exception it raises (it is checked)"
        if m is None:
            chunk.append(line)
            continue
        flush()
        exc = _exception(m["exc"])
        assert isinstance(exc, type) and issubclass(exc, BaseException), f"{where}: no exception {m['exc']}"
        with pytest.raises(exc) as e:
            exec(compile(m["code"], where, "exec"), env)              # noqa: S102
        shown = m["message"].removesuffix("...").removesuffix("; ...)").rstrip()
        assert str(e.value).startswith(shown), f"{where}: {e.value!s} does not start with {shown!r}"
    flush()
    return env


#: a python block's process: it runs the block as _run_python does here
_CHILD = f"""import sys
sys.path[:0] = [{str(dh.ROOT / "tests")!r}, {os.path.dirname(os.path.abspath(__file__))!r}]
import test_docs
test_docs._run_python(sys.stdin.read(), sys.argv[1])
"""


@pytest.mark.parametrize("block", PYTHON, ids=[b.id for b in PYTHON])
def test_python_block(block, in_examples):
    # A process of its own, as a user's script has: no state earlier tests left in this one (an RPC
    # server registered for the whole process and since stopped, handles the collector has not freed).
    r = subprocess.run([sys.executable, "-c", _CHILD, block.id], input=block.code, cwd=in_examples,
                       env=dict(os.environ), capture_output=True, text=True, encoding="utf-8", timeout=600)
    assert r.returncode == 0, f"{block.id}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"


def _ggmlpy_command(line: str, where: str) -> tuple[dict, list[str]]:
    words = shlex.split(line)
    env = {}
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        k, v = words.pop(0).split("=", 1)
        env[k] = v
    assert words and words[0] == "ggmlpy", \
        f"{where}: {line!r}: a bash block that runs holds ggmlpy commands only (mark it no-test otherwise)"
    assert not set(words) & {"|", ">", "<", "&&", ";"}, f"{where}: {line!r}: one simple command a line"
    return env, words[1:]


@pytest.mark.parametrize("block", BASH, ids=[b.id for b in BASH])
def test_bash_block(block, in_examples):
    env = dict(os.environ, PYTHONIOENCODING="utf-8")        # in_examples set docs_env in os.environ
    commands = dh.commands(block)
    assert commands, f"{block.id}: an empty block"
    for line in commands:
        extra, args = _ggmlpy_command(line, block.id)
        r = subprocess.run([sys.executable, "-m", "ggmlpy", *args], cwd=in_examples, env={**env, **extra},
                           input="Hello\n", capture_output=True, text=True, encoding="utf-8", timeout=300)
        assert r.returncode == 0, f"{block.id}: {line}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"


# ------------------------------------------------------------------------------------ the README itself


def _readme_block(lang: str, needle: str) -> dh.Block:
    found = [b for b in BLOCKS if b.path.name == "README.md" and b.lang == lang and needle in b.code]
    assert len(found) == 1, f"README: {len(found)} {lang} blocks with {needle!r}"
    return found[0]


def test_readme_is_a_guide_not_a_reference():
    readme = (dh.ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 260
    # CI (.ci/run) runs the README's test command: the two must not drift apart
    ci = (dh.ROOT / ".ci" / "run").read_text(encoding="utf-8")
    quick = _readme_block("bash", "pytest").code
    for command in ('pip install ".[test]"', "python -m pytest tests -q"):
        assert command in quick and command in ci, command
    assert "ggmlpy bench" in _readme_block("bash", 'pip install ".[test]"').code
    # the path from install to text: a model from the hub, run, chat, Python
    hub = _readme_block("bash", "ggmlpy run -hf")
    assert "ggmlpy run -hf" in hub.code and "ggmlpy chat -hf" in hub.code
    assert re.search(r'`ggmlpy\.open\("hf://[^"]+"\)`', readme)
    assert "ggmlpy.open(" in _readme_block("python", "with ggmlpy.open").code
    # and served: the command, then the openai client asking it (the alias the command gives)
    serve = _readme_block("bash", "ggmlpy serve")
    client = _readme_block("python", "from openai import OpenAI").code
    alias = re.search(r"--alias (\S+)", serve.code)[1]
    assert f'model="{alias}"' in client and len(client.strip().splitlines()) <= 5
    # every guide page is linked from the README
    for page in sorted((dh.ROOT / "docs").glob("*.md")):
        if page.name not in ("index.md", "measurements.md"):
            assert f"(docs/{page.name}" in readme, f"README does not link docs/{page.name}"


def test_readme_tensor_example_computes_what_it_says():
    code = _readme_block("python", "ggmlpy.Context(16 << 20)").code
    env = _run_python(code, "README.md")
    want = (lambda z: z / (1 + np.exp(-z)))(env["x"].numpy() @ env["w"].numpy().T)
    assert np.allclose(env["y"].numpy(), want, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------ the site


def test_mkdocs_builds_without_warnings(tmp_path):
    try:
        import mkdocs  # noqa: F401
        import mkdocstrings  # noqa: F401
    except ImportError:
        if os.environ.get("CI"):
            raise
        pytest.skip("MkDocs is not installed (pip install '.[docs]'); under CI=true this fails")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(dh.ROOT / "mkdocs.yml"),
                        "-d", str(tmp_path / "site")], cwd=dh.ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    assert "WARNING" not in out, out[-6000:]
    site = tmp_path / "site"
    for page in ("index.html", "install/index.html", "api/ggmlpy/index.html", "measurements/index.html"):
        assert (site / page).is_file(), page
    api = (site / "api" / "ggmlpy" / "index.html").read_text(encoding="utf-8")
    # _core's docstrings reach the reference (tools/griffe_core.py): Context.mul_mat's, for one
    assert "Matrix product" in api and "ggmlpy.Context.mul_mat" in api
    # measurements.md includes bench/README.md whole
    assert "realsize.py" in (site / "measurements" / "index.html").read_text(encoding="utf-8")
