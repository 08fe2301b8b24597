"""OpenAI's request JSON, checked and turned into :class:`~ggmlpy.runner.Runner` keywords.

Every field is checked for its type and range before anything runs, and a mistake is a 400 naming the
field (``param``). The policy on fields:

* **unknown fields are ignored**, as OpenAI's API ignores them (clients send vendor extensions);
* **known fields this server cannot honour are refused** (``suffix``, ``best_of`` > 1, audio output,
  the legacy ``functions``), never silently dropped, since ignoring them would change the answer;
* llama-server's extensions are taken under its names: every sampler of llama.cpp's chain (``top_k``,
  ``min_p``, ``repeat_penalty``, ``dry_*``, ``xtc_*``, ``mirostat*``, ``samplers``...), ``n_predict``,
  ``grammar``, ``json_schema``, ``chat_template_kwargs``.

:data:`SAMPLING_FIELDS` and :func:`sampling_kwargs` are shared with the Ollama routes (its ``options``
use the same names for the samplers both have). :mod:`.responses` builds the answers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

from .errors import ApiError, bad_request
from .state import ServerState

__all__ = ["MAX_N", "MAX_STOP", "MAX_TOP_LOGPROBS", "SAMPLING_FIELDS", "chat_request", "check_images",
           "check_model", "completion_request", "embedding_request", "parse_json", "runner_error", "sampling_kwargs"]

#: the most choices one request may ask for (``n``)
MAX_N = 16
#: the most stop strings
MAX_STOP = 16
#: the most alternatives per token (OpenAI's bound)
MAX_TOP_LOGPROBS = 20
#: the most embedding inputs in one request (OpenAI's bound)
MAX_INPUTS = 2048

_INT, _NUM, _BOOL, _STR = "integer", "number", "boolean", "string"

#: The samplers a request may set, by their llama-server (and SamplingParams) name: (kind, low, high).
#: The runner checks the finer rules (SamplingParams); these bounds keep nonsense out first.
SAMPLING_FIELDS: dict[str, tuple] = {
    "temperature": (_NUM, 0.0, None), "top_k": (_INT, 0, None), "top_p": (_NUM, 0.0, 1.0),
    "min_p": (_NUM, 0.0, 1.0), "typical_p": (_NUM, 0.0, 1.0), "top_n_sigma": (_NUM, None, None),
    "min_keep": (_INT, 0, None), "repeat_penalty": (_NUM, 0.0, None), "repeat_last_n": (_INT, -1, None),
    "frequency_penalty": (_NUM, -2.0, 2.0), "presence_penalty": (_NUM, -2.0, 2.0),
    "xtc_probability": (_NUM, 0.0, 1.0), "xtc_threshold": (_NUM, 0.0, 1.0), "dry_multiplier": (_NUM, 0.0, None),
    "dry_base": (_NUM, 0.0, None), "dry_allowed_length": (_INT, 0, None), "dry_penalty_last_n": (_INT, -1, None),
    "mirostat": (_INT, 0, 2), "mirostat_tau": (_NUM, 0.0, None), "mirostat_eta": (_NUM, 0.0, None),
    "dynatemp_range": (_NUM, 0.0, None), "dynatemp_exponent": (_NUM, 0.0, None),
}

#: fields OpenAI defines that this server refuses rather than ignores: field -> why
_REFUSED = {"functions": "the legacy functions field: send tools", "function_call": "the legacy function_call "
            "field: send tool_choice", "audio": "audio output is not supported"}


def parse_json(body: bytes, ollama: bool = False) -> dict:
    """A request body as a JSON object (400 for anything else: empty, not UTF-8, malformed or nested past
    the parser's depth, not an object), in OpenAI's error shape or Ollama's."""
    def bad(msg: str) -> ApiError:
        return ApiError(400, msg, ollama=True) if ollama else bad_request(msg)

    if not body:
        raise bad("the request body is empty: expected a JSON object")
    try:
        value = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError:
        raise bad("the request body is not UTF-8 text") from None
    except (ValueError, RecursionError) as e:
        raise bad(f"malformed JSON in the request body: {str(e)[:200]}") from None
    if not isinstance(value, dict):
        raise bad(f"the request body must be a JSON object, got {_kind(value)}")
    return value


async def json_body(request, ollama: bool = False) -> dict:
    """The routes' body as a JSON object (:func:`parse_json`); an empty body is ``{}`` (a GET-like call)."""
    raw = await request.body()
    return {} if not raw.strip() else parse_json(raw, ollama)


def state_of(request) -> ServerState:
    """The server's state, as :func:`~ggmlpy.server.app.create_app` put it on the app."""
    return request.app.state.server


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _field(body: dict, name: str, kind: str, default=None, lo=None, hi=None, param: Optional[str] = None):
    """``body[name]`` checked to be of ``kind`` (integer, number, boolean, string) within ``[lo, hi]``;
    absent or null: ``default``."""
    value = body.get(name)
    param = param or name
    if value is None:
        return default
    if kind == _BOOL:
        if not isinstance(value, bool):
            raise bad_request(f"{param} must be a boolean, got {_kind(value)}", param)
        return value
    if kind == _STR:
        if not isinstance(value, str):
            raise bad_request(f"{param} must be a string, got {_kind(value)}", param)
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(f"{param} must be {'an integer' if kind == _INT else 'a number'}, got {_kind(value)}", param)
    if kind == _INT:
        if isinstance(value, float):
            if not value.is_integer():
                raise bad_request(f"{param} must be an integer, got {value!r}", param)
            value = int(value)
    elif not math.isfinite(value):
        raise bad_request(f"{param} must be finite, got {value!r}", param)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f"at least {lo}" if hi is None else f"at most {hi}" if lo is None else f"in [{lo}, {hi}]"
        raise bad_request(f"{param} must be {bounds}, got {value!r}", param)
    return value


def check_model(state: ServerState, body: dict, required: bool = False, ollama: bool = False) -> None:
    """The request's ``model`` names this server's model (its alias, its file name or stem): else 404."""
    name = body.get("model")
    if name is None and not required:
        return
    if not isinstance(name, str):
        raise ApiError(400, f"model must be a string, got {_kind(name)}", param="model", ollama=ollama)
    known = {state.model_name}
    if state.path:
        p = Path(state.path)
        known |= {p.name, p.stem, state.path}
    if name not in known:
        raise ApiError(404, f"the model {name[:200]!r} does not exist: this server serves {state.model_name!r}",
                       param="model", code="model_not_found", ollama=ollama)


def sampling_kwargs(body: dict, prefix: str = "") -> dict:
    """The sampling keywords of the runner from ``body``'s fields (only those given; ``prefix`` is put
    before each name in error messages, e.g. ``options.``)."""
    kw: dict = {}
    for name, (kind, lo, hi) in SAMPLING_FIELDS.items():
        value = _field(body, name, kind, None, lo, hi, param=prefix + name)
        if value is not None:
            kw[name] = value
    seed = _field(body, "seed", _INT, None, param=prefix + "seed")
    if seed is not None:
        if seed < -1 or seed >= 1 << 64:
            raise bad_request(f"{prefix}seed must be in [0, 2**64) (-1: a random seed), got {seed}", prefix + "seed")
        if seed >= 0:
            kw["seed"] = seed
    bias = body.get("logit_bias")
    if bias is not None:
        kw["logit_bias"] = _logit_bias(bias, prefix + "logit_bias")
    breakers = body.get("dry_sequence_breakers")
    if breakers is not None:
        from ggmlpy.sampling.params import MAX_BREAKERS

        if not isinstance(breakers, list) or len(breakers) > MAX_BREAKERS or \
                not all(isinstance(b, str) and b for b in breakers):
            raise bad_request(f"{prefix}dry_sequence_breakers must be an array of at most {MAX_BREAKERS} non-empty "
                              "strings (each cut to its first 40 bytes, as llama.cpp does)",
                              prefix + "dry_sequence_breakers")
        kw["dry_sequence_breakers"] = tuple(breakers)
    samplers = body.get("samplers")
    if samplers is not None:
        from ggmlpy.sampling.params import parse_samplers

        if not isinstance(samplers, (list, str)) or (isinstance(samplers, list) and
                                                     not all(isinstance(s, str) for s in samplers)):
            raise bad_request(f"{prefix}samplers must be an array of sampler names or a ';'-separated string",
                              prefix + "samplers")
        try:
            kw["samplers"] = parse_samplers(samplers)
        except ValueError as e:
            raise bad_request(f"{prefix}{e}", prefix + "samplers") from None
    return kw


def _logit_bias(value: Any, param: str) -> dict:
    """OpenAI's ``{"<token id>": bias}`` (or llama-server's ``[[id, bias], ...]``); ``false`` bans."""
    items = value.items() if isinstance(value, dict) else value if isinstance(value, list) else None
    if items is None or len(value) > 1024:
        raise bad_request(f"{param} must be an object of token ids to biases (at most 1024)", param)
    out: dict = {}
    for item in items:
        if not (isinstance(item, (list, tuple)) and len(item) == 2):
            raise bad_request(f"{param}: each entry is a [token id, bias] pair", param)
        tok, bias = item
        try:
            tok = int(tok) if not isinstance(tok, bool) else None
        except (TypeError, ValueError):
            tok = None
        if tok is None or tok < 0:
            raise bad_request(f"{param}: keys are token ids (integers >= 0), got {str(item[0])[:40]!r}", param)
        if bias is False:
            bias = float("-inf")
        elif isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise bad_request(f"{param}[{tok}] must be a finite number (or false: banned)", param)
        out[tok] = float(bias)
    return out


def _stop(state: ServerState, body: dict) -> list:
    """``stop``: a string or a list of them; none (or an empty list) takes the server's ``--stop`` (llama-server's
    ``-r``)."""
    stop = body.get("stop")
    if stop is None or stop == []:
        return list(state.stop)
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request(f"stop must be a string or an array of strings, got {_kind(stop)}", "stop")
    if len(stops) > MAX_STOP:
        raise bad_request(f"stop: at most {MAX_STOP} stop strings, got {len(stops)}", "stop")
    if any(not s for s in stops):
        raise bad_request("stop: a stop string is empty", "stop")
    return stops


def _max_tokens(state: ServerState, body: dict) -> int:
    """``max_completion_tokens``, ``max_tokens`` or ``n_predict``: at least 1 and at most the context; -1 or
    absent: the server's ``-n`` (as llama-server), by default -1, until the end of generation or a full context."""
    for name in ("max_completion_tokens", "max_tokens", "n_predict"):
        if body.get(name) is not None:
            n = _field(body, name, _INT, None, -1)
            if n == 0:
                raise bad_request(f"{name} must be at least 1 (or -1: no bound), got 0", name)
            if state.n_ctx and n > state.n_ctx:
                raise bad_request(f"{name} {n} is more than the context ({state.n_ctx} tokens per request)", name)
            return n if n > 0 else state.n_predict
    return state.n_predict


def _common(state: ServerState, body: dict, chat: bool) -> dict:
    """The keywords chat and completions share, and the request's own settings (``n``, ``stream``...)."""
    for name, why in _REFUSED.items():
        if body.get(name) is not None:
            raise bad_request(f"{name}: {why}", name)
    check_model(state, body)
    n = _field(body, "n", _INT, 1, 1, MAX_N)
    stream = _field(body, "stream", _BOOL, False)
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad_request(f"stream_options must be an object, got {_kind(opts)}", "stream_options")
    include_usage = bool(_field(opts or {}, "include_usage", _BOOL, False, param="stream_options.include_usage"))
    kw = sampling_kwargs(body)
    kw["max_tokens"] = _max_tokens(state, body)
    kw["stop"] = _stop(state, body)
    if chat:
        want = _field(body, "logprobs", _BOOL, False)
        top = _field(body, "top_logprobs", _INT, None, 0, MAX_TOP_LOGPROBS)
        if top is not None and not want:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    else:
        top = _field(body, "logprobs", _INT, None, 0, MAX_TOP_LOGPROBS)
        want = top is not None
    if want:
        kw["logprobs"] = True
        kw["top_logprobs"] = top or 0
    grammar = _field(body, "grammar", _STR)
    if grammar:
        kw["grammar"] = grammar
    schema = body.get("json_schema")
    if schema is not None:
        if not isinstance(schema, (dict, bool)):
            raise bad_request(f"json_schema must be a JSON schema object, got {_kind(schema)}", "json_schema")
        kw["json_schema"] = schema
    return {"kw": kw, "n": n, "stream": stream, "include_usage": include_usage, "logprobs": want}


def chat_request(state: ServerState, body: dict) -> dict:
    """``/v1/chat/completions``: ``{"messages", "kw" (submit_chat's keywords), "n", "stream",
    "include_usage", "logprobs"}``."""
    req = _common(state, body, chat=True)
    kw = req["kw"]
    req["messages"], req["images"] = _messages(body.get("messages"))
    tools = body.get("tools")
    if tools is not None:
        kw["tools"] = _tools(tools)
    choice = body.get("tool_choice")
    if choice is not None:
        if isinstance(choice, str):
            if choice not in ("none", "auto", "required"):
                raise bad_request(f"tool_choice must be none, auto, required or a function, got {choice[:40]!r}",
                                  "tool_choice")
        elif not (isinstance(choice, dict) and isinstance(choice.get("function"), dict)
                  and isinstance(choice["function"].get("name"), str)):
            raise bad_request('tool_choice must be a string or {"type": "function", "function": {"name": ...}}',
                              "tool_choice")
        if choice != "none" and choice != "auto" and not tools:
            raise bad_request("tool_choice asks for a tool call and no tools are given", "tool_choice")
        kw["tool_choice"] = choice
    _field(body, "parallel_tool_calls", _BOOL)
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            raise bad_request("response_format must be {\"type\": \"text\" | \"json_object\" | \"json_schema\"}",
                              "response_format")
        if fmt["type"] == "json_schema" and not (isinstance(fmt.get("json_schema"), dict)
                                                 and isinstance(fmt["json_schema"].get("schema", {}), (dict, bool))):
            raise bad_request('response_format: json_schema needs {"json_schema": {"name": ..., "schema": {...}}}',
                              "response_format")
        if fmt["type"] != "text":
            kw["response_format"] = fmt
    targs = body.get("chat_template_kwargs")
    if targs is not None:
        if not isinstance(targs, dict):
            raise bad_request(f"chat_template_kwargs must be an object, got {_kind(targs)}", "chat_template_kwargs")
        kw["template_kwargs"] = targs
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise bad_request("modalities: only [\"text\"] output is supported", "modalities")
    return req


_ROLES = ("system", "developer", "user", "assistant", "tool")


def _messages(value: Any) -> tuple[list, list]:
    """OpenAI's messages as the chat template takes them: ``developer`` read as ``system``, text parts
    joined (with a newline, as llama.cpp joins them) unless the message holds images, a tool call's
    arguments parsed from their JSON text; and where each image part is (``messages[i].content[j]``)."""
    if not isinstance(value, list) or not value:
        raise bad_request("messages must be a non-empty array of messages", "messages")
    out: list = []
    images: list = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where} must be an object, got {_kind(m)}", where)
        role = m.get("role")
        if role not in _ROLES:
            raise bad_request(f"{where}.role must be one of {', '.join(_ROLES)}, got {str(role)[:40]!r}",
                              where + ".role")
        msg = {"role": "system" if role == "developer" else role}
        content = m.get("content")
        if content is None:
            if role != "assistant" or not m.get("tool_calls"):
                raise bad_request(f"{where}.content is missing", where + ".content")
            content = ""
        msg["content"] = _content(content, where + ".content", images)
        for key in ("name", "tool_call_id", "reasoning_content"):
            if m.get(key) is not None:
                if not isinstance(m[key], str):
                    raise bad_request(f"{where}.{key} must be a string", f"{where}.{key}")
                msg[key] = m[key]
        if m.get("tool_calls") is not None:
            msg["tool_calls"] = _tool_calls(m["tool_calls"], where + ".tool_calls")
        out.append(msg)
    return out, images


def _content(content: Any, where: str, images: list):
    """A message's content: a string as it is, text parts joined, or the parts when there are images (each
    image part's place appended to ``images``)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or an array of parts, got {_kind(content)}", where)
    parts, n_images = [], len(images)
    for j, part in enumerate(content):
        pw = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise bad_request(f"{pw}.text must be a string", pw + ".text")
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str) or not url:
                raise bad_request(f"{pw}.image_url.url must be a string (a data: URL)", pw + ".image_url")
            _check_image_url(url, pw + ".image_url.url")
            parts.append({"type": "image_url", "image_url": {"url": url}})
            images.append(pw)
        elif kind in ("input_audio", "file"):
            raise bad_request(f"{pw}: {kind} parts are not supported (text and image_url are)", pw)
        else:
            raise bad_request(f"{pw} must be a text or image_url part", pw)
    if len(images) > n_images:
        return parts
    return "\n".join(p["text"] for p in parts)


def _check_image_url(url: str, param: str) -> None:
    """An image URL must be a ``data:`` URL: the server fetches nothing and reads no local file (a path, a
    ``file://`` URL), so that a request cannot make it reach another host or its file system. Nothing is
    looked up, so the answer is the same whether a named file exists or not."""
    scheme, sep, _ = url[:16].partition(":")
    scheme = scheme.lower() if sep else ""       # as the image loader reads it: " data:" would be a path
    if scheme == "data":
        return
    if scheme in ("http", "https", "ftp", "ftps"):
        raise bad_request(f"{param}: the server never fetches images from URLs ({scheme}://...); send the image "
                          "itself as a data: URL (data:image/png;base64,...)", param)
    raise bad_request(f"{param}: the server never reads local files (a path or a file:// URL); send the image "
                      "itself as a data: URL (data:image/png;base64,...)", param)


def check_images(runner, where: list, truncate: bool = False, ollama: bool = False) -> None:
    """A request's images (``where``: each one's place in the request) before anything is decoded: 400 when
    the server has no vision projector (started without ``--mmproj``); over the context when the images
    alone take more tokens than a slot holds (413, Ollama's routes 400 as for a text prompt over the context),
    so that a request of many images is refused before it decodes them."""
    if not where:
        return
    vision = getattr(runner, "vision", None)
    if vision is None:
        raise ApiError(400, f"{where[0]}: this server takes no images: it was started without a vision projector "
                            "(ggmlpy serve --mmproj FILE, the model's mmproj GGUF)", param=where[0], ollama=ollama)
    n_ctx = int(runner.n_ctx)
    least = len(where) * int(vision.config.min_image_tokens)
    if least > n_ctx and not truncate:
        msg = (f"the prompt does not fit the context: {len(where)} images take at least {least} tokens, more than "
               f"the context ({n_ctx} tokens per request)")
        if ollama:
            raise ApiError(400, msg, ollama=True)
        raise ApiError(413, msg, type="exceed_context_size_error", param="messages", code="context_length_exceeded")


def _tool_calls(value: Any, where: str) -> list:
    if not isinstance(value, list):
        raise bad_request(f"{where} must be an array", where)
    out = []
    for k, call in enumerate(value):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"{where}[{k}] must be {{\"type\": \"function\", \"function\": {{\"name\", "
                              f"\"arguments\"}}}}", f"{where}[{k}]")
        args = fn.get("arguments", {})
        if isinstance(args, str):          # OpenAI sends JSON text; templates read the object
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise bad_request(f"{where}[{k}].function.arguments is not valid JSON",
                                  f"{where}[{k}].function.arguments") from None
        entry = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        out.append(entry)
    return out


def _tools(value: Any) -> list:
    if not isinstance(value, list) or len(value) > 128:
        raise bad_request("tools must be an array of at most 128 tools", "tools")
    for k, tool in enumerate(value):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type", "function") == "function" and isinstance(fn, dict)
                and isinstance(fn.get("name"), str) and fn["name"]):
            raise bad_request(f"tools[{k}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                              f"\"parameters\": {{...}}}}}}", f"tools[{k}]")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise bad_request(f"tools[{k}].function.parameters must be a JSON schema object",
                              f"tools[{k}].function.parameters")
    return value


def completion_request(state: ServerState, body: dict) -> dict:
    """``/v1/completions``: ``{"prompts" (str or token-id lists), "kw", "n", "stream", "include_usage",
    "logprobs", "echo"}``."""
    req = _common(state, body, chat=False)
    if body.get("suffix"):
        raise bad_request("suffix (fill-in-the-middle) is not supported", "suffix")
    if _field(body, "best_of", _INT, 1, 1) != 1:
        raise bad_request("best_of > 1 is not supported (ask for n choices)", "best_of")
    req["echo"] = _field(body, "echo", _BOOL, False)
    prompt = body.get("prompt")
    req["prompts"] = _inputs(prompt, "prompt", allow_empty_text=False)
    if len(req["prompts"]) * req["n"] > MAX_N:
        raise bad_request(f"prompt: {len(req['prompts'])} prompts times n={req['n']} choices is more than "
                          f"{MAX_N}", "prompt")
    return req


def _inputs(value: Any, param: str, allow_empty_text: bool = False) -> list:
    """A prompt or an embedding input: a string, an array of strings, token ids, or arrays of token ids."""
    if isinstance(value, str):
        items = [value]
    elif isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        items = [value]
    elif isinstance(value, list) and value:
        items = value
    else:
        raise bad_request(f"{param} must be a string, an array of strings, token ids or arrays of token ids "
                          f"(non-empty), got {_kind(value)}", param)
    if len(items) > MAX_INPUTS:
        raise bad_request(f"{param}: at most {MAX_INPUTS} inputs, got {len(items)}", param)
    for k, item in enumerate(items):
        if isinstance(item, str):
            if not item and not allow_empty_text:
                raise bad_request(f"{param}[{k}] is empty", param)
        elif isinstance(item, list) and item and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            if any(t < 0 for t in item):
                raise bad_request(f"{param}[{k}]: token ids are >= 0", param)
        else:
            raise bad_request(f"{param}[{k}] must be a string or a non-empty array of token ids, got {_kind(item)}",
                              param)
    return items


def embedding_request(state: ServerState, body: dict) -> dict:
    """``/v1/embeddings``: ``{"inputs", "encoding_format", "dimensions", "embd_normalize"}`` (``embd_normalize``
    llama-server's: -1 none, 0 max-abs, 1 taxicab, 2 Euclidean (default), p > 2 p-norm)."""
    check_model(state, body)
    inputs = _inputs(body.get("input"), "input")
    fmt = _field(body, "encoding_format", _STR, "float")
    if fmt not in ("float", "base64"):
        raise bad_request(f"encoding_format must be float or base64, got {fmt[:40]!r}", "encoding_format")
    dims = _field(body, "dimensions", _INT, None, 1)
    norm = _field(body, "embd_normalize", _INT, 2, -1)
    return {"inputs": inputs, "encoding_format": fmt, "dimensions": dims, "embd_normalize": norm}


def runner_error(e: BaseException, param: Optional[str] = None, ollama: bool = False,
                 images: Optional[list] = None) -> ApiError:
    """The HTTP error of what the runner raised at submit: 413 for a prompt over the context, 400 for a
    bad value (the runner's message, which names the setting), 503 for a closed runner. ``images``: where
    the request's images are (``messages[0].content[1]``), to name the one an image error is about."""
    from ggmlpy._core import ClosedError, GGMLTypeError, GGMLValueError
    from ggmlpy.runner import InputTooLong

    if isinstance(e, InputTooLong):
        return ApiError(413, f"the prompt does not fit the context: {e}", type="exceed_context_size_error",
                        param=param, code="context_length_exceeded", ollama=ollama)
    if isinstance(e, ClosedError):
        return ApiError(503, "the server is shutting down", ollama=ollama, headers={"Retry-After": "1"})
    if isinstance(e, (GGMLValueError, GGMLTypeError, ValueError, TypeError)):
        msg = str(e)
        k = getattr(e, "image_index", None)
        if images and isinstance(k, int) and 0 <= k < len(images):
            return ApiError(400, f"{images[k]}: {msg}", param=images[k], ollama=ollama)
        for prefix in ("submit_chat: ", "submit: ", "chat_prompt: "):
            msg = msg.removeprefix(prefix)
        first = msg.split(" ", 1)[0].rstrip(":")
        if param is None and (first in SAMPLING_FIELDS or first in ("seed", "logit_bias", "samplers", "grammar",
                                                                    "json_schema", "response_format", "tool_choice")):
            param = first
        return ApiError(400, msg, param=param, ollama=ollama)
    return ApiError(500, f"internal error: {type(e).__name__}: {e}", ollama=ollama)
