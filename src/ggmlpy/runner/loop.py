"""The :class:`Runner`: a model with its cache and runtime, the direct calls, and the request loop.

The loop (after Ollama's ``ollamarunner``) admits requests into slots (prefix reuse through the
:class:`~ggmlpy.sequences.SlotTable`), forms a batch round-robin (:mod:`.batching`), builds its graphs
(the model's, through the runtime's graph pool), computes, samples and streams (:mod:`.requests`).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Optional

import numpy as np

from ggmlpy._core import (
    ClosedError,
    GGMLError,
    GGMLMemoryError,
    GGMLValueError,
    Type,
)
from ggmlpy.backend import MemoryReport, Placement, Runtime, choose_devices
from ggmlpy.kvcache import V_TRANS_TYPES
from ggmlpy.models.kernels import KernelChoices
from ggmlpy.models.kernels import mode as kernel_mode
from ggmlpy.sampling import SamplingParams
from ggmlpy.sampling import logprobs as _logprobs

from .batching import (
    _NO_ROWS,
    _ROW0,
    _Batch,
    _drop_graphs,
    _Member,
    _Placeholder,
    _UBatch,
    as_units,
    split_ubatches,
)
from .images import FIRST_IMAGE_ID, ImageStore
from .inputs import Inputs, Prompt
from .requests import Completion, DoneReason, Handle, TokenEvent, _Request
from .slots import InputTooLong, SlotTable, shift_discard, truncate_indices
from .step import Step
from .text import TextStream, split_stops

__all__ = ["Runner"]

log = logging.getLogger("ggmlpy")

# llama-bench's cache types; each needs a ggml CPU row writer (set_rows) and, for flash attention, a K dot
# product and a V to-float conversion, which all of these have
_CACHE_TYPES = {"f32": Type.F32, "f16": Type.F16, "bf16": Type.BF16, "q8_0": Type.Q8_0, "q4_0": Type.Q4_0,
                "q4_1": Type.Q4_1, "q5_0": Type.Q5_0, "q5_1": Type.Q5_1, "iq4_nl": Type.IQ4_NL}


#: the constructor's defaults for settings a fitted model may give instead
_DEFAULTS = {"n_ctx": 2048, "n_batch": 512, "n_ubatch": 512, "n_seq_max": 1, "type_k": "f16", "type_v": "f16"}


class Runner:
    """A model plus its cache, scheduler and request loop.

    Parameters
    ----------
    model : ggmlpy.models.LlamaModel
        A loaded model.
    n_ctx : int
        Context per sequence (cache cells per sequence; positions stay below it). Default 2048.

        ``n_ctx``, ``n_batch``, ``n_ubatch``, ``n_seq_max``, ``type_k``, ``type_v`` and ``flash_attn`` not
        given take the values a placement search reserved for (``model.fit.runner_kwargs``, see
        ``load_model(..., n_gpu_layers="auto")``), so that the runner fits where the search said.
    n_batch, n_ubatch : int
        Tokens per logical batch and per computed micro-batch (default 512 each); shrunk to ``n_ctx``.
    n_seq_max : int
        Sequences served at once (slots; default 1).
    n_threads : int
        CPU threads (0: all cores).
    flash_attn : bool, optional
        Use ``flash_attn_ext`` (default; a quantized V cache needs it), or
        ``mul_mat`` + ``soft_max_ext`` with V stored transposed.
    type_k, type_v : str
        Cache types of K and V, each one of ``f32``, ``f16`` (default),
        ``bf16``, ``q8_0``, ``q4_0``, ``q4_1``, ``q5_0``, ``q5_1``, ``iq4_nl``
        (llama-bench's list); they may differ. Without flash attention V must
        be ``f32``, ``f16`` or ``bf16`` (see :meth:`check_cache_types`); a
        quantized type needs a head size that is a multiple of its block (32).
    op_offload : bool
        Let ggml's scheduler compute a product whose weight is in host memory on an accelerator when
        the batch is large enough for the copy to pay (default, as llama.cpp's ``op_offload``); False
        computes every op where its weights are (llama-bench's ``-nopo 1``). Without an accelerator
        both are the same.
    offload_kqv : bool
        Keep each layer's K/V cache on that layer's device (default, as
        llama.cpp's ``offload_kqv``), or, when False, every layer's cache in
        host (CPU) memory whatever device computes the layer (llama-bench's
        ``-nkvo 1``). On the CPU alone both are the same.
    pipeline : bool, optional
        Build the next batch's graphs while the current one computes. Default:
        only when an accelerator or RPC device computes layers; on the CPU
        alone the building thread takes a core from ggml's threads and the
        sequential loop was faster here (``bench/bench_runner.py``).
    multi_user_cache : bool
        Slot choice: fork prefixes and evict the least recently used slot
        (True), or take the free slot with the longest prefix (False).
    reuse_graphs : bool
        Reuse a built graph for the next batch of the same shape (the visible
        cache range is padded to 256 cells with flash attention, 32 without,
        so most one-token steps share a graph), as llama.cpp does.
    defrag_thold : float or None
        When a request is admitted and more than this fraction of the cells below the last live one are
        holes (:meth:`~ggmlpy.kvcache.Causal.fragmentation`), the cache is compacted first (the batch in
        flight completes, then K/V rows move on the cache's devices), so later batches attend over a
        shorter cell range. llama.cpp's ``defrag_thold``; None never compacts.
    tokenizer : ggmlpy.tokenizer.Tokenizer, optional
        What turns text prompts and chats into ids and generated ids into text. Default: the
        model's (``model.tokenizer``, read from its GGUF file on first use); give one to use another
        vocabulary file. Token-id requests never need one.
    vision : ggmlpy.vision.VisionModel, optional
        The image encoder (an mmproj file); default the model's (``load_model(..., mmproj=...)``).
        With one, prompts take images (``submit(..., images=[...])``): the worst-case reservation
        includes the largest image, and the memory report the encoder's weights and graph.
    image_token : int, optional
        The token id that marks an image's place in a token-id prompt (one run of it per image tile,
        as the model's HF processor writes ``input_ids``). Default: the vocabulary's image token
        (Gemma 3 ``<image_soft_token>``, Idefics3 ``<image>``).
    image_cache : int
        Encoded images kept, so that a prompt with the same image is not encoded again.
    kernels : str, optional
        Where ggmlpy's own CPU kernels (matrix-vector products, attention, GeGLU) replace ggml's ops:
        ``"measure"`` (default, or ``$GGMLPY_KERNELS``): each is timed against ggml's op on this
        machine at the sites of this runner's graphs (the model's own weights and shapes, the
        runner's threads; a second or so for a 1B model, then cached per machine in
        ``kernels.json``) and taken only where it was faster; ``"own"``: wherever it runs;
        ``"ggml"``: nowhere. :attr:`kernels` holds the choices (:mod:`ggmlpy.models.kernels`).

    Raises
    ------
    GGMLMemoryError
        Cache or compute buffers do not fit, or the host arrays sized from
        the context (see :meth:`host_bytes`) exceed the available memory
        (``.report`` says what was needed); nothing stays allocated.

    Notes
    -----
    Thread safety: :meth:`submit` (and :meth:`generate`, :meth:`embed`) may
    be called from any thread; direct calls (:meth:`decode`,
    :meth:`decode_batch`, :meth:`clear`) run one at a time and only while no
    request is being served; :meth:`close` may be called from any thread at
    any time (see there). After close every call raises
    :class:`~ggmlpy.ClosedError`.
    """

    def __init__(self, model, n_ctx: Optional[int] = None, n_batch: Optional[int] = None,
                 n_ubatch: Optional[int] = None, n_seq_max: Optional[int] = None, n_threads: int = 0,
                 flash_attn: Optional[bool] = None, type_k: Optional[str] = None, type_v: Optional[str] = None,
                 pipeline: Optional[bool] = None, multi_user_cache: bool = True, reuse_graphs: bool = True,
                 offload_kqv: bool = True, defrag_thold: Optional[float] = 0.1, tokenizer=None, vision=None,
                 image_token: Optional[int] = None, image_cache: int = 32, kernels: Optional[str] = None,
                 op_offload: bool = True) -> None:
        if not getattr(model, "loaded", True) and not getattr(self, "_measuring", False):
            raise GGMLValueError("runner: the model's weights are not loaded (call model.load())")
        # settings not given: those a placement search reserved for (load_model(n_gpu_layers="auto")),
        # else the defaults
        fitted = getattr(getattr(model, "fit", None), "runner_kwargs", None) or {}
        given = {"n_ctx": n_ctx, "n_batch": n_batch, "n_ubatch": n_ubatch, "n_seq_max": n_seq_max,
                 "type_k": type_k, "type_v": type_v}
        v = {k: x if x is not None else fitted.get(k, _DEFAULTS[k]) for k, x in given.items()}
        n_ctx, n_batch, n_ubatch, n_seq_max, type_k, type_v = (v[k] for k in given)
        if flash_attn is None:
            flash_attn = fitted.get("flash_attn")
        for name, v in (("n_ctx", n_ctx), ("n_batch", n_batch), ("n_ubatch", n_ubatch), ("n_seq_max", n_seq_max)):
            if int(v) < 1:
                raise GGMLValueError(f"runner: {name} must be >= 1 (got {v})")
        dtype_k, dtype_v, flash_attn = self.check_cache_types(type_k, type_v, flash_attn)
        self._kernel_mode = kernel_mode(kernels)
        self.model = model
        self.n_ctx = int(n_ctx)
        self.n_batch = min(int(n_batch), self.n_ctx)          # a batch never exceeds the context
        self.n_ubatch = min(int(n_ubatch), self.n_batch)
        self.n_seq_max = int(n_seq_max)
        self.flash_attn = bool(flash_attn)
        self.type_k, self.type_v = dtype_k.name.lower(), dtype_v.name.lower()
        self.offload_kqv = bool(offload_kqv)
        if pipeline is None:
            pipeline = any(d.type != "CPU" for d in model.placement.devices())
        self.pipeline = bool(pipeline)
        self.cache = model.new_cache(dtype_k, dtype_v, flash_attn=self.flash_attn)    # the model's recipe
        self.report: MemoryReport = model.report
        # Every piece of state close() looks at exists before anything is allocated, so that a failed
        # start frees through the same path as close().
        self.rt = None
        self._lock = threading.Condition()
        self._engine = threading.Lock()       # direct decode()/clear() calls one at a time
        self._waiting: deque = deque()
        self._active: dict[int, _Request] = {}
        self._next_seq = 0
        self._thread: Optional[threading.Thread] = None
        self._worker: Optional[threading.Thread] = None
        self._jobs = None
        self._closing = False                  # set once by close(): no new request or direct call
        self._closed_event = threading.Event()
        self._inflight = 0                     # batches launched and not yet completed
        self._direct_busy = 0
        self.reuse_graphs = bool(reuse_graphs)
        self.defrag_thold = None if defrag_thold is None or defrag_thold < 0 else float(defrag_thold)
        self.n_defrags = 0
        self.n_batches = 0
        self.batch_sizes: deque = deque(maxlen=256)   # micro-batch sizes of recent batches (diagnostics)
        self.overlap_s = 0.0                  # graph building hidden behind compute (pipeline)
        self.closed = False
        self.slots = SlotTable(self.n_seq_max, multi_user=multi_user_cache, cache=self.cache)
        self.step: Optional[Step] = None      # the graphs: made once the runtime exists
        self.vision = vision if vision is not None else getattr(model, "vision", None)
        if self.vision is not None:
            self._check_vision(self.vision)
        #: The input side: the tokenizer, the image store, the prompt checks (:mod:`.inputs`).
        self.inputs = Inputs(model, self.n_ubatch, tokenizer, self.vision, image_token, image_cache)
        self.images: Optional[ImageStore] = self.inputs.images
        try:
            self._check_host_memory()
            self.rt = Runtime(model.placement.devices(), n_threads=n_threads, graph_size=2 * model.graph_size(),
                              report=self.report, reuse_graphs=self.reuse_graphs, op_offload=op_offload)
            self.cache.init(self.n_ctx, self.n_seq_max, self.n_ubatch, placement=self._cache_placement(),
                            report=self.report, runtime=self.rt)
            self.step = Step(model, self.cache, self.rt, flash_attn=self.flash_attn, vision=self.vision,
                             images=self.images)
            self.step.choose_kernels(self._kernel_mode, self.n_ubatch, self.n_ctx,
                                     measuring=getattr(self, "_measuring", False))
            self.step.reserve(self.n_ubatch, min(self.n_seq_max, self.n_ubatch))
        except BaseException as e:
            self._closing = True
            try:
                self._free()
            except Exception:                # the start's own error is the one to report
                log.exception("runner: cleanup after a failed start failed too")
            if isinstance(e, MemoryError) and not isinstance(e, GGMLError):
                # numpy (host arrays sized from n_ctx) ran out: the same error as a device allocation
                raise GGMLMemoryError(f"runner: host memory ran out while reserving for n_ctx={self.n_ctx}, "
                                      f"n_seq_max={self.n_seq_max}, n_ubatch={self.n_ubatch} ({e})\n{self.report}",
                                      self.report) from e
            raise

    @classmethod
    def measure(cls, model, **kw) -> MemoryReport:
        """What a runner with these settings allocates on ``model``, then freed: a copy of the memory report.

        The cache and the worst-case graphs are allocated and reserved as by the constructor (``kw`` are
        its parameters), on a model whose weights need only be allocated (``load_model(..., load=False)``:
        no data read), then freed. ``load_model(..., n_gpu_layers="auto")`` tries placements with it.

        Raises
        ------
        GGMLMemoryError
            As the constructor (``.report`` says what each device needed).
        """
        self = cls.__new__(cls)
        self._measuring = True
        self.__init__(model, **kw)
        try:
            return copy.deepcopy(self.report)
        finally:
            self.close()

    # ------------------------------------------------------------------ set-up

    @staticmethod
    def check_cache_types(type_k: str = "f16", type_v: str = "f16",
                          flash_attn: Optional[bool] = None) -> tuple[Type, Type, bool]:
        """Check a K/V cache type pair against the attention path, as the constructor does.

        Parameters
        ----------
        type_k, type_v : str
            Cache type names (see the class parameters).
        flash_attn : bool, optional
            None resolves to True (flash attention), as in the constructor.

        Returns
        -------
        (Type, Type, bool)
            The K type, the V type and whether flash attention is used.

        Raises
        ------
        GGMLValueError
            An unknown type, or a V type the ``mul_mat`` path cannot use
            (quantized: it stores V transposed, one element per row, which a
            quantized block cannot be; llama.cpp requires flash attention for a
            quantized V cache too). A quantized K works on both paths.

        Examples
        --------
        >>> Runner.check_cache_types("q8_0", "f16", flash_attn=False)
        (<Type.Q8_0: 8>, <Type.F16: 1>, False)
        """
        tk, tv = str(type_k).lower(), str(type_v).lower()
        for what, t in (("type_k", tk), ("type_v", tv)):
            if t not in _CACHE_TYPES:
                raise GGMLValueError(f"runner: {what} {t!r} is not a cache type; expected one of "
                                     f"{', '.join(_CACHE_TYPES)}")
        dtype_k, dtype_v = _CACHE_TYPES[tk], _CACHE_TYPES[tv]
        fa = True if flash_attn is None else bool(flash_attn)
        if not fa and dtype_v not in V_TRANS_TYPES:
            raise GGMLValueError(f"runner: a {tv} V cache needs flash attention (flash_attn=True): without it V is "
                                 "stored transposed, which a quantized type cannot be (type_v f32, f16 or bf16 "
                                 "works without flash attention; a quantized type_k does)")
        return dtype_k, dtype_v, fa

    def _cache_placement(self) -> Placement:
        """The model's placement for the cache, or every layer on the CPU without KV offload."""
        placement = self.model.placement
        if self.offload_kqv:
            return placement
        cpu = choose_devices("cpu")[-1]
        return Placement(layers=[cpu] * placement.n_layers, output=cpu, input=cpu)

    def host_bytes(self) -> int:
        """Host memory this runner needs for what is sized from the context (an upper estimate, in bytes):
        the cache's :meth:`~ggmlpy.kvcache.Causal.host_bytes` at ``n_ctx``, ``n_seq_max`` and ``n_ubatch``
        (the worst-case batch's mask and cell metadata, and the K/V of layers on the CPU)."""
        return self.cache.host_bytes(self.n_ctx, self.n_seq_max, self.n_ubatch, self._cache_placement())

    def _check_host_memory(self) -> None:
        """Fail before allocating anything when the host arrays cannot fit (GGMLMemoryError with the report)."""
        need = self.host_bytes()
        avail = _available_host_memory()
        if avail is not None and need > avail:
            raise GGMLMemoryError(
                f"runner: n_ctx={self.n_ctx} with n_seq_max={self.n_seq_max} and n_ubatch={self.n_ubatch} needs "
                f"about {need / 2**30:.2f} GiB of host memory for the K/V cache on the CPU and the attention "
                f"mask and cache metadata of the worst-case batch, but {avail / 2**30:.2f} GiB are available; lower n_ctx, n_seq_max or "
                f"n_ubatch\n{self.report}", self.report)

    def _check_vision(self, vision) -> None:
        vc = vision.config
        if not getattr(self.model, "EMBD_INPUT", False):
            raise GGMLValueError(f"runner: {self.model.config.arch} models take no image embeddings")
        if vc.n_embd_text != self.model.config.n_embd:
            raise GGMLValueError(f"runner: the vision encoder projects to {vc.n_embd_text} values, the text model's "
                                 f"embeddings have {self.model.config.n_embd} (a projector of another model?)")
        if vc.tokens_per_image > self.n_ubatch:
            raise GGMLValueError(f"runner: an image takes {vc.tokens_per_image} tokens, more than n_ubatch "
                                 f"{self.n_ubatch}; it must fit in one micro-batch")

    @property
    def kernels(self) -> KernelChoices:
        """The own kernels' choices the graphs are built under (:mod:`ggmlpy.models.kernels`)."""
        return self.step.kernels if self.step is not None else KernelChoices("own")

    def memory_report(self) -> MemoryReport:
        """Weights, cache and compute graph per device (a :class:`ggmlpy.backend.MemoryReport`)."""
        return self.report

    @property
    def n_vocab(self) -> int:
        return self.model.n_vocab

    @property
    def tokenizer(self):
        """The :class:`~ggmlpy.tokenizer.Tokenizer` of text requests: the one given to the constructor,
        else the model's (read from its GGUF file on first use, then kept).

        Raises
        ------
        TokenizerError (a GGMLValueError)
            The model's file has no tokenizer (``tokenizer.ggml.model`` missing or ``"none"``, as in
            the synthetic models), or one this library cannot read.
        """
        return self.inputs.tokenizer

    # ------------------------------------------------------------------ validation

    def _check_seq_id(self, seq, what: str) -> int:
        s = int(seq)
        if not 0 <= s < self.n_seq_max:
            raise GGMLValueError(f"{what}: sequence {s} is out of range: this runner serves n_seq_max="
                                 f"{self.n_seq_max} sequences (0..{self.n_seq_max - 1})")
        return s

    # ------------------------------------------------------------------ the compute core

    @property
    def graphs_built(self) -> int:
        """Forward graphs built so far (not taken from the runtime's pool)."""
        return self.step.graphs_built if self.step is not None and self.rt is not None else 0

    def _compute(self, ub: _UBatch) -> Optional[np.ndarray]:
        """Compute a built micro-batch (:meth:`Step.compute`): the one call the loop's compute thread and
        the direct calls make into the step's compute."""
        return self.step.compute(ub)

    @property
    def image_token(self) -> int:
        """The token id that marks an image tile's place in a token-id prompt (see the class)."""
        return self.inputs.image_token

    def encode_image(self, image) -> np.ndarray:
        """An image's embeddings as the text model receives them: ``float32[rows, n_embd]``, the rows of its
        tiles in order (what replaces its image tokens in a prompt); computed now, synchronously, through
        this runner's scheduler, and not kept (prompts keep theirs, see :meth:`submit`).

        ``image`` is anything ``images=`` takes (a :class:`~ggmlpy.vision.preprocess.PreprocessedImage`
        skips the preprocessing, as ``ggmlpy bench -i`` times it).

        Raises
        ------
        GGMLValueError
            No vision encoder, a bad image, one over the reservation's tile bound, or requests being
            served (like :meth:`decode`, for direct use).
        """
        tiles = self.inputs.pixels(image, "encode_image")
        with self._direct("encode_image"):
            return self.step.encode(tiles)

    def decode(self, tokens, seq: int = 0, logits="last", positions=None, *,
               embeddings: bool = False, images: Sequence = ()) -> Optional[np.ndarray]:
        """Append ``tokens`` to sequence ``seq`` and compute them (synchronously).

        Positions continue from what the cache holds for ``seq`` unless
        given. The tokens are computed in micro-batches of ``n_ubatch``.

        Parameters
        ----------
        logits : ``"last"`` (default), ``"all"``, ``None``/False, or a list of indices into ``tokens``
            The rows to output.
        embeddings : bool
            Output those rows' final-normed hidden states (the graph
            :meth:`embed` uses, without the output head) instead of logits.

        Returns
        -------
        numpy.ndarray ``float32[n_rows, n_vocab]`` (``[n_rows, n_embd]`` with
        ``embeddings``) of the requested rows, or None.

        Raises
        ------
        GGMLValueError
            Token ids outside the vocabulary, a sequence id out of range,
            positions at or past ``n_ctx``, or requests being served.
        ClosedError
            The runner is closed (a close() from another thread waits for a
            decode already computing).
        """
        self._check_open("decode")
        seq = self._check_seq_id(seq, "decode")
        one_row = type(logits) is str and logits in ("last", "all")
        tied = None
        if images is not None and len(images):
            p = self.inputs.prompt(tokens, "decode", images=images)
            toks = np.asarray(p.ids, np.int32)
            tied = np.zeros(len(toks), bool)
            for i, k in enumerate(p.same_batch):
                tied[i + 1:i + 1 + k] = True
        else:
            if positions is None and (one_row or logits is None or logits is False):
                tok = self.inputs.one_token(tokens)
                if tok is not None:             # one generation step: scalars instead of arrays
                    return self._decode_one(tok, seq, logits is not None and logits is not False, bool(embeddings))
            toks = self.inputs.check_tokens(tokens, "decode")
        n = len(toks)
        if n == 0:
            raise GGMLValueError("decode: empty batch")
        if positions is not None:
            pos = np.asarray(positions, dtype=np.int64)
            if pos.shape != toks.shape:
                raise GGMLValueError(f"decode: {len(pos)} positions for {n} tokens")
        want = np.zeros(n, dtype=bool)
        if isinstance(logits, str):
            if logits == "last":
                want[-1] = True
            elif logits == "all":
                want[:] = True
            else:
                raise GGMLValueError(f"decode: logits must be 'last', 'all', None or indices (got {logits!r})")
        elif logits is not None and logits is not False:
            idx = np.asarray(logits, dtype=np.int64)
            if idx.size and (idx.min() < -n or idx.max() >= n):
                raise GGMLValueError(f"decode: logits indices out of range for {n} tokens")
            want[idx] = True
        with self._direct("decode"):
            if positions is None:             # read under _direct: the cache is alive and no one else writes
                start = self.cache.seq_pos_max(seq) + 1
                pos = np.arange(start, start + n, dtype=np.int64)
            if pos.min() < 0 or pos.max() >= self.n_ctx:
                raise GGMLValueError(f"decode: positions {int(pos.min())}..{int(pos.max())} are outside the "
                                     f"context [0, {self.n_ctx}) of sequence {seq}")
            return self._run_direct(split_ubatches(self.n_ubatch, toks, pos, np.full(n, seq, np.int64), want, tied),
                                    [seq],
                                    embedding=bool(embeddings), appended=(int(pos[0]), toks.tolist())
                                    if positions is None else None)

    def _decode_one(self, tok: int, seq: int, want: bool, embedding: bool) -> Optional[np.ndarray]:
        # One generation step, the hot path of token-by-token decoding: what decode() + _run_direct do
        # for one token, without the batch checks, micro-batch splitting or a generator context manager
        # (each step runs on caches the weight sweep has just emptied, so every call saved counts).
        self._direct_enter("decode")
        try:
            p = self.cache.seq_pos_max(seq) + 1
            if p >= self.n_ctx:
                raise GGMLValueError(f"decode: positions {p}..{p} are outside the context [0, {self.n_ctx}) of "
                                     f"sequence {seq}")
            ub = _UBatch(np.array([tok], np.int32), np.array([p], np.int64), np.array([seq], np.int64),
                         _ROW0 if want else _NO_ROWS)
            r = self._run_ubatch(ub, embedding, (seq,))
            self._record_direct((seq,), (p, (tok,)))
            return r
        finally:
            self._direct_exit()

    def _check_open(self, what: str) -> None:
        if self._closing:
            raise ClosedError(f"{what}: the runner is closed")

    def _direct_enter(self, what: str) -> None:
        """Start a direct use of the cache and scheduler (see :meth:`_direct`); pair with :meth:`_direct_exit`."""
        with self._lock:
            while True:
                # checked again after every wait: a request may be accepted while we wait for
                # the loop's last batch, and then the loop owns the cache
                self._check_open(what)
                if self._active or self._waiting:
                    raise GGMLValueError(f"{what}: requests are being served; {what}() is for direct use only")
                if not self._inflight:
                    break
                self._lock.wait()                    # the loop's last batch is still computing
            self._direct_busy += 1
        try:
            self._engine.acquire()
        except BaseException:
            self._direct_done()
            raise
        try:
            self._check_open(what)                   # close() may have come while we queued for the engine
        except BaseException:
            self._direct_exit()
            raise

    def _direct_exit(self) -> None:
        self._engine.release()
        self._direct_done()

    def _direct_done(self) -> None:
        with self._lock:
            self._direct_busy -= 1
            self._lock.notify_all()       # close() waits for the last direct call

    @contextlib.contextmanager
    def _direct(self, what: str):
        """Direct use of the cache and scheduler: only while no request is served or computing.

        close() waits for a direct call in progress before it frees anything,
        and a direct call started after close() raises ClosedError.
        """
        self._direct_enter(what)
        try:
            yield
        finally:
            self._direct_exit()

    def _record_direct(self, seqs, appended) -> None:
        """After a direct batch: the slot of ``seqs[0]`` records ``appended = (first position, tokens)``
        when they continued what it holds; otherwise the slots of ``seqs`` are dropped (a request
        re-processes them)."""
        if appended is not None and len(self.slots[seqs[0]].tokens) == appended[0]:
            self.slots.committed(seqs[0], appended[1])
        else:
            for s in seqs:
                self.slots.reset(s)
        self.n_batches += 1

    def _run_ubatch(self, ub: _UBatch, embedding: bool, seqs) -> Optional[np.ndarray]:
        """Build and compute one micro-batch of direct use; on failure, whatever part of the batch
        reached the cache is undone for the sequences ``seqs``, as for a failed compute."""
        try:
            self.step.build(ub, embedding)
            return self._compute(ub)
        except BaseException:
            if ub.built is not None:
                ub.built.free()
                ub.built = None
            for s in seqs:
                self.slots.clear(s)
            raise

    def _run_direct(self, ubatches, seqs, embedding, appended=None) -> Optional[np.ndarray]:
        """Compute micro-batches of direct use (sequences ``seqs``); their output rows, concatenated.

        ``appended`` is ``(first position, tokens)`` when one sequence's tokens continued it: its slot's
        token record grows with them (so a request can reuse them as a prefix); otherwise the slots'
        records are dropped (a request re-processes them).
        """
        rows = []
        for ub in ubatches:
            r = self._run_ubatch(ub, embedding, seqs)
            if r is not None:
                rows.append(r)
        self._record_direct(seqs, appended)
        return (rows[0] if len(rows) == 1 else np.concatenate(rows)) if rows else None

    def decode_batch(self, tokens, positions, seq_ids, logits) -> np.ndarray:
        """Compute one batch of several sequences: ``tokens``, ``positions``, ``seq_ids`` per row.

        ``logits`` is a boolean mask (or indices) of the rows to return, in order.
        """
        self._check_open("decode_batch")
        toks = self.inputs.check_tokens(tokens, "decode_batch")
        pos = np.asarray(positions, dtype=np.int64)
        seqs = np.asarray(seq_ids, dtype=np.int64)
        if not (toks.shape == pos.shape == seqs.shape) or toks.size == 0:
            raise GGMLValueError(f"decode_batch: tokens, positions and seq_ids need one equal, non-zero length "
                                 f"(got {toks.size}, {pos.size}, {seqs.size})")
        for s in np.unique(seqs):
            self._check_seq_id(s, "decode_batch")
        if pos.min() < 0 or pos.max() >= self.n_ctx:
            raise GGMLValueError(f"decode_batch: positions must be in [0, {self.n_ctx})")
        want = np.zeros(toks.size, dtype=bool)
        want[np.asarray(logits)] = True
        with self._direct("decode_batch"):
            return self._run_direct(split_ubatches(self.n_ubatch, toks, pos, seqs, want), [int(s) for s in np.unique(seqs)],
                                    embedding=False)

    def clear(self, seq: Optional[int] = None) -> None:
        """Forget one sequence's cache contents, or everything's (not while requests are served)."""
        self._check_open("clear")
        if seq is not None:
            seq = self._check_seq_id(seq, "clear")
        with self._direct("clear"):
            self.slots.clear(seq)

    def _fingerprint(self) -> dict:
        """What a saved state must match to be loaded into this runner: the model's shape and its weights'
        fingerprint (:mod:`ggmlpy.models.fingerprint`; None for a model without a file)."""
        from ggmlpy.models.fingerprint import model_fingerprint

        m, c = self.model, self.model.config
        return {"arch": c.arch, "desc": m.desc, "n_params": int(m.n_params), "size": int(m.size),
                "n_vocab": int(m.n_vocab), "n_layer": int(c.n_layer), "n_embd": int(c.n_embd),
                "weights": model_fingerprint(m)}

    def save_state(self, seq: int, path) -> int:
        """Save sequence ``seq``: its cache cells (positions, K/V of every layer) and the tokens they hold.

        A later :meth:`load_state` (this runner or another over the same model and cache types)
        continues it: the next :meth:`decode` gives the logits it would have given here (bit for bit
        where the loaded cells land where they were; elsewhere, after another sequence's cells say,
        attention sums them in another order, within float rounding), and a
        request whose prompt starts with the saved tokens reuses them as its prefix. The format is
        :mod:`ggmlpy.kvcache.state`'s (checksummed), with the model's fingerprint (shape and weights) and
        the tokens in its meta; a path is written atomically. Direct use only (not while requests are
        served), as :meth:`decode`. Returns the bytes written.
        """
        self._check_open("save_state")
        seq = self._check_seq_id(seq, "save_state")
        with self._direct("save_state"):
            return self.slots.save(seq, path, {"model": self._fingerprint()})

    def _state_tokens(self, meta: dict, positions: list) -> list:
        """The token record of a state's ``meta`` (from :meth:`save_state`), validated against this runner:
        the model fingerprint, every token an id of the vocabulary (or an image row: then the record is
        dropped, image ids being the saving runner's own), one token per position, positions within the
        context. Raises StateError naming what is wrong."""
        from ggmlpy.kvcache import StateError

        if set(meta) != {"model", "tokens"}:
            raise StateError(f"load_state: the state's meta has keys {repr(sorted(meta))[:100]}, not 'model' and "
                             "'tokens' (not saved by Runner.save_state)")
        mine, theirs = self._fingerprint(), meta["model"]
        if not isinstance(theirs, dict):
            raise StateError("load_state: the state's model fingerprint is not an object")
        if "weights" not in theirs and set(theirs) == set(mine) - {"weights"}:
            raise StateError("load_state: the state was saved by an older ggmlpy, without a weights "
                             "fingerprint: it cannot be checked against this model's weights; save it again")
        if set(theirs) != set(mine):
            raise StateError(f"load_state: the state's model fingerprint has keys {repr(sorted(theirs))[:150]}, "
                             f"expected {sorted(mine)}")
        diff = [f"{k} {theirs[k]!r} in the file, {mine[k]!r} here" for k in mine
                if k != "weights" and (type(theirs[k]) is not type(mine[k]) or theirs[k] != mine[k])]
        if diff:
            raise StateError(f"load_state: the state was saved for another model: {'; '.join(diff)[:300]}")
        if theirs["weights"] != mine["weights"]:
            got = theirs["weights"]
            raise StateError(f"load_state: the state belongs to another model of the same shape: its weights "
                             f"fingerprint {(got[:16] + '...') if isinstance(got, str) else repr(got)[:20]} is "
                             f"not this model's {str(mine['weights'])[:16]}...")
        tokens = meta["tokens"]
        if not isinstance(tokens, list):
            raise StateError(f"load_state: the state's tokens must be a list, not {type(tokens).__name__}")
        n_vocab = int(self.model.n_vocab)
        images = False
        for i, t in enumerate(tokens):
            if type(t) is not int or not (0 <= t < n_vocab or -2**31 <= t <= FIRST_IMAGE_ID):
                raise StateError(f"load_state: the state's token {i} is {repr(t)[:40]}, not a token id of this "
                                 f"model's vocabulary [0, {n_vocab})")
            images |= t < 0
        last = max((int(p[-1]) for p in positions if p.size), default=-1)
        if last >= self.n_ctx:
            raise StateError(f"load_state: the state holds position {last}, beyond this runner's context "
                             f"(n_ctx {self.n_ctx})")
        if tokens and len(tokens) != last + 1:
            raise StateError(f"load_state: the state lists {len(tokens)} tokens for positions up to {last}: "
                             f"it must list one per position from 0, or none")
        if tokens:
            # the record says every position 0..last was computed: a cache holds them all, without a gap
            # (a sliding window's, at least those the next token sees)
            for i, (c, p) in enumerate(zip(getattr(self.cache, "caches", [self.cache]), positions)):
                window = getattr(c, "window", None)
                need = 0 if window is None else max(0, last + 1 - window)
                if p.size != last + 1 - int(p[0]) or int(p[0]) > need:    # increasing, ending at last
                    raise StateError(f"load_state: the state's cache {i} holds {p.size} positions from "
                                     f"{int(p[0])} to {last}, not every one from {need}, as its "
                                     f"{len(tokens)} tokens say")
        return [] if images else tokens

    def load_state(self, seq: int, path) -> list:
        """Replace what sequence ``seq`` holds with a state from :meth:`save_state` (possibly of another
        sequence id); returns the tokens it holds (empty when the saver did not know them, or they include
        image rows: their ids are the saving runner's own, so a later prompt never reuses them).

        The whole file is validated before the cache or the slot table changes: its format and checksum
        (:mod:`ggmlpy.kvcache.state`), the cache configuration, the model (shape and weights fingerprint,
        :mod:`ggmlpy.models.fingerprint`), the tokens (ids of this model's vocabulary, one per position)
        and the positions (within ``n_ctx``).

        Raises
        ------
        ggmlpy.kvcache.StateError
            Not a state file, damaged, of another model (shape or weights) or cache configuration (types,
            layout, window), saved by an older ggmlpy without a weights fingerprint, or with a token or
            position this runner cannot hold; the message says which. Nothing is changed.
        ggmlpy.kvcache.KVCacheFull
            The cache has too few free cells for it; nothing is changed.
        """
        self._check_open("load_state")
        seq = self._check_seq_id(seq, "load_state")
        with self._direct("load_state"):
            return self.slots.restore(seq, path, self._state_tokens)

    def wait_idle(self, timeout: Optional[float] = None) -> bool:
        """Wait until no request is queued, served or computing; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._active or self._waiting or self._inflight:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._lock.wait(left)
        return True

    def seq_len(self, seq: int) -> int:
        """Tokens the cache holds for ``seq``."""
        seq = self._check_seq_id(seq, "seq_len")
        with self._lock:          # close() frees the cache under the same lock
            self._check_open("seq_len")
            return self.cache.seq_pos_max(seq) + 1

    # ------------------------------------------------------------------ requests

    def submit(self, prompt: str | Sequence[int], *, max_tokens: int = 128,
               sampling: Optional[SamplingParams] = None, stop: Sequence[int | str] = (), n_keep: int = 0,
               shift: bool = True, truncate: bool = False, embedding: bool = False, pooling: str = "mean",
               normalize: bool = True, same_batch: Optional[Sequence[int]] = None, parse_special: bool = True,
               detokenize: Optional[bool] = None, images: Sequence = ()) -> Handle:
        """Queue a request (thread-safe) and return its :class:`Handle`.

        Parameters
        ----------
        prompt : str or token ids
            A str is encoded by :attr:`tokenizer` as llama.cpp's completion endpoint does
            (:func:`~ggmlpy.runner.text.encode_prompt`: BOS as the file says, special tokens in the
            text parsed unless ``parse_special`` is False, never two BOS).
        max_tokens : generation limit (done reason ``length``). As llama.cpp's ``n_predict``:
            ``-1`` for no limit (the request runs until a stop token, EOS or :meth:`Handle.cancel`;
            with ``shift`` it never ends on its own), ``-2`` until the context is full (done
            reason ``length`` when the next token would not fit, whatever ``shift`` says)
        sampling : :class:`ggmlpy.sampling.SamplingParams` (default greedy)
        stop : token ids and stop strings that end the generation (done reason ``stop``). The model's
            EOS ids are added; for a request that produces text, every end-of-generation id of the
            tokenizer (``tokenizer.eog``: EOS, end-of-turn...) too. A stop string is matched in the
            generated text across token boundaries (:class:`~ggmlpy.runner.text.StopMatcher`): text
            that could still be the start of one is held back, and the stop string and anything after
            it are never in the text; the token that completed it is the last of ``tokens``. A lone
            str is one stop string.
        n_keep : tokens kept at the start on a context shift (-1: the whole prompt)
        shift : shift the context when it is full; False ends with ``length`` instead
        truncate : drop prompt tokens after ``n_keep`` when the prompt exceeds ``n_ctx``;
            otherwise such a prompt raises :class:`InputTooLong`
        embedding : return the pooled final hidden state instead of generating
        pooling : ``mean``, ``cls`` or ``last`` (embedding requests)
        normalize : L2-normalise the embedding
        same_batch : per prompt token, how many following tokens must be computed in the same
            batch (Ollama's ``SameBatch``, e.g. an image's embeddings): such a group is never split
            across batches or micro-batches, nor cut by truncation or a context shift
        parse_special : a str prompt's special-token texts (``<|im_start|>``) become those tokens
            (default, as llama.cpp's server and ``llama-cli``); False reads them as plain text, for
            text from users who must not write control tokens
        detokenize : produce text (:attr:`TokenEvent.text`, :attr:`Completion.text`). Default: when
            the prompt is a str or a stop string is given; True for a token-id prompt too. A request
            that produces text needs :attr:`tokenizer`; one that does not behaves exactly as before
            text existed (``text`` None, only the model's EOS ids stop it).
        images : images for a runner with a vision encoder (PIL images, ``uint8`` arrays ``(H, W, 3)``,
            paths, ``data:`` URLs or encoded bytes, see :func:`ggmlpy.vision.preprocess.load_image`, read
            within its bounds; a path is read, being the caller's own argument, unlike one in a chat
            message, see :meth:`chat_prompt`; or
            :class:`~ggmlpy.vision.preprocess.PreprocessedImage` made with the encoder's ``image_config``),
            in prompt order.
            A str prompt marks each image's place with :data:`MEDIA_MARKER` (``<__media__>``), which
            becomes the text the model's processor writes for it (Gemma 3: ``<start_of_image>``, the
            image tokens, ``<end_of_image>``); a token-id prompt holds a run of :attr:`image_token`
            per image tile, as the processor's ``input_ids``. Each tile's embeddings replace its run,
            in one micro-batch (never split, nor cut by truncation or a shift).

        Raises
        ------
        GGMLValueError, InputTooLong
            Bad token ids, an empty prompt, a prompt longer than the context, an empty stop string,
            stop strings with ``detokenize=False``.
        GGMLTypeError
            A stop that is neither an int nor a str.
        TokenizerError (a GGMLValueError)
            Text is asked for and the model has no tokenizer; or the prompt cannot be encoded.
        ClosedError
            The runner is closed (or closing): a request accepted before that
            ends with done reason ``cancel``.
        """
        self._check_open("submit")
        text = self._text_options(stop, detokenize, embedding, isinstance(prompt, str))
        p = self.inputs.prompt(prompt, "submit", images=images, same_batch=same_batch, parse_special=parse_special)
        return self._queue(p, text, max_tokens=max_tokens, sampling=sampling, n_keep=n_keep, shift=shift,
                           truncate=truncate, embedding=embedding, pooling=pooling, normalize=normalize)

    def _text_options(self, stop, detokenize: Optional[bool], embedding: bool, str_prompt: bool) -> tuple:
        """A request's stop ids and stop strings, and the tokenizer of the text it produces (None: no text)."""
        stop_ids, stop_texts = split_stops(stop, "submit")
        if detokenize is None:
            detokenize = not embedding and (str_prompt or bool(stop_texts))
        elif stop_texts and not detokenize:
            raise GGMLValueError("submit: stop strings need the generated text; detokenize=False leaves it out")
        if embedding and stop_texts:
            raise GGMLValueError("submit: an embedding request generates nothing to stop (stop strings given)")
        return stop_ids, stop_texts, self.tokenizer if detokenize and not embedding else None

    def _queue(self, prompt: Prompt, text: tuple, *, max_tokens: int = 128, sampling: Optional[SamplingParams] = None,
               n_keep: int = 0, shift: bool = True, truncate: bool = False, embedding: bool = False,
               pooling: str = "mean", normalize: bool = True) -> Handle:
        """Queue a prepared prompt as a request (the request options checked, the prompt fitted to the context)."""
        stop_ids, stop_texts, tok = text
        ids, sb = prompt.ids, prompt.same_batch
        if not ids:
            raise GGMLValueError("submit: empty prompt")
        if pooling not in ("mean", "cls", "last"):
            raise GGMLValueError(f"submit: pooling must be mean, cls or last (got {pooling!r})")
        max_tokens = int(max_tokens)
        if not embedding and (max_tokens == 0 or max_tokens < -2):
            raise GGMLValueError(f"submit: max_tokens must be >= 1, -1 (no limit) or -2 (until the context is "
                                 f"full) (got {max_tokens})")
        params = sampling if sampling is not None else SamplingParams()
        if sb is None:
            sb = [0] * len(ids)
        n_keep = len(ids) if n_keep < 0 else int(n_keep)
        n_keep = min(n_keep, self.n_ctx - 1)
        if embedding:
            if len(ids) > self.n_ctx:
                raise InputTooLong(f"input too long: {len(ids)} tokens for an embedding with context {self.n_ctx}")
        elif len(ids) > self.n_ctx:
            keep_idx = truncate_indices(len(ids), self.n_ctx, n_keep, same_batch=sb, truncate=truncate)
            ids = [ids[i] for i in keep_idx]
            sb = [sb[i] for i in keep_idx]
        stop_ids += tuple(self.model.config.eos_token_ids)
        if tok is not None:
            stop_ids += tuple(sorted(tok.eog))     # llama.cpp ends a generation at any of them
        req = _Request(ids, params, max_tokens, stop_ids, n_keep, shift, embedding, pooling, normalize, sb)
        if tok is not None:
            # a detokenizer of its own: it holds the bytes of a character not yet complete
            req.text = TextStream(tok.detokenizer(skip_special=True), stop_texts)
            req.result.text = ""
        self._enqueue(req)
        return Handle(self, req)

    def _enqueue(self, req: _Request) -> None:
        with self._lock:
            # checked again under the lock: close() sets _closing under it, so a request is either
            # refused here or seen by whoever ends the requests (the loop, or close() itself)
            self._check_open("submit")
            if self._direct_busy:
                raise GGMLValueError("submit: a direct decode()/clear() is running on this runner")
            self._waiting.append(req)
            self._ensure_loop()
            self._lock.notify_all()

    def generate(self, prompt: str | Sequence[int], **kw) -> Completion:
        """Submit and wait: the :class:`Completion` of one request (see :meth:`submit`).

        A str prompt gives the generated text in ``Completion.text``.
        """
        return self.submit(prompt, **kw).result()

    def chat_prompt(self, messages: Sequence[dict], *, add_generation_prompt: bool = True,
                    tools: Optional[Sequence[dict]] = None, template: Optional[str] = None,
                    template_kwargs: Optional[dict] = None, allow_local_files: bool = False) -> list[int]:
        """The prompt ids :meth:`chat` uses for ``messages`` (see :func:`ggmlpy.runner.text.chat_prompt`).

        The chat template (the GGUF's, or ``template``) rendered with the messages (and ``tools``,
        ``template_kwargs`` such as ``enable_thinking``), tokenized with special tokens parsed and
        nothing added; BOS first when the tokenizer adds BOS and the text did not start with it, so
        there is exactly one whether the template writes ``bos_token`` (transformers' templates) or
        not (ChatML).

        Images (a runner with a vision encoder): a message's ``content`` may be a list of parts, with
        image parts as transformers' processors take them (``{"type": "image", "image": <image>}``, or
        ``"url"``/``"path"``) or as OpenAI's API sends them (``{"type": "image_url", "image_url": {"url":
        "data:image/png;base64,..."}}``), the image anything :func:`ggmlpy.vision.preprocess.load_image`
        reads. The template gets ``{"type": "image"}`` for each, and its placeholder for an image
        (:attr:`VisionModel.image_placeholder`, Gemma 3's ``<start_of_image>``) becomes the image's
        tokens as the model's processor writes them: the ids are the processor's ``input_ids``.

        Messages may carry what someone else wrote (a server relays them), so an image part that names
        a local file (a path or a ``file://`` URL) is refused unless ``allow_local_files=True``: nothing
        is read or looked up, and the error is the same whether the file exists or not. A ``data:`` URL,
        encoded bytes, a PIL image or an array is always taken. (A server built on this keeps the
        default.) Encoded images are read within :mod:`ggmlpy.vision.preprocess`'s bounds (size,
        formats, pixels).

        Raises
        ------
        TokenizerError
            No tokenizer, or no chat template in the file and none given.
        ChatTemplateError
            The template failed (its own ``raise_exception``, a loop, output over the limits).
        ImageError
            (:class:`ggmlpy.vision.preprocess.ImageError`) An image part naming a local file without
            ``allow_local_files``, or an image that cannot be read or is refused.
        GGMLValueError
            Image parts without a vision encoder, an image part without an image, or a template that
            did not write one placeholder per image.
        """
        return self.inputs.chat_ids(messages, "chat_prompt", dict(add_generation_prompt=add_generation_prompt,
                                                                  tools=tools, template=template,
                                                                  template_kwargs=template_kwargs), allow_local_files)

    def submit_chat(self, messages: Sequence[dict], *, add_generation_prompt: bool = True,
                    tools: Optional[Sequence[dict]] = None, template: Optional[str] = None,
                    template_kwargs: Optional[dict] = None, allow_local_files: bool = False, **kw) -> Handle:
        """Queue the assistant's reply to ``messages`` and return its :class:`Handle` (streams text).

        ``messages`` are dicts as transformers' chat templates take them (``{"role": "user",
        "content": "..."}``; roles ``system``, ``user``, ``assistant``, ``tool``); contents with image
        parts as :meth:`chat_prompt` says (local files only with ``allow_local_files=True``). The
        prompt is :meth:`chat_prompt`; the reply ends at any
        end-of-generation id of the tokenizer (done reason ``stop``), at a stop string, or at
        ``max_tokens``. Other keywords are :meth:`submit`'s (``max_tokens``, ``sampling``, ``stop``, ...). A
        later chat whose messages start with this one's reuses the cached prompt (the runner's prefix
        reuse, images compared by content), as long as the slot still holds it.

        Raises
        ------
        As :meth:`chat_prompt` and :meth:`submit`.
        """
        if "detokenize" in kw and not kw["detokenize"]:
            raise GGMLValueError("submit_chat: a chat always produces text (detokenize=False given)")
        kw.pop("detokenize", None)
        kw.pop("parse_special", None)        # the chat's text is the template's: its special tokens are parsed
        self._check_open("submit_chat")
        p = self.inputs.chat(messages, "submit_chat", dict(add_generation_prompt=add_generation_prompt, tools=tools,
                                                           template=template, template_kwargs=template_kwargs),
                             allow_local_files, images=kw.pop("images", ()), same_batch=kw.pop("same_batch", None))
        return self._queue(p, self._text_options(kw.pop("stop", ()), True, kw.get("embedding", False), True), **kw)

    def chat(self, messages: Sequence[dict], **kw) -> Completion:
        """Submit a chat and wait: the assistant's reply as a :class:`Completion` (``.text``); see
        :meth:`submit_chat`.

        Examples
        --------
        ``rt.chat([{"role": "user", "content": "Hi"}], max_tokens=64).text``
        """
        return self.submit_chat(messages, **kw).result()

    def embed(self, tokens: str | Sequence[int], pooling: str = "mean", normalize: bool = True) -> np.ndarray:
        """The pooled final hidden state of ``tokens`` (``float32[n_embd]``), whole input in one batch
        (a str is encoded as :meth:`submit` does)."""
        r = self.submit(tokens, embedding=True, pooling=pooling, normalize=normalize).result()
        return r.embedding

    def _wake(self) -> None:
        with self._lock:
            self._lock.notify_all()

    def _ensure_loop(self) -> None:
        """Start the loop thread if it is not running (lock held, runner open)."""
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name="ggmlpy-runner", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ the loop

    def _admit(self, wait_prev) -> None:
        """Move waiting requests into free slots (lock held); compact the cache if they left it fragmented."""
        admitted = False
        while self._waiting and len(self._active) < self.n_seq_max:
            req = self._waiting.popleft()
            if req.cancelled:
                self._finish(req, DoneReason.CANCEL)
                continue
            try:
                self._load_slot(req)
            except Exception as e:               # the request ends with it (its handle raises it)
                self._finish(req, DoneReason.ERROR, e)
                continue
            self._active[req.slot] = req
            admitted = True
        if admitted and self.defrag_thold is not None and self.cache.fragmentation() > self.defrag_thold:
            wait_prev()                      # rows move under the batch in flight otherwise
            self.cache.defrag()
            self.n_defrags += 1

    def _load_slot(self, req: _Request) -> None:
        """Take a slot (prefix reuse, the cache trimmed to it) and queue the rest of the prompt."""
        slot, n_past = self.slots.load_slot(req.prompt, cache_prompt=not req.embedding, same_batch=req.same_batch)
        req.slot = slot
        req.record = self.slots[slot]
        req.pending = deque(as_units(req.prompt[n_past:], req.same_batch[n_past:]))
        req.n_prompt_left = len(req.prompt) - n_past
        req.result.n_cached = n_past
        req.result.prompt_eval_count = len(req.prompt)
        req.t_start = time.perf_counter()

    def _finish(self, req: _Request, reason: str, error: Optional[BaseException] = None) -> None:
        """End a request on any path: result, stream end, slot freed (lock held).

        The request ends even when freeing its slot fails (that error is
        logged and, for a request that was not failing already, becomes its
        error): a waiting :meth:`Handle.result` must always return.
        """
        if req.finished.is_set():
            return
        r = req.result
        r.done_reason = reason
        r.error = error
        try:
            if req.text is not None and error is None:
                # ended between tokens (cancelled, the context full): the text held back goes out last
                tail = req.text.finish()
                if tail:
                    r.text += tail
                    req.events.put(TokenEvent(None, None, tail))
            if req.t_first is not None:
                r.eval_duration = time.perf_counter() - req.t_first
            ph = req.placeholder
            if ph is not None and ph.value is None:
                ph.fill(0)              # a row already built computes token 0: the cache then really holds 0
            req.pending = deque()
            if req.slot is not None:
                if self._active.get(req.slot) is req:
                    del self._active[req.slot]
                # a failed request's sequence may hold half-written cells (none to clear once closed)
                self.slots.free(req.slot, failed=error is not None and not self.closed)
        except Exception as e:
            log.exception("runner: freeing the slot of a finished request failed")
            if r.error is None:
                r.done_reason, r.error = DoneReason.ERROR, e
        finally:
            req.finished.set()
            req.events.put(None)
            self._lock.notify_all()              # wait_idle(), close() and direct calls watch _active

    def _shift(self, req: _Request) -> None:
        """Make room in a full context: drop tokens after n_keep (or clear and re-process)."""
        rec = req.record
        keep = min(req.n_keep, self.n_ctx - 1)
        discard = shift_discard(len(rec.tokens), keep, self.n_ctx, rec.same_batch)
        req.result.n_shifts += 1
        if discard <= 0:
            return
        redo = self.slots.shift(req.slot, keep, discard)
        if redo is not None:               # the cache could not shift: what it kept is computed again
            req.pending.extendleft(reversed(as_units(*redo)))
            req.n_prompt_left += len(redo[0])

    def _form_batch(self, wait_prev) -> Optional[_Batch]:
        """Fill a batch round-robin from ``_next_seq`` (lock held); None when nothing is pending.

        ``wait_prev()`` completes the batch in flight; it is called before
        anything that must not overlap its compute (a shift rewrites keys).
        """
        self._admit(wait_prev)
        for req in list(self._active.values()):
            if req.cancelled:
                wait_prev()
                self._finish(req, DoneReason.CANCEL)
        ready = [s for s in sorted(self._active) if self._active[s].pending]
        if not ready:
            return None
        order = [s for s in ready if s >= self._next_seq] + [s for s in ready if s < self._next_seq]
        embedding = self._active[order[0]].embedding
        toks: list = []
        pos, rows_seq, want, tied = [], [], [], []
        members = []
        limit = self.n_batch
        resume = None
        for slot in order:
            req = self._active.get(slot)
            if req is None or req.embedding != embedding or not req.pending:
                continue
            if embedding:
                if toks:
                    break
                limit = max(limit, len(req.pending))       # the whole input in one batch
            n_in = 0
            rec = req.record
            new_toks, new_sb = [], []                # what this batch adds to the slot's record
            while req.pending and len(toks) < limit:
                unit = req.pending[0]
                need = len(unit) if type(unit) is tuple else 1
                if need > limit:
                    if toks:
                        break                 # a group bigger than the batch goes first in the next one
                    limit = need
                if len(toks) + need > limit:
                    break
                if len(rec.tokens) + n_in + need > self.n_ctx:
                    if n_in:
                        break                 # never shift in the middle of a batch
                    wait_prev()
                    if req.finished.is_set():
                        break
                    if not req.shift or embedding or req.max_tokens == -2:     # -2: until the context is full
                        self._finish(req, DoneReason.LENGTH)
                        break
                    self._shift(req)
                    if len(rec.tokens) + need > self.n_ctx:
                        self._finish(req, DoneReason.LENGTH)
                        break
                    continue
                req.pending.popleft()
                p0 = len(rec.tokens) + n_in
                for j, tok in enumerate(unit if need > 1 else (unit,)):    # a same-batch group goes in whole
                    if type(tok) is _Placeholder:
                        tok.row, tok.record, tok.pos = len(toks), rec, p0 + j
                        new_toks.append(-1 if tok.value is None else tok.value)
                    else:
                        new_toks.append(tok)
                    new_sb.append(need - 1 if j == 0 else 0)
                    tied.append(j > 0)
                    pos.append(p0 + j)
                    toks.append(tok)
                    rows_seq.append(slot)
                    want.append(embedding)
                n_in += need
                req.n_prompt_left = max(req.n_prompt_left - need, 0)
            if n_in:
                self.slots.committed(slot, new_toks, new_sb)
            if req.finished.is_set():
                continue
            if n_in:
                # generation: one output row, the last input, once the prompt is all in
                has_out = embedding or req.n_prompt_left == 0
                if not embedding and has_out:
                    want[-1] = True
                members.append(_Member(req, n_in, has_out))
            if req.pending and resume is None:
                resume = slot
            if len(toks) >= limit:
                break
        if not toks:
            return None
        self._next_seq = resume if resume is not None else rows_seq[-1] + 1
        # the one change of container on a token's way: the batch's rows become the graph's int32 input
        tok_a = np.array([0 if isinstance(t, _Placeholder) and t.value is None else int(t) for t in toks],
                         dtype=np.int32)
        ubs = split_ubatches(self.n_ubatch, tok_a, np.asarray(pos, np.int64), np.asarray(rows_seq, np.int64), np.asarray(want),
                          np.asarray(tied, bool))
        starts = np.cumsum([0] + [len(ub.tokens) for ub in ubs])
        for t in toks:
            if isinstance(t, _Placeholder):
                k = int(np.searchsorted(starts, t.row, side="right")) - 1
                t.ubatch, t.row = ubs[k], t.row - int(starts[k])
        self.batch_sizes.append([len(ub.tokens) for ub in ubs])
        return _Batch(ubs, embedding, members)

    def _launch(self, batch: _Batch) -> None:
        """Compute a built batch: on the compute thread when pipelining (ggml releases the GIL), else here."""
        if not self.pipeline:
            self._prev = batch                # completed at once by the caller
            self._work(batch)
            return
        if self._worker is None or not self._worker.is_alive():
            # one long-lived thread: ggml's CPU backend (OpenMP) keeps a thread team per calling thread,
            # so a new thread per batch would pay for a new team every time
            self._jobs = queue.SimpleQueue()
            self._worker = threading.Thread(target=self._work_loop, args=(self._jobs,), name="ggmlpy-compute",
                                            daemon=True)
            self._worker.start()
        batch.done = threading.Event()
        self._inflight += 1
        self._prev = batch
        self._jobs.put(batch)

    def _work_loop(self, jobs) -> None:
        while True:
            batch = jobs.get()
            if batch is None:
                return
            try:
                self._work(batch)
            finally:
                batch.done.set()          # the loop waits on it: set on every path

    def _work(self, batch: _Batch) -> None:
        try:
            for ub in batch.ubatches:
                r = self._compute(ub)
                if r is not None:
                    batch.outputs.append(r)
        except BaseException as e:       # noqa: BLE001 - handed to _complete, which ends the batch's requests
            batch.error = e

    def _complete(self, batch: _Batch) -> None:
        """Wait for a batch, then sample, stream and feed each sequence's next input (lock held)."""
        if batch.done is not None:
            batch.done.wait()
            batch.done = None
            self._inflight -= 1
            self._lock.notify_all()
        self.n_batches += 1
        if batch.error is not None:
            _drop_graphs(batch)          # graphs of micro-batches not computed (or whose compute failed)
            for m in batch.members:
                self._finish(m.req, DoneReason.ERROR, batch.error)
            return
        out = np.concatenate(batch.outputs) if batch.outputs else None
        now = time.perf_counter()
        base = 0
        for m in batch.members:
            req = m.req
            if not m.has_out:
                continue
            n_rows = m.n_in if batch.embedding else 1
            rows = out[base:base + n_rows]
            base += n_rows
            if req.finished.is_set():
                continue
            if batch.embedding:
                req.result.embedding = _pool(rows, req.pooling, req.normalize)
                req.result.prompt_eval_duration = now - req.t_start
                self._finish(req, DoneReason.STOP)
                continue
            if req.cancelled:
                self._finish(req, DoneReason.CANCEL)
                continue
            row = rows[0]
            r = req.result
            text, stop_text = None, False
            try:
                tok = req.sampler.sample(row)
                lp = _logprobs(row, tok, req.params.top_logprobs) if req.params.logprobs else None
                if req.text is not None:
                    # the text is decided before the event goes out, so the last event carries the tail
                    if tok in req.stop:
                        text = req.text.finish()        # a stop token's own text is left out
                    else:
                        text, stop_text = req.text.feed(tok)
                        if not stop_text and req.max_tokens > 0 and r.eval_count + 1 >= req.max_tokens:
                            text += req.text.finish()
            except Exception as e:           # a sampling failure ends that request only (its handle raises it)
                self._finish(req, DoneReason.ERROR, e)
                continue
            if req.t_first is None:
                req.t_first = now
                r.prompt_eval_duration = now - req.t_start
            r.tokens.append(tok)
            r.eval_count += 1
            if lp is not None:
                r.logprobs.append(lp)
            if text is not None:
                r.text += text
            req.events.put(TokenEvent(tok, lp, text))
            ph = req.placeholder
            req.placeholder = None
            if ph is not None:
                ph.fill(tok)          # already in the next batch (or still pending): the real token now
            if tok in req.stop or stop_text:
                self._finish(req, DoneReason.STOP)
            elif req.max_tokens > 0 and r.eval_count >= req.max_tokens:
                self._finish(req, DoneReason.LENGTH)
            elif ph is None:
                req.pending.append(tok)

    def _wait_prev(self) -> None:
        """Complete the batch in flight, if any (lock held)."""
        p, self._prev = self._prev, None
        if p is not None:
            self._complete(p)

    def _loop(self) -> None:
        """The request loop (thread ``ggmlpy-runner``).

        It returns once close() was called and every request it knew has
        ended. An error escaping one round (a bug, an error in sampling
        bookkeeping...) ends every request with that error, so no handle is
        left waiting, and the loop goes on serving new requests.
        """
        self._prev: Optional[_Batch] = None
        self._building: Optional[_Batch] = None     # formed, not launched yet
        while True:
            try:
                if self._round():
                    return
            except BaseException as e:
                log.exception("runner: the request loop failed; every request it holds ends with the error")
                with self._lock:
                    self._abandon(e)
                    if not isinstance(e, Exception) or self._closing:
                        return
                    self._lock.wait(timeout=0.5)          # an error that repeats must not spin a core

    def _abandon(self, error: BaseException) -> None:
        """After a failed round: wait for the compute in flight, then end every request with ``error`` (lock held)."""
        p, self._prev = self._prev, None
        if p is not None and p.done is not None:
            p.done.wait()                 # the compute thread still reads this batch's graphs and cache
            p.done = None
            self._inflight -= 1
        for b in (p, self._building):
            if b is not None:
                _drop_graphs(b)
        self._building = None
        for req in list(self._active.values()) + list(self._waiting):
            self._finish(req, DoneReason.ERROR, error)
        self._waiting.clear()

    def _round(self) -> bool:
        """One batch: form it (lock held), build it (lock released), launch it. True once closing is done."""
        with self._lock:
            if self._closing:
                self._wait_prev()
                for req in list(self._active.values()) + list(self._waiting):
                    self._finish(req, DoneReason.CANCEL)
                self._waiting.clear()
                return True
            prev = self._prev
            if prev is not None:
                # a sequence waiting for prev's sample gets a placeholder as its next input,
                # so the next batch can be built while prev computes
                for m in prev.members:
                    req = m.req
                    if m.has_out and not prev.embedding and not req.pending and not req.finished.is_set():
                        req.placeholder = _Placeholder()
                        req.pending.append(req.placeholder)
            # an error forming the batch goes to _loop, which ends every request (queued ones too:
            # an error that repeats would otherwise keep them waiting forever)
            batch = self._form_batch(self._wait_prev)
            if batch is None and self._prev is None:
                if not self._active and not self._waiting:
                    self._lock.wait(timeout=0.5)
                return False
            self._building = batch
        if batch is not None:
            t0 = time.perf_counter()
            try:
                for ub in batch.ubatches:
                    self.step.build(ub, batch.embedding)
            except Exception as e:     # handed to the batch: _complete ends its requests with it
                batch.error = e
            if prev is not None and prev.done is not None and not prev.done.is_set():
                self.overlap_s += time.perf_counter() - t0
        with self._lock:
            self._wait_prev()
            if batch is None:
                return False
            if batch.error is not None:
                self._complete(batch)
                self._building = None
                return False
            self._launch(batch)
            self._building = None
            if not self.pipeline:
                self._wait_prev()
        return False

    # ------------------------------------------------------------------ teardown

    def close(self) -> None:
        """Stop serving and free the cache, the scheduler and the graphs.

        Requests not finished end with done reason ``cancel`` (a batch
        computing is completed first); a direct :meth:`decode` (or
        :meth:`decode_batch`, :meth:`clear`) running in another thread is
        waited for. When close() returns, every handle is done, no thread of
        the runner is alive, and every later call raises
        :class:`~ggmlpy.ClosedError`. Safe to call more than once, and from
        several threads (all return once the runner is closed).
        """
        with self._lock:
            first = not self._closing
            self._closing = True
            self._lock.notify_all()
        if not first:
            if threading.current_thread() not in (self._thread, self._worker):
                self._closed_event.wait()
            return
        try:
            t = self._thread
            if t is not None and t is not threading.current_thread():
                t.join()                      # it ends every request it holds, after its batch in flight
            with self._lock:
                while self._direct_busy:      # a direct decode() computing in another thread
                    self._lock.wait()
                # requests the loop never saw (it died, or never started) end here
                for req in list(self._active.values()) + list(self._waiting):
                    self._finish(req, DoneReason.CANCEL)
                self._waiting.clear()
        finally:
            self._free()

    def _free(self) -> None:
        """Stop the compute thread and free graphs, scheduler and cache (each once, every one tried)."""
        errors = []
        w = self._worker
        if w is not None:
            self._jobs.put(None)              # after the batch it may still be computing
            if w is not threading.current_thread():
                w.join()
        try:
            with self._lock:
                self.closed = True
                steps = []
                if self.rt is not None:
                    steps.append(self.rt.close)      # with the graphs it pooled
                steps.append(self.cache.close)
                for step in steps:
                    try:
                        step()
                    except Exception as e:
                        errors.append(e)
                self.rt = None
        finally:
            self._closed_event.set()          # a second close() never waits forever
        for e in errors[1:]:
            log.error("runner: another error while freeing: %r", e)
        if errors:
            raise errors[0]

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _available_host_memory() -> Optional[int]:
    """Bytes of host memory the machine has available now (Linux ``MemAvailable``; cgroup limits are not read),
    or None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import os

        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def _pool(hidden: np.ndarray, pooling: str, normalize: bool) -> np.ndarray:
    if pooling == "mean":
        v = hidden.mean(axis=0)
    elif pooling == "cls":
        v = hidden[0]
    else:
        v = hidden[-1]
    v = v.astype(np.float32)
    if normalize:
        n = float(np.linalg.norm(v))
        if n > 0:
            v = v / n
    return v
