"""Llama 4 vision (the ``llama4`` mmproj) against transformers' ``Llama4ForConditionalGeneration``.

A tiny random model (vision: 56-pixel tiles of 4 x 4 patches of 14, width 32, 3 layers (the converter
maps the adapter's ``fc2`` only below the block count), 4 heads of 8; pixel shuffle to 4 tokens per tile;
text: llama4 with 2 layers, MoE of 2 experts) on llama-bpe's vocabulary with Llama 4's image tokens
added, converted by llama.cpp's converter (text and ``--mmproj``). The pixels come from ggmlpy's
preprocessing (equal to transformers' processor, tests/vision/test_llama4_preprocess.py); the prompt's
ids from the tokenizer on the text ``Llama4Processor._prompt_split_image`` writes.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch") if not os.environ.get("CI") else __import__("torch")
transformers = pytest.importorskip("transformers") if not os.environ.get("CI") else __import__("transformers")
pytest.importorskip("PIL") if not os.environ.get("CI") else __import__("PIL")

import hf_convert  # noqa: E402
import vision_helpers as vh  # noqa: E402

from ggmlpy import GGMLValueError, gguf  # noqa: E402
from ggmlpy.models import load_model  # noqa: E402
from ggmlpy.runner import Runner  # noqa: E402
from ggmlpy.vision.preprocess import ImageConfig, image_prompt, preprocess  # noqa: E402

pytestmark = pytest.mark.hf

TILE, PATCH = 56, 14
TOKENS_PER_TILE = (TILE // PATCH // 2) ** 2
IMAGE_TOKENS = ["<|image_start|>", "<|image_end|>", "<|image|>", "<|patch|>", "<|tile_x_separator|>",
                "<|tile_y_separator|>"]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|header_start|>{{ m['role'] }}<|header_end|>\n\n"
            "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
            "{% if p['type'] == 'image' %}<|image|>{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
            "<|eot|>{% endfor %}{% if add_generation_prompt %}<|header_start|>assistant<|header_end|>\n\n{% endif %}")


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    out = tmp_path_factory.mktemp("llama4v")
    tok = transformers.AutoTokenizer.from_pretrained(str(hf_convert.tokenizer_dir("llama-bpe")))
    tok.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS + ["<|header_start|>", "<|header_end|>",
                                                                       "<|eot|>"]})
    ids = tok.convert_tokens_to_ids
    vision = dict(image_size=TILE, patch_size=PATCH, hidden_size=32, num_attention_heads=4, num_hidden_layers=3,
                  intermediate_size=128, pixel_shuffle_ratio=0.5, projector_input_dim=64, projector_output_dim=64,
                  vision_output_dim=64, hidden_act="gelu", norm_eps=1e-5, initializer_range=0.2,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=64, intermediate_size_mlp=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=2,
                attention_chunk_size=512, initializer_range=0.1, bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id)
    cfg = transformers.Llama4Config(vision_config=vision, text_config=text, image_token_index=ids("<|patch|>"),
                                    boi_token_index=ids("<|image_start|>"), eoi_token_index=ids("<|image_end|>"))
    torch.manual_seed(0)
    hf = transformers.Llama4ForConditionalGeneration(cfg).float().eval()
    hf_convert.perturb_constant_weights(hf, seed=1)
    hf_dir = vh._new_dir(out, "llama4")
    hf.save_pretrained(str(hf_dir))
    tok.save_pretrained(str(hf_dir))
    (hf_dir / "preprocessor_config.json").write_text(json.dumps({
        "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "size": {"height": TILE, "width": TILE},
        "max_patches": 16, "image_processor_type": "Llama4ImageProcessor"}))
    text_path, mmproj_path = vh.convert_dir(hf_dir, out, name="llama4")
    return type("Fx", (), dict(hf=hf, tok=tok, text_path=text_path, mmproj_path=mmproj_path,
                               patch_id=ids("<|patch|>")))


def _features(fx, pixels: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        f = fx.hf.get_image_features(torch.from_numpy(pixels))
        f = f if torch.is_tensor(f) else f.last_hidden_state
        return fx.hf.multi_modal_projector(f).numpy()


def _logits(fx, ids, pixels=None) -> np.ndarray:
    """``Llama4ForConditionalGeneration.forward``'s steps (its output wrapper fails in transformers 5 on a
    MoE output without ``image_outputs``): the projected features scattered into the ``<|patch|>`` rows of
    the token embeddings, then the text model."""
    with torch.no_grad():
        input_ids = torch.tensor([ids])
        emb = fx.hf.get_input_embeddings()(input_ids)
        if pixels is not None:
            feats = torch.from_numpy(_features(fx, pixels)).reshape(-1, emb.shape[-1])
            mask = fx.hf.get_placeholder_mask(input_ids, inputs_embeds=emb, image_features=feats)
            emb = emb.masked_scatter(mask, feats)
        return fx.hf.language_model(inputs_embeds=emb).logits[0].float().numpy()


def _err(got, ref) -> float:
    return float(np.abs(np.asarray(got) - ref).max() / np.abs(ref).max())


def _image(h: int, w: int, seed: int) -> np.ndarray:
    return vh.sample_image(h, w, seed=seed)


def _data_url(img: np.ndarray) -> str:
    import base64
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _runner(fx, **kw):
    model = load_model(fx.text_path, mmproj=fx.mmproj_path, devices="cpu")
    return model, Runner(model, **{"n_ctx": 512, "type_k": "f32", "type_v": "f32", **kw})


def test_mmproj_file(fx):
    with gguf.GGUFReader(str(fx.mmproj_path)) as r:
        md, names = r.metadata, {t.name for t in r.tensors}
    assert md["clip.projector_type"] == "llama4" and md["clip.vision.projector.scale_factor"] == 2
    assert {"mm.model.fc.weight", "mm.model.mlp.1.weight", "mm.model.mlp.2.weight", "v.class_embd"} <= names
    # this converter writes the pre-FFN LayerNorm under the name attn_post_norm (ggmlpy reads it as ln2)
    assert "v.blk.0.attn_post_norm.weight" in names or "v.blk.0.ln2.weight" in names


@pytest.mark.parametrize("hw", [(40, 30), (100, 90), (60, 170)])
def test_features_match_hf(fx, hw):
    """The encoder's features of every tile (a single tile, a 2 x 2 canvas and a 1 x 3 one, each with its
    global tile) equal transformers' vision model + projector."""
    model = load_model(fx.text_path, mmproj=fx.mmproj_path, devices="cpu")
    with model:
        vision = model.vision
        pre = preprocess(_image(*hw, seed=hw[0]), vision.image_config)
        got = vision.encode(pre.pixel_values)
    ref = _features(fx, pre.pixel_values).reshape(got.shape)
    assert np.abs(ref).max() > 1e-2                      # features large enough to see an error
    assert _err(got, ref) < 3e-6                        # measured 6-7e-7


def test_fast_precision(fx):
    """vision_precision="fast": flash attention with F16 K/V (the GELU stays exact: Llama 4's is erf)."""
    pre = preprocess(_image(100, 90, seed=2), ImageConfig("llama4", TILE, PATCH))
    ref = _features(fx, pre.pixel_values)
    with load_model(fx.text_path, mmproj=fx.mmproj_path, devices="cpu", vision_precision="fast") as model:
        got = model.vision.encode(pre.pixel_values)
    assert 1e-6 < _err(got, ref.reshape(got.shape)) < 2e-3


def test_older_files_name_the_norm_ln2(fx, tmp_path):
    """A file whose pre-FFN norm is ``ln2`` (llama4 mmproj files converted before the tensor map moved it)
    gives the same features; with neither name the error names the tensor."""
    from arch_helpers import copy_gguf

    def rename(to):
        return lambda name, a: [(name.replace(".attn_post_norm.", f".{to}."), a)]

    old = copy_gguf(fx.mmproj_path, tmp_path / "ln2.gguf", tensors=rename("ln2"))
    pre = preprocess(_image(100, 90, seed=1), ImageConfig("llama4", TILE, PATCH))
    feats = []
    for path in (fx.mmproj_path, old):
        with load_model(fx.text_path, mmproj=path, devices="cpu") as model:
            feats.append(model.vision.encode(pre.pixel_values))
    np.testing.assert_array_equal(feats[0], feats[1])
    bad = copy_gguf(fx.mmproj_path, tmp_path / "bad.gguf", tensors=rename("ln_x"))
    with pytest.raises(GGMLValueError, match="attn_post_norm"):
        load_model(fx.text_path, mmproj=bad, devices="cpu")


def test_logits_match_hf(fx):
    """A prompt with text around a multi-tile image: every position's logits as transformers', the text
    prompt's ids as the processor's; then token by token after it."""
    img = _image(100, 90, seed=3)
    model, rt = _runner(fx)
    with model, rt:
        pre = preprocess(img, model.vision.image_config)
        assert (pre.rows, pre.cols, pre.n_tiles) == (2, 2, 5)
        text = "Describe" + image_prompt(pre, model.vision.image_config) + "this please"
        ids = fx.tok(text)["input_ids"]
        assert ids.count(fx.patch_id) == 5 * TOKENS_PER_TILE
        ref = _logits(fx, ids, pre.pixel_values)
        got = rt.decode(ids, logits="all", images=[img])
        assert _err(got, ref) < 1e-5                    # measured 1.1e-6
        p = rt.inputs.prompt("Describe<__media__>this please", "test", images=[img])
        assert [t if t >= 0 else fx.patch_id for t in p.ids] == ids
        nxt = [7, 11, 13]
        steps = np.concatenate([rt.decode([t]) for t in nxt])
    assert _err(steps, _logits(fx, ids + nxt, pre.pixel_values)[len(ids):]) < 1e-5
    # the image matters: another image changes the last position's logits
    other = preprocess(_image(100, 90, seed=4), model.vision.image_config).pixel_values
    assert _err(_logits(fx, ids, other)[-1], ref[-1]) > 1e-3


def test_chat_with_image(fx):
    """A chat's image part becomes the image's prompt where the template writes ``<|image|>``."""
    img = _image(60, 170, seed=8)
    msgs = [{"role": "user", "content": [{"type": "text", "text": "What is "},
                                         {"type": "image_url", "image_url": {"url": _data_url(img)}},
                                         {"type": "text", "text": "?"}]}]
    model, rt = _runner(fx)
    with model, rt:
        pre = preprocess(img, model.vision.image_config)
        text = ("<|begin_of_text|><|header_start|>user<|header_end|>\n\nWhat is " + image_prompt(
            pre, model.vision.image_config) + "?<|eot|><|header_start|>assistant<|header_end|>\n\n")
        want = fx.tok(text, add_special_tokens=False)["input_ids"]
        assert (pre.rows, pre.cols) == (2, 4) and want.count(fx.patch_id) == 9 * TOKENS_PER_TILE
        assert rt.chat_prompt(msgs, template=TEMPLATE) == want
        out = rt.chat(msgs, template=TEMPLATE, max_tokens=1, temperature=0)
        assert rt.images.n_encoded == 1
    assert out.tokens[0] == int(np.argmax(_logits(fx, want, pre.pixel_values)[-1]))


def test_largest_image_fits_the_reservation(fx):
    """An image on the largest canvas (16 tiles and the global one) runs within what the runner reserved."""
    model, rt = _runner(fx, n_ctx=1024)
    with model, rt:
        assert model.vision.max_tiles == 17
        pre = preprocess(_image(16 * TILE, TILE, seed=2), model.vision.image_config)
        assert pre.n_tiles == 17
        ids = fx.tok("x" + image_prompt(pre, model.vision.image_config))["input_ids"]
        logits = rt.decode(ids, logits="last", images=[pre])
        assert np.isfinite(logits).all()
        with pytest.raises(GGMLValueError, match="tiles"):
            model.vision.prepare(type(pre)(pre.tiles + pre.tiles[:1], rows=4, cols=4, has_global=True), "test")
