"""The server's one exception type, :class:`ApiError`, and the error bodies it becomes.

OpenAI's shape is ``{"error": {"message", "type", "param", "code"}}`` (what the ``openai`` client reads
into its exception's ``.message``, ``.type``, ``.param``, ``.code``); Ollama's routes answer
``{"error": "<message>"}``. The ``type`` names are llama-server's (``invalid_request_error``,
``authentication_error``, ``not_found_error``, ``exceed_context_size_error``, ``unavailable_error``,
``server_error``), each with its HTTP status.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["ApiError", "bad_request", "error_body"]

#: the default error type of each status
TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
         405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
         415: "invalid_request_error", 422: "invalid_request_error", 500: "server_error", 501: "not_supported_error",
         503: "unavailable_error"}


class ApiError(Exception):
    """An HTTP error answered in OpenAI's shape (or Ollama's, with ``ollama=True``).

    Parameters
    ----------
    status : int
        The HTTP status (400 a bad request, 401 no or a wrong API key, 404 an unknown model or route, 413
        a body or prompt too large, 503 loading or the queue full).
    message : str
        What went wrong, for the client: names the field where one is at fault.
    type : str, optional
        OpenAI's error type (default: the status's, :data:`TYPES`).
    param : str, optional
        The request field at fault.
    code : str or int, optional
        A machine-readable code (``model_not_found``, ``context_length_exceeded``).
    headers : dict, optional
        Extra response headers (``Retry-After``).
    ollama : bool
        Answer ``{"error": message}`` (Ollama's routes).
    """

    def __init__(self, status: int, message: str, type: Optional[str] = None, param: Optional[str] = None,
                 code=None, headers: Optional[dict] = None, ollama: bool = False) -> None:
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.type = type or TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        self.param = param
        self.code = code
        self.headers = dict(headers or {})
        self.ollama = ollama

    def body(self, ollama: Optional[bool] = None) -> dict:
        """The JSON body: OpenAI's shape, or Ollama's when ``ollama`` (default: the error's own flag)."""
        if self.ollama if ollama is None else ollama:
            return {"error": self.message}
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: Optional[str] = None, code=None) -> dict:
    """OpenAI's error object (also sent as an SSE event when a stream fails after it began)."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: Optional[str] = None) -> ApiError:
    """A 400 ``invalid_request_error`` naming ``param``."""
    return ApiError(400, message, param=param)
