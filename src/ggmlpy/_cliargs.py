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

from ggmlpy.defaults import DEFAULTS

__all__ = ["EXIT_BROKEN_PIPE", "EXIT_FAILURE", "EXIT_INTERRUPTED", "EXIT_USAGE", "ArgParser", "UsageError",
           "Version", "add_model_source_args", "add_sampling_args", "at_least", "check_model_source", "debug_requested",
           "gpu_layers_note", "model_file", "model_source", "one_line_warnings", "override_problem", "read_text",
           "sampling_from_args", "sampling_overrides", "usage_text", "version_text"]

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

    def _get_option_tuples(self, option_string: str) -> list:
        # With allow_abbrev=False argparse still reads a short flag as the start of a longer one (``-f`` as
        # ``-fa``); such a parser takes whole flags only (a value attached to a short flag, ``-c512``, stays).
        found = super()._get_option_tuples(option_string)
        if self.allow_abbrev:
            return found
        return [t for t in found if option_string.startswith(t[1])]


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
                        "--mmproj alone takes the repository's (run's and chat's --image do too)")


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


#: the largest text file an option reads (a template, a grammar, a schema): 16 MiB
_MAX_TEXT_FILE = 16 << 20


def read_text(path: str, option: str) -> str:
    """A UTF-8 file's text; a file that is not UTF-8, not a regular file (a FIFO, /dev/zero) or larger
    than 16 MiB is a GGMLValueError naming it (no traceback, and nothing read without bound)."""
    import os
    import stat

    from ggmlpy._core import GGMLValueError

    # O_NONBLOCK: opening a FIFO must not wait for a writer; what is opened is checked, not the path
    with os.fdopen(os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)), "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise GGMLValueError(f"{option} {path}: not a regular file")
        data = f.read(_MAX_TEXT_FILE + 1)
    if len(data) > _MAX_TEXT_FILE:
        raise GGMLValueError(f"{option} {path}: larger than {_MAX_TEXT_FILE >> 20} MiB")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise GGMLValueError(f"{option} {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


#: the sampling flags, with llama-cli's names: (flags, SamplingParams field, type, help)
_SAMPLING_FLAGS = [
    (("--temp", "--temperature"), "temperature", float, "temperature (default {}; 0: greedy)"),
    (("--top-k",), "top_k", int, "top-k sampling (default {}; 0: off)"),
    (("--top-p",), "top_p", float, "top-p sampling (default {}; 1: off)"),
    (("--min-p",), "min_p", float, "min-p sampling (default {}; 0: off)"),
    (("--typical", "--typical-p"), "typical_p", float, "locally typical sampling, parameter p (default {}; 1: off)"),
    (("--top-nsigma", "--top-n-sigma"), "top_n_sigma", float, "top-n-sigma sampling (default {}; <= 0: off)"),
    (("--min-keep",), "min_keep", int, "the least tokens each sampler keeps (default {}; 0: no bound)"),
    (("--repeat-penalty",), "repeat_penalty", float, "penalise repeated tokens (default {}; 1: off)"),
    (("--repeat-last-n",), "repeat_last_n", int,
     "last N tokens (prompt included) the penalties look at (default {}; 0: off, -1: the context size)"),
    (("--presence-penalty",), "presence_penalty", float, "repeat alpha presence penalty (default {}; 0: off)"),
    (("--frequency-penalty",), "frequency_penalty", float, "repeat alpha frequency penalty (default {}; 0: off)"),
    (("--xtc-probability",), "xtc_probability", float, "XTC probability (default {}; 0: off)"),
    (("--xtc-threshold",), "xtc_threshold", float, "XTC threshold (default {}; above 0.5: off)"),
    (("--dry-multiplier",), "dry_multiplier", float, "DRY sampling multiplier (default {}; 0: off)"),
    (("--dry-base",), "dry_base", float, "DRY sampling base value (default {})"),
    (("--dry-allowed-length",), "dry_allowed_length", int, "DRY: repetitions longer than this are penalised "
                                                            "(default {})"),
    (("--dry-penalty-last-n",), "dry_penalty_last_n", int,
     "DRY: last N tokens scanned (default {}; 0: off, -1: the context size)"),
    (("--mirostat",), "mirostat", int, "Mirostat sampling: 0 off, 1 Mirostat, 2 Mirostat 2.0 (default {})"),
    (("--mirostat-lr",), "mirostat_eta", float, "Mirostat learning rate, eta (default {})"),
    (("--mirostat-ent",), "mirostat_tau", float, "Mirostat target entropy, tau (default {})"),
    (("--dynatemp-range",), "dynatemp_range", float, "dynamic temperature range (default {}; 0: off)"),
    (("--dynatemp-exp",), "dynatemp_exponent", float, "dynamic temperature exponent (default {})"),
    (("--adaptive-target",), "adaptive_target", float,
     "adaptive-p: draw tokens near this probability, with adaptive_p in --samplers (default {}; negative: off)"),
    (("--adaptive-decay",), "adaptive_decay", float, "adaptive-p: the moving average's decay, 0 to 0.99 "
                                                     "(default {})"),
]


def add_sampling_args(p: argparse.ArgumentParser, constraints: bool = True, server: bool = False) -> None:
    """The sampling flags (default None: not given, so a model file's ``general.sampling.*`` applies), and with
    ``constraints`` the constrained-output ones (``--grammar``, ``--json-schema``...). ``server``: the group's
    title says they are every request's defaults (``ggmlpy serve``)."""
    from ggmlpy.sampling import DEFAULT_SAMPLERS

    title = ("sampling (llama-server's flags: every request's defaults, a request's own field wins; a flag not "
             "given takes the model file's general.sampling.* value, else the default shown)" if server else
             "sampling (llama-cli's flags; a flag not given takes the model file's general.sampling.* value, else "
             "the default shown)")
    g = p.add_argument_group(title)
    for flags, field, kind, text in _SAMPLING_FLAGS:
        g.add_argument(*flags, dest=field, type=kind, default=None, metavar="N", help=text.format(DEFAULTS[field]))
    g.add_argument("-s", "--seed", type=int, default=DEFAULTS["seed"], help="sampling seed (default: random)")
    g.add_argument("--samplers", default=None, metavar="NAMES",
                   help=f"the chain's samplers in order, separated by ';' (default {';'.join(DEFAULT_SAMPLERS)})")
    g.add_argument("--sampling-seq", "--sampler-seq", dest="sampling_seq", default=None, metavar="CHARS",
                   help="the chain as one letter per sampler (default edskypmxt)")
    g.add_argument("--dry-sequence-breaker", action="append", metavar="STR",
                   help="a DRY sequence breaker (repeatable; replaces the defaults \\n : \" *; 'none': no breaker)")
    g.add_argument("-l", "--logit-bias", action="append", metavar="TOKEN_ID(+/-)BIAS",
                   help="change a token's likelihood, e.g. 15043+1 or 15043-1 (repeatable); 15043-inf bans it")
    if not constraints:
        return
    c = p.add_argument_group("constrained output (one of them)")
    c.add_argument("--grammar", default=None, metavar="GBNF", help="a GBNF grammar (llama.cpp's format) the output "
                                                                   "follows")
    c.add_argument("--grammar-file", default=None, metavar="FILE", help="the GBNF grammar, from a file")
    c.add_argument("-j", "--json-schema", default=None, metavar="SCHEMA",
                   help="a JSON schema the output is valid under, e.g. '{}' for any JSON value")
    c.add_argument("-jf", "--json-schema-file", default=None, metavar="FILE", help="the JSON schema, from a file")


def _logit_bias_flag(value: str) -> tuple:
    m = re.fullmatch(r"\s*(\d+)\s*([+-])\s*(inf|[0-9]*\.?[0-9]+(?:[eE][+-]?\d+)?)\s*", value)
    if not m:
        raise UsageError(f"--logit-bias {value}: expected TOKEN_ID+BIAS or TOKEN_ID-BIAS, e.g. 15043+1")
    bias = float(m.group(3))
    return int(m.group(1)), -bias if m.group(2) == "-" else bias


def sampling_from_args(args: argparse.Namespace, defaults=None):
    """``run``'s and ``chat``'s SamplingParams from the flags given, over ``defaults`` (the model's
    ``general.sampling.*``); a value out of range is a UsageError naming its flag."""
    from ggmlpy._core import GGMLValueError
    from ggmlpy.sampling import sampling_params

    given = {field: getattr(args, field, None) for _, field, _, _ in _SAMPLING_FLAGS}
    given["seed"] = None if args.seed is None or args.seed < 0 else args.seed
    if getattr(args, "samplers", None) is not None and getattr(args, "sampling_seq", None) is not None:
        raise UsageError("--samplers and --sampling-seq given together: give the chain once")
    given["samplers"] = getattr(args, "samplers", None) or getattr(args, "sampling_seq", None)
    breakers = getattr(args, "dry_sequence_breaker", None)
    if breakers:
        # escapes as llama-cli reads them: --dry-sequence-breaker '\n' is a newline
        unescape = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "'": "'"}
        given["dry_sequence_breakers"] = () if breakers == ["none"] else tuple(
            re.sub(r"\\(.)", lambda m: unescape.get(m.group(1), m.group(0)), b) for b in breakers)
    biases = getattr(args, "logit_bias", None)
    if biases:
        pairs: dict = {}
        for b in biases:
            tok, bias = _logit_bias_flag(b)
            pairs[tok] = pairs.get(tok, 0.0) + bias
        given["logit_bias"] = pairs
    constraints = [(f, v) for f, v in (("--grammar", args.grammar), ("--grammar-file", args.grammar_file),
                                       ("--json-schema", args.json_schema),
                                       ("--json-schema-file", args.json_schema_file)) if v is not None] \
        if hasattr(args, "grammar") else []
    if len(constraints) > 1:
        raise UsageError(f"{constraints[0][0]} and {constraints[1][0]} given together: constrain the output one way")
    if constraints:
        flag, value = constraints[0]
        if flag.endswith("-file"):
            try:
                value = read_text(value, flag)
            except OSError as e:
                raise UsageError(f"{flag} {value}: {e.strerror or e}") from None
            except GGMLValueError as e:
                raise UsageError(str(e)) from None
        try:
            given["grammar" if flag.startswith("--grammar") else "json_schema"] = value
            return sampling_params("run", None, defaults, **given)
        except GGMLValueError as e:
            raise UsageError(f"{flag}: {e}") from None
    try:
        return sampling_params("run", None, defaults, **given)
    except GGMLValueError as e:
        msg = str(e)
        for flags, field, _, _ in _SAMPLING_FLAGS:
            if msg.startswith(field + " "):
                why = msg[len(field) + 1:].rsplit(", got ", 1)[0]      # the flag's value is shown already
                raise UsageError(f"{flags[0]} {getattr(args, field)}: {why}") from None
        for flag, field in (("--samplers", "samplers"), ("--dry-sequence-breaker", "dry_sequence_breakers"),
                            ("--logit-bias", "logit_bias")):
            if msg.startswith(field):
                raise UsageError(f"{flag}: {msg}") from None
        raise UsageError(msg) from None


def sampling_overrides(args: argparse.Namespace) -> dict:
    """The sampling flags given (not their defaults), as SamplingParams fields: what ``ggmlpy serve`` puts
    over the model file's recommendations for every request that does not set them, as llama-server
    does (``-s``/``--seed`` too: every request that sets no seed then draws the same, as there)."""
    sampling_from_args(args)                  # checked, each error naming its flag
    out = {field: getattr(args, field) for _, field, _, _ in _SAMPLING_FLAGS if getattr(args, field, None) is not None}
    if args.seed is not None and args.seed >= 0:
        out["seed"] = args.seed
    chain = getattr(args, "samplers", None) or getattr(args, "sampling_seq", None)
    if chain is not None:
        out["samplers"] = chain
    breakers = getattr(args, "dry_sequence_breaker", None)
    if breakers:
        out["dry_sequence_breakers"] = sampling_from_args(args).dry_sequence_breakers
    if getattr(args, "logit_bias", None):
        out["logit_bias"] = dict(sampling_from_args(args).logit_bias)
    return out


# ``--version`` (every command line ggmlpy has: the CLI's; moved here from cli.py, which stays under 800 lines)
def version_text() -> str:
    """``ggmlpy --version``: ggmlpy's version, ggml's and the commit of the ggml source it was built from."""
    from ggmlpy._system import ggml_commit, ggml_version
    from ggmlpy._version import __version__

    return f"ggmlpy {__version__} (ggml {ggml_version()}, commit {ggml_commit()})"


class Version(argparse.Action):
    """``--version``, with the text made only when asked for (it loads ggml)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())
        parser.exit()
