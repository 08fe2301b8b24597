"""The ``ggmlpy serve`` process: uvicorn serving :func:`~.app.create_app`, the model loaded in a thread
once the socket listens, and a graceful stop on SIGTERM or Ctrl-C.

The stop: new requests get 503 at once, running ones continue for ``--shutdown-grace`` seconds, then
each still running is cancelled and ends with a reason (a stream gets an error event before
``[DONE]``, a waiting request a 503), then uvicorn closes the connections and the runner is closed.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import threading
from typing import Callable, Optional

from . import require
from .flags import is_loopback
from .state import ServerState

__all__ = ["serve"]


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, told when it listens (to start the load) and when a stop is asked."""

        def __init__(self, config, state: ServerState, loader: Callable, grace: float, say: Callable) -> None:
            super().__init__(config)
            self.state, self.loader, self.grace, self.say = state, loader, grace, say
            self._stopping = False

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.should_exit:             # the port was taken: uvicorn said why
                return
            port = self.config.port
            for server in getattr(self, "servers", ()):
                for sock in server.sockets:
                    port = sock.getsockname()[1]
                    break
            self.say(f"listening on http://{self.config.host}:{port} (model {self.state.model_name})")
            if self.state.runner is None and self.loader is not None:
                self.state.start_loading(self.loader, on_fail=self._load_failed)

        def _load_failed(self) -> None:
            self.should_exit = True

        def handle_exit(self, sig, frame) -> None:
            if not self._stopping:
                self._stopping = True
                self.state.status = "stopping" if self.state.status != "error" else "error"
                self.say(f"stopping: running requests have {self.grace:g} s to finish")
                timer = threading.Timer(self.grace, self.state.cancel_all)
                timer.daemon = True
                timer.start()
            # uvicorn's own handler also re-raises the signal after the stop (the process would die of
            # SIGTERM); a stop that finished gracefully exits 0, as llama-server's does
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True

    return Server


def serve(args: argparse.Namespace, loader: Callable, prog: str = "ggmlpy serve",
          template: Optional[str] = None) -> int:
    """Serve until stopped; returns the exit status.

    Parameters
    ----------
    args : argparse.Namespace
        The parsed command line (:func:`~.flags.add_server_args`'s flags, ``-c``, ``-m``/``-hf``).
    loader : callable
        ``loader(progress) -> (model, runner)``: loads the model and starts the runner (called in a
        thread once the socket listens; ``progress(done, total)`` as :func:`ggmlpy.load_model` calls it).
    template : str, optional
        The chat template to use instead of the model's (``--chat-template-file``).
    """
    require()
    import uvicorn

    from .app import create_app

    def say(text: str) -> None:
        print(f"{prog}: {text}", file=sys.stderr, flush=True)

    from ggmlpy.hub import is_hub_ref

    if args.model is not None and not is_hub_ref(args.model):
        # a local file is checked before the socket listens (a missing -m is an error at once, as `run`'s); a
        # hub reference is resolved by the loader, under /health's loading status
        from ggmlpy._cliargs import model_source

        model_source(args, False, say)
    if not is_loopback(args.host) and not args.api_key:
        say(f"warning: listening on {args.host} without --api-key: anyone who can reach this address can use "
            f"the model")
    name = args.alias or _default_name(args)
    state = ServerState(args.model or "", model_name=name, n_parallel=args.parallel, n_ctx=args.ctx_size,
                        api_key=args.api_key, slot_save_path=args.slot_save_path, max_queue=args.max_queue,
                        timeout=args.timeout, max_body=args.max_body << 20, template=template,
                        n_predict=args.n_predict, stop=tuple(args.stop or ()))
    import logging

    from .bridge import DroppedStreamFilter

    # a stream dropped on purpose (its client took nothing for --timeout) is logged as such, not as uvicorn's error
    logging.getLogger("uvicorn.error").addFilter(DroppedStreamFilter())
    config = uvicorn.Config(create_app(state), host=args.host, port=args.port, log_level="warning",
                            access_log=False, lifespan="off", timeout_graceful_shutdown=args.shutdown_grace + 5,
                            server_header=False)
    server = _server_class()(config, state, loader, args.shutdown_grace, say)
    try:
        asyncio.run(server.serve())
    finally:
        state.close()
    if state.status == "error":
        say(f"error: {state.error}")
        return 1
    return 0 if server.started else 1


def _default_name(args: argparse.Namespace) -> str:
    from pathlib import Path

    if args.model:
        return Path(args.model).name.removesuffix(".gguf") or args.model
    return args.hf_repo or "model"
