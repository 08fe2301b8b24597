"""runner/text.py and the runner's text paths: stop strings against a character-by-character reference
(hypothesis, any chunking), the streaming text of byte tokens, the BOS rules of text and chat prompts;
then generation from text against generation from the same ids, on a tiny model with a byte-level fake
tokenizer and on a converted model with llama.cpp's real llama-bpe vocabulary and a Llama-3 chat
template (tests/text_helpers.py).

Random weights give garbage text, so every text expectation is computed from the token-id run: the
text of its tokens, cut where that text first contains a stop string.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from text_helpers import CHATML_TEMPLATE, LLAMA3_TEMPLATE, FakeTokenizer, llama_chat_gguf

from ggmlpy import GGMLTypeError, GGMLValueError
from ggmlpy.runner import DoneReason, Runner
from ggmlpy.runner.text import StopMatcher, TextStream, chat_prompt, encode_prompt, split_stops

# ---------------------------------------------------------------------------------------------- reference


def ref_cut(text: str, stops) -> tuple[str, bool]:
    """The text before the first stop string to complete, read character by character (of several
    completed by the same character, the longest); and whether one did."""
    for e in range(1, len(text) + 1):
        hit = [s for s in stops if text.endswith(s, 0, e)]
        if hit:
            return text[:e - max(map(len, hit))], True
    return text, False


def run_matcher(stops, chunks) -> tuple[str, bool, list]:
    """Push the chunks; the emitted text (with the final flush), whether it stopped, what was held."""
    m = StopMatcher(stops)
    out, helds = [], []
    for c in chunks:
        emit, stopped = m.push(c)
        out.append(emit)
        helds.append(m.held)
        if stopped:
            return "".join(out), True, helds
    out.append(m.flush())
    return "".join(out), False, helds


ALPHABET = "ab\né日"


@st.composite
def text_stops_chunks(draw):
    text = draw(st.text(alphabet=ALPHABET, max_size=40))
    stops = draw(st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), min_size=0, max_size=3))
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=12)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    return text, stops, chunks


# ---------------------------------------------------------------------------------------------- StopMatcher


@given(text_stops_chunks())
def test_stop_matcher_equals_the_reference_whatever_the_chunks(case):
    text, stops, chunks = case
    got, stopped, _ = run_matcher(stops, chunks)
    assert (got, stopped) == ref_cut(text, stops)


@given(text_stops_chunks())
def test_stop_matcher_holds_back_only_what_could_start_a_stop(case):
    text, stops, chunks = case
    m = StopMatcher(stops)
    seen = emitted = ""
    for c in chunks:
        seen += c
        emit, stopped = m.push(c)
        emitted += emit
        if stopped:
            return
        held = m.held
        assert emitted + held == seen
        # the held tail is the start of a stop string, and nothing before it could be one
        assert held == "" or any(s.startswith(held) and s != held for s in stops)
        for i in range(len(emitted)):
            assert not any(s.startswith(seen[i:]) for s in stops)


def test_stop_matcher_cases():
    assert run_matcher(["</s>"], ["Hello</", "s> world"])[:2] == ("Hello", True)
    assert run_matcher(["</s>"], ["Hello</", "p> world"])[:2] == ("Hello</p> world", False)
    assert run_matcher(["x"], ["xyz"])[:2] == ("", True)                      # at the very start
    # "bc" completes before "abcd" could: the first to complete wins, whatever the chunks
    assert run_matcher(["abcd", "bc"], ["abcd"])[:2] == ("a", True)
    assert run_matcher(["abcd", "bc"], ["a", "bc", "d"])[:2] == ("a", True)
    # completed by the same character: the longest (starting earliest)
    assert run_matcher(["b", "ab"], ["xab"])[:2] == ("x", True)
    assert run_matcher(["aab"], ["a", "a", "a", "b"])[:2] == ("a", True)      # a held tail that shifts
    m = StopMatcher(["END"])
    assert m.push("oh E") == ("oh ", False) and m.held == "E"
    assert m.push("ND and more") == ("", True) and m.matched == "END"
    assert m.push("later") == ("", True) and m.flush() == ""
    m = StopMatcher([])
    assert m.push("anything") == ("anything", False) and m.flush() == ""


def test_stop_matcher_rejects_bad_stops():
    with pytest.raises(GGMLValueError, match="empty stop string"):
        StopMatcher(["ok", ""])
    with pytest.raises(GGMLTypeError, match="expected str"):
        StopMatcher([b"bytes"])


def test_split_stops():
    assert split_stops([1, "a", np.int64(7), "bc"]) == ((1, 7), ("a", "bc"))
    assert split_stops("###") == ((), ("###",))               # a lone str is one stop string
    assert split_stops(()) == ((), ()) and split_stops(None) == ((), ())
    for bad in ([1.5], [True], [None], [b"x"]):
        with pytest.raises(GGMLTypeError, match="token id .* or a stop string"):
            split_stops(bad)
    with pytest.raises(GGMLTypeError, match="sequence of token ids and strings"):
        split_stops(5)
    with pytest.raises(GGMLValueError, match="empty stop string"):
        split_stops(["a", ""])


# ---------------------------------------------------------------------------------------------- TextStream


def test_text_stream_holds_a_character_split_across_byte_tokens():
    tok = FakeTokenizer()
    ts = TextStream(tok.detokenizer(skip_special=True))
    ja = "日".encode()                      # 3 bytes, 3 byte tokens
    assert [ts.feed(b) for b in ja] == [("", False), ("", False), ("日", False)]
    assert ts.feed(300) == ("", False)     # a control token: no text
    assert ts.feed(ja[0]) == ("", False)
    assert ts.finish() == "\ufffd"         # an unfinished character at the end
    assert ts.finish() == ""               # once


def test_text_stream_stop_string_across_a_split_character():
    tok = FakeTokenizer()
    ts = TextStream(tok.detokenizer(skip_special=True), ["é!"])
    out = []
    for b in "ab é".encode() + "é!x".encode():
        emit, stopped = ts.feed(b)
        out.append(emit)
        if stopped:
            break
    assert "".join(out) == "ab é" and stopped
    assert ts.finish() == "" and ts.feed(ord("z")) == ("", True)


# ---------------------------------------------------------------------------------------------- prompts


def test_encode_prompt_bos_rules():
    tok = FakeTokenizer()
    assert encode_prompt(tok, "hi") == [300, ord("h"), ord("i")]
    assert encode_prompt(tok, "<s>hi") == [300, ord("h"), ord("i")]             # one BOS, not two
    assert encode_prompt(tok, "<s>hi", parse_special=False) == [300, *b"<s>hi"]
    assert encode_prompt(tok, "a<|end|>") == [300, ord("a"), 301]
    assert encode_prompt(FakeTokenizer(add_bos=False), "hi") == [ord("h"), ord("i")]
    with pytest.raises(GGMLTypeError):
        encode_prompt(tok, b"hi")


def test_chat_prompt_has_exactly_one_bos():
    msgs = [{"role": "user", "content": "hi"}]
    tok = FakeTokenizer()
    ids = chat_prompt(tok, msgs)                                  # the template writes no BOS: added
    assert ids == [300, *tok.encode(tok.rendered[-1], add_special=False, parse_special=True)]
    ids = chat_prompt(tok, msgs, template="with-bos")             # it writes one: kept, not doubled
    assert ids == tok.encode(tok.rendered[-1], add_special=False, parse_special=True) and ids.count(300) == 1
    assert ids[0] == 300 and 301 in ids                           # special tokens parsed
    tok = FakeTokenizer(add_bos=False)
    assert chat_prompt(tok, msgs)[0] != 300


# ---------------------------------------------------------------------------------------------- the runner


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from hf_helpers import export_gguf, hf_model

    from ggmlpy.models import load_model

    path = export_gguf(hf_model("llama", seed=11), tmp_path_factory.mktemp("rt") / "m.gguf", "llama")
    m = load_model(path, devices="cpu")
    yield m
    m.close()


PROMPT = "hello world, the"


def stream_cut(tok, tokens, stops):
    """(tokens, text) a stop-string request must give when the same request without stops gave
    ``tokens``: it ends at the first token after which the streamed text holds a stop string."""
    det = tok.detokenizer(skip_special=True)
    text = ""
    for k, t in enumerate(tokens):
        text += det.feed(t)
        cut, hit = ref_cut(text, stops)
        if hit:
            return tokens[:k + 1], cut
    return None


def collect(handle):
    evs = list(handle)
    return evs, handle.result()


@pytest.mark.hf
def test_text_prompt_equals_its_ids(model):
    tok = FakeTokenizer()
    with Runner(model, n_ctx=96, tokenizer=tok) as rt:
        evs, r = collect(rt.submit(PROMPT, max_tokens=40, temperature=0))
        by_ids = rt.generate(tok.encode(PROMPT, parse_special=True), max_tokens=40, temperature=0)
        plain = rt.generate(tok.encode(PROMPT), max_tokens=40, detokenize=True, temperature=0)
    assert r.tokens == by_ids.tokens == plain.tokens and by_ids.text is None
    assert r.prompt_eval_count == len(PROMPT.encode()) + 1                    # BOS + one id per byte
    body = r.tokens[:-1] if r.done_reason == DoneReason.STOP else r.tokens
    assert r.text == plain.text == tok.text_of(body)
    assert "".join(e.text for e in evs) == r.text
    assert [e.token for e in evs] == r.tokens


@pytest.mark.hf
@pytest.mark.parametrize("pipeline", [False, True])
def test_stop_strings_cut_where_the_text_first_holds_one(model, pipeline):
    tok = FakeTokenizer()
    with Runner(model, n_ctx=128, tokenizer=tok, pipeline=pipeline) as rt:
        full = rt.generate(PROMPT, max_tokens=60, temperature=0)
        text = full.text
        assert len(text) > 12
        checked = 0
        for i, n in [(0, 1), (3, 2), (5, 3), (len(text) // 2, 4), (len(text) - 3, 3), (7, 1)]:
            stop = text[i:i + n]
            want = stream_cut(tok, full.tokens, [stop])
            if want is None:            # the stop string is the end's U+FFFD of an unfinished character
                continue
            evs, r = collect(rt.submit(PROMPT, max_tokens=60, stop=[stop, 9999], temperature=0))
            assert r.done_reason == DoneReason.STOP
            assert (r.tokens, r.text) == want
            assert r.text == ref_cut(text, [stop])[0]
            assert "".join(e.text for e in evs) == r.text
            assert not any(stop in (e.text or "") for e in evs)
            checked += 1
        assert checked >= 4


@pytest.mark.hf
def test_end_of_generation_ids_stop_text_requests_only(model):
    tok = FakeTokenizer()
    with Runner(model, n_ctx=96, tokenizer=tok) as rt:
        full = rt.generate(PROMPT, max_tokens=40, temperature=0)
        j = next(j for j in range(3, 40) if full.tokens[j] not in full.tokens[:j])
        tok.eog = frozenset({full.tokens[j]})                  # as if that id ended a turn
        evs, r = collect(rt.submit(PROMPT, max_tokens=40, temperature=0))
        assert r.done_reason == DoneReason.STOP and r.tokens == full.tokens[:j + 1]
        assert r.text == tok.text_of(full.tokens[:j])          # the stop token's own text left out
        assert evs[-1].token == full.tokens[j] and "".join(e.text for e in evs) == r.text
        # a token-id request without text is exactly as before: only the model's EOS ids stop it
        ids = rt.generate(tok.encode(PROMPT), max_tokens=40, temperature=0)
        assert ids.tokens == full.tokens and ids.text is None
        assert all(e.text is None for e in rt.submit(tok.encode(PROMPT), max_tokens=4, temperature=0))


@pytest.mark.hf
def test_byte_tokens_stream_whole_characters(model):
    tok = FakeTokenizer()
    # every token a piece of a multi-byte character (lead bytes, continuations, whole ones): random
    # sampling then splits characters across tokens, and makes invalid sequences too
    pool = [b"\xe6", b"\x97", b"\xa5", b"\xe6\x97", b"\xa5\xe6", "é".encode(), b"\xc3", b"\xa9", b"ok"]
    tok.pieces = [pool[i % len(pool)] for i in range(320)]
    tok.SPECIAL = {}
    from ggmlpy.sampling import SamplingParams

    held = whole_chars = False
    with Runner(model, n_ctx=200, tokenizer=tok) as rt:
        for seed in range(4):
            evs, r = collect(rt.submit([5, 6, 7], max_tokens=150, detokenize=True,
                                       sampling=SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0,
                                                               seed=seed)))
            body = r.tokens[:-1] if r.done_reason == DoneReason.STOP else r.tokens     # EOS: no text
            whole = b"".join(tok.pieces[t] for t in body)
            # joined, the events are the one decode of all the bytes: no character was cut in two
            assert "".join(e.text for e in evs) == r.text == whole.decode("utf-8", "replace")
            held |= any(e.text == "" for e in evs[:-1])
            whole_chars |= any(c not in "\ufffdok" for c in r.text)
    assert held and whole_chars           # characters were held back, and multi-byte ones came out whole


@pytest.mark.hf
def test_text_held_at_the_end_comes_in_a_last_event(model):
    tok = FakeTokenizer()
    with Runner(model, n_ctx=40, tokenizer=tok) as rt:
        full = rt.generate(PROMPT, max_tokens=-1, shift=False, temperature=0)  # until the context is full
        assert full.done_reason == DoneReason.LENGTH
        tail = full.text[-1]
        # a stop string that starts with the last character and never completes: that character is
        # held to the end, then flushed
        evs, r = collect(rt.submit(PROMPT, max_tokens=-1, shift=False, stop=[tail + "\x00never"], temperature=0))
    assert r.done_reason == DoneReason.LENGTH and r.tokens == full.tokens and r.text == full.text
    assert evs[-1].token is None and evs[-1].text.endswith(tail)
    assert [e.token for e in evs[:-1]] == r.tokens and "".join(e.text for e in evs) == r.text


@pytest.mark.hf
def test_chat_with_a_fake_template(model):
    tok = FakeTokenizer()
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    with Runner(model, n_ctx=128, tokenizer=tok) as rt:
        ids = rt.chat_prompt(msgs)
        assert ids[0] == 300 and ids.count(300) == 1 and ids.count(301) == 2
        r = rt.chat(msgs, max_tokens=20, temperature=0)
        same = rt.generate(ids, max_tokens=20, detokenize=True, temperature=0)
        assert (r.tokens, r.text) == (same.tokens, same.text) and r.prompt_eval_count == len(ids)
        evs, r2 = collect(rt.submit_chat(msgs, max_tokens=20, temperature=0))
        assert "".join(e.text for e in evs) == r2.text == r.text
        with pytest.raises(GGMLValueError, match="always produces text"):
            rt.submit_chat(msgs, detokenize=False)


@pytest.mark.hf
def test_concurrent_text_requests_equal_each_alone(model):
    tok = FakeTokenizer()
    prompts = ["hello", "the world", "é日本", "<s>abc", "z"]
    with Runner(model, n_ctx=64, tokenizer=tok) as rt:
        alone = [rt.generate(p, max_tokens=12, stop=["\x05"], temperature=0) for p in prompts]
    with Runner(model, n_ctx=64, n_seq_max=3, n_batch=16, tokenizer=tok) as rt:
        got = [None] * len(prompts)

        def worker(i):
            got[i] = rt.generate(prompts[i], max_tokens=12, stop=["\x05"], temperature=0)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert [(r.tokens, r.text) for r in got] == [(r.tokens, r.text) for r in alone]


@pytest.mark.hf
def test_bad_text_requests_raise_and_the_runner_goes_on(model):
    with Runner(model, n_ctx=32) as rt:                 # the file has no vocabulary
        with pytest.raises(GGMLValueError, match="no tokenizer"):
            rt.generate("hello")
        with pytest.raises(GGMLValueError, match="no tokenizer"):
            rt.generate([1, 2], stop=["x"])
        with pytest.raises(GGMLValueError, match="no tokenizer"):
            rt.chat([{"role": "user", "content": "hi"}])
        assert rt.generate([1, 2], max_tokens=2, temperature=0).text is None  # token ids need no tokenizer
    with Runner(model, n_ctx=32, tokenizer=FakeTokenizer()) as rt:
        with pytest.raises(GGMLValueError, match="detokenize=False"):
            rt.submit("hi", stop=["x"], detokenize=False)
        with pytest.raises(GGMLValueError, match="empty stop string"):
            rt.submit("hi", stop=[""])
        with pytest.raises(GGMLTypeError):
            rt.submit("hi", stop=[2.5])
        with pytest.raises(GGMLValueError, match="embedding"):
            rt.submit("hi", embedding=True, stop=["x"])
        assert rt.generate("", max_tokens=2, temperature=0).prompt_eval_count == 1  # BOS alone
        rt.tokenizer.add_bos = False
        with pytest.raises(GGMLValueError, match="empty prompt"):
            rt.submit("")
        rt.tokenizer.add_bos = True
        assert isinstance(rt.embed("hi"), np.ndarray)           # a text embedding: encoded, no text out
        assert rt.generate("hi", max_tokens=3, temperature=0).eval_count == 3


# ---------------------------------------------------------------------------------------------- a real vocabulary


@pytest.fixture(scope="module")
def real_model(tmp_path_factory):
    pytest.importorskip("ggmlpy.tokenizer")
    from ggmlpy.models import load_model

    m = load_model(llama_chat_gguf(tmp_path_factory), devices="cpu")
    yield m
    m.close()


@pytest.fixture
def real(real_model):
    # one runner a test: the leak check counts the graphs a runner pools until it closes
    with Runner(real_model, n_ctx=256, n_batch=64) as rt:
        yield rt


TEXT = "The quick brown fox jumps over the lazy dog: 42 times in 2024! Ünïcödé 日本語"


@pytest.mark.hf
def test_real_text_prompt_equals_its_ids_and_decode(real):
    tok = real.tokenizer
    ids = tok.encode(TEXT, add_special=True, parse_special=True)
    assert ids[0] == tok.bos and ids.count(tok.bos) == 1
    evs, r = collect(real.submit(TEXT, max_tokens=48, temperature=0))
    by_ids = real.generate(ids, max_tokens=48, temperature=0)
    assert r.tokens == by_ids.tokens and r.prompt_eval_count == len(ids)
    body = r.tokens[:-1] if r.done_reason == DoneReason.STOP else r.tokens
    assert r.text == tok.decode(body, skip_special=True)
    assert "".join(e.text for e in evs) == r.text
    # BOS written in the text is parsed, not doubled
    assert real.generate(tok.decode([tok.bos]) + TEXT, max_tokens=4, temperature=0).tokens == r.tokens[:4]


@pytest.mark.hf
def test_real_stop_strings(real):
    tok = real.tokenizer
    full = real.generate(TEXT, max_tokens=64, temperature=0)
    pieces = [tok.decode([t], skip_special=True) for t in full.tokens]
    checked = 0
    # stops that span a token boundary: the end of one token's text and the start of the next's
    for k in (3, 10, 20, 30):
        a, b = pieces[k], pieces[k + 1]
        if not a.strip() or not b or "\ufffd" in a + b:
            continue
        stop = a[-2:] + b[:2]
        want = stream_cut(tok, full.tokens, [stop])
        evs, r = collect(real.submit(TEXT, max_tokens=64, stop=stop, temperature=0))
        assert r.done_reason == DoneReason.STOP and (r.tokens, r.text) == want
        assert r.text == full.text[:full.text.index(stop)]
        assert "".join(e.text for e in evs) == r.text
        checked += 1
    assert checked >= 2


@pytest.mark.hf
@pytest.mark.parametrize("template", [None, CHATML_TEMPLATE])
def test_real_chat_prompt_and_reply(real, template):
    pytest.importorskip("ggmlpy.tokenizer.chat_template")
    tok = real.tokenizer
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    ids = real.chat_prompt(msgs, template=template)
    rendered = tok.apply_chat_template(msgs, add_generation_prompt=True, template=template)
    enc = tok.encode(rendered, add_special=False, parse_special=True)
    if template is None:        # Llama 3's template writes bos_token itself: kept, not doubled
        assert tok.chat_template == LLAMA3_TEMPLATE and enc[0] == tok.bos and ids == enc
    else:                       # ChatML writes none: the vocabulary adds BOS, so it is put first
        assert enc[0] != tok.bos and ids == [tok.bos, *enc]
    assert ids.count(tok.bos) == 1
    evs, r = collect(real.submit_chat(msgs, template=template, max_tokens=24, temperature=0))
    same = real.generate(ids, max_tokens=24, detokenize=True, temperature=0)
    assert (r.tokens, r.text) == (same.tokens, same.text)
    assert "".join(e.text for e in evs) == r.text


@pytest.mark.hf
def test_real_chat_turns_reuse_the_cached_prefix(real):
    pytest.importorskip("ggmlpy.tokenizer.chat_template")
    history = [{"role": "user", "content": "Hello there."}]
    p1 = real.chat_prompt(history)
    r1 = real.chat(history, max_tokens=16, temperature=0)
    history += [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "And then?"}]
    p2 = real.chat_prompt(history)
    r2 = real.chat(history, max_tokens=8, temperature=0)
    held = p1 + r1.tokens[:-1]            # what the slot holds: the last token was sampled, not computed
    common = next((i for i, (a, b) in enumerate(zip(held, p2)) if a != b), min(len(held), len(p2)))
    assert r2.n_cached == min(common, len(p2) - 1) and r2.n_cached >= len(p1) - 1
