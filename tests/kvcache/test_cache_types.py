"""K and V cache types chosen independently (llama-bench's ``-ctk``/``-ctv``).

Every pair ggml's attention supports runs: with flash attention any K type with any V type (ggml's CPU
``flash_attn_ext`` reads K through its own dot product and V through its own to-float conversion); without
it any K type (``mul_mat`` reads a quantized K) with V F32/F16/BF16 (V is stored transposed, which a
quantized row cannot be). The pairs that cannot run are refused before anything is allocated.

Correctness: logits of a 12-token prompt and 8 one-token steps against the same model with an F32 cache,
as max |error| / max |logit|. The bound of a pair is the sum of a K bound and a V bound, each about 3x the
error measured with that type alone (head size 32, F32 weights):

=========  =============  ==============
type       K (V is F32)   V (K is F32)
=========  =============  ==============
f16        1.0e-5         6.3e-4
bf16       8.4e-5         1.8e-3
q8_0       2.4e-4         4.6e-3
q5_0/q5_1  1.3e-3         4.3e-2
q4_0/q4_1  3.3e-3         1.1e-1
iq4_nl     2.7e-3         1.0e-1
=========  =============  ==============

V errors are larger because they reach the output linearly, while K errors pass through the softmax.
Pairs whose two types are at least as precise as q8_0 must also give the same top-1 token everywhere. And
the two attention paths, which share nothing but the stored cache, must read a quantized K identically
(F32 V: measured 2e-7, bound 1e-5).
"""

from __future__ import annotations

import numpy as np
import pytest
from hf_helpers import export_gguf, hf_model
from kv_helpers import _expand_put

import ggmlpy as gp
from ggmlpy import GGMLValueError, Type
from ggmlpy.kvcache import Causal
from ggmlpy.models import load_model
from ggmlpy.runner import Runner

PROMPT = [5, 17, 250, 3, 99, 42, 7, 300, 128, 64, 11, 200]
STEPS = [31, 8, 77, 150, 2, 19, 260, 4]

K_TOL = {"f32": 1e-6, "f16": 5e-5, "bf16": 3e-4, "q8_0": 1e-3, "q5_0": 5e-3, "q5_1": 5e-3,
         "q4_0": 1e-2, "q4_1": 1e-2, "iq4_nl": 1e-2}
V_TOL = {"f32": 1e-6, "f16": 2e-3, "bf16": 6e-3, "q8_0": 1.5e-2, "q5_0": 0.12, "q5_1": 0.12,
         "q4_0": 0.3, "q4_1": 0.3, "iq4_nl": 0.3}
TOP1 = ("f32", "f16", "bf16", "q8_0")
TYPES = tuple(K_TOL)
QUANT = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl")


def rel_err(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    pytest.importorskip("transformers")
    # head size 128 / 4 = 32: one block of every quantized cache type per head
    hf = hf_model("llama", hidden=128, heads=4, kv_heads=2, ff=256, seed=12)
    path = export_gguf(hf, tmp_path_factory.mktemp("ct") / "m.gguf", "llama")
    m = load_model(path, devices="cpu")
    yield m
    m.close()


def run(model, type_k, type_v, flash_attn):
    with Runner(model, n_ctx=64, type_k=type_k, type_v=type_v, flash_attn=flash_attn) as rt:
        k, v = rt.cache.keys[0], rt.cache.values[0]
        assert (k.type, v.type) == (Type[type_k.upper()], Type[type_v.upper()])
        assert (rt.type_k, rt.type_v) == (type_k, type_v)
        assert rt.cache.bytes_per_layer() == (Type[type_k.upper()].row_size(64)
                                              + Type[type_v.upper()].row_size(64)) * rt.cache.n_cells
        first = rt.decode(PROMPT, logits="all")
        return np.concatenate([first] + [rt.decode([t]) for t in STEPS])


@pytest.fixture(scope="module")
def reference(model):
    return run(model, "f32", "f32", True)


PAIRS_FA = ([(t, "f16") for t in TYPES if t != "f16"] + [("f16", t) for t in TYPES]
            + [("q8_0", "q4_0"), ("q4_0", "q8_0"), ("iq4_nl", "q5_1"), ("bf16", "q4_1"), ("q5_0", "bf16")])
PAIRS_NO_FA = [(t, "f16") for t in TYPES] + [("q8_0", "f32"), ("q4_0", "bf16"), ("f16", "f32")]


@pytest.mark.parametrize("flash_attn, type_k, type_v",
                         [(True, k, v) for k, v in PAIRS_FA] + [(False, k, v) for k, v in PAIRS_NO_FA])
def test_pair_tracks_the_f32_cache(model, reference, flash_attn, type_k, type_v):
    got = run(model, type_k, type_v, flash_attn)
    err = rel_err(got, reference)
    assert err < K_TOL[type_k] + V_TOL[type_v], err
    if type_k in TOP1 and type_v in TOP1:
        np.testing.assert_array_equal(got.argmax(-1), reference.argmax(-1))


@pytest.mark.parametrize("type_k", QUANT + ("bf16",))
def test_both_attention_paths_read_a_quantized_k_alike(model, type_k):
    fa = run(model, type_k, "f32", True)
    mm = run(model, type_k, "f32", False)
    assert rel_err(mm, fa) < 1e-5, rel_err(mm, fa)


def test_errors_follow_each_types_own_precision(model, reference):
    """A q4_0 V costs far more than a q4_0 K: K and V really are stored in their own types."""
    k_only = rel_err(run(model, "q4_0", "f32", True), reference)
    v_only = rel_err(run(model, "f32", "q4_0", True), reference)
    assert k_only < K_TOL["q4_0"] < 3e-2 < v_only < V_TOL["q4_0"]


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize("type_v", QUANT)
def test_quantized_v_without_flash_attention_is_refused(model, type_v):
    with pytest.raises(GGMLValueError, match=f"a {type_v} V cache needs flash attention"):
        Runner(model, n_ctx=16, type_k="f16", type_v=type_v, flash_attn=False)
    with pytest.raises(GGMLValueError, match="needs flash attention"):
        Runner.check_cache_types("f16", type_v, False)
    # auto (None) resolves to flash attention
    assert Runner.check_cache_types("f16", type_v, None) == (Type.F16, Type[type_v.upper()], True)


def test_check_cache_types_accepts_what_runs():
    assert Runner.check_cache_types("Q8_0", "f16", False) == (Type.Q8_0, Type.F16, False)
    assert Runner.check_cache_types("bf16", "bf16", False) == (Type.BF16, Type.BF16, False)
    for bad in ("q3_k", "f64", "", "q8"):
        with pytest.raises(GGMLValueError, match="not a cache type"):
            Runner.check_cache_types(bad, "f16")
        with pytest.raises(GGMLValueError, match="type_v"):
            Runner.check_cache_types("f16", bad)


def test_head_size_not_a_block_multiple_is_refused(tmp_path):
    from ggmlpy.models.synthetic import write_synthetic

    path = write_synthetic(tmp_path / "tiny.gguf", "tiny")          # head size 16 < a block of 32
    with load_model(path, devices="cpu") as m:
        with pytest.raises(GGMLValueError, match="V head dim 16 must be a multiple of the Q8_0 block size 32"):
            Runner(m, n_ctx=16, type_k="f16", type_v="q8_0")
        with pytest.raises(GGMLValueError, match="K head dim 16 .* Q4_0"):
            Runner(m, n_ctx=16, type_k="q4_0", type_v="f16")
        with Runner(m, n_ctx=16, type_k="f32", type_v="bf16", flash_attn=False) as rt:   # plain types run
            assert rt.decode([1, 2, 3]).shape == (1, m.n_vocab)


def test_cache_refuses_a_quantized_transposed_v():
    with pytest.raises(GGMLValueError, match="Q4_0 .* cannot be stored transposed"):
        Causal(1, 64, 64, Type.Q8_0, dtype_v=Type.Q4_0, v_trans=True)
    c = Causal(1, 64, 64, Type.Q8_0, dtype_v=Type.F16, v_trans=True)    # a quantized K is fine
    assert (c.dtype_k, c.dtype_v) == (Type.Q8_0, Type.F16) and "Q8_0/F16" in repr(c)


# ---------------------------------------------------------------- the cache itself


@pytest.mark.parametrize("v_trans", [False, True])
def test_mixed_storage_and_defrag(v_trans):
    """K rows are stored as q8_0 blocks and V as f16 (transposed or not); defrag moves both."""
    rng = np.random.default_rng(3)
    head_dim, n_head_kv = 32, 2
    c = Causal(1, head_dim * n_head_kv, head_dim * n_head_kv, Type.Q8_0, dtype_v=Type.F16, n_head_kv=n_head_kv,
               v_trans=v_trans)
    c.init(8, 2, 8)
    k = rng.standard_normal((4, n_head_kv, head_dim)).astype(np.float32)
    v = rng.standard_normal((4, n_head_kv, head_dim)).astype(np.float32)
    plan = c.start_forward([0, 0, 1, 1], [0, 1, 0, 1])
    with gp.Context(1 << 20) as ctx:
        gf = ctx.new_graph(64)
        _expand_put(ctx, gf, c, 0, plan, k, v)
        gf.compute(1)
    c.apply(plan)

    def stored():
        keys = c.keys[0].get()                      # dequantized
        vals = c.values[0].get().astype(np.float32)
        return keys, (vals.T if v_trans else vals)

    keys, vals = stored()
    rows_k, rows_v = k.reshape(4, 64), v.reshape(4, 64)
    # q8_0: at most one step (amax/127 of the 32-block) off; f16: exactly the rounded values
    step = np.abs(rows_k).reshape(4, 2, 32).max(-1, keepdims=True) / 127
    assert (np.abs(keys[plan.cell_ids] - rows_k).reshape(4, 2, 32) <= step).all()
    np.testing.assert_array_equal(vals[plan.cell_ids], rows_v.astype(np.float16).astype(np.float32))
    seq1 = plan.cell_ids[[1, 3]]                       # sequence 1's cells, positions 0 and 1
    before_k, before_v = keys[seq1], vals[seq1]
    c.clear(0)                                      # holes where sequence 0 was
    moves = c.defrag()
    assert moves and c.fragmentation() == 0.0
    keys, vals = stored()
    live = np.flatnonzero(c.cells.seqs[:, 1])
    live = live[np.argsort(c.cells.pos[live])]      # by position again
    assert sorted(live) == [0, 1] and list(live) != list(seq1)
    np.testing.assert_array_equal(keys[live], before_k)
    np.testing.assert_array_equal(vals[live], before_v)


@pytest.mark.parametrize("type_k, type_v, flash_attn", [("q8_0", "f16", True), ("q8_0", "f16", False),
                                                        ("q4_0", "f32", True), ("bf16", "q8_0", True)])
def test_context_shift_rotates_a_mixed_cache(tmp_path, type_k, type_v, flash_attn):
    """remove() re-rotates a quantized/BF16 K (through F32) and leaves V alone: one layer, so a shift equals
    a run from scratch on the kept tokens up to the re-quantization of K (measured 6e-4 for q8_0, 2.1e-3 for
    q4_0; without the rotation 2.1e-2)."""
    pytest.importorskip("transformers")
    hf = hf_model("llama", layers=1, hidden=128, heads=4, kv_heads=2, ff=256, seed=7)
    path = export_gguf(hf, tmp_path / "m.gguf", "llama")
    toks = (PROMPT * 3)[:30]
    keep, discard = 4, 10
    with load_model(path, devices="cpu") as m, \
            Runner(m, n_ctx=32, type_k=type_k, type_v=type_v, flash_attn=flash_attn) as rt:
        rt.decode(toks)
        rt.cache.remove(0, keep, keep + discard)
        shifted = rt.decode([9, 10], logits="all")
        rt.clear()
        scratch = rt.decode(toks[:keep] + toks[keep + discard:] + [9, 10], logits="all")[-2:]
    assert rel_err(shifted, scratch) < 6e-3, rel_err(shifted, scratch)
