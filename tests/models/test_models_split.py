"""A split model (gguf-split's format, written by ggmlpy's writer) loaded from its first shard: every shard's
weights, the same logits as the model in one file (plain reads and memory-mapped), the same weights
fingerprint, and a missing shard refused by name before anything is allocated."""

from __future__ import annotations

import os

import numpy as np
import pytest

from ggmlpy import gguf
from ggmlpy.load import load_model
from ggmlpy.models.synthetic import write_synthetic
from ggmlpy.runner import Runner

TOKENS = [1, 17, 42, 99, 7, 250, 3, 64]


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    return write_synthetic(tmp_path_factory.mktemp("split") / "m.gguf", size="tiny", type="Q8_0", seed=4)


def _logits(path, **kw):
    with load_model(path, devices="cpu", **kw) as m, Runner(m, n_ctx=64, n_threads=1) as rt:
        return rt.decode(TOKENS, logits="all"), m.weights_fingerprint, len(m.weights.tensors)


@pytest.mark.parametrize("how", [{"max_tensors": 5}, {"max_bytes": 64 << 10}])
def test_split_model_gives_the_logits_of_the_whole_file(whole, tmp_path, how):
    shards = gguf.write_split(whole, tmp_path / "s.gguf", **how)
    assert len(shards) >= 3
    want, fp, n = _logits(whole)
    for mmap in (False, True):
        got, fp_split, n_split = _logits(shards[0], mmap=mmap)
        assert np.array_equal(got, want)
        assert fp_split == fp and n_split == n
    # each shard holds a part of the weights: none of them is the model alone
    with gguf.open_reader(shards[0]) as r:
        per_shard = {r.shard_of(t.name) for t in r.tensors}
    assert per_shard == set(shards)


def test_missing_shard_is_named_before_anything_loads(whole, tmp_path):
    shards = gguf.write_split(whole, tmp_path / "s.gguf", max_tensors=5)
    os.unlink(shards[1])
    with pytest.raises(gguf.GGUFError, match=f"missing from .*: {os.path.basename(shards[1])}"):
        load_model(shards[0], devices="cpu")
    with pytest.raises(gguf.GGUFError, match="load the first, s-00001-of-"):
        load_model(shards[2], devices="cpu")
