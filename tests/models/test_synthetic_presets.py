"""The built-in models' real-size presets (ggmlpy.models.synthetic.PRESETS): the shapes users run.

Each preset's parameter count is its model's; a preset cut to one layer and a small vocabulary (the
same widths, heads, head size and head tying) is written in every type, read back with the metadata
llama.cpp reads, loaded and run; the benchmark names and writes presets in their own architecture.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from ggmlpy import gguf
from ggmlpy.benchmark import parse_args
from ggmlpy.benchmark.driver import _synthetic_models
from ggmlpy.models import load_model
from ggmlpy.models.synthetic import (
    PRESETS,
    SIZES,
    for_arch,
    matrix_type,
    parse_size,
    synthetic_path,
    tensor_specs,
    write_synthetic,
)
from ggmlpy.runner import Runner

#: (preset, parameters of the public model, tied head, head size, architecture)
PUBLIC = {
    "llama3.2-1B": (1.236e9, True, 64, "llama"),
    "llama3.2-3B": (3.213e9, True, 128, "llama"),
    "qwen3-1.7B": (1.721e9, True, 128, "qwen3"),
    "qwen3-4B": (4.022e9, True, 128, "qwen3"),
    "qwen3-8B": (8.191e9, False, 128, "qwen3"),
    "qwen3-30B-A3B-24L": (15.58e9, False, 128, "qwen3moe"),
    "lfm2-1.2B": (1.170e9, True, 64, "lfm2"),
    # the count of the shape it copies (llama.cpp's granitehybrid 7B-A1B type): no count of IBM's is at hand here
    "granitehybrid-7B-A1B": (6.939e9, True, 128, "granitehybrid"),
    # transformers' DeepseekV3ForCausalLM with these layers and experts (test_arch_deepseek counts it) and the
    # routing bias the file stores as weights; head size: a query head's (position-free + rotated part)
    "deepseek-v3-12L-32E": (18.37e9, False, 192, "deepseek2"),
    # transformers' Glm4MoeForCausalLM with these layers (test_arch_glm4moe counts it), GLM-4.5's Q/K norms and
    # the routing bias
    "glm4.5-air-8L": (17.876e9, False, 128, "glm4moe"),
    # transformers' Llama4ForCausalLM with these layers and experts (test_arch_llama4 counts it)
    "llama4-scout-8L-8E": (11.632e9, False, 128, "llama4"),
    # transformers' Qwen3NextForCausalLM with these layers and experts (counted on the meta device)
    "qwen3-next-12L-128E": (5.880e9, False, 256, "qwen3next"),
}


@pytest.mark.parametrize("name", PRESETS)
def test_each_preset_has_its_models_shape(name):
    params, tied, head_dim, arch = PUBLIC[name]
    cfg = SIZES[name]
    assert abs(cfg.n_params / params - 1) < 0.002
    assert cfg.tied == tied and cfg.head_dim == head_dim and cfg.arch == arch
    names = [n for n, _, _ in tensor_specs(cfg)]
    assert ("output.weight" in names) != tied
    assert abs(cfg.nominal_params / cfg.n_params - 1) < 0.01
    assert parse_size(name.upper()) == name                     # names are case-insensitive
    assert for_arch(cfg, None) is cfg and for_arch(cfg, arch) is cfg     # a preset keeps its family
    assert for_arch(cfg, "gemma3").arch == "gemma3"


def test_counts_pick_the_nearest_size():
    assert parse_size("8B") == "qwen3-8B" and parse_size("3B") == "llama3.2-3B"
    assert parse_size("1B") == "1B" and parse_size("1.24B") == "llama3.2-1B" and parse_size("110M") == "110M"
    assert parse_size("1.2B") == "lfm2-1.2B"              # 1.17B: nearer than Llama-3.2-1B's 1.24B


def test_tied_heads_get_q6_k_in_q4_k_m_as_llama_cpp_gives_them():
    assert matrix_type("Q4_K_M", "token_embd.weight", 16, tied=True) == "Q6_K"
    assert matrix_type("Q4_K_M", "token_embd.weight", 16) == "Q4_K"
    assert matrix_type("Q4_K_M", "output.weight", 16) == "Q6_K"
    assert matrix_type("Q8_0", "token_embd.weight", 16, tied=True) == "Q8_0"


def _small(name):
    """The preset with 1 layer and a 1024-token vocabulary (its widths, heads and tying kept; lfm2: 2 layers, a
    convolution and an attention layer)."""
    c = SIZES[name]
    if c.recurrent_layers:
        return replace(c, n_layer=2, n_vocab=1024, recurrent_layers=(True, False), n_expert=min(c.n_expert, 8),
                       n_expert_used=min(c.n_expert_used, 2))
    return replace(c, n_layer=1, n_vocab=1024, n_expert=min(c.n_expert, 8), n_expert_used=min(c.n_expert_used, 2))


# (the 8B shape's widths are the 4B's head layout in a wider model: the 1.7B and MoE cuts cover an
# untied head and head size 128 at a test's cost)
@pytest.mark.parametrize("name", ["llama3.2-1B", "qwen3-1.7B", "qwen3-30B-A3B-24L", "lfm2-1.2B",
                                  "granitehybrid-7B-A1B", "qwen3-next-12L-128E"])
@pytest.mark.parametrize("type", ["Q4_K_M", "Q8_0"])
def test_a_cut_preset_is_written_loaded_and_run(tmp_path, name, type):
    cfg = _small(name)
    path = write_synthetic(tmp_path / "m.gguf", cfg, type)
    r = gguf.GGUFReader(str(path))
    md, a = r.metadata, cfg.arch
    assert md["general.architecture"] == a
    default = cfg.n_embd // cfg.n_head                           # llama.cpp's head size without the keys
    assert md.get(f"{a}.attention.key_length", default) == md.get(f"{a}.attention.value_length", default) \
        == cfg.head_dim
    kv = md[f"{a}.attention.head_count_kv"]
    if cfg.recurrent_layers and a != "qwen3next":     # one per layer, 0 for a recurrent layer (qwen3next: one)
        assert list(kv) == [0 if c else cfg.n_head_kv for c in cfg.recurrent_layers]
    else:
        assert kv == cfg.n_head_kv
    types = {t.name: t.type.name for t in r.tensors}
    assert ("output.weight" in types) != cfg.tied
    if type == "Q4_K_M":
        assert types["token_embd.weight"] == ("Q6_K" if cfg.tied else "Q4_K")
        assert types.get("output.weight", "Q6_K") == "Q6_K"
    with load_model(path, devices="cpu") as m, Runner(m, n_ctx=64, n_threads=2) as rt:
        assert m.config.head_dim == cfg.head_dim and m.config.n_head_kv == cfg.n_head_kv
        logits = rt.decode(np.arange(1, 9, dtype=np.int32), seq=0, logits="last")
        assert logits.shape[-1] == 1024 and np.isfinite(logits).all()


def test_quantized_now_gives_the_bytes_the_writer_gave(tmp_path):
    """write_synthetic quantizes each matrix as it adds it (so an 8B file never holds its float32
    matrices): the bytes are the ones the writer's own quantization gives."""
    cfg = _small("qwen3-1.7B")
    path = write_synthetic(tmp_path / "a.gguf", cfg, "Q4_K_M", seed=3)
    r = gguf.GGUFReader(str(path))
    from ggmlpy.models.synthetic import _random_matrix

    for index, (name, shape, kind) in enumerate(tensor_specs(cfg)):
        if kind != "matrix" or index > 6:
            continue
        w = gguf.GGUFWriter(str(tmp_path / "b.gguf"))
        t = matrix_type("Q4_K_M", name, cfg.n_layer, tied=cfg.tied)
        w.add_tensor(name, _random_matrix(shape, 3, index), type=t)
        w.write()
        b = gguf.GGUFReader(str(tmp_path / "b.gguf"))
        assert np.array_equal(b.tensor_data(name, copy=True), r.tensor_data(name, copy=True)), name


def test_the_benchmark_writes_presets_in_their_own_architecture(tmp_path):
    p = parse_args(["--synthetic", "qwen3-1.7B,110M", "--type", "Q8_0", "--cache-dir", str(tmp_path)])
    assert p.synthetic == ["qwen3-1.7B", "110M"] and p.archs == []
    want = [synthetic_path(s, "Q8_0", cache_dir=tmp_path, create=False) for s in p.synthetic]
    assert "synthetic-qwen3-qwen3-1.7B-Q8_0" in want[0].name and "synthetic-llama-110M-Q8_0" in want[1].name
    p = parse_args(["--synthetic", "qwen3-1.7B", "--arch", "llama", "--cache-dir", str(tmp_path)])
    assert "synthetic-llama-qwen3-1.7B" in synthetic_path("qwen3-1.7B", "F16", cache_dir=tmp_path, create=False,
                                                         arch=p.archs[0]).name
    assert callable(_synthetic_models)
