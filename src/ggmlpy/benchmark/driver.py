"""The driver: :func:`run` runs every test of a :class:`~.options.BenchParams` on ggmlpy and the ``--vs`` peers,
printing the results as they come; :func:`main` is ``ggmlpy bench``.

Each test runs ``--rounds`` times, each round ggmlpy and the peers back to back
(the peers first in odd rounds); a failed test is reported, counted in the exit
code, and the next one runs, as llama-bench does. A test a peer cannot run at
all (llama.cpp's image tests without libmtmd) is reported once and skipped,
without a row and without failing. Image tests get their image's side from the
mmproj file, so that every engine encodes the same pixels.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import TextIO

from ggmlpy._cliargs import (
    EXIT_BROKEN_PIPE,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    debug_requested,
    gpu_layers_note,
    model_file,
    one_line_warnings,
)
from ggmlpy._core import GGMLError, devices, rpc_add_server
from ggmlpy._progress import ProgressBar
from ggmlpy._system import ggml_commit, ggml_version
from ggmlpy._version import __version__
from ggmlpy.gguf import GGUFReader
from ggmlpy.models.calibrate import forget as forget_kernel_timings
from ggmlpy.models.synthetic import SIZES, _count_label, for_arch, synthetic_path

from .engines import Engine, run_instance
from .errors import BenchError
from .ggmlpy_engine import GgmlpyEngine, has_gpu
from .options import PROG, BenchParams, _isatty, build_parser, make_instances, parse_args
from .output import check_plot, make_printer, plot
from .results import Instance, Result, _merge, ratio, round_ratio
from .roofline import MachineBounds, ModelWork, machine_bounds, roofline_fields
from .worker import PeerUnavailable, PeerUnsupported, WorkerClient

__all__ = ["NOISE", "main", "run"]

#: A row whose t/s varies more than this between repetitions (sample stddev / mean) gets the table's
#: footnote: the number says more about the machine's other work than about the engine.
NOISE = 0.20


def _synthetic_models(p: BenchParams, err: TextIO) -> list[str]:
    """The built-in models of ``--synthetic``, ``--type`` and ``--arch``, written to the cache folder where
    missing."""
    paths = []
    for arch, size, t in itertools.product(p.archs or [None], p.synthetic, p.types):
        path = synthetic_path(size, t, seed=p.seed, cache_dir=p.cache_dir, create=False, arch=arch)
        cfg = for_arch(SIZES[size], arch)
        what = f"{cfg.arch} {size} {t}"
        if not path.exists():
            print(f"{PROG}: writing the built-in {what} model ({_count_label(cfg.n_params)} parameters) to {path}",
                  file=err, flush=True)
        t0 = time.perf_counter()
        path = synthetic_path(size, t, seed=p.seed, cache_dir=p.cache_dir, arch=arch,
                              progress=ProgressBar(f"writing {what}", stream=err, unit="params"))
        if time.perf_counter() - t0 > 1:
            print(f"{PROG}: done in {time.perf_counter() - t0:.1f} s", file=err, flush=True)
        paths.append(str(path))
    return paths


def _roofline_setup(p: BenchParams, models: list[str],
                    err: TextIO) -> tuple[dict[str, ModelWork | None], dict[int, MachineBounds]]:
    """``--roofline``: each model's work (None where its file cannot be read) and the machine's bounds per
    thread count (measured now, or read from the cache)."""
    works: dict[str, ModelWork | None] = {}
    for m in dict.fromkeys(models):
        try:
            works[m] = ModelWork.from_gguf(m)
        except (OSError, GGMLError, ValueError, TypeError) as e:
            works[m] = None
            print(f"{PROG}: --roofline: cannot read {m} ({_one_line(e)}); no roofline fields for it", file=err,
                  flush=True)
    types = sorted({t for w in works.values() if w is not None for t in w.types})
    bounds = {n: machine_bounds(n, types, cache_dir=p.cache_dir, refresh=p.roofline_refresh, err=err)
              for n in dict.fromkeys(p.n_threads)}
    return works, bounds


def _cpu_only(p: BenchParams, inst: Instance, gpu: bool) -> bool:
    """Whether a test runs on the CPU alone (the roofline's bounds are the CPU's)."""
    return not p.rpc and (not gpu or inst.n_gpu_layers == 0 or inst.devices == "none")


def _build_string() -> str:
    return f"{ggml_commit()} (ggmlpy {__version__}, ggml {ggml_version()})"


class _Status:
    """Test progress on stderr: in a terminal one line, redrawn, and cleared before anything else is
    printed (rows, messages); elsewhere llama-bench's ``--progress`` lines."""

    def __init__(self, err: TextIO, on: bool) -> None:
        self.err, self.on = err, on
        self.tty = on and _isatty(err)
        self.shown = False

    def __call__(self, msg: str) -> None:
        if not self.on:
            return
        if self.tty:
            width = max(20, shutil.get_terminal_size().columns - 1)
            self.err.write("\r\033[K" + msg[:width])
            self.err.flush()
            self.shown = True
        else:
            print(msg, file=self.err, flush=True)

    def clear(self) -> None:
        if self.shown:
            self.err.write("\r\033[K")
            self.err.flush()
            self.shown = False


def _noise_note(results: list[Result], reps: int) -> str | None:
    """The footnote for rows whose t/s varied more than :data:`NOISE` between repetitions, or None."""
    if reps < 2:
        return None
    noisy = [(r, r.stddev_ts / r.avg_ts) for r in results if r.avg_ts > 0 and r.stddev_ts / r.avg_ts > NOISE]
    if not noisy:
        return None
    shown = ", ".join(f"{r.inst.name} ({r.engine}, ±{rel:.0%})" for r, rel in noisy[:3])
    more = f" and {len(noisy) - 3} more" if len(noisy) > 3 else ""
    return (f"note: {shown}{more} varied by more than {NOISE:.0%} between repetitions: the machine was busy; "
            "rerun with more -r (or --rounds)")


def run(p: BenchParams, out: TextIO | None = None, err: TextIO | None = None,
        engine: Engine | None = None) -> tuple[int, list[Result]]:
    """Run every test of ``p``, printing results as they come.

    Everything a run needs is checked before the first test: every ``-m`` file is opened once (a
    missing file, a folder or a file that is not GGUF is one error line, not one per test), ``--plot``
    finds matplotlib, and ``-ngl N`` without an accelerator is one note.

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

    Raises
    ------
    BenchError
        A model file that cannot be used, ``--plot`` without matplotlib, a peer that cannot start.
    """
    out = out or sys.stdout
    err = err or sys.stderr
    status = _Status(err, p.progress)

    def note(text: str) -> None:
        status.clear()
        print(text, file=err, flush=True)

    for k, m in enumerate(p.models if engine is None else ()):     # (a test's fake engine has no files)
        try:
            path = model_file(m, "-m", lambda text: note(f"{PROG}: {text}"))
        except GGMLError as e:
            raise BenchError(str(e)) from None
        if m.startswith("hf://"):
            p.models[k] = path          # -hf: the file in the hub's cache (the peer loads it too)
    if p.plot:
        check_plot()
    image_sizes: dict[str, int] = {}         # the image tests' image side per mmproj, the same for every engine
    if any(n > 0 for n in p.n_images):
        image_sizes = {mm: _image_size(mm) for mm in dict.fromkeys(p.mmproj)
                       if engine is None or Path(mm).is_file()}
    for ep in p.rpc:
        rpc_add_server(ep)
    if p.list_devices:
        for d in devices():
            print(f"{d.name}: {d.description}", file=out)
        return 0, []
    if engine is None:
        # llama.cpp ignores -ngl without a GPU in silence; one line says so (not ggmlpy's warning per load)
        for ngl, dev in itertools.product(dict.fromkeys(v for v in p.n_gpu_layers if v > 0), p.devices):
            msg = gpu_layers_note(ngl, dev, p.rpc)
            if msg:
                note(f"{PROG}: note: {msg}")
                break
    models = p.models or _synthetic_models(p, err)
    instances = make_instances(p, models)
    peers: list[WorkerClient] = []
    try:
        for name in p.vs:
            try:
                peers.append(WorkerClient(name, verbose=p.verbose))
            except PeerUnavailable as e:
                note(f"{PROG}: error: {e}")
                return 1, []
        gpu = has_gpu()
        local_gpu = has_gpu(local=True)     # RPC devices another part of the process added are not used
        build = _build_string()
        works: dict[str, ModelWork | None] = {}
        bounds: dict[int, MachineBounds] = {}
        if p.roofline:
            works, bounds = _roofline_setup(p, models, err)
        printers = [pr for pr in (make_printer(p.output, out, p, gpu, build),
                                  make_printer(p.output_err, err, p, gpu, build)) if pr]
        for pr in printers:
            pr.notes = [b.describe() for b in bounds.values()]
        for pr in printers:
            pr.header()
        if p.kernels_refresh:
            forget_kernel_timings()
        engine = engine or GgmlpyEngine(rpc=p.rpc, kernels=p.kernels, vision_precision=p.vision_precision)
        failed = 0
        unsupported: set[tuple[str, str]] = set()
        results: list[Result] = []
        n = len(instances)
        for i, inst in enumerate(instances):
            if p.progress and not status.tty:
                status(f"{PROG}: benchmark {i + 1}/{n}: starting")

            def prog(msg: str, _i=i, _e=engine.name, _inst=inst) -> None:
                if status.tty:
                    status(f"{PROG}: {_i + 1}/{n} {_inst.name}: {_e}: {msg}")
                else:
                    status(f"{PROG}: benchmark {_i + 1}/{n}: {_e}: {msg}")

            def verbose(report: str, _inst=inst) -> None:
                note(f"{PROG}: memory of {_inst.name} on {Path(_inst.model).name} "
                     f"(threads {_inst.n_threads}, n_batch {_inst.n_batch}, n_ubatch "
                     f"{_inst.n_ubatch}):\n{report}")

            kw: dict = dict(reps=p.reps, seed=p.seed, index=i, warmup=not p.no_warmup, delay=p.delay)
            if inst.n_images and inst.mmproj in image_sizes:
                kw["image_size"] = image_sizes[inst.mmproj]
            ours: Result | None = None
            theirs: dict[str, Result] = {}
            per_round: dict[str, list[float]] = {peer.engine: [] for peer in peers}
            def run_peers(_i=i, _inst=inst, _kw=kw) -> dict[str, Result]:
                nonlocal failed
                got: dict[str, Result] = {}
                for peer in peers:
                    try:
                        # (in a terminal the worker's own lines would break the redrawn one: one line per test)
                        if status.tty:
                            status(f"{PROG}: {_i + 1}/{n} {_inst.name}: {peer.engine}: running")
                        pk = dict(_kw, progress_prefix=f"{PROG}: benchmark {_i + 1}/{n}: {peer.engine}: "
                                  if p.progress and not status.tty else None)
                        got[peer.engine] = res = peer.run(_inst, **pk)
                        res.ggmlpy_version = engine.version
                    except PeerUnsupported as e:          # a skip, not a failure: no row
                        if (peer.engine, _inst.name) not in unsupported:
                            unsupported.add((peer.engine, _inst.name))
                            note(f"{PROG}: {peer.engine}: {_inst.name} not supported, skipped: {e}")
                    except BenchError as e:
                        failed += 1
                        note(f"{PROG}: error: {peer.engine} failed on {_inst.name} with {_inst.model}: {e}")
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
                    status.clear()
                    if p.verbose or p.debug or _debug() or not isinstance(e, (GGMLError, OSError, MemoryError)):
                        traceback.print_exc(file=err)     # always for what is not a user's error: a bug
                    note(f"{PROG}: error: ggmlpy failed on {inst.name} with {inst.model}: {type(e).__name__}: {e}")
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
            status.clear()
            if inst.n_images:
                _check_tiles(row, p.verbose, err)
            if p.roofline:
                for res in row:
                    res.roofline = roofline_fields(
                        res, works.get(inst.model),
                        bounds.get(inst.n_threads) if _cpu_only(p, inst, local_gpu) else None)
            for pr in printers:
                pr.rows(row)
            results += row
        status.clear()
        engine.close()
        noise = _noise_note(results, p.reps * p.rounds)
        for pr in printers:
            pr.kernel_notes = list(getattr(engine, "kernel_notes", ()))
            pr.footnotes = [noise] if noise else []
            pr.footer()
        if noise and not any(pr.shows_footnotes for pr in printers):
            note(f"{PROG}: {noise}")
    finally:
        status.clear()
        for peer in peers:
            peer.close()
    if p.plot and results:
        axis = plot(results, p.plot)
        note(f"{PROG}: wrote {p.plot}" + (" (nothing swept: a bar per test; sweep -p, -d or -t for a curve)"
                                         if axis == "test" else f" (t/s against {axis})"))
    return (1 if failed else 0), results


def _image_size(mmproj: str) -> int:
    """The side of the square image an mmproj's encoder takes (``clip.vision.image_size``): the image tests'
    image, the same for every engine."""
    if not Path(mmproj).is_file():
        raise BenchError(f"--mmproj {mmproj}: no such file")
    with GGUFReader(mmproj) as r:
        if r.metadata.get("general.architecture") != "clip":
            raise BenchError(f"--mmproj {mmproj}: not an mmproj file (general.architecture is "
                             f"{r.metadata.get('general.architecture')!r}, expected 'clip')")
        return int(r.get_int("clip.vision.image_size", lo=1, hi=1 << 15))


def _check_tiles(row: list[Result], verbose: bool, err: TextIO) -> None:
    """An image test's tiles per image, engine by engine: printed with -v; engines that cut the image into
    different numbers of tiles are always reported (each row's image_tiles and image_tokens say so too)."""
    counts = [(r.engine, r.image_tiles, r.image_tokens) for r in row]
    text = ", ".join(f"{e} {t} tile(s), {n} embedding rows" for e, t, n in counts)
    name = f"{row[0].inst.name} on {Path(row[0].inst.mmproj).name}" if row else ""
    if len({(t, n) for _, t, n in counts}) > 1:
        print(f"{PROG}: warning: {name}: the engines cut the {row[0].image_size}x{row[0].image_size} image "
              f"differently: {text} per image (t/s counts each engine's own rows)", file=err, flush=True)
    elif verbose and row:
        print(f"{PROG}: {name}: a {row[0].image_size}x{row[0].image_size} image: {text} per image", file=err,
              flush=True)


# --------------------------------------------------------------------------- entry

def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    """``ggmlpy bench``: parse ``argv``, run, print; returns the exit status.

    As every ``ggmlpy`` command (:mod:`ggmlpy._cliargs`): 2 for a usage error (a bad option, before
    anything runs), 1 when something failed (a file, a peer, a test), 130 on Ctrl-C (the rows printed
    so far stay), 141 when the reader of the output went away; errors are one line, ``--debug``, ``-v``
    or ``GGMLPY_DEBUG=1`` add the traceback.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        build_parser(prog).print_help()
        return 0
    debug = debug_requested(argv) or "-v" in argv or "--verbose" in argv
    try:
        params = parse_args(argv)
    except BenchError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        with warnings.catch_warnings(), one_line_warnings(prog, debug):
            # run() says it once, as a note naming -ngl (the loader would warn on every load, naming its API)
            warnings.filterwarnings("ignore", message=r"split_layers: n_gpu_layers=\d+ ignored")
            code, _ = run(params)
    except (GGMLError, OSError, MemoryError) as e:
        if isinstance(e, BrokenPipeError):
            return _broken_pipe()
        # expected failures (a dead RPC server, a missing file, memory): one line, the traceback with -v or
        # GGMLPY_DEBUG=1; anything else is a bug and keeps its traceback
        if debug:
            traceback.print_exc()
        print(f"{prog}: error: {_one_line(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # the rows printed so far stay; one line, as run and chat do
        print(f"\n{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return code


def _broken_pipe() -> int:
    """The reader of stdout went away (``| head``): exit quietly. stdout is pointed at /dev/null first, so
    that Python's flush of it at exit does not print a second error."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, AttributeError, ValueError):         # (a stream without a file: a test's)
        pass
    return EXIT_BROKEN_PIPE


def _debug() -> bool:
    return os.environ.get("GGMLPY_DEBUG", "0") not in ("", "0")


def _one_line(e: BaseException) -> str:
    """An exception as one line: its type when the message does not say much, the first line of the message
    (memory errors carry a whole report after it). A command-line error (a BenchError, or ggmlpy's error
    about a flag's value: ``-m x.gguf: no such file``) is its message alone, in every subcommand."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if msg and (isinstance(e, BenchError) or (isinstance(e, GGMLError) and re.match(r"--?[a-z]", msg))):
        return msg
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__
