"""The ``ggmlpy`` command: ``ggmlpy info``, ``ggmlpy bench``, ``ggmlpy run``, ``ggmlpy chat``, ``ggmlpy embed``,
``ggmlpy serve``, ``ggmlpy cache`` and ``ggmlpy rpc-server``.

Every subcommand answers a mistake the same way (:mod:`ggmlpy._cliargs`): one line naming the flag,
``ggmlpy <command>: error: -t 0: must be at least 1``, exit status 2 for a usage error (reported before
anything runs), 1 for a failure at run time (a model file that is missing, a folder or not GGUF; memory;
a device), 130 for Ctrl-C, 141 when the reader of the output went away; ``--debug`` (or
``GGMLPY_DEBUG=1``) adds the traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
import warnings
from typing import Optional

from ggmlpy._cliargs import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    ArgParser,
    UsageError,
    Version,
    add_model_source_args,
    add_sampling_args,
    at_least,
    check_model_source,
    debug_requested,
    gpu_layers_note,
    model_source,
    one_line_warnings,
    override_problem,
)
from ggmlpy._cliargs import read_text as _read_text
from ggmlpy._cliargs import sampling_from_args as _sampling
from ggmlpy._cliembed import add_embed_args
from ggmlpy.defaults import CLI_N_PREDICT, DEFAULTS, n_ctx_for


def _cmd_info(args: argparse.Namespace) -> int:
    from ggmlpy._system import format_system_info, system_info
    from ggmlpy.models.calibrate import cached_summary

    info = system_info()
    if "AMX" in info["cpu_weight_buffers"]:
        from ggmlpy.weights import amx_usable

        if not amx_usable():        # ggml offers it, its kernels fault here (checked in a child process)
            info["cpu_weight_buffers"] = [b if b != "AMX" else "AMX (faults on this machine: not used)"
                                          for b in info["cpu_weight_buffers"]]
    info["own_kernels"] = cached_summary()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(format_system_info(info))
        print("\n".join(info["own_kernels"]))
    return 0


def _mem_mib(text: str) -> float:
    """An ``rpc-server --mem`` value: MiB (decimals allowed), 0 for the device's own memory (llama.cpp's
    rpc-server ``-m``, in MiB)."""
    try:
        mib = float(text)
    except ValueError:
        mib = -1.0
    if not (mib == 0 or 1 <= mib * (1 << 20) < 2.0 ** 64):       # also refuses nan and inf
        raise argparse.ArgumentTypeError(f"must be a number of MiB from 1 byte up, 0 for the device's own "
                                         f"memory (got {text!r})")
    return mib


def _seconds(text: str) -> float:
    """An ``rpc-server --timeout`` value: seconds up to a day, 0 for none."""
    try:
        s = float(text)
    except ValueError:
        s = -1.0
    if not 0 <= s <= 86400:                        # also refuses nan
        raise argparse.ArgumentTypeError(f"must be a number of seconds up to 86400, 0 for none (got {text!r})")
    return s


def _clients(text: str) -> int:
    """An ``rpc-server --max-clients`` value: 0 (no limit) to 1024."""
    try:
        n = int(text)
    except ValueError:
        n = -1
    if not 0 <= n <= 1024:
        raise argparse.ArgumentTypeError(f"must be a whole number from 0 (no limit) to 1024 (got {text!r})")
    return n


def _cmd_rpc_server(args: argparse.Namespace) -> int:
    from ggmlpy import _core

    devs = [_core.device(name) for name in args.device] if args.device else [_core.device("CPU")]
    mem = args.mem or [0]
    if len(mem) == 1:
        mem = mem * len(devs)
    elif len(mem) != len(devs):
        print(f"ggmlpy rpc-server: error: {len(mem)} --mem sizes for {len(devs)} device(s): give one for every "
              f"device, or one per --device", file=sys.stderr)
        return 2
    limits = [round(mib * (1 << 20)) if mib else None for mib in mem]
    endpoint = f"{args.host}:{args.port}"
    # what each device advertises to clients: its limit, or its own total
    names = ", ".join(f"{d.name} ({mib:g} MiB)" if mib else f"{d.name} ({d.memory()[1] >> 20} MiB, its own)"
                      for d, mib in zip(devs, mem))
    print(f"ggmlpy rpc-server: serving {names} at {endpoint} (Ctrl-C to stop)", flush=True)
    try:
        _core.rpc_start_server(endpoint, devs, args.cache_dir, args.threads or 0, mem=limits, timeout=args.timeout,
                               max_clients=args.max_clients)
    except (OSError, ValueError) as e:
        print(f"ggmlpy rpc-server: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    return 1


def _cmd_bench(args: argparse.Namespace) -> int:
    from ggmlpy import benchmark

    return benchmark.main(args.bench_args, prog="ggmlpy bench")


# ---------------------------------------------------------------------------------------------- run / chat

#: ``ggmlpy chat``'s help, for ``/?``
_CHAT_HELP = """Available commands:
  /image PATH  attach an image to the next message (a model started with --mmproj)
  /clear       forget the conversation (the system prompt stays)
  /bye         exit (also Ctrl-D)
  /?           this help
Ctrl-C stops a reply and returns to the prompt; the reply is not kept (as Ollama)."""


def _lenient(stream) -> None:
    """Characters the terminal's encoding cannot show become ``?`` (bytes typed that are not text in it,
    U+FFFD) instead of an error in the middle of a reply."""
    reconf = getattr(stream, "reconfigure", None)
    if reconf is not None:
        try:
            reconf(errors="replace")
        except (ValueError, OSError):      # a stream already written to in another way: leave it
            pass


def _check_model_args(args: argparse.Namespace) -> None:
    """``run``'s and ``chat``'s values, checked before anything is loaded; each error names its flag (as
    ``ggmlpy bench`` words it) and is a :class:`UsageError` (exit status 2)."""
    if args.n_predict == 0 or args.n_predict < -1:
        raise UsageError(f"-n {args.n_predict}: must be at least 1, or -1 (until the end of generation or a "
                         f"full context)")
    checks = [("-c", args.ctx_size, 0, "0: the model's training context, at most 4096"),
              ("-b", args.batch_size, 1, ""), ("-mg", args.main_gpu, 0, ""), ("-ncmoe", args.n_cpu_moe, 0, "")]
    if args.threads is not None:
        checks.append(("-t", args.threads, 1, "default: all cores"))
    for flag, value, lo, note in checks:
        msg = at_least(flag, value, lo, note)
        if msg:
            raise UsageError(msg)
    _sampling(args)                  # each sampling flag checked now, its error naming the flag
    ngl = args.n_gpu_layers
    if ngl.lower() == "auto":
        args.n_gpu_layers = "auto"
    else:
        try:
            args.n_gpu_layers = int(ngl)
        except ValueError:
            raise UsageError(f"-ngl {ngl}: expected a number of layers, -1 (all) or auto") from None
        if args.n_gpu_layers < -1:
            raise UsageError(f"-ngl {ngl}: must be at least -1 (-1: all layers), or auto")
    if args.split_mode == "row":
        raise UsageError("-sm row: not supported: ggmlpy splits by layer (row splits need ggml's CUDA split "
                         "buffers)")
    if args.tensor_split:
        try:
            props = [float(x) for x in args.tensor_split.replace("/", ",").split(",")]
        except ValueError:
            raise UsageError(f"invalid -ts value {args.tensor_split!r}: expected proportions such as 3,1") from None
        if any(not (x >= 0) or x == float("inf") for x in props):
            raise UsageError(f"invalid -ts value {args.tensor_split!r}: proportions must be finite and >= 0")
        args.tensor_split = props
    for text in args.override_tensor or ():
        for item in text.split(","):
            msg = override_problem(item)
            if msg:
                raise UsageError(msg)
    from ggmlpy.benchmark.options import cache_types_problem

    fa = {"on": 1, "off": 0, "auto": -1}[args.flash_attn]
    msg = cache_types_problem(args.cache_type_k or "f16", args.cache_type_v or "f16", fa)
    if msg:
        raise UsageError(msg)
    check_model_source(args)
    if args.image and args.mmproj is None and args.hf_repo is None:
        raise UsageError("--image needs the model's vision encoder: --mmproj FILE (the mmproj GGUF)")


def _train_ctx(path: str) -> int:
    """The training context a GGUF's header gives (``<arch>.context_length``), 4096 when it gives none."""
    from ggmlpy.gguf import GGUFReader

    with GGUFReader(path) as r:
        arch = r.metadata.get("general.architecture", "")
        value = r.metadata.get(f"{arch}.context_length")
    return int(value) if isinstance(value, int) and value > 0 else 4096


def _load_images(paths, what: str = "--image") -> list:
    """The images of ``--image``/``/image`` paths, read now (RGB PIL images): a file that is missing or not
    an image is an error before the model is asked anything."""
    from ggmlpy.vision.preprocess import load_image

    return [load_image(p) for p in paths]


def _open_runner(args: argparse.Namespace, prog: str, n_seq_max: int = 1, progress=None):
    """Load ``args.model`` (with ``--mmproj``) and start a Runner over it (``n_seq_max`` sequences), with the
    tokenizer checked first; ``progress(done, total)`` as ``load_model`` calls it."""
    from ggmlpy.backend import main_accelerator
    from ggmlpy.load import load_model
    from ggmlpy.runner import Runner

    path, mmproj = model_source(args, bool(args.image), lambda text: print(f"{prog}: {text}", file=sys.stderr))
    devices = args.device.split(",") if "," in args.device else args.device
    kw = {"rpc": args.rpc.split(",") if args.rpc else (),
          "n_cpu_moe": 1 << 30 if args.cpu_moe else args.n_cpu_moe}
    if isinstance(args.n_gpu_layers, int):
        note = gpu_layers_note(args.n_gpu_layers, args.device, kw["rpc"])
        if note:
            print(f"{prog}: note: {note}", file=sys.stderr)
    if args.override_tensor:
        kw["tensor_overrides"] = ",".join(args.override_tensor)
    if args.tensor_split:
        kw["tensor_split"] = args.tensor_split
    if args.split_mode == "none":
        devices = main_accelerator(devices, args.main_gpu, rpc=kw["rpc"])
    fa = {"on": True, "off": False, "auto": None}[args.flash_attn]
    n_ctx = args.ctx_size
    if args.n_gpu_layers == "auto":
        # the placement search sizes the weights around this runner's cache and graphs
        n_ctx = n_ctx or n_ctx_for(_train_ctx(path))
        kw.update(n_ctx=n_ctx, n_batch=args.batch_size, n_ubatch=min(args.batch_size, 512),
                  type_k=args.cache_type_k or "f16", type_v=args.cache_type_v or "f16", flash_attn=fa)
    model = load_model(path, devices=devices, n_gpu_layers=args.n_gpu_layers, mmproj=mmproj, progress=progress,
                       vision_precision=getattr(args, "vision_precision", "exact"), **kw)
    try:
        if n_ctx <= 0:
            n_ctx = n_ctx_for(getattr(model.config, "n_ctx_train", None))
        if not getattr(model, "causal", True):
            from ggmlpy.runner.runner import ENCODER_N_SEQ_MAX

            # an encoder keeps no cache per sequence: a batch packs that many inputs (-np is the least)
            n_seq_max = max(n_seq_max, ENCODER_N_SEQ_MAX)
        rt = Runner(model, n_ctx=n_ctx, n_batch=args.batch_size, n_ubatch=min(args.batch_size, DEFAULTS["n_ubatch"]),
                    n_threads=args.threads or 0, op_offload=not args.no_op_offload, flash_attn=fa,
                    type_k=args.cache_type_k, type_v=args.cache_type_v, n_seq_max=n_seq_max)
    except BaseException:
        model.close()
        raise
    try:
        _ = rt.tokenizer               # a file without a vocabulary fails here, before any prompt is read
    except BaseException:
        rt.close()
        model.close()
        raise
    return model, rt


def _template(args: argparse.Namespace) -> Optional[str]:
    return _read_text(args.chat_template_file, "--chat-template-file") if args.chat_template_file else None


def _check_chat_template(rt, template: Optional[str]) -> None:
    from ggmlpy import GGMLValueError

    if template is None and not getattr(rt.tokenizer, "chat_template", None):
        raise GGMLValueError(f"{rt.model.path if hasattr(rt.model, 'path') else 'the model'} has no chat "
                             f"template (tokenizer.chat_template); give one with --chat-template-file")


def _stats_line(r) -> str:
    """One line of timings, after llama.cpp's ``llama-cli`` and ``ollama run --verbose``: the prompt tokens
    evaluated (those taken from the cache apart) and their rate, the generated tokens and their rate
    (the first token comes with the prompt's evaluation, so the generation rate counts the others)."""
    n_eval = max(r.prompt_eval_count - r.n_cached, 0)
    pp = n_eval / r.prompt_eval_duration if r.prompt_eval_duration > 0 else 0.0
    tg = (r.eval_count - 1) / r.eval_duration if r.eval_count > 1 and r.eval_duration > 0 else 0.0
    cached = f" ({r.n_cached} cached)" if r.n_cached else ""
    return (f"[ prompt: {r.prompt_eval_count} tokens{cached}, {pp:.2f} t/s | generated: {r.eval_count} tokens, "
            f"{tg:.2f} t/s | done: {r.done_reason} ]")


def _cancel(handle) -> None:
    """Cancel a request and wait until the runner has ended it (its slot is free for the next one)."""
    handle.cancel()
    while True:
        try:
            handle.result()
            return
        except KeyboardInterrupt:          # a second Ctrl-C while the cancel lands
            continue


def _stream(handle, out) -> bool:
    """Print a request's text as it comes; True when it ran to its end, False when Ctrl-C cancelled it.

    Ctrl-C (KeyboardInterrupt in this, the main thread, while it waits for the next token) cancels the
    request; the runner ends it at its next batch and what it generated until then is discarded here.
    """
    try:
        for ev in handle:
            if ev.text:
                out.write(ev.text)
                out.flush()
        return True
    except KeyboardInterrupt:
        _cancel(handle)
        return False


def _with_images(text: str, images: list):
    """A chat message's content: ``text`` after its images' parts (most vision models want the image
    first, as llama.cpp's ``llama-mtmd-cli`` puts it), or ``text`` itself when there are none."""
    if not images:
        return text
    return [*({"type": "image", "image": im} for im in images), {"type": "text", "text": text}]


def _cmd_run(args: argparse.Namespace) -> int:
    if args.prompt is None and args.file is None:
        raise UsageError("a prompt is needed: -p PROMPT or -f FILE ('-' for stdin)")
    if args.system is not None and not args.chat:
        raise UsageError("--system is for --chat")
    out = sys.stdout
    _lenient(out)
    _lenient(sys.stdin)
    if args.prompt is not None:
        prompt = args.prompt
    elif args.file == "-":
        prompt = sys.stdin.read()
    else:
        prompt = _read_text(args.file, "-f")
    template = _template(args)
    images = _load_images(args.image or ())
    model, rt = _open_runner(args, "ggmlpy run")
    try:
        kw = dict(max_tokens=args.n_predict, sampling=_sampling(args, rt.sampling_defaults),
                  stop=tuple(args.stop or ()), shift=False)
        if args.chat:
            _check_chat_template(rt, template)
            messages = ([{"role": "system", "content": args.system}] if args.system is not None else []) + \
                [{"role": "user", "content": _with_images(prompt, images)}]
            handle = rt.submit_chat(messages, template=template, **kw)
        else:
            if images:
                from ggmlpy.runner.images import MEDIA_MARKER

                # llama-mtmd-cli's rule: a prompt without markers gets one per image, before its text
                if MEDIA_MARKER not in prompt:
                    prompt = MEDIA_MARKER * len(images) + prompt
                kw["images"] = images
            handle = rt.submit(prompt, parse_special=not args.no_parse_special, **kw)
        finished = _stream(handle, out)
        r = handle.result()
        out.write("\n")
        out.flush()
        print(_stats_line(r), file=sys.stderr)
        return 0 if finished else EXIT_INTERRUPTED
    finally:
        rt.close()
        model.close()


def _has_images(messages: list) -> bool:
    return any(isinstance(m.get("content"), list) for m in messages)


def _chat_turn(rt, history: list, args, template: Optional[str], out):
    """Send the conversation, stream the reply; its Completion, or None when Ctrl-C cancelled it.

    A conversation longer than the context loses its oldest messages (the system prompt is kept), as
    Ollama does; the reply then ends when the context is full (no shifting inside a reply).
    """
    from ggmlpy import GGMLValueError

    messages = list(history)
    ids = rt.chat_prompt(messages, template=template)
    first = 1 if messages and messages[0].get("role") == "system" else 0
    while len(ids) >= rt.n_ctx and len(messages) - first > 1:
        del messages[first]
        ids = rt.chat_prompt(messages, template=template)
    if len(ids) >= rt.n_ctx:
        raise GGMLValueError(f"the message takes {len(ids)} tokens, more than the context of {rt.n_ctx} "
                             f"(-c) leaves room for")
    handle = None
    kw = dict(max_tokens=args.n_predict, sampling=_sampling(args, rt.sampling_defaults),
              stop=tuple(args.stop or ()), shift=False)
    try:
        if _has_images(messages):        # the images go with the messages (token ids alone would lose them)
            handle = rt.submit_chat(messages, template=template, **kw)
        else:
            handle = rt.submit(ids, detokenize=True, **kw)
        if not _stream(handle, out):
            return None
        r = handle.result()
    except KeyboardInterrupt:               # Ctrl-C just before or after the stream: a cancel too
        if handle is not None:
            _cancel(handle)
        return None
    return r


def chat_repl(rt, args: argparse.Namespace, history: list, template: Optional[str] = None, out=None,
              read=input, images: Optional[list] = None) -> int:
    """``ggmlpy chat``'s loop over a started runner: read a line, answer it, until ``/bye`` or Ctrl-D.

    ``history`` (a list of messages, the system prompt first if any) grows by each user message and
    each finished reply. Ctrl-C during a reply cancels it and returns to the prompt: as Ollama does,
    the user's message stays in the history and the partial reply is dropped. Ctrl-C at the prompt
    prints how to exit. An error in one turn (the template failed, the message alone is longer than
    the context) is printed and the message dropped; the chat goes on. ``/image PATH`` (as in
    llama.cpp's ``llama-mtmd-cli``) reads an image now and attaches it to the next message, as do
    ``images`` (``--image``) to the first. With ``--verbose`` the speed of each reply is printed on a
    line of its own after it. Returns the exit status (0).
    """
    from ggmlpy import GGMLError

    out = sys.stdout if out is None else out
    system = [m for m in history[:1] if m.get("role") == "system"]
    pending = list(images or ())
    while True:
        try:
            line = read(">>> ")
        except EOFError:                       # Ctrl-D
            out.write("\n")
            return 0
        except KeyboardInterrupt:              # Ctrl-C at the prompt: Ollama's hint, not an exit
            out.write("\nUse Ctrl + d or /bye to exit.\n")
            out.flush()
            continue
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            cmd, _, rest = text.partition(" ")
            if cmd in ("/bye", "/exit"):
                return 0
            if cmd == "/clear":
                history[:] = system
                pending.clear()
                out.write("Cleared session context\n")
            elif cmd in ("/?", "/help"):
                out.write(_CHAT_HELP + "\n")
            elif cmd == "/image":
                out.flush()
                _attach(rt, rest.strip(), pending, out)
            else:
                out.write(f"Unknown command '{cmd}'. Type /? for help\n")
            out.flush()
            continue
        history.append({"role": "user", "content": _with_images(line, pending)})
        try:
            r = _chat_turn(rt, history, args, template, out)
        except GGMLError as e:
            from ggmlpy.benchmark import _one_line

            history.pop()
            out.write("\n")
            out.flush()
            print(f"error: {_one_line(e)}", file=sys.stderr)
            continue
        pending.clear()                         # sent (the message keeps them)
        if r is not None:
            history.append({"role": "assistant", "content": r.text})
        out.write("\n")
        out.flush()
        if r is not None:
            if args.verbose:                    # on a line of its own, after the reply's
                print(_stats_line(r), file=sys.stderr, flush=True)
            out.write("\n")
            out.flush()


def _attach(rt, path: str, pending: list, out) -> None:
    """``/image PATH``: read the image now and keep it for the next message; a problem is one line."""
    from ggmlpy import GGMLError

    if not path:
        print("error: /image needs a file: /image PATH", file=sys.stderr)
    elif getattr(rt, "vision", None) is None:
        print("error: this model has no vision encoder: start the chat with --mmproj FILE (-hf: --mmproj)",
              file=sys.stderr)
    else:
        try:
            pending += _load_images([path], "/image")
        except (GGMLError, OSError) as e:
            from ggmlpy.benchmark import _one_line

            print(f"error: {_one_line(e)}", file=sys.stderr)
            return
        out.write(f"{path} image loaded (sent with your next message)\n")


def _cmd_chat(args: argparse.Namespace) -> int:
    """The interactive chat (see :func:`chat_repl` and ``_CHAT_HELP``)."""
    template = _template(args)
    _lenient(sys.stdout)
    _lenient(sys.stdin)
    images = _load_images(args.image or ())
    model, rt = _open_runner(args, "ggmlpy chat")
    try:
        _check_chat_template(rt, template)
        history = [{"role": "system", "content": args.system}] if args.system is not None else []
        return chat_repl(rt, args, history, template, images=images)
    finally:
        rt.close()
        model.close()


def _cmd_serve(args: argparse.Namespace) -> int:
    """``ggmlpy serve``: the model loads in a thread once the socket listens (ggmlpy.server.run)."""
    from ggmlpy._cliargs import sampling_overrides
    from ggmlpy.server.run import serve

    given = sampling_overrides(args)          # checked before anything loads

    def load(progress):
        model, rt = _open_runner(args, "ggmlpy serve", args.parallel, progress)
        # the sampling flags are every request's defaults, over the file's recommendations (llama-server's)
        rt.sampling_defaults = {**rt.sampling_defaults, **given}
        return model, rt

    return serve(args, load, template=_template(args))


def _add_model_args(p: argparse.ArgumentParser, serve: bool = False) -> None:
    """The model, placement, runner and sampling flags of run, chat and serve (serve: no constrained output)."""
    add_model_source_args(p)            # -m, -hf, -hff, --mmproj
    p.add_argument("--vision-precision", choices=("exact", "fast"), default="exact",
                   help="the vision encoder's numerics: exact (default; image features ~1e-6 of transformers') "
                        "or fast (ggml's flash attention and GELU table, as llama.cpp's mtmd: ~1e-3, faster)")
    # the defaults are ggmlpy.defaults' table, the API's own
    p.add_argument("-c", "--ctx-size", type=int, default=0,
                   help=f"context size (default 0: the model's training context, at most {DEFAULTS['n_ctx']})")
    p.add_argument("-b", "--batch-size", type=int, default=DEFAULTS["n_batch"],
                   help="prompt tokens per batch (default %(default)s)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("-ngl", "--n-gpu-layers", default=str(DEFAULTS["n_gpu_layers"]), metavar="N|auto",
                   help="layers on accelerators (default -1: all, when there is one); auto: as many as fit with "
                        "this context (-c), found by trying allocations")
    p.add_argument("-dev", "--device", default=DEFAULTS["devices"],
                   help="devices: auto (default), cpu, or names (comma list)")
    p.add_argument("-sm", "--split-mode", default="layer", choices=("layer", "none", "row"),
                   help="layer: the offloaded layers divided among the accelerators (default); none: all on the "
                        "-mg one; row: refused (ggml's CUDA split buffers)")
    p.add_argument("-ts", "--tensor-split", default=None, metavar="N0,N1,...",
                   help="proportions of the offloaded layers per accelerator (default: by free memory)")
    p.add_argument("-mg", "--main-gpu", type=int, default=0, help="the accelerator -sm none uses (default 0)")
    p.add_argument("-nopo", "--no-op-offload", action="store_true",
                   help="compute every op where its weights are (no offload of host-weight products)")
    p.add_argument("-ot", "--override-tensor", action="append", metavar="PATTERN=DEVICE,...",
                   help="weights whose names match PATTERN (a regular expression) on DEVICE (a device or buffer type "
                        "name), e.g. 'ffn_.*_exps=CPU'; repeatable")
    p.add_argument("-ncmoe", "--n-cpu-moe", type=int, default=0, metavar="N",
                   help="keep the expert weights of the first N layers on the CPU (default 0)")
    p.add_argument("-cmoe", "--cpu-moe", action="store_true", help="keep every layer's expert weights on the CPU")
    p.add_argument("-rpc", "--rpc", default=None, metavar="HOST:PORT,...",
                   help="add ggml RPC servers (their devices join -dev auto)")
    p.add_argument("-ctk", "--cache-type-k", default=None, metavar="TYPE",
                   help="K cache type: f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1 (default f16)")
    p.add_argument("-ctv", "--cache-type-v", default=None, metavar="TYPE",
                   help="V cache type, as -ctk; a quantized V needs -fa on or auto (default f16)")
    p.add_argument("-fa", "--flash-attn", default="auto", choices=("on", "off", "auto"),
                   help="flash attention (default auto)")
    add_sampling_args(p, constraints=not serve, server=serve)
    p.add_argument("--chat-template-file", default=None, metavar="FILE",
                   help="Jinja chat template to use instead of the model's")
    if serve:
        return
    p.add_argument("-n", "--n-predict", type=int, default=CLI_N_PREDICT,
                   help="tokens to generate at most (default -1: until end of generation or the context is full)")
    p.add_argument("--image", action="append", metavar="PATH",
                   help="an image for the prompt (run) or the first message (chat); repeatable; needs --mmproj "
                        "(with -hf: the repository's)")
    p.add_argument("--stop", action="append", metavar="STR",
                   help="stop string (repeatable): the text ends before it")
    p.add_argument("--system", default=None, help="system prompt (run: with --chat)")


def _human(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _hub_cache() -> str:
    """Where huggingface_hub keeps the models ``-hf`` downloads ($HF_HUB_CACHE, $HF_HOME/hub, ...)."""
    try:
        from huggingface_hub import constants
    except ImportError:                       # a dependency; an install without it has no -hf either
        return "(huggingface_hub is not installed)"
    return str(constants.HF_HUB_CACHE)


def _cmd_cache(args: argparse.Namespace) -> int:
    """``ggmlpy cache [list|path|clear [--yes]]``: the folder of ggmlpy's own files, what is in it, and
    removing it (only ggmlpy's entries; anything else there is listed and left alone)."""
    from ggmlpy._cache import cache_dir, cache_dir_source, cache_entries, clear_cache

    folder = cache_dir()
    if args.action == "path":
        print(folder)
        return 0
    entries = cache_entries(folder)
    own = [e for e in entries if e.own]
    total = sum(e.size for e in own)
    if args.action == "list":
        source = {"GGMLPY_CACHE": "from $GGMLPY_CACHE", "XDG_CACHE_HOME": "from $XDG_CACHE_HOME",
                  "default": "the default; $GGMLPY_CACHE or $XDG_CACHE_HOME move it"}[cache_dir_source()]
        print(f"{folder} ({source})")
        print(f"  models fetched with -hf or hf:// are in the Hugging Face cache, {_hub_cache()} (not here; "
              f"huggingface_hub's cache commands list and remove them)")
        if not entries:
            print("  empty: nothing written yet")
            return 0
        width = max(len(e.path.name) + (1 if e.path.is_dir() else 0) for e in entries)
        for e in entries:
            name = e.path.name + ("/" if e.path.is_dir() else "")
            print(f"  {_human(e.size):>10}  {name:<{width}}  {e.what}")
        print(f"  {_human(total):>10}  total of ggmlpy's {len(own)} entr{'y' if len(own) == 1 else 'ies'} "
              f"(ggmlpy cache clear removes them)")
        return 0
    # clear
    if not own:
        print(f"nothing of ggmlpy's to remove in {folder}")
        return 0
    what = f"{len(own)} entr{'y' if len(own) == 1 else 'ies'} ({_human(total)}) from {folder}"
    if not args.yes:
        if not sys.stdin.isatty():
            raise UsageError(f"this removes {what}; add --yes (there is no terminal to ask)")
        try:
            answer = input(f"Remove {what}? [y/N] ")
        except EOFError:
            answer = ""
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing removed")
            return 0
    n, size = clear_cache(folder)
    print(f"removed {n} entr{'y' if n == 1 else 'ies'} ({_human(size)}) from {folder}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = ArgParser(prog="ggmlpy", description="ggml from Python: info, benchmarks, text generation and chat, "
                   "its cache folder, RPC server")
    ap.add_argument("--version", action=Version, help="print ggmlpy's, ggml's version and ggml's commit, and exit")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, **kw) -> argparse.ArgumentParser:
        p = sub.add_parser(name, **kw)
        p.add_argument("--debug", action="store_true", help="print the traceback of an error")
        return p

    p = command("info", help="versions, CPU features, compiled backends and devices")
    p.add_argument("--json", action="store_true", help="print as JSON")
    p.set_defaults(func=_cmd_info)
    p = sub.add_parser("bench", add_help=False,
                       help="prompt/generation (and image encoding) throughput, llama-bench compatible "
                            "(ggmlpy bench -h)")
    p.add_argument("bench_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd_bench)
    p = command("run", help="complete a prompt, printing the text as it is generated, then the speed")
    p.add_argument("-p", "--prompt", default=None, help="the prompt")
    p.add_argument("-f", "--file", default=None, help="read the prompt from FILE ('-': stdin)")
    p.add_argument("--chat", action="store_true", help="send the prompt as one user message through the chat "
                   "template")
    p.add_argument("--no-parse-special", action="store_true",
                   help="read special-token texts in the prompt (<|im_start|>) as plain text")
    _add_model_args(p)
    p.set_defaults(func=_cmd_run)
    p = command("chat", help="interactive chat in the terminal (/? for commands, Ctrl-D to exit)")
    p.add_argument("--verbose", action="store_true", help="print the speed after each reply, on a line of its own")
    _add_model_args(p)
    p.set_defaults(func=_cmd_chat)
    p = command("embed", help="embeddings of texts (an embedding model: bert, nomic-bert..., or a decoder), or "
                              "with --query a reranker's scores")
    add_embed_args(p, _add_model_args)
    p = command("serve", help="an HTTP server with OpenAI's and Ollama's APIs (pip install 'ggmlpy[server]')",
                allow_abbrev=False)      # whole flags only: run's --chat or -f is not --chat-template-file or -fa
    _add_model_args(p, serve=True)
    from ggmlpy.server.flags import add_server_args

    add_server_args(p)
    p.set_defaults(func=_cmd_serve, image=None)      # no --image: the model and its requests' own images
    p = command("cache", help="ggmlpy's cache folder (built-in models, measurements): list, path, clear")
    p.add_argument("action", nargs="?", default="list", choices=("list", "path", "clear"),
                   help="list (default): what is there, with sizes; path: print the folder; clear: remove "
                        "ggmlpy's files from it (nothing else)")
    p.add_argument("-y", "--yes", action="store_true", help="clear without asking")
    p.set_defaults(func=_cmd_cache)
    p = command("rpc-server", help="serve this machine's devices to ggml RPC clients")
    p.add_argument("--host", default="127.0.0.1", help="IPv4 address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=50052, help="TCP port (default 50052)")
    p.add_argument("--threads", "-t", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--device", "-d", action="append", help="device to serve (repeatable; default CPU)")
    p.add_argument("--cache-dir", default=None, help="cache tensors received by hash in this folder")
    p.add_argument("--mem", "-m", type=_mem_mib, action="append", metavar="MiB",
                   help="memory each device offers clients, in MiB (decimals allowed): it reports this "
                        "size and refuses allocations beyond it (one for all devices, or one per --device; "
                        "default 0: the device's own memory)")
    p.add_argument("--timeout", type=_seconds, default=30.0, metavar="SECONDS",
                   help="disconnect a client whose HELLO, or any message once begun, makes no progress for this "
                        "long (default 30; 0: never). A client may stay idle between messages as long as it likes")
    p.add_argument("--max-clients", type=_clients, default=4, metavar="N",
                   help="serve at most N clients at once, each on its own thread; one more is refused within half "
                        "a second (default 4; 0: no limit)")
    p.set_defaults(func=_cmd_rpc_server)
    return ap


#: The subcommands (for naming the one a usage error is in before the command line is parsed).
COMMANDS = ("info", "bench", "run", "chat", "embed", "serve", "cache", "rpc-server")


def _prog(argv: list[str]) -> str:
    cmd = next((a for a in argv if not a.startswith("-")), None)
    return f"ggmlpy {cmd}" if cmd in COMMANDS else "ggmlpy"


def main(argv: list[str] | None = None) -> int:
    """The ``ggmlpy`` command; returns its exit status (see the module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        # bench has llama-bench's own option syntax (-ngl, -pg, comma lists): hand it over whole.
        return _cmd_bench(argparse.Namespace(bench_args=argv[1:]))
    prog = _prog(argv)
    debug = debug_requested(argv)
    try:
        args, extra = build_parser().parse_known_args(argv)
        if extra:
            raise UsageError(f"unrecognized arguments: {' '.join(extra)}")
        if args.command in ("run", "chat", "embed", "serve"):
            _check_model_args(args)
        if args.command == "serve":
            from ggmlpy.server.flags import check_server_args

            check_server_args(args)
        elif args.command == "rpc-server" and args.threads is not None:
            msg = at_least("-t", args.threads, 1, "default: all cores")
            if msg:
                raise UsageError(msg)
    except UsageError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except SystemExit as e:             # --help, --version
        return e.code if isinstance(e.code, int) else 0
    from ggmlpy import GGMLError

    try:
        with warnings.catch_warnings(), one_line_warnings(prog, debug):
            # said once as a note naming -ngl (_open_runner), not as the loader's warning naming its API
            warnings.filterwarnings("ignore", message=r"split_layers: n_gpu_layers=\d+ ignored")
            return args.func(args)
    except UsageError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        from ggmlpy.benchmark.driver import _broken_pipe

        return _broken_pipe()
    except (GGMLError, OSError, MemoryError) as e:
        # one clear line for what a user can cause; --debug or GGMLPY_DEBUG=1 shows the traceback
        from ggmlpy.benchmark import _one_line

        if debug:
            traceback.print_exc()
        print(f"{prog}: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:           # Ctrl-C while loading a model, say: no traceback
        print(file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
