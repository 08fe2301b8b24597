"""The sampler chain in the runner: the model file's general.sampling.* defaults, every SamplingParams field
as a request keyword, the logits processor, the prompt in the penalties' history, sample_batch, DRY's
sequence breakers read from a vocabulary.

The samplers' math against llama.cpp's is tests/runner/test_sampling_chain.py's and
test_sampling_llama_cpp.py's; this file is about how the runner uses the chain.
"""

from __future__ import annotations

import dataclasses
import inspect
import re

import numpy as np
import pytest
from text_helpers import FakeTokenizer
from text_helpers import WideFakeTokenizer as Tok

from ggmlpy import GGMLValueError
from ggmlpy.load import load_model
from ggmlpy.models.synthetic import write_synthetic
from ggmlpy.runner import Runner, RunnerError
from ggmlpy.sampling import (
    DEFAULT_SAMPLERS,
    Sampler,
    SamplingParams,
    gguf_sampling_defaults,
    parse_samplers,
    sampling_params,
)
from ggmlpy.sampling.chain import sample_batch
from ggmlpy.sampling.dry import DryBreakers, dry_penalties

IDS = [5, 17, 250, 3, 99, 42, 7]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_synthetic(tmp_path_factory.mktemp("samp") / "tiny.gguf", "tiny", "F16", seed=3)
    with load_model(path, devices="cpu") as m:
        yield m


@pytest.fixture
def rt(model):
    with Runner(model, n_ctx=128, tokenizer=Tok()) as r:
        yield r


# --------------------------------------------------------------------------- the model file's defaults


def test_gguf_sampling_keys_become_defaults():
    md = {"general.sampling.top_k": 20, "general.sampling.top_p": 0.8, "general.sampling.temp": 0.6,
          "general.sampling.min_p": 0.0, "general.sampling.penalty_last_n": 32,
          "general.sampling.penalty_repeat": 1.05, "general.sampling.mirostat": 2,
          "general.sampling.mirostat_tau": 4.0, "general.sampling.mirostat_eta": 0.2,
          "general.sampling.xtc_probability": 0.3, "general.sampling.xtc_threshold": 0.2,
          "general.sampling.sequence": "top_k;top_p;temperature", "general.name": "x"}
    d = gguf_sampling_defaults(md)
    assert d == {"top_k": 20, "top_p": 0.8, "temperature": 0.6, "min_p": 0.0, "repeat_last_n": 32,
                 "repeat_penalty": 1.05, "mirostat": 2, "mirostat_tau": 4.0, "mirostat_eta": 0.2,
                 "xtc_probability": 0.3, "xtc_threshold": 0.2, "samplers": ("top_k", "top_p", "temperature")}
    # a file's bad value is left out, the others kept: a suggestion never fails a request
    bad = gguf_sampling_defaults({"general.sampling.top_p": 7.0, "general.sampling.top_k": "40",
                                  "general.sampling.mirostat": 1.5, "general.sampling.sequence": "top_k;nope",
                                  "general.sampling.temp": 0.3})
    assert bad == {"temperature": 0.3}


def test_the_runner_applies_the_files_defaults_when_nothing_is_given(model):
    """A file that says temp 0 makes a request with no sampling keyword greedy; a keyword given beats the
    file; a SamplingParams object is taken whole."""
    model.sampling_metadata = {"general.sampling.temp": 0.0, "general.sampling.top_k": 5}
    try:
        with Runner(model, n_ctx=128, tokenizer=Tok()) as rt:
            assert rt.sampling_defaults == {"temperature": 0.0, "top_k": 5}
            greedy = rt.generate(IDS, max_tokens=12, sampling=SamplingParams(temperature=0)).tokens
            assert rt.generate(IDS, max_tokens=12).tokens == greedy
            hot = dict(temperature=5.0, top_k=0, top_p=1.0, min_p=0.0)
            sampled = [rt.generate(IDS, max_tokens=12, seed=s, **hot).tokens for s in range(4)]
            assert any(t != greedy for t in sampled)
            whole = rt.generate(IDS, max_tokens=12, sampling=SamplingParams(seed=1, **hot)).tokens
            assert whole == sampled[1]
            p = sampling_params("x", None, rt.sampling_defaults, top_p=0.5)
            assert (p.temperature, p.top_k, p.top_p) == (0.0, 5, 0.5)
    finally:
        model.sampling_metadata = {}


# --------------------------------------------------------------------------- keywords


def test_every_field_is_a_request_keyword():
    fields = [f for f in SamplingParams.__dataclass_fields__]
    for name in ("submit", "generate", "submit_chat", "chat"):
        params = inspect.signature(getattr(Runner, name)).parameters
        missing = [f for f in fields if f not in params]
        assert not missing, (name, missing)
        assert params["repeat_penalty"].kind == params["repeat_penalty"].KEYWORD_ONLY
        assert params["repeat_penalty"].default is None


def test_keywords_reach_the_chain_and_unknown_ones_are_refused(rt):
    # logit_bias of +100 on one token: greedy decoding picks it every time
    out = rt.generate(IDS, max_tokens=6, temperature=0, logit_bias={123: 100.0}).tokens
    assert out == [123] * 6
    # the same ban through the chain's other door, the penalties: with a huge repeat penalty the greedy
    # sequence never repeats a token it (or the prompt) has seen in the window
    base = rt.generate(IDS, max_tokens=24, temperature=0).tokens
    pen = rt.generate(IDS, max_tokens=24, temperature=0, repeat_penalty=1e6, presence_penalty=1e3,
                      repeat_last_n=-1).tokens
    assert len(set(base)) < len(base) or set(base) & set(IDS), "the unpenalised run must repeat for this test"
    assert len(set(pen)) == len(pen) and not set(pen) & set(IDS)
    with pytest.raises(TypeError, match="repeat_penalti"):
        rt.generate(IDS, max_tokens=2, repeat_penalti=1.1)
    with pytest.raises(GGMLValueError, match="repeat_penalty must be > 0"):
        rt.generate(IDS, max_tokens=2, repeat_penalty=0)


# --------------------------------------------------------------------------- the logits processor


def test_logits_processor_sees_the_history_and_steers(rt):
    seen = []

    def only_seven(tokens, logits):
        seen.append(tokens.copy())
        assert logits.dtype == np.float32 and logits.shape == (512,)
        out = np.full_like(logits, -np.inf)
        out[7] = 0.0
        return out

    r = rt.generate(IDS, max_tokens=4, logits_processor=only_seven, seed=1)
    assert r.tokens == [7, 7, 7, 7]
    # the history: the prompt, then each token as it was generated
    assert [list(s) for s in seen] == [IDS, IDS + [7], IDS + [7, 7], IDS + [7, 7, 7]]


@pytest.mark.parametrize("bad, said", [
    (lambda t, x: x[:10], r"logits_processor returned float32 shape \(10,\)"),
    (lambda t, x: 1 / 0, "division by zero"),
    (lambda t, x: np.full_like(x, np.nan), "NaN"),
])
def test_a_failing_logits_processor_ends_its_request_only(rt, bad, said):
    with pytest.raises(RunnerError, match=said):
        rt.generate(IDS, max_tokens=3, logits_processor=bad)
    assert rt.generate(IDS, max_tokens=3, temperature=0).done_reason == "length"     # the runner serves on


# --------------------------------------------------------------------------- chain pieces


def test_parse_samplers():
    assert parse_samplers("top_k;top-p;temp") == ("top_k", "top_p", "temperature")
    assert parse_samplers("edskypmxt") == DEFAULT_SAMPLERS
    assert parse_samplers(["typical", "nucleus"]) == ("typical_p", "top_p")
    for bad in ("top_k;warp", "kq", 5, ["top_k", 3]):
        with pytest.raises(GGMLValueError, match="samplers"):
            parse_samplers(bad)


def test_prompt_tokens_count_in_the_penalties():
    """As llama-server's init_sampler: a token of the prompt is penalised before it is ever generated."""
    x = np.zeros(8, np.float32)
    x[3] = 1.0
    x[4] = 0.9
    s = Sampler(SamplingParams(temperature=0, repeat_penalty=2.0))
    assert s.sample(x) == 3
    s = Sampler(SamplingParams(temperature=0, repeat_penalty=2.0))
    s.accept([3])
    assert s.sample(x) == 4 and s.history == [3, 4]
    # the window: repeat_last_n=1 forgets the prompt's 3 once 4 was generated
    s = Sampler(SamplingParams(temperature=0, repeat_penalty=2.0, repeat_last_n=1))
    s.accept([3])
    assert [s.sample(x) for _ in range(3)] == [4, 3, 4]


def test_sample_batch_equals_a_loop_and_isolates_failures():
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((6, 300)).astype(np.float32)
    rows[4, :] = np.nan
    def make():
        return [Sampler(SamplingParams(temperature=0)), Sampler(SamplingParams(temperature=0)),
                Sampler(SamplingParams(seed=3)), Sampler(SamplingParams(temperature=0, repeat_penalty=1.5)),
                Sampler(SamplingParams(temperature=0)), Sampler(SamplingParams(temperature=0, logit_bias={2: 50}))]
    a, b = make(), make()
    for s in a:
        s.accept([int(np.argmax(rows[3]))])
    for s in b:
        s.accept([int(np.argmax(rows[3]))])
    got = sample_batch(a, rows)
    for i, (s, g) in enumerate(zip(b, got)):
        if i == 4:
            assert isinstance(g, GGMLValueError) and "NaN" in str(g)
            with pytest.raises(GGMLValueError):
                s.sample(rows[i])
        else:
            assert g == s.sample(rows[i]), i
    assert got[5] == 2 and got[3] != int(np.argmax(rows[3]))
    assert [s.history for s in a] == [s.history for s in b]


def test_dry_breakers_from_a_vocabulary():
    """A token holding a breaker is a breaker alone; a token ending with a breaker's start is a head whose
    tail is the rest, tokenized (llama.cpp's get_overlapping_token_sequences)."""
    tok = FakeTokenizer()
    tok.pieces[270] = b"ab:c"            # holds ':'
    tok.pieces[271] = b"x<"              # ends with '<' of the breaker '<br>'
    tok.encode = lambda text, add_special=False, parse_special=False: list(text) if isinstance(text, bytes) \
        else list(text.encode())
    heads = DryBreakers.of(tok, (":", "<br>")).heads
    assert () in heads[ord(":")] and () in heads[270]
    assert tuple(b"br>") in heads[271] and tuple(b"br>") in heads[ord("<")]
    assert DryBreakers.of(tok, (":", "<br>")) is DryBreakers.of(tok, (":", "<br>"))      # built once


def _breaker_heads_plain(tokenizer, breakers) -> dict:
    """llama.cpp's get_overlapping_token_sequences restated plainly (a scan of every token's bytes per
    breaker), over the breakers as SamplingParams keeps them: what DryBreakers' numpy build must equal."""
    pieces = [tokenizer.token_to_piece(t, True) for t in range(len(tokenizer))]
    heads: dict = {}
    tails: dict = {}
    for text in breakers:
        b = text.encode()[:40]
        for tid, word in enumerate(pieces):
            if b in word:
                heads.setdefault(tid, set()).add(())
                continue
            for i in range(1, min(len(word), len(b) - 1) + 1):
                if word.endswith(b[:i]):
                    # the rest, as llama.cpp's tokenizer reads bytes: each one not UTF-8 is U+FFFD
                    if b[i:] not in tails:
                        rest = re.sub(r"\\x[0-9a-f]{2}", "\ufffd", b[i:].decode("utf-8", "backslashreplace"))
                        tails[b[i:]] = tuple(tokenizer.encode(rest, add_special=False, parse_special=False)[:20])
                    heads.setdefault(tid, set()).add(tails[b[i:]])
    return heads


@pytest.fixture(scope="module")
def qwen2_tokenizer():
    import hf_convert

    from ggmlpy.tokenizer import Tokenizer

    return Tokenizer.from_gguf(hf_convert.vocab_file("qwen2"))


def test_dry_breakers_are_bounded_and_cut_as_llama_cpp():
    # at most MAX_BREAKERS, the error naming the field (API, CLI and server alike go through here)
    from ggmlpy.sampling.params import MAX_BREAKERS

    with pytest.raises(GGMLValueError, match=f"dry_sequence_breakers: at most {MAX_BREAKERS} breakers, got 65"):
        SamplingParams(dry_sequence_breakers=["a"] * (MAX_BREAKERS + 1))
    with pytest.raises(GGMLValueError, match=r"dry_sequence_breakers\[1\] must be a string, got int"):
        SamplingParams(dry_sequence_breakers=["a", 3])
    with pytest.raises(GGMLValueError, match="dry_sequence_breakers must be a sequence of strings, got str"):
        SamplingParams(dry_sequence_breakers="\n")
    # each is cut to 40 bytes, as llama.cpp cuts it; kept as the characters that cover them (DRY cuts the
    # bytes), so a cut inside a character is llama.cpp's; empty ones are dropped
    got = SamplingParams(dry_sequence_breakers=["x" * 10_000, "a" * 39 + "é", "é" * 30, "。" * 14, "", "ab"])
    assert got.dry_sequence_breakers == ("x" * 40, "a" * 39 + "é", "é" * 20, "。" * 14, "ab")


@pytest.mark.parametrize("breakers", [("\n", ":", '"', "*"), ("。", "é", "ing "), ("。" * 14, "a" * 39 + "é"),
                                      ("the cat sat on the mat and the cat sat on the mat",)])
def test_dry_breakers_equal_the_plain_scan(qwen2_tokenizer, breakers):
    """The numpy build of the breaker tokens equals the plain scan on a 152k vocabulary: multi-byte
    breakers (heads ending inside a character, whose tails are not UTF-8: llama.cpp's U+FFFD), a cut
    inside a character, a long one with many heads."""
    kept = SamplingParams(dry_sequence_breakers=breakers).dry_sequence_breakers
    heads = DryBreakers.of(qwen2_tokenizer, kept).heads
    assert heads == _breaker_heads_plain(qwen2_tokenizer, kept)
    assert heads


def test_dry_breakers_build_fast_and_the_cache_is_bounded(qwen2_tokenizer):
    """A request's own breakers (the most, each 40 bytes) are built in well under a second each on a 152k
    vocabulary (the scan once took seconds per breaker: a server's requests could stall it); the built
    lists and breakers kept per tokenizer are bounded."""
    import time

    from ggmlpy.sampling import dry
    from ggmlpy.sampling.params import MAX_BREAKERS

    t0 = time.perf_counter()
    for k in range(3):
        DryBreakers.of(qwen2_tokenizer, tuple(f"{k}-{i:02d}-" + "word " * 7 for i in range(MAX_BREAKERS)))
    took = time.perf_counter() - t0
    assert took < 60, f"{3 * MAX_BREAKERS} breakers took {took:.1f} s"
    for k in range(dry._CACHE_LISTS + 4):
        DryBreakers.of(qwen2_tokenizer, (f"<{k}>",))
    per = DryBreakers._cache[qwen2_tokenizer]
    assert len(per.lists) == dry._CACHE_LISTS and len(per.singles) <= dry._CACHE_BREAKERS
    assert (f"<{dry._CACHE_LISTS + 3}>",) in per.lists and ("<0>",) not in per.lists


def test_dry_penalises_the_token_that_extends_a_repetition():
    # history a b c d a b c: the next 'd' would extend the repeat 'a b c' (length 3) -> penalty
    # mult * base^(3 - allowed); a breaker between cuts the repetition short
    a, b, c, d, brk = 10, 11, 12, 13, 14
    toks, pen = dry_penalties([a, b, c, d, a, b, c], DryBreakers({}), 0.8, 1.75, 2)
    assert dict(zip(toks.tolist(), pen.tolist())) == pytest.approx({d: 0.8 * 1.75 ** 1})
    toks, _ = dry_penalties([a, b, c, d, brk, a, b, c], DryBreakers({brk: {()}}), 0.8, 1.75, 2)
    assert d in toks.tolist()            # the breaker is before the repeat: it does not cut it
    toks, _ = dry_penalties([a, b, c, d, a, b, brk, c], DryBreakers({brk: {()}}), 0.8, 1.75, 2)
    assert toks.size == 0                # a breaker one token back limits any repeat to 1 < allowed_length


def test_a_converted_files_generation_config_sets_the_defaults(tmp_path):
    """llama.cpp's converter writes generation_config.json's sampling into general.sampling.*: a model
    whose maker says top_k 1 and repetition_penalty 0.3 generates, with no sampling keyword, exactly the
    greedy sequence under that penalty (llama.cpp applies them the same way when the user sets nothing). A
    penalty below 1 pulls toward repeats: the tiny random model never repeats within 16 tokens by itself,
    so a usual penalty above 1 would change nothing to see."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import hf_convert

    tok = hf_convert.tokenizer("llama-bpe")
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                                   bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(3)
    hf = transformers.LlamaForCausalLM(cfg).float().eval()
    hf_convert.perturb_constant_weights(hf, seed=4)
    hf.generation_config = transformers.GenerationConfig(do_sample=True, top_k=1, temperature=0.7, top_p=0.9,
                                                         repetition_penalty=0.3, bos_token_id=tok.bos_token_id,
                                                         eos_token_id=tok.eos_token_id)
    path = hf_convert.convert(hf, tmp_path, "llama-bpe")
    with load_model(path, devices="cpu") as m, Runner(m, n_ctx=128) as rt:
        assert rt.sampling_defaults == {"top_k": 1, "temperature": pytest.approx(0.7), "top_p": pytest.approx(0.9),
                                        "repeat_penalty": pytest.approx(0.3)}
        prompt = rt.tokenizer.encode("the cat sat on the mat")
        want = rt.generate(prompt, max_tokens=16, temperature=0, repeat_penalty=0.3).tokens
        # the penalty matters here (given 1 explicitly: a keyword not given takes the file's 0.3)
        assert want != rt.generate(prompt, max_tokens=16, temperature=0, repeat_penalty=1.0).tokens
        for seed in (1, 2):
            assert rt.generate(prompt, max_tokens=16, seed=seed).tokens == want


def _adaptive_ref(p: np.ndarray, target: float, ws: float, tw: float) -> np.ndarray:
    """llama.cpp's adaptive-p transform, restated: each probability's distance to the adapted target
    becomes a logit 5 - 10 d^2 / (1 + d), d = |p - target'| / 0.3, target' = clamp(2 t - ws / tw)."""
    adapted = min(max(2 * target - ws / tw, 0.0), 1.0)
    d = np.abs(p - adapted) / 0.3
    z = 5 - 10 * d * d / (1 + d)
    w = np.exp(z - z.max())
    return w / w.sum()


def test_adaptive_p_draws_near_its_target_and_tracks_the_average():
    probs = np.array([0.5, 0.2, 0.15, 0.1, 0.05])
    x = np.log(probs).astype(np.float32)
    params = SamplingParams(seed=4, top_k=0, top_p=1.0, min_p=0.0, temperature=1.0, adaptive_target=0.15,
                            adaptive_decay=0.8, samplers="temperature;adaptive_p")
    s = Sampler(params)
    ws, tw = 0.15 / 0.2, 1 / 0.2                        # llama.cpp's reset values: the target, weighted
    for _ in range(40):
        ids, got = s.distribution(x)
        want = _adaptive_ref(probs, 0.15, ws, tw)
        np.testing.assert_allclose(got, want[ids], rtol=1e-4, atol=1e-6)
        tok = s.sample(x)
        ws, tw = probs[tok] + 0.8 * ws, 1 + 0.8 * tw     # the chosen token's probability joins the average
    # without adaptive_p in the chain, or with a negative target, the draw is the plain softmax
    plain = Sampler(SamplingParams(seed=4, top_k=0, top_p=1.0, min_p=0.0, temperature=1.0, adaptive_target=0.15))
    np.testing.assert_allclose(plain.distribution(x)[1], probs, rtol=1e-5)
    off = Sampler(dataclasses.replace(params, adaptive_target=-1.0))
    np.testing.assert_allclose(off.distribution(x)[1], probs, rtol=1e-5)
    # drawn: tokens near 0.15 most often (chi-square against the first step's distribution, one step a sampler)
    counts = np.bincount([Sampler(dataclasses.replace(params, seed=i)).sample(x) for i in range(3000)], minlength=5)
    expect = _adaptive_ref(probs, 0.15, 0.75, 5.0) * 3000
    stat = float(((counts - expect) ** 2 / expect).sum())
    assert stat < 18.467, (counts, expect)               # chi-square(4) at 99.9%
    with pytest.raises(GGMLValueError, match="adaptive_decay"):
        SamplingParams(adaptive_decay=1.0)
