"""ggmlpy.tokenizer against llama.cpp's own tokenizer, on llama.cpp's own vocabulary files.

* ``models/ggml-vocab-*.gguf.inp/.out`` (llama.cpp's test-tokenizer-0 data, from the llama-cpp-python
  sdist tests/hf_convert.py fetches): every text, ids equal;
* tests/data/tokenizer_golden.json (tools/gen_tokenizer_golden.py, written by llama.cpp 0.3.36 through
  llama-cpp-python): special-token text mixed in, each of add_special/parse_special, and detokenize
  with and without special tokens: ids and bytes equal;
* with llama-cpp-python installed, random texts (hypothesis) against it live.
"""

from __future__ import annotations

import base64
import json
import resource
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/, for hf_convert
import hf_convert  # noqa: E402

from ggmlpy.tokenizer import TokenAttr, Tokenizer, TokenizerError, TokenType  # noqa: E402

GOLDEN = json.loads(
    (Path(__file__).resolve().parents[1] / "data" / "tokenizer_golden.json").read_text(encoding="utf-8"))
#: every vocabulary ggmlpy reads (all of llama.cpp's, nomic-bert-moe the one UGM among them)
VOCABS = sorted(GOLDEN["vocabs"])
#: vocabularies with llama.cpp's reference tokenizations (.inp/.out)
WITH_TESTS = ["bert-bge", "command-r", "deepseek-coder", "deepseek-llm", "falcon", "gemma-4", "gpt-2", "llama-bpe",
              "llama-spm", "mpt", "phi-3", "qwen2", "qwen35", "refact", "starcoder"]
#: decode(encode(x)) == x: no space clean-up on decode, no lower-casing or accent stripping
LOSSLESS = ["command-r", "deepseek-coder", "deepseek-llm", "llama-spm", "phi-3", "qwen2", "qwen35"]

_cache: dict[str, Tokenizer] = {}


def tok(vocab: str) -> Tokenizer:
    if vocab not in _cache:
        _cache[vocab] = Tokenizer.from_gguf(hf_convert.vocab_file(vocab))
    return _cache[vocab]


def test_the_lists_cover_llama_cpps_files():
    assert set(WITH_TESTS) == {v for v in hf_convert.vocabs() if hf_convert.vocab_tests(v)}
    assert set(VOCABS) == set(hf_convert.vocabs())
    # a vocabulary without .inp/.out has every reference text of the others in the golden file
    texts = {c["text"] for c in GOLDEN["vocabs"]["nomic-bert-moe"]}
    assert {t for t, _ in hf_convert.vocab_tests("llama-spm")} <= texts


@pytest.mark.parametrize("vocab", WITH_TESTS)
def test_llama_cpp_reference_tokenizations(vocab):
    cases = hf_convert.vocab_tests(vocab)
    assert len(cases) >= 46
    t = tok(vocab)
    wrong = [(text, want, got) for text, want in cases if (got := t.encode(text, add_special=False)) != want]
    assert not wrong, f"{len(wrong)}/{len(cases)} differ, first: {wrong[0]!r}"


@pytest.mark.parametrize("vocab", VOCABS)
def test_special_tokens_and_decode_as_llama_cpp(vocab):
    t = tok(vocab)
    n = 0
    for case in GOLDEN["vocabs"][vocab]:
        text = case["text"]
        for key, want in case["ids"].items():
            add, parse = key[0] == "1", key[1] == "1"
            assert t.encode(text, add_special=add, parse_special=parse) == want, (text, key)
            n += 1
        ids = case["ids"]["11"]
        for rs, want in case["decode"].items():
            assert t.decode_bytes(ids, skip_special=rs == "1") == base64.b64decode(want), (text, rs)
    assert n >= 80


@pytest.mark.parametrize("vocab", LOSSLESS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(st.characters(exclude_categories=("Cs",)), max_size=80))
def test_decode_of_encode_is_the_text(vocab, text):
    t = tok(vocab)
    assert t.decode(t.encode(text, add_special=False)) == text
    # the streaming detokenizer gives the same text, never a broken character; as llama.cpp's pieces,
    # it keeps the space SPM put before the text (a generation continues a prompt: that space is text)
    d = t.detokenizer(skip_special=False)
    chunks = [d.feed(i) for i in t.encode(text, add_special=False)] + [d.flush()]
    assert "".join(chunks) == (" " + text if t.add_space_prefix and text else text)
    assert all("\ufffd" not in c for c in chunks) or "\ufffd" in text


def test_a_character_split_over_byte_tokens_is_held_back():
    t = tok("llama-spm")
    ids = t.encode("🦙", add_special=False)
    # "▁" then the four UTF-8 bytes of the llama as byte tokens (the vocabulary has no such piece)
    assert [t.token_type(i) for i in ids[-4:]] == [TokenType.BYTE] * 4
    assert [t.token_to_piece(i) for i in ids[-4:]] == [bytes([b]) for b in "🦙".encode()]
    d = t.detokenizer()
    out = [d.feed(i) for i in ids]
    assert out[-4:] == ["", "", "", "🦙"]
    assert d.pending == b""
    d.feed(ids[-4])
    assert d.pending == "🦙".encode()[:1]
    assert d.flush() == "\ufffd"          # an unfinished character at the end, replaced, not dropped


def test_vocabulary_facts():
    spm = tok("llama-spm")
    assert (spm.kind, spm.bos, spm.eos, spm.add_bos, spm.add_eos, spm.add_space_prefix) == ("SPM", 1, 2, True, False,
                                                                                            True)
    nl = spm.token_id("<0x0A>")
    assert spm.token_type(nl) == TokenType.BYTE and spm.token_to_piece(nl) == b"\n"
    assert spm.is_special(1) and spm.token_to_piece(1, special=False) == b""
    assert spm.encode("Hello") == [1, 15043] and spm.decode([1, 15043], skip_special=True) == " Hello"
    assert spm.decode([15043]) == "Hello"

    l3 = tok("llama-bpe")
    assert (l3.kind, l3.pre, l3.bos, l3.add_bos) == ("BPE", "llama-bpe", 128000, True)
    assert l3.token_text(l3.eot) == "<|eot_id|>" and l3.eot in l3.eog and l3.eos in l3.eog
    assert l3.token_attr(l3.eot) & TokenAttr.CONTROL

    q = tok("qwen2")
    assert {q.token_text(i) for i in q.eog} >= {"<|im_end|>", "<|endoftext|>"}
    assert q.encode("<|im_start|>user", parse_special=True)[0] == q.token_id("<|im_start|>")
    assert q.encode("<|im_start|>user", parse_special=False)[0] != q.token_id("<|im_start|>")
    assert q.add_bos is False and q.clean_spaces is False

    bert = tok("bert-bge")
    ids = bert.encode("Hello, World!")
    assert ids[0] == bert.bos == bert.token_id("[CLS]") and ids[-1] == bert.sep == bert.token_id("[SEP]")
    assert bert.decode(ids, skip_special=True) == " hello, world!"   # lower-cased, "," and "!" cleaned up


def test_phi3_special_tokens_eat_the_space_after_them():
    # llama.cpp gives every special token of a Phi-3 model RSTRIP, except <s>, <unk>, <|endoftext|>
    t = tok("phi-3")
    assert t.token_attr(t.token_id("<|user|>")) & TokenAttr.RSTRIP
    assert not t.token_attr(t.token_id("<s>")) & TokenAttr.RSTRIP
    assert t.encode("<|user|>  \n Hi", add_special=False, parse_special=True) == \
        [t.token_id("<|user|>")] + t.encode("Hi", add_special=False)


def test_bad_text_is_a_clear_error():
    t = tok("qwen2")
    with pytest.raises(TokenizerError, match="not valid UTF-8 at offset 3"):
        t.encode(b"abc\xff\xfe")
    assert t.encode(b"abc") == t.encode("abc")
    with pytest.raises(TokenizerError, match="lone surrogate"):
        t.encode("ok \ud800 no")
    with pytest.raises(TypeError, match="str or bytes"):
        t.encode(123)
    with pytest.raises(TokenizerError, match=r"token id 151936 is outside the vocabulary \[0, 151936\)"):
        t.decode([1, 151936])
    with pytest.raises(TokenizerError, match="outside"):
        t.token_to_piece(-1)


@pytest.mark.parametrize("vocab", ["llama-spm", "qwen2", "bert-bge"])
def test_ten_megabytes(vocab):
    t = tok(vocab)
    words = ("The quick brown fox, 1234 jumps.\nOver the lazy dog's 🦙 back " * 200_000)[:10_000_000]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    ids = t.encode(words, add_special=False)
    grew_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    # encoded in pieces, the same ids as the parts encoded alone (a cut where no token can span it)
    first = words[:words.index("\n", 100_000) + 1]
    assert ids[:len(t.encode(first, add_special=False))] == t.encode(first, add_special=False)
    if vocab in LOSSLESS:
        assert t.decode(ids) == words
    else:       # BERT: lower-cased, unknown characters as [UNK]
        assert t.decode(ids[:9]) == " the quick brown fox, 1234 jumps."
    assert grew_mb < 1500, f"peak RSS grew {grew_mb:.0f} MB"
    # a run the tokenizer cannot cut (no line or word break) over 1 Mi characters: refused, not hours
    # (BERT splits at every space and ideograph: only the letters are one word there)
    runs = ("a" * 10_000_000,) if t.kind == "WPM" else ("a" * 10_000_000, " " * 10_000_000, "漢字" * 5_000_000)
    for run in runs:
        with pytest.raises(TokenizerError, match="no place where it can be split"):
            t.encode(run)


def test_files_it_cannot_read():
    from ggmlpy.models.synthetic import synthetic_path

    with pytest.raises(TokenizerError, match=r"no tokenizer \(tokenizer.ggml.model is 'none'\)"):
        Tokenizer.from_gguf(synthetic_path("tiny"))
    from ggmlpy.gguf import GGUFReader

    with GGUFReader(hf_convert.vocab_file("nomic-bert-moe")) as r:
        ugm = dict(r.metadata)
    with pytest.raises(TokenizerError, match=r"tokenizer.ggml.model = 'rwkv' \(RWKV\) is not supported"):
        Tokenizer.from_gguf({**ugm, "tokenizer.ggml.model": "rwkv"})
    with pytest.raises(TokenizerError, match="precompiled_charsmap is malformed"):
        Tokenizer.from_gguf({**ugm, "tokenizer.ggml.precompiled_charsmap": b"\xff\xff\x00\x00abc"})
    with GGUFReader(hf_convert.vocab_file("qwen2")) as r:
        md = dict(r.metadata)
    with pytest.raises(TokenizerError, match="tokenizer.ggml.pre = 'no-such-pre'"):
        Tokenizer.from_gguf({**md, "tokenizer.ggml.pre": "no-such-pre"})
    with pytest.raises(TokenizerError, match="tokenizer.ggml.merges is missing"):
        Tokenizer.from_gguf({k: v for k, v in md.items() if k != "tokenizer.ggml.merges"})
    with pytest.raises(TokenizerError, match="token_type has 3 entries"):
        Tokenizer.from_gguf({**md, "tokenizer.ggml.token_type": md["tokenizer.ggml.token_type"][:3]})


def test_every_known_pre_tokenizer_builds_and_round_trips():
    """Each ``tokenizer.ggml.pre`` llama.cpp knows (and this table holds) compiles in the engine and
    keeps byte-level text whole (the vocabulary is GPT-2's; only the splitting differs)."""
    from ggmlpy.gguf import GGUFReader
    from ggmlpy.tokenizer._bpe import _PRE_TOKENIZERS

    with GGUFReader(hf_convert.vocab_file("gpt-2")) as r:
        md = dict(r.metadata)
    text = "Hello  world's 12345 漢字\n\n  tabs\t!?"
    for pre, cfg in _PRE_TOKENIZERS.items():
        if not cfg.byte_encode:
            continue
        t = Tokenizer.from_gguf({**md, "tokenizer.ggml.pre": pre})
        ids = t.encode(text, add_special=False)
        assert b"".join(t.token_to_piece(i) for i in ids) == text.encode(), pre



_UGM_ALPHABET = list(" \t\n\r\u3000\u00a0\u2581abcAé\u0301\u0308ｱﾞｶﾟ가\u1100\u1161\u11a8\u3131\u314f\u00bd\u2460"
                     "\U0001d400\x00\x01\x7f漢字🦙ＡＢ，") + ["<s>", "</s>", "<mask>", "<unk>", "<pad>", "[PAD250001]"]
_UGM_WORDS = ["<s>", "</s>", "<mask>", "<unk>", "<pad>", " ", "  ", "\n", "a", "Hello", "é", "🦙"]


@pytest.mark.parametrize("vocab", ["llama-spm", "llama-bpe", "qwen2", "gpt-2", "bert-bge", "gemma-4", "nomic-bert-moe"])
def test_random_text_as_llama_cpp_live(vocab):
    lc = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (optional peer)")
    llm = lc.Llama(str(hf_convert.vocab_file(vocab)), vocab_only=True, verbose=False)
    t = tok(vocab)

    texts = st.text(st.characters(exclude_categories=("Cs", "Cn")), max_size=60)
    if t.kind == "UGM":
        # what its normaliser works on: whitespace runs, charsmap keys (combining, half-width, jamo,
        # compatibility forms), the escaped space itself, special-token text, unknown characters
        texts = st.one_of(texts, st.lists(st.sampled_from(_UGM_ALPHABET), max_size=40).map("".join),
                          st.lists(st.sampled_from(_UGM_WORDS), max_size=10).map("".join))

    @settings(max_examples=150, deadline=None)
    # unassigned code points (Cn) left out: Python's Unicode tables are older than llama.cpp's
    @given(text=texts, add=st.booleans(), parse=st.booleans())
    def check(text, add, parse):
        assert t.encode(text, add, parse) == llm.tokenize(text.encode(), add_bos=add, special=parse)

    check()


def test_chat_template_of_the_file():
    q = tok("qwen2")
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
    text = q.apply_chat_template(msgs)
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert q.apply_chat_template(msgs, add_generation_prompt=False).endswith("Hi<|im_end|>\n")
    ids = q.encode(text, add_special=False, parse_special=True)
    assert ids[0] == q.token_id("<|im_start|>") and ids.count(q.token_id("<|im_end|>")) == 2
    # Phi-3's template writes bos_token: the tokenizer passes the file's BOS text
    assert tok("phi-3").apply_chat_template([{"role": "user", "content": "x"}]).startswith("<s><|user|>")
    with pytest.raises(TokenizerError, match="no tokenizer.chat_template"):
        tok("gpt-2").apply_chat_template(msgs)
    assert tok("gpt-2").apply_chat_template(msgs, template="{{ messages[1].content }}") == "Hi"


# ---------------------------------------------------------------------------------------------- UGM

def _metadata(vocab: str) -> dict:
    from ggmlpy.gguf import GGUFReader

    with GGUFReader(hf_convert.vocab_file(vocab)) as r:
        return dict(r.metadata)


def test_ugm_vocabulary_facts():
    t = tok("nomic-bert-moe")
    assert (t.kind, t.model, t.bos, t.eos, t.unk, t.pad, t.mask) == ("UGM", "t5", 0, 2, 3, 1, 250001)
    assert (t.add_bos, t.add_eos, t.add_space_prefix, t.remove_extra_whitespaces) == (True, True, True, True)
    ids = t.encode("Hello world")
    assert ids[0] == t.bos and ids[-1] == t.eos and [t.token_text(i) for i in ids[1:-1]] == ["▁Hello", "▁world"]
    # as llama.cpp: the prefix space comes off the first piece, unless a BOS was skipped before it
    assert t.decode(ids[1:-1]) == "Hello world" and t.decode(ids) == "<s> Hello world</s>"
    assert t.decode(ids, skip_special=True) == " Hello world"
    # the precompiled charsmap (NFKC and more): composed, full-width, compatibility forms
    assert t.encode("e\u0301", False) == t.encode("é", False)
    assert t.encode("ＡＢＣ　ｶﾞ", False) == t.encode("ABC ガ", False)
    # tabs and newlines are spaces; runs of spaces are one; none at the ends
    assert t.encode(" \t a \n\n  b\r\n", False) == t.encode("a b", False)
    assert t.encode(" \n ", False) == [] and t.encode(" \n ") == [t.bos, t.eos]
    # characters no token holds: one unknown token for a run of them, also across words
    unk = [t.token_id("▁"), t.unk]
    assert t.encode("🦙🦙🦙", False) == unk and t.encode("🦙 🦙", False) == unk + unk
    # the [PAD…] tokens (unused, score -10000) are in llama.cpp's search but never win it
    assert t.token_id("[PAD250001]") not in t.encode("[PAD250001]", False)
    # text after a special token gets its own space prefix; <mask> strips the spaces before it
    assert t.encode("a<s>b", False, True) == t.encode("a", False) + [t.bos] + t.encode("b", False)
    assert t.encode("a  <mask>", False, True) == t.encode("a", False) + [t.mask]


@settings(max_examples=200, deadline=None)
@given(text=st.one_of(st.text(st.characters(exclude_categories=("Cs",)), max_size=60),
                      st.text(st.sampled_from(_UGM_ALPHABET[:-6]), max_size=60)))
def test_ugm_engine_is_llama_cpps_search(text):
    """The engine (Hugging Face's Unigram, text cut into words) gives the ids of the Python search
    written after llama.cpp's, on the whole normalised text."""
    t = tok("nomic-bert-moe")
    u = t._ugm
    assert u.hf is not None
    assert t.encode(text, add_special=False) == u.viterbi(u.normalize(text))


def test_ugm_whitespace_settings():
    """The normaliser's other settings (files llama.cpp ships set both flags): without
    remove_extra_whitespaces spaces stay, each a ▁, and add_space_prefix puts one ▁ before the
    first non-space; the engine still agrees with the search."""
    md = _metadata("nomic-bert-moe")
    keep = Tokenizer.from_gguf({**md, "tokenizer.ggml.remove_extra_whitespaces": False})
    bare = Tokenizer.from_gguf({**md, "tokenizer.ggml.remove_extra_whitespaces": False,
                                "tokenizer.ggml.add_space_prefix": False})
    merge = Tokenizer.from_gguf({**md, "tokenizer.ggml.add_space_prefix": False})
    assert keep._ugm.normalize(" \ta  b ") == "▁▁▁a▁▁b▁" and bare._ugm.normalize(" \ta  b ") == "▁▁a▁▁b▁"
    assert keep._ugm.normalize("  ") == "▁▁"        # no prefix without a non-space
    assert merge._ugm.normalize(" a  b ") == "▁a▁b"  # merging puts a ▁ before every word regardless
    text = "  Hello\u3000 wörld 🦙🦙 ＡＢ\t\tx  "
    for t in (keep, bare, merge):
        u = t._ugm
        assert t.encode(text, add_special=False) == u.viterbi(u.normalize(text))
        assert t.encode(" " + text + "<s>" + text, add_special=False, parse_special=True) == \
            u.viterbi(u.normalize(" " + text)) + [t.bos] + u.viterbi(u.normalize(text))


def _small_ugm(**extra) -> dict:
    tokens = ["<pad>", "</s>", "<unk>", "▁", "a", "b", "c", "▁a", "ab", "▁ab", "bc", "<user>", "[unused]", "x"]
    scores = [0.0, 0.0, 0.0, -2.0, -3.0, -3.0, -4.0, -2.5, -3.5, -4.0, -5.0, 0.0, -1e4, -6.0]
    types = [3, 3, 2, 1, 1, 1, 1, 1, 1, 1, 1, 4, 5, 1]
    md = {"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
          "tokenizer.ggml.token_type": types, "tokenizer.ggml.add_space_prefix": True}
    md.update(extra)
    return md


def test_ugm_small_vocabulary():
    """A vocabulary made here, without a charsmap: the search by hand, user-defined tokens, unknown
    characters, and a vocabulary the engine cannot reproduce searched in Python."""
    t = Tokenizer.from_gguf(_small_ugm())
    assert (t.kind, t.bos, t.eos, t.unk, t.pad, t.add_bos, t.add_eos) == ("UGM", None, 1, 2, 0, False, True)
    assert t._ugm.hf is not None and t._ugm.unk_score == -16.0     # the lowest normal score - 10
    tid = t.token_id
    # "▁ab": one token (-4) beats "▁a" + "b" (-5.5) and "▁" + "ab" (-5.5)
    assert t.encode("ab") == [tid("▁ab"), t.eos]
    # "▁abc": "▁a" + "bc" (-7.5) beats "▁ab" + "c" (-8)
    assert t.encode("abc", False) == [tid("▁a"), tid("bc")]
    # user-defined tokens are split out of the text and each side is normalised on its own
    assert t.encode("a<user>b", False) == [tid("▁a"), tid("<user>"), tid("▁"), tid("b")]
    # unknown characters: one token for a run; the unused token never wins
    assert t.encode("zzz a", False) == [tid("▁"), t.unk, tid("▁a")]
    assert t.encode("[unused]", False)[-1] != tid("[unused]")
    for text in ("abcabc zz", "ba  cb", "x" * 40, "▁a▁"):
        assert t.encode(text, False) == t._ugm.viterbi(t._ugm.normalize(text))
    # an unused one-code-point token scored below the unknown token: the engine's minimum cannot be
    # llama.cpp's, so the search runs in Python (the unused token is searched, as llama.cpp's)
    slow = Tokenizer.from_gguf(_small_ugm(**{"tokenizer.ggml.scores": [0.0, 0.0, 0.0, -2.0, -3.0, -3.0, -4.0, -2.5,
                                                                         -3.5, -4.0, -5.0, 0.0, -1e4, -99.0],
                                             "tokenizer.ggml.token_type": [3, 3, 2, 1, 1, 1, 1, 1, 1, 1, 1, 4, 5, 5]}))
    assert slow._ugm.hf is None and slow._ugm.unk_score == -15.0
    assert slow.encode("abc x zz") == [tid("▁a"), tid("bc"), tid("▁"), tid("x"), tid("▁"), t.unk, t.eos]
    # a token with a ▁ inside ("a▁b"): texts are not cut before a ▁ that follows an "a"
    md = _small_ugm()
    md["tokenizer.ggml.tokens"] = md["tokenizer.ggml.tokens"] + ["a▁b", "b▁"]
    md["tokenizer.ggml.scores"] = md["tokenizer.ggml.scores"] + [-1.0, -1.5]
    md["tokenizer.ggml.token_type"] = md["tokenizer.ggml.token_type"] + [1, 1]
    for merge in (False, True):
        inner = Tokenizer.from_gguf({**md, "tokenizer.ggml.remove_extra_whitespaces": merge})
        assert inner._ugm.hf is not None and inner._ugm.cut.pattern.startswith("(?<![ab])")
        assert inner.encode("a b", False) == [tid("▁"), inner.token_id("a▁b")]
        for text in ("a b a  b ab b c", "▁a b▁▁c", " b  b a", "zz a zz b"):
            assert inner.encode(text, False) == inner._ugm.viterbi(inner._ugm.normalize(text)), text
    assert Tokenizer.from_gguf(_small_ugm(**{"tokenizer.ggml.unknown_token_id": 99})).unk == 2   # ignored
    # no unknown token (the default id 2 is outside a two-token vocabulary): an unknown character is
    # refused (llama.cpp would put id -1 in the output)
    for types in ([1, 1], [1, 5]):      # the engine; the search in Python (an unused "a" below "▁" - 10)
        none = Tokenizer.from_gguf({"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": ["▁", "a"],
                                    "tokenizer.ggml.scores": [-1.0, -20.0], "tokenizer.ggml.token_type": types})
        assert none.unk is None and (none._ugm.hf is None) == (types[1] == 5)
        assert none.encode("a a", False) == [1, 0, 1]       # UGM's default: no space prefix
        with pytest.raises(TokenizerError, match="no token holds and the vocabulary defines no unknown token"):
            none.encode("a z", False)


def test_ugm_ten_megabytes():
    t = tok("nomic-bert-moe")
    words = ("The quick brown fox, 1234 jumps.\nOver the lazy dog's 🦙 back " * 200_000)[:10_000_000]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    ids = t.encode(words, add_special=False)
    grew_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    first = words[:words.index("\n", 100_000)]
    assert ids[:len(t.encode(first, add_special=False))] == t.encode(first, add_special=False)
    assert t.decode(ids[:11]) == "The quick brown fox, 1234 jumps."
    assert grew_mb < 1500, f"peak RSS grew {grew_mb:.0f} MB"
    assert t.encode(" " * 10_000_000, add_special=False) == []      # spaces: nothing left to search
    for run in ("a" * 10_000_000, "漢字" * 5_000_000):
        with pytest.raises(TokenizerError, match="no place where it can be split"):
            t.encode(run)


def test_spm_file_with_remove_extra_whitespaces_loads():
    """llama.cpp reads tokenizer.ggml.remove_extra_whitespaces for every type but only UGM applies it."""
    md = _metadata("llama-spm")
    t = Tokenizer.from_gguf({**md, "tokenizer.ggml.remove_extra_whitespaces": True})
    assert t.remove_extra_whitespaces is False
    assert t.encode("a   b\n\n c") == tok("llama-spm").encode("a   b\n\n c")


def test_wpm_slow_path_is_the_fast_one():
    """The Python matcher (for a BERT vocabulary with a bare word-start token, which WordPiece cannot
    hold) gives the engine's ids on llama.cpp's test texts of two vocabularies."""
    t = tok("bert-bge")
    texts = [x for x, _ in hf_convert.vocab_tests("bert-bge") + hf_convert.vocab_tests("llama-spm")]
    assert len(texts) >= 90
    assert [t._wpm_slow(x) for x in texts] == [t._wpm(x) for x in texts]
    assert t._wpm_slow("Hello, world!") == t.encode("Hello, world!", add_special=False)
