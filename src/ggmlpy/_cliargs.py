"""What every ``ggmlpy`` subcommand shares, so that one mistake gets one answer whichever command it is
made in: the exit statuses, usage errors that name the flag, the check of a model file, the note on
``-ngl`` without an accelerator, and warnings as one line.

Exit statuses, the same in every subcommand:

* 0: done;
* 1: a failure at run time: a file that cannot be used (missing, a directory, not GGUF), memory, a
  device, a benchmark test that failed;
* 2: a usage error, reported before anything runs: an unknown option, a value of the wrong form or
  out of range (``-t 0``, ``-n -5``), options that do not go together;
* 130: Ctrl-C; 141: the reader of the output went away (``ggmlpy bench | head``).

A user's error is one line, ``ggmlpy <command>: error: <flag> <value>: <why>``, without a traceback;
``--debug`` (or ``GGMLPY_DEBUG=1``) adds it.

This module imports nothing of ggmlpy at import time (``ggmlpy cache`` and ``--help`` do not load ggml).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Callable, Optional

__all__ = ["EXIT_BROKEN_PIPE", "EXIT_FAILURE", "EXIT_INTERRUPTED", "EXIT_USAGE", "ArgParser", "UsageError",
           "add_model_source_args", "at_least", "check_model_source", "debug_requested", "gpu_layers_note",
           "model_file", "model_source", "one_line_warnings", "override_problem", "usage_text"]

EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141


class UsageError(ValueError):
    """A mistake in the command line (exit status 2); the message names the flag."""


_ARGUMENT = re.compile(r"argument (\S+?)(?:/\S+)?: ")


def usage_text(message: str) -> str:
    """argparse's message with the flag first: ``argument -n/--n-predict: invalid int value: 'x'`` ->
    ``-n: invalid int value: 'x'``."""
    return _ARGUMENT.sub(lambda m: f"{m.group(1)}: ", message, count=1)


class ArgParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are :class:`UsageError` (the caller prints one line and returns 2)
    instead of the usage text and ``SystemExit``."""

    def error(self, message: str):
        raise UsageError(usage_text(message))


def at_least(flag: str, value: int | float, lo: int | float, note: str = "") -> str | None:
    """The message for a value below its bound (``-t 0: must be at least 1``), None when it is in range."""
    if value >= lo:
        return None
    return f"{flag} {value}: must be at least {lo}{f' ({note})' if note else ''}"


def debug_requested(argv: Sequence[str] = ()) -> bool:
    """``--debug`` in the arguments or ``GGMLPY_DEBUG`` set: errors keep their traceback."""
    return "--debug" in argv or os.environ.get("GGMLPY_DEBUG", "0") not in ("", "0")


def model_file(text: str, flag: str = "-m", note: Optional[Callable[[str], None]] = None) -> str:
    """The GGUF file that ``flag text`` names, checked before anything runs: it exists, is a file and
    has a GGUF header that ggml reads (the header is parsed; no tensor data is read).

    This is where every subcommand turns ``-m`` into a path. An ``hf://`` reference (``-hf``'s) is
    resolved here (:func:`ggmlpy.hub.resolve`: the file chosen, downloaded into the hub's cache if it is
    not there) and ``note`` is told what was chosen.

    Raises
    ------
    GGMLValueError
        ``-m PATH: no such file``, ``... is a directory``, ``... not a GGUF file (...)`` (exit status 1);
        an ``hf://`` reference that does not resolve (:class:`ggmlpy.hub.HubError`, naming the
        repository and the file).
    """
    from ggmlpy._core import GGMLValueError
    from ggmlpy.gguf import GGUFError, GGUFReader
    from ggmlpy.hub import HubError, is_hub_ref, resolve

    if is_hub_ref(text):
        try:
            found = resolve(text)
        except HubError as e:
            raise HubError(f"{flag} {e}") from None
        if note is not None:
            note(found.describe())
        text = found.path
    p = Path(text)
    if not p.exists():
        raise GGMLValueError(f"{flag} {text}: no such file")
    if p.is_dir():
        raise GGMLValueError(f"{flag} {text}: is a directory, not a GGUF file")
    try:
        GGUFReader(p).close()
    except GGUFError as e:
        # GGUFError's message starts with the path; say which flag gave it
        raise GGMLValueError(f"{flag} {e}") from None
    except OSError as e:
        raise GGMLValueError(f"{flag} {text}: {e.strerror or e}") from None
    return str(p)


def add_model_source_args(p: argparse.ArgumentParser) -> None:
    """``-m FILE`` or ``-hf ORG/REPO[:QUANT]`` (with ``-hff FILE``), and ``--mmproj [FILE]``: where a
    subcommand's model comes from, as llama.cpp's tools take it."""
    p.add_argument("-m", "--model", default=None, help="GGUF model file (a split model: its first shard), or an "
                   "hf:// reference")
    p.add_argument("-hf", "--hf-repo", default=None, metavar="ORG/REPO[:QUANT]",
                   help="a model from the Hugging Face hub, downloaded into its cache (HF_HOME; HF_HUB_OFFLINE=1: "
                        "from the cache only): the file tagged QUANT (any case), by default Q4_K_M, else Q8_0, "
                        "else the repository's only model")
    p.add_argument("-hff", "--hf-file", default=None, metavar="FILE",
                   help="with -hf: this file of the repository instead of a tag's")
    p.add_argument("--mmproj", default=None, nargs="?", const="", metavar="FILE",
                   help="the model's vision encoder (an mmproj GGUF): the model then takes images; with -hf, "
                        "--mmproj alone takes the repository's (--image does too)")


def check_model_source(args: argparse.Namespace) -> None:
    """The source options' combinations, before anything runs (:class:`UsageError`)."""
    if args.hf_file is not None and args.hf_repo is None:
        raise UsageError(f"-hff {args.hf_file}: names a file of the -hf repository; -hf ORG/REPO is missing")
    if args.model is None and args.hf_repo is None:
        raise UsageError("a model is needed: -m FILE or -hf ORG/REPO[:QUANT]")
    if args.model is not None and args.hf_repo is not None:
        raise UsageError(f"-m {args.model} and -hf {args.hf_repo}: give one")
    if args.hf_file is not None:
        if ":" in args.hf_repo:
            raise UsageError(f"-hf {args.hf_repo} -hff {args.hf_file}: a quant tag and a file; give one")
    if args.mmproj == "" and args.hf_repo is None:
        raise UsageError("--mmproj without a file takes the -hf repository's vision encoder; give --mmproj FILE")


def model_source(args: argparse.Namespace, images: bool, note: Callable[[str], None]) -> tuple[str, Optional[str]]:
    """The local paths of the model and its vision encoder from ``-m``/``-hf``/``-hff``/``--mmproj`` (see
    :func:`add_model_source_args`), files from the hub fetched now. With ``-hf``, the repository's vision
    encoder is fetched when ``images`` (``--image`` given) or ``--mmproj`` alone asks for it; where the
    repository has one and nothing asks, ``note`` says so."""
    from ggmlpy.hub import HubError, HubRef, parse_ref, resolve

    mmproj = model_file(args.mmproj, "--mmproj", note) if args.mmproj else None
    if args.hf_repo is None:
        return model_file(args.model, "-m", note), mmproj
    ref = parse_ref(args.hf_repo)
    if args.hf_file is not None:
        ref = HubRef(ref.repo, ref.revision, file=args.hf_file)
    want = args.mmproj == "" or (images and mmproj is None)
    try:
        found = resolve(ref, mmproj=want)
    except HubError as e:                  # named by the flags the user typed
        flags = f"-hf {args.hf_repo}" + (f" -hff {args.hf_file}" if args.hf_file is not None else "")
        raise HubError(f"{flags}: {str(e).removeprefix(f'{ref}: ')}") from None
    note(found.describe())
    if found.mmproj_file and not want and mmproj is None:
        note(f"{ref.repo} also has a vision encoder, {found.mmproj_file}: add --mmproj (or --image) to use it")
    path = model_file(found.path, "-hf")
    return path, (found.mmproj_path if want else mmproj)


def gpu_layers_note(ngl: int, devices: str = "auto", rpc: Sequence[str] = ()) -> str | None:
    """The note for ``-ngl N`` (N > 0) where no accelerator can take layers, None where one can.

    ``devices``: ``auto``, ``cpu``/``none`` or device names (``,`` or ``/``-separated). RPC servers
    are accelerators (their devices are found only once connected: with ``-rpc`` there is no note).
    """
    if ngl <= 0 or rpc:
        return None
    spec = devices.strip().lower()
    if spec in ("cpu", "none"):
        return f"-ngl {ngl} ignored: -dev {devices} keeps every layer on the CPU"
    from ggmlpy._core import devices as all_devices

    def accelerator(kind: str) -> bool:
        return kind.upper() in ("GPU", "IGPU")

    found = [(d.name.lower(), str(getattr(d.type, "name", d.type))) for d in all_devices() if d.endpoint is None]
    if spec == "auto":
        if any(accelerator(k) for _, k in found):
            return None
        return (f"-ngl {ngl} ignored: no GPU found, every layer runs on the CPU (`ggmlpy info` lists this "
                f"build's backends and devices)")
    names = [n.strip() for n in re.split(r"[,/]", spec) if n.strip()]
    if any(n != "cpu" for n in names):
        return None                     # a named device: the loader says if it does not exist
    return f"-ngl {ngl} ignored: -dev {devices} keeps every layer on the CPU"


def override_problem(item: str) -> str | None:
    """What is wrong with one ``-ot`` item ``PATTERN=DEVICE`` (its form and its regular expression; the
    device is checked when the model loads), None when nothing is. ``ggmlpy bench`` says the same."""
    pattern, eq, dev = item.partition("=")
    if not eq or not pattern or not dev.strip():
        return f"invalid -ot value {item!r}: expected PATTERN=DEVICE (e.g. ffn_.*_exps=CPU)"
    try:
        re.compile(pattern)
    except re.error as e:
        return f"invalid -ot value {item!r}: {pattern!r} is not a regular expression ({e})"
    return None


@contextlib.contextmanager
def one_line_warnings(prog: str, debug: bool = False) -> Iterator[None]:
    """Warnings print as ``prog: warning: <first line>`` instead of Python's two lines with a source
    path (``--debug`` keeps Python's form). Only the text changes: recording and filtering work as
    before."""
    if debug:
        yield
        return
    saved = warnings.formatwarning

    def fmt(message, category, filename, lineno, line=None) -> str:
        text = str(message).strip().splitlines()[0] if str(message).strip() else category.__name__
        return f"{prog}: warning: {text}\n"

    warnings.formatwarning = fmt
    try:
        yield
    finally:
        warnings.formatwarning = saved
