"""Tiny random-weight vision-language models, converted by llama.cpp's own converter, and their
transformers references: the fixtures of the image-input tests.

Two families, each a Hugging Face model saved with its processor into one folder, which
``convert_hf_to_gguf.py`` (tests/hf_convert.py) converts twice: a text GGUF and, with ``--mmproj``, a
projector GGUF (``general.architecture = "clip"``).

========  ====================================  ================  ===========================================
family    HF model                              text GGUF         mmproj (``clip.projector_type``)
========  ====================================  ================  ===========================================
gemma3    ``Gemma3ForConditionalGeneration``    ``gemma3``        ``gemma3``: SigLIP, 2x2 average pool, RMS
                                                                  norm (stored ``1 + w``), matmul
idefics3  ``Idefics3ForConditionalGeneration``  ``llama``         ``idefics3``: SigLIP-like, pixel shuffle
                                                                  (scale 2), linear
========  ====================================  ================  ===========================================

Both vision towers take 64x64 pixels in 8x8 patches (64 patches, width 48, 2 layers, 4 heads) and give
16 tokens per image (gemma3) or per tile (idefics3) of the text width (64).

Tokenizers. The gemma3 converter reads ``tokenizer.model``: :func:`hf_convert.spm_tokenizer_model`'s
1000 pieces, plus three special tokens added after them as in the real Gemma 3 (``<start_of_image>``
1000, ``<end_of_image>`` 1001, ``<image_soft_token>`` 1002; ``vocab_size`` 1003). The HF tokenizer is a
``GemmaTokenizer`` rebuilt from that model (vocabulary and merges by ``SentencePieceExtractor``, which
needs no protobuf), so that the real ``Gemma3Processor`` runs. idefics3 uses llama.cpp's ``llama-bpe``
vocabulary (:func:`hf_convert.tokenizer_dir`) with ``Idefics3Processor``'s tokens added as special tokens:
``<fake_token_around_image>`` 128257, ``<image>`` 128258, ``<end_of_utterance>`` 128259, ``<global-img>``
128260 and ``<row_R_col_C>`` (R, C in 1..6) 128261.. (``vocab_size`` 128297). In both text GGUFs these are
CONTROL tokens, and the GGUF's tokenizer splits them out of a text with special-token parsing on, as the
HF tokenizer does.

Processors. transformers 5.23 has PIL backends of both image processors (``Gemma3ImageProcessorPil``,
``Idefics3ImageProcessorPil``), which run without torchvision: every token id and pixel value here
comes from the real HF processors. :func:`prompt_ids` also builds the ids by hand, and the fixture
tests check it against the processor.

Adjustments the converter (llama.cpp 0c1e570) needs with transformers 5 (the smallest found):

- gemma3 (as ``../shared/reference/converter-recipes.md`` says): the saved tensors ``vision_tower.*``
  are renamed ``vision_tower.vision_model.*`` (the published checkpoints' layout; else "Can not map
  tensor 'vision_tower.embeddings.patch_embedding.bias'"); ``vision_use_head=False``; the processor is
  saved with ``image_seq_length = 16`` (``processor_config.json``), from which the converter derives
  ``clip.vision.projector.scale_factor``
  (2; with the default 256 it would write none). The special tokens' ids go into
  ``tokenizer_config.json``'s ``added_tokens_decoder`` (transformers 5 keeps them only in
  ``tokenizer.json``, which this converter does not read for gemma3); without it they would be
  ``[PAD1000]``.. of type UNUSED.
- gemma3: the converter stores ``mm.input_projection.weight`` as F16 whatever ``--outtype`` says, so the
  HF weight is rounded to F16 before saving: the reference uses exactly the file's weight. (ggml's CPU
  matmul with an F16 weight also rounds the activations to F16, about 1e-3 relative.)
- idefics3: the text conversion picks its class from ``text_config.architectures``, which transformers 5
  does not save; without it ``Idefics3ForConditionalGeneration`` is "not supported" as a text model.
  ``config.json`` gets ``text_config.architectures = ["VLlama3ForCausalLM"]``, as in the published
  SmolVLM / Idefics3 checkpoints (the llama converter, which strips ``text_model.`` from the names).

Layout of one image in a prompt (``processor`` adds it where the text has ``image_placeholder``):

- gemma3: text ``"\\n\\n<start_of_image>" + "<image_soft_token>" * 16 + "<end_of_image>\\n\\n"``. The
  ``"\\n\\n"`` are text, tokenized together with the text beside them (the special tokens split the
  string); with this vocabulary ``"\\n"`` is the byte token 13. The image tokens' ``token_type_ids`` are
  1 (attention among one image's tokens is bidirectional), all others 0.
- idefics3, an image split into R x C tiles (row-major)::

      for each row r:  for each column c:  <fake_token_around_image> <row_r_col_c> <image>*16
                       "\\n"  (the last row's is joined with the next one: "\\n\\n")
      <fake_token_around_image> <global-img> <image>*16 <fake_token_around_image>

  the tiles' features first (row-major), then the global image's: ``pixel_values`` holds the tiles
  and then the global image (64x64 each). ``"\\n"`` is 198 and ``"\\n\\n"`` 271 in llama-bpe. An image
  not split (``split=False``) is only the last line.

The images are resized by the processors: gemma3 to 64x64 (bilinear); idefics3 to a longest edge of
128 (``size``, written as ``clip.vision.preproc_image_size``), then to multiples of 64 (lanczos), cut
into 64x64 tiles, plus the whole image at 64x64 as the global tile.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Union

import hf_convert
import numpy as np

GEMMA3 = "gemma3"
IDEFICS3 = "idefics3"
FAMILIES = (GEMMA3, IDEFICS3)

#: vision tower: input side, patch side, width, layers, heads, feed-forward width
IMAGE_SIZE, PATCH_SIZE, N_EMBD_VISION, N_LAYER_VISION, N_HEAD_VISION, N_FF_VISION = 64, 8, 48, 2, 4, 96
#: text model width
N_EMBD_TEXT = 64
#: tokens per image (gemma3) or per tile (idefics3)
TOKENS_PER_IMAGE = 16
#: idefics3 preprocessing: longest edge of the resized image, side of a tile
IDEFICS3_LONGEST_EDGE, IDEFICS3_TILE = 128, 64
#: idefics3 has <row_R_col_C> tokens for R, C up to this
IDEFICS3_MAX_GRID = 6
#: image shapes (height, width) of :func:`sample_images`; idefics3 splits them 2x2, 1x2 and 2x1
SAMPLE_SIZES = ((48, 64), (40, 120), (120, 40))

#: chat templates written for the tests (the fixtures' files have none: give them as ``template=`` or
#: ``--chat-template-file``): what the families' published templates write for an image part,
#: ``{"type": "image"}``
CHAT_TEMPLATES = {
    "gemma3": ("{{ bos_token }}{% for m in messages %}<start_of_turn>"
               "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
               "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
               "{% if p['type'] == 'image' %}<start_of_image>{% elif p['type'] == 'text' %}{{ p['text'] }}"
               "{% endif %}{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
               "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"),
    "idefics3": ("{{ bos_token }}{% for m in messages %}{{ m['role'] | capitalize }}:"
                 "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
                 "{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
                 "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"),
}

#: an image in a prompt: its pixels (uint8, height x width x 3)
Image = np.ndarray
Part = Union[str, Image]


@dataclasses.dataclass
class VisionFixture:
    """A tiny HF vision-language model, its processor and the two GGUF files converted from it.

    Attributes
    ----------
    family : str
        ``"gemma3"`` or ``"idefics3"``.
    hf : transformers.PreTrainedModel
        The model (float32, eval mode) that the files were converted from.
    processor : transformers.ProcessorMixin
        ``Gemma3Processor`` or ``Idefics3Processor`` with the PIL image processor; ``processor.tokenizer``
        is the HF tokenizer.
    hf_dir : Path
        The saved model folder the converter read (weights, config, processor, tokenizer).
    text_path, mmproj_path : Path
        The text GGUF and the projector GGUF.
    image_token_id : int
        The placeholder that image features replace (``<image_soft_token>`` / ``<image>``).
    image_placeholder : str
        What marks an image in a text given to ``processor`` (``<start_of_image>`` / ``<image>``).
    tokens_per_image : int
        Image tokens per image (gemma3) or per tile (idefics3).
    image_size, patch_size : int
        The vision tower's input side and patch side, in pixels.
    n_embd_text, n_embd_vision : int
        Widths of the text model and of the vision tower.
    bos_token_id : int
        What the tokenizer puts first.
    boi_token_id, eoi_token_id : int or None
        gemma3's ``<start_of_image>`` and ``<end_of_image>``; None for idefics3.
    fake_token_id, global_token_id : int or None
        idefics3's ``<fake_token_around_image>`` and ``<global-img>``; None for gemma3.
    row_col_token_ids : dict
        idefics3: ``(row, col)`` (from 1) to the id of ``<row_{row}_col_{col}>``; empty for gemma3.
    perturbed : list of str
        The parameters that were constant after initialisation and were made random.
    """

    family: str
    hf: Any = dataclasses.field(repr=False)
    processor: Any = dataclasses.field(repr=False)
    hf_dir: Path
    text_path: Path
    mmproj_path: Path
    image_token_id: int
    image_placeholder: str
    tokens_per_image: int
    image_size: int
    patch_size: int
    n_embd_text: int
    n_embd_vision: int
    bos_token_id: int
    boi_token_id: int | None = None
    eoi_token_id: int | None = None
    fake_token_id: int | None = None
    global_token_id: int | None = None
    row_col_token_ids: dict = dataclasses.field(default_factory=dict)
    perturbed: list = dataclasses.field(default_factory=list, repr=False)

    @property
    def tokenizer(self):
        """The HF tokenizer (``processor.tokenizer``)."""
        return self.processor.tokenizer

    @property
    def n_vocab(self) -> int:
        """The text model's vocabulary size (``len(tokenizer)``)."""
        return int(self.hf.config.text_config.vocab_size)


# ------------------------------------------------------------------ converting


def _start_converter(hf_dir: Path, outfile: Path, outtype: str, extra_args: Sequence[str]) -> tuple:
    script = hf_convert.llama_cpp_dir() / "convert_hf_to_gguf.py"
    env = dict(os.environ)
    env.pop("NO_LOCAL_GGUF", None)   # it would import PyPI's gguf, which this converter does not work with
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cmd = [sys.executable, str(script), str(hf_dir), "--outfile", str(outfile), "--outtype", outtype, *extra_args]
    log = open(outfile.with_suffix(".log"), "w+")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log


def convert_dir(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, name: str = "model", outtype: str = "f32",
                timeout: float = 600) -> tuple[Path, Path]:
    """Convert a saved vision-language model folder into a text GGUF and an mmproj GGUF.

    The converter runs twice on ``hf_dir``, at the same time (subprocesses), without and with
    ``--mmproj``; each one's output goes to a ``.log`` beside its file.

    Parameters
    ----------
    hf_dir : path
        A model folder as :func:`make_gemma3` / :func:`make_idefics3` write it (adjusted for the converter).
    out_dir : path
        Where the files go (created).
    name : str
        The files are ``name-text-outtype.gguf`` and ``name-mmproj-outtype.gguf``.
    outtype : str
        The converter's ``--outtype`` (f32, f16, bf16, q8_0).
    timeout : float
        Seconds allowed to the two conversions together.

    Returns
    -------
    (Path, Path)
        The text GGUF and the mmproj GGUF.

    Raises
    ------
    hf_convert.ConverterError
        A conversion failed; the message ends with its output.
    """
    hf_convert._require("sentencepiece")
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    outs = (out_dir / f"{name}-text-{outtype}.gguf", out_dir / f"{name}-mmproj-{outtype}.gguf")
    started = [_start_converter(hf_dir, outs[0], outtype, ()), _start_converter(hf_dir, outs[1], outtype, ["--mmproj"])]
    failures = []
    try:
        for (proc, log), out in zip(started, outs):
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired as e:
                raise hf_convert.ConverterError(f"convert_hf_to_gguf.py took over {timeout} s on {hf_dir}") from e
            if rc != 0 or not out.is_file():
                log.seek(0)
                failures.append(f"convert_hf_to_gguf.py failed (exit {rc}) writing {out.name}:\n{log.read()[-4000:]}")
    finally:
        for proc, log in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    if failures:
        raise hf_convert.ConverterError("\n".join(failures))
    return outs


def _rename_tensors(path: Path, old: str, new: str) -> None:
    """Rename the tensors of a safetensors file whose names start with ``old``: ``new`` + the rest."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    renamed = {(new + k[len(old):] if k.startswith(old) else k): v for k, v in tensors.items()}
    save_file(renamed, str(path), metadata={"format": "pt"})


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    edit(data)
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _new_dir(out_dir: Path, name: str) -> Path:
    hf_dir = out_dir / f"{name}-hf"
    if hf_dir.exists():
        shutil.rmtree(hf_dir)
    hf_dir.mkdir(parents=True)
    return hf_dir


# ------------------------------------------------------------------ the two families


def _gemma3_tokenizer():
    """A ``GemmaTokenizer`` of :func:`hf_convert.spm_tokenizer_model` with Gemma 3's image tokens added."""
    import transformers
    from transformers.tokenization_utils_sentencepiece import SentencePieceExtractor

    vocab, _scores, merges = SentencePieceExtractor(str(hf_convert.spm_tokenizer_model())).extract()
    # the SentencePiece model's own special pieces (unk 0, bos 1, eos 2); no pad or mask piece is added
    return transformers.GemmaTokenizer(
        vocab=vocab, merges=merges, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<unk>",
        mask_token=None, add_bos_token=True,
        extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                              "image_token": "<image_soft_token>"})


def make_gemma3(out_dir: str | os.PathLike, seed: int = 0, outtype: str = "f32", name: str = "gemma3") -> VisionFixture:
    """A random-weight ``Gemma3ForConditionalGeneration``, saved and converted.

    Text: 2 layers (both local, as llama.cpp's default pattern has them), width 64, 4 heads of 16, 2 KV
    heads, window 512 (wider than any test prompt), weights of scale 0.1. Vision: SigLIP without head;
    the projector pools 8x8 patches 2x2 to 16 tokens.

    Parameters
    ----------
    out_dir : path
        Folder for the model folder and the GGUF files.
    seed : int
        Seeds the weights.
    outtype : str
        The converter's ``--outtype``.
    name : str
        Prefix of the files.

    Returns
    -------
    VisionFixture
    """
    import torch
    import transformers

    out_dir = Path(out_dir)
    tok = _gemma3_tokenizer()
    n_spm = len(tok) - 3
    text = transformers.Gemma3TextConfig(
        vocab_size=len(tok), hidden_size=N_EMBD_TEXT, intermediate_size=2 * N_EMBD_TEXT, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
        max_position_embeddings=256, sliding_window=512, rms_norm_eps=1e-6, initializer_range=0.1,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    vision = transformers.SiglipVisionConfig(
        hidden_size=N_EMBD_VISION, intermediate_size=N_FF_VISION, num_hidden_layers=N_LAYER_VISION,
        num_attention_heads=N_HEAD_VISION, image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, vision_use_head=False,
        layer_norm_eps=1e-6)
    cfg = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=TOKENS_PER_IMAGE,
        image_token_index=tok.image_token_id, boi_token_index=tok.boi_token_id, eoi_token_index=tok.eoi_token_id,
        attn_implementation="eager")
    torch.manual_seed(seed)
    hf = transformers.Gemma3ForConditionalGeneration(cfg).float().eval()
    perturbed = hf_convert.perturb_constant_weights(hf, seed=seed + 1)
    with torch.no_grad():
        w = hf.model.multi_modal_projector.mm_input_projection_weight
        w.copy_(w.half().float())    # the converter stores it as F16

    image_processor = transformers.Gemma3ImageProcessorPil(
        image_mean=[0.5] * 3, image_std=[0.5] * 3, size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = transformers.Gemma3Processor(
        image_processor=image_processor, tokenizer=tok, image_seq_length=TOKENS_PER_IMAGE)

    hf_dir = _new_dir(out_dir, name)
    hf.save_pretrained(str(hf_dir))
    processor.save_pretrained(str(hf_dir))     # tokenizer, processor_config.json (with image_seq_length)
    shutil.copyfile(hf_convert.spm_tokenizer_model(), hf_dir / "tokenizer.model")
    _rename_tensors(hf_dir / "model.safetensors", "vision_tower.", "vision_tower.vision_model.")
    added = {str(i): {"content": t.content, "special": t.special, "normalized": t.normalized, "lstrip": t.lstrip,
                      "rstrip": t.rstrip, "single_word": t.single_word}
             for i, t in tok.added_tokens_decoder.items() if i >= n_spm}
    _edit_json(hf_dir / "tokenizer_config.json", lambda d: d.__setitem__("added_tokens_decoder", added))

    text_path, mmproj_path = convert_dir(hf_dir, out_dir, name=name, outtype=outtype)
    return VisionFixture(
        family=GEMMA3, hf=hf, processor=processor, hf_dir=hf_dir, text_path=text_path, mmproj_path=mmproj_path,
        image_token_id=tok.image_token_id, image_placeholder=tok.boi_token, tokens_per_image=TOKENS_PER_IMAGE,
        image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, n_embd_text=N_EMBD_TEXT, n_embd_vision=N_EMBD_VISION,
        bos_token_id=tok.bos_token_id, boi_token_id=tok.boi_token_id, eoi_token_id=tok.eoi_token_id,
        perturbed=perturbed)


def _idefics3_tokenizer():
    """llama-bpe's HF tokenizer (a fresh copy) with Idefics3Processor's tokens added as special tokens."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(hf_convert.tokenizer_dir("llama-bpe")))
    grid = [f"<row_{r}_col_{c}>" for r in range(1, IDEFICS3_MAX_GRID + 1) for c in range(1, IDEFICS3_MAX_GRID + 1)]
    tok.add_special_tokens({"additional_special_tokens": [
        "<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>", *grid]})
    return tok


def make_idefics3(out_dir: str | os.PathLike, seed: int = 0, outtype: str = "f32",
                  name: str = "idefics3") -> VisionFixture:
    """A random-weight ``Idefics3ForConditionalGeneration`` (SmolVLM's architecture), saved and converted.

    Text: llama, 2 layers, width 64, 4 heads of 16, 2 KV heads, untied output, weights of scale 0.1.
    Vision: Idefics3's SigLIP-like tower; the connector's pixel shuffle (scale 2) turns 64 patches into
    16 tokens of width 4 x 48, projected to 64. The image processor resizes to a longest edge of 128 and
    cuts 64x64 tiles.

    Parameters
    ----------
    out_dir : path
        Folder for the model folder and the GGUF files.
    seed : int
        Seeds the weights.
    outtype : str
        The converter's ``--outtype``.
    name : str
        Prefix of the files.

    Returns
    -------
    VisionFixture
    """
    import torch
    import transformers

    out_dir = Path(out_dir)
    tok = _idefics3_tokenizer()
    text = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=N_EMBD_TEXT, intermediate_size=2 * N_EMBD_TEXT, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5,
        initializer_range=0.1, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    vision = transformers.Idefics3VisionConfig(
        hidden_size=N_EMBD_VISION, intermediate_size=N_FF_VISION, num_hidden_layers=N_LAYER_VISION,
        num_attention_heads=N_HEAD_VISION, image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, layer_norm_eps=1e-6)
    cfg = transformers.Idefics3Config(
        text_config=text, vision_config=vision, scale_factor=2, image_token_id=tok.convert_tokens_to_ids("<image>"),
        pad_token_id=tok.convert_tokens_to_ids("<end_of_utterance>"), attn_implementation="eager")
    torch.manual_seed(seed)
    hf = transformers.Idefics3ForConditionalGeneration(cfg).float().eval()
    perturbed = hf_convert.perturb_constant_weights(hf, seed=seed + 1)

    image_processor = transformers.Idefics3ImageProcessorPil(
        image_mean=[0.5] * 3, image_std=[0.5] * 3, size={"longest_edge": IDEFICS3_LONGEST_EDGE},
        max_image_size={"longest_edge": IDEFICS3_TILE})
    processor = transformers.Idefics3Processor(
        image_processor=image_processor, tokenizer=tok, image_seq_len=TOKENS_PER_IMAGE)

    hf_dir = _new_dir(out_dir, name)
    hf.save_pretrained(str(hf_dir))
    processor.save_pretrained(str(hf_dir))

    def text_arch(d):
        d["text_config"]["architectures"] = ["VLlama3ForCausalLM"]
    _edit_json(hf_dir / "config.json", text_arch)

    text_path, mmproj_path = convert_dir(hf_dir, out_dir, name=name, outtype=outtype)
    ids = tok.convert_tokens_to_ids
    return VisionFixture(
        family=IDEFICS3, hf=hf, processor=processor, hf_dir=hf_dir, text_path=text_path, mmproj_path=mmproj_path,
        image_token_id=ids("<image>"), image_placeholder="<image>", tokens_per_image=TOKENS_PER_IMAGE,
        image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, n_embd_text=N_EMBD_TEXT, n_embd_vision=N_EMBD_VISION,
        bos_token_id=tok.bos_token_id, fake_token_id=ids("<fake_token_around_image>"),
        global_token_id=ids("<global-img>"),
        row_col_token_ids={(r, c): ids(f"<row_{r}_col_{c}>") for r in range(1, IDEFICS3_MAX_GRID + 1)
                           for c in range(1, IDEFICS3_MAX_GRID + 1)},
        perturbed=perturbed)


def make(family: str, out_dir: str | os.PathLike, **kw) -> VisionFixture:
    """:func:`make_gemma3` or :func:`make_idefics3` by ``family`` name."""
    makers = {GEMMA3: make_gemma3, IDEFICS3: make_idefics3}
    if family not in makers:
        raise ValueError(f"unknown family {family!r}; there are {list(makers)}")
    return makers[family](out_dir, **kw)


# ------------------------------------------------------------------ images and prompts


def sample_image(height: int, width: int, seed: int = 0) -> np.ndarray:
    """A deterministic test image: colour gradients, a diagonal wave and noise.

    Parameters
    ----------
    height, width : int
        Its size in pixels.
    seed : int
        Seeds the noise and shifts the wave.

    Returns
    -------
    numpy.ndarray
        uint8, shape ``(height, width, 3)``.
    """
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    red = 255.0 * x / max(width - 1, 1)
    green = 255.0 * y / max(height - 1, 1)
    blue = 127.5 + 127.5 * np.sin((x + 2.0 * y) / 5.0 + seed)
    img = np.stack([red, green, blue], axis=-1) + rng.normal(0.0, 20.0, (height, width, 3))
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def sample_images(seed: int = 0) -> list:
    """One :func:`sample_image` per shape of ``SAMPLE_SIZES``, seeds ``seed``, ``seed + 1``, ..."""
    return [sample_image(h, w, seed + i) for i, (h, w) in enumerate(SAMPLE_SIZES)]


def _as_list(images) -> list:
    return [images] if isinstance(images, np.ndarray) and images.ndim == 3 else list(images)


def _process_images(fixture: VisionFixture, images: list, split: bool) -> dict:
    kw = {"return_row_col_info": True, "do_image_splitting": split} if fixture.family == IDEFICS3 else {}
    return fixture.processor.image_processor(images=[images], return_tensors="np", **kw)


def pixel_values(fixture: VisionFixture, images, split: bool = True) -> np.ndarray:
    """The HF image processor's pixel values of ``images``.

    Parameters
    ----------
    fixture : VisionFixture
    images : numpy.ndarray or sequence of them
        uint8 ``(height, width, 3)`` images.
    split : bool
        idefics3: cut each image into tiles (the default; else only the global 64x64 image).

    Returns
    -------
    numpy.ndarray
        float32 ``(n, 3, 64, 64)``: gemma3 one per image; idefics3 each image's tiles (row-major), then
        its global image, image after image.
    """
    pv = _process_images(fixture, _as_list(images), split)["pixel_values"]
    # gemma3's processor flattens the prompt's images: (n, 3, H, W); idefics3's keeps the prompt axis
    return np.ascontiguousarray(pv[0] if fixture.family == IDEFICS3 else pv, np.float32)


def image_grid(fixture: VisionFixture, image: np.ndarray, split: bool = True) -> tuple[int, int]:
    """``(rows, cols)`` of the tiles the HF image processor cuts ``image`` into; ``(0, 0)``: not split
    (always for gemma3)."""
    if fixture.family != IDEFICS3:
        return 0, 0
    out = _process_images(fixture, [image], split)
    return int(out["rows"][0][0]), int(out["cols"][0][0])


def _image_pieces(fixture: VisionFixture, rows: int = 0, cols: int = 0) -> list:
    """One image as the processor writes it: texts (str) between runs of special-token ids (lists)."""
    img = [fixture.image_token_id] * fixture.tokens_per_image
    if fixture.family == GEMMA3:
        return ["\n\n", [fixture.boi_token_id, *img, fixture.eoi_token_id], "\n\n"]
    out: list = []
    for r in range(1, rows + 1):
        tiles = [(fixture.fake_token_id, fixture.row_col_token_ids[(r, c)], *img) for c in range(1, cols + 1)]
        out += [[tok for tile in tiles for tok in tile], "\n"]
    if rows:
        out.append("\n")     # joins the last row's newline: "\n\n"
    return out + [[fixture.fake_token_id, fixture.global_token_id, *img, fixture.fake_token_id]]


def _encode_pieces(fixture: VisionFixture, pieces: list) -> list:
    """Token ids of texts and id runs: adjacent texts joined, then tokenized (special tokens split the
    processor's string into exactly these texts)."""
    out: list = []
    text = ""
    for piece in [*pieces, []]:
        if isinstance(piece, str):
            text += piece
            continue
        if text:
            out += fixture.tokenizer.encode(text, add_special_tokens=False)
            text = ""
        out += piece
    return out


def image_block(fixture: VisionFixture, rows: int = 0, cols: int = 0) -> list:
    """The token ids that stand for one image, built by hand (the layout in the module docstring).

    gemma3: ``<start_of_image>``, 16 x ``<image_soft_token>``, ``<end_of_image>`` (the ``"\\n\\n"``
    around them are text, tokenized with the text beside: :func:`prompt_ids` puts them there).
    idefics3: the whole block for a ``rows x cols`` grid, its newlines included; ``(0, 0)``: an image
    not split.
    """
    if fixture.family == GEMMA3:
        return list(_image_pieces(fixture)[1])
    return _encode_pieces(fixture, _image_pieces(fixture, rows, cols))


def prompt_ids(fixture: VisionFixture, parts: Sequence[Part], bos: bool = True, split: bool = True) -> list:
    """The token ids of a prompt of texts and images, built by hand as the HF processor lays them out.

    Each image becomes its special tokens and the texts around or inside them (gemma3: ``"\\n\\n"``
    before and after; idefics3: newlines after each row of tiles, for its :func:`image_grid`); texts
    next to each other are joined and tokenized by the HF tokenizer, as the processor's string is
    split at its special tokens. Equal to :func:`hf_inputs`' ``input_ids`` (the fixture tests check it).

    Parameters
    ----------
    fixture : VisionFixture
    parts : sequence of str or numpy.ndarray
        Texts and uint8 ``(height, width, 3)`` images, in order.
    bos : bool
        Put ``bos_token_id`` first (the HF tokenizers do).
    split : bool
        idefics3: images are cut into tiles.

    Returns
    -------
    list of int
    """
    pieces: list = [[fixture.bos_token_id]] if bos else []
    for part in parts:
        if isinstance(part, str):
            pieces.append(part)
        else:
            pieces += _image_pieces(fixture, *image_grid(fixture, part, split))
    return _encode_pieces(fixture, pieces)


def prompt_text(fixture: VisionFixture, parts: Sequence[Part]) -> str:
    """The text handed to the HF processor for ``parts``: the texts, ``image_placeholder`` for each image."""
    return "".join(p if isinstance(p, str) else fixture.image_placeholder for p in parts)


def expanded_text(fixture: VisionFixture, parts: Sequence[Part], split: bool = True) -> str:
    """The text that the HF processor tokenizes for ``parts``: each image replaced by its special tokens
    (the processor's own replacement strings). Tokenized with special tokens parsed, it gives
    :func:`prompt_ids` (less the BOS)."""
    out = []
    for p in parts:
        if isinstance(p, str):
            out.append(p)
        elif fixture.family == GEMMA3:
            out.append(fixture.processor.full_image_sequence)
        else:
            rows, cols = image_grid(fixture, p, split)
            out.append(fixture.processor.replace_image_token({"rows": [[rows]], "cols": [[cols]]}, 0))
    return "".join(out)


def hf_inputs(fixture: VisionFixture, parts: Sequence[Part], split: bool = True) -> dict:
    """What the real HF processor makes of a prompt of texts and images.

    Parameters
    ----------
    fixture : VisionFixture
    parts : sequence of str or numpy.ndarray
        Texts and uint8 ``(height, width, 3)`` images, in order.
    split : bool
        idefics3: images are cut into tiles.

    Returns
    -------
    dict
        ``input_ids`` (int64, 1-D, BOS first), ``pixel_values`` (float32 ``(n, 3, 64, 64)`` as
        :func:`pixel_values`, or None without images), and for gemma3 ``token_type_ids`` (int64, 1 on
        the image tokens).
    """
    images = [p for p in parts if not isinstance(p, str)]
    kw: dict = {"images": [images]} if images else {}
    if images and fixture.family == IDEFICS3:
        kw["do_image_splitting"] = split
    out = fixture.processor(text=[prompt_text(fixture, parts)], return_tensors="np", **kw)
    res = {"input_ids": np.asarray(out["input_ids"][0], np.int64),
           "pixel_values": np.ascontiguousarray(out["pixel_values"], np.float32) if images else None}
    if res["pixel_values"] is not None and fixture.family == IDEFICS3:
        res["pixel_values"] = res["pixel_values"][0]           # one prompt: (n_tiles, 3, H, W)
    if fixture.family == GEMMA3:
        # the processor gives none for a text alone
        res["token_type_ids"] = (np.asarray(out["token_type_ids"][0], np.int64) if "token_type_ids" in out
                                 else token_type_ids(fixture, res["input_ids"]))
    return res


# ------------------------------------------------------------------ transformers references


def _torch_pixels(fixture: VisionFixture, pixel_values: np.ndarray):
    """The model's ``pixel_values`` (and idefics3's ``pixel_attention_mask``) from ``(n, 3, H, W)``."""
    import torch

    pv = torch.from_numpy(np.ascontiguousarray(pixel_values, np.float32))
    if pv.ndim != 4:
        raise ValueError(f"pixel_values must be (n, 3, H, W), not {tuple(pv.shape)}")
    if fixture.family == GEMMA3:
        return {"pixel_values": pv}
    # one prompt holding every tile; no tile is padding, so the mask is all ones
    mask = torch.ones((1, pv.shape[0], *pv.shape[2:]), dtype=torch.bool)
    return {"pixel_values": pv[None], "pixel_attention_mask": mask}


def _vision_outputs(fixture: VisionFixture, pixel_values: np.ndarray):
    import torch

    with torch.no_grad():
        return fixture.hf.get_image_features(**_torch_pixels(fixture, pixel_values), return_dict=True)


def image_features(fixture: VisionFixture, pixel_values: np.ndarray) -> np.ndarray:
    """The projected image embeddings that replace the image tokens (HF ``get_image_features``).

    Parameters
    ----------
    fixture : VisionFixture
    pixel_values : numpy.ndarray
        ``(n, 3, 64, 64)`` as :func:`pixel_values` gives them (images, or idefics3 tiles).

    Returns
    -------
    numpy.ndarray
        float32 ``(n, tokens_per_image, n_embd_text)``.
    """
    feats = _vision_outputs(fixture, pixel_values).pooler_output
    if fixture.family == IDEFICS3:
        feats = feats[0]    # a list, one per prompt: (n_tiles * tokens, n_embd)
    n = len(pixel_values)
    return feats.reshape(n, fixture.tokens_per_image, fixture.n_embd_text).float().numpy()


def vision_hidden(fixture: VisionFixture, pixel_values: np.ndarray) -> np.ndarray:
    """The vision tower's last hidden state (after its post-layernorm), before the projector.

    Returns
    -------
    numpy.ndarray
        float32 ``(n, n_patches, n_embd_vision)``, ``n_patches = (64 / 8) ** 2 = 64`` in row-major patch order.
    """
    return _vision_outputs(fixture, pixel_values).last_hidden_state.float().numpy()


def project(fixture: VisionFixture, hidden: np.ndarray) -> np.ndarray:
    """The projector re-done in numpy from :func:`vision_hidden` (what the mmproj tensors compute).

    gemma3: the 8x8 patch grid average-pooled 2x2 (to 4x4, row-major), RMS-normed with weight
    ``1 + w`` (``mm.soft_emb_norm.weight`` holds ``1 + w``), times ``mm_input_projection_weight``
    (``(n_embd_vision, n_embd_text)``; ``mm.input_projection.weight``, ne ``(n_embd_vision, n_embd_text)``).
    idefics3: pixel shuffle (each 2x2 block of patches concatenated along the width:
    ``[(2i, 2j), (2i, 2j+1), (2i+1, 2j), (2i+1, 2j+1)]``), then ``mm.model.fc.weight``.

    Parameters
    ----------
    fixture : VisionFixture
    hidden : numpy.ndarray
        ``(n, n_patches, n_embd_vision)``.

    Returns
    -------
    numpy.ndarray
        float32 ``(n, tokens_per_image, n_embd_text)``.
    """
    h = np.asarray(hidden, np.float64)
    n, n_patches, width = h.shape
    side = int(round(n_patches ** 0.5))
    grid = h.reshape(n, side, side, width)
    if fixture.family == GEMMA3:
        proj = fixture.hf.model.multi_modal_projector
        k = side // int(round(fixture.tokens_per_image ** 0.5))
        pooled = grid.reshape(n, side // k, k, side // k, k, width).mean(axis=(2, 4)).reshape(n, -1, width)
        eps = proj.mm_soft_emb_norm.eps
        norm = 1.0 + proj.mm_soft_emb_norm.weight.detach().double().numpy()
        normed = pooled / np.sqrt((pooled ** 2).mean(-1, keepdims=True) + eps) * norm
        return (normed @ proj.mm_input_projection_weight.detach().double().numpy()).astype(np.float32)
    s = fixture.hf.config.scale_factor
    shuffled = (grid.reshape(n, side // s, s, side // s, s, width)      # (n, i, di, j, dj, w)
                .transpose(0, 1, 3, 2, 4, 5)                            # (n, i, j, di, dj, w)
                .reshape(n, (side // s) ** 2, s * s * width))
    weight = fixture.hf.model.connector.modality_projection.proj.weight.detach().double().numpy()
    return (shuffled @ weight.T).astype(np.float32)


def token_type_ids(fixture: VisionFixture, input_ids: Sequence[int]) -> np.ndarray:
    """gemma3's ``token_type_ids`` for ``input_ids``: 1 on the image tokens, else 0 (as Gemma3Processor)."""
    return (np.asarray(input_ids) == fixture.image_token_id).astype(np.int64)


def input_embeddings(fixture: VisionFixture, input_ids: Sequence[int], pixel_values: np.ndarray | None = None,
                     features: np.ndarray | None = None) -> np.ndarray:
    """The embeddings the HF text model receives: the token embeddings (gemma3's scaled by
    ``sqrt(n_embd_text)``), with the image features, unscaled, in place of the image tokens, in order.

    Parameters
    ----------
    fixture : VisionFixture
    input_ids : sequence of int
        The prompt.
    pixel_values : numpy.ndarray or None
        The prompt's images (as for :func:`logits`); their :func:`image_features` are put in.
    features : numpy.ndarray or None
        Or the features themselves, ``(n, tokens_per_image, n_embd_text)`` (e.g. ggmlpy's).

    Returns
    -------
    numpy.ndarray
        float32 ``(len(input_ids), n_embd_text)``.
    """
    import torch

    ids = np.asarray(input_ids, np.int64)
    with torch.no_grad():
        emb = fixture.hf.get_input_embeddings()(torch.from_numpy(ids)).float().numpy().copy()
    if features is None and pixel_values is not None:
        features = image_features(fixture, pixel_values)
    where = ids == fixture.image_token_id
    if features is not None:
        flat = np.asarray(features, np.float32).reshape(-1, fixture.n_embd_text)
        if len(flat) != where.sum():
            raise ValueError(f"{where.sum()} image tokens but {len(flat)} feature rows")
        emb[where] = flat
    elif where.any():
        raise ValueError("the prompt has image tokens: give pixel_values or features")
    return emb


def logits(fixture: VisionFixture, input_ids: Sequence[int], pixel_values: np.ndarray | None = None,
           bidirectional: bool = True, embeddings: np.ndarray | None = None) -> np.ndarray:
    """Every position's logits of one prompt, from the HF model.

    Parameters
    ----------
    fixture : VisionFixture
    input_ids : sequence of int
        The prompt, image tokens included (:func:`prompt_ids`).
    pixel_values : numpy.ndarray or None
        ``(n, 3, 64, 64)`` of the prompt's images (idefics3: their tiles), in prompt order; their
        features replace the ``image_token_id`` tokens in order. None: a prompt without images, or
        ``embeddings`` given.
    bidirectional : bool
        gemma3: pass ``token_type_ids`` (:func:`token_type_ids`), so that the tokens of one image attend
        to each other both ways, as with Gemma3Processor's inputs; False: causal everywhere. idefics3 is
        always causal.
    embeddings : numpy.ndarray or None
        Run the text model on these ``(len(input_ids), n_embd_text)`` embeddings (:func:`input_embeddings`)
        instead of embedding ``input_ids`` (which still give gemma3's ``token_type_ids``).

    Returns
    -------
    numpy.ndarray
        float32 ``(len(input_ids), n_vocab)``.
    """
    import torch

    kw = _torch_pixels(fixture, pixel_values) if pixel_values is not None else {}
    if embeddings is not None:
        kw["inputs_embeds"] = torch.from_numpy(np.asarray(embeddings, np.float32))[None]
    else:
        kw["input_ids"] = torch.tensor([list(input_ids)], dtype=torch.long)
    if fixture.family == GEMMA3 and bidirectional:
        kw["token_type_ids"] = torch.from_numpy(token_type_ids(fixture, input_ids))[None]
    with torch.no_grad():
        return fixture.hf(use_cache=False, **kw).logits[0].float().numpy()


def mmproj_reference_tensors(fixture: VisionFixture) -> dict:
    """What each tensor of the mmproj GGUF holds, from the HF weights, as ``GGUFReader.tensor_data``
    gives it (numpy shape = the GGUF's ``ne`` reversed; HF's shapes, except as noted).

    ``v.*``: the vision tower (``v.patch_embd.weight`` the conv kernel ``(width, 3, patch, patch)``,
    ``v.position_embd.weight`` ``(n_patches, width)``, per layer ``ln1``/``ln2`` (LayerNorms), ``attn_q``/
    ``attn_k``/``attn_v``/``attn_out`` and ``ffn_up``/``ffn_down`` with biases, ``v.post_ln``). gemma3:
    ``mm.soft_emb_norm.weight`` is ``1 + w`` of HF's RMSNorm; ``mm.input_projection.weight`` is HF's
    ``(n_embd_vision, n_embd_text)`` matrix as it is (ne ``(n_embd_text, n_embd_vision)``: transpose it
    before ``mul_mat``), F16 in the file. idefics3: ``mm.model.fc.weight`` the connector's linear
    ``(n_embd_text, 4 * n_embd_vision)``.

    Returns
    -------
    dict
        GGUF tensor name to float32 array.
    """
    params = {n: p.detach().float().numpy() for n, p in fixture.hf.named_parameters()}
    tower = "model.vision_tower." if fixture.family == GEMMA3 else "model.vision_model."
    per_layer = {"layer_norm1": "ln1", "layer_norm2": "ln2", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                 "self_attn.v_proj": "attn_v", "self_attn.out_proj": "attn_out", "mlp.fc1": "ffn_up",
                 "mlp.fc2": "ffn_down"}
    out = {"v.patch_embd.weight": params[tower + "embeddings.patch_embedding.weight"],
           "v.patch_embd.bias": params[tower + "embeddings.patch_embedding.bias"],
           "v.position_embd.weight": params[tower + "embeddings.position_embedding.weight"],
           "v.post_ln.weight": params[tower + "post_layernorm.weight"],
           "v.post_ln.bias": params[tower + "post_layernorm.bias"]}
    for i in range(N_LAYER_VISION):
        for hf_name, name in per_layer.items():
            for kind in ("weight", "bias"):
                out[f"v.blk.{i}.{name}.{kind}"] = params[f"{tower}encoder.layers.{i}.{hf_name}.{kind}"]
    if fixture.family == GEMMA3:
        out["mm.soft_emb_norm.weight"] = params["model.multi_modal_projector.mm_soft_emb_norm.weight"] + 1.0
        out["mm.input_projection.weight"] = params["model.multi_modal_projector.mm_input_projection_weight"]
    else:
        out["mm.model.fc.weight"] = params["model.connector.modality_projection.proj.weight"]
    return out
