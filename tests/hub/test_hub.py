"""Models from the Hugging Face hub (ggmlpy.hub, ``hf://``, ``-hf``) without the internet: a hub on loopback
(tests/hub_helpers.py) serves repositories of files made by llama.cpp's converter (a tiny Llama with a
SentencePiece vocabulary, F16 and Q8_0) and a split set written by ggmlpy's writer; ``huggingface_hub``
downloads from it (its endpoint pointed there) into a cache in the test's folder.

Checked: the choice of a file by quant tag (any case; the defaults; a missing tag or several matches
refused with the files listed), text from a downloaded model equal to the local file's, a second load
offline from the cache with the server stopped, a download cut midway taken up where it broke, a split
set fetched whole and loaded as one model with the unsplit file's logits, a missing shard named, the
vision encoder beside a model, and ``ggmlpy run``/``bench`` with ``-hf`` in a child process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from hub_helpers import LoopbackHub

from ggmlpy import gguf, hub
from ggmlpy.hub import HubError, HubRef, choose_mmproj, choose_model, parse_ref

PROMPT = "Hello world"
FAKE_MMPROJ = b"an mmproj file (never loaded here)"

# ---------------------------------------------------------------------------------------------- references


def test_references_parse():
    assert parse_ref("hf://org/repo/sub/m-Q8_0.gguf") == HubRef("org/repo", None, "sub/m-Q8_0.gguf", None)
    assert parse_ref("hf://org/repo:q4_k_m") == HubRef("org/repo", None, None, "q4_k_m")
    assert parse_ref("org/repo") == HubRef("org/repo")                       # -hf's form
    assert parse_ref("hf://org/re.po-1@v1.0:Q8_0") == HubRef("org/re.po-1", "v1.0", None, "Q8_0")
    assert str(parse_ref("hf://org/repo@abc/m.gguf")) == "hf://org/repo@abc/m.gguf"
    for bad in ("hf://repo", "hf://org/repo/", "hf://org/repo:", "hf://org/repo:Q8_0/x", "hf://datasets/org/x.gguf",
                "hf://"):
        with pytest.raises(HubError):
            parse_ref(bad)


# ---------------------------------------------------------------------------------------------- the choice

FILES = ["README.md", "m-F16.gguf", "m-Q8_0.gguf", "m-Q4_K_M.gguf", "m-IQ4_XS.gguf", "mmproj-m-F16.gguf",
         "imatrix-Q4_K_M.gguf", "Q2_K/m-Q2_K-00001-of-00002.gguf", "Q2_K/m-Q2_K-00002-of-00002.gguf"]


def test_the_quant_tag_chooses_the_file_in_any_case():
    assert choose_model(FILES, "q8_0") == ["m-Q8_0.gguf"]
    assert choose_model(FILES, "F16") == ["m-F16.gguf"]
    assert choose_model(FILES, "iq4_xs") == ["m-IQ4_XS.gguf"]
    # file names in lower case (as llama.cpp's converter writes them) too
    assert choose_model(["m-q4_k_m.gguf", "m-f16.gguf"]) == ["m-q4_k_m.gguf"]
    assert choose_model(["m-q4_k_m.gguf", "m-f16.gguf"], "F16") == ["m-f16.gguf"]
    # a split set: its shards in order, from the first one's name
    assert choose_model(FILES, "Q2_K") == ["Q2_K/m-Q2_K-00001-of-00002.gguf", "Q2_K/m-Q2_K-00002-of-00002.gguf"]
    # the tag starts a word: Q4_XS is no file's tag (IQ4_XS is another quant), and an mmproj or an
    # imatrix is not a model even with the tag in its name
    with pytest.raises(HubError, match="no model file tagged Q4_XS"):
        choose_model(FILES, "Q4_XS")
    assert choose_model(["imatrix-Q4_K_M.gguf", "m-Q4_K_M.gguf"], "Q4_K_M") == ["m-Q4_K_M.gguf"]


def test_the_default_is_q4_k_m_then_q8_0_then_the_only_model():
    assert choose_model(FILES) == ["m-Q4_K_M.gguf"]
    assert choose_model([f for f in FILES if "Q4_K_M" not in f]) == ["m-Q8_0.gguf"]
    assert choose_model(["a/model-BF16.gguf", "mmproj-F16.gguf", "x.txt"]) == ["a/model-BF16.gguf"]
    with pytest.raises(HubError, match=r"2 model files match none tagged Q4_K_M or Q8_0 .*: m-F16\.gguf, "
                                       r"m-BF16\.gguf"):
        choose_model(["m-F16.gguf", "m-BF16.gguf"])
    with pytest.raises(HubError, match="no GGUF model file; its GGUF files: mmproj-F16.gguf"):
        choose_model(["mmproj-F16.gguf", "README.md"])


def test_a_missing_tag_lists_the_models_and_several_matches_are_refused():
    with pytest.raises(HubError) as e:
        choose_model(FILES, "Q5_K_M", where="org/m")
    msg = str(e.value)
    assert msg.startswith("org/m has no model file tagged Q5_K_M; its models: ")
    for f in ("m-F16.gguf (F16)", "m-Q8_0.gguf (Q8_0)", "Q2_K/m-Q2_K-00001-of-00002.gguf (Q2_K)"):
        assert f in msg
    assert "mmproj" not in msg and "00002-of-00002" not in msg
    with pytest.raises(HubError, match=r"2 model files match the tag Q4_K_M, name one: m-Q4_K_M\.gguf, "
                                       r"m-UD-Q4_K_M\.gguf \(hf://ORG/REPO/FILE, or -hff FILE\)"):
        choose_model(["m-Q4_K_M.gguf", "m-UD-Q4_K_M.gguf"], "q4_k_m")


def test_the_vision_encoder_beside_the_model():
    files = ["mmproj-F16.gguf", "mmproj-Q8_0.gguf", "big/m-Q8_0.gguf", "big/mmproj-m-BF16.gguf",
             "other/mmproj-F16.gguf", "m-Q8_0.gguf", "m-F32.gguf"]
    assert choose_mmproj(files, "m-Q8_0.gguf") == "mmproj-Q8_0.gguf"         # the closest bits
    assert choose_mmproj(files, "m-F32.gguf") == "mmproj-F16.gguf"
    assert choose_mmproj(files, "big/m-Q8_0.gguf") == "big/mmproj-m-BF16.gguf"   # the nearest folder first
    assert choose_mmproj(["m-Q8_0.gguf"], "m-Q8_0.gguf") is None


# ---------------------------------------------------------------------------------------------- served files


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny model converted by llama.cpp's converter, F16 and Q8_0, and the Q8_0 one as a split set of
    three shards written by ggmlpy's writer."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import hf_convert

    out = tmp_path_factory.mktemp("hub-model")
    spm = hf_convert.spm_tokenizer_model()
    import sentencepiece

    n_vocab = sentencepiece.SentencePieceProcessor(model_file=str(spm)).get_piece_size()
    cfg = transformers.LlamaConfig(vocab_size=n_vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                                   attn_implementation="eager")
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    hf_convert.perturb_constant_weights(model, seed=4)
    files = {q: hf_convert.convert(model, out, hf_convert.SPM, outtype=q.lower(), name="tiny") for q in ("F16", "Q8_0")}
    (out / "split").mkdir()
    files["split"] = gguf.write_split(files["Q8_0"], out / "split" / "tiny-Q8_0.gguf", max_tensors=8)
    assert len(files["split"]) == 3
    return files


@pytest.fixture
def served(tiny, tmp_path, monkeypatch):
    """The hub on loopback with four repositories, and huggingface_hub pointed at it with its cache in
    ``tmp_path/hf/hub`` (what ``HF_HOME=tmp_path/hf`` gives a child process)."""
    import huggingface_hub.constants as hfc

    with LoopbackHub() as h:
        h.add("org/tiny", {"tiny-F16.gguf": tiny["F16"], "tiny-Q8_0.gguf": tiny["Q8_0"],
                           "mmproj-tiny-F16.gguf": FAKE_MMPROJ, "README.md": b"# tiny"})
        h.add("org/tiny-split", {os.path.basename(p): p for p in tiny["split"]})
        h.add("org/tiny-split-broken", {os.path.basename(p): p for p in tiny["split"][:2]})
        h.add("org/tiny-q4", {"tiny-Q4_K_M.gguf": tiny["F16"], "tiny-Q8_0.gguf": tiny["Q8_0"]})
        monkeypatch.setenv("HF_ENDPOINT", h.url)        # ggmlpy.hub reads it at each call
        monkeypatch.setattr(hfc, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
        monkeypatch.setattr(hfc, "HF_HUB_OFFLINE", False)
        yield h


def _same_file(a, b) -> bool:
    return Path(a).read_bytes() == Path(b).read_bytes()


def _text(path) -> str:
    from ggmlpy.load import load_model
    from ggmlpy.runner import Runner

    with load_model(path, devices="cpu") as m, Runner(m, n_ctx=64, n_threads=1) as rt:
        return rt.generate(PROMPT, max_tokens=8, temperature=0).text


@pytest.mark.hf
def test_downloads_the_file_of_the_tag(served, tiny, tmp_path):
    m = hub.resolve("hf://org/tiny:q8_0")
    assert m.files == ("tiny-Q8_0.gguf",) and _same_file(m.path, tiny["Q8_0"])
    assert m.path.startswith(str(tmp_path / "hf" / "hub" / "models--org--tiny" / "snapshots"))
    assert _same_file(hub.resolve("hf://org/tiny:F16").path, tiny["F16"])
    assert hub.resolve("hf://org/tiny").files == ("tiny-Q8_0.gguf",)         # no Q4_K_M: Q8_0
    assert hub.resolve("hf://org/tiny-q4").files == ("tiny-Q4_K_M.gguf",)    # Q4_K_M first
    assert _same_file(hub.resolve("hf://org/tiny/tiny-F16.gguf").path, tiny["F16"])
    with pytest.raises(HubError, match=r"^hf://org/tiny:Q5_K_M: org/tiny \(revision main\) has no model file tagged "
                                       r"Q5_K_M; its models: "
                                       r"tiny-F16\.gguf \(F16\), tiny-Q8_0\.gguf \(Q8_0\)"):
        hub.resolve("hf://org/tiny:Q5_K_M")
    with pytest.raises(HubError, match="no repository org/nothing on http://127.0.0.1"):
        hub.resolve("hf://org/nothing")
    with pytest.raises(HubError, match="org/tiny has no revision v9"):
        hub.resolve("hf://org/tiny@v9:Q8_0")
    # nothing but what was asked for was downloaded
    gets = [p for meth, p, _ in served.requests if meth == "GET" and "/resolve/" in p]
    assert sorted(set(gets)) == ["/org/tiny-q4/resolve/main/tiny-Q4_K_M.gguf", "/org/tiny/resolve/main/tiny-F16.gguf",
                                 "/org/tiny/resolve/main/tiny-Q8_0.gguf"]


@pytest.mark.hf
def test_load_model_from_the_hub_writes_what_the_local_file_writes(served, tiny):
    from ggmlpy.load import load_model

    assert _text("hf://org/tiny:Q8_0") == _text(tiny["Q8_0"])
    # the model's vision encoder from the same repository, when asked for (hf://ORG/REPO as mmproj)
    path, mmproj = hub.local_files("hf://org/tiny:Q8_0", "hf://org/tiny")
    assert _same_file(path, tiny["Q8_0"]) and Path(mmproj).read_bytes() == FAKE_MMPROJ
    assert hub.resolve("hf://org/tiny:Q8_0").mmproj_path is None            # found, not fetched unasked
    with pytest.raises(HubError, match="has no vision encoder"):
        hub.resolve("hf://org/tiny-q4", mmproj=True)
    with pytest.raises(HubError, match="has no model file tagged Q2_K"):
        load_model("hf://org/tiny:Q2_K", devices="cpu")


def _child_env(tmp_path, url: str, offline: bool) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT=url, HF_HUB_DISABLE_TELEMETRY="1",
               HF_HUB_OFFLINE="1" if offline else "0")
    return env


_CHILD = textwrap.dedent("""
    import json, sys
    from ggmlpy.load import load_model
    from ggmlpy.runner import Runner
    out = {}
    for ref in sys.argv[1:]:
        try:
            with load_model(ref, devices="cpu") as m, Runner(m, n_ctx=64, n_threads=1) as rt:
                out[ref] = rt.generate(%r, max_tokens=8, temperature=0).text
        except Exception as e:
            out[ref] = f"{type(e).__name__}: {e}"
    print(json.dumps(out))
""") % PROMPT


@pytest.mark.hf
def test_a_second_load_offline_comes_from_the_cache(served, tiny, tmp_path):
    hub.resolve("hf://org/tiny:Q8_0")             # downloaded once
    served.stop()                                 # and the hub gone
    refs = ["hf://org/tiny:Q8_0", "hf://org/tiny", "hf://org/tiny/tiny-F16.gguf", "hf://org/never"]
    r = subprocess.run([sys.executable, "-c", _CHILD, *refs], env=_child_env(tmp_path, served.url, offline=True),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    want = _text(tiny["Q8_0"])
    assert out["hf://org/tiny:Q8_0"] == want
    assert out["hf://org/tiny"] == want           # offline, the default among the cached files
    assert out["hf://org/tiny/tiny-F16.gguf"].startswith("HubError: hf://org/tiny/tiny-F16.gguf: the hub cache's "
                                                         "copy of org/tiny (revision main; offline: HF_HUB_OFFLINE=1")
    assert "has no file tiny-F16.gguf" in out["hf://org/tiny/tiny-F16.gguf"]
    assert out["hf://org/never"].startswith("HubError: hf://org/never: org/never (revision main) is not in the hub "
                                            "cache") and "offline (HF_HUB_OFFLINE=1)" in out["hf://org/never"]


@pytest.mark.hf
def test_an_unreachable_hub_falls_back_to_the_cache(served, tiny):
    hub.resolve("hf://org/tiny:Q8_0")
    served.stop()
    m = hub.resolve("hf://org/tiny:Q8_0")
    assert m.offline and _same_file(m.path, tiny["Q8_0"])
    with pytest.raises(HubError, match=r"out of reach.*has no model file tagged F16"):
        hub.resolve("hf://org/tiny:F16")


@pytest.mark.hf
def test_a_download_cut_midway_resumes_where_it_broke(served, tmp_path):
    # larger than huggingface_hub's write chunk (10 MiB), so that part of it is on disk when the cut comes
    data = np.random.default_rng(0).integers(0, 256, 24 << 20, dtype=np.uint8).tobytes()
    served.add("org/big", {"big-F32.gguf": data})
    served.cut("org/big", "big-F32.gguf")
    m = hub.resolve("hf://org/big")
    assert Path(m.path).read_bytes() == data
    ranges = served.gets("big-F32.gguf")
    assert len(ranges) == 2 and ranges[0] is None
    start = int(ranges[1].removeprefix("bytes=").removesuffix("-"))
    assert 0 < start <= len(data) // 2                        # the second GET asked for the rest only
    blobs = Path(m.path).parents[2] / "blobs"
    assert not [p for p in blobs.iterdir() if p.name.endswith(".incomplete")]


@pytest.mark.hf
def test_a_split_set_is_fetched_whole_and_loads_as_one_model(served, tiny):
    from ggmlpy.load import load_model
    from ggmlpy.runner import Runner

    m = hub.resolve("hf://org/tiny-split:Q8_0")
    names = [os.path.basename(p) for p in tiny["split"]]
    assert m.files == tuple(names) and all(_same_file(a, b) for a, b in zip(m.paths, tiny["split"]))
    # a later shard named: the whole set, loaded from its first
    assert hub.resolve(f"hf://org/tiny-split/{names[1]}").paths == m.paths

    def logits(path):
        with load_model(path, devices="cpu") as model, Runner(model, n_ctx=64, n_threads=1) as rt:
            return rt.decode([1, 20, 300, 7, 55], logits="all")

    assert np.array_equal(logits("hf://org/tiny-split:Q8_0"), logits(tiny["Q8_0"]))
    with pytest.raises(HubError, match=f"org/tiny-split-broken has no file {names[2]}"):
        hub.resolve("hf://org/tiny-split-broken:Q8_0")


# ---------------------------------------------------------------------------------------------- the CLI


def _cli(tmp_path, url, *args, offline=False, input=None):
    return subprocess.run([sys.executable, "-m", "ggmlpy.cli", *args], capture_output=True, text=True, timeout=300,
                          env=_child_env(tmp_path, url, offline), encoding="utf-8", input=input)


def _serve_once(tmp_path, url, args) -> None:
    """``ggmlpy serve`` ARGS against the loopback hub: it resolves the file, listens, becomes ready and
    answers a completion, then exits 0 on SIGTERM."""
    import re
    import signal
    import time

    import httpx

    proc = subprocess.Popen([sys.executable, "-m", "ggmlpy.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=_child_env(tmp_path, url, False),
                            encoding="utf-8")
    lines: list = []
    try:
        port = None
        t_end = time.monotonic() + 120
        while port is None and time.monotonic() < t_end:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
            port = int(m[1]) if m else None
        assert port, "".join(lines)
        base = f"http://127.0.0.1:{port}"
        while time.monotonic() < t_end and httpx.get(base + "/health", timeout=5).status_code != 200:
            time.sleep(0.1)
        r = httpx.post(base + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0},
                       timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"], r.text
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0 and "-Q4_K_M.gguf (revision main)" in "".join(lines) + out, "".join(lines) + out


@pytest.mark.hf
def test_ggmlpy_run_with_hf(served, tiny, tmp_path):
    from ggmlpy.load import load_model
    from ggmlpy.runner import Runner

    with load_model(tiny["Q8_0"], devices="cpu") as m, Runner(m, n_ctx=64) as rt:
        want = rt.generate("Hi", max_tokens=4, temperature=0, shift=False).text
    common = ["-p", "Hi", "-n", "4", "--temp", "0", "-c", "64", "-t", "1", "-dev", "cpu"]
    r = _cli(tmp_path, served.url, "run", "-hf", "org/tiny:Q8_0", *common)
    assert r.returncode == 0, r.stderr
    assert r.stdout == want + "\n"
    assert "hf://org/tiny:Q8_0 -> org/tiny/tiny-Q8_0.gguf (revision main)" in r.stderr
    assert "org/tiny also has a vision encoder, mmproj-tiny-F16.gguf: add --mmproj" in r.stderr
    r = _cli(tmp_path, served.url, "run", "-hf", "org/tiny", "-hff", "tiny-Q8_0.gguf", *common)
    assert r.returncode == 0 and r.stdout == want + "\n", r.stderr
    # one line and exit status 1 for a tag the repository lacks; 2 for options that do not go together
    r = _cli(tmp_path, served.url, "run", "-hf", "org/tiny:Q5_K_M", *common)
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1].startswith(
        "ggmlpy run: error: -hf org/tiny:Q5_K_M: org/tiny (revision main) has no model file tagged Q5_K_M; its "
        "models: tiny-F16.gguf (F16), tiny-Q8_0.gguf (Q8_0)")
    for args, msg in ((["-m", tiny["Q8_0"], "-hf", "org/tiny"], "give one"),
                      (["-hff", "tiny-F16.gguf"], "-hf ORG/REPO is missing"),
                      (["-hf", "org/tiny:Q8_0", "-hff", "x.gguf"], "a quant tag and a file"),
                      ([], "a model is needed: -m FILE or -hf ORG/REPO[:QUANT]")):
        r = _cli(tmp_path, served.url, "run", *args, *common)
        assert r.returncode == 2 and msg in r.stderr, r.stderr
    served.stop()
    r = _cli(tmp_path, served.url, "run", "-hf", "org/tiny:Q8_0", *common, offline=True)
    assert r.returncode == 0 and r.stdout == want + "\n", r.stderr


@pytest.mark.hf
def test_ggmlpy_chat_and_images_with_hf(served, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    r = subprocess.run([sys.executable, "-m", "ggmlpy.cli", "chat", "-hf", "org/tiny:Q8_0", "--chat-template-file",
                        str(template), "-n", "4", "--temp", "0", "-c", "64", "-t", "1", "-dev", "cpu"],
                       input="Hi\n/bye\n", capture_output=True, text=True, timeout=300,
                       env=_child_env(tmp_path, served.url, False))
    assert r.returncode == 0, r.stderr
    assert "hf://org/tiny:Q8_0 -> org/tiny/tiny-Q8_0.gguf (revision main)" in r.stderr
    # images ask for the repository's vision encoder: fetched and given to the loader (which refuses this
    # one, a stand-in that is not GGUF: proof that it was the file passed)
    Image = pytest.importorskip("PIL.Image")
    Image.new("RGB", (8, 8)).save(tmp_path / "i.png")
    for extra in (["--image", str(tmp_path / "i.png")], ["--mmproj"]):
        r = _cli(tmp_path, served.url, "run", "-hf", "org/tiny:Q8_0", "-p", "x", "-n", "1", "-dev", "cpu", *extra)
        assert r.returncode == 1 and "mmproj-tiny-F16.gguf: not a GGUF file" in r.stderr, r.stderr
        assert "vision encoder mmproj-tiny-F16.gguf" in r.stderr


@pytest.mark.hf
def test_ggmlpy_bench_with_hf(served, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_loopback")       # the library's token, sent with every request
    r = _cli(tmp_path, served.url, "bench", "-hf", "org/tiny-split:Q8_0", "-p", "8", "-n", "0", "-r", "1", "-t", "1",
             "-dev", "none", "-o", "json")
    assert r.returncode == 0, r.stderr
    assert len(served.requests) >= 7 and set(served.authorizations) == {"Bearer hf_loopback"}
    rows = json.loads(r.stdout)
    assert len(rows) == 1 and rows[0]["model_filename"].endswith("tiny-Q8_0-00001-of-00003.gguf")
    assert str(tmp_path / "hf" / "hub") in rows[0]["model_filename"]
    r = _cli(tmp_path, served.url, "bench", "-hf", "org/tiny:Q8_0", "-hff", "x.gguf", "-p", "8")
    assert r.returncode == 2 and "-hff x.gguf: names a file of one -hf ORG/REPO (without a :QUANT tag)" in r.stderr


@pytest.mark.hf
def test_the_readme_gets_a_model_from_the_hub(served, tiny, tmp_path):
    """The README's ``-hf`` commands and its ``hf://`` line, as written, against a repository of that name on
    the loopback hub (the tiny model under the file names such a repository has)."""
    import re
    import shlex

    import ggmlpy

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    commands = [line for block in re.findall(r"```bash\n(.*?)```", readme, re.S) for line in block.splitlines()
                if line.startswith("ggmlpy ") and " -hf " in line]
    lines = re.findall(r'`(ggmlpy\.open\("hf://[^"]+"\))`', readme)
    assert commands and lines
    repos = {parse_ref(shlex.split(c)[shlex.split(c).index("-hf") + 1]) for c in commands}
    repos |= {parse_ref(re.search(r'"(hf://[^"]+)"', line)[1]) for line in lines}
    for ref in repos:
        stem = ref.repo.split("/")[1].removesuffix("-GGUF")
        served.add(ref.repo, {f"{stem}-{ref.quant}.gguf": tiny["Q8_0"], f"{stem}-F16.gguf": tiny["F16"]})
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    for c in commands:
        args, stdin = [*shlex.split(c)[1:], "-t", "1"], None
        if args[0] == "serve":     # serves until stopped: up, the hub's file loaded and answering, then SIGTERM
            _serve_once(tmp_path, served.url, [*args, "--port", "0", "-c", "64"])
            continue
        if args[0] == "chat":      # the served tiny model has no chat template: give one; one turn, then /bye
            args, stdin = [*args, "--chat-template-file", str(template), "-n", "4"], "Hi\n/bye\n"
        r = _cli(tmp_path, served.url, *args, input=stdin)
        assert r.returncode == 0 and r.stdout.strip(), r.stderr
        assert "-Q4_K_M.gguf (revision main)" in r.stderr
    for line in lines:
        with eval(line, {"ggmlpy": ggmlpy}) as llm:       # noqa: S307  (the README's own line)
            assert llm.model.path.endswith("-Q4_K_M.gguf") and _same_file(llm.model.path, tiny["Q8_0"])
            assert llm.generate(PROMPT, max_tokens=8, temperature=0).text == _text(tiny["Q8_0"])
