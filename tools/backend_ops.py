"""ggml's own op tests (llama.cpp's ``test-backend-ops``) against the installed ggmlpy's libraries.

    python tools/backend_ops.py -b Vulkan0                 # the bounded selection below
    python tools/backend_ops.py -b CUDA0 --all             # every op and case (long)
    python tools/backend_ops.py -b Vulkan0 -- -o ROPE      # anything after -- goes to the program

``test-backend-ops`` runs each case on a backend and on the CPU backend and compares. Its source is one
file of llama.cpp's ``tests/``, from the same archive as ggml's (``vendor/ggml/PIN``: downloaded with pip
once, checked against the pinned sha256, kept in ``build/backend-ops/``, never committed). It is compiled
against the headers in ``vendor/ggml/src`` and the libraries of the ggmlpy that ``import ggmlpy``
finds, so it tests the ggml build the package ships (a Vulkan or CUDA build: ``pip install`` with
``CMAKE_ARGS``).

The default selection is sized for Mesa's software Vulkan driver, on which every new shader variant
costs seconds to a minute to compile: the ops ggmlpy's models build, with the matrix products limited
to matrix-vector products of the weight types of its files (F32, F16, Q4_0, Q8_0, Q4_K, Q6_K) and
flash attention to one-token decodes over caches of F16, Q8_0 and Q4_0. Exit status: the program's.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "vendor" / "ggml"))
import fetch  # noqa: E402  (vendor/ggml/fetch.py: the pinned archive)

SOURCE = "vendor/llama.cpp/tests/test-backend-ops.cpp"
OUT = ROOT / "build" / "backend-ops"

#: ``(ops, params regex)`` runs of the default selection (see the module docstring)
SELECTION = [
    ("ADD,MUL,SCALE,RMS_NORM,NORM,ROPE,SOFT_MAX,GET_ROWS,SET_ROWS,GLU", None),
    ("MUL_MAT", r"^type_a=(f32|f16|q4_0|q8_0|q4_K|q6_K),type_b=f32,m=16,n=1,k=256,bs=\[1,1\],nr=\[1,1\],"
                r"per=\[0,1,2,3\],k_v=0,o=1,"),
    ("FLASH_ATTN_EXT", r"^hsk=64,hsv=64,nh=4,nr23=\[4,1\],kv=512,nb=1,mask=1,sinks=0,max_bias=0\.000000,"
                       r"logit_softcap=0\.000000,prec=f32,type_K=(f16|q8_0|q4_0),"),
]


def source() -> Path:
    """``test-backend-ops.cpp`` of the pinned archive (downloaded and extracted once)."""
    dest = OUT / "test-backend-ops.cpp"
    if dest.is_file():
        return dest
    pin = fetch.read_pin(ROOT / "vendor" / "ggml" / "PIN")
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=OUT) as tmp:
        archive = fetch.download(pin, Path(tmp))
        if fetch.sha256_of(archive) != pin["sha256"]:
            raise SystemExit(f"{archive.name}: sha256 is not the pinned {pin['sha256']}")
        with tarfile.open(archive) as tf:
            member = next((m for m in tf.getmembers() if m.name.split("/", 1)[-1] == SOURCE), None)
            if member is None:
                raise SystemExit(f"{archive.name} has no {SOURCE}")
            data = tf.extractfile(member).read()
    tmp_dest = dest.with_suffix(".tmp")
    tmp_dest.write_bytes(data)
    os.replace(tmp_dest, dest)
    return dest


def program() -> Path:
    """The compiled program, linked against the installed ggmlpy's libggml (rebuilt when that changes)."""
    import ggmlpy

    libs = Path(ggmlpy.__file__).parent
    if not (libs / "libggml.so").is_file():
        raise SystemExit(f"{libs}: no libggml.so (an editable install keeps it in its build folder; "
                         "install ggmlpy with pip install . to test its libraries)")
    exe = OUT / "test-backend-ops"
    stamp = OUT / "libs.txt"
    if exe.is_file() and stamp.is_file() and stamp.read_text() == str(libs) \
            and exe.stat().st_mtime > (libs / "libggml.so").stat().st_mtime:
        return exe
    cmd = [os.environ.get("CXX", "c++"), "-O1", "-std=c++17", "-o", str(exe), str(source()),
           f"-I{ROOT / 'vendor/ggml/src/include'}", f"-L{libs}", "-lggml", "-lggml-base",
           f"-Wl,-rpath,{libs}", "-lpthread"]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    stamp.write_text(str(libs))
    return exe


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-b", "--backend", required=True, help="the backend to test (Vulkan0, CUDA0, ...)")
    ap.add_argument("--all", action="store_true", help="every op and case, not the bounded selection")
    ap.add_argument("extra", nargs="*", help="after --: arguments for test-backend-ops itself (then no selection)")
    args = ap.parse_args(argv)
    exe = program()
    runs = [[]] if args.all else [["-o", ops] + (["-p", params] if params else []) for ops, params in SELECTION]
    if args.extra:
        runs = [args.extra]
    status = 0
    for run in runs:
        cmd = [str(exe), "test", "-b", args.backend, *run]
        print("+", " ".join(cmd), flush=True)
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        # the cases that failed, and the summary; the whole output only when something failed
        lines = [re.sub(r"\x1b\[[0-9;]*m", "", ln) for ln in proc.stdout.splitlines()]
        failed = [ln for ln in lines if "FAIL" in ln]
        passed = sum(1 for ln in lines if ln.rstrip().endswith("OK") and "(" in ln)
        print(f"  {passed} cases passed, {len(failed)} failed (exit {proc.returncode})")
        if proc.returncode != 0:
            print("\n".join(lines[-200:]))
            status = status or proc.returncode
    return status


if __name__ == "__main__":
    sys.exit(main())
