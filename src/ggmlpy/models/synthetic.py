"""Synthetic models: deterministic random weights written as a real GGUF file.

The benchmark needs a model on a fresh machine with nothing downloaded. This
module writes one: a GGUF with the shapes of a known model
(llama2.c's *stories* models, TinyLlama) and random weights drawn from a seeded
numpy generator, in one of :data:`ARCHS`: ``llama`` (the default), ``qwen3``
(per-head Q/K norms), ``qwen3moe`` (8 experts, 2 used per token, each expert
an eighth of the dense feed-forward, so the parameter count stays close),
``gemma3`` (Q/K norms, post-norms, GeGLU, tied output, 5 sliding-window layers
of 512 then one global, as llama.cpp assumes), ``lfm2`` (LFM2's short
convolutions of 3 taps, attention in every third layer), ``granitehybrid`` (Granite 4.0 H:
Mamba-2 layers, attention without RoPE in every fourth, Granite's multipliers), ``qwen3next`` (Qwen3-Next:
gated DeltaNet layers, gated attention in every fourth, 8 experts and a shared one), ``qwen35`` and
``qwen35moe`` (Qwen3.5's: qwen3next's layers, a dense feed-forward or qwen3next's experts), ``deepseek2``
(multi-head latent attention, the first layer dense, then 8 experts in 4 groups with a shared
one and sigmoid routing: DeepSeek-V3's layout scaled to the size), ``glm4moe`` (GLM-4.5's:
Q/K/V biases, Q/K norms, half of each head rotated, DeepSeek's experts without groups) or ``llama4``
(Llama 4's: dense and MoE layers in turn, 8 experts with one used and a shared one, chunked attention in
three layers of four and NoPE in the fourth, as llama.cpp assumes for a file without the keys), each
with the metadata keys
and tensor names llama.cpp's loader reads. The file has no tokenizer (``tokenizer.ggml.model = "none"``
plus ``llama.vocab_size``), which llama.cpp also loads, so the same file can be
benchmarked by llama.cpp for a side-by-side comparison.

Sizes are nominal names (``"tiny"``, ``"15M"``, ``"42M"``, ``"110M"``,
``"1B"``); the parameter count of the written file is a little larger for the
llama2.c shapes because ``output.weight`` is written as its own matrix instead of
being tied to ``token_embd.weight`` (``"110M"`` has 134M parameters; :func:`size_list`
gives every size's count). A count names a size only when it is that size's, nominal or
written, within 15% (:func:`parse_size`): ``7B`` is refused, not replaced by another size.

Examples
--------
>>> from ggmlpy.models.synthetic import parse_size
>>> parse_size("100m")
'110M'
"""

from __future__ import annotations

import functools
import math
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np

from ggmlpy._cache import cache_dir
from ggmlpy._core import GGMLValueError
from ggmlpy._files import replacing

from .synthetic_layout import _QWEN_HYBRID, matrix_type, tensor_specs

__all__ = [
    "ARCHS", "PRESETS", "SIZES", "TYPES", "SyntheticConfig", "for_arch", "cache_dir", "matrix_type", "parse_size",
    "size_list", "synthetic_path", "tensor_specs", "write_synthetic",
]

#: Bumped whenever the written content changes, so cached files are not reused.
FORMAT_VERSION = 1

#: llama.cpp's ``LLAMA_FTYPE`` numbers for ``general.file_type``.
FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q8_0": 7, "Q4_K_M": 15}

#: Weight types the generator writes for the 2-D matrices. ``Q4_K_M`` is llama.cpp's mix of that name:
#: Q4_K, with Q6_K for ``output`` and for ``attn_v``/``ffn_down`` in the layers that get more bits; a matrix
#: whose rows are not a multiple of 256 falls back as llama.cpp's quantizer does (:func:`matrix_type`).
TYPES = ("F32", "F16", "Q8_0", "Q4_0", "Q4_K_M")

#: Standard deviation of the random matrix entries (norm weights are 1).
WEIGHT_STD = 0.02

#: The architectures the generator writes (``general.architecture``).
ARCHS = ("llama", "qwen3", "qwen3moe", "gemma3", "lfm2", "granitehybrid", "qwen3next", "qwen35", "qwen35moe",
         "deepseek2", "glm4moe", "llama4")


@dataclass(frozen=True)
class SyntheticConfig:
    """The hyper-parameters of one synthetic llama model.

    Parameters
    ----------
    name : str
        Nominal size name (the key in :data:`SIZES`).
    n_embd, n_layer, n_head, n_head_kv, n_ff, n_vocab, n_ctx : int
        The usual llama hyper-parameters (``n_ctx`` is the training context
        written as ``llama.context_length``).
    shape_of : str
        The public model whose shape this copies.
    """

    name: str
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int
    n_ctx: int
    shape_of: str = ""
    rope_freq_base: float = 10000.0
    rms_eps: float = 1e-5
    arch: str = "llama"
    n_expert: int = 0            # qwen3moe: experts per layer, used per token, rows of one expert
    n_expert_used: int = 0
    n_ff_exp: int = 0
    sliding_window: int = 0      # gemma3: window of the local layers
    rope_freq_base_swa: float = 10000.0
    n_embd_head: int = 0         # head size where it is not n_embd / n_head (Qwen3: 128)
    tied: bool = False           # the output head is token_embd.weight (no output.weight)
    nominal: float = 0.0         # the parameter count a preset stands for (its name is not a count)
    recurrent_layers: tuple = ()  # lfm2, granitehybrid: the recurrent layers (convolutions, Mamba-2; others attend)
    conv_l_cache: int = 3        # lfm2: taps of each convolution
    ssm_d_state: int = 128       # granitehybrid: Mamba-2 state size, head size (the inner width is 2 n_embd), groups
    ssm_head_dim: int = 64
    ssm_n_group: int = 1
    n_ff_shexp: int = 0          # granitehybrid with experts: the shared expert's width
    # deepseek2 (multi-head latent attention, DeepSeek's mixture of experts): the query's compressed size
    # (0: none), the latent's, the rotated part of a query head (n_embd_head: its whole size), a head's output
    # size; shared experts (each n_ff_exp wide), leading dense layers, expert groups and those kept per token
    n_lora_q: int = 0
    n_lora_kv: int = 0
    n_rot: int = 0
    n_embd_head_v: int = 0
    n_expert_shared: int = 0
    n_dense_lead: int = 0
    n_group: int = 0
    n_group_used: int = 0
    moe_step: int = 0            # llama4: every moe_step-th layer has the experts (interleave_moe_layer_step)

    @property
    def head_dim(self) -> int:
        """Size of one attention head."""
        return self.n_embd_head or self.n_embd // self.n_head

    @property
    def n_params(self) -> int:
        """Number of parameters written (embeddings, output and all blocks)."""
        return sum(math.prod(shape) for _, shape, _ in tensor_specs(self))

    @property
    def nominal_params(self) -> float:
        """The parameter count the name stands for (``110M`` -> 110e6)."""
        if self.nominal:
            return self.nominal
        return _size_number(self.name) if self.name != "tiny" else float(self.n_params)


#: The sizes :func:`write_synthetic` knows, by nominal name.
SIZES: dict[str, SyntheticConfig] = {
    c.name: c for c in (
        SyntheticConfig("tiny", 64, 2, 4, 2, 192, 512, 2048, "test model"),
        SyntheticConfig("15M", 288, 6, 6, 6, 768, 32000, 2048, "llama2.c stories15M"),
        SyntheticConfig("42M", 512, 8, 8, 8, 1376, 32000, 2048, "llama2.c stories42M"),
        SyntheticConfig("110M", 768, 12, 12, 12, 2048, 32000, 2048, "llama2.c stories110M"),
        SyntheticConfig("1B", 2048, 22, 32, 4, 5632, 32000, 2048, "TinyLlama 1.1B"),
        # the shapes users run (grouped-query attention, vocabularies of 128k-152k, tied heads), each
        # in its own family's architecture
        SyntheticConfig("llama3.2-1B", 2048, 16, 32, 8, 8192, 128256, 131072, "Llama-3.2-1B",
                        rope_freq_base=500000.0, tied=True, nominal=1.24e9),
        SyntheticConfig("llama3.2-3B", 3072, 28, 24, 8, 8192, 128256, 131072, "Llama-3.2-3B",
                        rope_freq_base=500000.0, tied=True, nominal=3.21e9),
        SyntheticConfig("qwen3-1.7B", 2048, 28, 16, 8, 6144, 151936, 40960, "Qwen3-1.7B", rope_freq_base=1e6,
                        rms_eps=1e-6, arch="qwen3", n_embd_head=128, tied=True, nominal=1.72e9),
        SyntheticConfig("qwen3-4B", 2560, 36, 32, 8, 9728, 151936, 40960, "Qwen3-4B", rope_freq_base=1e6,
                        rms_eps=1e-6, arch="qwen3", n_embd_head=128, tied=True, nominal=4.02e9),
        SyntheticConfig("qwen3-8B", 4096, 36, 32, 8, 12288, 151936, 40960, "Qwen3-8B", rope_freq_base=1e6,
                        rms_eps=1e-6, arch="qwen3", n_embd_head=128, nominal=8.19e9),
        # 24 of Qwen3-30B-A3B's 48 layers (15.6B parameters: Q4_K_M in 9 GB, the whole model would not
        # leave room on a 24 GB machine); per token it reads what the real model's first half does
        SyntheticConfig("qwen3-30B-A3B-24L", 2048, 24, 32, 4, 6144, 151936, 40960,
                        "Qwen3-30B-A3B, 24 of its 48 layers", rope_freq_base=1e6, rms_eps=1e-6, arch="qwen3moe",
                        n_embd_head=128, n_expert=128, n_expert_used=8, n_ff_exp=768, nominal=15.6e9),
        # LFM2-1.2B: 10 short-convolution layers and 6 attention layers (its config's full_attn_idxs)
        SyntheticConfig("lfm2-1.2B", 2048, 16, 32, 8, 8192, 65536, 128000, "LFM2-1.2B", rope_freq_base=1e6,
                        arch="lfm2", tied=True, nominal=1.17e9,
                        recurrent_layers=tuple(i not in (2, 5, 8, 10, 12, 14) for i in range(16))),
        # llama.cpp's granitehybrid 7B-A1B (n_embd 1536, experts 512 wide: Granite-4.0-H-Tiny): 40 layers, attention
        # in 4, 64 experts of which 6 per token and a shared one, Mamba-2 of 48 heads of 64 and a 128 state
        SyntheticConfig("granitehybrid-7B-A1B", 1536, 40, 12, 4, 512, 100352, 131072,
                        "Granite-4.0-H-Tiny's layout (llama.cpp's granitehybrid 7B-A1B)", arch="granitehybrid",
                        tied=True, n_expert=64, n_expert_used=6, n_ff_exp=512, n_ff_shexp=1024, nominal=6.94e9,
                        recurrent_layers=tuple(i % 10 != 5 for i in range(40))),
        # GLM-4.5-Air's widths (96 heads of 128 over 8 KV heads, half of each rotated, its 128 experts of 1408
        # with 8 used and 1 shared, its 151k vocabulary) in 8 of its 46 layers (the first dense, as its): 17.9B
        # parameters, Q4_K_M in about 11 GB; per token it reads what the real model's first 8 layers do
        SyntheticConfig("glm4.5-air-8L", 4096, 8, 96, 8, 10944, 151552, 131072, "GLM-4.5-Air, 8 of its 46 layers",
                        rope_freq_base=1e6, arch="glm4moe", n_embd_head=128, n_rot=64, n_expert=128, n_expert_used=8,
                        n_ff_exp=1408, n_expert_shared=1, n_dense_lead=1, nominal=17.9e9),
        # DeepSeek-V3's widths (128 heads of latent attention, its 1.5k/512 compressions, 2k-wide experts, its
        # 129k vocabulary) in 12 of its 61 layers (the first 3 dense, as its) with 32 of its 256 experts (8
        # used, in 8 groups of which 4 are kept, 1 shared): 18.4B parameters, Q4_K_M in about 11 GB
        SyntheticConfig("deepseek-v3-12L-32E", 7168, 12, 128, 1, 18432, 129280, 163840,
                        "DeepSeek-V3, 12 of its 61 layers and 32 of its 256 experts", rms_eps=1e-6, arch="deepseek2",
                        n_embd_head=192, n_expert=32, n_expert_used=8, n_ff_exp=2048, n_lora_q=1536, n_lora_kv=512,
                        n_rot=64, n_embd_head_v=128, n_expert_shared=1, n_dense_lead=3, n_group=8, n_group_used=4,
                        nominal=18.4e9),
        # Llama-4-Scout's widths (40 heads of 128 over 8 KV heads, 8k-wide experts with one used and a shared
        # one, every layer MoE, its 202k vocabulary) in 8 of its 48 layers with 8 of its 16 experts: 11.6B
        # parameters, Q4_K_M in about 7 GB; per token it reads what the real model's first 8 layers do
        SyntheticConfig("llama4-scout-8L-8E", 5120, 8, 40, 8, 16384, 202048, 10485760,
                        "Llama-4-Scout-17B-16E, 8 of its 48 layers and 8 of its 16 experts", rope_freq_base=500000.0,
                        arch="llama4", n_embd_head=128, n_expert=8, n_expert_used=1, n_ff_exp=8192, moe_step=1,
                        nominal=11.6e9),
        # Qwen3-Next-80B-A3B's widths (16 attention heads of 256 over 2 KV heads with a rotary quarter, 16 DeltaNet
        # key heads and 32 value heads of 128, its 512-wide experts with 10 used and a shared one, its 152k
        # vocabulary) in 12 of its 48 layers (gated attention in every fourth, as its) with 128 of its 512 experts:
        # 5.9B parameters (as transformers' Qwen3NextForCausalLM so cut), Q4_K_M in about 3.6 GB; per token it
        # reads what the real model's first 12 layers do
        SyntheticConfig("qwen3-next-12L-128E", 2048, 12, 16, 2, 5120, 151936, 262144,
                        "Qwen3-Next-80B-A3B, 12 of its 48 layers and 128 of its 512 experts", rope_freq_base=1e7,
                        rms_eps=1e-6, arch="qwen3next", n_embd_head=256, n_expert=128, n_expert_used=10,
                        n_ff_exp=512, n_ff_shexp=512, ssm_d_state=128, ssm_n_group=16, nominal=5.88e9,
                        recurrent_layers=tuple((i + 1) % 4 != 0 for i in range(12))),
    )
}

#: The real-shape presets (the sizes after the llama2.c and TinyLlama shapes): what the benchmark's
#: tables at the sizes users run are measured on.
PRESETS = ("llama3.2-1B", "llama3.2-3B", "qwen3-1.7B", "qwen3-4B", "qwen3-8B", "qwen3-30B-A3B-24L", "lfm2-1.2B",
           "granitehybrid-7B-A1B", "glm4.5-air-8L", "deepseek-v3-12L-32E", "llama4-scout-8L-8E",
           "qwen3-next-12L-128E")

def for_arch(cfg: SyntheticConfig, arch: str | None) -> SyntheticConfig:
    """``cfg``'s shape as architecture ``arch`` (one of :data:`ARCHS`), with that family's usual settings;
    ``None`` or the config's own architecture keeps it as it is (a preset's family settings)."""
    if arch is None or str(arch).lower() == cfg.arch and cfg.name in PRESETS:
        return cfg
    arch = str(arch).lower()
    if arch not in ARCHS:
        raise GGMLValueError(f"synthetic model architecture {arch!r}: expected one of {', '.join(ARCHS)}")
    if arch == "llama":
        return replace(cfg, arch=arch)
    if arch == "qwen3":
        return replace(cfg, arch=arch, rope_freq_base=1e6, rms_eps=1e-6)
    if arch == "qwen3moe":
        return replace(cfg, arch=arch, rope_freq_base=1e6, rms_eps=1e-6, n_expert=8, n_expert_used=2,
                       n_ff_exp=max(32, cfg.n_ff // 8 // 32 * 32))
    if arch == "lfm2":
        # LFM2's mix: attention in every third layer (its 16-layer models attend in 6), from the second (so the
        # 2-layer tiny size has one: llama.cpp does not run an lfm2 file without attention layers)
        return replace(cfg, arch=arch, rope_freq_base=1e6, tied=True,
                       recurrent_layers=tuple(i % 3 != 1 for i in range(cfg.n_layer)))
    if arch == "granitehybrid":
        # Granite 4.0 H's mix: attention in every fourth layer (from the second), Mamba-2 (heads of 64, state 128)
        # in the others; a dense feed-forward (Micro's)
        return replace(cfg, arch=arch, tied=True, ssm_head_dim=min(64, cfg.n_embd), ssm_d_state=min(128, cfg.n_embd),
                       recurrent_layers=tuple(i % 4 != 1 for i in range(cfg.n_layer)))
    if arch in _QWEN_HYBRID:
        # Qwen3-Next's mix: gated attention in every fourth layer (from the second, so the 2-layer tiny size has
        # one), gated DeltaNet in the others (heads of the attention head size up to 128, twice as many value
        # heads as key heads, values n_embd wide); 8 experts, 2 used, and a shared one
        ds = min(128, cfg.head_dim)
        f = max(32, cfg.n_ff // 8 // 32 * 32)
        moe = arch != "qwen35"
        return replace(cfg, arch=arch, rope_freq_base=1e7, rms_eps=1e-6, n_expert=8 * moe, n_expert_used=2 * moe,
                       n_ff_exp=f * moe, n_ff_shexp=f * moe, ssm_d_state=ds, ssm_n_group=max(1, cfg.n_embd // (2 * ds)),
                       recurrent_layers=tuple(i % 4 != 1 for i in range(cfg.n_layer)))
    if arch == "deepseek2":
        # DeepSeek-V3's proportions at this width: heads of a position-free part as wide as the llama head
        # and a rotated part half that, compressions a third of n_embd (whole K-quant blocks from 768 on),
        # 8 experts of an eighth of the dense width, 2 used, in 4 groups of which 2 are kept, 1 shared,
        # the first layer dense; every row a whole number of 32-value blocks
        hd = cfg.head_dim
        nope, rot = max(32, hd), max(16, hd // 2)
        lora = max(256, cfg.n_embd // 3 // 256 * 256) if cfg.n_embd >= 768 else max(32, cfg.n_embd // 3 // 32 * 32)
        return replace(cfg, arch=arch, n_head_kv=1, rms_eps=1e-6, n_embd_head=nope + rot, n_rot=rot,
                       n_embd_head_v=nope, n_lora_q=lora, n_lora_kv=lora, n_expert=8, n_expert_used=2,
                       n_ff_exp=max(32, cfg.n_ff // 8 // 32 * 32), n_expert_shared=1,
                       n_dense_lead=1 if cfg.n_layer > 1 else 0, n_group=4, n_group_used=2)
    if arch == "glm4moe":
        # GLM-4.5's proportions: half of each head rotated, Q/K/V biases and Q/K norms, 8 experts of an eighth
        # of the dense width (2 used, 1 shared, no groups), the first layer dense
        return replace(cfg, arch=arch, rope_freq_base=1e6, n_rot=cfg.head_dim // 2, n_expert=8, n_expert_used=2,
                       n_ff_exp=max(32, cfg.n_ff // 8 // 32 * 32), n_expert_shared=1,
                       n_dense_lead=1 if cfg.n_layer > 1 else 0, n_group=0, n_group_used=0)
    if arch == "llama4":
        # Llama 4's: dense and MoE layers in turn (Maverick's step; the tiny size's second layer has the experts),
        # 8 experts of a quarter of the dense width, 1 used, and a shared one as wide; heads of 128 at most; 4
        # layers at least, so that the fourth is NoPE (llama.cpp asserts on a file without one: its temperature
        # input would be in no graph)
        return replace(cfg, arch=arch, rope_freq_base=500000.0, n_embd_head=min(128, cfg.head_dim), n_expert=8,
                       n_expert_used=1, n_ff_exp=max(32, cfg.n_ff // 4 // 32 * 32), moe_step=2,
                       n_layer=max(4, cfg.n_layer))
    return replace(cfg, arch=arch, rope_freq_base=1e6, rms_eps=1e-6, sliding_window=min(512, cfg.n_ctx // 4))


_SUFFIX = {"": 1.0, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}


def _size_number(text: str) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kKmMbBgGtT]?)\s*", text)
    if not m:
        raise GGMLValueError(
            f"synthetic model size {text!r}: expected a name ({', '.join(SIZES)}) "
            "or a parameter count such as 110M or 1B")
    value = float(m.group(1)) * _SUFFIX[m.group(2).upper()]
    if value <= 0:
        raise GGMLValueError(f"synthetic model size {text!r} must be positive")
    return value


#: How far a parameter count may be from a size's (its nominal count or the count it writes) and still name it:
#: ``100M`` names ``110M``, ``7B`` names nothing (the nearest, ``qwen3-8B``, writes 8.2B).
SIZE_TOLERANCE = 1.15


def _count_label(n: float) -> str:
    """``134M``, ``1.1B``: a parameter count as the model column of the benchmark's table writes it."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale or unit == "K":
            v = n / scale
            return (f"{v:.1f}" if v < 10 else f"{v:.0f}").replace(".0", "") + unit
    return str(n)


def size_list() -> str:
    """The built-in sizes with the parameters each writes: ``tiny (0.1M), 15M (24M), ...``."""
    return ", ".join(f"{name} ({_count_label(cfg.n_params)})" for name, cfg in SIZES.items())


def parse_size(size: str) -> str:
    """The entry of :data:`SIZES` that ``size`` names.

    Parameters
    ----------
    size : str
        A name of :data:`SIZES` (case-insensitive) or a parameter count such as
        ``"110M"``, ``"0.1B"`` or ``"42m"``; a count names the entry whose nominal
        count or written count it is within :data:`SIZE_TOLERANCE` of (the nearest
        such), and no other: a size that is not built in is refused, not replaced.

    Returns
    -------
    str
        The key in :data:`SIZES`.

    Raises
    ------
    ValueError
        ``size`` is neither a name nor a count, or a count of no built-in size (the
        message lists them, with the parameters each writes).
    """
    key = str(size).strip()
    for name in SIZES:
        if key.lower() == name.lower():
            return name
    value = _size_number(key)

    def distance(name: str) -> float:
        cfg = SIZES[name]
        return min(abs(math.log(cfg.nominal_params / value)), abs(math.log(cfg.n_params / value)))

    best = min(SIZES, key=distance)
    if distance(best) > math.log(SIZE_TOLERANCE):
        raise GGMLValueError(f"synthetic model size {key!r} is not built in; the built-in sizes (and the parameters "
                             f"each writes) are {size_list()}")
    return best


def _normalize_type(type: str) -> str:
    t = str(getattr(type, "name", type)).upper()
    if t not in TYPES:
        raise GGMLValueError(f"synthetic model type {type!r}: expected one of {', '.join(TYPES)}")
    return t


def _metadata(cfg: SyntheticConfig, type: str, seed: int) -> list[tuple[str, object, str]]:
    """(key, value, value type name) in the order they are written."""
    md: list[tuple[str, object, str]] = [
        ("general.name", f"ggmlpy synthetic {cfg.name} {type}", "STRING"),
        ("general.description", f"random weights (seed {seed}) in the shape of {cfg.shape_of}",
         "STRING"),
        ("general.file_type", FILE_TYPES[type], "UINT32"),
    ]
    if type not in ("F32", "F16"):
        md.append(("general.quantization_version", 2, "UINT32"))
    a = cfg.arch
    md += [
        (f"{a}.vocab_size", cfg.n_vocab, "UINT32"),
        (f"{a}.context_length", cfg.n_ctx, "UINT32"),
        (f"{a}.embedding_length", cfg.n_embd, "UINT32"),
        (f"{a}.block_count", cfg.n_layer, "UINT32"),
        (f"{a}.feed_forward_length", cfg.n_ff, "UINT32"),
        (f"{a}.attention.head_count", cfg.n_head, "UINT32"),
        # lfm2: one per layer, 0 for a convolution layer (as llama.cpp's converter writes it)
        (f"{a}.attention.head_count_kv", [0 if c else cfg.n_head_kv for c in cfg.recurrent_layers], "ARRAY")
        if cfg.recurrent_layers and a not in _QWEN_HYBRID else
        (f"{a}.attention.head_count_kv", cfg.n_head_kv, "UINT32"),
        # qwen3next rotates a quarter of each head (partial rotary), deepseek2 and glm4moe their n_rot
        (f"{a}.rope.dimension_count", cfg.head_dim // 4 if a in _QWEN_HYBRID else cfg.n_rot or cfg.head_dim,
         "UINT32"),
        (f"{a}.rope.freq_base", cfg.rope_freq_base, "FLOAT32"),
        (f"{a}.attention.layer_norm_rms_epsilon", cfg.rms_eps, "FLOAT32"),
    ]
    if a == "deepseek2":
        md += _deepseek2_metadata(cfg)
    elif a == "glm4moe":
        md += [(f"{a}.attention.key_length", cfg.head_dim, "UINT32"),
               (f"{a}.attention.value_length", cfg.head_dim, "UINT32"),
               (f"{a}.leading_dense_block_count", cfg.n_dense_lead, "UINT32"),
               (f"{a}.expert_shared_count", cfg.n_expert_shared, "UINT32"),
               (f"{a}.expert_gating_func", 2, "UINT32"), (f"{a}.expert_weights_norm", True, "BOOL"),
               (f"{a}.expert_weights_scale", 2.5, "FLOAT32")]
    elif a == "llama4":
        # no chunk size or temperature keys: llama.cpp's 8192, as its converter writes the released models
        md += [(f"{a}.attention.key_length", cfg.head_dim, "UINT32"),
               (f"{a}.attention.value_length", cfg.head_dim, "UINT32"),
               (f"{a}.interleave_moe_layer_step", cfg.moe_step, "UINT32")]
    elif a != "llama" or cfg.n_embd_head:         # (the llama files stay as they were: no format change)
        md += [(f"{a}.attention.key_length", cfg.head_dim, "UINT32"),
               (f"{a}.attention.value_length", cfg.head_dim, "UINT32")]
    if cfg.n_expert:
        md += [(f"{a}.expert_count", cfg.n_expert, "UINT32"), (f"{a}.expert_used_count", cfg.n_expert_used, "UINT32"),
               (f"{a}.expert_feed_forward_length", cfg.n_ff_exp, "UINT32")]
    if cfg.sliding_window:
        md += [(f"{a}.attention.sliding_window", cfg.sliding_window, "UINT32"),
               (f"{a}.rope.freq_base_swa", cfg.rope_freq_base_swa, "FLOAT32")]
    if cfg.recurrent_layers and a == "lfm2":
        md += [(f"{a}.shortconv.l_cache", cfg.conv_l_cache, "UINT32")]
    if a == "granitehybrid":
        # Granite 4.0 H: Mamba-2 with an inner width of 2 n_embd, no RoPE, Granite's multipliers
        di = 2 * cfg.n_embd
        md += [(f"{a}.ssm.conv_kernel", 4, "UINT32"), (f"{a}.ssm.inner_size", di, "UINT32"),
               (f"{a}.ssm.state_size", cfg.ssm_d_state, "UINT32"),
               (f"{a}.ssm.time_step_rank", di // cfg.ssm_head_dim, "UINT32"),
               (f"{a}.ssm.group_count", cfg.ssm_n_group, "UINT32"), (f"{a}.rope.scaling.finetuned", False, "BOOL"),
               (f"{a}.embedding_scale", 12.0, "FLOAT32"), (f"{a}.residual_scale", 0.22, "FLOAT32"),
               (f"{a}.attention.scale", 1.0 / cfg.head_dim, "FLOAT32"), (f"{a}.logit_scale", 6.0, "FLOAT32")]
        if cfg.n_ff_shexp:
            md += [(f"{a}.expert_shared_feed_forward_length", cfg.n_ff_shexp, "UINT32")]
    if a in _QWEN_HYBRID:
        ds, nk = cfg.ssm_d_state, cfg.ssm_n_group
        if cfg.n_expert:
            md += [(f"{a}.expert_shared_feed_forward_length", cfg.n_ff_shexp, "UINT32")]
        if a != "qwen3next":
            # Qwen3.5's multimodal RoPE sections (llama.cpp requires them), split as the released models' 11 + 11 +
            # 10 of 32: llama.cpp interleaves them (pair i in section i % 3), so each must cover its third of the
            # rotated pairs; for text every section has the same position (a pair outside them would not rotate)
            half = cfg.head_dim // 8
            md += [(f"{a}.rope.dimension_sections", [(half + 2) // 3, (half + 1) // 3, half // 3, 0], "ARRAY")]
        md += [(f"{a}.ssm.conv_kernel", 4, "UINT32"), (f"{a}.ssm.state_size", ds, "UINT32"),
               (f"{a}.ssm.group_count", nk, "UINT32"), (f"{a}.ssm.time_step_rank", 2 * nk, "UINT32"),
               (f"{a}.ssm.inner_size", 2 * nk * ds, "UINT32"),
               (f"{a}.attention.recurrent_layers", list(cfg.recurrent_layers), "ARRAY")]
    md += [
        ("tokenizer.ggml.model", "none", "STRING"),
        ("ggmlpy.synthetic.size", cfg.name, "STRING"),
        ("ggmlpy.synthetic.seed", int(seed), "UINT32"),
        ("ggmlpy.synthetic.format_version", FORMAT_VERSION, "UINT32"),
    ]
    return md


def _deepseek2_metadata(cfg: SyntheticConfig) -> list[tuple[str, object, str]]:
    """deepseek2's keys as llama.cpp's converter writes them for DeepSeek-V3: the latent cache row as the key
    length (one KV head), the heads' sizes as the ``_mla`` lengths, sigmoid routing with groups, renormalised
    and scaled by 2.5."""
    a = "deepseek2"
    md = [(f"{a}.attention.key_length", cfg.n_lora_kv + cfg.n_rot, "UINT32"),
          (f"{a}.attention.value_length", cfg.n_lora_kv, "UINT32"),
          (f"{a}.attention.key_length_mla", cfg.head_dim, "UINT32"),
          (f"{a}.attention.value_length_mla", cfg.n_embd_head_v, "UINT32"),
          (f"{a}.attention.kv_lora_rank", cfg.n_lora_kv, "UINT32"),
          (f"{a}.leading_dense_block_count", cfg.n_dense_lead, "UINT32"),
          (f"{a}.expert_shared_count", cfg.n_expert_shared, "UINT32")]
    if cfg.n_lora_q:
        md.append((f"{a}.attention.q_lora_rank", cfg.n_lora_q, "UINT32"))
    if cfg.n_expert:
        md += [(f"{a}.expert_gating_func", 2, "UINT32"), (f"{a}.expert_weights_norm", True, "BOOL"),
               (f"{a}.expert_weights_scale", 2.5, "FLOAT32")]
    if cfg.n_group:
        md += [(f"{a}.expert_group_count", cfg.n_group, "UINT32"),
               (f"{a}.expert_group_used_count", cfg.n_group_used, "UINT32")]
    return md


def _random_matrix(shape: tuple[int, ...], seed: int, index: int) -> np.ndarray:
    # One generator per tensor: a tensor's values do not depend on the others.
    rng = np.random.default_rng([int(seed), index])
    out = rng.standard_normal(shape, dtype=np.float32)
    out *= np.float32(WEIGHT_STD)
    return out


def write_synthetic(path: str | os.PathLike, size: str | SyntheticConfig = "110M", type: str = "F16", seed: int = 0,
                    progress: Callable[[int, int], None] | None = None, arch: str | None = None) -> Path:
    """Write a GGUF file with deterministic random weights.

    Parameters
    ----------
    path : str or PathLike
        Where to write (overwritten).
    size : str or SyntheticConfig
        A size name or parameter count, see :func:`parse_size`, or a shape of one's own.
    type : {"F32", "F16", "Q8_0", "Q4_0", "Q4_K_M"}
        Type of the 2-D matrices (``token_embd`` and ``output`` included; for
        ``Q4_K_M`` see :data:`TYPES`); the norm weights are F32.
    seed : int
        Seed of the weights: the same seed gives the same file.
    progress : callable, optional
        Called as ``progress(done, total)`` with the number of parameters
        generated so far.
    arch : str, optional
        One of :data:`ARCHS` (default: the config's, ``llama`` for a size name).

    Returns
    -------
    pathlib.Path
        ``path``.

    Examples
    --------
    >>> import tempfile, os
    >>> from ggmlpy import gguf
    >>> p = write_synthetic(os.path.join(tempfile.mkdtemp(), "tiny.gguf"), "tiny")
    >>> gguf.GGUFReader(p).metadata["llama.block_count"]
    2
    """
    from ggmlpy import gguf

    cfg = size if isinstance(size, SyntheticConfig) else SIZES[parse_size(size)]
    if arch is not None:
        cfg = for_arch(cfg, arch)
    type = _normalize_type(type)
    path = Path(path)
    specs = tensor_specs(cfg)
    total = sum(math.prod(s) for _, s, _ in specs)
    w = gguf.GGUFWriter(str(path), arch=cfg.arch)
    for key, value, vtype in _metadata(cfg, type, seed):
        w.add(key, value, type=getattr(gguf.ValueType, vtype))
    done = 0
    if progress is not None:
        progress(0, total)

    def lazy(make, n: int):
        # each tensor made when the writer reaches it: one tensor's float32 in memory at a time, not the
        # whole file (20 GB of quantized tensors held for an 11 GB file before)
        def run():
            nonlocal done
            data = make()
            done += n
            if progress is not None:
                progress(done, total)
            return data
        return run

    for index, (name, shape, kind) in enumerate(specs):
        t = _tensor_type(cfg, type, name, shape, kind)
        w.add_tensor(name, lazy(functools.partial(_tensor_data, shape, kind, t, seed, index), math.prod(shape)),
                     type=t, ne=tuple(reversed(shape)))
    w.write()
    return path


def _tensor_type(cfg: SyntheticConfig, type: str, name: str, shape: tuple, kind: str) -> str:
    """The GGUF type of one synthetic tensor in a file of ``type``."""
    if kind in ("norm", "router", "conv", "bias", "decay"):
        return "F32"        # llama.cpp keeps norms, routers, their bias, conv kernels and SSM decays in F32
    if kind == "mla" and type not in ("F32", "F16"):
        return "Q8_0"       # deepseek2's per-head matrices: rows of the head size, no K-quant blocks
    if type in ("F32", "F16"):
        return type
    return matrix_type(type, name, cfg.n_layer, tied=cfg.tied, n_cols=shape[-1])


def _tensor_data(shape: tuple, kind: str, t: str, seed: int, index: int) -> np.ndarray:
    """One synthetic tensor's data, encoded in ``t``."""
    from ggmlpy._core import Type, quantize

    if kind == "norm":
        return np.ones(shape, np.float32)
    m = _random_matrix(shape, seed, index)
    if kind == "decay":                     # Mamba-2's A = -exp(A_log): negative, about -1 to -16
        return -np.exp(np.abs(m) / WEIGHT_STD * 0.7)
    if t in ("F32", "F16"):
        return m.astype({"F32": np.float32, "F16": np.float16}[t])
    return quantize(m, Type[t])


def _is_complete(path: Path, cfg: SyntheticConfig, type: str, seed: int) -> bool:
    # (the architecture is in the file name)
    from ggmlpy import gguf
    from ggmlpy._core import GGMLError

    try:
        r = gguf.GGUFReader(str(path))
        md = r.metadata
        if (md.get("ggmlpy.synthetic.format_version") != FORMAT_VERSION
                or md.get("ggmlpy.synthetic.seed") != seed
                or md.get("general.file_type") != FILE_TYPES[type]
                or len(r.tensors) != len(tensor_specs(cfg))):
            return False
        return True
    except (OSError, GGMLError):
        # unreadable or corrupt (GGUFError): rewrite it; anything else is a bug and propagates
        return False


def synthetic_path(size: str = "110M", type: str = "F16", seed: int = 0,
                   cache_dir: str | os.PathLike | None = None, create: bool = True,
                   progress: Callable[[int, int], None] | None = None, arch: str | None = None) -> Path:
    """The cached file of a synthetic model, written first if missing.

    The file is written to a temporary name in the cache folder and renamed into
    place, so a present file is a complete one; it is still checked (format
    version, seed, type, tensor count) and rewritten if it does not match.

    Parameters
    ----------
    size, type, seed, arch
        As for :func:`write_synthetic`.
    cache_dir : str or PathLike, optional
        Folder of the cache (default :func:`cache_dir`).
    create : bool
        Write the file if it is missing (default); otherwise only return the path.
    progress : callable, optional
        Passed to :func:`write_synthetic` when the file is written.

    Returns
    -------
    pathlib.Path
    """
    name = parse_size(size)
    type = _normalize_type(type)
    cfg = for_arch(SIZES[name], arch)
    folder = Path(cache_dir) if cache_dir is not None else globals()["cache_dir"]()
    path = folder / f"synthetic-{cfg.arch}-{name}-{type}-seed{int(seed)}-v{FORMAT_VERSION}.gguf"
    if not create or (path.exists() and _is_complete(path, cfg, type, int(seed))):
        return path
    folder.mkdir(parents=True, exist_ok=True)
    with replacing(path) as tmp:
        write_synthetic(tmp, cfg, type, seed, progress)
    return path
