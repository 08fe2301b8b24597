"""OpenAI's API: ``/v1/models`` (this file's skeleton; the generation routes follow)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from .state import ServerState

__all__ = ["ROUTES"]


def model_card(state: ServerState) -> dict:
    """The one model, as OpenAI's ``Model`` object (llama-server adds ``meta``)."""
    meta = {"n_ctx": state.n_ctx, "n_parallel": state.n_parallel, "status": state.status}
    return {"id": state.model_name, "object": "model", "created": int(state.started), "owned_by": "ggmlpy",
            "meta": meta}


async def models(request: Request) -> JSONResponse:
    state: ServerState = request.app.state.server
    return JSONResponse({"object": "list", "data": [model_card(state)]})


ROUTES = [Route("/v1/models", models, methods=["GET"]), Route("/models", models, methods=["GET"])]
