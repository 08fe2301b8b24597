"""Loading a GGUF model: peak RSS stays near the model's size (data is read straight into the weight
buffers), progress is reported, and bad files give clear errors (no transformers needed here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import run_child

from ggmlpy import gguf
from ggmlpy.models import MissingTensor, UnknownArchitecture, load_model
from ggmlpy.models.synthetic import write_synthetic

CHILD = r"""
import json, resource, sys
import ggmlpy
from ggmlpy.models import load_model
from ggmlpy.runner import Runner
kib = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
before = kib()
m = load_model(sys.argv[1], devices="cpu")
after = kib()
print(json.dumps({"before": before * 1024, "after": after * 1024, "size": m.size}))
"""


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    return write_synthetic(tmp_path_factory.mktemp("syn") / "m.gguf", size="15M", type="F16", seed=3)


def test_peak_rss_is_model_size_plus_a_small_margin(synth):
    out = subprocess.run([sys.executable, "-c", CHILD, str(synth)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    grew = r["after"] - r["before"]
    assert r["size"] > 30 << 20
    # margin: 8 MiB plus 5% (allocator rounding, the metadata context); a second copy would be 100%
    assert grew <= r["size"] * 1.05 + (8 << 20), (grew / 2**20, r["size"] / 2**20)


@pytest.mark.parametrize("mmap", [False, True])
def test_weights_equal_the_file(synth, mmap):
    """Plain weights hold the file's bytes; a fused weight holds its parts' bytes in order (Q, K, V rows;
    gate, up rows), on every layer; unfused, each part is its own tensor."""
    def raw(name):
        return rd.tensor_data(name).view(np.uint8).ravel()

    with load_model(synth, repack=False, mmap=mmap, devices="cpu") as m, gguf.GGUFReader(synth) as rd:
        for name in ("token_embd.weight", "output_norm.weight", "blk.0.attn_norm.weight"):
            np.testing.assert_array_equal(m.weights[name].numpy().view(np.uint8).ravel(), raw(name))
        n_layer = m.config.n_layer
        assert len(m.fused) == 2 * n_layer
        for i in range(n_layer):
            for fused, parts in (("attn_qkv", ("attn_q", "attn_k", "attn_v")), ("ffn_gate_up", ("ffn_gate", "ffn_up"))):
                names = tuple(f"blk.{i}.{q}.weight" for q in parts)
                assert m.fused[f"blk.{i}.{fused}.weight"] == names and not any(n in m.weights for n in names)
                np.testing.assert_array_equal(m.weights[f"blk.{i}.{fused}.weight"].numpy().view(np.uint8).ravel(),
                                              np.concatenate([raw(n) for n in names]))
    with load_model(synth, repack=False, fuse=False, devices="cpu") as m, gguf.GGUFReader(synth) as rd:
        assert m.fused == {} and "blk.0.attn_qkv.weight" not in m.weights
        np.testing.assert_array_equal(m.weights["blk.0.attn_k.weight"].numpy().view(np.uint8).ravel(),
                                      raw("blk.0.attn_k.weight"))


def _mapped(path) -> bool:
    """Whether this process has ``path`` memory-mapped now (Linux)."""
    real = os.path.realpath(path)
    with open("/proc/self/maps") as f:
        return any(line.rstrip("\n").endswith(" " + real) for line in f)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps (Linux)")
def test_mmap_load_reads_through_a_mapping_and_read_load_does_not(synth):
    """load_model(mmap=True) (llama-bench -mmp 1) copies the weights out of a mapping of the file, released
    when loading ends; mmap=False (-mmp 0) reads them with read(2): the file is never mapped. Same weights."""
    from ggmlpy.runner import Runner

    out = {}
    for mmap in (False, True):
        seen = []
        with load_model(synth, mmap=mmap, devices="cpu",
                        progress=lambda d, t, seen=seen: seen.append(_mapped(synth))) as m:
            assert len(seen) > 10 and not _mapped(synth)
            assert any(seen) if mmap else not any(seen)
            with Runner(m, n_ctx=16) as rt:
                out[mmap] = (m.weights["token_embd.weight"].get(), rt.decode([1, 2, 3, 4], logits="all"))
    np.testing.assert_array_equal(out[True][0], out[False][0])
    np.testing.assert_array_equal(out[True][1], out[False][1])


def test_truncated_file_and_wrong_shape(tmp_path, synth):
    data = open(synth, "rb").read()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(gguf.GGUFError):
        load_model(cut, devices="cpu")
    # a tensor with the wrong shape: MissingTensor naming it
    bad = rewrite(synth, tmp_path / "bad.gguf", tensor=("blk.1.ffn_down.weight", lambda a: a[:, :-32]))
    with pytest.raises(MissingTensor, match="blk.1.ffn_down.weight.*expected"):
        load_model(bad, devices="cpu")


@pytest.mark.parametrize("key,value,error,match", [
    ("general.architecture", "gpt2", UnknownArchitecture, "gpt2"),
    ("llama.expert_count", 8, ValueError, "'llama.expert_used_count': is missing"),     # mixtral's keys, half
    ("llama.attention.value_length", 32, ValueError, "key and value head sizes differ"),
    ("llama.attention.head_count_kv", 4, ValueError, "head_count_kv 4 must divide"),
    ("llama.rope.scaling.type", "longrope", ValueError, "rope scaling 'longrope'"),
])
def test_unsupported_metadata_is_refused(tmp_path, synth, key, value, error, match):
    path = rewrite(synth, tmp_path / "x.gguf", meta=(key, value))
    with pytest.raises(error, match=match):
        load_model(path, devices="cpu")


def rewrite(src, dst, meta=None, tensor=None):
    """Copy a GGUF file, replacing one metadata value or transforming one tensor's data."""
    with gguf.GGUFReader(src) as rd:
        w = gguf.GGUFWriter(str(dst))
        for k, v in rd.metadata.items():
            if k != gguf.ALIGNMENT_KEY and (meta is None or k != meta[0]):
                w.add(k, v, None if isinstance(v, (list, np.ndarray)) else rd.kv_type(k))
        if meta is not None:
            w.add(*meta)
        for info in rd.tensors:
            arr = rd.tensor_data(info.name)
            if tensor is not None and info.name == tensor[0]:
                arr = tensor[1](arr)
            w.add_tensor(info.name, arr, type=info.type)
        w.write()
    return dst


@pytest.mark.fuzz
def test_corrupt_model_files_never_abort_and_semantic_edits_never_load(tmp_path):
    """A sample of tests/gguf_fuzz.py (the long run is documented there): structural corruption (truncations,
    flips, huge counts, duplicate keys, bad offsets, n_dims > 4, unknown types ...) and semantic edits (one
    tensor fewer, eps inf, block_count wrong, F16 re-typed BF16 ...) through GGUFReader, load_model and a
    decode, in child processes: no abort, no hang, every semantic edit rejected, every error a GGMLError."""
    import gguf_fuzz

    n = int(os.environ.get("GGMLPY_GGUF_FUZZ_CASES", "400"))
    s = gguf_fuzz.run(n, seed=11, jobs=1, batch=200, case_timeout=20.0, work=str(tmp_path))
    assert s["cases"] == n and not s["failures"], s["failures"]
    assert s["aborts"] == s["hangs"] == s["bad_exceptions"] == s["silent_semantic_loads"] == 0, s
    # the sample really covers both sides: many semantic edits (all rejected) and some loads
    assert s["semantic"] > n // 5 and s["semantic_rejected"] == s["semantic"], s
    assert s["loaded"] > 0 and s["rejected"] > n // 2, s
    assert set(gguf_fuzz.SEMANTIC) <= set(s["by_kind"]), sorted(s["by_kind"])


# --- memory and resources given back ----------------------------------------------------------------

def _open_handles(path: str) -> tuple[int, int]:
    """(file descriptors on ``path``, memory mappings of ``path``) of this process."""
    real = os.path.realpath(path)
    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds += os.readlink(f"/proc/self/fd/{fd}") == real
        except OSError:
            pass
    with open("/proc/self/maps") as f:
        maps = sum(line.rstrip().endswith(real) for line in f)
    return fds, maps


def test_load_close_loop_keeps_rss_flat_and_releases_the_file(synth):
    """load_model/close five times after a warm-up: RSS flat (it grew by the model's 46 MiB per reload
    while backend buffers leaked), and no descriptor or mapping of the file left behind."""
    from helpers import rss_growth

    size = []

    def once():
        m = load_model(synth, devices="cpu")
        # touch the mapped reader too, so its mapping must be released by close()
        m._reader.tensor_data("output_norm.weight").sum()
        size.append(m.size)
        m.close()

    grew = rss_growth(once, loops=5, warmup=1)
    assert size[-1] > 40 << 20
    assert grew < 8, f"RSS grew {grew:.1f} MiB over 5 load/close of a {size[-1] / 2**20:.0f} MiB model"
    assert _open_handles(str(synth)) == (0, 0)
    # a load that fails after the weights are allocated (NaN in the last tensor read) gives everything back
    def nan_first(a):
        a = a.copy()
        a[0, 0] = np.nan
        return a

    bad = rewrite(synth, synth.parent / "bad-close.gguf", tensor=("output.weight", nan_first))

    def failing():
        with pytest.raises(gguf.GGUFError, match="'output.weight' .* holds non-finite values"):
            load_model(bad, devices="cpu")

    assert rss_growth(failing, loops=5, warmup=1) < 8
    assert _open_handles(str(bad)) == (0, 0)


def test_synthetic_cache_check_does_not_hide_bugs(tmp_path, monkeypatch):
    """_is_complete swallowed every Exception: a bug (here an AttributeError) silently rewrote the cache."""
    from ggmlpy.models import synthetic

    p = synthetic.synthetic_path("tiny", "F16", cache_dir=tmp_path)
    assert synthetic.synthetic_path("tiny", "F16", cache_dir=tmp_path) == p
    p.write_bytes(b"GGUF corrupt")                 # a corrupt cache file is rewritten
    assert gguf.GGUFReader(synthetic.synthetic_path("tiny", "F16", cache_dir=tmp_path)).get("llama.block_count") == 2

    def broken(*a, **k):
        raise AttributeError("a bug")

    monkeypatch.setattr(gguf, "GGUFReader", broken)
    with pytest.raises(AttributeError, match="a bug"):
        synthetic.synthetic_path("tiny", "F16", cache_dir=tmp_path)


def test_mapped_file_reads_like_a_plain_file(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, 3 * 4096 + 17, dtype=np.uint8).tobytes()
    path = tmp_path / "blob"
    path.write_bytes(data)
    with gguf.open_data(path, mmap=True) as mf, gguf.open_data(path) as pf:
        assert isinstance(mf, gguf.MappedFile) and not isinstance(pf, gguf.MappedFile)
        for f in (mf, pf):
            assert f.read(5) == data[:5] and f.tell() == 5
            assert f.seek(4090) == 4090
            buf = bytearray(100)
            assert f.readinto(buf) == 100 and bytes(buf) == data[4090:4190]
            f.seek(-10, os.SEEK_END)
            assert f.readinto(memoryview(buf)[:50]) == 10 and bytes(buf[:10]) == data[-10:]
            assert f.read(4) == b"" and f.readinto(buf) == 0            # at the end
            f.seek(3, os.SEEK_SET)
            f.seek(4, os.SEEK_CUR)
            assert f.read() == data[7:]
    with pytest.raises(ValueError):
        mf.read(1)                                   # closed
    (tmp_path / "empty").write_bytes(b"")
    with gguf.MappedFile(tmp_path / "empty") as f:
        assert f.read(10) == b""
    with pytest.raises(FileNotFoundError):
        gguf.MappedFile(tmp_path / "missing")


def test_mapped_file_refuses_to_touch_pages_of_a_file_that_shrank(tmp_path):
    """Reading a page past the new end of a mapped file would kill the process (SIGBUS): an error instead.
    In a child process, so that a missing check shows as a dead child, not a dead test run."""
    path = tmp_path / "blob"
    path.write_bytes(b"x" * (1 << 20))
    r = run_child("""
        import os, sys
        from ggmlpy import gguf
        f = gguf.MappedFile(sys.argv[1])
        os.truncate(sys.argv[1], 1000)
        assert f.read(500) == b"x" * 500                 # still inside the file
        f.seek(8192)
        try:
            f.read(100)
        except gguf.GGUFError as e:
            print("REFUSED", e)
        f.close()
    """, path)
    assert r.returncode == 0, r.stderr
    assert "REFUSED" in r.stdout and "shrank" in r.stdout
