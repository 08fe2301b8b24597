"""ggmlpy bench --roofline: the bytes and FLOPs of a test, the machine's measured bounds and their cache, the output."""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import sqlite3

import pytest

from ggmlpy import benchmark as bm
from ggmlpy.benchmark import Instance, Result, parse_args
from ggmlpy.benchmark import roofline as rl
from ggmlpy.models.synthetic import synthetic_path

TINY_MEASURE = {"bw_bytes": 1 << 20, "mm": (64, 256, 32), "reps": 1, "min_s": 0.0}


@pytest.fixture
def small(monkeypatch):
    """Measurements of a few kB (they still run ggml's kernels), and a count of how many ran."""
    monkeypatch.setattr(rl, "MEASURE", dict(TINY_MEASURE))
    calls = {"bw": 0, "peak": []}
    real_bw, real_peak = rl.measure_bandwidth, rl.measure_peak

    def bw(n_threads, *a, **kw):
        calls["bw"] += 1
        return real_bw(n_threads, *a, **kw)

    def peak(n_threads, type="F32", *a, **kw):
        calls["peak"].append((n_threads, str(type)))
        return real_peak(n_threads, type, *a, **kw)

    monkeypatch.setattr(rl, "measure_bandwidth", bw)
    monkeypatch.setattr(rl, "measure_peak", peak)
    return calls


# --------------------------------------------------------------------------- the work of a test, by hand

def test_attended_positions_closed_form_matches_the_sum():
    for start in (0, 1, 5, 17):
        for n in (0, 1, 4, 30):
            for window in (None, 1, 3, 8, 50):
                want = sum(pos + 1 if window is None else min(pos + 1, window) for pos in range(start, start + n))
                assert rl.attended(start, n, window) == want, (start, n, window)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return str(synthetic_path("tiny", "F16", cache_dir=tmp_path_factory.mktemp("models")))


def test_dense_llama_bytes_and_flops_by_hand(tiny_llama):
    # tiny: n_embd 64, 2 layers, 4 heads, 2 KV heads (head 16), n_ff 192, vocab 512; F16 matrices, F32 norms
    w = rl.ModelWork.from_gguf(tiny_llama)
    per_layer = 64 * 64 + 2 * (32 * 64) + 64 * 64 + 3 * (192 * 64)           # q, k, v, o, gate, up, down
    assert w.matmul_params == {"F16": 2 * per_layer}
    norms = 4 * (2 * 2 * 64 + 64)                                             # attn/ffn norm per layer, output norm
    assert w.body_bytes == 2 * 2 * per_layer + norms
    assert (w.embd_row_bytes, w.head_bytes, w.head_params, w.tied) == (64 * 2, 512 * 64 * 2, 512 * 64, False)
    assert [(ly.n_head, ly.n_head_kv, ly.head_dim_k, ly.head_dim_v, ly.window) for ly in w.layers] == \
        [(4, 2, 16, 16, None)] * 2
    # a generated token reads every matrix, one embedding row and the head
    assert w.token_weight_bytes() == w.body_bytes + 64 * 2 + 512 * 64 * 2
    assert w.token_weight_bytes(embeddings=True) == w.body_bytes + 64 * 2
    # KV: per attended position and layer, 2 KV heads x (16 K + 16 V) x 2 bytes; tg4 at depth 8: positions 8..11
    assert w.kv_bytes(8, 4) == 2 * (9 + 10 + 11 + 12) * 2 * 32 * 2
    assert w.kv_bytes(8, 4, "q8_0", "f32") == pytest.approx(2 * 42 * 2 * 16 * (34 / 32 + 4))
    # pp16: 2 x params x 16 tokens, the head for the one output row, attention 2 x 4 heads x 32 x (1+..+16) a layer
    f = w.prompt_flops(16, 0, 2048)
    assert f == {"F16": 2 * 2 * per_layer * 16 + 2 * 512 * 64, "attention": 2 * 2 * 4 * 32 * 136}
    assert w.prompt_flops(16, 0, 8)["F16"] == 2 * 2 * per_layer * 16 + 2 * 512 * 64 * 2     # two decodes, two rows
    assert "F16" in w.prompt_flops(16, embeddings=True) and \
        w.prompt_flops(16, embeddings=True)["F16"] == 2 * 2 * per_layer * 16                  # no head
    assert w.types == {"F16"}


def _md(arch: str, **kv) -> dict:
    base = {"general.architecture": arch, f"{arch}.block_count": 2, f"{arch}.embedding_length": 64,
            f"{arch}.attention.head_count": 4, f"{arch}.attention.head_count_kv": 2}
    return {**base, **{f"{arch}.{k}": v for k, v in kv.items()}}


def test_moe_reads_only_the_experts_it_uses():
    md = _md("qwen3moe", expert_count=8, expert_used_count=2)
    t = [("token_embd.weight", "F16", (64, 100), 64 * 100 * 2), ("output.weight", "Q8_0", (64, 100), 6800)]
    for i in range(2):
        t += [(f"blk.{i}.attn_q.weight", "F16", (64, 64), 64 * 64 * 2),
              (f"blk.{i}.ffn_gate_inp.weight", "F32", (64, 8), 64 * 8 * 4),          # the router: all of it
              (f"blk.{i}.ffn_up_exps.weight", "Q4_0", (64, 32, 8), 8 * 32 * 2 * 18),  # 2 blocks a row
              (f"blk.{i}.ffn_norm.weight", "F32", (64,), 256)]
    w = rl.ModelWork.from_tensors(md, t)
    assert w.body_bytes == 2 * (64 * 64 * 2 + 64 * 8 * 4 + 8 * 32 * 2 * 18 // 4 + 256)
    assert w.matmul_params == {"F16": 2 * 64 * 64, "F32": 2 * 64 * 8, "Q4_0": 2 * 64 * 32 * 8 / 4}
    assert (w.head_type, w.head_params, w.head_bytes, w.embd_row_bytes) == ("Q8_0", 6400, 6800, 128)
    assert w.types == {"F16", "F32", "Q4_0", "Q8_0"}
    assert w.token_weight_bytes() == w.body_bytes + 6800 + 128
    # each prompt token also uses 2 of the 8 experts
    assert w.prompt_flops(4, 0)["Q4_0"] == 2 * (2 * 64 * 32 * 8 / 4) * 4


def test_tied_head_is_counted_once():
    md = _md("gemma3")
    t = [("token_embd.weight", "F16", (64, 100), 64 * 100 * 2), ("blk.0.attn_q.weight", "F16", (64, 64), 8192)]
    w = rl.ModelWork.from_tensors(md, t)
    assert w.tied and (w.head_bytes, w.head_params, w.body_bytes) == (12800, 6400, 8192)
    assert w.token_weight_bytes() == 8192 + 12800                        # the whole table; its row not again
    assert w.token_weight_bytes(embeddings=True) == 8192 + 128          # no head: only the row looked up


def test_sliding_window_layers_cap_what_they_read():
    # an architecture ggmlpy does not build: the pattern key (period 2: layer 0 local, layer 1 global)
    md = _md("somearch", **{"attention.sliding_window": 4, "attention.sliding_window_pattern": 2,
                            "attention.key_length": 16, "attention.value_length": 8})
    w = rl.ModelWork.from_tensors(md, [])
    assert [ly.window for ly in w.layers] == [4, None]
    assert [(ly.head_dim_k, ly.head_dim_v) for ly in w.layers] == [(16, 8)] * 2
    # tg3 at depth 10 (positions 10..12): the local layer reads 4 positions a token, the global 11, 12, 13
    per_pos = 2 * (16 * 2 + 8 * 2)
    assert w.kv_bytes(10, 3) == (4 * 3 + 11 + 12 + 13) * per_pos
    assert w.attention_flops(0, 6) == 2 * 4 * 24 * ((1 + 2 + 3 + 4 + 4 + 4) + (1 + 2 + 3 + 4 + 5 + 6))
    # a config that says which layers are local (gemma's), and mistral's one window for every layer
    cfg = type("Cfg", (), {"swa_layers": (False, True), "sliding_window": 3})()
    assert [ly.window for ly in rl.ModelWork.from_tensors(md, [], cfg).layers] == [None, 3]
    cfg = type("Cfg", (), {"sliding_window": 5})()
    assert [ly.window for ly in rl.ModelWork.from_tensors(md, [], cfg).layers] == [5, 5]


def test_gemma3_file_gives_local_layers_and_a_tied_head(tmp_path):
    path = synthetic_path("tiny", "F16", cache_dir=tmp_path, arch="gemma3")
    w = rl.ModelWork.from_gguf(path)
    assert w.tied and all(ly.window == 512 for ly in w.layers)          # 5 local layers of 6: both of 2 are
    assert w.kv_bytes(1000, 1) == 2 * 512 * 2 * (16 * 2 + 16 * 2)


# --------------------------------------------------------------------------- per result

def _res(n_prompt, n_gen, n_depth=0, samples=(1_000_000_000,), **kw) -> Result:
    inst = Instance("m.gguf", n_prompt, n_gen, n_depth, n_threads=1, **kw)
    return Result(inst=inst, engine="ggmlpy", engine_version="", build_commit="", build_number=0, cpu_info="",
                  gpu_info="", backends="CPU", model_type="", model_size=0, model_n_params=0, load_mode="mmap",
                  test_time="", samples_ns=list(samples), ttft_ns=[0], load_time_ms=0.0)


def _work() -> rl.ModelWork:
    return rl.ModelWork(body_bytes=1000, embd_row_bytes=10, head_bytes=90, head_params=45, head_type="F16",
                        matmul_params={"Q4_0": 500.0},
                        layers=[rl.AttentionLayer(2, 1, 4, 4)])


def _bounds() -> rl.MachineBounds:
    return rl.MachineBounds(n_threads=1, cpu="cpu", build="b", bw_gbps=10.0,
                            peaks={"F32": 50.0, "F16": 100.0, "Q4_0": 200.0})


def test_fields_of_tg_pp_and_pg_tests():
    w, b = _work(), _bounds()
    tg = rl.roofline_fields(_res(0, 4, n_depth=2, samples=(2_000_000_000,)), w, b)    # 2 t/s
    kv = 1 * (4 * 2 + 4 * 2) * (3 + 4 + 5 + 6) / 4                                   # f16 K and V, positions 2..5
    assert tg["roofline_weight_bytes"] == 1100 and tg["roofline_kv_bytes"] == round(kv)
    assert tg["roofline_gbps"] == pytest.approx(2 * (1100 + kv) / 1e9)
    assert tg["roofline_bw_pct"] == pytest.approx(100 * tg["roofline_gbps"] / 10.0)
    assert tg["roofline_flops"] is None and tg["roofline_gflops"] is None and tg["roofline_peak_pct"] is None
    assert tg["machine_bw_gbps"] == 10.0 and tg["machine_gflops"] == pytest.approx(200.0)
    pp = rl.roofline_fields(_res(8, 0), w, b)                                           # 8 t/s: one prompt a second
    flops = {"Q4_0": 2 * 500 * 8, "F16": 2 * 45, "attention": 2 * 2 * 8 * 36}
    assert pp["roofline_flops"] == sum(flops.values())
    assert pp["roofline_gflops"] == pytest.approx(sum(flops.values()) / 1e9)
    bound = sum(flops.values()) / (flops["Q4_0"] / 200 + flops["F16"] / 100 + flops["attention"] / 100)
    assert pp["machine_gflops"] == pytest.approx(bound)
    assert pp["roofline_peak_pct"] == pytest.approx(100 * pp["roofline_gflops"] / bound)
    assert pp["roofline_gbps"] is None and pp["roofline_bw_pct"] is None
    # pp4+tg2: each phase's work over the whole time; both shares add up to the roofline's share of the time
    pg = rl.roofline_fields(_res(4, 2, samples=(1_000_000_000,)), w, b)
    assert pg["roofline_gbps"] == pytest.approx((2 * 1100 + 1 * 16 * (5 + 6)) / 1e9)
    assert pg["roofline_flops"] == sum(rl.ModelWork.prompt_flops(w, 4, 0).values())
    assert pg["roofline_gflops"] == pytest.approx(pg["roofline_flops"] / 1e9)
    assert pg["roofline_bw_pct"] > 0 and pg["roofline_peak_pct"] > 0


def test_fields_without_bounds_or_model():
    r = _res(8, 0)
    off = rl.roofline_fields(r, _work(), None)                                         # a GPU test
    assert off["roofline_gflops"] > 0 and off["roofline_peak_pct"] is None and off["machine_gflops"] is None
    assert set(rl.roofline_fields(r, None, _bounds()).values()) == {None}              # an unreadable file
    assert tuple(off) == rl.FIELDS


# --------------------------------------------------------------------------- the machine and the cache

def test_measurements_are_plausible(small):
    bw = rl.measure_bandwidth(1)
    assert bw["gbps"] == max(bw["gemv_gbps"], bw["copy_gbps"]) > 0 and bw["bytes"] == 1 << 20
    for t in ("F32", "F16", "Q4_0", "IQ2_XXS"):       # IQ2_XXS needs an importance matrix: filled with bytes
        pk = rl.measure_peak(1, t)
        assert pk["gflops"] > 0 and pk["shape"] == [64, 256, 32] and pk["buffer"]


def test_cache_is_written_reused_keyed_and_refreshed(tmp_path, small):
    err = io.StringIO()
    a = rl.machine_bounds(1, ["Q4_0"], cache_dir=tmp_path, err=err)
    assert small["bw"] == 1 and sorted(t for _, t in small["peak"]) == ["F16", "F32", "Q4_0"]
    assert "measuring this machine's memory bandwidth" in err.getvalue()
    data = json.loads((tmp_path / rl.CACHE_FILE).read_text())
    key = rl.machine_key(1)[0]
    assert list(data["machines"]) == [key] and data["machines"][key]["n_threads"] == 1
    assert a.bw_gbps > 0 and set(a.peaks) == {"F32", "F16", "Q4_0"} and a.path == str(tmp_path / rl.CACHE_FILE)
    # reused: nothing measured again, the same numbers
    b = rl.machine_bounds(1, ["Q4_0"], cache_dir=tmp_path, err=io.StringIO())
    assert small["bw"] == 1 and len(small["peak"]) == 3 and b.to_json() == a.to_json()
    # a type not yet measured: only its peak
    rl.machine_bounds(1, ["Q8_0"], cache_dir=tmp_path, err=io.StringIO())
    assert small["bw"] == 1 and small["peak"][-1] == (1, "Q8_0")
    # keyed by the thread count: 2 threads measure (and keep the 1-thread entry)
    rl.machine_bounds(2, [], cache_dir=tmp_path, err=io.StringIO())
    assert small["bw"] == 2 and {n for n, _ in small["peak"][-2:]} == {2}
    assert len(json.loads((tmp_path / rl.CACHE_FILE).read_text())["machines"]) == 2
    # refreshed
    n = len(small["peak"])
    rl.machine_bounds(1, [], cache_dir=tmp_path, refresh=True, err=io.StringIO())
    assert small["bw"] == 3 and len(small["peak"]) == n + 2
    assert set(json.loads((tmp_path / rl.CACHE_FILE).read_text())["machines"][key]["matmul"]["gflops"]) == \
        {"F32", "F16"}


def test_unreadable_cache_is_measured_again(tmp_path, small):
    (tmp_path / rl.CACHE_FILE).write_text("{not json")
    rl.machine_bounds(1, [], cache_dir=tmp_path, err=io.StringIO())
    assert small["bw"] == 1 and json.loads((tmp_path / rl.CACHE_FILE).read_text())["format"] == rl.FORMAT


def test_machine_key_names_cpu_threads_and_build():
    key, cpu, build = rl.machine_key(3)
    assert cpu in key and "3 threads" in key and build in key and "ggml" in build and "cpu " in build


# --------------------------------------------------------------------------- the command

def test_options():
    assert parse_args([]).roofline is False
    p = parse_args(["--roofline"])
    assert p.roofline and not p.roofline_refresh
    p = parse_args(["--roofline-refresh"])
    assert p.roofline and p.roofline_refresh


def test_bench_roofline_json_has_the_fields(tmp_path, capsys, small):
    code = bm.main(["--synthetic", "tiny", "-p", "16", "-n", "4", "-pg", "8,2", "-r", "1", "-t", "1", "-o", "json",
                    "--roofline", "--cache-dir", str(tmp_path)])
    cap = capsys.readouterr()
    assert code == 0 and "measuring this machine" in cap.err
    pp, tg, pg = json.loads(cap.out)
    for r in (pp, tg, pg):
        assert r["machine_bw_gbps"] > 0 and r["machine_gflops"] > 0
        assert list(r)[-len(rl.FIELDS):] == list(rl.FIELDS)
    assert pp["roofline_flops"] > 0 and pp["roofline_gflops"] > 0 and pp["roofline_gbps"] is None
    assert pp["roofline_peak_pct"] == pytest.approx(100 * pp["roofline_gflops"] / pp["machine_gflops"])
    assert pp["roofline_gflops"] == pytest.approx(pp["roofline_flops"] * pp["avg_ts"] / 16 / 1e9)
    assert tg["roofline_weight_bytes"] > 100_000 and tg["roofline_kv_bytes"] > 0 and tg["roofline_gflops"] is None
    assert tg["roofline_bw_pct"] == pytest.approx(100 * tg["roofline_gbps"] / tg["machine_bw_gbps"])
    assert tg["roofline_gbps"] == pytest.approx(
        (tg["roofline_weight_bytes"] + tg["roofline_kv_bytes"]) * tg["avg_ts"] / 1e9, rel=1e-3)
    assert pg["roofline_gbps"] > 0 and pg["roofline_gflops"] > 0
    # the second run reads the cache
    n = small["bw"]
    assert bm.main(["--synthetic", "tiny", "-p", "16", "-n", "0", "-r", "1", "-t", "1", "-o", "jsonl",
                    "--roofline", "--cache-dir", str(tmp_path)]) == 0
    assert small["bw"] == n and "measuring" not in capsys.readouterr().err


def test_without_roofline_nothing_changes(tmp_path, capsys, small):
    for fmt in ("json", "md", "csv"):
        assert bm.main(["--synthetic", "tiny", "-p", "16", "-n", "4", "-r", "1", "-t", "1", "-o", fmt,
                        "--cache-dir", str(tmp_path)]) == 0
        out = capsys.readouterr().out
        if fmt == "json":
            assert not set(json.loads(out)[0]) & set(rl.FIELDS)
        elif fmt == "csv":
            assert not set(next(csv.reader(io.StringIO(out)))) & set(rl.FIELDS)
        else:
            assert "GB/s" not in out and "% peak" not in out and "roofline," not in out
    assert small["bw"] == 0 and not (tmp_path / rl.CACHE_FILE).exists()


def _two_results():
    w, b = _work(), _bounds()
    rs = [_res(8, 0, samples=(1000,)), _res(0, 4, samples=(1000,))]
    for r in rs:
        r.roofline = rl.roofline_fields(r, w, b)
    return rs, b


def _params_roofline():
    return bm.BenchParams(n_threads=[1], roofline=True)


def test_markdown_columns_and_footnote():
    rs, b = _two_results()
    p = _params_roofline()
    buf = io.StringIO()
    pr = bm.make_printer("md", buf, p, False, "build")
    pr.notes = [b.describe()]
    pr.header()
    pr.rows(rs)
    pr.footer()
    lines = buf.getvalue().splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert head[-6:] == ["test", "t/s", "GB/s", "% bw", "GFLOP/s", "% peak"]
    pp = [c.strip() for c in lines[2].strip("|").split("|")]
    tg = [c.strip() for c in lines[3].strip("|").split("|")]
    assert pp[-4:-2] == ["", ""] and float(pp[-2]) > 0 and float(pp[-1]) > 0
    assert tg[-2:] == ["", ""] and float(tg[-4]) > 0
    assert any(line.startswith("roofline, 1 thread: memory 10.0 GB/s") for line in lines)
    assert "reading alone" not in b.describe()                 # bounds without the two figures
    b.bandwidth.update(gemv_gbps=6.5, copy_gbps=10.0)
    assert "over 0 MiB; reading alone 6.5, copy 10.0)" in b.describe()
    plain = bm.format_results(rs, "md", bm.BenchParams(n_threads=[1]))
    assert "GB/s" not in plain and "roofline" not in plain


def test_csv_and_sql_carry_the_fields():
    rs, _ = _two_results()
    rows = list(csv.DictReader(io.StringIO(bm.format_results(rs, "csv", _params_roofline()))))
    assert float(rows[0]["roofline_gflops"]) > 0 and rows[0]["roofline_gbps"] == ""
    assert float(rows[1]["roofline_bw_pct"]) > 0
    db = sqlite3.connect(":memory:")
    db.executescript(bm.format_results(rs, "sql", _params_roofline()))
    got = db.execute("select n_prompt, roofline_gflops, roofline_gbps, machine_bw_gbps from llama_bench").fetchall()
    assert got[0][0] == 8 and got[0][1] > 0 and got[0][2] is None and got[0][3] == 10.0
    assert got[1][2] > 0
    plain = bm.format_results(rs, "sql", bm.BenchParams(n_threads=[1]))
    assert "roofline" not in plain


def test_unreadable_model_gives_empty_fields(tmp_path, small):
    from test_benchmark import FakeEngine

    p = parse_args(["-m", "missing.gguf", "-p", "8", "-n", "0", "-r", "1", "-t", "1", "-o", "jsonl", "--roofline",
                    "--cache-dir", str(tmp_path)])
    out, err = io.StringIO(), io.StringIO()
    code, _ = bm.run(p, out, err, engine=FakeEngine())
    rec = json.loads(out.getvalue())
    assert code == 0 and "cannot read missing.gguf" in err.getvalue()
    assert all(rec[f] is None for f in rl.FIELDS)


def test_bounds_only_for_tests_on_the_cpu():
    from ggmlpy.benchmark.driver import _cpu_only

    p = bm.BenchParams()
    assert _cpu_only(p, Instance("m", 8, 0), gpu=False)
    assert not _cpu_only(p, Instance("m", 8, 0), gpu=True)
    assert _cpu_only(p, Instance("m", 8, 0, n_gpu_layers=0), gpu=True)
    assert not _cpu_only(bm.BenchParams(rpc=["h:1"]), Instance("m", 8, 0), gpu=False)


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python not installed")
def test_peer_rows_get_the_same_columns(tmp_path, capsys, small):
    code = bm.main(["--synthetic", "tiny", "-p", "16", "-n", "4", "-r", "1", "-t", "1", "-o", "jsonl",
                    "--vs", "llama.cpp", "--roofline", "--cache-dir", str(tmp_path)])
    recs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert code == 0 and [r["engine"] for r in recs] == ["ggmlpy", "llama.cpp"] * 2
    for mine, peer in (recs[:2], recs[2:]):
        for f in ("roofline_weight_bytes", "roofline_kv_bytes", "roofline_flops", "machine_bw_gbps",
                  "machine_gflops"):
            assert peer[f] == mine[f]
        rate = "roofline_gflops" if mine["n_prompt"] else "roofline_gbps"
        assert peer[rate] / mine[rate] == pytest.approx(peer["avg_ts"] / mine["avg_ts"])
