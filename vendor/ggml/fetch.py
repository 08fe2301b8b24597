"""Fetch ggml's source for the build from the pinned registry package.

Reads ``PIN`` beside this file (package, version, sha256, subfolder, license),
downloads that sdist with pip, checks its sha256, extracts only ``subfolder/`` (a
path inside the sdist's top folder, possibly nested) and the ``license`` file
(ggml's notice, which every wheel must carry: llama.cpp's LICENSE, outside the
subfolder) as ``LICENSE`` in it, applies our patches (``patches/NNNN-*.patch``
beside this file, in name order; each says in its header why it exists) and
moves the result into ``src/`` beside this file. A patch that does not apply
stops the fetch and leaves no tree. Run by CMake when ``src/CMakeLists.txt`` or
``src/LICENSE`` is missing; run it by hand to refresh the tree (it also
refetches when ``src/`` was patched with another set; a tree fetched before the
notice was taken only gets ``LICENSE`` added, its sources left untouched)::

    python vendor/ggml/fetch.py [--force] [--dest DIR]

No registry host is named here: pip finds the package through its own
configuration, so mirrors and offline indexes work unchanged.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
WAY_OUT = (
    "To build without the registry, point CMake at any ggml source tree: "
    "pip install . -C cmake.define.GGMLPY_GGML_DIR=/path/to/ggml "
    "(or CMAKE_ARGS=-DGGMLPY_GGML_DIR=/path/to/ggml)."
)


STAMP = ".ggmlpy-patches"   # in the extracted tree: the sha256 of each patch applied


class FetchError(RuntimeError):
    pass


def read_pin(path: Path) -> dict[str, str]:
    pin: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            key, _, value = line.partition("=")
            pin[key.strip()] = value.strip()
    missing = {"package", "version", "sha256", "subfolder", "license"} - pin.keys()
    if missing:
        raise FetchError(f"{path}: missing keys {sorted(missing)}")
    return pin


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def download(pin: dict[str, str], into: Path) -> Path:
    # --no-binary names only our package: with ':all:' pip would also insist on
    # building the sdist's *build* requirements (cmake itself) from source just
    # to read its metadata, which takes many minutes for nothing.
    args = ["download", "--no-deps", "--no-binary", pin["package"], "--disable-pip-version-check",
            f"{pin['package']}=={pin['version']}", "-d", str(into)]
    env = None
    if importlib.util.find_spec("pip") is not None:
        cmd = [sys.executable, "-m", "pip", *args]
    elif shutil.which("pip") or shutil.which("pip3"):
        # An isolated build environment without pip: use the one on PATH, with
        # the build environment's path overrides removed.
        cmd = [shutil.which("pip") or shutil.which("pip3"), *args]
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONHOME")}
    else:
        raise FetchError(f"pip is not available to download {pin['package']}=={pin['version']}.\n{WAY_OUT}")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    files = [p for p in into.iterdir() if p.is_file()]
    if proc.returncode != 0 or len(files) != 1:
        raise FetchError(
            f"could not download {pin['package']}=={pin['version']} with pip "
            f"(exit {proc.returncode}).\n{proc.stderr.strip()[-2000:]}\n{WAY_OUT}"
        )
    return files[0]


def patch_files(patch_dir: Path) -> list[Path]:
    return sorted(patch_dir.glob("*.patch")) if patch_dir.is_dir() else []


def patch_stamp(patches: list[Path]) -> str:
    return "".join(f"{sha256_of(p)}  {p.name}\n" for p in patches)


def _parse_patch(text: str, name: str) -> list[tuple[str, list[tuple[int, list[str], list[str]]]]]:
    # A unified diff (diff -ru / git diff): text before the first '--- ' line
    # is the header. Returns [(path, [(old_start, old_lines, new_lines)])].
    files: list = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            path = lines[i + 1][4:].split("\t")[0].strip()
            path = path.split("/", 1)[1] if path.startswith("b/") else path
            files.append((path, []))
            i += 2
            continue
        if line.startswith("@@ "):
            if not files:
                raise FetchError(f"{name}: a hunk before any file header")
            try:
                old_range, new_range = line.split()[1][1:], line.split()[2][1:]
                old_start = int(old_range.split(",")[0])
                old_len = int(old_range.split(",")[1]) if "," in old_range else 1
                new_len = int(new_range.split(",")[1]) if "," in new_range else 1
            except (IndexError, ValueError):
                raise FetchError(f"{name}: malformed hunk header {line!r}") from None
            old: list[str] = []
            new: list[str] = []
            i += 1
            while i < len(lines) and lines[i][:1] in (" ", "-", "+", "\\", ""):
                body = lines[i]
                if body.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
                    break
                tag, rest = (body[:1] or " "), body[1:]
                if tag in (" ", "-"):
                    old.append(rest)
                if tag in (" ", "+"):
                    new.append(rest)
                i += 1
            if len(old) != old_len or len(new) != new_len:
                # a patch cut short (or edited by hand) must not half-apply
                raise FetchError(f"{name}: hunk {line.strip()!r} has {len(old)}/{len(new)} lines, its header "
                                 f"says {old_len}/{new_len}")
            files[-1][1].append((old_start, old, new))
            continue
        i += 1
    if not files:
        raise FetchError(f"{name}: no file changes found (not a unified diff?)")
    return files


def apply_patch(patch: Path, root: Path) -> None:
    """Apply one unified diff to the tree at ``root``; raise FetchError, changing nothing, if any hunk fails."""
    out: dict[Path, list[str]] = {}
    for rel, hunks in _parse_patch(patch.read_text(), patch.name):
        target = root / rel
        if ".." in Path(rel).parts or not target.is_file():
            raise FetchError(f"{patch.name}: {rel} is not a file of the ggml tree")
        # split on "\n" only (str.splitlines would also split form feeds and turn CRLF into LF)
        with open(target, encoding="utf-8", newline="") as f:
            text = f.read()
        lines = out.get(target)
        if lines is None:
            lines = text.split("\n")
            if text.endswith("\n"):
                lines.pop()
        offset = 0
        for k, (start, old, new) in enumerate(hunks, 1):
            at = start - 1 + offset
            if lines[at:at + len(old)] != old:
                # ggml moved the lines: accept one exact match anywhere else, never a guess.
                hits = [j for j in range(len(lines) - len(old) + 1) if lines[j:j + len(old)] == old]
                if len(hits) != 1:
                    raise FetchError(
                        f"{patch.name} does not apply: hunk {k} of {rel} (at line {start}) "
                        f"{'matches nowhere' if not hits else f'matches {len(hits)} places'} in this ggml. "
                        f"Port the patch to the pinned ggml (vendor/ggml/PIN) or drop it.")
                at = hits[0]
            lines[at:at + len(old)] = new
            offset = at + len(new) - (start - 1) - len(old)
        out[target] = lines
    for target, lines in out.items():
        with open(target, "w", encoding="utf-8", newline="") as f:
            f.write("\n".join(lines) + "\n")


def apply_patches(root: Path, patches: list[Path]) -> None:
    for p in patches:
        apply_patch(p, root)
    (root / STAMP).write_text(patch_stamp(patches))


def _extract_into(archive: Path, paths: list[str], staging: Path) -> Path:
    """Extract what lies under each of ``paths`` (inside the archive's top folder) into ``staging``;
    returns that top folder there (``staging`` itself when nothing matched)."""
    if archive.name.endswith((".tar.gz", ".tgz")):
        with tarfile.open(archive) as tf:
            members = [m for m in tf.getmembers()
                       if any(_inside(m.name, p) for p in paths) and (m.isfile() or m.isdir())]
            tf.extractall(staging, members=members, filter="data")
    elif archive.suffix == ".zip":
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(staging, [n for n in zf.namelist() if any(_inside(n, p) for p in paths)])
    else:
        raise FetchError(f"unknown archive type: {archive.name}")
    roots = list(staging.iterdir())
    return roots[0] if len(roots) == 1 else staging


def _notice_in(root: Path, notice: str, archive: Path) -> Path:
    path = root / notice
    if not path.is_file():
        raise FetchError(f"{archive.name} has no {notice}: ggml's license notice, which every wheel must "
                         f"carry (vendor/ggml/PIN: license)")
    return path


def extract(archive: Path, subfolder: str, dest: Path, patches: list[Path] = (),
            notice: str | None = None) -> None:
    """``subfolder`` of ``archive``, patched, as the tree ``dest``; with ``notice`` (a file of the archive,
    ggml's license) copied into it as ``LICENSE``. Leaves no tree on any error."""
    staging = Path(tempfile.mkdtemp(prefix="ggml-src-", dir=dest.parent))
    try:
        root = _extract_into(archive, [subfolder] + ([notice] if notice else []), staging)
        if not (root / subfolder / "CMakeLists.txt").is_file():
            raise FetchError(f"{archive.name} has no {subfolder}/CMakeLists.txt")
        if notice:
            found = _notice_in(root, notice, archive)
            if found != root / subfolder / "LICENSE":      # a ggml sdist's subfolder carries its own
                shutil.copyfile(found, root / subfolder / "LICENSE")
        apply_patches(root / subfolder, list(patches))
        # The archive's file times are old (the sdist's, often years back): kept, a build folder
        # made from the previous pin would find every object newer than its source and relink
        # stale objects. Extraction time makes a new pin (or re-fetch) rebuild what it replaces.
        now = time.time()
        for f in (root / subfolder).rglob("*"):
            os.utime(f, (now, now), follow_symlinks=False)
        if dest.exists():
            shutil.rmtree(dest)
        # Rename is atomic: a build that dies half-way never leaves a partial tree.
        os.replace(root / subfolder, dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def add_notice(archive: Path, notice: str, dest: Path) -> None:
    """Put the archive's ``notice`` file into the tree at ``dest`` as ``LICENSE``, touching nothing else:
    a tree fetched before fetch.py took the notice keeps its sources and their times, so the build
    folders made from it do not rebuild ggml for a text file."""
    staging = Path(tempfile.mkdtemp(prefix="ggml-license-", dir=dest.parent))
    try:
        found = _notice_in(_extract_into(archive, [notice], staging), notice, archive)
        os.replace(found, dest / "LICENSE")
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _inside(name: str, subfolder: str) -> bool:
    # subfolder may be nested ("vendor/llama.cpp/ggml"); the archive's first
    # component is its top folder (e.g. "pkg-1.0/").
    parts = [p for p in name.split("/") if p not in ("", ".")]
    sub = [p for p in subfolder.split("/") if p not in ("", ".")]
    return (len(parts) >= 1 + len(sub) and parts[1:1 + len(sub)] == sub
            and ".." not in parts and ".." not in sub)


def fetch(dest: Path, force: bool = False) -> Path:
    pin = read_pin(HERE / "PIN")
    patches = patch_files(HERE / "patches")
    stamp = dest / STAMP
    current = ((dest / "CMakeLists.txt").is_file() and not force
               and stamp.is_file() and stamp.read_text() == patch_stamp(patches))
    if current and (dest / "LICENSE").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ggml-dl-") as tmp:
        archive = download(pin, Path(tmp))
        got = sha256_of(archive)
        if got != pin["sha256"].lower():
            raise FetchError(
                f"sha256 mismatch for {archive.name}: got {got}, "
                f"pinned {pin['sha256']}. Refusing to build from it.\n{WAY_OUT}"
            )
        if current:
            add_notice(archive, pin["license"], dest)       # a tree fetched before the notice was taken
        else:
            extract(archive, pin["subfolder"], dest, patches, pin["license"])
    return dest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dest", type=Path, default=HERE / "src")
    ap.add_argument("--force", action="store_true", help="fetch even if present")
    args = ap.parse_args(argv)
    try:
        out = fetch(args.dest.resolve(), args.force)
    except FetchError as e:
        print(f"ggmlpy: {e}", file=sys.stderr)
        return 1
    print(f"ggml source ready in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
