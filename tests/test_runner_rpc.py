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
    with load_model(path) as cpu_model, Runner(cpu_model, n_ctx=32, type_k="f32", type_v="f32") as rt:
        ref = rt.decode(PROMPT, logits="all")
        ref_gen = rt.generate(PROMPT, max_tokens=25, n_keep=2).tokens
    seen = []
    with load_model(path, devices="auto", rpc=[rpc_server], n_gpu_layers=2,
                    progress=lambda d, t: seen.append(d)) as model:
        kinds = [d.type for d in model.placement.layers]
        assert kinds == ["CPU", "GPU", "GPU"] and model.backend_names == "RPC"
        remote = model.placement.layers[1].name
        assert not model.weights["blk.1.attn_q.weight"].is_host
        np.testing.assert_array_equal(model.weights["blk.1.attn_q.weight"].get(),
                                      cpu_model_weights(path, "blk.1.attn_q.weight"))
        assert seen[-1] == model.size
        with Runner(model, n_ctx=32, type_k="f32", type_v="f32") as rt:
            report = rt.memory_report()
            assert report.devices[remote].cache_total == 2 * rt.cache.bytes_per_layer()
            assert report.devices[remote].graph > 0 and report.devices["CPU"].graph > 0
            got = rt.decode(PROMPT, logits="all")
            np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4 * np.abs(ref).max())
            rt.clear()
            # n_ctx 32 with 12 + 25 tokens: one shift; the cache is remote, so the runner clears and
            # re-processes the kept tokens instead of rotating keys
            r = rt.generate(PROMPT, max_tokens=25, n_keep=2)
            assert r.n_shifts == 1 and len(r.tokens) == 25
            assert rt.rt.reallocations == 0
    # re-processing is exact, the CPU shift is an approximation: they agree up to the shift ...
    n_before = 32 - len(PROMPT) + 1
    assert r.tokens[:n_before] == ref_gen[:n_before]
    # ... and after it the remote run continues exactly as a fresh run over the kept tokens
    from ggmlpy.sequences import shift_discard

    full = (PROMPT + r.tokens)[:32]
    d = shift_discard(32, 2, 32)
    kept = full[:2] + full[2 + d:] + [r.tokens[n_before - 1]]
    with load_model(path) as cpu_model, Runner(cpu_model, n_ctx=32, type_k="f32", type_v="f32") as rt:
        fresh = rt.generate(kept, max_tokens=25 - n_before).tokens
    assert r.tokens[n_before:] == fresh


def cpu_model_weights(path, name):
    from ggmlpy import gguf

    with gguf.GGUFReader(path) as rd:
        info = rd.tensor_info(name)
        import ggmlpy as gp
        return gp.dequantize(rd.tensor_data(name).tobytes(), info.type, info.ne[0]).reshape(info.shape)
