"""GGUF reading and writing (ggmlpy.gguf over ggml's gguf.h).

Round trips of every value and array type and of tensors of plain and
quantized types; compatibility both ways with the ``gguf`` package
(gguf-py, which nobody here wrote); corrupt files fuzzed in a child process;
the error messages.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ggmlpy
import ggmlpy.gguf as ggguf
import ggmlpy.gguf.writer as gguf_writer
from ggmlpy import Type, _core
from ggmlpy.gguf import GGUFError, GGUFReader, GGUFWriter, ValueType

gguf_py = pytest.importorskip("gguf")

VT = ValueType
INT_LIMITS = {
    VT.UINT8: (0, 255), VT.INT8: (-128, 127), VT.UINT16: (0, 2**16 - 1), VT.INT16: (-2**15, 2**15 - 1),
    VT.UINT32: (0, 2**32 - 1), VT.INT32: (-2**31, 2**31 - 1), VT.UINT64: (0, 2**64 - 1),
    VT.INT64: (-2**63, 2**63 - 1),
}
DTYPES = {VT.UINT8: np.uint8, VT.INT8: np.int8, VT.UINT16: np.uint16, VT.INT16: np.int16, VT.UINT32: np.uint32,
          VT.INT32: np.int32, VT.FLOAT32: np.float32, VT.BOOL: np.bool_, VT.UINT64: np.uint64,
          VT.INT64: np.int64, VT.FLOAT64: np.float64}


def _same(a, b) -> bool:
    """Exact equality that treats NaN as equal to NaN (scalars, arrays, lists)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        return a.dtype == b.dtype and a.shape == b.shape and bool(np.array_equal(a, b, equal_nan=a.dtype.kind == "f"))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def _bf16_reference(x: np.ndarray) -> bytes:
    return gguf_py.quants.quantize(np.asarray(x, np.float32), gguf_py.GGMLQuantizationType.BF16).tobytes()


# --- metadata -------------------------------------------------------------------------

SCALARS = [
    *[(f"int.{vt.name}.{i}", v, vt) for vt, lims in INT_LIMITS.items() for i, v in enumerate((*lims, 1))],
    ("f32.pi", math.pi, VT.FLOAT32), ("f32.nan", float("nan"), VT.FLOAT32), ("f32.inf", -math.inf, VT.FLOAT32),
    ("f32.tiny", 1e-45, VT.FLOAT32), ("f64.pi", math.pi, VT.FLOAT64), ("f64.nan", float("nan"), VT.FLOAT64),
    ("f64.max", 1.7976931348623157e308, VT.FLOAT64), ("bool.t", True, VT.BOOL), ("bool.f", False, VT.BOOL),
    ("str.empty", "", VT.STRING), ("str.unicode", "héllo wörld ✓ 𝄞 日本", VT.STRING),
    ("str.long", "x" * 100_000, VT.STRING), ("ключ.🔑", "value", VT.STRING),
]


def _expected_scalar(value, vt):
    if vt == VT.FLOAT32:
        return float(np.float32(value))
    return value


def test_every_scalar_type_round_trips(tmp_path):
    path = tmp_path / "s.gguf"
    with GGUFWriter(path) as w:
        for key, value, vt in SCALARS:
            w.add(key, value, vt)
    r = GGUFReader(path)
    assert list(r.metadata) == [k for k, _, _ in SCALARS]
    for key, value, vt in SCALARS:
        assert r.kv_type(key) == vt and r.arr_type(key) is None
        assert _same(r.get(key), _expected_scalar(value, vt)), (key, r.get(key), value)
    assert not r.tensors and r.version == 3 and r.alignment == 32


ARRAYS = [
    *[(f"arr.{vt.name}", np.array([lo, hi, 0, 1], DTYPES[vt]), vt) for vt, (lo, hi) in INT_LIMITS.items()],
    ("arr.f32", np.array([1.5, -0.0, np.nan, np.inf, 3e38], np.float32), VT.FLOAT32),
    ("arr.f64", np.array([np.pi, np.nan, -np.inf, 5e-324]), VT.FLOAT64),
    ("arr.bool", np.array([True, False, True]), VT.BOOL),
    ("arr.str", ["", "a", "héllo ✓", "x" * 1000, "𝄞"], VT.STRING),
    *[(f"arr.empty.{vt.name}", [], vt) for vt in VT if vt != VT.ARRAY],
]


def test_every_array_type_round_trips_including_empty(tmp_path):
    path = tmp_path / "a.gguf"
    with GGUFWriter(path) as w:
        for key, values, vt in ARRAYS:
            w.add_array(key, values, vt)
    r = GGUFReader(path)
    for key, values, vt in ARRAYS:
        assert r.kv_type(key) == VT.ARRAY and r.arr_type(key) == vt, key
        got = r.get(key)
        if vt == VT.STRING:
            assert got == list(values)
        else:
            assert _same(got, np.asarray(values, DTYPES[vt])), (key, got)


def test_types_are_inferred(tmp_path):
    path = tmp_path / "i.gguf"
    cases = {
        "b": (True, VT.BOOL, None), "i": (-5, VT.INT32, None), "i64": (2**31, VT.INT64, None),
        "i64n": (-2**31 - 1, VT.INT64, None), "u64": (2**63, VT.UINT64, None), "f": (0.5, VT.FLOAT32, None),
        "s": ("x", VT.STRING, None), "npint": (np.int64(7), VT.INT32, None),
        "npf": (np.float64(0.25), VT.FLOAT32, None),
        "li": ([1, 2], VT.ARRAY, VT.INT32), "lbig": ([1, 2**40], VT.ARRAY, VT.INT64),
        "lu": ([2**64 - 1], VT.ARRAY, VT.UINT64),
        "lf": ([1, 2.5], VT.ARRAY, VT.FLOAT32), "lb": ([True, False], VT.ARRAY, VT.BOOL),
        "ls": (("a", "b"), VT.ARRAY, VT.STRING),
        "nu8": (np.arange(3, dtype=np.uint8), VT.ARRAY, VT.UINT8), "nf64": (np.ones(2), VT.ARRAY, VT.FLOAT64),
        "nstr": (np.array(["p", "q"]), VT.ARRAY, VT.STRING), "general.alignment": (64, VT.UINT32, None),
    }
    with GGUFWriter(path) as w:
        for k, (v, _, _) in cases.items():
            w.add(k, v)
    r = GGUFReader(path)
    for k, (_, vt, et) in cases.items():
        assert (r.kv_type(k), r.arr_type(k)) == (vt, et), k
    assert r.alignment == 64 and r.get("lu")[0] == 2**64 - 1 and r.get("ls") == ["a", "b"]


def test_a_later_add_replaces_and_moves_to_the_end(tmp_path):
    path = tmp_path / "d.gguf"
    with GGUFWriter(path, arch="llama") as w:
        w.add("a", 1)
        w.add("b", 2)
        w.add("a", "again")
    r = GGUFReader(path)
    assert list(r.metadata.items()) == [("general.architecture", "llama"), ("b", 2), ("a", "again")]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(
    st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), min_size=1, max_size=20),
    st.one_of(st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(width=32),
              st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), max_size=30),
              st.lists(st.integers(-2**31, 2**31 - 1), max_size=5),
              st.lists(st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), max_size=8),
                       min_size=1, max_size=5)),
    max_size=8).filter(lambda d: "general.alignment" not in d))
def test_random_metadata_round_trips(tmp_path, md):
    path = tmp_path / "h.gguf"
    with GGUFWriter(path) as w:
        for k, v in md.items():
            if isinstance(v, list) and not v:
                w.add_array(k, v, VT.INT32)
            else:
                w.add(k, v)
    got = GGUFReader(path).metadata
    assert list(got) == list(md)
    for k, v in md.items():
        if isinstance(v, list) and v and isinstance(v[0], str):
            assert got[k] == v
        elif isinstance(v, list):
            assert got[k].tolist() == v
        else:
            assert _same(got[k], v), (k, got[k], v)


# --- tensors ---------------------------------------------------------------------------

TENSOR_CASES = [
    ("F32", (7,)), ("F32", (3, 5)), ("F32", (2, 3, 4, 5)), ("F16", (5, 3)), ("F16", (2, 1, 3)),
    ("BF16", (9,)), ("BF16", (3, 2, 7)), ("Q8_0", (64,)), ("Q8_0", (3, 96)), ("Q4_0", (5, 32)),
    ("Q4_0", (2, 3, 2, 64)), ("Q4_K", (3, 256)), ("Q4_K", (2, 2, 512)), ("Q6_K", (1, 256)), ("Q6_K", (3, 256)),
    ("I32", (11,)), ("I32", (3, 4, 5)),
]


def _source(type_name: str, shape, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if type_name == "I32":
        return rng.integers(-2**31, 2**31, size=shape, dtype=np.int32)
    x = rng.standard_normal(shape).astype(np.float32)
    if type_name in ("F32", "BF16") and x.size > 3:
        x.flat[:3] = [np.nan, np.inf, -0.0]
    return x


def _encoded(type_name: str, x: np.ndarray) -> bytes:
    t = Type[type_name]
    if t.is_quantized:
        return ggmlpy.quantize(x.reshape(-1, x.shape[-1]), t)
    if t == Type.BF16:
        return _bf16_reference(x)
    return np.ascontiguousarray(x, t.numpy_dtype).tobytes()


def _trim(ne):
    ne = list(ne)
    while len(ne) > 1 and ne[-1] == 1:
        ne.pop()
    return tuple(ne)


def test_tensors_round_trip_exactly(tmp_path):
    path = tmp_path / "t.gguf"
    sources = {f"t{i}.{tn}": (tn, _source(tn, shape, i)) for i, (tn, shape) in enumerate(TENSOR_CASES)}
    with GGUFWriter(path, arch="test") as w:
        for name, (tn, x) in sources.items():
            w.add_tensor(name, x, type=None if tn in ("F32", "I32") else tn)
    r = GGUFReader(path)
    assert [t.name for t in r.tensors] == list(sources)
    for name, (tn, x) in sources.items():
        ti = r.tensor_info(name)
        assert ti.type == Type[tn] and ti.ne == _trim(x.shape[::-1]) and ti.offset % 32 == 0
        assert name in r and ti.nbytes == len(_encoded(tn, x))
        data = r.tensor_data(name)
        assert data.tobytes() == _encoded(tn, x), name
        if Type[tn].numpy_dtype is not None:
            assert data.dtype == Type[tn].numpy_dtype and data.shape == ti.shape
            if tn in ("F32", "I32"):
                assert np.array_equal(data, x.reshape(ti.shape), equal_nan=tn == "F32")
        else:
            assert data.dtype == np.uint8 and data.shape == ti.shape[:-1] + (Type[tn].row_size(ti.ne[0]),)
    assert "nope" not in r and len(r.tensors) == len(TENSOR_CASES)


def test_tensor_data_is_a_read_only_view_of_the_file(tmp_path):
    path = tmp_path / "v.gguf"
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    with GGUFWriter(path) as w:
        w.add_tensor("x", x)
    with GGUFReader(path) as r:
        a, b = r.tensor_data("x"), r.tensor_data("x")
        assert np.shares_memory(a, b) and not a.flags.writeable
        with pytest.raises(ValueError):
            a[0, 0] = 1
        assert r.tensor_info("x").offset == r.data_offset
    with pytest.raises(GGUFError, match="closed"):
        r.tensor_data("x")
    assert a[2, 3] == 11        # arrays outlive close()


def test_raw_encoded_tensors_and_conversions(tmp_path):
    path = tmp_path / "raw.gguf"
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    q = ggmlpy.quantize(x, Type.Q8_0)
    with GGUFWriter(path) as w:
        w.add_tensor("q.bytes", q, type="q8_0", ne=(64, 4))
        w.add_tensor("q.array", np.frombuffer(q, np.uint8).reshape(4, -1), type=Type.Q8_0, ne=[64, 4])
        w.add_tensor("i16.raw", np.arange(6, dtype=np.int16), ne=(3, 2))
        w.add_tensor("f64to16", x.astype(np.float64), type="F16")
        w.add_tensor("i8to32", np.arange(-3, 3, dtype=np.int8), type=Type.F32)
        w.add_tensor("scalar", np.float32(2.5))
        w.add_tensor("empty", np.zeros((2, 0, 32), np.float32), type="Q8_0")
        w.add_tensor("empty0", np.zeros((3, 0), np.float32))
    r = GGUFReader(path)
    assert r.tensor_data("q.bytes").tobytes() == q == r.tensor_data("q.array").tobytes()
    assert r.tensor_data("i16.raw").tolist() == [[0, 1, 2], [3, 4, 5]]
    assert np.array_equal(r.tensor_data("f64to16"), x.astype(np.float64).astype(np.float16))
    assert r.tensor_data("i8to32").tolist() == [-3, -2, -1, 0, 1, 2]
    assert r.tensor_info("scalar").ne == (1,) and r.tensor_data("scalar").tolist() == [2.5]
    assert r.tensor_info("empty").ne == (32, 0, 2) and r.tensor_info("empty").nbytes == 0
    assert r.tensor_data("empty").shape == (2, 0, 34) and r.tensor_data("empty0").shape == (3, 0)


def test_tensors_made_by_callables_are_made_at_write_in_order(tmp_path):
    # the lazy form: nothing is made when added; write() makes each tensor as it reaches it, in order
    x = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    made = []

    def make(name, data):
        def run():
            made.append(name)
            return data
        return run

    w = GGUFWriter(tmp_path / "lazy.gguf")
    w.add_tensor("a", make("a", ggmlpy.quantize(x, Type.Q8_0)), type="Q8_0", ne=(64, 4))
    w.add_tensor("b", make("b", x.astype(np.float16)), type="F16", ne=(64, 4))
    w.add_tensor("c", make("c", x.tobytes()), type="F32", ne=(64, 4))
    assert made == []
    w.write()
    assert made == ["a", "b", "c"]
    r = GGUFReader(tmp_path / "lazy.gguf")
    assert r.tensor_data("a").tobytes() == ggmlpy.quantize(x, Type.Q8_0)
    assert np.array_equal(r.tensor_data("b"), x.astype(np.float16)) and np.array_equal(r.tensor_data("c"), x)
    # a callable that makes the wrong size fails the write; no file is left
    w = GGUFWriter(tmp_path / "bad.gguf")
    w.add_tensor("a", lambda: b"\0" * 10, type="F32", ne=(64, 4))
    with pytest.raises(GGUFError, match="tensor 'a' encoded to 10 bytes, expected 1024"):
        w.write()
    assert not (tmp_path / "bad.gguf").exists()
    with pytest.raises(ggmlpy.GGMLTypeError, match="callable needs ne= and type="):
        GGUFWriter(tmp_path / "x.gguf").add_tensor("a", lambda: x)


def test_conversion_in_slices_gives_the_same_bytes(tmp_path, monkeypatch):
    # The writer encodes a few rows at a time; force many slices.
    monkeypatch.setattr(gguf_writer, "_CHUNK_BYTES", 300)     # where _Pending.pieces reads it
    x = np.random.default_rng(4).standard_normal((5, 3, 64)).astype(np.float32)
    path = tmp_path / "sl.gguf"
    with GGUFWriter(path) as w:
        for tn in ("Q8_0", "Q4_0", "BF16", "F16"):
            w.add_tensor(tn, x, type=tn)
    r = GGUFReader(path)
    for tn in ("Q8_0", "Q4_0", "BF16", "F16"):
        assert r.tensor_data(tn).tobytes() == _encoded(tn, x), tn


def test_custom_alignment(tmp_path):
    path = tmp_path / "al.gguf"
    with GGUFWriter(path) as w:
        w.add("general.alignment", 256, VT.UINT32)
        for i in range(3):
            w.add_tensor(f"t{i}", np.full(5 + i, i, np.float32))
    r = GGUFReader(path)
    assert r.alignment == 256 and r.data_offset % 256 == 0
    assert all(t.offset % 256 == 0 for t in r.tensors)
    assert [r.tensor_data(f"t{i}").tolist() for i in range(3)] == [[i] * (5 + i) for i in range(3)]
    p = gguf_py.GGUFReader(path)
    assert p.alignment == 256 and [t.data.tolist() for t in p.tensors] == [[i] * (5 + i) for i in range(3)]


# --- compatibility with gguf-py --------------------------------------------------------

def test_gguf_py_reads_what_ggmlpy_writes(tmp_path):
    path = tmp_path / "ours.gguf"
    x32 = np.random.default_rng(1).standard_normal((3, 2, 64)).astype(np.float32)
    with GGUFWriter(path, arch="llama") as w:
        for key, value, vt in SCALARS:
            if vt != VT.STRING or value:
                w.add(key, value, vt)
        for key, values, vt in ARRAYS:
            if len(values):
                w.add_array(key, values, vt)
        w.add_tensor("f32", x32)
        w.add_tensor("f16", x32, type="F16")
        w.add_tensor("bf16", x32, type="BF16")
        w.add_tensor("q8", x32, type="Q8_0")
        w.add_tensor("q4k", np.resize(x32, (2, 256)), type="Q4_K")
        w.add_tensor("i32", np.arange(10, dtype=np.int32).reshape(2, 5))
    ours = GGUFReader(path)
    theirs = gguf_py.GGUFReader(path)
    assert [k for k in theirs.fields if not k.startswith("GGUF.")] == list(ours.metadata)
    for key, value in ours.metadata.items():
        f = theirs.fields[key]
        assert int(f.types[0]) == ours.kv_type(key)
        if ours.kv_type(key) == VT.ARRAY:
            assert int(f.types[-1]) == ours.arr_type(key)
        got = f.contents()
        if isinstance(value, np.ndarray):
            assert _same(np.asarray(got, value.dtype), value), key
        elif isinstance(value, float):
            assert _same(float(got), value), key
        else:
            assert got == value, key
    assert [t.name for t in theirs.tensors] == [t.name for t in ours.tensors]
    for t in theirs.tensors:
        mine = ours.tensor_info(t.name)
        assert tuple(int(n) for n in t.shape) == mine.ne
        assert int(t.tensor_type) == int(mine.type)
        assert int(t.data_offset) == mine.offset and int(t.n_bytes) == mine.nbytes
        assert t.data.shape == ours.tensor_data(t.name).shape
        assert t.data.tobytes() == ours.tensor_data(t.name).tobytes()


def test_ggmlpy_reads_what_gguf_py_writes(tmp_path):
    path = tmp_path / "theirs.gguf"
    Q = gguf_py.GGMLQuantizationType
    PV = gguf_py.GGUFValueType
    rng = np.random.default_rng(2)
    x32 = rng.standard_normal((4, 64)).astype(np.float32)
    q8 = gguf_py.quants.quantize(x32, Q.Q8_0)
    w = gguf_py.GGUFWriter(str(path), "llama")
    w.add_uint8("u8", 200)
    w.add_int8("i8", -100)
    w.add_uint16("u16", 60000)
    w.add_int16("i16", -30000)
    w.add_uint32("u32", 2**32 - 1)
    w.add_int32("i32", -2**31)
    w.add_uint64("u64", 2**64 - 1)
    w.add_int64("i64", -2**63)
    w.add_float32("f32", 0.1)
    w.add_float64("f64", 0.1)
    w.add_bool("b", True)
    w.add_string("s", "ünïcode ✓")
    w.add_key_value("arr.i32", [1, -2, 3], PV.ARRAY, PV.INT32)
    w.add_key_value("arr.f32", [0.5, 1.5], PV.ARRAY, PV.FLOAT32)
    w.add_key_value("arr.u8", [0, 255], PV.ARRAY, PV.UINT8)
    w.add_key_value("arr.bool", [True, False], PV.ARRAY, PV.BOOL)
    w.add_key_value("arr.str", ["a", "", "ü"], PV.ARRAY, PV.STRING)
    w.add_tensor("f32", x32)
    w.add_tensor("f16", x32.astype(np.float16))
    w.add_tensor("q8", q8, raw_dtype=Q.Q8_0)
    w.add_tensor("i32", np.arange(6, dtype=np.int32).reshape(2, 3))
    w.add_tensor("f32.3d", rng.standard_normal((2, 3, 5)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    r = GGUFReader(path)
    md = r.metadata
    assert md["general.architecture"] == "llama"
    assert (md["u8"], md["i8"], md["u16"], md["i16"], md["u32"], md["i32"], md["u64"], md["i64"]) == \
        (200, -100, 60000, -30000, 2**32 - 1, -2**31, 2**64 - 1, -2**63)
    assert (r.kv_type("u8"), r.kv_type("u64"), r.kv_type("f64"), r.kv_type("b")) == \
        (VT.UINT8, VT.UINT64, VT.FLOAT64, VT.BOOL)
    assert md["f32"] == float(np.float32(0.1)) and md["f64"] == 0.1 and md["b"] is True and md["s"] == "ünïcode ✓"
    assert md["arr.i32"].tolist() == [1, -2, 3] and md["arr.i32"].dtype == np.int32
    assert md["arr.f32"].tolist() == [0.5, 1.5] and md["arr.u8"].dtype == np.uint8
    assert md["arr.bool"].tolist() == [True, False] and md["arr.str"] == ["a", "", "ü"]
    theirs = gguf_py.GGUFReader(path)
    for t in theirs.tensors:
        mine = r.tensor_info(t.name)
        assert mine.ne == tuple(int(n) for n in t.shape) and int(mine.type) == int(t.tensor_type)
        assert r.tensor_data(t.name).tobytes() == t.data.tobytes()
    assert np.array_equal(r.tensor_data("f32"), x32)
    assert np.array_equal(r.tensor_data("f16"), x32.astype(np.float16))
    assert r.tensor_data("q8").tobytes() == q8.tobytes()
    assert r.tensor_data("i32").tolist() == [[0, 1, 2], [3, 4, 5]]
    assert r.tensor_data("f32.3d").shape == (2, 3, 5)


def test_bf16_and_q8_0_match_gguf_py_quantizers(tmp_path):
    # An outside reference for the encoders the writer uses.
    x = np.random.default_rng(3).standard_normal((3, 64)).astype(np.float32)
    x[0, :4] = [np.nan, -np.inf, 3.4e38, 1e-40]
    path = tmp_path / "ref.gguf"
    with GGUFWriter(path) as w:
        w.add_tensor("bf16", x, type="BF16")
        w.add_tensor("q8", x[1:], type="Q8_0")
    r = GGUFReader(path)
    Q = gguf_py.GGMLQuantizationType
    assert r.tensor_data("bf16").tobytes() == gguf_py.quants.quantize(x, Q.BF16).tobytes()
    assert r.tensor_data("q8").tobytes() == gguf_py.quants.quantize(x[1:], Q.Q8_0).tobytes()


# --- errors ---------------------------------------------------------------------------------

def test_reader_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        GGUFReader(tmp_path / "missing.gguf")
    with pytest.raises(IsADirectoryError):
        GGUFReader(tmp_path)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + bytes(40))
    with pytest.raises(GGUFError, match=r"bad\.gguf: not a GGUF file \(magic b'GGML'"):
        GGUFReader(bad)
    bad.write_bytes(b"GG")
    with pytest.raises(GGUFError, match="too short"):
        GGUFReader(bad)
    bad.write_bytes(b"GGUF" + (1).to_bytes(4, "little") + bytes(16))
    with pytest.raises(GGUFError, match="unsupported GGUF version 1"):
        GGUFReader(bad)
    bad.write_bytes(b"GGUF" + (3 << 24).to_bytes(4, "little") + bytes(16))
    with pytest.raises(GGUFError, match="big-endian"):
        GGUFReader(bad)

    good = tmp_path / "good.gguf"
    with GGUFWriter(good) as w:
        w.add("k", "v")
        w.add_tensor("w", np.ones((4, 8), np.float32))
    data = good.read_bytes()
    bad.write_bytes(data[:40])
    with pytest.raises(GGUFError, match=r"truncated or corrupt\) \[ggml: .*\]") as e:
        GGUFReader(bad)
    assert isinstance(e.value, ValueError) and isinstance(e.value, ggmlpy.GGMLError)
    r = GGUFReader(good)
    bad.write_bytes(data[:r.data_offset + 100])           # header intact, data cut short
    with pytest.raises(GGUFError, match=r"tensor 'w' data \[\d+, \d+\) lies past the end of the file"):
        GGUFReader(bad)
    with pytest.raises(KeyError, match=r"good\.gguf has no tensor 'nope'"):
        r.tensor_info("nope")
    with pytest.raises(KeyError, match="nope"):
        r.tensor_data("nope")
    with pytest.raises(KeyError, match=r"good\.gguf has no metadata key 'nope'"):
        r.kv_type("nope")
    assert r.get("nope", 7) == 7


def test_writer_tensor_errors(tmp_path):
    w = GGUFWriter(tmp_path / "e.gguf")
    x = np.ones((2, 32), np.float32)
    w.add_tensor("x", x)
    with pytest.raises(GGUFError, match="'x' was already added"):
        w.add_tensor("x", x)
    with pytest.raises(GGUFError, match="tensor 'y': unknown ggml type 'Q9_9'"):
        w.add_tensor("y", x, type="Q9_9")
    with pytest.raises(GGUFError, match=r"tensor 'y': 10 bytes of raw Q8_0 data, but ne=\(32, 2\) takes 68"):
        w.add_tensor("y", b"\0" * 10, type="Q8_0", ne=(32, 2))
    with pytest.raises(GGUFError, match="'y': row length ne.0.=30 is not a multiple of q4_K's block size 256"):
        w.add_tensor("y", np.ones((2, 30), np.float32), type="Q4_K")
    w.add_tensor("n" * 63, x)
    with pytest.raises(GGUFError, match="is 64 bytes long; ggml allows at most 63"):
        w.add_tensor("n" * 64, x)
    with pytest.raises(GGUFError, match="at most 63"):
        w.add_tensor("é" * 32, x)                      # 64 bytes of UTF-8
    with pytest.raises(GGUFError, match="NUL"):
        w.add_tensor("a\0b", x)
    with pytest.raises(GGUFError, match="must not be empty"):
        w.add_tensor("", x)
    with pytest.raises(GGUFError, match=r"ne=\(32, 0\) ends in a dimension of 0"):
        w.add_tensor("y", np.zeros((0, 32), np.float32))
    with pytest.raises(GGUFError, match="5 dimensions"):
        w.add_tensor("y", np.ones((1, 1, 1, 1, 2), np.float32))
    with pytest.raises(ggmlpy.GGMLTypeError, match="will not truncate float32 data to I32"):
        w.add_tensor("y", x, type="I32")
    with pytest.raises(ggmlpy.GGMLTypeError, match="numpy dtype uint32 has no ggml type"):
        w.add_tensor("y", np.ones(4, np.uint32))
    with pytest.raises(ggmlpy.GGMLTypeError, match="numeric"):
        w.add_tensor("y", np.array(["a"]))
    with pytest.raises(ggmlpy.GGMLValueError, match="tensor 'y'.*iq2_xxs needs an importance matrix"):
        w.add_tensor("y", np.ones((1, 256), np.float32), type="IQ2_XXS")
    with pytest.raises(ggmlpy.GGMLTypeError, match="tensor 'y'.*cannot quantize to q8_1"):
        w.add_tensor("y", np.ones((1, 32), np.float32), type="Q8_1")
    with pytest.raises(ggmlpy.GGMLTypeError, match="needs type="):
        w.add_tensor("y", b"1234", ne=(4,))
    w.write()
    assert len(GGUFReader(tmp_path / "e.gguf").tensors) == 2
    with pytest.raises(GGUFError, match="already written"):
        w.write()


def test_writer_metadata_errors(tmp_path):
    w = GGUFWriter(tmp_path / "m.gguf")
    with pytest.raises(GGUFError, match="keys must not be empty"):
        w.add("", 1)
    with pytest.raises(GGUFError, match="NUL"):
        w.add("a\0", 1)
    with pytest.raises(GGUFError, match="NUL"):
        w.add("a", "x\0y")
    with pytest.raises(GGUFError, match="NUL"):
        w.add("a", ["x", "y\0"])
    with pytest.raises(GGUFError, match="not valid Unicode"):
        w.add("a", "\ud800")
    with pytest.raises(GGUFError, match=r"256 is out of range for UINT8 \[0, 255\]"):
        w.add("a", 256, VT.UINT8)
    with pytest.raises(GGUFError, match="out of range for INT8"):
        w.add_array("a", [1, 128], VT.INT8)
    with pytest.raises(GGUFError, match="out of range for UINT16"):
        w.add_array("a", np.array([-1, 3]), VT.UINT16)
    with pytest.raises(GGUFError, match="does not fit"):
        w.add("a", 2**64)
    with pytest.raises(ggmlpy.GGMLTypeError, match="INT32 needs an int"):
        w.add("a", 1.5, VT.INT32)
    with pytest.raises(ggmlpy.GGMLTypeError, match="value of .a. must be a str, got int"):
        w.add("a", 1, VT.STRING)
    with pytest.raises(ggmlpy.GGMLTypeError, match="decoded"):
        w.add("a", b"bytes")
    with pytest.raises(ggmlpy.GGMLTypeError, match="needs integers"):
        w.add_array("a", np.ones(2), VT.INT32)
    with pytest.raises(ggmlpy.GGMLTypeError, match="explicit element type"):
        w.add("a", [])
    with pytest.raises(ggmlpy.GGMLTypeError, match="one element type"):
        w.add("a", [1, "x"])
    with pytest.raises(GGUFError, match="arrays of arrays"):
        w.add_array("a", [[1]], VT.ARRAY)
    with pytest.raises(GGUFError, match="1-D"):
        w.add_array("a", np.ones((2, 2), np.float32))
    with pytest.raises(GGUFError, match="not a ValueType"):
        w.add("a", 1, 99)
    for bad in (48, 0, -32):
        with pytest.raises(GGUFError, match="power of two"):
            w.add("general.alignment", bad)
    with pytest.raises(GGUFError, match="UINT32 power of two"):
        w.add("general.alignment", 64, VT.UINT64)
    with pytest.raises(GGUFError, match="UINT32 power of two"):
        w.add_array("general.alignment", [64], VT.UINT32)
    w.write()
    assert GGUFReader(tmp_path / "m.gguf").metadata == {}


def test_a_failed_write_leaves_no_file(tmp_path):
    path = tmp_path / "f.gguf"
    with pytest.raises(RuntimeError), GGUFWriter(path) as w:
        w.add_tensor("x", np.ones(4, np.float32))
        raise RuntimeError("boom")
    assert not path.exists() and not list(tmp_path.glob("*.tmp"))
    w = GGUFWriter(tmp_path / "nodir" / "f.gguf")
    with pytest.raises(FileNotFoundError):
        w.write()
    assert not list(tmp_path.glob("**/*.tmp"))


def test_private_core_entry_points_validate():
    # _gguf_meta is reachable from Python: it must raise, not reach ggml's asserts.
    with pytest.raises(GGUFError, match="duplicate tensor name"):
        _core._gguf_meta([], [("a", 0, (4,)), ("a", 0, (4,))])
    with pytest.raises(GGUFError, match="power of two"):
        _core._gguf_meta([("general.alignment", int(VT.INT32), None, 32)], [])
    with pytest.raises(GGUFError, match="must not be empty"):
        _core._gguf_meta([("", int(VT.INT32), None, 1)], [])
    with pytest.raises(ggmlpy.GGMLTypeError):
        _core._gguf_meta([("k", int(VT.ARRAY), int(VT.INT32), [1, 2])], [])
    with pytest.raises(GGUFError, match="negative"):
        _core._gguf_meta([], [("a", 0, (4, -1))])
    with pytest.raises(GGUFError, match="too large"):
        _core._gguf_meta([], [("a", 0, (2**40, 2**40))])
    with pytest.raises(GGUFError, match="1 to 4 dimensions"):
        _core._gguf_meta([], [("a", 0, ())])


# --- corrupt files, in a child process -------------------------------------------------------

FUZZ_CHILD = textwrap.dedent(r"""
    import json, os, random, sys
    import numpy as np
    from ggmlpy import GGMLError
    from ggmlpy import gguf

    base = open(sys.argv[1], "rb").read()
    header, log_path, work, seed = int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
    rng = random.Random(seed)
    edges = [0, 1, 2, 3, 4, 8, 12, 13, 63, 64, 255, 2**16, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**62,
             2**63 - 1, 2**63, 2**64 - 1]
    cases = [(f"truncate at {n}", base[:n]) for n in range(header + 1)]
    cases += [(f"truncate at {n}", base[:n]) for n in sorted(rng.sample(range(header + 1, len(base)), 20))]
    for _ in range(60):
        pos = rng.randrange(header)
        bit = rng.randrange(8)
        cases.append((f"flip bit {bit} at {pos}", base[:pos] + bytes([base[pos] ^ (1 << bit)]) + base[pos + 1:]))
    for _ in range(100):
        width = rng.choice((4, 8))
        pos = rng.randrange(header - width + 1)
        v = rng.choice(edges) % (1 << (8 * width))
        cases.append((f"write {v} as u{8 * width} at {pos}",
                      base[:pos] + v.to_bytes(width, "little") + base[pos + width:]))
    for _ in range(20):
        pos = rng.randrange(header)
        junk = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 16)))
        cases.append((f"insert {junk.hex()} at {pos}", base[:pos] + junk + base[pos:]))

    out = {"cases": len(cases), "read": 0, "rejected": 0, "failures": []}
    case_path = os.path.join(work, "case.gguf")
    again = os.path.join(work, "again.gguf")
    with open(log_path, "w") as log:
        for i, (desc, data) in enumerate(cases):
            with open(case_path, "wb") as f:
                f.write(data)
            log.write(f"case {i}: {desc}\n")
            log.flush()
            try:
                r = gguf.GGUFReader(case_path)
            except gguf.GGUFError as e:
                out["rejected"] += 1
                if case_path not in str(e):
                    out["failures"].append(f"{desc}: message does not name the file: {e}")
                continue
            except Exception as e:
                out["failures"].append(f"{desc}: {type(e).__name__}: {e}")
                continue
            out["read"] += 1
            try:
                for t in r.tensors:
                    r.tensor_data(t.name).tobytes()
                # Write back what was read: the writer must cope with whatever came out.
                w = gguf.GGUFWriter(again)
                for k, v in r.metadata.items():
                    if r.kv_type(k) == gguf.ValueType.ARRAY:
                        w.add_array(k, v, r.arr_type(k))
                    else:
                        w.add(k, v, r.kv_type(k))
                for t in r.tensors:
                    w.add_tensor(t.name, r.tensor_data(t.name), type=t.type, ne=t.ne)
                w.write()
                r2 = gguf.GGUFReader(again)
                if [t.ne for t in r2.tensors] != [t.ne for t in r.tensors] or list(r2.metadata) != list(r.metadata):
                    out["failures"].append(f"{desc}: rewrite changed the file's layout")
            except GGMLError:
                pass
            except Exception as e:
                out["failures"].append(f"{desc}: after reading: {type(e).__name__}: {e}")
            finally:
                r.close()
    print(json.dumps(out))
""")


@pytest.mark.fuzz
def test_corrupt_files_never_abort(tmp_path):
    base = tmp_path / "base.gguf"
    with GGUFWriter(base, arch="llama") as w:
        w.add("general.alignment", 64)
        w.add("n", 3, VT.UINT32)
        w.add("eps", 1e-5)
        w.add("ok", True)
        w.add("big", 2**64 - 1)
        w.add("name", "tïny")
        w.add_array("toks", ["a", "bc", ""], VT.STRING)
        w.add_array("ids", [1, -2, 3], VT.INT32)
        w.add_tensor("w", np.ones((2, 32), np.float32), type="Q8_0")
        w.add_tensor("b", np.arange(3, dtype=np.float32))
        w.add_tensor("i", np.arange(4, dtype=np.int32).reshape(2, 2))
    header = GGUFReader(base).data_offset
    assert header < 600
    log = tmp_path / "fuzz.log"
    work = tmp_path / "work"
    work.mkdir()
    proc = subprocess.run([sys.executable, "-X", "faulthandler", "-c", FUZZ_CHILD, str(base), str(header),
                           str(log), str(work), "1234"], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        last = log.read_text().splitlines()[-1:] if log.exists() else []
        pytest.fail(f"the GGUF fuzz child died ({proc.returncode}) on {last[0] if last else '?'} "
                    f"(input left in {work / 'case.gguf'}):\n{proc.stderr[-3000:]}")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not summary["failures"], "\n".join(summary["failures"][:20])
    assert summary["read"] > 20 and summary["rejected"] > 200, summary


def test_module_is_the_public_face():
    assert ggguf.ValueType is _core.GGUFValueType and ggguf.GGUFError is _core.GGUFError
    assert issubclass(GGUFError, ValueError) and issubclass(GGUFError, ggmlpy.GGMLError)
    assert [int(v) for v in VT] == list(range(13))
    assert [v.name for v in VT] == [v.name for v in gguf_py.GGUFValueType]
    assert ggguf.__file__.endswith(os.path.join("ggmlpy", "gguf", "__init__.py"))
