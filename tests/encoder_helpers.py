"""What the encoder tests share: tiny embedding models and rerankers converted by llama.cpp's converter, and
llama.cpp's own outputs on the same files (llama-cpp-python), as the reference for "within llama.cpp's error".

* :func:`pooling_files`: sentence-transformers' ``modules.json`` + ``1_Pooling/config.json``, from which the
  converter writes ``{arch}.pooling_type``;
* :func:`nomic_dir`: a transformers ``NomicBertModel`` saved in nomic's own checkpoint layout (the one
  llama.cpp's converter reads: ``config.json`` with nomic's keys, ``Wqkv``, ``fc11``/``fc12``...), optionally
  with nomic-bert-moe's experts;
* :func:`make_hf`, :func:`bert_gguf`, :func:`xlmr_gguf`: the tiny models of the tests and their files;
* :func:`llama_cpp_outputs`: llama.cpp's embeddings (or rank scores) of token-id inputs.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import hf_convert
import numpy as np
import pytest

#: llama.cpp's pooling numbers (LLAMA_POOLING_TYPE_*)
POOLING_IDS = {"none": 0, "mean": 1, "cls": 2, "last": 3, "rank": 4}

#: llama-cpp-python is an optional peer (.ci/run does not install it): where it is missing the comparisons
#: with llama.cpp are left out and the ones with transformers still run.
LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None


def _llama_cpp():
    if not LLAMA_CPP:
        pytest.skip("llama-cpp-python is not installed (optional peer)")
    import llama_cpp

    return llama_cpp


#: the tiny models' shape: two layers, n_embd 64, 4 heads
COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)


def make_hf(cls_name: str, cfg_name: str, seed: int = 3, **cfg):
    """A random-weight ``transformers.<cls_name>`` from ``<cfg_name>(**cfg)``, its constant weights made random."""
    import torch
    import transformers

    config = getattr(transformers, cfg_name)(attn_implementation="eager", **cfg)
    torch.manual_seed(seed)
    hf = getattr(transformers, cls_name)(config).float().eval()
    hf_convert.perturb_constant_weights(hf, seed=seed + 1)
    return hf


def bert_gguf(out: Path, pooling: str = "mean", outtype: str = "f32", hf=None):
    """``(hf, path)``: a ``BertModel`` (bert-bge vocabulary, 64 positions) converted with ``pooling``."""
    if hf is None:
        hf = make_hf("BertModel", "BertConfig", vocab_size=len(hf_convert.tokenizer("bert-bge")),
                     max_position_embeddings=64, **COMMON)
    return hf, hf_convert.convert(hf, out, "bert-bge", outtype=outtype, files=pooling_files(pooling))


def xlmr_gguf(out: Path):
    """``(hf, path)``: an XLM-RoBERTa reranker (the classifier's dense + tanh + out_proj, one label; weights wide
    enough that the scores differ by more than rounding), converted."""
    hf = make_hf("XLMRobertaForSequenceClassification", "XLMRobertaConfig",
                 vocab_size=len(hf_convert.tokenizer(hf_convert.XLMR)), num_labels=1, max_position_embeddings=66,
                 type_vocab_size=1, pad_token_id=1, bos_token_id=0, eos_token_id=2, initializer_range=0.2, **COMMON)
    return hf, hf_convert.convert(hf, out, hf_convert.XLMR)


def pooling_files(mode: str) -> dict:
    """The sentence-transformers files that make the converter write ``pooling_type = mode`` (mean, cls, last)."""
    key = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token", "last": "pooling_mode_lasttoken"}
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    return {"modules.json": json.dumps(modules), "1_Pooling/config.json": json.dumps({key[mode]: True})}


def nomic_dir(hf, out: Path, *, moe: dict | None = None, seed: int = 0) -> Path:
    """``hf`` (a transformers ``NomicBertModel``) written as nomic's checkpoint (``NomicBertModel`` of
    ``nomic-ai/nomic-embed-text-v1.5``: the layout llama.cpp's converter maps) with the ``bert-bge`` tokenizer.

    With ``moe = {"every": k, "experts": n, "top_k": t}`` the layers ``i % k == 1`` get random GELU experts
    (nomic-embed-text-v2-moe's layout: ``mlp.router.layer``, ``mlp.experts.mlp.w1``/``w2``), every layer
    biases on Wqkv, out_proj, fc1 and fc2, and GELU dense layers (``fc1``/``fc2``, no gate): the model is then
    no longer ``hf`` (the reference is llama.cpp on the file).
    """
    import safetensors.torch
    import torch

    c = hf.config
    e, ff, nl = c.hidden_size, c.intermediate_size, c.num_hidden_layers
    sd = {k: v.detach().clone().contiguous() for k, v in hf.state_dict().items()}
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=0.1):
        return (torch.randn(*shape, generator=gen) * scale).contiguous()

    w = {"embeddings.word_embeddings.weight": sd["embeddings.word_embeddings.weight"],
         "embeddings.token_type_embeddings.weight": sd["embeddings.token_type_embeddings.weight"],
         "emb_ln.weight": sd["embeddings.LayerNorm.weight"], "emb_ln.bias": sd["embeddings.LayerNorm.bias"]}
    for i in range(nl):
        src, dst = f"layers.{i}.", f"encoder.layers.{i}."
        w[dst + "attn.Wqkv.weight"] = torch.cat([sd[src + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        w[dst + "attn.out_proj.weight"] = sd[src + "self_attn.o_proj.weight"]
        for n_src, n_dst in (("post_attention_layernorm", "norm1"), ("post_mlp_layernorm", "norm2")):
            for x in ("weight", "bias"):
                w[f"{dst}{n_dst}.{x}"] = sd[f"{src}{n_src}.{x}"]
        if moe is None:
            # nomic's SwiGLU: fc2(fc11(x) * silu(fc12(x))): fc11 is HF's up, fc12 its gate
            w[dst + "mlp.fc11.weight"] = sd[src + "mlp.up_proj.weight"]
            w[dst + "mlp.fc12.weight"] = sd[src + "mlp.gate_proj.weight"]
            w[dst + "mlp.fc2.weight"] = sd[src + "mlp.down_proj.weight"]
            continue
        w[dst + "attn.Wqkv.bias"], w[dst + "attn.out_proj.bias"] = rnd(3 * e), rnd(e)
        if i % moe["every"] == 1:
            n = moe["experts"]
            w[dst + "mlp.router.layer.weight"] = rnd(n, e, scale=0.5)
            w[dst + "mlp.experts.mlp.w1"] = rnd(n * ff, e)         # per expert (n_inner, n_embd): up
            w[dst + "mlp.experts.mlp.w2"] = rnd(n * ff, e)         # per expert (n_inner, n_embd): down, transposed
            w[dst + "mlp.experts.bias"] = rnd(e)                   # the converter drops it (llama.cpp has none)
        else:
            w[dst + "mlp.fc1.weight"], w[dst + "mlp.fc1.bias"] = rnd(ff, e), rnd(ff)
            w[dst + "mlp.fc2.weight"], w[dst + "mlp.fc2.bias"] = rnd(e, ff), rnd(e)
    out.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(w, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = {"architectures": ["NomicBertModel"], "model_type": "nomic_bert", "n_embd": e,
           "n_head": c.num_attention_heads, "n_layer": nl, "n_inner": ff, "vocab_size": c.vocab_size,
           "type_vocab_size": c.type_vocab_size,
           "layer_norm_epsilon": c.layer_norm_eps, "rotary_emb_base": c.rope_parameters["rope_theta"],
           "rotary_emb_fraction": 1.0, "rotary_emb_interleaved": False, "rotary_emb_scale_base": None,
           "causal": False, "prenorm": False, "activation_function": "gelu" if moe else "swiglu",
           "qkv_proj_bias": bool(moe), "mlp_fc1_bias": bool(moe), "mlp_fc2_bias": bool(moe),
           # nomic-embed-text v1.5's (trained for 2048) and v2-moe's (512): the two the converter knows
           "n_positions": 2048 if moe else 8192, "max_trained_positions": 2048,
           # transformers 5 knows model_type nomic_bert: the converter's AutoConfig would fill these keys with
           # its defaults (12 layers...) where nomic's names are not its own
           "hidden_size": e, "num_hidden_layers": nl, "num_attention_heads": c.num_attention_heads,
           "intermediate_size": ff, "max_position_embeddings": 2048 if moe else 8192}
    if moe:
        cfg.update(moe_every_n_layers=moe["every"], num_experts=moe["experts"], moe_top_k=moe["top_k"])
    (out / "config.json").write_text(json.dumps(cfg))
    shutil.copytree(hf_convert.tokenizer_dir("bert-bge"), out, dirs_exist_ok=True)
    return out


def llama_cpp_outputs(path, inputs: list, pooling: str, n_out: int) -> list:
    """llama.cpp's output for each token-id input of ``inputs``, one decode each, through llama-cpp-python:
    the pooled embedding (``float32[n_out]``, not normalised), every token's (``none``: ``[n, n_out]``) or the
    rank scores (``rank``: ``[n_out]``, ``n_out`` = the head's outputs)."""
    lc = _llama_cpp()

    n = max(len(t) for t in inputs)
    llm = lc.Llama(str(path), embedding=True, verbose=False, n_ctx=max(n, 64), n_batch=n, n_ubatch=n,
                   pooling_type=POOLING_IDS[pooling], n_threads=2)
    ctx = llm._ctx.ctx
    out = []
    try:
        for toks in inputs:
            batch = lc.llama_batch_init(len(toks), 0, 1)
            try:
                for i, t in enumerate(toks):
                    batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = int(t), i, 1, 1
                    batch.seq_id[i][0] = 0
                batch.n_tokens = len(toks)
                if lc.llama_decode(ctx, batch) != 0:
                    raise RuntimeError("llama_decode failed")
                if pooling == "none":
                    rows = [np.ctypeslib.as_array(lc.llama_get_embeddings_ith(ctx, i), (n_out,)).copy()
                            for i in range(len(toks))]
                    out.append(np.stack(rows))
                else:
                    out.append(np.ctypeslib.as_array(lc.llama_get_embeddings_seq(ctx, 0), (n_out,)).copy())
            finally:
                lc.llama_batch_free(batch)
    finally:
        llm.close()
    return out


def llama_cpp_tokenize(path, text: str, add_special: bool = True, parse_special: bool = True) -> list:
    """llama.cpp's tokenization of ``text`` with the file's vocabulary."""
    lc = _llama_cpp()

    llm = lc.Llama(str(path), vocab_only=True, verbose=False)
    try:
        return llm.tokenize(text.encode("utf-8"), add_bos=add_special, special=parse_special)
    finally:
        llm.close()


def llama_cpp_rerank_prompt(path, query: str, document: str) -> list:
    """llama-server's ``format_prompt_rerank`` for a file without a rerank template, written from the
    vocabulary's flags as llama.cpp reports them: BOS if it adds BOS, the query, EOS (SEP if none) if it adds
    EOS, SEP if it adds SEP, the document, EOS if it adds EOS (texts without special tokens parsed)."""
    lc = _llama_cpp()

    llm = lc.Llama(str(path), vocab_only=True, verbose=False)
    try:
        v = llm._model.vocab
        eos = lc.llama_vocab_eos(v)
        eos = lc.llama_vocab_sep(v) if eos == -1 else eos
        ids = [lc.llama_vocab_bos(v)] if lc.llama_vocab_get_add_bos(v) else []
        ids += llm.tokenize(query.encode(), add_bos=False, special=False)
        ids += [eos] if lc.llama_vocab_get_add_eos(v) else []
        ids += [lc.llama_vocab_sep(v)] if lc.llama_vocab_get_add_sep(v) else []
        ids += llm.tokenize(document.encode(), add_bos=False, special=False)
        ids += [eos] if lc.llama_vocab_get_add_eos(v) else []
        return ids
    finally:
        llm.close()
