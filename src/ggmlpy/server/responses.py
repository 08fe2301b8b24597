"""OpenAI's response JSON from the runner's :class:`~ggmlpy.runner.Completion` s and events.

The shapes are those the ``openai`` client's types read (``ChatCompletion``, ``ChatCompletionChunk``,
``Completion``, ``CreateEmbeddingResponse``), with llama-server's additions: ``timings`` (prompt and
generation speed) and ``reasoning_content``.
"""

from __future__ import annotations

import base64
import secrets
import time
from typing import Optional

import numpy as np

__all__ = ["chat_chunk", "chat_message", "chat_response", "completion_chunk", "completion_response",
           "embedding_response", "finish_reason", "logprobs_chat", "logprobs_completion", "new_id", "timings",
           "usage"]


def new_id(prefix: str) -> str:
    """A response id: ``chatcmpl-``/``cmpl-`` and 24 random letters and digits."""
    return f"{prefix}-{secrets.token_hex(12)}"


def finish_reason(c) -> str:
    """OpenAI's finish reason of a Completion: ``tool_calls`` when it called tools, ``length`` at
    ``max_tokens`` or a full context, else ``stop`` (an end token, a stop string, or a grammar's end)."""
    if getattr(c, "tool_calls", None):
        return "tool_calls"
    return "length" if c.done_reason == "length" else "stop"


def usage(completions: list, prompts: Optional[list] = None) -> dict:
    """``usage`` over a request's completions: the prompt counted once per distinct prompt (``n``
    choices share it), cached prompt tokens in ``prompt_tokens_details``."""
    seen, prompt, cached = set(), 0, 0
    for i, c in enumerate(completions):
        key = prompts[i] if prompts is not None else 0
        if key in seen:
            continue
        seen.add(key)
        prompt += c.prompt_eval_count
        cached += c.n_cached
    gen = sum(c.eval_count for c in completions)
    return {"prompt_tokens": prompt, "completion_tokens": gen, "total_tokens": prompt + gen,
            "prompt_tokens_details": {"cached_tokens": cached}}


def timings(c) -> dict:
    """llama-server's ``timings`` of one Completion: prompt tokens evaluated (the cached ones apart) and
    generated tokens, with their milliseconds and tokens per second."""
    prompt_n = max(0, c.prompt_eval_count - c.n_cached)
    prompt_ms, gen_ms = c.prompt_eval_duration * 1e3, c.eval_duration * 1e3
    return {"cache_n": c.n_cached, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
            "prompt_per_second": prompt_n / c.prompt_eval_duration if prompt_n and c.prompt_eval_duration > 0 else 0.0,
            "predicted_n": c.eval_count, "predicted_ms": gen_ms,
            "predicted_per_token_ms": gen_ms / c.eval_count if c.eval_count else 0.0,
            "predicted_per_second": (c.eval_count / c.eval_duration if c.eval_count and c.eval_duration > 0
                                     else 0.0)}


def _piece(tokenizer, token: int) -> tuple[str, list]:
    raw = tokenizer.token_to_piece(token) if tokenizer is not None else b""
    return raw.decode("utf-8", errors="replace"), list(raw)


def logprobs_chat(entries: list, tokenizer) -> dict:
    """OpenAI's chat ``logprobs``: ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``."""
    content = []
    for lp in entries:
        if lp is None:
            continue
        text, raw = _piece(tokenizer, lp.token)
        top = []
        for t in lp.top:
            ttext, traw = _piece(tokenizer, t.token)
            top.append({"token": ttext, "logprob": float(t.logprob), "bytes": traw})
        content.append({"token": text, "logprob": float(lp.logprob), "bytes": raw, "top_logprobs": top})
    return {"content": content}


def logprobs_completion(entries: list, tokenizer, offset: int = 0) -> dict:
    """OpenAI's legacy completions ``logprobs``: parallel lists of tokens, their log-probabilities, the
    alternatives as ``{token: logprob}`` and each token's character offset in the text."""
    tokens, lps, tops, offsets = [], [], [], []
    for lp in entries:
        if lp is None:
            continue
        text, _ = _piece(tokenizer, lp.token)
        tokens.append(text)
        lps.append(float(lp.logprob))
        tops.append({_piece(tokenizer, t.token)[0]: float(t.logprob) for t in lp.top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_message(c) -> dict:
    """The assistant's message of a chat Completion: content, reasoning and tool calls."""
    msg: dict = {"role": "assistant", "content": c.content if c.content is not None else c.text}
    if c.tool_calls:
        msg["tool_calls"] = [call.to_openai() for call in c.tool_calls]
        if not msg["content"]:
            msg["content"] = None
    if c.reasoning:
        msg["reasoning_content"] = c.reasoning
    return msg


def chat_response(rid: str, model: str, completions: list, tokenizer, want_logprobs: bool) -> dict:
    """The ``chat.completion`` object of ``n`` choices."""
    choices = []
    for i, c in enumerate(completions):
        choice = {"index": i, "message": chat_message(c), "finish_reason": finish_reason(c), "logprobs": None}
        if want_logprobs:
            choice["logprobs"] = logprobs_chat(c.logprobs, tokenizer)
        choices.append(choice)
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "system_fingerprint": "ggmlpy", "choices": choices, "usage": usage(completions, [0] * len(completions)),
            "timings": timings(completions[0])}


def chat_chunk(rid: str, model: str, created: int, index: int, delta: dict, finish: Optional[str] = None,
               logprobs: Optional[dict] = None) -> dict:
    """One ``chat.completion.chunk``."""
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "system_fingerprint": "ggmlpy",
            "choices": [{"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]}


def completion_response(rid: str, model: str, completions: list, texts: list, prompt_keys: list, tokenizer,
                        want_logprobs: bool) -> dict:
    """The ``text_completion`` object; ``texts`` are the choices' texts (the prompt first with ``echo``)."""
    choices = []
    for i, (c, text) in enumerate(zip(completions, texts)):
        choice = {"index": i, "text": text, "finish_reason": finish_reason(c), "logprobs": None}
        if want_logprobs:
            choice["logprobs"] = logprobs_completion(c.logprobs, tokenizer, len(text) - len(c.text or ""))
        choices.append(choice)
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "system_fingerprint": "ggmlpy", "choices": choices, "usage": usage(completions, prompt_keys),
            "timings": timings(completions[0])}


def completion_chunk(rid: str, model: str, created: int, index: int, text: str, finish: Optional[str] = None,
                     logprobs: Optional[dict] = None) -> dict:
    """One streamed ``text_completion`` object."""
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "system_fingerprint": "ggmlpy",
            "choices": [{"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}]}


def embedding_response(model: str, vectors: list, counts: list, encoding: str) -> dict:
    """``/v1/embeddings``' list: float lists, or base64 of little-endian float32 (what the ``openai``
    client decodes)."""
    data = []
    for i, v in enumerate(vectors):
        v = np.asarray(v, dtype="<f4")
        emb = base64.b64encode(v.tobytes()).decode() if encoding == "base64" else [float(x) for x in v]
        data.append({"object": "embedding", "index": i, "embedding": emb})
    n = int(sum(counts))
    return {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": n, "total_tokens": n}}
