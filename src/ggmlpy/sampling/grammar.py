"""Constrained output: GBNF, Lark, regular expressions and JSON schemas, through llguidance.

A :class:`Grammar` is compiled once from its text (llama.cpp's GBNF, llguidance's Lark, a regular
expression, a JSON schema or OpenAI's ``response_format``) and reused by every request. Each
request gets its own :class:`GrammarMatcher` from :meth:`Grammar.matcher`, which knows the
vocabulary (a :class:`VocabBridge`, built once per :class:`~ggmlpy.tokenizer.Tokenizer`) and,
before each sampling step, sets every token the grammar does not allow to ``-inf``
(:meth:`GrammarMatcher.apply`); the sampled token is then fed back with
:meth:`GrammarMatcher.accept`. The engine is `llguidance <https://github.com/guidance-ai/llguidance>`_,
the one llama.cpp builds in as its alternative to its own grammar sampler: an Earley parser over a
lazily built lexer DFA, walking a trie of the vocabulary's byte pieces, in Rust.

How it is used (the runner does this for each generated token)::

    grammar = Grammar.json_schema({"type": "object", "properties": {"n": {"type": "integer"}}})
    m = grammar.matcher(tokenizer)          # tokenizer: ggmlpy.tokenizer.Tokenizer (or a VocabBridge)
    while not m.is_stopped:
        m.prepare()                         # optional: the next mask, while the forward pass runs
        logits = ...                        # float32, one row of n_vocab (the model's)
        m.apply(logits)                     # disallowed tokens -> -inf, in place
        token = sample(logits)
        m.accept(token)                     # True; False (state unchanged) for a refused token
    m.reason                                # why it stopped: "eos", "grammar end", or an error

Failing closed
--------------
* A grammar or schema that does not compile raises :class:`~ggmlpy.GGMLValueError` naming the
  grammar kind and llguidance's message (with the line and column where it has one): the
  constructors check the syntax, :meth:`Grammar.matcher` compiles the lexer against the vocabulary.
  Either way it raises before a token is generated. JSON schema keywords llguidance does not
  implement are errors too, never ignored.
* The engine works under bounded :class:`llguidance.LLParserLimits` (:data:`LIMITS`): a grammar
  whose lexer or parser would grow past them (huge repetition counts, regular expressions with an
  exponential DFA) fails to compile, or, when the limit is met later in a generation, stops the
  matcher with an error reason. It never runs unbounded.
* A generation that can no longer continue under its grammar (the engine's error, a limit) makes
  :attr:`GrammarMatcher.is_error` true; :meth:`GrammarMatcher.apply` then allows only the
  end-of-generation tokens, so the generation ends, and :attr:`GrammarMatcher.reason` says why. A
  matcher is never silently unconstrained.

The vocabulary
--------------
llguidance matches bytes, so :class:`VocabBridge` gives it each token's bytes as ggmlpy's
tokenizer decodes them (GPT-2 byte-level pieces mapped back to bytes, SPM's ``▁`` as a space,
``<0xNN>`` byte tokens as their byte), and marks control and unknown tokens (and user-defined
tokens written like ``<...>``, as llguidance's own llama.cpp bridge does) as special: plain text in
a grammar never produces them; a Lark grammar can name one (``<|im_start|>``). The tokenize callback
llguidance uses for forced text is the tokenizer's own :meth:`~ggmlpy.tokenizer.Tokenizer.encode`
(without BOS and without SPM's space prefix). End of generation is every id in the tokenizer's
``eog`` (end-of-turn first, as llama.cpp picks it).

The GIL
-------
llguidance releases the GIL while it builds a matcher and while it computes a mask
(``unsafe_compute_mask_ptr``), so :meth:`GrammarMatcher.prepare` can run on the thread that waits for
the forward pass, or alongside it, while other Python threads run. ``consume_token`` and the checks
hold it (they take microseconds).
"""

from __future__ import annotations

import json
import threading
import time
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np

from ggmlpy._core import GGMLTypeError, GGMLValueError

__all__ = ["LIMITS", "Grammar", "GrammarMatcher", "VocabBridge"]

#: The bounds every grammar compiles and runs under: llguidance's :class:`~llguidance.LLParserLimits`
#: arguments. llguidance's own defaults (lexer fuel 1,000,000 to build and 200,000 per token,
#: 250,000 lexer states of 1-2 kB each, 50,000 Earley items per token, 2,000 items per row, 500,000
#: grammar symbols) already bound a request to tens of milliseconds a token and a few hundred MB;
#: ggmlpy lowers the lexer states to 100,000 (memory) and the grammar size to 250,000, far above what
#: the JSON schemas and llama.cpp's example grammars in the tests need.
LIMITS = {
    "max_items_in_row": 2000,
    "initial_lexer_fuel": 1_000_000,
    "step_lexer_fuel": 200_000,
    "step_max_items": 50_000,
    "max_lexer_states": 100_000,
    "max_grammar_size": 250_000,
    # errors name the problem, without the parser's state and the whole grammar (a 20,000-way
    # alternative makes a 200 kB message otherwise)
    "verbose_errors": False,
}

#: JSON schema compile options (llguidance's ``JsonCompileOptions``), before the schema's own
#: ``"x-guidance"``: JSON whitespace is allowed where JSON allows it (models write pretty JSON), but
#: at most 20 characters of it at each place, as llama.cpp's own schema grammars bound it, so a
#: model cannot loop on whitespace forever.
JSON_OPTIONS = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,20}"}

#: The kinds of :class:`Grammar`.
KINDS = ("gbnf", "lark", "regex", "json_schema", "json_object")


def _llg():
    # imported on first use: tokenizing and sampling without a grammar never load the extension
    import llguidance

    return llguidance


def _limits():
    return _llg().LLParserLimits(**LIMITS)


def _one_line(msg: str) -> str:
    """llguidance's message: kept whole (a source excerpt with a caret spans lines), trailing space cut,
    at most 2,000 characters (a grammar's excerpt can be long)."""
    # verbose_errors=False leaves a "<non-verbose/>" marker where the long form would go: not for a reader
    msg = msg.replace("<non-verbose/>", "").strip()
    return msg if len(msg) <= 2000 else msg[:2000] + " [...]"


# ---------------------------------------------------------------------------------------------------
# the vocabulary


class _Encoder:
    """What llguidance's :class:`~llguidance.TokenizerWrapper` wraps: the vocabulary's byte pieces,
    its special ids and a tokenize callback. The callback is called (with the GIL) for text the
    grammar forces; it must not raise (a Python exception there is a Rust panic), so text the
    tokenizer refuses falls back to llguidance's greedy tokenization over the same pieces."""

    def __init__(self, tokenizer, tokens: list[bytes], special: list[int], eos: int) -> None:
        import copy

        # SPM (and SPM-style BPE) put a space before text at the start of an encode; llguidance asks
        # for the tokens of a piece of text in the middle of a generation, so without it. A shallow
        # copy: the engine and tables are shared, read-only.
        if getattr(tokenizer, "add_space_prefix", False) and tokenizer.kind in ("SPM", "BPE"):
            tokenizer = copy.copy(tokenizer)
            tokenizer.add_space_prefix = False
        self._tok = tokenizer
        self.tokens = tokens
        self.special_token_ids = special
        self.eos_token_id = eos
        self.bos_token_id = tokenizer.bos
        self.fallback = None   # the LLTokenizer, once built (its greedy tokenizer)

    def __call__(self, text: bytes | str) -> list[int]:
        try:
            return self._tok.encode(text, add_special=False, parse_special=False)
        except Exception:
            if self.fallback is None:
                raise
            s = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
            return self.fallback.greedy_tokenize(s)


class VocabBridge:
    """llguidance's view of a ggmlpy :class:`~ggmlpy.tokenizer.Tokenizer`: every token's bytes,
    the special tokens, the end-of-generation ids and a tokenize callback.

    Build it with :meth:`of`, which caches one per tokenizer (building takes about a second at a
    150k vocabulary). Immutable and safe to share between threads and requests.

    Attributes
    ----------
    tokenizer : Tokenizer
    n_vocab : int
        The tokenizer's vocabulary size; a model's logits may be longer (padding rows), and those
        tokens are never allowed.
    eog : tuple of int
        The ids that end a generation, allowed when the grammar is complete; the first is the one
        llguidance calls EOS (end-of-turn when there is one, as llama.cpp picks).
    special : frozenset of int
        Tokens plain text never produces (marked with llguidance's ``0xFF`` prefix).
    build_seconds : float
        How long building took.
    ll : llguidance.LLTokenizer
        The engine's tokenizer (the escape hatch).
    """

    _cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    _cache_lock = threading.Lock()

    def __init__(self, tokenizer) -> None:
        from ggmlpy.tokenizer import TokenAttr, Tokenizer

        if not isinstance(tokenizer, Tokenizer):
            raise GGMLTypeError(f"VocabBridge: expected a ggmlpy.tokenizer.Tokenizer, not {type(tokenizer).__name__}")
        t0 = time.perf_counter()
        n = tokenizer.n_vocab
        special_attr = int(TokenAttr.CONTROL | TokenAttr.UNKNOWN)
        user = int(TokenAttr.USER_DEFINED)
        tokens: list[bytes] = []
        special: list[int] = []
        for i in range(n):
            piece = tokenizer.token_to_piece(i, special=True)
            attr = int(tokenizer.token_attr(i))
            # llguidance's llama.cpp bridge: control tokens, and user-defined ones that look like
            # markup, are special (an unknown token's text is "<unk>": it is not text either)
            if attr & special_attr or (attr & user and piece.startswith(b"<") and piece.endswith(b">")):
                special.append(i)
            tokens.append(piece)
        eog = sorted(tokenizer.eog)
        first = tokenizer.eot if tokenizer.eot is not None else tokenizer.eos
        if first is None or first not in tokenizer.eog:
            first = eog[0] if eog else None
        if first is None:
            raise GGMLValueError(f"VocabBridge: {tokenizer.source} defines no end-of-generation token; a "
                                 f"grammar needs one to let a generation end")
        self.eog: tuple[int, ...] = (first, *(t for t in eog if t != first))
        llg = _llg()
        self._encoder = _Encoder(tokenizer, tokens, special, first)
        try:
            self.ll = llg.LLTokenizer(llg.TokenizerWrapper(self._encoder), eos_token=list(self.eog))
        except ValueError as e:
            raise GGMLValueError(f"VocabBridge: llguidance refused {tokenizer.source}'s vocabulary: {e}") from None
        self._encoder.fallback = self.ll
        if self.ll.vocab_size != n:   # llguidance adds a token only when there is no EOS
            raise GGMLValueError(f"VocabBridge: llguidance sized the vocabulary {self.ll.vocab_size}, the "
                                 f"tokenizer has {n}")
        self.tokenizer = tokenizer
        self.n_vocab = n
        self.special = frozenset(special)
        self.build_seconds = time.perf_counter() - t0

    @classmethod
    def of(cls, tokenizer) -> VocabBridge:
        """The bridge of ``tokenizer``, built on first use and kept as long as the tokenizer lives.

        Raises
        ------
        GGMLTypeError
            ``tokenizer`` is not a :class:`~ggmlpy.tokenizer.Tokenizer` (or a bridge, returned as is).
        GGMLValueError
            The vocabulary has no end-of-generation token.
        """
        if isinstance(tokenizer, VocabBridge):
            return tokenizer
        # one lock for all: builds are rare and a second thread asking for the same vocabulary
        # should wait for the first build rather than make its own
        with cls._cache_lock:
            try:
                bridge = cls._cache.get(tokenizer)
            except TypeError:
                bridge = None
            if bridge is None:
                bridge = cls(tokenizer)
                cls._cache[tokenizer] = bridge
            return bridge

    def __repr__(self) -> str:
        return f"VocabBridge(n_vocab={self.n_vocab}, eog={list(self.eog)}, special={len(self.special)})"


# ---------------------------------------------------------------------------------------------------
# grammars


class Grammar:
    """A compiled grammar: immutable, reusable by any number of requests and threads.

    Made with :meth:`gbnf`, :meth:`lark`, :meth:`regex`, :meth:`json_schema`, :meth:`json_object`
    or :meth:`from_response_format`; each checks the grammar's syntax and raises on an error.
    :meth:`matcher` compiles it against a vocabulary for one request.

    Attributes
    ----------
    kind : str
        One of ``"gbnf"``, ``"lark"``, ``"regex"``, ``"json_schema"``, ``"json_object"``.
    source : str
        The text it was made from (a JSON schema as JSON text).
    """

    __slots__ = ("_ll", "kind", "source", "_note")

    def __init__(self, *args, **kwargs) -> None:
        raise GGMLTypeError("Grammar cannot be constructed directly; use Grammar.gbnf(), .lark(), .regex(), "
                        ".json_schema(), .json_object() or .from_response_format()")

    @classmethod
    def _make(cls, kind: str, source: str, ll: str) -> Grammar:
        msg = _llg().LLMatcher.validate_grammar(ll, None, limits=_limits())
        if msg:
            raise GGMLValueError(f"{kind} grammar: {_one_line(msg)}")
        g = object.__new__(cls)
        object.__setattr__(g, "kind", kind)
        object.__setattr__(g, "source", source)
        object.__setattr__(g, "_ll", ll)
        object.__setattr__(g, "_note", "")
        return g

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Grammar is immutable")

    def __repr__(self) -> str:
        src = self.source if len(self.source) <= 60 else self.source[:57] + "..."
        return f"Grammar.{self.kind}({src!r}{self._note})"

    # ------------------------------------------------------------------ constructors

    @classmethod
    def gbnf(cls, text: str, *, lexemes: bool = False) -> Grammar:
        """A grammar in llama.cpp's GBNF (``root ::= ...``), with llama.cpp's meaning: parsed by
        llguidance's converter, then every rule kept a parser rule and every lexeme one character
        (:mod:`ggmlpy.sampling.gbnf`), so it accepts exactly the text llama.cpp's engine accepts.

        Parameters
        ----------
        lexemes : bool
            ``True``: llguidance's own conversion instead, rules made only of characters becoming
            greedy lexemes: a mask ~30x cheaper on character-heavy grammars (json.gbnf at a 152k
            vocabulary: ~0.07 ms a token against ~5 ms), but text llama.cpp accepts may be refused
            (arithmetic.gbnf's ``x=1\\n``: its trailing ``ws`` swallows the newline the line needs).

        Raises
        ------
        GGMLValueError
            GBNF that does not parse (the message gives the line and the text around the error), a rule
            that is used but not defined, no ``root`` rule.
        """
        text = _text(text, "gbnf")
        if lexemes:
            from llguidance.gbnf_to_lark import gbnf_to_lark
        else:
            from .gbnf import gbnf_to_lark

        try:
            lark = gbnf_to_lark(text)
        except RecursionError:
            raise GGMLValueError("gbnf grammar: nested too deeply to convert") from None
        except Exception as e:   # GbnfToLarkError, and plain Exception for rule errors
            raise GGMLValueError(f"gbnf grammar: {e}") from None
        g = cls._make("gbnf", text, _llg().LLMatcher.grammar_from_lark(lark))
        if lexemes:
            object.__setattr__(g, "_note", ", lexemes=True")
        return g

    @classmethod
    def lark(cls, text: str) -> Grammar:
        """A grammar in llguidance's Lark dialect (``start: ...``; see llguidance's ``docs/syntax.md``;
        ``%json {...}`` embeds a JSON schema, ``<|name|>`` a special token).

        Raises
        ------
        GGMLValueError
            Lark that does not compile (the message gives the line and column).
        """
        text = _text(text, "lark")
        return cls._make("lark", text, _llg().LLMatcher.grammar_from_lark(text))

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        """Text that matches ``pattern`` whole (Rust ``regex`` syntax: no look-around, no back-references).

        Raises
        ------
        GGMLValueError
            A pattern that does not compile.
        """
        pattern = _text(pattern, "regex")
        return cls._make("regex", pattern, _llg().LLMatcher.grammar_from_regex(pattern))

    @classmethod
    def json_schema(cls, schema: Mapping | str | bool) -> Grammar:
        """JSON text that validates against ``schema`` (a dict, its JSON text, or ``True``).

        Objects, arrays (``minItems``/``maxItems``), ``enum``/``const``, numbers and integers with
        bounds, strings (``minLength``/``maxLength``, ``pattern``, common ``format``), ``required``,
        ``additionalProperties``, ``anyOf``/``oneOf``/``allOf``, ``$ref``/``$defs``. Whitespace is
        :data:`JSON_OPTIONS`' unless the schema's top-level ``"x-guidance"`` says otherwise.

        Raises
        ------
        GGMLValueError
            Text that is not JSON; a schema that is not an object (or a boolean); a keyword or format
            llguidance does not implement, or an invalid one (the message names it): never ignored.
        """
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise GGMLValueError(f"json_schema grammar: the schema is not JSON: {e}") from None
        if isinstance(schema, Mapping):
            schema = dict(schema)
        elif not isinstance(schema, bool):
            raise GGMLValueError(f"json_schema grammar: the schema must be a JSON object, not "
                                 f"{type(schema).__name__}")
        try:
            source = json.dumps(schema, ensure_ascii=False, sort_keys=True, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise GGMLValueError(f"json_schema grammar: the schema is not JSON: {e}") from None
        try:
            ll = _llg().LLMatcher.grammar_from_json_schema(source, defaults=dict(JSON_OPTIONS))
        except ValueError as e:
            raise GGMLValueError(f"json_schema grammar: {e}") from None
        return cls._make("json_schema", source, ll)

    @classmethod
    def json_object(cls) -> Grammar:
        """Any JSON object (OpenAI's ``{"type": "json_object"}``)."""
        g = cls.json_schema({"type": "object"})
        object.__setattr__(g, "kind", "json_object")
        return g

    @classmethod
    def from_response_format(cls, rf: Mapping | None) -> Grammar | None:
        """The grammar of an OpenAI ``response_format``; None for ``{"type": "text"}`` (or None).

        ``{"type": "json_object"}`` is :meth:`json_object`; ``{"type": "json_schema", "json_schema":
        {"name": ..., "schema": {...}, "strict": ...}}`` is :meth:`json_schema` of ``schema``. The
        schema is always enforced, ``strict`` or not (OpenAI's non-strict mode only hopes for it).

        Raises
        ------
        GGMLValueError
            Not a dict, an unknown ``type``, a ``json_schema`` without a ``schema`` object, or a
            schema :meth:`json_schema` refuses.
        """
        if rf is None:
            return None
        if not isinstance(rf, Mapping):
            raise GGMLValueError(f"response_format must be an object, not {type(rf).__name__}")
        kind = rf.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls.json_object()
        if kind != "json_schema":
            raise GGMLValueError(f"response_format: unknown type {kind!r} (expected 'text', 'json_object' or "
                                 f"'json_schema')")
        spec = rf.get("json_schema")
        if not isinstance(spec, Mapping):
            raise GGMLValueError("response_format: type 'json_schema' needs a 'json_schema' object with a "
                                 "'schema'")
        name = spec.get("name")
        if name is not None and not isinstance(name, str):
            raise GGMLValueError(f"response_format: json_schema.name must be a string, not {type(name).__name__}")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise GGMLValueError(f"response_format: json_schema.strict must be a boolean, not "
                                 f"{type(strict).__name__}")
        schema = spec.get("schema")
        if not isinstance(schema, (Mapping, bool)):
            raise GGMLValueError("response_format: json_schema.schema must be a JSON schema object"
                                 + (f" ({name!r})" if name else ""))
        return cls.json_schema(schema)

    # ------------------------------------------------------------------ matching

    def matcher(self, vocab) -> GrammarMatcher:
        """A fresh :class:`GrammarMatcher` for one request, against ``vocab`` (a :class:`VocabBridge`,
        or a :class:`~ggmlpy.tokenizer.Tokenizer`, whose cached bridge is used).

        The lexer is compiled here, for this vocabulary (llguidance releases the GIL meanwhile).

        Raises
        ------
        GGMLValueError
            The grammar does not compile against the vocabulary (a limit of :data:`LIMITS`, a special
            token it names that the vocabulary lacks); the message says which.
        """
        bridge = VocabBridge.of(vocab)
        m = _llg().LLMatcher(bridge.ll, self._ll, log_level=0, limits=_limits())
        if m.is_error():
            raise GGMLValueError(f"{self.kind} grammar: {_one_line(m.get_error())}")
        return GrammarMatcher._new(self, bridge, m)


def _text(text: Any, kind: str) -> str:
    if not isinstance(text, str):
        raise GGMLTypeError(f"{kind} grammar: the grammar must be a str, not {type(text).__name__}")
    if not text.strip():
        raise GGMLValueError(f"{kind} grammar: the grammar is empty")
    return text


# ---------------------------------------------------------------------------------------------------
# one request


#: llguidance's stop reasons that end a generation normally (the rest are errors)
_NORMAL_STOPS = {"EndOfSentence": "eos", "NoExtension": "grammar end", "NoExtensionBias": "grammar end"}


class GrammarMatcher:
    """One request's position in a :class:`Grammar`: the mask of allowed tokens, and the tokens
    accepted so far.

    Made by :meth:`Grammar.matcher`. Not for concurrent use by several requests; its methods take
    a lock, so :meth:`prepare` on one thread and :meth:`apply` or :meth:`accept` on another are
    ordered (the second waits for the first).

    Attributes
    ----------
    grammar : Grammar
    vocab : VocabBridge
    ll : llguidance.LLMatcher
        The engine's matcher (the escape hatch; calling it directly bypasses the mask cache).
    """

    def __init__(self, *args, **kwargs) -> None:
        raise GGMLTypeError("GrammarMatcher cannot be constructed directly; use Grammar.matcher(vocab)")

    @classmethod
    def _new(cls, grammar: Grammar, vocab: VocabBridge, ll) -> GrammarMatcher:
        self = object.__new__(cls)
        self.grammar = grammar
        self.vocab = vocab
        self.ll = ll
        self._lock = threading.Lock()
        n = vocab.n_vocab
        self._words = np.zeros((n + 31) // 32, dtype=np.int32)
        # the mask (llguidance's words, one bit per token), and as _compute prepares it for apply:
        # the allowed ids, or one bool per token (True: refused); valid only while _ready
        self._refused = np.zeros(n, dtype=bool)
        self._allowed_ids: np.ndarray | None = None
        self._refused_ids: np.ndarray | None = None
        self._ready = False
        self._eog = np.array(vocab.eog, dtype=np.intp)
        return self

    def __repr__(self) -> str:
        state = self.reason or ("accepting" if self.is_accepting else "running")
        return f"<GrammarMatcher {self.grammar!r} {state}>"

    # ------------------------------------------------------------------ state

    @property
    def is_accepting(self) -> bool:
        """The text so far is complete under the grammar: an end-of-generation token is allowed now."""
        return bool(self.ll.is_accepting())

    @property
    def is_stopped(self) -> bool:
        """Nothing but an end-of-generation token can follow (the grammar is complete, EOS was
        accepted, or the matcher is in error): the generation should end; :attr:`reason` says why."""
        return bool(self.ll.is_stopped())

    @property
    def is_error(self) -> bool:
        """The generation cannot continue under the grammar (a limit met, the engine's error)."""
        return bool(self.ll.is_error())

    @property
    def reason(self) -> str | None:
        """Why the matcher stopped: None while it runs; ``"eos"`` (an end-of-generation token was
        accepted in an accepting state); ``"grammar end"`` (the grammar allows nothing more);
        ``"error: <llguidance's message>"`` (the generation cannot continue under its grammar:
        a limit of :data:`LIMITS` or the engine's error; the done reason to report)."""
        if self.ll.is_error():
            return f"error: {_one_line(self.ll.get_error())}"
        if not self.ll.is_stopped():
            return None
        why = self.ll.stop_reason()
        return _NORMAL_STOPS.get(why, f"error: {why}")

    # ------------------------------------------------------------------ the mask

    def _compute(self) -> None:
        # called with the lock held; llguidance releases the GIL while it fills the words
        if self._ready:
            return
        w = self._words
        self.ll.unsafe_compute_mask_ptr(w.ctypes.data, w.nbytes)
        if self.ll.is_error():
            # fail closed: only the end-of-generation tokens, so the generation ends, and reason says why
            w[:] = 0
            u = w.view(np.uint32)
            for t in self.vocab.eog:
                u[t >> 5] |= np.uint32(1 << (t & 31))
        # How apply() will use the mask, chosen here, off the critical path (times at 152k tokens):
        # few allowed tokens (JSON's structure, a number, an enum): their ids, so apply() saves them,
        # fills the row with -inf and puts them back (~20 us); few refused (free text in a string):
        # their ids, set to -inf (~10 us); else one bool per token for np.putmask (~130 us; not
        # np.copyto(where=), which takes 4 ms on some masks).
        nz = np.flatnonzero(w)
        n = self.vocab.n_vocab
        self._allowed_ids = self._refused_ids = None
        if len(nz) * 32 <= n // 8:
            bits = np.unpackbits(w[nz].view(np.uint8), bitorder="little").reshape(-1, 32)
            row, col = np.nonzero(bits)
            self._allowed_ids = nz[row] * 32 + col
        else:
            bits = np.unpackbits(w.view(np.uint8), count=n, bitorder="little")
            np.equal(bits, 0, out=self._refused)
            if np.count_nonzero(self._refused) <= n // 8:
                self._refused_ids = np.flatnonzero(self._refused)
        self._ready = True

    def _is_allowed(self, t: int) -> bool:
        return bool((int(self._words[t >> 5]) >> (t & 31)) & 1)

    def prepare(self) -> None:
        """Compute the next mask now and keep it for :meth:`apply`, :meth:`allowed` and
        :meth:`accept`; meant to run while the forward pass computes the logits. The GIL is released
        while llguidance computes. Calling it again before the next :meth:`accept` does nothing."""
        with self._lock:
            self._compute()

    def apply(self, logits: np.ndarray) -> None:
        """Set the logit of every token the grammar does not allow now to ``-inf``, in place.

        Parameters
        ----------
        logits : numpy.ndarray
            float32, 1-D, writeable, of at least the vocabulary's :attr:`VocabBridge.n_vocab`
            entries; entries past it (a model's padding rows) are set to ``-inf`` too.

        Raises
        ------
        GGMLTypeError
            ``logits`` is not a float32 numpy array.
        GGMLValueError
            Not 1-D, read-only, or shorter than the vocabulary.
        """
        if not isinstance(logits, np.ndarray) or logits.dtype != np.float32:
            raise GGMLTypeError(f"GrammarMatcher.apply: logits must be a float32 numpy array, not "
                                f"{getattr(logits, 'dtype', type(logits).__name__)}")
        n = self.vocab.n_vocab
        if logits.ndim != 1 or logits.shape[0] < n:
            raise GGMLValueError(f"GrammarMatcher.apply: logits must be 1-D with at least n_vocab={n} entries "
                                 f"(got shape={logits.shape})")
        if not logits.flags.writeable:
            raise GGMLValueError("GrammarMatcher.apply: logits are read-only")
        with self._lock:
            self._compute()
            if self._allowed_ids is not None:
                keep = logits[self._allowed_ids]
                logits.fill(-np.inf)
                logits[self._allowed_ids] = keep
                return
            if self._refused_ids is not None:
                logits[self._refused_ids] = -np.inf
            else:
                np.putmask(logits[:n], self._refused, -np.inf)
        logits[n:] = -np.inf

    def allowed(self, token: int) -> bool:
        """Whether ``token`` is allowed now (computes the mask if :meth:`prepare` has not)."""
        t = int(token)
        if not 0 <= t < self.vocab.n_vocab:
            return False
        with self._lock:
            self._compute()
            return self._is_allowed(t)

    def accept(self, token: int) -> bool:
        """Advance past ``token``; False, and nothing changes, if the grammar does not allow it now.

        An end-of-generation token accepted in an accepting state stops the matcher
        (:attr:`reason` ``"eos"``). An allowed token past which the engine cannot advance (a limit
        of :data:`LIMITS` met while parsing it) also returns False, with :attr:`is_error` set and
        :attr:`reason` saying why: the generation must end there.
        """
        t = int(token)
        if not 0 <= t < self.vocab.n_vocab:
            return False
        with self._lock:
            self._compute()
            if not self._is_allowed(t):
                return False
            ok = self.ll.consume_token(t)
            self._ready = False
            return bool(ok)

    def forced_tokens(self) -> list[int]:
        """The tokens the grammar forces next, whatever the model says (llguidance's fast-forward
        tokens; empty when there is a choice). Not accepted: :meth:`accept` each to advance, e.g. to
        feed them to the model in one batch."""
        with self._lock:
            if self.ll.is_stopped():
                return []
            return list(self.ll.compute_ff_tokens())

    def reset(self) -> None:
        """Back to the start of the grammar, as a fresh matcher (from an error state too)."""
        with self._lock:
            if self.ll.is_error():   # llguidance's errors are sticky: a new engine matcher
                self.ll = _llg().LLMatcher(self.vocab.ll, self.grammar._ll, log_level=0, limits=_limits())
            else:
                self.ll.reset()
            self._ready = False
