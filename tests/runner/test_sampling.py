"""Sampling and log-probabilities (ggmlpy.sampling): pure numpy, no ggml.

Statistical tests use fixed seeds, so they are deterministic; their
tolerances are stated where they are used. No timing assertions.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ggmlpy.sampling import (
    MAX_TOP_LOGPROBS,
    Logprobs,
    Sampler,
    SamplingParams,
    TokenLogprob,
    log_softmax,
    logprobs,
)

#: Greedy decoding (``SamplingParams()`` samples: the library's defaults are llama.cpp's).
GREEDY = SamplingParams(temperature=0)


def plain(**kw) -> SamplingParams:
    """SamplingParams with each filter (top-k, top-p, min-p) off unless given: the tests here look at one
    filter at a time, and the defaults turn all three on."""
    return SamplingParams(**{"top_k": 0, "top_p": 1.0, "min_p": 0.0, **kw})


# chi-square 99.9% quantiles for small df (scipy.stats.chi2.ppf(0.999, df)).
_CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}


def chi2_999(df: int) -> float:
    """99.9% quantile of chi-square(df): the table above, else Wilson-Hilferty
    (within 1% of the exact value for df >= 8)."""
    if df in _CHI2_999:
        return _CHI2_999[df]
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + 3.090232 * math.sqrt(a)) ** 3


# --------------------------------------------------------------------------- references


def ref_distribution(logits, params: SamplingParams) -> np.ndarray:
    """The sampling distribution by the book, in llama.cpp's default order: full stable sort, float64.

    top_k -> softmax -> top_p (smallest prefix with mass >= p) -> min_p (p >= min_p * p_max)
    -> temperature -> softmax. (Orders ``samplers=`` names are supported for top_k, top_p, min_p and
    temperature alone.)
    """
    x = np.asarray(logits, dtype=np.float64)
    n = x.size
    out = np.zeros(n)
    if params.temperature == 0:
        out[int(np.argmax(x))] = 1.0
        return out
    order = sorted(range(n), key=lambda i: (-x[i], i))
    z = np.array([x[i] for i in order])
    for name in params.samplers:
        p = np.exp(z - z.max())
        p /= p.sum()
        if name == "top_k" and 0 < params.top_k < len(order):
            order, z = order[: params.top_k], z[: params.top_k]
        elif name == "top_p" and params.top_p < 1:
            cum = 0.0
            for j, pj in enumerate(p):
                cum += pj
                if cum >= params.top_p:
                    order, z = order[: j + 1], z[: j + 1]
                    break
        elif name == "min_p" and params.min_p > 0:
            keep = p >= params.min_p * p.max()
            order = [i for i, k in zip(order, keep) if k]
            z = z[keep]
        elif name == "temperature":
            z = z / params.temperature
    w = np.exp(z - z.max())
    out[order] = w / w.sum()
    return out


def draw(params: SamplingParams, logits, n: int) -> np.ndarray:
    s = Sampler(params)
    return np.array([s.sample(logits) for _ in range(n)])


def chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic over the categories with positive probability, and its df."""
    support = probs > 0
    assert counts[~support].sum() == 0, "a token outside the support was drawn"
    n = counts.sum()
    expected = probs[support] * n
    stat = float((((counts[support] - expected) ** 2) / expected).sum())
    return stat, int(support.sum()) - 1


def logits_of(probs) -> np.ndarray:
    return np.log(np.asarray(probs, dtype=np.float64)).astype(np.float32)


# --------------------------------------------------------------------------- params


def test_params_defaults_are_the_tables():
    # llama.cpp's, llama-cpp-python's and Ollama's sampling, from ggmlpy.defaults (the CLI's too)
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (0.8, 40, 0.95, 0.05) and not p.greedy
    assert p.seed is None and p.logprobs is False and p.top_logprobs == 0
    assert SamplingParams(temperature=0).greedy and SamplingParams(temperature=0, top_k=3).top_p == 0.95


def test_params_are_frozen_and_normalised():
    p = SamplingParams(temperature=1, top_k=np.int64(5), top_p=np.float32(0.5), seed=np.uint8(3))
    assert type(p.temperature) is float and p.temperature == 1.0
    assert type(p.top_k) is int and type(p.top_p) is float and type(p.seed) is int
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 2.0  # type: ignore[misc]


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"temperature": "1"}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"top_k": 1.5}, "top_k"),
    ({"top_k": None}, "top_k"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": -0.5}, "top_p"),
    ({"top_p": 1.0001}, "top_p"),
    ({"top_p": float("nan")}, "top_p"),
    ({"min_p": -0.01}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"seed": -1}, "seed"),
    ({"seed": 1.0}, "seed"),
    ({"logprobs": 1}, "logprobs"),
    ({"top_logprobs": -1}, "top_logprobs"),
    ({"top_logprobs": MAX_TOP_LOGPROBS + 1}, "top_logprobs"),
    ({"top_logprobs": 2.0}, "top_logprobs"),
])
def test_params_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_params_accepts_edges():
    SamplingParams(temperature=0.0, top_p=1.0, min_p=0.0, top_logprobs=0)
    SamplingParams(temperature=1e-6, top_p=1e-6, min_p=1.0, top_logprobs=MAX_TOP_LOGPROBS, seed=0)
    SamplingParams(top_k=-5)  # negative top_k means off


def test_sampler_rejects_other_params():
    with pytest.raises(TypeError):
        Sampler({"temperature": 1.0})  # type: ignore[arg-type]
    assert Sampler().params == SamplingParams()


# --------------------------------------------------------------------------- greedy


def test_greedy_is_argmax_large_vocab():
    rng = np.random.default_rng(0)
    s = Sampler(GREEDY)
    for _ in range(20):
        x = rng.standard_normal(150_000).astype(np.float32)
        assert s.sample(x) == int(np.argmax(x))


def test_greedy_ties_lowest_id_and_masked():
    x = np.array([-np.inf, 1.0, 3.0, 3.0, -np.inf], dtype=np.float32)
    assert Sampler(GREEDY).sample(x) == 2
    # the greedy path ignores every other option
    assert Sampler(SamplingParams(temperature=0, top_k=3, top_p=0.1, min_p=0.9, seed=1)).sample(x) == 2


def test_greedy_does_not_consume_randomness():
    x = np.array([0.0, 1.0, 0.5], dtype=np.float32)
    s = Sampler(SamplingParams(temperature=0, seed=5))
    assert [s.sample(x) for _ in range(10)] == [1] * 10


@pytest.mark.parametrize("temperature", [0.1, 1.0, 5.0])
def test_top_k_one_is_greedy(temperature):
    rng = np.random.default_rng(1)
    s = Sampler(plain(temperature=temperature, top_k=1, seed=3))
    for _ in range(50):
        x = rng.standard_normal(5000).astype(np.float32)
        assert s.sample(x) == int(np.argmax(x))
    x = np.array([0.0, 2.0, 2.0, 1.0], dtype=np.float32)  # tie: the lower id wins
    assert {s.sample(x) for _ in range(50)} == {1}


def test_tiny_temperature_is_greedy_without_warnings():
    x = np.array([0.0, 1.0, 0.999, -np.inf], dtype=np.float32)
    s = Sampler(plain(temperature=1e-300, seed=0))
    with np.errstate(all="raise"):
        assert {s.sample(x) for _ in range(100)} == {1}


# --------------------------------------------------------------------------- seeds


def test_seed_reproducible_and_seeds_differ():
    rng = np.random.default_rng(2)
    rows = [rng.standard_normal(1000).astype(np.float32) for _ in range(200)]
    params = plain(temperature=1.5, top_p=0.95, seed=1234)
    a = Sampler(params)
    b = Sampler(params)
    ta = [a.sample(r) for r in rows]
    assert ta == [b.sample(r) for r in rows]
    c = Sampler(dataclasses.replace(params, seed=1235))
    assert ta != [c.sample(r) for r in rows]


def test_samplers_have_independent_generators():
    x = np.zeros(100, dtype=np.float32)
    params = plain(temperature=1.0, seed=9)
    a, b = Sampler(params), Sampler(params)
    ref = [Sampler(params).sample(x) for _ in range(1)]  # fresh sampler, first draw
    seq_a = []
    for _ in range(20):
        seq_a.append(a.sample(x))
        b.sample(x)  # interleaving another sampler must not disturb a
    assert seq_a[0] == ref[0]
    assert seq_a == [Sampler(params).sample(x)] + seq_a[1:]
    c = Sampler(params)
    assert [c.sample(x) for _ in range(20)] == seq_a


def test_unseeded_samplers_vary():
    x = np.zeros(1000, dtype=np.float32)
    params = plain(temperature=1.0)
    runs = {tuple(Sampler(params).sample(x) for _ in range(8)) for _ in range(5)}
    assert len(runs) > 1


# --------------------------------------------------------------------------- distributions


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_matches_softmax(temperature):
    """Draws follow softmax(logits / T): Pearson chi-square below the 99.9% quantile
    (df = 7) and every frequency within 0.01 of its probability, over 40,000 draws."""
    logits = np.array([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.25, 1.5], dtype=np.float32)
    n = 40_000
    tokens = draw(plain(temperature=temperature, seed=17), logits, n)
    counts = np.bincount(tokens, minlength=logits.size)
    z = logits.astype(np.float64) / temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    stat, df = chi_square(counts, probs)
    assert stat < chi2_999(df), (stat, counts, probs * n)
    assert np.max(np.abs(counts / n - probs)) < 0.01


@pytest.mark.parametrize("params", [
    plain(temperature=0.8, top_k=5, seed=3),
    plain(temperature=1.3, top_p=0.7, seed=4),
    plain(temperature=1.0, min_p=0.2, seed=5),
    SamplingParams(temperature=0.7, top_k=12, top_p=0.9, min_p=0.05, seed=6),
    plain(temperature=2.0, top_k=40, top_p=0.5, seed=7),
], ids=["top_k", "top_p", "min_p", "all", "top_k+top_p"])
def test_pipeline_matches_reference_distribution(params):
    """Full pipeline vs :func:`ref_distribution`: nothing outside the reference support,
    chi-square below the 99.9% quantile over 30,000 draws."""
    rng = np.random.default_rng(11)
    logits = (rng.standard_normal(64) * 1.5).astype(np.float32)
    probs = ref_distribution(logits, params)
    counts = np.bincount(draw(params, logits, 30_000), minlength=logits.size)
    stat, df = chi_square(counts, probs)
    assert df >= 1
    assert stat < chi2_999(df), (stat, df)


# --------------------------------------------------------------------------- filters


def support_seen(params, logits, n=3000) -> set[int]:
    return set(draw(params, logits, n).tolist())


@pytest.mark.parametrize("top_p, expected", [
    (0.3, {0}),            # 0.5 >= 0.3
    (0.6, {0, 1}),         # 0.5 < 0.6 <= 0.8
    (0.85, {0, 1, 2}),     # 0.8 < 0.85 <= 0.95
    (0.97, {0, 1, 2, 3}),  # 0.95 < 0.97
    (1.0, {0, 1, 2, 3}),
])
def test_top_p_keeps_smallest_set_reaching_p(top_p, expected):
    # token probabilities 0.5, 0.3, 0.15, 0.05, deliberately not in id order
    probs = {2: 0.5, 0: 0.3, 3: 0.15, 1: 0.05}
    logits = logits_of([probs[i] for i in range(4)])
    rank = [2, 0, 3, 1]  # tokens by descending probability
    want = {rank[i] for i in expected}
    assert support_seen(plain(temperature=1.0, top_p=top_p, seed=8), logits) == want


def test_top_p_large_vocab_ties_go_to_lower_ids():
    """The nucleus needs ~500 of 1,000 equal logits hidden in 50,000: the sampler must
    widen its search window and, among equal logits, keep the lowest ids."""
    rng = np.random.default_rng(12)
    n = 50_000
    logits = np.full(n, -20.0, dtype=np.float32)
    hot = np.sort(rng.choice(n, size=1000, replace=False))
    logits[hot] = 5.0
    params = plain(temperature=1.0, top_p=0.5, seed=13)
    ref = ref_distribution(logits, params)
    allowed = set(np.flatnonzero(ref > 0).tolist())
    assert allowed == set(hot[: len(allowed)].tolist())  # the lowest-id prefix of the ties
    assert 480 <= len(allowed) <= 520
    seen = support_seen(params, logits, 600)
    assert seen <= allowed
    assert len(seen) > 0.6 * len(allowed)  # 600 draws from ~500 tokens see ~70% of them


def test_top_k_boundary_ties_go_to_lower_ids():
    logits = np.array([1.0, 3.0, 2.0, 2.0, 2.0, 0.0], dtype=np.float32)
    params = plain(temperature=1.0, top_k=3, seed=14)
    assert support_seen(params, logits) == {1, 2, 3}


@pytest.mark.parametrize("min_p, expected", [
    (0.6, {0, 1}),        # threshold 0.24: 0.4, 0.3 survive
    (0.45, {0, 1, 2}),    # threshold 0.18
    (0.2, {0, 1, 2, 3}),  # threshold 0.08
    (1.0, {0}),
])
def test_min_p_drops_below_fraction_of_max(min_p, expected):
    logits = logits_of([0.4, 0.3, 0.2, 0.1])
    assert support_seen(plain(temperature=1.0, min_p=min_p, seed=15), logits) == expected


def test_mostly_masked_large_vocab():
    """Grammar-style masking: 150,000 tokens, all but 20 at -inf."""
    n = 150_000
    logits = np.full(n, -np.inf, dtype=np.float32)
    live = np.arange(7, n, n // 20)[:20]
    logits[live] = np.linspace(0.0, 1.0, live.size, dtype=np.float32)
    for params in (plain(temperature=1.0, top_k=5, seed=2),
                   plain(temperature=1.0, top_k=40, seed=2),
                   plain(temperature=1.0, top_p=0.5, seed=2),
                   plain(temperature=1.0, min_p=0.5, seed=2)):
        want = set(np.flatnonzero(ref_distribution(logits, params) > 0).tolist())
        assert want <= set(live.tolist())
        assert support_seen(params, logits, 300) == want


def test_masked_tokens_never_drawn():
    logits = np.array([0.0, -np.inf, 0.0, -np.inf, 0.0], dtype=np.float32)
    for params in (plain(temperature=1.0, seed=1),
                   plain(temperature=1.0, top_k=4, seed=1),
                   plain(temperature=3.0, top_p=0.99, seed=1),
                   plain(temperature=3.0, min_p=0.0001, seed=1)):
        assert support_seen(params, logits, 600) == {0, 2, 4}


# --------------------------------------------------------------------------- order


def test_order_top_k_before_softmax_before_top_p():
    """Probabilities 0.4, 0.3, 0.3. top_k=2 keeps {0, 1} and renormalises to 4/7, 3/7,
    so top_p=0.5 then keeps token 0 alone. Applying top_p to the full distribution
    first (0.4 < 0.5, keep {0, 1}) and top_k after would allow token 1 as well."""
    logits = logits_of([0.4, 0.3, 0.3])
    params = plain(temperature=1.0, top_k=2, top_p=0.5, seed=21)
    assert support_seen(params, logits) == {0}
    assert support_seen(dataclasses.replace(params, top_k=0), logits) == {0, 1}


def test_order_temperature_after_top_p():
    """llama.cpp's order: top_p cuts the distribution at T=1, temperature comes last. Probabilities
    0.6, 0.3, 0.1: top_p=0.55 keeps token 0 alone at any temperature; with the temperature moved
    before top_p (``samplers=``, Ollama's order), T=3 tempers them to about 0.43, 0.34, 0.24 and
    top_p=0.55 keeps {0, 1}."""
    logits = logits_of([0.6, 0.3, 0.1])
    assert support_seen(plain(temperature=1.0, top_p=0.55, seed=22), logits) == {0}
    assert support_seen(plain(temperature=3.0, top_p=0.55, seed=22), logits) == {0}
    ollama = ("top_k", "temperature", "top_p", "min_p")
    assert support_seen(plain(temperature=3.0, top_p=0.55, seed=22, samplers=ollama), logits) == {0, 1}


def test_order_temperature_after_min_p():
    """Probabilities 0.4, 0.3, 0.2, 0.1, min_p=0.6: the ratios to the max at T=1 are 1, .75, .5, .25
    -> {0, 1} whatever the temperature (it runs last); with the temperature first, T=2 makes them
    1, .87, .71, .5 -> {0, 1, 2}."""
    logits = logits_of([0.4, 0.3, 0.2, 0.1])
    assert support_seen(plain(temperature=1.0, min_p=0.6, seed=23), logits) == {0, 1}
    assert support_seen(plain(temperature=2.0, min_p=0.6, seed=23), logits) == {0, 1}
    first = ("temperature", "min_p")
    assert support_seen(plain(temperature=2.0, min_p=0.6, seed=23, samplers=first), logits) == {0, 1, 2}


def test_order_top_p_then_min_p_uses_unrenormalised_max():
    """min_p compares with the largest probability, which top_p always keeps, so the
    two filters combine as the intersection of their sets."""
    logits = logits_of([0.4, 0.3, 0.2, 0.1])
    params = plain(temperature=1.0, top_p=0.85, min_p=0.6, seed=24)
    assert support_seen(params, logits) == {0, 1}
    params = plain(temperature=1.0, top_p=0.5, min_p=0.2, seed=24)
    assert support_seen(params, logits) == {0, 1}


@settings(max_examples=60, deadline=None)
@given(
    logits=st.lists(st.floats(-8, 8, allow_nan=False, width=32), min_size=1, max_size=40),
    temperature=st.floats(0.05, 4.0),
    top_k=st.integers(-1, 45),
    top_p=st.floats(0.05, 1.0),
    min_p=st.floats(0.0, 0.95),
    seed=st.integers(0, 2**32),
)
def test_samples_stay_in_reference_support(logits, temperature, top_k, top_p, min_p, seed):
    """Every token drawn lies in the support of the by-the-book distribution, computed
    with the filters loosened by 1e-9 to absorb float rounding at exact boundaries."""
    x = np.array(logits, dtype=np.float32)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                            min_p=min_p, seed=seed)
    loose = dataclasses.replace(params, top_p=min(1.0, top_p + 1e-9),
                                min_p=max(0.0, min_p - 1e-9))
    support = set(np.flatnonzero(ref_distribution(x, loose) > 0).tolist())
    s = Sampler(params)
    for _ in range(20):
        assert s.sample(x) in support


# --------------------------------------------------------------------------- bad logits


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(), plain(temperature=1.0, seed=0),
                                    plain(temperature=1.0, top_k=2, seed=0)])
@pytest.mark.parametrize("bad, pattern", [
    ([0.0, np.nan, 1.0], "NaN"),
    ([0.0, np.inf, 1.0], r"\+inf"),
    ([np.nan, np.inf], "NaN and 1 \\+inf"),
    ([-np.inf, -np.inf], "all 2 logits are -inf"),
])
def test_invalid_logits_raise(params, bad, pattern):
    with pytest.raises(ValueError, match=pattern):
        Sampler(params).sample(np.array(bad, dtype=np.float32))


@pytest.mark.parametrize("bad", [np.zeros((2, 3), np.float32), np.zeros(0, np.float32),
                                 np.array(["a", "b"]), 3.0])
def test_bad_logits_shape_or_dtype(bad):
    with pytest.raises(ValueError):
        Sampler().sample(bad)


def test_integer_and_float16_logits_work():
    assert Sampler(GREEDY).sample(np.array([1, 5, 2])) == 1
    assert Sampler(plain(temperature=1.0, top_k=1, seed=0)).sample(
        np.array([1, 5, 2], dtype=np.float16)) == 1


# --------------------------------------------------------------------------- logprobs


def ref_log_softmax(x) -> list[float]:
    x = [float(v) for v in x]
    m = max(x)
    lse = m + math.log(math.fsum(math.exp(v - m) for v in x))
    return [v - lse for v in x]


def test_log_softmax_matches_float64_reference():
    rng = np.random.default_rng(30)
    x = (rng.standard_normal(5000) * 4).astype(np.float32)
    got = log_softmax(x)
    assert got.dtype == np.float64 and got.shape == x.shape
    np.testing.assert_allclose(got, ref_log_softmax(x), rtol=0, atol=1e-9)
    assert abs(math.fsum(np.exp(got)) - 1.0) < 1e-12


def test_log_softmax_is_stable_and_masks():
    x = np.array([1000.0, 999.0, -np.inf, -1000.0], dtype=np.float64)
    got = log_softmax(x)
    assert np.isfinite(got[[0, 1, 3]]).all() and got[2] == -np.inf
    np.testing.assert_allclose(got[[0, 1, 3]], [ref_log_softmax([1000.0, 999.0, -1000.0])[i]
                                                for i in range(3)], atol=1e-9)
    with pytest.raises(ValueError, match="NaN"):
        log_softmax(np.array([0.0, np.nan]))


def test_logprobs_token_and_top_order():
    logits = np.array([0.5, 2.0, -1.0, 2.0, 1.0, -np.inf, 0.5], dtype=np.float32)
    ref = ref_log_softmax(np.where(np.isinf(logits), -1e30, logits))
    out = logprobs(logits, 4, top_n=5)
    assert isinstance(out, Logprobs) and out.token == 4
    assert abs(out.logprob - ref[4]) < 1e-9
    # descending, ties by lower id: 1 and 3 (2.0), 4 (1.0), 0 and 6 (0.5)
    assert [t.token for t in out.top] == [1, 3, 4, 0, 6]
    assert all(isinstance(t, TokenLogprob) for t in out.top)
    for t in out.top:
        assert abs(t.logprob - ref[t.token]) < 1e-9
    assert all(isinstance(t.token, int) and isinstance(t.logprob, float) for t in out.top)
    masked = logprobs(logits, 5)
    assert masked.logprob == -math.inf and masked.top == []


def test_logprobs_full_vocab_raw_logits_large():
    rng = np.random.default_rng(31)
    x = (rng.standard_normal(32_000) * 3).astype(np.float32)
    ref = ref_log_softmax(x)
    out = logprobs(x, 123, top_n=MAX_TOP_LOGPROBS)
    assert abs(out.logprob - ref[123]) < 1e-9
    want = sorted(range(x.size), key=lambda i: (-x[i], i))[:MAX_TOP_LOGPROBS]
    assert [t.token for t in out.top] == want
    assert [t.logprob for t in out.top] == sorted((t.logprob for t in out.top), reverse=True)


def test_logprobs_top_n_larger_than_vocab():
    out = logprobs(np.array([0.0, 1.0], dtype=np.float32), 0, top_n=10)
    assert [t.token for t in out.top] == [1, 0]


@pytest.mark.parametrize("token, top_n", [(-1, 0), (3, 0), (1.0, 0), (0, -1)])
def test_logprobs_validation(token, top_n):
    with pytest.raises(ValueError):
        logprobs(np.zeros(3, np.float32), token, top_n)
