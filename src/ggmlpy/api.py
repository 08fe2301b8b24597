"""The one call for the common case: :func:`open` loads a model and starts a runner over it.

Why a function named ``open`` (``ggmlpy.open``), and not a class such as llama-cpp-python's ``Llama`` or
vLLM's ``LLM``: what it gives is a resource opened from a file that must be closed, the way
``open()``, ``gzip.open``, ``tarfile.open``, ``sqlite3.connect`` or ``fsspec.open("hf://...")`` give
one, and it is used the same way, in a ``with`` block. What it returns is the ordinary
:class:`~ggmlpy.runner.Runner` (which owns its model), not a third kind of object beside
``load_model``'s model and the Runner with its own copy of their methods: everything a user learns
about it holds for a Runner they build themselves, and ``load_model`` + ``Runner`` remain the way
to share one model among runners. ``LLM`` would also misname the embedding and vision uses.
(``llama_cpp.Llama.from_pretrained`` downloads from the hub; a ``hf://`` path will do that here,
through :func:`~ggmlpy.load.load_model`.)

``open`` is not in ``ggmlpy.__all__``: ``from ggmlpy import *`` must not shadow the builtin.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Callable, Optional

from ggmlpy._core import GGMLValueError
from ggmlpy.defaults import DEFAULTS
from ggmlpy.load import load_model
from ggmlpy.runner import Runner

__all__ = ["open"]


def open(path: str | os.PathLike, *, devices: str | Sequence[str] = DEFAULTS["devices"],
         n_gpu_layers: int | str = DEFAULTS["n_gpu_layers"], n_ctx: int | str | None = None,
         n_batch: Optional[int] = None, n_ubatch: Optional[int] = None, n_seq_max: Optional[int] = None,
         n_threads: int = 0, flash_attn: Optional[bool] = None, type_k: Optional[str] = None,
         type_v: Optional[str] = None, mmproj: Optional[str | os.PathLike] = None, rpc: Sequence[str] = (),
         tensor_split: Optional[Sequence[float]] = None, tensor_overrides: Optional[str | Sequence] = None,
         n_cpu_moe: int = 0, mmap: bool = False, progress: Optional[Callable[[int, int], None]] = None,
         tokenizer=None, kernels: Optional[str] = None, vision_precision: str = "exact") -> Runner:
    """Load the model in ``path`` and start a :class:`~ggmlpy.runner.Runner` over it, which owns it:
    closing the runner (``close()``, the end of a ``with`` block) closes the model too.

    Defaults are :data:`ggmlpy.defaults.DEFAULTS`' (the table in ``docs/runner.md``), the same as the
    command line's. Other settings: ``load_model`` and ``Runner`` themselves, which this composes.

    Parameters
    ----------
    path : str or PathLike
        The GGUF file, passed to :func:`ggmlpy.load_model` as it is.
    devices, n_gpu_layers
        Where the weights go (:func:`ggmlpy.load_model`): by default every layer on the local
        accelerators when there are any, else the CPU (``devices="auto"``, ``n_gpu_layers=-1``, as
        ``ggmlpy run``); ``devices="cpu"`` keeps them on the CPU; ``n_gpu_layers="auto"`` offloads as
        many as fit with this runner's cache and graphs.
    n_ctx : int, optional
        Context per sequence: default 4096, at most the model's training context (``"auto"`` with
        ``n_gpu_layers="auto"``: the largest that fits, from the training context down).
    n_batch, n_ubatch, n_seq_max, n_threads, flash_attn, type_k, type_v, kernels, tokenizer
        The :class:`~ggmlpy.runner.Runner`'s settings (defaults there; with ``n_gpu_layers="auto"`` the
        placement is searched for these).
    mmproj, vision_precision, rpc, tensor_split, tensor_overrides, n_cpu_moe, mmap, progress
        :func:`ggmlpy.load_model`'s: a vision encoder (then prompts take images) and its numerics
        (``"exact"`` or ``"fast"``), RPC servers, the placement's options, the read.

    Returns
    -------
    Runner
        Started, with :attr:`~ggmlpy.runner.Runner.owns_model` set; ``runner.model`` is the model.

    Raises
    ------
    As :func:`ggmlpy.load_model` and :class:`~ggmlpy.runner.Runner` (a runner that cannot start
    closes the model it loaded); GGMLValueError for ``n_ctx="auto"`` without ``n_gpu_layers="auto"``.

    Examples
    --------
    ::

        with ggmlpy.open("model.gguf", n_ctx=4096) as llm:
            print(llm.generate("Hello", max_tokens=32).text)
            for ev in llm.chat([{"role": "user", "content": "Hi"}], stream=True):
                print(ev.text, end="")
    """
    if isinstance(n_ctx, str) and n_gpu_layers != "auto":
        raise GGMLValueError(f"open: n_ctx={n_ctx!r} is chosen by the placement search: give n_gpu_layers='auto' "
                             f"with it, or a number of tokens")
    runner_kw = dict(n_batch=n_batch, n_ubatch=n_ubatch, n_seq_max=n_seq_max, type_k=type_k, type_v=type_v,
                     flash_attn=flash_attn)
    # what a placement search (n_gpu_layers="auto") must leave room for: the settings given, the rest its defaults
    fit_kw = {k: v for k, v in {**runner_kw, "n_ctx": n_ctx}.items() if v is not None}
    model = load_model(path, devices=devices, n_gpu_layers=n_gpu_layers, progress=progress, rpc=rpc, mmap=mmap,
                       mmproj=mmproj, tensor_split=tensor_split, tensor_overrides=tensor_overrides,
                       n_cpu_moe=n_cpu_moe, vision_precision=vision_precision, **fit_kw)
    try:
        # n_ctx "auto": the searched context, which the runner takes from model.fit
        rt = Runner(model, n_ctx=None if isinstance(n_ctx, str) else n_ctx, n_threads=n_threads, tokenizer=tokenizer,
                    kernels=kernels, **runner_kw)
    except BaseException:
        model.close()
        raise
    rt.owns_model = True
    return rt
