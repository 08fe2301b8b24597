"""``ggmlpy serve``'s own flags (llama-server's names), added to the model flags ``run`` and ``chat`` share.

Imports nothing heavy: ``ggmlpy --help`` builds every subcommand's parser.
"""

from __future__ import annotations

import argparse
import ipaddress

from ggmlpy._cliargs import UsageError, at_least
from ggmlpy.defaults import CLI_N_PREDICT

__all__ = ["add_server_args", "check_server_args", "is_loopback"]


def add_server_args(p: argparse.ArgumentParser) -> None:
    """``-n`` and ``--stop`` (every request's defaults), ``--host``, ``--port``, ``-np``, ``--api-key``,
    ``--slot-save-path``, ``--alias``, ``--timeout``..."""
    r = p.add_argument_group("request defaults (llama-server's: a request's own field wins)")
    r.add_argument("-n", "--n-predict", type=int, default=CLI_N_PREDICT,
                   help="the max_tokens of a request that sets none, as llama-server's -n (default -1: until the end "
                        "of generation or a full context)")
    r.add_argument("--stop", action="append", metavar="STR",
                   help="the stop strings of a request that gives none, as llama-server's -r (repeatable)")
    g = p.add_argument_group("server (llama-server's flags)")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1, this machine only; another address without "
                        "--api-key is warned about)")
    g.add_argument("--port", type=int, default=8080, help="TCP port (default 8080; 0: any free port)")
    g.add_argument("-np", "--parallel", type=int, default=1, metavar="N",
                   help="requests served at once, each in its own slot of -c tokens (default 1); more wait in "
                        "a queue")
    g.add_argument("--max-queue", type=int, default=None, metavar="N",
                   help="requests waiting for a slot beyond which the server answers 503 (default 4*np+16)")
    g.add_argument("--api-key", default=None, metavar="KEY",
                   help="require this key (Authorization: Bearer KEY, or x-api-key); /health stays public")
    g.add_argument("--slot-save-path", default=None, metavar="DIR", help="folder of saved slot states")
    g.add_argument("--alias", default=None, metavar="NAME",
                   help="the model's name in /v1/models and requests (default: the file's stem)")
    g.add_argument("-to", "--timeout", type=float, default=600.0, metavar="SECONDS",
                   help="socket timeout, as llama-server's: a request body that stops arriving for this long is "
                        "answered 408, a client that accepts no bytes of a stream for this long is dropped and its "
                        "request cancelled (default 600; 0: never)")
    g.add_argument("--shutdown-grace", type=float, default=10.0, metavar="SECONDS",
                   help="on SIGTERM, let running requests finish this long, then end them (default 10)")
    g.add_argument("--max-body", type=int, default=64, metavar="MiB",
                   help="the largest request body (default 64 MiB; images come base64 in the body)")


def check_server_args(args: argparse.Namespace) -> None:
    """The server flags' values, before anything loads (:class:`UsageError` naming the flag)."""
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port {args.port}: must be 0..65535")
    for flag, value, lo in (("-np", args.parallel, 1), ("--max-body", args.max_body, 1)):
        msg = at_least(flag, value, lo)
        if msg:
            raise UsageError(msg)
    if args.parallel > 256:
        raise UsageError(f"-np {args.parallel}: at most 256")
    if args.max_queue is not None and args.max_queue < 0:
        raise UsageError(f"--max-queue {args.max_queue}: must be at least 0")
    for flag, value in (("--timeout", args.timeout), ("--shutdown-grace", args.shutdown_grace)):
        if not value >= 0 or value == float("inf"):
            raise UsageError(f"{flag} {value}: must be a finite number of seconds >= 0")
    stops = args.stop or []
    if any(not s for s in stops):
        raise UsageError("--stop: a stop string is empty")
    if len(stops) > 16:                           # requests_map.MAX_STOP, a request's bound
        raise UsageError(f"--stop: at most 16 stop strings, got {len(stops)}")
    if args.api_key is not None and not args.api_key.strip():
        raise UsageError("--api-key: empty")
    if args.alias is not None and not args.alias.strip():
        raise UsageError("--alias: empty")


def is_loopback(host: str) -> bool:
    """Whether ``host`` only listens on this machine (127.0.0.0/8, ::1, localhost)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
