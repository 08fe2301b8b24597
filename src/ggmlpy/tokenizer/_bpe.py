"""BPE: the pre-tokenizer of each ``tokenizer.ggml.pre`` (llama.cpp's llm_tokenizer_bpe) and GPT-2's
byte-to-character mapping."""

from __future__ import annotations

import re
from dataclasses import dataclass

# --- BPE pre-tokenizers (llama.cpp's llm_tokenizer_bpe, by tokenizer.ggml.pre) ------------------------
# The expressions are those of the models' own tokenizer.json files, in the form llama.cpp uses them
# (case-insensitive contractions spelled out). Applied in order, each splitting the pieces before it.

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# non-raw strings: the code points are written as escapes, so no editor or normalisation can change them
_CJK = "[\u4E00-\u9FA5\u0800-\u4E00\uAC00-\uD7FF]+"
_DEEPSEEK_LATIN = (
    "\\s?[A-Za-z\u00B5\u00C0-\u00D6\u00D8-\u00F6\u00F8-\u01BA\u01BC-\u01BF\u01C4-\u0293\u0295-\u02AF"
    "\u0370-\u0373\u0376\u0377\u037B-\u037D\u037F\u0386\u0388-\u038A\u038C\u038E-\u03A1\u03A3-\u03F5"
    "\u03F7-\u0481\u048A-\u052F\u0531-\u0556\u10A0-\u10C5\u13A0-\u13F5\u13F8-\u13FD\u1C90-\u1CBA"
    "\u1CBD-\u1CBF\u1D00-\u1D2B\u1D6B-\u1D77\u1D79-\u1D9A\u1E00-\u1F15\u1F18-\u1F1D\u1F20-\u1F45"
    "\u1F48-\u1F4D\u1F50-\u1F57\u1F59\u1F5B\u1F5D\u1F5F-\u1F7D\u1F80-\u1FB4\u1FB6-\u1FBC\u1FBE\u1FC2-"
    "\u1FC4\u1FC6-\u1FCC\u1FD0-\u1FD3\u1FD6-\u1FDB\u1FE0-\u1FEC\u1FF2-\u1FF4\u1FF6-\u1FFC\u2102\u2107"
    "\u210A-\u2113\u2115\u2119-\u211D\u2124\u2126\u2128\u212A-\u212D\u212F-\u2134\u2139\u213C-\u213F"
    "\u2145-\u2149\u214E\u2183\u2184\u2C00-\u2C7B\u2C7E-\u2CE4\u2CEB-\u2CEE\u2CF2\u2CF3\uA640-\uA66D"
    "\uA680-\uA69B\uA722-\uA76F\uA771-\uA787\uA78B-\uA78E\uAB70-\uABBF\uFB00-\uFB06\uFB13-\uFB17"
    "\uFF21-\uFF3A\uFF41-\uFF5A\U00010400-\U0001044F\U000104B0-\U000104D3\U000104D8-\U000104FB"
    "\U00010C80-\U00010CB2\U00010CC0-\U00010CF2\U000118A0-\U000118DF\U0001E900-\U0001E943]+")
_DEEPSEEK_PUNCT = "\\s?[!-/:-~\uFF01-\uFF0F\uFF1A-\uFF5E\u2018-\u201F\u3000-\u3002]+"
_CJK_KANA = "[\u4E00-\u9FA5\u3040-\u309F\u30A0-\u30FF]+"


@dataclass(frozen=True)
class _Pre:
    """How one ``tokenizer.ggml.pre`` value tokenizes (llama.cpp's per-type settings)."""

    regexes: tuple
    ignore_merges: bool = False
    clean_spaces: bool = True
    add_bos: bool | None = None     # None: as the vocabulary type says
    byte_encode: bool = True            # GPT-2 byte-to-character mapping
    escape_whitespace: bool = False     # spaces as U+2581 (SPM-style BPE)
    no_bos: bool = False


_DEFAULT = _Pre((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))
_STARCODER = _Pre((r"\p{N}", _GPT2))
_GPT2_PRE = _Pre((_GPT2,))
_LLAMA3_PRE = _Pre((_LLAMA3,), ignore_merges=True, add_bos=True)
_QWEN2_PRE = _Pre((_QWEN2,), clean_spaces=False)
_PORO = (r" ?[^(\s|.,!?…。，、।۔،)]+",)

_PRE_TOKENIZERS: dict[str, _Pre] = {
    "default": _DEFAULT,
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano"), _LLAMA3_PRE),
    "dbrx": _Pre((_LLAMA3,)),
    "smaug-bpe": _Pre((_LLAMA3,)),
    "deepseek-llm": _Pre((r"[\r\n]", _DEEPSEEK_LATIN, _DEEPSEEK_PUNCT, r"\s+$", _CJK, r"\p{N}+"),
                         clean_spaces=False),
    "deepseek-coder": _Pre((r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}"), clean_spaces=False),
    "deepseek-v3": _Pre((r"\p{N}{1,3}", _CJK_KANA,
                         r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                         r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"), clean_spaces=False),
    "falcon": _Pre((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")),
    **dict.fromkeys(("starcoder", "refact", "codeshell", "exaone", "minerva-7b"), _STARCODER),
    **dict.fromkeys(("command-r", "smollm"), _Pre((r"\p{N}", _GPT2), clean_spaces=False)),
    **dict.fromkeys(("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0",
                     "mellum", "modern-bert", "mpt", "olmo", "jais", "exaone4", "jina-v1-en", "jina-v2-code",
                     "roberta-bpe"), _GPT2_PRE),
    **dict.fromkeys(("trillion", "granite-docling"), _Pre((_GPT2,), clean_spaces=False)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "stablelm2", "megrez", "hunyuan",
                     "solar-open"), _QWEN2_PRE),
    "qwen35": _Pre((_QWEN35,), clean_spaces=False),
    "poro-chat": _Pre(_PORO, clean_spaces=False),
    **dict.fromkeys(("bloom", "gpt3-finnish"), _Pre(_PORO)),
    "viking": _Pre(_PORO + (r"\p{N}",), clean_spaces=False),
    "chatglm-bpe": _Pre((_LLAMA3,), no_bos=True),
    **dict.fromkeys(("glm4", "glm5"), _Pre((_LLAMA3,), ignore_merges=True, no_bos=True)),
    "seed-coder": _Pre((_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+"
                        r"|\s+(?!\S)|\s+",), clean_spaces=False),
    "grok-2": _Pre((_QWEN2,), clean_spaces=False),
    "ufakzeka": _Pre((r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
                     clean_spaces=False),
    **dict.fromkeys(("gemma4", "granite-embed-multi-311m"),
                    _Pre((r"[^\n]+|[\n]+",), byte_encode=False, escape_whitespace=True, add_bos=True)),
    "whitespace": _Pre((r"\S+",), byte_encode=False),
}


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte-to-character mapping: printable bytes stand for themselves, the others are moved
    to code points from 256 up so every byte is a visible character."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out


_BYTE_TO_CHAR = _byte_chars()
#: where a long text may be cut for parallel encoding (see Tokenizer._cuts), and the piece size
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}
_CHAR_TO_BYTE_TABLE = {ord(c): b for c, b in _CHAR_TO_BYTE.items()}
_BYTE_LEVEL = re.compile("[" + "".join(re.escape(c) for c in _CHAR_TO_BYTE) + "]*")
_NOT_BYTE_LEVEL = re.compile("[^" + "".join(re.escape(c) for c in _CHAR_TO_BYTE) + "]")
