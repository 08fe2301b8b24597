"""One micro-batch through the model: plan -> graph -> apply -> fill -> run (llama.cpp's ``process_ubatch``).

:class:`Step` is where a runner's graphs are made and computed: the per-micro-batch step the request
loop and the direct calls share (:meth:`Step.build`, then :meth:`Step.compute`), the worst-case
reservation at start (:meth:`Step.reserve`), the choice of ggmlpy's own kernels for those graphs
(:meth:`Step.choose_kernels`), and the encoding of an image (the vision encoder's own route on the
runner's runtime: for a micro-batch's image rows, and :meth:`Step.encode` for a direct call).

Everything computes through the runtime's one route (:meth:`ggmlpy.backend.Runtime.run`); forward
graphs are taken from and given back to its pool, keyed by their shape.
"""

from __future__ import annotations

import functools
from typing import Optional

import numpy as np

from ggmlpy.models import kernels
from ggmlpy.models.calibrate import kernel_choices
from ggmlpy.models.kernels import KernelChoices

from .batching import _UBatch
from .images import FIRST_IMAGE_ID, ImageStore, chunk_spans
from .mrope import mrope_positions

__all__ = ["Step"]


class Step:
    """The graphs of one runner: build and compute a micro-batch, reserve for the worst one, encode images.

    Parameters
    ----------
    model
        The text model (``build``, ``config``).
    cache
        Its cache, initialised (``start_forward``, ``apply``).
    runtime : ggmlpy.backend.Runtime
        What computes (scheduler, graph pool).
    flash_attn : bool
        The attention path of the graphs.
    vision : ggmlpy.vision.VisionModel, optional
        The image encoder; with it ``images`` is the store whose rows micro-batches take.
    images : ImageStore, optional
    history : callable, optional
        ``history(seq)``: the token record of a cache sequence (the slot table's), from which a multi-section
        RoPE model's positions follow (:mod:`.mrope`).
    """

    def __init__(self, model, cache, runtime, *, flash_attn: bool, vision=None,
                 images: Optional[ImageStore] = None, history=None) -> None:
        self.model, self.cache, self.rt = model, cache, runtime
        self.flash_attn = bool(flash_attn)
        self.vision, self.images = vision, images
        self.history = history
        self._mrope = getattr(model, "POS_PER_TOKEN", 1) == 4
        #: The own kernels' choices the graphs are built under (:mod:`ggmlpy.models.kernels`).
        self.kernels = KernelChoices("own")

    @property
    def graphs_built(self) -> int:
        """Forward graphs built so far (not taken from the runtime's pool)."""
        return self.rt.graphs.built

    # ------------------------------------------------------------------ one micro-batch

    def build(self, ub: _UBatch, embedding: bool) -> None:
        """Plan the cache for a micro-batch, take its graph (built, or reused from the pool), commit the
        plan's metadata; ``ub.plan`` and ``ub.built`` hold them until :meth:`compute`."""
        n = len(ub.tokens)
        n_out = max(1, len(ub.out_rows))
        n_img = 0
        if self.images is not None and ub.tokens.min() <= FIRST_IMAGE_ID:
            # image rows: their embeddings replace the tokens'; Gemma 3's attend both ways within an image
            n_img = int(np.count_nonzero(ub.tokens <= FIRST_IMAGE_ID))
            spans = chunk_spans(ub.tokens, self.vision.config.tokens_per_image, self.images) \
                if self.vision.bidirectional else None
            plan = self.cache.start_forward(ub.positions, ub.seqs, spans=spans)
        else:
            plan = self.cache.start_forward(ub.positions, ub.seqs)
        kw = {"n_embd_rows": n_img} if n_img else {}

        def build():
            with kernels.using(self.kernels):
                b = self.model.build(self.cache, plan, n, n_out, flash_attn=self.flash_attn,
                                     embeddings=embedding, **kw)
            self.rt.pin(b.pins)
            return b

        # A graph of the same shape is reused with new inputs: the rows and outputs (the batch's), the
        # visible cell ranges (the plan's own key: padded, so consecutive one-token steps share one
        # graph), what it outputs and how many rows take image embeddings.
        built = self.rt.graphs.take((n, n_out, plan.key, embedding, n_img), build)
        # Metadata is committed once the graph exists; the cells are written when it computes. A failed
        # compute clears the sequences involved (the runner's caller does, through the slot table).
        try:
            self.cache.apply(plan)
        except BaseException:
            built.free()
            raise
        ub.plan, ub.built = plan, built

    def compute(self, ub: _UBatch) -> Optional[np.ndarray]:
        """Fill a built micro-batch's inputs and compute it; its wanted output rows as ``(rows, n_out_dim)``
        (None when it wants none). The graph goes back to the pool."""
        b = ub.built
        out_rows = ub.out_rows if len(ub.out_rows) else np.array([len(ub.tokens) - 1], np.int32)
        positions = ub.positions
        if self._mrope:
            positions = mrope_positions(ub.tokens, ub.positions, ub.seqs, self.history or (lambda s: ()),
                                        self.images, self.vision.grid if self.vision is not None else None)
        if getattr(b, "embd", None) is not None:
            rows = np.flatnonzero(ub.tokens <= FIRST_IMAGE_ID)
            # images encoded on first use, straight through the encoder's one route
            encode = functools.partial(self.vision.run, runtime=self.rt)
            embd = (self.images.rows(ub.tokens[rows], encode), rows)
            toks = np.where(ub.tokens < 0, 0, ub.tokens)
            self.rt.run(b.graph, lambda: b.set_inputs(toks, positions, ub.plan, out_rows, embd))
        else:
            self.rt.run(b.graph, lambda: b.set_inputs(ub.tokens, positions, ub.plan, out_rows))
        ub.plan = None          # its mask is uploaded: the micro-batches of a batch must not all hold one
        res = b.output.get() if len(ub.out_rows) else None
        ub.built = None
        self.rt.graphs.give(b)
        return None if res is None else res.reshape(len(out_rows), -1)

    def encode(self, tiles: np.ndarray) -> np.ndarray:
        """An image's checked tiles -> its embedding rows ``float32 (rows, n_embd_text)``, computed on this
        runtime by the encoder's own route (:meth:`ggmlpy.vision.VisionModel.run`)."""
        return self.vision.run(tiles, self.rt).reshape(-1, self.vision.config.n_embd_out)

    # ------------------------------------------------------------------ start-up

    def worst_case_graph(self, n: int):
        """The forward graph of ``n`` tokens at full context (the reservation's), built under :attr:`kernels`."""
        plan = self.cache.start_forward(np.zeros(n, np.int64), np.zeros(n, np.int64), reserve=True)
        # the prompt batch with an image tile in it (the decode batch has no room for one)
        kw = {}
        if self.vision is not None:
            tpi = self.vision.config.tokens_per_image
            # an image's rows kept in one micro-batch fill a prompt one; Qwen-VL's may fill any
            if not self.vision.tie_images or n >= tpi:
                kw["n_embd_rows"] = min(tpi, n)
        with kernels.using(self.kernels):
            return self.model.build(self.cache, plan, n, n, flash_attn=self.flash_attn,
                                    embeddings=self.worst_output(), **kw)

    def worst_output(self):
        """What the worst-case graphs output: logits (False), or for a model that cannot generate (an
        encoder) its hidden states (True), or its classification scores (``"rank"``) where it has a head:
        that graph is the hidden states' plus the head."""
        m = self.model
        if getattr(m, "can_generate", True):
            return False
        return "rank" if getattr(m, "n_cls_out", 0) else True

    def reserve(self, n_prompt: int, n_decode: int) -> None:
        """Reserve the compute buffers for the worst case: a prompt micro-batch, a decode one and, with a
        vision encoder, its largest image batch (:meth:`ggmlpy.backend.Runtime.reserve`)."""
        keep = []

        def build(n: int):
            b = self.worst_case_graph(n)
            keep.append(b)
            return b.graph

        def build_image():
            b = self.vision.build(self.vision.max_tiles)
            keep.append(b)
            return b.graph

        extra = [("vision", build_image)] if self.vision is not None else []
        try:
            self.rt.reserve(build, n_prompt=n_prompt, n_decode=n_decode, extra=extra)
        finally:
            for b in keep:             # on failure too: each holds a graph context
                b.free()
            # and a plan with a worst-case mask (n_ubatch x cells), which a failure's traceback would keep
            # alive through this frame
            keep.clear()

    def choose_kernels(self, mode: Optional[str], n_ubatch: int, n_ctx: int, measuring: bool = False) -> None:
        """Set :attr:`kernels`, which own kernels the graphs take (:mod:`ggmlpy.models.kernels`): measured on
        this machine against ggml's ops at the sites of these graphs (a decode and a prompt micro-batch),
        or read from the cache of those timings. A runner that only measures memory takes them all."""
        if measuring:
            self.kernels = KernelChoices("own", n_threads=self.rt.n_threads)
            return

        def record(recorder) -> None:
            saved, self.kernels = self.kernels, recorder
            try:
                for n in dict.fromkeys((1, n_ubatch)):
                    self.worst_case_graph(n).free()
            finally:
                self.kernels = saved

        self.kernels = kernel_choices(record, self.rt.n_threads, mode=mode, n_ctx=n_ctx,
                                      n_expert_used=getattr(self.model.config, "n_expert_used", 1) or 1)
