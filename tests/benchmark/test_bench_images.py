"""ggmlpy bench's image tests (-i N --mmproj FILE): parsing, the tests they make, the timing loop on a fake
engine, the image fields of every format, and real runs on the tiny converted vision models of
tests/vision_helpers.py (gemma3: one tile per image; idefics3: a 2 x 2 grid and the global image), with
llama.cpp's mtmd as the peer."""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import sqlite3
import time
from dataclasses import replace

import numpy as np
import pytest

from ggmlpy import benchmark as bm
from ggmlpy.benchmark import BenchError, BenchParams, Instance, Result, parse_args

HAS_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None

# --------------------------------------------------------------------------- parsing and instances


def test_parse_images_and_mmproj():
    p = parse_args(["-m", "a.gguf", "--mmproj", "a-mm.gguf", "-i", "1,2", "-i", "4-8*2"])
    assert p.n_images == [1, 2, 4, 8] and p.mmproj == ["a-mm.gguf"]
    p = parse_args(["-m", "a.gguf", "-m", "b.gguf", "--mmproj", "pa.gguf,pb.gguf", "--n-images", "3"])
    assert p.mmproj == ["pa.gguf", "pb.gguf"] and p.n_images == [3]
    p = parse_args(["-m", "a.gguf", "-m", "b.gguf", "--mmproj", "pa.gguf", "--mmproj", "pb.gguf", "-i", "1"])
    assert p.mmproj == ["pa.gguf", "pb.gguf"]
    # the defaults: no image test, no encoder
    p = parse_args(["-m", "a.gguf"])
    assert p.n_images == [] and p.mmproj == []
    assert all(i.n_images == 0 and i.mmproj == "" for i in bm.make_instances(p))


@pytest.mark.parametrize("argv, words", [
    (["-m", "a.gguf", "-i", "1"], "^-i: .*--mmproj"),
    (["-i", "1", "--mmproj", "mm.gguf"], "^-i: .*-m MODEL"),
    (["-i", "2"], "^-i: .*synthetic"),
    (["--mmproj", "mm.gguf"], "^--mmproj: needs -m"),
    (["-m", "a", "-m", "b", "-m", "c", "--mmproj", "pa,pb", "-i", "1"], "^--mmproj: 2 files for 3 models"),
    (["-m", "a", "--mmproj", "pa,pb", "-i", "1"], "^--mmproj: 2 files for 1 models"),
    (["-m", "a", "--mmproj", "pa", "-i", "x"], "invalid range"),
    (["-m", "a", "--mmproj", "pa", "-i", "-1"], "^-i -1: must be at least 0$"),     # the flag, as every bound
    (["-m", "a", "--mmproj", "pa,", "-i", "1"], "empty item"),
])
def test_parse_image_errors(argv, words):
    with pytest.raises(BenchError, match=words):
        parse_args(argv)


def test_image_instances_follow_each_models_token_tests():
    p = parse_args(["-m", "a.gguf", "-m", "b.gguf", "--mmproj", "pa.gguf,pb.gguf", "-i", "1,0,2", "-p", "8",
                    "-n", "0", "-t", "1,2", "-fa", "0,1", "-ub", "16,32", "-d", "0,4", "-ctk", "q8_0,f16"])
    insts = bm.make_instances(p)
    n_token = 2 * 2 * 2 * 2 * 2          # -t x -fa x -ub x -d x -ctk for one model, one pp test each
    n_image = 2 * 2 * 2                  # -t x -fa x the two image counts (-i 0 makes none)
    assert len(insts) == 2 * (n_token + n_image)
    first, second = insts[:n_token + n_image], insts[n_token + n_image:]
    for insts_m, model, mm in ((first, "a.gguf", "pa.gguf"), (second, "b.gguf", "pb.gguf")):
        token, image = insts_m[:n_token], insts_m[n_token:]
        assert {i.model for i in insts_m} == {model}
        assert all(i.name.startswith("pp8") and i.mmproj == "" and i.n_images == 0 for i in token)
        # the image tests sweep fa and threads only; the other lists give their first value, and no depth
        assert [(i.flash_attn, i.n_threads, i.name) for i in image] == [
            (fa, t, name) for fa in (0, 1) for t in (1, 2) for name in ("img1", "img2")]
        for i in image:
            assert (i.n_prompt, i.n_gen, i.n_depth, i.n_ctx) == (0, 0, 0, 0)
            assert (i.mmproj, i.n_ubatch, i.type_k) == (mm, 16, "q8_0")
        # the encoder comes with the model: loaded once more for the image tests, not between them
        assert len({i.model_key() for i in token}) == 1 and len({i.model_key() for i in image}) == 1
        assert token[0].model_key() != image[0].model_key()
    # one mmproj for every model
    p = parse_args(["-m", "a.gguf", "-m", "b.gguf", "--mmproj", "mm.gguf", "-i", "4", "-p", "0", "-n", "0"])
    assert [(i.model, i.mmproj, i.name) for i in bm.make_instances(p)] == [
        ("a.gguf", "mm.gguf", "img4"), ("b.gguf", "mm.gguf", "img4")]


def test_image_test_names():
    assert Instance("m", 0, 0, n_images=1).name == "img1"
    assert Instance("m", 0, 0, n_images=16, mmproj="mm").name == "img16"
    assert Instance("m", 512, 0).name == "pp512"           # the others as before


# --------------------------------------------------------------------------- results and formats


def _result(n_images=2, image_tokens=80, samples=(1_000_000_000, 2_000_000_000), engine="ggmlpy", **kw) -> Result:
    inst = Instance("/models/m.gguf", 0, 0, n_threads=2, n_images=n_images,
                    mmproj="/models/mm.gguf" if n_images else "", **kw)
    return Result(inst=inst, engine=engine, engine_version="0.1.0", build_commit="abc1234", build_number=0,
                  cpu_info="Some CPU", gpu_info="", backends="CPU", model_type="llama 16M F32", model_size=1 << 26,
                  model_n_params=16_000_000, load_mode="mmap", test_time="2026-01-01T00:00:00Z",
                  samples_ns=list(samples), ttft_ns=[0] * len(samples), load_time_ms=3.0, ggmlpy_version="0.1.0",
                  image_size=64 if n_images else 0, image_tiles=5 if n_images else 0,
                  image_tokens=image_tokens if n_images else 0)


def test_image_rate_counts_embedding_rows():
    r = _result(n_images=2, image_tokens=80, samples=(1_000_000_000, 2_000_000_000))
    assert r.n_tokens == 160
    assert r.samples_ts == [160.0, 80.0] and r.avg_ts == pytest.approx(120.0)
    # the rates survive the worker's JSON round trip (the peer's results travel as dicts)
    back = Result.from_dict(json.loads(json.dumps(r.to_dict())))
    assert back.inst == r.inst and back.samples_ts == [160.0, 80.0] and back.image_tiles == 5


def test_image_fields_only_with_images_and_last():
    img, tok = _result(), replace(_result(n_images=0), inst=Instance("/models/m.gguf", 16, 0, n_threads=2))
    with_i = parse_args(["-m", "m", "--mmproj", "mm", "-i", "2", "--vs", "llama.cpp"])
    without = parse_args(["-m", "m", "--vs", "llama.cpp"])
    for fmt in ("json", "jsonl"):
        text = bm.format_results([img, tok], fmt, with_i)
        recs = json.loads(text) if fmt == "json" else [json.loads(line) for line in text.splitlines()]
        assert list(recs[0])[-len(bm.IMAGE_FIELDS):] == list(bm.IMAGE_FIELDS)
        assert list(recs[0])[-len(bm.IMAGE_FIELDS) - 2:-len(bm.IMAGE_FIELDS)] == [
            "ratio_vs_llama_cpp", "ratio_vs_llama_cpp_stddev"]
        assert [recs[0][f] for f in bm.IMAGE_FIELDS] == [2, "/models/mm.gguf", 64, 5, 80]
        assert [recs[1][f] for f in bm.IMAGE_FIELDS] == [0, "", 0, 0, 0]
        assert (recs[0]["n_prompt"], recs[0]["n_gen"], recs[0]["avg_ts"]) == (0, 0, pytest.approx(120.0))
        assert not set(bm.IMAGE_FIELDS) & set(json.loads(bm.format_results([tok], "json", without))[0])
    rows = list(csv.reader(io.StringIO(bm.format_results([img], "csv", with_i))))
    assert rows[0][-5:] == list(bm.IMAGE_FIELDS) and rows[1][-5:] == ["2", "/models/mm.gguf", "64", "5", "80"]
    assert not set(bm.IMAGE_FIELDS) & set(bm.format_results([tok], "csv", without).splitlines()[0].split(","))
    db = sqlite3.connect(":memory:")
    db.executescript(bm.format_results([img, tok], "sql", with_i))
    rows = db.execute("select n_images, image_tiles, image_tokens, mmproj from llama_bench order by n_images")
    assert rows.fetchall() == [(0, 0, 0, ""), (2, 5, 80, "/models/mm.gguf")]
    assert "n_images" not in bm.format_results([tok], "sql", without)
    # the table: a test named img2, its rate, the ratio column as for any test
    lines = bm.format_results([img], "md", BenchParams(n_threads=[2])).splitlines()
    assert [c.strip() for c in lines[2].strip("|").split("|")][-2:] == ["img2", "120.00 ± 56.57"]


# --------------------------------------------------------------------------- the loop, on a fake engine


class FakeImageEngine(bm.Engine):
    """Records what the loop asks; an image 'costs' 100 µs and gives 3 tiles of 16 rows."""

    name = "fake"
    version = "9"

    def __init__(self):
        super().__init__()
        self.calls: list[tuple] = []
        self.images: list[np.ndarray] = []

    def system(self):
        return {"build_commit": "c", "build_number": 1, "cpu_info": "cpu", "gpu_info": ""}

    def load(self, inst):
        self.calls.append(("load", inst.mmproj))
        self.info = {"desc": "fake", "size": 1, "n_params": 1, "n_vocab": 100, "backends": "CPU", "image_size": 12}

    def new_context(self, inst):
        self.calls.append(("ctx",))

    def clear(self):
        raise AssertionError("an image test has no cache to clear")

    def decode(self, tokens):
        raise AssertionError("an image test decodes no token")

    def prepare_images(self, inst, image):
        self.calls.append(("prepare",))
        self.images.append(image)
        return 3, 48

    def encode_images(self, n):
        self.calls.append(("encode", n))
        time.sleep(1e-4 * n)


def test_run_instance_times_the_encodes_only():
    eng = FakeImageEngine()
    msgs: list[str] = []
    res = bm.run_instance(eng, Instance("m", 0, 0, n_images=4, mmproj="mm"), reps=2, seed=1, index=3,
                          progress=msgs.append)
    assert eng.calls == [("load", "mm"), ("ctx",), ("prepare",), ("encode", 1), ("encode", 4), ("encode", 4)]
    assert msgs == ["warmup image run", "image run 1/2", "image run 2/2"]
    img = eng.images[0]
    assert img.shape == (12, 12, 3) and img.dtype == np.uint8 and len(np.unique(img)) > 50
    assert (res.image_size, res.image_tiles, res.image_tokens) == (12, 3, 48)
    assert res.ttft_ns == [0, 0] and len(res.samples_ns) == 2
    # 4 images of 48 rows in >= 400 µs each repetition
    assert all(t >= 400_000 for t in res.samples_ns)
    assert res.samples_ts == [pytest.approx(4 * 48 * 1e9 / t) for t in res.samples_ns]
    # the driver's image size wins over the engine's; the same seed and index give the same pixels
    again = FakeImageEngine()
    bm.run_instance(again, Instance("m", 0, 0, n_images=1, mmproj="mm"), reps=1, seed=1, index=3, warmup=False,
                    image_size=12)
    assert np.array_equal(again.images[0], img) and ("encode", 1) == again.calls[-1]
    other = FakeImageEngine()
    res = bm.run_instance(other, Instance("m", 0, 0, n_images=1, mmproj="mm"), reps=1, seed=1, index=3,
                          image_size=20)
    assert other.images[0].shape == (20, 20, 3) and res.image_size == 20


def test_unsupported_peer_is_skipped_not_failed(monkeypatch):
    class Peer:
        def __init__(self, engine, verbose=False):
            self.engine, self.version = engine, "1"

        def run(self, inst, progress_prefix=None, **kw):
            if inst.n_images:
                raise bm.PeerUnsupported("image tests need llama.cpp's libmtmd (simulated)")
            eng = FakeImageEngine()
            eng.name = "llama.cpp"
            eng.decode = lambda tokens: None
            eng.clear = lambda: None
            return bm.run_instance(eng, inst, **kw)

        def close(self):
            pass

    monkeypatch.setattr(bm.driver, "WorkerClient", Peer)
    p = parse_args(["-m", "a.gguf", "--mmproj", "mm.gguf", "-i", "1", "-p", "8", "-n", "0", "-r", "1",
                    "--rounds", "2", "--vs", "llama.cpp", "-o", "jsonl"])
    eng = FakeImageEngine()
    eng.decode = lambda tokens: None
    eng.clear = lambda: None
    out, err = io.StringIO(), io.StringIO()
    code, results = bm.run(p, out, err, engine=eng)
    assert code == 0
    assert [(r.engine, r.inst.name) for r in results] == [("fake", "pp8"), ("llama.cpp", "pp8"), ("fake", "img1")]
    assert "llama.cpp" not in results[2].ratios
    assert err.getvalue().count("llama.cpp: img1 not supported, skipped: image tests need") == 1   # once, not per round
    recs = [json.loads(line) for line in out.getvalue().splitlines()]
    assert recs[2]["ratio_vs_llama_cpp"] is None and recs[2]["image_tiles"] == 3


def test_llama_cpp_engine_without_mtmd_says_not_supported(monkeypatch):
    """A llama-cpp-python whose mtmd bindings cannot load: the image test raises UnsupportedTest (a skip), naming
    libmtmd; without an mtmd_cpp module at all, the same."""
    import types

    ll = types.SimpleNamespace(__version__="0.0-fake", llama_log_callback=lambda fn: fn,
                               llama_log_set=lambda cb, data: None, llama_backend_init=lambda: None)
    monkeypatch.setitem(__import__("sys").modules, "llama_cpp", ll)
    eng = bm.LlamaCppEngine()
    inst = Instance("m.gguf", 0, 0, n_images=1, mmproj="mm.gguf")
    with pytest.raises(bm.UnsupportedTest, match="libmtmd"):
        eng.new_context(inst)
    ll.mtmd_cpp = types.SimpleNamespace(mtmd_context_params_default=lambda: None)      # an older, partial one
    with pytest.raises(bm.UnsupportedTest, match="has no .*mtmd_encode_chunk"):
        eng.new_context(inst)


def test_bad_mmproj_files_are_refused_before_any_test(tmp_path, capsys):
    model = bm._synthetic_models(parse_args(["--synthetic", "tiny", "--cache-dir", str(tmp_path)]), io.StringIO())[0]
    for mmproj, words in ((str(tmp_path / "none.gguf"), "no such file"),
                          (model, "not an mmproj file (general.architecture is 'llama'")):
        code = bm.main(["-m", model, "--mmproj", mmproj, "-i", "1", "-p", "8", "-n", "0", "-r", "1"])
        cap = capsys.readouterr()
        assert code == 1 and f"--mmproj {mmproj}: {words}" in cap.err
        assert cap.out == ""                                   # refused before the table starts


# --------------------------------------------------------------------------- real runs on converted models

FAMILIES = ("gemma3", "idefics3")


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    pytest.importorskip("torch")
    vh = pytest.importorskip("vision_helpers")
    return {f: vh.make(f, tmp_path_factory.mktemp(f)) for f in FAMILIES}


def _expected_tiles(fx) -> int:
    """Tiles of a native-size (image_size x image_size) image, as the HF processor cuts it."""
    import vision_helpers as vh

    return len(vh.pixel_values(fx, [vh.sample_image(fx.image_size, fx.image_size, seed=0)]))


@pytest.mark.hf
@pytest.mark.parametrize("family", FAMILIES)
def test_bench_images_for_real(fixtures, family, capsys):
    fx = fixtures[family]
    tiles = _expected_tiles(fx)
    assert tiles == {"gemma3": 1, "idefics3": 5}[family]           # the fixture's 2 x 2 grid and global image
    code = bm.main(["-m", str(fx.text_path), "--mmproj", str(fx.mmproj_path), "-i", "1,3", "-p", "8", "-n", "2",
                    "-r", "1", "-t", "1", "-o", "json", "-v"])
    cap = capsys.readouterr()
    assert code == 0, cap.err
    recs = json.loads(cap.out)
    assert [(r["n_prompt"], r["n_gen"], r["n_images"]) for r in recs] == [(8, 0, 0), (0, 2, 0), (0, 0, 1), (0, 0, 3)]
    for r in recs[:2]:                                    # the token tests run without the encoder, as before
        assert (r["mmproj"], r["image_tokens"], r["image_tiles"]) == ("", 0, 0) and r["ttft_ms"] > 0
    for r, n in zip(recs[2:], (1, 3)):
        assert r["mmproj"] == str(fx.mmproj_path) and r["model_filename"] == str(fx.text_path)
        assert (r["image_size"], r["image_tiles"], r["image_tokens"]) == (
            fx.image_size, tiles, tiles * fx.tokens_per_image)
        assert r["avg_ts"] == pytest.approx(n * tiles * fx.tokens_per_image * 1e9 / r["samples_ns"][0])
        assert r["engine"] == "ggmlpy" and r["ttft_ms"] == 0 and r["load_time_ms"] > 0
    side = fx.image_size
    assert f"img1 on {fx.mmproj_path.name}: a {side}x{side} image: ggmlpy {tiles} tile(s), " \
           f"{tiles * fx.tokens_per_image} embedding rows per image" in cap.err


@pytest.mark.hf
def test_ggmlpy_encodes_through_the_runners_scheduler(fixtures, monkeypatch):
    """The image test's encodes are the runner's: its Runtime computes one encoder graph of all the image's
    tiles per image, with the test's threads; the warm-up encodes one image."""
    fx = fixtures["idefics3"]
    made, built, runs = [], [], []

    class SpyRunner(bm.ggmlpy_engine.Runner):
        def __init__(self, model, **kw):
            made.append(kw)
            super().__init__(model, **kw)         # (its reservation builds the largest image's graph too)
            real_build, real_run = self.vision.build, self.rt.run

            def build(n=1, size=None):
                g = real_build(n, size)
                built.append((n, g.graph))
                return g

            def run(graph, fill=None):
                runs.append(graph)
                return real_run(graph, fill)

            monkeypatch.setattr(self.vision, "build", build)
            self.rt.run = run

    monkeypatch.setattr(bm.ggmlpy_engine, "Runner", SpyRunner)
    eng = bm.GgmlpyEngine()
    try:
        inst = Instance(str(fx.text_path), 0, 0, n_threads=2, n_images=3, mmproj=str(fx.mmproj_path))
        res = bm.run_instance(eng, inst, reps=2, seed=0)
    finally:
        eng.close()
    assert len(made) == 1 and made[0]["n_threads"] == 2
    # warm-up, then 3 images x 2 repetitions: each one graph of the image's 5 tiles, computed by the runner's
    # Runtime
    assert [n for n, _ in built] == [5] * (1 + 3 * 2)
    assert runs == [g for _, g in built]
    assert (res.image_tiles, res.image_tokens) == (5, 5 * fx.tokens_per_image)


@pytest.mark.hf
@pytest.mark.skipif(not HAS_LLAMA_CPP, reason="llama-cpp-python not installed")
@pytest.mark.parametrize("family", FAMILIES)
def test_bench_images_vs_llama_cpp(fixtures, family, capsys):
    fx = fixtures[family]
    tiles = _expected_tiles(fx)
    code = bm.main(["-m", str(fx.text_path), "--mmproj", str(fx.mmproj_path), "-i", "2", "-p", "0", "-n", "0",
                    "-r", "2", "-t", "1", "-o", "jsonl", "--vs", "llama.cpp"])
    cap = capsys.readouterr()
    assert code == 0, cap.err
    recs = [json.loads(line) for line in cap.out.splitlines()]
    assert [(r["engine"], r["n_images"]) for r in recs] == [("ggmlpy", 2), ("llama.cpp", 2)]
    mine, peer = recs
    assert peer["avg_ts"] > 0 and len(peer["samples_ns"]) == 2
    # llama.cpp's mtmd cuts the same tiles from the same pixels (no warning), each of tokens_per_image rows
    for r in recs:
        assert (r["image_size"], r["image_tiles"], r["image_tokens"]) == (
            fx.image_size, tiles, tiles * fx.tokens_per_image)
    assert "differently" not in cap.err
    # llama-bench's avg_ts: the mean of each sample's rate (not the rate of the mean time, which two noisy
    # samples put more than 20 % away)
    rows = 2 * tiles * fx.tokens_per_image
    assert peer["avg_ts"] == pytest.approx(np.mean([rows * 1e9 / ns for ns in peer["samples_ns"]]))
    assert mine["ratio_vs_llama_cpp"] == pytest.approx(mine["avg_ts"] / peer["avg_ts"])
    assert peer["ratio_vs_llama_cpp"] is None


@pytest.mark.hf
@pytest.mark.skipif(not HAS_LLAMA_CPP, reason="llama-cpp-python not installed")
def test_bench_images_vs_llama_cpp_without_libmtmd(fixtures, capsys, monkeypatch, tmp_path):
    """llama-cpp-python's mtmd bindings load libmtmd from $MTMD_CPP_LIB when set: pointed at an empty folder,
    the worker cannot load it, and the image test is skipped on llama.cpp's side (the token tests run)."""
    fx = fixtures["gemma3"]
    monkeypatch.setenv("MTMD_CPP_LIB", str(tmp_path))
    code = bm.main(["-m", str(fx.text_path), "--mmproj", str(fx.mmproj_path), "-i", "1", "-p", "8", "-n", "0",
                    "-r", "1", "-t", "1", "-o", "jsonl", "--vs", "llama.cpp"])
    cap = capsys.readouterr()
    assert code == 0, cap.err
    recs = [json.loads(line) for line in cap.out.splitlines()]
    assert [(r["engine"], r["n_prompt"], r["n_images"]) for r in recs] == [
        ("ggmlpy", 8, 0), ("llama.cpp", 8, 0), ("ggmlpy", 0, 1)]
    assert recs[2]["ratio_vs_llama_cpp"] is None
    assert "llama.cpp: img1 not supported, skipped: image tests need llama.cpp's libmtmd" in cap.err
