"""The image-input test fixtures themselves (tests/vision_helpers.py): the conversions, the files' keys and
tensors, the prompt layout against the HF processors, and the HF references against each other.

Each family's tiny model is made and converted once for the module (about 6 s for gemma3, 11 s for
idefics3, whose text model has llama-bpe's 128k vocabulary).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch") if not os.environ.get("CI") else __import__("torch")
transformers = pytest.importorskip("transformers") if not os.environ.get("CI") else __import__("transformers")
PIL = pytest.importorskip("PIL") if not os.environ.get("CI") else __import__("PIL")

import vision_helpers as vh  # noqa: E402

from ggmlpy import gguf  # noqa: E402
from ggmlpy.tokenizer import Tokenizer  # noqa: E402

pytestmark = pytest.mark.hf

#: GGUF token type of the image tokens (llama.cpp's LLAMA_TOKEN_TYPE_CONTROL)
CONTROL = 3


@pytest.fixture(scope="module", params=vh.FAMILIES)
def fx(request, tmp_path_factory) -> vh.VisionFixture:
    return vh.make(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def images():
    return vh.sample_images()


def _prompts(images) -> list:
    a, b, c = images
    return [["Describe ", a, " please."],          # text on both sides
            [b, "and", c, a],                      # starts with an image, two images side by side
            ["Hi\n\n", a],                         # ends with an image; newlines next to the image's
            [a]]


def _rel(got, ref) -> float:
    return float(np.abs(got - ref).max() / np.abs(ref).max())


# ------------------------------------------------------------------ the files


def test_mmproj_metadata(fx):
    with gguf.GGUFReader(str(fx.mmproj_path)) as r:
        md = r.metadata
    assert md["general.architecture"] == "clip" and md["general.type"] == "mmproj"
    assert md["clip.projector_type"] == fx.family
    assert md["clip.has_vision_encoder"]
    assert md["clip.vision.image_size"] == vh.IMAGE_SIZE and md["clip.vision.patch_size"] == vh.PATCH_SIZE
    assert md["clip.vision.embedding_length"] == vh.N_EMBD_VISION
    assert md["clip.vision.feed_forward_length"] == vh.N_FF_VISION
    assert md["clip.vision.block_count"] == vh.N_LAYER_VISION
    assert md["clip.vision.attention.head_count"] == vh.N_HEAD_VISION
    assert md["clip.vision.projection_dim"] == vh.N_EMBD_TEXT
    assert md["clip.vision.attention.layer_norm_epsilon"] == pytest.approx(1e-6)
    np.testing.assert_array_equal(md["clip.vision.image_mean"], [0.5] * 3)
    np.testing.assert_array_equal(md["clip.vision.image_std"], [0.5] * 3)
    assert md["clip.use_gelu"]
    # gemma3: (64 / 8) patches per side pooled to sqrt(16) = 4; idefics3: the config's scale_factor
    assert md["clip.vision.projector.scale_factor"] == 2
    if fx.family == vh.IDEFICS3:
        assert md["clip.vision.preproc_image_size"] == vh.IDEFICS3_LONGEST_EDGE
    else:
        assert "clip.vision.preproc_image_size" not in md


def test_mmproj_tensors_are_the_hf_weights(fx):
    """Every mmproj tensor, by name, holds the HF weight it came from (gemma3's norm as 1 + w, its
    projection in F16: the fixture rounded it so), and nothing else is in the file."""
    want = vh.mmproj_reference_tensors(fx)
    with gguf.GGUFReader(str(fx.mmproj_path)) as r:
        infos = {t.name: t for t in r.tensors}
        assert set(infos) == set(want)
        for name, ref in want.items():
            got = r.tensor_data(name)
            assert tuple(infos[name].ne) == tuple(reversed(ref.shape)), name
            f16 = name == "mm.input_projection.weight"
            assert (infos[name].type == gguf.Type.F16) == f16, name
            np.testing.assert_array_equal(np.asarray(got, np.float32), ref, err_msg=name)


def test_text_gguf(fx):
    with gguf.GGUFReader(str(fx.text_path)) as r:
        md, infos = r.metadata, {t.name: t for t in r.tensors}
    arch = "gemma3" if fx.family == vh.GEMMA3 else "llama"
    assert md["general.architecture"] == arch and md["general.type"] == "model"
    assert md[f"{arch}.embedding_length"] == vh.N_EMBD_TEXT and md[f"{arch}.block_count"] == 2
    tokens, types = md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"]
    assert len(tokens) == fx.n_vocab == len(fx.tokenizer)
    assert tuple(infos["token_embd.weight"].ne) == (vh.N_EMBD_TEXT, fx.n_vocab)
    assert ("output.weight" in infos) == (fx.family == vh.IDEFICS3)    # gemma3 ties it
    assert not any(n.startswith(("v.", "mm.")) for n in infos)
    special = [fx.image_token_id, fx.boi_token_id, fx.eoi_token_id, fx.fake_token_id, fx.global_token_id,
               *fx.row_col_token_ids.values()]
    for tid in (t for t in special if t is not None):
        assert tokens[tid] == fx.tokenizer.convert_ids_to_tokens(tid) and types[tid] == CONTROL, tid
    if fx.family == vh.GEMMA3:
        assert (fx.boi_token_id, fx.eoi_token_id, fx.image_token_id) == (1000, 1001, 1002) == tuple(
            tokens.index(t) for t in ("<start_of_image>", "<end_of_image>", "<image_soft_token>"))
        assert not md["tokenizer.ggml.add_space_prefix"]      # as the HF GemmaTokenizer


# ------------------------------------------------------------------ prompts


def test_prompt_ids_are_the_processors(fx, images):
    """The hand-built ids equal Gemma3Processor's / Idefics3Processor's, and so do the pixels and
    gemma3's token types; the GGUF's tokenizer gives the same ids from the processor's expanded text."""
    with gguf.GGUFReader(str(fx.text_path)) as r:
        tokenizer = Tokenizer.from_gguf(r)
    for parts in _prompts(images):
        inputs = vh.hf_inputs(fx, parts)
        ids = vh.prompt_ids(fx, parts)
        assert ids == inputs["input_ids"].tolist()
        assert ids == tokenizer.encode(vh.expanded_text(fx, parts), add_special=True, parse_special=True)
        pics = [p for p in parts if not isinstance(p, str)]
        np.testing.assert_array_equal(vh.pixel_values(fx, pics), inputs["pixel_values"])
        if fx.family == vh.GEMMA3:
            np.testing.assert_array_equal(vh.token_type_ids(fx, ids), inputs["token_type_ids"])
        n_tiles = sum(max(r * c, 0) + 1 for r, c in (vh.image_grid(fx, p) for p in pics))
        assert inputs["pixel_values"].shape == (n_tiles, 3, vh.IMAGE_SIZE, vh.IMAGE_SIZE)
        assert ids.count(fx.image_token_id) == n_tiles * fx.tokens_per_image


def test_the_image_layout(fx, images):
    """The layout the module docstring states, spelled out."""
    a = images[0]
    ids = vh.prompt_ids(fx, ["x", a, "y"])
    enc = fx.tokenizer.encode
    img = [fx.image_token_id] * 16
    if fx.family == vh.GEMMA3:
        nl = enc("\n\n", add_special_tokens=False)
        assert nl == [13, 13]        # byte tokens: never merged with the text beside
        assert ids == [fx.bos_token_id, *enc("x\n\n", add_special_tokens=False), fx.boi_token_id, *img,
                       fx.eoi_token_id, *enc("\n\ny", add_special_tokens=False)]
        assert vh.image_grid(fx, a) == (0, 0)
        return
    assert [vh.image_grid(fx, im) for im in images] == [(2, 2), (1, 2), (2, 1)]
    f, g, rc = fx.fake_token_id, fx.global_token_id, fx.row_col_token_ids
    nl, nl2 = enc("\n", add_special_tokens=False), enc("\n\n", add_special_tokens=False)
    assert (nl, nl2) == ([198], [271])
    block = [f, rc[1, 1], *img, f, rc[1, 2], *img, *nl, f, rc[2, 1], *img, f, rc[2, 2], *img, *nl2, f, g, *img, f]
    assert ids == [fx.bos_token_id, *enc("x", add_special_tokens=False), *block, *enc("y", add_special_tokens=False)]
    assert vh.image_block(fx, 2, 2) == block
    # 2 x 1: a newline after each one-tile row; not split: the global image alone
    assert vh.image_block(fx, 2, 1) == [f, rc[1, 1], *img, *nl, f, rc[2, 1], *img, *nl2, f, g, *img, f]
    assert vh.prompt_ids(fx, [a], split=False) == [fx.bos_token_id, f, g, *img, f] == vh.hf_inputs(
        fx, [a], split=False)["input_ids"].tolist()


# ------------------------------------------------------------------ the HF references


def test_reference_shapes(fx, images):
    pv = vh.pixel_values(fx, images)
    n = 3 if fx.family == vh.GEMMA3 else 5 + 3 + 3   # idefics3: 2x2, 1x2, 2x1 tiles and a global image each
    assert pv.shape == (n, 3, 64, 64) and pv.dtype == np.float32
    assert -1.0 <= pv.min() < pv.max() <= 1.0        # mean and std 0.5
    feats, hidden = vh.image_features(fx, pv), vh.vision_hidden(fx, pv)
    assert feats.shape == (n, 16, vh.N_EMBD_TEXT) and feats.dtype == np.float32
    assert hidden.shape == (n, 64, vh.N_EMBD_VISION) and hidden.dtype == np.float32
    ids = vh.prompt_ids(fx, ["Look: ", *images])
    out = vh.logits(fx, ids, pv)
    assert out.shape == (len(ids), fx.n_vocab) and out.dtype == np.float32 and np.isfinite(out).all()


def test_the_projector_from_the_hidden_state(fx, images):
    """image_features = the projector (re-done in numpy) of vision_hidden: the two references agree, and
    per image (tile) the features do not depend on the other images of the call."""
    pv = vh.pixel_values(fx, images)
    feats = vh.image_features(fx, pv)
    assert _rel(vh.project(fx, vh.vision_hidden(fx, pv)), feats) < 1e-5
    assert _rel(vh.image_features(fx, pv[1:2]), feats[1:2]) < 1e-5


def test_logits_self_consistent(fx, images):
    """The logits: positions before the image are the text-only model's; the image's pixels matter; the
    text model run on input_embeddings (image features in place of the image tokens) gives the same
    logits; for gemma3, bidirectional attention changes only the image's own positions and later."""
    a = images[0]
    parts = ["Describe ", a, " please."]
    ids = vh.prompt_ids(fx, parts)
    pv = vh.pixel_values(fx, [a])
    ref = vh.logits(fx, ids, pv)
    first = ids.index(fx.image_token_id)
    assert _rel(vh.logits(fx, ids[:first]), ref[:first]) < 1e-5

    other = vh.pixel_values(fx, [vh.sample_image(*a.shape[:2], seed=99)])
    changed = vh.logits(fx, ids, other)
    assert _rel(changed[:first], ref[:first]) < 1e-5
    assert _rel(changed[-1], ref[-1]) > 1e-2       # the fixture is sensitive to the image

    emb = vh.input_embeddings(fx, ids, pv)
    np.testing.assert_array_equal(emb[np.asarray(ids) == fx.image_token_id],
                                  vh.image_features(fx, pv).reshape(-1, vh.N_EMBD_TEXT))
    assert _rel(vh.logits(fx, ids, embeddings=emb), ref) < 1e-5

    if fx.family == vh.GEMMA3:
        causal = vh.logits(fx, ids, pv, bidirectional=False)
        assert _rel(causal[:first], ref[:first]) < 1e-5
        last = len(ids) - 1 - ids[::-1].index(fx.image_token_id)
        assert _rel(causal[first:last], ref[first:last]) > 1e-2      # the image tokens see the later ones
        # the last image token sees its whole image either way; what follows sees the changed features
        assert _rel(causal[last], ref[last]) > 1e-3
