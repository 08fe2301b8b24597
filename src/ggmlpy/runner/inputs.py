"""A request's input, prepared once: text, chat messages and images -> a :class:`Prompt`.

:class:`Inputs` turns what a caller gives (a str, token ids, chat messages, images) into the ids the
runner queues, with every check made here and only here: token ids within the vocabulary, images
preprocessed and their pixels checked, each image's place filled with its rows (:mod:`.images`), the
same-batch groups that keep an image whole. The text rules it applies (BOS, special tokens, chat
templates) are :mod:`.text`'s.

An image row is a token id below ``-1`` unique to (image, row) (see :mod:`.images`), so a prompt stays
one list of ints from here to the micro-batch that computes it.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ggmlpy._core import GGMLError, GGMLTypeError, GGMLValueError

from .images import MEDIA_MARKER, ImageStore
from .slots import group_sizes
from .text import chat_prompt, chat_text, encode_chat, encode_prompt

__all__ = ["Inputs", "Prompt", "chat_images", "place_images"]


@dataclass
class Prompt:
    """A prepared prompt: its ids (an image row as its :class:`~.images.ImageStore` id) and, when it has
    groups, per id how many following ids must share its micro-batch (Ollama's ``SameBatch``)."""

    ids: list[int]
    same_batch: Optional[list[int]] = None


class Inputs:
    """The input side of one runner: its tokenizer, its vision encoder's image store, the checks.

    Parameters
    ----------
    model
        The text model (``n_vocab``; ``tokenizer`` or ``path`` when no tokenizer is given).
    n_ubatch : int
        The largest same-batch group a prompt may hold.
    tokenizer, vision, image_token, image_cache
        As :class:`~ggmlpy.runner.Runner` takes them (the vision encoder already checked against the model).
    """

    def __init__(self, model, n_ubatch: int, tokenizer=None, vision=None, image_token: Optional[int] = None,
                 image_cache: int = 32) -> None:
        self.model = model
        self.n_vocab = int(model.n_vocab)
        self.n_ubatch = int(n_ubatch)
        self.vision = vision
        self.images: Optional[ImageStore] = None
        if vision is not None:
            self.images = ImageStore(vision.config.tokens_per_image, keep=image_cache)
        self._tokenizer = tokenizer
        self._tokenizer_lock = threading.Lock()     # the first text request reads it from the file once
        self._image_token = image_token

    # ------------------------------------------------------------------ the tokenizer

    @property
    def tokenizer(self):
        """The tokenizer given, else the model's (read from its GGUF file on first use, then kept)."""
        tok = self._tokenizer
        if tok is not None:
            return tok
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = self._model_tokenizer()
            return self._tokenizer

    def _model_tokenizer(self):
        try:
            return self.model.tokenizer
        except AttributeError:
            pass
        # a model class without the property: read the vocabulary from its file
        path = getattr(self.model, "path", None)
        if path is None:
            raise GGMLValueError("runner: the model has no tokenizer and no file to read one from; pass "
                                 "Runner(..., tokenizer=Tokenizer.from_gguf(path)) or token ids")
        from ggmlpy.tokenizer import Tokenizer

        return Tokenizer.from_gguf(path)

    @property
    def image_token(self) -> int:
        """The token id that marks an image tile's place in a token-id prompt."""
        if self._image_token is None:
            text = self.vision.image_token_text if self.vision is not None else None
            tid = self.tokenizer.token_id(text) if text else None
            if tid is None:
                raise GGMLValueError(f"runner: the vocabulary has no image token {text!r}; pass Runner(..., "
                                     f"image_token=ID)")
            self._image_token = int(tid)
        return self._image_token

    # ------------------------------------------------------------------ token ids

    def check_tokens(self, tokens, what: str) -> np.ndarray:
        """Token ids as an int32 array, each checked to be an id of the vocabulary."""
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise GGMLValueError(f"{what}: tokens must be a 1-D sequence (got shape {arr.shape})")
        if arr.size and arr.dtype.kind not in "iu":
            raise GGMLValueError(f"{what}: token ids must be integers (got {arr.dtype})")
        wide = arr.astype(np.int64)
        bad = (wide < 0) | (wide >= self.n_vocab)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise GGMLValueError(f"{what}: token id {int(wide[i])} at index {i} is outside the vocabulary "
                                 f"[0, {self.n_vocab})")
        return wide.astype(np.int32)

    def ids(self, tokens, what: str) -> list[int]:
        """Token ids as a list of ints, each checked to be an id of the vocabulary (a list of ints is
        checked as it is, without a round trip through an array)."""
        if type(tokens) in (list, tuple) and all(type(t) is int for t in tokens) \
                and (not tokens or (min(tokens) >= 0 and max(tokens) < self.n_vocab)):
            return list(tokens)
        return self.check_tokens(tokens, what).tolist()

    def one_token(self, tokens) -> Optional[int]:
        """The id of a batch of one valid token id (a list, tuple or 1-D array), else None: the
        generation step's check, without an array."""
        if isinstance(tokens, np.ndarray):
            if tokens.shape != (1,):
                return None
        elif type(tokens) not in (list, tuple) or len(tokens) != 1:
            return None
        t = tokens[0]
        if type(t) is not int and not isinstance(t, np.integer):
            return None                     # bools, floats...: the general path says what is wrong
        t = int(t)
        return t if 0 <= t < self.n_vocab else None

    # ------------------------------------------------------------------ prompts

    def prompt(self, prompt, what: str, *, images: Sequence = (), same_batch: Optional[Sequence[int]] = None,
               parse_special: bool = True) -> Prompt:
        """A str or token-id prompt, with its images (see :meth:`Runner.submit`), as a :class:`Prompt`."""
        if images is not None and len(images):
            if same_batch is not None:
                raise GGMLValueError(f"{what}: same_batch and images together; the images set the groups")
            ids, pixels = self._expand(prompt, images, what, parse_special)
            return self._place(ids, pixels, what)
        if isinstance(prompt, str):
            prompt = encode_prompt(self.tokenizer, prompt, parse_special=parse_special)
        ids = self.ids(prompt, what)
        if same_batch is None:
            return Prompt(ids)
        sb = [int(x) for x in same_batch]
        try:
            longest = max(group_sizes(sb, len(ids)), default=0)
        except GGMLError as e:
            raise GGMLValueError(f"{what}: {e}") from None
        if longest > self.n_ubatch:
            raise GGMLValueError(f"{what}: a same_batch group of {longest} inputs exceeds n_ubatch {self.n_ubatch}")
        return Prompt(ids, sb)

    def chat(self, messages: Sequence[dict], what: str, template_kw: dict, allow_local_files: bool = False,
             images: Sequence = (), same_batch: Optional[Sequence[int]] = None) -> Prompt:
        """A chat's prompt, its image parts in place; ``images`` are a token-id prompt's (a chat whose
        messages have none)."""
        ids, pixels = self._chat(messages, what, template_kw, allow_local_files)
        if not pixels:
            return self.prompt(ids, what, images=images, same_batch=same_batch)
        if images is not None and len(images):
            raise GGMLValueError(f"{what}: images both in the messages and in images=; give them as image parts "
                                 "of the messages")
        if same_batch is not None:
            raise GGMLValueError(f"{what}: same_batch and images together; the images set the groups")
        return self._place(ids, pixels, what)

    def chat_ids(self, messages: Sequence[dict], what: str, template_kw: dict,
                 allow_local_files: bool = False) -> list[int]:
        """A chat's prompt ids, each image's tokens as the model's processor writes them."""
        return self._chat(messages, what, template_kw, allow_local_files)[0]

    def pixels(self, image, what: str) -> np.ndarray:
        """One image's checked tiles, float32 ``(tiles, 3, S, S)``."""
        return self._expand([], [image], what, True)[1][0]

    # ------------------------------------------------------------------ images

    def _need_vision(self, what: str) -> None:
        if self.vision is None:
            raise GGMLValueError(f"{what}: images given, but this runner has no vision encoder (load the model "
                                 f"with load_model(path, mmproj=...) or pass Runner(..., vision=...))")

    def _chat(self, messages, what: str, kw: dict, allow_local_files: bool) -> tuple[list[int], list]:
        """A chat's ids (image tokens in place, checked when there are images) and its images' pixels."""
        msgs, images = chat_images(messages, what, allow_local_files)
        if not images:
            return chat_prompt(self.tokenizer, msgs, **kw), []
        text = chat_text(self.tokenizer, msgs, **kw)
        self._need_vision(what)
        ph = self.vision.image_placeholder
        n = text.count(ph)
        if n != len(images):
            raise GGMLValueError(f"{what}: {len(images)} image part(s), but the chat template wrote {n} {ph!r} "
                                 f"(a template that does not render image parts, or {ph!r} in a message's text)")
        return self._expand(text, images, what, True, marker=ph, encode=lambda t: encode_chat(self.tokenizer, t),
                            allow_local_files=allow_local_files)

    def _expand(self, prompt, images, what: str, parse_special: bool, marker: str = MEDIA_MARKER,
                encode=None, allow_local_files: bool = True) -> tuple[list[int], list[np.ndarray]]:
        """A prompt's ids with each image's tokens in place (as the processor's ``input_ids``), checked, and
        the images' checked pixels (float32 ``(tiles, 3, S, S)`` each). A str prompt has one ``marker`` per
        image; ``encode`` tokenizes the expanded text (default: :func:`~.text.encode_prompt`). Paths are
        read only with ``allow_local_files`` (the caller's own ``images=``; not a chat's)."""
        self._need_vision(what)
        if isinstance(images, (str, bytes)) or not isinstance(images, Sequence):
            raise GGMLTypeError(f"{what}: images must be a list (got {type(images).__name__})")
        prepared = []
        for k, im in enumerate(images):
            try:
                prepared.append(self.vision.prepare(im, what, allow_local_files))
            except (GGMLValueError, GGMLTypeError) as e:
                e.image_index = k            # which image, for a caller that names it (the server's field)
                raise
        pixels = [px for px, _ in prepared]
        if isinstance(prompt, str):
            n_mark = prompt.count(marker)
            if n_mark != len(prepared):
                raise GGMLValueError(f"{what}: {len(prepared)} image(s) but the prompt has {n_mark} {marker} "
                                     f"marker(s)")
            parts = prompt.split(marker)
            # a plain prompt's marker stands for the whole image (Qwen-VL: with its vision start and end);
            # a chat template's placeholder is only what the processor expands
            a, b = self.vision.marker_wrap if marker == MEDIA_MARKER else ("", "")
            text = parts[0] + "".join(a + t + b + rest for (_, t), rest in zip(prepared, parts[1:]))
            prompt = encode_prompt(self.tokenizer, text, parse_special=parse_special) if encode is None \
                else encode(text)
        return self.ids(prompt, what), pixels

    def _place(self, ids: list[int], pixels: list[np.ndarray], what: str) -> Prompt:
        """Checked ids and pixels -> a Prompt: each image in the store, its rows where its tokens were."""
        runs = [self.vision.runs(px) for px in pixels]
        rows = [self.images.add(px, sum(r)) for px, r in zip(pixels, runs)]
        return Prompt(*place_images(ids, rows, self.image_token, runs, what, tie=self.vision.tie_images))


def place_images(tokens: Sequence[int], images: Sequence[list[int]], image_token: int,
                 runs: int | Sequence[Sequence[int]], what: str = "submit",
                 tie: bool = True) -> tuple[list[int], list[int]]:
    """Put the images' rows where the prompt has its runs of ``image_token``; also the same-batch markers.

    ``images`` holds each image's row ids (:meth:`~.images.ImageStore.add`). Each run of the image token
    id is one chunk of rows, taken in order from the images: ``runs`` gives each image's chunk lengths
    (:meth:`~ggmlpy.vision.VisionModel.runs`), or one length for every chunk (a tile's rows). Each chunk is a
    same-batch group (kept in one micro-batch) with ``tie``. Returns ``(tokens, same_batch)``.

    Raises
    ------
    GGMLValueError
        A run of another length, or fewer or more runs than the images have chunks.
    """
    toks = [int(t) for t in tokens]
    if isinstance(runs, int):
        runs = [[runs] * (len(r) // runs) for r in images]
    chunks = []
    for r, lengths in zip(images, runs):
        at = 0
        for n in lengths:
            chunks.append(r[at:at + n])
            at += n
    out, sb = list(toks), [0] * len(toks)
    i, k, n = 0, 0, len(toks)
    while i < n:
        if toks[i] != image_token:
            i += 1
            continue
        j = i
        while j < n and toks[j] == image_token:
            j += 1
        if k >= len(chunks):
            raise GGMLValueError(f"{what}: the prompt has more image placeholders than the {len(images)} image(s) "
                                 f"fill ({len(chunks)} run(s) of image tokens)")
        if j - i != len(chunks[k]):
            raise GGMLValueError(f"{what}: a run of {j - i} image tokens (id {image_token}) at index {i}; the "
                                 f"image's run there takes exactly {len(chunks[k])}")
        out[i:j] = chunks[k]
        sb[i] = len(chunks[k]) - 1 if tie else 0
        k += 1
        i = j
    if k != len(chunks):
        raise GGMLValueError(f"{what}: {len(images)} image(s) ({len(chunks)} run(s) of image tokens) but the prompt "
                             f"has {k} image placeholder run(s) (id {image_token})")
    return out, sb


def chat_images(messages: Sequence, what: str, allow_local_files: bool = False) -> tuple[list, list]:
    """The images of a chat's messages, in order, and the messages with each image part as ``{"type": "image"}``.

    Image parts as transformers' processors take them (``{"type": "image", "image": ...}``, or ``"url"`` /
    ``"path"`` instead of ``"image"``) and as OpenAI's chat API sends them (``{"type": "image_url",
    "image_url": {"url": ...}}``); the value is anything :func:`ggmlpy.vision.preprocess.load_image` reads
    (a ``data:`` URL too). Chat templates written for vision models render ``{"type": "image"}`` as the
    model's image placeholder. Messages without image parts are returned as they are.

    Messages may come from someone other than the caller (a server relays them), so an image part that
    names a local file (a path or a ``file://`` URL) is refused here, before anything is read or looked
    up, unless ``allow_local_files`` (the same error whether the file exists or not); see
    :func:`ggmlpy.vision.preprocess.check_source`.

    Raises
    ------
    GGMLValueError
        An image part without an image.
    ggmlpy.vision.preprocess.ImageError
        An image part naming a local file while ``allow_local_files`` is false.
    """
    out: list = []
    images: list[Any] = []
    for m in messages:
        content = m.get("content") if isinstance(m, Mapping) else None
        if isinstance(content, (str, bytes)) or not isinstance(content, Sequence):
            out.append(m)
            continue
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind == "image":
                src = next((part[k] for k in ("image", "url", "path") if part.get(k) is not None), None)
            elif kind == "image_url":
                src = part.get("image_url")
                if isinstance(src, Mapping):
                    src = src.get("url")
            else:
                parts.append(part)
                continue
            if src is None:
                raise GGMLValueError(f"{what}: an {kind} part without an image (give it 'image', 'url' or 'path'; "
                                     f"OpenAI's form is {{'type': 'image_url', 'image_url': {{'url': ...}}}})")
            if not allow_local_files:
                from ggmlpy.vision.preprocess import check_source

                check_source(src, allow_local_files=False, what=what)
            images.append(src)
            parts.append({"type": "image"})
        out.append({**m, "content": parts})
    return out, images
