"""The ``ggmlpy`` command: ``ggmlpy info``, ``ggmlpy bench``, ``ggmlpy run``, ``ggmlpy chat`` and
``ggmlpy rpc-server``."""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from typing import Optional

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
        _core.rpc_start_server(endpoint, devs, args.cache_dir, args.threads, mem=limits, timeout=args.timeout,
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
  /clear   forget the conversation (the system prompt stays)
  /bye     exit (also Ctrl-D)
  /?       this help
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


def _open_runner(args: argparse.Namespace):
    """Load ``args.model`` and start a Runner over it (one sequence), with the tokenizer checked first."""
    from ggmlpy._core import GGMLValueError
    from ggmlpy.backend import main_accelerator
    from ggmlpy.load import load_model
    from ggmlpy.runner import Runner

    devices = args.device.split(",") if "," in args.device else args.device
    if args.split_mode == "row":
        raise GGMLValueError("-sm row: ggmlpy splits by layer (row splits need ggml's CUDA split buffers)")
    if args.n_cpu_moe < 0:
        raise GGMLValueError(f"-ncmoe {args.n_cpu_moe}: must be >= 0")
    kw = {"rpc": args.rpc.split(",") if args.rpc else (),
          "n_cpu_moe": 1 << 30 if args.cpu_moe else args.n_cpu_moe}
    if args.override_tensor:
        kw["tensor_overrides"] = ",".join(args.override_tensor)
    if args.tensor_split:
        try:
            kw["tensor_split"] = [float(x) for x in args.tensor_split.replace("/", ",").split(",")]
        except ValueError:
            raise GGMLValueError(f"-ts {args.tensor_split}: expected proportions such as 3,1") from None
    if args.split_mode == "none":
        devices = main_accelerator(devices, args.main_gpu, rpc=kw["rpc"])
    model = load_model(args.model, devices=devices, n_gpu_layers=args.n_gpu_layers, **kw)
    try:
        n_ctx = args.ctx_size
        if n_ctx <= 0:
            n_ctx = n_ctx_for(getattr(model.config, "n_ctx_train", None))
        rt = Runner(model, n_ctx=n_ctx, n_batch=args.batch_size, n_ubatch=min(args.batch_size, DEFAULTS["n_ubatch"]),
                    n_threads=args.threads, op_offload=not args.no_op_offload)
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


def _sampling(args: argparse.Namespace):
    from ggmlpy.sampling import SamplingParams

    return SamplingParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          seed=None if args.seed is None or args.seed < 0 else args.seed)


def _read_text(path: str, option: str) -> str:
    """A UTF-8 file's text; a file that is not UTF-8 is a GGMLValueError naming it (no traceback)."""
    from ggmlpy import GGMLValueError

    with open(path, "rb") as f:
        data = f.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise GGMLValueError(f"{option} {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


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


def _cmd_run(args: argparse.Namespace) -> int:
    if args.prompt is None and args.file is None:
        print("ggmlpy run: error: a prompt is needed: -p PROMPT or -f FILE ('-' for stdin)", file=sys.stderr)
        return 2
    if args.system is not None and not args.chat:
        print("ggmlpy run: error: --system is for --chat", file=sys.stderr)
        return 2
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
    model, rt = _open_runner(args)
    try:
        kw = dict(max_tokens=args.n_predict, sampling=_sampling(args), stop=tuple(args.stop or ()), shift=False)
        if args.chat:
            _check_chat_template(rt, template)
            messages = ([{"role": "system", "content": args.system}] if args.system is not None else []) + \
                [{"role": "user", "content": prompt}]
            handle = rt.submit_chat(messages, template=template, **kw)
        else:
            handle = rt.submit(prompt, parse_special=not args.no_parse_special, **kw)
        finished = _stream(handle, out)
        r = handle.result()
        out.write("\n")
        out.flush()
        print(_stats_line(r), file=sys.stderr)
        return 0 if finished else 130
    finally:
        rt.close()
        model.close()


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
    try:
        handle = rt.submit(ids, detokenize=True, max_tokens=args.n_predict, sampling=_sampling(args),
                           stop=tuple(args.stop or ()), shift=False)
        if not _stream(handle, out):
            return None
        r = handle.result()
    except KeyboardInterrupt:               # Ctrl-C just before or after the stream: a cancel too
        if handle is not None:
            _cancel(handle)
        return None
    if args.verbose:
        print(_stats_line(r), file=sys.stderr)
    return r


def chat_repl(rt, args: argparse.Namespace, history: list, template: Optional[str] = None, out=None,
              read=input) -> int:
    """``ggmlpy chat``'s loop over a started runner: read a line, answer it, until ``/bye`` or Ctrl-D.

    ``history`` (a list of messages, the system prompt first if any) grows by each user message and
    each finished reply. Ctrl-C during a reply cancels it and returns to the prompt: as Ollama does,
    the user's message stays in the history and the partial reply is dropped. Ctrl-C at the prompt
    prints how to exit. An error in one turn (the template failed, the message alone is longer than
    the context) is printed and the message dropped; the chat goes on. Returns the exit status (0).
    """
    from ggmlpy import GGMLError

    out = sys.stdout if out is None else out
    system = [m for m in history[:1] if m.get("role") == "system"]
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
            cmd = text.split()[0]
            if cmd in ("/bye", "/exit"):
                return 0
            if cmd == "/clear":
                history[:] = system
                out.write("Cleared session context\n")
            elif cmd in ("/?", "/help"):
                out.write(_CHAT_HELP + "\n")
            else:
                out.write(f"Unknown command '{cmd}'. Type /? for help\n")
            out.flush()
            continue
        history.append({"role": "user", "content": line})
        try:
            r = _chat_turn(rt, history, args, template, out)
        except GGMLError as e:
            from ggmlpy.benchmark import _one_line

            history.pop()
            out.write("\n")
            out.flush()
            print(f"error: {_one_line(e)}", file=sys.stderr)
            continue
        if r is not None:
            history.append({"role": "assistant", "content": r.text})
        out.write("\n\n" if r is not None else "\n")
        out.flush()


def _cmd_chat(args: argparse.Namespace) -> int:
    """The interactive chat (see :func:`chat_repl` and ``_CHAT_HELP``)."""
    template = _template(args)
    _lenient(sys.stdout)
    _lenient(sys.stdin)
    model, rt = _open_runner(args)
    try:
        _check_chat_template(rt, template)
        history = [{"role": "system", "content": args.system}] if args.system is not None else []
        return chat_repl(rt, args, history, template)
    finally:
        rt.close()
        model.close()


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", required=True, help="GGUF model file")
    # the defaults are ggmlpy.defaults' table, the API's own
    p.add_argument("-n", "--n-predict", type=int, default=CLI_N_PREDICT,
                   help="tokens to generate at most (default -1: until end of generation or the context is full)")
    p.add_argument("-c", "--ctx-size", type=int, default=0,
                   help=f"context size (default 0: the model's training context, at most {DEFAULTS['n_ctx']})")
    p.add_argument("-b", "--batch-size", type=int, default=DEFAULTS["n_batch"],
                   help="prompt tokens per batch (default %(default)s)")
    p.add_argument("-t", "--threads", type=int, default=0, help="CPU threads (default: all cores)")
    p.add_argument("-ngl", "--n-gpu-layers", type=int, default=DEFAULTS["n_gpu_layers"],
                   help="layers on accelerators (default -1: all, when there is one)")
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
    p.add_argument("--temp", type=float, default=DEFAULTS["temperature"],
                   help="temperature (default %(default)s; 0: greedy)")
    p.add_argument("--top-k", type=int, default=DEFAULTS["top_k"], help="top-k sampling (default %(default)s; 0: off)")
    p.add_argument("--top-p", type=float, default=DEFAULTS["top_p"],
                   help="top-p sampling (default %(default)s; 1: off)")
    p.add_argument("--min-p", type=float, default=DEFAULTS["min_p"],
                   help="min-p sampling (default %(default)s; 0: off)")
    p.add_argument("-s", "--seed", type=int, default=DEFAULTS["seed"], help="sampling seed (default: random)")
    p.add_argument("--stop", action="append", metavar="STR",
                   help="stop string (repeatable): the text ends before it")
    p.add_argument("--system", default=None, help="system prompt (run: with --chat)")
    p.add_argument("--chat-template-file", default=None, metavar="FILE",
                   help="Jinja chat template to use instead of the model's")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ggmlpy", description="ggml from Python: info, benchmarks, text "
                                 "generation and chat, RPC server")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="versions, CPU features, compiled backends and devices")
    p.add_argument("--json", action="store_true", help="print as JSON")
    p.set_defaults(func=_cmd_info)
    p = sub.add_parser("bench", add_help=False,
                       help="prompt/generation (and image encoding) throughput, llama-bench compatible "
                            "(ggmlpy bench -h)")
    p.add_argument("bench_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd_bench)
    p = sub.add_parser("run", help="complete a prompt, printing the text as it is generated, then the speed")
    p.add_argument("-p", "--prompt", default=None, help="the prompt")
    p.add_argument("-f", "--file", default=None, help="read the prompt from FILE ('-': stdin)")
    p.add_argument("--chat", action="store_true", help="send the prompt as one user message through the chat "
                   "template")
    p.add_argument("--no-parse-special", action="store_true",
                   help="read special-token texts in the prompt (<|im_start|>) as plain text")
    _add_model_args(p)
    p.set_defaults(func=_cmd_run)
    p = sub.add_parser("chat", help="interactive chat in the terminal (/? for commands, Ctrl-D to exit)")
    p.add_argument("--verbose", action="store_true", help="print the speed after each reply")
    _add_model_args(p)
    p.set_defaults(func=_cmd_chat)
    p = sub.add_parser("rpc-server", help="serve this machine's devices to ggml RPC clients")
    p.add_argument("--host", default="127.0.0.1", help="IPv4 address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=50052, help="TCP port (default 50052)")
    p.add_argument("--threads", "-t", type=int, default=0, help="CPU threads (default: all cores)")
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


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        # bench has llama-bench's own option syntax (-ngl, -pg, comma lists): hand it over whole.
        return _cmd_bench(argparse.Namespace(bench_args=argv[1:]))
    args = build_parser().parse_args(argv)
    from ggmlpy import GGMLError

    try:
        return args.func(args)
    except (GGMLError, OSError, MemoryError) as e:
        # one clear line for what a user can cause; GGMLPY_DEBUG=1 shows the traceback
        from ggmlpy.benchmark import _debug, _one_line

        if _debug():
            traceback.print_exc()
        print(f"ggmlpy {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:           # Ctrl-C while loading a model, say: no traceback
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
