"""The model and runner split across a real RPC server on loopback and the CPU: weights streamed into
remote buffers, the KV cache placed per layer, logits equal to the CPU alone, and a context shift on a
cache in device memory falling back to clearing and re-processing (then exactly a fresh run)."""

from __future__ import annotations

import numpy as np
import pytest
from hf_helpers import export_gguf, hf_model
from test_core_backend import rpc_server  # noqa: F401  (the loopback server fixture)

from ggmlpy.models import load_model
from ggmlpy.runner import Runner

pytestmark = [pytest.mark.rpc, pytest.mark.hf]

PROMPT = [5, 17, 250, 3, 99, 42, 7, 300, 128, 64, 11, 200]


def test_rpc_split_equals_cpu(tmp_path, rpc_server):  # noqa: F811
    path = export_gguf(hf_model("qwen2", layers=3, seed=21), tmp_path / "m.gguf", "qwen2", wtype="Q8_0")
    with load_model(path, devices="cpu") as cpu_model, Runner(cpu_model, n_ctx=32, type_k="f32", type_v="f32") as rt:
        ref = rt.decode(PROMPT, logits="all")
        ref_gen = rt.generate(PROMPT, max_tokens=25, n_keep=2, temperature=0).tokens
    seen = []
    with load_model(path, devices="auto", rpc=[rpc_server], n_gpu_layers=2,
                    progress=lambda d, t: seen.append(d)) as model:
        kinds = [d.type for d in model.placement.layers]
        assert kinds == ["CPU", "GPU", "GPU"] and model.backend_names == "RPC"
        remote = model.placement.layers[1].name
        # the fused Q/K/V weight on the server holds the file's three weights, rows in order
        assert not model.weights["blk.1.attn_qkv.weight"].is_host
        np.testing.assert_array_equal(model.weights["blk.1.attn_qkv.weight"].get(), np.concatenate(
            [cpu_model_weights(path, f"blk.1.attn_{q}.weight") for q in "qkv"]))
        assert seen[-1] == model.size
        with Runner(model, n_ctx=32, type_k="f32", type_v="f32") as rt:
            report = rt.memory_report()
            assert report.devices[remote].cache_total == 2 * rt.cache.bytes_per_layer()
            assert report.devices[remote].graph > 0 and report.devices["CPU"].graph > 0
            got = rt.decode(PROMPT, logits="all")
            np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4 * np.abs(ref).max())
            rt.clear()
            # n_ctx 32 with 12 + 25 tokens: one shift. The cache is remote, and its keys are re-rotated
            # there: the shift graph computes through the runner's scheduler on the server
            shifts = []
            real_shift = rt.cache._shift
            rt.cache._shift = lambda cells, offset: (shifts.append(offset), real_shift(cells, offset))
            r = rt.generate(PROMPT, max_tokens=25, n_keep=2, temperature=0)
            assert r.n_shifts == 1 and len(r.tokens) == 25 and len(shifts) == 1 and shifts[0] < 0
            assert rt.reallocations == 0
    # the same request on the CPU alone (its cache shifted on the CPU) gave the same tokens
    assert r.tokens == ref_gen


def test_no_kv_offload_keeps_the_cache_in_host_memory(tmp_path, rpc_server):  # noqa: F811
    """offload_kqv=False (llama-bench's -nkvo 1): the layers compute on the server, their K/V stay in CPU
    buffers, the memory report counts them there, and the logits are those of the offloaded cache."""
    path = export_gguf(hf_model("llama", layers=2, seed=22), tmp_path / "m.gguf", "llama")
    with load_model(path, devices="auto", rpc=[rpc_server]) as model:
        remote = model.placement.layers[0].name
        assert [d.type for d in model.placement.layers] == ["GPU", "GPU"]
        with Runner(model, n_ctx=32, type_k="f32", type_v="f32") as rt:
            assert not any(t.is_host for t in rt.cache.keys + rt.cache.values)
            assert rt.memory_report().devices[remote].cache_total == 2 * rt.cache.bytes_per_layer()
            offloaded = rt.decode(PROMPT, logits="all")
        with Runner(model, n_ctx=32, type_k="f32", type_v="f32", offload_kqv=False) as rt:
            assert all(t.is_host for t in rt.cache.keys + rt.cache.values)
            report = rt.memory_report()
            assert report.devices[remote].cache_total == 0
            assert report.devices["CPU"].cache_total == 2 * rt.cache.bytes_per_layer()
            assert not model.weights["blk.0.attn_qkv.weight"].is_host        # the layers still compute remotely
            host = rt.decode(PROMPT, logits="all")
            rt.cache.remove(0, 2, 4)             # a host cache can shift positions; a remote one cannot
            assert rt.cache.seq_pos_max(0) == len(PROMPT) - 3
    np.testing.assert_allclose(host, offloaded, rtol=0, atol=1e-5 * np.abs(offloaded).max())


def cpu_model_weights(path, name):
    from ggmlpy import gguf

    with gguf.GGUFReader(path) as rd:
        info = rd.tensor_info(name)
        import ggmlpy as gp
        return gp.dequantize(rd.tensor_data(name).tobytes(), info.type, info.ne[0]).reshape(info.shape)


RUNNER_KILL = r"""
import socket, subprocess, sys, time
import ggmlpy as gp
from ggmlpy.models import load_model
from ggmlpy.runner import Runner, RunnerError
path = sys.argv[1]
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
proc = subprocess.Popen([sys.executable, "-m", "ggmlpy.cli", "rpc-server", "--host", "127.0.0.1", "--port", str(port),
                         "-t", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
ep = f"127.0.0.1:{port}"
try:
    for _ in range(300):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close(); break
        except OSError:
            time.sleep(0.1)
    with load_model(path, devices="auto", rpc=[ep], n_gpu_layers=2) as model:
        rt = Runner(model, n_ctx=512, type_k="f32", type_v="f32")
        h = rt.submit([5, 17, 250, 3], max_tokens=480, temperature=0)
        events = iter(h)
        for _ in range(3):
            next(events)                                  # generating now
        proc.kill(); proc.wait()
        try:
            h.result(timeout=120)
        except RunnerError as e:
            cause = e.__cause__
            assert isinstance(cause, ConnectionError) and isinstance(cause, gp.GGMLError), repr(cause)
            assert ep in str(e), str(e)
            print("request failed:", e)
        else:
            raise AssertionError("the request finished although its server died")
        # a later request on the same runner ends with an error too, never hangs
        try:
            rt.generate([5, 17], max_tokens=4, temperature=0)
        except (RunnerError, ConnectionError) as e:
            assert ep in str(e), str(e)
        else:
            raise AssertionError("a request on a dead server succeeded")
        rt.close()
    with load_model(path, devices="cpu") as model, Runner(model, n_ctx=32) as rt:      # the CPU keeps working
        assert len(rt.generate([5, 17, 250], max_tokens=5, temperature=0).tokens) == 5
finally:
    proc.kill()
print("survived")
"""


def test_server_killed_while_generating_fails_the_request(tmp_path):
    # Fails on 076c683: the client process aborted in ggml's RPC client when the server died.
    from helpers import run_child

    path = export_gguf(hf_model("qwen2", layers=3, seed=21), tmp_path / "m.gguf", "qwen2")
    out = run_child(RUNNER_KILL, path, timeout=300)
    assert out.returncode == 0 and "survived" in out.stdout, (out.returncode, out.stdout[-2000:], out.stderr[-3000:])
