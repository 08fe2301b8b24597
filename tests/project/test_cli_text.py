"""``ggmlpy run`` and ``ggmlpy chat`` (cli.py) on a converted model with llama.cpp's llama-bpe vocabulary
and a Llama-3 chat template (tests/text_helpers.py): the printed text against the runner's own text
API in this process, the stats line, errors as one line and exit status 1, the chat's history across
turns and Ctrl-C (in-process, and a real SIGINT to a chat in a pseudo-terminal)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from test_core_backend import rpc_server  # noqa: F401  (a fixture: an RPC server on loopback)
from text_helpers import llama_chat_gguf

from ggmlpy import cli
from ggmlpy.runner import DoneReason, Runner
from ggmlpy.sampling import SamplingParams

pytestmark = pytest.mark.hf

PROMPT = "The quick brown fox"
STATS = re.compile(r"\[ prompt: (\d+) tokens(?: \((\d+) cached\))?, [\d.]+ t/s \| generated: (\d+) tokens, "
                   r"[\d.]+ t/s \| done: (\w+) \]")
# what the CLI's --temp 0 means (its other sampling defaults do not matter to greedy decoding)
GREEDY = SamplingParams(temperature=0.0, top_k=40, top_p=0.95, min_p=0.05)
COMMON = ["-c", "256", "-t", "2", "-dev", "cpu", "--temp", "0"]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    pytest.importorskip("ggmlpy.tokenizer")
    pytest.importorskip("ggmlpy.tokenizer.chat_template")
    return str(llama_chat_gguf(tmp_path_factory))


@pytest.fixture(scope="module")
def model(path):
    from ggmlpy.models import load_model

    m = load_model(path, devices="cpu")
    yield m
    m.close()


@pytest.fixture
def rt(model):
    with Runner(model, n_ctx=256) as r:
        yield r


def run_cli(*args, stdin=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "ggmlpy.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout, encoding="utf-8")


# ---------------------------------------------------------------------------------------------- run


def test_run_prints_the_completion_then_the_speed(path, rt, capsys):
    want = rt.generate(PROMPT, max_tokens=24, sampling=GREEDY, shift=False)
    assert cli.main(["run", "-m", path, "-p", PROMPT, "-n", "24", *COMMON]) == 0
    out, err = capsys.readouterr()
    assert out == want.text + "\n"
    m = STATS.search(err)
    assert m and int(m[1]) == want.prompt_eval_count and m[3] == "24" and m[4] == "length"


def test_run_constrains_the_output_and_takes_llama_clis_sampling_flags(path, rt, capsys, tmp_path):
    """-j / -jf / --grammar / --grammar-file reach the runner as its json_schema / grammar (the same
    completion as the API's), with the penalty and bias flags alongside."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    flags = ["--repeat-penalty", "1.3", "--repeat-last-n", "16", "-l", "11+0.5"]
    want = rt.generate(PROMPT, max_tokens=48, shift=False, json_schema=schema, repeat_penalty=1.3,
                       repeat_last_n=16, logit_bias={11: 0.5}, sampling=None, temperature=0.0)
    (tmp_path / "s.json").write_text(json.dumps(schema))
    for how in (["-j", json.dumps(schema)], ["-jf", str(tmp_path / "s.json")]):
        assert cli.main(["run", "-m", path, "-p", PROMPT, "-n", "48", *COMMON, *flags, *how]) == 0
        out, _ = capsys.readouterr()
        assert out == want.text + "\n" and json.loads(out)["n"] in range(100)
    gbnf = 'root ::= "n=" [0-9] [0-9]?'
    (tmp_path / "g.gbnf").write_text(gbnf)
    want = rt.generate(PROMPT, max_tokens=8, shift=False, grammar=gbnf, temperature=0.0).text
    for how in (["--grammar", gbnf], ["--grammar-file", str(tmp_path / "g.gbnf")]):
        assert cli.main(["run", "-m", path, "-p", PROMPT, "-n", "8", *COMMON, *how]) == 0
        assert capsys.readouterr().out == want + "\n" and re.fullmatch(r"n=\d\d?", want)


def test_run_stop_strings_and_chat(path, rt, capsys):
    full = rt.generate(PROMPT, max_tokens=24, sampling=GREEDY, shift=False).text
    stop = full[8:11]
    assert cli.main(["run", "-m", path, "-p", PROMPT, "-n", "24", "--stop", stop, "--stop", "never!",
                     *COMMON]) == 0
    out, err = capsys.readouterr()
    assert out == full[:full.index(stop)] + "\n" and "done: stop" in err
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
    want = rt.chat(msgs, max_tokens=12, sampling=GREEDY, shift=False)
    assert cli.main(["run", "-m", path, "-p", PROMPT, "--chat", "--system", "Be brief.", "-n", "12",
                     *COMMON]) == 0
    out, err = capsys.readouterr()
    assert out == want.text + "\n" and int(STATS.search(err)[1]) == len(rt.chat_prompt(msgs))


def test_run_in_a_process_streams_and_reads_stdin(path, rt):
    want = rt.generate(PROMPT, max_tokens=16, sampling=GREEDY, shift=False)
    p = run_cli("run", "-m", path, "-f", "-", "-n", "16", *COMMON, stdin=PROMPT)
    assert p.returncode == 0, p.stderr
    assert p.stdout == want.text + "\n" and STATS.search(p.stderr) and "Traceback" not in p.stderr


def test_run_and_chat_errors_are_one_line(path, tmp_path, capsys):
    from ggmlpy.gguf import GGUFReader, GGUFWriter
    from ggmlpy.models.synthetic import write_synthetic

    no_vocab = write_synthetic(tmp_path / "tiny.gguf", size="tiny", type="F16")
    # the converted model without its chat template
    no_template = str(tmp_path / "no-template.gguf")
    with GGUFReader(path) as r:
        w = GGUFWriter(no_template)
        for k, v in r.metadata.items():
            if k not in ("tokenizer.chat_template", "general.alignment"):
                w.add(k, v)
        for t in r.tensors:
            w.add_tensor(t.name, r.tensor_data(t.name, copy=True))
        w.write()
    bad_text = tmp_path / "latin1.txt"
    bad_text.write_bytes("caf\xe9".encode("latin-1"))
    cases = [
        (["run", "-m", str(tmp_path / "missing.gguf"), "-p", "x"], 1, "missing.gguf: no such file"),
        (["run", "-m", str(no_vocab), "-p", "x"], 1, "has no tokenizer"),
        (["chat", "-m", str(no_vocab)], 1, "has no tokenizer"),
        (["run", "-m", no_template, "-p", "x", "--chat"], 1, "no chat template"),
        (["chat", "-m", no_template], 1, "no chat template"),
        (["run", "-m", path, "-f", str(bad_text)], 1, "not UTF-8 text"),
        (["run", "-m", path, "-p", "x", "--chat", "--chat-template-file", str(bad_text)], 1, "not UTF-8"),
        (["run", "-m", path, "-p", "x", "--stop", ""], 1, "empty stop string"),
        (["run", "-m", path], 2, "a prompt is needed"),
        (["run", "-m", path, "-p", "x", "--system", "s"], 2, "--system is for --chat"),
        # the option's form and values are usage errors (2), in ggmlpy bench's words; the device when it loads
        (["run", "-m", path, "-p", "x", "-ot", "exps"], 2, "invalid -ot value 'exps': expected PATTERN=DEVICE"),
        (["run", "-m", path, "-p", "x", "-ot", "exps=GPU9"], 1, "unknown device or buffer type 'GPU9'"),
        (["run", "-m", path, "-p", "x", "-ot", "exps(=CPU"], 2, "'exps(' is not a regular expression"),
        (["run", "-m", path, "-p", "x", "-ncmoe", "-1"], 2, "-ncmoe -1: must be at least 0"),
        (["run", "-m", path, "-p", "x", "-sm", "row"], 2, "-sm row: not supported: ggmlpy splits by layer"),
        (["run", "-m", path, "-p", "x", "-ts", "3,x"], 2, "invalid -ts value '3,x': expected proportions"),
    ]
    for argv, code, message in cases:
        assert cli.main([*argv, "-dev", "cpu"]) == code, argv
        out, err = capsys.readouterr()
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, (argv, err)
    # the same through the installed entry point's module, in a process of its own
    p = run_cli("chat", "-m", no_template)
    assert p.returncode == 1 and "no chat template" in p.stderr and "Traceback" not in p.stderr


# ---------------------------------------------------------------------------------------------- chat


def chat_args(path, *extra):
    return cli.build_parser().parse_args(["chat", "-m", path, "-n", "8", *COMMON, *extra])


def test_chat_piped_turns_history_and_commands(path, rt):
    def reply(history):
        return rt.chat(history, max_tokens=8, sampling=GREEDY, shift=False).text

    sys_msg = {"role": "system", "content": "You are terse."}
    r1 = reply([sys_msg, {"role": "user", "content": "hello"}])
    r2 = reply([sys_msg, {"role": "user", "content": "hello"}, {"role": "assistant", "content": r1},
                {"role": "user", "content": "hi again"}])
    p = run_cli("chat", "-m", path, "-n", "8", *COMMON, "--system", "You are terse.",
                stdin="hello\nhi again\n\n/what\n/clear\nhello\n/bye\nnever read\n")
    assert p.returncode == 0, p.stderr
    assert p.stdout == (f">>> {r1}\n\n>>> {r2}\n\n>>> >>> Unknown command '/what'. Type /? for help\n"
                        f">>> Cleared session context\n>>> {r1}\n\n>>> ")
    # Ctrl-D (end of input) exits too
    p = run_cli("chat", "-m", path, "-n", "8", *COMMON, stdin="hello\n")
    assert p.returncode == 0 and p.stdout.endswith(">>> \n")


class _Interrupting:
    """An output stream that raises KeyboardInterrupt on its first write of reply text: Ctrl-C arriving
    while a reply streams."""

    def __init__(self):
        self.parts, self.armed = [], True

    def write(self, s):
        if self.armed and s.strip() and not s.startswith(("\n", "Use Ctrl")):
            self.armed = False
            raise KeyboardInterrupt
        self.parts.append(s)

    def flush(self):
        pass


def test_chat_ctrl_c_drops_the_partial_reply_and_keeps_the_message(path, rt, capsys):
    lines = iter(["hello", KeyboardInterrupt, "and you?", "/bye"])

    def read(prompt):
        x = next(lines)
        if x is KeyboardInterrupt:
            raise KeyboardInterrupt           # Ctrl-C at the prompt
        return x

    out = _Interrupting()
    history: list = []
    assert cli.chat_repl(rt, chat_args(path), history, out=out, read=read) == 0
    assert rt.wait_idle(10)                   # the cancelled reply ended
    u1, u2 = {"role": "user", "content": "hello"}, {"role": "user", "content": "and you?"}
    # as Ollama: the user's message stays, the partial reply is gone; the next turn answers both
    want = rt.chat([u1, u2], max_tokens=8, sampling=GREEDY, shift=False)
    assert history == [u1, u2, {"role": "assistant", "content": want.text}]
    assert "Use Ctrl + d or /bye to exit." in "".join(out.parts)
    assert "".join(out.parts).endswith(want.text + "\n\n")


def test_chat_drops_old_messages_when_the_context_fills(path, model, capsys):
    long = " ".join(["word"] * 20)
    with Runner(model, n_ctx=96) as small:
        history: list = [{"role": "system", "content": "Be brief."}]
        lines = iter([long, long + " again", long + " more", "x " * 200, "short", "/bye"])
        assert cli.chat_repl(small, chat_args(path, "--verbose"), history, out=_Sink(),
                             read=lambda p: next(lines)) == 0
        err = capsys.readouterr().err
        # each turn fit: older messages were dropped from the prompt, not from the history
        stats = STATS.findall(err)
        assert len(stats) == 4 and all(int(n) < 96 for n, *_ in stats)
        assert "error: " in err and "more than the context" in err       # a message alone too long
        assert [m["content"] for m in history if m["role"] == "user"] == [long, long + " again", long + " more",
                                                                          "short"]


class _Sink:
    def write(self, s):
        pass

    def flush(self):
        pass


def _read_until(fd, buf: bytearray, pattern: bytes, timeout: float) -> bool:
    """Read the pseudo-terminal into ``buf`` until ``pattern`` appears after what was there (True) or
    ``timeout`` seconds pass."""
    import select

    start = len(buf)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pattern in buf[start:]:
            return True
        r, _, _ = select.select([fd], [], [], 0.1)
        if r:
            try:
                data = os.read(fd, 4096)
            except OSError:
                return pattern in buf[start:]
            if not data:
                break
            buf += data
    return pattern in buf[start:]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a pseudo-terminal and SIGINT")
def test_chat_in_a_terminal_ctrl_c_stops_the_reply_not_the_chat(path):
    import pty

    master, slave = pty.openpty()
    # a reply with no limit in a large context runs for many seconds: Ctrl-C comes while it streams
    proc = subprocess.Popen([sys.executable, "-m", "ggmlpy.cli", "chat", "-m", path, "-n", "-1", "-c", "16384",
                             "-t", "2", "-dev", "cpu", "--temp", "0", "--verbose"],
                            stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    buf = bytearray()
    try:
        assert _read_until(master, buf, b">>> ", 120), bytes(buf)
        os.write(master, b"hello\n")
        assert _read_until(master, buf, b"hello", 10)          # the terminal's echo
        mark = len(buf)
        deadline = time.monotonic() + 30
        while len(buf) < mark + 40 and time.monotonic() < deadline:       # the reply is streaming
            _read_until(master, buf, b"\x00", 0.2)
        assert len(buf) >= mark + 40, bytes(buf)
        proc.send_signal(signal.SIGINT)
        assert _read_until(master, buf, b">>> ", 30), bytes(buf[-400:])
        assert proc.poll() is None                              # still running, back at the prompt
        assert not STATS.search(buf[mark:].decode("utf-8", "replace"))    # no finished reply
        # at the prompt: a hint, no exit. A SIGINT that lands after the prompt is written but before
        # the read blocks is only seen at the next input (CPython checks signals on EINTR): wait a
        # moment, and send it again if the hint does not come
        for _ in range(3):
            time.sleep(0.5)
            proc.send_signal(signal.SIGINT)
            if _read_until(master, buf, b"Use Ctrl + d or /bye to exit.", 10):
                break
        else:
            raise AssertionError(bytes(buf[-400:]))
        os.write(master, b"/clear\n")
        assert _read_until(master, buf, b"Cleared session context", 10)
        os.write(master, b"/bye\n")
        assert proc.wait(timeout=30) == 0
        assert b"Traceback" not in buf
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)


def test_stats_line_counts_what_was_evaluated():
    from ggmlpy.runner import Completion

    r = Completion(tokens=[1] * 11, done_reason=DoneReason.STOP, prompt_eval_count=20, n_cached=15,
                   prompt_eval_duration=0.5, eval_count=11, eval_duration=2.0)
    line = cli._stats_line(r)
    assert line == "[ prompt: 20 tokens (15 cached), 10.00 t/s | generated: 11 tokens, 5.00 t/s | done: stop ]"
    assert STATS.fullmatch(line)
    assert "0.00 t/s" in cli._stats_line(Completion(eval_count=1, prompt_eval_count=1, done_reason="cancel"))



@pytest.mark.rpc
def test_run_places_weights_by_name_on_a_server(path, rpc_server, monkeypatch, capsys):  # noqa: F811
    """``ggmlpy run -rpc EP -ngl 99 -ot ... -cmoe``: the overrides reach load_model (the feed-forward
    weights stay in host memory, everything else on the server) and the reply is the one the same
    placement gives through the Python API."""
    from ggmlpy import load as loading

    kw = {"devices": "auto", "rpc": [rpc_server], "n_gpu_layers": 99, "tensor_overrides": "ffn_=CPU"}
    with loading.load_model(path, **kw) as m, Runner(m, n_ctx=256, n_threads=2) as r:
        want = r.generate(PROMPT, max_tokens=12, sampling=GREEDY, shift=False).text
    seen = []
    load = loading.load_model

    def spy(*a, **k):
        model = load(*a, **k)
        seen.append((k, dict(model.weights.overridden)))
        return model

    monkeypatch.setattr(loading, "load_model", spy)
    argv = ["run", "-m", path, "-p", PROMPT, "-n", "12", "-c", "256", "-t", "2", "--temp", "0", "-rpc", rpc_server,
            "-ngl", "99", "-ot", "ffn_(gate|up)=CPU", "-ot", "ffn_down=cpu", "-cmoe"]
    with pytest.warns(UserWarning, match="this llama model has no expert weights"):       # -cmoe
        assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert out == want + "\n"
    (k, overridden), = seen
    assert k["tensor_overrides"] == "ffn_(gate|up)=CPU,ffn_down=cpu" and k["n_cpu_moe"] >= 1 << 30
    assert overridden and all(("ffn_" in n) and d == "CPU" for n, d in overridden.items())


# ---------------------------------------------------------------------------------------------- llama-cli's options


def test_run_takes_cache_types_flash_attention_and_ngl_auto(path, model, capsys, monkeypatch):
    """-ctk/-ctv/-fa reach the runner (the text is what a runner with those settings writes) and -ngl auto
    loads through the placement search (all layers fit here; the text is the plain greedy one)."""
    import ggmlpy.runner
    from ggmlpy import load as loading

    seen: list = []
    runner_cls, load = ggmlpy.runner.Runner, loading.load_model

    class Spy(runner_cls):
        def __init__(self, *a, **k):
            seen.append(k)
            super().__init__(*a, **k)

    monkeypatch.setattr(ggmlpy.runner, "Runner", Spy)
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: seen.append(k) or load(*a, **k))
    # (this model's heads of 16 hold no quantized block: float types)
    with Runner(model, n_ctx=256, type_k="bf16", type_v="f32", flash_attn=False) as r:
        want = r.generate(PROMPT, max_tokens=12, sampling=GREEDY, shift=False).text
    assert cli.main(["run", "-m", path, "-p", PROMPT, "-n", "12", *COMMON, "-ctk", "bf16", "-ctv", "f32",
                     "-fa", "off"]) == 0
    assert capsys.readouterr().out == want + "\n"
    assert (seen[1]["type_k"], seen[1]["type_v"], seen[1]["flash_attn"]) == ("bf16", "f32", False)
    seen.clear()
    with Runner(model, n_ctx=256) as r:
        plain = r.generate(PROMPT, max_tokens=12, sampling=GREEDY, shift=False).text
    assert cli.main(["run", "-m", path, "-p", PROMPT, "-n", "12", *COMMON, "-ngl", "auto"]) == 0
    assert capsys.readouterr().out == plain + "\n"
    assert seen[0]["n_gpu_layers"] == "auto" and seen[0]["n_ctx"] == 256 and seen[-1]["n_ctx"] == 256, seen


def test_chat_verbose_prints_the_speed_on_a_line_of_its_own(path, rt, monkeypatch):
    """In a terminal stdout and stderr are one screen: the reply's line ends before the speed is printed."""
    screen = _Screen()
    monkeypatch.setattr(sys, "stderr", screen)
    lines = iter(["hello", "/bye"])
    assert cli.chat_repl(rt, chat_args(path, "--verbose"), [], out=screen, read=lambda p: next(lines)) == 0
    text = "".join(screen.parts)
    m = STATS.search(text)
    assert m and text[m.start() - 1] == "\n" and text[m.end()] == "\n", repr(text)
    assert text.endswith("\n\n")            # and a blank line after it, as without --verbose


class _Screen:
    def __init__(self):
        self.parts = []

    def write(self, s):
        self.parts.append(s)

    def flush(self):
        pass


def test_chat_image_command_without_a_vision_encoder(path, rt, capsys):
    lines = iter(["/image nothing.png", "/image", "/?", "/bye"])
    out = _Screen()
    assert cli.chat_repl(rt, chat_args(path), [], out=out, read=lambda p: next(lines)) == 0
    err = capsys.readouterr().err
    assert "error: this model has no vision encoder: start the chat with --mmproj FILE" in err
    assert "/image PATH" in "".join(out.parts)


@pytest.fixture(scope="module")
def vision(tmp_path_factory):
    pytest.importorskip("torch")
    vh = pytest.importorskip("vision_helpers")
    from PIL import Image

    d = tmp_path_factory.mktemp("gemma3")
    fx = vh.make("gemma3", d)
    image = d / "picture.png"
    Image.fromarray(vh.sample_image(90, 120, seed=5)).save(image)
    return fx, str(image)


def test_run_and_chat_take_mmproj_and_images(vision, monkeypatch, capsys):
    """``run --mmproj F --image P -p TEXT``: llama-mtmd-cli's rule (a prompt without a marker gets one per
    image, before the text), the text the runner gives for that prompt and image; ``chat``'s ``/image P``
    attaches it to the next message, whose reply is the runner's chat with that image part."""
    from ggmlpy.load import load_model
    from ggmlpy.runner.images import MEDIA_MARKER
    from ggmlpy.vision.preprocess import load_image

    fx, image = vision
    args = ["-m", str(fx.text_path), "--mmproj", str(fx.mmproj_path), "-n", "6", *COMMON]
    pic = load_image(image)
    with load_model(str(fx.text_path), mmproj=str(fx.mmproj_path)) as m, Runner(m, n_ctx=256) as r:
        want = r.generate(MEDIA_MARKER + "Describe", images=[pic], max_tokens=6, sampling=GREEDY, shift=False)
        ph = r.vision.image_placeholder
        template = ("{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}"
                    "{% for p in m.content %}{% if p.type == 'image' %}" + ph + "{% else %}{{ p.text }}{% endif %}"
                    "{% endfor %}{% endif %}{% endfor %}")
        reply = r.chat([{"role": "user", "content": [{"type": "image", "image": pic},
                                                     {"type": "text", "text": "Describe"}]}],
                       template=template, max_tokens=6, sampling=GREEDY, shift=False).text
        lines = iter([f"/image {image}", "Describe", "/bye"])
        out = _Screen()
        history: list = []
        assert cli.chat_repl(r, cli.build_parser().parse_args(["chat", *args]), history, template=template, out=out,
                             read=lambda p: next(lines)) == 0
        assert "".join(out.parts).endswith(reply + "\n\n") and "picture.png image loaded" in "".join(out.parts)
        assert history[-1] == {"role": "assistant", "content": reply}
    capsys.readouterr()
    assert cli.main(["run", *args, "--image", image, "-p", "Describe"]) == 0
    assert capsys.readouterr().out == want.text + "\n"
    # an image that cannot be read is one line, before the model loads
    assert cli.main(["run", *args, "--image", image + ".missing", "-p", "Describe"]) == 1
    err = capsys.readouterr().err
    assert "no such file" in err and len(err.strip().splitlines()) == 1
