"""ggmlpy.sampling against llama.cpp itself, through llama-cpp-python's low-level API (0.3.36, the llama.cpp
that vendor/ggml/PIN and tests/hf_convert.py pin).

1. On token arrays (no model): llama.cpp's sampler chain, built as common_sampler_init builds it
   (logit bias, then the samplers in order, temperature as temp_ext), applied to random logits with a
   history accepted first; its surviving candidates equal ggmlpy's ``Sampler.distribution`` and the
   numpy reference's (sampling_reference.py), probabilities to 1e-6. This also checks the reference.
2. DRY with llama.cpp's real llama-bpe vocabulary (a vocab-only load): the sequence breakers are found
   in the token texts as llama.cpp finds them.
3. Greedy decoding on a converted model (tests/text_helpers.py: a tiny random Llama with the llama-bpe
   vocabulary), step by step: llama.cpp's logits go to both llama.cpp's chain (logit bias, penalties,
   DRY, greedy) and a ggmlpy Sampler with the same settings and history (the prompt accepted first);
   the same token at every step, for each penalty alone, logit bias, DRY, and all together.
4. End to end: ``Runner.generate`` on the same F32 file with ``temperature=0`` and those settings gives
   llama.cpp's own generation.

llama-cpp-python is not a test dependency and .ci/run does not install it: without it the module skips,
under CI too.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import sampling_reference as R
from hypothesis import assume, given, settings
from hypothesis import strategies as st

L = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (.ci/run does not install it)")

from test_sampling_chain import PieceVocab  # noqa: E402

from ggmlpy.sampling import DEFAULT_SAMPLERS, Sampler, SamplingParams  # noqa: E402

# every filter off, temperature 1: a test turns on what it looks at
OFF = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
BREAKERS = ("\n", ":", '"', "*")


@L.llama_log_callback
def _quiet(level, text, user_data):  # llama.cpp logs every load and context to stderr
    pass


L.llama_log_set(_quiet, ctypes.c_void_p(0))
L.llama_backend_init()


def full(kw: dict) -> dict:
    """ggmlpy's defaults (SamplingParams) under ``kw``."""
    p = SamplingParams(**kw)
    names = ("temperature", "top_k", "top_p", "min_p", "typical_p", "top_n_sigma", "min_keep", "repeat_penalty",
             "repeat_last_n", "frequency_penalty", "presence_penalty", "logit_bias", "xtc_probability",
             "xtc_threshold", "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n",
             "dry_sequence_breakers", "dynatemp_range", "dynatemp_exponent", "samplers")
    return {n: getattr(p, n) for n in names}


class Chain:
    """llama.cpp's chain for ggmlpy settings ``kw``, as common_sampler_init builds it; ``final`` is
    "greedy", "dist" (seeded) or None (no picker: for reading the candidates). -1 lengths are ``n_ctx``
    (the pinned llama.cpp would clamp them to 0, off; ggmlpy follows llama-server's older -1 = context)."""

    def __init__(self, kw: dict, n_vocab: int, *, vocab=None, n_ctx: int = 0, final=None, seed: int = 0,
                 samplers=None):
        p = full(kw)
        self.ptr = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())

        def add(s):
            L.llama_sampler_chain_add(self.ptr, s)

        def length(n):
            return n_ctx if n == -1 else n

        if p["logit_bias"]:
            lb = p["logit_bias"]
            items = list(lb.items()) if isinstance(lb, dict) else list(lb)     # ggmlpy keeps (id, bias) pairs
            arr = (L.llama_logit_bias * len(items))(*[L.llama_logit_bias(int(t), float(b)) for t, b in items])
            add(L.llama_sampler_init_logit_bias(n_vocab, len(items), arr))
        for name in (p["samplers"] if samplers is None else samplers):
            if name == "penalties":
                add(L.llama_sampler_init_penalties(n_vocab, length(p["repeat_last_n"]), p["repeat_penalty"],
                                                   p["frequency_penalty"], p["presence_penalty"]))
            elif name == "dry":
                if p["dry_multiplier"] == 0.0:
                    continue
                assert vocab is not None, "DRY needs llama.cpp's vocabulary"
                bs = [b.encode() for b in p["dry_sequence_breakers"]]
                arr = (ctypes.c_char_p * len(bs))(*bs)
                add(L.llama_sampler_init_dry(vocab, p["dry_multiplier"], p["dry_base"], p["dry_allowed_length"],
                                             length(p["dry_penalty_last_n"]), arr, len(bs)))
            elif name == "top_n_sigma":
                add(L.llama_sampler_init_top_n_sigma(p["top_n_sigma"]))
            elif name == "top_k":
                add(L.llama_sampler_init_top_k(p["top_k"]))
            elif name == "typical_p":
                add(L.llama_sampler_init_typical(p["typical_p"], p["min_keep"]))
            elif name == "top_p":
                add(L.llama_sampler_init_top_p(p["top_p"], p["min_keep"]))
            elif name == "min_p":
                add(L.llama_sampler_init_min_p(p["min_p"], p["min_keep"]))
            elif name == "xtc":
                add(L.llama_sampler_init_xtc(p["xtc_probability"], p["xtc_threshold"], p["min_keep"], seed))
            elif name == "temperature":
                add(L.llama_sampler_init_temp_ext(p["temperature"], p["dynatemp_range"], p["dynatemp_exponent"]))
            else:
                raise ValueError(name)
        if final == "greedy":
            add(L.llama_sampler_init_greedy())
        elif final == "dist":
            add(L.llama_sampler_init_dist(seed))

    def accept(self, tokens) -> None:
        for t in tokens:
            L.llama_sampler_accept(self.ptr, int(t))

    def candidates(self, logits: np.ndarray) -> tuple[list, list]:
        """Apply the chain to the array of all tokens: (ids, probabilities) of the finite survivors."""
        n = logits.size
        data = (L.llama_token_data * n)()
        for i in range(n):
            data[i].id, data[i].logit, data[i].p = i, float(logits[i]), 0.0
        cur = L.llama_token_data_array(data, n, -1, False)
        L.llama_sampler_apply(self.ptr, ctypes.byref(cur))
        c = R.Cands([cur.data[i].logit for i in range(cur.size)], [cur.data[i].id for i in range(cur.size)])
        return canon(*c.finite())

    def sample(self, ctx) -> int:
        return int(L.llama_sampler_sample(self.ptr, ctx, -1))

    def close(self) -> None:
        L.llama_sampler_free(self.ptr)


# llama.cpp's softmax is expf in float32: a probability below ~1e-38 is 0 there (never drawn); ggmlpy's may
# keep or flush it. Both sides drop what is below this.
TINY = 1e-30


def canon(ids, probs) -> tuple[list, list]:
    ids, probs = np.asarray(ids, dtype=np.int64), np.asarray(probs, dtype=np.float64)
    keep = probs > TINY
    order = np.argsort(ids[keep])
    return ids[keep][order].tolist(), probs[keep][order].tolist()


def assert_same(g, r, what=""):
    assert g[0] == r[0], f"{what}: kept set {g[0]} != llama.cpp's {r[0]}"
    np.testing.assert_allclose(g[1], r[1], rtol=1e-5, atol=1e-6, err_msg=what)


def ggml_dist(kw, logits, history=(), vocab=None, n_ctx=None) -> tuple[list, list]:
    s = Sampler(SamplingParams(**kw), tokenizer=PieceVocab.of(vocab) if vocab is not None else None, n_ctx=n_ctx)
    if len(history):
        s.accept(list(history))
    return canon(*s.distribution(np.asarray(logits, dtype=np.float32)))


def ref_dist(kw, logits, history=(), n_ctx=None, breakers=None) -> tuple[list, list]:
    p = full(kw)
    p.pop("dry_sequence_breakers")
    p["logit_bias"] = dict(p["logit_bias"]) if p["logit_bias"] else None
    p = {k: float(np.float32(v)) if isinstance(v, float) else v for k, v in p.items()}
    return canon(*R.chain(np.asarray(logits, dtype=np.float32).tolist(), R.Params(**p), list(history),
                          n_ctx=n_ctx, breakers=breakers))


# ---------------------------------------------------------------------------------------------- 1. token arrays


def logits_from(seed: int, n: int, scale: float) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32)


array_settings = st.fixed_dictionaries({
    "temperature": st.sampled_from([0.0, 0.6, 1.0, 1.8]),
    "top_k": st.sampled_from([0, 1, 3, 10, 40]),
    "top_p": st.sampled_from([1.0, 0.95, 0.7, 0.4]),
    "min_p": st.sampled_from([0.0, 0.05, 0.2]),
    "typical_p": st.sampled_from([1.0, 0.9, 0.5]),
    "top_n_sigma": st.sampled_from([-1.0, 0.8, 2.0]),
    "min_keep": st.sampled_from([0, 1, 3]),
    "repeat_penalty": st.sampled_from([1.0, 0.8, 1.5]),
    "repeat_last_n": st.sampled_from([0, 4, 64, -1]),
    "frequency_penalty": st.sampled_from([0.0, 0.5, -0.3]),
    "presence_penalty": st.sampled_from([0.0, 0.7]),
    "logit_bias": st.sampled_from([None, {0: 2.0, 3: -1.5}, {1: -np.inf}, {2: 5.0, 5: -np.inf}]),
    "xtc_probability": st.sampled_from([0.0, 1.0]),
    "xtc_threshold": st.sampled_from([0.05, 0.15, 0.3]),
    "dynatemp_range": st.sampled_from([0.0, 0.0, 0.4]),
    "dynatemp_exponent": st.sampled_from([1.0, 2.0]),
})


@settings(max_examples=200)
@given(st.integers(0, 2**32 - 1), st.integers(6, 64), st.floats(0.3, 5.0), st.lists(st.integers(0, 63), max_size=30),
       array_settings, st.one_of(st.just(DEFAULT_SAMPLERS), st.permutations(DEFAULT_SAMPLERS)))
def test_chain_on_token_arrays_equals_llama_cpp(seed, n, scale, history, kw, order):
    x = logits_from(seed, n, scale)
    history = [t % n for t in history]
    kw = {**kw, "samplers": tuple(s for s in order if s != "dry")}
    try:
        r = ref_dist(kw, x, history, n_ctx=32)
    except (R.Ambiguous, R.Undefined):
        assume(False)
    ch = Chain(kw, n, n_ctx=32)
    try:
        ch.accept(history)
        want = ch.candidates(x)
    finally:
        ch.close()
    assert_same(r, want, f"the reference against llama.cpp: {kw}")
    assert_same(ggml_dist(kw, x, history, n_ctx=32), want, f"ggmlpy against llama.cpp: {kw}")


@pytest.mark.parametrize("version", [1, 2])
def test_mirostat_on_token_arrays_equals_llama_cpp(version):
    """llama.cpp's mirostat draws inside apply, with its own generator, and moves its mu by that draw: the
    reference, updated with llama.cpp's draws, follows llama.cpp's truncations over 30 steps (this checks
    the reference's mu update, which test_sampling_chain holds ggmlpy to); ggmlpy's first distribution
    (mu = 2 tau) equals llama.cpp's first truncation."""
    tau, eta, n = 3.0, 0.2, 64
    rng = np.random.default_rng(version)
    smpl = (L.llama_sampler_init_mirostat(n, 3, tau, eta, 100) if version == 1
            else L.llama_sampler_init_mirostat_v2(3, tau, eta))
    mu, steps = 2 * tau, 0
    try:
        for step in range(30):
            x = (rng.standard_normal(n) * rng.uniform(1.0, 3.0)).astype(np.float32)
            try:
                r = canon(*R.chain(x.tolist(), R.Params(temperature=1.0, mirostat=version, mirostat_tau=tau,
                                                        mirostat_eta=float(np.float32(eta))), mu=mu))
            except (R.Ambiguous, R.Undefined):
                break
            data = (L.llama_token_data * n)()
            for i in range(n):
                data[i].id, data[i].logit = i, float(x[i])
            cur = L.llama_token_data_array(data, n, -1, False)
            L.llama_sampler_apply(smpl, ctypes.byref(cur))
            got = canon([cur.data[i].id for i in range(cur.size)], [cur.data[i].p for i in range(cur.size)])
            assert_same(r, got, f"step {step}")
            if step == 0:
                kw = dict(OFF, mirostat=version, mirostat_tau=tau, mirostat_eta=eta)
                assert_same(ggml_dist(kw, x), got)
            t = cur.data[cur.selected].id
            mu = R.mirostat_update(mu, dict(zip(*r))[t], tau, float(np.float32(eta)))
            steps += 1
    finally:
        L.llama_sampler_free(smpl)
    assert steps >= 10


# ---------------------------------------------------------------------------------------------- 2. DRY, real vocabulary


def token_texts(vocab) -> list[bytes]:
    """Each token's bytes as llama.cpp's DRY sees them (detokenize with special tokens rendered)."""
    out = []
    buf = ctypes.create_string_buffer(256)
    for t in range(L.llama_vocab_n_tokens(vocab)):
        n = L.llama_token_to_piece(vocab, t, buf, len(buf), 0, True)
        out.append(buf.raw[:max(n, 0)])
    return out


def tokenize(vocab, text: str, add_special: bool = False) -> list[int]:
    b = text.encode()
    arr = (L.llama_token * (len(b) + 8))()
    n = L.llama_tokenize(vocab, b, len(b), arr, len(arr), add_special, True)
    assert n >= 0
    return list(arr[:n])


@pytest.fixture(scope="module")
def bpe_vocab():
    hf_convert = pytest.importorskip("hf_convert")
    path = hf_convert.vocab_file("llama-bpe")
    mp = L.llama_model_default_params()
    mp.vocab_only = True
    model = L.llama_model_load_from_file(str(path).encode(), mp)
    assert model
    vocab = L.llama_model_get_vocab(model)
    yield vocab, token_texts(vocab)
    L.llama_model_free(model)


DRY_TEXTS = [
    "the cat sat on the mat and the cat sat on the mat and the cat sat",
    "a: one two three four\nb: one two three four\nc: one two three",
    "a * b c d * a b c d * a b c",
    "def f(x): return x + 1\ndef g(x): return x + 1\ndef h(x): return x +",
]


@pytest.mark.parametrize("text", DRY_TEXTS)
@pytest.mark.parametrize("allowed,last_n", [(2, -1), (1, 16), (3, -1), (0, 16), (0, -1)])
def test_dry_with_the_llama_bpe_vocabulary(bpe_vocab, text, allowed, last_n):
    vocab, texts = bpe_vocab
    n = len(texts)
    history = tokenize(vocab, text)
    x = logits_from(len(text), n, 2.0)
    kw = dict(OFF, dry_multiplier=0.8, dry_base=1.75, dry_allowed_length=allowed, dry_penalty_last_n=last_n,
              samplers=("dry",))
    ch = Chain(kw, n, vocab=vocab, n_ctx=64)
    try:
        ch.accept(history)
        want = ch.candidates(x)
    finally:
        ch.close()
    plain = canon(np.arange(n), np.exp(x - x.max()) / np.exp(x - x.max()).sum())
    changed = [t for t, a, b in zip(want[0], want[1], plain[1]) if abs(a / b - 1) > 1e-4]
    assert changed, "DRY changed nothing: not a test"
    assert_same(ggml_dist(kw, x, history, texts, n_ctx=64), want, f"DRY on {text!r}")
    strs = [t.decode("utf-8", errors="replace") for t in texts]
    assert_same(ref_dist(kw, x, history, n_ctx=64, breakers=R.dry_breakers(strs, BREAKERS)), want)


#: breakers beyond one ASCII character: multi-byte ones (heads ending inside a character: tails tokenized from
#: bytes that are not UTF-8, which llama.cpp reads as U+FFFD each), and one of 42 bytes cut to 40 inside its
#: last "。": the cut's tail holds no whole "。" run, so unlike a cut to 13 whole characters it breaks nothing
WIDE_BREAKERS = [
    ("猫が座った。猫が座った。猫が座った。猫が座った", ("。",)),
    ("café au lait; café au lait; café au lait; café au", ("é", "; c")),
    ("猫が座った。。。。。。。。。。。。。。猫が座った。。。。。。。。。。。。。。猫が座った", ("。" * 14,)),
]


@pytest.fixture(scope="module")
def bpe_tokenizer():
    hf_convert = pytest.importorskip("hf_convert")
    from ggmlpy.tokenizer import Tokenizer

    return Tokenizer.from_gguf(hf_convert.vocab_file("llama-bpe"))


@pytest.mark.parametrize("text,breakers", WIDE_BREAKERS)
def test_dry_wide_breakers_equal_llama_cpp(bpe_vocab, bpe_tokenizer, text, breakers):
    """The breakers reach llama.cpp as the user gave them (llama.cpp cuts them itself); ggmlpy's cut and its
    breaker tokens give llama.cpp's candidates, and the breakers change the result (not a vacuous test)."""
    vocab, texts = bpe_vocab
    n = len(texts)
    history = tokenize(vocab, text)
    x = logits_from(len(text), n, 2.0)
    kw = dict(OFF, dry_multiplier=0.8, dry_base=1.75, dry_allowed_length=1, dry_penalty_last_n=-1,
              samplers=("dry",))
    raw = [b.encode() for b in breakers]
    smpl = L.llama_sampler_init_dry(vocab, 0.8, 1.75, 1, 64, (ctypes.c_char_p * len(raw))(*raw), len(raw))
    ch = Chain(dict(kw, dry_multiplier=0.0), n, n_ctx=64)    # the array plumbing; its DRY is the one added
    L.llama_sampler_chain_add(ch.ptr, smpl)
    try:
        ch.accept(history)
        want = ch.candidates(x)
    finally:
        ch.close()

    def mine(bs):
        s = Sampler(SamplingParams(**kw, dry_sequence_breakers=bs), tokenizer=bpe_tokenizer, n_ctx=64)
        s.accept(history)
        return canon(*s.distribution(x))

    def differs(g):
        return g[0] != want[0] or not np.allclose(g[1], want[1], rtol=1e-3)

    assert_same(mine(breakers), want, f"DRY with breakers {breakers!r} on {text!r}")
    if len(breakers[0]) < 14:
        assert differs(mine(())), "the breakers change nothing here: not a test"
    else:                                # a cut to the 13 whole characters would break the repeats
        assert differs(mine(("。" * 13,)))


# ---------------------------------------------------------------------------------------------- 3. greedy on a model


PROMPT = "The cat sat on the mat. The cat sat on the mat. The cat sat on the mat. The"
N_GEN = 24
N_CTX = 128


class LlamaModel:
    def __init__(self, path):
        mp = L.llama_model_default_params()
        self.model = L.llama_model_load_from_file(str(path).encode(), mp)
        assert self.model
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self.texts = token_texts(self.vocab)
        self.prompt = tokenize(self.vocab, PROMPT, add_special=True)

    def context(self):
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_threads, cp.n_threads_batch = N_CTX, N_CTX, N_CTX, 2, 2
        ctx = L.llama_init_from_model(self.model, cp)
        assert ctx
        return ctx

    def decode(self, ctx, tokens) -> np.ndarray:
        arr = (L.llama_token * len(tokens))(*tokens)
        assert L.llama_decode(ctx, L.llama_batch_get_one(arr, len(tokens))) == 0
        return np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(self.n_vocab,)).copy()

    def close(self):
        L.llama_model_free(self.model)


@pytest.fixture(scope="module")
def llama_model(tmp_path_factory):
    from text_helpers import llama_chat_gguf

    path = llama_chat_gguf(tmp_path_factory)
    m = LlamaModel(path)
    m.path = path
    yield m
    m.close()


def margin(logits: np.ndarray) -> float:
    top = np.sort(logits[np.isfinite(logits)])[-2:]
    return float(top[1] - top[0]) if top.size == 2 else np.inf


def greedy_steps(m: LlamaModel, kw: dict, final: str = "greedy", samplers=("penalties", "dry"),
                 ggml: bool = True) -> tuple[list, list]:
    """Generate N_GEN tokens with llama.cpp (its chain picks), giving each step's logits to a ggmlpy
    Sampler too: (llama.cpp's tokens, ggmlpy's tokens; the runs stop at the first difference)."""
    ctx = m.context()
    ch = Chain(kw, m.n_vocab, vocab=m.vocab, n_ctx=N_CTX, final=final, samplers=samplers)
    tok = PieceVocab.of(m.texts)
    s = Sampler(SamplingParams(**{**kw, "temperature": 0.0}), tokenizer=tok, n_ctx=N_CTX) if ggml else None
    try:
        ch.accept(m.prompt)
        if s:
            s.accept(m.prompt)
        logits = m.decode(ctx, m.prompt)
        mine, theirs = [], []
        for _ in range(N_GEN):
            b = ch.sample(ctx)
            theirs.append(b)
            if s:
                mine.append(s.sample(logits))
                if mine[-1] != b:
                    break
            logits = m.decode(ctx, [b])
        return theirs, mine
    finally:
        ch.close()
        L.llama_free(ctx)


_plain: dict = {}


def plain_run(m: LlamaModel, kw: dict) -> list:
    """llama.cpp's greedy run with ``kw`` (cached): the baseline a setting must change."""
    key = repr(sorted(kw.items()))
    if key not in _plain:
        _plain[key] = greedy_steps(m, kw, ggml=False)[0]
    return _plain[key]


def biases(m: LlamaModel) -> dict:
    """Logit biases chosen on the plain greedy run so that each one changes it: ban its first token,
    lower its third, raise a token it never picks."""
    plain = plain_run(m, dict(temperature=0.0))
    return {plain[0]: -np.inf, plain[2]: -3.0, 1000: 4.0}


def repeat_bias(m: LlamaModel) -> dict:
    """A bias that makes the prompt's repeat go on (" cat" after "... The", 1.5 above the arg-max), so
    that DRY has a repeat to penalise: the random model would not repeat by itself."""
    ctx = m.context()
    try:
        logits = m.decode(ctx, m.prompt)
    finally:
        L.llama_free(ctx)
    cat = tokenize(m.vocab, " cat")
    assert len(cat) == 1
    return {cat[0]: float(logits.max() - logits[cat[0]] + 1.5)}


# The random model never repeats a token by itself within 24, so penalties that push tokens away would
# change nothing: these settings pull seen tokens up (repeat < 1 multiplies a positive logit, negative
# frequency and presence penalties add), which changes the greedy run whenever the window holds a token;
# DRY gets a repeat to push against from repeat_bias.
PENALTY_CASES = {
    "repeat": dict(repeat_penalty=0.4),
    "frequency": dict(frequency_penalty=-1.5),
    "presence": dict(presence_penalty=-2.0),
    "dry": dict(dry_multiplier=0.8, dry_base=1.75, dry_allowed_length=2, dry_penalty_last_n=-1),
    "all": dict(repeat_penalty=0.7, frequency_penalty=-0.5, presence_penalty=-0.5, dry_multiplier=0.5,
                dry_allowed_length=2, dry_penalty_last_n=-1),
}


def case_settings(m: LlamaModel, case: str, last_n: int = -1) -> tuple[dict, dict]:
    """(the settings of a case, the same without its penalties: the baseline)."""
    base = {"temperature": 0.0}
    if case in ("dry", "all"):
        base["logit_bias"] = repeat_bias(m)
    kw = {**base, **PENALTY_CASES[case]}
    if case == "dry":
        kw["dry_penalty_last_n"] = last_n
    else:
        kw["repeat_last_n"] = last_n
    return kw, base


@pytest.mark.hf
@pytest.mark.parametrize("last_n", [0, 8, 64, -1])
@pytest.mark.parametrize("case", list(PENALTY_CASES))
def test_greedy_with_penalties_step_by_step(llama_model, case, last_n):
    kw, base = case_settings(llama_model, case, last_n)
    theirs, mine = greedy_steps(llama_model, kw)
    assert mine == theirs, f"{case}, last_n {last_n}: ggmlpy {mine} != llama.cpp {theirs}"
    plain = plain_run(llama_model, base)
    if last_n == 0 and case != "all":
        assert theirs == plain                       # the window is empty: nothing to penalise
    else:
        assert theirs != plain, f"{case} does not change this greedy run: not a test"


@pytest.mark.hf
def test_greedy_with_logit_bias_step_by_step(llama_model):
    bias = biases(llama_model)
    plain = plain_run(llama_model, dict(temperature=0.0))
    for b in ({k: v} for k, v in bias.items()):
        theirs, mine = greedy_steps(llama_model, dict(temperature=0.0, logit_bias=b))
        assert mine == theirs, f"logit bias {b}"
        assert theirs != plain, f"logit bias {b} does not change this greedy run"
    theirs, mine = greedy_steps(llama_model, dict(temperature=0.0, logit_bias=bias, **PENALTY_CASES["all"]))
    assert mine == theirs


@pytest.mark.hf
def test_greedy_through_the_full_default_chain(llama_model):
    """The whole default chain at temperature 0 with a seeded dist last, as llama-server runs it."""
    kw, _ = case_settings(llama_model, "all")
    theirs, mine = greedy_steps(llama_model, kw, final="dist", samplers=None)
    assert mine == theirs


# ---------------------------------------------------------------------------------------------- 4. end to end


def llama_generate(m: LlamaModel, kw: dict) -> tuple[list, list]:
    """llama.cpp's own generation (its logits, the full default chain with dist last, the prompt accepted
    first); stops after an end-of-generation token. Also each step's top-2 logit margin after the
    penalties (by the reference), to tell a near tie from a real difference."""
    p = full(kw)
    last_n = N_CTX if p["repeat_last_n"] == -1 else p["repeat_last_n"]
    ctx = m.context()
    ch = Chain(kw, m.n_vocab, vocab=m.vocab, n_ctx=N_CTX, final="dist", samplers=None)
    try:
        ch.accept(m.prompt)
        logits = m.decode(ctx, m.prompt)
        out, margins = [], []
        for _ in range(N_GEN):
            c = R.Cands(logits.tolist())
            R.penalties(c, list(m.prompt) + out, last_n, p["repeat_penalty"], p["frequency_penalty"],
                        p["presence_penalty"])
            margins.append(margin(np.asarray(c.logit)))
            t = ch.sample(ctx)
            out.append(t)
            if L.llama_vocab_is_eog(m.vocab, t):
                break
            logits = m.decode(ctx, [t])
        return out, margins
    finally:
        ch.close()
        L.llama_free(ctx)


@pytest.fixture(scope="module")
def ggml_model(llama_model):
    from ggmlpy.models import load_model

    model = load_model(llama_model.path, devices="cpu")
    yield model
    model.close()


@pytest.fixture
def runner(ggml_model):
    # one runner a test: the leak check counts the graphs a runner pools until it closes
    from ggmlpy.runner import Runner

    with Runner(ggml_model, n_ctx=N_CTX, n_batch=64) as rt:
        yield rt


@pytest.mark.hf
@pytest.mark.parametrize("case", ["plain", *PENALTY_CASES, "bias"])
def test_runner_generate_equals_llama_cpp(llama_model, runner, case):
    if case == "plain":
        kw = {"temperature": 0.0}
    elif case == "bias":
        kw = {"temperature": 0.0, "logit_bias": biases(llama_model)}
    else:
        kw, _ = case_settings(llama_model, case)
    want, margins = llama_generate(llama_model, kw)
    got_ = runner.generate(list(llama_model.prompt), max_tokens=len(want), sampling=SamplingParams(**kw)).tokens
    if got_ != want:
        i = next((i for i, (a, b) in enumerate(zip(got_, want)) if a != b), min(len(got_), len(want)))
        pytest.fail(f"{case}: ggmlpy's run differs from llama.cpp's at step {i} (top-2 margin there "
                    f"{margins[i] if i < len(margins) else float('nan'):.3g}; smallest margin "
                    f"{min(margins):.3g}):\nggmlpy    {got_}\nllama.cpp {want}")
