"""Every tokenizer.ggml.* key of four small vocabularies (SPM, BPE, WPM, UGM) replaced by each of about
110 hostile values (wrong types, NaN/inf, out-of-range ids, wrong lengths, lone surrogates, objects whose len()
raises): each must load or raise TokenizerError naming a tokenizer key (its own, or the one whose length it
contradicts); a vocabulary that loads then encodes and decodes, or refuses with TokenizerError. Anything else is
counted as bad and the script exits 1.

    python tests/tokenizer_fuzz.py          # 21,080 cases; prints the counts

The same metadata reader is fuzzed at random by tests/tokenizer/test_tokenizer_hostile.py (hypothesis).
"""
import logging
import math
import sys

import numpy as np

from ggmlpy.tokenizer import Tokenizer, TokenizerError

SPM = {"tokenizer.ggml.model": "llama",
       "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>", "▁", "a", "b", "▁a", "ab", "<0x41>"],
       "tokenizer.ggml.scores": [0.0, 0, 0, -1, -2, -2, -1.5, -3, 0],
       "tokenizer.ggml.token_type": [2, 3, 3, 1, 1, 1, 1, 1, 6]}
BPE = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
       "tokenizer.ggml.tokens": ["a", "b", "ab", "Ġ", "Ġa", "<|endoftext|>"],
       "tokenizer.ggml.merges": ["a b", "Ġ a"], "tokenizer.ggml.token_type": [1, 1, 1, 1, 1, 3]}
WPM = {"tokenizer.ggml.model": "bert",
       "tokenizer.ggml.tokens": ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "▁a", "b", "▁ab"],
       "tokenizer.ggml.token_type": [3, 3, 3, 3, 3, 1, 1, 1], "tokenizer.ggml.unknown_token_id": 1,
       "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.seperator_token_id": 3}
UGM = {"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": ["<pad>", "</s>", "<unk>", "▁", "a", "b", "▁a"],
       "tokenizer.ggml.scores": [0.0, 0, 0, -2, -3, -3, -2.5], "tokenizer.ggml.token_type": [3, 3, 2, 1, 1, 1, 1]}
KEYS = ["tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.scores",
        "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.precompiled_charsmap",
        "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token",
        "tokenizer.ggml.add_sep_token", "tokenizer.ggml.add_space_prefix", "tokenizer.ggml.remove_extra_whitespaces",
        "tokenizer.ggml.normalizer.lowercase", "tokenizer.ggml.normalizer.strip_accents", "tokenizer.chat_template",
        "general.name", "general.architecture"] + [f"tokenizer.ggml.{k}_token_id" for k in (
        "bos", "eos", "eot", "eom", "unknown", "seperator", "padding", "mask",
        "fim_pre", "fim_suf", "fim_mid", "fim_pad", "fim_rep", "fim_sep")]

class Weird:
    def __len__(self): raise RuntimeError("len")
def values(n):
    base = ["x", "", "a b", b"ab", bytearray(b"\x00\x01"), 1.5, math.nan, math.inf, -math.inf,
            -1, 0, 1, 7, 255, 256, 2**31, 2**32, 2**40, 2**70, -2**70,
            True, False, np.bool_(True), np.int64(3), np.float32(np.nan),
            [], [1, 2], [[1]], ["a"], [math.nan], [None], {"a": 1}, (1,), object(),
            np.array([[1, 2]]), np.array(["a"]), np.array([1.5]), np.array([np.nan]), np.array([], dtype=np.int32),
            np.zeros(3, np.uint8),
            np.array([1, 2], dtype=object), "\ud800", ["\ud800"], [b"x"], ["a"] * 3, Weird()]
    for elem in ["x", "a b", "ab", "\ud800", "a" * 5000, b"a", 1, -1, 7, 100, 2**70, -2**70, 1.5, math.nan, math.inf,
                 3e39, None, True, [1], ["x"], np.int8(1), np.float64(np.nan), np.uint8(200), "𝔞 b"]:
        base.append([elem] * n)
        base.append([elem] * (n - 1))
        base.append([elem] * (n + 1))
        base.append(tuple([elem] * n))
    for dt in (np.int8, np.uint8, np.int32, np.int64, np.uint64, np.float32, np.float64, np.bool_):
        base.append(np.ones(n, dt))
        base.append(np.full(n, 200 if dt not in (np.bool_,) else 1).astype(dt))
        base.append(np.full(n, -1).astype(dt) if dt not in (np.bool_,) else np.zeros(n, dt))
    base.append(np.full(n, np.nan, np.float32))
    base.append(np.full(n, np.inf, np.float32))
    base.append(np.array(["x"] * n))
    base.append(np.array([["x"]] * n))
    return base



def main() -> int:
    logging.disable(logging.WARNING)   # ids past the vocabulary are dropped with a warning, by design
    bad = count = refused = refused_use = 0
    for name, md in [("SPM", SPM), ("BPE", BPE), ("WPM", WPM), ("UGM", UGM)]:
        n = len(md["tokenizer.ggml.tokens"])
        for key in KEYS:
            for v in values(n):
                m = dict(md)
                m[key] = v
                count += 1
                try:
                    t = Tokenizer.from_gguf(m)
                except TokenizerError as e:
                    refused += 1
                    # a length that disagrees with another key's may name that key
                    if key not in str(e) and "tokenizer.ggml." not in str(e):
                        bad += 1
                        print("NOKEY", name, key, repr(v)[:60], "->", str(e)[:150])
                    continue
                except Exception as e:  # noqa: BLE001 - anything else is the defect this script looks for
                    bad += 1
                    print("BAD", name, key, repr(v)[:60], "->", type(e).__name__, str(e)[:150])
                    continue
                try:    # a vocabulary that loads may still refuse a request (adds BOS but has none)
                    t.encode("a ab b a", add_special=True, parse_special=True)
                    t.decode(list(range(t.n_vocab)))
                except TokenizerError:
                    refused_use += 1
                except Exception as e:  # noqa: BLE001
                    bad += 1
                    print("BAD(use)", name, key, repr(v)[:60], "->", type(e).__name__, str(e)[:150])
    print(f"cases {count}: refused at load {refused}, loaded {count - refused}, of which refused a request "
          f"{refused_use}; bad {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
