"""What the architecture tests (test_arch_*.py) share: a tiny transformers model converted by llama.cpp's
own converter (tests/hf_convert.py) and the runs that compare it with transformers.

Errors are measured as in test_models_converted.py: per position, max |got - ref| / max |ref|.
"""

from __future__ import annotations

import hf_convert
import numpy as np
import torch
import transformers
from test_models_converted import errors, hf_logits

from ggmlpy.models import load_model
from ggmlpy.runner import Runner


class Converted:
    """An HF model, the GGUF files made from it (by converter ``--outtype``) and a test prompt."""

    def __init__(self, hf, vocab: str, tokens: list, out_dir, config_edit=None, tokenizer=None):
        self.hf, self.vocab, self.tokens, self.out_dir = hf, vocab, tokens, out_dir
        self.config_edit = config_edit            # hf_convert.convert's, for every file converted
        self.extra_args: tuple = ()               # converter arguments for every file (qwen3next: --no-mtp)
        self.tokenizer = tokenizer                # saved instead of vocab's files (hf_convert.save_model_dir)
        self.paths: dict = {}

    def path(self, outtype: str = "f32"):
        """The file converted with ``--outtype outtype`` (converted on first use)."""
        if outtype not in self.paths:
            self.paths[outtype] = hf_convert.convert(self.hf, self.out_dir, self.vocab, outtype=outtype, name=outtype,
                                                     config_edit=self.config_edit, extra_args=self.extra_args,
                                                     tokenizer=self.tokenizer)
        return self.paths[outtype]


def make(cls_name: str, cfg_name: str, vocab: str, tokens: list, out_dir, seed: int = 11, **cfg) -> Converted:
    """A random-weight ``transformers.<cls_name>`` from ``transformers.<cfg_name>(**cfg)``, its constant
    weights (norms, biases) made random, ready to convert."""
    config = getattr(transformers, cfg_name)(attn_implementation="eager", **cfg)
    torch.manual_seed(seed)
    hf = getattr(transformers, cls_name)(config).float().eval()
    hf_convert.perturb_constant_weights(hf, seed=seed + 1)
    return Converted(hf, vocab, tokens, out_dir)


def run_batch(path, tokens, n_ctx: int = 64, **kw) -> np.ndarray:
    """Every position's logits of ``tokens`` in one batch (F32 cache unless given)."""
    kw = {"type_k": "f32", "type_v": "f32", **kw}
    with load_model(path, devices="cpu") as model, Runner(model, n_ctx=n_ctx, **kw) as rt:
        return rt.decode(tokens, logits="all")


def run_steps(path, tokens, n_ctx: int = 64, **kw) -> np.ndarray:
    """The logits of ``tokens`` fed one at a time."""
    kw = {"type_k": "f32", "type_v": "f32", **kw}
    with load_model(path, devices="cpu") as model, Runner(model, n_ctx=n_ctx, **kw) as rt:
        return np.concatenate([rt.decode([t]) for t in tokens])


def sequences_error(conv: Converted, seqs: list, nxt: list, n_ctx: int = 64, flash: bool = False) -> float:
    """Several sequences in one batch, then one more token of each, all in a second batch, against
    transformers on each sequence alone: the largest error of any row."""
    with load_model(conv.path(), devices="cpu") as model, \
            Runner(model, n_ctx=n_ctx, n_seq_max=len(seqs), type_k="f32", type_v="f32", flash_attn=flash) as rt:
        toks = [t for s in seqs for t in s]
        pos = [p for s in seqs for p in range(len(s))]
        ids = [i for i, s in enumerate(seqs) for _ in s]
        first = rt.decode_batch(toks, pos, ids, logits=np.ones(len(toks), bool))
        second = rt.decode_batch(nxt, [len(s) for s in seqs], list(range(len(seqs))), logits=list(range(len(seqs))))
    worst, at = 0.0, 0
    for i, s in enumerate(seqs):
        ref = hf_logits(conv.hf, list(s) + [nxt[i]])
        worst = max(worst, errors(first[at:at + len(s)], ref[:-1]).max(), errors(second[i:i + 1], ref[-1:]).max())
        at += len(s)
    return float(worst)


def shift_error(path, tokens, keep: int, discard: int, flash: bool = False, n_ctx: int = 32) -> np.ndarray:
    """A context shift against a fresh run: ``tokens`` decoded, ``remove(keep, keep + discard)`` (the kept
    keys re-rotated by the model's shift), two more tokens decoded; the errors of their logits against a
    fresh run over the kept tokens and the same two (equal with one layer: a shift is exact there)."""
    with load_model(path, devices="cpu") as model, \
            Runner(model, n_ctx=n_ctx, type_k="f32", type_v="f32", flash_attn=flash) as rt:
        rt.decode(tokens)
        rt.cache.remove(0, keep, keep + discard)
        shifted = rt.decode([9, 10], logits="all")
        rt.clear()
        scratch = rt.decode(tokens[:keep] + tokens[keep + discard:] + [9, 10], logits="all")[-2:]
    return errors(shifted, scratch)


def copy_gguf(src, dst, meta: dict = None, tensors=None, types=None, meta_types: dict = None):
    """Copy a GGUF file with metadata values replaced (``meta``: key -> value, None deletes the key; stored as
    ``meta_types``: key -> ValueType says, else inferred: llama.cpp wants its counts UINT32) and
    each tensor passed through ``tensors(name, array) -> [(name, array), ...]`` (kept when None), stored
    as ``types(name, type) -> type`` says (from float data: converted or quantized; as in the file when None)."""
    from ggmlpy import gguf

    meta = meta or {}
    with gguf.GGUFReader(str(src)) as rd:
        out = gguf.GGUFWriter(str(dst))
        for key, value in rd.metadata.items():
            if key == gguf.ALIGNMENT_KEY or key in meta:
                continue
            out.add(key, value, None if isinstance(value, (list, np.ndarray)) else rd.kv_type(key))
        for key, value in meta.items():
            if value is not None:
                out.add(key, value, (meta_types or {}).get(key))
        for info in rd.tensors:
            want = types(info.name, info.type) if types else info.type
            # a copy to convert: ggmlpy.quantize refuses the reader's read-only memory map
            data = rd.tensor_data(info.name, copy=want != info.type)
            for name, arr in tensors(info.name, data) if tensors else [(info.name, data)]:
                out.add_tensor(name, arr, type=want if arr is data else None)
        out.write()
    return dst


def assert_same_top1(got: np.ndarray, ref: np.ndarray) -> None:
    """The same top-1 token at every position where the reference's lead over its second choice is more
    than twice that position's largest error (where it is less, a quantized model may rightly pick the
    other: a tie within its error), and those positions are at least half of them."""
    top2 = np.sort(ref, -1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 2 * np.abs(got - ref).max(-1)
    assert clear.mean() >= 0.5, clear
    np.testing.assert_array_equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])


_LLAMA_CPP_LOGITS = """
import json, sys
import numpy as np
import llama_cpp
path, toks, out, type_kv, flash = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
llm = llama_cpp.Llama(path, n_ctx=max(64, len(toks)), n_batch=len(toks), logits_all=True, n_threads=2,
                      verbose=False, type_k=type_kv, type_v=type_kv, flash_attn=flash == "1")
llm.eval(toks)
np.save(out, np.asarray(llm.scores[:len(toks)], np.float32))
"""


def llama_cpp_logits(path, tokens, tmp_path, f32_cache: bool = True, flash: bool = False) -> np.ndarray:
    """Every position's logits of ``tokens`` in one batch as llama.cpp computes them on the same file, through
    llama-cpp-python in a child process (its libggml and ggmlpy's must not share one: the same soname), with
    flash attention or not (llama.cpp then casts an F32 cache to F16). Skips when llama-cpp-python is not
    installed (an optional peer)."""
    import importlib.util
    import json
    import subprocess
    import sys

    import pytest

    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed (optional peer)")
    out = tmp_path / "llama_cpp_logits.npy"
    r = subprocess.run([sys.executable, "-c", _LLAMA_CPP_LOGITS, str(path), json.dumps([int(t) for t in tokens]),
                        str(out), "0" if f32_cache else "1", "1" if flash else "0"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return np.load(out)
