"""The ``ggmlpy`` command as a whole (cli.py, ggmlpy/_cliargs.py, ggmlpy/_cache.py): one mistake gets one
answer in every subcommand (the line, the flag it names, the exit status), notes and warnings as one line,
``--version``, the cache folder and ``ggmlpy cache``, and the benchmark's progress line, noise footnote,
``--plot`` checks and model column. Built-in synthetic models only: no tokenizer is needed (the commands
that need one fail after the checks these tests look at)."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ggmlpy import benchmark as bm
from ggmlpy import cli
from ggmlpy._cache import cache_dir, cache_entries
from ggmlpy.benchmark import BenchError, BenchParams, Instance, Result, parse_args

ROOT = Path(__file__).resolve().parents[2]


def ggmlpy(*args, env=None, timeout=120):
    """The command in a process of its own (as a user runs it: warnings, exit status, stderr)."""
    e = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "ggmlpy", *args], capture_output=True, text=True,
                          timeout=timeout, env=e)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny synthetic llama GGUF (no vocabulary)."""
    from ggmlpy.models.synthetic import write_synthetic

    return str(write_synthetic(tmp_path_factory.mktemp("tiny") / "tiny.gguf", "tiny", "F16"))


def _one_error(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ---------------------------------------------------------------------------------------------- mistakes

#: What each subcommand needs besides the mistake to get as far as its checks.
COMMANDS = {"run": ["run", "-p", "x"], "chat": ["chat"], "embed": ["embed", "-p", "x"],
            "bench": ["bench", "-p", "8", "-n", "0", "-r", "1"]}


@pytest.mark.parametrize("command", COMMANDS)
def test_a_bad_model_file_is_the_same_line_in_every_subcommand(command, tmp_path, capsys):
    """A missing file, a folder or a file that is not GGUF for -m: ``ggmlpy <cmd>: error: -m PATH: ...``,
    exit status 1, one line, whichever command; bench says it once, before its table."""
    text = tmp_path / "notes.txt"
    text.write_text("hello, not a model\n")
    cases = [(tmp_path / "missing.gguf", "no such file"), (tmp_path, "is a directory, not a GGUF file"),
             (text, "not a GGUF file (magic b'hell', expected b'GGUF')")]
    for path, why in cases:
        assert cli.main([*COMMANDS[command], "-m", str(path)]) == 1
        out, err = capsys.readouterr()
        assert _one_error(err).startswith(f"ggmlpy {command}: error: -m {path}: {why}"), err
        assert out == ""                              # bench: before its table, not once per test


@pytest.mark.parametrize("argv, message", [
    (["-t", "0"], "-t 0: must be at least 1"),
    (["-t", "-3"], "-t -3: must be at least 1"),
    (["-n", "-5"], "-n -5: must be at least"),
    (["-b", "0"], "-b 0: must be at least 1"),
    (["-mg", "-1"], "-mg -1: must be at least 0"),
    (["-ncmoe", "-2"], "-ncmoe -2: must be at least 0"),
    (["-ngl", "-7"], "-ngl -7: must be at least -1"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["-ctv", "q8_0", "-fa", "off"], "-ctk f16 -ctv q8_0 -fa off: a quantized V cache needs flash attention"),
    (["-ot", "exps"], "invalid -ot value 'exps': expected PATTERN=DEVICE"),
    (["-sm", "row"], "-sm row: not supported"),
])
def test_a_usage_error_is_the_same_line_and_status_2_in_every_subcommand(argv, message, tiny, capsys):
    """The flag and its value, never the API's parameter name (n_threads, max_tokens), exit status 2,
    before anything is loaded."""
    for command, base in COMMANDS.items():
        assert cli.main([*base, "-m", tiny, *argv]) == 2, command
        out, err = capsys.readouterr()
        line = _one_error(err)
        assert line.startswith(f"ggmlpy {command}: error: {message}"), (command, line)
        assert not re.search(r"n_threads|max_tokens|n_gpu_layers|type_v|flash_attn=", line), line
        assert out == ""


@pytest.mark.parametrize("command", ["info", "cache", "rpc-server", "run", "chat", "bench"])
def test_unknown_flags_everywhere(command, capsys):
    assert cli.main([command, "--no-such-flag", *(["-m", "x.gguf"] if command in ("run", "chat") else [])]) == 2
    assert _one_error(capsys.readouterr().err) == f"ggmlpy {command}: error: unrecognized arguments: --no-such-flag"


def test_rpc_server_threads_as_every_command(capsys):
    assert cli.main(["rpc-server", "-t", "0"]) == 2
    assert _one_error(capsys.readouterr().err).startswith("ggmlpy rpc-server: error: -t 0: must be at least 1")


def test_debug_shows_the_traceback(tmp_path):
    p = ggmlpy("run", "-m", str(tmp_path / "missing.gguf"), "-p", "x")
    assert p.returncode == 1 and "Traceback" not in p.stderr
    p = ggmlpy("run", "-m", str(tmp_path / "missing.gguf"), "-p", "x", "--debug")
    assert p.returncode == 1 and "Traceback" in p.stderr and "-m " in p.stderr.splitlines()[-1]


def test_ngl_without_an_accelerator_is_one_note(tiny, tmp_path):
    """``-ngl 99`` where no accelerator can take layers: one line naming -ngl, not the loader's UserWarning
    (with its source path and API names) once per load."""
    want = "note: -ngl 99 ignored: -dev {} keeps every layer on the CPU"
    p = ggmlpy("bench", "-m", tiny, "-ngl", "99", "-dev", "none", "-p", "8", "-n", "1", "-r", "1", "-t", "1",
               "-o", "jsonl", "--no-progress")
    assert p.returncode == 0, p.stderr
    assert p.stderr.count(want.format("none")) == 1, p.stderr
    assert "UserWarning" not in p.stderr and ".py:" not in p.stderr and "n_gpu_layers=" not in p.stderr
    assert len(p.stdout.splitlines()) == 2
    p = ggmlpy("run", "-m", tiny, "-p", "x", "-ngl", "99", "-dev", "cpu")
    assert p.returncode == 1 and "has no tokenizer" in p.stderr           # (after the load)
    assert p.stderr.count(want.format("cpu")) == 1 and "UserWarning" not in p.stderr, p.stderr


def test_library_warnings_are_one_line(tiny):
    """A warning of the library (here -cmoe on a model without experts) is ``ggmlpy run: warning: ...``;
    --debug keeps Python's form."""
    p = ggmlpy("run", "-m", tiny, "-p", "x", "-cmoe", "-dev", "cpu")
    warns = [ln for ln in p.stderr.splitlines() if "no expert weights" in ln]
    assert len(warns) == 1 and warns[0].startswith("ggmlpy run: warning: "), p.stderr
    assert "UserWarning" not in p.stderr and ".py:" not in p.stderr
    p = ggmlpy("run", "-m", tiny, "-p", "x", "-cmoe", "-dev", "cpu", "--debug")
    assert "UserWarning" in p.stderr


def test_version(capsys):
    from ggmlpy._system import ggml_commit

    assert cli.main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out == f"ggmlpy 0.1.0 (ggml 0.25.3, commit {ggml_commit()})\n"
    p = ggmlpy("--version")
    assert p.returncode == 0 and p.stdout == out


def test_ggml_commit_names_the_pinned_source():
    """ggml's CMake asks git, which finds ggmlpy's own checkout around the fetched tree: the build writes the
    commit vendor/ggml/PIN records instead (CMakeLists.txt). (A build against GGMLPY_GGML_DIR reports that
    tree's: skip where the build says so.)"""
    from ggmlpy._system import ggml_commit

    pin = (ROOT / "vendor/ggml/PIN").read_text()
    commit = re.search(r"^commit = ([0-9a-f]{40})$", pin, re.M)[1]
    ours = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    if os.environ.get("GGMLPY_GGML_DIR"):
        pytest.skip("built against another ggml tree")
    assert ggml_commit() == commit[:7], (ggml_commit(), "ggmlpy's own commit" if ggml_commit() == ours else "")


# ---------------------------------------------------------------------------------------------- --synthetic

def test_synthetic_size_not_built_in_is_refused_before_anything_is_written(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GGMLPY_CACHE", str(tmp_path / "cache"))
    assert cli.main(["bench", "--synthetic", "70B", "-p", "8", "-n", "0"]) == 2
    line = _one_error(capsys.readouterr().err)
    assert "'70B' is not built in" in line and "110M (134M)" in line and "qwen3-8B (8.2B)" in line
    assert not (tmp_path / "cache").exists()


def test_synthetic_model_message_gives_its_parameters(tmp_path):
    err = io.StringIO()
    bm._synthetic_models(parse_args(["--synthetic", "tiny", "--cache-dir", str(tmp_path)]), err)
    assert re.search(r"writing the built-in llama tiny F16 model \(164K parameters\)", err.getvalue())


# ---------------------------------------------------------------------------------------------- the cache

def test_cache_dir_order(monkeypatch, tmp_path):
    monkeypatch.delenv("GGMLPY_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "ggmlpy"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")           # the XDG spec: absolute paths only
    assert cache_dir() == tmp_path / "home" / ".cache" / "ggmlpy"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "ggmlpy"
    monkeypatch.setenv("GGMLPY_CACHE", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"
    # every writer asks the one function
    from ggmlpy.benchmark import roofline
    from ggmlpy.models import calibrate, synthetic

    assert synthetic.cache_dir is cache_dir
    assert calibrate._default_dir() == tmp_path / "mine"
    assert synthetic.synthetic_path("tiny", "F16", create=False).parent == tmp_path / "mine"
    assert "cache_dir as default_cache_dir" in Path(roofline.__file__).read_text()


def test_cache_command_lists_clears_and_prints_the_path(tmp_path, monkeypatch, capsys):
    from ggmlpy.models.synthetic import synthetic_path

    folder = tmp_path / "c"
    monkeypatch.setenv("GGMLPY_CACHE", str(folder))
    assert cli.main(["cache", "path"]) == 0 and capsys.readouterr().out == f"{folder}\n"
    assert cli.main(["cache"]) == 0 and "empty: nothing written yet" in capsys.readouterr().out
    model = synthetic_path("tiny", "F16")                  # a writer puts its file there
    (folder / "roofline.json").write_text("{}")
    (folder / "converter" / "x").mkdir(parents=True)
    (folder / "converter" / "x" / "f.bin").write_bytes(b"1" * 5000)
    (folder / "mine.txt").write_text("a user's file")       # not ggmlpy's
    assert cli.main(["cache", "list"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{folder} (from $GGMLPY_CACHE)\n")
    # the hub's models are elsewhere, and the listing says where
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hfhub"))
    assert cli.main(["cache", "list"]) == 0
    assert f"Hugging Face cache, {tmp_path / 'hfhub'} (not here" in capsys.readouterr().out
    assert re.search(rf"\d+\.\d KiB  {model.name} +built-in benchmark model", out)
    assert re.search(r"4\.9 KiB  converter/ +llama.cpp's converter", out)
    assert re.search(r"mine\.txt +not ggmlpy's: left alone", out)
    total = sum(e.size for e in cache_entries(folder) if e.own)
    assert total == model.stat().st_size + 2 + 5000
    assert re.search(r"total of ggmlpy's 3 entries", out)
    # clear asks; without a terminal to ask and without --yes nothing goes
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert cli.main(["cache", "clear"]) == 2
    assert "add --yes" in capsys.readouterr().err and model.exists()
    assert cli.main(["cache", "clear", "--yes"]) == 0
    assert "removed 3 entries" in capsys.readouterr().out
    assert sorted(p.name for p in folder.iterdir()) == ["mine.txt"]         # only ggmlpy's own
    assert cli.main(["cache", "clear", "-y"]) == 0 and "nothing of ggmlpy's" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------- bench

class FakeEngine(bm.Engine):
    """Each decode sleeps ``costs[k]`` seconds per token, k counting the clears (the repetitions)."""

    name = "fake"
    version = "9"

    def __init__(self, costs=(1e-5,)):
        super().__init__()
        self.costs, self.clears, self.loads = costs, 0, 0

    def system(self):
        return {"build_commit": "c", "build_number": 1, "cpu_info": "cpu", "gpu_info": ""}

    def load(self, inst):
        self.loads += 1
        self.info = {"desc": "fake 1M F16", "size": 2 << 20, "n_params": 10 ** 6, "n_vocab": 100, "backends": "CPU"}

    def new_context(self, inst):
        pass

    def clear(self):
        self.clears += 1

    def decode(self, tokens):
        time.sleep(self.costs[self.clears % len(self.costs)] * len(tokens))


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_is_on_by_default_in_a_terminal(monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert parse_args(["-m", "a"]).progress is False
    monkeypatch.setattr(sys, "stderr", _Tty())
    assert parse_args(["-m", "a"]).progress is True
    assert parse_args(["-m", "a", "--no-progress"]).progress is False
    # in a terminal: one line, redrawn, cleared before the rows (no llama-bench lines in the way)
    out, err = io.StringIO(), _Tty()
    code, _ = bm.run(parse_args(["-m", "a", "-p", "8", "-n", "2", "-r", "2"]), out, err, engine=FakeEngine())
    assert code == 0 and "\r\x1b[K" in err.getvalue() and "tg2: fake: generation run 2/2" in err.getvalue()
    assert "\n" not in err.getvalue().replace("\r\x1b[K", "")
    # elsewhere, asked for: llama-bench's lines, as before
    err = io.StringIO()
    bm.run(parse_args(["-m", "a", "-p", "8", "-n", "0", "-r", "1", "--progress"]), io.StringIO(), err,
           engine=FakeEngine())
    assert "benchmark 1/1: starting\n" in err.getvalue() and "\x1b" not in err.getvalue()


def test_noisy_results_get_a_footnote():
    noisy = FakeEngine(costs=(2e-4, 1e-3))             # alternate repetitions 5x slower
    out, err = io.StringIO(), io.StringIO()
    code, results = bm.run(parse_args(["-m", "a", "-p", "16", "-n", "0", "-r", "4", "--no-warmup"]), out, err,
                           engine=noisy)
    assert code == 0 and results[0].stddev_ts / results[0].avg_ts > 0.2
    assert re.search(r"note: pp16 \(fake, ±\d+%\) varied by more than 20% between repetitions: the machine was "
                     r"busy; rerun with more -r", out.getvalue())
    # other formats keep their text: the note goes to stderr
    out, err = io.StringIO(), io.StringIO()
    bm.run(parse_args(["-m", "a", "-p", "16", "-n", "0", "-r", "4", "--no-warmup", "-o", "json"]), out, err,
           engine=FakeEngine(costs=(2e-4, 1e-3)))
    json.loads(out.getvalue())
    assert "the machine was busy" in err.getvalue()
    # a steady one gets none
    out = io.StringIO()
    bm.run(parse_args(["-m", "a", "-p", "16", "-n", "0", "-r", "3"]), out, io.StringIO(), engine=FakeEngine((1e-3,)))
    assert "busy" not in out.getvalue()


def test_plot_without_matplotlib_fails_before_anything_runs(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    eng, out = FakeEngine(), io.StringIO()
    with pytest.raises(BenchError, match="--plot needs matplotlib"):
        bm.run(parse_args(["-m", "a", "-p", "8", "-n", "0", "-r", "1", "--plot", "x.png"]), out, io.StringIO(),
               engine=eng)
    assert eng.loads == 0 and out.getvalue() == ""


def test_a_huge_range_is_refused_at_once():
    t0 = time.perf_counter()
    with pytest.raises(BenchError, match=r"^-p: range '1-100000000000' has 100,000,000,000 values"):
        parse_args(["-m", "a", "-p", "1-100000000000"])
    assert time.perf_counter() - t0 < 1


def test_plot_with_nothing_swept_draws_a_bar_per_test(tmp_path):
    pytest.importorskip("matplotlib")
    err = io.StringIO()
    path = tmp_path / "bars.png"
    code, results = bm.run(parse_args(["-m", "a", "-p", "8", "-n", "4", "-r", "1", "--plot", str(path)]),
                           io.StringIO(), err, engine=FakeEngine())
    assert code == 0 and bm.swept_variable(results) is None
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "nothing swept: a bar per test" in err.getvalue()
    assert bm.plot(results, tmp_path / "again.png") == "test"


def _row(engine: str, model_type: str) -> Result:
    return Result(inst=Instance("/m/synthetic-llama-110M-F16.gguf", 512, 0, n_threads=2), engine=engine,
                  engine_version="1", build_commit="c", build_number=0, cpu_info="cpu", gpu_info="",
                  backends="CPU", model_type=model_type, model_size=268_435_456, model_n_params=134_105_856,
                  load_mode="mmap", test_time="t", samples_ns=[10 ** 9], ttft_ns=[1], load_time_ms=1.0)


def test_the_model_column_names_the_model_alike_for_both_engines():
    """llama.cpp describes a shape it does not know as ``llama ?B F16``; the table writes its parameter count
    as ggmlpy's row does. The machine formats keep each engine's own description."""
    rows = [_row("ggmlpy", "llama 134M F16"), _row("llama.cpp", "llama ?B F16")]
    md = bm.format_results(rows, "md", BenchParams(n_threads=[2], vs=["llama.cpp"]))
    cells = [ln.split("|")[1].strip() for ln in md.splitlines() if ln.startswith("| llama")]
    assert cells == ["llama 134M F16", "llama 134M F16"], md
    recs = json.loads(bm.format_results(rows, "json", BenchParams(n_threads=[2], vs=["llama.cpp"])))
    assert [r["model_type"] for r in recs] == ["llama 134M F16", "llama ?B F16"]


def test_ctrl_c_in_bench_is_one_line_and_130(monkeypatch, capsys):
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(bm.driver, "run", interrupted)
    assert cli.main(["bench", "-m", "a", "-p", "8"]) == 130
    assert _one_error(capsys.readouterr().err) == "ggmlpy bench: interrupted"


def test_a_closed_pipe_exits_quietly(tiny):
    """``ggmlpy bench | head -1``: the reader goes away after the first line; no traceback."""
    p = subprocess.Popen([sys.executable, "-m", "ggmlpy", "bench", "-m", tiny, "-p", "8,16,32,64", "-n", "0", "-r",
                          "1", "-t", "1", "-o", "jsonl", "--no-progress"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    first = p.stdout.readline()
    p.stdout.close()                            # as head does
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) in (0, 141) and json.loads(first)["n_prompt"] == 8
    assert "Traceback" not in err and "BrokenPipe" not in err, err


@pytest.mark.parametrize("flags, said", [
    (["--repeat-penalty", "0"], "--repeat-penalty 0.0: must be > 0 (1 is off)"),
    (["--typical", "1.5"], "--typical 1.5: must be in (0, 1]"),
    (["--mirostat", "3"], "--mirostat 3: must be 0 (off), 1 or 2"),
    (["--dry-base", "0.5"], "--dry-base 0.5: must be >= 1"),
    (["--repeat-last-n", "-2"], "--repeat-last-n -2: must be >= -1"),
    (["--samplers", "top_k;warp"], "--samplers: samplers: unknown sampler 'warp'"),
    (["--samplers", "top_k", "--sampling-seq", "kt"], "--samplers and --sampling-seq given together"),
    (["-l", "15043*2"], "--logit-bias 15043*2: expected TOKEN_ID+BIAS or TOKEN_ID-BIAS"),
    (["--grammar", 'root ::= "a" nope'], "--grammar: gbnf grammar: Rule 'nope' not found"),
    (["-j", "{bad"], "--json-schema: json_schema grammar: the schema is not JSON"),
    (["--grammar", "x", "-j", "{}"], "--grammar and --json-schema given together"),
    (["--grammar-file", "/dev/zero"], "--grammar-file /dev/zero: not a regular file"),
    (["-jf", "/nonexistent.json"], "--json-schema-file /nonexistent.json: No such file or directory"),
])
def test_cli_sampling_flags_are_checked_naming_the_flag(flags, said, capsys):
    assert cli.main(["run", "-m", "/nonexistent.gguf", "-p", "x", *flags]) == 2
    assert said in capsys.readouterr().err


def test_cli_sampling_flags_reach_the_params():
    """Every llama-cli sampling flag lands in its SamplingParams field; the ones not given are the model's
    general.sampling.* recommendation, else the table's."""
    args = cli.build_parser().parse_args([
        "run", "-m", "x.gguf", "-p", "hi", "--temp", "0.5", "--repeat-penalty", "1.2", "--repeat-last-n", "-1",
        "--presence-penalty", "0.3", "--frequency-penalty", "0.4", "--typical", "0.9", "--top-nsigma", "1.5",
        "--min-keep", "2", "--xtc-probability", "0.5", "--xtc-threshold", "0.2", "--dry-multiplier", "0.8",
        "--dry-base", "2", "--dry-allowed-length", "3", "--dry-penalty-last-n", "128", "--dry-sequence-breaker",
        "\n", "--mirostat", "2", "--mirostat-lr", "0.2", "--mirostat-ent", "4", "--dynatemp-range", "0.1",
        "--dynatemp-exp", "1.5", "--sampling-seq", "kpt", "-l", "15043+1", "-l", "7-inf", "-l", "15043+0.5",
        "-s", "7"])
    p = cli._sampling(args, {"top_k": 12, "temperature": 0.1})
    assert (p.temperature, p.top_k, p.top_p, p.seed) == (0.5, 12, 0.95, 7)       # --temp beats the file's
    assert (p.repeat_penalty, p.repeat_last_n, p.presence_penalty, p.frequency_penalty) == (1.2, -1, 0.3, 0.4)
    assert (p.typical_p, p.top_n_sigma, p.min_keep, p.xtc_probability, p.xtc_threshold) == (0.9, 1.5, 2, 0.5, 0.2)
    assert (p.dry_multiplier, p.dry_base, p.dry_allowed_length, p.dry_penalty_last_n) == (0.8, 2.0, 3, 128)
    assert p.dry_sequence_breakers == ("\n",)            # '\\n' typed: a newline, as llama-cli reads it
    assert (p.mirostat, p.mirostat_eta, p.mirostat_tau, p.dynatemp_range, p.dynatemp_exponent) == (2, 0.2, 4, 0.1, 1.5)
    assert p.samplers == ("top_k", "top_p", "temperature")
    assert p.logit_bias == ((7, float("-inf")), (15043, 1.5))
    none = cli._sampling(cli.build_parser().parse_args(["run", "-m", "x.gguf", "-p", "hi"]), {"top_k": 12})
    assert none.top_k == 12 and none.temperature == 0.8


def test_cli_numbers_are_checked_without_loading_anything(capsys):
    """The checks run before any model is opened: a value error comes first even with a missing file."""
    assert cli.main(["run", "-m", "/nonexistent.gguf", "-p", "x", "--top-p", "0"]) == 2
    assert "--top-p 0.0: must be in (0, 1]" in capsys.readouterr().err
    assert cli.main(["chat", "-m", "/nonexistent.gguf", "--image", "a.png"]) == 2
    assert "--image needs the model's vision encoder: --mmproj FILE" in capsys.readouterr().err
    assert cli.main(["run", "-m", "/nonexistent.gguf", "-p", "x", "-ngl", "lots"]) == 2
    assert "-ngl lots: expected a number of layers, -1 (all) or auto" in capsys.readouterr().err
