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

__all__ = ["EXIT_BROKEN_PIPE", "EXIT_FAILURE", "EXIT_INTERRUPTED", "EXIT_USAGE", "ArgParser", "UsageError",
           "at_least", "debug_requested", "gpu_layers_note", "model_file", "one_line_warnings", "override_problem",
           "usage_text"]

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


def model_file(text: str, flag: str = "-m") -> str:
    """The GGUF file that ``flag text`` names, checked before anything runs: it exists, is a file and
    has a GGUF header that ggml reads (the header is parsed; no tensor data is read).

    This is where every subcommand turns ``-m`` into a path, and the place for a later ``-hf`` (a
    hub reference resolved, downloaded if need be, into a local path) to join.

    Raises
    ------
    GGMLValueError
        ``-m PATH: no such file``, ``... is a directory``, ``... not a GGUF file (...)`` (exit status 1).
    """
    from ggmlpy._core import GGMLValueError
    from ggmlpy.gguf import GGUFError, GGUFReader

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
