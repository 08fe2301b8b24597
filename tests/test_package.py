"""The installed package: versions, build info, self-contained libraries, the pin."""

from __future__ import annotations

import hashlib
import io
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import ggmlpy
from ggmlpy import _core

ROOT = Path(__file__).resolve().parents[1]


def test_versions():
    assert ggmlpy.__version__ == "0.1.0"
    pin = (ROOT / "vendor/ggml/PIN").read_text()
    assert "package = llama-cpp-python" in pin and "version = 0.3.36" in pin
    # The pinned sdist's vendor/llama.cpp/ggml folder is ggml 0.25.3.
    assert ggmlpy.ggml_version() == "0.25.3"


def test_system_info_lists_cpu():
    info = ggmlpy.system_info()
    assert "CPU" in info["backends"]
    assert "RPC" in info["backends"]          # on by default
    cpu = [d for d in info["devices"] if d["type"] == "CPU"]
    assert cpu and cpu[0]["memory_total"] > 0
    assert info["ggml"] == ggmlpy.ggml_version()


def test_cli_info_runs():
    out = subprocess.run([sys.executable, "-m", "ggmlpy.cli", "info"], capture_output=True, text=True, check=True)
    assert "ggml 0.25.3" in out.stdout and "CPU" in out.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ELF check")
def test_extension_finds_ggml_in_its_own_folder():
    pkg = Path(_core.__file__).parent
    libs = {p.name for p in pkg.iterdir()}
    for name in ("libggml.so", "libggml-base.so", "libggml-cpu.so"):
        assert any(n.startswith(name) for n in libs), f"{name} missing from {pkg}"
    dyn = subprocess.run(["readelf", "-d", _core.__file__], capture_output=True, text=True, check=True).stdout
    runpath = [line for line in dyn.splitlines() if "RUNPATH" in line or "RPATH" in line]
    assert runpath and "$ORIGIN" in runpath[0]
    # Every ggml library the extension needs resolves to a file in the package folder.
    ldd = subprocess.run(["ldd", _core.__file__], capture_output=True, text=True, check=True).stdout
    for line in ldd.splitlines():
        if "libggml" in line:
            assert str(pkg) in line, line


def test_only_pin_fetch_script_and_our_patches_are_tracked():
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    files = subprocess.run(["git", "ls-files", "vendor/ggml"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    patches = [f for f in files if f.startswith("vendor/ggml/patches/")]
    assert sorted(set(files) - set(patches)) == ["vendor/ggml/PIN", "vendor/ggml/fetch.py"]
    for f in patches:   # NNNN-what.patch, each with a header saying why before the diff
        name = Path(f).name
        assert name[:4].isdigit() and name[4] == "-" and name.endswith(".patch"), name
        text = (ROOT / f).read_text()
        assert text.index("Why:") < text.index("\n--- ") and "upstream" in text[:text.index("\n--- ")]


def _load_fetch():
    import importlib.util

    spec = importlib.util.spec_from_file_location("ggml_fetch", ROOT / "vendor/ggml/fetch.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


SDIST_FILES = {"pkg-1.0/ggml/CMakeLists.txt": b"project(x)\n",
               "pkg-1.0/ggml/include/ggml.h": b"/* */\n",
               "pkg-1.0/other/file.txt": b"not extracted\n"}


def _fake_sdist(tmp_path: Path, files=None) -> Path:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, data in (files or SDIST_FILES).items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    path = tmp_path / "pkg-1.0.tar.gz"
    path.write_bytes(buf.getvalue())
    return path


def _pinned(tmp_path: Path, monkeypatch, files=None, subfolder="ggml"):
    """fetch.py with HERE in tmp_path, pinned to a fake sdist of ``files`` that "download" copies."""
    fetch = _load_fetch()
    archive = _fake_sdist(tmp_path, files)
    good = hashlib.sha256(archive.read_bytes()).hexdigest()
    (tmp_path / "PIN").write_text(f"package = pkg\nversion = 1.0\nsha256 = {good}\nsubfolder = {subfolder}\n")
    monkeypatch.setattr(fetch, "HERE", tmp_path)
    monkeypatch.setattr(fetch, "download", lambda pin, into: Path(shutil.copy(archive, into)))
    return fetch


def test_fetch_verifies_hash_and_extracts_only_the_subfolder(tmp_path, monkeypatch):
    fetch = _pinned(tmp_path, monkeypatch)
    dest = tmp_path / "src"
    fetch.fetch(dest)
    assert (dest / "CMakeLists.txt").read_bytes() == b"project(x)\n"
    assert (dest / "include/ggml.h").exists()
    assert not (dest / "other").exists()

    # A wrong hash is refused, names the way out, and leaves no tree behind.
    (tmp_path / "PIN").write_text(f"package = pkg\nversion = 1.0\nsha256 = {'0' * 64}\nsubfolder = ggml\n")
    dest2 = tmp_path / "src2"
    with pytest.raises(fetch.FetchError) as ei:
        fetch.fetch(dest2)
    assert "sha256 mismatch" in str(ei.value) and "GGMLPY_GGML_DIR" in str(ei.value)
    assert not dest2.exists()


def test_fetch_extracts_a_nested_subfolder(tmp_path, monkeypatch):
    # The pin's subfolder may be a path (llama-cpp-python: vendor/llama.cpp/ggml).
    fetch = _pinned(tmp_path, monkeypatch, {"pkg-1.0/vendor/llama.cpp/ggml/CMakeLists.txt": b"project(x)\n",
                                            "pkg-1.0/vendor/llama.cpp/ggml/src/a.c": b"/* */\n",
                                            "pkg-1.0/vendor/llama.cpp/src/llama.cpp": b"not extracted\n",
                                            "pkg-1.0/ggml/CMakeLists.txt": b"not extracted\n"},
                    subfolder="vendor/llama.cpp/ggml")
    dest = tmp_path / "src"
    fetch.fetch(dest)
    assert (dest / "CMakeLists.txt").read_bytes() == b"project(x)\n"
    assert (dest / "src/a.c").exists()
    assert sorted(p.name for p in dest.iterdir()) == [".ggmlpy-patches", "CMakeLists.txt", "src"]
    assert not fetch._inside("pkg-1.0/vendor/llama.cpp/ggml2/x", "vendor/llama.cpp/ggml")
    assert not fetch._inside("pkg-1.0/vendor/../ggml/x", "vendor/../ggml")


PATCH_OK = """Header: why and what upstream does.

--- a/include/ggml.h
+++ b/include/ggml.h
@@ -1,2 +1,3 @@
 /* one */
-/* two */
+/* two, patched */
+/* three */
"""


def test_fetch_applies_patches_in_order_and_refuses_one_that_does_not_apply(tmp_path, monkeypatch):
    fetch = _pinned(tmp_path, monkeypatch, {"pkg-1.0/ggml/CMakeLists.txt": b"project(x)\n",
                                            "pkg-1.0/ggml/include/ggml.h": b"/* one */\n/* two */\n"})
    (tmp_path / "patches").mkdir()
    (tmp_path / "patches/0001-first.patch").write_text(PATCH_OK)
    # the second patch applies only on top of the first: order matters
    (tmp_path / "patches/0002-second.patch").write_text(
        PATCH_OK.replace("@@ -1,2 +1,3 @@", "@@ -1,3 +1,3 @@")
                .replace("-/* two */\n+/* two, patched */\n+/* three */", " /* two, patched */\n-/* three */\n+/* 3 */"))
    dest = tmp_path / "src"
    fetch.fetch(dest)
    assert (dest / "include/ggml.h").read_text() == "/* one */\n/* two, patched */\n/* 3 */\n"
    assert fetch.fetch(dest) == dest                          # up to date: not fetched again
    # A patch that does not apply stops the fetch, names itself, and leaves no tree.
    (tmp_path / "patches/0003-stale.patch").write_text(PATCH_OK.replace("/* one */", "/* gone */"))
    dest2 = tmp_path / "src2"
    with pytest.raises(fetch.FetchError, match="0003-stale.patch does not apply: hunk 1 of include/ggml.h"):
        fetch.fetch(dest2)
    assert not dest2.exists()
    # A patch cut short inside a hunk (fewer lines than its header says) is refused, not half-applied.
    (tmp_path / "patches/0003-stale.patch").unlink()
    (tmp_path / "patches/0003-cut.patch").write_text(PATCH_OK.replace("@@ -1,2 +1,3 @@", "@@ -1,2 +1,4 @@"))
    with pytest.raises(fetch.FetchError, match="0003-cut.patch: hunk .* says 2/4"):
        fetch.fetch(dest2)
    assert not dest2.exists()


def test_fetch_reports_an_unreachable_registry(tmp_path, monkeypatch):
    fetch = _load_fetch()
    (tmp_path / "PIN").write_text("package = ggmlpy-no-such-package-xyz\nversion = 0.0.1\n"
                                  f"sha256 = {'0' * 64}\nsubfolder = ggml\n")
    monkeypatch.setattr(fetch, "HERE", tmp_path)
    # An index that does not exist stands in for an unreachable registry.
    monkeypatch.setenv("PIP_INDEX_URL", (tmp_path / "no-index").as_uri())
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_NO_INDEX", "")
    with pytest.raises(fetch.FetchError) as ei:
        fetch.fetch(tmp_path / "src")
    assert "could not download" in str(ei.value) and "GGMLPY_GGML_DIR" in str(ei.value)
