"""Prompt-processing and token-generation throughput, measured the way llama.cpp's llama-bench does.

``ggmlpy bench`` (and ``python -m ggmlpy.benchmark``) takes llama-bench's
options with their meanings and defaults, runs the same tests and prints the
same table, CSV, JSON or JSONL, so results can be read by the same tools.

What a test is
--------------
Every test parameter takes comma lists, repeats (``-p 16 -p 32``) and integer
ranges (``a-b``, ``a-b+step``, ``a-b*mult``); all lists are combined as a
cartesian product. For each combination there is one **pp** test per ``-p``
value (process a prompt of that many tokens, in chunks of ``-b``), one **tg**
test per ``-n`` value (generate that many tokens one decode at a time) and one
**pg** test per ``-pg`` pair (both in one timed run). Token ids are random, as
in llama-bench: no tokenizer and no sampling is timed. Each test runs one
untimed warm-up (a full prompt and one generated token), then ``-r``
repetitions; each repetition clears the cache, prefills ``-d`` tokens untimed
and times the prompt and/or generation. The rate of a test is the mean of the
per-repetition rates ``(n_prompt + n_gen) / t`` and its ``±`` the sample
standard deviation of those rates.

What llama-bench's options mean here
------------------------------------
They drive ggmlpy's runner, so each means what it can mean for it, and a value
that cannot run is refused when the command line is parsed:

* ``-ctk``/``-ctv`` pair freely (ggml's flash attention reads K and V each in
  its own type); without flash attention V is stored transposed, which a
  quantized type cannot be, so a quantized ``-ctv`` with ``-fa off`` is refused
  (:meth:`ggmlpy.runner.Runner.check_cache_types`). A quantized type also needs
  a head size that is a multiple of its block; a model without one fails its
  tests with that message.
* ``-lm none|mmap`` (``-mmp 0|1``, its older spelling; default mmap): the
  loader reads the weights with ``read(2)``, or copies them out of a memory map
  of the file (:class:`ggmlpy.gguf.MappedFile`); either way they end up in
  ggmlpy's own buffers. ``mlock``, ``mmap+mlock`` and ``dio`` are refused.
  Written, as llama-bench writes it, in the ``load_mode`` field.
* ``-nkvo 1``: the K/V cache of every layer stays in host memory whatever
  device computes the layer (``Runner(offload_kqv=False)``); the same as 0 on
  the CPU alone.
* ``-embd 1``: every decode outputs the final-normed hidden state of every
  token (``Runner.decode(embeddings=True)``, the embeddings path) instead of
  the last token's logits. llama.cpp's embeddings mode also outputs every
  token, but computes logits for them too.
* ``--repack 0|1`` (default 1): matrix weights go to the CPU's extra buffer
  types where ggml has kernels for their type and shape (``CPU_REPACK``,
  ``AMX``; ``load_model(repack=...)``), as llama.cpp's loader does; 0 keeps
  every weight in plain memory. Written in the ``repack`` field.

Beyond llama-bench
------------------
* With no ``-m``, a built-in model: a llama GGUF with random weights of the
  size and type chosen by ``--synthetic`` and ``--type`` (comma lists sweep),
  written once to the cache folder (:mod:`ggmlpy.models.synthetic`).
* Extra fields in CSV/JSON/JSONL (after llama-bench's): ``engine``,
  ``engine_version``, ``ggmlpy_version``, ``load_time_ms`` (wall time of
  loading the model the test ran on) and ``ttft_ms`` (time to first token:
  the mean over repetitions of the time from the start of the timed part to the
  end of the decode that produces the first new token's logits, i.e. the whole
  prompt for pp and pp+tg tests and the first one-token decode for tg tests;
  depth prefill is not included, sampling is excluded as everywhere here).
* ``--vs llama.cpp`` runs the same tests, with the same token ids, through
  llama-cpp-python in a separate process (the two packages each ship a
  ``libggml-base.so`` with the same soname, so they must never share a
  process), interleaved test by test with ggmlpy's, and adds the ratio
  ggmlpy/llama.cpp with its spread to each ggmlpy row. The peer gets the same
  options (cache types, flash attention, load mode, KV offload, embeddings,
  repack).
* ``--rounds N`` runs every test N times, each time ggmlpy and the peers back
  to back (the peers first in every other round); the repetitions of all
  rounds make the row's t/s, and the ratio is the median of the N per-round ratios (``±``: their standard
  deviation), which a burst of other work on a shared machine cannot sway.
* ``--plot FILE.png`` draws t/s against the swept prompt size, depth or thread
  count, one line per model, engine and kind of test (needs matplotlib).
* ``-v`` prints the memory report (weights, cache, graph per device) of each
  test's configuration.

This module imports ggmlpy's compiled extension lazily: the llama.cpp worker
runs this same file as a script and must not load ggml twice.
"""

from __future__ import annotations

import argparse
import csv
import io
import itertools
import json
import math
import os
import re
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, TextIO

import numpy as np

__all__ = [
    "BenchError", "BenchParams", "Instance", "Result", "format_results", "main", "make_instances",
    "parse_args", "parse_int_range", "run",
]

PROG = "ggmlpy bench"

#: llama-bench's CSV/JSON field list (source @ 0104b151, with the ``repack`` of the llama.cpp in
#: llama-cpp-python 0.3.36, the peer of ``--vs``), in order.
FIELDS = (
    "build_commit", "build_number", "cpu_info", "gpu_info", "backends",
    "model_filename", "model_type", "model_size", "model_n_params", "n_batch",
    "n_ubatch", "n_threads", "cpu_mask", "cpu_strict", "poll",
    "type_k", "type_v", "n_gpu_layers", "n_cpu_moe", "split_mode",
    "main_gpu", "no_kv_offload", "flash_attn", "devices", "tensor_split",
    "tensor_buft_overrides", "load_mode", "embeddings",
    "no_op_offload", "no_host", "repack", "fit_target", "fit_min_ctx",
    "n_prompt", "n_gen", "n_depth",
    "test_time", "avg_ns", "stddev_ns", "avg_ts", "stddev_ts",
)
INT_FIELDS = frozenset((
    "build_number", "n_batch", "n_ubatch", "n_threads", "poll", "model_size", "model_n_params",
    "n_gpu_layers", "main_gpu", "n_prompt", "n_gen", "n_depth", "avg_ns", "stddev_ns",
    "no_op_offload", "n_cpu_moe", "fit_target", "fit_min_ctx", "flash_attn",
))
BOOL_FIELDS = frozenset(("no_kv_offload", "cpu_strict", "embeddings", "no_host", "repack"))
FLOAT_FIELDS = frozenset(("avg_ts", "stddev_ts"))

#: Our fields, written after llama-bench's (and after the samples in JSON).
EXTRA_FIELDS = ("engine", "engine_version", "ggmlpy_version", "load_time_ms", "ttft_ms")

#: Cache types llama-bench accepts (ggml type names).
CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl")
#: Load modes (-lm) ggmlpy's loader has: read(2) into the buffers, or copy out of a memory map.
LOAD_MODES = ("none", "mmap")
OUTPUTS = ("md", "csv", "json", "jsonl", "sql", "none")
PEERS = ("llama.cpp",)
_TRUTHY = ("on", "enabled", "true", "1")
_FALSEY = ("off", "disabled", "false", "0")
_AUTOY = ("auto", "-1")


if __name__ == "__main__":
    # the llama.cpp worker process (this file run as a script) must not load ggml: its errors only
    # travel as JSON text, so a plain ValueError base is enough there
    _BenchErrorBase: type = ValueError
    GGMLErrorBase: type = ValueError
else:
    from ggmlpy._core import GGMLError as GGMLErrorBase
    from ggmlpy._core import GGMLValueError as _BenchErrorBase


class BenchError(_BenchErrorBase):
    """A bad option value or an engine that cannot run (a :class:`ggmlpy.GGMLError` and a ValueError)."""


# --------------------------------------------------------------------------- parsing

_RANGE = re.compile(r"(-?\d+)(?:-(\d+)(?:([+*])(\d+))?)?")


def parse_int_range(text: str, allow_negative: bool = False) -> list[int]:
    """Parse llama-bench's integer lists: ``a``, ``a-b``, ``a-b+step``, ``a-b*mult``, comma-separated.

    Parameters
    ----------
    text : str
        E.g. ``"16,32"``, ``"1-4"``, ``"64-512*2"``, ``"0-1024+256"``.
    allow_negative : bool
        Accept a negative first value (``-ngl -1``).

    Returns
    -------
    list of int

    Raises
    ------
    BenchError
        Malformed text, a negative value where none is allowed, or a range whose
        step does not increase (``4-8*1``, ``0-8*2``).

    Examples
    --------
    >>> parse_int_range("1-4,8")
    [1, 2, 3, 4, 8]
    >>> parse_int_range("64-512*2")
    [64, 128, 256, 512]
    """
    out: list[int] = []
    parts = text.split(",")
    if not text or any(p == "" for p in parts):
        raise BenchError(f"invalid range {text!r}: empty item")
    for part in parts:
        m = _RANGE.fullmatch(part.strip())
        if not m or (m.group(1).startswith("-") and not allow_negative):
            raise BenchError(f"invalid range {text!r}: expected N, A-B, A-B+STEP or A-B*MULT")
        first = int(m.group(1))
        last = int(m.group(2)) if m.group(2) is not None else first
        op = m.group(3) or "+"
        step = int(m.group(4)) if m.group(4) is not None else 1
        i = first
        while i <= last:
            out.append(i)
            nxt = i + step if op == "+" else i * step
            if nxt <= i:
                raise BenchError(f"invalid range {text!r}: the step does not increase")
            i = nxt
    return out


def _split(text: str) -> list[str]:
    items = [s.strip() for s in text.split(",")]
    if any(not s for s in items):
        raise BenchError(f"invalid list {text!r}: empty item")
    return items


def _parse_fa(text: str) -> list[int]:
    out = []
    for v in _split(text):
        lv = v.lower()
        if lv in _TRUTHY:
            out.append(1)
        elif lv in _FALSEY:
            out.append(0)
        elif lv in _AUTOY:
            out.append(-1)
        else:
            raise BenchError(f"invalid -fa value {v!r}: expected on, off or auto")
    return out


def _parse_bools(option: str) -> Callable[[str], list[bool]]:
    """A parser of llama-bench's ``0|1`` lists (on/off, true/false also read)."""
    def parse(text: str) -> list[bool]:
        out = []
        for v in _split(text):
            lv = v.lower()
            if lv in _TRUTHY:
                out.append(True)
            elif lv in _FALSEY:
                out.append(False)
            else:
                raise BenchError(f"invalid {option} value {v!r}: expected 0 or 1")
        return out
    return parse


def _parse_mmap(text: str) -> list[str]:
    # llama-bench's -mmp is the deprecated spelling of -lm mmap / -lm none: one field, load_mode
    return ["mmap" if b else "none" for b in _parse_bools("-mmp")(text)]


def _parse_load_modes(text: str) -> list[str]:
    out = []
    for v in _split(text):
        lv = v.lower()
        if lv in LOAD_MODES:
            out.append(lv)
        elif lv in ("mlock", "mmap+mlock", "dio"):
            raise BenchError(f"-lm {v}: not supported by ggmlpy's loader, which reads the weights (none) or "
                             "copies them out of a memory map of the file (mmap); it has no mlock or direct I/O")
        else:
            raise BenchError(f"invalid -lm value {v!r}: expected {' or '.join(LOAD_MODES)}")
    return out


def _parse_cache_types(text: str) -> list[str]:
    out = []
    for v in _split(text):
        if v.lower() not in CACHE_TYPES:
            raise BenchError(f"invalid cache type {v!r}: expected one of {', '.join(CACHE_TYPES)}")
        out.append(v.lower())
    return out


def _parse_devices(text: str) -> list[str]:
    out = []
    for combo in _split(text):
        names = [s.strip() for s in combo.split("/")]
        if any(not n for n in names):
            raise BenchError(f"invalid device list {combo!r}")
        out.append("/".join(names))
    return out


def _parse_pg(text: str) -> tuple[int, int]:
    parts = text.split(",")
    if len(parts) != 2:
        raise BenchError(f"invalid -pg {text!r}: expected PROMPT,GEN such as 512,128")
    try:
        pp, tg = int(parts[0]), int(parts[1])
    except ValueError:
        raise BenchError(f"invalid -pg {text!r}: expected two integers") from None
    if pp < 0 or tg < 0:
        raise BenchError(f"invalid -pg {text!r}: negative size")
    return pp, tg


def default_threads() -> int:
    """Physical CPU cores usable by this process (llama-bench's default for ``-t``)."""
    try:
        allowed = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        allowed = set(range(os.cpu_count() or 1))
    try:
        cores = set()
        proc = phys = core = None
        with open("/proc/cpuinfo") as f:
            for line in itertools.chain(f, [""]):
                if not line.strip():
                    if proc is not None and proc in allowed:
                        cores.add((phys, core if core is not None else proc))
                    proc = phys = core = None
                    continue
                key, _, val = line.partition(":")
                key = key.strip()
                if key == "processor":
                    proc = int(val)
                elif key == "physical id":
                    phys = val.strip()
                elif key == "core id":
                    core = val.strip()
        if cores:
            return len(cores)
    except (OSError, ValueError):
        pass
    return max(1, len(allowed))


@dataclass
class BenchParams:
    """The parsed command line: every test parameter as the list it sweeps."""

    models: list[str] = field(default_factory=list)
    n_prompt: list[int] = field(default_factory=lambda: [512])
    n_gen: list[int] = field(default_factory=lambda: [128])
    n_pg: list[tuple[int, int]] = field(default_factory=list)
    n_depth: list[int] = field(default_factory=lambda: [0])
    n_batch: list[int] = field(default_factory=lambda: [2048])
    n_ubatch: list[int] = field(default_factory=lambda: [512])
    type_k: list[str] = field(default_factory=lambda: ["f16"])
    type_v: list[str] = field(default_factory=lambda: ["f16"])
    n_threads: list[int] = field(default_factory=lambda: [default_threads()])
    n_gpu_layers: list[int] = field(default_factory=lambda: [-1])
    devices: list[str] = field(default_factory=lambda: ["auto"])
    flash_attn: list[int] = field(default_factory=lambda: [-1])
    load_mode: list[str] = field(default_factory=lambda: ["mmap"])
    no_kv_offload: list[bool] = field(default_factory=lambda: [False])
    embeddings: list[bool] = field(default_factory=lambda: [False])
    repack: list[bool] = field(default_factory=lambda: [True])
    reps: int = 5
    rounds: int = 1
    delay: float = 0.0
    output: str = "md"
    output_err: str = "none"
    progress: bool = False
    verbose: bool = False
    no_warmup: bool = False
    synthetic: list[str] = field(default_factory=lambda: ["110M"])
    types: list[str] = field(default_factory=lambda: ["F16"])
    cache_dir: str | None = None
    plot: str | None = None
    vs: list[str] = field(default_factory=list)
    seed: int = 0
    rpc: list[str] = field(default_factory=list)
    list_devices: bool = False


#: (option strings, BenchParams attribute, parser, help) for the swept test parameters. Several options may
#: fill one attribute (-mmp and -lm both give load_mode).
_LIST_OPTIONS: list[tuple[tuple[str, ...], str, Callable[[str], list], str]] = [
    (("-m", "--model"), "models", lambda s: [s], "GGUF model file (repeat for more; default: "
     "the built-in synthetic model)"),
    (("-p", "--n-prompt"), "n_prompt", parse_int_range, "prompt sizes (default 512)"),
    (("-n", "--n-gen"), "n_gen", parse_int_range, "generation sizes (default 128)"),
    (("-pg",), "n_pg", lambda s: [_parse_pg(s)], "PROMPT,GEN: prompt then generation in one test"),
    (("-d", "--n-depth"), "n_depth", parse_int_range, "tokens already in the cache (default 0)"),
    (("-b", "--batch-size"), "n_batch", parse_int_range, "logical batch size (default 2048)"),
    (("-ub", "--ubatch-size"), "n_ubatch", parse_int_range, "physical batch size (default 512)"),
    (("-ctk", "--cache-type-k"), "type_k", _parse_cache_types,
     f"K cache type: {', '.join(CACHE_TYPES)} (default f16)"),
    (("-ctv", "--cache-type-v"), "type_v", _parse_cache_types,
     "V cache type, as -ctk; a quantized V needs -fa on or auto (default f16)"),
    (("-t", "--threads"), "n_threads", parse_int_range, "CPU threads (default: physical cores)"),
    (("-ngl", "--n-gpu-layers"), "n_gpu_layers", lambda s: parse_int_range(s, True),
     "layers on the GPU (default -1: all)"),
    (("-dev", "--device"), "devices", _parse_devices,
     "devices, '/'-separated (auto, none = CPU only; default auto)"),
    (("-fa", "--flash-attn"), "flash_attn", _parse_fa, "flash attention: on, off, auto (default auto)"),
    (("-nkvo", "--no-kv-offload"), "no_kv_offload", _parse_bools("-nkvo"),
     "1: keep the KV cache in host memory when layers run on another device (default 0)"),
    (("-lm", "--load-mode"), "load_mode", _parse_load_modes,
     "none: read the weights; mmap: copy them out of a memory map of the file (default mmap)"),
    (("-mmp", "--mmap"), "load_mode", _parse_mmap, "0|1: -lm none|mmap (llama-bench's older spelling)"),
    (("--repack",), "repack", _parse_bools("--repack"),
     "0: keep every weight in plain memory; 1: matrix weights in the CPU's extra buffer types where ggml has "
     "kernels for them (CPU_REPACK, AMX; default 1)"),
    (("-embd", "--embeddings"), "embeddings", _parse_bools("-embd"),
     "1: measure the embeddings path (hidden states of every token, no output head; default 0)"),
    (("--synthetic",), "synthetic", _split, "built-in model size when no -m: tiny, 15M, 42M, "
     "110M, 1B or a count (default 110M)"),
    (("--type",), "types", _split, "built-in model weight type: F16, Q8_0, Q4_0, Q4_K_M (default F16)"),
]


class _Swept(argparse.Action):
    """Collects every list option in command-line order (two options may fill one list: -lm and -mmp)."""

    def __call__(self, parser, namespace, values, option_string=None):
        namespace.swept = [*namespace.swept, (self.dest, values)]


class _ArgParser(argparse.ArgumentParser):
    def error(self, message: str):  # raise instead of exiting, main() reports
        raise BenchError(message)


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The argument parser of ``ggmlpy bench`` (llama-bench's options plus ours)."""
    ap = _ArgParser(prog=prog, description="Prompt processing (pp) and token generation (tg) "
                    "throughput, llama-bench compatible.", allow_abbrev=False)
    for i, (opts, _attr, _, help_) in enumerate(_LIST_OPTIONS):
        ap.add_argument(*opts, dest=str(i), action=_Swept, metavar="V", help=help_)
    ap.set_defaults(swept=[])
    ap.add_argument("-r", "--repetitions", dest="reps", type=int, default=5,
                    help="timed repetitions per test (default 5)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run each test this many times, alternating with --vs peers; the ratio is then the "
                         "median of the per-round ratios (default 1)")
    ap.add_argument("--delay", type=float, default=0.0, help="seconds of sleep before each test")
    ap.add_argument("-o", "--output", default="md", choices=OUTPUTS, help="stdout format (default md)")
    ap.add_argument("-oe", "--output-err", default="none", choices=OUTPUTS,
                    help="second copy of the results on stderr (default none)")
    ap.add_argument("-v", "--verbose", action="store_true",
                    help="print the memory report of each configuration (and llama.cpp's logs)")
    ap.add_argument("--progress", action="store_true", help="print test progress on stderr")
    ap.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up run")
    ap.add_argument("--list-devices", action="store_true", help="list ggml devices and exit")
    ap.add_argument("-rpc", "--rpc", dest="rpc", action="append", metavar="HOST:PORT,...",
                    help="add ggml RPC servers")
    ap.add_argument("--cache-dir", default=None,
                    help="folder of the built-in models (default $GGMLPY_CACHE or ~/.cache/ggmlpy)")
    ap.add_argument("--plot", default=None, metavar="FILE.png",
                    help="plot t/s against the swept prompt size, depth or threads (matplotlib)")
    ap.add_argument("--vs", action="append", default=None, metavar="ENGINE",
                    help="also run the tests through ENGINE (llama.cpp: the llama_cpp package) "
                    "and print the ratio")
    ap.add_argument("--seed", type=int, default=0,
                    help="seed of the random token ids and of the built-in model (default 0)")
    return ap


def _normalize_argv(argv: list[str]) -> list[str]:
    out: list[str] = []
    for a in argv:
        if a.startswith("--") and "_" in a:
            name, eq, rest = a.partition("=")
            a = name.replace("_", "-") + eq + rest
        if re.match(r"-\d", a) and out and out[-1].startswith("-") and "=" not in out[-1]:
            out[-1] += "=" + a  # a negative value such as "-ngl -1,99"
            continue
        out.append(a)
    return out


def parse_args(argv: list[str] | None = None) -> BenchParams:
    """Parse ``ggmlpy bench``'s command line.

    Parameters
    ----------
    argv : list of str, optional
        The arguments (default ``sys.argv[1:]``). ``--foo_bar`` is read as
        ``--foo-bar``.

    Returns
    -------
    BenchParams

    Raises
    ------
    BenchError
        An unknown option or a bad value (the message names it).

    Examples
    --------
    >>> p = parse_args(["-p", "64-256*2", "-n", "16", "-t", "1,2"])
    >>> p.n_prompt, p.n_gen, p.n_threads
    ([64, 128, 256], [16], [1, 2])
    """
    args = build_parser().parse_args(_normalize_argv(list(sys.argv[1:] if argv is None else argv)))
    params = BenchParams()
    swept: dict[str, list] = {}
    for i, text in args.swept:
        _opts, attr, conv, _ = _LIST_OPTIONS[int(i)]
        swept.setdefault(attr, []).extend(conv(text))
    for attr, values in swept.items():
        setattr(params, attr, values)
    params.reps = args.reps
    params.rounds = args.rounds
    params.delay = args.delay
    params.output, params.output_err = args.output, args.output_err
    params.verbose, params.progress, params.no_warmup = args.verbose, args.progress, args.no_warmup
    params.cache_dir, params.plot, params.seed = args.cache_dir, args.plot, args.seed
    params.rpc = [s for text in (args.rpc or []) for s in _split(text)]
    params.vs = [v for text in (args.vs or []) for v in _split(text)]
    params.list_devices = args.list_devices
    _validate(params)
    return params


def _validate(p: BenchParams) -> None:
    if p.reps < 1:
        raise BenchError(f"-r {p.reps}: at least one repetition is needed")
    if p.rounds < 1:
        raise BenchError(f"--rounds {p.rounds}: at least one round is needed")
    if p.delay < 0:
        raise BenchError(f"--delay {p.delay}: must be >= 0")
    for name in ("n_prompt", "n_gen", "n_depth"):
        if any(v < 0 for v in getattr(p, name)):
            raise BenchError(f"{name}: sizes must be >= 0")
    for name in ("n_batch", "n_ubatch", "n_threads"):
        if any(v < 1 for v in getattr(p, name)):
            raise BenchError(f"{name}: values must be >= 1")
    _validate_cache_types(p)
    for peer in p.vs:
        if peer.lower() not in ("llama.cpp", "llama_cpp", "llamacpp", "llama-cpp"):
            raise BenchError(f"--vs {peer!r}: the only peer engine is llama.cpp")
    p.vs = ["llama.cpp"] if p.vs else []
    if not p.models:
        from ggmlpy.models.synthetic import TYPES, parse_size

        try:
            p.synthetic = [parse_size(s) for s in p.synthetic]
        except ValueError as e:
            raise BenchError(f"--synthetic: {e}") from None
        p.types = [t.upper() for t in p.types]
        for t in p.types:
            if t not in TYPES:
                raise BenchError(f"--type {t}: expected one of {', '.join(TYPES)}")


def _validate_cache_types(p: BenchParams) -> None:
    """Refuse the -ctk/-ctv/-fa combinations the runner cannot run (its own rule, Runner.check_cache_types)."""
    from ggmlpy.runner import Runner

    bad = []
    for tk, tv, fa in itertools.product(p.type_k, p.type_v, p.flash_attn):
        try:
            Runner.check_cache_types(tk, tv, None if fa < 0 else bool(fa))
        except GGMLErrorBase as e:
            if fa != 0:                       # not the flash attention rule: say what the runner says
                raise BenchError(f"-ctk {tk} -ctv {tv}: {e}") from None
            bad.append(f"-ctk {tk} -ctv {tv} -fa off")
    if bad:
        raise BenchError(f"{', '.join(dict.fromkeys(bad))}: a quantized V cache needs flash attention (-fa on or "
                         "auto), as in llama.cpp: without it V is stored transposed, which a quantized type cannot "
                         "be (a quantized K runs either way)")


# --------------------------------------------------------------------------- instances

@dataclass(frozen=True)
class Instance:
    """One test: a model, a configuration and its sizes."""

    model: str
    n_prompt: int
    n_gen: int
    n_depth: int = 0
    n_batch: int = 2048
    n_ubatch: int = 512
    type_k: str = "f16"
    type_v: str = "f16"
    n_threads: int = 1
    n_gpu_layers: int = -1
    devices: str = "auto"
    flash_attn: int = -1
    load_mode: str = "mmap"
    no_kv_offload: bool = False
    embeddings: bool = False
    repack: bool = True

    @property
    def n_ctx(self) -> int:
        """Context size of the test (llama-bench: prompt + generation + depth)."""
        return self.n_prompt + self.n_gen + self.n_depth

    @property
    def name(self) -> str:
        """llama-bench's test name: ``pp512``, ``tg128``, ``pp512+tg128``, `` @ d1024``."""
        if self.n_prompt > 0 and self.n_gen == 0:
            s = f"pp{self.n_prompt}"
        elif self.n_gen > 0 and self.n_prompt == 0:
            s = f"tg{self.n_gen}"
        else:
            s = f"pp{self.n_prompt}+tg{self.n_gen}"
        return s + (f" @ d{self.n_depth}" if self.n_depth > 0 else "")

    def model_key(self) -> tuple:
        """What decides whether the model must be reloaded between two tests."""
        return (self.model, self.n_gpu_layers, self.load_mode, self.devices, self.repack)


def make_instances(p: BenchParams, models: list[str] | None = None) -> list[Instance]:
    """All tests in llama-bench's order (a model is reloaded as rarely as possible)."""
    out = []
    # llama-bench's nesting: model parameters outermost
    for m, ngl, lm, dev, rpk, embd, nb, nub, tk, tv, nkvo, fa, nt, nd in itertools.product(
            models if models is not None else p.models, p.n_gpu_layers, p.load_mode, p.devices, p.repack,
            p.embeddings, p.n_batch, p.n_ubatch, p.type_k, p.type_v, p.no_kv_offload, p.flash_attn,
            p.n_threads, p.n_depth):
        common = dict(model=m, n_depth=nd, n_batch=nb, n_ubatch=nub, type_k=tk, type_v=tv,
                      n_threads=nt, n_gpu_layers=ngl, devices=dev, flash_attn=fa, load_mode=lm,
                      no_kv_offload=nkvo, embeddings=embd, repack=rpk)
        out += [Instance(n_prompt=n, n_gen=0, **common) for n in p.n_prompt if n > 0]
        out += [Instance(n_prompt=0, n_gen=n, **common) for n in p.n_gen if n > 0]
        out += [Instance(n_prompt=a, n_gen=b, **common) for a, b in p.n_pg if a or b]
    return out


# --------------------------------------------------------------------------- results

def _mean(v: list[float]) -> float:
    return sum(v) / len(v) if v else 0.0


def _stdev(v: list[float]) -> float:
    if len(v) <= 1:
        return 0.0
    m = _mean(v)
    return math.sqrt(max(0.0, sum((x - m) ** 2 for x in v) / (len(v) - 1)))


@dataclass
class Result:
    """The measurements of one test by one engine, and what describes it."""

    inst: Instance
    engine: str
    engine_version: str
    build_commit: str
    build_number: int
    cpu_info: str
    gpu_info: str
    backends: str
    model_type: str
    model_size: int
    model_n_params: int
    load_mode: str
    test_time: str
    samples_ns: list[int]
    ttft_ns: list[int]
    load_time_ms: float
    ggmlpy_version: str = ""
    ratios: dict[str, tuple[float, float]] = field(default_factory=dict)

    @property
    def samples_ts(self) -> list[float]:
        """Per-repetition rates in tokens per second."""
        n = self.inst.n_prompt + self.inst.n_gen
        return [1e9 * n / t for t in self.samples_ns]

    @property
    def avg_ts(self) -> float:
        return _mean(self.samples_ts)

    @property
    def stddev_ts(self) -> float:
        return _stdev(self.samples_ts)

    @property
    def avg_ns(self) -> int:
        return int(_mean([float(t) for t in self.samples_ns]))

    @property
    def stddev_ns(self) -> int:
        return int(_stdev([float(t) for t in self.samples_ns]))

    @property
    def ttft_ms(self) -> float:
        return _mean([t / 1e6 for t in self.ttft_ns])

    def record(self) -> dict[str, Any]:
        """llama-bench's fields with JSON types (bools, ints, floats), in order."""
        i = self.inst
        return {
            "build_commit": self.build_commit, "build_number": self.build_number,
            "cpu_info": self.cpu_info, "gpu_info": self.gpu_info, "backends": self.backends,
            "model_filename": i.model, "model_type": self.model_type,
            "model_size": self.model_size, "model_n_params": self.model_n_params,
            "n_batch": i.n_batch, "n_ubatch": i.n_ubatch, "n_threads": i.n_threads,
            "cpu_mask": "0x0", "cpu_strict": False, "poll": 50,
            "type_k": i.type_k, "type_v": i.type_v, "n_gpu_layers": i.n_gpu_layers,
            "n_cpu_moe": 0, "split_mode": "layer", "main_gpu": 0, "no_kv_offload": i.no_kv_offload,
            "flash_attn": i.flash_attn, "devices": i.devices, "tensor_split": "0.00",
            "tensor_buft_overrides": "none", "load_mode": self.load_mode, "embeddings": i.embeddings,
            "no_op_offload": 0, "no_host": False, "repack": i.repack, "fit_target": 0, "fit_min_ctx": 0,
            "n_prompt": i.n_prompt, "n_gen": i.n_gen, "n_depth": i.n_depth,
            "test_time": self.test_time, "avg_ns": self.avg_ns, "stddev_ns": self.stddev_ns,
            "avg_ts": self.avg_ts, "stddev_ts": self.stddev_ts,
        }

    def extras(self, peers: list[str]) -> dict[str, Any]:
        """Our extra fields; ``ratio_vs_<peer>`` (and its stddev) per peer, None on peer rows."""
        out: dict[str, Any] = {
            "engine": self.engine, "engine_version": self.engine_version,
            "ggmlpy_version": self.ggmlpy_version,
            "load_time_ms": round(self.load_time_ms, 3), "ttft_ms": round(self.ttft_ms, 3),
        }
        for peer in peers:
            r = self.ratios.get(peer)
            out[_ratio_key(peer)] = r[0] if r else None
            out[_ratio_key(peer) + "_stddev"] = r[1] if r else None
        return out

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["inst"] = asdict(self.inst)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Result:
        d = dict(d)
        d["inst"] = Instance(**d["inst"])
        d["ratios"] = {k: tuple(v) for k, v in d.get("ratios", {}).items()}
        return cls(**d)


def _ratio_key(peer: str) -> str:
    return "ratio_vs_" + re.sub(r"[^0-9a-zA-Z]+", "_", peer).strip("_").lower()


def _merge(a: Result, b: Result) -> Result:
    """``a`` with the repetitions of ``b`` (the same test in a later round) added."""
    a.samples_ns = [*a.samples_ns, *b.samples_ns]
    a.ttft_ns = [*a.ttft_ns, *b.ttft_ns]
    return a


def round_ratio(per_round: list[float]) -> tuple[float, float]:
    """The median of per-round ratios, with their sample standard deviation as the spread.

    Each round times ggmlpy and then the peer back to back, so a ratio within a round
    compares the two under the same load; the median ignores a round a burst of other
    work on the machine spoiled.
    """
    v = [x for x in per_round if math.isfinite(x)]
    if not v:
        return (float("nan"), float("nan"))
    v.sort()
    mid = len(v) // 2
    med = v[mid] if len(v) % 2 else (v[mid - 1] + v[mid]) / 2
    return med, _stdev(v)


def ratio(a: Result, b: Result) -> tuple[float, float]:
    """``a.avg_ts / b.avg_ts`` and its spread (relative stddevs added in quadrature)."""
    if b.avg_ts <= 0 or a.avg_ts <= 0:
        return (float("nan"), float("nan"))
    r = a.avg_ts / b.avg_ts
    return r, r * math.hypot(a.stddev_ts / a.avg_ts, b.stddev_ts / b.avg_ts)


# --------------------------------------------------------------------------- printers

def _value_str(name: str, value: Any) -> str:
    """A field as llama-bench's C++ ``std::to_string`` writes it (CSV/SQL)."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if value is None:
        return ""
    if name in FLOAT_FIELDS or isinstance(value, float):
        return f"{value:f}"
    return str(value)


def _md_width(name: str) -> int:
    widths = {"model": -30, "t/s": 20, "size": 10, "params": 10, "n_gpu_layers": 3,
              "n_threads": 7, "n_batch": 7, "n_ubatch": 8, "type_k": 6, "type_v": 6,
              "flash_attn": 3, "devices": -12, "load_mode": 10, "test": 15}
    if name in widths:
        return widths[name]
    w = max(len(name), 10)
    # llama-bench left-aligns only its string fields
    numeric = name in INT_FIELDS or name in FLOAT_FIELDS or name in BOOL_FIELDS or name.startswith("ratio")
    return w if numeric else -w


_MD_DISPLAY = {"n_gpu_layers": "ngl", "n_threads": "threads", "flash_attn": "fa", "devices": "dev",
               "no_kv_offload": "nkvo", "load_mode": "lm", "embeddings": "embd"}


def _size_str(n: int) -> str:
    return f"{n / 1024 / 1024:.2f} MiB" if n < 1024 ** 3 else f"{n / 1024 ** 3:.2f} GiB"


def _params_str(n: int) -> str:
    return f"{n / 1e6:.2f} M" if n < 1e9 else f"{n / 1e9:.2f} B"


class Printer:
    """Writes results as they come: a header, one row per test, a footer."""

    def __init__(self, out: TextIO, params: BenchParams, gpu: bool, build: str):
        self.out, self.params, self.gpu, self.build = out, params, gpu, build

    def header(self) -> None:
        pass

    def rows(self, results: list[Result]) -> None:
        raise NotImplementedError

    def footer(self) -> None:
        pass

    def _write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()


class MarkdownPrinter(Printer):
    """llama-bench's table: fixed columns, then the parameters that were given, then test and t/s."""

    def header(self) -> None:
        p, d = self.params, BenchParams()
        fields = ["model", "size", "params", "backend"]
        if self.p_vs:
            fields.append("engine")
        if self.gpu:
            fields.append("n_gpu_layers")
        if len(p.n_threads) > 1 or p.n_threads != d.n_threads or not self.gpu:
            fields.append("n_threads")
        for name in ("n_batch", "n_ubatch", "type_k", "type_v", "no_kv_offload", "flash_attn", "devices",
                     "load_mode", "embeddings", "repack"):
            if len(getattr(p, name)) > 1 or getattr(p, name) != getattr(d, name):
                fields.append(name)
        fields += ["test", "t/s"]
        fields += [_ratio_key(peer) for peer in p.vs]
        self.fields = fields
        names = [self._display(f) for f in fields]
        self._write("|" + "".join(f" {self._pad(n, _md_width(f))} |" for f, n in zip(fields, names))
                    + "\n")
        self._write("|" + "".join(
            f" {'-' * (abs(_md_width(f)) - 1)}{':' if _md_width(f) > 0 else '-'} |" for f in fields)
            + "\n")

    @property
    def p_vs(self) -> bool:
        return bool(self.params.vs)

    def _display(self, f: str) -> str:
        if f.startswith("ratio_vs_"):
            peer = next(pe for pe in self.params.vs if _ratio_key(pe) == f)
            return f"ggmlpy/{peer}"
        return _MD_DISPLAY.get(f, f)

    @staticmethod
    def _pad(text: str, width: int) -> str:
        return text.ljust(-width) if width < 0 else text.rjust(width)

    def rows(self, results: list[Result]) -> None:
        for r in results:
            rec = r.record()
            cells = []
            for f in self.fields:
                if f == "model":
                    v = r.model_type
                elif f == "size":
                    v = _size_str(r.model_size)
                elif f == "params":
                    v = _params_str(r.model_n_params)
                elif f == "backend":
                    v = r.backends
                elif f == "engine":
                    v = r.engine
                elif f == "test":
                    v = r.inst.name
                elif f == "t/s":
                    v = f"{r.avg_ts:.2f} ± {r.stddev_ts:.2f}"
                elif f.startswith("ratio_vs_"):
                    peer = next(pe for pe in self.params.vs if _ratio_key(pe) == f)
                    rr = r.ratios.get(peer)
                    v = f"{rr[0]:.2f} ± {rr[1]:.2f}" if rr else ""
                else:
                    v = _value_str(f, rec[f])
                cells.append(f" {self._pad(v, _md_width(f))} |")
            self._write("|" + "".join(cells) + "\n")

    def footer(self) -> None:
        self._write(f"\nbuild: {self.build}\n")


class CsvPrinter(Printer):
    """llama-bench's CSV (every value quoted), our extra fields at the end."""

    def header(self) -> None:
        self.names = list(FIELDS) + list(EXTRA_FIELDS) + [
            k for peer in self.params.vs for k in (_ratio_key(peer), _ratio_key(peer) + "_stddev")]
        self._write(",".join(self.names) + "\n")

    def rows(self, results: list[Result]) -> None:
        for r in results:
            rec = {**r.record(), **r.extras(self.params.vs)}
            buf = io.StringIO()
            csv.writer(buf, quoting=csv.QUOTE_ALL, lineterminator="\n").writerow(
                [_value_str(n, rec[n]) for n in self.names])
            self._write(buf.getvalue())


def _json_record(r: Result, peers: list[str]) -> dict[str, Any]:
    rec = r.record()
    rec["samples_ns"] = list(r.samples_ns)
    rec["samples_ts"] = r.samples_ts
    rec.update(r.extras(peers))
    return rec


class JsonPrinter(Printer):
    """A JSON array of test objects (llama-bench's fields, samples, then ours)."""

    def header(self) -> None:
        self.first = True
        self._write("[\n")

    def rows(self, results: list[Result]) -> None:
        for r in results:
            text = json.dumps(_json_record(r, self.params.vs), indent=2)
            text = "\n".join("  " + line for line in text.splitlines())
            self._write(("" if self.first else ",\n") + text)
            self.first = False

    def footer(self) -> None:
        self._write("\n]\n")


class JsonlPrinter(Printer):
    """One JSON object per line."""

    def rows(self, results: list[Result]) -> None:
        for r in results:
            self._write(json.dumps(_json_record(r, self.params.vs)) + "\n")


class SqlPrinter(Printer):
    """llama-bench's SQL: ``CREATE TABLE IF NOT EXISTS llama_bench`` and one INSERT per test."""

    def header(self) -> None:
        def sql_type(f: str) -> str:
            return "REAL" if f in FLOAT_FIELDS else "INTEGER" if (
                f in INT_FIELDS or f in BOOL_FIELDS) else "TEXT"
        cols = ",\n".join(f"  {f} {sql_type(f)}" for f in FIELDS)
        self._write(f"CREATE TABLE IF NOT EXISTS llama_bench (\n{cols}\n);\n\n")

    def rows(self, results: list[Result]) -> None:
        for r in results:
            rec = r.record()
            vals = ", ".join("'" + _value_str(f, rec[f]).replace("'", "''") + "'" for f in FIELDS)
            self._write(f"INSERT INTO llama_bench ({', '.join(FIELDS)}) VALUES ({vals});\n")


_PRINTERS = {"md": MarkdownPrinter, "csv": CsvPrinter, "json": JsonPrinter, "jsonl": JsonlPrinter,
             "sql": SqlPrinter}


def make_printer(fmt: str, out: TextIO, params: BenchParams, gpu: bool = False,
                 build: str = "") -> Printer | None:
    """The printer of format ``fmt`` (None for ``"none"``)."""
    cls = _PRINTERS.get(fmt)
    return cls(out, params, gpu, build) if cls else None


def format_results(results: list[Result], fmt: str = "md", params: BenchParams | None = None,
                   gpu: bool = False, build: str = "") -> str:
    """Results as the text ``ggmlpy bench -o fmt`` prints."""
    buf = io.StringIO()
    pr = make_printer(fmt, buf, params or BenchParams(n_threads=[1]), gpu, build)
    if pr is not None:
        pr.header()
        pr.rows(results)
        pr.footer()
    return buf.getvalue()


# --------------------------------------------------------------------------- engines

def _cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class Engine:
    """What the benchmark loop needs from an inference engine.

    An engine holds at most one model and one context; :func:`run_instance`
    drives it. Subclasses: :class:`GgmlpyEngine` and :class:`LlamaCppEngine`.
    """

    name = "engine"
    version = ""

    def __init__(self) -> None:
        self.model_key: tuple | None = None
        self.load_time_ms = 0.0
        self.info: dict[str, Any] = {}

    def system(self) -> dict[str, Any]:
        """build_commit, build_number, cpu_info, gpu_info."""
        raise NotImplementedError

    def load(self, inst: Instance) -> None:
        """Load ``inst.model`` (placed per ``inst``, read per ``inst.load_mode``), setting :attr:`info`
        (desc, size, n_params, n_vocab, backends)."""
        raise NotImplementedError

    def unload(self) -> None:
        """Free the model."""

    def new_context(self, inst: Instance) -> None:
        """Create the context (KV cache, compute buffers) of a test; with ``inst.embeddings``, later
        decodes output every token's embedding."""
        raise NotImplementedError

    def free_context(self) -> None:
        """Free the context."""

    def clear(self) -> None:
        """Empty the KV cache."""
        raise NotImplementedError

    def decode(self, tokens: np.ndarray) -> None:
        """Append ``tokens`` to the sequence and compute, synchronously."""
        raise NotImplementedError

    def memory_report(self) -> str | None:
        """The memory report of the current context, if the engine has one."""
        return None

    def ensure_model(self, inst: Instance) -> None:
        """Load the model unless the loaded one has the same file and placement."""
        if self.model_key == inst.model_key():
            return
        if self.model_key is not None:
            self.unload()
            self.model_key = None
        t0 = time.perf_counter()
        self.load(inst)
        self.load_time_ms = (time.perf_counter() - t0) * 1e3
        self.model_key = inst.model_key()

    def close(self) -> None:
        """Free everything."""
        self.free_context()
        if self.model_key is not None:
            self.unload()
            self.model_key = None


class GgmlpyEngine(Engine):
    """ggmlpy's llama model and runner."""

    name = "ggmlpy"

    def __init__(self, rpc: list[str] | None = None) -> None:
        super().__init__()
        import ggmlpy

        self.rpc = list(rpc or [])           # -rpc servers: "auto" device choice takes only those named
        self.version = ggmlpy.__version__
        self.model: Any = None
        self.rt: Any = None
        self.embeddings = False

    def system(self) -> dict[str, Any]:
        import ggmlpy

        cpu, gpu = [], []
        for d in ggmlpy.devices():
            kind = getattr(d.type, "name", str(d.type)).upper()
            (gpu if "GPU" in kind else cpu if kind in ("CPU", "ACCEL") else []).append(d.description)
        return {"build_commit": ggmlpy.ggml_commit(), "build_number": 0,
                "cpu_info": ", ".join(cpu), "gpu_info": ", ".join(gpu)}

    def load(self, inst: Instance) -> None:
        from ggmlpy.models import load_model

        devices: Any = {"auto": "auto", "none": "cpu"}.get(inst.devices, inst.devices.split("/"))
        self.model = load_model(inst.model, devices=devices, n_gpu_layers=inst.n_gpu_layers, rpc=self.rpc,
                                mmap=inst.load_mode == "mmap", repack=inst.repack)
        m = self.model
        self.info = {"desc": m.desc, "size": int(m.size), "n_params": int(m.n_params),
                     "n_vocab": int(m.n_vocab), "backends": m.backend_names}

    def unload(self) -> None:
        self.free_context()
        if self.model is not None:
            self.model.close()
            self.model = None

    def new_context(self, inst: Instance) -> None:
        from ggmlpy.runner import Runner

        self.free_context()
        fa = None if inst.flash_attn < 0 else bool(inst.flash_attn)
        self.rt = Runner(self.model, n_ctx=inst.n_ctx, n_batch=inst.n_batch, n_ubatch=inst.n_ubatch,
                         n_seq_max=1, n_threads=inst.n_threads, flash_attn=fa,
                         type_k=inst.type_k, type_v=inst.type_v, offload_kqv=not inst.no_kv_offload)
        self.embeddings = inst.embeddings

    def free_context(self) -> None:
        if self.rt is not None:
            self.rt.close()
            self.rt = None

    def clear(self) -> None:
        self.rt.clear()

    def decode(self, tokens: np.ndarray) -> None:
        if self.embeddings:
            # llama.cpp's embeddings mode outputs every token; ggmlpy's embeddings path gives their
            # hidden states (no output head), as Runner.embed uses them
            self.rt.decode(tokens, seq=0, logits="all", embeddings=True)
        else:
            # llama.cpp's llama_batch_get_one outputs the logits of the last token of
            # every decode; ask for the same work.
            self.rt.decode(tokens, seq=0, logits="last")

    def memory_report(self) -> str | None:
        return str(self.rt.memory_report()) if self.rt is not None else None


class LlamaCppEngine(Engine):
    """llama.cpp through llama-cpp-python's low-level API (run only in a worker process)."""

    name = "llama.cpp"
    _GGML_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8,
                   "iq4_nl": 20, "bf16": 30}

    def __init__(self, verbose: bool = False) -> None:
        super().__init__()
        import llama_cpp

        self.ll = llama_cpp
        self.version = getattr(llama_cpp, "__version__", "")
        self.model: Any = None
        self.ctx: Any = None
        if not verbose:
            # Keep a reference: ctypes callbacks must outlive their registration.
            self._log_cb = llama_cpp.llama_log_callback(lambda level, text, data: None)
            llama_cpp.llama_log_set(self._log_cb, None)
        llama_cpp.llama_backend_init()

    def _fn(self, *names: str) -> Callable:
        for n in names:
            f = getattr(self.ll, n, None)
            if f is not None:
                return f
        raise BenchError(f"llama_cpp {self.version} has none of {', '.join(names)}")

    def system(self) -> dict[str, Any]:
        return {"build_commit": f"llama-cpp-python {self.version}", "build_number": 0,
                "cpu_info": _cpu_model_name(), "gpu_info": ""}

    def load(self, inst: Instance) -> None:
        ll = self.ll
        mp = ll.llama_model_default_params()
        mp.n_gpu_layers = inst.n_gpu_layers if inst.n_gpu_layers >= 0 else 999
        if inst.devices not in ("auto", "none"):
            raise BenchError("-dev with explicit devices is not supported for llama.cpp here")
        if inst.devices == "none":
            mp.n_gpu_layers = 0
        if hasattr(mp, "load_mode"):        # llama.cpp's enum llama_load_mode (it replaced use_mmap)
            mp.load_mode = {"none": getattr(ll, "LLAMA_LOAD_MODE_NONE", 0),
                            "mmap": getattr(ll, "LLAMA_LOAD_MODE_MMAP", 1)}[inst.load_mode]
        else:
            mp.use_mmap = inst.load_mode == "mmap"
        if hasattr(mp, "use_extra_bufts"):
            mp.use_extra_bufts = inst.repack
        elif not inst.repack:
            raise BenchError(f"--repack 0: llama_cpp {self.version} cannot keep weights out of the extra buffer types")
        load = self._fn("llama_model_load_from_file", "llama_load_model_from_file")
        self.model = load(inst.model.encode(), mp)
        if not self.model:
            raise BenchError(f"llama.cpp failed to load {inst.model}")
        import ctypes

        buf = ctypes.create_string_buffer(256)
        ll.llama_model_desc(self.model, buf, 256)
        if hasattr(ll, "llama_model_get_vocab") and hasattr(ll, "llama_vocab_n_tokens"):
            n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.model))
        else:
            n_vocab = ll.llama_n_vocab(self.model)
        gpu = bool(getattr(ll, "llama_supports_gpu_offload", lambda: False)())
        self.info = {"desc": buf.value.decode(errors="replace"),
                     "size": int(ll.llama_model_size(self.model)),
                     "n_params": int(ll.llama_model_n_params(self.model)),
                     "n_vocab": int(n_vocab), "backends": "GPU" if gpu else "CPU"}

    def unload(self) -> None:
        self.free_context()
        if self.model is not None:
            self._fn("llama_model_free", "llama_free_model")(self.model)
            self.model = None

    def new_context(self, inst: Instance) -> None:
        ll = self.ll
        self.free_context()
        cp = ll.llama_context_default_params()
        cp.n_ctx = inst.n_ctx
        cp.n_batch = inst.n_batch
        cp.n_ubatch = inst.n_ubatch
        cp.n_seq_max = 1
        cp.n_threads = inst.n_threads
        cp.n_threads_batch = inst.n_threads
        cp.type_k = self._GGML_TYPES[inst.type_k]
        cp.type_v = self._GGML_TYPES[inst.type_v]
        if hasattr(cp, "flash_attn_type"):
            cp.flash_attn_type = inst.flash_attn
        elif hasattr(cp, "flash_attn"):
            cp.flash_attn = inst.flash_attn == 1
        if hasattr(cp, "swa_full"):
            cp.swa_full = False
        cp.offload_kqv = not inst.no_kv_offload
        cp.embeddings = inst.embeddings
        init = self._fn("llama_init_from_model", "llama_new_context_with_model")
        self.ctx = init(self.model, cp)
        if not self.ctx:
            raise BenchError("llama.cpp failed to create the context")
        self._tok = None

    def free_context(self) -> None:
        if self.ctx is not None:
            self.ll.llama_free(self.ctx)
            self.ctx = None

    def clear(self) -> None:
        ll = self.ll
        if hasattr(ll, "llama_memory_clear") and hasattr(ll, "llama_get_memory"):
            ll.llama_memory_clear(ll.llama_get_memory(self.ctx), False)
        elif hasattr(ll, "llama_kv_self_clear"):
            ll.llama_kv_self_clear(self.ctx)
        else:
            ll.llama_kv_cache_clear(self.ctx)

    def decode(self, tokens: np.ndarray) -> None:
        ll = self.ll
        n = len(tokens)
        arr = (ll.llama_token * n)(*tokens.tolist())
        rc = ll.llama_decode(self.ctx, ll.llama_batch_get_one(arr, n))
        if rc != 0:
            raise BenchError(f"llama_decode failed ({rc})")
        ll.llama_synchronize(self.ctx)


# --------------------------------------------------------------------------- running

Progress = Callable[[str], None]


def run_instance(engine: Engine, inst: Instance, reps: int, seed: int, index: int = 0,
                 warmup: bool = True, delay: float = 0.0, progress: Progress | None = None,
                 verbose: Callable[[str], None] | None = None) -> Result:
    """Run one test on ``engine`` the way llama-bench does and return its measurements.

    Parameters
    ----------
    engine : Engine
    inst : Instance
    reps : int
        Timed repetitions.
    seed, index : int
        The random token ids come from ``numpy.random.default_rng([seed, index])``,
        so two engines given the same pair see the same ids.
    warmup : bool
        One untimed prompt (if any) and one generated token (if any) first.
    delay : float
        Seconds of sleep before the test.
    progress : callable, optional
        Called with llama-bench's progress messages (``"prompt run 1/5"``).
    verbose : callable, optional
        Called with the engine's memory report once the context exists.
    """
    say = progress or (lambda msg: None)
    engine.ensure_model(inst)
    engine.new_context(inst)
    try:
        if verbose is not None:
            rep = engine.memory_report()
            if rep:
                verbose(rep)
        info = engine.info
        n_vocab = info["n_vocab"]
        rng = np.random.default_rng([int(seed), int(index)])

        def prompt(n: int) -> None:
            done = 0
            while done < n:
                k = min(n - done, inst.n_batch)
                engine.decode(rng.integers(0, n_vocab, size=k, dtype=np.int32))
                done += k

        def gen(n: int) -> None:
            tok = np.empty(1, dtype=np.int32)
            tok[0] = rng.integers(0, n_vocab)
            for _ in range(n):
                engine.decode(tok)
                tok = np.array([rng.integers(0, n_vocab)], dtype=np.int32)

        engine.clear()
        if delay > 0:
            time.sleep(delay)
        if warmup:
            if inst.n_prompt > 0:
                say("warmup prompt run")
                prompt(inst.n_prompt)
            if inst.n_gen > 0:
                say("warmup generation run")
                gen(1)
        samples, ttfts = [], []
        for r in range(reps):
            engine.clear()
            if inst.n_depth > 0:
                say(f"depth run {r + 1}/{reps}")
                prompt(inst.n_depth)
            t0 = time.perf_counter_ns()
            ttft = None
            if inst.n_prompt > 0:
                say(f"prompt run {r + 1}/{reps}")
                prompt(inst.n_prompt)
                ttft = time.perf_counter_ns() - t0
            if inst.n_gen > 0:
                say(f"generation run {r + 1}/{reps}")
                if ttft is None:
                    gen(1)
                    ttft = time.perf_counter_ns() - t0
                    gen(inst.n_gen - 1)
                else:
                    gen(inst.n_gen)
            samples.append(max(1, time.perf_counter_ns() - t0))
            ttfts.append(ttft or 0)
        sysinfo = engine.system()
        return Result(
            inst=inst, engine=engine.name, engine_version=engine.version,
            build_commit=sysinfo["build_commit"], build_number=sysinfo["build_number"],
            cpu_info=sysinfo["cpu_info"], gpu_info=sysinfo["gpu_info"], backends=info["backends"],
            model_type=info["desc"], model_size=info["size"], model_n_params=info["n_params"],
            load_mode=inst.load_mode, test_time=_utc_now(), samples_ns=samples, ttft_ns=ttfts,
            load_time_ms=engine.load_time_ms)
    finally:
        engine.free_context()


class PeerUnavailable(BenchError):
    """The peer engine's package is not installed (or does not start)."""


class WorkerClient:
    """A peer engine in a child process, driven one test at a time over JSON lines.

    The child runs this file as a script (``python benchmark.py --engine-worker
    llama.cpp``), so ggmlpy's package, and with it ggmlpy's ggml libraries, is
    never imported there.
    """

    def __init__(self, engine: str, verbose: bool = False):
        self.engine = engine
        cmd = [sys.executable, "-u", os.path.abspath(__file__), "--engine-worker", engine]
        if verbose:
            cmd.append("-v")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=None, text=True, bufsize=1)
        hello = self._recv()
        if not hello.get("ok"):
            self.close()
            raise PeerUnavailable(hello.get("error", f"{engine} worker failed to start"))
        self.version = hello.get("version", "")

    def _recv(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            return {"ok": False, "error": f"the {self.engine} worker exited ({code})"}
        return json.loads(line)

    def run(self, inst: Instance, **kw: Any) -> Result:
        """Run one test in the worker (same arguments as :func:`run_instance`)."""
        assert self.proc.stdin is not None
        if self.proc.poll() is not None:
            raise BenchError(f"the {self.engine} worker has exited ({self.proc.returncode})")
        try:
            self.proc.stdin.write(json.dumps({"cmd": "run", "inst": asdict(inst), **kw}) + "\n")
            self.proc.stdin.flush()
        except OSError as e:
            raise BenchError(f"the {self.engine} worker is gone: {e}") from None
        reply = self._recv()
        if not reply.get("ok"):
            raise BenchError(reply.get("error", "worker error"))
        return Result.from_dict(reply["result"])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                self.proc.kill()
                self.proc.wait()


def _worker_main(engine_name: str, verbose: bool) -> int:
    """The child side of :class:`WorkerClient`."""
    # Replies go through a private copy of stdout; the engine's C code may print
    # to fd 1, which now goes to stderr.
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def send(obj: dict[str, Any]) -> None:
        reply.write(json.dumps(obj) + "\n")
        reply.flush()

    if engine_name != "llama.cpp":
        send({"ok": False, "error": f"unknown engine {engine_name!r}"})
        return 2
    try:
        engine: Engine = LlamaCppEngine(verbose=verbose)
    except ImportError as e:
        send({"ok": False, "error": _NO_LLAMA_CPP + f" ({e})"})
        return 1
    except Exception as e:  # a broken install
        send({"ok": False, "error": f"llama_cpp failed to start: {type(e).__name__}: {e}"})
        return 1
    send({"ok": True, "version": engine.version})
    try:
        for line in sys.stdin:
            msg = json.loads(line)
            if msg.get("cmd") != "run":
                break
            inst = Instance(**msg["inst"])
            kw = {k: msg[k] for k in ("reps", "seed", "index", "warmup", "delay") if k in msg}
            prefix = msg.get("progress_prefix")
            prog = (lambda s, _p=prefix: print(f"{_p}{s}", file=sys.stderr, flush=True)) if prefix \
                else None
            try:
                res = run_instance(engine, inst, progress=prog, **kw)
                send({"ok": True, "result": res.to_dict()})
            except Exception as e:
                send({"ok": False, "error": f"{type(e).__name__}: {e}"})
    finally:
        engine.close()
    return 0


_NO_LLAMA_CPP = ("--vs llama.cpp needs llama-cpp-python (the llama_cpp package), which is not "
                 "installed: pip install llama-cpp-python (it builds llama.cpp from source)")


def _synthetic_models(p: BenchParams, err: TextIO) -> list[str]:
    from ggmlpy.models.synthetic import synthetic_path

    paths = []
    for size in p.synthetic:
        for t in p.types:
            path = synthetic_path(size, t, seed=p.seed, cache_dir=p.cache_dir, create=False)
            if not path.exists():
                print(f"{PROG}: writing the built-in {size} {t} model to {path}", file=err, flush=True)
            t0 = time.perf_counter()
            from ggmlpy.backend import ProgressBar

            path = synthetic_path(size, t, seed=p.seed, cache_dir=p.cache_dir,
                                  progress=ProgressBar(f"writing {size} {t}", stream=err, unit="params"))
            if time.perf_counter() - t0 > 1:
                print(f"{PROG}: done in {time.perf_counter() - t0:.1f} s", file=err, flush=True)
            paths.append(str(path))
    return paths


def _has_gpu() -> bool:
    import ggmlpy

    return any("GPU" in getattr(d.type, "name", str(d.type)).upper() for d in ggmlpy.devices())


def _build_string() -> str:
    import ggmlpy

    return f"{ggmlpy.ggml_commit()} (ggmlpy {ggmlpy.__version__}, ggml {ggmlpy.ggml_version()})"


def run(p: BenchParams, out: TextIO | None = None, err: TextIO | None = None,
        engine: Engine | None = None) -> tuple[int, list[Result]]:
    """Run every test of ``p``, printing results as they come.

    Parameters
    ----------
    p : BenchParams
    out, err : text streams, optional
        Where the results (``-o``) and the progress, messages and ``-oe`` copy go
        (default ``sys.stdout`` / ``sys.stderr``).
    engine : Engine, optional
        The engine under test (default a :class:`GgmlpyEngine`; tests pass a fake).

    Returns
    -------
    (int, list of Result)
        The exit code (1 if any test failed) and every result, peers' included.
    """
    out = out or sys.stdout
    err = err or sys.stderr
    import ggmlpy

    for m in p.models if engine is None else ():      # (a test's fake engine has no files)
        if not Path(m).is_file():
            raise BenchError(f"-m {m}: no such model file")
    for ep in p.rpc:
        ggmlpy.rpc_add_server(ep)
    if p.list_devices:
        for d in ggmlpy.devices():
            print(f"{d.name}: {d.description}", file=out)
        return 0, []
    models = p.models or _synthetic_models(p, err)
    instances = make_instances(p, models)
    peers: list[WorkerClient] = []
    try:
        for name in p.vs:
            try:
                peers.append(WorkerClient(name, verbose=p.verbose))
            except PeerUnavailable as e:
                print(f"{PROG}: error: {e}", file=err, flush=True)
                return 1, []
        gpu = _has_gpu()
        build = _build_string()
        printers = [pr for pr in (make_printer(p.output, out, p, gpu, build),
                                  make_printer(p.output_err, err, p, gpu, build)) if pr]
        for pr in printers:
            pr.header()
        engine = engine or GgmlpyEngine(rpc=p.rpc)
        failed = 0
        results: list[Result] = []
        n = len(instances)
        for i, inst in enumerate(instances):
            if p.progress:
                print(f"{PROG}: benchmark {i + 1}/{n}: starting", file=err, flush=True)

            def prog(msg: str, _i=i, _e=engine.name) -> None:
                print(f"{PROG}: benchmark {_i + 1}/{n}: {_e}: {msg}", file=err, flush=True)

            def verbose(report: str, _inst=inst) -> None:
                print(f"{PROG}: memory of {_inst.name} on {Path(_inst.model).name} "
                      f"(threads {_inst.n_threads}, n_batch {_inst.n_batch}, n_ubatch "
                      f"{_inst.n_ubatch}):\n{report}", file=err, flush=True)

            kw = dict(reps=p.reps, seed=p.seed, index=i, warmup=not p.no_warmup, delay=p.delay)
            ours: Result | None = None
            theirs: dict[str, Result] = {}
            per_round: dict[str, list[float]] = {peer.engine: [] for peer in peers}
            def run_peers(_i=i, _inst=inst, _kw=kw) -> dict[str, Result]:
                nonlocal failed
                got: dict[str, Result] = {}
                for peer in peers:
                    try:
                        pk = dict(_kw, progress_prefix=f"{PROG}: benchmark {_i + 1}/{n}: {peer.engine}: "
                                  if p.progress else None)
                        got[peer.engine] = res = peer.run(_inst, **pk)
                        res.ggmlpy_version = engine.version
                    except BenchError as e:
                        failed += 1
                        print(f"{PROG}: error: {peer.engine} failed on {_inst.name} with "
                              f"{_inst.model}: {e}", file=err, flush=True)
                return got

            for rnd in range(p.rounds):
                # one round: ggmlpy and each peer back to back, so a slow phase of a shared machine hits
                # both; odd rounds run the peers first (A B B A ...), so neither engine always runs
                # right after the other
                early = run_peers() if rnd % 2 else None
                mine: Result | None = None
                try:
                    mine = run_instance(engine, inst, progress=prog if p.progress else None,
                                        verbose=verbose if p.verbose and rnd == 0 else None, **kw)
                    mine.ggmlpy_version = engine.version
                    ours = mine if ours is None else _merge(ours, mine)
                except Exception as e:
                    # reported, counted in the exit code, and the next test runs (llama-bench goes on too)
                    failed += 1
                    engine.close()
                    if p.verbose or _debug() or not isinstance(e, (GGMLErrorBase, OSError, MemoryError)):
                        traceback.print_exc(file=err)     # always for what is not a user's error: a bug
                    print(f"{PROG}: error: ggmlpy failed on {inst.name} with {inst.model}: "
                          f"{type(e).__name__}: {e}", file=err, flush=True)
                    break
                for name, res in (early if early is not None else run_peers()).items():
                    per_round[name].append(ratio(mine, res)[0])
                    prev = theirs.get(name)
                    theirs[name] = res if prev is None else _merge(prev, res)
            row: list[Result] = [ours] if ours is not None else []
            for peer in peers:
                res = theirs.get(peer.engine)
                if res is None:
                    continue
                if ours is not None:
                    ours.ratios[peer.engine] = (ratio(ours, res) if p.rounds == 1
                                                else round_ratio(per_round[peer.engine]))
                row.append(res)
            for pr in printers:
                pr.rows(row)
            results += row
        engine.close()
        for pr in printers:
            pr.footer()
    finally:
        for peer in peers:
            peer.close()
    if p.plot and results:
        plot(results, p.plot)
        print(f"{PROG}: wrote {p.plot}", file=err, flush=True)
    return (1 if failed else 0), results


# --------------------------------------------------------------------------- plot

def swept_variable(results: list[Result]) -> str:
    """The x axis of the plot: ``n_prompt``, ``n_depth`` or ``n_threads``, whichever varies (in that order)."""
    for name in ("n_prompt", "n_depth", "n_threads"):
        if len({getattr(r.inst, name) for r in results if r.inst.n_prompt or name != "n_prompt"}) > 1:
            return name
    return "n_prompt" if any(r.inst.n_prompt for r in results) else "n_threads"


def plot(results: list[Result], path: str | os.PathLike) -> None:
    """Plot t/s (with the ± as error bars) against the swept variable and save a PNG.

    One line per model file, engine and kind of test (pp, tg, pp+tg). When the prompt
    size is the swept variable, tg tests (which have no prompt) are left out.

    Raises
    ------
    BenchError
        matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BenchError("--plot needs matplotlib: pip install matplotlib "
                         "(or pip install 'ggmlpy[bench]')") from None
    x_name = swept_variable(results)
    labels = {"n_prompt": "prompt tokens", "n_depth": "depth (tokens in the cache)",
              "n_threads": "threads"}
    lines: dict[tuple, list[tuple[int, float, float]]] = {}
    for r in results:
        i = r.inst
        if x_name == "n_prompt" and i.n_prompt == 0:
            continue
        if x_name == "n_prompt":
            kind = "pp" if i.n_gen == 0 else f"pp+tg{i.n_gen}"
            kind += f" @ d{i.n_depth}" if i.n_depth else ""
        elif x_name == "n_depth":
            kind = Instance(i.model, i.n_prompt, i.n_gen).name
        else:
            kind = i.name
        key = (Path(i.model).stem, r.engine, kind)  # engines name one model differently
        lines.setdefault(key, []).append((getattr(i, x_name), r.avg_ts, r.stddev_ts))
    fig, ax = plt.subplots(figsize=(8, 5))
    for (model, engine, kind), pts in sorted(lines.items()):
        pts.sort()
        xs, ys, es = zip(*pts)
        ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, label=f"{model} · {engine} · {kind}")
    ax.set_xlabel(labels[x_name])
    ax.set_ylabel("tokens / s")
    if x_name == "n_prompt" and len({x for pts in lines.values() for x, _, _ in pts}) > 2:
        ax.set_xscale("log", base=2)
    ax.set_title(f"{PROG}: throughput vs {labels[x_name]}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=100)
    plt.close(fig)


# --------------------------------------------------------------------------- entry

def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    """``ggmlpy bench``: parse ``argv``, run, print; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        build_parser(prog).print_help()
        return 0
    debug = _debug() or "-v" in argv or "--verbose" in argv
    try:
        params = parse_args(argv)
    except BenchError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    try:
        code, _ = run(params)
    except (GGMLErrorBase, OSError, MemoryError) as e:
        # expected failures (a dead RPC server, a missing file, memory): one line, the traceback with -v or
        # GGMLPY_DEBUG=1; anything else is a bug and keeps its traceback
        if debug:
            traceback.print_exc()
        print(f"{prog}: error: {_one_line(e)}", file=sys.stderr)
        return 1
    return code


def _debug() -> bool:
    return os.environ.get("GGMLPY_DEBUG", "0") not in ("", "0")


def _one_line(e: BaseException) -> str:
    """An exception as one line: its type when the message does not say much, the first line of the message
    (memory errors carry a whole report after it)."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if isinstance(e, BenchError) and msg:
        return msg
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "--engine-worker":
        # Run as a script by WorkerClient: do not let this file's folder (the
        # ggmlpy package) shadow top-level modules.
        here = {os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.realpath(__file__))}
        sys.path[:] = [s for s in sys.path
                       if os.path.abspath(s or ".") not in here and os.path.realpath(s or ".") not in here]
        sys.exit(_worker_main(sys.argv[2], "-v" in sys.argv[3:]))
    sys.exit(main())
