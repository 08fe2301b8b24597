"""The installed package: versions, build info, self-contained libraries, the pin."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

import ggmlpy
from ggmlpy import _core

ROOT = Path(__file__).resolve().parents[2]


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
    bufs = [b.name for b in ggmlpy.device("CPU").extra_buffer_types()]
    assert ggmlpy.system_info()["cpu_weight_buffers"] == bufs
    # AMX where ggml offers it but its kernels fault here (checked in a child process) is marked unused
    from ggmlpy.backend import amx_usable

    shown = [b if b != "AMX" or amx_usable() else "AMX (faults on this machine: not used)" for b in bufs]
    assert f"CPU weight repacking: {', '.join(shown) or '(none)'}" in out.stdout
    assert "own kernels: mode " in out.stdout                    # and the own kernels' choices


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ELF check")
def test_extension_finds_ggml_in_its_own_folder():
    pkg = Path(_core.__file__).parent
    libs = {p.name for p in pkg.iterdir()}
    # a portable build carries its CPU backend as libggml-cpu-<variant>.so, loaded at import
    cpu = "libggml-cpu-" if ggmlpy.cpu_variant() else "libggml-cpu.so"
    for name in ("libggml.so", "libggml-base.so", cpu):
        assert any(n.startswith(name) for n in libs), f"{name} missing from {pkg}"
    dyn = subprocess.run(["readelf", "-d", _core.__file__], capture_output=True, text=True, check=True).stdout
    runpath = [line for line in dyn.splitlines() if "RUNPATH" in line or "RPATH" in line]
    assert runpath and "$ORIGIN" in runpath[0]
    # Every ggml library the extension needs resolves to a file in the package folder.
    ldd = subprocess.run(["ldd", _core.__file__], capture_output=True, text=True, check=True).stdout
    for line in ldd.splitlines():
        if "libggml" in line:
            assert str(pkg) in line, line


def test_cpu_variant_is_the_best_scoring_one_in_the_package():
    from ggmlpy._system import format_system_info

    pkg = Path(_core.__file__).parent
    v = ggmlpy.cpu_variant()
    text = format_system_info()
    if v is None:
        assert "cpu variant: native build" in text
        assert not list(pkg.glob("libggml-cpu-*"))
        return
    name, path = v
    assert Path(path).parent == pkg and Path(path).name == f"libggml-cpu-{name}.so"
    assert f"cpu variant: {name} (libggml-cpu-{name}.so)" in text
    assert ggmlpy.system_info()["cpu_variant"] == (name, path)
    # ggml's own score, asked of every variant in a child process: the chosen one scores highest
    # (a variant this CPU cannot run scores 0).
    code = ("import ctypes, glob, json, sys\n"
            "print(json.dumps({p: ctypes.CDLL(p).ggml_backend_score() for p in sorted(glob.glob(sys.argv[1]))}))")
    out = subprocess.run([sys.executable, "-c", code, str(pkg / "libggml-cpu-*.so")], capture_output=True,
                         text=True, check=True).stdout
    scores = json.loads(out)
    assert len(scores) > 1 and scores[path] == max(scores.values()) > 0, scores
    # The variants that lost were unloaded: this process maps one CPU backend.
    if Path("/proc/self/maps").exists():
        mapped = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
                  if "libggml-cpu-" in line}
        assert mapped == {path}, mapped


@pytest.mark.skipif(_core._cpu_variant() is None, reason="portable builds only")
def test_portable_import_without_its_cpu_backends_raises(tmp_path):
    # A copy of the package with its CPU variants (or the RPC module) removed: a clear ImportError, no crash.
    pkg = Path(_core.__file__).parent
    for missing, message in (("libggml-cpu-*.so", "no CPU backend could be loaded"),
                             ("libggml-rpc.so", "the RPC backend could not be loaded")):
        dest = tmp_path / missing.replace("*", "_") / "ggmlpy"
        shutil.copytree(pkg, dest, ignore=shutil.ignore_patterns(missing, "__pycache__"))
        r = subprocess.run([sys.executable, "-c", "import ggmlpy"], capture_output=True, text=True,
                           cwd=dest.parent, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(dest.parent)})
        assert r.returncode == 1 and "ImportError" in r.stderr and message in r.stderr, r.stderr


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


def test_license_is_mit_and_the_wheel_lists_it():
    """ggmlpy's LICENSE is the MIT License that pyproject.toml declares (PEP 639), and its license-files
    take it into the wheel's .dist-info/licenses/; ggml's notice comes from the pinned sdist."""
    text = (ROOT / "LICENSE").read_text()
    assert text.splitlines()[:3] == ["MIT License", "", "Copyright (c) 2026 the ggmlpy authors"]
    assert "Permission is hereby granted, free of charge," in text and 'PROVIDED "AS IS"' in text
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^license = "MIT"$', pyproject, re.M)
    assert re.search(r'^license-files = \["LICENSE"\]$', pyproject, re.M)
    # PEP 639 metadata needs scikit-build-core 0.11 or later
    floor = re.search(r'"scikit-build-core>=([0-9.]+)"', pyproject).group(1)
    assert tuple(int(x) for x in floor.split(".")) >= (0, 11), floor
    # llama.cpp's LICENSE, beside the ggml folder the pin takes (fetch.py puts it in the tree)
    pin = _load_fetch().read_pin(ROOT / "vendor/ggml/PIN")
    assert pin["license"] == str(Path(pin["subfolder"]).parent / "LICENSE") == "vendor/llama.cpp/LICENSE"


def _load_fetch():
    import importlib.util

    spec = importlib.util.spec_from_file_location("ggml_fetch", ROOT / "vendor/ggml/fetch.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


NOTICE = b"MIT License\n\nCopyright (c) the ggml authors\n"
SDIST_FILES = {"pkg-1.0/ggml/CMakeLists.txt": b"project(x)\n",
               "pkg-1.0/ggml/include/ggml.h": b"/* */\n",
               "pkg-1.0/LICENSE": NOTICE,
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


def _pinned(tmp_path: Path, monkeypatch, files=None, subfolder="ggml", notice="LICENSE"):
    """fetch.py with HERE in tmp_path, pinned to a fake sdist of ``files`` that "download" copies
    (counted in ``fetch.downloads``)."""
    fetch = _load_fetch()
    archive = _fake_sdist(tmp_path, files)
    good = hashlib.sha256(archive.read_bytes()).hexdigest()
    (tmp_path / "PIN").write_text(f"package = pkg\nversion = 1.0\nsha256 = {good}\nsubfolder = {subfolder}\n"
                                  f"license = {notice}\n")
    monkeypatch.setattr(fetch, "HERE", tmp_path)
    fetch.downloads = 0

    def download(pin, into):
        fetch.downloads += 1
        return Path(shutil.copy(archive, into))

    monkeypatch.setattr(fetch, "download", download)
    return fetch


def test_fetch_verifies_hash_and_extracts_only_the_subfolder(tmp_path, monkeypatch):
    fetch = _pinned(tmp_path, monkeypatch)
    dest = tmp_path / "src"
    before = time.time() - 1
    fetch.fetch(dest)
    assert (dest / "CMakeLists.txt").read_bytes() == b"project(x)\n"
    assert (dest / "include/ggml.h").exists()
    assert (dest / "LICENSE").read_bytes() == NOTICE        # the notice, from outside the subfolder
    assert not (dest / "other").exists()
    # The archive says 1970; kept, a build folder of an older pin would not rebuild these sources.
    assert all(f.stat().st_mtime >= before for f in dest.rglob("*"))

    # A wrong hash is refused, names the way out, and leaves no tree behind.
    (tmp_path / "PIN").write_text(f"package = pkg\nversion = 1.0\nsha256 = {'0' * 64}\nsubfolder = ggml\n"
                                  "license = LICENSE\n")
    dest2 = tmp_path / "src2"
    with pytest.raises(fetch.FetchError) as ei:
        fetch.fetch(dest2)
    assert "sha256 mismatch" in str(ei.value) and "GGMLPY_GGML_DIR" in str(ei.value)
    assert not dest2.exists()


def test_fetch_extracts_a_nested_subfolder(tmp_path, monkeypatch):
    # The pin's subfolder may be a path (llama-cpp-python: vendor/llama.cpp/ggml).
    # Its notice is llama.cpp's LICENSE, beside the subfolder (and only that file of llama.cpp comes along).
    fetch = _pinned(tmp_path, monkeypatch, {"pkg-1.0/vendor/llama.cpp/ggml/CMakeLists.txt": b"project(x)\n",
                                            "pkg-1.0/vendor/llama.cpp/ggml/src/a.c": b"/* */\n",
                                            "pkg-1.0/vendor/llama.cpp/LICENSE": NOTICE,
                                            "pkg-1.0/vendor/llama.cpp/LICENSES": b"not extracted\n",
                                            "pkg-1.0/vendor/llama.cpp/src/llama.cpp": b"not extracted\n",
                                            "pkg-1.0/LICENSE": b"not extracted\n",
                                            "pkg-1.0/ggml/CMakeLists.txt": b"not extracted\n"},
                    subfolder="vendor/llama.cpp/ggml", notice="vendor/llama.cpp/LICENSE")
    dest = tmp_path / "src"
    fetch.fetch(dest)
    assert (dest / "CMakeLists.txt").read_bytes() == b"project(x)\n"
    assert (dest / "src/a.c").exists()
    assert (dest / "LICENSE").read_bytes() == NOTICE
    assert sorted(p.name for p in dest.iterdir()) == [".ggmlpy-patches", "CMakeLists.txt", "LICENSE", "src"]
    assert not fetch._inside("pkg-1.0/vendor/llama.cpp/ggml2/x", "vendor/llama.cpp/ggml")
    assert not fetch._inside("pkg-1.0/vendor/../ggml/x", "vendor/../ggml")


def test_fetch_adds_the_notice_to_a_tree_fetched_without_it(tmp_path, monkeypatch):
    # A tree fetched before fetch.py took ggml's notice: LICENSE is added from the (verified) archive and
    # nothing else changes, so build folders made from the tree do not rebuild ggml for a text file.
    fetch = _pinned(tmp_path, monkeypatch)
    dest = tmp_path / "src"
    fetch.fetch(dest)
    assert fetch.fetch(dest) == dest and fetch.downloads == 1        # complete: not fetched again
    (dest / "LICENSE").unlink()
    (dest / "built-here.txt").write_text("a file of the old tree\n")   # proves the tree was not replaced
    old = 1_000_000_000
    os.utime(dest / "include/ggml.h", (old, old))
    fetch.fetch(dest)
    assert fetch.downloads == 2
    assert (dest / "LICENSE").read_bytes() == NOTICE
    assert (dest / "built-here.txt").exists() and (dest / "include/ggml.h").stat().st_mtime == old
    assert not list(tmp_path.glob("ggml-license-*"))                  # no staging left behind
    # Without the notice and with other patches, the tree is fetched whole again.
    (dest / "LICENSE").unlink()
    (dest / fetch.STAMP).write_text("an older patch set\n")
    fetch.fetch(dest)
    assert (dest / "LICENSE").read_bytes() == NOTICE and not (dest / "built-here.txt").exists()


def test_fetch_refuses_an_archive_without_the_notice(tmp_path, monkeypatch):
    files = {k: v for k, v in SDIST_FILES.items() if k != "pkg-1.0/LICENSE"}
    fetch = _pinned(tmp_path, monkeypatch, files)
    dest = tmp_path / "src"
    with pytest.raises(fetch.FetchError, match="has no LICENSE: ggml's license notice, which every wheel must"):
        fetch.fetch(dest)
    assert not dest.exists()
    # Nor is a tree without it patched up from such an archive: it stays as it was.
    dest.mkdir()
    (dest / "CMakeLists.txt").write_text("project(x)\n")
    (dest / fetch.STAMP).write_text("")
    with pytest.raises(fetch.FetchError, match="has no LICENSE"):
        fetch.fetch(dest)
    assert sorted(p.name for p in dest.iterdir()) == [fetch.STAMP, "CMakeLists.txt"]
    # A pin must name the notice.
    (tmp_path / "PIN").write_text((tmp_path / "PIN").read_text().replace("license = LICENSE\n", ""))
    with pytest.raises(fetch.FetchError, match=r"missing keys \['license'\]"):
        fetch.read_pin(tmp_path / "PIN")


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
                                            "pkg-1.0/ggml/include/ggml.h": b"/* one */\n/* two */\n",
                                            "pkg-1.0/LICENSE": NOTICE})
    (tmp_path / "patches").mkdir()
    (tmp_path / "patches/0001-first.patch").write_text(PATCH_OK)
    # the second patch applies only on top of the first: order matters
    (tmp_path / "patches/0002-second.patch").write_text(
        PATCH_OK.replace("@@ -1,2 +1,3 @@", "@@ -1,3 +1,3 @@")
                .replace("-/* two */\n+/* two, patched */\n+/* three */",
                         " /* two, patched */\n-/* three */\n+/* 3 */"))
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
                                  f"sha256 = {'0' * 64}\nsubfolder = ggml\nlicense = LICENSE\n")
    monkeypatch.setattr(fetch, "HERE", tmp_path)
    # An index that does not exist stands in for an unreachable registry.
    monkeypatch.setenv("PIP_INDEX_URL", (tmp_path / "no-index").as_uri())
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_NO_INDEX", "")
    with pytest.raises(fetch.FetchError) as ei:
        fetch.fetch(tmp_path / "src")
    assert "could not download" in str(ei.value) and "GGMLPY_GGML_DIR" in str(ei.value)


# --- wheels and the sdist (opt-in group `wheel`: they build ggml) ---------------------------

# Run by the installed package in a fresh interpreter: import, a graph against numpy, a tiny model's
# logits for a few tokens (printed as JSON for comparison with another build).
SMOKE = r"""
import json, sys
import numpy as np
import ggmlpy
from ggmlpy.models import load_model
from ggmlpy.runner import Runner

rng = np.random.default_rng(0)
a, b = rng.standard_normal((3, 5), dtype=np.float32), rng.standard_normal((4, 5), dtype=np.float32)
ctx = ggmlpy.Context(1 << 20)
out = ctx.soft_max(ctx.mul_mat(ctx.from_numpy(a), ctx.from_numpy(b)))
gf = ctx.new_graph(16)
gf.build_forward_expand(out)
gf.compute(2)
ref = np.exp(b @ a.T - (b @ a.T).max(-1, keepdims=True))
np.testing.assert_allclose(out.numpy(), ref / ref.sum(-1, keepdims=True), rtol=1e-5, atol=1e-6)

model = load_model(sys.argv[1], devices="cpu")
with Runner(model, n_ctx=64) as rt:
    logits = rt.decode([1, 5, 9, 200, 3])
model.close()
print(json.dumps({"file": ggmlpy.__file__, "variant": ggmlpy.cpu_variant(), "logits": logits.tolist()}))
"""


def _clean_env(**extra) -> dict:
    # nothing of this checkout or this interpreter's site may leak into the child
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(extra)
    return env


def _fresh_venv(path: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    return path / "bin" / "python"


def _assert_licenses(whl: Path) -> None:
    """``whl`` carries ggmlpy's notice and ggml's in .dist-info/licenses/ (PEP 639), its METADATA naming
    the license and ggmlpy's file (ggml's comes from CMake's install: see pyproject.toml)."""
    with zipfile.ZipFile(whl) as z:
        names = z.namelist()
        (meta,) = [n for n in names if re.fullmatch(r"ggmlpy-[^/]+\.dist-info/METADATA", n)]
        lic = meta.replace("METADATA", "licenses/")
        got = sorted(n for n in names if n.startswith(lic) and not n.endswith("/"))    # auditwheel lists folders
        assert got == [lic + "LICENSE", lic + "ggml/LICENSE"], got
        ours, ggml = z.read(lic + "LICENSE"), z.read(lic + "ggml/LICENSE")
        metadata = z.read(meta).decode()
    assert ours.decode().splitlines()[:3] == ["MIT License", "", "Copyright (c) 2026 the ggmlpy authors"]
    assert ggml.decode().splitlines()[:3] == ["MIT License", "", "Copyright (c) 2023-2026 The ggml authors"]
    assert ours == (ROOT / "LICENSE").read_bytes()
    if (ROOT / "vendor/ggml/src/LICENSE").exists():
        assert ggml == (ROOT / "vendor/ggml/src/LICENSE").read_bytes()
    assert "\nLicense-Expression: MIT\n" in metadata and "\nLicense-File: LICENSE\n" in metadata


def _tiny_model(tmp_path: Path) -> Path:
    from ggmlpy.models.synthetic import write_synthetic

    return Path(write_synthetic(tmp_path / "tiny-F16.gguf", size="tiny", type="F16"))


@pytest.mark.slow
@pytest.mark.wheel
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="auditwheel: Linux")
def test_portable_wheel_installs_into_a_fresh_venv_and_runs(tmp_path):
    # GGMLPY_TEST_WHEEL_FILE names a wheel tools/build_wheel.py already made; else build one
    # (its build folder is kept under build/, so a second run recompiles little).
    whl = os.environ.get("GGMLPY_TEST_WHEEL_FILE")
    if not whl:
        r = subprocess.run([sys.executable, str(ROOT / "tools/build_wheel.py"), "--out", str(tmp_path / "wh")],
                           capture_output=True, text=True, env=_clean_env())
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        whl = r.stdout.strip().splitlines()[-1]
    whl = Path(whl)
    assert "manylinux" in whl.name, whl.name
    _assert_licenses(whl)
    py = _fresh_venv(tmp_path / "venv")
    subprocess.run([str(py), "-m", "pip", "install", "-q", str(whl)], check=True, env=_clean_env())

    model = _tiny_model(tmp_path)
    r = subprocess.run([str(py), "-c", SMOKE, str(model)], capture_output=True, text=True, cwd=tmp_path,
                       env=_clean_env())
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["file"].startswith(str(tmp_path / "venv"))
    name, lib = got["variant"]
    assert Path(lib).name == f"libggml-cpu-{name}.so"
    info = subprocess.run([str(tmp_path / "venv/bin/ggmlpy"), "info"], capture_output=True, text=True,
                          cwd=tmp_path, env=_clean_env(), check=True).stdout
    assert f"cpu variant: {name} (libggml-cpu-{name}.so)" in info and "ggml 0.25.3" in info

    # The same logits as this build's (native or portable: other kernels, so a tolerance).
    r = subprocess.run([sys.executable, "-c", SMOKE, str(model)], capture_output=True, text=True, check=True,
                       cwd=tmp_path)
    ref = np.asarray(json.loads(r.stdout.strip().splitlines()[-1])["logits"])
    out = np.asarray(got["logits"])
    assert out.shape == ref.shape and np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, atol=0.02 * np.abs(ref).max())


@pytest.mark.slow
@pytest.mark.wheel
def test_sdist_builds_a_wheel_offline(tmp_path):
    if not (ROOT / "vendor/ggml/src/CMakeLists.txt").exists():
        subprocess.run([sys.executable, str(ROOT / "vendor/ggml/fetch.py")], check=True)
    # Online, beforehand: wheels of the build requirements (and cmake/ninja, which scikit-build-core
    # asks for when the machine has none) in one folder.
    text = (ROOT / "pyproject.toml").read_text()
    reqs = re.findall(r'"([^"]+)"', re.search(r"^requires\s*=\s*\[(.*?)\]", text, re.S | re.M).group(1))
    local = tmp_path / "local-wheels"
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "-d", str(local), *reqs, "cmake>=3.21", "ninja"],
                   check=True)

    sdist_dir = tmp_path / "sdist"
    subprocess.run([sys.executable, "-c", "import sys, scikit_build_core.build as b; b.build_sdist(sys.argv[1])",
                    str(sdist_dir)], cwd=ROOT, check=True)
    (sdist,) = sdist_dir.glob("ggmlpy-*.tar.gz")
    with tarfile.open(sdist) as tf:
        names = tf.getnames()
    top = names[0].split("/")[0]
    assert f"{top}/vendor/ggml/src/CMakeLists.txt" in names
    assert f"{top}/vendor/ggml/src/src/ggml-cpu/ggml-cpu.c" in names
    assert {f"{top}/LICENSE", f"{top}/vendor/ggml/src/LICENSE"} <= set(names)      # both notices
    assert not any(n.startswith(f"{top}/build/") for n in names)

    # Offline: no index, and any connection attempt goes to a closed port.
    dead = "http://127.0.0.1:9"
    env = _clean_env(PIP_NO_INDEX="1", PIP_FIND_LINKS=str(local), http_proxy=dead, https_proxy=dead,
                     HTTP_PROXY=dead, HTTPS_PROXY=dead, GGML_NATIVE="ON")
    env.pop("PIP_INDEX_URL", None)
    env.pop("CMAKE_ARGS", None)
    out = tmp_path / "wheel"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-index", "--find-links", str(local),
                        "-w", str(out), str(sdist)], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (whl,) = out.glob("ggmlpy-*.whl")
    with zipfile.ZipFile(whl) as z:
        names = z.namelist()
    assert any(n.startswith("ggmlpy/_core.") for n in names)
    assert {"ggmlpy/libggml.so", "ggmlpy/libggml-base.so", "ggmlpy/libggml-cpu.so"} <= set(names)
    _assert_licenses(whl)


@pytest.mark.skipif(not shutil.which("readelf"), reason="readelf (binutils) reads the libraries' rpath")
def test_build_wheel_checks_a_variant_wheel_for_its_backend_library(tmp_path, monkeypatch):
    """tools/build_wheel.py --backend: a variant wheel must hold its backend's library, finding
    libggml-base beside it; a Vulkan build refuses first when its build packages are missing."""
    import zipfile

    import ggmlpy

    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import build_wheel as bw
    finally:
        sys.path.remove(str(ROOT / "tools"))
    lib = Path(ggmlpy._core.__file__).with_name("libggml-rpc.so")      # an $ORIGIN-rpath library of this build
    whl = tmp_path / "ggmlpy-0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.write(lib, "ggmlpy/libggml-vulkan.so")
    assert bw.check_wheel(whl, "vulkan", portable=False) == []
    with pytest.raises(SystemExit, match="ggmlpy/libggml-cuda.so missing"):
        bw.check_wheel(whl, "cuda", portable=False)
    with pytest.raises(SystemExit, match="not a portable build"):
        bw.check_wheel(whl, "vulkan")
    monkeypatch.setattr(bw.shutil, "which", lambda name: None)
    monkeypatch.setattr(bw, "VULKAN_PACKAGES", (("libvulkan-dev", "/nonexistent/vulkan.h"), ("glslc", "glslc")))
    with pytest.raises(SystemExit, match="--backend vulkan needs: apt-get install libvulkan-dev glslc"):
        bw.check_build_tools("vulkan")
    bw.check_build_tools("cpu")
