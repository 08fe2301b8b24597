"""Ollama's API as the runner's calls: request JSON in, runner keywords out; a :class:`Completion` in, Ollama's
response objects out. No HTTP here (:mod:`.ollama_routes` is the thin layer over Starlette), so each mapping is
tested alone.

The facts followed are Ollama's ``docs/api.md`` and ``api/types.go``: durations in nanoseconds, streamed responses
as one JSON object a line (NDJSON) ending with ``"done": true`` and the timings, ``options`` as the Modelfile's
parameters, ``format`` as ``"json"`` or a JSON schema, ``think`` as a bool or a level, tool calls as
``{"function": {"index", "name", "arguments": {...}}}`` with the arguments an object, not JSON text.

Where this server differs, and why:

- One model is served; a request's ``model`` name is not checked (llama-server does the same), and responses
  name the served model.
- ``num_predict`` not given (or ``-1``) generates until the end of generation or a full context (done reason
  ``length``): Ollama's ``-1`` shifts the context and may never end, which a server should not allow by default.
- Options fixed when the model is loaded (``num_ctx`` when it differs from the server's, ``num_gpu``,
  ``num_thread``, ``num_batch``, ``use_mmap``...) and options this engine does not have are ignored, each with
  the reason, which the routes send in a ``Warning`` header and log (Ollama logs unknown options and reloads
  the model for load-time ones; a request cannot reload a shared server's model).
- ``template`` (a Go template), ``suffix`` (fill-in-the-middle) and ``context`` (deprecated token memory) are
  refused with 400 rather than ignored, since ignoring them would change what the model is asked.
- ``keep_alive`` is accepted and has no effect: the model stays loaded for the server's life.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Optional

__all__ = ["OllamaError", "ChatCall", "chat_call", "generate_call", "embed_inputs", "format_constraint",
           "map_options", "messages_from_ollama", "tool_calls_to_ollama", "chunk_from_deltas", "final_fields",
           "model_details", "parameter_size", "quantization_level", "model_info", "timestamp"]


class OllamaError(ValueError):
    """A request Ollama's API refuses: ``status`` (400 unless said) and the message for ``{"error": ...}``."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


#: Ollama's option name → the runner's keyword, for the options taken as they are (types checked here,
#: ranges by :class:`ggmlpy.sampling.SamplingParams`)
_FLOAT_OPTIONS = {"temperature": "temperature", "top_p": "top_p", "min_p": "min_p", "typical_p": "typical_p",
                  "repeat_penalty": "repeat_penalty", "presence_penalty": "presence_penalty",
                  "frequency_penalty": "frequency_penalty", "mirostat_tau": "mirostat_tau",
                  "mirostat_eta": "mirostat_eta",
                  # llama.cpp's samplers under their own names (Ollama has none of these)
                  "top_n_sigma": "top_n_sigma", "xtc_probability": "xtc_probability",
                  "xtc_threshold": "xtc_threshold", "dry_multiplier": "dry_multiplier", "dry_base": "dry_base",
                  "dynatemp_range": "dynatemp_range", "dynatemp_exponent": "dynatemp_exponent"}
_INT_OPTIONS = {"top_k": "top_k", "repeat_last_n": "repeat_last_n", "mirostat": "mirostat", "num_keep": "n_keep",
                "min_keep": "min_keep", "dry_allowed_length": "dry_allowed_length",
                "dry_penalty_last_n": "dry_penalty_last_n"}

#: options set when Ollama loads a model: they cannot change per request here
_LOAD_OPTIONS = ("num_batch", "num_gpu", "main_gpu", "use_mmap", "use_mlock", "num_thread", "numa", "low_vram",
                 "f16_kv", "vocab_only", "draft_num_predict", "logits_all", "embedding_only", "rope_frequency_base",
                 "rope_frequency_scale", "num_gqa")
#: options Ollama once had that this engine does not implement
_GONE_OPTIONS = {"penalize_newline": "the newline token is penalized like any other (llama.cpp removed the "
                                     "switch)",
                 "tfs_z": "tail-free sampling was removed from llama.cpp's sampler chain"}


def _number(name: str, value: Any, integer: bool) -> float | int:
    # JSON's true/false are not numbers here, though Python's bool is an int
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise OllamaError(f"options.{name} must be a number (got {json.dumps(value)[:40]})")
    if integer:
        if isinstance(value, float) and not value.is_integer():
            raise OllamaError(f"options.{name} must be an integer (got {value})")
        return int(value)
    if not math.isfinite(value):
        raise OllamaError(f"options.{name} must be finite")
    return float(value)


def map_options(options: Optional[Mapping], n_ctx: int) -> tuple[dict, list[str]]:
    """Ollama's ``options`` as the runner's request keywords, and the reasons for what was ignored.

    ``seed`` -1 (Ollama's default) is a fresh seed; ``num_predict`` -1, -2 or absent generates until the end of
    generation or a full context (``max_tokens=-2``), a positive count at most that many tokens; ``stop`` is a
    list of strings (or one); ``num_ctx`` equal to the server's context is accepted, another is ignored with the
    reason. Sampler options not given take the model file's recommendations, then the runner's defaults
    (``docs/generation.md``).

    Raises
    ------
    OllamaError
        ``options`` not an object, or a value of the wrong type.
    """
    if options is None:
        options = {}
    if not isinstance(options, Mapping):
        raise OllamaError("options must be an object")
    kw: dict[str, Any] = {"max_tokens": -2}
    ignored: list[str] = []
    for name, value in options.items():
        if value is None:
            continue
        if name in _FLOAT_OPTIONS:
            kw[_FLOAT_OPTIONS[name]] = _number(name, value, False)
        elif name in _INT_OPTIONS:
            kw[_INT_OPTIONS[name]] = _number(name, value, True)
        elif name == "seed":
            seed = _number(name, value, True)
            kw["seed"] = None if seed < 0 else seed
        elif name == "num_predict":
            n = _number(name, value, True)
            if n > 0:
                kw["max_tokens"] = n
            elif n < -2:
                raise OllamaError(f"options.num_predict must be positive, -1 or -2 (got {n})")
        elif name == "stop":
            stops = [value] if isinstance(value, str) else value
            if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
                raise OllamaError("options.stop must be a string or a list of strings")
            kw["stop"] = [s for s in stops if s]
        elif name == "num_ctx":
            n = _number(name, value, True)
            if n != n_ctx:
                ignored.append(f"num_ctx {n} ignored: the server's context is {n_ctx} tokens a slot, set when it "
                               "started (ggmlpy serve -c)")
        elif name in _LOAD_OPTIONS:
            ignored.append(f"{name} ignored: it is set when the server loads the model")
        elif name in _GONE_OPTIONS:
            ignored.append(f"{name} ignored: {_GONE_OPTIONS[name]}")
        else:
            ignored.append(f"{name} ignored: not an option of this server")
    return kw, ignored


def format_constraint(fmt: Any) -> dict:
    """Ollama's ``format`` as the runner's keywords: ``"json"`` → any JSON object, a schema → that schema
    (``json_schema=``, compiled by llguidance: a schema it cannot compile is refused), ``""``/None → nothing."""
    if fmt is None or fmt == "":
        return {}
    if fmt == "json":
        return {"json_schema": {"type": "object"}}
    if isinstance(fmt, dict):
        return {"json_schema": fmt}
    raise OllamaError(f"format must be \"json\" or a JSON schema object (got {json.dumps(fmt)[:60]})")


def think_kwargs(think: Any) -> dict:
    """``think`` (a bool, or Ollama's level ``low``/``medium``/``high``/``max``) as chat template keywords:
    ``enable_thinking`` (Qwen3, DeepSeek and most thinking templates read it) and ``reasoning_effort`` for a
    level (gpt-oss's)."""
    if think is None:
        return {}
    if isinstance(think, bool):
        return {"enable_thinking": think}
    if think in ("low", "medium", "high", "max"):
        return {"enable_thinking": True, "reasoning_effort": think}
    raise OllamaError(f"think must be true, false, \"low\", \"medium\", \"high\" or \"max\" (got "
                      f"{json.dumps(think)[:40]})")


def decode_image(data: Any, where: str) -> bytes:
    """One of Ollama's ``images``: base64 text (a ``data:`` URL's payload also taken) → the encoded bytes."""
    if not isinstance(data, str):
        raise OllamaError(f"{where} must be base64 text")
    if data.startswith("data:") and "," in data:
        data = data.split(",", 1)[1]
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise OllamaError(f"{where} is not valid base64") from None


def messages_from_ollama(messages: Any) -> list[dict]:
    """Ollama's chat messages as the chat template takes them: ``images`` (base64) become image parts before
    the text, an assistant's ``tool_calls`` gain OpenAI's ``type`` (the arguments stay an object, as the
    templates index them), a tool's ``tool_name`` becomes ``name``; ``thinking`` is passed as
    ``reasoning_content``, the field templates that replay reasoning read."""
    if not isinstance(messages, list):
        raise OllamaError("messages must be a list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise OllamaError(f"messages[{i}] must be an object")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise OllamaError(f"messages[{i}].role must be a string")
        content = m.get("content") or ""
        if not isinstance(content, str):
            raise OllamaError(f"messages[{i}].content must be a string")
        msg: dict[str, Any] = {"role": role.lower()}
        images = m.get("images") or []
        if not isinstance(images, list):
            raise OllamaError(f"messages[{i}].images must be a list of base64 strings")
        if images:
            parts: list[dict] = [{"type": "image", "image": decode_image(im, f"messages[{i}].images[{j}]")}
                                 for j, im in enumerate(images)]
            msg["content"] = [*parts, {"type": "text", "text": content}]
        else:
            msg["content"] = content
        calls = m.get("tool_calls")
        if calls:
            if not isinstance(calls, list):
                raise OllamaError(f"messages[{i}].tool_calls must be a list")
            msg["tool_calls"] = [_tool_call_in(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(calls)]
        if m.get("tool_name"):
            msg["name"] = m["tool_name"]
        if m.get("tool_call_id"):
            msg["tool_call_id"] = m["tool_call_id"]
        if m.get("thinking"):
            msg["reasoning_content"] = m["thinking"]
        out.append(msg)
    return out


def _tool_call_in(call: Any, where: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise OllamaError(f"{where} must be {{\"function\": {{\"name\": ..., \"arguments\": {{...}}}}}}")
    args = fn.get("arguments", {})
    if isinstance(args, str):          # OpenAI's JSON text, as some clients send
        try:
            args = json.loads(args)
        except ValueError:
            raise OllamaError(f"{where}.function.arguments is not JSON") from None
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if call.get("id"):
        out["id"] = call["id"]
    return out


def tool_calls_to_ollama(calls: Sequence, start: int = 0) -> list[dict]:
    """:class:`ggmlpy.chat.ToolCall` s (or streamed whole-call deltas) in Ollama's shape, ``index`` counting
    from ``start``."""
    out = []
    for i, c in enumerate(calls, start):
        args = c.arguments
        if isinstance(args, str):          # a ToolCallDelta carries the arguments as JSON text
            args = json.loads(args) if args else {}
        out.append({"id": c.id, "function": {"index": i, "name": c.name, "arguments": args}})
    return out


def timestamp(t: Optional[float] = None) -> str:
    """``created_at``: RFC 3339 in UTC with nanosecond digits, as Go's ``time.Time`` marshals."""
    t = time.time() if t is None else t
    d = datetime.fromtimestamp(t, timezone.utc)
    return d.strftime("%Y-%m-%dT%H:%M:%S.") + f"{int(round((t % 1) * 1e9)) % 10**9:09d}Z"


def _ns(seconds: float) -> int:
    return max(0, int(round(seconds * 1e9)))


def final_fields(c, started: float, load_duration: float = 0.0) -> dict:
    """The last object's statistics from a :class:`~ggmlpy.runner.Completion`: the done reason and the
    durations in nanoseconds (``total_duration`` from ``started``, a :func:`time.monotonic` reading when the
    request arrived)."""
    return {"done": True, "done_reason": c.done_reason or "stop",
            "total_duration": _ns(time.monotonic() - started), "load_duration": _ns(load_duration),
            "prompt_eval_count": int(c.prompt_eval_count), "prompt_eval_duration": _ns(c.prompt_eval_duration),
            "eval_count": int(c.eval_count), "eval_duration": _ns(c.eval_duration)}


@dataclass
class ChatCall:
    """What to ask the runner: ``chat`` (a chat's messages through the template, reply parsed) or ``raw`` (a
    prompt as it is); the positional argument and the keywords; the reasons for ignored options; the places
    of the images."""

    kind: str
    arg: Any
    kwargs: dict
    ignored: list = field(default_factory=list)
    #: where each image is in the request (``messages[0].images[1]``, ``images[0]``), in prompt order
    images: list = field(default_factory=list)


def _common(body: Mapping, n_ctx: int) -> tuple[dict, list]:
    kw, ignored = map_options(body.get("options"), n_ctx)
    kw.update(format_constraint(body.get("format")))
    return kw, ignored


def chat_call(body: Mapping, n_ctx: int) -> ChatCall:
    """``/api/chat``'s body as a runner call (``Runner.submit_chat``): messages, tools, ``think`` as template
    keywords, ``format`` and ``options`` as keywords.

    Raises
    ------
    OllamaError
        A malformed field.
    """
    kw, ignored = _common(body, n_ctx)
    messages = messages_from_ollama(body.get("messages") or [])
    tools = body.get("tools")
    if tools:
        if not isinstance(tools, list):
            raise OllamaError("tools must be a list")
        kw["tools"] = tools
    tk = think_kwargs(body.get("think"))
    if tk:
        kw["template_kwargs"] = tk
    if body.get("truncate") is not None:
        kw["truncate"] = bool(body["truncate"])
    if body.get("shift") is not None:
        kw["shift"] = bool(body["shift"])
    places = [f"messages[{i}].images[{j}]" for i, m in enumerate(body.get("messages") or [])
              for j in range(len(m.get("images") or []))]
    return ChatCall("chat", messages, kw, ignored, places)


def generate_call(body: Mapping, n_ctx: int) -> ChatCall:
    """``/api/generate``'s body as a runner call: with ``raw`` the prompt as it is (``Runner.submit``, BOS as
    the file says), else the chat template over ``system`` and the prompt as the user's message (Ollama applies
    the model's template, so the reply is parsed as a chat's: ``thinking``, ``tool_calls``).

    Raises
    ------
    OllamaError
        A malformed field, or ``template``/``suffix``/``context``, which this server does not take.
    """
    for name, why in (("template", "the prompt template is the model file's Jinja chat template; send the "
                                   "prompt with raw: true to format it yourself"),
                      ("suffix", "fill-in-the-middle is not supported"),
                      ("context", "the deprecated context memory is not supported; send the conversation to "
                                  "/api/chat as messages")):
        if body.get(name):
            raise OllamaError(f"{name}: {why}")
    prompt = body.get("prompt") or ""
    if not isinstance(prompt, str):
        raise OllamaError("prompt must be a string")
    images = body.get("images") or []
    if not isinstance(images, list):
        raise OllamaError("images must be a list of base64 strings")
    kw, ignored = _common(body, n_ctx)
    decoded = [decode_image(im, f"images[{j}]") for j, im in enumerate(images)]
    places = [f"images[{j}]" for j in range(len(images))]
    if body.get("raw"):
        if decoded:
            kw["images"] = decoded
        return ChatCall("raw", prompt, kw, ignored, places)
    messages: list[dict] = []
    system = body.get("system")
    if system:
        if not isinstance(system, str):
            raise OllamaError("system must be a string")
        messages.append({"role": "system", "content": system})
    # the images before the text, as messages_from_ollama places a message's images
    content = [*({"type": "image", "image": b} for b in decoded), {"type": "text", "text": prompt}] if decoded \
        else prompt
    messages.append({"role": "user", "content": content})
    tk = think_kwargs(body.get("think"))
    if tk:
        kw["template_kwargs"] = tk
    return ChatCall("chat", messages, kw, ignored, places)


def chunk_from_deltas(deltas: Sequence, n_calls: int) -> tuple[dict, int]:
    """One streamed token's :class:`~ggmlpy.chat.ReplyDelta` s joined as Ollama's message fields (``content``,
    ``thinking``, ``tool_calls``; empty ones left out), and the tool calls counted so far."""
    content = "".join(d.content for d in deltas)
    thinking = "".join(d.reasoning for d in deltas)
    calls = [d.tool_call for d in deltas if d.tool_call is not None]
    out: dict[str, Any] = {}
    if content:
        out["content"] = content
    if thinking:
        out["thinking"] = thinking
    if calls:
        out["tool_calls"] = tool_calls_to_ollama(calls, n_calls)
    return out, n_calls + len(calls)


def embed_inputs(body: Mapping) -> tuple[list[str], bool, Optional[int]]:
    """``/api/embed``'s ``input`` (a string or a list of them), ``truncate`` (default true) and ``dimensions``."""
    inp = body.get("input")
    inputs = [inp] if isinstance(inp, str) else inp
    if not isinstance(inputs, list) or not inputs or not all(isinstance(s, str) and s for s in inputs):
        raise OllamaError("input must be a non-empty string or a non-empty list of non-empty strings")
    dims = body.get("dimensions")
    if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int) or dims < 1):
        raise OllamaError("dimensions must be a positive integer")
    truncate = body.get("truncate")
    return inputs, True if truncate is None else bool(truncate), dims


# --------------------------------------------------------------------------- the model's description

#: llama.cpp's LLAMA_FTYPE numbers (``general.file_type``) and the names Ollama gives them (``fs/ggml``)
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
              12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
              19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL",
              26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16",
              36: "TQ1_0", 37: "TQ2_0", 38: "MXFP4"}


def parameter_size(n: int) -> str:
    """Ollama's ``format.HumanNumber``: ``8B``, ``7.6B``, ``16.49M``, ``500K``."""
    for unit, scale, digits in (("B", 10**9, 1), ("M", 10**6, 2)):
        if n >= scale:
            v = n / scale
            return f"{v:.0f}{unit}" if v == math.floor(v) else f"{v:.{digits}f}{unit}"
    return f"{n / 1000:.0f}K" if n >= 1000 else str(n)


def quantization_level(file_type: Optional[int]) -> str:
    """``general.file_type`` as Ollama names it (``Q4_K_M``), ``unknown`` when absent or unknown."""
    return FILE_TYPES.get(file_type, "unknown") if file_type is not None else "unknown"


def model_details(model) -> dict:
    """Ollama's ``details`` of a loaded model: the file's format, architecture as the family, the parameter
    count and the quantization."""
    arch = model.config.arch
    return {"parent_model": "", "format": "gguf", "family": arch, "families": [arch],
            "parameter_size": parameter_size(int(model.n_params)),
            "quantization_level": quantization_level(model.config.file_type)}


#: arrays too long to list unless ``verbose`` (Ollama shows them empty)
_LONG_ARRAY = 64


def model_info(path: str, verbose: bool = False) -> dict:
    """The GGUF's metadata as ``/api/show``'s ``model_info``: every key, arrays longer than 64 items (the
    vocabulary, the merges) empty unless ``verbose``, numpy values as JSON numbers."""
    from ggmlpy.gguf import open_reader

    r = open_reader(path)
    try:
        meta = dict(r.metadata)
    finally:
        close = getattr(r, "close", None)
        if close is not None:
            close()
    out = {}
    for k, v in meta.items():
        if k.startswith("split.") or k == "general.alignment":
            continue
        if isinstance(v, (list, tuple)) or hasattr(v, "tolist"):
            v = v.tolist() if hasattr(v, "tolist") else list(v)
            if isinstance(v, list) and len(v) > _LONG_ARRAY and not verbose:
                v = []
        elif isinstance(v, bytes):
            v = v.decode("utf-8", "replace")
        out[k] = v
    return out


def file_facts(path: str) -> tuple[int, float]:
    """The model file's size and modification time (a split model's first file)."""
    st = os.stat(path)
    return st.st_size, st.st_mtime
