"""The :class:`Runner`: a model with its cache and runtime, its public API, and its start and close.

The runner owns what one model needs to serve requests and direct calls: the cache (the model's
recipe), the runtime over the model's devices, the :class:`~.step.Step` that computes a micro-batch
with them, the :class:`~.slots.SlotTable` of what each cache sequence holds, and the
:class:`~.inputs.Inputs` that prepare prompts. The request loop is its base class
(:class:`~.loop.RequestLoop`), as are the direct calls (:class:`~.direct.DirectCalls`) and the embedding and
reranking calls (:class:`~.embeddings.EmbeddingCalls`). Details of every setting and option: ``docs/runner.md``.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
import time
from collections.abc import Sequence
from typing import Optional

from ggmlpy._core import (
    GGMLError,
    GGMLMemoryError,
    GGMLValueError,
    Type,
)
from ggmlpy._system import available_host_memory as _available_host_memory
from ggmlpy.backend import MemoryReport, Placement, Runtime, choose_devices
from ggmlpy.defaults import DEFAULTS, n_ctx_for
from ggmlpy.kvcache import CACHE_TYPES, V_TRANS_TYPES
from ggmlpy.models.kernels import KernelChoices
from ggmlpy.models.kernels import mode as kernel_mode
from ggmlpy.sampling import SamplingParams, gguf_sampling_defaults, sampling_params
from ggmlpy.sampling.params import sampling_keywords

from .direct import DirectCalls
from .embeddings import EmbeddingCalls
from .images import ImageStore
from .inputs import Inputs
from .loop import RequestLoop
from .requests import Completion, Handle, Stream
from .slots import SlotTable
from .state import check_state, fingerprint
from .step import Step
from .text import chat_constraint, split_stops

__all__ = ["Runner"]

log = logging.getLogger("ggmlpy")



#: the constructor's defaults for settings a fitted model may give instead (``n_ctx``: at most the model's
#: training context, :func:`ggmlpy.defaults.n_ctx_for`)
_DEFAULTS = {k: DEFAULTS[k] for k in ("n_ctx", "n_batch", "n_ubatch", "n_seq_max", "type_k", "type_v")}
#: ``n_seq_max`` when not given, for a non-causal model (an encoder): it keeps no cache per sequence, so a
#: batch of short inputs is that many sequences in one micro-batch
ENCODER_N_SEQ_MAX = 64


class Runner(DirectCalls, EmbeddingCalls, RequestLoop):
    """A model plus its cache, scheduler and request loop.

    Parameters
    ----------
    model
        A loaded model (:func:`ggmlpy.load_model`).
    n_ctx : int
        Context per sequence (default 4096, at most the model's training context).
    n_batch, n_ubatch : int
        Tokens per logical batch and per computed micro-batch (default 512 each; at most ``n_ctx``).
    n_seq_max : int
        Sequences served at once (default 1).
    n_threads : int
        CPU threads (0: all cores).
    flash_attn : bool, optional
        Attention by ``flash_attn_ext`` (default) or ``mul_mat`` + ``soft_max_ext``.
    type_k, type_v : str
        K and V cache types (default ``f16``; see :meth:`check_cache_types`).
    pipeline : bool, optional
        Build the next batch while the current one computes (default: when an accelerator computes).
    multi_user_cache, reuse_graphs, offload_kqv, op_offload, defrag_thold
        Ollama's and llama.cpp's switches of those names (defaults on, and 0.1).
    tokenizer, vision : optional
        Default the model's (``model.tokenizer``; ``load_model(..., mmproj=...)``).
    image_token : int, optional
        The id marking an image tile in a token-id prompt (default the vocabulary's).
    image_cache : int
        Encoded images kept for reuse (default 32).
    kernels : str, optional
        ``"measure"`` (default), ``"own"`` or ``"ggml"``: where ggmlpy's own CPU kernels replace ggml's
        ops (:attr:`kernels` holds the choices).

    Raises
    ------
    GGMLMemoryError
        The cache, the compute buffers or the host arrays do not fit (``.report`` says what was
        needed); nothing stays allocated.

    Notes
    -----
    Settings not given take those a placement search reserved for (``model.fit.runner_kwargs``), else
    the defaults (:data:`ggmlpy.defaults.DEFAULTS`). Each is described in full in ``docs/runner.md``.
    :func:`ggmlpy.open` loads a model and starts a runner over it in one call.

    :meth:`submit`, :meth:`generate` and :meth:`embed` may be called from any thread; the direct calls
    (:meth:`decode`, :meth:`decode_batch`, :meth:`clear`, the state) run one at a time while no request
    is served; :meth:`close` may be called from any thread at any time, after which every call raises
    :class:`~ggmlpy.ClosedError`.
    """

    #: Whether :meth:`close` closes :attr:`model` too: True for a runner that loaded its model
    #: (:func:`ggmlpy.open`), False for one given a model (which may serve other runners).
    owns_model: bool = False

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
        defaults = {**_DEFAULTS, "n_ctx": n_ctx_for(getattr(getattr(model, "config", None), "n_ctx_train", None))}
        v = {k: x if x is not None else fitted.get(k, defaults[k]) for k, x in given.items()}
        n_ctx, n_batch, n_ubatch, n_seq_max, type_k, type_v = (v[k] for k in given)
        if flash_attn is None:
            flash_attn = fitted.get("flash_attn")
        for name, v in (("n_ctx", n_ctx), ("n_batch", n_batch), ("n_ubatch", n_ubatch), ("n_seq_max", n_seq_max)):
            if int(v) < 1:
                raise GGMLValueError(f"runner: {name} must be >= 1 (got {v})")
        dtype_k, dtype_v, flash_attn = self.check_cache_types(type_k, type_v, flash_attn)
        kmode = kernel_mode(kernels)          # checked before anything is allocated
        self.model = model
        #: The sampling settings the model file recommends (its ``general.sampling.*`` keys, as
        #: :func:`~ggmlpy.sampling.gguf_sampling_defaults` reads them): a request's keyword not given
        #: takes them before the table's defaults, as llama.cpp applies them when the user set nothing.
        self.sampling_defaults = gguf_sampling_defaults(getattr(model, "sampling_metadata", None) or {})
        self._formats: dict = {}              # chat reply formats by template (see _chat_format)
        self._formats_lock = threading.Lock()
        self.n_ctx = int(n_ctx)
        causal = getattr(model, "causal", True)
        # a causal batch never exceeds the context; a non-causal one holds many sequences, each within it
        self.n_batch = min(int(n_batch), self.n_ctx) if causal else int(n_batch)
        self.n_ubatch = min(int(n_ubatch), self.n_batch)
        if not causal:
            # a non-causal model reads a batch in one micro-batch (llama.cpp asserts n_ubatch >= the batch;
            # llama-server sets n_batch = n_ubatch for embeddings)
            self.n_batch = self.n_ubatch
            if given["n_seq_max"] is None:
                # an encoder keeps nothing per sequence (its memory does not grow with them, so a fit's number
                # is no bound): the inputs of a batch are as many sequences
                n_seq_max = max(int(n_seq_max), ENCODER_N_SEQ_MAX)
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
        self._closed_event = threading.Event()
        self._init_loop()
        self.reuse_graphs = bool(reuse_graphs)
        self.defrag_thold = None if defrag_thold is None or defrag_thold < 0 else float(defrag_thold)
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
            # the scheduler computes the encoder's graphs too, which may be the larger (a vision tower deeper
            # than a small text model)
            nodes = max(model.graph_size(), self.vision.graph_size() if self.vision is not None else 0)
            self.rt = Runtime(model.placement.devices(), n_threads=n_threads, graph_size=2 * nodes,
                              report=self.report, reuse_graphs=self.reuse_graphs, op_offload=op_offload)
            self.cache.init(self.n_ctx, self.n_seq_max, self.n_ubatch, placement=self._cache_placement(),
                            report=self.report, runtime=self.rt)
            self.step = Step(model, self.cache, self.rt, flash_attn=self.flash_attn, vision=self.vision,
                             images=self.images, history=lambda seq: self.slots[seq].tokens)
            self.step.choose_kernels(kmode, self.n_ubatch, self.n_ctx,
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
            if t not in CACHE_TYPES:
                raise GGMLValueError(f"runner: {what} {t!r} is not a cache type; expected one of "
                                     f"{', '.join(CACHE_TYPES)}")
        dtype_k, dtype_v = CACHE_TYPES[tk], CACHE_TYPES[tv]
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
                f"mask and cache metadata of the worst-case batch, but {avail / 2**30:.2f} GiB are available; "
                f"lower n_ctx, n_seq_max or "
                f"n_ubatch\n{self.report}", self.report)

    def _check_vision(self, vision) -> None:
        vc = vision.config
        if not getattr(self.model, "EMBD_INPUT", False):
            raise GGMLValueError(f"runner: {self.model.config.arch} models take no image embeddings")
        if vc.n_embd_text != self.model.config.n_embd:
            raise GGMLValueError(f"runner: the vision encoder projects to {vc.n_embd_text} values, the text model's "
                                 f"embeddings have {self.model.config.n_embd} (a projector of another model?)")
        width = getattr(self.model, "embd_width", self.model.config.n_embd)
        if vc.n_embd_out != width:
            raise GGMLValueError(f"runner: the vision encoder gives {vc.n_embd_out} values a token "
                                 f"({len(vc.deepstack)} deepstack layers), the text model takes {width}")
        if vision.tie_images and vc.tokens_per_image > self.n_ubatch:
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

    def _check_seq_id(self, seq, what: str) -> int:
        s = int(seq)
        if not 0 <= s < self.n_seq_max:
            raise GGMLValueError(f"{what}: sequence {s} is out of range: this runner serves n_seq_max="
                                 f"{self.n_seq_max} sequences (0..{self.n_seq_max - 1})")
        return s

    @property
    def graphs_built(self) -> int:
        """Forward graphs built so far (not taken from the runtime's pool)."""
        return self.step.graphs_built if self.step is not None and self.rt is not None else 0

    @property
    def reallocations(self) -> int:
        """Times the compute buffers grew past the start-up reservation (0 when it covered every graph)."""
        return self.rt.reallocations if self.rt is not None else 0

    @property
    def image_token(self) -> int:
        """The token id that marks an image tile's place in a token-id prompt (see the class)."""
        return self.inputs.image_token

    def clear(self, seq: Optional[int] = None) -> None:
        """Forget one sequence's cache contents, or everything's (not while requests are served)."""
        self._check_open("clear")
        if seq is not None:
            seq = self._check_seq_id(seq, "clear")
        with self._direct("clear"):
            self.slots.clear(seq)

    def save_state(self, seq: int, path) -> int:
        """Save sequence ``seq``: its cache cells (positions, K/V of every layer) and the tokens they hold.

        A later :meth:`load_state` (this runner or another over the same model and cache types)
        continues it: the next :meth:`decode` gives the logits it would have given here (within float
        rounding where the cells land elsewhere), and a prompt starting with the saved tokens reuses
        them. The format is :mod:`ggmlpy.kvcache.state`'s, with the model's fingerprint and the tokens
        in its meta (:mod:`.state`); a path is written atomically. Direct use only, as :meth:`decode`.
        Returns the bytes written.
        """
        self._check_open("save_state")
        seq = self._check_seq_id(seq, "save_state")
        with self._direct("save_state"):
            if getattr(self.model, "POS_PER_TOKEN", 1) != 1 and any(t < -1 for t in self.slots[seq].tokens):
                # the record keeps image rows as this runner's own ids: the state could not say where the
                # tokens after an image rotate
                raise GGMLValueError(f"save_state: sequence {seq} holds images, and a {self.model.config.arch} "
                                     "model's positions after an image follow its grid, which a state does not "
                                     "carry; nothing was written")
            return self.slots.save(seq, path, {"model": fingerprint(self.model)})

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
            return self.slots.restore(seq, path, lambda meta, positions: check_state(
                meta, positions, self.model, self.cache, self.n_ctx))

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

    @sampling_keywords
    def submit(self, prompt: str | Sequence[int], *, max_tokens: int = DEFAULTS["max_tokens"],
               temperature: Optional[float] = None, top_k: Optional[int] = None, top_p: Optional[float] = None,
               min_p: Optional[float] = None, seed: Optional[int] = None, logprobs: Optional[bool] = None,
               top_logprobs: Optional[int] = None, sampling: Optional[SamplingParams] = None,
               stop: Sequence[int | str] = (), n_keep: int = 0, shift: bool = True, truncate: bool = False,
               embedding: bool = False, pooling: Optional[str] = None, normalize: bool | int = True,
               same_batch: Optional[Sequence[int]] = None, parse_special: bool = True,
               detokenize: Optional[bool] = None, images: Sequence = (), **settings) -> Handle:
        """Queue a request (thread-safe) and return its :class:`Handle`.

        Each option is described in full in ``docs/runner.md``.

        Parameters
        ----------
        prompt : str or token ids
            A str is encoded by :attr:`tokenizer` (:func:`~ggmlpy.runner.text.encode_prompt`).
        max_tokens : int
            Tokens to generate (default 128); ``-1`` no limit, ``-2`` until the context is full.
        temperature, top_k, top_p, min_p, seed : optional
            How the next token is sampled (:class:`~ggmlpy.sampling.SamplingParams`' fields); those not
            given take the defaults of :data:`ggmlpy.defaults.DEFAULTS`, as ``ggmlpy run`` does:
            temperature 0.8, top-k 40, top-p 0.95, min-p 0.05 and a fresh seed. ``temperature=0`` is
            greedy decoding; a seed makes a sampled request reproducible.
        logprobs, top_logprobs : optional
            Report the chosen token's log-probability, and that many most likely alternatives
            (``TokenEvent.logprobs``, ``Completion.logprobs``; default none).
        **settings
            Any other field of :class:`~ggmlpy.sampling.SamplingParams`, by name: llama.cpp's samplers
            (``repeat_penalty``, ``repeat_last_n``, ``frequency_penalty``, ``presence_penalty``,
            ``logit_bias``, ``typical_p``, ``top_n_sigma``, ``min_keep``, ``xtc_probability``,
            ``xtc_threshold``, ``dry_multiplier``, ``dry_base``, ``dry_allowed_length``,
            ``dry_penalty_last_n``, ``dry_sequence_breakers``, ``mirostat``, ``mirostat_tau``,
            ``mirostat_eta``, ``dynatemp_range``, ``dynatemp_exponent``, ``samplers``) and
            ``logits_processor``. A setting not given takes the model file's recommendation
            (``general.sampling.*``, :attr:`sampling_defaults`) if it has one, else the table's; an
            unknown name is a GGMLValueError.
        sampling : SamplingParams, optional
            The sampling settings as one object, instead of the keywords above (giving both is a
            GGMLValueError); taken whole (the file's recommendations do not apply).
        stop : token ids and str
            What ends the generation besides EOS (and, for text, the tokenizer's end-of-generation ids).
        n_keep, shift, truncate
            Tokens kept on a context shift (-1: the prompt); shift when full (else ``length``); cut a
            prompt longer than ``n_ctx`` (else :class:`InputTooLong`).
        embedding, pooling, normalize
            Return the input's embedding instead of generating (see :meth:`embed`): ``pooling`` one of
            ``none``, ``mean``, ``cls``, ``last``, ``rank`` (default: the model file's ``pooling_type``,
            else ``mean``), ``normalize`` as llama.cpp's ``embd_normalize`` (True: Euclidean).
        same_batch : list of int, optional
            Per prompt token, how many following tokens must share its micro-batch.
        parse_special : bool
            A str prompt's special-token texts become those tokens (default).
        detokenize : bool, optional
            Produce text (default: for a str prompt or a stop string).
        images : list
            Images, in prompt order, for a runner with a vision encoder: a str prompt marks each with
            ``<__media__>``, a token-id prompt with a run of :attr:`image_token` per tile.

        Raises
        ------
        GGMLValueError, InputTooLong
            A bad prompt, image or option (the message says which); ``sampling`` and a sampling keyword
            together. An image that cannot be read or used (an :class:`~ggmlpy.vision.preprocess.ImageError`,
            or a GGMLTypeError for its type) carries ``image_index``: its place among the prompt's images,
            from 0 (a chat's: among its messages' image parts, in order).
        GGMLTypeError
            A stop that is neither an int nor a str; a ``sampling`` that is not a SamplingParams.
        ClosedError
            The runner is closed (a request accepted before that ends with done reason ``cancel``).
        """
        self._check_open("submit")
        params = sampling_params("submit", sampling, self.sampling_defaults, temperature=temperature, top_k=top_k,
                                 top_p=top_p, min_p=min_p, seed=seed, logprobs=logprobs, top_logprobs=top_logprobs,
                                 **settings)
        text = self._text_options(stop, detokenize, embedding, isinstance(prompt, str))
        p = self.inputs.prompt(prompt, "submit", images=images, same_batch=same_batch, parse_special=parse_special)
        return self._queue(p, text, max_tokens=max_tokens, sampling=params, n_keep=n_keep, shift=shift,
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

    @sampling_keywords
    def generate(self, prompt: str | Sequence[int], *, max_tokens: int = DEFAULTS["max_tokens"],
                 temperature: Optional[float] = None, top_k: Optional[int] = None, top_p: Optional[float] = None,
                 min_p: Optional[float] = None, seed: Optional[int] = None, logprobs: Optional[bool] = None,
                 top_logprobs: Optional[int] = None, sampling: Optional[SamplingParams] = None,
                 stop: Sequence[int | str] = (), stream: bool = False, n_keep: int = 0, shift: bool = True,
                 truncate: bool = False, embedding: bool = False, pooling: Optional[str] = None,
                 normalize: bool | int = True, same_batch: Optional[Sequence[int]] = None, parse_special: bool = True,
                 detokenize: Optional[bool] = None, images: Sequence = (), **settings) -> Completion | Stream:
        """Generate a continuation of ``prompt``: wait for its :class:`Completion`, or with ``stream=True``
        iterate its tokens as they come.

        A str prompt gives text (``Completion.text``, ``TokenEvent.text``), a list of token ids gives
        ids (``Completion.tokens``). The parameters are :meth:`submit`'s, sampling included (temperature
        0.8, top-k 40, top-p 0.95, min-p 0.05 unless given; ``temperature=0`` is greedy), and:

        Parameters
        ----------
        stream : bool
            Return a :class:`~ggmlpy.runner.Stream` at once instead of waiting: an iterator of
            :class:`TokenEvent` s that ends with the request; closing it early (or leaving the loop
            over it) cancels the request. ``Stream.result()`` is then the Completion.

        Returns
        -------
        Completion, or Stream with ``stream=True``.

        Raises
        ------
        As :meth:`submit`; GGMLValueError for ``stream=True`` with ``embedding=True`` (nothing to stream).
        A request that fails inside the runner raises :class:`RunnerError` (from the stream's iteration).

        Examples
        --------
        ``rt.generate("Once upon a time", max_tokens=32, temperature=0.7, seed=1).text``, or
        ``for ev in rt.generate("Once upon a time", stream=True): print(ev.text, end="")``
        """
        if stream and embedding:
            raise GGMLValueError("generate: an embedding request generates no tokens to stream (stream=True and "
                                 "embedding=True given)")
        h = self.submit(prompt, max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                        min_p=min_p, seed=seed, logprobs=logprobs, top_logprobs=top_logprobs, sampling=sampling,
                        stop=stop, n_keep=n_keep, shift=shift, truncate=truncate, embedding=embedding,
                        pooling=pooling, normalize=normalize, same_batch=same_batch, parse_special=parse_special,
                        detokenize=detokenize, images=images, **settings)
        return Stream(h) if stream else h.result()

    def chat_prompt(self, messages: Sequence[dict], *, add_generation_prompt: bool = True,
                    tools: Optional[Sequence[dict]] = None, template: Optional[str] = None,
                    template_kwargs: Optional[dict] = None, allow_local_files: bool = False) -> list[int]:
        """The prompt ids :meth:`chat` uses for ``messages``: the chat template (the GGUF's, or
        ``template``) rendered and tokenized with exactly one BOS (:func:`~ggmlpy.runner.text.chat_prompt`).

        A message's ``content`` may hold image parts (``{"type": "image", "image": ...}`` or OpenAI's
        ``{"type": "image_url", ...}``); their tokens are written as the model's processor writes them.
        An image part naming a local file is refused unless ``allow_local_files=True`` (messages may
        come from someone else). Details in ``docs/runner.md``.

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

    @sampling_keywords
    def submit_chat(self, messages: Sequence[dict], *, add_generation_prompt: bool = True,
                    tools: Optional[Sequence[dict]] = None, tool_choice: str | dict | None = None,
                    response_format: Optional[dict] = None, template: Optional[str] = None,
                    template_kwargs: Optional[dict] = None, allow_local_files: bool = False,
                    max_tokens: int = DEFAULTS["max_tokens"], temperature: Optional[float] = None,
                    top_k: Optional[int] = None, top_p: Optional[float] = None, min_p: Optional[float] = None,
                    seed: Optional[int] = None, logprobs: Optional[bool] = None, top_logprobs: Optional[int] = None,
                    sampling: Optional[SamplingParams] = None, stop: Sequence[int | str] = (), n_keep: int = 0,
                    shift: bool = True, truncate: bool = False, embedding: bool = False, pooling: Optional[str] = None,
                    normalize: bool | int = True, same_batch: Optional[Sequence[int]] = None,
                    detokenize: Optional[bool] = None, images: Sequence = (), **settings) -> Handle:
        """Queue the assistant's reply to ``messages`` and return its :class:`Handle` (streams text).

        The prompt is :meth:`chat_prompt`'s (its keywords, up to ``allow_local_files``); the other
        keywords are :meth:`submit`'s, sampling included (temperature 0.8, top-k 40, top-p 0.95, min-p
        0.05 unless given; ``temperature=0`` is greedy). ``detokenize`` may only be True: a chat always
        produces text. A later chat whose messages start with this one's reuses the cached prompt,
        images compared by content.

        The reply is parsed in the format of the chat template's model family (:func:`ggmlpy.chat.chat_format`:
        Hermes/Qwen, Llama 3.x, Mistral, gpt-oss, DeepSeek, Qwen3 thinking, Functionary, Command-R...):
        ``Completion.content``, ``Completion.reasoning`` and ``Completion.tool_calls`` (name, arguments
        as parsed JSON, id), and each streamed :class:`TokenEvent`'s ``deltas``.

        Parameters
        ----------
        tool_choice : str or dict, optional
            OpenAI's: ``"auto"`` (default: the model may call a tool), ``"none"`` (the tools are not
            shown to the model and no call is parsed), ``"required"`` (the output is constrained to one
            call of one of ``tools`` in the template's format, its arguments valid under the tool's
            schema), or ``{"type": "function", "function": {"name": ...}}`` (that tool).
        response_format : dict, optional
            OpenAI's: ``{"type": "json_object"}`` (any JSON object), ``{"type": "json_schema",
            "json_schema": {"schema": ...}}`` or ``{"type": "text"}``: the output constrained by
            :class:`~ggmlpy.sampling.grammar.Grammar`. Not with ``grammar``/``json_schema`` or a
            forced tool call.

        Raises
        ------
        As :meth:`chat_prompt` and :meth:`submit`; GGMLValueError for ``detokenize=False``, an unknown
        ``tool_choice``, a schema or grammar that does not compile, or two constraints at once.
        """
        if detokenize is not None and not detokenize:
            raise GGMLValueError("submit_chat: a chat always produces text (detokenize=False given)")
        self._check_open("submit_chat")
        if not embedding:
            self._check_generates("submit_chat")
        params = sampling_params("submit_chat", sampling, self.sampling_defaults, temperature=temperature,
                                 top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, logprobs=logprobs,
                                 top_logprobs=top_logprobs, **settings)
        if tool_choice == "none":
            tools = None                      # the model is not shown the tools, and no call is parsed
        fmt = None if embedding else self._chat_format(template, tools, template_kwargs)
        params = chat_constraint(params, fmt, tools, tool_choice, response_format)
        # the chat's text is the template's: its special tokens are always parsed
        p = self.inputs.chat(messages, "submit_chat", dict(add_generation_prompt=add_generation_prompt, tools=tools,
                                                           template=template, template_kwargs=template_kwargs),
                             allow_local_files, images=images, same_batch=same_batch)
        return self._queue(p, self._text_options(stop, True, embedding, True), max_tokens=max_tokens,
                           sampling=params, n_keep=n_keep, shift=shift, truncate=truncate, embedding=embedding,
                           pooling=pooling, normalize=normalize, reply=fmt.stream() if fmt is not None else None)

    def _chat_format(self, template: Optional[str], tools, template_kwargs: Optional[dict]):
        """The reply format of this chat's template (:func:`ggmlpy.chat.chat_format`), kept per template,
        tools and template options (finding it renders the template once)."""
        from ggmlpy.chat import chat_format

        source = template if template is not None else getattr(self.tokenizer, "chat_template", None)
        if not isinstance(source, str):
            return None
        key = (source, json.dumps(tools, sort_keys=True, default=str),
               json.dumps(template_kwargs or {}, sort_keys=True, default=str))
        with self._formats_lock:
            fmt = self._formats.get(key)
        if fmt is None:
            fmt = chat_format(source, tools=tools, **(template_kwargs or {}))
            with self._formats_lock:
                if len(self._formats) >= 16:
                    self._formats.pop(next(iter(self._formats)))
                self._formats[key] = fmt
        return fmt

    @sampling_keywords
    def chat(self, messages: Sequence[dict], *, add_generation_prompt: bool = True,
             tools: Optional[Sequence[dict]] = None, tool_choice: str | dict | None = None,
             response_format: Optional[dict] = None, template: Optional[str] = None,
             template_kwargs: Optional[dict] = None, allow_local_files: bool = False,
             max_tokens: int = DEFAULTS["max_tokens"], temperature: Optional[float] = None,
             top_k: Optional[int] = None, top_p: Optional[float] = None, min_p: Optional[float] = None,
             seed: Optional[int] = None, logprobs: Optional[bool] = None, top_logprobs: Optional[int] = None,
             sampling: Optional[SamplingParams] = None, stop: Sequence[int | str] = (), stream: bool = False,
             n_keep: int = 0, shift: bool = True, truncate: bool = False, embedding: bool = False,
             pooling: Optional[str] = None, normalize: bool | int = True, same_batch: Optional[Sequence[int]] = None,
             detokenize: Optional[bool] = None, images: Sequence = (), **settings) -> Completion | Stream:
        """The assistant's reply to ``messages``: wait for its :class:`Completion` (``.text``), or with
        ``stream=True`` iterate its tokens (``ev.text``) as they come.

        The parameters are :meth:`submit_chat`'s, sampling included (temperature 0.8, top-k 40, top-p
        0.95, min-p 0.05 unless given; ``temperature=0`` is greedy), and ``stream`` as in :meth:`generate`
        (a :class:`~ggmlpy.runner.Stream`; closing it early cancels the reply).

        Raises
        ------
        As :meth:`submit_chat`; GGMLValueError for ``stream=True`` with ``embedding=True``.

        Examples
        --------
        ``rt.chat([{"role": "user", "content": "Hi"}], max_tokens=64).text``, or
        ``for ev in rt.chat(messages, stream=True): print(ev.text, end="")``
        """
        if stream and embedding:
            raise GGMLValueError("chat: an embedding request generates no tokens to stream (stream=True and "
                                 "embedding=True given)")
        h = self.submit_chat(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                             tool_choice=tool_choice, response_format=response_format, template=template,
                             template_kwargs=template_kwargs, allow_local_files=allow_local_files,
                             max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                             seed=seed, logprobs=logprobs, top_logprobs=top_logprobs, sampling=sampling, stop=stop,
                             n_keep=n_keep, shift=shift, truncate=truncate, embedding=embedding, pooling=pooling,
                             normalize=normalize, same_batch=same_batch, detokenize=detokenize, images=images,
                             **settings)
        return Stream(h) if stream else h.result()

    def close(self) -> None:
        """Stop serving and free the cache, the scheduler and the graphs.

        Requests not finished end with done reason ``cancel`` (a batch
        computing is completed first); a direct :meth:`decode` (or
        :meth:`decode_batch`, :meth:`clear`) running in another thread is
        waited for. When close() returns, every handle is done, no thread of
        the runner is alive, and every later call raises
        :class:`~ggmlpy.ClosedError`. Safe to call more than once, and from
        several threads (all return once the runner is closed). A runner that
        owns its model (:attr:`owns_model`, :func:`ggmlpy.open`) closes it
        last.
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
            self._stop_loop()
        finally:
            try:
                self._free()
            finally:
                if self.owns_model:
                    self.model.close()

    def _free(self) -> None:
        """Stop the compute thread and free graphs, scheduler and cache (each once, every one tried)."""
        errors = []
        self._stop_worker()
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
