"""The ``ggmlpy`` command: ``ggmlpy info`` (more subcommands arrive with the runtime layers)."""

from __future__ import annotations

import argparse
import json
import sys


def _cmd_info(args: argparse.Namespace) -> int:
    from ggmlpy._system import format_system_info, system_info

    info = system_info()
    print(json.dumps(info, indent=2) if args.json else format_system_info(info))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ggmlpy", description="ggml from Python: info, benchmarks, RPC server")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="versions, CPU features, compiled backends and devices")
    p.add_argument("--json", action="store_true", help="print as JSON")
    p.set_defaults(func=_cmd_info)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
