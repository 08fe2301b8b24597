"""Write tests/data/tokenizer_golden.json: what llama.cpp's own tokenizer gives on its vocabulary files.

llama.cpp's ``models/ggml-vocab-*.gguf.out`` files hold ids for one setting only (no BOS/EOS, special
tokens not parsed). This records, for every vocabulary ggmlpy supports, llama.cpp's ids for texts that
mix special-token text with plain text, with and without ``add_special`` and ``parse_special``, and its
``llama_detokenize`` output with and without ``remove_special``, so the tests check those settings
without llama.cpp installed. A vocabulary with no ``.inp``/``.out`` of its own (``nomic-bert-moe``,
the one UGM file, and a few BPE ones) also gets every text of the other vocabularies' ``.inp`` files
(multilingual text, runs of whitespace, emoji, code), so its plain tokenization is covered too.
Needs llama-cpp-python (the version of tests/hf_convert.py) and the extracted sdist; run from the
repository root:

    python tools/gen_tokenizer_golden.py
"""

from __future__ import annotations

import base64
import ctypes
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import hf_convert  # noqa: E402
import llama_cpp  # noqa: E402

from ggmlpy.tokenizer import TokenAttr, Tokenizer, TokenizerError  # noqa: E402

OUT = ROOT / "tests" / "data" / "tokenizer_golden.json"
#: plain texts the special-token texts are mixed into
PLAIN = ["Hello world", " leading space", "two  spaces\n\nnew lines", "tabs\tand 123456 digits", "ünïcödé 🦙 漢字",
         "don't stop . , ! ?", "", " "]


def _detokenize(llm, ids: list[int], remove_special: bool, unparse_special: bool) -> bytes:
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    arr = (llama_cpp.llama_token * max(1, len(ids)))(*ids)
    buf = ctypes.create_string_buffer(1 << 16)
    n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, len(buf), remove_special, unparse_special)
    if n < 0:
        raise RuntimeError("detokenize buffer too small")
    return buf.raw[:n]


def texts_for(tok: Tokenizer, seed: int) -> list[str]:
    specials = [tok.token_text(i) for i in range(tok.n_vocab)
                if tok.token_attr(i) & (TokenAttr.CONTROL | TokenAttr.USER_DEFINED | TokenAttr.UNKNOWN)]
    rng = random.Random(seed)
    out = list(PLAIN)
    for _ in range(12):
        parts = []
        for _ in range(rng.randint(1, 4)):
            if specials and rng.random() < 0.6:
                parts.append(rng.choice(specials))
            parts.append(rng.choice(PLAIN[:6]) + rng.choice(["", " ", "\n", "  "]))
        out.append("".join(parts))
    return out


def reference_texts() -> list[str]:
    """Every text of llama.cpp's ``.inp`` files, each once, in file order."""
    out: list[str] = []
    seen: set[str] = set()
    for vocab in hf_convert.vocabs():
        for text, _ids in hf_convert.vocab_tests(vocab):
            if text not in seen:
                seen.add(text)
                out.append(text)
    return out


def main() -> None:
    golden = {}
    reference = reference_texts()
    for vocab in hf_convert.vocabs():
        path = hf_convert.vocab_file(vocab)
        try:
            tok = Tokenizer.from_gguf(path)
        except TokenizerError as e:
            print(f"{vocab}: skipped ({e})")
            continue
        llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
        cases = []
        texts = texts_for(tok, seed=len(vocab))
        if not hf_convert.vocab_tests(vocab):
            texts += [t for t in reference if t not in texts]
        for text in texts:
            case = {"text": text, "ids": {}}
            for add in (False, True):
                for parse in (False, True):
                    case["ids"][f"{int(add)}{int(parse)}"] = llm.tokenize(text.encode(), add_bos=add, special=parse)
            ids = case["ids"]["11"]
            # bytes: a text may end inside a character; base64 keeps them exact
            case["decode"] = {f"{int(rs)}": base64.b64encode(_detokenize(llm, ids, rs, not rs)).decode()
                              for rs in (False, True)}
            cases.append(case)
        golden[vocab] = cases
        print(f"{vocab}: {len(cases)} texts")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"llama_cpp_python": llama_cpp.__version__, "vocabs": golden}, ensure_ascii=False,
                              separators=(",", ":")) + "\n", encoding="utf-8")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
