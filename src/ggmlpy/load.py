"""Opening a model file: the architecture's class from the registry, placement, allocation, loading."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from typing import Callable, Optional

from ggmlpy._core import GGMLValueError
from ggmlpy.backend import (
    Placement,
    choose_devices,
    n_cpu_moe_overrides,
    parse_tensor_overrides,
    split_layers,
)
from ggmlpy.defaults import DEFAULTS
from ggmlpy.gguf import open_reader
from ggmlpy.hub import local_files
from ggmlpy.models import Model, model_class
from ggmlpy.models.fingerprint import weights_fingerprint

__all__ = ["load_model"]


def load_model(path: str | os.PathLike, devices: str | Sequence[str] = DEFAULTS["devices"],
               n_gpu_layers: int | str = DEFAULTS["n_gpu_layers"],
               progress: Optional[Callable[[int, int], None]] = None, rpc: Sequence[str] = (),
               load: bool = True, check_tensors: bool = False, mmap: bool = False, repack: bool = True,
               fuse: bool = True, mmproj: Optional[str | os.PathLike] = None, placement: Optional[Placement] = None,
               *, n_ctx: int | str | None = None, n_ctx_min: int = 2048, n_seq_max: int = DEFAULTS["n_seq_max"],
               n_batch: int = DEFAULTS["n_batch"], n_ubatch: int = DEFAULTS["n_ubatch"],
               type_k: str = DEFAULTS["type_k"], type_v: str = DEFAULTS["type_v"], flash_attn: Optional[bool] = None,
               margin: Optional[int | dict] = None, memory: Optional[dict] = None,
               tensor_split: Optional[Sequence[float]] = None,
               tensor_overrides: Optional[str | Sequence] = None, n_cpu_moe: int = 0,
               vision_precision: str = "exact") -> Model:
    """Open a GGUF file, pick its architecture's model class, place and allocate its weights, and load them.

    Parameters
    ----------
    path : the GGUF file; the first shard of a split model (``model-00001-of-00003.gguf``, as llama.cpp's
        ``gguf-split`` writes it: every shard is loaded, the metadata from the first; see
        :mod:`ggmlpy.gguf.split`); or a Hugging Face hub reference, ``"hf://ORG/REPO:Q4_K_M"`` (the file
        with that quant tag, as llama.cpp's ``-hf``), ``"hf://ORG/REPO/FILE.gguf"`` or ``"hf://ORG/REPO"``
        (Q4_K_M, else Q8_0, else the only model), downloaded into the hub's cache if it is not there
        (``HF_HUB_OFFLINE=1``: only from the cache); see :mod:`ggmlpy.hub`
    devices : ``"auto"`` (default: every local accelerator, then the CPU), ``"cpu"`` or device names (see
        :func:`ggmlpy.backend.choose_devices`)
    n_gpu_layers : how many of the last layers go to accelerators (-1, the default: all), or ``"auto"``: as many as
        fit, found by trying allocations (:mod:`ggmlpy.runner.fit`): each try allocates the weights (no
        data read), the KV cache and the worst-case graphs of a runner with ``n_ctx``, ``n_seq_max``,
        ``n_batch``, ``n_ubatch``, ``type_k``, ``type_v``, ``flash_attn`` on every device, and reads what
        each device needed; the devices are filled in order (``devices``: local GPUs, then RPC servers,
        the CPU last), the last layers first and the output layer after every repeating one, each
        within its free memory minus ``margin``; the data is then read once. ``model.fit`` (also in
        ``model.report``) lists the tries and why; ``Runner(model)`` takes the fitted ``n_ctx``.
    placement : an explicit :class:`~ggmlpy.backend.Placement` (device per layer, output, input), instead
        of ``devices`` and ``n_gpu_layers``
    n_ctx, n_ctx_min, n_seq_max, n_batch, n_ubatch, type_k, type_v, flash_attn : with
        ``n_gpu_layers="auto"``, the runner the placement must leave room for. ``n_ctx="auto"`` starts at
        the model's training context and halves it, not below ``n_ctx_min``, while the model does not
        fit wholly on the accelerators (llama.cpp's ``--fit`` order); a number is never changed; None (the
        default) is the runner's default, 4096 or the training context if smaller. The defaults of
        these and of ``devices``/``n_gpu_layers`` are :data:`ggmlpy.defaults.DEFAULTS`'.
    margin : with ``"auto"``, bytes left free on each device (an int, or a dict by device name); default
        10 % of each device's memory, at most 512 MiB
    memory : with ``"auto"``, a cap in bytes per device name (``{"CPU": 8 << 30}``) below its free memory
    tensor_split : the proportions of the offloaded layers per accelerator, in ``devices`` order
        (llama.cpp's ``--tensor-split``, e.g. ``[3, 1]``); default: by each one's free memory. Not with
        ``n_gpu_layers="auto"``.
    tensor_overrides : weights by name on another device than their layer's, as llama.cpp's ``-ot``:
        ``"PATTERN=DEVICE,..."`` or a list of ``"PATTERN=DEVICE"`` / ``(pattern, device)``, e.g.
        ``"ffn_.*_exps=CPU"`` keeps a MoE's experts on the CPU with its layers on the GPU (ggml's scheduler
        runs each product where its weight is, or takes a prompt's to the GPU: op offload). Regular
        expressions searched in the file's tensor names; the first match wins
        (:func:`~ggmlpy.backend.parse_tensor_overrides`). The memory report counts those weights on
        their device (``model.weights.overridden`` lists them) and ``"auto"`` fits around them. A
        pattern that matches no weight is warned about.
    n_cpu_moe : keep the expert weights of the first ``n_cpu_moe`` layers on the CPU (llama.cpp's
        ``--n-cpu-moe``; overrides after ``tensor_overrides``)
    progress : ``progress(done_bytes, total_bytes)`` while loading (e.g. ``backend.ProgressBar()``)
    rpc : RPC server endpoints to add
    load : False to stop after allocation (the memory report is then available; call ``model.load()``)
    check_tensors : check every weight for NaN/inf while loading (a few rows of each are always checked)
    mmap : read the weights through a memory map of the file (llama.cpp's mmap load mode; they are still
        copied into ggmlpy's weight buffers: no zero-copy use of the mapping) instead of with read(2)
    repack : put matrix weights in the CPU's extra buffer types where ggml has kernels for them (as
        llama.cpp's ``--repack 1``, its default: Q4_0 1.8x the prompt speed on an AVX-512 CPU);
        False keeps every weight in plain memory, where it can be read back
    fuse : concatenate each layer's Q/K/V and gate/up weights into one matrix each where their types
        agree (fewer, larger matrix products; the same results); see :class:`LlamaModel`
    mmproj : the model's vision encoder, an mmproj GGUF file (``convert_hf_to_gguf.py --mmproj``): loaded
        as ``model.vision`` (:func:`ggmlpy.vision.load_mmproj`), on the device of the output layer, its
        weights in the model's memory report; a :class:`~ggmlpy.runner.Runner` then takes images.
        Closed with the model. An ``hf://`` reference too; ``"hf://ORG/REPO"`` alone is the repository's
        vision encoder for the model (``mmproj*.gguf``, chosen as llama.cpp's ``-hf`` chooses it).
    vision_precision : the vision encoder's numerics, ``"exact"`` (default: features ~1e-6 of transformers')
        or ``"fast"`` (ggml's flash attention and GELU table, as llama.cpp's mtmd: ~1e-3, faster); see
        :class:`~ggmlpy.vision.VisionModel`

    Raises
    ------
    FileNotFoundError, ggmlpy.gguf.GGUFError
        No file, or not a valid GGUF file: a corrupt header, a tensor table that does not tile the
        file, a tensor the hyperparameters leave unused, weights that are not finite or do not look
        like their type.
    ggmlpy.gguf.MetadataError, ggmlpy.gguf.MetadataTypeError
        A hyperparameter missing, out of range, not finite, of the wrong type, or contradicting the
        file's tensors (``block_count`` vs. the ``blk.N`` layers present, sizes vs. shapes); the
        message names the key and the file. Checked before anything is sized from it.
    UnknownArchitecture, MissingTensor, GGMLValueError
        The file's architecture has no model class, or uses a variant it cannot build.
    GGMLMemoryError
        A device has no room for its weights (``.report`` says what was needed); with ``"auto"``, no
        placement fits (the message lists the tries, ``.report`` is the last one's; nothing stays
        allocated).
    ggmlpy.hub.HubError
        An ``hf://`` reference that does not resolve or cannot be fetched (a GGMLValueError; the message
        names the repository and the file).
    """
    path, mmproj = local_files(path, mmproj)        # hf:// references: files in the hub's cache
    overrides = ()
    if tensor_overrides is not None:
        choose_devices(devices, rpc=rpc)        # RPC servers first: an override may name their devices
        overrides = parse_tensor_overrides(tensor_overrides)
    n_cpu_moe_overrides(n_cpu_moe, 0)           # its value checked before anything is read
    if isinstance(n_gpu_layers, str):
        if n_gpu_layers != "auto":
            raise GGMLValueError(f"load_model: n_gpu_layers must be an integer or 'auto' (got {n_gpu_layers!r})")
        if tensor_split is not None:
            raise GGMLValueError("load_model: tensor_split and n_gpu_layers='auto' together; give one (the fit "
                                 "divides the layers by each device's free memory)")
        if placement is not None:
            raise GGMLValueError("load_model: placement and n_gpu_layers='auto' together; give one")
        if not load:
            raise GGMLValueError("load_model: n_gpu_layers='auto' loads the model (load=False given)")
        from ggmlpy.runner.fit import fit_model

        return fit_model(path, devices=devices, rpc=rpc, n_ctx=n_ctx, n_ctx_min=n_ctx_min, n_seq_max=n_seq_max,
                         n_batch=n_batch, n_ubatch=n_ubatch, type_k=type_k, type_v=type_v, flash_attn=flash_attn,
                         margin=margin, memory=memory, progress=progress, check_tensors=check_tensors, mmap=mmap,
                         open_model=lambda p: load_model(path, placement=p, load=False, repack=repack, fuse=fuse,
                                                         mmproj=mmproj), overrides=overrides,
                         n_cpu_moe=n_cpu_moe)
    reader = open_reader(path)         # a split model's first shard: every shard, read as one file
    try:
        cls = model_class(reader.metadata.get("general.architecture"), str(path))
        n_layer = cls.read_config(reader, str(path)).n_layer      # the placement needs the layer count first
        if placement is None:
            devs = choose_devices(devices, rpc=rpc)
            placement = split_layers(n_layer, devs, n_gpu_layers,
                                     "memory" if tensor_split is None else list(tensor_split))
        elif placement.n_layers != n_layer:
            raise GGMLValueError(f"load_model: the placement has {placement.n_layers} layers, {path} has {n_layer}")
        overrides += n_cpu_moe_overrides(n_cpu_moe, n_layer)
        if overrides:
            placement = replace(placement, overrides=placement.overrides + overrides)
        model = cls(reader, placement, repack=repack, fuse=fuse)
    except BaseException:
        reader.close()
        raise
    try:
        # what a saved KV state must match (Runner.load_state): computed now, from the file as loaded
        model.weights_fingerprint = weights_fingerprint(reader)
        if mmproj is not None:
            from ggmlpy.vision import load_mmproj

            if not getattr(model, "EMBD_INPUT", False):
                raise GGMLValueError(f"{path}: {model.config.arch} models take no image embeddings (mmproj given)")
            model.vision = load_mmproj(mmproj, placement=model.placement, report=model.report, load=False,
                                       precision=vision_precision)
        if load:
            model.load(progress, check_tensors, mmap=mmap)
            if mmproj is not None:
                model.vision.load(progress, check_tensors=check_tensors)
    except BaseException:
        model.close()
        raise
    return model
