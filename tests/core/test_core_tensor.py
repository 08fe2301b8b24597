"""Tensor metadata, the numpy bridge (zero copy both ways), buffer protocol, DLPack, lifetimes and leaks."""

from __future__ import annotations

import gc
import subprocess
import sys

import numpy as np
import pytest

import ggmlpy as gp


def _compute(ctx, t):
    gf = ctx.new_graph()
    gf.build_forward_expand(t)
    gf.compute(1)
    return t


def test_ne_nb_shape_and_repr():
    ctx = gp.Context(1 << 20)
    t = ctx.new_tensor(gp.Type.F32, (4, 3, 2), name="x")
    assert t.ne == (4, 3, 2, 1) and t.nb == (4, 16, 48, 96)
    assert t.shape == (2, 3, 4) and t.n_dims == 3 and t.nelements == 24 and t.nbytes == 96
    assert t.name == "x" and "f32 ne=(4, 3, 2, 1)" in repr(t) and "'x'" in repr(t)
    assert t.type is gp.Type.F32 and t.op is gp.Op.NONE and not t.is_view and t.is_contiguous
    q = ctx.new_tensor(gp.Type.Q8_0, (64, 2))
    assert q.nb[0] == gp.Type.Q8_0.type_size and q.nbytes == 2 * gp.Type.Q8_0.row_size(64)
    with pytest.raises(gp.GGMLValueError, match="block size"):
        ctx.new_tensor(gp.Type.Q8_0, (33,))
    with pytest.raises(gp.GGMLValueError, match="at most 63"):
        t.name = "n" * 64


def test_types_table():
    assert gp.Type.F16.numpy_dtype == np.float16 and gp.Type.Q4_0.numpy_dtype is None
    assert gp.Type.Q4_0.is_quantized and not gp.Type.F32.is_quantized
    assert gp.type_size("q8_0") == 34 and gp.blck_size(gp.Type.Q4_K) == 256
    assert gp.row_size(gp.Type.F16, 10) == 20
    # Removed type ids (blck_size 0 in ggml) are not members.
    assert all(t.block_size > 0 for t in gp.Type)


def test_numpy_is_zero_copy_both_ways():
    ctx = gp.Context(1 << 20)
    t = ctx.from_numpy(np.zeros((2, 3), np.float32))
    view = t.numpy()
    view[1, 2] = 7.0                               # written through numpy ...
    assert t.get()[1, 2] == 7.0                    # ... seen by ggml's memory
    y = _compute(ctx, ctx.scale(t, 2.0))
    assert y.numpy()[1, 2] == 14.0
    t.set(np.ones((2, 3), np.float32))              # written by ggmlpy ...
    assert view[0, 0] == 1.0                       # ... seen by the earlier numpy view
    assert np.shares_memory(view, t.numpy())
    assert t.data_ptr == view.__array_interface__["data"][0]


def test_view_of_view_shares_memory_and_is_strided():
    ctx = gp.Context(1 << 20)
    base = ctx.from_numpy(np.arange(24, dtype=np.float32).reshape(4, 6))
    v = ctx.view(base, (3, 4), (24,), 4)                 # columns 1..3 of every row
    vv = ctx.view(v, (2, 2), (48,), 4)                   # every other row of that, columns 2..3
    np.testing.assert_array_equal(v.numpy(), np.arange(24, dtype=np.float32).reshape(4, 6)[:, 1:4])
    np.testing.assert_array_equal(vv.numpy(), np.arange(24, dtype=np.float32).reshape(4, 6)[::2, 2:4])
    vv.numpy()[1, 1] = -1
    assert base.numpy()[2, 3] == -1
    assert vv.view_src == base and vv.is_view


def test_set_checks_shape_and_dtype():
    ctx = gp.Context(1 << 20)
    t = ctx.new_tensor(gp.Type.F32, (3, 2))
    with pytest.raises(gp.GGMLValueError, match="shape mismatch"):
        t.set(np.zeros((3, 2), np.float32))
    with pytest.raises(gp.GGMLTypeError, match="cannot cast"):
        t.set(np.zeros((2, 3), np.complex64))
    t.set(np.arange(6, dtype=np.float64).reshape(1, 2, 3))   # same_kind cast, leading 1 allowed
    assert t.get().tolist() == [[0, 1, 2], [3, 4, 5]]
    i = ctx.new_tensor(gp.Type.I32, (3,))
    with pytest.raises(gp.GGMLTypeError):
        i.set(np.array([0.5, 1, 2]))


def test_strided_numpy_input_is_gathered():
    ctx = gp.Context(1 << 20)
    src = np.arange(30, dtype=np.float32).reshape(5, 6)[::2, ::3]
    t = ctx.from_numpy(src)
    assert t.is_contiguous and t.nb[1] == 8
    np.testing.assert_array_equal(t.numpy(), src)


def test_quantized_and_bf16_get_set():
    ctx = gp.Context(1 << 20)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    q = ctx.from_numpy(x, gp.Type.Q8_0)
    assert q.numpy().shape == (4, gp.Type.Q8_0.row_size(64)) and q.numpy().dtype == np.uint8
    err = np.abs(q.get() - x).max()
    assert err <= np.abs(x).max() / 127 + 1e-6
    b = ctx.from_numpy(x, gp.Type.BF16)
    np.testing.assert_allclose(b.get(), x, rtol=2 ** -8)
    assert b.numpy().dtype == np.uint16


def test_buffer_protocol_and_dlpack():
    ctx = gp.Context(1 << 20)
    t = ctx.from_numpy(np.arange(6, dtype=np.int32).reshape(2, 3))
    m = memoryview(t)
    assert m.format == "i" and m.shape == (2, 3) and m.strides == (12, 4) and not m.readonly
    d = np.from_dlpack(t)
    assert d.tolist() == [[0, 1, 2], [3, 4, 5]] and np.shares_memory(d, t.numpy())
    tt = ctx.transpose(t)
    dt = np.from_dlpack(tt)
    assert dt.shape == (3, 2) and dt.tolist() == [[0, 3], [1, 4], [2, 5]]
    assert np.asarray(t).tolist() == [[0, 1, 2], [3, 4, 5]]
    del m, d, dt


def test_tensor_keeps_context_alive():
    ctx = gp.Context(1 << 20)
    t = ctx.from_numpy(np.full(4, 3.0, np.float32))
    arr = t.numpy()
    del ctx
    gc.collect()
    assert t.get().tolist() == [3.0] * 4           # the arena is still there
    assert arr.tolist() == [3.0] * 4               # and so is the numpy view's memory
    assert t.context.used_mem > 0


def test_view_in_other_context_keeps_source_context_alive():
    src_ctx = gp.Context(1 << 20)
    a = src_ctx.from_numpy(np.arange(8, dtype=np.float32))
    ctx = gp.Context(1 << 20)
    y = ctx.scale(ctx.view_1d(a, 4, 16), 2.0)
    del src_ctx, a
    gc.collect()
    _compute(ctx, y)
    assert y.get().tolist() == [8.0, 10.0, 12.0, 14.0]


def test_free_makes_tensors_raise():
    ctx = gp.Context(1 << 20)
    t = ctx.from_numpy(np.ones(4, np.float32))
    gf = ctx.new_graph()
    other = gp.Context(1 << 20)
    y = other.scale(t, 2.0)
    gf2 = other.new_graph()
    gf2.build_forward_expand(y)
    ctx.free()
    assert ctx.closed
    for call in (lambda: t.ne, lambda: t.numpy(), lambda: t.get(), lambda: ctx.new_tensor(gp.Type.F32, (1,)),
                 lambda: gf.n_nodes, lambda: other.scale(t, 1.0), lambda: gf2.compute(1)):
        with pytest.raises(gp.ClosedError):
            call()
    assert "freed" in repr(t) and "freed" in repr(ctx)
    with gp.Context(1 << 20) as c2:
        t2 = c2.new_tensor(gp.Type.F32, (2,))
    with pytest.raises(gp.ClosedError):
        t2.set(np.zeros(2, np.float32))


def test_reset_invalidates_old_tensors():
    ctx = gp.Context(1 << 20)
    t = ctx.new_tensor(gp.Type.F32, (2,))
    used = ctx.used_mem
    ctx.reset()
    assert ctx.used_mem == 0 < used
    with pytest.raises(gp.ClosedError):
        _ = t.ne


def test_context_out_of_memory_is_memoryerror_and_recoverable():
    with pytest.raises(MemoryError):
        gp.Context(1 << 60)                           # the arena itself
    ctx = gp.Context(4096)
    a = ctx.new_tensor(gp.Type.F32, (16,))
    with pytest.raises(gp.GGMLMemoryError, match="new_tensor: context out of memory"):
        ctx.new_tensor(gp.Type.F32, (100000,))
    with pytest.raises(gp.GGMLMemoryError, match="new_graph"):
        ctx.new_graph(4096)
    a.set(np.ones(16, np.float32))                    # nothing lost
    assert a.get().sum() == 16.0


LEAK_SCRIPT = r"""
import gc, resource, sys
import numpy as np
import ggmlpy as gp
from ggmlpy import _core

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

x = np.ones(64, np.float32)
def once():
    ctx = gp.Context(1 << 16)
    a = ctx.from_numpy(x); b = ctx.from_numpy(x)
    c = ctx.mul(ctx.add(a, b), b)
    gf = ctx.new_graph(16)
    gf.build_forward_expand(c)
    gf.compute(1)
    _ = c.numpy().sum()

for _ in range(1000):
    once()
gc.collect()
start = rss_mb()
for _ in range(10000):
    once()
gc.collect()
end = rss_mb()
print(start, end, _core._live_objects())
assert set(_core._live_objects().values()) == {0}, _core._live_objects()
assert end - start < 4.0, (start, end)
"""


def test_no_leaks_over_10000_contexts():
    out = subprocess.run([sys.executable, "-c", LEAK_SCRIPT], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr


def test_free_with_live_numpy_view_defers_the_release():
    ctx = gp.Context(1 << 20)
    t = ctx.from_numpy(np.arange(4, dtype=np.float32))
    arr = t.numpy()
    cap = np.from_dlpack(t)
    ctx.free()
    with pytest.raises(gp.ClosedError):
        t.numpy()
    # The exported memory is still the tensor's, not freed memory.
    assert arr.tolist() == [0.0, 1.0, 2.0, 3.0] and cap.tolist() == arr.tolist()
    arr[0] = 5.0
    del arr, cap
    gc.collect()


def test_reset_refuses_while_views_are_alive():
    ctx = gp.Context(1 << 20)
    t = ctx.from_numpy(np.ones(4, np.float32))
    arr = t.numpy()
    with pytest.raises(gp.GGMLValueError, match="reset"):
        ctx.reset()
    del arr
    ctx.reset()
    assert ctx.n_tensors == 0


def test_set_fast_path_matches_slow_path():
    ctx = gp.Context(1 << 20)
    t = ctx.new_tensor(gp.Type.F32, (3, 2, 2))
    src = np.arange(12, dtype=np.float32).reshape(2, 2, 3)
    t.set(src)                                      # fast path
    assert t.get().tolist() == src.tolist()
    t.set(src[None])                                # leading 1 axis, still fast
    t.set(np.asfortranarray(src) + 1)               # strided: slow path, same values
    assert t.get().tolist() == (src + 1).tolist()
    with pytest.raises(gp.GGMLValueError):
        t.set(src.reshape(2, 3, 2))                 # same size, wrong shape
    with pytest.raises(gp.GGMLValueError):
        t.set(src.astype(">f4").reshape(3, 4))      # wrong shape via the slow path
    t.set(src.astype(">f4"))                        # big-endian: converted, not memcpy'd
    assert t.get().tolist() == src.tolist()


def test_set_integers_by_width():
    # numpy's int64 buffer says 'l' on LP64 where ggml's I64 is 'q': the same integers, one memcpy;
    # other widths and unsigned input are converted, never reinterpreted
    ctx = gp.Context(1 << 20)
    t64 = ctx.new_tensor(gp.Type.I64, (3,))
    t32 = ctx.new_tensor(gp.Type.I32, (3,))
    big = np.array([2**40 + 1, -5, 7], np.int64)
    t64.set(big)
    assert t64.get().tolist() == big.tolist()
    t64.set(np.array([1, -2, 3], np.int32))                # widened
    assert t64.get().tolist() == [1, -2, 3]
    t64.set(np.array([1, 2, 3], dtype="q"))
    assert t64.get().tolist() == [1, 2, 3]
    t32.set(np.array([4, -5, 6], np.int64))                # narrowed by value, not by bytes
    assert t32.get().tolist() == [4, -5, 6]
    t32.set(np.array([7, 8, 9], np.uint16))
    assert t32.get().tolist() == [7, 8, 9]


def test_invalidated_context_does_not_hand_out_old_tensors():
    src = gp.Context(1 << 20)
    a = src.from_numpy(np.ones(4, np.float32))
    ctx = gp.Context(1 << 20)
    y = ctx.scale(a, 2.0).set_name("y")
    assert ctx.get_tensor("y") == y and len(ctx.tensors()) == 1
    src.reset()                                   # y's input memory is reused now
    with pytest.raises(gp.ClosedError):
        _ = y.ne
    assert ctx.tensors() == [] and ctx.get_tensor("y") is None
    z = ctx.from_numpy(np.arange(3, dtype=np.float32), name="z")     # the context itself still works
    assert ctx.tensors() == [z] and z.get().tolist() == [0.0, 1.0, 2.0]
