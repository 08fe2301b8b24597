"""ggmlpy bench: option parsing, llama-bench's output formats, the synthetic model, short real runs."""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from test_core_backend import rpc_server  # noqa: F401  (the loopback server fixture)

from ggmlpy import benchmark as bm
from ggmlpy.benchmark import BenchError, BenchParams, Instance, Result, parse_args, parse_int_range

# --------------------------------------------------------------------------- parsing


@pytest.mark.parametrize("text, expected", [
    ("512", [512]),
    ("16,32", [16, 32]),
    ("1-4", [1, 2, 3, 4]),
    ("1-4,8", [1, 2, 3, 4, 8]),
    ("0-1024+256", [0, 256, 512, 768, 1024]),
    ("64-512*2", [64, 128, 256, 512]),
    ("64-500*2", [64, 128, 256]),
    ("3-3", [3]),
    ("5-1", []),
])
def test_int_ranges(text, expected):
    assert parse_int_range(text) == expected


@pytest.mark.parametrize("text", ["", "a", "1-", "1,,2", "1-4*1", "0-8*2", "1-4+0", "-1", "1.5", "1-4/2"])
def test_int_range_errors(text):
    with pytest.raises(BenchError):
        parse_int_range(text)


def test_negative_only_where_allowed():
    assert parse_int_range("-1", allow_negative=True) == [-1]
    assert parse_args(["-m", "x.gguf", "-ngl", "-1,99"]).n_gpu_layers == [-1, 99]


@pytest.mark.parametrize("argv, words", [
    (["-ot", "exps"], r"invalid -ot value 'exps': expected PATTERN=DEVICE"),
    (["--override-tensor", "a=CPU;b(=CPU"], r"invalid -ot value 'b\(=CPU': 'b\(' is not a regular expression"),
    (["-ncmoe", "-1"], r"^-ncmoe -1: must be at least 0$"),
    (["-sm", "layer,row"], r"-sm row: not supported .*row splits"),
    (["-sm", "rows"], r"invalid -sm value 'rows'"),
    (["-ts", "3/x"], r"invalid -ts value '3/x'"),
    (["-ts", "1/-1"], r"invalid -ts value '1/-1': .*>= 0"),
    (["--no-host", "1"], r"--no-host 1: "),
])
def test_placement_options_are_parsed_and_refused_with_the_reason(argv, words):
    """llama-bench's placement options are options here too (``-ot`` was read as ``-o t``): ``-ot``,
    ``-ncmoe``, ``-sm layer|none``, ``-mg``, ``-ts`` and ``-nopo`` sweep like llama-bench's (test_fit.py and
    test_overrides.py run them over RPC servers); ``--no-host`` takes only the value that means ggmlpy's
    placement, any other is refused before anything runs, with the reason."""
    with pytest.raises(BenchError, match=words):
        parse_args(["-m", "x.gguf", *argv])
    p = parse_args(["-m", "x.gguf", "-ot", "none", "-ncmoe", "0", "-sm", "layer,none", "-ts", "0,3/1", "-mg", "0",
                    "--no-host", "0", "-o", "json", "-nopo", "1,0", "-n", "0"])
    assert p.output == "json" and p.no_op_offload == [True, False]
    assert (p.split_mode, p.main_gpu, p.tensor_split) == (["layer", "none"], [0], [(), (3.0, 1.0)])
    got = [(i.split_mode, i.tensor_split, i.no_op_offload) for i in bm.make_instances(p)]
    assert got == [(sm, ts, nopo) for sm in ("layer", "none") for ts in ((), (3.0, 1.0)) for nopo in (True, False)]
    # -ot: configurations ','-separated, overrides ';'-separated within one (llama-bench's syntax)
    p = parse_args(["-m", "x.gguf", "-ot", "exps=CPU;attn_.*=Vulkan0,none,", "-ncmoe", "0-2", "-n", "0"])
    assert p.tensor_buft_overrides == ["exps=CPU;attn_.*=Vulkan0", "none", "none"] and p.n_cpu_moe == [0, 1, 2]
    insts = bm.make_instances(p)
    assert [(i.n_cpu_moe, i.tensor_buft_overrides) for i in insts] == \
        [(n, ot) for n in (0, 1, 2) for ot in ("exps=CPU;attn_.*=Vulkan0", "none", "none")]
    assert len({i.model_key() for i in insts}) == 6          # each placement loads the model anew
    rec = _result(n_cpu_moe=1, tensor_buft_overrides=insts[3].tensor_buft_overrides).record()
    assert (rec["n_cpu_moe"], rec["tensor_buft_overrides"]) == (1, "exps=CPU;attn_.*=Vulkan0")


def test_defaults_are_llama_bench_defaults():
    p = parse_args(["-m", "x.gguf"])
    assert (p.n_prompt, p.n_gen, p.n_pg, p.n_depth) == ([512], [128], [], [0])
    assert (p.n_batch, p.n_ubatch, p.type_k, p.type_v) == ([2048], [512], ["f16"], ["f16"])
    assert (p.n_gpu_layers, p.flash_attn, p.devices) == ([-1], [-1], ["auto"])
    assert (p.reps, p.output, p.delay, p.progress) == (5, "md", 0, False)
    assert (p.load_mode, p.no_kv_offload, p.embeddings) == (["mmap"], [False], [False])
    assert p.n_threads == [bm.default_threads()] and p.n_threads[0] >= 1


def test_lists_repeats_and_aliases():
    p = parse_args(["-m", "a.gguf", "-m", "b.gguf", "-p", "16", "-p", "32,64", "--n_gen", "4",
                    "-pg", "8,2", "-pg", "16,4", "-fa", "on,off,auto", "-ctk", "q8_0", "-ctv", "BF16",
                    "-dev", "none,auto", "-t", "1-2", "-r", "3", "-o", "jsonl", "--delay", "0"])
    assert p.models == ["a.gguf", "b.gguf"]
    assert p.n_prompt == [16, 32, 64] and p.n_gen == [4]
    assert p.n_pg == [(8, 2), (16, 4)]
    assert p.flash_attn == [1, 0, -1]
    assert p.type_k == ["q8_0"] and p.type_v == ["bf16"]
    assert p.devices == ["none", "auto"] and p.n_threads == [1, 2]
    assert p.reps == 3 and p.output == "jsonl"


@pytest.mark.parametrize("argv, words", [
    (["-pg", "512"], "-pg"),
    (["-pg", "a,b"], "-pg"),
    (["-fa", "maybe"], "-fa"),
    (["-ctk", "q3_k"], "cache type"),
    (["-r", "0"], "repetition"),
    (["-t", "0"], "^-t 0: must be at least 1$"),             # the flag, not the API's n_threads
    (["-t", "2,-1"], "^-t -1: must be at least 1$"),
    (["-n", "-3"], "^-n -3: must be at least 0$"),
    (["-b", "0"], "^-b 0: must be at least 1$"),
    (["-p", "x"], "range"),
    (["--vs", "vllm"], "llama.cpp"),
    (["--bogus"], "unrecognized"),
    (["-o", "xml"], "invalid choice"),
    (["--type", "Q5_K"], "--type"),
    (["--synthetic", "huge"], "synthetic"),
    (["--synthetic", "70B"], r"^--synthetic: synthetic model size '70B' is not built in; the built-in sizes .* are "
                            r"tiny \(164K\), 15M \(24M\), 42M \(58M\), 110M \(134M\), 1B \(1.1B\), .*qwen3-8B "
                            r"\(8.2B\)"),
    (["-p", "1-100000000"], r"^-p: range '1-100000000' has 100,000,000 values; one list takes at most 1,024"),
    (["-p", "1-101", "-t", "1-100", "-n", "0"], r"^10,100 tests asked for \(the product of every list\); one run "
                                                r"takes at most 10,000"),
    (["-ngl", "-3"], r"^-ngl -3: must be at least -1"),
    (["-mmp", "2"], "invalid -mmp value '2'"),
    (["-lm", "mlock"], "not supported by ggmlpy's loader"),
    (["-lm", "dio"], "no mlock or direct I/O"),
    (["-lm", "fast"], "expected none or mmap"),
    (["-nkvo", "yes please"], "invalid -nkvo"),
    (["-embd", "2"], "invalid -embd"),
    (["-ctv", "q8_0", "-fa", "0"], "-ctk f16 -ctv q8_0 -fa off: a quantized V cache needs flash attention"),
    (["-ctv", "f16,q4_0", "-ctk", "q8_0", "-fa", "1,0"], "^-ctk q8_0 -ctv q4_0 -fa off: a quantized V"),
])
def test_parse_errors(argv, words):
    with pytest.raises(BenchError, match=words):
        parse_args((["-m", "x.gguf"] if "--type" not in argv and "--synthetic" not in argv else [])
                   + argv)


def test_mmap_load_mode_nkvo_and_embd_lists():
    p = parse_args(["-m", "a.gguf", "-mmp", "0,1", "-lm", "none", "--no-kv-offload", "1,0", "-embd", "1",
                    "--mmap", "1"])
    # -lm and -mmp fill one list, in command-line order (llama-bench's load_mode; -mmp is its older spelling)
    assert p.load_mode == ["none", "mmap", "none", "mmap"]
    assert p.no_kv_offload == [True, False] and p.embeddings == [True]
    assert parse_args(["-m", "a", "-lm", "mmap,none"]).load_mode == ["mmap", "none"]


def test_cache_type_pairs_that_run_are_accepted():
    # a quantized K runs without flash attention; a quantized V with it (on, or auto, which is on here)
    p = parse_args(["-m", "x", "-ctk", "q8_0,q4_0,iq4_nl", "-ctv", "f16,bf16,f32", "-fa", "0,1,auto"])
    assert len(bm.make_instances(p)) == 3 * 3 * 3 * 2
    assert parse_args(["-m", "x", "-ctk", "f16", "-ctv", "q5_1,q4_1", "-fa", "on,auto"]).type_v == ["q5_1", "q4_1"]


def test_synthetic_and_vs_options():
    p = parse_args(["--synthetic", "100m,tiny", "--type", "f16,q8_0", "--vs", "llama_cpp"])
    assert p.models == [] and p.synthetic == ["110M", "tiny"] and p.types == ["F16", "Q8_0"]
    assert p.vs == ["llama.cpp"]


def test_cartesian_product_in_llama_bench_order():
    p = parse_args(["-m", "m.gguf", "-p", "16,32", "-n", "4", "-pg", "8,2", "-t", "1,2", "-d", "0,8"])
    insts = bm.make_instances(p)
    assert len(insts) == 2 * 2 * 4
    # threads outside depth, tests innermost (pp, then tg, then pg)
    assert [(i.n_threads, i.n_depth, i.name) for i in insts[:8]] == [
        (1, 0, "pp16"), (1, 0, "pp32"), (1, 0, "tg4"), (1, 0, "pp8+tg2"),
        (1, 8, "pp16 @ d8"), (1, 8, "pp32 @ d8"), (1, 8, "tg4 @ d8"), (1, 8, "pp8+tg2 @ d8")]
    assert {i.n_ctx for i in insts if i.name == "pp8+tg2 @ d8"} == {18}
    # zero sizes are skipped
    assert [i.name for i in bm.make_instances(parse_args(["-m", "m", "-p", "0", "-n", "0,4"]))] == ["tg4"]


def test_new_options_multiply_tests_in_llama_bench_order():
    p = parse_args(["-m", "m", "-p", "8", "-n", "0", "-mmp", "0,1", "-embd", "0,1", "-nkvo", "0,1", "-t", "1"])
    insts = bm.make_instances(p)
    # load mode is a model parameter (outermost), then embeddings, then (after the cache types) nkvo
    assert [(i.load_mode, i.embeddings, i.no_kv_offload) for i in insts] == [
        (lm, e, k) for lm in ("none", "mmap") for e in (False, True) for k in (False, True)]
    # only the load mode needs another model load
    assert len({i.model_key() for i in insts}) == 2


def test_synthetic_sizes():
    from ggmlpy.models.synthetic import SIZES, parse_size

    assert parse_size("110M") == "110M" and parse_size("tiny") == "tiny"
    assert parse_size("0.1B") == "110M" and parse_size("1.1b") == "1B" and parse_size("134M") == "110M"
    assert parse_size("8B") == "qwen3-8B" and parse_size("3b") == "llama3.2-3B"
    assert parse_size("7B") == "granitehybrid-7B-A1B"          # (6.9B: before that preset, 7B was refused)
    # a count that names no built-in size is refused, not replaced by the nearest (70B is not the 30B shape,
    # 20M not the 15M one): the message lists the sizes with the parameters each writes
    for text in ("70B", "20M", "1M", "30B"):
        with pytest.raises(ValueError, match=f"'{text}' is not built in; .*110M \\(134M\\)"):
            parse_size(text)
    c = SIZES["110M"]
    assert (c.n_embd, c.n_layer, c.n_head, c.n_ff, c.n_vocab) == (768, 12, 12, 2048, 32000)
    with pytest.raises(ValueError):
        parse_size("big")


# --------------------------------------------------------------------------- results and formats

def _result(n_prompt=512, n_gen=0, n_depth=0, samples=(1_000_000_000, 2_000_000_000), engine="ggmlpy",
            **inst_kw) -> Result:
    inst = Instance("/models/m.gguf", n_prompt, n_gen, n_depth, n_threads=2, **inst_kw)
    return Result(inst=inst, engine=engine, engine_version="0.1.0", build_commit="abc1234",
                  build_number=0, cpu_info="Some CPU", gpu_info="", backends="CPU",
                  model_type="llama 110M F16", model_size=268_435_456, model_n_params=134_105_856,
                  load_mode="none", test_time="2026-01-01T00:00:00Z", samples_ns=list(samples),
                  ttft_ns=[t // 2 for t in samples], load_time_ms=12.5, ggmlpy_version="0.1.0")


def test_statistics_are_per_rep_rates():
    r = _result(n_prompt=100, samples=(1_000_000_000, 2_000_000_000))
    assert r.samples_ts == [100.0, 50.0]
    assert r.avg_ts == pytest.approx(75.0)
    assert r.stddev_ts == pytest.approx(35.3553, rel=1e-4)   # sample stddev of the rates
    assert r.avg_ns == 1_500_000_000 and r.stddev_ns == 707106781
    assert r.ttft_ms == pytest.approx(750.0)
    one = _result(samples=(5,))
    assert one.stddev_ts == 0.0 and one.stddev_ns == 0


def test_test_names():
    assert Instance("m", 512, 0).name == "pp512"
    assert Instance("m", 0, 128).name == "tg128"
    assert Instance("m", 512, 128).name == "pp512+tg128"
    assert Instance("m", 512, 0, 4096).name == "pp512 @ d4096"


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def test_markdown_like_llama_bench():
    results = [_result(), _result(n_prompt=0, n_gen=128)]
    text = bm.format_results(results, "md", BenchParams(n_threads=[2]), build="abc1234 (ggmlpy 0.1.0)")
    lines = text.splitlines()
    assert _cells(lines[0]) == ["model", "size", "params", "backend", "threads", "test", "t/s"]
    assert lines[0] == ("| model                          |       size |     params | backend    "
                        "| threads |            test |                  t/s |")
    assert lines[1] == ("| ------------------------------ | ---------: | ---------: | ---------- "
                        "| ------: | --------------: | -------------------: |")
    assert _cells(lines[2]) == ["llama 110M F16", "256.00 MiB", "134.11 M", "CPU", "2", "pp512",
                                "384.00 ± 181.02"]
    assert len(lines[2]) == len(lines[0])
    assert _cells(lines[3])[5] == "tg128"
    assert lines[-1] == "build: abc1234 (ggmlpy 0.1.0)" and lines[-2] == ""


def test_markdown_shows_non_default_params_and_gpu_columns():
    p = BenchParams(n_threads=[2], n_batch=[256], flash_attn=[0, 1], type_k=["q8_0"])
    header = _cells(bm.format_results([_result(flash_attn=1)], "md", p).splitlines()[0])
    assert header == ["model", "size", "params", "backend", "threads", "n_batch", "type_k", "fa",
                      "test", "t/s"]
    header = _cells(bm.format_results([_result()], "md", BenchParams(), gpu=True).splitlines()[0])
    assert header == ["model", "size", "params", "backend", "ngl", "test", "t/s"]
    big = _result()
    big.model_size, big.model_n_params = 3 * 1024 ** 3, 6_740_000_000
    assert _cells(bm.format_results([big], "md").splitlines()[2])[1:3] == ["3.00 GiB", "6.74 B"]


def test_markdown_vs_column():
    p = BenchParams(n_threads=[2], vs=["llama.cpp"])
    a, b = _result(), _result(engine="llama.cpp", samples=(2_000_000_000, 2_000_000_000))
    a.ratios["llama.cpp"] = bm.ratio(a, b)
    lines = bm.format_results([a, b], "md", p).splitlines()
    assert _cells(lines[0]) == ["model", "size", "params", "backend", "engine", "threads", "test",
                                "t/s", "ggmlpy/llama.cpp"]
    assert _cells(lines[2])[4] == "ggmlpy" and _cells(lines[2])[-1] == "1.50 ± 0.71"
    assert _cells(lines[3])[4] == "llama.cpp" and _cells(lines[3])[-1] == ""


def _check_types(rec: dict):
    for f in bm.FIELDS:
        v = rec[f]
        if f in bm.BOOL_FIELDS:
            assert isinstance(v, bool), f
        elif f in bm.INT_FIELDS:
            assert isinstance(v, int) and not isinstance(v, bool), f
        elif f in bm.FLOAT_FIELDS:
            assert isinstance(v, float), f
        else:
            assert isinstance(v, str), f


LLAMA_BENCH_FIELDS = [
    "build_commit", "build_number", "cpu_info", "gpu_info", "backends", "model_filename", "model_type",
    "model_size", "model_n_params", "n_batch", "n_ubatch", "n_threads", "cpu_mask", "cpu_strict", "poll",
    "type_k", "type_v", "n_gpu_layers", "n_cpu_moe", "split_mode", "main_gpu", "no_kv_offload",
    "flash_attn", "devices", "tensor_split", "tensor_buft_overrides", "load_mode", "embeddings",
    "no_op_offload", "no_host", "repack", "fit_target", "fit_min_ctx", "n_prompt", "n_gen", "n_depth",
    "test_time", "avg_ns", "stddev_ns", "avg_ts", "stddev_ts"]


def test_new_fields_in_every_format():
    r = _result(load_mode="none", no_kv_offload=True, embeddings=True)
    r.load_mode = "none"
    rec = json.loads(bm.format_results([r], "json"))[0]
    assert (rec["load_mode"], rec["no_kv_offload"], rec["embeddings"]) == ("none", True, True)
    _check_types(rec)
    row = next(csv.DictReader(io.StringIO(bm.format_results([r], "csv"))))
    assert (row["load_mode"], row["no_kv_offload"], row["embeddings"]) == ("none", "1", "1")
    p = BenchParams(n_threads=[2], load_mode=["none"], no_kv_offload=[False, True], embeddings=[True])
    lines = bm.format_results([r], "md", p).splitlines()
    assert _cells(lines[0]) == ["model", "size", "params", "backend", "threads", "nkvo", "lm", "embd",
                                "test", "t/s"]
    # llama-bench's widths; its bool and load_mode columns are right-aligned
    assert "|          nkvo |         lm |       embd |" in lines[0]
    assert "| ------------: | ---------: | ---------: |" in lines[1]
    assert _cells(lines[2])[5:8] == ["1", "none", "1"] and len(lines[2]) == len(lines[0])
    # defaults add no column
    assert _cells(bm.format_results([_result()], "md", BenchParams(n_threads=[2])).splitlines()[0]) == [
        "model", "size", "params", "backend", "threads", "test", "t/s"]


def test_json_and_jsonl_fields_and_types():
    results = [_result(), _result(n_prompt=16, n_gen=4, n_depth=8)]
    for fmt in ("json", "jsonl"):
        text = bm.format_results(results, fmt)
        recs = json.loads(text) if fmt == "json" else [json.loads(line) for line in text.splitlines()]
        assert len(recs) == 2
        for rec in recs:
            assert list(rec)[:len(LLAMA_BENCH_FIELDS)] == LLAMA_BENCH_FIELDS
            assert list(rec)[len(LLAMA_BENCH_FIELDS):len(LLAMA_BENCH_FIELDS) + 2] == [
                "samples_ns", "samples_ts"]
            _check_types(rec)
            assert all(isinstance(x, int) for x in rec["samples_ns"])
            assert all(isinstance(x, float) for x in rec["samples_ts"])
            for extra in ("engine", "engine_version", "ggmlpy_version", "load_time_ms", "ttft_ms"):
                assert extra in rec
            assert rec["flash_attn"] == -1 and rec["no_kv_offload"] is False
        assert recs[1]["n_depth"] == 8 and recs[1]["avg_ts"] == pytest.approx(15.0)


def test_csv_fields_quoted_and_parseable():
    text = bm.format_results([_result(), _result(n_prompt=0, n_gen=32)], "csv")
    lines = text.splitlines()
    assert lines[0].split(",")[:len(LLAMA_BENCH_FIELDS)] == LLAMA_BENCH_FIELDS
    assert lines[1].startswith('"abc1234","0",')
    rows = list(csv.DictReader(io.StringIO(text)))
    assert len(rows) == 2
    assert int(rows[1]["n_gen"]) == 32 and float(rows[1]["avg_ts"]) > 0
    assert rows[0]["cpu_strict"] == "0" and rows[0]["engine"] == "ggmlpy"
    assert rows[0]["avg_ts"] == "384.000000"


def test_sql_loads_into_sqlite():
    text = bm.format_results([_result(), _result(n_prompt=0, n_gen=8)], "sql")
    db = sqlite3.connect(":memory:")
    db.executescript(text)
    assert db.execute("select count(*), sum(n_gen) from llama_bench").fetchone() == (2, 8)


# --------------------------------------------------------------------------- the loop, on a fake engine

class FakeEngine(bm.Engine):
    """Records what the loop asks; each decoded token 'costs' 10 µs."""

    name = "fake"
    version = "9"

    def __init__(self):
        super().__init__()
        self.calls: list[tuple] = []
        self.loads = 0

    def system(self):
        return {"build_commit": "c", "build_number": 1, "cpu_info": "cpu", "gpu_info": ""}

    def load(self, inst):
        self.loads += 1
        self.info = {"desc": "fake 1M F16", "size": 2 << 20, "n_params": 10 ** 6, "n_vocab": 100,
                     "backends": "CPU"}

    def new_context(self, inst):
        self.calls.append(("ctx", inst.n_ctx))

    def clear(self):
        self.calls.append(("clear",))

    def decode(self, tokens):
        assert tokens.dtype == np.int32 and tokens.min() >= 0 and tokens.max() < 100
        self.calls.append(("decode", len(tokens)))
        time.sleep(1e-5 * len(tokens))


def test_run_instance_follows_llama_bench():
    eng = FakeEngine()
    inst = Instance("m.gguf", n_prompt=10, n_gen=3, n_depth=5, n_batch=4)
    msgs: list[str] = []
    res = bm.run_instance(eng, inst, reps=2, seed=0, progress=msgs.append)
    decodes = [c for c in eng.calls]
    assert decodes[0] == ("ctx", 18)
    # warm-up: the prompt in n_batch chunks, one token
    assert decodes[1:6] == [("clear",), ("decode", 4), ("decode", 4), ("decode", 2), ("decode", 1)]
    rep = [("clear",), ("decode", 4), ("decode", 1),                   # depth 5
           ("decode", 4), ("decode", 4), ("decode", 2),                # prompt 10
           ("decode", 1), ("decode", 1), ("decode", 1)]                # 3 generated
    assert decodes[6:] == rep + rep
    assert len(res.samples_ns) == 2 and all(t > 0 for t in res.samples_ns)
    assert all(0 < f < t for f, t in zip(res.ttft_ns, res.samples_ns))
    assert res.avg_ts > 0 and res.model_type == "fake 1M F16"
    assert msgs == ["warmup prompt run", "warmup generation run",
                    "depth run 1/2", "prompt run 1/2", "generation run 1/2",
                    "depth run 2/2", "prompt run 2/2", "generation run 2/2"]


def test_same_seed_same_tokens():
    seen = []

    class Rec(FakeEngine):
        def decode(self, tokens):
            seen.append(tokens.tolist())

    for _ in range(2):
        bm.run_instance(Rec(), Instance("m", 8, 2), reps=1, seed=3, index=7)
    assert seen[:len(seen) // 2] == seen[len(seen) // 2:]


def test_run_with_fake_engine_reuses_model_and_prints(tmp_path):
    p = parse_args(["-m", "a.gguf", "-p", "8,16", "-n", "2", "-r", "2", "-t", "1,2", "-o", "jsonl",
                    "--progress", "--no-warmup"])
    out, err = io.StringIO(), io.StringIO()
    eng = FakeEngine()
    code, results = bm.run(p, out, err, engine=eng)
    assert code == 0 and len(results) == 6 and eng.loads == 1
    recs = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [r["n_threads"] for r in recs] == [1, 1, 1, 2, 2, 2]
    assert [r["engine"] for r in recs] == ["fake"] * 6
    assert "benchmark 1/6: starting" in err.getvalue()
    assert "benchmark 6/6: fake: generation run 2/2" in err.getvalue()
    assert "warmup" not in err.getvalue()


def test_failed_test_is_counted_and_others_run():
    class Failing(FakeEngine):
        def new_context(self, inst):
            if inst.n_gen:
                raise MemoryError("no room")

    out, err = io.StringIO(), io.StringIO()
    code, results = bm.run(parse_args(["-m", "a", "-p", "8", "-n", "2", "-r", "1"]), out, err,
                           engine=Failing())
    assert code == 1 and [r.inst.name for r in results] == ["pp8"]
    assert "no room" in err.getvalue() and "pp8" in out.getvalue()


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    results = [_result(n_prompt=n, samples=(n * 1000, n * 1100)) for n in (64, 128, 256)]
    results += [_result(n_prompt=n, engine="llama.cpp", samples=(n * 900, n * 950)) for n in (64, 128, 256)]
    results += [_result(n_prompt=0, n_gen=16)]
    assert bm.swept_variable(results) == "n_prompt"
    path = tmp_path / "pp.png"
    bm.plot(results, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    depth = [_result(n_prompt=0, n_gen=8, n_depth=d) for d in (0, 64)]
    assert bm.swept_variable(depth) == "n_depth"
    bm.plot(depth, tmp_path / "d.png")
    assert (tmp_path / "d.png").stat().st_size > 1000


def test_plot_without_matplotlib_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(BenchError, match="pip install matplotlib"):
        bm.plot([_result()], "x.png")


def test_vs_llama_cpp_missing_gives_clear_message(tmp_path, monkeypatch, capsys):
    # A llama_cpp that cannot be imported shadows any installed one in the worker.
    fake = tmp_path / "shadow" / "llama_cpp"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('simulated: not installed')\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(fake.parent)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    from ggmlpy.models.synthetic import write_synthetic

    # a real GGUF (a file that is not one is reported first, before any peer starts); never loaded
    model = write_synthetic(tmp_path / "a.gguf", "tiny", "F16")
    code = bm.main(["-m", str(model), "-p", "8", "-n", "0", "-r", "1", "--vs", "llama.cpp"])
    err = capsys.readouterr().err
    assert code == 1
    assert "pip install llama-cpp-python" in err and "simulated" in err


def test_worker_never_imports_ggmlpy(tmp_path):
    # The worker runs benchmark/worker.py as a script; it must not load ggmlpy's ggml next to llama.cpp's: it
    # imports its folder under another name, and ggmlpy is blocked there (None in sys.modules).
    code = ("import runpy, sys; sys.argv = [sys.argv[0], '--engine-worker', 'nothing'];\n"
            f"try:\n    runpy.run_path({bm.worker.__file__!r}, run_name='__main__')\n"
            "except SystemExit:\n    pass\n"
            "assert sys.modules.get('ggmlpy') is None and 'ggmlpy._core' not in sys.modules\n"
            "assert not [m for m in sys.modules if m.startswith('ggmlpy.')]\n"
            f"assert '{bm.worker.WORKER_PACKAGE}.llamacpp' in sys.modules     # the engine's module did load\n"
            "print('CLEAN', file=sys.stderr)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "CLEAN" in r.stderr, r.stderr
    assert json.loads(r.stdout.splitlines()[0])["ok"] is False


def test_cli_bench_help(capsys):
    from ggmlpy import cli

    assert cli.main(["bench", "--help"]) == 0
    assert "-ngl" in capsys.readouterr().out
    # a usage error is exit status 2 in every ggmlpy command (llama-bench exits 1; both are a failure to a script)
    assert cli.main(["bench", "-p", "nonsense"]) == 2


# --------------------------------------------------------------------------- the synthetic model file

def _gguf_pypi():
    return pytest.importorskip("gguf")


@pytest.mark.parametrize("wtype", ["F16", "Q8_0", "Q4_0"])
def test_synthetic_gguf_reads_back(tmp_path, wtype):
    from ggmlpy.models.synthetic import SIZES, write_synthetic

    t0 = time.perf_counter()
    path = write_synthetic(tmp_path / "tiny.gguf", "tiny", wtype, seed=1)
    assert time.perf_counter() - t0 < 2
    cfg = SIZES["tiny"]
    gg = _gguf_pypi()
    r = gg.GGUFReader(str(path))

    def field(key):
        f = r.get_field(key)
        assert f is not None, key
        return f.contents()

    assert field("general.architecture") == "llama"
    assert field("tokenizer.ggml.model") == "none"
    assert field("llama.vocab_size") == cfg.n_vocab
    assert field("llama.block_count") == 2 and field("llama.embedding_length") == 64
    assert field("llama.attention.head_count") == 4 and field("llama.attention.head_count_kv") == 2
    assert field("llama.feed_forward_length") == 192 and field("llama.rope.dimension_count") == 16
    assert field("general.file_type") == {"F16": 1, "Q8_0": 7, "Q4_0": 2}[wtype]
    assert field("llama.attention.layer_norm_rms_epsilon") == pytest.approx(1e-5)
    for key in ("llama.context_length", "llama.vocab_size", "llama.block_count"):
        assert r.get_field(key).types == [gg.GGUFValueType.UINT32]
    if wtype != "F16":
        assert field("general.quantization_version") == 2
    tensors = {t.name: t for t in r.tensors}
    assert len(tensors) == 3 + 9 * cfg.n_layer
    assert list(tensors["token_embd.weight"].shape) == [64, 512]
    assert list(tensors["output.weight"].shape) == [64, 512]
    assert list(tensors["blk.1.attn_k.weight"].shape) == [64, 32]
    assert list(tensors["blk.0.attn_output.weight"].shape) == [64, 64]
    assert list(tensors["blk.0.ffn_down.weight"].shape) == [192, 64]
    assert list(tensors["blk.0.ffn_up.weight"].shape) == [64, 192]
    assert tensors["blk.0.attn_norm.weight"].tensor_type == gg.GGMLQuantizationType.F32
    assert tensors["blk.0.attn_q.weight"].tensor_type == getattr(gg.GGMLQuantizationType, wtype)
    assert np.all(tensors["output_norm.weight"].data == 1)
    w = gg.quants.dequantize(tensors["blk.0.ffn_gate.weight"].data,
                             tensors["blk.0.ffn_gate.weight"].tensor_type)
    assert w.shape == (192, 64) and 0.015 < float(np.std(w)) < 0.025

    from ggmlpy import gguf as ggguf

    mine = ggguf.GGUFReader(str(path))
    assert mine.metadata["general.architecture"] == "llama"
    assert mine.metadata["llama.vocab_size"] == 512
    assert {t.name: tuple(t.ne) for t in mine.tensors}["blk.0.ffn_down.weight"][:2] == (192, 64)


def test_synthetic_is_deterministic_and_cached(tmp_path):
    from ggmlpy.models.synthetic import synthetic_path, write_synthetic

    a = write_synthetic(tmp_path / "a.gguf", "tiny", "Q8_0", seed=5)
    b = write_synthetic(tmp_path / "b.gguf", "tiny", "Q8_0", seed=5)
    c = write_synthetic(tmp_path / "c.gguf", "tiny", "Q8_0", seed=6)
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()
    p1 = synthetic_path("tiny", "F16", cache_dir=tmp_path / "cache")
    mtime = p1.stat().st_mtime_ns
    p2 = synthetic_path("tiny", "f16", cache_dir=tmp_path / "cache")
    assert p1 == p2 and p2.stat().st_mtime_ns == mtime
    assert [f.name for f in (tmp_path / "cache").iterdir()] == [p1.name]   # no temporary left
    p1.write_bytes(b"GGUF truncated")                                        # a broken file is rewritten
    assert synthetic_path("tiny", "F16", cache_dir=tmp_path / "cache").stat().st_size > 1000
    monkey_env = dict(os.environ, GGMLPY_CACHE=str(tmp_path / "env"))
    r = subprocess.run([sys.executable, "-c", "from ggmlpy.models.synthetic import cache_dir; "
                        "print(cache_dir())"], env=monkey_env, capture_output=True, text=True)
    assert Path(r.stdout.strip()) == tmp_path / "env"


@pytest.mark.parametrize("arch", ["qwen3", "qwen3moe", "gemma3"])
def test_synthetic_architectures_have_llama_cpp_names_and_keys(tmp_path, arch):
    """The keys and tensors llama.cpp's loader reads for each architecture (its src/models/<arch>.cpp)."""
    from ggmlpy import gguf as ggguf
    from ggmlpy.models.synthetic import SIZES, for_arch, synthetic_path, tensor_specs

    cfg = for_arch(SIZES["tiny"], arch)
    path = synthetic_path("tiny", "Q8_0", cache_dir=tmp_path, arch=arch)
    assert path.name.startswith(f"synthetic-{arch}-tiny-Q8_0")
    r = ggguf.GGUFReader(str(path))
    md = r.metadata
    assert md["general.architecture"] == arch and md[f"{arch}.block_count"] == 2
    assert md[f"{arch}.attention.key_length"] == md[f"{arch}.attention.value_length"] == 16
    ne = {t.name: tuple(t.ne) for t in r.tensors}
    types = {t.name: t.type.name for t in r.tensors}
    assert ne["blk.1.attn_q_norm.weight"] == ne["blk.1.attn_k_norm.weight"] == (16,)
    if arch == "qwen3moe":
        assert (md["qwen3moe.expert_count"], md["qwen3moe.expert_used_count"]) == (8, 2)
        f = md["qwen3moe.expert_feed_forward_length"]
        assert ne["blk.0.ffn_gate_exps.weight"] == (64, f, 8) and ne["blk.0.ffn_down_exps.weight"] == (f, 64, 8)
        assert ne["blk.0.ffn_gate_inp.weight"] == (64, 8) and types["blk.0.ffn_gate_inp.weight"] == "F32"
        assert types["blk.0.ffn_up_exps.weight"] == "Q8_0" and "blk.0.ffn_up.weight" not in ne
    if arch == "gemma3":
        assert md["gemma3.attention.sliding_window"] == cfg.sliding_window == 512
        assert "output.weight" not in ne                       # tied to token_embd
        assert ne["blk.0.post_attention_norm.weight"] == ne["blk.0.post_ffw_norm.weight"] == (64,)
    assert len(ne) == len(tensor_specs(cfg)) and cfg.n_params == sum(int(np.prod(v)) for v in ne.values())
    with pytest.raises(ValueError, match="architecture"):
        synthetic_path("tiny", "F16", cache_dir=tmp_path, arch="bert")


# --------------------------------------------------------------------------- real runs (ggmlpy's model + runner)

def test_real_run_on_tiny_model(tmp_path, capsys):
    """Needs ggmlpy.models.load_model and ggmlpy.runner.Runner."""
    code = bm.main(["--synthetic", "tiny", "--type", "F16", "-p", "16", "-n", "4", "-pg", "8,2",
                    "-d", "0,8", "-r", "2", "-t", "1", "-o", "json", "--cache-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    recs = json.loads(out)
    assert [(r["n_prompt"], r["n_gen"], r["n_depth"]) for r in recs] == [
        (16, 0, 0), (0, 4, 0), (8, 2, 0), (16, 0, 8), (0, 4, 8), (8, 2, 8)]
    for r in recs:
        assert r["avg_ts"] > 0 and len(r["samples_ts"]) == 2 and r["engine"] == "ggmlpy"
        assert r["model_type"].startswith("llama") and r["model_n_params"] > 100_000
        assert r["ttft_ms"] > 0 and r["load_time_ms"] > 0
    assert bm.main(["--synthetic", "tiny", "-p", "16", "-n", "4", "-r", "1", "-v",
                    "--cache-dir", str(tmp_path)]) == 0
    cap = capsys.readouterr()
    assert "| pp16 |" in cap.out.replace(" ", "").replace("|pp16|", "| pp16 |")
    assert "memory of pp16" in cap.err


@pytest.mark.rpc
def test_rpc_server_takes_the_layers(tmp_path, capsys, rpc_server):  # noqa: F811
    """-rpc with -ngl 99 puts the model on a real loopback server (backend column RPC)."""
    code = bm.main(["--synthetic", "tiny", "-p", "8", "-n", "2", "-r", "1", "-t", "1", "-o", "json",
                    "-rpc", rpc_server, "-ngl", "0,99", "--cache-dir", str(tmp_path)])
    recs = json.loads(capsys.readouterr().out)
    assert code == 0
    assert [(r["n_gpu_layers"], r["backends"]) for r in recs] == [(0, "CPU"), (0, "CPU"), (99, "RPC"), (99, "RPC")]
    assert all(r["avg_ts"] > 0 for r in recs)


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python not installed")
def test_vs_llama_cpp_for_real(tmp_path, capsys):
    """The same tests through llama-cpp-python in its worker process, on the same synthetic file."""
    code = bm.main(["--synthetic", "tiny", "-p", "16", "-n", "4", "-r", "2", "-t", "1", "-o", "jsonl",
                    "--vs", "llama.cpp", "--cache-dir", str(tmp_path)])
    recs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert code == 0
    assert [(r["engine"], r["n_prompt"], r["n_gen"]) for r in recs] == [
        ("ggmlpy", 16, 0), ("llama.cpp", 16, 0), ("ggmlpy", 0, 4), ("llama.cpp", 0, 4)]
    for mine, peer in (recs[:2], recs[2:]):
        assert peer["avg_ts"] > 0 and peer["model_n_params"] == mine["model_n_params"]
        assert peer["model_filename"] == mine["model_filename"]
        assert mine["ratio_vs_llama_cpp"] == pytest.approx(mine["avg_ts"] / peer["avg_ts"])
        assert peer["ratio_vs_llama_cpp"] is None


# --------------------------------------------------------------------------- what -mmp, -nkvo and -embd change


def test_mmp_decides_how_ggmlpy_reads_the_weights(tmp_path, monkeypatch):
    """-mmp 1 (-lm mmap) loads through a memory map of the file, -mmp 0 (-lm none) with read(2)."""
    import ggmlpy.weights as weights_mod  # WeightLoader.load opens the file
    from ggmlpy import gguf

    opened = []
    real = weights_mod.open_data

    def spy(path, mmap=False):
        f = real(path, mmap=mmap)
        opened.append(type(f))
        return f

    monkeypatch.setattr(weights_mod, "open_data", spy)
    out = io.StringIO()
    code, results = bm.run(parse_args(["--synthetic", "tiny", "-p", "8", "-n", "0", "-r", "1", "-t", "1",
                                       "-mmp", "0,1", "-o", "json", "--cache-dir", str(tmp_path)]),
                           out, io.StringIO())
    assert code == 0
    assert [o is gguf.MappedFile for o in opened] == [False, True]
    assert [r["load_mode"] for r in json.loads(out.getvalue())] == ["none", "mmap"]


@pytest.mark.rpc
def test_nkvo_keeps_the_cache_in_host_memory(tmp_path, rpc_server):  # noqa: F811
    """-nkvo 1 with the layers on a (loopback RPC) device: the K/V cache is in host buffers; -nkvo 0: on the
    device."""
    seen = []

    class Spy(bm.GgmlpyEngine):
        def new_context(self, inst):
            super().new_context(inst)
            cache = self.rt.cache
            seen.append((inst.no_kv_offload, {t.is_host for t in cache.keys + cache.values}))

    out = io.StringIO()
    p = parse_args(["--synthetic", "tiny", "-p", "8", "-n", "0", "-r", "1", "-t", "1", "-rpc", rpc_server,
                    "-ngl", "99", "-nkvo", "0,1", "-o", "json", "--cache-dir", str(tmp_path)])
    p.models = bm._synthetic_models(p, io.StringIO())
    code, _ = bm.run(p, out, io.StringIO(), engine=Spy(rpc=p.rpc))
    assert code == 0
    assert seen == [(False, {False}), (True, {True})]
    recs = json.loads(out.getvalue())
    assert [(r["no_kv_offload"], r["backends"]) for r in recs] == [(False, "RPC"), (True, "RPC")]


def test_embd_measures_the_embeddings_path(tmp_path):
    """-embd 1: every decode outputs the hidden state of every token (n_embd wide), not the last token's
    logits."""
    outputs = []

    class Spy(bm.GgmlpyEngine):
        def new_context(self, inst):
            super().new_context(inst)
            real = self.rt.decode

            def decode(tokens, **kw):
                res = real(tokens, **kw)
                outputs.append((inst.embeddings, len(tokens), res.shape))
                return res

            self.rt.decode = decode

    path = str(bm._synthetic_models(parse_args(["--synthetic", "tiny", "--cache-dir", str(tmp_path)]),
                                    io.StringIO())[0])
    eng = Spy()
    try:
        for embd in (False, True):
            res = bm.run_instance(eng, Instance(path, 6, 2, n_threads=1, embeddings=embd), reps=1, seed=0)
            assert res.record()["embeddings"] is embd
        n_embd, n_vocab = eng.model.config.n_embd, eng.model.n_vocab
    finally:
        eng.close()
    assert {o for o in outputs if not o[0]} == {(False, 6, (1, n_vocab)), (False, 1, (1, n_vocab))}
    assert {o for o in outputs if o[0]} == {(True, 6, (6, n_embd)), (True, 1, (1, n_embd))}


class _FakeParams:
    def __init__(self, **fields):
        self.__dict__.update(fields)


def _fake_llama_cpp(new_api: bool):
    """Just enough of llama-cpp-python's low-level API to see what LlamaCppEngine sets."""
    import types

    ll = types.SimpleNamespace(__version__="0.0-fake", made={})
    ll.llama_log_callback = lambda fn: fn
    ll.llama_log_set = lambda cb, data: None
    ll.llama_backend_init = lambda: None
    model_fields = dict(n_gpu_layers=0, load_mode=-1) if new_api else dict(n_gpu_layers=0, use_mmap=True)
    ll.llama_model_default_params = lambda: _FakeParams(**model_fields)
    ll.llama_context_default_params = lambda: _FakeParams(offload_kqv=True, embeddings=False)

    def load(path, mp):
        ll.made["model"] = mp
        return object()

    def init(model, cp):
        ll.made["context"] = cp
        return object()

    ll.llama_model_load_from_file = load
    ll.llama_init_from_model = init
    ll.llama_model_desc = lambda m, buf, n: None
    ll.llama_model_get_vocab = lambda m: None
    ll.llama_vocab_n_tokens = lambda v: 100
    ll.llama_model_size = lambda m: 1
    ll.llama_model_n_params = lambda m: 1
    ll.llama_free = lambda c: None
    ll.llama_model_free = lambda m: None
    return ll


@pytest.mark.parametrize("new_api", [True, False])
def test_llama_cpp_peer_gets_the_same_options(monkeypatch, new_api):
    """--vs llama.cpp passes -mmp/-lm (load_mode, or use_mmap in older llama-cpp-python), -nkvo (offload_kqv)
    and -embd (embeddings) to llama.cpp."""
    ll = _fake_llama_cpp(new_api)
    monkeypatch.setitem(sys.modules, "llama_cpp", ll)
    eng = bm.LlamaCppEngine()
    for lm, nkvo, embd in (("none", True, True), ("mmap", False, False)):
        inst = Instance("m.gguf", 8, 0, load_mode=lm, no_kv_offload=nkvo, embeddings=embd)
        eng.load(inst)
        eng.new_context(inst)
        mp, cp = ll.made["model"], ll.made["context"]
        if new_api:
            assert mp.load_mode == {"none": 0, "mmap": 1}[lm]      # LLAMA_LOAD_MODE_NONE / _MMAP
        else:
            assert mp.use_mmap is (lm == "mmap")
        assert cp.offload_kqv is (not nkvo) and cp.embeddings is embd


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python not installed")
def test_vs_llama_cpp_with_the_new_options(tmp_path, capsys):
    code = bm.main(["--synthetic", "tiny", "-p", "8", "-n", "2", "-r", "1", "-t", "1", "-o", "jsonl",
                    "-mmp", "0", "-nkvo", "1", "-embd", "1", "-ctk", "f32", "-fa", "0",
                    "--vs", "llama.cpp", "--cache-dir", str(tmp_path)])
    recs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert code == 0 and [r["engine"] for r in recs] == ["ggmlpy", "llama.cpp"] * 2
    for r in recs:
        assert r["avg_ts"] > 0 and (r["load_mode"], r["no_kv_offload"], r["embeddings"]) == ("none", True, True)
        assert (r["type_k"], r["type_v"], r["flash_attn"]) == ("f32", "f16", 0)     # mixed types too


# --------------------------------------------------------------------------- --repack and --rounds

def test_repack_sweeps_reloads_and_is_written():
    p = parse_args(["-m", "a.gguf", "-p", "8", "-n", "0", "--repack", "0,1"])
    insts = bm.make_instances(p)
    assert [i.repack for i in insts] == [False, True]
    assert insts[0].model_key() != insts[1].model_key()          # the weights are placed at load
    assert parse_args(["-m", "a.gguf"]).repack == [True]          # llama-bench's default
    with pytest.raises(BenchError, match="--repack"):
        parse_args(["-m", "a.gguf", "--repack", "2"])
    out = io.StringIO()
    code, results = bm.run(p, out, io.StringIO(), engine=FakeEngine())
    assert code == 0 and [r.inst.repack for r in results] == [False, True]
    header = _cells(out.getvalue().splitlines()[0])
    assert header[header.index("test") - 1] == "repack"
    assert [_cells(line)[header.index("repack")] for line in out.getvalue().splitlines()[2:4]] == ["0", "1"]
    rec = json.loads(bm.format_results(results[:1], "json"))[0]
    assert rec["repack"] is False and list(rec).index("repack") == list(rec).index("no_host") + 1
    # the default adds no column
    assert "repack" not in bm.format_results(results[1:], "md", parse_args(["-m", "a.gguf"]))


def test_ggmlpy_engine_loads_with_and_without_repack(tmp_path):
    from ggmlpy.models.synthetic import write_synthetic

    path = str(write_synthetic(tmp_path / "q4.gguf", "tiny", "Q4_0"))
    eng = bm.GgmlpyEngine()
    try:
        for repack in (False, True):
            eng.ensure_model(Instance(path, 8, 0, repack=repack))
            w = eng.model.weights["blk.0.ffn_gate_up.weight"]
            offered = any(b.name == "CPU_REPACK" for b in __import__("ggmlpy").device("cpu").extra_buffer_types())
            assert w.is_repacked == (repack and offered)
    finally:
        eng.close()


@pytest.mark.parametrize("has_field", [True, False])
def test_llama_cpp_peer_gets_repack(monkeypatch, has_field):
    ll = _fake_llama_cpp(True)
    if has_field:
        made = ll.llama_model_default_params
        ll.llama_model_default_params = lambda: _FakeParams(**vars(made()), use_extra_bufts=True)
    monkeypatch.setitem(sys.modules, "llama_cpp", ll)
    eng = bm.LlamaCppEngine()
    for repack in (False, True):
        inst = Instance("m.gguf", 8, 0, repack=repack)
        if has_field:
            eng.load(inst)
            assert ll.made["model"].use_extra_bufts is repack
        elif not repack:
            with pytest.raises(BenchError, match="--repack 0"):
                eng.load(inst)
        else:
            eng.load(inst)                                        # nothing to set: repacking is its default


def test_round_ratio_is_the_median_of_the_rounds():
    assert bm.round_ratio([1.0, 5.0, 1.2]) == (1.2, pytest.approx(np.std([1.0, 5.0, 1.2], ddof=1)))
    assert bm.round_ratio([1.0, 1.5])[0] == 1.25
    assert bm.round_ratio([float("nan"), 2.0]) == (2.0, 0.0)
    assert all(np.isnan(bm.round_ratio([])))


def test_rounds_repeat_each_test_and_pool_the_repetitions():
    eng = FakeEngine()
    p = parse_args(["-m", "a.gguf", "-p", "8", "-n", "0", "-r", "2", "--rounds", "3", "--no-warmup"])
    code, results = bm.run(p, io.StringIO(), io.StringIO(), engine=eng)
    assert code == 0 and len(results) == 1
    assert len(results[0].samples_ns) == 6                        # 2 repetitions x 3 rounds
    assert sum(1 for c in eng.calls if c[0] == "ctx") == 3        # a fresh context each round
    with pytest.raises(BenchError, match="--rounds"):
        parse_args(["-m", "a.gguf", "--rounds", "0"])


def test_rounds_alternate_which_engine_runs_first(monkeypatch):
    """A B B A: the peers run first in odd rounds, so neither engine always follows the other; each
    round's ratio pairs that round's two runs."""
    order: list[str] = []
    # a clock the fakes' tokens advance (10 µs each), not a sleep: a busy machine oversleeps unevenly
    clock = [0]
    monkeypatch.setattr(bm.engines.time, "perf_counter_ns", lambda: clock[0])

    class Timed(FakeEngine):
        def decode(self, tokens):
            self.calls.append(("decode", len(tokens)))
            clock[0] += 10_000 * len(tokens)

    class Mine(Timed):
        def new_context(self, inst):
            order.append("ggmlpy")

    class Peer:
        def __init__(self, engine, verbose=False):
            self.engine, self.version, self.n = engine, "1", 0

        def run(self, inst, progress_prefix=None, **kw):
            order.append("peer")
            self.n += 1
            eng = Timed()
            eng.name = "llama.cpp"
            r = bm.run_instance(eng, inst, **kw)
            r.samples_ns = [s * self.n for s in r.samples_ns]        # round k: the peer k times slower
            return r

        def close(self):
            pass

    monkeypatch.setattr(bm.driver, "WorkerClient", Peer)         # where run() looks it up
    p = parse_args(["-m", "a.gguf", "-p", "256", "-n", "0", "-r", "1", "--rounds", "4", "--no-warmup",
                    "--vs", "llama.cpp"])
    code, results = bm.run(p, io.StringIO(), io.StringIO(), engine=Mine())
    assert code == 0
    assert order == ["ggmlpy", "peer", "peer", "ggmlpy", "ggmlpy", "peer", "peer", "ggmlpy"]
    # per-round ratios 1, 2, 3, 4 (on the fakes' clock): the median is 2.5
    assert results[0].ratios["llama.cpp"][0] == pytest.approx(2.5, rel=1e-6)


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python not installed")
def test_vs_llama_cpp_in_rounds_with_repack(tmp_path, capsys):
    code = bm.main(["--synthetic", "tiny", "--type", "Q4_0", "-p", "16", "-n", "0", "-r", "1", "-t", "1",
                    "-o", "jsonl", "--repack", "0,1", "--rounds", "2", "--vs", "llama.cpp",
                    "--cache-dir", str(tmp_path)])
    recs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert code == 0 and [r["engine"] for r in recs] == ["ggmlpy", "llama.cpp"] * 2
    assert [r["repack"] for r in recs] == [False, False, True, True]
    for r in recs:
        assert len(r["samples_ns"]) == 2                          # one repetition in each of 2 rounds
    assert all(r["ratio_vs_llama_cpp"] > 0 for r in recs if r["engine"] == "ggmlpy")


def test_the_llama_cpp_peer_reads_the_cache_types_as_ggmlpy_does():
    """The peer's ggml_type values (its module imports nothing from ggmlpy) are kvcache.CACHE_TYPES's."""
    from ggmlpy.benchmark.llamacpp import LlamaCppEngine
    from ggmlpy.kvcache import CACHE_TYPES

    assert LlamaCppEngine._GGML_TYPES == {name: int(t) for name, t in CACHE_TYPES.items()}
    assert bm.CACHE_TYPES == tuple(CACHE_TYPES)
