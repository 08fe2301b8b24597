"""Images in: the vision encoders (mmproj files written by llama.cpp's converter) and image prompts in the
runner, against transformers on tiny random-weight models (tests/vision_helpers.py).

Measured (max |got - ref| / max |ref|):

=========  ==================  ========================  ==========================================
family     image features      logits, default           logits, GELU from exact ops
=========  ==================  ========================  ==========================================
gemma3     3.5e-7              4.8e-4 (text GELU table)  ~1e-6
idefics3   4.0e-7              8.2e-7                    (no GELU in the text model)
=========  ==================  ========================  ==========================================

The encoder computes its GELU from exact F32 ops and unrolls the patch convolution in F32 (ggml's own
GELU reads an F16 table and its conv_2d unrolls to F16: ~4e-4 each, llama.cpp's figure). The gemma3 text
model's GeGLU still uses ggml's GELU, as in test_arch_gemma.py, which also shows the exact-op figure.
"""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest

pytest.importorskip("torch")
vh = pytest.importorskip("vision_helpers")

from helpers import exact_geglu, exact_geglu_fused  # noqa: E402

from ggmlpy._core import GGMLTypeError, GGMLValueError  # noqa: E402
from ggmlpy.models import blocks, load_model  # noqa: E402
from ggmlpy.runner import Runner  # noqa: E402
from ggmlpy.vision import load_mmproj  # noqa: E402
from ggmlpy.vision.preprocess import preprocess  # noqa: E402

pytestmark = pytest.mark.hf

TOL = 1e-5
#: image features from mmproj files the converter wrote with --outtype f16 / q8_0 (measured 6.5e-4 and
#: 5.2e-4 for f16, 7.8e-3 and 1.5e-2 for q8_0, gemma3 and idefics3; the test_arch_* figures for weights)
QUANT_TOL = {"f16": 3e-3, "q8_0": 3e-2}
#: gemma3's text GeGLU with ggml's GELU (test_arch_gemma.py's tolerance)
TOL_GEMMA_GELU = 2e-3
FAMILIES = ("gemma3", "idefics3")


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    return {f: vh.make(f, tmp_path_factory.mktemp(f)) for f in FAMILIES}


def _err(got, ref) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float((np.abs(got - ref).max(axis=-1) / np.abs(ref).max(axis=-1)).max())


def _runner(fx, **kw):
    kw = {"n_ctx": 256, "type_k": "f32", "type_v": "f32", **kw}
    model = load_model(fx.text_path, mmproj=fx.mmproj_path, devices="cpu")
    try:
        return model, Runner(model, **kw)
    except BaseException:
        model.close()
        raise


@pytest.mark.parametrize("family", FAMILIES)
def test_features_and_pixels_match_hf(fixtures, family):
    """The preprocessing gives the HF processor's pixel values and the encoder its image features."""
    fx = fixtures[family]
    img = vh.sample_image(100, 70, seed=3)
    ref_px = vh.pixel_values(fx, [img])
    with load_mmproj(fx.mmproj_path) as vm:
        px = preprocess(img, vm.image_config).pixel_values
        assert px.shape == ref_px.shape
        assert np.abs(px - ref_px).max() < 1e-6
        got = vm.encode(px)
    ref = vh.image_features(fx, ref_px)
    assert got.shape == ref.shape == (len(px), fx.tokens_per_image, fx.n_embd_text)
    assert _err(got, ref) < TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_fast_precision(fixtures, family):
    """vision_precision="fast" (ggml's flash attention with F16 K/V and GELU table): features within
    llama.cpp's error of transformers', not the exact mode's numbers; the rest of the runner unchanged."""
    fx = fixtures[family]
    img = vh.sample_image(100, 70, seed=3)
    px = vh.pixel_values(fx, [img])
    ref = vh.image_features(fx, px)
    with load_mmproj(fx.mmproj_path, precision="fast") as fast, load_mmproj(fx.mmproj_path) as exact:
        assert "fast" in repr(fast)
        got, want = fast.encode(px), exact.encode(px)
    assert 1e-6 < _err(got, ref) < 2e-3
    assert _err(want, ref) < TOL
    with pytest.raises(GGMLValueError, match="precision 'quick'"):
        load_mmproj(fx.mmproj_path, precision="quick")
    model = load_model(fx.text_path, mmproj=fx.mmproj_path, devices="cpu", vision_precision="fast")
    with model, Runner(model, n_ctx=256, type_k="f32", type_v="f32") as rt:
        assert model.vision.precision == "fast"
        np.testing.assert_array_equal(rt.encode_image(img), got.reshape(-1, got.shape[-1]))


def test_encode_image(fixtures):
    """Runner.encode_image: the rows a prompt's image tokens get, as transformers' image features."""
    fx = fixtures["idefics3"]
    img = vh.sample_image(100, 70, seed=3)
    px = vh.pixel_values(fx, [img])
    model, rt = _runner(fx)
    with model, rt:
        got = rt.encode_image(img)
        same = rt.encode_image(preprocess(img, model.vision.image_config))
    ref = vh.image_features(fx, px)
    assert got.shape == (len(px) * fx.tokens_per_image, fx.n_embd_text)
    assert _err(got, ref.reshape(got.shape)) < TOL
    np.testing.assert_array_equal(same, got)


@pytest.mark.parametrize("outtype", list(QUANT_TOL))
@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_mmproj_features(fixtures, family, outtype, tmp_path):
    """mmproj files converted with --outtype f16 / q8_0 (the converter keeps norms, biases and tensors
    whose rows are not a multiple of the block in F32/F16): the features within the per-type tolerance of
    transformers' F32 ones."""
    from ggmlpy.gguf import GGUFReader

    fx = fixtures[family]
    _, mmproj = vh.convert_dir(fx.hf_dir, tmp_path, outtype=outtype)
    with GGUFReader(mmproj) as r:
        types = {t.type.name for t in r.tensors}
    assert outtype.upper() in types
    img = vh.sample_image(100, 70, seed=3)
    px = vh.pixel_values(fx, [img])
    with load_mmproj(mmproj) as vm:
        got = vm.encode(px)
    assert _err(got, vh.image_features(fx, px)) < QUANT_TOL[outtype]


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_hf(fixtures, family, monkeypatch):
    """A prompt with text before and after an image, in one batch: every position's logits as transformers'
    (gemma3: its image tokens attend both ways, via token_type_ids), the ids of a text prompt with a
    marker as the HF processor's; then token by token after it."""
    fx = fixtures[family]
    img = vh.sample_image(90, 120, seed=5)
    inp = vh.hf_inputs(fx, ["Describe", img, "this please"])
    ids = [int(t) for t in inp["input_ids"]]
    ref = vh.logits(fx, ids, inp["pixel_values"])
    tol = TOL
    if family == "gemma3":
        monkeypatch.setitem(blocks.GLU, "gelu", (exact_geglu_fused, exact_geglu))
    model, rt = _runner(fx)
    with model, rt:
        got = rt.decode(ids, logits="all", images=[img])
        assert _err(got, ref) < tol
        # a text prompt: the marker becomes what the processor writes, the same ids
        p = rt.inputs.prompt("Describe<__media__>this please", "test", images=[img])
        text_ids, sb = p.ids, p.same_batch
        assert [t if t >= 0 else fx.image_token_id for t in text_ids] == ids
        assert sum(1 for x in sb if x) == len(vh.pixel_values(fx, [img]))
        # then generation steps, one token at a time, against the whole sequence in transformers
        nxt = [7, 11, 13]
        steps = np.concatenate([rt.decode([t]) for t in nxt])
    ref2 = vh.logits(fx, ids + nxt, inp["pixel_values"])
    assert _err(steps, ref2[len(ids):]) < tol


def test_gemma3_default_gelu_tolerance(fixtures):
    """With ggml's GELU table in the text model, gemma3 is within the text architecture's tolerance."""
    fx = fixtures["gemma3"]
    img = vh.sample_image(64, 64, seed=8)
    inp = vh.hf_inputs(fx, ["A", img, "B"])
    ids = [int(t) for t in inp["input_ids"]]
    model, rt = _runner(fx)
    with model, rt:
        got = rt.decode(ids, logits="all", images=[img])
    assert _err(got, vh.logits(fx, ids, inp["pixel_values"])) < TOL_GEMMA_GELU


def test_image_never_split_across_micro_batches(fixtures):
    """With micro-batches of 20 rows and a 16-row image after a few text rows, the image moves whole to the next
    micro-batch: the logits are those of one batch (a split image would attend to half of itself)."""
    fx = fixtures["gemma3"]
    img = vh.sample_image(64, 64, seed=1)
    inp = vh.hf_inputs(fx, ["one two", img, "end"])
    ids = [int(t) for t in inp["input_ids"]]
    start = ids.index(fx.image_token_id)
    assert 2 <= start < 20 < start + fx.tokens_per_image
    model, rt = _runner(fx, n_batch=20, n_ubatch=20)
    with model, rt:
        got = rt.decode(ids, logits="all", images=[img])
    model, rt = _runner(fx)
    with model, rt:
        whole = rt.decode(ids, logits="all", images=[img])
    assert _err(got, whole) < 1e-5


def test_generate_reuses_encoding_and_prefix(fixtures):
    """Two requests with the same image: the image is encoded once, the second request reuses the cached
    prefix (image included), and both generate transformers' greedy tokens. Another image in the same
    place is not taken for the first (prefix reuse compares images by content)."""
    fx = fixtures["gemma3"]
    img, other = vh.sample_image(64, 64, seed=2), vh.sample_image(64, 64, seed=9)
    inp = vh.hf_inputs(fx, ["Look", img, "now"])
    ids = [int(t) for t in inp["input_ids"]]
    model, rt = _runner(fx)
    with model, rt:
        a = rt.generate(ids, images=[img], max_tokens=3, temperature=0)
        b = rt.generate(ids, images=[img], max_tokens=3, temperature=0)
        assert rt.images.n_encoded == 1
        assert b.n_cached >= len(ids) - 1
        assert a.tokens == b.tokens
        c = rt.generate(ids, images=[other], max_tokens=3, temperature=0)
        assert rt.images.n_encoded == 2
        assert c.n_cached < ids.index(fx.image_token_id) + 1
        assert rt.reallocations == 0          # the reservation covered the image batches
    ref = vh.logits(fx, ids, inp["pixel_values"])
    assert a.tokens[0] == int(np.argmax(ref[-1]))


def test_memory_report_has_vision(fixtures):
    fx = fixtures["idefics3"]
    model, rt = _runner(fx)
    with model, rt:
        dev = rt.memory_report().to_dict()["devices"]["CPU"]
        assert dev["weights"]["vision"] == model.vision.size
        # the text model's weights are still there: allocating the encoder's into the shared report kept them
        assert sum(v for k, v in dev["weights"].items() if k != "vision") >= model.size
        assert dev["graph"] > 0
        assert model.vision.max_tiles == 5          # a 2 x 2 grid and the global image
        # the largest image batch was reserved: what its graph needs, as measured on a scheduler of its own
        from ggmlpy.backend import Runtime

        g = model.vision.build(model.vision.max_tiles)
        own = Runtime(model.placement.devices(), graph_size=2 * model.graph_size())
        try:
            need = own.sched.reserve_size(g.graph)["CPU"]
        finally:
            own.close()
            g.free()
        assert dev["graphs"]["vision"] == need > 0
        assert dev["graph"] >= max(dev["graphs"].values())
        text = str(rt.memory_report())
        assert "vision encoder [MiB]" in text
        assert f"{model.vision.size / 2**20:.2f}" in text.split("vision encoder")[1]


@pytest.mark.parametrize("case", ["more_images", "fewer_images", "short_run", "no_marker", "bad_image", "not_list"])
def test_bad_image_prompts(fixtures, case):
    """Clear errors, and the runner goes on serving."""
    fx = fixtures["gemma3"]
    img = vh.sample_image(64, 64, seed=4)
    inp = vh.hf_inputs(fx, ["x", img, "y"])
    ids = [int(t) for t in inp["input_ids"]]
    model, rt = _runner(fx)
    with model, rt:
        args = {
            "more_images": (ids, [img, img], GGMLValueError, "placeholder"),
            "fewer_images": (ids + ids[1:], [img], GGMLValueError, "more image placeholders"),
            "short_run": ([i for i in ids if i != fx.image_token_id] + [fx.image_token_id] * 3, [img],
                          GGMLValueError, "exactly 16"),
            "no_marker": ("no marker here", [img], GGMLValueError, "<__media__>"),
            "bad_image": (ids, [np.zeros((5, 7, 2), np.uint8)], GGMLValueError, "image"),
            "not_list": (ids, img.tobytes(), GGMLTypeError, "list"),
        }[case]
        prompt, images, err, words = args
        with pytest.raises(err, match=words):
            rt.generate(prompt, images=images, max_tokens=1)
        with pytest.raises(err):
            rt.decode(prompt, images=images) if not isinstance(prompt, str) else rt.submit(prompt, images=images)
        assert rt.generate(ids, images=[img], max_tokens=2, temperature=0).done_reason in ("length", "stop")


def test_images_need_a_vision_encoder(fixtures):
    fx = fixtures["gemma3"]
    with load_model(fx.text_path, devices="cpu") as model, Runner(model, n_ctx=64) as rt:
        with pytest.raises(GGMLValueError, match="no vision encoder"):
            rt.decode([1, 2, 3], images=[vh.sample_image(8, 8)])


def test_mmproj_errors(fixtures):
    """A text model file given as mmproj is refused by name; a model loaded without one has no encoder."""
    g = fixtures["gemma3"]
    from ggmlpy.gguf import MetadataError

    with pytest.raises(MetadataError, match="clip"):
        load_mmproj(g.text_path)
    with pytest.raises(MetadataError, match="clip"):
        load_model(g.text_path, mmproj=g.text_path, devices="cpu")
    with load_model(g.text_path, devices="cpu") as model:
        assert model.vision is None


#: chat templates written for the tests (the fixtures' files have none)
CHAT_TEMPLATES = vh.CHAT_TEMPLATES


def _chat_messages(*images) -> list:
    """A user turn with text around two images (parts given as the caller wants them)."""
    a, b = images
    return [{"role": "user", "content": [{"type": "text", "text": "Look at "}, a, {"type": "text", "text": " and "},
                                         b, {"type": "text", "text": ", what changed?"}]}]


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_with_images_matches_hf(fixtures, family, tmp_path, monkeypatch):
    """Chat messages with image parts: the prompt ids are those of the HF processor's apply_chat_template
    (each image's placeholder expanded as the processor expands it), whatever form the parts take; the
    reply's first token is transformers' greedy token; a follow-up turn reuses the prompt and both images."""
    from PIL import Image

    fx = fixtures[family]
    template = CHAT_TEMPLATES[family]
    a, b = vh.sample_image(100, 70, seed=3), vh.sample_image(60, 90, seed=4)
    hf_msgs = _chat_messages({"type": "image", "image": Image.fromarray(a)},
                             {"type": "image", "image": Image.fromarray(b)})
    out = fx.processor.apply_chat_template(hf_msgs, chat_template=template, add_generation_prompt=True,
                                           tokenize=True, return_dict=True, return_tensors="np")
    ref_ids = [int(t) for t in out["input_ids"][0]]
    assert ref_ids.count(fx.image_token_id) >= 2 * fx.tokens_per_image
    path = tmp_path / "b.png"
    Image.fromarray(b).save(path)
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    forms = [hf_msgs,
             _chat_messages({"type": "image", "image": a}, {"type": "image", "path": str(path)}),
             _chat_messages({"type": "image_url", "image_url": {"url": url}}, {"type": "image", "url": path.as_uri()})]
    if family == "gemma3":
        monkeypatch.setitem(blocks.GLU, "gelu", (exact_geglu_fused, exact_geglu))
    model, rt = _runner(fx, n_ctx=512)
    with model, rt:
        for msgs in forms:   # the messages name local files: the caller allows them
            assert rt.chat_prompt(msgs, template=template, allow_local_files=True) == ref_ids
        first = rt.chat(forms[2], template=template, max_tokens=1, temperature=0,       # greedy
                        allow_local_files=True)
        assert first.prompt_eval_count + first.n_cached == len(ref_ids)
        assert rt.images.n_encoded == 2
        follow = forms[0] + [{"role": "assistant", "content": first.text},
                             {"role": "user", "content": [{"type": "text", "text": "And now?"}]}]
        second = rt.chat(follow, template=template, max_tokens=1, temperature=0)
        assert rt.images.n_encoded == 2                      # both images were reused, not encoded again
        assert second.n_cached >= len(ref_ids) - 1
    ref = vh.logits(fx, ref_ids, vh.pixel_values(fx, [a, b]))
    assert first.tokens[0] == int(np.argmax(ref[-1]))


def test_chat_image_errors(fixtures):
    """Bad image parts and templates that drop them: clear errors, and the runner goes on serving."""
    fx = fixtures["idefics3"]
    template = CHAT_TEMPLATES["idefics3"]
    img = vh.sample_image(64, 64, seed=6)
    good = _chat_messages({"type": "image", "image": img}, {"type": "image", "image": img})
    text_only = "{% for m in messages %}{{ m['content'][0]['text'] }}{% endfor %}"
    model, rt = _runner(fx, n_ctx=512)
    with model, rt:
        with pytest.raises(GGMLValueError, match="wrote 0 '<image>'"):
            rt.chat(good, template=text_only, max_tokens=1)
        with pytest.raises(GGMLValueError, match="without an image"):
            rt.chat(_chat_messages({"type": "image"}, {"type": "image", "image": img}), template=template)
        with pytest.raises(GGMLValueError, match="both in the messages"):
            rt.submit_chat(good, template=template, images=[img])
        with pytest.raises(GGMLValueError, match="image"):
            rt.chat(_chat_messages({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                                   {"type": "image", "image": img}), template=template)
        assert rt.chat(good, template=template, max_tokens=2, temperature=0).done_reason in ("length", "stop")
    with load_model(fx.text_path, devices="cpu") as model, Runner(model, n_ctx=512) as rt:
        with pytest.raises(GGMLValueError, match="no vision encoder"):
            rt.chat_prompt(good, template=template)


def test_a_chat_prepares_its_images_once(fixtures, monkeypatch):
    """A chat's prompt is prepared once: each image part preprocessed and its pixels checked once (the chat
    path used to go back through submit, which did both again), then encoded by the encoder's own route
    (VisionModel.run) on the runner's runtime, once per distinct image."""
    import importlib

    enc = importlib.import_module("ggmlpy.vision.encoder")    # where VisionModel.prepare finds preprocess
    fx = fixtures["idefics3"]
    template = CHAT_TEMPLATES["idefics3"]
    msgs = _chat_messages({"type": "image", "image": vh.sample_image(64, 64, seed=6)},
                          {"type": "image", "image": vh.sample_image(64, 64, seed=7)})
    model, rt = _runner(fx, n_ctx=512)
    with model, rt:
        calls = {"preprocess": 0, "check_pixels": 0, "run": 0}

        def counted(name, real):
            def f(*a, **kw):
                calls[name] += 1
                return real(*a, **kw)
            return f

        monkeypatch.setattr(enc, "preprocess", counted("preprocess", enc.preprocess))
        for name in ("check_pixels", "run"):
            monkeypatch.setattr(type(model.vision), name, counted(name, getattr(type(model.vision), name)))
        assert rt.chat(msgs, template=template, max_tokens=1, temperature=0).done_reason in ("length", "stop")
        assert calls == {"preprocess": 2, "check_pixels": 2, "run": 2}


def test_no_image_exceeds_the_reservation(fixtures):
    """The reservation holds the largest image: any size or shape the processor takes stays within
    max_tiles (idefics3 resizes to its longest edge), and runs with no reallocation; a preprocessed image
    of more tiles, or of another tile size, is refused before anything runs."""
    from ggmlpy.vision.preprocess import PreprocessedImage

    fx = fixtures["idefics3"]
    model, rt = _runner(fx, n_ctx=512)
    with model, rt:
        cap = model.vision.max_tiles
        for h, w in ((900, 1500), (4000, 3), (3, 4000), (1, 1), (129, 127)):
            pre = preprocess(vh.sample_image(h, w, seed=h), model.vision.image_config)
            assert len(pre.pixel_values) <= cap
            r = rt.generate("a <__media__> b", images=[pre], max_tokens=1, temperature=0)
            assert r.done_reason in ("length", "stop")
        assert rt.reallocations == 0
        tile = pre.pixel_values[0]
        with pytest.raises(GGMLValueError, match=f"at most {cap}"):
            rt.generate("a <__media__> b", images=[PreprocessedImage([tile] * (cap + 1))], max_tokens=1)
        with pytest.raises(GGMLValueError, match="expected"):
            rt.generate("a <__media__> b", images=[PreprocessedImage([tile[:, :32, :32]])], max_tokens=1)
        r = rt.generate("a <__media__> b", images=[pre], max_tokens=1, temperature=0)
        assert r.done_reason in ("length", "stop")
