"""Images through ``ggmlpy serve`` (issue 39) on tiny converted vision models (tests/vision_helpers.py: random-weight
gemma3 and idefics3, each converted by llama.cpp's converter into a text GGUF and an mmproj GGUF).

A real server process (``--mmproj``; ``--chat-template-file``, since the fixtures' files have no template) is
sent real PNGs made here with Pillow: as OpenAI's ``image_url`` data URLs by the official ``openai`` client, and
as Ollama's base64 ``images`` by httpx. Each reply is compared with ``Runner.chat`` in this process on the same
files, messages and images:

* the greedy text, and the log-probabilities of its tokens (to :data:`TOL`): random weights often give the same
  text for any image, but another image moves the log-probabilities by about 0.1 (checked in the test), so a
  server that dropped, reordered or decoded an image differently would fail;
* the token counts, and the prompt's against the HF processor's ids for the same chat (its image tokens, every
  idefics3 tile's, included): a count nobody here wrote.

Both sides use ggml's kernels (the own kernels are chosen by timing, which could differ between two processes)
and F32 caches (an F16 cache rounds differently when a prefix is reused: ~1e-3 in a log-probability).

Then the refusals, each a 4xx naming the field and the cause, the server serving on: a server without
``--mmproj``; data URLs that are not images; decompression bombs (refused from the header: the server's peak
RSS does not move); remote URLs (never fetched: a listener sees no connection) and local files (never read);
more images than the context holds (refused before any is decoded, again seen in the peak RSS).
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import socket
import struct
import zlib

import httpx
import numpy as np
import pytest
from server_helpers import ServerProcess

pytest.importorskip("torch")
Image = pytest.importorskip("PIL.Image")
vh = pytest.importorskip("vision_helpers")

from ggmlpy import load_model  # noqa: E402
from ggmlpy.runner import Runner  # noqa: E402

pytestmark = pytest.mark.hf

N_CTX = 256
#: generated tokens per compared reply
MAX = 6
#: server against in-process log-probabilities (measured: 0 from a fresh cache, ~2e-6 after a prefix reuse)
TOL = 1e-4
#: the peak RSS a refused image may add (a decoded 100-megapixel image alone is over 100 MiB)
PEAK_MIB = 48
#: both processes on ggml's kernels (see the module notes)
KERNELS = {"GGMLPY_KERNELS": "ggml"}
RUNNER_KW = {"n_ctx": N_CTX, "kernels": "ggml", "type_k": "f32", "type_v": "f32", "reuse_graphs": False}
SERVER_ARGS = ("-c", N_CTX, "-np", "1", "-ctk", "f32", "-ctv", "f32", "-dev", "cpu")


def png(height: int, width: int, seed: int) -> bytes:
    """A real PNG of :func:`vision_helpers.sample_image`'s pixels, written by Pillow."""
    buf = io.BytesIO()
    Image.fromarray(vh.sample_image(height, width, seed=seed)).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def zeros_png(width: int, height: int, rows=None) -> bytes:
    """A greyscale PNG of zeros, written by hand: ``rows`` rows of data (all by default). Zeros compress ~1000:1,
    so a small body declares a huge image."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    c = zlib.compressobj(1)
    n = (width + 1) * (height if rows is None else rows)       # each row: filter byte 0, then the pixels
    block, parts = bytes(1 << 20), []
    while n > 0:
        parts.append(c.compress(block[:min(n, len(block))]))
        n -= len(block)
    parts.append(c.flush())
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"".join(parts)) + chunk(b"IEND", b"")


def text_part(text: str) -> dict:
    return {"type": "text", "text": text}


def image_part(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(data)}}


@dataclasses.dataclass
class Setup:
    """A family's fixture files, its server (with ``--mmproj``) and the in-process runner it is compared with."""

    fx: object
    template: str
    server: ServerProcess
    runner: Runner
    name: str

    def chat(self, messages: list, **kw):
        """The server's reply through the ``openai`` client (greedy, with log-probabilities)."""
        return self.server.client().chat.completions.create(model=self.name, messages=messages, temperature=0,
                                                            max_tokens=MAX, logprobs=True, **kw)

    def reference(self, messages: list):
        return self.runner.chat(messages, template=self.template, temperature=0, max_tokens=MAX, logprobs=True)

    def hf_ids(self, messages: list) -> list:
        """The HF processor's prompt ids for the chat (images as PIL images decoded from the parts)."""
        hf = []
        for m in messages:
            content = m["content"]
            if isinstance(content, list):
                content = [{"type": "image", "image": _pil(p)} if p["type"] in ("image", "image_url") else p
                           for p in content]
            hf.append({"role": m["role"], "content": content})
        out = self.fx.processor.apply_chat_template(hf, chat_template=self.template, add_generation_prompt=True,
                                                    tokenize=True, return_dict=True, return_tensors="np")
        return [int(t) for t in out["input_ids"][0]]

    def post(self, body: dict, path: str = "/v1/chat/completions") -> httpx.Response:
        return httpx.post(self.server.url + path, json={"model": self.name, **body}, timeout=120)

    def serves(self) -> None:
        """An image chat still gets its reply."""
        r = self.post({"messages": [{"role": "user", "content": [text_part("and this?"), image_part(SMALL)]}],
                       "max_tokens": 1})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop"), r.text


def _pil(part: dict):
    if part["type"] == "image_url":
        data = base64.b64decode(part["image_url"]["url"].split(",", 1)[1])
    else:
        data = part["image"]
    return Image.open(io.BytesIO(data)).convert("RGB")


def _setup(family: str, tmp_path_factory):
    fx = vh.make(family, tmp_path_factory.mktemp(family))
    template = vh.CHAT_TEMPLATES[family]
    tpl = fx.text_path.parent / "template.jinja"
    tpl.write_text(template)
    srv = ServerProcess(fx.text_path, "--mmproj", fx.mmproj_path, "--chat-template-file", tpl, *SERVER_ARGS,
                        env=KERNELS)
    model = load_model(str(fx.text_path), mmproj=str(fx.mmproj_path), devices="cpu")
    runner = Runner(model, **RUNNER_KW)
    s = Setup(fx, template, srv, runner, fx.text_path.stem)
    s.reference([{"role": "user", "content": [text_part("warm up"), image_part(SMALL)]}])
    return s, model


def _teardown(s: Setup, model) -> None:
    s.runner.close()
    model.close()
    assert s.server.stop() == 0, s.server.output()[-3000:]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    s, model = _setup(vh.GEMMA3, tmp_path_factory)
    yield s
    _teardown(s, model)


@pytest.fixture(scope="module")
def idefics(tmp_path_factory):
    s, model = _setup(vh.IDEFICS3, tmp_path_factory)
    yield s
    _teardown(s, model)


SMALL = png(8, 8, seed=9)
A = png(100, 70, seed=3)
B = png(60, 90, seed=4)


def _logprobs(reply) -> np.ndarray:
    return np.array([t.logprob for t in reply.choices[0].logprobs.content])


def _ref_logprobs(c) -> np.ndarray:
    return np.array([lp.logprob for lp in c.logprobs])


def _assert_same(s: Setup, messages: list, reply, ref) -> list:
    """The server's reply is the runner's: text, counts, log-probabilities; the prompt count is the HF
    processor's. Returns the HF ids."""
    ids = s.hf_ids(messages)
    assert reply.choices[0].message.content == ref.content
    u = reply.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == \
        (ref.prompt_eval_count, ref.eval_count, ref.prompt_eval_count + ref.eval_count)
    assert u.prompt_tokens == len(ids)
    np.testing.assert_allclose(_logprobs(reply), _ref_logprobs(ref), rtol=0, atol=TOL)
    return ids


# ------------------------------------------------------------------------------------------------ OpenAI's route

def test_an_image_reply_equals_the_runner(gemma):
    """A text part and an image_url part: the greedy reply, its log-probabilities and the counts are the
    runner's; the prompt holds the image's 16 tokens (the HF processor's count); another image moves the
    log-probabilities far beyond the tolerance."""
    messages = [{"role": "user", "content": [text_part("What is in this picture?"), image_part(A)]}]
    ref = gemma.reference(messages)
    ids = _assert_same(gemma, messages, gemma.chat(messages), ref)
    assert ids.count(gemma.fx.image_token_id) == vh.TOKENS_PER_IMAGE
    other = gemma.reference([{"role": "user", "content": [text_part("What is in this picture?"), image_part(B)]}])
    assert np.abs(_ref_logprobs(other) - _ref_logprobs(ref)).max() > 100 * TOL


def test_streamed_deltas_join_to_the_reply(gemma):
    messages = [{"role": "user", "content": [text_part("Describe"), image_part(B)]}]
    whole = gemma.chat(messages)
    pieces, usage = [], None
    for chunk in gemma.chat(messages, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
    assert "".join(pieces) == whole.choices[0].message.content
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, whole.usage.completion_tokens)
    _assert_same(gemma, messages, whole, gemma.reference(messages))


def test_two_images_in_one_message(gemma):
    messages = [{"role": "user", "content": [text_part("Look at "), image_part(A), text_part(" and "), image_part(B),
                                             text_part(", what changed?")]}]
    ids = _assert_same(gemma, messages, gemma.chat(messages), gemma.reference(messages))
    assert ids.count(gemma.fx.image_token_id) == 2 * vh.TOKENS_PER_IMAGE
    # the order matters: swapped, the log-probabilities move
    swapped = [{"role": "user", "content": [text_part("Look at "), image_part(B), text_part(" and "), image_part(A),
                                            text_part(", what changed?")]}]
    assert np.abs(_logprobs(gemma.chat(swapped)) - _ref_logprobs(gemma.reference(messages))).max() > 100 * TOL


def test_an_image_in_an_earlier_turn(gemma):
    """The image is in the first user turn; the reply is to the last."""
    messages = [{"role": "user", "content": [image_part(A), text_part("What is this?")]},
                {"role": "assistant", "content": "A picture of stripes."},
                {"role": "user", "content": "Which colour is at the top?"}]
    ids = _assert_same(gemma, messages, gemma.chat(messages), gemma.reference(messages))
    assert ids.count(gemma.fx.image_token_id) == vh.TOKENS_PER_IMAGE


def test_a_tiled_image_counts_every_tile(idefics):
    """idefics3 cuts an image into tiles plus a global one: the prompt counts every tile's tokens, as the HF
    processor does, and the reply is the runner's."""
    wide = png(40, 120, seed=5)
    messages = [{"role": "user", "content": [image_part(wide), text_part("Describe it.")]}]
    ids = _assert_same(idefics, messages, idefics.chat(messages), idefics.reference(messages))
    assert ids.count(idefics.fx.image_token_id) == 3 * vh.TOKENS_PER_IMAGE       # 1 x 2 tiles and the global one


# ------------------------------------------------------------------------------------------------ Ollama's routes

def _ollama(s: Setup, path: str, body: dict) -> dict:
    r = s.post({"stream": False, "options": {"temperature": 0, "num_predict": MAX}, **body}, path)
    assert r.status_code == 200, r.text
    return r.json()


def test_ollama_chat_and_generate_give_the_runners_reply(gemma):
    """``/api/chat`` (``messages[].images``) and ``/api/generate`` (``images``) put the images before the text, as
    Ollama does: both give the runner's reply to that message (through ``--chat-template-file``'s template), and
    so does OpenAI's route given the same parts; the streamed NDJSON joins to the same text."""
    prompt = "What is in this picture?"
    b64 = base64.b64encode(A).decode()
    ref = gemma.runner.chat([{"role": "user", "content": [{"type": "image", "image": A}, text_part(prompt)]}],
                            template=gemma.template, temperature=0, max_tokens=MAX)
    chat = _ollama(gemma, "/api/chat", {"messages": [{"role": "user", "content": prompt, "images": [b64]}]})
    gen = _ollama(gemma, "/api/generate", {"prompt": prompt, "images": [b64]})
    for got, text in ((chat, chat["message"]["content"]), (gen, gen["response"])):
        assert text == ref.content
        assert (got["prompt_eval_count"], got["eval_count"]) == (ref.prompt_eval_count, ref.eval_count)
    openai_reply = gemma.chat([{"role": "user", "content": [image_part(A), text_part(prompt)]}])
    assert openai_reply.choices[0].message.content == ref.content
    with httpx.stream("POST", gemma.server.url + "/api/chat", timeout=120,
                      json={"messages": [{"role": "user", "content": prompt, "images": [b64]}],
                            "options": {"temperature": 0, "num_predict": MAX}}) as r:
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert "".join(obj["message"]["content"] for obj in lines) == ref.content
    assert lines[-1]["done"] and lines[-1]["prompt_eval_count"] == ref.prompt_eval_count


# ------------------------------------------------------------------------------------------------ refusals

def test_a_server_without_mmproj_names_the_missing_projector(gemma, tmp_path):
    """The same text model served without ``--mmproj``: an image is a 400 naming the flag and the image's place on
    every route; text still works."""
    tpl = tmp_path / "template.jinja"
    tpl.write_text(gemma.template)
    srv = ServerProcess(gemma.fx.text_path, "--chat-template-file", tpl, *SERVER_ARGS, env=KERNELS)
    try:
        url = srv.url
        r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": [text_part("see"), image_part(A)]}], "max_tokens": 1})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert "--mmproj" in err["message"] and "no images" in err["message"]
        assert err["param"] == "messages[0].content[1]"
        b64 = base64.b64encode(A).decode()
        for path, body, where in (
                ("/api/chat", {"messages": [{"role": "user", "content": "see", "images": [b64]}]},
                 "messages[0].images[0]"),
                ("/api/generate", {"prompt": "see", "images": [b64]}, "images[0]")):
            r = httpx.post(url + path, json={**body, "stream": False}, timeout=60)
            assert r.status_code == 400 and r.json()["error"].startswith(where) and "--mmproj" in r.json()["error"]
        r = httpx.post(url + "/v1/chat/completions", timeout=60,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        assert r.status_code == 200, r.text
    finally:
        assert srv.stop() == 0, srv.output()[-3000:]


_TRUNCATED = A[: len(A) // 2]


@pytest.mark.parametrize("url, words", [
    ("data:image/png;base64,%%%not-base64%%%", "base64 payload is not valid"),
    (data_url(b"Dear diary,\nnothing happened today.\n" * 8, "text/plain"), "cannot decode the image"),
    (data_url(b"Dear diary,\nnothing happened today.\n" * 8), "cannot decode the image"),
    (data_url(_TRUNCATED), "truncated"),
    (data_url(A[:40]), "cannot decode the image"),
    ("data:image/png;base64,", "empty"),
    ("data:image/png;base64" + base64.b64encode(A).decode(), "no ','"),
], ids=["bad base64", "text file", "text file as PNG", "truncated PNG", "PNG header only", "empty", "no comma"])
def test_data_urls_that_are_not_images(gemma, url, words):
    messages = [{"role": "user", "content": [text_part("see"), image_part(SMALL), text_part("and"),
                                             {"type": "image_url", "image_url": {"url": url}}]}]
    r = gemma.post({"messages": messages, "max_tokens": 1})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    # the second image is named: its place in the request, then what is wrong with it
    assert err["param"] == "messages[0].content[3]" and err["message"].startswith("messages[0].content[3]: image")
    assert words in err["message"], err
    gemma.serves()


def test_ollama_images_that_are_not_images(gemma):
    text = base64.b64encode(b"Dear diary,\nnothing happened today.\n" * 8).decode()
    ok = base64.b64encode(SMALL).decode()
    cases = [("/api/chat", {"messages": [{"role": "user", "content": "see", "images": [ok, text]}]},
              "messages[0].images[1]: image bytes: cannot decode"),
             ("/api/chat", {"messages": [{"role": "user", "content": "see", "images": ["%%%"]}]},
              "messages[0].images[0] is not valid base64"),
             ("/api/generate", {"prompt": "see", "images": [ok, text]}, "images[1]: image bytes: cannot decode"),
             # /api/generate has no messages: its images are images[j]
             ("/api/generate", {"prompt": "see", "images": ["%%%"]}, "images[0] is not valid base64")]
    for path, body, words in cases:
        r = gemma.post({**body, "stream": False}, path)
        assert r.status_code == 400 and r.json()["error"].startswith(words), (path, r.text)
    gemma.serves()


def test_decompression_bombs_are_refused_from_the_header(gemma):
    """Images declaring 100 megapixels to 4.3 gigapixels in a small body: 400 "too large" before anything is
    decoded; the server's peak RSS does not move (decoding the smallest would take over 100 MiB)."""
    peak = gemma.server.rss_mib("VmHWM")
    bombs = {"10000x10000, every row": zeros_png(10000, 10000), "65535x65535, one row": zeros_png(65535, 65535, 1),
             "GIF screen 65535x65535": b"GIF89a" + struct.pack("<HH", 65535, 65535) + b"\x80\x00\x00" + bytes(6)
             + b"\x2c" + struct.pack("<HHHH", 0, 0, 1, 1) + b"\x00\x02\x02\x44\x01\x00\x3b"}
    for name, data in bombs.items():
        r = gemma.post({"messages": [{"role": "user", "content": [text_part("see"), image_part(data)]}],
                        "max_tokens": 1})
        assert r.status_code == 400, (name, r.text)
        assert "too large" in r.json()["error"]["message"] and "refused before decoding" in r.json()["error"]["message"]
        r = gemma.post({"prompt": "see", "images": [base64.b64encode(data).decode()], "stream": False},
                       "/api/generate")
        assert r.status_code == 400 and "too large" in r.json()["error"], (name, r.text)
    assert gemma.server.rss_mib("VmHWM") - peak < PEAK_MIB
    gemma.serves()


def test_remote_and_local_urls_are_never_fetched(gemma):
    """http(s) and ftp URLs are refused unfetched (a listener they name sees no connection), paths and file://
    URLs unread; each names the part's url."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        port = listener.getsockname()[1]
        urls = {f"http://127.0.0.1:{port}/cat.png": "never fetches", f"HTTPS://127.0.0.1:{port}/cat.png":
                "never fetches", f"ftp://127.0.0.1:{port}/cat.png": "never fetches",
                "/etc/passwd": "never reads local files", "file:///etc/passwd": "never reads local files",
                "cat.png": "never reads local files", " data:image/png;base64,AAAA": "never reads local files"}
        for url, words in urls.items():
            part = {"type": "image_url", "image_url": {"url": url}}
            r = gemma.post({"messages": [{"role": "user", "content": [text_part("see"), part]}], "max_tokens": 1})
            assert r.status_code == 400, (url, r.text)
            err = r.json()["error"]
            assert words in err["message"] and "data: URL" in err["message"], (url, err)
            assert err["param"] == "messages[0].content[1].image_url.url"
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()
    gemma.serves()


def test_more_images_than_the_context_holds(gemma):
    """Twenty 49-megapixel images (each under the pixel bound, ~230 MiB to decode) take at least 320 tokens of
    a 256-token context: 413 before any is decoded (the peak RSS does not move); thirteen small ones pass that
    bound but their prompt does not fit: 413 as for a text prompt over the context. Ollama's routes answer 400,
    as they do for text."""
    big = data_url(zeros_png(7000, 7000))
    peak = gemma.server.rss_mib("VmHWM")
    r = gemma.post({"messages": [{"role": "user", "content": [text_part("see")] + [
        {"type": "image_url", "image_url": {"url": big}}] * 20}], "max_tokens": 1})
    assert r.status_code == 413, r.text
    assert gemma.server.rss_mib("VmHWM") - peak < PEAK_MIB
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and "20 images take at least 320 tokens" in err["message"]
    r = gemma.post({"messages": [{"role": "user", "content": [text_part("see")] + [image_part(SMALL)] * 13}],
                    "max_tokens": 1})
    assert r.status_code == 413 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert "does not fit the context" in r.json()["error"]["message"]
    text_over = gemma.post({"messages": [{"role": "user", "content": "x " * 400}], "max_tokens": 1})
    assert text_over.status_code == 413 and text_over.json()["error"]["type"] == err["type"]
    b64 = base64.b64encode(SMALL).decode()
    for n, words in ((20, "does not fit the context"), (13, "exceeds the context length")):
        r = gemma.post({"messages": [{"role": "user", "content": "see", "images": [b64] * n}], "stream": False},
                       "/api/chat")
        assert r.status_code == 400 and words in r.json()["error"], r.text
    gemma.serves()
