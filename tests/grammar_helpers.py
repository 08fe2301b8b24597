"""A "garbage-preferring model" for the grammar tests, and the JSON schemas hypothesis draws.

The model: random float32 logits at each step (a seeded numpy generator) over a real vocabulary,
so left alone it would write garbage; the grammar's mask decides what it can write. Greedy after the
mask (the arg-max of the random row), until the matcher stops or an end-of-generation token wins.
A random model rarely chooses to end (one token of ~150k), so after ``budget`` steps it is steered
to finish: tokens that close things (quotes, brackets, a newline) and the end-of-generation tokens
get a bonus over every random logit, among the tokens the grammar allows, so the grammar still
decides what is possible; a bonus halves each time its token is chosen (a repetition penalty: a
grammar that lets a closer repeat, a quote inside free text, moves on to the next closer), when
sampling down to 25 at least (which still outweighs 150k random logits in the softmax). A
generation that has not ended ``extra`` steps later fails the test.
"""

from __future__ import annotations

import functools

import numpy as np
from hypothesis import strategies as st

#: pieces that bring a generation to its end, by preference (bonus over a random logit in [0, 1))
_FINISHERS = {
    b'"': 90, b"}": 90, b"]": 90, b")": 90, b"\n": 60, b";": 60, b"=": 50, b":": 45, b",": 5,
    b"0": 40, b"1": 35, b"a": 30, b"(": 20, b"{": 10,
}


def finish_bonus(bridge, finishers: tuple | None = None) -> np.ndarray:
    """Per token of ``bridge``'s vocabulary: the bonus that steers a generation to its end
    (``finishers``: (piece, bonus) pairs instead of the default)."""
    return _finish_bonus(bridge, finishers or tuple(_FINISHERS.items())).copy()


@functools.lru_cache(maxsize=8)
def _finish_bonus(bridge, finishers: tuple) -> np.ndarray:
    tok = bridge.tokenizer
    table = dict(finishers)
    bonus = np.zeros(bridge.n_vocab, dtype=np.float32)
    for i in range(bridge.n_vocab):
        b = table.get(tok.token_to_piece(i))
        if b is not None and i not in bridge.special:
            bonus[i] = b
    bonus[list(bridge.eog)] = 1000
    return bonus


def generate(matcher, seed: int, budget: int = 120, extra: int = 400, n_model: int | None = None,
             sample: bool = False, finishers: tuple | None = None) -> tuple[list[int], str]:
    """Run the garbage-preferring model under ``matcher``; the ids (the final end-of-generation token
    left out) and why it ended (``matcher.reason``, or ``"eog"`` when an end-of-generation token was
    chosen and accepted). ``sample``: draw from the softmax instead of the arg-max; ``finishers``: see
    :func:`finish_bonus`."""
    bridge = matcher.vocab
    n = n_model or bridge.n_vocab
    rng = np.random.default_rng(seed)
    bonus = finish_bonus(bridge, finishers)
    floor = np.minimum(bonus, 25) if sample else np.zeros_like(bonus)
    eog = set(bridge.eog)
    ids: list[int] = []
    for step in range(budget + extra):
        if matcher.is_stopped:
            return ids, matcher.reason
        logits = rng.random(n, dtype=np.float32) * 4
        if step >= budget:
            logits[:bridge.n_vocab] += bonus
        matcher.apply(logits)
        assert np.isfinite(logits).any(), f"step {step}: the mask allows nothing ({matcher.reason})"
        if sample:
            p = np.exp(logits - logits.max())
            t = int(rng.choice(n, p=p / p.sum()))
        else:
            t = int(np.argmax(logits))
        assert matcher.allowed(t), f"step {step}: token {t} survived the mask but is not allowed"
        assert matcher.accept(t), f"step {step}: token {t} was allowed but refused"
        if t in eog:
            return ids, matcher.reason or "eog"
        if step >= budget:
            bonus[t] = max(bonus[t] * 0.5, floor[t])
        ids.append(t)
    raise AssertionError(f"no end after {budget + extra} steps: {bridge.tokenizer.decode(ids)[:500]!r}")


# ------------------------------------------------------------------------------------------------
# JSON schemas


def _integer(draw):
    lo = draw(st.none() | st.integers(-1000, 1000))
    hi = draw(st.none() | st.integers(-1000, 1000))
    if lo is not None and hi is not None and hi < lo:
        lo, hi = hi, lo
    s: dict = {"type": "integer"}
    if lo is not None:
        s["minimum"] = lo
    if hi is not None:
        s["maximum"] = hi
    return s


def _number(draw):
    lo = draw(st.none() | st.floats(-1e3, 1e3, allow_nan=False).map(lambda x: round(x, 2)))
    hi = draw(st.none() | st.floats(-1e3, 1e3, allow_nan=False).map(lambda x: round(x, 2)))
    if lo is not None and hi is not None and hi < lo:
        lo, hi = hi, lo
    s: dict = {"type": "number"}
    if lo is not None:
        s[draw(st.sampled_from(["minimum", "exclusiveMinimum"])) if hi != lo else "minimum"] = lo
    if hi is not None:
        s[draw(st.sampled_from(["maximum", "exclusiveMaximum"])) if hi != lo else "maximum"] = hi
    return s


def _string(draw):
    s: dict = {"type": "string"}
    hi = draw(st.none() | st.integers(0, 12))
    if hi is not None:
        s["maxLength"] = hi
        lo = draw(st.none() | st.integers(0, hi))
        if lo is not None:
            s["minLength"] = lo
    return s


_ENUM_VALUES = st.one_of(st.text(min_size=0, max_size=6), st.integers(-50, 50), st.booleans(), st.none())


@st.composite
def schemas(draw, depth: int = 0):
    """A JSON schema: objects (required and optional keys, additionalProperties either way), arrays
    with minItems/maxItems, enums, const, integers and numbers with bounds, strings with lengths,
    booleans, nested at most 3 deep."""
    leaves = ["integer", "number", "string", "enum", "boolean", "const"]
    kinds = leaves + (["object", "array"] * 2 if depth < 3 else [])
    kind = draw(st.sampled_from(kinds))
    if kind == "integer":
        return _integer(draw)
    if kind == "number":
        return _number(draw)
    if kind == "string":
        return _string(draw)
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": draw(st.lists(_ENUM_VALUES, min_size=1, max_size=4, unique_by=repr))}
    if kind == "const":
        return {"const": draw(_ENUM_VALUES)}
    if kind == "array":
        lo = draw(st.integers(0, 3))
        hi = draw(st.integers(lo, 4))
        return {"type": "array", "items": draw(schemas(depth + 1)), "minItems": lo, "maxItems": hi}
    names = draw(st.lists(st.text("abcdefgh_", min_size=1, max_size=5), min_size=0, max_size=4, unique=True))
    props = {k: draw(schemas(depth + 1)) for k in names}
    required = [k for k in names if draw(st.booleans())]
    s = {"type": "object", "properties": props, "required": required}
    if draw(st.booleans()):
        s["additionalProperties"] = False
    return s
