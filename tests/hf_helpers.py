"""Small random-weight Hugging Face models and their GGUF export (ggmlpy's writer), for reference tests.

Nothing is downloaded: each model is built from a config with a fixed seed.
The export follows llama.cpp's converter conventions: tensor names, ``ne``
shapes (numpy order is HF's ``[out, in]``), and for the ``llama``/``mistral``
architectures the per-head Q/K row permutation that turns HF's rotate-half
RoPE into ggml's adjacent-pair RoPE (qwen2 keeps NEOX RoPE, no permutation).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch") if not os.environ.get("CI") else __import__("torch")
transformers = pytest.importorskip("transformers") if not os.environ.get("CI") else __import__("transformers")

from ggmlpy import gguf  # noqa: E402

VOCAB = 320

# Per architecture: HF class, HF config kwargs beyond the common ones, GGUF arch name.
ARCHS = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", {}, "llama"),
    "mistral": ("MistralForCausalLM", "MistralConfig", {"sliding_window": 6}, "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", {"use_sliding_window": False}, "qwen2"),
}


def hf_model(arch: str, *, hidden=64, layers=2, heads=4, kv_heads=2, ff=128, vocab=VOCAB, seed=0,
             tie=False, rope_theta=10000.0, rope_scaling=None, max_pos=256, **extra):
    """A random-weight HF causal LM in float32, eval mode."""
    cls_name, cfg_name, kw, _ = ARCHS[arch]
    cfg = getattr(transformers, cfg_name)(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ff, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_pos,
        rms_norm_eps=1e-5, rope_theta=rope_theta, tie_word_embeddings=tie, rope_scaling=rope_scaling,
        attn_implementation="eager", **{**kw, **extra})
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(cfg).float().eval()
    # HF initialises norms to 1 and biases to 0: randomise them so the test sees them
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model


def hf_logits(model, tokens) -> np.ndarray:
    """float32 logits ``[len(tokens), vocab]`` of one sequence."""
    with torch.no_grad():
        out = model(torch.tensor([list(tokens)], dtype=torch.long))
    return out.logits[0].float().numpy()


def hf_hidden(model, tokens) -> np.ndarray:
    """The final-normed hidden states ``[len(tokens), hidden]``."""
    with torch.no_grad():
        out = model(torch.tensor([list(tokens)], dtype=torch.long), output_hidden_states=True)
    return out.hidden_states[-1][0].float().numpy()


def _permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF rotate-half rows → ggml adjacent pairs: per head, interleave the two halves."""
    out_dim = w.shape[0]
    hd = out_dim // n_head
    rest = w.shape[1:]
    return w.reshape(n_head, 2, hd // 2, *rest).swapaxes(1, 2).reshape(out_dim, *rest)


def _rope(cfg) -> dict:
    """RoPE settings across transformers versions (v5 keeps rope_theta inside rope_parameters)."""
    rp = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    rp.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    return rp


def export_gguf(model, path, arch: str, wtype="F32", embd_type=None, types=None) -> str:
    """Write ``model`` as a GGUF file with ggmlpy's writer; 2-D weights in ``wtype`` (``types``: per
    tensor name exceptions)."""
    cfg = model.config
    gguf_arch = ARCHS[arch][3]
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = cfg.hidden_size // heads
    permute = gguf_arch in ("llama", "mistral")
    w = gguf.GGUFWriter(str(path), arch=gguf_arch)
    U, F = gguf.ValueType.UINT32, gguf.ValueType.FLOAT32
    w.add("general.name", f"test-{arch}")
    w.add(f"{gguf_arch}.context_length", cfg.max_position_embeddings, U)
    w.add(f"{gguf_arch}.embedding_length", cfg.hidden_size, U)
    w.add(f"{gguf_arch}.block_count", cfg.num_hidden_layers, U)
    w.add(f"{gguf_arch}.feed_forward_length", cfg.intermediate_size, U)
    w.add(f"{gguf_arch}.attention.head_count", heads, U)
    w.add(f"{gguf_arch}.attention.head_count_kv", kv_heads, U)
    w.add(f"{gguf_arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps, F)
    rs = _rope(cfg)
    w.add(f"{gguf_arch}.rope.freq_base", rs["rope_theta"], F)
    w.add(f"{gguf_arch}.rope.dimension_count", hd, U)
    w.add(f"{gguf_arch}.vocab_size", cfg.vocab_size, U)
    sw = getattr(cfg, "sliding_window", None)
    if arch == "mistral" and sw:
        w.add(f"{gguf_arch}.attention.sliding_window", sw, U)
    rtype = rs.get("rope_type", rs.get("type"))
    if rtype == "linear":
        w.add(f"{gguf_arch}.rope.scaling.type", "linear")
        w.add(f"{gguf_arch}.rope.scaling.factor", float(rs["factor"]), F)
    elif rtype == "yarn":
        w.add(f"{gguf_arch}.rope.scaling.type", "yarn")
        w.add(f"{gguf_arch}.rope.scaling.factor", float(rs["factor"]), F)
        w.add(f"{gguf_arch}.rope.scaling.original_context_length", int(rs["original_max_position_embeddings"]), U)
    elif rtype == "llama3":
        # llama.cpp's converter stores the llama3 frequency factors as rope_freqs.weight: base / scaled
        inv = model.model.rotary_emb.inv_freq.detach().double().numpy()
        base = 1.0 / (rs["rope_theta"] ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
        w.add_tensor("rope_freqs.weight", (base / inv).astype(np.float32))
    w.add("tokenizer.ggml.model", "none")
    w.add("tokenizer.ggml.eos_token_id", VOCAB - 1, U)

    def mat(name, a):
        w.add_tensor(name, a.astype(np.float32), type=(types or {}).get(name, wtype))

    mat("token_embd.weight", sd["model.embed_tokens.weight"]) if embd_type is None else \
        w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"], type=embd_type)
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        mat("output.weight", sd["lm_head.weight"])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        q, k = sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"]
        if permute:
            q, k = _permute_qk(q, heads), _permute_qk(k, kv_heads)
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        mat(f"blk.{i}.attn_q.weight", q)
        mat(f"blk.{i}.attn_k.weight", k)
        mat(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        if p + "self_attn.q_proj.bias" in sd:
            qb, kb = sd[p + "self_attn.q_proj.bias"], sd[p + "self_attn.k_proj.bias"]
            if permute:
                qb, kb = _permute_qk(qb, heads), _permute_qk(kb, kv_heads)
            w.add_tensor(f"blk.{i}.attn_q.bias", qb)
            w.add_tensor(f"blk.{i}.attn_k.bias", kb)
            w.add_tensor(f"blk.{i}.attn_v.bias", sd[p + "self_attn.v_proj.bias"])
        mat(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        mat(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        mat(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        mat(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    w.write()
    return str(path)
