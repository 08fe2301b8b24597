"""Every architecture split across the CPU and a real RPC server on loopback gives the CPU's logits.

One ``rpc-server`` process (test_core_backend's module fixture) serves every case. Each architecture's
tiny F32 model is loaded twice: on the CPU alone, and with its last layers on the server (for some every
layer and the output head, the input staying on the CPU). The split is checked to be real before
anything is compared: the placement, the memory report's weights and cache per layer group on each
device, and every layer's K/V tensors in host memory exactly where the layer is on the CPU (for gemma2
and gemma3 through the :class:`~ggmlpy.kvcache.Wrapper`'s routing, with both the window cache and the
full one holding layers on each side). Then the same runner session, F32 cache, on both:

* a prompt of 20 tokens in one batch (past gemma's window of 8), then three tokens one at a time;
* a second sequence's prompt and the first's next token in one batch;
* a context shift, ``cache.remove(0, keep, keep + discard)`` (the remote keys are re-rotated by a graph
  the runner's scheduler computes on the server), then two more tokens;
* one token, two, one again on the second sequence: the third takes the first's graph from the runner's
  pool, allocated again after another graph. Before the fix in ``Scheduler._alloc``
  (``ggmlpy_unplace`` in ggmlpy_sched.h) ggml re-planned only the scheduler's fresh copies of split
  inputs around the stale addresses of the graph's own tensors, and a copy was overwritten before it
  was read: phi3 (its LongRoPE factors then stayed with the input on the CPU, so each remote layer was
  several splits on the server) crashed the server on an out-of-range ``get_rows`` index. The server now
  holds its own copy of the factors (``DecoderModel._copy_to_layer_devices``), and each side of a split
  is one split of the graph.

Sources: llama (4 layers), Mixtral (a llama file with experts), qwen3, qwen3moe, gemma3 (13 layers:
local 0-4, global 5, local 6-10, global 11, local 12; window 8), deepseek2 (4 layers, the
first dense; a K-only latent cache), glm4moe (4 layers, the first dense), llama4 (4 layers, dense and MoE in
turn, the last NoPE) and lfm2 (6 layers: attention 1 and 4,
short convolutions with recurrent states elsewhere; its context shift is the runner's fallback, the
kept tokens computed again), granitehybrid (6 layers: attention 1 and 5, Mamba-2 elsewhere) and qwen3next (6
layers: gated attention 1 and 5, gated DeltaNet elsewhere) are
ggmlpy's synthetic files, rewritten as F32; gemma2, phi3 (LongRoPE), olmo2 and granite (tied output,
multipliers) are the files llama.cpp's
converter writes for the architecture tests' tiny transformers models (test_arch_gemma, test_arch_phi3,
test_arch_olmo_granite), converted once for this module.

Tolerance: per position, max |split - cpu| / max |cpu| at most 1e-6 (:data:`TOL`). The server runs
ggml's CPU kernels on the same F32 data; measured: 0 (bit-identical) for every architecture and step.
"""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
import pytest
from test_core_backend import rpc_server  # noqa: F401  (the loopback server fixture)

from ggmlpy import gguf
from ggmlpy.kvcache import NotSupported, Recurrent, Wrapper
from ggmlpy.models import blocks, load_model
from ggmlpy.models.synthetic import SIZES, for_arch, write_synthetic
from ggmlpy.runner import Runner

pytestmark = pytest.mark.rpc

#: max over positions of max |split - cpu| / max |cpu| (measured 0 everywhere: see the module docstring)
TOL = 1e-6


@pytest.fixture(autouse=True)
def _same_kernels(monkeypatch):
    """Both runs use ggml's kernels: ggmlpy's CPU kernels (attention for generation and prompts,
    blocks.attention; the one-token products, blocks.linear; GeGLU, blocks.ffn_glu) take the
    CPU-only run's layers but not the server's, and they differ from ggml's by rounding (float16 in
    attention, ~1e-5; float32 summation order in the products; ggml's float16 GELU table), more than
    TOL, which checks the placement, not the kernels."""
    for switch in ("decode_kernel", "prefill_kernel", "matvec_kernel", "glu_kernel"):
        monkeypatch.setattr(blocks, switch, False)

PROMPT = [13, 17, 250, 3, 99, 42, 7, 300, 128, 64, 11, 200, 5, 77, 31, 402, 8, 19, 260, 4]
STEPS = [23, 311, 6]
SECOND = [21, 90, 14, 222, 37, 5, 480, 12, 61]
NEXT = 150
KEEP, DISCARD = 2, 5

_TINY = SIZES["tiny"]
#: synthetic shapes (written F16 by write_synthetic, rewritten F32)
SYNTHETIC = {
    "llama": replace(for_arch(_TINY, "llama"), n_layer=4),
    # Mixtral: llama.cpp's llama reads the experts' width from feed_forward_length
    "mixtral": replace(for_arch(_TINY, "llama"), n_ff=32, n_expert=8, n_expert_used=2, n_ff_exp=32),
    "qwen3": for_arch(_TINY, "qwen3"),
    "qwen3moe": for_arch(_TINY, "qwen3moe"),
    "gemma3": replace(for_arch(replace(_TINY, n_layer=13), "gemma3"), sliding_window=8),
    # attention in layers 1 and 4, short convolutions (recurrent states) in the others
    "lfm2": for_arch(replace(_TINY, n_layer=6), "lfm2"),
    # attention in layers 1 and 5, Mamba-2 (convolution and scan states) in the others
    "granitehybrid": for_arch(replace(_TINY, n_layer=6), "granitehybrid"),
    # gated attention in layers 1 and 5, gated DeltaNet (convolution and delta-rule states) in the others
    "qwen3next": for_arch(replace(_TINY, n_layer=6), "qwen3next"),
    # the first layer dense, then experts in groups; the latent cache (K rows only) on both sides
    "deepseek2": replace(for_arch(_TINY, "deepseek2"), n_layer=4),
    "glm4moe": replace(for_arch(_TINY, "glm4moe"), n_layer=4),
    # dense and MoE layers in turn, chunked attention in 0-2, NoPE in 3 (a Wrapper of a chunked and a full cache)
    "llama4": for_arch(_TINY, "llama4"),
}

# name: (n_gpu_layers, flash attention). n_gpu_layers > n_layer puts every layer and the output head on the
# server, the input (token_embd's get_rows) on the CPU; granite's tied head then has its own copy of
# token_embd on the server.
CASES = {
    "llama": (2, False),
    "mixtral": (3, True),
    "qwen3": (1, True),
    "qwen3moe": (3, False),
    "gemma3": (7, True),          # layers 6-12: global 11 and locals on the server, global 5 on the CPU
    "gemma2": (2, False),         # layers 2 (local) and 3 (global) on the server, 0 and 1 on the CPU
    "phi3": (3, True),
    "olmo2": (1, False),
    "granite": (3, False),
    "lfm2": (3, True),            # convolution layers 3, 5 and attention layer 4 on the server
    "granitehybrid": (3, False),  # Mamba-2 layers 3, 4 and attention layer 5 on the server
    "qwen3next": (3, True),       # DeltaNet layers 3, 4 and attention layer 5 on the server
    "deepseek2": (3, True),       # layers 1-3 (experts) on the server, the dense layer 0 on the CPU
    "glm4moe": (2, False),        # layers 2-3 (experts) on the server; the dense layer 0 and layer 1 on the CPU
    "llama4": (2, True),          # chunked layer 2 (dense) and NoPE layer 3 (experts) on the server
}
CONVERTED = ("gemma2", "phi3", "olmo2", "granite")


def _f32_copy(src, dst):
    """``src`` with every F16 tensor stored as F32 (the same values) and ``general.file_type`` 0."""
    with gguf.GGUFReader(str(src)) as rd:
        out = gguf.GGUFWriter(str(dst))
        for key, value in rd.metadata.items():
            if key == gguf.ALIGNMENT_KEY:
                continue
            if key == "general.file_type":
                value = 0
            out.add(key, value, None if isinstance(value, (list, np.ndarray)) else rd.kv_type(key))
        for info in rd.tensors:
            out.add_tensor(info.name, np.asarray(rd.tensor_data(info.name), dtype=np.float32), type="F32")
        out.write()
    return dst


def _convert(name: str, tmp_path_factory):
    """The architecture test's tiny transformers model of ``name``, converted to F32 by llama.cpp's converter."""
    if not os.environ.get("CI"):
        for module in ("torch", "transformers", "sentencepiece"):
            pytest.importorskip(module)
    import hf_convert
    from arch_helpers import make

    if name == "gemma2":
        from test_arch_gemma import _convert as convert_gemma

        return convert_gemma("gemma2", tmp_path_factory).path
    if name == "phi3":
        from test_arch_phi3 import longrope

        return make("Phi3ForCausalLM", "Phi3Config", hf_convert.SPM, [], tmp_path_factory.mktemp(name),
                    **longrope()).path()
    from test_arch_olmo_granite import _convert as convert_olmo_granite

    return convert_olmo_granite(name, tmp_path_factory.mktemp(name), []).path()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """``get(name)``: the F32 file of architecture ``name`` (each made once for the module)."""
    made: dict = {}

    def get(name: str):
        if name not in made:
            if name in SYNTHETIC:
                out = tmp_path_factory.mktemp(name)
                f16 = write_synthetic(out / "f16.gguf", SYNTHETIC[name], "F16", seed=3)
                made[name] = _f32_copy(f16, out / "f32.gguf")
            else:
                made[name] = _convert(name, tmp_path_factory)
        return made[name]
    return get


def _layer_kv(cache, layer: int):
    """The K and V tensors of model layer ``layer`` (through a Wrapper's routing; K alone for a K-only cache), or
    its recurrent states."""
    c, i = cache.route(layer) if isinstance(cache, Wrapper) else (cache, layer)
    if isinstance(c, Recurrent):
        return tuple(c.tensors[i].values())
    return (c.keys[i],) + ((c.values[i],) if c.values else ())


def _recurrent_layers(model) -> set:
    return {i for i, r in enumerate(getattr(model.config, "recurrent_layers", ())) if r}


def _session(model, flash: bool, check=None) -> dict:
    """The logits of one runner session (see the module docstring), by step."""
    out = {}
    with Runner(model, n_ctx=64, n_seq_max=2, type_k="f32", type_v="f32", flash_attn=flash) as rt:
        if check is not None:
            check(rt)
        out["batch"] = rt.decode(PROMPT, logits="all")
        out["steps"] = np.concatenate([rt.decode([t]) for t in STEPS])
        n0 = len(PROMPT) + len(STEPS)
        out["two seqs"] = rt.decode_batch(SECOND + [NEXT], [*range(len(SECOND)), n0], [1] * len(SECOND) + [0],
                                          logits=np.ones(len(SECOND) + 1, bool))
        try:
            rt.cache.remove(0, KEEP, KEEP + DISCARD)
        except NotSupported:
            # recurrent states cannot shift: the runner's fallback, the kept tokens computed again
            rt.clear(0)
            held = PROMPT + STEPS + [NEXT]
            rt.decode(held[:KEEP] + held[KEEP + DISCARD:], logits=None)
        assert rt.cache.seq_pos_max(0) == n0 - DISCARD
        out["shift"] = rt.decode([9, 10], logits="all")
        # one token, two, one again: the third takes the first's graph from the runner's pool, which the
        # scheduler allocates again after the second's (every graph is planned afresh: ggmlpy_sched.h)
        built = rt.graphs_built
        out["regraph"] = np.concatenate([rt.decode([33], seq=1), rt.decode([34, 35], seq=1, logits="all"),
                                         rt.decode([36], seq=1)])
        assert rt.graphs_built - built <= 2
    return out


ARCH_PARAMS = [pytest.param(n, marks=pytest.mark.hf) if n in CONVERTED else n for n in CASES]


@pytest.mark.parametrize("name", ARCH_PARAMS)
def test_split_equals_cpu(name, files, rpc_server):  # noqa: F811
    path = files(name)
    ngl, flash = CASES[name]
    with load_model(path, devices="cpu") as model:
        assert {d.type for d in model.placement.devices()} == {"CPU"}
        ref = _session(model, flash)
    with load_model(path, devices="auto", rpc=[rpc_server], n_gpu_layers=ngl) as model:
        n = model.config.n_layer
        p = model.placement
        remote = p.layers[-1]
        on_server = set(range(n - min(ngl, n), n))
        # a real split: layers on both sides, or every layer and the head on the server (the input on the CPU)
        assert on_server and (len(on_server) < n or ngl > n)
        assert remote.type != "CPU" and remote.name.startswith("RPC") and model.backend_names == "RPC"
        assert [i for i, d in enumerate(p.layers) if d == remote] == sorted(on_server)
        assert all(p.layers[i].type == "CPU" for i in range(n) if i not in on_server)
        assert p.output == (remote if ngl > n else p.input) and p.input.type == "CPU"
        # the weights: each layer's, and the head's, on its device
        weights = model.report.devices[remote.name].weights
        assert {g for g, b in weights.items() if b} == on_server | ({"output"} if ngl > n else set())
        cpu_groups = {g for g, b in model.report.devices["CPU"].weights.items() if b}
        assert cpu_groups == {"input"} | (set(range(n)) - on_server) | ({"output"} if ngl <= n else set())

        if name == "phi3":
            # the LongRoPE factors every layer reads: a copy on the server, which its layers read
            for f in ("rope_factors_short.weight", "rope_factors_long.weight"):
                copy = f"{f}@{remote.name}"
                assert copy in model.copies and model.fused[copy] == (f,)
                assert not model.weights[copy].is_host and model.weights[f].is_host
                for i in range(n):
                    assert model.layer_weight(f, i) is model.weights[copy if i in on_server else f], i
            assert model.n_params == sum(int(np.prod(t.ne)) for k, (t, _g) in model.weights.tensors.items()
                                         if k not in model.copies)

        def check(rt):
            # no layer reaches back to the input's device: the layers on each side are one split each
            # (phi3's factors on the CPU alone made every remote layer several)
            assert rt.rt.stats["tg"][1] <= 3 and rt.rt.stats["pp"][1] <= 3, rt.rt.stats
            cache = rt.memory_report().devices
            rec = _recurrent_layers(model)
            for kind, layers in (("cache", set(range(n)) - rec), ("state", rec)):
                assert {g for g, b in getattr(cache[remote.name], kind).items() if b} == on_server & layers
                assert {g for g, b in getattr(cache["CPU"], kind).items() if b} == layers - on_server
            for i in range(n):
                assert all(t.is_host == (i not in on_server) for t in _layer_kv(rt.cache, i)), i
            if name.startswith("gemma"):
                # each wrapped cache (window, full) holds layers on both devices
                assert isinstance(rt.cache, Wrapper) and len(rt.cache.caches) == 2
                for c in rt.cache.caches:
                    assert len({t.is_host for t in c.keys}) == 2, c.model_layers
            if name in ("lfm2", "granitehybrid", "qwen3next"):
                # the attention cache and the recurrent one each hold layers on both devices
                kv, rs = rt.cache.caches
                assert isinstance(rs, Recurrent) and len({t.is_host for t in kv.keys}) == 2
                assert len({ts["conv"].is_host for ts in rs.tensors}) == 2

        got = _session(model, flash, check)
    worst = {}
    for step, r in ref.items():
        assert got[step].shape == r.shape and np.isfinite(r).all() and (np.abs(r).max(-1) > 0).all()
        err = np.abs(got[step] - r).max(-1) / np.abs(r).max(-1)
        worst[step] = float(err.max())
    assert max(worst.values()) <= TOL, worst
