"""Constrained output (ggmlpy.sampling.grammar): grammars fail closed, and every generation of a
garbage-preferring model (tests/grammar_helpers.py) over real vocabularies obeys its grammar:
JSON schemas hypothesis draws validate with jsonschema, llama.cpp's example GBNF grammars hold."""

from __future__ import annotations

import functools
import json
import re
import threading
import time

import hf_convert
import jsonschema
import numpy as np
import pytest
from grammar_helpers import generate, schemas
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ggmlpy._core import GGMLTypeError, GGMLValueError
from ggmlpy.sampling.grammar import Grammar, GrammarMatcher, VocabBridge
from ggmlpy.tokenizer import Tokenizer

pytest.importorskip("llguidance")


@pytest.fixture(scope="module")
def vocab():
    """vocab(name) -> the cached VocabBridge of llama.cpp's ggml-vocab-<name>.gguf."""
    tokenizers: dict[str, Tokenizer] = {}

    def get(name: str) -> VocabBridge:
        if name not in tokenizers:
            tokenizers[name] = Tokenizer.from_gguf(hf_convert.vocab_file(name))
        return VocabBridge.of(tokenizers[name])

    return get


@pytest.fixture(scope="module")
def gbnf():
    return hf_convert.grammars()


def _mask(m: GrammarMatcher, n: int) -> np.ndarray:
    logits = np.zeros(n, dtype=np.float32)
    m.apply(logits)
    return np.isfinite(logits)


# ------------------------------------------------------------------------------------------------
# the vocabulary bridge


@pytest.mark.parametrize("name", ["qwen2", "llama-bpe", "llama-spm", "gpt-2"])
def test_bridge_bytes_special_and_eog(vocab, name):
    b = vocab(name)
    tok = b.tokenizer
    assert b.ll.vocab_size == tok.n_vocab == b.n_vocab
    rng = np.random.default_rng(0)
    for i in [int(x) for x in rng.integers(0, tok.n_vocab, 2000)]:
        if i in b.special:
            assert b.ll.is_special_token(i)
        else:
            assert not b.ll.is_special_token(i)
            assert b.ll.decode_bytes([i]) == tok.token_to_piece(i)
    for i in b.special:
        assert b.ll.is_special_token(i)
    assert set(b.eog) == set(tok.eog) and b.ll.eos_tokens[0] == b.eog[0]
    assert VocabBridge.of(tok) is b and VocabBridge.of(b) is b


def test_bridge_spm_pieces(vocab):
    b = vocab("llama-spm")
    tok = b.tokenizer
    # SPM: "▁the" is " the", "<0x41>" is the byte 0x41; control tokens are special
    assert b.ll.decode_bytes([tok.token_id("▁the")]) == b" the"
    assert b.ll.decode_bytes([tok.token_id("<0x41>")]) == b"A"
    assert b.ll.decode_bytes([tok.token_id("<0xE2>")]) == b"\xe2"
    assert {tok.bos, tok.eos} <= b.special


def test_bridge_byte_level(vocab):
    b = vocab("qwen2")
    tok = b.tokenizer
    assert b.ll.decode_bytes([tok.token_id("Ġworld")]) == b" world"
    assert b.ll.decode_bytes([tok.token_id("Ċ")]) == b"\n"
    assert tok.token_id("<|im_start|>") in b.special


def test_tokenize_callback_has_no_space_prefix(vocab):
    # llguidance tokenizes forced text with the bridge's callback: with SPM's space prefix, "ab" would
    # come back as "▁ab" and the forced token would add a space the grammar does not have
    b = vocab("llama-spm")
    m = Grammar.regex("ab[0-9]+").matcher(b)
    forced = m.forced_tokens()
    assert b.tokenizer.decode_bytes(forced) == b"ab"
    assert all(m.accept(t) for t in forced)
    assert not m.is_accepting


def test_bridge_built_once_across_threads():
    tok = Tokenizer.from_gguf(hf_convert.vocab_file("gpt-2"))   # a fresh tokenizer: no bridge yet
    got: list[VocabBridge] = []
    threads = [threading.Thread(target=lambda: got.append(VocabBridge.of(tok))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 3 and got[0] is got[1] is got[2]


def test_bridge_refuses_other_objects():
    with pytest.raises(GGMLTypeError, match="Tokenizer"):
        VocabBridge.of("qwen2")


# ------------------------------------------------------------------------------------------------
# fail closed


@pytest.mark.parametrize("make, pattern", [
    (lambda: Grammar.gbnf('root ::= "a" ('), r"gbnf grammar: Expected '\)' at line 1"),
    (lambda: Grammar.gbnf('root ::= item\n'), r"gbnf grammar: Rule 'item' not found"),
    (lambda: Grammar.gbnf('item ::= "a"'), r"gbnf grammar: No 'root' rule"),
    (lambda: Grammar.gbnf("   "), r"gbnf grammar: the grammar is empty"),
    (lambda: Grammar.lark("start: foo"), r"lark grammar: at 1\(8\): unknown name: \"foo\""),
    (lambda: Grammar.lark('start: "a" b\nb: /[/'), r"lark grammar: .*regex"),
    (lambda: Grammar.regex("(ab"), r"regex grammar: .*(unclosed|parse)"),
    (lambda: Grammar.json_schema({"type": "foo"}), r"json_schema grammar: .*foo"),
    (lambda: Grammar.json_schema({"type": "string", "format": "not-a-format"}),
     r"json_schema grammar: .*not-a-format"),
    (lambda: Grammar.json_schema('{"type": '), r"json_schema grammar: the schema is not JSON"),
    (lambda: Grammar.json_schema([1, 2]), r"json_schema grammar: the schema must be a JSON object, not list"),
    (lambda: Grammar.json_schema({"type": "integer", "minimum": 5, "maximum": 1}), r"json_schema grammar"),
    (lambda: Grammar.from_response_format({"type": "xml"}), r"unknown type 'xml'"),
    (lambda: Grammar.from_response_format({"type": "json_schema"}), r"needs a 'json_schema' object"),
    (lambda: Grammar.from_response_format({"type": "json_schema", "json_schema": {"name": "x"}}),
     r"json_schema.schema must be a JSON schema object \('x'\)"),
    (lambda: Grammar.from_response_format({"type": "json_schema", "json_schema": {"schema": {"type": 3}}}),
     r"json_schema grammar"),
])
def test_bad_grammars_raise(make, pattern):
    with pytest.raises(GGMLValueError, match=pattern):
        make()


def test_grammar_is_immutable_and_not_constructible():
    g = Grammar.regex("a+")
    with pytest.raises(AttributeError):
        g.kind = "lark"
    with pytest.raises(TypeError, match="Grammar.gbnf"):
        Grammar()
    with pytest.raises(TypeError, match="Grammar.matcher"):
        GrammarMatcher()
    with pytest.raises(GGMLTypeError):
        Grammar.lark(b"start: a")


def test_unknown_special_token_fails_at_matcher(vocab):
    g = Grammar.lark('start: <|no_such_token|> "x"')   # syntax is fine; the vocabulary lacks it
    with pytest.raises(GGMLValueError, match="lark grammar: .*no_such_token"):
        g.matcher(vocab("qwen2"))


def test_hostile_grammar_is_bounded(vocab):
    # 20,000 alternatives that share a first letter: after "w" one Earley row holds them all, past
    # LIMITS["max_items_in_row"], and the engine stops instead of spending time and memory on it; the
    # generation can then only end, and says why
    b = vocab("qwen2")
    g = Grammar.lark("start: " + " | ".join(f'"w{i}"' for i in range(20000)))
    t0 = time.perf_counter()
    m = g.matcher(b)
    w = b.tokenizer.token_id("w")
    assert m.allowed(w) and not m.is_error
    assert not m.accept(w)   # allowed, but the engine meets the limit while advancing past it
    allowed = _mask(m, b.n_vocab)
    assert time.perf_counter() - t0 < 30
    assert m.is_error and m.is_stopped
    assert m.reason.startswith("error: ") and "max is 2000" in m.reason and len(m.reason) < 2100
    assert set(np.flatnonzero(allowed)) == set(b.eog)
    assert not m.accept(b.tokenizer.token_id("1"))


# ------------------------------------------------------------------------------------------------
# the matcher


def test_apply_pads_and_checks_logits(vocab):
    b = vocab("gpt-2")
    m = Grammar.regex("[0-9]+").matcher(b)
    logits = np.zeros(b.n_vocab + 7, dtype=np.float32)
    m.apply(logits)
    assert np.isneginf(logits[b.n_vocab:]).all()
    ok = np.flatnonzero(np.isfinite(logits))
    assert len(ok) > 10 and all(b.tokenizer.decode([i]).isdigit() for i in [int(x) for x in ok])
    with pytest.raises(GGMLValueError, match="at least n_vocab"):
        m.apply(np.zeros(b.n_vocab - 1, dtype=np.float32))
    with pytest.raises(GGMLTypeError, match="float32"):
        m.apply(np.zeros(b.n_vocab, dtype=np.float64))
    with pytest.raises(GGMLValueError, match="1-D"):
        m.apply(np.zeros((1, b.n_vocab), dtype=np.float32))
    assert not m.allowed(b.n_vocab + 3) and not m.accept(b.n_vocab + 3)
    assert not m.allowed(b.eog[0]) and not m.is_accepting
    assert all(m.accept(t) for t in b.tokenizer.encode("12", add_special=False))
    assert m.is_accepting and not m.is_stopped and m.allowed(b.eog[0]) and m.reason is None
    assert m.accept(b.eog[0]) and m.is_stopped and m.reason == "eos"


def test_accept_refuses_without_changing_state(vocab):
    b = vocab("qwen2")
    tok = b.tokenizer
    m = Grammar.json_schema({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}).matcher(b)
    before = _mask(m, b.n_vocab)
    assert not m.accept(tok.token_id("hello")) and not m.is_error
    assert (before == _mask(m, b.n_vocab)).all()
    for t in tok.encode('{"n": 12', add_special=False):
        assert m.accept(t)
    assert not m.is_accepting and not m.allowed(b.eog[0])
    assert m.accept(tok.token_id("}"))
    # the object is closed: nothing but the end can follow
    assert m.is_accepting and m.is_stopped and m.reason == "grammar end"
    assert list(np.flatnonzero(_mask(m, b.n_vocab))) == sorted(b.eog)
    assert m.accept(b.eog[0]) and m.reason in ("eos", "grammar end")
    m.reset()
    assert m.reason is None and (_mask(m, b.n_vocab) == before).all()


def test_reset_after_error(vocab):
    b = vocab("gpt-2")
    m = Grammar.lark("start: " + " | ".join(f'"w{i}"' for i in range(3000))).matcher(b)
    w = b.tokenizer.token_id("w")
    assert not m.accept(w) and m.is_error
    m.reset()   # a fresh engine matcher: llguidance's errors are sticky
    assert not m.is_error and m.reason is None and m.allowed(w)
    assert not m.accept(w)
    assert m.reason.startswith("error: ")   # the same grammar errs again at the same place: still closed


def test_prepare_matches_apply_across_threads(vocab):
    b = vocab("qwen2")
    g = Grammar.gbnf('root ::= "x" [0-9]+ ("," [a-z]+)*')
    rng = np.random.default_rng(3)
    m1, m2 = g.matcher(b), g.matcher(b)
    for _ in range(12):
        logits = rng.random(b.n_vocab, dtype=np.float32)
        l1, l2 = logits.copy(), logits.copy()
        th = threading.Thread(target=m2.prepare)   # the runner's pattern: the mask during the forward pass
        th.start()
        th.join()
        m1.apply(l1)
        m2.apply(l2)
        assert np.array_equal(l1, l2)
        t = int(np.argmax(l1))
        assert m1.accept(t) and m2.accept(t)


def test_forced_tokens(vocab):
    b = vocab("qwen2")
    m = Grammar.regex(r"hello, world [0-9]").matcher(b)
    forced = m.forced_tokens()
    assert b.tokenizer.decode(forced).startswith("hello, world")
    for t in forced:
        assert m.accept(t)
    assert not m.forced_tokens() or not m.is_accepting


# ------------------------------------------------------------------------------------------------
# special tokens


def test_control_tokens_never_text(vocab):
    b = vocab("qwen2")
    tok = b.tokenizer
    im_start, im_end = tok.token_id("<|im_start|>"), tok.token_id("<|im_end|>")
    # any text at all: the text "<|im_start|>" can be written with ordinary tokens, never the token
    m = Grammar.regex(r"(.|\n){0,40}").matcher(b)
    ids, _ = generate(m, seed=1, budget=30)
    m = Grammar.regex(r"(.|\n){0,40}").matcher(b)
    for t in ids:
        assert not m.allowed(im_start)
        assert m.accept(t)
    assert not m.allowed(im_start)
    assert not any(t in b.special for t in ids)
    # a grammar that names it allows it, and only it
    m = Grammar.lark('start: <|im_start|> "user"').matcher(b)
    assert list(np.flatnonzero(_mask(m, b.n_vocab))) == [im_start]
    assert m.accept(im_start) and not m.allowed(im_end)


# ------------------------------------------------------------------------------------------------
# JSON schemas: every completion validates


@pytest.mark.parametrize("name", ["qwen2", "llama-bpe"])
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(schema=schemas(), seed=st.integers(0, 2**31 - 1), sample=st.booleans())
def test_json_schema_completions_validate(vocab, name, schema, seed, sample):
    b = vocab(name)
    jsonschema.Draft202012Validator.check_schema(schema)
    g = Grammar.from_response_format({"type": "json_schema",
                                      "json_schema": {"name": "t", "schema": schema, "strict": True}})
    ids, reason = generate(g.matcher(b), seed, sample=sample)
    assert reason in ("eos", "eog", "grammar end"), reason
    text = b.tokenizer.decode(ids)
    assert text.strip(), "an empty completion"
    jsonschema.validate(json.loads(text), schema)


def test_json_object(vocab):
    b = vocab("qwen2")
    g = Grammar.from_response_format({"type": "json_object"})
    assert g.kind == "json_object" and Grammar.from_response_format({"type": "text"}) is None
    for seed in range(4):
        ids, _ = generate(g.matcher(b), seed)
        assert isinstance(json.loads(b.tokenizer.decode(ids)), dict)


def test_schema_is_enforced_not_just_json(vocab):
    # a value the schema refuses can never be written: the matcher refuses the token that starts it
    b = vocab("qwen2")
    tok = b.tokenizer
    m = Grammar.json_schema({"type": "object", "properties": {"c": {"enum": ["red", "blue"]}},
                             "required": ["c"], "additionalProperties": False}).matcher(b)
    for t in tok.encode('{"c": "', add_special=False):
        assert m.accept(t)
    allowed = {tok.decode([int(i)]) for i in np.flatnonzero(_mask(m, b.n_vocab))}
    assert allowed and all("red".startswith(a) or "blue".startswith(a) for a in allowed), allowed


# ------------------------------------------------------------------------------------------------
# llama.cpp's GBNF examples


def _arith_ok(text: str) -> bool:
    """An independent parser of arithmetic.gbnf, ``(expr "=" ws term "\\n")+``, with llama.cpp's
    semantics (every way of reading the text is tried: a ws may stop before a newline)."""
    ws_end = functools.lru_cache(None)(lambda i: i if i == len(text) or text[i] not in " \t\n" else ws_end(i + 1))

    def ws(i):          # every end of a ws run from i
        return range(i, ws_end(i) + 1)

    def run(i, chars):  # the end of a run of chars (at least one) from i, else None
        j = i
        while j < len(text) and text[j] in chars:
            j += 1
        return j if j > i else None

    @functools.lru_cache(None)
    def term(i):
        out = set()
        if i < len(text) and text[i] in LOWER:
            j = run(i + 1, LOWER + DIGITS + "_") or i + 1
            out.update(ws(j))
        j = run(i, DIGITS)
        if j is not None:
            out.update(ws(j))
        if i < len(text) and text[i] == "(":
            for a in ws(i + 1):
                for e in expr(a):
                    if e < len(text) and text[e] == ")":
                        out.update(ws(e + 1))
        return frozenset(out)

    @functools.lru_cache(None)
    def expr(i):
        out, todo = set(), set(term(i))
        while todo:
            e = todo.pop()
            if e not in out:
                out.add(e)
                if e < len(text) and text[e] in "-+*/":
                    todo.update(term(e + 1))
        return frozenset(out)

    @functools.lru_cache(None)
    def lines(i):
        ends = set()
        for e in expr(i):
            if e < len(text) and text[e] == "=":
                for a in ws(e + 1):
                    ends.update(t + 1 for t in term(a) if t < len(text) and text[t] == "\n")
        return len(text) in ends or any(lines(j) for j in ends if j < len(text))

    LOWER, DIGITS = "abcdefghijklmnopqrstuvwxyz", "0123456789"
    return lines(0)


#: the finishing model for arithmetic.gbnf: it opens and closes a parenthesised term
_ARITH_FINISH = ((b"(", 95), (b")", 90), (b"=", 70), (b"\n", 60), (b"0", 40), (b"+", 30))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("name", ["json", "arithmetic", "list", "c"])
def test_llama_cpp_gbnf(vocab, gbnf, name, seed):
    b = vocab("qwen2")
    tok = b.tokenizer
    g = Grammar.gbnf(gbnf[name])
    if name == "arithmetic":   # steered from the start: a line ending in a bare term never ends
        ids, reason = generate(g.matcher(b), seed, budget=0, extra=600, finishers=_ARITH_FINISH)
    else:
        ids, reason = generate(g.matcher(b), seed, budget=60)
    assert reason in ("eos", "eog", "grammar end"), reason
    text = tok.decode(ids)
    if name == "json":
        assert isinstance(json.loads(text), dict)
    elif name == "arithmetic":
        assert _arith_ok(text), text
    elif name == "list":
        assert re.fullmatch("(- [^\r\n\x0b\x0c\x85\u2028\u2029]+\n)+", text), text
    # the same text, tokenized afresh by the tokenizer, is accepted whole by a fresh matcher
    m = g.matcher(b)
    assert all(m.accept(t) for t in tok.encode(text, add_special=False)) and m.is_accepting, text


def test_gbnf_has_llama_cpp_meaning_and_lexemes_are_opt_in(vocab, gbnf):
    # llama.cpp's engine steps one character at a time: "x=1\n" is a whole line of arithmetic.gbnf.
    # llguidance's own conversion (lexemes=True) makes `num ::= [0-9]+ ws` (ws ::= [ \t\n]*) a greedy
    # lexeme, whose ws swallows the "\n" the line needs: "x=1\n" never completes there, "x=(1)\n" does.
    # (tests/runner/test_gbnf_llama_cpp.py compares the masks with llama.cpp's at every step.)
    b = vocab("gpt-2")
    for text, greedy in (("x=1\n", False), ("x=(1)\n", True), ("(a+b)=(1)\n", True), ("x=1\ny=22\n", False)):
        ids = b.tokenizer.encode(text, add_special=False)
        for lexemes, complete in ((False, True), (True, greedy)):
            m = Grammar.gbnf(gbnf["arithmetic"], lexemes=lexemes).matcher(b)
            assert (all(m.accept(t) for t in ids) and m.is_accepting) == complete and _arith_ok(text), (text, lexemes)
    assert not _arith_ok("x=1") and not _arith_ok("x==1\n") and not _arith_ok("x=(1\n")
    for gb, text in (('root ::= [a-z]+ "ing"', "singing"), ('root ::= x "bc"\nx ::= "a" | "ab"', "abc"),
                     ('root ::= "a" . "b"', "a\nb"), ('root ::= "\\u00e9" "\\U0001F600"', "é😀")):
        m = Grammar.gbnf(gb).matcher(b)
        assert all(m.accept(t) for t in b.tokenizer.encode(text, add_special=False)) and m.is_accepting, gb
    assert repr(Grammar.gbnf('root ::= "a"', lexemes=True)) == """Grammar.gbnf('root ::= "a"', lexemes=True)"""
    assert repr(Grammar.gbnf('root ::= "a"')) == """Grammar.gbnf('root ::= "a"')"""
    with pytest.raises(GGMLValueError, match="past the last code point"):
        Grammar.gbnf('root ::= "\\U00110000"')


@pytest.mark.parametrize("name, bad", [
    ("json", '{"a": 1,}'), ("arithmetic", "x = = 1\n"), ("list", "* item\n"), ("c", "int main( {"),
])
def test_llama_cpp_gbnf_refuses(vocab, gbnf, name, bad):
    b = vocab("qwen2")
    m = Grammar.gbnf(gbnf[name]).matcher(b)
    ok = [m.accept(t) for t in b.tokenizer.encode(bad, add_special=False)]
    assert not all(ok) and not m.is_error
