"""ggmlpy against llama.cpp on each architecture, with ~100M-parameter files written by llama.cpp's converter.

For every architecture a random-weight transformers model of about 100M parameters (768 wide, 12
layers) is converted by llama.cpp's own ``convert_hf_to_gguf.py`` (tests/hf_convert.py fetches it) to
F16, and from that file a Q4_0 one is written (every matrix Q4_0, as ``llama-quantize --pure``).
Both go through ``ggmlpy bench --vs llama.cpp`` (interleaved rounds, pp512 and tg128), and the ratios
are printed as one table. The files are kept in ``bench-arch`` of ggmlpy's cache folder (``ggmlpy cache
path``): a second run benchmarks at once.

Needs what the converter tests need (torch, transformers, sentencepiece, pytest for tests/hf_convert.py)
and llama-cpp-python for the peer::

    python bench/architectures.py                                  # all, F16 and Q4_0, 3 rounds
    python bench/architectures.py --arch phi3,gemma2 --type f16 --rounds 5

The built-in synthetic models cover llama, qwen3, qwen3moe, gemma3, deepseek2 and glm4moe without the
converter: ``ggmlpy bench --arch llama,qwen3,qwen3moe,gemma3,deepseek2,glm4moe --type F16,Q4_0 --vs llama.cpp``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

#: arch -> (transformers model class, config class, vocabulary, config values beyond the common ones)
MODELS = {
    "phi3": ("Phi3ForCausalLM", "Phi3Config", "spm", {}),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", "spm",
               dict(head_dim=64, query_pre_attn_scalar=64, sliding_window=512, attn_logit_softcapping=50.0,
                    final_logit_softcapping=30.0)),
    "olmo2": ("Olmo2ForCausalLM", "Olmo2Config", "gpt-2", dict(tie_word_embeddings=False)),
    "granite": ("GraniteForCausalLM", "GraniteConfig", "gpt-2",
                dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0078125,
                     logits_scaling=8.0)),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", "llama-spm",
                dict(intermediate_size=512, num_local_experts=8, num_experts_per_tok=2)),
    # gpt-oss's shape scaled down: 64-wide heads, window 128 on every other layer, YaRN, biased experts
    "gpt-oss": ("GptOssForCausalLM", "GptOssConfig", "gpt-2",
                dict(intermediate_size=512, num_local_experts=8, num_experts_per_tok=2, head_dim=64,
                     sliding_window=128, rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0,
                                                          "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                                          "original_max_position_embeddings": 4096,
                                                          "truncate": True})),
}
#: the shape of llama2.c's stories110M, with grouped-query attention as these families use
COMMON = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
              num_key_value_heads=4, max_position_embeddings=4096, rms_norm_eps=1e-6)
#: GGUF general.file_type of a file whose matrices are all Q4_0 (llama.cpp's LLAMA_FTYPE_MOSTLY_Q4_0)
FTYPE_Q4_0 = 2


def cache() -> Path:
    from ggmlpy.models.synthetic import cache_dir

    d = cache_dir() / "bench-arch"
    d.mkdir(parents=True, exist_ok=True)
    return d


def converted(arch: str) -> Path:
    """The F16 file of ``arch`` (made once: build the HF model, convert it)."""
    out = cache() / arch
    path = out / "model-f16.gguf"
    if path.is_file():
        return path
    import hf_convert
    import torch
    import transformers

    cls_name, cfg_name, vocab, extra = MODELS[arch]
    if vocab == "spm":
        import sentencepiece

        sp = sentencepiece.SentencePieceProcessor(model_file=str(hf_convert.spm_tokenizer_model()))
        ids = dict(vocab_size=sp.get_piece_size(), bos_token_id=sp.bos_id(), eos_token_id=sp.eos_id())
        vocab = hf_convert.SPM
    else:
        tok = hf_convert.tokenizer(vocab)
        ids = dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    cfg = getattr(transformers, cfg_name)(pad_token_id=0, **ids, **{**COMMON, **extra})
    torch.manual_seed(0)
    hf = getattr(transformers, cls_name)(cfg).eval()
    n = sum(p.numel() for p in hf.parameters())
    print(f"{arch}: {n / 1e6:.0f}M parameters, converting to F16 ...", file=sys.stderr, flush=True)
    got = hf_convert.convert(hf, out, vocab, outtype="f16", name="model")
    assert got == path, got
    return path


def q4_0(src: Path) -> Path:
    """``src`` with every weight matrix whose rows are whole Q4_0 blocks stored as Q4_0; norms, biases
    and the experts' router stay as they are (``llama-quantize --pure`` leaves the router too)."""
    from ggmlpy import Type, gguf

    dst = src.with_name("model-q4_0.gguf")
    if dst.is_file():
        return dst
    tmp = dst.with_suffix(".tmp")
    with gguf.GGUFReader(str(src)) as rd:
        out = gguf.GGUFWriter(str(tmp))
        for key, value in rd.metadata.items():
            if key == gguf.ALIGNMENT_KEY:
                continue
            if key == "general.file_type":
                value = FTYPE_Q4_0
            out.add(key, value, None if isinstance(value, (list, np.ndarray)) else rd.kv_type(key))
        for info in rd.tensors:
            matrix = (info.name.endswith(".weight") and "ffn_gate_inp" not in info.name and len(info.ne) >= 2
                      and info.ne[0] % 32 == 0 and info.type in (Type.F16, Type.F32, Type.BF16))
            data = rd.tensor_data(info.name, copy=matrix)
            out.add_tensor(info.name, data, type=Type.Q4_0 if matrix else info.type)
        out.write()
    tmp.replace(dst)
    return dst


def bench(paths: list[Path], reps: int, rounds: int) -> list[dict]:
    cmd = ["ggmlpy", "bench", "--vs", "llama.cpp", "-p", "512", "-n", "128", "-r", str(reps),
           "--rounds", str(rounds), "-o", "md", "-oe", "jsonl"]
    for p in paths:
        cmd += ["-m", str(p)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    print(proc.stdout, flush=True)
    return [json.loads(line) for line in proc.stderr.splitlines() if line.startswith("{")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default=",".join(MODELS), help=f"comma list of {', '.join(MODELS)}")
    ap.add_argument("--type", default="f16,q4_0", help="comma list of f16, q4_0")
    ap.add_argument("-r", "--repetitions", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    archs = [x for x in a.arch.split(",") if x]
    types = [x.lower() for x in a.type.split(",") if x]
    if bad := [x for x in archs if x not in MODELS] + [t for t in types if t not in ("f16", "q4_0")]:
        ap.error(f"unknown: {', '.join(bad)}")
    summary = []
    for arch in archs:
        f16 = converted(arch)
        paths = [f16 if t == "f16" else q4_0(f16) for t in types]
        for rec in bench(paths, a.repetitions, a.rounds):
            if rec.get("engine") == "ggmlpy":
                test = f"pp{rec['n_prompt']}" if rec["n_prompt"] else f"tg{rec['n_gen']}"
                summary.append((arch, rec["model_type"].split()[-1], test, rec["ratio_vs_llama_cpp"]))
    cells: dict = {}
    for arch, ftype, test, ratio in summary:
        cells.setdefault((arch, ftype), {})[test] = ratio
    print("| model | weights | pp512 | tg128 |\n|---|---|---:|---:|")
    for (arch, ftype), r in cells.items():
        print(f"| {arch} | {ftype} | {r.get('pp512', float('nan')):.2f}x | {r.get('tg128', float('nan')):.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
