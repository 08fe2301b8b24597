"""Hostile tokenizer metadata: every malformed ``tokenizer.ggml.*`` key is a TokenizerError naming the
key (through a GGUF file and through the metadata dict), and a vocabulary's load time and memory stay
proportional to its size (a cap on token length, SPM merges found without cutting each token at every
place, bounded merge tables and decoded pieces).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/, for helpers
from helpers import run_child  # noqa: E402

from ggmlpy.gguf import GGUFWriter, ValueType  # noqa: E402
from ggmlpy.tokenizer import Tokenizer, TokenizerError  # noqa: E402
from ggmlpy.tokenizer._common import _MAX_TOKEN  # noqa: E402

T = "tokenizer.ggml."
VT = ValueType

# small valid vocabularies of each kind
SPM = {T + "model": "llama", T + "tokens": ["<unk>", "<s>", "</s>", "▁", "a", "b", "▁a", "ab", "<0x41>"],
       T + "scores": [0.0, 0.0, 0.0, -1.0, -2.0, -2.0, -1.5, -3.0, 0.0], T + "token_type": [2, 3, 3, 1, 1, 1, 1, 1, 6]}
BPE = {T + "model": "gpt2", T + "pre": "gpt-2", T + "tokens": ["a", "b", "ab", "Ġ", "Ġa", "<|endoftext|>"],
       T + "merges": ["a b", "Ġ a"], T + "token_type": [1, 1, 1, 1, 1, 3]}
WPM = {T + "model": "bert", T + "tokens": ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "▁a", "b", "▁ab"],
       T + "token_type": [3, 3, 3, 3, 3, 1, 1, 1], T + "unknown_token_id": 1, T + "bos_token_id": 2,
       T + "seperator_token_id": 3}
UGM = {T + "model": "t5", T + "tokens": ["<pad>", "</s>", "<unk>", "▁", "a", "b", "▁a"],
       T + "scores": [0.0, 0.0, 0.0, -2.0, -3.0, -3.0, -2.5], T + "token_type": [3, 3, 2, 1, 1, 1, 1]}
BASES = {"SPM": SPM, "BPE": BPE, "WPM": WPM, "UGM": UGM}
#: the element type each valid key is written with (as llama.cpp's converter writes it)
TYPES = {T + "tokens": VT.STRING, T + "scores": VT.FLOAT32, T + "token_type": VT.INT32, T + "merges": VT.STRING,
         T + "precompiled_charsmap": VT.UINT8}


def write_vocab(path: Path, md: dict, types: dict | None = None) -> Path:
    """A vocabulary-only GGUF of ``md``; ``types``: element (arrays) or value types that override the
    writer's inference."""
    types = {**TYPES, **(types or {})}
    with GGUFWriter(path) as w:
        for k, v in md.items():
            if isinstance(v, (list, tuple, np.ndarray)):
                w.add_array(k, v, types.get(k))
            elif k in types and k not in TYPES:
                w.add(k, v, types[k])
            else:
                w.add(k, v)
    return path


@pytest.mark.parametrize("kind", sorted(BASES))
def test_the_small_vocabularies_load_from_a_file_and_a_dict(kind, tmp_path):
    md = BASES[kind]
    for t in (Tokenizer.from_gguf(md), Tokenizer.from_gguf(write_vocab(tmp_path / "v.gguf", md))):
        assert t.kind == kind and t.n_vocab == len(md[T + "tokens"])
        t.decode(t.encode("a ab b"))


N = {k: len(v[T + "tokens"]) for k, v in BASES.items()}
nan, inf = math.nan, math.inf

# (kind, key, value, GGUF type or None: the writer infers it); every one can be written to a file
FILE_CASES = [
    # token_type: strings, NaN, floats, bools, wrong length, values that are no TokenType
    ("SPM", T + "token_type", ["1"] * N["SPM"], VT.STRING),
    ("SPM", T + "token_type", [nan] * N["SPM"], VT.FLOAT32),
    ("SPM", T + "token_type", [1.0] * N["SPM"], VT.FLOAT32),
    ("SPM", T + "token_type", [True] * N["SPM"], VT.BOOL),
    ("SPM", T + "token_type", [1] * (N["SPM"] - 1), VT.INT32),
    ("SPM", T + "token_type", [1] * (N["SPM"] + 1), VT.INT32),
    ("SPM", T + "token_type", [1] * (N["SPM"] - 1) + [7], VT.INT32),
    ("BPE", T + "token_type", [1] * (N["BPE"] - 1) + [-1], VT.INT32),
    ("WPM", T + "token_type", [2**40] * N["WPM"], VT.INT64),
    ("UGM", T + "token_type", "1", None),
    # scores: strings, NaN, infinities, wrong length, a scalar
    ("SPM", T + "scores", ["-1.0"] * N["SPM"], VT.STRING),
    ("SPM", T + "scores", [nan] * N["SPM"], VT.FLOAT32),
    ("UGM", T + "scores", [-1.0] * (N["UGM"] - 1) + [-inf], VT.FLOAT32),
    ("UGM", T + "scores", [-1.0] * (N["UGM"] - 1) + [inf], VT.FLOAT64),
    ("SPM", T + "scores", [0.0] * (N["SPM"] + 1), VT.FLOAT32),
    ("UGM", T + "scores", -1.0, None),
    # tokens: numbers, empty, a scalar, one longer than the cap
    ("SPM", T + "tokens", list(range(N["SPM"])), VT.INT32),
    ("BPE", T + "tokens", [1.5] * N["BPE"], VT.FLOAT32),
    ("WPM", T + "tokens", [], VT.STRING),
    ("UGM", T + "tokens", "abc", None),
    ("SPM", T + "tokens", SPM[T + "tokens"][:-1] + ["a" * (_MAX_TOKEN + 1)], VT.STRING),
    # merges: numbers, a scalar, a merge that is not two tokens
    ("BPE", T + "merges", [1, 2], VT.INT32),
    ("BPE", T + "merges", "a b", None),
    ("BPE", T + "merges", ["a b", "ab"], VT.STRING),
    ("BPE", T + "merges", ["a b", " ab"], VT.STRING),
    # model and pre-tokenizer names of the wrong type
    ("SPM", T + "model", 1, VT.INT32),
    ("BPE", T + "model", ["gpt2"], VT.STRING),
    ("BPE", T + "pre", 7, VT.INT32),
    ("BPE", T + "pre", ["gpt-2"], VT.STRING),
    # special token ids: strings, floats, negative, bools, arrays
    ("SPM", T + "bos_token_id", "1", None),
    ("SPM", T + "eos_token_id", 2.0, VT.FLOAT32),
    ("SPM", T + "unknown_token_id", -1, VT.INT32),
    ("WPM", T + "seperator_token_id", True, VT.BOOL),
    ("WPM", T + "padding_token_id", [0], VT.INT32),
    ("BPE", T + "eot_token_id", nan, VT.FLOAT32),
    ("UGM", T + "mask_token_id", -(2**40), VT.INT64),
    ("BPE", T + "fim_pre_token_id", "0", None),
    # flags: strings, numbers, arrays
    ("SPM", T + "add_bos_token", "false", None),
    ("SPM", T + "add_eos_token", 1, VT.INT32),
    ("WPM", T + "add_sep_token", 0.0, VT.FLOAT32),
    ("SPM", T + "add_space_prefix", [True], VT.BOOL),
    ("UGM", T + "remove_extra_whitespaces", "yes", None),
    ("WPM", T + "normalizer.lowercase", 1, VT.UINT8),
    ("WPM", T + "normalizer.strip_accents", "no", None),
    # the UGM charsmap: not bytes
    ("UGM", T + "precompiled_charsmap", "abcd", None),
    ("UGM", T + "precompiled_charsmap", [0.5] * 8, VT.FLOAT32),
    ("UGM", T + "precompiled_charsmap", [300] * 8, VT.INT32),
    ("UGM", T + "precompiled_charsmap", ["a"] * 8, VT.STRING),
    ("UGM", T + "precompiled_charsmap", 5, VT.INT32),
]

# what only a dict can hold: non-string entries, lone surrogates, numbers beyond any GGUF type, nesting
DICT_CASES = [
    ("SPM", T + "tokens", SPM[T + "tokens"][:-1] + [5]),
    ("BPE", T + "tokens", BPE[T + "tokens"][:-1] + [None]),
    ("WPM", T + "tokens", WPM[T + "tokens"][:-1] + [b"ab"]),
    ("UGM", T + "tokens", UGM[T + "tokens"][:-1] + ["\ud800"]),
    ("SPM", T + "tokens", {"a": 1}),
    ("SPM", T + "tokens", np.array([["a"]] * N["SPM"])),
    ("BPE", T + "merges", ["a b", 3]),
    ("BPE", T + "merges", ["a b", None]),
    ("BPE", T + "merges", [["a", "b"]]),
    ("SPM", T + "scores", [0.0] * (N["SPM"] - 1) + ["x"]),
    ("SPM", T + "scores", [0.0] * (N["SPM"] - 1) + [None]),
    ("UGM", T + "scores", [0.0] * (N["UGM"] - 1) + [2**2000]),
    ("UGM", T + "scores", [0.0] * (N["UGM"] - 1) + [3e39]),       # no float32
    ("SPM", T + "scores", [0.0] * (N["SPM"] - 1) + [True]),
    ("SPM", T + "scores", np.zeros((N["SPM"], 1))),
    ("SPM", T + "token_type", [1] * (N["SPM"] - 1) + [1.0]),
    ("SPM", T + "token_type", [1] * (N["SPM"] - 1) + [None]),
    ("SPM", T + "token_type", [1] * (N["SPM"] - 1) + [2**70]),
    ("SPM", T + "token_type", np.array(["1"] * N["SPM"])),
    ("SPM", T + "bos_token_id", np.float32(1)),
    ("SPM", T + "bos_token_id", 1.5),
    ("SPM", T + "eos_token_id", b"\x01"),
    ("SPM", T + "add_bos_token", "True"),
    ("SPM", T + "add_bos_token", np.array([True])),
    ("UGM", T + "precompiled_charsmap", [1, 2, 256]),
    ("UGM", T + "precompiled_charsmap", [1, 2, -1]),
    ("UGM", T + "precompiled_charsmap", np.zeros((2, 4), np.uint8)),
    ("UGM", T + "precompiled_charsmap", 3.5),
    ("BPE", T + "model", b"gpt2"),
]


def _expect_refusal(load, key):
    with pytest.raises(TokenizerError) as e:
        load()
    assert key in str(e.value), str(e.value)
    return e.value


@pytest.mark.parametrize("kind,key,value,vt", FILE_CASES,
                         ids=[f"{c[0]}-{c[1][len(T):] if c[1].startswith(T) else c[1]}-{i}"
                              for i, c in enumerate(FILE_CASES)])
def test_a_malformed_key_in_a_file_is_named(kind, key, value, vt, tmp_path):
    md = {**BASES[kind], key: value}
    path = write_vocab(tmp_path / "v.gguf", md, {key: vt} if vt is not None else None)
    err = _expect_refusal(lambda: Tokenizer.from_gguf(path), key)
    assert str(path) in str(err)
    # the same value as a dict holds it
    _expect_refusal(lambda: Tokenizer.from_gguf(md), key)


@pytest.mark.parametrize("kind,key,value", DICT_CASES,
                         ids=[f"{c[0]}-{c[1][len(T):]}-{i}" for i, c in enumerate(DICT_CASES)])
def test_a_malformed_key_in_a_dict_is_named(kind, key, value):
    _expect_refusal(lambda: Tokenizer.from_gguf({**BASES[kind], key: value}), key)


def test_special_ids_past_the_vocabulary_are_dropped_with_a_warning(caplog, tmp_path):
    """As llama.cpp ("bad special token", its default kept) and the model loader: an unsigned id past
    the vocabulary is ignored, not an error; only ids that are no unsigned integer are refused."""
    path = write_vocab(tmp_path / "v.gguf", {**SPM, T + "bos_token_id": 2**32 - 1}, {T + "bos_token_id": VT.UINT32})
    with caplog.at_level("WARNING", logger="ggmlpy"):
        t = Tokenizer.from_gguf(path)
    assert t.bos == 1 and "tokenizer.ggml.bos_token_id = 4294967295 is outside the vocabulary" in caplog.text


# ------------------------------------------------------------------------------------ random metadata

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
                     st.text(max_size=8), st.binary(max_size=8), st.sampled_from(["llama", "gpt2", "bert", "t5"]))


def _filled(dt, k, fill):
    with np.errstate(invalid="ignore", over="ignore"):
        return np.full(k, fill).astype(dt)


def _arrays(n):
    sizes = st.sampled_from([0, 1, n - 1, n, n + 1])
    return st.one_of(
        st.builds(lambda v, k: [v] * k, _scalars, sizes),
        sizes.flatmap(lambda k: st.lists(_scalars, min_size=k, max_size=k)),
        st.builds(_filled,
                  st.sampled_from([np.int8, np.uint8, np.int32, np.int64, np.uint64, np.float32, np.float64, np.bool_]),
                  sizes, st.sampled_from([0, 1, 7, -1, 255, 300]) | st.floats(allow_nan=True, width=32)),
        st.lists(st.lists(_scalars, max_size=2), max_size=3),
    )


_KEYS = [T + k for k in ("model", "pre", "tokens", "scores", "token_type", "merges", "precompiled_charsmap",
                         "add_bos_token", "add_eos_token", "add_sep_token", "add_space_prefix",
                         "remove_extra_whitespaces", "normalizer.lowercase", "normalizer.strip_accents",
                         "bos_token_id", "eos_token_id", "unknown_token_id", "seperator_token_id",
                         "padding_token_id", "mask_token_id", "eot_token_id", "fim_pre_token_id")] + \
        ["tokenizer.chat_template", "general.name", "general.architecture"]


@st.composite
def _hostile_metadata(draw):
    kind = draw(st.sampled_from(sorted(BASES)))
    md = dict(BASES[kind])
    n = len(md[T + "tokens"])
    for key in draw(st.lists(st.sampled_from(_KEYS), min_size=1, max_size=3, unique=True)):
        md[key] = draw(st.one_of(_scalars, _arrays(n)))
    return md


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(md=_hostile_metadata())
def test_random_malformed_metadata_only_raises_tokenizer_error(md):
    """Whatever the values: a tokenizer, or a TokenizerError; never another exception."""
    try:
        t = Tokenizer.from_gguf(md)
    except TokenizerError:
        return
    try:
        t.decode(t.encode("a ab <s> b", add_special=True, parse_special=True))
    except TokenizerError:
        pass


# --------------------------------------------------------------------------- size: time and memory

def _spm(tokens: list[str]) -> dict:
    return {T + "model": "llama", T + "tokens": tokens, T + "scores": [-1.0] * len(tokens)}


def test_a_400000_character_token_is_refused_at_once(tmp_path):
    """The old load cut this token at every place: 34-43 s for one 400 KB file."""
    import time

    md = _spm(["<unk>", "<s>", "</s>", "▁", "a", "a" * 400_000])
    path = write_vocab(tmp_path / "v.gguf", md)
    for src in (md, path):
        t0 = time.perf_counter()
        err = _expect_refusal(lambda src=src: Tokenizer.from_gguf(src), T + "tokens")
        assert time.perf_counter() - t0 < 5.0
        assert "entry 5 is 400000 characters long" in str(err) and str(_MAX_TOKEN) in str(err)


def test_tokens_up_to_the_cap_load():
    """The cap is twice the longest token llama.cpp ships; a token of exactly the cap loads (each kind)."""
    long = "x" * _MAX_TOKEN
    for md in BASES.values():
        toks = md[T + "tokens"] + [long]
        extra = {k: list(md[k]) + [1 if k.endswith("token_type") else -5.0] for k in (T + "scores", T + "token_type")
                 if k in md}
        t = Tokenizer.from_gguf({**md, T + "tokens": toks, **extra})
        assert t.token_text(len(toks) - 1) == long


_RSS_CHILD = """
import resource, sys, time
from ggmlpy.tokenizer import Tokenizer, TokenizerError
path = sys.argv[1]
from ggmlpy.gguf import GGUFReader
with GGUFReader(path) as r:
    md = dict(r.metadata)
# the old load took all the memory it could: bound it, so that it fails rather than swaps
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
with open("/proc/self/status") as f:
    vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (vm + (3 << 30), hard))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
try:
    Tokenizer.from_gguf(md)
    out = "loaded"
except TokenizerError as e:
    out = "refused " + str(e)
except MemoryError:
    out = "MemoryError"
print(time.perf_counter() - t0, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024, out)
"""


@pytest.mark.parametrize("longest,letters", [(2000, "abcde"), (1000, "abcdefghij")])
def test_ten_thousand_long_tokens_stay_within_memory(tmp_path, longest, letters):
    """10,000 tokens: runs of one letter up to ``longest`` characters (5-10 MB files), every split of
    every run a pair of tokens. The old load built each split's strings: all the memory there was.
    Now runs over the cap are refused at once, and within it the merge table's bound refuses the
    vocabulary before it is built: fast, and RSS grows by less than 200 MiB."""
    tokens = ["<unk>", "<s>", "</s>", "▁"] + [c * k for c in letters for k in range(1, longest + 1)]
    path = write_vocab(tmp_path / "v.gguf", _spm(tokens))
    r = run_child(_RSS_CHILD, path, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    secs, grew, out = r.stdout.split(" ", 2)
    assert out.startswith("refused") and T + "tokens" in out, out
    assert float(secs) < 10.0 and float(grew) < 200, r.stdout


def test_load_time_grows_with_the_characters_not_their_square():
    """Two vocabularies of the same 1 M characters: 1,000 tokens of 1,000 and 10,000 of 100. A load
    linear in the characters takes less time for the long tokens (there are fewer of them: about a
    quarter, measured); the old SPM load, which cut each token at every place, took 1.7 times longer."""
    import random
    import time

    rnd = random.Random(0)
    alpha = "abcdefghijklmnopqrstuvwxyz"

    def load_time(kind, count, length):
        md = dict(BASES[kind])
        del md[T + "token_type"]
        toks = md[T + "tokens"] + list(alpha) + ["".join(rnd.choices(alpha, k=length)) for _ in range(count)]
        md[T + "tokens"] = toks
        if T + "scores" in md:
            md[T + "scores"] = [-1.0] * len(toks)
        best = math.inf
        for _ in range(2):
            t0 = time.perf_counter()
            Tokenizer.from_gguf(md)
            best = min(best, time.perf_counter() - t0)
        return best

    for kind in sorted(BASES):
        long, short = load_time(kind, 1000, 1000), load_time(kind, 10_000, 100)
        assert long < 0.7 * short + 0.02, (kind, long, short)


def _old_spm_merges(t: Tokenizer) -> list[tuple[str, str]]:
    """The definition: every cut of every (non-byte) token into two tokens, by score, id and place."""
    ids = t._ids
    cands = []
    for text, i in ids.items():
        if len(text) < 2 or t._attrs[i] & 32:
            continue
        s = float(t._scores[i]) if t._scores is not None else 0.0
        cands += [(-s, i, k, text[:k], text[k:]) for k in range(1, len(text)) if text[:k] in ids and text[k:] in ids]
    return [(a, b) for *_, a, b in sorted(cands)]


@settings(max_examples=60, deadline=None)
@given(words=st.lists(st.text("ab▁", min_size=1, max_size=70), min_size=1, max_size=40),
       cuts=st.lists(st.integers(1, 69), max_size=20), scores=st.lists(st.sampled_from([0.0, -1.0, -2.5]), min_size=1))
def test_spm_merges_are_every_split_into_two_tokens(words, cuts, scores):
    """The merges found through sorted prefix and suffix chains (and short parts looked up) are the
    definition's, for vocabularies with long tokens whose long prefixes and suffixes are tokens too."""
    toks = ["<unk>", "<s>", "</s>", "a", "b", "▁"] + words
    for w, k in zip(words, cuts):
        if 0 < k < len(w):
            toks += [w[:k], w[k:]]
    md = {T + "model": "llama", T + "tokens": toks, T + "scores": [scores[i % len(scores)] for i in range(len(toks))]}
    t = Tokenizer.from_gguf(md)
    assert t._spm_merges() == _old_spm_merges(t)


def test_bpe_pieces_outside_the_byte_mapping_are_bounded():
    """llama.cpp decodes each character outside GPT-2's byte mapping to the whole token text again:
    a 1,000-character CJK token would be a 3 MB piece (kept for every such token by the old load).
    Over 64 KiB the vocabulary is refused; a big piece within it is made when asked for, the same bytes."""
    base = {T + "model": "gpt2", T + "pre": "gpt-2", T + "merges": ["a b"]}
    with pytest.raises(TokenizerError, match=r"tokenizer.ggml.tokens entry 2 has 1000 characters outside"):
        Tokenizer.from_gguf({**base, T + "tokens": ["a", "b", "漢" * 1000]})
    t = Tokenizer.from_gguf({**base, T + "tokens": ["a", "b", "漢" * 20, "ab"]})
    want = (b"[UNK_BYTE_0xe6bca2" + ("漢" * 20).encode() + b"]") * 20
    assert t._pieces[2] is None and t.token_to_piece(2) == want
    assert t.decode_bytes([0, 2, 1]) == b"a" + want + b"b"
