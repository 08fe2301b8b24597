"""``ggmlpy serve``: an HTTP server over one :class:`~ggmlpy.runner.Runner`, speaking OpenAI's and Ollama's APIs
and llama-server's extra routes.

An ASGI application (Starlette) served by uvicorn, installed with ``pip install ggmlpy[server]``. One
job per module:

* :mod:`.state`: :class:`~.state.ServerState`, what every route reads: the runner (None while the model
  loads), the model's name, the limits, the counters;
* :mod:`.errors`: :class:`~.errors.ApiError` and the error bodies (OpenAI's, or Ollama's for its routes);
* :mod:`.app`: :func:`~.app.create_app`: the routes of each API module, the API key, the body limit,
  request logging;
* :mod:`.requests_map`: OpenAI's request JSON checked and turned into the runner's keywords, and a
  :class:`~ggmlpy.runner.Completion` turned into OpenAI's response JSON and SSE chunks;
* :mod:`.bridge`: a runner request seen from the event loop: its events as an async iterator, cancelled
  when the client goes away or the server stops, streamed with back-pressure as SSE or NDJSON; the one path
  (:func:`~.bridge.answer`) both APIs' generating routes take;
* :mod:`.openai_routes`: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``, ``/v1/models``;
* :mod:`.rerank_routes`: llama-server's ``/v1/rerank`` (and ``/rerank``), Jina's and TEI's shapes, for a
  reranker;
* :mod:`.ollama` and :mod:`.ollama_routes`: Ollama's JSON mapped to the runner's keywords and back, and its
  ``/api/...`` routes;
* :mod:`.extras` and :mod:`.extras_routes`: llama-server's ``/slots``, ``/tokenize``, ``/metrics``, ``/props``...;
* :mod:`.flags`: the command line's server flags;
* :mod:`.run`: the process: uvicorn, the model loaded in a thread once the socket listens, SIGTERM.

Nothing here imports Starlette or uvicorn at import time except :mod:`.app`, the route modules and
:mod:`.run`; :func:`require` names the extra to install when they are missing.
"""

from __future__ import annotations

__all__ = ["require"]


def require() -> None:
    """Import Starlette and uvicorn, or raise ImportError saying how to install them."""
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ImportError(f"ggmlpy serve needs Starlette and uvicorn ({e}): pip install 'ggmlpy[server]'") from None
