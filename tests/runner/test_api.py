"""The high-level API (issue 37): the top-level names, ``ggmlpy.open`` in a ``with`` block, sampling settings
as keywords, ``stream=True``, full signatures, and one table of defaults read by the API and the CLI."""

from __future__ import annotations

import dataclasses
import gc
import inspect
import pydoc

import pytest
from helpers import run_child
from text_helpers import WideFakeTokenizer as Tok

import ggmlpy
from ggmlpy import GGMLTypeError, GGMLValueError
from ggmlpy.defaults import CLI_N_PREDICT, DEFAULTS, n_ctx_for
from ggmlpy.load import load_model
from ggmlpy.models.synthetic import SIZES, write_synthetic
from ggmlpy.runner import Completion, DoneReason, Runner, Stream, TokenEvent
from ggmlpy.sampling import SamplingParams

HANG = 60          # seconds before a wait counts as a hang
IDS = [5, 17, 250, 3, 99, 42, 7]
SAMPLING = ("temperature", "top_k", "top_p", "min_p", "seed")


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_synthetic(tmp_path_factory.mktemp("api") / "tiny.gguf", "tiny", "F16", seed=3)


@pytest.fixture(scope="module")
def long_ctx_path(tmp_path_factory):
    """The tiny model trained (so its file says) on 8192 tokens: more than the default context."""
    cfg = dataclasses.replace(SIZES["tiny"], name="tiny-8k", n_ctx=8192)
    return write_synthetic(tmp_path_factory.mktemp("api8k") / "tiny8k.gguf", cfg, "F16", seed=3)


@pytest.fixture(scope="module")
def model(tiny_path):
    with load_model(tiny_path, devices="cpu") as m:
        yield m


@pytest.fixture
def rt(model):
    # one runner per test: the graphs it pools are freed with it (the live-handle check counts them)
    with Runner(model, n_ctx=128, tokenizer=Tok()) as r:
        yield r


# --------------------------------------------------------------------------- the top-level names


LAZY = {"open": "ggmlpy.api", "load_model": "ggmlpy.load", "Runner": "ggmlpy.runner",
        "Completion": "ggmlpy.runner", "TokenEvent": "ggmlpy.runner", "Stream": "ggmlpy.runner",
        "Handle": "ggmlpy.runner", "DoneReason": "ggmlpy.runner", "RunnerError": "ggmlpy.runner",
        "RequestTimeout": "ggmlpy.runner", "InputTooLong": "ggmlpy.runner", "SamplingParams": "ggmlpy.sampling",
        "DEFAULTS": "ggmlpy.defaults"}


def test_a_first_script_needs_one_import():
    import importlib

    for name, module in LAZY.items():
        assert getattr(ggmlpy, name) is getattr(importlib.import_module(module), name), name
        assert name in dir(ggmlpy)
    for name in ggmlpy.__all__:
        assert getattr(ggmlpy, name) is not None, name
    # a star import must not shadow the builtin open()
    assert "open" not in ggmlpy.__all__ and "Runner" in ggmlpy.__all__ and "load_model" in ggmlpy.__all__
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        ggmlpy.nope  # noqa: B018


def test_import_ggmlpy_stays_light():
    # the Python layers are imported on first use of their names, not by `import ggmlpy`
    out = run_child("""
        import sys
        import ggmlpy
        heavy = ("ggmlpy.api", "ggmlpy.load", "ggmlpy.runner", "ggmlpy.sampling", "ggmlpy.models", "ggmlpy.tokenizer")
        print(sorted(m for m in heavy if m in sys.modules))
        ggmlpy.Runner
        print("ggmlpy.runner" in sys.modules, "ggmlpy.api" in sys.modules)
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["[]", "True False"], out.stdout


# --------------------------------------------------------------------------- ggmlpy.open


def test_open_gives_a_runner_that_closes_its_model(tiny_path):
    with ggmlpy.open(tiny_path, devices="cpu", n_ctx=64, n_seq_max=2, type_k="f32") as llm:
        assert isinstance(llm, Runner) and llm.owns_model
        assert (llm.n_ctx, llm.n_seq_max, llm.type_k) == (64, 2, "f32")
        model = llm.model
        assert len(llm.generate(IDS, max_tokens=4, temperature=0).tokens) == 4
        assert not model._closed
    assert llm.closed and model._closed and not model.weights.allocated
    llm.close()                                    # twice: nothing more to do
    # a runner given a model leaves it open: it may serve another runner
    with load_model(tiny_path, devices="cpu") as model:
        with Runner(model, n_ctx=32) as r:
            assert not r.owns_model
        assert not model._closed
        with Runner(model, n_ctx=32) as r:         # the same model, a second runner
            assert len(r.generate(IDS, max_tokens=2, temperature=0).tokens) == 2


def test_open_passes_the_path_through_and_closes_the_model_when_the_runner_fails(tiny_path, monkeypatch):
    import ggmlpy.api as api

    seen, loaded = [], []

    def spy(path, **kw):
        seen.append((path, kw))
        if str(path).startswith("hf://"):
            raise FileNotFoundError(path)
        m = load_model(path, **kw)
        loaded.append(m)
        return m

    monkeypatch.setattr(api, "load_model", spy)
    with pytest.raises(FileNotFoundError):
        ggmlpy.open("hf://org/repo/file.gguf")
    assert seen[0][0] == "hf://org/repo/file.gguf"          # unchanged: load_model resolves it
    assert seen[0][1]["devices"] == "auto" and seen[0][1]["n_gpu_layers"] == -1
    with pytest.raises(GGMLValueError, match="type_k 'nope'"):
        ggmlpy.open(tiny_path, devices="cpu", type_k="nope")
    assert loaded[0]._closed                                  # the model it loaded did not leak
    with pytest.raises(GGMLValueError, match="n_gpu_layers='auto'"):
        ggmlpy.open(tiny_path, devices="cpu", n_ctx="auto")


def test_open_takes_the_default_context(tiny_path, long_ctx_path):
    with ggmlpy.open(tiny_path, devices="cpu") as llm:
        assert llm.n_ctx == 2048 == n_ctx_for(2048)           # the training context, below 4096
        assert (llm.n_batch, llm.n_ubatch, llm.n_seq_max, llm.type_k) == (512, 512, 1, "f16")
    with ggmlpy.open(long_ctx_path, devices="cpu") as llm:
        assert llm.n_ctx == DEFAULTS["n_ctx"] == 4096 == n_ctx_for(8192)


def test_a_placement_search_reserves_for_the_default_context(long_ctx_path):
    with load_model(long_ctx_path, devices="cpu", n_gpu_layers="auto") as model:
        assert model.fit.n_ctx == 4096
        with Runner(model) as r:
            assert r.n_ctx == 4096


# --------------------------------------------------------------------------- sampling keywords


def test_keywords_reach_the_sampler(rt):
    kw = dict(temperature=1.3, top_k=30, top_p=0.9, min_p=0.01)
    by_kw = rt.generate(IDS, max_tokens=16, seed=5, **kw).tokens
    assert by_kw == rt.generate(IDS, max_tokens=16, sampling=SamplingParams(seed=5, **kw)).tokens
    assert by_kw == rt.submit(IDS, max_tokens=16, seed=5, **kw).result().tokens
    # the seed and the settings matter: another seed, or greedy decoding, gives other tokens
    others = [rt.generate(IDS, max_tokens=16, seed=s, **kw).tokens for s in range(6, 10)]
    assert any(o != by_kw for o in others)
    greedy = rt.generate(IDS, max_tokens=16, temperature=0).tokens
    assert greedy == rt.generate(IDS, max_tokens=16, sampling=SamplingParams(temperature=0)).tokens
    assert greedy == rt.generate(IDS, max_tokens=16, temperature=0, seed=9, top_k=2).tokens   # greedy ignores them
    assert any(t != greedy for t in [by_kw, *others])
    # nothing given: the table's sampling, the same as SamplingParams() and as spelling it out
    default = rt.generate(IDS, max_tokens=16, seed=3).tokens
    assert default == rt.generate(IDS, max_tokens=16, sampling=SamplingParams(seed=3)).tokens
    assert default == rt.generate(IDS, max_tokens=16, seed=3, temperature=0.8, top_k=40, top_p=0.95,
                                  min_p=0.05).tokens


def test_logprobs_keywords(rt):
    r = rt.generate(IDS, max_tokens=3, temperature=0, logprobs=True, top_logprobs=4)
    assert len(r.logprobs) == 3 and all(len(lp.top) == 4 and lp.token == t for lp, t in zip(r.logprobs, r.tokens))
    assert rt.generate(IDS, max_tokens=3, temperature=0).logprobs == []


def test_chat_takes_the_keywords_too(rt):
    msgs = [{"role": "user", "content": "hello"}]
    a = rt.chat(msgs, max_tokens=12, temperature=1.1, top_k=50, seed=4)
    b = rt.chat(msgs, max_tokens=12, sampling=SamplingParams(temperature=1.1, top_k=50, seed=4))
    c = rt.submit_chat(msgs, max_tokens=12, temperature=1.1, top_k=50, seed=4).result()
    assert a.tokens == b.tokens == c.tokens and a.text == b.text == c.text


@pytest.mark.parametrize("call", ["generate", "submit", "chat", "submit_chat"])
def test_sampling_and_keywords_together_is_an_error_naming_both(rt, call):
    prompt = [{"role": "user", "content": "hi"}] if "chat" in call else IDS
    with pytest.raises(GGMLValueError, match=r"sampling= and temperature=, seed= given together"):
        getattr(rt, call)(prompt, sampling=SamplingParams(), temperature=0.5, seed=1)
    with pytest.raises(GGMLTypeError, match="sampling must be a SamplingParams"):
        getattr(rt, call)(prompt, sampling={"temperature": 0})
    with pytest.raises(GGMLValueError, match="top_p must be in"):
        getattr(rt, call)(prompt, top_p=0)
    assert rt.wait_idle(HANG)                      # none of them was queued


# --------------------------------------------------------------------------- stream=True


def test_a_stream_yields_the_tokens_of_the_call_without_it(rt):
    want = rt.generate(IDS, max_tokens=12, temperature=0)
    s = rt.generate(IDS, max_tokens=12, temperature=0, stream=True)
    assert isinstance(s, Stream) and iter(s) is s
    events = list(s)
    assert all(isinstance(e, TokenEvent) for e in events) and [e.token for e in events] == want.tokens
    r = s.result()
    assert isinstance(r, Completion) and r.tokens == want.tokens and r.done_reason == DoneReason.LENGTH
    s.close()                                      # after the end: nothing to cancel
    assert s.result().done_reason == DoneReason.LENGTH
    # a text prompt: the text pieces join into the completion's text
    text = rt.generate("hello world", max_tokens=20, temperature=0)
    s = rt.generate("hello world", max_tokens=20, temperature=0, stream=True)
    assert "".join(e.text for e in s) == text.text == s.result().text
    # a chat
    msgs = [{"role": "user", "content": "hello"}]
    reply = rt.chat(msgs, max_tokens=16, temperature=0)
    s = rt.chat(msgs, max_tokens=16, temperature=0, stream=True)
    assert [e.token for e in s] == reply.tokens and s.result().text == reply.text
    with pytest.raises(GGMLValueError, match="no tokens to stream"):
        rt.generate(IDS, embedding=True, stream=True)


def _slot_is_free(rt) -> None:
    """The runner (one sequence) serves a new request: the cancelled one gave its slot back."""
    assert rt.submit(IDS, max_tokens=2, temperature=0).result(timeout=HANG).done_reason == DoneReason.LENGTH


def test_closing_a_stream_early_cancels_its_request(rt):
    assert rt.n_seq_max == 1
    # max_tokens=-1 with context shift: the request never ends on its own
    s = rt.generate(IDS, max_tokens=-1, temperature=0, stream=True)
    first = [next(s) for _ in range(3)]
    s.close()                                      # cancels, and waits until the runner has ended it
    assert s.handle.done and s.result().done_reason == DoneReason.CANCEL
    assert [e.token for e in first] == s.result().tokens[:3]
    assert list(s) == []                           # closed: nothing more
    _slot_is_free(rt)
    # the end of a with block closes it
    with rt.chat([{"role": "user", "content": "hi"}], max_tokens=-1, temperature=0, stream=True) as s:
        next(s)
    assert s.result().done_reason == DoneReason.CANCEL
    _slot_is_free(rt)


def test_dropping_a_stream_cancels_its_request(rt):
    s = rt.generate(IDS, max_tokens=-1, temperature=0, stream=True)
    handle = s.handle
    next(s)
    del s
    gc.collect()
    assert handle.result(timeout=HANG).done_reason == DoneReason.CANCEL
    _slot_is_free(rt)
    # the usual way to drop one: leave the loop over the call
    for _ in rt.generate(IDS, max_tokens=-1, temperature=0, stream=True):
        break
    gc.collect()
    _slot_is_free(rt)
    assert rt.wait_idle(HANG)


# --------------------------------------------------------------------------- signatures and help


@pytest.mark.parametrize("name", ["generate", "submit", "chat", "submit_chat"])
def test_help_shows_every_request_option(name):
    fn = getattr(Runner, name)
    params = inspect.signature(fn).parameters
    assert not any(p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) for p in params.values())
    for p in (*SAMPLING, "max_tokens", "sampling", "stop", "logprobs", "top_logprobs", "images", "shift"):
        assert p in params and params[p].kind == params[p].KEYWORD_ONLY, (name, p)
    assert ("stream" in params) == (name in ("generate", "chat"))
    assert params["max_tokens"].default == DEFAULTS["max_tokens"]
    assert all(params[p].default is None for p in SAMPLING)          # not given: the table's
    text = " ".join(pydoc.render_doc(fn, renderer=pydoc.plaintext).split())
    assert all(f"{p}:" in text for p in SAMPLING) and "= 128" in text and "**kw" not in text
    assert "temperature" in fn.__doc__


def test_help_shows_opens_options():
    params = inspect.signature(ggmlpy.open).parameters
    assert not any(p.kind == p.VAR_KEYWORD for p in params.values())
    for p in ("devices", "n_gpu_layers", "n_ctx", "n_batch", "n_seq_max", "n_threads", "flash_attn", "type_k",
              "mmproj", "rpc", "tokenizer"):
        assert p in params, p
    assert inspect.signature(ggmlpy.open).return_annotation in (Runner, "Runner")
    assert "closes the model too" in ggmlpy.open.__doc__


# --------------------------------------------------------------------------- one table of defaults


def test_the_api_reads_the_table():
    p = SamplingParams()
    assert {k: getattr(p, k) for k in SAMPLING} == {k: DEFAULTS[k] for k in SAMPLING}
    assert (DEFAULTS["temperature"], DEFAULTS["top_k"], DEFAULTS["top_p"], DEFAULTS["min_p"]) == (0.8, 40, 0.95, 0.05)
    load = inspect.signature(load_model).parameters
    for k in ("devices", "n_gpu_layers", "n_seq_max", "n_batch", "n_ubatch", "type_k", "type_v"):
        assert load[k].default == DEFAULTS[k], k
    assert load["devices"].default == "auto" and load["n_ctx"].default is None   # None: n_ctx_for the model
    opened = inspect.signature(ggmlpy.open).parameters
    assert ((opened["devices"].default, opened["n_gpu_layers"].default)
            == (DEFAULTS["devices"], DEFAULTS["n_gpu_layers"]))
    with pytest.raises(TypeError):
        DEFAULTS["temperature"] = 0        # read-only: the signatures took their values at import
    assert n_ctx_for(None) == n_ctx_for(0) == 4096 and n_ctx_for(100) == 100


@pytest.mark.parametrize("command", ["run", "chat"])
def test_the_cli_reads_the_same_table(command, capsys):
    from ggmlpy import cli

    args = cli.build_parser().parse_args([command, "-m", "x.gguf"] + (["-p", "hi"] if command == "run" else []))
    # a sampling flag not given is None (the model file's general.sampling.* may then apply), and its help
    # shows the table's default
    assert (args.temperature, args.top_k, args.top_p, args.min_p, args.seed) == (None,) * 4 + (DEFAULTS["seed"],)
    # -ngl is read as text (N or auto) and made an int once the parse is checked
    assert (args.device, int(args.n_gpu_layers), args.batch_size) == (DEFAULTS["devices"], DEFAULTS["n_gpu_layers"],
                                                                        DEFAULTS["n_batch"])
    assert args.n_predict == CLI_N_PREDICT == -1 and args.ctx_size == 0       # 0: n_ctx_for the model
    # the CLI's sampling with no option given is the API's with none given
    assert cli._sampling(args) == SamplingParams()
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args([command, "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "temperature (default 0.8;" in help_text and "at most 4096)" in help_text
    assert "top-k sampling (default 40;" in help_text and "prompt tokens per batch (default 512)" in help_text


def test_the_examples_in_the_docstrings_run():
    import doctest

    import ggmlpy.defaults
    import ggmlpy.sampling

    tests = [t for mod, obj in ((ggmlpy.defaults, ggmlpy.defaults.n_ctx_for),
                                (ggmlpy.sampling, ggmlpy.sampling.sampling_params))
             for t in doctest.DocTestFinder().find(obj, obj.__name__, module=False, globs=dict(vars(mod)))]
    assert len(tests) == 2
    for t in tests:
        runner = doctest.DocTestRunner()
        runner.run(t)
        assert runner.failures == 0, t.name
