"""Loading a GGUF model: peak RSS stays near the model's size (data is read straight into the weight
buffers), progress is reported, and bad files give clear errors (no transformers needed here)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

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
m = load_model(sys.argv[1])
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


def test_weights_equal_the_file(synth):
    with load_model(synth) as m, gguf.GGUFReader(synth) as rd:
        for name in ("token_embd.weight", "blk.0.attn_q.weight", "output_norm.weight"):
            np.testing.assert_array_equal(m.weights[name].numpy().view(np.uint8).ravel(),
                                          rd.tensor_data(name).view(np.uint8).ravel())


def test_truncated_file_and_wrong_shape(tmp_path, synth):
    data = open(synth, "rb").read()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(gguf.GGUFError):
        load_model(cut)
    # a tensor with the wrong shape: MissingTensor naming it
    bad = rewrite(synth, tmp_path / "bad.gguf", tensor=("blk.1.ffn_down.weight", lambda a: a[:, :-32]))
    with pytest.raises(MissingTensor, match="blk.1.ffn_down.weight.*expected"):
        load_model(bad)


@pytest.mark.parametrize("key,value,error,match", [
    ("general.architecture", "gpt2", UnknownArchitecture, "gpt2"),
    ("llama.expert_count", 8, UnknownArchitecture, "mixture-of-experts"),
    ("llama.attention.value_length", 32, ValueError, "key and value head sizes differ"),
    ("llama.attention.head_count_kv", 4, ValueError, "head_count_kv 4 must divide"),
    ("llama.rope.scaling.type", "longrope", ValueError, "rope scaling 'longrope'"),
])
def test_unsupported_metadata_is_refused(tmp_path, synth, key, value, error, match):
    path = rewrite(synth, tmp_path / "x.gguf", meta=(key, value))
    with pytest.raises(error, match=match):
        load_model(path)


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


FUZZ_CHILD = r"""
import sys, random
import numpy as np
from ggmlpy.models import load_model
from ggmlpy.runner import Runner
data = open(sys.argv[1], "rb").read()
rng = random.Random(int(sys.argv[2]))
head = int(sys.argv[3])                      # bytes of metadata and tensor infos
for case in range(int(sys.argv[4])):
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        i = rng.randrange(head)
        buf[i] = rng.randrange(256) if rng.random() < 0.7 else buf[i] ^ (1 << rng.randrange(8))
    path = sys.argv[1] + ".fuzz"
    open(path, "wb").write(buf)
    print("case", case, flush=True)
    try:
        with load_model(path) as m, Runner(m, n_ctx=16) as rt:
            rt.decode([1, 2, 3])
    except (ValueError, TypeError, MemoryError, KeyError, OSError, RuntimeError):
        pass
print("done", flush=True)
"""


def test_corrupt_model_files_never_abort(tmp_path):
    """Random bytes flipped in the metadata and tensor infos of a model: load_model (and a decode when it
    loads) raises or works, the process never aborts. In a child process, so an abort names the case."""
    path = write_synthetic(tmp_path / "tiny.gguf", size="tiny", type="Q8_0")
    with gguf.GGUFReader(path) as rd:
        head = rd.data_offset
    out = subprocess.run([sys.executable, "-c", FUZZ_CHILD, str(path), "1234", str(head), "300"],
                         capture_output=True, text=True, timeout=300)
    last = [line for line in out.stdout.splitlines() if line.startswith("case")][-1:]
    assert out.returncode == 0 and out.stdout.rstrip().endswith("done"), (out.returncode, last, out.stderr[-2000:])
