"""``ggmlpy bench``'s command line: llama-bench's options and ours (:func:`parse_args` into :class:`BenchParams`),
their checks, and the tests they ask for (:func:`make_instances`).

Every test parameter takes comma lists, repeats and integer ranges
(:func:`parse_int_range`); a value that cannot run is refused here, with a
:class:`~.errors.BenchError` naming the option.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Callable

from ggmlpy._cliargs import at_least, override_problem, usage_text
from ggmlpy._core import GGMLError
from ggmlpy.kvcache import CACHE_TYPES as _KV_CACHE_TYPES
from ggmlpy.models.synthetic import ARCHS, TYPES, parse_size, size_list
from ggmlpy.runner import Runner

from .errors import BenchError
from .results import AUTO_NGL, Instance

__all__ = ["CACHE_TYPES", "LOAD_MODES", "MAX_TESTS", "MAX_VALUES", "OUTPUTS", "PEERS", "PROG", "BenchParams",
           "build_parser", "count_tests", "default_threads", "make_instances", "parse_args", "parse_int_range"]

PROG = "ggmlpy bench"


#: Cache types llama-bench accepts (ggml type names).
CACHE_TYPES = tuple(_KV_CACHE_TYPES)      # the names, from ggmlpy.kvcache's one table
#: Load modes (-lm) ggmlpy's loader has: read(2) into the buffers, or copy out of a memory map.
LOAD_MODES = ("none", "mmap")
OUTPUTS = ("md", "csv", "json", "jsonl", "sql", "none")
PEERS = ("llama.cpp",)
_TRUTHY = ("on", "enabled", "true", "1")
_FALSEY = ("off", "disabled", "false", "0")
_AUTOY = ("auto", "-1")


# --------------------------------------------------------------------------- parsing

_RANGE = re.compile(r"(-?\d+)(?:-(\d+)(?:([+*])(\d+))?)?")


#: The most values one list option may sweep (``-p 1-100000000`` is refused before a list is built).
MAX_VALUES = 1024
#: The most tests one run may ask for (the product of every list).
MAX_TESTS = 10_000


def parse_int_range(text: str, allow_negative: bool = False, limit: int = MAX_VALUES) -> list[int]:
    """Parse llama-bench's integer lists: ``a``, ``a-b``, ``a-b+step``, ``a-b*mult``, comma-separated.

    Parameters
    ----------
    text : str
        E.g. ``"16,32"``, ``"1-4"``, ``"64-512*2"``, ``"0-1024+256"``.
    allow_negative : bool
        Accept a negative first value (``-ngl -1``).
    limit : int
        The most values the list may have (:data:`MAX_VALUES`); counted before any is made.

    Returns
    -------
    list of int

    Raises
    ------
    BenchError
        Malformed text, a negative value where none is allowed, a range whose
        step does not increase (``4-8*1``, ``0-8*2``), or more than ``limit`` values.

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
        if op == "+" and step > 0 and last >= first:       # (a "*" range has few values, or does not increase)
            n = (last - first) // step + 1
            if len(out) + n > limit:
                raise BenchError(f"range {text!r} has {len(out) + n:,} values; one list takes at most {limit:,} "
                                 "(each value is a test)")
        i = first
        while i <= last:
            out.append(i)
            nxt = i + step if op == "+" else i * step
            if nxt <= i:
                raise BenchError(f"invalid range {text!r}: the step does not increase")
            i = nxt
        if len(out) > limit:
            raise BenchError(f"range {text!r} has more than {limit:,} values; one list takes at most {limit:,}")
    return out


def _ints(text: str) -> list[int]:
    """An integer list whose values may be negative here: the bounds are checked by :func:`_validate`,
    whose message names the flag and the value (``-t 0: must be at least 1``)."""
    return parse_int_range(text, allow_negative=True)


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


def _parse_ngl(text: str) -> list[int]:
    out: list[int] = []
    for part in _split(text):
        if part.lower() == "auto":
            out.append(AUTO_NGL)
            continue
        values = parse_int_range(part, True)
        bad = next((v for v in values if v < -1), None)
        if bad is not None:
            raise BenchError(f"-ngl {bad}: must be at least -1 (-1: all layers), or auto")
        out += values
    return out


def _parse_fit(text: str) -> list[int]:
    return [AUTO_NGL if b else -1 for b in _parse_bools("-fit")(text)]


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


def _parse_split_mode(text: str) -> list[str]:
    out = []
    for v in _split(text):
        v = v.strip().lower()
        if v == "row":
            raise BenchError("-sm row: not supported by ggmlpy's bench: ggmlpy splits by layer (row splits need "
                             "ggml's CUDA split buffers)")
        if v not in ("layer", "none"):
            raise BenchError(f"invalid -sm value {v!r}: expected layer or none")
        out.append(v)
    return out


def _parse_overrides(text: str) -> list[str]:
    """llama-bench's ``-ot``: configurations separated by ``,``, each ``PATTERN=DEVICE`` items separated by
    ``;`` (``"exps=CPU;attn=CUDA0,none"``); ``none`` or an empty one is no override. The patterns are
    checked here (the devices when the model loads: an RPC server's exist only then)."""
    out = []
    for combo in text.split(","):
        items = [x for x in combo.split(";") if x.strip()]
        if not items or combo.strip().lower() == "none":
            out.append("none")
            continue
        for item in items:
            msg = override_problem(item)          # (ggmlpy run's check: the same words)
            if msg:
                raise BenchError(msg)
        out.append(";".join(items))
    return out


def _parse_tensor_split(text: str) -> list[tuple]:
    """llama-bench's ``-ts``: per configuration, '/'-separated proportions per accelerator (``3/1``);
    ``0`` is the default split (by free memory), stored as ()."""
    out = []
    for combo in _split(text):
        try:
            props = tuple(float(x) for x in combo.split("/"))
        except ValueError:
            raise BenchError(f"invalid -ts value {combo!r}: expected proportions such as 3/1") from None
        if any(not (p >= 0) or p == float("inf") for p in props):
            raise BenchError(f"invalid -ts value {combo!r}: proportions must be finite and >= 0")
        out.append(() if not any(props) else props)
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
    no_op_offload: list[bool] = field(default_factory=lambda: [False])
    split_mode: list[str] = field(default_factory=lambda: ["layer"])
    main_gpu: list[int] = field(default_factory=lambda: [0])
    tensor_split: list[tuple] = field(default_factory=lambda: [()])
    n_cpu_moe: list[int] = field(default_factory=lambda: [0])
    tensor_buft_overrides: list[str] = field(default_factory=lambda: ["none"])
    embeddings: list[bool] = field(default_factory=lambda: [False])
    repack: list[bool] = field(default_factory=lambda: [True])
    reps: int = 5
    rounds: int = 1
    delay: float = 0.0
    output: str = "md"
    output_err: str = "none"
    progress: bool = False
    verbose: bool = False
    debug: bool = False
    no_warmup: bool = False
    synthetic: list[str] = field(default_factory=lambda: ["110M"])
    types: list[str] = field(default_factory=lambda: ["F16"])
    archs: list[str] = field(default_factory=list)       # none given: each size's own (llama, a preset's family)
    cache_dir: str | None = None
    plot: str | None = None
    vs: list[str] = field(default_factory=list)
    seed: int = 0
    rpc: list[str] = field(default_factory=list)
    list_devices: bool = False
    roofline: bool = False
    roofline_refresh: bool = False
    kernels: str | None = None
    kernels_refresh: bool = False
    vision_precision: str = "exact"
    n_images: list[int] = field(default_factory=list)
    mmproj: list[str] = field(default_factory=list)


#: (option strings, BenchParams attribute, parser, help) for the swept test parameters. Several options may
#: fill one attribute (-mmp and -lm both give load_mode).
_LIST_OPTIONS: list[tuple[tuple[str, ...], str, Callable[[str], list], str]] = [
    (("-m", "--model"), "models", lambda s: [s], "GGUF model file (repeat for more; default: "
     "the built-in synthetic model)"),
    (("-hf", "--hf-repo"), "models", lambda s: [s if s.startswith("hf://") else f"hf://{s}"],
     "a model from the Hugging Face hub, ORG/REPO[:QUANT], fetched into its cache (as ggmlpy run -hf; repeat for "
     "more)"),
    (("-p", "--n-prompt"), "n_prompt", _ints, "prompt sizes (default 512)"),
    (("-n", "--n-gen"), "n_gen", _ints, "generation sizes (default 128)"),
    (("-pg",), "n_pg", lambda s: [_parse_pg(s)], "PROMPT,GEN: prompt then generation in one test"),
    (("-i", "--n-images"), "n_images", _ints, "images encoded per image test (imgN; needs --mmproj; "
     "default: no image tests)"),
    (("--mmproj",), "mmproj", _split, "the vision encoder (mmproj GGUF) of the -m model: one file for all "
     "models, or one per -m in order (comma list or repeated)"),
    (("-d", "--n-depth"), "n_depth", _ints, "tokens already in the cache (default 0)"),
    (("-b", "--batch-size"), "n_batch", _ints, "logical batch size (default 2048)"),
    (("-ub", "--ubatch-size"), "n_ubatch", _ints, "physical batch size (default 512)"),
    (("-ctk", "--cache-type-k"), "type_k", _parse_cache_types,
     f"K cache type: {', '.join(CACHE_TYPES)} (default f16)"),
    (("-ctv", "--cache-type-v"), "type_v", _parse_cache_types,
     "V cache type, as -ctk; a quantized V needs -fa on or auto (default f16)"),
    (("-t", "--threads"), "n_threads", _ints, "CPU threads (default: physical cores)"),
    (("-ngl", "--n-gpu-layers"), "n_gpu_layers", _parse_ngl,
     "layers on the GPU (default -1: all); auto: as many as fit each device's free memory, found by trying "
     "allocations (-v prints the tries)"),
    (("-fit", "--fit"), "n_gpu_layers", _parse_fit, "on: -ngl auto; off: -ngl -1"),
    (("-dev", "--device"), "devices", _parse_devices,
     "devices, '/'-separated (auto, none = CPU only; default auto)"),
    (("-fa", "--flash-attn"), "flash_attn", _parse_fa, "flash attention: on, off, auto (default auto)"),
    (("-sm", "--split-mode"), "split_mode", _parse_split_mode,
     "layer: the offloaded layers divided among the accelerators; none: all on the -mg one (default layer)"),
    (("-mg", "--main-gpu"), "main_gpu", _ints, "the accelerator -sm none uses, by index (default 0)"),
    (("-ts", "--tensor-split"), "tensor_split", _parse_tensor_split,
     "proportions of the offloaded layers per accelerator, '/'-separated (3/1); 0: by free memory (default)"),
    (("-ot", "--override-tensor", "--override-tensors"), "tensor_buft_overrides", _parse_overrides,
     "weights by name on a device: PATTERN=DEVICE items ';'-separated, configurations ','-separated "
     "(exps=CPU;attn=Vulkan0,none); default none"),
    (("-ncmoe", "--n-cpu-moe"), "n_cpu_moe", _ints,
     "the first N layers' expert weights on the CPU (default 0)"),
    (("-nopo", "--no-op-offload"), "no_op_offload", _parse_bools("-nopo"),
     "1: every op where its weights are (no offload of host-weight products to a device; default 0)"),
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
    (("--synthetic",), "synthetic", _split, f"built-in model size when no -m: {size_list()} (parameters as "
     "written; the first five are llama2.c's and TinyLlama's shapes, the others real models'); a count "
     "names the size it is within 15%% of (default 110M)"),
    (("--type",), "types", _split, "built-in model weight type: F32, F16, Q8_0, Q4_0, Q4_K_M (default F16)"),
    (("--arch",), "archs", _split, f"built-in model architecture: {', '.join(ARCHS)} (default: the size's "
     "own, llama for the classic sizes, a preset's family for a preset)"),
]


#: llama-bench's placement options: (option names, the values meaning ggmlpy's one placement, why others
#: are refused). They are parsed (so ``-ot`` is never read as ``-o t``) and checked before anything runs.
PLACEMENT_OPTIONS = [
    (("--no-host",), ("0",), "ggmlpy allocates no host buffer types to bypass"),
]


def _check_placement(option: str, values: list[str], accepted: tuple, why: str) -> None:
    for v in values:
        for item in _split(v):
            if item.strip().lower() not in accepted:
                raise BenchError(f"{option} {item}: not supported by ggmlpy's bench: {why}")


class _Swept(argparse.Action):
    """Collects every list option in command-line order (two options may fill one list: -lm and -mmp)."""

    def __call__(self, parser, namespace, values, option_string=None):
        namespace.swept = [*namespace.swept, (self.dest, values)]


class _ArgParser(argparse.ArgumentParser):
    def error(self, message: str):  # raise instead of exiting, main() reports (exit status 2)
        raise BenchError(usage_text(message))


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The argument parser of ``ggmlpy bench`` (llama-bench's options plus ours)."""
    ap = _ArgParser(prog=prog, description="Prompt processing (pp) and token generation (tg) "
                    "throughput, llama-bench compatible; with -i and --mmproj, image encoding (img: the vision "
                    "encoder's embedding rows per second, preprocessing not timed).", allow_abbrev=False)
    for i, (opts, _attr, _, help_) in enumerate(_LIST_OPTIONS):
        ap.add_argument(*opts, dest=str(i), action=_Swept, metavar="V", help=help_)
    ap.set_defaults(swept=[])
    for i, (opts, accepted, _why) in enumerate(PLACEMENT_OPTIONS):
        ap.add_argument(*opts, dest=f"placement{i}", action="append", default=[], metavar="V",
                        help=f"llama-bench's placement option; only {' or '.join(accepted)} (others are refused "
                             "with the reason)")
    ap.add_argument("-hff", "--hf-file", default=None, metavar="FILE",
                    help="with one -hf ORG/REPO: this file of the repository instead of a tag's")
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
    ap.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                    help="print test progress on stderr (default: on when stderr is a terminal, where it is one "
                         "line redrawn; --progress elsewhere prints llama-bench's lines)")
    ap.add_argument("--debug", action="store_true", help="print the traceback of an error")
    ap.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up run")
    ap.add_argument("--list-devices", action="store_true", help="list ggml devices and exit")
    ap.add_argument("-rpc", "--rpc", dest="rpc", action="append", metavar="HOST:PORT,...",
                    help="add ggml RPC servers")
    ap.add_argument("--cache-dir", default=None,
                    help="folder of the built-in models and of --roofline's measurements (default: ggmlpy's cache "
                         "folder, `ggmlpy cache path`)")
    ap.add_argument("--plot", default=None, metavar="FILE.png",
                    help="plot t/s against the swept prompt size, depth or threads; with nothing swept, a bar per "
                         "test (needs matplotlib, checked before anything runs)")
    ap.add_argument("--vs", action="append", default=None, metavar="ENGINE",
                    help="also run the tests through ENGINE (llama.cpp: the llama_cpp package) "
                    "and print the ratio")
    ap.add_argument("--seed", type=int, default=0,
                    help="seed of the random token ids and of the built-in model (default 0)")
    ap.add_argument("--roofline", action="store_true",
                    help="add each test's achieved GB/s (tg: weight and KV bytes per token) and GFLOP/s (pp) and "
                         "their share of this machine's memory bandwidth and matmul peak, measured once per thread "
                         "count and cached in --cache-dir")
    ap.add_argument("--roofline-refresh", action="store_true",
                    help="--roofline, measuring the machine again instead of reading the cache")
    ap.add_argument("--kernels", default=None, choices=("measure", "own", "ggml"),
                    help="ggmlpy's own CPU kernels: measure (each against ggml's op on this machine, the faster "
                         "taken; timings cached in kernels.json in the cache folder), own (wherever they run), ggml "
                         "(none); default $GGMLPY_KERNELS or measure. The table's footnote says which ran")
    ap.add_argument("--kernels-refresh", action="store_true",
                    help="measure the own kernels again instead of reading the cache")
    ap.add_argument("--vision-precision", default="exact", choices=("exact", "fast"),
                    help="ggmlpy's vision encoder in image tests (-i): exact (default) or fast (ggml's flash "
                         "attention and GELU table, llama.cpp mtmd's numerics)")
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
    for i, (opts, accepted, why) in enumerate(PLACEMENT_OPTIONS):
        _check_placement(opts[0], getattr(args, f"placement{i}"), accepted, why)
    params = BenchParams()
    swept: dict[str, list] = {}
    for i, text in args.swept:
        opts, attr, conv, _ = _LIST_OPTIONS[int(i)]
        try:
            values = conv(text)
        except BenchError as e:
            # every message names the flag: "-p: range '1-100000000' has ..."
            msg = str(e)
            raise BenchError(msg if any(o in msg for o in opts) else f"{opts[0]}: {msg}") from None
        swept.setdefault(attr, []).extend(values)
    for attr, values in swept.items():
        setattr(params, attr, values)
    if args.hf_file is not None:
        hub = [i for i, m in enumerate(params.models) if m.startswith("hf://")]
        if len(hub) != 1 or ":" in params.models[hub[0]][len("hf://"):]:
            raise BenchError(f"-hff {args.hf_file}: names a file of one -hf ORG/REPO (without a :QUANT tag)")
        params.models[hub[0]] = f"{params.models[hub[0]].rstrip('/')}/{args.hf_file}"
    params.reps = args.reps
    params.rounds = args.rounds
    params.delay = args.delay
    params.output, params.output_err = args.output, args.output_err
    params.verbose, params.debug, params.no_warmup = args.verbose, args.debug, args.no_warmup
    # on by default where someone watches (stderr a terminal), as pip and huggingface_hub do
    params.progress = args.progress if args.progress is not None else _isatty(sys.stderr)
    params.cache_dir, params.plot, params.seed = args.cache_dir, args.plot, args.seed
    params.rpc = [s for text in (args.rpc or []) for s in _split(text)]
    params.vs = [v for text in (args.vs or []) for v in _split(text)]
    params.list_devices = args.list_devices
    params.roofline_refresh = args.roofline_refresh
    params.roofline = args.roofline or args.roofline_refresh
    params.kernels, params.kernels_refresh = args.kernels, args.kernels_refresh
    params.vision_precision = args.vision_precision
    _validate(params)
    return params


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


#: The lower bound of each integer list and its flag (the messages are those of ``ggmlpy run``'s checks).
_LOWER_BOUNDS = (("n_prompt", "-p", 0), ("n_gen", "-n", 0), ("n_depth", "-d", 0), ("n_images", "-i", 0),
                 ("n_batch", "-b", 1), ("n_ubatch", "-ub", 1), ("n_threads", "-t", 1), ("main_gpu", "-mg", 0),
                 ("n_cpu_moe", "-ncmoe", 0))


def _validate(p: BenchParams) -> None:
    for flag, value, lo, note in (("-r", p.reps, 1, "timed repetitions per test"), ("--rounds", p.rounds, 1, ""),
                                  ("--delay", p.delay, 0, "seconds")):
        msg = at_least(flag, value, lo, note)
        if msg:
            raise BenchError(msg)
    for name, flag, lo in _LOWER_BOUNDS:
        for v in getattr(p, name):
            msg = at_least(flag, v, lo)
            if msg:
                raise BenchError(msg)
    _validate_cache_types(p)
    for peer in p.vs:
        if peer.lower() not in ("llama.cpp", "llama_cpp", "llamacpp", "llama-cpp"):
            raise BenchError(f"--vs {peer!r}: the only peer engine is llama.cpp")
    p.vs = ["llama.cpp"] if p.vs else []
    _validate_images(p)
    if not p.models:
        try:
            p.synthetic = [parse_size(s) for s in p.synthetic]
        except ValueError as e:
            raise BenchError(f"--synthetic: {e}") from None
        p.types = [t.upper() for t in p.types]
        for t in p.types:
            if t not in TYPES:
                raise BenchError(f"--type {t}: expected one of {', '.join(TYPES)}")
        p.archs = [a.lower() for a in p.archs]
        for a in p.archs:
            if a not in ARCHS:
                raise BenchError(f"--arch {a}: expected one of {', '.join(ARCHS)}")
    n = count_tests(p)
    if n > MAX_TESTS:
        raise BenchError(f"{n:,} tests asked for (the product of every list); one run takes at most {MAX_TESTS:,}")


def count_tests(p: BenchParams) -> int:
    """How many tests :func:`make_instances` would make of ``p`` (counted, not made)."""
    n_models = len(p.models) if p.models else len(p.synthetic) * len(p.types) * max(1, len(p.archs))
    placements = math.prod(len(x) for x in (p.n_gpu_layers, p.n_cpu_moe, p.split_mode, p.main_gpu, p.tensor_split,
                                            p.tensor_buft_overrides, p.load_mode, p.devices, p.repack,
                                            p.no_op_offload))
    contexts = math.prod(len(x) for x in (p.embeddings, p.n_batch, p.n_ubatch, p.type_k, p.type_v, p.no_kv_offload,
                                          p.flash_attn, p.n_threads, p.n_depth))
    tokens = (sum(1 for n in p.n_prompt if n > 0) + sum(1 for n in p.n_gen if n > 0)
              + sum(1 for a, b in p.n_pg if a or b))
    images = (len(p.flash_attn) * len(p.n_threads) * sum(1 for n in p.n_images if n > 0)) if p.mmproj else 0
    return n_models * placements * (contexts * tokens + images)


def _validate_images(p: BenchParams) -> None:
    """-i needs --mmproj and a -m model (the built-in model has no vision encoder); --mmproj gives one file for
    all models or one per model."""
    if any(n > 0 for n in p.n_images):
        if not p.models:
            raise BenchError("-i: image tests need -m MODEL and --mmproj FILE (the built-in synthetic model has no "
                             "vision encoder)")
        if not p.mmproj:
            raise BenchError("-i: image tests need the model's vision encoder: --mmproj FILE (the mmproj GGUF "
                             "convert_hf_to_gguf.py --mmproj writes)")
    if p.mmproj:
        if not p.models:
            raise BenchError("--mmproj: needs -m MODEL (the built-in synthetic model has no vision encoder)")
        if len(p.mmproj) not in (1, len(p.models)):
            raise BenchError(f"--mmproj: {len(p.mmproj)} files for {len(p.models)} models (-m): give one for all "
                             "models or one per model, in -m's order")


_QUANTIZED_V = ("a quantized V cache needs flash attention (-fa on or auto), as in llama.cpp: without it V is "
                "stored transposed, which a quantized type cannot be (a quantized K runs either way)")


def cache_types_problem(type_k: str, type_v: str, flash_attn: int) -> str | None:
    """What is wrong with one ``-ctk``/``-ctv``/``-fa`` combination (``flash_attn`` 1, 0 or -1 for auto),
    in the flags' words, or None: the runner's own rule (:meth:`Runner.check_cache_types`). ``ggmlpy
    run`` and ``chat`` ask this too."""
    if type_k.lower() not in CACHE_TYPES or type_v.lower() not in CACHE_TYPES:
        flag, t = ("-ctk", type_k) if type_k.lower() not in CACHE_TYPES else ("-ctv", type_v)
        return f"invalid cache type {t!r} ({flag}): expected one of {', '.join(CACHE_TYPES)}"
    try:
        Runner.check_cache_types(type_k, type_v, None if flash_attn < 0 else bool(flash_attn))
    except GGMLError as e:
        if flash_attn != 0:                   # not the flash attention rule: say what the runner says
            return f"-ctk {type_k} -ctv {type_v}: {e}"
        return f"-ctk {type_k} -ctv {type_v} -fa off: {_QUANTIZED_V}"
    return None


def _validate_cache_types(p: BenchParams) -> None:
    """Refuse the -ctk/-ctv/-fa combinations the runner cannot run (its own rule, Runner.check_cache_types)."""
    bad = []
    for tk, tv, fa in itertools.product(p.type_k, p.type_v, p.flash_attn):
        msg = cache_types_problem(tk, tv, fa)
        if msg and fa != 0:
            raise BenchError(msg)
        if msg:
            bad.append(f"-ctk {tk} -ctv {tv} -fa off")
    if bad:
        raise BenchError(f"{', '.join(dict.fromkeys(bad))}: {_QUANTIZED_V}")


# --------------------------------------------------------------------------- instances

def make_instances(p: BenchParams, models: list[str] | None = None) -> list[Instance]:
    """All tests in llama-bench's order (a model is reloaded as rarely as possible).

    The token tests (pp, tg, pp+tg) sweep every parameter, as llama-bench's do. The image tests (``-i``)
    come after the token tests of each model configuration (the model is loaded once more, with its
    encoder) and sweep only what changes the encoding: the model's placement, flash attention (llama.cpp's
    encoder uses it) and the threads; they take the first value of every other list and no depth.
    """
    models = list(models if models is not None else p.models)
    mmprojs = (p.mmproj * len(models) if len(p.mmproj) == 1 else list(p.mmproj)) if p.mmproj else []
    images = [n for n in p.n_images if n > 0]
    out = []
    # llama-bench's nesting: model parameters outermost
    for (k, m), ngl, ncmoe, sm, mg, ts, ot, lm, dev, rpk, nopo in itertools.product(
            enumerate(models), p.n_gpu_layers, p.n_cpu_moe, p.split_mode, p.main_gpu, p.tensor_split,
            p.tensor_buft_overrides, p.load_mode, p.devices, p.repack, p.no_op_offload):
        model = dict(model=m, n_gpu_layers=ngl, n_cpu_moe=ncmoe, split_mode=sm, main_gpu=mg, tensor_split=ts,
                     tensor_buft_overrides=ot, devices=dev, load_mode=lm, repack=rpk, no_op_offload=nopo)
        for embd, nb, nub, tk, tv, nkvo, fa, nt, nd in itertools.product(
                p.embeddings, p.n_batch, p.n_ubatch, p.type_k, p.type_v, p.no_kv_offload, p.flash_attn,
                p.n_threads, p.n_depth):
            common = dict(n_depth=nd, n_batch=nb, n_ubatch=nub, type_k=tk, type_v=tv, n_threads=nt,
                          flash_attn=fa, no_kv_offload=nkvo, embeddings=embd, **model)
            out += [Instance(n_prompt=n, n_gen=0, **common) for n in p.n_prompt if n > 0]
            out += [Instance(n_prompt=0, n_gen=n, **common) for n in p.n_gen if n > 0]
            out += [Instance(n_prompt=a, n_gen=b, **common) for a, b in p.n_pg if a or b]
        if images and k < len(mmprojs):
            for fa, nt in itertools.product(p.flash_attn, p.n_threads):
                common = dict(n_batch=p.n_batch[0], n_ubatch=p.n_ubatch[0], type_k=p.type_k[0], type_v=p.type_v[0],
                              n_threads=nt, flash_attn=fa, no_kv_offload=p.no_kv_offload[0],
                              embeddings=p.embeddings[0], mmproj=mmprojs[k], **model)
                out += [Instance(n_prompt=0, n_gen=0, n_images=n, **common) for n in images]
    return out
