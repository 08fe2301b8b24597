"""The prompt text of an image: what the model's Hugging Face processor puts in place of the image's
placeholder token (:func:`image_prompt`; per projector :func:`gemma3_image_prompt`, :func:`idefics3_image_prompt`,
:func:`llama4_image_prompt`, :func:`pixtral_image_prompt`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ggmlpy._core import GGMLTypeError, GGMLValueError

from .image_config import ImageConfig
from .resize import PreprocessedImage

__all__ = ["gemma3_image_prompt", "idefics3_image_prompt", "image_prompt", "llama4_image_prompt",
           "pixtral_image_prompt"]


def gemma3_image_prompt(n_tokens: int = 256, *, boi_token: str = "<start_of_image>",
                        image_token: str = "<image_soft_token>", eoi_token: str = "<end_of_image>") -> str:
    """The text ``Gemma3Processor`` puts in place of each ``<start_of_image>`` in the prompt.

    ``"\\n\\n<start_of_image>" + "<image_soft_token>" * n_tokens + "<end_of_image>\\n\\n"`` (pan-and-scan's
    extra crops are not supported).

    Parameters
    ----------
    n_tokens : int
        The soft tokens per image, ``mm_tokens_per_image`` (:attr:`ImageConfig.tokens_per_tile`).
    boi_token, image_token, eoi_token : str
        The tokenizer's begin-of-image, image placeholder and end-of-image tokens.
    """
    n_tokens = _check_prompt_int("n_tokens", n_tokens, 1)
    return f"\n\n{boi_token}{image_token * n_tokens}{eoi_token}\n\n"


def idefics3_image_prompt(rows: int, cols: int, image_seq_len: int, *,
                          fake_image_token: str = "<fake_token_around_image>", image_token: str = "<image>",
                          global_image_token: str = "<global-img>") -> str:
    """The text ``Idefics3Processor`` puts in place of each ``<image>`` in the prompt.

    For a split image, each grid row is ``<fake_token_around_image><row_R_col_C>`` + ``<image>`` *
    ``image_seq_len`` per tile, then ``"\\n"``; then ``"\\n<fake_token_around_image><global-img>"`` +
    ``<image>`` * ``image_seq_len`` + ``<fake_token_around_image>``. An image that was not split
    (``rows == cols == 0``) is only the global part, without the leading newline.

    Parameters
    ----------
    rows, cols : int
        :attr:`PreprocessedImage.rows` and ``cols``; both 0, or both >= 1.
    image_seq_len : int
        Tokens per tile (:attr:`ImageConfig.tokens_per_tile`).
    fake_image_token, image_token, global_image_token : str
        The tokenizer's spellings of these tokens.

    Raises
    ------
    GGMLValueError
        Negative counts, or one of ``rows``/``cols`` 0 and the other not.
    """
    rows = _check_prompt_int("rows", rows, 0)
    cols = _check_prompt_int("cols", cols, 0)
    image_seq_len = _check_prompt_int("image_seq_len", image_seq_len, 1)
    if (rows == 0) != (cols == 0):
        raise GGMLValueError(f"idefics3_image_prompt: rows={rows}, cols={cols}; expected both 0 (image not split) "
                             "or both >= 1")
    tokens = image_token * image_seq_len
    global_part = f"{fake_image_token}{global_image_token}{tokens}{fake_image_token}"
    if rows == 0:
        return global_part
    grid = "".join(
        "".join(f"{fake_image_token}<row_{r + 1}_col_{c + 1}>{tokens}" for c in range(cols)) + "\n"
        for r in range(rows)
    )
    return f"{grid}\n{global_part}"


def llama4_image_prompt(rows: int, cols: int, n_tokens: int = 144, *, patch_token: str = "<|patch|>") -> str:
    """The text ``Llama4Processor`` puts in place of each ``<|image|>`` in the prompt.

    ``<|image_start|>``; for a canvas of more than one tile, each row's tiles as ``n_tokens`` patch tokens,
    ``<|tile_x_separator|>`` between the tiles of a row and ``<|tile_y_separator|>`` after every row; then
    ``<|image|>`` and the global tile's (or the only tile's) patch tokens; ``<|image_end|>``.

    Parameters
    ----------
    rows, cols : int
        :attr:`PreprocessedImage.rows` and ``cols`` (0 and 0, or 1 and 1, for a single tile).
    n_tokens : int
        Tokens per tile (:attr:`ImageConfig.tokens_per_tile`: 144 for 336 / 14 with the pixel shuffle's 2).
    patch_token : str
        The tokenizer's ``<|patch|>``, where the image's features go.
    """
    rows = _check_prompt_int("rows", rows, 0)
    cols = _check_prompt_int("cols", cols, 0)
    n_tokens = _check_prompt_int("n_tokens", n_tokens, 1)
    tile = patch_token * n_tokens
    grid = ""
    if rows * cols > 1:
        grid = "".join("<|tile_x_separator|>".join([tile] * cols) + "<|tile_y_separator|>" for _ in range(rows))
    return f"<|image_start|>{grid}<|image|>{tile}<|image_end|>"


def pixtral_image_prompt(rows: int, cols: int, *, image_token: str = "[IMG]", break_token: str = "[IMG_BREAK]",
                         end_token: str = "[IMG_END]") -> str:
    """The text ``PixtralProcessor`` puts in place of each ``[IMG]``: ``rows`` rows of ``cols`` image tokens,
    each row followed by ``[IMG_BREAK]`` except the last, followed by ``[IMG_END]``.

    Parameters
    ----------
    rows, cols : int
        The image's grid of output tokens (:attr:`PreprocessedImage.rows` and ``cols``), both >= 1.
    image_token, break_token, end_token : str
        The tokenizer's spellings.
    """
    rows = _check_prompt_int("rows", rows, 1)
    cols = _check_prompt_int("cols", cols, 1)
    row = image_token * cols
    return break_token.join([row] * rows) + end_token


def image_prompt(image: PreprocessedImage, cfg: ImageConfig) -> str:
    """The prompt text for a preprocessed image, as the model's HF processor expands its placeholder.

    The placeholder the text holds before expansion is ``<start_of_image>`` for gemma3, ``<image>`` for
    idefics3, ``<|image|>`` for llama4, ``[IMG]`` for pixtral and ``<|image_pad|>`` for Qwen-VL; the returned
    text replaces it.
    """
    if not isinstance(image, PreprocessedImage):
        raise GGMLTypeError(f"image_prompt: image is {type(image).__name__}; expected a PreprocessedImage")
    if not isinstance(cfg, ImageConfig):
        raise GGMLTypeError(f"image_prompt: cfg is {type(cfg).__name__}; expected an ImageConfig")
    if cfg.projector_type == "gemma3":
        return gemma3_image_prompt(cfg.tokens_per_tile)
    if cfg.projector_type == "llama4":
        return llama4_image_prompt(image.rows, image.cols, cfg.tokens_per_tile)
    if cfg.projector_type == "pixtral":
        return pixtral_image_prompt(image.rows, image.cols)
    if cfg.projector_type in ("qwen2vl_merger", "qwen2.5vl_merger", "qwen3vl_merger"):
        # Qwen2VLProcessor: the placeholder repeated once per token (its template writes the vision start/end)
        return "<|image_pad|>" * (image.rows * image.cols)
    return idefics3_image_prompt(image.rows, image.cols, cfg.tokens_per_tile)


def _check_prompt_int(name: str, v: Any, minimum: int) -> int:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise GGMLTypeError(f"{name} is {v!r} ({type(v).__name__}); expected an integer >= {minimum}")
    if v < minimum:
        raise GGMLValueError(f"{name} is {v}; expected an integer >= {minimum}")
    return int(v)
