"""Hostile KV-state files against ``Runner.load_state`` and ``load_seq`` (ggmlpy.kvcache.state).

Before this file, a forged state (right length, tokens as strings) replaced sequence 0's K/V and then
raised a bare ValueError with the slot table still listing the old tokens; a deeply nested JSON header
raised RecursionError; and a state of another model of the same shape loaded silently. Now every
refusal is a StateError naming what is wrong, raised before anything changes: each test below reads
back every K/V byte of both sequences' caches, the cell table and the slot table before and after each
refused load and asserts they are identical. A hypothesis property mutates a valid state at random
(bytes, or any value of its JSON header with the checksum fixed): it loads exactly or is refused with
nothing changed. A sample of tests/state_fuzz.py (the long run is documented there) runs in the suite.

The bases come from tests/state_fuzz.py: tiny synthetic models (a llama: one Causal cache; a 6-layer
gemma3: a Wrapper whose sliding-window cache drops old positions; a second llama of the same shape and
other weights) and a state of 16 tokens saved from each.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import os
import struct

import numpy as np
import pytest
import state_fuzz as sf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_kvcache_save import CONFIGS, _busy, _make, _same, _saved, _snapshot, _src

from ggmlpy import GGMLTypeError
from ggmlpy.gguf import GGUFReader
from ggmlpy.kvcache import KVCacheFull, StateError
from ggmlpy.kvcache import state as kvstate
from ggmlpy.models import load_model
from ggmlpy.models.fingerprint import SAMPLE_BYTES, SAMPLE_ROWS, weights_fingerprint
from ggmlpy.runner import Runner

LLAMA, GEMMA, FOREIGN = 0, 1, 2


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    w = str(tmp_path_factory.mktemp("state-hostile"))
    sf.make_bases(w)
    return w


@pytest.fixture(scope="module")
def bases(work):
    return [sf.State(open(p, "rb").read()) for p in sf.base_paths(work)[1]]


@pytest.fixture(scope="module")
def runners(work):
    """Runners over the llama and the gemma3, and each one's rows of the base state once loaded."""
    ms, rts = sf.open_runners(sf.base_paths(work)[0])
    refs = []
    for rt, p in zip(rts, sf.base_paths(work)[1]):
        # every batch shape the tests compute, built once here (the runner keeps its graphs)
        rt.generate(sf.PREFIX + sf.MORE + [9, 10], max_tokens=3, temperature=0)
        rt.decode([77], seq=0)
        sf.fill(rt)
        rt.clear()
        assert rt.load_state(0, p) == sf.PREFIX
        refs.append(sf.seq_rows(rt, 0))
    yield rts, refs
    for rt in rts:
        rt.close()
    for m in ms:
        m.close()


def _refused(rt, data: bytes, match: str, tmp_path, how: str = "path", error=StateError) -> None:
    """Loading ``data`` into sequence 0 raises ``error`` matching ``match`` and changes nothing: every K/V
    byte of every cache (both sequences' rows), the cell table and the slot table read back the same."""
    sf.fill(rt)
    before = sf.snapshot(rt)
    rows = [sf.seq_rows(rt, 0), sf.seq_rows(rt, 1)]
    slot = list(rt.slots[0].tokens)
    assert slot == sf.PREFIX + sf.MORE
    path = tmp_path / "case.state"
    path.write_bytes(data)
    src = {"path": path, "stream": sf.Stream(data), "bytesio": io.BytesIO(data)}[how]
    with pytest.raises(error, match=match):
        rt.load_state(0, src)
    assert sf.snapshot(rt) == before
    assert [sf.seq_rows(rt, 0), sf.seq_rows(rt, 1)] == rows and list(rt.slots[0].tokens) == slot


def _edit(st: sf.State, fn) -> bytes:
    h = copy.deepcopy(st.header)
    fn(h)
    return st.build(header=h)


def _tokens(fn):
    return lambda st: _edit(st, lambda h: h["meta"].update(tokens=fn(h["meta"]["tokens"])))


def _set(path, value):
    def fn(st):
        def edit(h):
            d = h
            for k in path[:-1]:
                d = d[k]
            d[path[-1]] = value
        return _edit(st, edit)
    return fn


def _drop(path):
    def fn(st):
        def edit(h):
            d = h
            for k in path[:-1]:
                d = d[k]
            del d[path[-1]]
        return _edit(st, edit)
    return fn


def _nested(where: str, depth: int):
    def fn(st):
        h = copy.deepcopy(st.header)
        h["meta"][where] = "@"
        raw = json.dumps(h, separators=(",", ":")).encode().replace(b'"@"', b"[" * depth + b"0" + b"]" * depth)
        return st.build(raw_header=raw)
    return fn


def _shift_positions(d):
    return lambda st: st.with_positions(0, [p + d for p in st.positions(0)])


def _drop_first(st, k, n):
    for _ in range(n):
        st = sf.State(st.drop_cell(k, 0))
    return st.data


def _flip(at):
    return lambda st: st.data[:at(st)] + bytes([st.data[at(st)] ^ 0x10]) + st.data[at(st) + 1:]


# (name, base, forge(State) -> bytes, message): every one refused with nothing changed
FORGED = [
    # the tokens: the original defect (a string of digits loaded as the int, other strings raised ValueError
    # after the cache changed)
    ("tokens as digit strings", LLAMA, _tokens(lambda t: [str(x) for x in t]), r"token 0 is '5', not a token id"),
    ("tokens as words", LLAMA, _tokens(lambda t: ["x"] + t[1:]), r"token 0 is 'x'"),
    ("a token a float", LLAMA, _tokens(lambda t: t[:3] + [3.0] + t[4:]), r"token 3 is 3.0"),
    ("a token a bool", LLAMA, _tokens(lambda t: [True] + t[1:]), r"token 0 is True"),
    ("a token null", GEMMA, _tokens(lambda t: t[:-1] + [None]), r"token 15 is None"),
    ("a token a list", LLAMA, _tokens(lambda t: [[5]] + t[1:]), r"token 0 is \[5\]"),
    ("a token an object", LLAMA, _tokens(lambda t: [{"id": 5}] + t[1:]), r"token 0 is \{'id': 5\}"),
    ("a token = n_vocab", LLAMA, _tokens(lambda t: t[:5] + [512] + t[6:]), r"token 5 is 512, .*\[0, 512\)"),
    ("a token 10**30", LLAMA, _tokens(lambda t: [10**30] + t[1:]), r"token 0 is 10{30}"),
    ("a token -1", GEMMA, _tokens(lambda t: [-1] + t[1:]), r"token 0 is -1"),
    ("a token below int32", LLAMA, _tokens(lambda t: [-2**31 - 1] + t[1:]), r"token 0 is -2147483649"),
    ("one token too many", LLAMA, _tokens(lambda t: t + [1]), r"lists 17 tokens for positions up to 15"),
    ("one token too few", GEMMA, _tokens(lambda t: t[:-1]), r"lists 15 tokens for positions up to 15"),
    ("tokens a string", LLAMA, _tokens(lambda t: "5 17 250"), r"tokens must be a list, not str"),
    ("tokens an object", LLAMA, _tokens(lambda t: {"0": 5}), r"tokens must be a list, not dict"),
    ("no tokens", LLAMA, _drop(["meta", "tokens"]), r"meta has keys \['model'\]"),
    ("a meta key more", LLAMA, _set(["meta", "note"], 1), r"meta has keys \['model', 'note', 'tokens'\]"),
    # the model
    ("weights fingerprint edited", LLAMA, lambda st: _edit(st, lambda h: h["meta"]["model"].update(
        weights=h["meta"]["model"]["weights"][::-1])), "belongs to another model of the same shape"),
    ("weights fingerprint a number", LLAMA, _set(["meta", "model", "weights"], 1), "belongs to another model"),
    ("another description", GEMMA, _set(["meta", "model", "desc"], "llama 1B F16"),
     "saved for another model: desc 'llama 1B F16' in the file"),
    ("n_vocab a string", LLAMA, _set(["meta", "model", "n_vocab"], "512"),
     "saved for another model: n_vocab '512' in the file, 512 here"),
    ("n_layer a float", LLAMA, _set(["meta", "model", "n_layer"], 2.0), "n_layer 2.0 in the file, 2 here"),
    ("a fingerprint key more", LLAMA, _set(["meta", "model", "x"], 1), "fingerprint has keys"),
    ("the fingerprint a list", LLAMA, _set(["meta", "model"], []), "fingerprint is not an object"),
    ("saved before weights fingerprints", LLAMA, _drop(["meta", "model", "weights"]),
     "older ggmlpy, without a weights fingerprint.*save it again"),
    ("another model of the same shape", FOREIGN, lambda st: st.data, "belongs to another model of the same shape"),
    # positions and cells
    ("positions beyond n_ctx", LLAMA, _shift_positions(20), r"holds position 35, beyond this runner's context"),
    ("positions from 1", LLAMA, _shift_positions(1), r"lists 16 tokens for positions up to 16"),
    ("a gap in the positions", LLAMA, lambda st: st.with_positions(0, list(range(7)) + list(range(8, 17))),
     r"lists 16 tokens for positions up to 16"),
    ("positions decreasing", GEMMA, lambda st: st.with_positions(1, list(range(15)) + [3]), "must increase"),
    ("a negative position", LLAMA, lambda st: st.with_positions(0, [-5] + list(range(1, 16))), ">= 0"),
    ("the last cell dropped", LLAMA, lambda st: st.drop_cell(0, -1), r"lists 16 tokens for positions up to 14"),
    ("the full cache's first cell dropped", GEMMA, lambda st: st.drop_cell(1, 0),
     r"cache 1 holds 15 positions from 1 to 15, not every one from 0"),
    ("the window cache's last cell dropped", GEMMA, lambda st: st.drop_cell(0, -1),
     r"caches end at different positions \[14, 15\]"),
    # the window is 3: the next token (16) sees 13..15, which the cache must hold
    ("the window cache short of the window", GEMMA, lambda st: _drop_first(st, 0, 6),
     r"cache 0 holds 2 positions from 14 to 15, not every one from 13"),
    # the header's schema
    ("deeply nested meta", LLAMA, _nested("deep", 100_000), r"nests deeper than 32 levels"),
    ("nested one level past the bound", LLAMA, _nested("deep", 31), r"nests deeper than 32 levels"),
    ("nested to the bound", LLAMA, _nested("deep", 30), r"meta has keys \['deep', 'model', 'tokens'\]"),
    ("NaN in the tokens", LLAMA,
     lambda st: st.build(raw_header=st.raw_header.replace(b'"tokens":[', b'"tokens":[NaN,')),
     "not valid JSON: NaN is not a JSON number"),
    ("header not UTF-8", LLAMA, lambda st: st.build(raw_header=st.raw_header.replace(b'"desc":"', b'"desc":"\xff')),
     "not valid JSON"),
    ("an unknown header key", LLAMA, _set(["x"], 1), r"unknown keys \['x'\]"),
    ("no seq", LLAMA, _drop(["seq"]), r"missing keys \['seq'\]"),
    ("seq a bool", LLAMA, _set(["seq"], True), r"'seq' must be a sequence id, not True"),
    ("seq negative", LLAMA, _set(["seq"], -1), r"'seq' must be a sequence id"),
    ("kind lower case", LLAMA, _set(["kind"], "causal"),
     r"'kind' must be 'Causal', 'Recurrent' or 'Wrapper', not 'causal'"),
    ("kind of the other cache", LLAMA, _set(["kind"], "Wrapper"), r"missing keys \['layer_to_cache'\]"),
    ("routing on a Causal", LLAMA, _set(["layer_to_cache"], [0, 0]), r"unknown keys \['layer_to_cache'\]"),
    ("routing of bools", GEMMA, lambda st: _edit(st, lambda h: h.update(
        layer_to_cache=[bool(x) for x in h["layer_to_cache"]])), "'layer_to_cache' must be a list of cache indices"),
    ("routing changed", GEMMA, lambda st: _edit(st, lambda h: h["layer_to_cache"].reverse()), "routing"),
    ("count a float", LLAMA, _set(["caches", 0, "count"], 16.0), r"cache 0 has a bad 'count': 16.0"),
    ("count a bool", LLAMA, _set(["caches", 0, "count"], True), r"cache 0 has a bad 'count': True"),
    ("count huge", LLAMA, _set(["caches", 0, "count"], 2**31 - 1), "truncated: the header describes"),
    ("count beyond int32", LLAMA, _set(["caches", 0, "count"], 2**31), r"bad 'count': 2147483648"),
    ("n_layers negative", GEMMA, _set(["caches", 1, "n_layers"], -1), r"cache 1 has a bad 'n_layers': -1"),
    ("v_trans an int", LLAMA,
     lambda st: _edit(st, lambda h: h["caches"][0].update(v_trans=int(h["caches"][0]["v_trans"]))),
     r"bad 'v_trans'"),
    ("window 0", LLAMA, _set(["caches", 0, "window"], 0), r"bad 'window': 0"),
    ("memory negative", GEMMA, _set(["caches", 0, "memory"], -4), r"bad 'memory': -4"),
    ("type_k a number", LLAMA, _set(["caches", 0, "type_k"], 1), r"bad 'type_k': 1"),
    ("type_k another type", LLAMA, _set(["caches", 0, "type_k"], "F32"), "type_k 'F32' in the file, 'F16' here"),
    ("a cache key more", LLAMA, _set(["caches", 0, "x"], 0), r"cache 0 has unknown keys \['x'\]"),
    ("no caches", LLAMA, _set(["caches"], []), r"'caches' must be a list of 1 to"),
    # the bytes (checksum not fixed)
    ("a data byte flipped", LLAMA, _flip(lambda st: len(st.data) - 100), "checksum mismatch"),
    ("a header byte flipped", GEMMA, _flip(lambda st: 40), "checksum mismatch|not valid JSON|header"),
    ("version 3", LLAMA, lambda st: st.build(version=3), "version 3 is newer"),
    ("truncated", LLAMA, lambda st: st.data[:-1], "truncated"),
    ("a byte more", LLAMA, lambda st: st.data + b"\0", "extra bytes"),
]


@pytest.mark.parametrize("name,base,forge,match", FORGED, ids=[f[0] for f in FORGED])
def test_every_forged_state_is_refused_and_changes_nothing(name, base, forge, match, bases, runners, tmp_path):
    rts, _refs = runners
    rt = rts[LLAMA if base == FOREIGN else base]
    _refused(rt, forge(bases[base]), match, tmp_path)


@pytest.mark.parametrize("how", ["stream", "bytesio"])
@pytest.mark.parametrize("name", ["tokens as words", "another model of the same shape", "deeply nested meta",
                                  "count huge", "a byte more", "truncated"])
def test_refusals_through_file_objects(name, how, bases, runners, tmp_path):
    _name, base, forge, match = next(f for f in FORGED if f[0] == name)
    rts, _refs = runners
    if name == "a byte more" and how == "bytesio":
        match = None                    # a seekable stream may go on after the state: the load is fine
        sf.fill(rts[LLAMA])
        assert rts[LLAMA].load_state(0, io.BytesIO(forge(bases[base]))) == sf.PREFIX
        return
    _refused(rts[LLAMA if base == FOREIGN else base], forge(bases[base]), match, tmp_path, how=how)


def test_a_header_over_max_header_is_refused_before_it_is_read(bases, runners, tmp_path, monkeypatch):
    rts, _refs = runners
    monkeypatch.setattr(kvstate, "MAX_HEADER", 256)
    _refused(rts[LLAMA], bases[LLAMA].data, r"header of \d+ bytes is larger than 256 \(MAX_HEADER\)", tmp_path)
    # a stream declaring a 4 GiB header: refused from the 16-byte preamble
    data = bases[LLAMA].data[:12] + struct.pack("<I", 2**32 - 1) + bases[LLAMA].data[16:]
    _refused(rts[LLAMA], data, r"header of 4294967295 bytes is larger", tmp_path, how="stream")


def test_the_original_defect_leaves_no_stale_slot_record(bases, runners, tmp_path):
    """Issue 33's case: the forged state is refused whole, so a prompt over the slot's record still reuses
    exactly the cache it describes (the generation equals a fresh runner's)."""
    rts, _refs = runners
    rt = rts[LLAMA]
    forged = _tokens(lambda t: ["a"] * len(t))(bases[LLAMA])
    _refused(rt, forged, "token 0 is 'a'", tmp_path)
    prompt = sf.PREFIX + sf.MORE + [9, 10]
    got = rt.generate(prompt, max_tokens=3, temperature=0)
    assert got.n_cached == len(sf.PREFIX + sf.MORE)
    with Runner(rt.model, **sf.RUNNER) as fresh:
        assert fresh.generate(prompt, max_tokens=3, temperature=0).tokens == got.tokens


# ---------------------------------------------------------------------------------------- the fingerprint


def test_the_weights_fingerprint_tells_models_of_the_same_shape_apart(work, bases, runners, tmp_path):
    models = sf.base_paths(work)[0]
    a, b = bases[LLAMA].header["meta"]["model"], bases[FOREIGN].header["meta"]["model"]
    assert {k: v for k, v in a.items() if k != "weights"} == {k: v for k, v in b.items() if k != "weights"}
    assert a["weights"] != b["weights"] and len(a["weights"]) == 64
    # the same file gives the same fingerprint whatever the load options (they change nothing stored)
    for kw in ({"mmap": True}, {"repack": False, "fuse": False}, {"load": False}):
        with load_model(models[LLAMA], devices="cpu", **kw) as m:
            assert m.weights_fingerprint == a["weights"]
    # the foreign model's own runner loads its state; the other model's refuses it
    with load_model(models[FOREIGN], devices="cpu") as m, Runner(m, **sf.RUNNER) as rt:
        assert rt.load_state(0, io.BytesIO(bases[FOREIGN].data)) == sf.PREFIX
        sf.fill(rt)
        before = sf.snapshot(rt)
        with pytest.raises(StateError, match="belongs to another model of the same shape"):
            rt.load_state(0, io.BytesIO(bases[LLAMA].data))
        assert sf.snapshot(rt) == before


def test_the_fingerprint_reads_samples_only_and_covers_them(work, tmp_path):
    """Cheap (a few KiB per tensor, whatever the file's size) and what the module documents: a byte changed
    in a sampled row changes it, one outside the sample does not."""
    path = sf.base_paths(work)[0][LLAMA]
    blob = open(path, "rb").read()

    class Counting(io.BytesIO):
        read_bytes = 0

        def read(self, n=-1):
            out = super().read(n)
            Counting.read_bytes += len(out)
            return out

    with GGUFReader(path) as r:
        fp = weights_fingerprint(r)
        assert weights_fingerprint(r, Counting(blob)) == fp
        assert Counting.read_bytes <= len(r.tensors) * SAMPLE_ROWS * SAMPLE_BYTES
        emb = r.tensor_info("token_embd.weight")
        rs = emb.type.row_size(emb.ne[0])
        n_rows = emb.nbytes // rs
        sampled = {(n_rows - 1) * k // (SAMPLE_ROWS - 1) for k in range(SAMPLE_ROWS)}
        unsampled = next(i for i in range(n_rows) if i not in sampled)
        assert Counting.read_bytes < len(blob) // 4

        def flipped(at):
            return weights_fingerprint(r, io.BytesIO(blob[:at] + bytes([blob[at] ^ 1]) + blob[at + 1:]))

        assert flipped(emb.offset + max(sampled) * rs + 3) != fp          # in the last row: covered
        assert flipped(emb.offset + unsampled * rs + 3) == fp             # documented: not covered


def test_a_model_without_load_model_gets_its_fingerprint_on_first_use(work, bases):
    from ggmlpy.backend import choose_devices, split_layers
    from ggmlpy.models.base import model_class

    path = sf.base_paths(work)[0][LLAMA]
    reader = GGUFReader(path)
    cls = model_class(reader.metadata["general.architecture"])
    m = cls(reader, split_layers(cls.read_config(reader, path).n_layer, choose_devices("cpu")))
    with m:
        m.load()
        assert getattr(m, "weights_fingerprint", None) is None
        with Runner(m, **sf.RUNNER) as rt:
            assert rt.load_state(0, io.BytesIO(bases[LLAMA].data)) == sf.PREFIX
            with pytest.raises(StateError, match="belongs to another model"):
                rt.load_state(1, io.BytesIO(bases[FOREIGN].data))
        assert m.weights_fingerprint == bases[LLAMA].header["meta"]["model"]["weights"]


# ---------------------------------------------------------------------------------------- what still loads


@pytest.mark.parametrize("name,edit,tokens", [
    ("the header re-serialized",
     lambda st: st.build(raw_header=json.dumps(st.header, indent=2, sort_keys=True).encode()),
     sf.PREFIX),
    ("another saved sequence id", _set(["seq"], 7), sf.PREFIX),
    ("another memory", _set(["caches", 0, "memory"], 3), sf.PREFIX),
    ("no token record", _tokens(lambda t: []), []),
    ("an image row among the tokens", _tokens(lambda t: [-7] + t[1:]), []),
], ids=lambda x: x if isinstance(x, str) else "")
@pytest.mark.parametrize("base", [LLAMA, GEMMA], ids=["llama", "gemma3"])
def test_valid_edits_load_exactly(name, edit, tokens, base, bases, runners):
    rts, refs = runners
    rt = rts[base]
    sf.fill(rt)
    other = sf.seq_rows(rt, 1)
    assert rt.load_state(0, io.BytesIO(edit(bases[base]))) == tokens
    assert sf.seq_rows(rt, 0) == refs[base] and sf.seq_rows(rt, 1) == other
    assert list(rt.slots[0].tokens) == tokens


def test_a_sliding_window_state_continues_exactly(work, bases, runners):
    """The gemma3 state holds positions 8..15 in its window cache (memory 4 + a batch of 4) and 0..15 in
    the full one; loaded under another id it gives the logits of the run that never stopped."""
    rts, _refs = runners
    rt = rts[GEMMA]
    pos = [bases[GEMMA].positions(k) for k in range(2)]
    assert pos[0] == list(range(8, 16)) and pos[1] == list(range(16))
    rt.clear()
    rt.decode(sf.PREFIX, seq=0, logits=None)
    want = rt.decode([77], seq=0)
    rt.clear()
    assert rt.load_state(1, io.BytesIO(bases[GEMMA].data)) == sf.PREFIX
    got = rt.decode([77], seq=1)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


# ---------------------------------------------------------------------------------------- property


def _paths(v, at=()):
    """Every path into a JSON value (the root excluded)."""
    if isinstance(v, dict):
        for k, x in v.items():
            yield at + (k,)
            yield from _paths(x, at + (k,))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            yield at + (i,)
            yield from _paths(x, at + (i,))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.sampled_from([0, 1, 2, 16, 511, 512, -2])
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=6) | st.sampled_from(["F16", "F32"]),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3), max_leaves=6)


@st.composite
def mutations(draw, bases):
    base = draw(st.sampled_from([LLAMA, GEMMA]))
    s = bases[base]
    kind = draw(st.sampled_from(["flip", "cut", "insert", "delete", "json-set", "json-del", "json-add"]))
    d = s.data
    if kind == "flip":
        at = draw(st.integers(0, len(d) - 1))
        return base, kind, d[:at] + bytes([d[at] ^ draw(st.integers(1, 255))]) + d[at + 1:]
    if kind == "cut":
        return base, kind, d[:draw(st.integers(0, len(d) - 1))]
    if kind == "insert":
        at = draw(st.integers(0, len(d)))
        # bytes after the state's end are not the state's: a seekable stream may go on (load_seq's
        # contract), so that one loads, exactly the original
        return base, kind if at < len(d) else "append", d[:at] + draw(st.binary(min_size=1, max_size=8)) + d[at:]
    if kind == "delete":
        at = draw(st.integers(0, len(d) - 1))
        return base, kind, d[:at] + d[at + draw(st.integers(1, 8)):]
    h = copy.deepcopy(s.header)
    path = draw(st.sampled_from(list(_paths(h))))
    parent = h
    for k in path[:-1]:
        parent = parent[k]
    if kind == "json-set":
        parent[path[-1]] = draw(json_values)
    elif kind == "json-del":
        del parent[path[-1]]
    elif isinstance(parent, dict):
        parent[draw(st.text(max_size=4))] = draw(json_values)
    else:
        parent.insert(path[-1], draw(json_values))
    return base, f"{kind} {path}", s.build(header=h)


def _property(data, bases, runners):
    rts, refs = runners
    base, kind, mutated = data.draw(mutations(bases))
    rt = rts[base]
    sf.fill(rt)
    before = sf.snapshot(rt)
    other = sf.seq_rows(rt, 1)
    try:
        tokens = rt.load_state(0, io.BytesIO(mutated))
    except (StateError, KVCacheFull):
        assert sf.snapshot(rt) == before, kind
        return
    # it loaded: only an edit of what does not matter (or a token record of other valid ids, which no
    # file format can tell from the true one), and exactly
    assert not kind.startswith(("flip", "cut", "insert", "delete")) or mutated == bases[base].data, kind
    header = json.loads(mutated[16:16 + struct.unpack_from("<I", mutated, 12)[0]])
    want = header["meta"]["tokens"]
    assert tokens == ([] if any(t < 0 for t in want) else want), kind
    assert sf.seq_rows(rt, 0) == refs[base] and sf.seq_rows(rt, 1) == other, kind
    assert list(rt.slots[0].tokens) == tokens


@settings(max_examples=int(os.environ.get("GGMLPY_STATE_PROPERTY_EXAMPLES", "150")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_property_random_mutations_load_exactly_or_change_nothing(data, bases, runners):
    _property(data, bases, runners)


# ---------------------------------------------------------------------------------------- the cache layer


def test_load_seq_check_callback_refuses_before_anything_changes():
    rng = np.random.default_rng(40)
    data = _saved(_src(CONFIGS[1], rng), meta={"tokens": [1, 2]})
    dst = _make(CONFIGS[1])
    _busy(dst, rng)
    before = _snapshot(dst)
    seen = []

    def check(meta, positions):
        seen.append((meta, [p.tolist() for p in positions]))
        raise StateError("not today")

    with pytest.raises(StateError, match="not today"):
        dst.load_seq(1, io.BytesIO(data), check=check)
    _same(before, _snapshot(dst))
    assert seen == [({"tokens": [1, 2]}, [list(range(10))])]
    with pytest.raises(GGMLTypeError, match="check must be callable"):
        dst.load_seq(1, io.BytesIO(data), check=1)


def test_expect_meta_compares_as_json():
    data = _saved(_src(CONFIGS[2], np.random.default_rng(41)), meta={"n": 1, "f": 1.0})
    dst = _make()
    before = _snapshot(dst)
    for want in ({"n": True}, {"n": 1.0}, {"f": 1}):
        with pytest.raises(StateError, match="meta '[nf]' is"):
            dst.load_seq(0, io.BytesIO(data), expect_meta=want)
    _same(before, _snapshot(dst))
    dst.load_seq(0, io.BytesIO(data), expect_meta={"n": 1, "f": 1.0})


def test_save_refuses_a_meta_the_loader_would_refuse(tmp_path, monkeypatch):
    src = _src(CONFIGS[0], np.random.default_rng(42))
    deep = 0
    for _ in range(40):
        deep = [deep]
    with pytest.raises(StateError, match="nested deeper"):
        src.save_seq(1, tmp_path / "x", meta={"d": deep})
    very = 0
    for _ in range(5000):
        very = [very]
    with pytest.raises(GGMLTypeError, match="JSON-serializable"):
        src.save_seq(1, tmp_path / "x", meta={"d": very})
    monkeypatch.setattr(kvstate, "MAX_HEADER", 600)
    with pytest.raises(StateError, match="MAX_HEADER"):
        src.save_seq(1, tmp_path / "x", meta={"s": "x" * 600})
    assert not list(tmp_path.iterdir())
    # brackets inside strings do not count as nesting, escaped quotes included
    monkeypatch.setattr(kvstate, "MAX_HEADER", 16 << 20)
    meta = {"s": "[" * 100 + '\\"' + "{" * 100, "t": '"\\\\' + "[" * 50}
    assert _make(CONFIGS[0]).load_seq(0, io.BytesIO(_saved(src, 1, meta=meta))) == meta


def test_a_stream_is_read_only_as_far_as_its_header_says():
    """A non-seekable stream declaring a huge state is read to its end (what it holds), not to the size it
    declares; one that goes on after the state is read one byte past it and refused."""
    src = _src(CONFIGS[2], np.random.default_rng(43))
    data = _saved(src)

    class Endless(io.RawIOBase):
        def __init__(self, head):
            self.head, self.served = head, 0

        def readable(self):
            return True

        def readinto(self, buf):
            if self.served > len(self.head) + (64 << 20):      # (the old code read to the end: forever)
                raise AssertionError("read 64 MiB past the state")
            n = min(len(buf), 1 << 20)
            buf[:n] = (self.head[self.served:] + b"\0" * n)[:n]
            self.served += n
            return n

    dst = _make()
    s = Endless(data)
    with pytest.raises(StateError, match="extra bytes"):
        dst.load_seq(0, s)
    assert s.served <= len(data) + (1 << 16) and dst.cells.used == 0


def test_a_file_that_changes_between_the_two_reads_leaves_the_sequence_cleared():
    """The checksum is verified again over the bytes written: a source that serves other bytes the second
    time leaves the loading sequence cleared (and says so); the others keep their cells and bytes."""
    rng = np.random.default_rng(44)
    data = _saved(_src(CONFIGS[1], rng))

    class Shifty(io.BytesIO):
        reads = 0

        def seek(self, *a):
            Shifty.reads += 1
            if Shifty.reads == 3:          # the rewind for the second pass: the data changed meanwhile
                buf = self.getbuffer()
                buf[len(buf) - 100] ^= 0xFF
                del buf
            return super().seek(*a)

    dst = _make(CONFIGS[1])
    _busy(dst, rng)
    before = [dst.cells.seqs[:, s].copy() for s in (0, 2, 3)]
    with pytest.raises(StateError, match="changed while it was loaded.*sequence 1 was cleared"):
        dst.load_seq(1, Shifty(data))
    assert dst.seq_pos_max(1) == -1
    assert all(np.array_equal(b, dst.cells.seqs[:, s]) for b, s in zip(before, (0, 2, 3)))


def test_bool_and_float_values_in_a_bare_cache_state_are_refused():
    rng = np.random.default_rng(45)
    data = _saved(_src(CONFIGS[1], rng))
    hl = struct.unpack_from("<I", data, 12)[0]
    header = json.loads(data[16:16 + hl])
    dst = _make(CONFIGS[1])
    _busy(dst, rng)
    before = _snapshot(dst)
    for key, value in [("v_trans", 1), ("n_layers", 2.0), ("window", False), ("n_head_kv", True)]:
        h = copy.deepcopy(header)
        h["caches"][0][key] = value
        raw = json.dumps(h).encode()
        d = data[:12] + struct.pack("<I", len(raw)) + raw + data[16 + hl:-32]
        with pytest.raises(StateError, match=f"bad '{key}'"):
            dst.load_seq(1, io.BytesIO(d + hashlib.sha256(d).digest()))
    _same(before, _snapshot(dst))


# ---------------------------------------------------------------------------------------- the fuzzer


@pytest.mark.fuzz
def test_state_fuzz_sample(tmp_path):
    """A sample of tests/state_fuzz.py in a child process: structural edits (all refused), semantic edits
    (all refused) and benign ones (all loaded exactly), no refusal changing anything, every error a
    StateError or KVCacheFull."""
    n = int(os.environ.get("GGMLPY_STATE_FUZZ_CASES", "120"))
    s = sf.run(n, seed=5, jobs=1, batch=n, case_timeout=60.0, work=str(tmp_path))
    assert s["cases"] == n and not s["failures"], s["failures"]
    assert s["aborts"] == s["hangs"] == s["bad_exceptions"] == s["changed_on_refusal"] == 0, s
    assert s["silent_loads"] == s["refused_valid"] == s["inexact_loads"] == 0, s
    assert s["rejected"] > n // 2 and s["loaded"] > 0, s
