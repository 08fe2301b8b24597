"""What a synthetic model file holds (:mod:`ggmlpy.models.synthetic` writes it): each architecture's tensors, in
the order written, and the ggml type each matrix gets (llama.cpp's Q4_K_M mix and its quantizer's fallbacks).
Kept apart from the sizes, the presets and the writer, which import it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from .synthetic import SyntheticConfig

__all__ = ["matrix_type", "tensor_specs"]

#: Qwen3-Next's layers: qwen35 (Qwen3.5) has ``ssm_beta``/``ssm_alpha`` apart and a dense feed-forward,
#: qwen35moe qwen3next's experts
_QWEN_HYBRID = ("qwen3next", "qwen35", "qwen35moe")


def tensor_specs(cfg: SyntheticConfig) -> list[tuple[str, tuple[int, ...], str]]:
    """The tensors of a synthetic model in file order.

    Returns
    -------
    list of (name, numpy_shape, kind)
        ``kind`` is ``"norm"`` (F32 ones), ``"matrix"`` (random, written in the
        model's type), ``"router"`` / ``"conv"`` / ``"bias"`` (random, F32: an expert router, a
        convolution kernel or bias, a routing bias), ``"decay"`` (F32, negative: Mamba-2's A) or ``"mla"``
        (deepseek2's per-head matrices: random, Q8_0 in a quantized file). Shapes are in numpy order (the
        reverse of ggml's ``ne``).
    """
    d, hd = cfg.n_embd, cfg.head_dim
    specs: list[tuple[str, tuple[int, ...], str]] = [("token_embd.weight", (cfg.n_vocab, d), "matrix")]
    layers = _LAYERS.get(cfg.arch)
    if layers is not None:
        specs += layers(cfg)
    qk_norm = cfg.arch in ("qwen3", "qwen3moe", "gemma3", "lfm2")
    for i in range(cfg.n_layer if layers is None else 0):
        b = f"blk.{i}."
        if cfg.arch == "granitehybrid":
            specs += _granitehybrid_layer(cfg, b, cfg.recurrent_layers[i])
            continue
        if cfg.arch in _QWEN_HYBRID:
            specs += _qwen3next_layer(cfg, b, cfg.recurrent_layers[i])
            continue
        if cfg.recurrent_layers and cfg.recurrent_layers[i]:
            specs += [
                (b + "attn_norm.weight", (d,), "norm"),
                (b + "shortconv.in_proj.weight", (3 * d, d), "matrix"),
                (b + "shortconv.conv.weight", (d, cfg.conv_l_cache), "conv"),
                (b + "shortconv.out_proj.weight", (d, d), "matrix"),
                (b + "ffn_norm.weight", (d,), "norm"),
                (b + "ffn_gate.weight", (cfg.n_ff, d), "matrix"),
                (b + "ffn_up.weight", (cfg.n_ff, d), "matrix"),
                (b + "ffn_down.weight", (d, cfg.n_ff), "matrix"),
            ]
            continue
        specs += [
            (b + "attn_norm.weight", (d,), "norm"),
            (b + "attn_q.weight", (cfg.n_head * hd, d), "matrix"),
            (b + "attn_k.weight", (cfg.n_head_kv * hd, d), "matrix"),
            (b + "attn_v.weight", (cfg.n_head_kv * hd, d), "matrix"),
            (b + "attn_output.weight", (d, cfg.n_head * hd), "matrix"),
        ]
        if qk_norm:
            specs += [(b + "attn_q_norm.weight", (hd,), "norm"), (b + "attn_k_norm.weight", (hd,), "norm")]
        if cfg.arch == "gemma3":
            specs.append((b + "post_attention_norm.weight", (d,), "norm"))
        specs.append((b + "ffn_norm.weight", (d,), "norm"))
        if cfg.n_expert:
            e, f = cfg.n_expert, cfg.n_ff_exp
            specs += [
                (b + "ffn_gate_inp.weight", (e, d), "router"),
                (b + "ffn_gate_exps.weight", (e, f, d), "matrix"),
                (b + "ffn_up_exps.weight", (e, f, d), "matrix"),
                (b + "ffn_down_exps.weight", (e, d, f), "matrix"),
            ]
        else:
            specs += [
                (b + "ffn_gate.weight", (cfg.n_ff, d), "matrix"),
                (b + "ffn_up.weight", (cfg.n_ff, d), "matrix"),
                (b + "ffn_down.weight", (d, cfg.n_ff), "matrix"),
            ]
        if cfg.arch == "gemma3":
            specs.append((b + "post_ffw_norm.weight", (d,), "norm"))
    # (lfm2's output norm has the name llama.cpp reads: token_embd_norm)
    specs.append(("token_embd_norm.weight" if cfg.arch == "lfm2" else "output_norm.weight", (d,), "norm"))
    if cfg.arch != "gemma3" and not cfg.tied:   # gemma ties the output to the embeddings
        specs.append(("output.weight", (cfg.n_vocab, d), "matrix"))
    return specs


def _granitehybrid_layer(cfg: SyntheticConfig, b: str, mamba: bool) -> list:
    """One granitehybrid layer's tensors: Mamba-2 (inner width 2 n_embd) or attention, then the feed-forward (the
    experts and the shared one, or dense)."""
    d, hd = cfg.n_embd, cfg.head_dim
    specs = [(b + "attn_norm.weight", (d,), "norm")]
    if mamba:
        di, ds, ng = 2 * d, cfg.ssm_d_state, cfg.ssm_n_group
        nh, conv = di // cfg.ssm_head_dim, di + 2 * ng * ds
        specs += [(b + "ssm_in.weight", (2 * di + 2 * ng * ds + nh, d), "matrix"),
                  (b + "ssm_conv1d.weight", (conv, 4), "conv"), (b + "ssm_conv1d.bias", (conv,), "conv"),
                  (b + "ssm_dt.bias", (nh,), "conv"), (b + "ssm_a", (nh, 1), "decay"), (b + "ssm_d", (nh, 1), "norm"),
                  (b + "ssm_norm.weight", (ng, di // ng), "norm"), (b + "ssm_out.weight", (d, di), "matrix")]
    else:
        specs += [(b + "attn_q.weight", (cfg.n_head * hd, d), "matrix"),
                  (b + "attn_k.weight", (cfg.n_head_kv * hd, d), "matrix"),
                  (b + "attn_v.weight", (cfg.n_head_kv * hd, d), "matrix"),
                  (b + "attn_output.weight", (d, cfg.n_head * hd), "matrix")]
    specs.append((b + "ffn_norm.weight", (d,), "norm"))
    if cfg.n_expert:
        e, f, s = cfg.n_expert, cfg.n_ff_exp, cfg.n_ff_shexp
        specs += [(b + "ffn_gate_inp.weight", (e, d), "router"), (b + "ffn_gate_exps.weight", (e, f, d), "matrix"),
                  (b + "ffn_up_exps.weight", (e, f, d), "matrix"), (b + "ffn_down_exps.weight", (e, d, f), "matrix")]
        if s:
            specs += [(b + "ffn_gate_shexp.weight", (s, d), "matrix"), (b + "ffn_up_shexp.weight", (s, d), "matrix"),
                      (b + "ffn_down_shexp.weight", (d, s), "matrix")]
    else:
        specs += [(b + "ffn_gate.weight", (cfg.n_ff, d), "matrix"), (b + "ffn_up.weight", (cfg.n_ff, d), "matrix"),
                  (b + "ffn_down.weight", (d, cfg.n_ff), "matrix")]
    return specs


def _qwen3next_layer(cfg: SyntheticConfig, b: str, delta: bool) -> list:
    """One qwen3next layer's tensors: gated DeltaNet (``ssm_n_group`` key heads, twice as many value heads, all of
    ``ssm_d_state``) or gated attention (a query and an output gate per head), then the experts and the shared
    one."""
    d, hd = cfg.n_embd, cfg.head_dim
    specs = [(b + "attn_norm.weight", (d,), "norm")]
    if delta:
        ds, nk = cfg.ssm_d_state, cfg.ssm_n_group
        nv = 2 * nk
        conv = 2 * nk * ds + nv * ds
        specs += [(b + "attn_qkv.weight", (conv, d), "matrix"), (b + "attn_gate.weight", (nv * ds, d), "matrix"),
                  *([(b + "ssm_ba.weight", (2 * nv, d), "matrix")] if cfg.arch == "qwen3next" else
                    [(b + "ssm_beta.weight", (nv, d), "matrix"), (b + "ssm_alpha.weight", (nv, d), "matrix")]),
                  (b + "ssm_conv1d.weight", (conv, 4), "conv"),
                  (b + "ssm_dt.bias", (nv,), "conv"), (b + "ssm_a", (nv,), "decay"),
                  (b + "ssm_norm.weight", (ds,), "norm"), (b + "ssm_out.weight", (d, nv * ds), "matrix")]
    else:
        specs += [(b + "attn_q.weight", (2 * cfg.n_head * hd, d), "matrix"),
                  (b + "attn_k.weight", (cfg.n_head_kv * hd, d), "matrix"),
                  (b + "attn_v.weight", (cfg.n_head_kv * hd, d), "matrix"),
                  (b + "attn_q_norm.weight", (hd,), "norm"), (b + "attn_k_norm.weight", (hd,), "norm"),
                  (b + "attn_output.weight", (d, cfg.n_head * hd), "matrix")]
    e, f, s = cfg.n_expert, cfg.n_ff_exp, cfg.n_ff_shexp
    specs.append((b + "post_attention_norm.weight", (d,), "norm"))
    if not e:                                     # qwen35: dense
        return specs + [(b + "ffn_gate.weight", (cfg.n_ff, d), "matrix"), (b + "ffn_up.weight", (cfg.n_ff, d),
                                                                             "matrix"),
                        (b + "ffn_down.weight", (d, cfg.n_ff), "matrix")]
    specs += [(b + "ffn_gate_inp.weight", (e, d), "router"),
              (b + "ffn_gate_exps.weight", (e, f, d), "matrix"), (b + "ffn_up_exps.weight", (e, f, d), "matrix"),
              (b + "ffn_down_exps.weight", (e, d, f), "matrix"), (b + "ffn_gate_inp_shexp.weight", (d,), "router"),
              (b + "ffn_gate_shexp.weight", (s, d), "matrix"), (b + "ffn_up_shexp.weight", (s, d), "matrix"),
              (b + "ffn_down_shexp.weight", (d, s), "matrix")]
    return specs


def _deepseek2_layers(cfg: SyntheticConfig) -> list[tuple[str, tuple[int, ...], str]]:
    """The layers of a deepseek2 file (llama.cpp's names; shapes in numpy order): latent attention (the query
    compressed or not, the per-head ``attn_k_b``/``attn_v_b`` of kind ``"mla"``), then DeepSeek's feed-forward."""
    d, hd, rot, v = cfg.n_embd, cfg.head_dim, cfg.n_rot, cfg.n_embd_head_v
    specs: list[tuple[str, tuple[int, ...], str]] = []
    for i in range(cfg.n_layer):
        b = f"blk.{i}."
        specs.append((b + "attn_norm.weight", (d,), "norm"))
        if cfg.n_lora_q:
            specs += [(b + "attn_q_a.weight", (cfg.n_lora_q, d), "matrix"),
                      (b + "attn_q_a_norm.weight", (cfg.n_lora_q,), "norm"),
                      (b + "attn_q_b.weight", (cfg.n_head * hd, cfg.n_lora_q), "matrix")]
        else:
            specs.append((b + "attn_q.weight", (cfg.n_head * hd, d), "matrix"))
        specs += [(b + "attn_kv_a_mqa.weight", (cfg.n_lora_kv + rot, d), "matrix"),
                  (b + "attn_kv_a_norm.weight", (cfg.n_lora_kv,), "norm"),
                  (b + "attn_k_b.weight", (cfg.n_head, cfg.n_lora_kv, hd - rot), "mla"),
                  (b + "attn_v_b.weight", (cfg.n_head, v, cfg.n_lora_kv), "mla"),
                  (b + "attn_output.weight", (d, cfg.n_head * v), "matrix"),
                  (b + "ffn_norm.weight", (d,), "norm")]
        specs += _deepseek_ffn(cfg, i)
    return specs


def _deepseek_ffn(cfg: SyntheticConfig, i: int) -> list[tuple[str, tuple[int, ...], str]]:
    """Layer ``i``'s feed-forward in DeepSeek's layout: dense in the leading layers, else the experts with their
    routing bias (kind ``"bias"``, F32) and the shared experts."""
    b, d, e, f = f"blk.{i}.", cfg.n_embd, cfg.n_expert, cfg.n_ff_exp
    fs = f * cfg.n_expert_shared
    if i < cfg.n_dense_lead or not e:
        return [(b + "ffn_gate.weight", (cfg.n_ff, d), "matrix"), (b + "ffn_up.weight", (cfg.n_ff, d), "matrix"),
                (b + "ffn_down.weight", (d, cfg.n_ff), "matrix")]
    return [(b + "ffn_gate_inp.weight", (e, d), "router"), (b + "exp_probs_b.bias", (e,), "bias"),
            (b + "ffn_gate_exps.weight", (e, f, d), "matrix"), (b + "ffn_up_exps.weight", (e, f, d), "matrix"),
            (b + "ffn_down_exps.weight", (e, d, f), "matrix"),
            (b + "ffn_gate_shexp.weight", (fs, d), "matrix"), (b + "ffn_up_shexp.weight", (fs, d), "matrix"),
            (b + "ffn_down_shexp.weight", (d, fs), "matrix")]


def _glm4moe_layers(cfg: SyntheticConfig) -> list[tuple[str, tuple[int, ...], str]]:
    """The layers of a glm4moe file (GLM-4.5's: Q/K/V biases, per-head Q/K norms, the pre-feed-forward norm
    named ``post_attention_norm``, DeepSeek's feed-forward layout)."""
    d, hd = cfg.n_embd, cfg.head_dim
    specs: list[tuple[str, tuple[int, ...], str]] = []
    for i in range(cfg.n_layer):
        b = f"blk.{i}."
        specs.append((b + "attn_norm.weight", (d,), "norm"))
        for x, rows in (("q", cfg.n_head * hd), ("k", cfg.n_head_kv * hd), ("v", cfg.n_head_kv * hd)):
            specs += [(f"{b}attn_{x}.weight", (rows, d), "matrix"), (f"{b}attn_{x}.bias", (rows,), "bias")]
        specs += [(b + "attn_q_norm.weight", (hd,), "norm"), (b + "attn_k_norm.weight", (hd,), "norm"),
                  (b + "attn_output.weight", (d, cfg.n_head * hd), "matrix"),
                  (b + "post_attention_norm.weight", (d,), "norm")]
        specs += _deepseek_ffn(cfg, i)
    return specs


def _llama4_layers(cfg: SyntheticConfig) -> list[tuple[str, tuple[int, ...], str]]:
    """The layers of a llama4 file: llama's attention, then a dense feed-forward or (every ``moe_step``-th
    layer) the experts and a shared expert as wide as one."""
    d, hd, e, f = cfg.n_embd, cfg.head_dim, cfg.n_expert, cfg.n_ff_exp
    specs: list[tuple[str, tuple[int, ...], str]] = []
    for i in range(cfg.n_layer):
        b = f"blk.{i}."
        specs += [(b + "attn_norm.weight", (d,), "norm"), (b + "attn_q.weight", (cfg.n_head * hd, d), "matrix"),
                  (b + "attn_k.weight", (cfg.n_head_kv * hd, d), "matrix"),
                  (b + "attn_v.weight", (cfg.n_head_kv * hd, d), "matrix"),
                  (b + "attn_output.weight", (d, cfg.n_head * hd), "matrix"), (b + "ffn_norm.weight", (d,), "norm")]
        if cfg.moe_step and (i + 1) % cfg.moe_step == 0:
            specs += [(b + "ffn_gate_inp.weight", (e, d), "router"),
                      (b + "ffn_gate_exps.weight", (e, f, d), "matrix"),
                      (b + "ffn_up_exps.weight", (e, f, d), "matrix"),
                      (b + "ffn_down_exps.weight", (e, d, f), "matrix"),
                      (b + "ffn_gate_shexp.weight", (f, d), "matrix"), (b + "ffn_up_shexp.weight", (f, d), "matrix"),
                      (b + "ffn_down_shexp.weight", (d, f), "matrix")]
        else:
            specs += [(b + "ffn_gate.weight", (cfg.n_ff, d), "matrix"), (b + "ffn_up.weight", (cfg.n_ff, d), "matrix"),
                      (b + "ffn_down.weight", (d, cfg.n_ff), "matrix")]
    return specs


#: The architectures whose layers :func:`tensor_specs` takes from a function of their own.
_LAYERS: dict[str, Callable[[SyntheticConfig], list]] = {"deepseek2": _deepseek2_layers, "glm4moe": _glm4moe_layers,
                                                         "llama4": _llama4_layers}


def _more_bits(layer: int, n_layer: int) -> bool:
    # the layers llama.cpp's Q4_K_M gives Q6_K for attn_v and ffn_down: the first and last eighth, and
    # every third layer in between
    return layer < n_layer // 8 or layer >= 7 * n_layer // 8 or (layer - n_layer // 8) % 3 == 2


#: llama.cpp's quantizer's fallback for a matrix whose rows its block does not divide (``tensor_type_fallback``)
_FALLBACK = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}
_BLOCK = {"Q4_K": 256, "Q6_K": 256, "Q5_0": 32, "Q8_0": 32, "Q4_0": 32}


def matrix_type(type: str, name: str, n_layer: int, tied: bool = False, n_cols: int | None = None) -> str:
    """The ggml type a matrix called ``name`` is written in, for the model type ``type`` (``tied``: the
    embeddings are the output head, which llama.cpp's Q4_K_M gives Q6_K as it would ``output``). With the row
    length ``n_cols``, a type whose block does not divide it falls back as llama.cpp's quantizer does (Q4_K to
    Q5_0, Q6_K to Q8_0, then F16): GLM-4.5's dense ``ffn_down`` rows of 10944, say."""
    t = type
    if type == "Q4_K_M":
        t = "Q4_K"
        if name == "output.weight" or (tied and name == "token_embd.weight"):
            t = "Q6_K"
        elif name.endswith(("attn_v.weight", "ffn_down.weight", "ffn_down_exps.weight")) and \
                _more_bits(int(name.split(".")[1]), n_layer):
            t = "Q6_K"
    if n_cols is not None and t in _BLOCK and n_cols % _BLOCK[t]:
        t = _FALLBACK.get(t, t)
        if n_cols % _BLOCK[t]:
            t = "F16"
    return t
