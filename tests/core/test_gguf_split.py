"""Split GGUF models (ggmlpy.gguf.split, GGUFWriter's split sets): the format llama.cpp's gguf-split writes
(the keys and their types as gguf-py, which nobody here wrote, names and reads them), the shards read as
one file, and each broken set refused with a message naming the file."""

from __future__ import annotations

import os

import numpy as np
import pytest

from ggmlpy import gguf
from ggmlpy.gguf import (
    GGUFError,
    GGUFReader,
    GGUFSplitReader,
    GGUFWriter,
    ValueType,
    open_reader,
    write_split,
)

gguf_py = pytest.importorskip("gguf")


def _model(path, n: int = 10, arch: str = "toy") -> dict:
    """A file of ``n`` F32 tensors of different sizes (and one quantized), two metadata keys; returns the
    tensors by name."""
    rng = np.random.default_rng(0)
    tensors = {f"t{i}": rng.standard_normal((i + 1, 32)).astype(np.float32) for i in range(n - 1)}
    tensors["q"] = rng.standard_normal((4, 64)).astype(np.float32)
    with GGUFWriter(path, arch=arch) as w:
        w.add("toy.block_count", 3)
        w.add_array("toy.list", ["a", "b"])
        for name, a in tensors.items():
            w.add_tensor(name, a, type="Q8_0" if name == "q" else None)
    return tensors


def test_the_writer_splits_as_gguf_split_does(tmp_path):
    src = tmp_path / "m.gguf"
    _model(src)
    paths = write_split(src, tmp_path / "s.gguf", max_tensors=4)
    assert [os.path.basename(p) for p in paths] == [f"s-0000{k}-of-00003.gguf" for k in (1, 2, 3)]
    K = gguf_py.Keys.Split
    assert (gguf.SPLIT_NO, gguf.SPLIT_COUNT, gguf.SPLIT_TENSORS_COUNT) == (K.LLM_KV_SPLIT_NO, K.LLM_KV_SPLIT_COUNT,
                                                                         K.LLM_KV_SPLIT_TENSORS_COUNT)
    counts = []
    for k, p in enumerate(paths):
        r = gguf_py.GGUFReader(p)            # another reader of the format
        f = r.fields
        assert f[gguf.SPLIT_NO].types == [gguf_py.GGUFValueType.UINT16] and int(f[gguf.SPLIT_NO].parts[-1][0]) == k
        assert f[gguf.SPLIT_COUNT].types == [gguf_py.GGUFValueType.UINT16]
        assert int(f[gguf.SPLIT_COUNT].parts[-1][0]) == 3
        assert f[gguf.SPLIT_TENSORS_COUNT].types == [gguf_py.GGUFValueType.INT32]
        assert int(f[gguf.SPLIT_TENSORS_COUNT].parts[-1][0]) == 10
        # every key of the model in the first shard only (gguf-split: "Save all metadata in first split only")
        assert ("toy.block_count" in f) == (k == 0) and ("general.architecture" in f) == (k == 0)
        counts.append(len(r.tensors))
    assert counts == [4, 4, 2]


def test_split_by_bytes_keeps_each_shard_under_the_bound(tmp_path):
    src = tmp_path / "m.gguf"
    _model(src)
    bound = 1024
    paths = write_split(src, tmp_path / "b.gguf", max_bytes=bound)
    sizes = []
    for p in paths:
        with GGUFReader(p) as r:
            padded = [t.nbytes + (-t.nbytes % r.alignment) for t in r.tensors]
            sizes.append(padded)
            # under the bound, or a single tensor that is larger by itself
            assert sum(padded) <= bound or len(padded) == 1
    # no two neighbouring shards could have been one
    assert all(sum(a) + b[0] > bound for a, b in zip(sizes, sizes[1:]))
    assert sum(len(s) for s in sizes) == 10 and len(paths) > 2


def test_split_reader_is_the_model(tmp_path):
    src = tmp_path / "m.gguf"
    tensors = _model(src)
    paths = write_split(src, tmp_path / "s.gguf", max_tensors=3)
    with open_reader(paths[0]) as r, GGUFReader(src) as whole:
        assert isinstance(r, GGUFSplitReader) and r.files == tuple(paths)
        assert r.metadata == {**whole.metadata, gguf.SPLIT_NO: 0, gguf.SPLIT_COUNT: 4, gguf.SPLIT_TENSORS_COUNT: 10}
        assert [t.name for t in r.tensors] == [t.name for t in whole.tensors]
        for name, a in tensors.items():
            assert np.array_equal(r.tensor_data(name), whole.tensor_data(name))
            if name != "q":
                assert np.array_equal(r.tensor_data(name).reshape(a.shape), a)
            assert r.shard_of(name) == paths[list(tensors).index(name) // 3]
        # the offsets count in the shards laid end to end: what open_data(files) reads
        with gguf.open_data(r.files) as f, gguf.open_data(r.files, mmap=True) as fm:
            for t in r.tensors:
                f.seek(t.offset)
                fm.seek(t.offset)
                want = whole.tensor_data(t.name).tobytes()
                assert f.read(t.nbytes) == want and fm.read(t.nbytes) == want
    # a plain file is a plain reader; a set of one shard too (nothing else to find)
    assert type(open_reader(src)) is GGUFReader
    one = write_split(src, tmp_path / "one.gguf", max_tensors=100)
    assert [os.path.basename(p) for p in one] == ["one-00001-of-00001.gguf"]
    assert type(open_reader(one[0])) is GGUFReader


def _shard(path, no: int, count: int, total: int, tensors: dict, meta: bool = False) -> None:
    with GGUFWriter(path, arch="toy" if meta else None) as w:
        w.add(gguf.SPLIT_NO, no, ValueType.UINT16)
        w.add(gguf.SPLIT_COUNT, count, ValueType.UINT16)
        w.add(gguf.SPLIT_TENSORS_COUNT, total, ValueType.INT32)
        for name, a in tensors.items():
            w.add_tensor(name, a)


A = {"a": np.ones((2, 4), np.float32)}
B = {"b": np.full((2, 4), 2, np.float32)}


@pytest.mark.parametrize("case, expected", [
    ("missing", r"split in 3 files and 1 of them is missing from .*: s-00003-of-00003\.gguf"),
    ("second", r"s-00002-of-00003\.gguf: shard 2 of a model split in 3 files .* load the first, "
               r"s-00001-of-00003\.gguf"),
    ("renamed", r"renamed\.gguf: split\.count is 3 .* does not end in -00001-of-00003\.gguf"),
    ("index", r"s-00003-of-00003\.gguf: split\.no is 1, expected 2"),
    ("count", r"s-00003-of-00003\.gguf: split\.count is 4, but the first shard s-00001-of-00003\.gguf says 3"),
    ("duplicate", r"s-00003-of-00003\.gguf: tensor 'b' is in s-00002-of-00003\.gguf too"),
    ("total", r"s-00001-of-00003\.gguf: split\.tensors\.count is 4, but the 3 shards hold 3 tensors"),
])
def test_broken_sets_are_refused_naming_the_file(tmp_path, case, expected):
    p = [str(tmp_path / f"s-0000{k}-of-00003.gguf") for k in (1, 2, 3)]
    total = 4 if case == "total" else 3
    _shard(p[0], 0, 3, total, A, meta=True)
    _shard(p[1], 1, 3, total, B)
    C = B if case == "duplicate" else {"c": np.zeros((2, 4), np.float32) + 3}
    _shard(p[2], 1 if case == "index" else 2, 4 if case == "count" else 3, total, C)
    first = p[0]
    if case == "missing":
        os.unlink(p[2])
    elif case == "second":
        first = p[1]
    elif case == "renamed":
        os.rename(p[0], tmp_path / "renamed.gguf")
        first = str(tmp_path / "renamed.gguf")
    with pytest.raises(GGUFError, match=expected):
        open_reader(first)
    if case in ("index", "count", "duplicate", "total"):
        # the same set made right reads
        for k, t in enumerate((A, B, {"c": C.get("c", np.zeros((2, 4), np.float32))})):
            _shard(p[k], k, 3, 3, t, meta=k == 0)
        with open_reader(first) as r:
            assert [t.name for t in r.tensors] == ["a", "b", "c"]


def test_writer_split_arguments_are_checked(tmp_path):
    with pytest.raises(GGUFError, match="not both"):
        GGUFWriter(tmp_path / "x.gguf", split_max_tensors=2, split_max_bytes=10)
    with pytest.raises(GGUFError, match="split_max_tensors must be a whole number"):
        GGUFWriter(tmp_path / "x.gguf", split_max_tensors=0)
