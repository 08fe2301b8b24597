"""Pixtral vision (the ``pixtral`` mmproj) against transformers, in both layouts llama.cpp's converter writes
as ``pixtral``: Mistral 3 (``Mistral3ForConditionalGeneration``: SiLU MLP, RMSNorm and a 2 x 2 patch
merger; text ``mistral3``) and Pixtral-12B (``LlavaForConditionalGeneration`` with a pixtral tower: GELU,
no merger, projector biases; text ``llama``).

Tiny random models (vision: 8-pixel patches, width 32, 3 layers (the converter maps the projector's
``linear_2`` only below the block count), 2 heads of 16, longest edge 64; text: 2 layers, width 64) on
llama-bpe's vocabulary with ``[IMG]``, ``[IMG_BREAK]``, ``[IMG_END]`` added. transformers' image processor
runs here through its PIL backend (``PixtralImageProcessorPil``); ``PixtralProcessor`` needs torchvision,
so its module is imported with tests/torchvision_stub.py and its prompt expansion
(``replace_image_token``, pure Python) called on a stand-in instance.
"""

from __future__ import annotations

import json
import os
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch") if not os.environ.get("CI") else __import__("torch")
transformers = pytest.importorskip("transformers") if not os.environ.get("CI") else __import__("transformers")
pytest.importorskip("PIL") if not os.environ.get("CI") else __import__("PIL")

import hf_convert  # noqa: E402
import torchvision_stub  # noqa: E402

from ggmlpy import GGMLValueError, gguf  # noqa: E402
from ggmlpy.models import load_model  # noqa: E402
from ggmlpy.runner import Runner  # noqa: E402
from ggmlpy.vision import load_mmproj  # noqa: E402
from ggmlpy.vision.preprocess import image_prompt, pixtral_image_prompt, preprocess  # noqa: E402

pytestmark = pytest.mark.hf

PATCH, EDGE = 8, 64
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
LAYOUTS = ("mistral3", "llava")
TEMPLATE = ("{{ bos_token }}{% for m in messages %}[INST]{% if m['content'] is string %}{{ m['content'] }}"
            "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}[IMG]{% else %}{{ p['text'] }}"
            "{% endif %}{% endfor %}{% endif %}[/INST]{% endfor %}")


def _make(layout: str, out):
    import copy

    tok = copy.deepcopy(hf_convert.tokenizer("llama-bpe"))
    tok.add_tokens(["[IMG]", "[IMG_BREAK]", "[IMG_END]", "[INST]", "[/INST]"], special_tokens=True)
    img_id = tok.convert_tokens_to_ids("[IMG]")
    vision = dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                  num_attention_heads=2, head_dim=16, image_size=EDGE, patch_size=PATCH, initializer_range=0.1,
                  rope_parameters={"rope_type": "axial", "rope_theta": 10000.0})
    text = dict(model_type="mistral", vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, sliding_window=None,
                initializer_range=0.1)
    torch.manual_seed(0)
    if layout == "mistral3":
        merge = 2
        cfg = transformers.Mistral3Config(vision_config=dict(vision, hidden_act="silu"), text_config=text,
                                          image_token_index=img_id, spatial_merge_size=merge,
                                          multimodal_projector_bias=False, projector_hidden_act="gelu",
                                          vision_feature_layer=-1)
        hf = transformers.Mistral3ForConditionalGeneration(cfg).eval()
    else:
        merge = 1
        cfg = transformers.LlavaConfig(vision_config=dict(vision, hidden_act="gelu"), text_config=text,
                                       image_token_index=img_id, projector_hidden_act="gelu",
                                       vision_feature_select_strategy="full", vision_feature_layer=-1,
                                       multimodal_projector_bias=True)
        hf = transformers.LlavaForConditionalGeneration(cfg).eval()
    hf_convert.perturb_constant_weights(hf, seed=1)
    d = hf_convert.save_model_dir(hf, out / f"{layout}-hf", "llama-bpe", tokenizer=tok)
    (d / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "PixtralImageProcessor", "resample": 3, "size": {"longest_edge": EDGE},
        "patch_size": {"height": PATCH, "width": PATCH}, "image_mean": CLIP_MEAN, "image_std": CLIP_STD}))
    (d / "processor_config.json").write_text(json.dumps({
        "processor_class": "PixtralProcessor", "patch_size": PATCH, "spatial_merge_size": merge}))
    mmproj = hf_convert.convert_dir(d, out / f"{layout}-mmproj.gguf", "f32", ["--mmproj"])
    text_path = hf_convert.convert_dir(d, out / f"{layout}-text.gguf", "f32")
    return types.SimpleNamespace(layout=layout, hf=hf, tok=tok, merge=merge, mmproj=mmproj, text=text_path,
                                 img_id=img_id, hf_dir=d)


@pytest.fixture(scope="module", params=LAYOUTS)
def fx(request, tmp_path_factory):
    return _make(request.param, tmp_path_factory.mktemp(request.param))


def _hf_pixels(img: np.ndarray, align: int) -> np.ndarray:
    ip = transformers.PixtralImageProcessorPil(size={"longest_edge": EDGE}, image_mean=CLIP_MEAN, image_std=CLIP_STD)
    out = ip(images=[img], patch_size={"height": align, "width": align}, return_tensors="np")
    return np.asarray(out["pixel_values"][0], np.float32)


def _features(fx, pixels: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        f = fx.hf.get_image_features(torch.from_numpy(pixels), image_sizes=torch.tensor([pixels.shape[2:]]))
        f = f if torch.is_tensor(f) or isinstance(f, (list, tuple)) else f.pooler_output
        f = f[0] if isinstance(f, (list, tuple)) else f
        return f.reshape(-1, f.shape[-1]).numpy()


def _logits(fx, ids, pixels) -> np.ndarray:
    with torch.no_grad():
        return fx.hf(input_ids=torch.tensor([ids]), pixel_values=torch.from_numpy(pixels),
                     image_sizes=torch.tensor([pixels.shape[2:]])).logits[0].numpy()


def _err(got, ref) -> float:
    return float(np.abs(np.asarray(got) - ref).max() / np.abs(ref).max())


def _hf_prompt(rows: int, cols: int) -> str:
    stand_in = types.SimpleNamespace(patch_size=PATCH, spatial_merge_size=1, image_token="[IMG]",
                                     image_break_token="[IMG_BREAK]", image_end_token="[IMG_END]")
    (mod,) = torchvision_stub.import_with_stub("transformers.models.pixtral.processing_pixtral")
    return mod.PixtralProcessor.replace_image_token(stand_in, {"image_sizes": [(rows * PATCH, cols * PATCH)]}, 0)


# (height, width): under one token, odd sizes, over the longest edge both ways, extreme aspect ratios
SIZES = [(5, 17), (30, 50), (50, 30), (64, 64), (100, 37), (37, 100), (300, 20), (1, 500), (64, 63)]


@pytest.mark.parametrize("merge", [1, 2])
def test_pixels_equal_transformers(merge):
    from ggmlpy.vision.preprocess import ImageConfig

    cfg = ImageConfig("pixtral", EDGE, PATCH, CLIP_MEAN, CLIP_STD, scale_factor=merge)
    rng = np.random.default_rng(merge)
    for h, w in SIZES:
        img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        pre = preprocess(img, cfg)
        assert pre.pixel_values.shape[2:] == (pre.rows * cfg.align, pre.cols * cfg.align)
        if h == 1:          # transformers scales the 1-pixel side to 0 and fails; ggmlpy keeps one token
            assert pre.rows == 1
            continue
        np.testing.assert_array_equal(pre.pixel_values, _hf_pixels(img, cfg.align)[None], err_msg=f"{h}x{w}")


@pytest.mark.parametrize("rows,cols", [(1, 1), (1, 5), (4, 2), (8, 8)])
def test_prompt_equals_transformers(rows, cols):
    assert pixtral_image_prompt(rows, cols) == _hf_prompt(rows, cols)


def test_mmproj_file(fx):
    with gguf.GGUFReader(str(fx.mmproj)) as r:
        md, names = r.metadata, {t.name for t in r.tensors}
    assert md["clip.projector_type"] == "pixtral"
    assert ("mm.patch_merger.weight" in names) == (fx.layout == "mistral3")
    assert md.get("clip.vision.spatial_merge_size", 1) == fx.merge
    assert bool(md.get("clip.use_silu")) == (fx.layout == "mistral3")
    assert "v.token_embd.img_break" not in names     # the converter never writes it (llama.cpp requires it)


@pytest.mark.parametrize("hw", [(30, 50), (100, 37), (64, 64)])
def test_features_match_hf(fx, hw):
    img = np.random.default_rng(hw[0]).integers(0, 256, (*hw, 3), dtype=np.uint8)
    with load_mmproj(fx.mmproj) as vm, load_mmproj(fx.mmproj, precision="fast") as fast:
        pre = preprocess(img, vm.image_config)
        got, quick = vm.encode(pre.pixel_values)[0], fast.encode(pre.pixel_values)[0]
        assert vm.runs(pre.pixel_values) == [pre.cols] * pre.rows
    ref = _features(fx, pre.pixel_values)
    assert got.shape == ref.shape == (pre.rows * pre.cols, 64)
    assert np.abs(ref).max() > 1e-2
    assert _err(got, ref) < 3e-6                  # measured 4e-7 / 7e-8
    assert 1e-6 < _err(quick, ref) < 2e-3         # flash attention, ggml's GELU: measured 3-5e-4 / 5e-5


def test_logits_match_hf(fx):
    """Text around an image: every position's logits as transformers' (the [IMG_BREAK]/[IMG_END] tokens are
    text, the features go to [IMG]); the text prompt's ids as the processor's; then token by token."""
    img = np.random.default_rng(5).integers(0, 256, (50, 30, 3), dtype=np.uint8)
    model = load_model(fx.text, mmproj=fx.mmproj, devices="cpu")
    with model, Runner(model, n_ctx=512, type_k="f32", type_v="f32") as rt:
        assert model.config.arch == ("mistral3" if fx.layout == "mistral3" else "llama")
        pre = preprocess(img, model.vision.image_config)
        ids = fx.tok("Describe" + image_prompt(pre, model.vision.image_config) + "this please")["input_ids"]
        assert ids.count(fx.img_id) == pre.rows * pre.cols and pre.rows > 1
        ref = _logits(fx, ids, pre.pixel_values)
        got = rt.decode(ids, logits="all", images=[img])
        assert _err(got, ref) < 1e-5              # measured 4e-7 / 6e-7
        p = rt.inputs.prompt("Describe<__media__>this please", "test", images=[img])
        assert [t if t >= 0 else fx.img_id for t in p.ids] == ids
        nxt = [7, 11, 13]
        steps = np.concatenate([rt.decode([t]) for t in nxt])
    assert _err(steps, _logits(fx, ids + nxt, pre.pixel_values)[len(ids):]) < 1e-5
    other = preprocess(np.random.default_rng(6).integers(0, 256, (50, 30, 3), dtype=np.uint8),
                       model.vision.image_config).pixel_values
    assert _err(_logits(fx, ids, other)[-1], ref[-1]) > 1e-3


def test_chat_and_images_of_different_sizes(fx):
    """Two images of different sizes in one chat: each its own runs; greedy first token as transformers'
    on the same ids and pixels; an image seen again is not encoded again."""
    rng = np.random.default_rng(9)
    a, b = rng.integers(0, 256, (20, 60, 3), dtype=np.uint8), rng.integers(0, 256, (70, 25, 3), dtype=np.uint8)
    msgs = [{"role": "user", "content": [{"type": "image", "image": a}, {"type": "text", "text": " and "},
                                         {"type": "image", "image": b}, {"type": "text", "text": "?"}]}]
    model = load_model(fx.text, mmproj=fx.mmproj, devices="cpu")
    with model, Runner(model, n_ctx=512, type_k="f32", type_v="f32") as rt:
        cfg = model.vision.image_config
        pa, pb = preprocess(a, cfg), preprocess(b, cfg)
        assert (pa.rows, pa.cols) != (pb.rows, pb.cols)
        text = fx.tok.bos_token + "[INST]" + image_prompt(pa, cfg) + " and " + image_prompt(pb, cfg) + "?[/INST]"
        want = fx.tok(text, add_special_tokens=False)["input_ids"]
        assert rt.chat_prompt(msgs, template=TEMPLATE) == want
        out = rt.chat(msgs, template=TEMPLATE, max_tokens=1, temperature=0)
        assert rt.images.n_encoded == 2
        rt.chat(msgs, template=TEMPLATE, max_tokens=1, temperature=0)
        assert rt.images.n_encoded == 2
    with torch.no_grad():
        pv = torch.zeros(2, 3, max(pa.pixel_values.shape[2], pb.pixel_values.shape[2]),
                         max(pa.pixel_values.shape[3], pb.pixel_values.shape[3]))
        for i, p in enumerate((pa.pixel_values[0], pb.pixel_values[0])):
            pv[i, :, :p.shape[1], :p.shape[2]] = torch.from_numpy(p)
        sizes = torch.tensor([pa.pixel_values.shape[2:], pb.pixel_values.shape[2:]])
        ref = fx.hf(input_ids=torch.tensor([want]), pixel_values=pv, image_sizes=sizes).logits[0, -1].numpy()
    assert out.tokens[0] == int(np.argmax(ref))


def test_largest_image_and_bad_pixels(fx):
    """The largest image (the longest edge both ways) runs within the reservation; pixels of a size the
    encoder cannot take are refused by name."""
    model = load_model(fx.text, mmproj=fx.mmproj, devices="cpu")
    with model, Runner(model, n_ctx=1024, type_k="f32", type_v="f32") as rt:
        vm = model.vision
        assert vm.largest_image == (EDGE, EDGE) and vm.config.tokens_per_image == EDGE // (PATCH * fx.merge)
        big = preprocess(np.random.default_rng(1).integers(0, 256, (500, 480, 3), dtype=np.uint8), vm.image_config)
        assert big.pixel_values.shape[2:] == (EDGE, EDGE)
        assert rt.encode_image(big).shape == ((EDGE // (PATCH * fx.merge)) ** 2, 64)
        align = PATCH * fx.merge
        for shape in [(1, 3, EDGE + align, align), (1, 3, align + 1, align), (2, 3, align, align)]:
            with pytest.raises(GGMLValueError, match="pixels of shape"):
                vm.encode(np.zeros(shape, np.float32))
        for size in [(align + 1, align), (EDGE + align, align), (0, align)]:
            with pytest.raises(GGMLValueError, match="vision build: an image of"):
                vm.build(1, size)


def test_files_that_ask_for_more(fx, tmp_path):
    """A head size the 2D RoPE cannot split, a merge size without the merger, and Ministral 3's attention
    temperature: refused by key."""
    from arch_helpers import copy_gguf

    odd = copy_gguf(fx.mmproj, tmp_path / "h.gguf", meta={"clip.vision.attention.head_count": 16},
                    meta_types={"clip.vision.attention.head_count": gguf.ValueType.UINT32})
    with pytest.raises(GGMLValueError, match="head size 2 .* multiple of 4"):
        load_mmproj(odd)
    if fx.layout == "llava":
        bad = copy_gguf(fx.mmproj, tmp_path / "m.gguf", meta={"clip.vision.spatial_merge_size": 2},
                        meta_types={"clip.vision.spatial_merge_size": gguf.ValueType.UINT32})
        with pytest.raises(GGMLValueError, match="patch_merger"):
            load_mmproj(bad)
    else:
        bad = copy_gguf(fx.text, tmp_path / "t.gguf", meta={"mistral3.attention.temperature_scale": 0.1})
        with pytest.raises(GGMLValueError, match="temperature_scale"):
            load_model(bad, devices="cpu")
