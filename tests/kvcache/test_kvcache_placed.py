"""Causal cache placed on devices through backend.Placement: memory report, data, device limits."""

from __future__ import annotations

import numpy as np
import pytest
from test_core_backend import rpc_server  # noqa: F401  (the loopback server fixture)

import ggmlpy as gp
from ggmlpy import backend as bk
from ggmlpy.kvcache import Causal, NotSupported


def _store(cache, n_tokens, seq=0, start=0):
    """Write tokens start..start+n-1 of ``seq`` with K = V = position, through a graph."""
    plan = cache.start_forward(np.arange(start, start + n_tokens), np.full(n_tokens, seq))
    ctx = gp.Context(1 << 22)
    k = ctx.from_numpy(np.repeat(np.arange(start, start + n_tokens, dtype=np.float32)[:, None, None],
                                 cache.n_embd_k, axis=2).reshape(n_tokens, 1, cache.n_embd_k))
    v = ctx.from_numpy(np.repeat(np.arange(start, start + n_tokens, dtype=np.float32)[:, None, None],
                                 cache.n_embd_v, axis=2).reshape(n_tokens, 1, cache.n_embd_v))
    gf = ctx.new_graph(64)
    for layer in range(cache.n_layers):
        for t in cache.put(ctx, layer, plan, k, v):
            gf.build_forward_expand(t)
    gf.compute(1)
    cache.apply(plan)
    return plan


def test_cpu_placement_reports_cache_per_layer():
    placement = bk.split_layers(3, bk.choose_devices("cpu"))
    report = bk.MemoryReport(3)
    cache = Causal(3, 16, 16, gp.Type.F16)
    cache.init(capacity=8, n_seq_max=2, max_batch=4, placement=placement, report=report)
    cpu = report.devices["CPU"]
    assert cpu.cache_ok is True
    assert [cpu.cache[i] for i in range(3)] == [cache.bytes_per_layer()] * 3
    assert cpu.cache_total == 3 * cache.bytes_per_layer()
    assert all(t.is_host for t in cache.keys)        # CPU buffers are host memory
    plan = _store(cache, 4)
    k0 = cache.keys[0].get()
    assert k0[plan.cell_ids].tolist() == [[float(p)] * 16 for p in range(4)]
    assert not k0[np.setdiff1d(np.arange(cache.n_cells), plan.cell_ids)].any()   # zero-filled elsewhere
    assert "cache" in str(report)
    cache.close()


def test_placement_failure_is_memoryerror_with_report():
    placement = bk.split_layers(1, bk.choose_devices("cpu"))
    cache = Causal(1, 1 << 16, 1 << 16, gp.Type.F32)
    with pytest.raises(MemoryError) as ei:
        cache.init(capacity=1 << 22, n_seq_max=4, max_batch=1, placement=placement)
    assert ei.value.report.devices["CPU"].cache_ok is False
    assert ei.value.report.devices["CPU"].cache_total >= 2 * 4 * (1 << 22) * (1 << 16) * 4


@pytest.mark.rpc
def test_rpc_placement_holds_data_and_refuses_host_only_work(rpc_server):  # noqa: F811
    devs = bk.choose_devices("auto", rpc=[rpc_server])
    placement = bk.split_layers(2, devs, n_gpu_layers=1)          # layer 1 on the server
    report = bk.MemoryReport(2)
    cache = Causal(2, 8, 8, gp.Type.F32, shift_fn=lambda ctx, layer, k, off: k)
    cache.init(capacity=8, n_seq_max=1, max_batch=4, placement=placement, report=report)
    assert report.devices[devs[0].name].cache[1] == cache.bytes_per_layer()
    assert cache.keys[0].is_host and not cache.keys[1].is_host
    assert not cache.keys[1].get().any()                          # zero-filled on the server
    cache.keys[1].set(np.ones((cache.n_cells, 8), np.float32))
    assert cache.keys[1].get().sum() == cache.n_cells * 8
    cache.start_forward(np.arange(6), np.zeros(6, int))
    cache.apply(cache.start_forward(np.arange(6), np.zeros(6, int)))
    with pytest.raises(NotSupported, match="device memory"):
        cache.remove(0, 1, 2)                                     # would shift positions 2..5
    assert cache.seq_pos_max(0) == 5                              # nothing changed
    cache.remove(0, 3)                                            # to the end: no shift needed
    assert cache.seq_pos_max(0) == 2
    cache.close()


@pytest.mark.rpc
@pytest.mark.parametrize("v_trans", [False, True])
def test_rpc_placed_cache_shifts_and_defrags_through_the_runtime(rpc_server, v_trans):  # noqa: F811
    """Given the runtime of its devices, a cache on an RPC server re-rotates keys and compacts its cells
    there (the graphs compute through the scheduler): every row equals a host cache's after the same
    removes and defragmentation, and the cells agree."""
    hd, n_head = 8, 2
    shift = lambda ctx, layer, k, off: ctx.rope_ext(k, off, n_dims=hd, mode=gp.RopeType.NEOX)  # noqa: E731
    devs = bk.choose_devices("auto", rpc=[rpc_server])
    placement = bk.split_layers(2, devs, n_gpu_layers=1)          # layer 1 on the server
    rng = np.random.default_rng(3)
    data = [rng.standard_normal((32, hd * n_head)).astype(np.float32) for _ in range(4)]

    def run(**init):
        cache = Causal(2, hd * n_head, hd * n_head, gp.Type.F32, n_head_kv=n_head, shift_fn=shift, v_trans=v_trans)
        cache.init(capacity=16, n_seq_max=2, max_batch=4, **init)
        for i, t in enumerate(cache.keys + cache.values):
            t.set(data[i] if t.ne[1] == 32 else np.ascontiguousarray(data[i].T))
        for a in range(0, 12, 4):                 # interleaved: each sequence's cells scattered
            for s in (0, 1):
                cache.apply(cache.start_forward(np.arange(a, a + 4), np.full(4, s)))
        cache.remove(0, 2, 5)                     # shifts seq 0's positions 5..11 down by 3
        cache.remove(1, 0, 4)                     # shifts all of seq 1
        cache.clear(0)
        cache.apply(cache.start_forward(np.arange(0, 3), np.zeros(3, int)))
        moves = cache.defrag()
        out = [t.get().copy() for t in cache.keys + cache.values], cache.cells.pos.copy(), moves
        cache.close()
        return out

    rt = bk.Runtime(placement.devices(), n_threads=1)
    try:
        remote, pos, moves = run(placement=placement, report=bk.MemoryReport(2), runtime=rt)
    finally:
        rt.close()
    host, host_pos, host_moves = run()
    assert moves and moves == host_moves
    np.testing.assert_array_equal(pos, host_pos)
    assert not np.array_equal(remote[1], data[1])     # layer 1's keys (on the server) were rotated
    for got, want in zip(remote, host):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def test_forward_protocol_set_layer_put_get():
    cache = Causal(2, 8, 8, gp.Type.F32)
    cache.init(capacity=8, n_seq_max=2, max_batch=4)
    plan = cache.start_forward([0, 1, 0], [0, 0, 1])
    ctx = gp.Context(1 << 22)
    fw = cache.forward(ctx, plan)
    with pytest.raises(ValueError, match="set_layer"):
        fw.get()
    rng = np.random.default_rng(0)
    kv = {}
    for layer in range(2):
        kv[layer] = rng.standard_normal((2, 3, 1, 8)).astype(np.float32)
        k = ctx.from_numpy(kv[layer][0])
        v = ctx.from_numpy(kv[layer][1])
        fw.set_layer(layer).put(k, v)
        kview, vview, mask = fw.get()
        assert mask is fw.get()[2]                      # one mask for every layer
        assert kview.ne[1] == plan.hi - plan.lo
    with pytest.raises(ValueError):
        fw.set_layer(0).put(ctx.from_numpy(np.zeros((2, 1, 8), np.float32)),
                             ctx.from_numpy(np.zeros((2, 1, 8), np.float32)))    # batch of 2, plan of 3
    gf = ctx.new_graph(64)
    for t in fw.pending:
        gf.build_forward_expand(t)
    gf.compute(1)
    cache.apply(plan)
    for layer in range(2):
        np.testing.assert_array_equal(cache.keys[layer].get()[plan.cell_ids], kv[layer][0].reshape(3, 8))
        np.testing.assert_array_equal(cache.values[layer].get()[plan.cell_ids], kv[layer][1].reshape(3, 8))
    np.testing.assert_array_equal(plan.mask[2][plan.cell_ids[:2] - plan.lo], [-np.inf, -np.inf])  # seq 1 sees no seq 0


@pytest.mark.rpc
def test_wrapper_places_each_cache_on_its_model_layers_devices(rpc_server):  # noqa: F811
    """A Wrapper of a window and a full cache over layers [0, 1, 0, 1] with layers 2 and 3 on an RPC server:
    each wrapped layer sits on its *model* layer's device and is reported under that layer, host_bytes
    counts only the CPU layers, and a failed init leaves nothing allocated."""
    from ggmlpy.kvcache import Wrapper
    from ggmlpy.models import Cache

    devs = bk.choose_devices("auto", rpc=[rpc_server])
    placement = bk.split_layers(4, devs, n_gpu_layers=2)          # layers 2, 3 on the server
    report = bk.MemoryReport(4)
    swa = Causal(2, 8, 8, gp.Type.F16, window=4)
    full = Causal(2, 8, 8, gp.Type.F16)
    w = Wrapper([swa, full], [0, 1, 0, 1])
    assert isinstance(w, Cache) and isinstance(swa, Cache)
    need = w.host_bytes(32, 1, 8, placement)
    w.init(32, 1, 8, placement=placement, report=report)
    server, cpu = report.devices[devs[0].name], report.devices["CPU"]
    assert sorted(cpu.cache) == [0, 1] and sorted(server.cache) == [2, 3]
    assert cpu.cache[0] == swa.bytes_per_layer() and server.cache[3] == full.bytes_per_layer()
    assert swa.keys[0].is_host and not swa.keys[1].is_host and full.keys[0].is_host and not full.keys[1].is_host
    assert swa.n_cells < full.n_cells                                # the window cache is smaller
    # mask + cell metadata of each cache, plus the K/V of its one CPU layer
    expect = sum(8 * c.n_cells * 2 + 2 * c.n_cells * 5 + c.bytes_per_layer() for c in (swa, full))
    assert need == expect
    assert w.host_bytes(32, 1, 8) == expect + swa.bytes_per_layer() + full.bytes_per_layer()   # all on the host
    w.close()
    too_big = Wrapper([Causal(1, 8, 8, gp.Type.F16), Causal(1, 1 << 16, 1 << 16, gp.Type.F32)], [0, 1])
    with pytest.raises(MemoryError):
        too_big.init(1 << 22, 4, 1, placement=bk.split_layers(2, bk.choose_devices("cpu")))
    assert all(not c.keys for c in too_big.caches)                  # the first cache was freed again
