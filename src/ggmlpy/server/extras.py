"""llama-server's extra endpoints as plain functions over a runner: the slot table, slot file names, the
Prometheus text, the properties. :mod:`.extras_routes` puts them on HTTP.

The shapes and metric names are llama.cpp's ``tools/server`` (``README.md``, ``server-task.cpp``'s
``to_metrics``): ``llamacpp:`` names where llama.cpp has the metric, ``ggmlpy:`` for the ones it does not.
"""

from __future__ import annotations

import math
import os
import re
import threading
from collections.abc import Mapping
from typing import Any, Optional

__all__ = ["TokenMetrics", "metrics_of", "render_metrics", "slot_file", "slots_info", "kv_usage", "props"]


class TokenMetrics:
    """Totals of served requests, for ``/metrics``: prompt and generated tokens and the seconds they took,
    prompt tokens taken from the cache, requests finished, the longest sequence seen. Thread-safe: every
    route records its completions here (:meth:`record`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.prompt_tokens = 0           # computed, the cached ones excluded (llama.cpp's prompt_tokens_total)
        self.prompt_tokens_cached = 0
        self.prompt_seconds = 0.0
        self.predicted_tokens = 0
        self.predicted_seconds = 0.0
        self.requests = 0
        self.n_tokens_max = 0

    def record(self, c) -> None:
        """Count one finished :class:`~ggmlpy.runner.Completion` (a generation or an embedding)."""
        cached = int(getattr(c, "n_cached", 0) or 0)
        prompt = int(c.prompt_eval_count)
        with self._lock:
            self.prompt_tokens += max(0, prompt - cached)
            self.prompt_tokens_cached += min(cached, prompt)
            self.prompt_seconds += float(c.prompt_eval_duration)
            self.predicted_tokens += int(c.eval_count)
            self.predicted_seconds += float(c.eval_duration)
            self.requests += 1
            self.n_tokens_max = max(self.n_tokens_max, prompt + int(c.eval_count))


def metrics_of(state) -> TokenMetrics:
    """The state's :class:`TokenMetrics` (``state.token_metrics``), made on first use."""
    m = getattr(state, "token_metrics", None)
    if m is None:
        m = state.token_metrics = TokenMetrics()
    return m


def kv_usage(runner) -> tuple[int, int]:
    """Cells in use and cells in all of the runner's cache (the fullest of a composite cache's parts)."""
    caches = getattr(runner.cache, "caches", None) or [runner.cache]
    used, total = 0, 1
    for c in caches:
        cells = c.cells
        if cells.used * total >= used * cells.n_cells:
            used, total = int(cells.used), int(cells.n_cells)
    return used, total


def _fmt(v: float) -> str:
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer() and abs(v) < 2**53):
        return str(int(v))
    return repr(float(v)) if math.isfinite(v) else ("+Inf" if v > 0 else "NaN")


def render_metrics(m: TokenMetrics, runner, extra_counters: Mapping[str, tuple[str, float]] = ()) -> str:
    """Prometheus's text exposition (version 0.0.4) of ``m`` and the runner's state: llama.cpp's counters and
    gauges under their ``llamacpp:`` names, the KV cache's use, and ``extra_counters`` (name → (help, value))."""
    with m._lock:
        counters = [
            ("llamacpp:prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens",
             m.prompt_tokens),
            ("llamacpp:prompt_tokens_cached_total", "Number of prompt tokens reused from the cache",
             m.prompt_tokens_cached),
            ("llamacpp:prompt_seconds_total", "Total time spent processing prompts", m.prompt_seconds),
            ("llamacpp:tokens_predicted_total", "Number of generation tokens processed", m.predicted_tokens),
            ("llamacpp:tokens_predicted_seconds_total", "Total time spent generating tokens", m.predicted_seconds),
            ("llamacpp:n_decode_total", "Total number of batches computed", int(getattr(runner, "n_batches", 0))),
            ("llamacpp:n_tokens_max", "Largest observed sequence length (prompt + generation)", m.n_tokens_max),
            ("ggmlpy:requests_total", "Requests finished", m.requests),
        ]
        p_rate = m.prompt_tokens / m.prompt_seconds if m.prompt_seconds > 0 else 0.0
        g_rate = m.predicted_tokens / m.predicted_seconds if m.predicted_seconds > 0 else 0.0
    counters += [(k, h, v) for k, (h, v) in dict(extra_counters).items()]
    with runner._lock:            # the loop's own record of what it serves and what waits
        processing, deferred = len(runner._active), len(runner._waiting)
    used, total = kv_usage(runner)
    gauges = [
        ("llamacpp:prompt_tokens_seconds", "Average prompt throughput in tokens/s", p_rate),
        ("llamacpp:predicted_tokens_seconds", "Average generation throughput in tokens/s", g_rate),
        ("llamacpp:requests_processing", "Number of requests processing", processing),
        ("llamacpp:requests_deferred", "Number of requests deferred", deferred),
        ("llamacpp:kv_cache_usage_ratio", "KV-cache usage. 1 means 100 percent usage", used / total),
        ("llamacpp:kv_cache_tokens", "KV-cache tokens", used),
    ]
    lines = []
    for kind, items in (("counter", counters), ("gauge", gauges)):
        for name, help_, value in items:
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {_fmt(value)}"]
    return "\n".join(lines) + "\n"


#: a slot file's name: letters, digits, ``_``, ``-`` and ``.``, not starting with a dot, at most 200 characters
_SLOT_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,199}")


class SlotFileError(ValueError):
    """A slot file name that is refused (the message says why)."""


def slot_file(folder: str, filename: Any, must_exist: bool = False) -> str:
    """The path of slot file ``filename`` in ``folder`` (``--slot-save-path``), or SlotFileError.

    Only a plain name is taken: letters, digits, ``_``, ``-``, ``.``, not starting with a dot, without ``..``;
    so no separator, no absolute path, no parent. The path is checked again after symbolic links are
    resolved: it must stay directly in the folder (a link placed there that points elsewhere is refused)."""
    if not isinstance(filename, str) or not filename:
        raise SlotFileError("filename must be a non-empty string")
    if not _SLOT_NAME.fullmatch(filename) or ".." in filename:
        raise SlotFileError(f"filename {filename[:60]!r} is not a plain file name (letters, digits, '_', '-', "
                            "'.'; not starting with '.', no '..', no path)")
    base = os.path.realpath(folder)
    path = os.path.join(base, filename)
    real = os.path.realpath(path)
    if os.path.dirname(real) != base or os.path.islink(path):
        raise SlotFileError(f"filename {filename!r} leads outside the slot folder")
    if must_exist and not os.path.isfile(real):
        raise FileNotFoundError(f"no slot file {filename!r}")
    return real


def slots_info(runner) -> list[dict]:
    """Each slot: ``id``, ``n_ctx``, ``is_processing`` and ``state`` (``busy``/``idle``), and the tokens its
    cache holds (``n_cached``, the prompt reuse's record)."""
    out = []
    with runner._lock:
        busy = set(runner._active)
        for i in range(runner.n_seq_max):
            s = runner.slots[i]
            n = sum(1 for t in s.tokens if t != -1)
            out.append({"id": i, "n_ctx": runner.n_ctx, "is_processing": i in busy or s.in_use,
                        "state": "busy" if (i in busy or s.in_use) else "idle", "n_cached": n})
    return out


def default_params(runner) -> dict:
    """The sampling settings a request gets when it sets none (the file's recommendations over the
    defaults), as llama-server's ``params``."""
    from ggmlpy.sampling import SamplingParams

    p = SamplingParams(**runner.sampling_defaults)
    out: dict[str, Any] = {}
    for k in ("temperature", "top_k", "top_p", "min_p", "typical_p", "top_n_sigma", "min_keep", "repeat_penalty",
              "repeat_last_n", "frequency_penalty", "presence_penalty", "xtc_probability", "xtc_threshold",
              "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n", "mirostat",
              "mirostat_tau", "mirostat_eta", "dynatemp_range", "dynatemp_exponent"):
        out[k] = getattr(p, k)
    out["dry_sequence_breakers"] = list(p.dry_sequence_breakers)
    out["samplers"] = list(p.samplers) if not isinstance(p.samplers, str) else p.samplers.split(";")
    out["seed"] = p.seed
    return out


def props(state, runner) -> dict:
    """``/props``: the default generation settings, the slots, the chat template, the memory report and the
    placement decision (``fit``: how ``n_gpu_layers="auto"`` chose, None when the placement was given)."""
    from ggmlpy._version import __version__

    report = runner.memory_report()
    fit = getattr(report, "fit", None)
    template = getattr(runner.tokenizer, "chat_template", None) if _has_tokenizer(runner) else None
    return {
        "default_generation_settings": {"n_ctx": runner.n_ctx, "params": default_params(runner)},
        "total_slots": runner.n_seq_max,
        "n_ctx": runner.n_ctx,
        "model_path": str(getattr(state, "path", "") or ""),
        "model_alias": getattr(state, "model_name", None),
        "chat_template": template or "",
        "modalities": {"vision": runner.vision is not None, "audio": False},
        "build_info": f"ggmlpy {__version__}",
        "memory": report.to_dict(),
        "fit": fit.to_dict() if fit is not None else None,
    }


def _has_tokenizer(runner) -> bool:
    try:
        return runner.tokenizer is not None
    except ValueError:
        return False


def pieces(tokenizer, ids: list[int]) -> list[dict]:
    """``/tokenize``'s ``with_pieces``: each id with its text, or its bytes when they are not valid UTF-8."""
    out = []
    for t in ids:
        b = tokenizer.decode_bytes([t]) if hasattr(tokenizer, "decode_bytes") else tokenizer.decode([t]).encode()
        try:
            piece: Any = b.decode("utf-8")
        except UnicodeDecodeError:
            piece = list(b)
        out.append({"id": t, "piece": piece})
    return out


def check_ids(tokens: Any, n_vocab: int) -> list[int]:
    """``/detokenize``'s ``tokens``: a list of ids of the vocabulary (ValueError otherwise)."""
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise ValueError("tokens must be a list of integers")
    bad = [t for t in tokens if not 0 <= t < n_vocab]
    if bad:
        raise ValueError(f"token {bad[0]} is not in the vocabulary [0, {n_vocab})")
    return tokens


def optional_bool(body: Mapping, key: str, default: bool) -> bool:
    v: Optional[Any] = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ValueError(f"{key} must be true or false")
    return v
