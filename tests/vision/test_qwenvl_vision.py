"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL (``qwen2vl_merger`` / ``qwen2.5vl_merger`` / ``qwen3vl_merger`` mmproj,
``qwen2vl`` / ``qwen3vl`` text) against transformers.

Tiny random models built from a config (vision: width 32, 4 layers of 4 heads; Qwen2: 14-pixel patches,
QuickGELU; Qwen2.5: 14-pixel patches, 112-pixel windows, full attention in every second layer; Qwen3:
16-pixel patches, a 4 x 4 position table,
deepstack after layers 1 and 2; text: width 64, Qwen2.5 M-RoPE sections [2, 3, 3], Qwen3 interleaved [4, 2, 2]),
saved with the qwen2 vocabulary (its vision tokens put at Qwen's ids) and converted by llama.cpp's converter.
transformers' image processor runs through its PIL backend (``Qwen2VLImageProcessorPil``); the processor
class needs torchvision, so the prompt is laid out as it does (``<|vision_start|>``, one ``<|image_pad|>``
per token, ``<|vision_end|>``, ``mm_token_type_ids`` marking the image tokens).
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

from ggmlpy import GGMLValueError, gguf  # noqa: E402
from ggmlpy.models import load_model  # noqa: E402
from ggmlpy.runner import Runner  # noqa: E402
from ggmlpy.runner.mrope import mrope_positions  # noqa: E402
from ggmlpy.vision import load_mmproj  # noqa: E402
from ggmlpy.vision.image_config import QWEN_PIXELS, ImageConfig  # noqa: E402
from ggmlpy.vision.preprocess import PreprocessedImage, preprocess  # noqa: E402

pytestmark = pytest.mark.hf

VSTART, VEND, PAD = 151652, 151653, 151655
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
KINDS = ("q2", "q25", "q3")
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
            "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<|vision_start|><|image_pad|>"
            "<|vision_end|>{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
            "<|im_start|>assistant\n")


def _make(kind: str, out):
    n_vocab = len(hf_convert.tokenizer("qwen2"))
    lo, hi = QWEN_PIXELS[{"q2": "qwen2vl_merger", "q25": "qwen2.5vl_merger", "q3": "qwen3vl_merger"}[kind]]
    if kind == "q2":
        vision = dict(depth=4, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=3, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, hidden_act="quick_gelu")
        text = dict(vocab_size=n_vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]})
        cfg = transformers.Qwen2VLConfig(vision_config=vision, text_config=text)
        cls, patch, mean, std = transformers.Qwen2VLForConditionalGeneration, 14, CLIP_MEAN, CLIP_STD
    elif kind == "q25":
        vision = dict(depth=4, hidden_size=32, num_heads=4, intermediate_size=64, patch_size=14, spatial_merge_size=2,
                      temporal_patch_size=2, window_size=112, out_hidden_size=64, fullatt_block_indexes=[1, 3],
                      hidden_act="silu")
        text = dict(vocab_size=n_vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]})
        cfg = transformers.Qwen2_5_VLConfig(vision_config=vision, text_config=text)
        cls, patch, mean, std = transformers.Qwen2_5_VLForConditionalGeneration, 14, CLIP_MEAN, CLIP_STD
    else:
        vision = dict(depth=4, hidden_size=32, num_heads=4, intermediate_size=64, patch_size=16, spatial_merge_size=2,
                      temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16,
                      deepstack_visual_indexes=[1, 2], hidden_act="gelu_pytorch_tanh")
        text = dict(vocab_size=n_vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                    rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [4, 2, 2],
                                     "mrope_interleaved": True})
        cfg = transformers.Qwen3VLConfig(vision_config=vision, text_config=text)
        cls, patch, mean, std = transformers.Qwen3VLForConditionalGeneration, 16, [0.5] * 3, [0.5] * 3
    torch.manual_seed(0)
    hf = cls(cfg).eval()
    hf_convert.perturb_constant_weights(hf, seed=1)
    d = hf_convert.save_model_dir(hf, out / "hf", "qwen2")
    hf_convert.qwen_vision_tokens(d)
    (d / "preprocessor_config.json").write_text(json.dumps({
        "size": {"shortest_edge": lo, "longest_edge": hi}, "patch_size": patch, "temporal_patch_size": 2,
        "merge_size": 2, "image_mean": mean, "image_std": std, "resample": 3,
        "image_processor_type": "Qwen2VLImageProcessor"}))
    mmproj = hf_convert.convert_dir(d, out / "mmproj.gguf", "f32", ["--mmproj"])
    text_path = hf_convert.convert_dir(d, out / "text.gguf", "f32")
    ip = transformers.AutoImageProcessor.from_pretrained(d)
    return types.SimpleNamespace(kind=kind, hf=hf, ip=ip, mmproj=mmproj, text=text_path, patch=patch, dir=d)


@pytest.fixture(scope="module", params=KINDS)
def fx(request, tmp_path_factory):
    return _make(request.param, tmp_path_factory.mktemp(request.param))


def _img(h: int, w: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _hf_rows(pixels: np.ndarray, patch: int) -> np.ndarray:
    """Our (1, 3, H, W) image as transformers' ``pixel_values`` rows: merge-block order, (c, t, y, x) each."""
    _, c, h, w = pixels.shape
    gh, gw = h // patch, w // patch
    x = pixels[0].reshape(c, gh // 2, 2, patch, gw // 2, 2, patch).transpose(1, 4, 2, 5, 0, 3, 6)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], 2, patch, patch))
    return x.reshape(gh * gw, c * 2 * patch * patch)


def _err(got, ref) -> float:
    return float(np.abs(np.asarray(got) - ref).max() / np.abs(ref).max())


def _hf_logits(fx, ids, images):
    o = fx.ip(images=list(images), return_tensors="pt")
    tt = [1 if t == PAD else 0 for t in ids]
    with torch.no_grad():
        return fx.hf(input_ids=torch.tensor([ids]), mm_token_type_ids=torch.tensor([tt]), **o).logits[0].numpy()


def _prompt(n_tokens: int, before=(151644, 872, 198), after=(6023, 3838, 374, 151645, 198, 151644, 77091)) -> list:
    return [*before, VSTART] + [PAD] * n_tokens + [VEND, *after]


# (height, width): a 70-pixel side (70 / 28 = 2.5: Python's round goes to 2, C's to 3), under the minimum,
# over the default maximum, odd sizes, a thin strip
SIZES = [(70, 100), (20, 20), (1200, 1600), (333, 517), (40, 900), (1000, 30)]


@pytest.mark.parametrize("hw", SIZES)
def test_pixels_equal_transformers(fx, hw):
    img = _img(*hw, seed=hw[0])
    with load_mmproj(fx.mmproj) as vm:
        pre = preprocess(img, vm.image_config)
    out = fx.ip(images=[img], return_tensors="np")
    grid = tuple(int(x) for x in out["image_grid_thw"][0])
    assert grid == (1, pre.rows * 2, pre.cols * 2)
    assert np.array_equal(_hf_rows(pre.pixel_values, fx.patch), out["pixel_values"])


def test_pixel_budget_and_aspect(fx):
    """Another budget gives transformers' sizes too; an aspect ratio over 200 is refused by both."""
    with load_mmproj(fx.mmproj) as vm:
        cfg = ImageConfig(vm.config.projector, vm.config.image_size, fx.patch, vm.config.image_mean,
                          vm.config.image_std, 2, min_pixels=8 * 32 * 32, max_pixels=60 * 32 * 32)
        img = _img(480, 640, 3)
        pre = preprocess(img, cfg)
        ip = transformers.Qwen2VLImageProcessorPil(size={"shortest_edge": cfg.min_pixels,
                                                         "longest_edge": cfg.max_pixels}, patch_size=fx.patch,
                                                   image_mean=list(cfg.image_mean), image_std=list(cfg.image_std))
        out = ip(images=[img], return_tensors="np")
        assert np.array_equal(_hf_rows(pre.pixel_values, fx.patch), out["pixel_values"])
        with pytest.raises(GGMLValueError, match="aspect ratio"):
            preprocess(_img(2, 500), vm.image_config)
    from PIL import Image

    with pytest.raises(ValueError, match="aspect ratio"):
        fx.ip(images=[Image.fromarray(_img(2, 500))])
    with pytest.raises(GGMLValueError, match="max_pixels"):
        ImageConfig("qwen3vl_merger", 64, 16, min_pixels=100, max_pixels=50)


@pytest.mark.parametrize("hw", [(70, 100), (300, 200), (480, 640), (300, 57)])
def test_features_match_hf(fx, hw):
    img = _img(*hw, seed=hw[1])
    with load_mmproj(fx.mmproj) as vm, load_mmproj(fx.mmproj, precision="fast") as fast:
        pre = preprocess(img, vm.image_config)
        got, quick = vm.encode(pre.pixel_values)[0], fast.encode(pre.pixel_values)[0]
        assert vm.runs(pre.pixel_values) == [pre.rows * pre.cols]
        n_ds = len(vm.config.deepstack)
    o = fx.ip(images=[img], return_tensors="pt")
    with torch.no_grad():
        f = fx.hf.model.get_image_features(pixel_values=o["pixel_values"], image_grid_thw=o["image_grid_thw"])
    ref = [torch.cat(list(f.pooler_output)).numpy()]
    for ds in getattr(f, "deepstack_features", None) or []:
        ref.append(torch.cat(list(ds)).numpy() if isinstance(ds, (list, tuple)) else ds.numpy())
    ref = np.concatenate(ref, 1)
    assert n_ds == (2 if fx.kind == "q3" else 0)
    assert got.shape == ref.shape == (pre.rows * pre.cols, 64 * (1 + n_ds))
    assert _err(got, ref) < 3e-6                   # measured 4-6e-7
    assert 1e-6 < _err(quick, ref) < 3e-3          # flash attention, ggml's GELU


@pytest.mark.parametrize("n_ubatch", [512, 16, 80])
def test_logits_match_hf(fx, n_ubatch, tmp_path):
    """Text around an image: every position's logits as transformers' (M-RoPE positions, Qwen3's deepstack),
    with the image whole in a micro-batch or cut across several; then token by token; saving the sequence
    refused; the plain prompt's media marker laid out as the processor lays out the image."""
    img = _img(200, 300, 3)
    model = load_model(fx.text, mmproj=fx.mmproj, devices="cpu")
    with model, Runner(model, n_ctx=1024, n_ubatch=n_ubatch, type_k="f32", type_v="f32") as rt:
        pre = preprocess(img, model.vision.image_config)
        ids = _prompt(pre.rows * pre.cols)
        ref = _hf_logits(fx, ids, [img])
        got = rt.decode(ids, logits="all", images=[img])
        assert _err(got, ref) < 1e-5               # measured 6e-7
        nxt = [7, 11, 13]
        steps = np.concatenate([rt.decode([t]) for t in nxt])
        # the state could not carry where the tokens after the image rotate: refused, nothing written
        with pytest.raises(GGMLValueError, match="holds images"):
            rt.save_state(0, tmp_path / "s.state")
        assert not (tmp_path / "s.state").exists()
        p = rt.inputs.prompt("a<__media__>b", "test", images=[img])
        enc = rt.tokenizer.encode
        assert [t if t >= 0 else PAD for t in p.ids] == enc("a", add_special=False) + \
            [VSTART] + [PAD] * (pre.rows * pre.cols) + [VEND] + enc("b", add_special=False)
    assert _err(steps, _hf_logits(fx, ids + nxt, [img])[len(ids):]) < 1e-5
    other = _img(200, 300, 4)
    assert _err(_hf_logits(fx, ids, [other])[-1], ref[-1]) > 1e-3


def test_positions_equal_get_rope_index(fx):
    """The M-RoPE positions of random layouts (texts and images of random grids), cut into random micro-batches
    with the earlier tokens read from the record, equal transformers' get_rope_index (the fourth position
    the time one)."""
    from ggmlpy.runner.images import ImageStore

    rng = np.random.default_rng(0)
    align = fx.patch * 2
    for _ in range(25):
        store, toks, ids, grids = ImageStore(1), [], [], []
        for _k in range(rng.integers(1, 4)):
            t = rng.integers(0, 6)
            ids += [int(x) for x in rng.integers(100, 1000, t)]
            toks += ids[len(toks):]
            gh, gw = (int(x) for x in rng.integers(1, 6, 2))
            rows = store.add(np.zeros((1, 3, gh * align, gw * align), np.float32), gh * gw)
            ids += [VSTART] + [PAD] * (gh * gw) + [VEND]
            toks += [VSTART] + rows + [VEND]
            grids.append((1, gh * 2, gw * 2))
        ids += [5, 6]
        toks += [5, 6]
        n = len(toks)
        tt = torch.tensor([[1 if t == PAD else 0 for t in ids]])
        ref, _ = fx.hf.model.get_rope_index(torch.tensor([ids]), tt, image_grid_thw=torch.tensor(grids))
        ref = ref[:, 0].numpy()                                     # (3, n)
        got = np.zeros((4, n), np.int64)
        cuts = sorted({0, n, *rng.integers(1, n, rng.integers(0, 4)).tolist()})
        for a, b in zip(cuts[:-1], cuts[1:]):
            pos = mrope_positions(np.array(toks[a:b]), np.arange(a, b), np.zeros(b - a, np.int64),
                                  lambda s, toks=toks: toks, store,
                                  lambda px: (px.shape[-2] // align, px.shape[-1] // align))
            got[:, a:b] = pos.reshape(4, -1)
        assert np.array_equal(got[:3], ref), (ids, grids)
        assert np.array_equal(got[3], ref[0])


def test_chat_two_images_and_reuse(fx):
    """A chat with two images of different sizes: the template's placeholders expanded as the processor
    does, the greedy token transformers'; the same chat again reuses the images' encodings and the prefix
    (the same tokens); two chats at once as each alone; a context shift is refused by the cache, and the
    runner computes what it keeps again."""
    a, b = _img(60, 200, 1), _img(250, 90, 2)
    msgs = [{"role": "user", "content": [{"type": "image", "image": a}, {"type": "text", "text": "and"},
                                         {"type": "image", "image": b}, {"type": "text", "text": "?"}]}]
    model = load_model(fx.text, mmproj=fx.mmproj, devices="cpu")
    one = [[{"role": "user", "content": [{"type": "image", "image": im}]}] for im in (a, b)]
    with model:
        with Runner(model, n_ctx=512, type_k="f32", type_v="f32") as rt:
            cfg = model.vision.image_config
            na, nb = (p.rows * p.cols for p in (preprocess(a, cfg), preprocess(b, cfg)))
            assert na != nb
            want = rt.chat_prompt(msgs, template=TEMPLATE)
            assert want.count(PAD) == na + nb and want.count(VSTART) == 2
            out = rt.chat(msgs, template=TEMPLATE, max_tokens=4, temperature=0)
            again = rt.chat(msgs, template=TEMPLATE, max_tokens=4, temperature=0)
            assert rt.images.n_encoded == 2 and again.tokens == out.tokens
            alone = [rt.chat(m, template=TEMPLATE, max_tokens=4, temperature=0).tokens for m in one]
        # the two images' chats at once (each sequence its own M-RoPE positions) as each alone
        with Runner(model, n_ctx=1024, n_seq_max=2, type_k="f32", type_v="f32") as rt:
            hs = [rt.submit_chat(m, template=TEMPLATE, max_tokens=4, temperature=0) for m in one]
            assert [h.result(timeout=120).tokens for h in hs] == alone
    ref = _hf_logits(fx, want, [a, b])[-1]
    assert out.tokens[0] == int(np.argmax(ref))
    model = load_model(fx.text, devices="cpu")
    assert model.shift_fn is None
    with model, Runner(model, n_ctx=16, n_batch=8) as rt:
        h = rt.submit([1, 2, 3], max_tokens=-1, temperature=0)
        for n, _ in enumerate(h):
            if n == 40:
                h.cancel()
        r = h.result(timeout=60)
    assert len(r.tokens) >= 40 and r.n_shifts >= 2


def test_largest_image_and_bad_pixels(fx):
    """The largest image the budget allows runs within the runner's reservation; pixels of a size the encoder
    cannot take are refused by name."""
    model = load_model(fx.text, mmproj=fx.mmproj, devices="cpu")
    with model, Runner(model, n_ctx=2048, type_k="f32", type_v="f32") as rt:
        vm = model.vision
        h, w = vm.largest_image
        align = fx.patch * 2
        assert (h // align) * (w // align) <= vm.config.tokens_per_image == 1280
        before = rt.reallocations
        big = PreprocessedImage([np.zeros((3, h, w), np.float32)], rows=h // align, cols=w // align)
        assert rt.encode_image(big).shape[0] == (h // align) * (w // align)
        assert rt.reallocations == before
        for shape in [(1, 3, align + 1, align), (2, 3, align, align), (1, 3, 64 * align, 64 * align)]:
            with pytest.raises(GGMLValueError, match="pixels of shape"):
                vm.encode(np.zeros(shape, np.float32))


def test_files_refused_by_key(fx, tmp_path):
    """A Qwen2 mmproj of an unknown projector, a Qwen2.5 one without its window pattern, a Qwen3 one whose
    deepstack flags do not match its layers, a text model without its RoPE sections or with sections ggml's
    rope_multi cannot take: each refused naming the key."""
    from arch_helpers import copy_gguf

    key, value = {"q2": ("clip.projector_type", "qwen2vl_mergers"), "q25": ("clip.vision.n_wa_pattern", None),
                  "q3": ("clip.vision.is_deepstack_layers", [True, False])}[fx.kind]
    bad = copy_gguf(fx.mmproj, tmp_path / "m.gguf", meta={key: value})
    with pytest.raises(GGMLValueError, match=key.replace(".", r"\.")):
        load_mmproj(bad)
    with gguf.GGUFReader(str(fx.text)) as r:
        arch = r.metadata["general.architecture"]
    for value in (None, [0, 0, 0, 8], [8, 8, 8, 8]):
        bad = copy_gguf(fx.text, tmp_path / "t.gguf", meta={f"{arch}.rope.dimension_sections": value})
        with pytest.raises(GGMLValueError, match="dimension_sections"):
            load_model(bad, devices="cpu")
