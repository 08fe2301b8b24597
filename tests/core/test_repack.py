"""Weights in the CPU's extra buffer types (CPU_REPACK, AMX...): which weights go there, that products over
them equal the plain ones, that a model loads and runs the same with and without, and that everything
ggml cannot do with such a tensor (read it back, write part of it, use it in another op) is an error."""

from __future__ import annotations

import numpy as np
import pytest

import ggmlpy as gp
from ggmlpy import _core
from ggmlpy import backend as bk
from ggmlpy import weights as wt
from ggmlpy.models import load_model
from ggmlpy.models.synthetic import write_synthetic
from ggmlpy.runner import Runner

CPU = gp.device("cpu")
EXTRA = {bt.name: bt for bt in CPU.extra_buffer_types()}
AVX2 = "AVX2" in _core._cpu_features()
# ggml's repack kernels for Q4_0/Q4_K/IQ4_NL need AVX2 on x86 (NEON dot products on ARM)
needs_repack = pytest.mark.skipif("CPU_REPACK" not in EXTRA, reason="this build/CPU offers no CPU_REPACK buffer")

#: |repacked - plain| / max|plain| of one product. Both quantize the activations to the same type
#: (Q8_0 for Q4_0/IQ4_NL, Q8_K for Q4_K) and sum the same integer products, so only float rounding differs.
TOL = 2e-5


def test_the_cpu_lists_its_extra_buffer_types():
    for bt in CPU.extra_buffer_types():
        assert not bt.is_host                       # its memory holds rearranged data
        assert bt.device_name == "CPU"
        assert CPU.supports_buft(bt)
    if AVX2 and _core._ggml_version()[0].startswith("0.25"):
        assert "CPU_REPACK" in EXTRA                 # ggml 0.25 builds it in on every x86 with AVX2


def _probe(type, ne, batch=512):
    ctx = gp.Context.for_tensors(4, no_alloc=True)
    w = ctx.new_tensor(type, ne)
    return ctx, ctx.mul_mat(w, ctx.new_tensor("F32", (ne[0], batch)))


@needs_repack
def test_supports_weight_follows_the_kernels_ggml_has():
    rp = EXTRA["CPU_REPACK"]
    for type, ne, want in [("Q4_0", (256, 64), AVX2), ("IQ4_NL", (256, 64), AVX2), ("Q4_K", (256, 64), AVX2),
                           ("Q4_0", (256, 12), False),        # rows are interleaved 8 at a time
                           ("F32", (256, 64), False), ("F16", (256, 64), False)]:
        _ctx, op = _probe(type, ne)
        assert CPU.supports_weight(rp, op) is want, (type, ne)
    # the question leaves the weight as it was: still without memory
    _ctx, op = _probe("Q4_0", (256, 64))
    CPU.supports_weight(rp, op)
    assert op.src[0].buffer_type is None and not op.src[0].has_data


@needs_repack
def test_supports_weight_refuses_what_it_cannot_ask():
    ctx = gp.Context.for_tensors(4, 4096)             # allocated: the weight has memory already
    w, x = ctx.new_tensor("Q4_0", (64, 8)), ctx.new_tensor("F32", (64, 2))
    with pytest.raises(gp.GGMLValueError, match="supports_weight.*without memory"):
        CPU.supports_weight(EXTRA["CPU_REPACK"], ctx.mul_mat(w, x))
    with pytest.raises(gp.GGMLValueError, match="no first source"):
        CPU.supports_weight(EXTRA["CPU_REPACK"], ctx.new_tensor("F32", (4,)))


def _weight(type, W, buft):
    ctx = gp.Context.for_tensors(2, no_alloc=True)
    w = ctx.new_tensor(type, W.shape[::-1], name="w")
    buf = _core.alloc_ctx_tensors(ctx, buft)
    w.set(W)
    return ctx, buf, w


def _matmul(w, X, backend):
    g = gp.Context.for_tensors(8, graph_size=16, no_alloc=True)
    x = g.new_tensor("F32", X.shape[::-1], name="x")
    x.set_input()
    y = g.mul_mat(w, x)
    graph = g.new_graph(16)
    graph.build_forward_expand(y)
    ga = gp.Gallocr(CPU.buffer_type())
    ga.alloc_graph(graph)
    x.set(X)
    backend.graph_compute(graph)
    return y.get()


@needs_repack
@pytest.mark.parametrize("type", ["Q4_0", "IQ4_NL", "Q4_K"])
def test_repacked_products_equal_plain_ones(type):
    if not AVX2:
        pytest.skip("x86 repack kernels need AVX2")
    rng = np.random.default_rng(1)
    W = rng.standard_normal((64, 512)).astype(np.float32)
    be = CPU.init()
    keep = []
    for n_threads in (1, 2):
        be.set_n_threads(n_threads)
        for batch in (1, 3, 4, 7, 16, 33):          # gemv, the gemm tiles and their remainders
            X = rng.standard_normal((batch, 512)).astype(np.float32)
            got = {}
            for buft in (EXTRA["CPU_REPACK"], CPU.buffer_type()):
                ctx, buf, w = _weight(type, W, buft)
                keep.append((ctx, buf))
                assert w.is_repacked == (buft.name == "CPU_REPACK")
                got[buft.name] = _matmul(w, X, be)
            plain = got["CPU"]
            err = np.abs(got["CPU_REPACK"] - plain).max() / np.abs(plain).max()
            assert err < TOL, (type, batch, n_threads, err)
            # and both are the product of the quantized weight (relative to numpy's, for scale)
            Wq = _core.dequantize(_core.quantize(W, gp.Type[type]), gp.Type[type], 512).reshape(W.shape)
            assert np.abs(plain - X @ Wq.T).max() / np.abs(plain).max() < 0.02


@needs_repack
def test_a_repacked_weight_is_written_whole_and_never_read():
    rng = np.random.default_rng(2)
    W = rng.standard_normal((16, 64)).astype(np.float32)
    ctx, buf, w = _weight("Q4_0", W, EXTRA["CPU_REPACK"])
    assert w.buffer_type == "CPU_REPACK" and w.is_repacked and not w.is_host
    for read in (w.get, lambda: w.numpy(copy=True), lambda: np.asarray(w)):
        with pytest.raises(gp.GGMLValueError):
            read()
    raw = _core.quantize(W, gp.Type.Q4_0)
    with pytest.raises(gp.GGMLValueError, match="whole.*got 18 bytes at offset 0"):
        w.set_bytes(raw[:18])
    with pytest.raises(gp.GGMLValueError, match="whole"):
        w.set_bytes(raw[18:], 18)
    # the whole tensor in one call works, and computes what the plain weight computes
    w.set_bytes(raw)
    X = rng.standard_normal((5, 64)).astype(np.float32)
    ctx2, buf2, plain = _weight("Q4_0", W, CPU.buffer_type())
    be = CPU.init()
    np.testing.assert_allclose(_matmul(w, X, be), _matmul(plain, X, be), rtol=0, atol=1e-4)
    # a view of it cannot be written (ggml would repack the view's bytes as a tensor of their own)
    v = ctx.view_2d(w, 64, 8, w.nb[1], 0) if hasattr(ctx, "view_2d") else None
    if v is not None:
        with pytest.raises(gp.GGMLValueError, match="view"):
            v.set(W[:8])


@needs_repack
def test_a_tensor_repack_has_no_kernel_for_is_refused_on_write():
    # ggml leaves such a tensor without repack traits and its write would jump through a null pointer
    ctx = gp.Context.for_tensors(2, no_alloc=True)
    t = ctx.new_tensor("F32", (64, 8), name="f")
    _buf = _core.alloc_ctx_tensors(ctx, EXTRA["CPU_REPACK"])
    with pytest.raises(gp.GGMLValueError, match="CPU_REPACK has no kernels for f32"):
        t.set(np.zeros((8, 64), np.float32))


@needs_repack
def test_other_ops_on_a_repacked_weight_are_refused():
    ctx, buf, w = _weight("Q4_0", np.ones((16, 64), np.float32), EXTRA["CPU_REPACK"])
    g = gp.Context.for_tensors(8, graph_size=16, no_alloc=True)
    idx = g.new_tensor("I32", (2,), name="idx")
    idx.set_input()
    rows = g.get_rows(w, idx)
    graph = g.new_graph(16)
    graph.build_forward_expand(rows)
    gp.Gallocr(CPU.buffer_type()).alloc_graph(graph)
    with pytest.raises(gp.GGMLValueError, match="get_rows"):
        CPU.init().graph_compute(graph)
    sched = gp.Scheduler([CPU.init()], graph_size=64)
    with pytest.raises(gp.GGMLValueError, match="get_rows"):
        sched.compute(graph)


# ------------------------------------------------------------------ placement of a model's weights

def _weights(repack, types=("Q4_0", "Q8_0", "F16")):
    placement = bk.split_layers(1, bk.choose_devices("cpu"))
    w = bk.Weights(placement, max_tensors=16, repack=repack)
    for i, t in enumerate(types):
        w.add(f"m{i}", t, (256, 64), 0, op="mul_mat")
    w.add("emb", "Q4_0", (256, 64), "input")                 # read by get_rows: never repacked
    w.add("norm", "F32", (256,), 0)
    return w


def test_weights_go_to_the_extra_buffer_types_that_support_them():
    w = _weights(repack=True)
    w.allocate()
    try:
        where = {name: t.buffer_type for name, (t, _g) in w.tensors.items()}
        want_repack = "CPU_REPACK" in EXTRA and AVX2
        assert where["m0"] == ("CPU_REPACK" if want_repack else "CPU")
        assert where["m1"] in ("CPU",) + tuple(n for n in EXTRA if n != "AMX")     # Q8_0: never AMX
        assert where["m2"] == "CPU" or where["m2"] in EXTRA
        if set(EXTRA) <= {"CPU_REPACK"} and __import__("platform").machine() in ("x86_64", "AMD64"):
            # x86 has no CPU_REPACK kernel for Q8_0 or F16 (ARM has one for Q8_0)
            assert where["m1"] == "CPU" and where["m2"] == "CPU"
        assert where["emb"] == "CPU" and where["norm"] == "CPU"
        sizes = w.buffer_sizes()["CPU"]
        m = w.report.devices["CPU"]
        assert m.weight_buffers == sizes and sum(sizes.values()) == m.weights_total
        assert sum(b.size for b in w.buffers.values()) == m.weights_total
        assert m.to_dict()["weight_buffers"] == sizes
    finally:
        w.close()


def test_repack_false_keeps_every_weight_in_plain_memory():
    w = _weights(repack=False)
    w.allocate()
    try:
        assert {t.buffer_type for t, _g in w.tensors.values()} == {"CPU"}
        assert list(w.buffer_sizes()["CPU"]) == ["CPU"]
        assert not any(t.is_repacked for t, _g in w.tensors.values())
    finally:
        w.close()


@needs_repack
def test_known_bad_pairs_stay_on_plain_memory(monkeypatch):
    # The Sapphire Rapids AMX + Q8_0 crash cannot be reproduced on every CPU; the guard that keeps it
    # away is the same for any pair, so prove it with the pair this CPU does repack.
    assert ("AMX", "Q8_0") in bk.KNOWN_BAD_WEIGHT_BUFFERS            # still importable from backend
    monkeypatch.setattr(wt, "KNOWN_BAD_WEIGHT_BUFFERS", wt.KNOWN_BAD_WEIGHT_BUFFERS | {("CPU_REPACK", "Q4_0")})
    w = _weights(repack=True, types=("Q4_0",))
    w.allocate()
    try:
        assert w["m0"].buffer_type == "CPU"
    finally:
        w.close()


def test_q8_0_is_never_placed_on_amx():
    # on an AMX CPU this is the guard for upstream llama.cpp #20824; elsewhere AMX is simply absent
    w = _weights(repack=True, types=("Q8_0", "Q8_0"))
    w.allocate()
    try:
        assert all(t.buffer_type != "AMX" for t, _g in w.tensors.values())
    finally:
        w.close()


def test_expert_stacks_go_where_mul_mat_id_has_kernels():
    w = _weights(repack=True, types=())
    w.add("exps_q4", "Q4_0", (256, 64, 4), 0, op="mul_mat_id")
    w.add("exps_f16", "F16", (256, 64, 4), 0, op="mul_mat_id")
    w.add("flat", "Q4_0", (256, 64), 0, op="mul_mat_id")        # not a stack: mul_mat_id cannot read it
    w.add("stack", "Q4_0", (256, 64, 4), 0, op="mul_mat")       # a matrix product reads 2-d weights only
    try:
        w.allocate()
        want = "CPU_REPACK" if "CPU_REPACK" in EXTRA and AVX2 else "CPU"
        assert w["exps_q4"].buffer_type == want
        assert w.where("Q4_0", (256, 64, 4), 0, "mul_mat_id") == ("CPU", want)       # what add would choose
        assert w.where("Q4_0", (256, 64, 4), 0) == ("CPU", "CPU")
        if set(EXTRA) <= {"CPU_REPACK"}:
            assert w["exps_f16"].buffer_type == "CPU"
        assert w["flat"].buffer_type == "CPU" and w["stack"].buffer_type == "CPU"
    finally:
        w.close()


def test_weights_add_refuses_an_unknown_op():
    w = _weights(repack=True, types=())
    with pytest.raises(gp.GGMLValueError, match="op must be"):
        w.add("x", "Q4_0", (256, 64), 0, op="get_rows")
    w.close()


# ------------------------------------------------------------------ a whole model

@pytest.fixture(scope="module")
def q4_model_path(tmp_path_factory):
    return write_synthetic(tmp_path_factory.mktemp("repack") / "tiny-q4_0.gguf", "tiny", "Q4_0", seed=3)


@needs_repack
def test_a_repacked_model_computes_the_plain_models_logits(q4_model_path):
    prompt = [1, 17, 250, 3, 99, 42, 7, 300, 128, 64, 11, 200, 5]
    out = {}
    for repack in (True, False):
        with load_model(q4_model_path, repack=repack, devices="cpu") as model, \
                Runner(model, n_ctx=64, n_batch=8, n_ubatch=8) as rt:
            kinds = model.weights.buffer_sizes()["CPU"]
            assert ("CPU_REPACK" in kinds) == (repack and AVX2)
            if repack and AVX2:
                assert model.weights["blk.0.ffn_gate_up.weight"].is_repacked
                assert not model.weights["token_embd.weight"].is_repacked
            logits = rt.decode(prompt, logits="all")          # two micro-batches of 8 and 5
            step = rt.decode([9], logits="last")              # one-token decode: the gemv path
            out[repack] = np.concatenate([logits, step])
    a, b = out[True], out[False]
    assert np.abs(a - b).max() / np.abs(b).max() < 1e-4
    assert (a.argmax(-1) == b.argmax(-1)).all()


@needs_repack
@pytest.mark.parametrize("arch", ["qwen3moe", "gemma3"])
def test_repacked_experts_and_tied_head_compute_the_plain_logits(arch, tmp_path):
    """qwen3moe: the expert stacks are repacked for mul_mat_id. gemma3 (tied embeddings): the head gets a
    repacked copy of token_embd while the lookup keeps the plain one; the file's size and parameter
    count do not change. Logits as the plain model's, over a prompt and one-token steps."""
    path = write_synthetic(tmp_path / f"{arch}.gguf", "tiny", "Q4_0", seed=5, arch=arch)
    prompt = [1, 17, 250, 3, 99, 42, 7, 300, 128, 64, 11, 200, 5]
    out, sizes = {}, {}
    for repack in (True, False):
        with load_model(path, repack=repack, devices="cpu") as model, \
                Runner(model, n_ctx=64, n_batch=8, n_ubatch=8) as rt:
            on = repack and AVX2
            if arch == "qwen3moe":
                assert model.weights["blk.0.ffn_gate_exps.weight"].is_repacked == on
                assert model.weights["blk.1.ffn_down_exps.weight"].is_repacked == on
            else:
                assert model.tied_output and model.copies == ({"output.weight"} if on else set())
                assert ("output.weight" in model.weights) == on and not model.weights["token_embd.weight"].is_repacked
                if on:
                    assert model.weights["output.weight"].is_repacked
                    # both copies are memory the process holds: the report counts the copy
                    extra = model.weights["output.weight"].nbytes
                    assert model.report.devices["CPU"].weights_total >= model.size + extra
            sizes[repack] = (model.size, model.n_params, model.desc)
            logits = rt.decode(prompt, logits="all")                             # two micro-batches
            steps = [rt.decode([t], logits="last") for t in (9, 33, 2)]          # the gemv path
            out[repack] = np.concatenate([logits] + steps)
    assert sizes[True] == sizes[False]
    a, b = out[True], out[False]
    assert np.abs(a - b).max() / np.abs(b).max() < 1e-4
    assert (a.argmax(-1) == b.argmax(-1)).all()


@pytest.fixture(scope="module")
def q4_k_m_path(tmp_path_factory):
    from ggmlpy.models.synthetic import SyntheticConfig

    # the smallest llama shape whose rows suit K-quants (multiples of 256); 8 layers give Q4_K_M its mix
    cfg = SyntheticConfig("k-test", 256, 8, 4, 2, 512, 512, 2048, "test model")
    return write_synthetic(tmp_path_factory.mktemp("repack") / "k-q4_k_m.gguf", cfg, "Q4_K_M", seed=4)


def test_q4_k_m_is_llama_cpps_mix(q4_k_m_path):
    from ggmlpy import gguf

    r = gguf.GGUFReader(q4_k_m_path)
    types = {t.name: t.type.name for t in r.tensors}
    assert r.metadata["general.file_type"] == 15
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
    # 8 layers: the first and last eighth (0 and 7) and every third in between (3, 6) get more bits
    assert [i for i in range(8) if types[f"blk.{i}.ffn_down.weight"] == "Q6_K"] == [0, 3, 6, 7]
    assert [i for i in range(8) if types[f"blk.{i}.attn_v.weight"] == "Q6_K"] == [0, 3, 6, 7]
    assert {types[f"blk.{i}.{n}.weight"] for i in range(8) for n in ("attn_q", "ffn_up", "ffn_gate")} == {"Q4_K"}
    # rows of 64 or 192 (the tiny shape) fall back as llama.cpp's quantizer does: Q4_K to Q5_0, Q6_K to Q8_0;
    # rows no 32-block divides to F16
    tiny = {t.name: t.type.name for t in gguf.GGUFReader(
        write_synthetic(q4_k_m_path.parent / "tiny.gguf", "tiny", "Q4_K_M")).tensors}
    assert tiny["blk.0.attn_q.weight"] == "Q5_0" and tiny["blk.1.ffn_down.weight"] == "Q8_0"
    assert tiny["output.weight"] == "Q8_0" and tiny["blk.1.ffn_up.weight"] == "Q5_0"
    from ggmlpy.models.synthetic import matrix_type

    assert matrix_type("Q4_K_M", "blk.0.ffn_down.weight", 46, n_cols=10944) == "Q8_0"     # GLM-4.5's dense layer
    assert matrix_type("Q4_K_M", "blk.5.ffn_up.weight", 46, n_cols=4096) == "Q4_K"
    assert matrix_type("Q4_K_M", "blk.5.ffn_up.weight", 46, n_cols=80) == "F16"
    assert matrix_type("Q8_0", "blk.5.ffn_up.weight", 46, n_cols=80) == "F16"


@pytest.fixture(scope="module")
def q4_k_m_2layer_path(tmp_path_factory):
    from ggmlpy.models.synthetic import SyntheticConfig

    # 2 layers: layer 0 all Q4_K (repacked), layer 1 with Q6_K attn_v/ffn_down (no x86 kernel: plain memory)
    cfg = SyntheticConfig("k-test-2", 256, 2, 4, 2, 512, 512, 2048, "test model")
    return write_synthetic(tmp_path_factory.mktemp("repack") / "k2-q4_k_m.gguf", cfg, "Q4_K_M", seed=4)


@needs_repack
def test_a_repacked_q4_k_m_model_computes_the_plain_models_logits(q4_k_m_2layer_path):
    prompt = [1, 17, 250, 3, 99, 42, 7, 300, 128, 64, 11]
    out = {}
    for repack in (True, False):
        for fa in (False, True):
            with load_model(q4_k_m_2layer_path, repack=repack, devices="cpu") as model, \
                    Runner(model, n_ctx=64, flash_attn=fa) as rt:
                assert model.desc.endswith("Q4_K - Medium")
                # layer 1's attn_v is Q6_K: its Q, K and V stay apart, gate and up (Q4_K) still fuse
                assert set(model.fused) == {"blk.0.attn_qkv.weight", "blk.0.ffn_gate_up.weight",
                                            "blk.1.ffn_gate_up.weight"}
                assert "blk.1.attn_q.weight" in model.weights and "blk.1.attn_qkv.weight" not in model.weights
                if repack and AVX2:
                    assert model.weights["blk.0.ffn_down.weight"].is_repacked          # Q4_K
                    assert model.weights["blk.0.attn_qkv.weight"].is_repacked          # fused Q4_K
                    assert not model.weights["blk.1.ffn_down.weight"].is_repacked      # Q6_K: no x86 kernel
                out[repack, fa] = np.concatenate([rt.decode(prompt, logits="all"), rt.decode([9])])

    def err(a, b):
        return np.abs(a - b).max() / np.abs(b).max()

    # F32 attention: the repacked kernels only sum in another order than the plain ones
    ref = out[False, False]
    assert err(out[True, False], ref) < 2e-4
    # Flash attention accumulates V in F16 on the CPU, which turns those ulps into visible differences
    # on random weights (and is itself about 1% off here): repacking must not add to that error.
    fa_plain, fa_repack = err(out[False, True], ref), err(out[True, True], ref)
    assert fa_plain < 0.05 and fa_repack < 1.5 * fa_plain + 1e-4


@needs_repack
def test_check_tensors_finds_a_nan_in_a_repacked_weight(tmp_path):
    # a repacked weight is read whole and checked in row-aligned pieces: the row named must be the file's
    from ggmlpy import gguf

    path = write_synthetic(tmp_path / "nan.gguf", "tiny", "Q4_0", seed=5)
    info = gguf.GGUFReader(path).tensor_info("blk.1.ffn_up.weight")
    row = gp.Type.Q4_0.row_size(info.ne[0])
    with open(path, "r+b") as f:
        f.seek(info.offset + 150 * row)            # the first block's F16 scale of row 150
        f.write(b"\x00\x7e")
    with load_model(path, repack=True, devices="cpu") as m:       # a sample of rows is all that is checked by default
        assert m.weights["blk.1.ffn_gate_up.weight"].is_repacked == AVX2     # ffn_up is fused with ffn_gate
    with pytest.raises(gp.GGMLError, match=r"'blk.1.ffn_up.weight' \(Q4_0\) holds non-finite values .* row 150"):
        load_model(path, repack=True, check_tensors=True, devices="cpu")


def test_amx_verdict_from_the_environment(monkeypatch):
    # GGMLPY_AMX decides without a check (children inherit the parent's verdict); "0" keeps every weight
    # off AMX on a CPU that offers it
    for value, want in (("0", False), ("1", True)):
        monkeypatch.setattr(wt, "_amx_ok", None)
        monkeypatch.setenv("GGMLPY_AMX", value)
        assert bk.amx_usable() is want
    monkeypatch.setattr(wt, "_amx_ok", None)
    monkeypatch.setenv("GGMLPY_AMX", "0")
    w = _weights(repack=True, types=("Q4_0", "Q4_0"))
    w.allocate()
    try:
        assert all(t.buffer_type != "AMX" for t, _g in w.tensors.values())
    finally:
        w.close()


def test_a_q4_0_model_computes_wherever_ggml_offers_amx(tmp_path):
    # Some virtual machines report AMX yet fault (SIGILL) on tile instructions inside ggml's kernels: the
    # first model that could use AMX checks them in a child, so a plain load-and-decode never dies.
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "GGMLPY_AMX"}
    r = subprocess.run([sys.executable, "-c", wt._AMX_CHECK.replace("sys.exit(3)", "pass")], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
