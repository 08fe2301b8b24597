"""ggmlpy.sampling's sampler chain against llama.cpp's, restated in numpy (tests/runner/sampling_reference.py,
written from the pinned llama.cpp's src/llama-sampler.cpp and common/sampling.cpp, not from ggmlpy's code).

* ``Sampler.distribution`` (the candidates the draw picks from, and their probabilities) equals the
  reference's: the same kept set exactly, probabilities to 1e-6; for each sampler alone, for
  combinations, for orders other than llama.cpp's default, with min_keep; on hand-made logits where a
  wrong convention gives another set, and on random ones (hypothesis; vocabularies up to 64 and one of
  152,064 tokens, Qwen2's).
* ``Sampler.sample`` draws from that distribution: chi-square goodness of fit over seeded draws; a seed
  reproduces its draws; XTC's coin is tossed with the probability asked.
* Mirostat's mu follows the reference over a sequence of draws (the same tokens fed to both).
* Penalties and DRY see the history given to ``accept`` (prompt tokens included, as llama-server
  accepts them) and every sampled token.

The reference raises ``Ambiguous`` where llama.cpp's float32 arithmetic could legitimately decide a
boundary case either way; random inputs that hit one are discarded (``assume``), the hand-made ones
are chosen clear of any.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import sampling_reference as R
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ggmlpy.sampling import DEFAULT_SAMPLERS, Sampler, SamplingParams

# every filter off, temperature 1: a test turns on what it looks at
OFF = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)

#: a character vocabulary for DRY: token i is VOCAB[i]; "\n" (4), ":" (5) and '"' (6) are single-token
#: breakers with the default breakers, and so is "a:b" (7), which contains one
VOCAB = ["a", "b", "c", "y", "\n", ":", '"', "a:b", "x", "z", "d", "e"]
A, B, C, Y, NL, COLON, QUOTE, AB, X, Z, D, E = range(12)


class PieceVocab:
    """What Sampler reads of a tokenizer for DRY's breakers: the size and each token's bytes. ``encode``
    tokenizes the rest of a breaker a token's text ends with the start of: never needed here (every
    breaker is one character)."""

    _made: dict = {}

    def __init__(self, pieces) -> None:
        self.pieces = [p if isinstance(p, bytes) else p.encode() for p in pieces]

    @classmethod
    def of(cls, pieces) -> PieceVocab:
        """One per vocabulary, so that ggmlpy's cache of breakers per tokenizer works as with a real one."""
        key = tuple(pieces)
        if key not in cls._made:
            cls._made[key] = cls(pieces)
        return cls._made[key]

    def __len__(self) -> int:
        return len(self.pieces)

    def token_to_piece(self, token: int, special: bool = True) -> bytes:
        return self.pieces[token]

    def encode(self, text, add_special=False, parse_special=False):
        raise AssertionError(f"a multi-token breaker tail {text!r}: not expected with one-character breakers")


def got(logits, history=(), vocab=None, n_ctx=None, **kw) -> tuple[list, list]:
    """ggmlpy's distribution over ``logits`` after ``history`` was accepted: (ids, probs), ids ascending,
    zero-probability entries dropped."""
    tok = PieceVocab.of(vocab) if vocab is not None else None
    s = Sampler(SamplingParams(**{**OFF, **kw}), tokenizer=tok, n_ctx=n_ctx)
    if len(history):
        s.accept(list(history))
    ids, probs = s.distribution(np.asarray(logits, dtype=np.float32))
    return canon(ids, probs)


def ref(logits, history=(), vocab=None, n_ctx=None, **kw) -> tuple[list, list]:
    """The reference's distribution, as :func:`got`. llama.cpp takes its float parameters as float32."""
    kw = {**OFF, **kw}
    f32 = {k: float(np.float32(v)) if isinstance(v, float) else v for k, v in kw.items()}
    breakers = R.dry_breakers(vocab, kw.get("dry_sequence_breakers", ("\n", ":", '"', "*"))) if vocab else None
    f32.pop("dry_sequence_breakers", None)
    f32.pop("seed", None)
    ids, probs = R.chain(np.asarray(logits, dtype=np.float32).tolist(), R.Params(**f32), list(history),
                         n_ctx=n_ctx, breakers=breakers)
    return canon(ids, probs)


# llama.cpp's softmax is expf in float32: a probability below ~1e-38 is 0 there (never drawn); ggmlpy's may
# keep or flush it. Both sides drop what is below this.
TINY = 1e-30


def canon(ids, probs) -> tuple[list, list]:
    ids, probs = np.asarray(ids, dtype=np.int64), np.asarray(probs, dtype=np.float64)
    keep = probs > TINY
    ids, probs = ids[keep], probs[keep]
    order = np.argsort(ids)
    return ids[order].tolist(), probs[order].tolist()


def assert_same(g, r, what=""):
    assert g[0] == r[0], f"{what}: kept set {g[0]} != llama.cpp's {r[0]}"
    np.testing.assert_allclose(g[1], r[1], rtol=1e-5, atol=1e-6, err_msg=what)


def check(logits, history=(), vocab=None, n_ctx=None, **kw):
    """ggmlpy equals the reference, or (random inputs) the input is discarded when the reference says
    llama.cpp's result is not pinned down."""
    try:
        r = ref(logits, history, vocab, n_ctx, **kw)
    except (R.Ambiguous, R.Undefined):
        assume(False)
    assert_same(got(logits, history, vocab, n_ctx, **kw), r, repr(kw))
    return r


def logits_from(seed: int, n: int, scale: float, n_masked: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * scale).astype(np.float32)
    if n_masked:
        x[rng.choice(n, size=min(n_masked, n - 1), replace=False)] = -np.inf
    return x


logit_rows = st.builds(logits_from, st.integers(0, 2**32 - 1), st.integers(2, 64), st.floats(0.3, 6.0))
histories = st.lists(st.integers(0, 63), max_size=40)
min_keeps = st.sampled_from([0, 0, 1, 2, 5])


# ---------------------------------------------------------------------------------------------- each sampler alone


@settings(max_examples=60)
@given(logit_rows, st.integers(-2, 70))
def test_top_k(x, k):
    r = check(x, top_k=k)
    assert len(r[0]) == (min(k, x.size) if k > 0 else x.size)


@given(logit_rows, st.floats(0.05, 1.0), min_keeps)
def test_top_p(x, p, min_keep):
    check(x, top_p=p, min_keep=min_keep)


@given(logit_rows, st.floats(0.0, 1.0), min_keeps)
def test_min_p(x, p, min_keep):
    check(x, min_p=p, min_keep=min_keep)


@given(logit_rows, st.floats(0.05, 1.0), min_keeps)
def test_typical_p(x, p, min_keep):
    check(x, typical_p=p, min_keep=min_keep)


@given(logit_rows, st.floats(-1.0, 4.0), st.integers(0, 5))
def test_top_n_sigma(x, n, n_masked):
    x = x.copy()
    x[: min(n_masked, x.size - 1)] = -np.inf          # masked logits stay out of the mean and the std
    check(x, top_n_sigma=n)


@given(logit_rows, st.floats(0.0, 0.6), min_keeps)
def test_xtc_when_its_coin_comes_up(x, threshold, min_keep):
    check(x, xtc_probability=1.0, xtc_threshold=threshold, min_keep=min_keep)


@given(logit_rows, st.floats(0.05, 5.0))
def test_temperature(x, t):
    check(x, temperature=t)


@given(logit_rows, st.floats(0.0, 3.0), st.floats(0.01, 2.0), st.floats(0.1, 4.0))
def test_dynamic_temperature(x, t, delta, exponent):
    check(x, temperature=t, dynatemp_range=delta, dynatemp_exponent=exponent)


@given(logit_rows, histories, st.sampled_from([0, 1, 3, 8, 64, -1]), st.floats(0.5, 2.0), st.floats(-1.0, 1.0),
       st.floats(-1.0, 1.0))
def test_penalties(x, history, last_n, repeat, freq, present):
    history = [t % x.size for t in history]
    check(x, history, n_ctx=48, repeat_last_n=last_n, repeat_penalty=repeat, frequency_penalty=freq,
          presence_penalty=present)


@given(logit_rows, st.dictionaries(st.integers(0, 63), st.sampled_from([-np.inf, -5.0, -0.5, 0.5, 3.0, 10.0]),
                                   max_size=6))
def test_logit_bias(x, bias):
    bias = {t % x.size: b for t, b in bias.items()}
    assume(any(x[t] + bias.get(t, 0) > -np.inf for t in range(x.size)))
    check(x, logit_bias=bias)


dry_histories = st.lists(st.sampled_from([A, B, C, Y, A, B, C, NL, COLON, AB, X]), max_size=40)


@given(st.builds(logits_from, st.integers(0, 2**32 - 1), st.just(len(VOCAB)), st.floats(0.3, 3.0)),
       dry_histories, st.floats(0.1, 2.0), st.floats(1.0, 3.0), st.integers(0, 4), st.sampled_from([0, 5, 16, -1]))
def test_dry(x, history, mult, base, allowed, last_n):
    check(x, history, VOCAB, n_ctx=32, dry_multiplier=mult, dry_base=base, dry_allowed_length=allowed,
          dry_penalty_last_n=last_n)


# ---------------------------------------------------------------------------------------------- combinations


settings_all = st.fixed_dictionaries({
    "temperature": st.sampled_from([0.0, 0.5, 1.0, 1.7]),
    "top_k": st.sampled_from([0, 1, 5, 40]),
    "top_p": st.sampled_from([1.0, 0.95, 0.6]),
    "min_p": st.sampled_from([0.0, 0.05, 0.3]),
    "typical_p": st.sampled_from([1.0, 1.0, 0.7]),
    "top_n_sigma": st.sampled_from([-1.0, -1.0, 1.5]),
    "min_keep": min_keeps,
    "repeat_penalty": st.sampled_from([1.0, 1.3]),
    "repeat_last_n": st.sampled_from([0, 8, 64, -1]),
    "frequency_penalty": st.sampled_from([0.0, 0.4]),
    "presence_penalty": st.sampled_from([0.0, -0.3, 0.6]),
    "xtc_probability": st.sampled_from([0.0, 1.0]),
    "xtc_threshold": st.sampled_from([0.05, 0.2]),
    "dry_multiplier": st.sampled_from([0.0, 0.8]),
    "dry_allowed_length": st.sampled_from([1, 2]),
    "dynatemp_range": st.sampled_from([0.0, 0.0, 0.5]),
})


@settings(max_examples=150)
@given(st.builds(logits_from, st.integers(0, 2**32 - 1), st.just(len(VOCAB)), st.floats(0.3, 5.0)), dry_histories,
       settings_all)
def test_the_default_chain(x, history, kw):
    check(x, history, VOCAB, n_ctx=40, **kw)


@settings(max_examples=150)
@given(logit_rows, histories, settings_all, st.permutations(DEFAULT_SAMPLERS), st.integers(1, 9))
def test_other_orders_and_subsets(x, history, kw, order, n):
    history = [t % x.size for t in history]
    kw.pop("dry_multiplier")
    check(x, history, n_ctx=40, samplers=tuple(order[:n]), **kw)


def test_default_samplers_are_llama_cpps():
    assert tuple(DEFAULT_SAMPLERS) == R.DEFAULT_SAMPLERS
    assert SamplingParams().samplers == R.DEFAULT_SAMPLERS
    p = SamplingParams()
    # common_params_sampling's defaults
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.typical_p, p.top_n_sigma, p.min_keep) == \
        (0.8, 40, 0.95, 0.05, 1.0, -1.0, 0)
    assert (p.repeat_penalty, p.repeat_last_n, p.frequency_penalty, p.presence_penalty) == (1.0, 64, 0.0, 0.0)
    assert (p.xtc_probability, p.xtc_threshold, p.mirostat, p.mirostat_tau, p.mirostat_eta) == (0.0, 0.1, 0, 5.0, 0.1)
    assert (p.dry_multiplier, p.dry_base, p.dry_allowed_length) == (0.0, 1.75, 2)
    assert tuple(p.dry_sequence_breakers) == ("\n", ":", '"', "*")
    assert (p.dynatemp_range, p.dynatemp_exponent) == (0.0, 1.0)


def test_one_qwen2_sized_vocabulary():
    """152,064 logits (Qwen2's vocabulary), the default chain with penalties over a long history: the
    sizes where llama.cpp's top-p switches to its bucket sort (> 1024 candidates, unsorted). The mass sits
    on 3,000 tokens so that the top-p cut falls between tokens of p ~ 3e-4, clear of float32 rounding
    (with the mass spread over the vocabulary, llama.cpp's own float32 sum decides the last token)."""
    x = logits_from(7, 152064, 1.0)
    x[np.random.default_rng(9).choice(x.size, 3000, replace=False)] += 9.0   # most of the mass on 3,000 tokens
    history = np.random.default_rng(8).integers(0, 152064, size=300).tolist()
    history += [int(i) for i in np.argsort(-x)[:30]]     # the most likely tokens were seen: penalties matter
    kw = dict(temperature=0.8, top_k=0, top_p=0.9, min_p=0.01, repeat_penalty=1.3, repeat_last_n=-1,
              frequency_penalty=0.2, presence_penalty=0.1)
    r = ref(x, history, n_ctx=4096, **kw)
    assert len(r[0]) > 1000            # the top-p cut falls deep in the vocabulary
    assert_same(got(x, history, n_ctx=4096, **kw), r)
    r2 = ref(x, history, n_ctx=4096, **{**kw, "samplers": ("penalties", "top_n_sigma", "temperature"),
                                         "top_n_sigma": 2.0})
    assert_same(got(x, history, n_ctx=4096, **{**kw, "samplers": ("penalties", "top_n_sigma", "temperature"),
                                              "top_n_sigma": 2.0}), r2)


# ---------------------------------------------------------------------------------------------- hand-made cases


def probs(*ps) -> np.ndarray:
    """Logits whose softmax is ``ps`` (normalised)."""
    p = np.asarray(ps, dtype=np.float64)
    return np.log(p / p.sum()).astype(np.float32)


def test_filters_run_before_temperature():
    """llama.cpp's order: top_p and min_p measure the untempered probabilities, temperature comes last.
    At T=1, p = .5 .3 .15 .05 and top_p .75 keeps 2 tokens; tempered first (T=3: .336 .283 .225 .156, Ollama's
    order) it would keep 3. min_p .35 drops .15 < .35 x .5 at T=1, not .225 > .35 x .336 at T=3."""
    x = probs(0.5, 0.3, 0.15, 0.05)
    assert ref(x, temperature=3.0, top_p=0.75)[0] == [0, 1]
    assert got(x, temperature=3.0, top_p=0.75)[0] == [0, 1]
    assert ref(x, temperature=3.0, min_p=0.35)[0] == [0, 1]
    assert got(x, temperature=3.0, min_p=0.35)[0] == [0, 1]
    # the probabilities are the tempered softmax over what is kept
    assert_same(got(x, temperature=3.0, top_p=0.75), ref(x, temperature=3.0, top_p=0.75))
    # and another order says otherwise
    order = ("temperature", "top_p")
    assert got(x, temperature=3.0, top_p=0.75, samplers=order)[0] == ref(x, temperature=3.0, top_p=0.75,
                                                                         samplers=order)[0] == [0, 1, 2]


def test_top_p_counts_min_keep():
    x = probs(0.9, 0.05, 0.03, 0.02)
    assert got(x, top_p=0.5)[0] == [0]
    assert got(x, top_p=0.5, min_keep=3)[0] == [0, 1, 2]
    assert got(x, min_p=0.5, min_keep=2)[0] == [0, 1]


def test_typical_keeps_the_tokens_near_the_entropy_not_the_most_likely():
    """p = .4 and six of .1: entropy 1.75 nats; -log .1 = 2.30 is nearer to it than -log .4 = .92, so the
    typical set fills with the .1 tokens first: mass > .55 takes six of them and leaves out the best."""
    x = probs(0.1, 0.1, 0.4, 0.1, 0.1, 0.1, 0.1)
    r = ref(x, typical_p=0.55)
    assert r[0] == [0, 1, 3, 4, 5, 6]
    assert_same(got(x, typical_p=0.55), r)
    # greedy decoding follows: the arg-max of what is left (ties: the lowest id), not token 2
    assert got(x, temperature=0.0, typical_p=0.55) == ([0], [1.0])


def test_xtc_removes_the_likely_tokens_but_the_least_of_them():
    x = probs(0.4, 0.3, 0.2, 0.1)
    r = ref(x, xtc_probability=1.0, xtc_threshold=0.15)
    assert r[0] == [2, 3]
    assert_same(got(x, xtc_probability=1.0, xtc_threshold=0.15), r)
    assert got(x, xtc_probability=1.0, xtc_threshold=0.15, min_keep=3)[0] == [0, 1, 2, 3]   # would keep 2 < 3
    assert got(x, xtc_probability=1.0, xtc_threshold=0.6)[0] == [0, 1, 2, 3]                 # > 0.5: off
    assert got(x, xtc_probability=1.0, xtc_threshold=0.45)[0] == [0, 1, 2, 3]                # one above: none
    assert got(x, temperature=0.0, xtc_probability=1.0, xtc_threshold=0.15) == ([2], [1.0])


def test_min_p_on_logits():
    x = probs(0.5, 0.2, 0.1, 0.04, 0.16)
    assert got(x, min_p=0.3)[0] == [0, 1, 4]            # p >= .15
    assert got(x, min_p=0.3, min_keep=4)[0] == [0, 1, 2, 4]


def test_top_n_sigma_masks_below_max_minus_n_std():
    x = np.array([4.0, 3.0, 0.0, -1.0, -np.inf, 2.5], dtype=np.float32)
    fin = np.array([4.0, 3.0, 0.0, -1.0, 2.5])
    cut = 4.0 - 1.0 * fin.std()                         # population std over the finite logits: 1.87
    assert got(x, top_n_sigma=1.0)[0] == [i for i in (0, 1, 5) if x[i] >= cut] == [0, 1, 5]


def test_penalties_divide_positive_and_multiply_negative_logits():
    x = np.array([2.0, -1.0, 1.5, 0.0, 1.0], dtype=np.float32)
    hist = [0, 1, 1, 3]
    # repeat 2: 2 -> 1, -1 -> -2, 0 -> 0 (x 2); frequency .5 per occurrence; presence .25 once
    want = np.array([1.0 - 0.5 - 0.25, -2.0 - 1.0 - 0.25, 1.5, 0.0 - 0.5 - 0.25, 1.0])
    g = got(x, hist, repeat_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    e = np.exp(want - want.max())
    assert_same(g, ([0, 1, 2, 3, 4], (e / e.sum()).tolist()))
    # only the last repeat_last_n tokens count
    g = got(x, hist, repeat_penalty=2.0, repeat_last_n=1)
    w = x.astype(np.float64)
    w[3] = 0.0
    e = np.exp(w - w.max())
    assert_same(g, ([0, 1, 2, 3, 4], (e / e.sum()).tolist()))
    # repeat_last_n 0: off
    assert_same(got(x, hist, repeat_penalty=2.0, repeat_last_n=0), got(x))


@pytest.mark.parametrize("last_n,n_ctx,window", [(8, 100, 8), (11, 100, 11), (-1, 100, 100), (-1, 8, 8),
                                                   (0, 100, 0)])
def test_repeat_last_n_window(last_n, n_ctx, window):
    """Only the last repeat_last_n tokens count (-1: the context size, 0: off): token 2, first of 11, is
    penalised only by a window of 11 or more; token 0, the last 10, by any window."""
    x = np.ones(4, dtype=np.float32)
    hist = [2] + [0] * 10
    g = got(x, hist, n_ctx=n_ctx, repeat_last_n=last_n, presence_penalty=1.0)
    assert_same(g, ref(x, hist, n_ctx=n_ctx, repeat_last_n=last_n, presence_penalty=1.0))
    p = dict(zip(*g))
    assert (p[2] < p[3]) == (window >= 11)
    assert (p[0] < p[3]) == (window > 0)


def test_logit_bias_bans_and_boosts():
    x = np.array([3.0, 2.0, 1.0, 0.0], dtype=np.float32)
    assert got(x, temperature=0.0, logit_bias={0: -np.inf}) == ([1], [1.0])
    assert got(x, temperature=0.0, logit_bias={3: 3.5}) == ([3], [1.0])
    assert got(x, logit_bias={0: -np.inf, 2: -np.inf})[0] == [1, 3]
    assert_same(got(x, logit_bias={1: 0.5}), ref(x, logit_bias={1: 0.5}))


def test_greedy_ties_go_to_the_lowest_id():
    x = np.array([1.0, 3.0, 2.0, 3.0], dtype=np.float32)
    assert got(x, temperature=0.0) == ([1], [1.0])
    s = Sampler(SamplingParams(temperature=0.0, seed=1))
    assert [s.sample(x) for _ in range(3)] == [1, 1, 1]
    # a penalty on token 1 hands the tie to token 3
    assert got(x, [1], temperature=0.0, repeat_penalty=1.5) == ([3], [1.0])


def dry_penalties(history, **kw) -> dict:
    """{token: its logit change} under DRY, on flat logits of VOCAB: ggmlpy's, checked against the
    reference's."""
    x = np.zeros(len(VOCAB), dtype=np.float32)
    kw = {"dry_multiplier": 1.0, "dry_base": 2.0, "dry_allowed_length": 2, **kw}
    g = got(x, history, VOCAB, n_ctx=64, **kw)
    assert_same(g, ref(x, history, VOCAB, n_ctx=64, **kw))
    lg = np.log(np.asarray(g[1]))
    lg -= lg.max()
    return {t: round(float(v), 4) for t, v in zip(g[0], lg) if abs(v) > 1e-6}


def test_dry_penalises_the_token_that_extends_a_repeat():
    # llama.cpp's own example: "a b c c b c y a b c": c would extend "a b c" (3), y would extend "b c" (2),
    # b would extend "c" (1 < 2: no penalty); penalty = 1 * 2 ** (length - 2)
    assert dry_penalties([A, B, C, C, B, C, Y, A, B, C]) == {C: -2.0, Y: -1.0}
    assert dry_penalties([A, B, C, C, B, C, Y, A, B, C], dry_allowed_length=1) == {C: -4.0, Y: -2.0, B: -1.0}
    # only the last dry_penalty_last_n tokens count: the last 4 ("y a b c") hold no repeat
    assert dry_penalties([A, B, C, C, B, C, Y, A, B, C], dry_penalty_last_n=4) == {}
    assert dry_penalties([A, B, C, C, B, C, Y, A, B, C], dry_multiplier=0.0) == {}


def test_dry_sequence_breakers():
    # without a breaker "a x b c" repeats 4 long: y gets 2 ** (4 - 2)
    assert dry_penalties([A, X, B, C, Y, A, X, B, C]) == {Y: -4.0}
    # with "\n" in its place the repeat counts from the breaker on: "b c", 2 long
    assert dry_penalties([A, NL, B, C, Y, A, NL, B, C]) == {Y: -1.0}
    # a token containing a breaker (":" in "a:b") breaks too
    assert dry_penalties([A, AB, B, C, Y, A, AB, B, C]) == {Y: -1.0}
    # a breaker that would extend a repeat is not penalised itself
    assert dry_penalties([A, B, NL, A, B]) == {}
    assert dry_penalties([A, B, X, A, B]) == {X: -1.0}
    # breakers are the parameter's: without ":" the "a:b" token is an ordinary one
    assert dry_penalties([A, AB, B, C, Y, A, AB, B, C], dry_sequence_breakers=("\n",)) == {Y: -4.0}


def test_temperature_0_with_dynatemp_samples_as_llama_cpp_does():
    """llama.cpp has no greedy shortcut: with dynatemp_range > 0, temperature 0 spans [0, range] by the
    entropy (temp_ext), and a range of .5 on these logits gives a temperature above 0."""
    x = probs(0.3, 0.25, 0.2, 0.15, 0.1)
    t = R.dynamic_temperature(x.tolist(), 0.0, 0.5, 1.0)
    assert 0.4 < t < 0.5
    r = ref(x, temperature=0.0, dynatemp_range=0.5)
    assert len(r[0]) == 5
    assert_same(got(x, temperature=0.0, dynatemp_range=0.5), r)


def test_mirostat_replaces_the_chain():
    """mirostat 1 and 2: logit bias, temperature, mirostat; no penalties, DRY, top-k, top-p, min-p."""
    x = logits_from(3, 64, 2.0)
    hist = [int(i) for i in np.argsort(-x)[:5]]
    for v in (1, 2):
        kw = dict(mirostat=v, mirostat_tau=3.0, temperature=0.9, top_k=2, min_p=0.5, repeat_penalty=2.0,
                  dry_multiplier=1.0)
        r = ref(x, hist, (VOCAB * 6)[:64], n_ctx=64, **kw)
        assert_same(got(x, hist, (VOCAB * 6)[:64], n_ctx=64, **kw), r, f"mirostat {v}")
        assert_same(r, ref(x, mirostat=v, mirostat_tau=3.0, temperature=0.9))
        assert len(r[0]) > 2


# ---------------------------------------------------------------------------------------------- history


def test_accept_builds_the_history_and_sample_accepts():
    x = np.array([2.0, 1.9, 1.8, 0.0], dtype=np.float32)
    kw = dict(temperature=0.0, repeat_penalty=1.5, frequency_penalty=0.1)
    one = Sampler(SamplingParams(**{**OFF, **kw}))
    for t in (0, 1):
        one.accept(t)
    many = Sampler(SamplingParams(**{**OFF, **kw}))
    many.accept([0, 1])
    assert canon(*one.distribution(x)) == canon(*many.distribution(x)) == ([2], [1.0])   # the prompt counts
    # distribution changes nothing; sample accepts its token: 2, then 0 (2 is now penalised), ...
    assert canon(*one.distribution(x)) == ([2], [1.0])
    seq = [one.sample(x) for _ in range(4)]
    hist, want = [0, 1], []
    for _ in range(4):
        ids, _p = ref(x, hist, **kw)
        want.append(ids[0])
        hist.append(ids[0])
    assert seq == want
    assert want[:2] == [2, 0]


def test_dry_sees_sampled_tokens():
    x = np.array([0.0] * len(VOCAB), dtype=np.float32)
    x[C] = 2.0
    x[Y] = 1.9
    kw = dict(temperature=0.0, dry_multiplier=1.0, dry_base=2.0, dry_allowed_length=1)
    s = Sampler(SamplingParams(**{**OFF, **kw}), tokenizer=PieceVocab.of(VOCAB), n_ctx=64)
    s.accept([A, B])
    seq = [s.sample(x) for _ in range(6)]
    hist, want = [A, B], []
    for _ in range(6):
        ids, _p = ref(x, hist, VOCAB, n_ctx=64, **kw)
        want.append(ids[0])
        hist.append(ids[0])
    assert seq == want
    assert seq != [C] * 6


# ---------------------------------------------------------------------------------------------- draws


# chi-square 99.9% quantiles (scipy.stats.chi2.ppf(0.999, df)), df 1..15; scipy is not a test dependency
CHI2_999 = [10.828, 13.816, 16.266, 18.467, 20.515, 22.458, 24.322, 26.124, 27.877, 29.588, 31.264, 32.909,
            34.528, 36.123, 37.697]


def chi2_stat(counts: np.ndarray, p: np.ndarray, n: int) -> tuple[float, int]:
    """Pearson's statistic over cells of expected count >= 5 (the rest pooled into one cell)."""
    e = p * n
    big = e >= 5
    obs, exp = list(counts[big]), list(e[big])
    if (~big).any():
        obs.append(counts[~big].sum())
        exp.append(e[~big].sum())
    obs, exp = np.asarray(obs, dtype=np.float64), np.asarray(exp)
    return float(((obs - exp) ** 2 / exp).sum()), len(exp) - 1


CHAINS = {
    "plain": dict(temperature=1.0),
    "default": dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
    "typical+hot": dict(temperature=1.5, typical_p=0.8, top_k=8),
    "dynatemp": dict(temperature=0.7, dynatemp_range=0.5, top_k=10),
    "xtc": dict(temperature=1.0, xtc_probability=1.0, xtc_threshold=0.1, top_k=12),
}


@pytest.mark.parametrize("name", list(CHAINS))
def test_sample_draws_from_the_distribution(name):
    """4,000 seeded draws against distribution(): chi-square at the 99.9% level (a fixed seed: the
    outcome is deterministic; a wrong distribution fails by hundreds)."""
    x = logits_from(11, 16, 1.5)
    kw = CHAINS[name]
    ids, p = got(x, **kw)
    assert_same((ids, p), ref(x, **kw))
    assert len(ids) > 1
    s = Sampler(SamplingParams(**{**OFF, **kw, "seed": 1234}))
    n = 4000
    draws = np.array([s.sample(x) for _ in range(n)])
    counts = np.array([(draws == t).sum() for t in ids])
    assert counts.sum() == n                       # never a token outside the distribution
    stat, df = chi2_stat(counts, np.asarray(p), n)
    assert 1 <= df <= len(CHI2_999)
    assert stat < CHI2_999[df - 1], (stat, df)


def test_sample_draws_with_penalties():
    """Penalties change the distribution after every draw: each draw from a fresh seeded sampler over the
    same history, against that history's distribution."""
    x = logits_from(12, 10, 1.0)
    hist = [0, 0, 3, 5]
    kw = dict(temperature=1.0, repeat_penalty=1.4, frequency_penalty=0.3, presence_penalty=0.2)
    ids, p = got(x, hist, **kw)
    assert_same((ids, p), ref(x, hist, **kw))
    draws = []
    for seed in range(3000):
        s = Sampler(SamplingParams(**{**OFF, **kw, "seed": seed}))
        s.accept(hist)
        draws.append(s.sample(x))
    draws = np.array(draws)
    stat, df = chi2_stat(np.array([(draws == t).sum() for t in ids]), np.asarray(p), len(draws))
    assert stat < CHI2_999[df - 1], (stat, df)


def test_a_seed_reproduces_its_draws():
    x = logits_from(13, 32, 1.0)
    kw = {**OFF, "temperature": 1.0, "xtc_probability": 0.5, "xtc_threshold": 0.05, "repeat_penalty": 1.2}

    def run(seed):
        s = Sampler(SamplingParams(**kw, seed=seed))
        s.accept([1, 2, 3])
        return [s.sample(x) for _ in range(40)]

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_xtc_coin():
    """xtc_probability .5: distribution() shows the coin the next sample() tosses (with a copy of the
    generator), and over 2,000 steps it comes up about half the time (4 sigma: 0.455..0.545)."""
    x = probs(0.5, 0.3, 0.1, 0.05, 0.05)
    kw = dict(temperature=1.0, xtc_probability=0.5, xtc_threshold=0.2)
    with_xtc = ref(x, **{**kw, "xtc_probability": 1.0})
    without = ref(x, **{**kw, "xtc_probability": 0.0})
    assert with_xtc[0] == [1, 2, 3, 4] and without[0] == [0, 1, 2, 3, 4]
    s = Sampler(SamplingParams(**{**OFF, **kw, "seed": 9}))
    up = 0
    for _ in range(2000):
        d = canon(*s.distribution(x))
        assert d == canon(*s.distribution(x))       # no state change
        if d[0] == with_xtc[0]:
            assert_same(d, with_xtc)
            up += 1
        else:
            assert_same(d, without)
        assert s.sample(x) in d[0]
    assert 910 <= up <= 1090, up


# ---------------------------------------------------------------------------------------------- mirostat


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mirostat_mu_follows_the_reference(version, seed):
    """40 draws over changing logits: at every step distribution() is the reference's truncation at the
    reference's mu, and mu moves by eta * (surprise of the drawn token - tau), the same token fed to
    both. A wrong update shows within a few steps as another truncation."""
    tau, eta = 3.0, 0.3
    kw = dict(temperature=1.0, mirostat=version, mirostat_tau=tau, mirostat_eta=eta, seed=seed)
    s = Sampler(SamplingParams(**{**OFF, **kw}))
    rng = np.random.default_rng(100 + seed)
    mu = 2 * tau
    sizes, checked = set(), 0
    for step in range(40):
        x = (rng.standard_normal(64) * rng.uniform(1.0, 4.0)).astype(np.float32)
        prm = R.Params(**{k: v for k, v in kw.items() if k != "seed"}, top_k=0, top_p=1.0, min_p=0.0)
        try:
            r = canon(*R.chain(x.tolist(), prm, mu=mu))
        except (R.Ambiguous, R.Undefined):
            break                                      # the truncation is not pinned down: stop here
        d = canon(*s.distribution(x))
        assert_same(d, r, f"mirostat {version} step {step} mu {mu}")
        t = s.sample(x)
        assert t in r[0]
        mu = R.mirostat_update(mu, dict(zip(*r))[t], tau, eta)
        if hasattr(s, "mu"):                           # ggmlpy exposes it: compare it directly as well
            assert s.mu == pytest.approx(mu, rel=1e-5, abs=1e-5), step
        sizes.add(len(r[0]))
        checked += 1
    assert checked >= 15, checked
    assert len(sizes) > 2                              # mu moved the cut


# ---------------------------------------------------------------------------------------------- exhaustive orders


def test_every_pair_order_of_the_filters():
    """Each ordered pair of filters on one row: the order decides the result where the filters do not
    commute (e.g. min_p then top_p against top_p then min_p with min_keep), and ggmlpy follows it."""
    x = probs(0.3, 0.25, 0.15, 0.12, 0.08, 0.06, 0.04)
    kw = dict(temperature=1.3, top_k=5, top_p=0.7, min_p=0.3, typical_p=0.9, top_n_sigma=1.0,
              xtc_probability=1.0, xtc_threshold=0.2, min_keep=2)
    distinct = set()
    for a, b in itertools.permutations(("top_n_sigma", "top_k", "typical_p", "top_p", "min_p", "xtc",
                                        "temperature"), 2):
        try:
            r = ref(x, samplers=(a, b), **kw)
        except (R.Ambiguous, R.Undefined):
            continue
        assert_same(got(x, samplers=(a, b), **kw), r, f"{a} then {b}")
        distinct.add(tuple(r[0]))
    assert len(distinct) >= 5
