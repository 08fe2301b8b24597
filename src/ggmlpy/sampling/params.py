"""How a sequence samples: :class:`SamplingParams` (llama.cpp's ``common_params_sampling``), the sampler
names of ``--samplers``, and the defaults a GGUF file's ``general.sampling.*`` keys set."""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Optional

import numpy as np

from ggmlpy._core import GGMLTypeError, GGMLValueError
from ggmlpy.defaults import DEFAULTS

__all__ = ["DEFAULT_SAMPLERS", "MAX_TOP_LOGPROBS", "SAMPLER_NAMES", "SamplingParams", "gguf_sampling_defaults",
           "parse_samplers", "sampling_params"]

#: Largest accepted :attr:`SamplingParams.top_logprobs` (the OpenAI/Ollama limit).
MAX_TOP_LOGPROBS = 20

#: The chain's samplers in llama.cpp's default order (``common_params_sampling::samplers``); the draw
#: (``dist``) always comes last.
DEFAULT_SAMPLERS = ("penalties", "dry", "top_n_sigma", "top_k", "typical_p", "top_p", "min_p", "xtc", "temperature")

#: Every name ``samplers=`` / ``--samplers`` accepts (llama.cpp's ``common_sampler_types_from_names``,
#: its aliases included) → the canonical name.
SAMPLER_NAMES = {
    "penalties": "penalties", "dry": "dry", "top_n_sigma": "top_n_sigma", "top-n-sigma": "top_n_sigma",
    "top_k": "top_k", "top-k": "top_k", "typ_p": "typical_p", "typical_p": "typical_p", "typ-p": "typical_p",
    "typical-p": "typical_p", "typical": "typical_p", "top_p": "top_p", "top-p": "top_p", "nucleus": "top_p",
    "min_p": "min_p", "min-p": "min_p", "xtc": "xtc", "temperature": "temperature", "temp": "temperature",
    "adaptive_p": "adaptive_p", "adaptive-p": "adaptive_p",
}
#: ``--sampling-seq``'s one-letter names (llama.cpp's ``common_sampler_type_to_chr``)
SAMPLER_CHARS = {"e": "penalties", "d": "dry", "s": "top_n_sigma", "k": "top_k", "y": "typical_p", "p": "top_p",
                 "m": "min_p", "x": "xtc", "t": "temperature"}

#: GGUF ``general.sampling.*`` key → field: what llama.cpp's ``common_init_sampler_from_model`` reads
GGUF_SAMPLING_KEYS = {
    "general.sampling.top_k": "top_k", "general.sampling.top_p": "top_p", "general.sampling.min_p": "min_p",
    "general.sampling.xtc_probability": "xtc_probability", "general.sampling.xtc_threshold": "xtc_threshold",
    "general.sampling.temp": "temperature", "general.sampling.penalty_last_n": "repeat_last_n",
    "general.sampling.penalty_repeat": "repeat_penalty", "general.sampling.mirostat": "mirostat",
    "general.sampling.mirostat_tau": "mirostat_tau", "general.sampling.mirostat_eta": "mirostat_eta",
}


def _real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise GGMLValueError(f"{name} must be a real number, got {value!r}")
    out = float(value)
    if not math.isfinite(out):
        raise GGMLValueError(f"{name} must be finite, got {value!r}")
    return out


def _integer(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise GGMLValueError(f"{name} must be an integer, got {value!r}")
    return int(value)


def parse_samplers(value: object) -> tuple:
    """The chain's order from ``samplers=``: a sequence of names, or one string of names separated by
    ``;`` (``--samplers``, the GGUF's ``general.sampling.sequence``) or of llama.cpp's one-letter names
    (``--sampling-seq edskypmxt``). A name not in :data:`SAMPLER_NAMES` is an error naming it; a name
    given twice runs twice, as in llama.cpp.
    """
    if isinstance(value, str):
        if ";" in value or value.lower() in SAMPLER_NAMES:
            names = [n for n in value.split(";") if n.strip()]
        elif value and all(c in SAMPLER_CHARS for c in value):
            return tuple(SAMPLER_CHARS[c] for c in value)
        else:
            names = [value]
    elif isinstance(value, (list, tuple)):
        names = list(value)
    else:
        raise GGMLValueError(f"samplers must be a sequence of sampler names or a ';'-separated string, got {value!r}")
    out = []
    for n in names:
        if not isinstance(n, str) or n.strip().lower() not in SAMPLER_NAMES:
            raise GGMLValueError(f"samplers: unknown sampler {n!r}; known: {', '.join(DEFAULT_SAMPLERS)} "
                                 f"(or llama.cpp's one-letter sequence such as 'edskypmxt')")
        out.append(SAMPLER_NAMES[n.strip().lower()])
    return tuple(out)


def _logit_bias(value: object) -> tuple:
    """``logit_bias`` as sorted ``(token, bias)`` pairs; a mapping, or pairs (llama-server's ``[[id, bias]]``)."""
    if value is None:
        return ()
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, (list, tuple)):
        items = list(value)
        if not all(isinstance(it, (list, tuple)) and len(it) == 2 for it in items):
            raise GGMLValueError("logit_bias must be a mapping {token id: bias} or a list of [token id, bias] pairs")
    else:
        raise GGMLValueError(f"logit_bias must be a mapping {{token id: bias}}, got {type(value).__name__}")
    out: dict[int, float] = {}
    for tok, bias in items:
        if isinstance(tok, str) and tok.strip().lstrip("-").isdigit():
            tok = int(tok)           # OpenAI's JSON keys are strings of ids
        tok = _integer("logit_bias token", tok)
        if tok < 0:
            raise GGMLValueError(f"logit_bias: token ids are >= 0, got {tok}")
        if bias is False:
            bias = -math.inf         # llama-server's [id, false]: never this token
        elif isinstance(bias, bool) or not isinstance(bias, numbers.Real) or math.isnan(float(bias)) \
                or float(bias) == math.inf:
            raise GGMLValueError(f"logit_bias[{tok}] must be a finite number or -inf (a ban), got {bias!r}")
        out[tok] = out.get(tok, 0.0) + float(bias)
    return tuple(sorted(out.items()))


#: (field, check) for the numeric fields: check(value) -> error text or None
_RANGES = {
    "top_p": lambda v: None if 0.0 < v <= 1.0 else "must be in (0, 1]",
    "min_p": lambda v: None if 0.0 <= v <= 1.0 else "must be in [0, 1]",
    "typical_p": lambda v: None if 0.0 < v <= 1.0 else "must be in (0, 1]",
    "min_keep": lambda v: None if v >= 0 else "must be >= 0",
    "repeat_penalty": lambda v: None if v > 0 and math.isfinite(1.0 / v) else "must be > 0 (1 is off)",
    "repeat_last_n": lambda v: None if v >= -1 else "must be >= -1 (-1: the whole context, 0: off)",
    "xtc_probability": lambda v: None if 0.0 <= v <= 1.0 else "must be in [0, 1]",
    "xtc_threshold": lambda v: None if 0.0 <= v <= 1.0 else "must be in [0, 1] (above 0.5 turns XTC off)",
    "dry_multiplier": lambda v: None if v >= 0 else "must be >= 0 (0 is off)",
    "dry_base": lambda v: None if v >= 1.0 else "must be >= 1",
    "dry_allowed_length": lambda v: None if v >= 0 else "must be >= 0",
    "dry_penalty_last_n": lambda v: None if v >= -1 else "must be >= -1 (-1: the whole context, 0: off)",
    "mirostat": lambda v: None if v in (0, 1, 2) else "must be 0 (off), 1 or 2",
    "mirostat_tau": lambda v: None if v >= 0 else "must be >= 0",
    "mirostat_eta": lambda v: None if v >= 0 else "must be >= 0",
    "dynatemp_range": lambda v: None if v >= 0 else "must be >= 0 (0 is off)",
    "dynatemp_exponent": lambda v: None if v >= 0 else "must be >= 0",
    "adaptive_target": lambda v: None if v <= 1.0 else "must be at most 1 (negative: off)",
    "adaptive_decay": lambda v: None if 0.0 <= v <= 0.99 else "must be in [0, 0.99]",
    "temperature": lambda v: None if v >= 0 else "must be >= 0",
    "top_logprobs": lambda v: None if 0 <= v <= MAX_TOP_LOGPROBS else f"must be in [0, {MAX_TOP_LOGPROBS}]",
}
#: the fields that are not numbers (checked each in its own way)
_NOT_NUMBERS = ("seed", "logprobs", "logit_bias", "dry_sequence_breakers", "samplers", "logits_processor", "grammar",
                "json_schema")
_INTS = {"top_k", "min_keep", "repeat_last_n", "dry_allowed_length", "dry_penalty_last_n", "mirostat", "top_logprobs"}
#: a sequence breaker longer than this many bytes is cut, as llama.cpp does (MAX_CHAR_LEN)
MAX_BREAKER_BYTES = 40
#: the most sequence breakers (llama.cpp has no bound; each is a pass over the vocabulary, so a request's
#: list is bounded, as llama-server's body is)
MAX_BREAKERS = 64


def _breakers(value: object) -> tuple:
    """``dry_sequence_breakers`` checked and cut as llama.cpp cuts them: empty ones dropped, each to the
    characters that cover its first :data:`MAX_BREAKER_BYTES` bytes (DRY cuts the bytes: a cut inside a
    character is llama.cpp's cut)."""
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise GGMLValueError(f"dry_sequence_breakers must be a sequence of strings, got {type(value).__name__}")
    if len(value) > MAX_BREAKERS:
        raise GGMLValueError(f"dry_sequence_breakers: at most {MAX_BREAKERS} breakers, got {len(value)}")
    for i, b in enumerate(value):
        if not isinstance(b, str):
            raise GGMLValueError(f"dry_sequence_breakers[{i}] must be a string, got {type(b).__name__}")
    out = []
    for b in value:
        if not b:
            continue
        b = b[:MAX_BREAKER_BYTES]               # a character is at least a byte: these cover the cut
        enc = b.encode("utf-8")
        if len(enc) > MAX_BREAKER_BYTES:
            keep = len(enc[:MAX_BREAKER_BYTES].decode("utf-8", "ignore"))     # the whole characters in it
            b = b[:keep + (len(b[:keep].encode("utf-8")) < MAX_BREAKER_BYTES)]  # and the one cut inside
        out.append(b)
    return tuple(out)


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence picks its next token: llama.cpp's sampler chain and its settings.

    The defaults are :data:`ggmlpy.defaults.DEFAULTS`' (llama.cpp's ``common_params_sampling``, which
    llama-cpp-python and Ollama share for the first four: temperature 0.8, top-k 40, top-p 0.95, min-p
    0.05, a fresh seed; every other sampler off). ``SamplingParams(temperature=0)`` is greedy decoding:
    the arg-max after the samplers that move logits (logit bias, penalties, DRY) and those that can drop
    the most likely token (typical-p, XTC), as llama.cpp's ``temp <= 0`` is.

    The chain (:class:`~ggmlpy.sampling.Sampler`) runs, as llama.cpp's ``common_sampler``: the logits
    processor (if any), the grammar's mask (if any), the logit bias, then ``samplers`` in their order
    (default :data:`DEFAULT_SAMPLERS`: penalties, DRY, top-n-sigma, top-k, typical-p, top-p, min-p, XTC,
    temperature), then the weighted draw. ``mirostat`` 1 or 2 replaces the chain after the logit bias
    by temperature then Mirostat, as llama.cpp does (penalties and DRY do not run).

    Parameters
    ----------
    temperature : float
        ``>= 0``; ``0`` is greedy. Default 0.8.
    top_k : int
        Keep the ``top_k`` most likely tokens; ``<= 0`` turns it off. Default 40.
    top_p : float
        Nucleus: keep the smallest set of most likely tokens whose probability reaches ``top_p`` (at
        least ``min_keep``). In ``(0, 1]``; ``1`` is off. Default 0.95.
    min_p : float
        Drop tokens whose probability is below ``min_p`` times the largest. In ``[0, 1]``; ``0`` is off.
        Default 0.05.
    seed : int or None
        The sampler's random generator's seed (``>= 0``); None draws fresh entropy (not reproducible).
    logprobs, top_logprobs : bool, int
        Report the chosen token's log-probability and that many alternatives (0 to
        :data:`MAX_TOP_LOGPROBS`), over the raw logits, as Ollama and OpenAI do.
    typical_p : float
        Locally typical sampling; in ``(0, 1]``, ``1`` is off.
    top_n_sigma : float
        Keep tokens whose logit is within ``top_n_sigma`` standard deviations of the largest;
        ``<= 0`` is off (llama.cpp: -1).
    min_keep : int
        The least number of tokens top-p, min-p, typical-p and XTC leave (``0``: no bound).
    repeat_penalty, repeat_last_n, frequency_penalty, presence_penalty : float, int, float, float
        llama.cpp's penalties over the last ``repeat_last_n`` tokens (the prompt's included, as
        llama-server counts them; ``0`` is off, ``-1`` the whole context): a seen token's logit is
        divided by ``repeat_penalty`` (multiplied when negative), then lowered by ``count *
        frequency_penalty + presence_penalty``. Off at 1, 0, 0.
    logit_bias : mapping of int to float, optional
        Added to those tokens' logits before anything else; ``-inf`` (or llama-server's ``False``)
        bans a token. Stored as sorted ``(token, bias)`` pairs.
    xtc_probability, xtc_threshold : float
        Exclude Top Choices: with probability ``xtc_probability``, drop every token whose probability
        is at least ``xtc_threshold`` except the least likely of them. Off at 0; a threshold above
        0.5 turns it off.
    dry_multiplier, dry_base, dry_allowed_length, dry_penalty_last_n, dry_sequence_breakers
        DRY ("don't repeat yourself"): a token that would extend a sequence already seen in the last
        ``dry_penalty_last_n`` tokens (``-1``: the whole context) beyond ``dry_allowed_length`` tokens is
        lowered by ``dry_multiplier * dry_base ** (length - dry_allowed_length)``; a sequence breaker
        (a string: the tokens whose text holds it) ends the repetition. Off at multiplier 0. Needs the
        vocabulary (the runner passes it).
    mirostat, mirostat_tau, mirostat_eta : int, float, float
        Mirostat 1 or 2 with its target surprise ``tau`` and learning rate ``eta``; 0 is off.
    dynatemp_range, dynatemp_exponent : float
        Dynamic temperature: the temperature moves within ``temperature ± dynatemp_range`` with the
        normalised entropy raised to ``dynatemp_exponent``. Off at range 0.
    adaptive_target, adaptive_decay : float
        Adaptive-p (llama.cpp's newest draw): when ``"adaptive_p"`` is in ``samplers``, the draw favours
        tokens whose probability is near a target that adapts so the chosen tokens' average probability
        (an exponential moving average with ``adaptive_decay``) tracks ``adaptive_target``. A negative
        target draws as usual. Defaults -1 and 0.9.
    samplers : sequence of str or str
        The chain's order (:func:`parse_samplers`: names, ``"top_k;top_p;temperature"``, or
        ``"kpt"``). A sampler left out does not run. ``"adaptive_p"`` anywhere in it makes adaptive-p
        the draw (as llama.cpp, it replaces the plain draw at the end).
    logits_processor : callable, optional
        ``f(tokens, logits) -> logits``: the sequence's tokens so far (``int32`` array, prompt
        included) and the raw logits row (``float32``, a copy the callable may change in place); it
        returns the logits to sample from (same shape), as llama-cpp-python's and transformers' logits
        processors. It runs first, on every token; an exception in it ends that request with it.
    grammar : str or Grammar, optional
        Constrain the output: llama.cpp's GBNF text (with llama.cpp's meaning; text starting with
        ``%llguidance`` is llguidance's Lark, as in llama.cpp), or a
        :class:`~ggmlpy.sampling.grammar.Grammar` (Lark, a regular expression, a JSON schema, OpenAI's
        ``response_format``). Compiled here: a grammar that does not compile is a GGMLValueError before
        anything runs.
    json_schema : dict or str, optional
        Constrain the output to JSON valid under this schema (``{}`` or ``True``: any JSON value); kept
        as canonical JSON text. Not with ``grammar``.

    Raises
    ------
    ValueError
        For any out-of-range or wrongly typed field, naming the field.
    """

    temperature: float = DEFAULTS["temperature"]
    top_k: int = DEFAULTS["top_k"]
    top_p: float = DEFAULTS["top_p"]
    min_p: float = DEFAULTS["min_p"]
    seed: Optional[int] = DEFAULTS["seed"]
    logprobs: bool = False
    top_logprobs: int = 0
    typical_p: float = DEFAULTS["typical_p"]
    top_n_sigma: float = DEFAULTS["top_n_sigma"]
    min_keep: int = DEFAULTS["min_keep"]
    repeat_penalty: float = DEFAULTS["repeat_penalty"]
    repeat_last_n: int = DEFAULTS["repeat_last_n"]
    frequency_penalty: float = DEFAULTS["frequency_penalty"]
    presence_penalty: float = DEFAULTS["presence_penalty"]
    logit_bias: Any = None
    xtc_probability: float = DEFAULTS["xtc_probability"]
    xtc_threshold: float = DEFAULTS["xtc_threshold"]
    dry_multiplier: float = DEFAULTS["dry_multiplier"]
    dry_base: float = DEFAULTS["dry_base"]
    dry_allowed_length: int = DEFAULTS["dry_allowed_length"]
    dry_penalty_last_n: int = DEFAULTS["dry_penalty_last_n"]
    dry_sequence_breakers: tuple = DEFAULTS["dry_sequence_breakers"]
    mirostat: int = DEFAULTS["mirostat"]
    mirostat_tau: float = DEFAULTS["mirostat_tau"]
    mirostat_eta: float = DEFAULTS["mirostat_eta"]
    dynatemp_range: float = DEFAULTS["dynatemp_range"]
    dynatemp_exponent: float = DEFAULTS["dynatemp_exponent"]
    adaptive_target: float = DEFAULTS["adaptive_target"]
    adaptive_decay: float = DEFAULTS["adaptive_decay"]
    samplers: Any = DEFAULT_SAMPLERS
    logits_processor: Optional[Callable] = None
    grammar: Any = None
    json_schema: Any = None

    def __post_init__(self) -> None:
        for f in fields(self):
            name = f.name
            if name in _NOT_NUMBERS:
                continue
            v = getattr(self, name)
            v = _integer(name, v) if name in _INTS else _real(name, v)
            check = _RANGES.get(name)
            why = check(v) if check is not None else None
            if why is not None:
                raise GGMLValueError(f"{name} {why}, got {getattr(self, name)!r}")
            object.__setattr__(self, name, v)
        seed = self.seed
        if seed is not None:
            seed = _integer("seed", seed)
            if seed < 0:
                raise GGMLValueError(f"seed must be >= 0 (None for a random seed), got {seed}")
        object.__setattr__(self, "seed", seed)
        if not isinstance(self.logprobs, (bool, np.bool_)):
            raise GGMLValueError(f"logprobs must be a bool, got {self.logprobs!r}")
        object.__setattr__(self, "logprobs", bool(self.logprobs))
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        object.__setattr__(self, "dry_sequence_breakers", _breakers(self.dry_sequence_breakers))
        object.__setattr__(self, "samplers", parse_samplers(self.samplers))
        if self.logits_processor is not None and not callable(self.logits_processor):
            raise GGMLValueError(f"logits_processor must be callable, got {type(self.logits_processor).__name__}")
        object.__setattr__(self, "_constraint", self._compile_constraint())

    def _compile_constraint(self):
        """The grammar the output must follow (compiled now: a grammar or schema that does not compile
        fails here, before any request runs), or None."""
        from .grammar import Grammar

        g, schema = self.grammar, self.json_schema
        if g is not None and schema is not None:
            raise GGMLValueError("grammar and json_schema given together: constrain the output one way")
        if schema is not None:
            if isinstance(schema, Mapping):
                # kept as canonical JSON text: hashable, and the caller's dict may change afterwards
                object.__setattr__(self, "json_schema", json.dumps(schema, sort_keys=True))
            return Grammar.json_schema(self.json_schema)
        if g is None:
            return None
        if isinstance(g, Grammar):
            return g
        if isinstance(g, str):
            # llama.cpp's convention: text that starts with %llguidance is llguidance's Lark
            return Grammar.lark(g) if g.lstrip().startswith("%llguidance") else Grammar.gbnf(g)
        raise GGMLValueError(f"grammar must be GBNF text or a ggmlpy.sampling.grammar.Grammar, got "
                             f"{type(g).__name__}")

    @property
    def constraint(self):
        """The compiled :class:`~ggmlpy.sampling.grammar.Grammar` of ``grammar`` or ``json_schema``, or None."""
        return self._constraint

    @property
    def greedy(self) -> bool:
        """True when the draw is the arg-max (``temperature == 0``)."""
        return self.temperature == 0.0

    def __repr__(self) -> str:
        # only what differs from the defaults: 29 fields are unreadable
        diff = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                if getattr(self, f.name) != getattr(_PLAIN, f.name, None)]
        return f"SamplingParams({', '.join(diff)})"


_PLAIN: Any = None
_PLAIN = SamplingParams()

#: SamplingParams' fields a caller may give as keywords (all but the object itself)
FIELDS = tuple(f.name for f in fields(SamplingParams))


def gguf_sampling_defaults(metadata: Mapping) -> dict:
    """The sampling defaults a model file recommends: its ``general.sampling.*`` keys (the model maker's,
    written by llama.cpp's converter from ``generation_config.json``), as ``SamplingParams`` fields.

    ``general.sampling.sequence`` is the chain's order (``;``-separated names). A value that is not a
    number of the right kind, or out of the field's range, is left out (with the others kept), as
    llama.cpp's ``strtol``/``strtof`` reading leaves its default: a file's suggestion never makes a
    request fail.
    """
    out: dict = {}
    seq = metadata.get("general.sampling.sequence")
    if isinstance(seq, str) and seq.strip():
        try:
            out["samplers"] = parse_samplers(seq)
        except GGMLValueError:
            pass
    for key, name in GGUF_SAMPLING_KEYS.items():
        v = metadata.get(key)
        if v is None or isinstance(v, bool) or not isinstance(v, numbers.Real):
            continue
        if name in _INTS:
            if not float(v).is_integer():
                continue
            v = int(v)
        try:
            SamplingParams(**{name: v})
        except GGMLValueError:
            continue
        out[name] = v
    return out


def sampling_params(where: str, sampling: Optional[SamplingParams] = None, defaults: Optional[Mapping] = None,
                    **settings) -> SamplingParams:
    """A request's :class:`SamplingParams`: ``sampling``, or the keyword ``settings`` that are not None over
    ``defaults`` (a model's :func:`gguf_sampling_defaults`) over the table's; both ``sampling`` and a
    setting is an error. A ``sampling`` object is taken whole: the model's defaults do not change it.

    Raises
    ------
    GGMLValueError
        ``sampling`` and a setting given together (the message names both), a setting out of range, or
        an unknown setting.
    GGMLTypeError
        ``sampling`` is not a SamplingParams.

    Examples
    --------
    >>> sampling_params("generate", temperature=0, seed=1).greedy
    True
    >>> sampling_params("generate", SamplingParams(top_k=5)).top_k
    5
    >>> sampling_params("generate", defaults={"top_k": 20}, top_p=0.5).top_k
    20
    """
    given = {k: v for k, v in settings.items() if v is not None}
    unknown = sorted(set(given) - set(FIELDS))
    if unknown:
        raise GGMLValueError(f"{where}: unknown sampling setting(s) {', '.join(unknown)}")
    if sampling is None:
        return SamplingParams(**{**(defaults or {}), **given})
    if not isinstance(sampling, SamplingParams):
        raise GGMLTypeError(f"{where}: sampling must be a SamplingParams, got {type(sampling).__name__}")
    if given:
        names = ", ".join(f"{k}=" for k in given)
        raise GGMLValueError(f"{where}: sampling= and {names} given together: put every setting in one place, "
                             f"SamplingParams({names.replace('=, ', '=..., ')}...) or the keywords alone")
    return sampling


def sampling_keywords(fn: Callable) -> Callable:
    """Give a request method every :class:`SamplingParams` field as a keyword-only parameter (default None:
    not given), from the one list, the dataclass's fields: ``fn`` takes them through ``**settings``, and
    its signature (``help()``, ``inspect.signature``) lists each by name after its own parameters. A
    keyword that is neither ``fn``'s nor a field is a TypeError, as for any function."""
    import functools
    import inspect

    sig = inspect.signature(fn)
    own = [p for p in sig.parameters.values() if p.kind != p.VAR_KEYWORD]
    have = {p.name for p in own}
    types = {f.name: f.type for f in fields(SamplingParams)}
    extra = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=f"Optional[{types[n]}]")
             for n in FIELDS if n not in have]
    full = sig.replace(parameters=own + extra)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            full.bind(*args, **kwargs)
        except TypeError as e:
            raise GGMLTypeError(f"{fn.__name__}(): {e}") from None
        return fn(*args, **kwargs)

    wrapper.__signature__ = full          # type: ignore[attr-defined]
    return wrapper
