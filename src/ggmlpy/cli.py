"""The ``ggmlpy`` command: ``ggmlpy info``, ``ggmlpy bench`` and ``ggmlpy rpc-server``."""

from __future__ import annotations

import argparse
import json
import sys
import traceback


def _cmd_info(args: argparse.Namespace) -> int:
    from ggmlpy._system import format_system_info, system_info

    info = system_info()
    print(json.dumps(info, indent=2) if args.json else format_system_info(info))
    return 0


def _cmd_rpc_server(args: argparse.Namespace) -> int:
    from ggmlpy import _core

    devs = [_core.device(name) for name in args.device] if args.device else None
    endpoint = f"{args.host}:{args.port}"
    names = ", ".join(d.name for d in devs) if devs else "CPU"
    print(f"ggmlpy rpc-server: serving {names} at {endpoint} (Ctrl-C to stop)", flush=True)
    try:
        _core.rpc_start_server(endpoint, devs, args.cache_dir, args.threads)
    except (OSError, ValueError) as e:
        print(f"ggmlpy rpc-server: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    return 1


def _cmd_bench(args: argparse.Namespace) -> int:
    from ggmlpy import benchmark

    return benchmark.main(args.bench_args, prog="ggmlpy bench")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ggmlpy", description="ggml from Python: info, benchmarks, RPC server")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="versions, CPU features, compiled backends and devices")
    p.add_argument("--json", action="store_true", help="print as JSON")
    p.set_defaults(func=_cmd_info)
    p = sub.add_parser("bench", add_help=False,
                       help="prompt/generation throughput, llama-bench compatible (ggmlpy bench -h)")
    p.add_argument("bench_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd_bench)
    p = sub.add_parser("rpc-server", help="serve this machine's devices to ggml RPC clients")
    p.add_argument("--host", default="127.0.0.1", help="IPv4 address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=50052, help="TCP port (default 50052)")
    p.add_argument("--threads", "-t", type=int, default=0, help="CPU threads (default: all cores)")
    p.add_argument("--device", "-d", action="append", help="device to serve (repeatable; default CPU)")
    p.add_argument("--cache-dir", default=None, help="cache tensors received by hash in this folder")
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


if __name__ == "__main__":
    sys.exit(main())
