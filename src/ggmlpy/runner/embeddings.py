"""Embeddings and reranking: the runner's calls for them, and how an input's output rows become its embedding.

:class:`EmbeddingCalls` is a base class of :class:`~ggmlpy.runner.Runner` (as the request loop is): ``embed``,
``submit_embeddings``, ``rerank_prompt`` and ``rerank``, over the loop's embedding requests (queued together, so
the loop packs as many inputs into one batch as fit, each a sequence of its own). :func:`pool` and
:func:`normalized` turn the rows an input's pooling asked for into its embedding, as llama.cpp does
(``build_pooling``, ``common_embd_normalize``); :func:`embedding_norm` reads ``normalize`` as llama.cpp's
``embd_normalize``. See ``docs/embeddings.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import numpy as np

from ggmlpy._core import GGMLValueError
from ggmlpy.models.config import POOLING

from .requests import Handle

__all__ = ["EmbeddingCalls", "embedding_norm", "normalized", "pool"]


class EmbeddingCalls:
    """The embedding and reranking calls of a runner. It uses of the runner: ``model``, ``tokenizer``,
    ``inputs``, ``n_ctx``, ``n_ubatch``, and the loop's ``_queue``, ``_enqueue``, ``_text_options``,
    ``_check_open``, ``submit``."""

    def embedding_pooling(self, pooling: Optional[str], what: str) -> str:
        """The pooling of an embedding request: ``pooling`` checked, or (None) the model file's
        ``pooling_type``, else ``"mean"``; ``"rank"`` only for a model with a classification head."""
        if pooling is None:
            pooling = getattr(self.model, "pooling", None) or "mean"
        if pooling not in POOLING:
            raise GGMLValueError(f"{what}: pooling must be one of {', '.join(POOLING)} (got {pooling!r})")
        if pooling == "rank" and not getattr(self.model, "n_cls_out", 0):
            raise GGMLValueError(f"{what}: this {self.model.config.arch} model has no classification head "
                                 "(cls.output): it is not a reranker, and cannot pool by rank")
        return pooling

    @property
    def max_embedding_tokens(self) -> int:
        """The longest embedding input: ``n_ctx``, and for a non-causal model (an encoder reads an input in
        one micro-batch) at most ``n_ubatch``."""
        return self.n_ctx if getattr(self.model, "causal", True) else min(self.n_ctx, self.n_ubatch)

    def embed(self, inputs, pooling: Optional[str] = None, normalize: bool | int = True,
              truncate: bool = False) -> np.ndarray | list:
        """Embeddings of one input or of several, computed together.

        Each input is read whole, as one sequence: as many as fit go into one batch, side by side (an
        encoder's each see only their own tokens), as llama.cpp's embedding path does; up to ``n_seq_max``
        at once.

        Parameters
        ----------
        inputs : str, token ids, or a list of them
            A str is encoded as :meth:`submit` does (with the vocabulary's BOS/EOS or BERT's [CLS]/[SEP]).
        pooling : str, optional
            How a sequence's last hidden states become its embedding: ``"mean"`` (their mean), ``"cls"``
            (the first token's), ``"last"`` (the last token's), ``"none"`` (every token's, one row each) or
            ``"rank"`` (a reranker's classification scores, ``float32[n_cls_out]``, not normalised; see
            :meth:`rerank`). Default: the model file's ``pooling_type``, else ``"mean"``.
        normalize : bool or int
            llama.cpp's ``embd_normalize``: True (2, Euclidean; default), False (-1, none), 0 (scaled to the
            int16 range by the largest absolute value), 1 (taxicab), p > 2 (p-norm).
        truncate : bool
            Cut an input longer than :attr:`max_embedding_tokens` to its first tokens (else
            :class:`InputTooLong`).

        Returns
        -------
        numpy.ndarray
            For one input: ``float32[n_embd]`` (``[n_tokens, n_embd]`` for ``"none"``, ``[n_cls_out]`` for
            ``"rank"``). For a list: those stacked, ``float32[n_inputs, ...]`` (a list of arrays for
            ``"none"``, whose lengths differ).

        Raises
        ------
        GGMLValueError
            An unknown pooling, ``"rank"`` for a model without a classification head, a bad ``normalize``.
        InputTooLong
            An input longer than :attr:`max_embedding_tokens` without ``truncate``.
        """
        one = isinstance(inputs, str) or (len(inputs) > 0 and isinstance(inputs[0], (int, np.integer))) \
            or (isinstance(inputs, np.ndarray) and inputs.ndim == 1)
        items = [inputs] if one else list(inputs)
        if not items:
            raise GGMLValueError("embed: no inputs")
        pooling = self.embedding_pooling(pooling, "embed")
        handles = self.submit_embeddings(items, pooling=pooling, normalize=normalize, truncate=truncate,
                                         what="embed")
        try:
            vectors = [h.result().embedding for h in handles]
        except BaseException:
            for h in handles:
                h.cancel()
            raise
        if one:
            return vectors[0]
        return vectors if pooling == "none" else np.stack(vectors)

    def submit_embeddings(self, inputs: Sequence, *, pooling: Optional[str] = None, normalize: bool | int = True,
                          truncate: bool = False, what: str = "submit_embeddings") -> list[Handle]:
        """Queue one embedding request per input, all at once (thread-safe), and return their handles in
        order: the loop sees them together, so as many as fit are computed in one batch (see :meth:`embed`,
        whose parameters these are; ``Completion.embedding`` holds each result). Every input is checked
        before any is queued: a bad one raises and queues nothing."""
        self._check_open(what)
        if isinstance(inputs, str):
            raise GGMLValueError(f"{what}: inputs must be a list of str or of token-id lists, got one str")
        items = list(inputs)
        if not items:
            raise GGMLValueError(f"{what}: no inputs")
        pooling = self.embedding_pooling(pooling, what)
        text = self._text_options((), None, True, False)
        held: list = []
        handles = [self._queue(self.inputs.prompt(x, what), text, truncate=truncate, embedding=True, pooling=pooling,
                               normalize=normalize, hold=held) for x in items]
        self._enqueue(*held)
        return handles

    def rerank_prompt(self, query: str, document: str) -> list[int]:
        """The token ids :meth:`rerank` scores for one document, as llama-server forms them
        (``format_prompt_rerank``): the file's ``rerank`` chat template with ``{query}`` and ``{document}``
        put in, where it has one; else BOS (if the vocabulary adds it), the query, EOS (if it adds EOS; SEP
        where it has no EOS), SEP (if it adds SEP), the document, EOS: ``[CLS] query [SEP] document [SEP]``
        for a BERT vocabulary, ``<s> query </s></s> document </s>`` for XLM-RoBERTa's."""
        tok = self.tokenizer
        template = tok.chat_templates.get("rerank")
        if template:
            return tok.encode(template.replace("{query}", query).replace("{document}", document),
                              add_special=False, parse_special=True)
        eos = tok.eos if tok.eos is not None else tok.sep
        ids = [tok.bos] if tok.add_bos and tok.bos is not None else []
        ids += tok.encode(query, add_special=False, parse_special=False)
        if tok.add_eos and eos is not None:
            ids.append(eos)
        if tok.add_sep and tok.sep is not None:
            ids.append(tok.sep)
        ids += tok.encode(document, add_special=False, parse_special=False)
        if tok.add_eos and eos is not None:
            ids.append(eos)
        return ids

    def rerank(self, query: str, documents: Sequence[str], truncate: bool = False) -> np.ndarray:
        """How relevant each document is to ``query``: a reranker's score of each pair, in ``documents``' order.

        Each pair is one input (:meth:`rerank_prompt`) through the model's classification head (pooling
        ``rank``: the first token's last hidden state, the dense + tanh layer where the file has one, then
        ``cls.output``); its first output is the score, raw (a logit, not normalised), as llama-server's
        ``/v1/rerank`` returns it. The pairs are computed together, as :meth:`embed` does.

        Returns
        -------
        numpy.ndarray
            ``float32[len(documents)]``.

        Raises
        ------
        GGMLValueError
            A model without a classification head (a decoder, or an embedding model: not a reranker), no
            documents, or a query or document that is not a str.
        InputTooLong
            A pair longer than :attr:`max_embedding_tokens` without ``truncate``.
        """
        self._check_open("rerank")
        if not getattr(self.model, "n_cls_out", 0):
            raise GGMLValueError(f"rerank: this {self.model.config.arch} model has no classification head "
                                 "(cls.output): it is not a reranker")
        if not isinstance(query, str):
            raise GGMLValueError(f"rerank: query must be a str, got {type(query).__name__}")
        if isinstance(documents, str):
            raise GGMLValueError("rerank: documents must be a list of str, got one str")
        docs = list(documents)
        if not docs:
            raise GGMLValueError("rerank: no documents")
        for i, d in enumerate(docs):
            if not isinstance(d, str):
                raise GGMLValueError(f"rerank: documents[{i}] must be a str, got {type(d).__name__}")
        prompts = [self.rerank_prompt(query, d) for d in docs]
        scores = self.embed(prompts, pooling="rank", normalize=False, truncate=truncate)
        return np.ascontiguousarray(scores[:, 0], dtype=np.float32)


def embedding_norm(normalize, what: str) -> int:
    """``normalize`` as llama.cpp's ``embd_normalize``: True -> 2 (Euclidean), False -> -1 (none), or an
    int: 0 (max-abs, to the int16 range), 1 (taxicab), p > 2 (p-norm)."""
    if isinstance(normalize, (bool, np.bool_)):
        return 2 if normalize else -1
    if not isinstance(normalize, (int, np.integer)) or normalize < -1:
        raise GGMLValueError(f"{what}: normalize must be a bool or an int >= -1 (llama.cpp's embd_normalize: -1 "
                             f"none, 0 max-abs, 1 taxicab, 2 Euclidean, p > 2 p-norm), got {normalize!r}")
    return int(normalize)


def normalized(v: np.ndarray, norm: int) -> np.ndarray:
    """``v`` (float32, one vector per row of the last axis) normalised as llama.cpp's ``common_embd_normalize``
    with ``embd_norm = norm`` (sums in float64, as there)."""
    x = v.astype(np.float64)
    if norm == -1:
        return v
    a = np.abs(x)
    if norm == 0:
        s = a.max(axis=-1, keepdims=True) / 32760.0          # to the int16 range
    elif norm == 2:
        s = np.sqrt((x * x).sum(axis=-1, keepdims=True))
    else:
        s = (a ** norm).sum(axis=-1, keepdims=True) ** (1.0 / norm)
    scale = np.where(s > 0, 1.0 / np.where(s > 0, s, 1.0), 0.0).astype(np.float32)
    return v * scale


def pool(hidden: np.ndarray, pooling: str, norm: int) -> np.ndarray:
    """An embedding from the output rows of one input (``hidden``: float32 ``(rows, dim)``, the rows its
    pooling asked for): ``mean`` of them, the one row of ``cls``/``last``, every row for ``none`` (each
    normalised); ``rank``'s row is the classification scores, not normalised (as llama.cpp's)."""
    if pooling == "rank":
        return hidden[0].astype(np.float32)
    if pooling == "none":
        return normalized(hidden.astype(np.float32), norm)
    v = hidden.mean(axis=0, dtype=np.float64).astype(np.float32) if pooling == "mean" else hidden[0]
    return normalized(v.astype(np.float32), norm)
