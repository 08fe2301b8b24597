"""ggmlpy.kvcache.Recurrent (recurrent states per sequence) and its bookkeeping, StateRows.

* StateRows against a simple reference: random sequences of batches, prefix forks, cuts back to
  checkpoints, clears and checkpoint wishes (hypothesis) against a dict of token lists, with every row's
  data simulated as the graph computes it (each batch reads every sequence's row before it writes any):
  each sequence's live row and every checkpoint hold exactly its history, a refused cut changes nothing,
  and no row a sequence still needs is ever overwritten.
* Recurrent through real graphs: the convolution state (``RecurrentForward.conv``) and the scan state
  (``RecurrentForward.scan``) over several batches, a fork sharing a row written twice (copy on write), a
  cut back to a checkpoint, against numpy.
* In a Wrapper with a Causal (a hybrid model's cache): a middle range (a context shift) is refused by
  both before either changes; a cut back to a checkpoint goes through both; where both can resume.
* The runner's micro-batches for such a cache (split_ubatches(equal=True)), the memory report's state
  column, and sequence state files with recurrent sections (round trip; forged sizes refused first).
"""

from __future__ import annotations

import hashlib
import json
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ggmlpy
from ggmlpy import Type
from ggmlpy.kvcache import (
    CacheStateError,
    Causal,
    NotSupported,
    Recurrent,
    StateError,
    StateRows,
    Wrapper,
)
from ggmlpy.kvcache import state as kvstate
from ggmlpy.runner.loop import split_ubatches

# ---------------------------------------------------------------------------------------------- StateRows


class _Sim:
    """StateRows plus the data of every row as the graphs would leave it (a row holds the tuple of tokens its
    state has seen) and the reference: each sequence's token list."""

    def __init__(self, n_seq, n_ckpt):
        self.rows = StateRows(n_seq, n_ckpt)
        self.data = {}
        self.hist = {s: [] for s in range(n_seq)}

    def batch(self, seqs, toks):
        trial = self.rows.copy()
        src, dst = trial.advance(seqs, len(toks[0]))
        # the graph reads every sequence's row, then writes each new state
        new = {d: (() if r < 0 else self.data[r]) + tuple(t) for r, d, t in zip(src, dst, toks)}
        needed = self._needed(exclude=set(seqs))
        assert not needed & set(dst), "a row someone else still needs is written"
        self.data.update(new)
        self.rows = trial
        for s, t in zip(seqs, toks):
            self.hist[s] += list(t)

    def _needed(self, exclude):
        """Rows held by a checkpoint or by a sequence outside ``exclude``."""
        held = {self.rows.tail[s] for s in range(self.rows.n_seq_max) if s not in exclude}
        held |= {r for cps in self.rows.checkpoints for _, r in cps}
        return held - {-1}

    def check(self):
        self.rows.check()
        for s, h in self.hist.items():
            row = self.rows.tail[s]
            assert self.rows.length[s] == len(h)
            assert (row < 0 and not h) or self.data[row] == tuple(h), (s, h)
            for k, r in self.rows.checkpoints[s]:
                assert 0 < k <= len(h) and self.data[r] == tuple(h[:k]), (s, k)


_OPS = st.lists(st.one_of(
    st.tuples(st.just("batch"), st.sets(st.integers(0, 3), min_size=1), st.integers(1, 3)),
    st.tuples(st.just("fork"), st.integers(0, 3), st.integers(0, 3), st.integers(0, 12)),
    # a fork near one of src's checkpoints (index, offset -1..1): where the point chosen matters most
    st.tuples(st.just("fork_ckpt"), st.integers(0, 3), st.integers(0, 3), st.integers(0, 2), st.integers(-1, 1)),
    st.tuples(st.just("cut"), st.integers(0, 3), st.integers(0, 12)),
    st.tuples(st.just("clear"), st.integers(0, 3)),
    st.tuples(st.just("want"), st.integers(0, 3), st.integers(1, 4)),
), max_size=40)


@settings(max_examples=200, deadline=None)
@given(ops=_OPS, n_ckpt=st.integers(0, 2))
def test_rows_against_a_dict_of_lists(ops, n_ckpt):
    sim = _Sim(4, n_ckpt)
    tok = iter(range(1, 10**6))
    for op in ops:
        if op[0] == "batch":
            seqs = sorted(op[1])
            sim.batch(seqs, [[next(tok) for _ in range(op[2])] for _ in seqs])
        elif op[0] in ("fork", "fork_ckpt"):
            if op[0] == "fork":
                _, src, dst, n = op
            else:
                _, src, dst, i, delta = op
                cps = sim.rows.checkpoints[src]
                n = (cps[i % len(cps)][0] if cps else len(sim.hist[src])) + delta
            k = sim.rows.copy_seq(src, dst, n)
            if src != dst:
                # the longest state of src covering at most n tokens: its live one or a checkpoint
                points = [len(sim.hist[src])] * (sim.rows.tail[src] >= 0) + [c for c, _ in sim.rows.checkpoints[src]]
                assert k == max([p for p in points if p <= n], default=0)
                sim.hist[dst] = sim.hist[src][:k]
        elif op[0] == "cut":
            _, s, n = op
            before = (sim.rows.copy().__dict__, list(sim.hist[s]))
            ok = n <= 0 or len(sim.hist[s]) <= n or any(k == n for k, _ in sim.rows.checkpoints[s])
            if ok:
                sim.rows.truncate(s, n)
                sim.hist[s] = sim.hist[s][:max(n, 0)] if n > 0 else []
            else:
                with pytest.raises(NotSupported, match="cannot be cut back"):
                    sim.rows.truncate(s, n)
                assert sim.rows.__dict__ == before[0] and sim.hist[s] == before[1]
        elif op[0] == "clear":
            sim.rows.clear(op[1])
            sim.hist[op[1]] = []
        else:
            _, s, ahead = op
            n = len(sim.hist[s]) + ahead
            sim.rows.want_checkpoint(s, n)
            if n_ckpt:
                sim.batch([s], [[next(tok) for _ in range(ahead)]])
                assert (n, sim.rows.tail[s]) in sim.rows.checkpoints[s]
        sim.check()
        for s in range(4):
            p = sim.rows.resume_point(s, len(sim.hist[s]) + 1)
            assert p in {0, len(sim.hist[s]), *(k for k, _ in sim.rows.checkpoints[s])}


def test_rows_share_until_written():
    """A fork and a checkpoint take references, no copy; the first batch after them writes a free row."""
    r = StateRows(2, 1)
    r.advance([0], 4)
    r.want_checkpoint(0, 6)
    assert r.advance([0], 2) == ([0], [0]) and r.checkpoints[0] == [(6, 0)]
    # both sequences and their checkpoints (seq 1 inherits the one at 6) hold row 0
    assert r.copy_seq(0, 1, 6) == 6 and r.tail == [0, 0] and r.refs[0] == 4
    # both go on in one batch: each writes a free row (the checkpoint still holds row 0)
    assert r.advance([0, 1], 1) == ([0, 0], [1, 2])
    r.check()
    # row 0 held only by batch members: the first writes it in place
    r2 = StateRows(3, 0)
    r2.advance([0], 2)
    r2.copy_seq(0, 1, 2)
    assert r2.advance([1, 0], 1) == ([0, 0], [0, 1])


def test_a_fork_takes_the_checkpoints_it_covers():
    """Forked at one of two adjacent checkpoints, the copy holds that state and the earlier checkpoints, not the
    later one (it would be a state of tokens the copy does not have)."""
    sim = _Sim(2, 2)
    sim.batch([0], [[1, 2]])
    for tok in (3, 4):
        sim.rows.want_checkpoint(0, tok)
        sim.batch([0], [[tok]])
    sim.batch([0], [[5]])
    assert [k for k, _ in sim.rows.checkpoints[0]] == [3, 4]
    assert sim.rows.copy_seq(0, 1, 3) == 3
    sim.hist[1] = sim.hist[0][:3]
    assert [k for k, _ in sim.rows.checkpoints[1]] == [3]
    sim.check()


def test_rows_refuse_what_a_state_cannot():
    r = StateRows(2, 2)
    r.advance([0], 5)
    with pytest.raises(NotSupported, match="no checkpoint at 3"):
        r.truncate(0, 3)
    r.truncate(0, 9)                        # beyond its end: nothing to cut
    assert r.length[0] == 5
    r.truncate(0, 0)
    assert r.tail[0] == -1 and r.used == 0


# ---------------------------------------------------------------------------------------------- graphs

C, W = 6, 2                    # conv channels, state width (d_conv - 1)
RNG = np.random.default_rng(5)
KERN = RNG.standard_normal((C, W + 1)).astype(np.float32)


def _conv_ref(hist):
    """Each position's convolution output of a sequence's whole input history ``(n, C)``."""
    full = np.concatenate([np.zeros((W, C), np.float32), hist])
    return np.stack([(full[t:t + W + 1] * KERN.T).sum(0) for t in range(len(hist))])


def _run_conv(cache, seqs, t, layer=0, strided=False):
    """One batch of ``t`` tokens for each of ``seqs`` through the convolution state of ``layer``: the inputs
    (random; ``strided``: given as a view of wider rows, as a projection's part is) and outputs ``(n_seqs, t, C)``."""
    rows = cache.rows if isinstance(cache, Recurrent) else cache.caches[1].rows
    pos = np.concatenate([rows.length[s] + np.arange(t) for s in seqs])
    plan = cache.start_forward(pos, np.repeat(seqs, t))
    x = RNG.standard_normal((len(seqs) * t, C)).astype(np.float32)
    with ggmlpy.Context(1 << 22) as ctx:
        fw = cache.forward(ctx, plan).set_layer(layer)
        if strided:
            wide = ctx.from_numpy(np.concatenate([np.zeros((len(x), 3), np.float32), x], 1))
            xt = ctx.view(wide, (C, len(x)), (wide.nb[1],), 3 * 4)
        else:
            xt = ctx.from_numpy(x)
        out = fw.conv(xt, ctx.from_numpy(KERN))
        gf = ctx.new_graph(128)
        for w in fw.pending:
            gf.build_forward_expand(w)
        gf.build_forward_expand(out)
        gf.compute(2)
        y = out.numpy().reshape(len(seqs), t, C).copy()
    cache.apply(plan)
    return x.reshape(len(seqs), t, C), y


def test_conv_state_over_batches_forks_and_checkpoints():
    cache = Recurrent(1, {"conv": (W, C)}, checkpoints=1)
    cache.init(64, 3, 16)
    hist = {s: np.zeros((0, C), np.float32) for s in range(3)}

    def step(seqs, t):
        x, y = _run_conv(cache, seqs, t, strided=t == 2)
        for j, s in enumerate(seqs):
            hist[s] = np.concatenate([hist[s], x[j]])
            np.testing.assert_allclose(y[j], _conv_ref(hist[s])[-t:], rtol=1e-5, atol=1e-5)

    step([0], 5)
    cache.want_checkpoint(0, 7)
    step([0], 2)                                      # the checkpoint at 7 shares seq 0's row
    cache.copy_prefix(0, 1, 7)                        # seq 1 shares it too
    hist[1] = hist[0].copy()
    assert cache.resume_point(1, 20) == 7 and cache.can_resume(1, 7) and not cache.can_resume(1, 6)
    step([0, 1], 1)                                   # both write free rows; the checkpoint stays
    step([1, 0], 3)
    step([2], 4)
    cache.remove(0, 7)                                # back to the checkpoint
    hist[0] = hist[0][:7]
    assert cache.seq_pos_max(0) == 6
    step([0, 2], 2)
    with pytest.raises(NotSupported, match="shifting positions"):
        cache.remove(1, 2, 4)                          # a middle range: a context shift
    with pytest.raises(ggmlpy.GGMLValueError, match="cannot go back or skip"):
        cache.start_forward([3], [1])
    with pytest.raises(ggmlpy.GGMLValueError, match="same number of consecutive rows"):
        cache.start_forward([12, 13, 9], [1, 1, 2])
    cache.rows.check()
    cache.close()
    with pytest.raises(CacheStateError):
        cache.start_forward([0], [0])


def _scan_ref(state, x, dt, A, B, Cm):
    """Mamba-2's scan of one sequence: state (n_head, head_dim, d_state), x (t, n_head, head_dim), dt (t,
    n_head), A (n_head,), B and C (t, d_state): the outputs and the final state."""
    y = np.zeros(x.shape)
    st_ = state.astype(np.float64).copy()
    for i in range(x.shape[0]):
        d = np.log1p(np.exp(dt[i]))
        st_ = st_ * np.exp(d * A)[:, None, None] + B[i][None, None, :] * (x[i] * d[:, None])[:, :, None]
        y[i] = st_ @ Cm[i]
    return y, st_


@pytest.mark.parametrize("ds, hd, nh", [(8, 4, 2), (32, 16, 8)])     # the second state moves as 4 rows of 1024
def test_scan_state_over_batches_and_a_fork(ds, hd, nh):
    cache = Recurrent(1, {"ssm": (ds, hd, nh)}, checkpoints=0)
    cache.init(64, 2, 16)
    A = -RNG.uniform(0.2, 1.0, nh).astype(np.float32)
    states = {s: np.zeros((nh, hd, ds)) for s in range(2)}

    def step(seqs, t):
        n = len(seqs)
        pos = np.concatenate([cache.rows.length[s] + np.arange(t) for s in seqs])
        plan = cache.start_forward(pos, np.repeat(seqs, t))
        x = RNG.standard_normal((n, t, nh, hd)).astype(np.float32)
        dt = RNG.uniform(-2, 1, (n, t, nh)).astype(np.float32)
        B, Cm = (RNG.standard_normal((n, t, 1, ds)).astype(np.float32) for _ in range(2))
        with ggmlpy.Context(1 << 22) as ctx:
            fw = cache.forward(ctx, plan).set_layer(0)
            y = fw.scan(*(ctx.from_numpy(a) for a in (x, dt, A.reshape(nh, 1), B, Cm)))
            gf = ctx.new_graph(64)
            for w in fw.pending:
                gf.build_forward_expand(w)
            gf.build_forward_expand(y)
            gf.compute(2)
            got = y.numpy().reshape(n, t, nh, hd).copy()
        cache.apply(plan)
        for j, s in enumerate(seqs):
            want, states[s] = _scan_ref(states[s], x[j], dt[j], A, B[j, :, 0], Cm[j, :, 0])
            np.testing.assert_allclose(got[j], want, rtol=1e-4, atol=1e-5)

    step([0], 3)
    step([0], 1)
    cache.copy_prefix(0, 1, 4)
    states[1] = states[0].copy()
    step([1, 0], 2)                     # one writes the shared row in place, the other a free one
    step([0, 1], 1)


def test_large_states_move_as_several_rows_and_a_reused_graph_follows_its_plan():
    """A state of 4096 values is read and written as 4 rows of 1024 (ggml shares a copy out among threads by
    rows); the spread indices follow each plan when a graph built once is filled with the next one."""
    from ggmlpy.kvcache.recurrent import _parts

    assert [_parts(n) for n in (64, 2048, 4096, 196608, 4100, 4098)] == [1, 2, 4, 32, 4, 2]
    cache = Recurrent(1, {"s": (64, 64)}, checkpoints=0)
    cache.init(64, 2, 8)
    held = {0: np.zeros(4096, np.float32), 1: np.zeros(4096, np.float32)}
    with ggmlpy.Context(1 << 24, no_alloc=False) as ctx:
        plan = cache.start_forward([0], [0])
        fw = cache.forward(ctx, plan).set_layer(0)
        new = ctx.new_tensor(Type.F32, (4096, 1))
        old = fw.get("s")
        out = ctx.scale(old, 1.0)                                          # what the step read, for the check
        fw.put("s", ctx.add(ctx.scale(old, 0.0), new))                     # a write after the read, as a model's
        assert {t.name for t in fw._index.values()} == {"rs_src_4", "rs_dst_4"}
        gf = ctx.new_graph(64)
        for w in fw.pending:
            gf.build_forward_expand(w)
        gf.build_forward_expand(out)
        for step, seq in enumerate([0, 1, 0, 0, 1]):
            if step:
                plan = cache.start_forward([cache.rows.length[seq]], [seq])
                fw.fill(plan)
            value = RNG.standard_normal(4096).astype(np.float32)
            new.set(value.reshape(1, 4096))
            gf.compute(2)
            np.testing.assert_array_equal(out.numpy().ravel(), held[seq])    # each reads its own last state
            cache.apply(plan)
            held[seq] = value


def _hybrid(checkpoints=1):
    kv = Causal(1, 2, 2, Type.F32, shift_fn=lambda ctx, layer, k, off: ctx.scale(k, 1.0))
    rs = Recurrent(1, {"conv": (W, C)}, checkpoints=checkpoints)
    w = Wrapper([kv, rs], [1, 0])           # layer 0 recurrent, layer 1 attention
    w.init(32, 2, 8)
    return w, kv, rs


def _hybrid_step(w, seqs, t):
    rs = w.caches[1]
    pos = np.concatenate([rs.rows.length[s] + np.arange(t) for s in seqs])
    plan = w.start_forward(pos, np.repeat(seqs, t))
    n = len(pos)
    with ggmlpy.Context(1 << 22) as ctx:
        fw = w.forward(ctx, plan)
        y = fw.set_layer(0).conv(ctx.from_numpy(RNG.standard_normal((n, C)).astype(np.float32)),
                                 ctx.from_numpy(KERN))
        kvt = ctx.from_numpy(np.repeat(pos.astype(np.float32)[:, None], 2, 1).reshape(n, 1, 2))
        fw.set_layer(1).put(kvt, kvt)
        gf = ctx.new_graph(128)
        for p in fw.pending:
            gf.build_forward_expand(p)
        gf.build_forward_expand(y)
        gf.compute(1)
    assert fw.n_seqs == len(seqs) and fw.n_seq_tokens == t
    w.apply(plan)


def test_in_a_wrapper_both_caches_change_or_neither():
    w, kv, rs = _hybrid()
    assert w.split_equal and w.n_checkpoints == 1
    w.want_checkpoint(0, 4)
    _hybrid_step(w, [0], 4)
    _hybrid_step(w, [0], 3)
    before = (kv.cells.pos.copy(), rs.rows.__dict__.copy())
    with pytest.raises(NotSupported, match="shifting positions"):
        w.remove(0, 1, 3)                               # the K/V could shift, the state cannot: neither does
    assert (kv.cells.pos == before[0]).all() and rs.rows.__dict__ == before[1]
    with pytest.raises(NotSupported, match="no checkpoint at 5"):
        w.remove(0, 5)
    assert w.resume_point(0, 6) == 4 and w.resume_point(0, 7) == 7 and w.resume_point(0, 3) == 0
    w.remove(0, 4)                                      # back to the checkpoint, in both
    assert kv.seq_pos_max(0) == rs.seq_pos_max(0) == w.seq_pos_max(0) == 3
    w.copy_prefix(0, 1, 4)
    assert w.can_resume(1, 4) and kv.seq_pos_max(1) == rs.seq_pos_max(1) == 3
    _hybrid_step(w, [0, 1], 1)
    w.close()


# ---------------------------------------------------------------------------------------------- runner


def test_split_equal_keeps_the_rows_in_order():
    """Runs of one sequence cut at n_ubatch; runs of the same length and different sequences go together."""
    seqs = np.array([0] * 5 + [1, 2, 3] + [4] * 2 + [5] * 2 + [1])
    n = seqs.size
    ubs = split_ubatches(4, np.arange(n, dtype=np.int32), np.arange(n), seqs, np.ones(n, bool), equal=True)
    assert [ub.seqs.tolist() for ub in ubs] == [[0] * 4, [0, 1, 2, 3], [4, 4, 5, 5], [1]]
    assert np.concatenate([ub.tokens for ub in ubs]).tolist() == list(range(n))
    for ub in ubs:
        runs = np.diff(np.flatnonzero(np.r_[True, np.diff(ub.seqs) != 0, True]))
        assert len(set(runs.tolist())) == 1 and len(set(ub.seqs.tolist())) == len(runs)


def test_the_memory_report_shows_the_states():
    from ggmlpy.backend import choose_devices, split_layers
    from ggmlpy.memory import MemoryReport

    placement = split_layers(2, choose_devices("cpu"))
    report = MemoryReport(2)
    rs = Recurrent(2, {"conv": (W, C), "ssm": (4, 2, 2)}, checkpoints=2)
    rs.init(1000, 3, 8, placement=placement, report=report)
    cpu = report.devices["CPU"]
    per_layer = rs.bytes_per_layer(3)
    assert per_layer == 4 * (W * C + 16) * (3 * 3 + 1)
    assert cpu.state == {0: per_layer, 1: per_layer} and cpu.cache_total == 0
    assert cpu.self_total == cpu.weights_total + 2 * per_layer + cpu.graph
    text = str(report)
    assert "state" in text.splitlines()[1] and "context: cache + state" in text
    assert "CPU state" in report.layer_table()
    assert report.to_dict()["devices"]["CPU"]["state_total"] == 2 * per_layer
    # the context does not change their size
    assert rs.host_bytes(10**6, 3, 8) == rs.host_bytes(10, 3, 8) == 2 * per_layer
    rs.close()


# ---------------------------------------------------------------------------------------------- state files


def test_state_round_trip_and_forged_sizes(tmp_path):
    w, kv, rs = _hybrid(checkpoints=0)
    _hybrid_step(w, [0], 5)
    _hybrid_step(w, [0, 1], 2)
    path = tmp_path / "s.bin"
    w.save_seq(0, path, meta={"x": 1})
    raw = path.read_bytes()
    assert struct.unpack("<8sII", raw[:16])[1] == 2        # version 2: a recurrent section
    state0 = rs.tensor(0, "conv").numpy()[rs.rows.tail[0]].copy()
    assert w.load_seq(1, path) == {"x": 1}
    assert rs.seq_pos_max(1) == kv.seq_pos_max(1) == 6
    np.testing.assert_array_equal(rs.tensor(0, "conv").numpy()[rs.rows.tail[1]], state0)

    def forged(change):
        head_len = struct.unpack("<8sII", raw[:16])[2]
        header = json.loads(raw[16:16 + head_len])
        change(header)
        head = json.dumps(header, separators=(",", ":")).encode()
        body = raw[16 + head_len:-32]
        data = struct.pack("<8sII", b"GGMLKVSQ", 2, len(head)) + head + body
        return data + hashlib.sha256(data).digest()

    def refused(data, match, version=None):
        if version is not None:
            data = data[:8] + struct.pack("<I", version) + data[12:]
            data = data[:-32] + hashlib.sha256(data[:-32]).digest()
        p = tmp_path / "f.bin"
        p.write_bytes(data)
        before = (rs.rows.__dict__.copy(), rs.tensor(0, "conv").numpy().copy(), kv.cells.pos.copy())
        with pytest.raises(StateError, match=match):
            w.load_seq(0, p)
        assert rs.rows.__dict__ == before[0] and kv.cells.pos.tolist() == before[2].tolist()
        np.testing.assert_array_equal(rs.tensor(0, "conv").numpy(), before[1])

    refused(forged(lambda h: h["caches"][1].__setitem__("states", [["conv", [W + 1, C]]])),
            r"recurrent states of 1 layers \[\['conv', \[3, 6\]\]\] in the file")
    refused(forged(lambda h: h["caches"][1].__setitem__("states", [["conv", [W, C]], ["conv", [1]]])),
            "bad 'states'")
    refused(forged(lambda h: h["caches"][1].__setitem__("count", 2)), r"'count' \(0 or 1\)")
    refused(forged(lambda h: h["caches"][1].pop("kind")), "cache 1 has")
    refused(forged(lambda h: h["caches"].reverse()), "a recurrent section of cache 0")
    refused(raw, "not a K/V section nor a recurrent one of version 2", version=1)
    # a file of K/V only is still version 1 (what older ggmlpy reads)
    kv_only = Causal(1, 2, 2, Type.F32)
    kv_only.init(8, 1, 4)
    kv_only.save_seq(0, tmp_path / "kv.bin")
    assert struct.unpack("<8sII", (tmp_path / "kv.bin").read_bytes()[:16])[1] == 1
    kv_only.close()
    w.close()


def test_a_recurrent_cache_alone_saves_and_loads(tmp_path):
    rs = Recurrent(1, {"conv": (W, C)}, checkpoints=0)
    rs.init(32, 2, 8)
    _run_conv(rs, [1], 3)
    assert kvstate.save_seq(rs, 1, tmp_path / "r.bin") > 0
    rs.clear()
    rs.load_seq(0, tmp_path / "r.bin")
    assert rs.seq_pos_max(0) == 2 and rs.seq_pos_max(1) == -1
    rs.save_seq(1, tmp_path / "empty.bin")            # a sequence with nothing: count 0
    rs.load_seq(0, tmp_path / "empty.bin")
    assert rs.seq_pos_max(0) == -1
    rs.close()
