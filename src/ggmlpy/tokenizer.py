"""Text to token ids and back, from the vocabulary a GGUF file carries, as llama.cpp tokenizes.

:class:`Tokenizer` reads ``tokenizer.ggml.*`` (a model file or a vocabulary-only file) and reproduces
llama.cpp's ``llama_tokenize``/``llama_detokenize``: the same ids for the same text, the same text for
the same ids. The per-word work runs in Hugging Face's ``tokenizers`` (Rust), built here from the GGUF
metadata; what it cannot express is done around it, as llama.cpp does it:

* special tokens are split out of the text first (control tokens only with ``parse_special``;
  user-defined ones always), longest first, with their left/right whitespace stripping;
* SPM (``llama``: Llama 1/2, Mistral, Gemma, Phi-3): spaces become ``▁``, a space is put before text
  that starts the input or follows a special token, and pieces are merged by vocabulary score over the
  whole fragment, bytes of unknown characters as ``<0xXX>`` tokens. The scores become BPE merge ranks
  (a merge of two pieces ranks by the score of the piece it makes);
* BPE (``gpt2``): the pre-tokenizer regular expressions llama.cpp applies for each
  ``tokenizer.ggml.pre``, GPT-2's byte-to-character mapping, the merges in file order, and for the
  Llama-3 family a word found whole in the vocabulary taken as one token;
* WPM (``bert``): llama.cpp's word splitting and greedy longest match, in Python;
* UGM (``t5``: T5, XLM-R-style Unigram vocabularies such as nomic-bert-moe's): the file's
  SentencePiece charsmap (longest match at each place), spaces escaped to ``▁`` with the space prefix
  and the removal of extra whitespace as the file says, then the best-scoring segmentation (Viterbi)
  with llama.cpp's score for unknown characters, in the engine's ``Unigram`` where it is provably the
  same search (else in Python), word by word where a cut is provably exact (see ``_Ugm``).

Decoding is a table of each token's bytes (:meth:`Tokenizer.token_to_piece`), joined and checked as
UTF-8, with llama.cpp's clean-up of spaces before punctuation where the vocabulary asks for it. The
streaming :class:`Detokenizer` gives text as soon as it is whole UTF-8, holding back a character split
across byte tokens.

RWKV and PLaMo-2 vocabularies are refused with a clear error: llama.cpp ships no test vocabulary to
prove them against.
"""

from __future__ import annotations

import enum
import itertools
import os
import re
import unicodedata
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

from ggmlpy._core import GGMLValueError

__all__ = ["Tokenizer", "Detokenizer", "TokenType", "TokenAttr", "TokenizerError"]


class TokenizerError(GGMLValueError):
    """A vocabulary the tokenizer cannot use, or text it cannot take (the message says which)."""


class TokenType(enum.IntEnum):
    """``tokenizer.ggml.token_type`` values (llama.cpp's ``llama_token_type``)."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


class TokenAttr(enum.IntFlag):
    """Per-token attributes as llama.cpp derives them (``llama_token_attr``)."""

    UNDEFINED = 0
    UNKNOWN = 1 << 0
    UNUSED = 1 << 1
    NORMAL = 1 << 2
    CONTROL = 1 << 3
    USER_DEFINED = 1 << 4
    BYTE = 1 << 5
    NORMALIZED = 1 << 6
    LSTRIP = 1 << 7
    RSTRIP = 1 << 8
    SINGLE_WORD = 1 << 9


_TYPE_TO_ATTR = {
    TokenType.UNKNOWN: TokenAttr.UNKNOWN, TokenType.UNUSED: TokenAttr.UNUSED,
    TokenType.NORMAL: TokenAttr.NORMAL, TokenType.CONTROL: TokenAttr.CONTROL,
    TokenType.USER_DEFINED: TokenAttr.USER_DEFINED, TokenType.BYTE: TokenAttr.BYTE,
}
_SPECIAL = int(TokenAttr.UNKNOWN | TokenAttr.CONTROL)
_PARTITIONED = int(TokenAttr.UNKNOWN | TokenAttr.CONTROL | TokenAttr.USER_DEFINED)
_ESCAPED_SPACE = "\u2581"
#: what C's isspace() calls whitespace: llama.cpp strips these beside special tokens
_C_SPACE = " \t\n\v\f\r"

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
    add_bos: Optional[bool] = None     # None: as the vocabulary type says
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

#: end-of-turn and end-of-generation tokens llama.cpp recognises by their text (llama-vocab.cpp)
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>",
              "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>")
_EOG_TEXTS = frozenset(("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
                        "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
                        "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
                        "<｜end▁of▁sentence｜>", "[e~["))
#: fill-in-the-middle tokens, recognised by text when the file does not give their ids
_FIM_TEXTS = {
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
#: ids read from tokenizer.ggml.<key>_token_id
_SPECIAL_IDS = ("bos", "eos", "eot", "eom", "unknown", "seperator", "padding", "mask",
                "fim_pre", "fim_suf", "fim_mid", "fim_pad", "fim_rep", "fim_sep")


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
_CUT_WORDS = re.compile(r"(?<=\S\n)(?=\S)|(?<=[A-Za-z])(?= [A-Za-z])")
_NL_NONSPACE = re.compile(r"\n\S")
_LETTER_SPACE = re.compile("[A-Za-z]\u2581")
_CHUNK = 1 << 14
_HANGUL = re.compile("[\uAC00-\uD7A3]")
_HANGUL_LEAD = {cp: 0x1100 + (cp - 0xAC00) // 588 for cp in range(0xAC00, 0xD7A4)}
_GROUP = 1 << 20
_MAX_PIECE = 1 << 20
_LONG_WORD = 256
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}
_CHAR_TO_BYTE_TABLE = {ord(c): b for c, b in _CHAR_TO_BYTE.items()}
_BYTE_LEVEL = re.compile("[" + "".join(re.escape(c) for c in _CHAR_TO_BYTE) + "]*")
_AS_TEXT = int(TokenAttr.UNKNOWN | TokenAttr.CONTROL | TokenAttr.USER_DEFINED)
_NORMAL = int(TokenAttr.NORMAL)
_BYTE = int(TokenAttr.BYTE)


def _text_arg(text: Union[str, bytes], what: str) -> str:
    """``text`` as a str that encodes to UTF-8; bytes must be valid UTF-8."""
    if isinstance(text, (bytes, bytearray, memoryview)):
        try:
            return bytes(text).decode("utf-8")
        except UnicodeDecodeError as e:
            raise TokenizerError(f"{what}: the bytes are not valid UTF-8 at offset {e.start} "
                                 f"({bytes(text)[e.start:e.start + 4]!r})") from None
    if not isinstance(text, str):
        raise TypeError(f"{what}: text must be str or bytes, not {type(text).__name__}")
    return text


def _check_encodable(text: str, what: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise TokenizerError(f"{what}: the text has a lone surrogate {text[e.start]!r} at index {e.start}; "
                             f"it has no UTF-8 form") from None


class Tokenizer:
    """A GGUF file's tokenizer: :meth:`encode` text to ids and :meth:`decode` ids to text exactly as
    llama.cpp does for the same file.

    Made with :meth:`from_gguf` (a model file, a vocabulary-only file, an open
    :class:`~ggmlpy.gguf.GGUFReader` or its metadata dict), or taken from a loaded model
    (``model.tokenizer``). Immutable after construction and safe to share between threads.

    Attributes
    ----------
    kind : str
        ``"SPM"``, ``"BPE"``, ``"WPM"`` or ``"UGM"``.
    model, pre : str
        ``tokenizer.ggml.model`` and ``tokenizer.ggml.pre`` (``""`` when absent).
    n_vocab : int
    bos, eos, eot, eom, unk, sep, pad, mask : int or None
        Special token ids as llama.cpp resolves them (file keys, else the type's defaults, else by text).
    eog : frozenset of int
        Every id that ends a generation (EOS, end-of-turn and the like).
    add_bos, add_eos, add_sep : bool
        What ``encode(..., add_special=True)`` adds.
    add_space_prefix : bool
        SPM: a space is put before text at the start and after special tokens; UGM: a ``▁`` before the
        first non-space of each text between special tokens.
    remove_extra_whitespaces : bool
        UGM: runs of spaces become one, and none is kept at the ends (``False`` for the other kinds,
        which llama.cpp never applies it to).
    clean_spaces : bool
        :meth:`decode` removes spaces before ``. , ! ?`` and in contractions, as llama.cpp does.
    chat_template : str or None
        ``tokenizer.chat_template``.
    """

    def __init__(self, md: dict, source: str = "<metadata>") -> None:
        self.source = source
        model = md.get("tokenizer.ggml.model")
        if model is None or model in ("none", "no_vocab"):
            raise TokenizerError(f"{source}: the file has no tokenizer (tokenizer.ggml.model is "
                                 f"{'missing' if model is None else repr(model)}); pass token ids instead of text")
        if not isinstance(model, str):
            raise TokenizerError(f"{source}: tokenizer.ggml.model must be a string, not {type(model).__name__}")
        self.model = model
        self.pre = md.get("tokenizer.ggml.pre", "") or ""
        if not isinstance(self.pre, str):
            raise TokenizerError(f"{source}: tokenizer.ggml.pre must be a string")
        tokens = md.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens[:1]):
            raise TokenizerError(f"{source}: tokenizer.ggml.tokens is missing or not an array of strings")
        n = len(tokens)
        # llama.cpp names empty tokens so every text maps back to one id
        self._texts: list[str] = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        self.n_vocab = n
        self._scores = self._array(md, "tokenizer.ggml.scores", n)
        types = self._array(md, "tokenizer.ggml.token_type", n)
        attrs = [TokenAttr.NORMAL] * n if types is None else [_TYPE_TO_ATTR.get(int(t), TokenAttr.UNDEFINED)
                                                              for t in types]
        self._attrs: list[int] = [int(a) for a in attrs]
        self._ids: dict[str, int] = {t: i for i, t in enumerate(self._texts)}   # last wins, as llama.cpp
        self.chat_template: Optional[str] = md.get("tokenizer.chat_template")
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            self.chat_template = None
        self._setup_type(md)
        self._setup_special(md)
        self._pieces = [self._piece(i) for i in range(n)]
        self._special_mask = bytearray(1 if a & _SPECIAL else 0 for a in self._attrs)
        self._build_engine(md)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_gguf(cls, source: Any) -> Tokenizer:
        """The tokenizer of a GGUF file (a path, a :class:`~ggmlpy.gguf.GGUFReader` or its ``metadata``).

        Raises
        ------
        TokenizerError
            The file has no tokenizer, a tokenizer type or pre-tokenizer this library does not know
            (the message names the key and value), or malformed vocabulary metadata.
        GGUFError, FileNotFoundError
            As :class:`~ggmlpy.gguf.GGUFReader`.
        """
        if isinstance(source, dict):
            return cls(source)
        if hasattr(source, "metadata"):
            return cls(source.metadata, getattr(source, "path", "<reader>"))
        from ggmlpy.gguf import GGUFReader

        path = os.fsdecode(os.fspath(source))
        with GGUFReader(path) as r:
            return cls(r.metadata, path)

    def _array(self, md: dict, key: str, n: int):
        v = md.get(key)
        if v is None:
            return None
        if not hasattr(v, "__len__") or isinstance(v, (str, bytes)):
            raise TokenizerError(f"{self.source}: {key} must be an array")
        if len(v) < n:
            raise TokenizerError(f"{self.source}: {key} has {len(v)} entries for {n} tokens")
        return v

    def _setup_type(self, md: dict) -> None:
        self.add_space_prefix = False
        self.clean_spaces = False
        self.add_sep = False
        self._escape_ws = False
        self.remove_extra_whitespaces = False
        self._pre_cfg: Optional[_Pre] = None
        bos: Optional[int]
        if self.model == "llama":
            self.kind = "SPM"
            bos, eos, unk, sep, pad, mask = 1, 2, 0, None, None, None
            self.add_space_prefix, self.add_bos, self.add_eos = True, True, False
            self._escape_ws = True
        elif self.model == "bert":
            self.kind = "WPM"
            bos, eos, unk, sep, pad, mask = 101, None, 100, 102, 0, 103
            self.clean_spaces, self.add_bos, self.add_eos, self.add_sep = True, True, False, True
        elif self.model in ("gpt2", "gemma4", "whitespace"):
            self.kind = "BPE"
            pre = "gemma4" if self.model == "gemma4" else (self.pre or "default")
            if self.model == "whitespace":
                pre = "whitespace"
            cfg = _PRE_TOKENIZERS.get(pre)
            if cfg is None:
                raise TokenizerError(f"{self.source}: tokenizer.ggml.pre = {self.pre!r} is a pre-tokenizer this "
                                     f"library does not know (known: {', '.join(sorted(_PRE_TOKENIZERS))})")
            self._pre_cfg = cfg
            bos, eos = (None, None) if self.model == "gemma4" else (11, 11)
            unk = sep = pad = mask = None
            self.clean_spaces = cfg.clean_spaces
            self.add_bos = bool(cfg.add_bos)
            self.add_eos = False
            self._escape_ws = cfg.escape_whitespace
            if cfg.no_bos:
                bos = None
            if pre in ("jina-v1-en", "jina-v2-code", "roberta-bpe"):
                self.add_sep = True
        elif self.model == "t5":
            self.kind = "UGM"
            bos, eos, unk, sep, pad, mask = None, 1, 2, None, 0, None
            self.add_bos, self.add_eos = False, True
            # llama.cpp reads this flag for every type but only its UGM normaliser applies it
            self.remove_extra_whitespaces = bool(md.get("tokenizer.ggml.remove_extra_whitespaces", False))
        else:
            kinds = {"rwkv": "RWKV", "plamo2": "PLaMo-2", "hybriddna": "HybridDNA"}
            raise TokenizerError(f"{self.source}: tokenizer.ggml.model = {self.model!r}"
                                 f"{' (' + kinds[self.model] + ')' if self.model in kinds else ''} is not supported "
                                 f"(supported: 'llama' (SPM), 'gpt2' (BPE), 'gemma4', 'bert' (WPM), 't5' (UGM))")
        self.add_space_prefix = bool(md.get("tokenizer.ggml.add_space_prefix", self.add_space_prefix))
        self.unk, self.sep, self.pad, self.mask = unk, sep, pad, mask
        self.bos, self.eos = bos, eos
        self.eot = self.eom = None

    def _setup_special(self, md: dict) -> None:
        n = self.n_vocab
        ids: dict[str, Optional[int]] = {"bos": self.bos, "eos": self.eos, "eot": None, "eom": None,
                                         "unknown": self.unk, "seperator": self.sep, "padding": self.pad,
                                         "mask": self.mask}
        ids.update({k: None for k in _FIM_TEXTS})
        for k in ids:
            if ids[k] is not None and ids[k] >= n:
                ids[k] = None
        for k in _SPECIAL_IDS:
            v = md.get(f"tokenizer.ggml.{k}_token_id")
            if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < n:
                ids[k] = v
        if "tokenizer.ggml.add_bos_token" in md:
            self.add_bos = bool(md["tokenizer.ggml.add_bos_token"])
        if "tokenizer.ggml.add_eos_token" in md:
            self.add_eos = bool(md["tokenizer.ggml.add_eos_token"])
        if "tokenizer.ggml.add_sep_token" in md:
            self.add_sep = bool(md["tokenizer.ggml.add_sep_token"])
        if self._pre_cfg is not None and self._pre_cfg.add_bos and self.model == "gemma4":
            self.add_bos = True
        self.lowercase = bool(md.get("tokenizer.ggml.normalizer.lowercase", False))
        self.strip_accents = bool(md.get("tokenizer.ggml.normalizer.strip_accents", self.lowercase))
        if self.model == "bert" and "tokenizer.ggml.normalizer.lowercase" not in md:
            self.lowercase = self.strip_accents = True   # llama.cpp's BertNormalizer defaults for WPM

        attrs = self._attrs
        control = int(TokenAttr.CONTROL)

        def mark(tid: int) -> None:
            attrs[tid] |= control

        # tokens recognised by text: llama.cpp takes the first it meets in its (unordered) map; the first
        # in the order of its list of texts is deterministic and agrees with it on every vocabulary
        # llama.cpp ships (<|eot_id|> over <|end_of_text|>, <|im_end|> over <|endoftext|>)
        def by_text(texts) -> Optional[int]:
            return next((self._ids[t] for t in texts if t in self._ids), None)

        if ids["eot"] is None:
            ids["eot"] = by_text(_EOT_TEXTS)
            if ids["eot"] is not None:
                mark(ids["eot"])
        if ids["eom"] is None:
            ids["eom"] = by_text(("<|eom_id|>",))
            if ids["eom"] is not None:
                mark(ids["eom"])
        for k, texts in _FIM_TEXTS.items():
            if ids[k] is None:
                ids[k] = by_text(texts)
                if ids[k] is not None:
                    mark(ids[k])
        unused = int(TokenAttr.UNUSED)
        for i, t in enumerate(self._texts):
            if attrs[i] & control and "unused" in t:
                attrs[i] |= unused
        eog = {ids[k] for k in ("fim_pad", "fim_rep", "fim_sep") if ids[k] is not None}
        for t in _EOG_TEXTS:
            i = self._ids.get(t)
            if i is not None:
                eog.add(i)
                mark(i)
        for t in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):   # gpt-oss: always rendered
            if t in self._ids:
                attrs[self._ids[t]] = int(TokenAttr.USER_DEFINED)
        eog.update(ids[k] for k in ("eos", "eot", "eom") if ids[k] is not None)
        texts_eog = {self._texts[i]: i for i in eog}
        # o200k_harmony / solar-open: <|end|> ends a message, not the generation
        if "<|end|>" in texts_eog and (("<|return|>" in texts_eog and ("<|call|>" in texts_eog or "<|calls|>" in
                                                                         texts_eog))
                                       or ("<|flush|>" in texts_eog and "<|calls|>" in texts_eog)):
            eog.discard(texts_eog["<|end|>"])
            attrs[texts_eog["<|end|>"]] = int(TokenAttr.USER_DEFINED)
        if "</s>" in texts_eog and ("<|tool_response>" in texts_eog or "<|plamo:eos|>" in texts_eog):
            eog.discard(texts_eog["</s>"])
            attrs[texts_eog["</s>"]] = int(TokenAttr.NORMAL)
        name = str(md.get("general.name", "")).lower()
        arch = str(md.get("general.architecture", ""))
        if any(s in self.pre for s in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or \
                any(s in arch for s in ("nomic-bert-moe", "jina-bert-v3")):
            if "<mask>" in self._ids:
                attrs[self._ids["<mask>"]] |= int(TokenAttr.LSTRIP)
        elif "phi-3" in name or "phi3" in name:
            for i, a in enumerate(attrs):
                if a & _PARTITIONED:
                    attrs[i] |= int(TokenAttr.RSTRIP)
            if "</s>" in self._ids:
                attrs[self._ids["</s>"]] |= int(TokenAttr.RSTRIP)
            for t in ("<unk>", "<s>", "<|endoftext|>"):
                if t in self._ids:
                    attrs[self._ids[t]] &= ~int(TokenAttr.RSTRIP)
        elif "modern-bert" in name and "[MASK]" in self._ids:
            attrs[self._ids["[MASK]"]] |= int(TokenAttr.LSTRIP)
        self.bos, self.eos, self.eot, self.eom = ids["bos"], ids["eos"], ids["eot"], ids["eom"]
        self.unk, self.sep, self.pad, self.mask = ids["unknown"], ids["seperator"], ids["padding"], ids["mask"]
        self.fim = {k[4:]: ids[k] for k in _FIM_TEXTS}
        self.eog: frozenset[int] = frozenset(eog)
        # llama.cpp's partition order: longest text first (a stable sort of ids by length)
        self._partition = sorted((i for i, a in enumerate(attrs) if a & _PARTITIONED),
                                 key=lambda i: -len(self._texts[i].encode("utf-8")))

    def _piece(self, tid: int) -> bytes:
        """llama.cpp's token_to_piece(special=True) for one token."""
        text, attr = self._texts[tid], self._attrs[tid]
        if attr & _AS_TEXT:
            return text.encode("utf-8")
        if attr & _NORMAL:
            if self.kind == "BPE" and not self._escape_ws:
                if _BYTE_LEVEL.fullmatch(text):         # every character stands for one byte
                    return text.translate(_CHAR_TO_BYTE_TABLE).encode("latin-1")
                out = bytearray()
                for ch in text:
                    b = _CHAR_TO_BYTE.get(ch)
                    if b is not None:
                        out.append(b)
                    else:   # llama.cpp marks characters outside the byte mapping this way
                        out += b"[UNK_BYTE_0x" + ch.encode("utf-8").hex().encode() + text.encode("utf-8") + b"]"
                return bytes(out)
            return text.replace(_ESCAPED_SPACE, " ").encode("utf-8")
        if attr & _BYTE and self.kind != "WPM":
            try:
                return bytes((int(text[3:5], 16),))
            except ValueError:
                return b""
        return b""

    def _build_engine(self, md: dict) -> None:
        from tokenizers import Regex, pre_tokenizers
        from tokenizers import Tokenizer as _HFTokenizer
        from tokenizers.models import BPE

        self._hf = None
        self._cut = None
        if self.kind == "UGM":
            self._ugm = _Ugm(self, md)      # its own engine and cuts (see _Ugm)
            self._hf = self._ugm.hf
            return
        if self.kind == "WPM":
            self._max_token_len = max(len(t) for t in self._texts)
            if _ESCAPED_SPACE in self._ids:   # a bare word-start token: WordPiece cannot hold it
                return
            from tokenizers.models import WordPiece

            # WordPiece spells word starts bare and continuations "##x"; the GGUF, "▁x" and "x"
            wp = {(t[1:] if t.startswith(_ESCAPED_SPACE) else "##" + t): i for t, i in self._ids.items()}
            if len(wp) == len(self._ids) and self.unk is not None:
                # the engine looks its unknown token up by name; "[UNK]" can never be a word here
                # (brackets are words of their own), so the extra entry changes no match
                unk = self._texts[self.unk]
                wp.setdefault(unk, self.unk)
                self._hf = _HFTokenizer(WordPiece(wp, unk_token=unk, max_input_chars_per_word=1 << 30))
                # whole words found in the vocabulary, and (up to a bound) the pieces of others seen
                self._wpm_known = {t[1:]: (i,) for t, i in self._ids.items() if t.startswith(_ESCAPED_SPACE)}
                self._wpm_limit = len(self._wpm_known) + (1 << 17)
            return
        vocab = dict(self._ids)
        if self.kind == "SPM":
            merges = self._spm_merges()
            unk = self._texts[self.unk] if self.unk is not None else None
            model = BPE(vocab, merges, unk_token=unk, byte_fallback=True, fuse_unk=False)
            tok = _HFTokenizer(model)
        else:
            raw = md.get("tokenizer.ggml.merges")
            if not isinstance(raw, list):
                raise TokenizerError(f"{self.source}: tokenizer.ggml.merges is missing or not an array of strings")
            merges = []
            for m in raw:
                pos = m.find(" ", 1)
                if pos < 0:
                    continue
                a, b = m[:pos], m[pos + 1:]
                if a in vocab and b in vocab and a + b in vocab:
                    merges.append((a, b))
            cfg = self._pre_cfg
            model = BPE(vocab, merges, ignore_merges=cfg.ignore_merges, byte_fallback=not cfg.byte_encode,
                        fuse_unk=False)
            tok = _HFTokenizer(model)
            steps = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in cfg.regexes]
            if cfg.byte_encode:
                steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
            tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
        self._hf = tok
        self._cut = self._cut_pattern()


    def _cut_pattern(self):
        """Where :meth:`_cuts` may cut this vocabulary's prepared text (None: nowhere)."""
        if self._pre_cfg is not None and not self._escape_ws:
            return _CUT_WORDS       # word-splitting BPE: the pre-tokenizer ends a word there
        # merges over the whole text: only where no token holds the characters on both sides
        parts = []
        if not any(_NL_NONSPACE.search(t) for t in self._texts if "\n" in t):
            parts.append(r"(?<=\S\n)(?=\S)")
        if not any(_LETTER_SPACE.search(t) for t in self._texts if _ESCAPED_SPACE in t):
            parts.append(r"(?<=[A-Za-z])(?=\u2581[A-Za-z])")
        return re.compile("|".join(parts)) if parts else None

    def _spm_merges(self) -> list[tuple[str, str]]:
        """SPM as BPE: every split of a vocabulary text into two vocabulary texts is a merge, ranked by
        the score of the text it makes (higher first), as llama.cpp's SPM session picks its bigrams."""
        ids, scores = self._ids, self._scores
        byte = int(TokenAttr.BYTE)
        cands = []
        for t, i in ids.items():
            if len(t) < 2 or self._attrs[i] & byte:
                continue
            s = float(scores[i]) if scores is not None else 0.0
            for k in range(1, len(t)):
                a, b = t[:k], t[k:]
                if a in ids and b in ids:
                    cands.append((-s, i, k, a, b))
        cands.sort()
        return [(a, b) for _s, _i, _k, a, b in cands]

    # ------------------------------------------------------------------ queries

    def __len__(self) -> int:
        return self.n_vocab

    def __repr__(self) -> str:
        return (f"Tokenizer({self.kind}, model={self.model!r}, pre={self.pre!r}, n_vocab={self.n_vocab}, "
                f"bos={self.bos}, eos={self.eos})")

    def _check_id(self, tid: Any, what: str) -> int:
        try:
            i = int(tid)
        except (TypeError, ValueError):
            raise TypeError(f"{what}: token ids must be integers, not {type(tid).__name__}") from None
        if not 0 <= i < self.n_vocab:
            raise TokenizerError(f"{what}: token id {i} is outside the vocabulary [0, {self.n_vocab})")
        return i

    def token_text(self, tid: int) -> str:
        """The vocabulary entry of ``tid`` as the file stores it (``▁the``, ``Ġthe``, ``<0x0A>``)."""
        return self._texts[self._check_id(tid, "token_text")]

    def token_type(self, tid: int) -> TokenType:
        """The :class:`TokenType` llama.cpp's attributes correspond to."""
        a = self.token_attr(tid)
        for t, flag in _TYPE_TO_ATTR.items():
            if a & flag:
                return t
        return TokenType.UNDEFINED

    def token_attr(self, tid: int) -> TokenAttr:
        """llama.cpp's attributes of ``tid`` (type, plus LSTRIP/RSTRIP where a model sets them)."""
        return TokenAttr(self._attrs[self._check_id(tid, "token_attr")])

    def token_id(self, text: str) -> Optional[int]:
        """The id whose vocabulary entry is exactly ``text``, else None."""
        return self._ids.get(text)

    def is_eog(self, tid: int) -> bool:
        """Whether ``tid`` ends a generation."""
        return tid in self.eog

    def is_special(self, tid: int) -> bool:
        """A control or unknown token: left out of :meth:`decode` with ``skip_special``."""
        return bool(self._attrs[self._check_id(tid, "is_special")] & _SPECIAL)

    # ------------------------------------------------------------------ encode

    def _fragments(self, text: str, parse_special: bool) -> list:
        """llama.cpp's tokenizer_st_partition: text pieces (str) and special token ids (int)."""
        frags: list = [text]
        for tid in self._partition:
            attr = self._attrs[tid]
            if not parse_special and attr & (TokenAttr.CONTROL | TokenAttr.UNKNOWN):
                continue
            tt = self._texts[tid]
            if not any(isinstance(f, str) and tt in f for f in frags):
                continue
            out: list = []
            for f in frags:
                if not isinstance(f, str) or tt not in f:
                    out.append(f)
                    continue
                parts = f.split(tt)
                for j, p in enumerate(parts):
                    if j > 0:
                        out.append(tid)
                    if attr & TokenAttr.LSTRIP and j < len(parts) - 1:
                        p = p.rstrip(_C_SPACE)
                    if attr & TokenAttr.RSTRIP and j > 0:
                        p = p.lstrip(_C_SPACE)
                    if p:
                        out.append(p)
            frags = out
        return frags

    def encode(self, text: Union[str, bytes], add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of ``text`` (llama.cpp's ``llama_tokenize``).

        Parameters
        ----------
        text : str or bytes
            bytes must be UTF-8.
        add_special : bool
            Add BOS/EOS (and BERT's SEP) as the vocabulary says (:attr:`add_bos`, :attr:`add_eos`).
        parse_special : bool
            Turn the text of control tokens (``<|im_start|>``, ``<s>``) into their ids; without it they
            are tokenized as plain text. User-defined tokens are always matched.

        Raises
        ------
        TokenizerError
            Bytes that are not UTF-8; a str with a lone surrogate; BOS/EOS wanted but not defined.
        """
        text = _text_arg(text, "encode")
        _check_encodable(text, "encode")
        out: list[int] = []
        if add_special and (self.add_bos or self.kind == "WPM"):
            if self.bos is None:
                raise TokenizerError(f"encode: the vocabulary adds BOS but defines no BOS token ({self.source})")
            out.append(self.bos)
        frags = self._fragments(text, parse_special) if text else []
        if self.kind == "WPM":
            for f in frags:
                out.extend((f,) if isinstance(f, int) else self._wpm(f))
        else:
            texts: list[str] = []
            plan: list[int] = []   # per fragment: a special id (>= 0), or -1 - its index in texts
            prev_special = True    # SPM: a space before text at the start and after a special token
            for f in frags:
                if isinstance(f, int):
                    plan.append(f)
                    prev_special = True
                    continue
                if self.kind != "UGM":      # UGM normalises each fragment itself
                    if self.add_space_prefix and prev_special:
                        f = " " + f
                    if self._escape_ws:
                        f = f.replace(" ", _ESCAPED_SPACE)
                plan.append(-1 - len(texts))
                texts.append(f)
                prev_special = False
            encoded = [self._ugm.encode(t) for t in texts] if self.kind == "UGM" else self._run_engine(texts)
            for p in plan:
                if p >= 0:
                    out.append(p)
                else:
                    out.extend(encoded[-1 - p])
        if add_special:
            if self.add_eos:
                if self.eos is None:
                    raise TokenizerError(f"encode: the vocabulary adds EOS but defines no EOS token ({self.source})")
                out.append(self.eos)
            if self.kind == "WPM":   # BERT's [SEP], always (llama.cpp's WPM session)
                if self.sep is None:
                    raise TokenizerError(f"encode: the vocabulary adds SEP but defines no SEP token ({self.source})")
                out.append(self.sep)
        return out

    def _run_engine(self, texts: list[str]) -> list[list[int]]:
        """The Rust engine's ids for each prepared text. Long texts are cut where no token can span the
        cut (:meth:`_cuts`), so both cores work, the ids are the same and the engine's per-token
        records stay small: the pieces go in groups of about _GROUP characters."""
        out: list[list[int]] = [[] for _ in texts]
        group: list[str] = []
        owner: list[int] = []
        size = 0
        for k, t in enumerate(texts):
            for piece in self._cuts(t):
                group.append(piece)
                owner.append(k)
                size += len(piece)
                if size >= _GROUP:
                    self._engine(group, owner, out)
                    group, owner, size = [], [], 0
        if group:
            self._engine(group, owner, out)
        return out

    def _engine(self, pieces: list[str], owner: list[int], out: list[list[int]]) -> None:
        try:
            if len(pieces) == 1:
                out[owner[0]].extend(self._hf.encode(pieces[0], add_special_tokens=False).ids)
                return
            for k, enc in zip(owner, self._hf.encode_batch_fast(pieces, add_special_tokens=False)):
                out[k].extend(enc.ids)
        except BaseException as e:   # a Rust panic (e.g. the regex engine's backtracking limit)
            if isinstance(e, (KeyboardInterrupt, SystemExit, MemoryError)):
                raise
            raise TokenizerError(f"encode: the tokenizer engine failed on a piece of "
                                 f"{max(map(len, pieces))} characters: {e}") from None

    def _cuts(self, text: str) -> list[str]:
        """``text`` in pieces of about _CHUNK characters, cut only where no token can span the cut:
        after a lone newline between non-spaces, or before a space between ASCII letters.

        Every word-splitting BPE pre-tokenizer here ends a word at both (no expression lets a match
        run from whitespace into a non-space, or looks behind, and a lone newline after a non-space
        is one word whether or not more follows). SPM (and SPM-style BPE) merges run over the whole
        text, so a vocabulary is only cut where none of its tokens holds the two characters around
        the cut. A piece that cannot be cut is refused beyond _MAX_PIECE characters: the engine's
        memory grows with it (hundreds of bytes per character) and its regex search has limits."""
        cut = self._cut
        if len(text) < 2 * _CHUNK or cut is None:
            pieces = [text]
        else:
            pieces = []
            start = 0
            while True:
                m = cut.search(text, start + _CHUNK)
                if m is None or len(text) - m.start() < _CHUNK // 2:
                    pieces.append(text[start:])
                    break
                pieces.append(text[start:m.start()])
                start = m.start()
        for p in pieces:
            if len(p) > _MAX_PIECE:
                raise TokenizerError(f"encode: the text has a run of {len(p)} characters with no place where "
                                     f"it can be split (a line or word break); at most {_MAX_PIECE} are encoded "
                                     f"in one piece: encode it in parts")
        return pieces

    def encode_batch(self, texts: Iterable[Union[str, bytes]], add_special: bool = True,
                     parse_special: bool = False) -> list[list[int]]:
        """:meth:`encode` of each text; the texts run in parallel in the Rust engine where they can."""
        return [self.encode(t, add_special, parse_special) for t in texts]

    # ------------------------------------------------------------------ WPM

    def _wpm_split(self, text: str) -> list[str]:
        """llama.cpp's BERT pre-processing: NFD and removal of combining marks, lower case, split on
        whitespace; punctuation, ASCII symbols and CJK ideographs are words of their own; control,
        format and private-use characters dropped (what llama.cpp's Unicode tables say, checked
        against it category by category)."""
        if self.strip_accents:
            # llama.cpp's NFD table maps a Hangul syllable to its leading consonant alone (checked
            # against it: 퀢 and 킯 both give ▁ᄏ); the rest is Unicode's NFD
            text = unicodedata.normalize("NFD", text.translate(_HANGUL_LEAD)) if _HANGUL.search(text) \
                else unicodedata.normalize("NFD", text)
        words: list[str] = []
        cur: list[str] = []
        cat = unicodedata.category
        for ch in text:
            c = cat(ch)
            cp = ord(ch)
            # Unicode's White_Space: str.isspace() also counts the separators U+001C..U+001F
            if ch.isspace() and not 0x1C <= cp <= 0x1F:
                if cur:
                    words.append("".join(cur))
                    cur = []
                continue
            if cp == 0 or cp == 0xFFFD or c in ("Cc", "Cf", "Co"):
                continue
            if self.strip_accents and c[0] == "M":
                continue
            if self.lowercase:
                ch = ch.lower()
            if c[0] == "P" or (cp < 0x7F and c[0] == "S") or _is_cjk(cp):
                if cur:
                    words.append("".join(cur))
                    cur = []
                words.append(ch)
            else:
                cur.append(ch)
        if cur:
            words.append("".join(cur))
        return words

    def _wpm(self, text: str) -> list[int]:
        """Greedy longest match of each word, with the word-start marker, as llama.cpp's WPM session:
        the words split by regular expressions built from Python's Unicode tables, the matching in
        the engine's WordPiece (same rule: a word with an unmatched rest is one unknown token)."""
        if self._hf is None:
            return self._wpm_slow(text)
        if self.strip_accents:
            text = unicodedata.normalize("NFD", text.translate(_HANGUL_LEAD) if _HANGUL.search(text) else text)
        # controls (and marks) deleted, one-character words spaced out, then split on White_Space
        # (str.split's whitespace less U+001C..U+001F, which the table deleted)
        text = text.translate(_wpm_tables()[1 if self.strip_accents else 0])
        if self.lowercase:
            text = text.lower()
        words = text.split()
        known = self._wpm_known
        missing = list({w for w in words if w not in known})
        if missing:
            # the engine's WordPiece tries every length of the rest of a word (quadratic): long words
            # take the loop bounded by the longest token instead
            found = {w: tuple(self._wpm_greedy(w)) for w in missing if len(w) > _LONG_WORD}
            missing = [w for w in missing if len(w) <= _LONG_WORD]
            for k in range(0, len(missing), 1 << 14):
                part = missing[k:k + (1 << 14)]
                encs = self._hf.encode_batch_fast([[w] for w in part], is_pretokenized=True, add_special_tokens=False)
                found.update(zip(part, (tuple(e.ids) for e in encs)))
            if len(known) + len(found) <= self._wpm_limit:
                known.update(found)     # kept: words repeat, and a dictionary hit is the fast path
            else:
                known = {**known, **found}
        return list(itertools.chain.from_iterable(map(known.__getitem__, words)))

    def _wpm_slow(self, text: str) -> list[int]:
        out: list[int] = []
        for word in self._wpm_split(text):
            out.extend(self._wpm_greedy(word))
        return out

    def _wpm_greedy(self, word: str) -> list[int]:
        """One word's ids: the longest vocabulary entry at each place, starting with the word-start
        marker; the unknown token if some place has none (llama.cpp's WPM session)."""
        if len(word) > _MAX_PIECE:
            raise TokenizerError(f"encode: the text has a word of {len(word)} characters, with no place where it "
                                 f"can be split; at most {_MAX_PIECE} are encoded in one piece: encode it in parts")
        ids, maxlen = self._ids, self._max_token_len
        w = _ESCAPED_SPACE + word
        n = len(w)
        out: list[int] = []
        i = 0
        while i < n:
            for j in range(min(n, i + maxlen + 1), i, -1):
                tid = ids.get(w[i:j])
                if tid is not None:
                    out.append(tid)
                    i = j
                    break
            else:
                out = []
                break
        if not out:
            if self.unk is None:
                raise TokenizerError(f"encode: no tokens for the word {word[:40]!r} and no unknown token")
            out.append(self.unk)
        return out

    # ------------------------------------------------------------------ decode

    def token_to_piece(self, tid: int, special: bool = True) -> bytes:
        """The bytes ``tid`` stands for (llama.cpp's ``llama_token_to_piece``): part of a UTF-8 character
        for byte tokens; ``b""`` for control tokens when ``special`` is false."""
        i = self._check_id(tid, "token_to_piece")
        if not special and self._special_mask[i]:
            return b""
        return self._pieces[i]

    def decode_bytes(self, ids: Sequence[int], skip_special: bool = False) -> bytes:
        """:meth:`decode` before the UTF-8 check: the exact bytes of ``ids``."""
        ids = [self._check_id(t, "decode") for t in ids]
        remove_space = self.add_space_prefix
        if skip_special and self.add_bos and ids and ids[0] == self.bos:
            remove_space = False
            ids = ids[1:]
        if skip_special and self.add_eos and ids and ids[-1] == self.eos:
            ids = ids[:-1]
        pieces, mask = self._pieces, self._special_mask
        if skip_special:
            parts = [pieces[i] for i in ids if not mask[i]]
            first = next((i for i in ids if not mask[i]), None)
        else:
            parts = [pieces[i] for i in ids]
            first = ids[0] if ids else None
        # llama.cpp strips one leading space from the first piece it writes (the space SPM added)
        if remove_space and parts and first == ids[0] and parts[0][:1] == b" ":
            parts[0] = parts[0][1:]
        data = b"".join(parts)
        if self.clean_spaces:
            data = _clean_spaces(data)
        return data

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """The text of ``ids`` (llama.cpp's ``llama_detokenize``): bytes that do not form UTF-8 (a
        character cut at the end) become U+FFFD.

        Parameters
        ----------
        skip_special : bool
            Leave out control tokens (BOS, EOS, ``<|im_start|>``); llama.cpp's ``remove_special`` and
            not ``unparse_special``.
        """
        return self.decode_bytes(ids, skip_special).decode("utf-8", errors="replace")

    def detokenizer(self, skip_special: bool = True) -> Detokenizer:
        """A streaming :class:`Detokenizer` (control tokens left out by default, as a chat shows)."""
        return Detokenizer(self, skip_special)

    # ------------------------------------------------------------------ chat

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True, *,
                            tools: Optional[Sequence[dict]] = None, template: Optional[str] = None,
                            **kwargs: Any) -> str:
        """Render ``messages`` with the file's chat template (``tokenizer.chat_template``), sandboxed
        (see :mod:`ggmlpy.chat_template`); ``template`` overrides the file's.

        Raises
        ------
        TokenizerError
            The file has no chat template and none was given.
        ChatTemplateError
            The template failed (its own ``raise_exception``, a loop or output over the limits).
        """
        from ggmlpy.chat_template import ChatTemplate

        src = template if template is not None else self.chat_template
        if src is None:
            raise TokenizerError(f"apply_chat_template: {self.source} has no tokenizer.chat_template; pass "
                                 f"template=")
        bos = self._texts[self.bos] if self.bos is not None else ""
        eos = self._texts[self.eos] if self.eos is not None else ""
        return ChatTemplate(src, bos_token=bos, eos_token=eos).render(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs)


_wpm_cache: list = []


def _wpm_tables() -> tuple[dict, dict]:
    """``str.translate`` tables for llama.cpp's BERT pre-processing, from Python's Unicode tables
    (built once, on first use: a pass over every code point). Control, format and private-use
    characters that are not whitespace, NUL and U+FFFD are deleted; punctuation, ASCII symbols and
    CJK ideographs get a space on each side (words of their own). The second table also deletes
    combining marks (for ``strip_accents``)."""
    if _wpm_cache:
        return _wpm_cache[0]
    keep: dict[int, Optional[str]] = {0: None, 0xFFFD: None}
    marks: dict[int, Optional[str]] = {}
    cat = unicodedata.category
    for cp in range(1, 0x110000):
        if 0xD800 <= cp <= 0xDFFF:
            continue
        ch = chr(cp)
        c = cat(ch)
        if c in ("Cc", "Cf", "Co") and not (ch.isspace() and not 0x1C <= cp <= 0x1F):
            keep[cp] = None
        elif c[0] == "M":
            marks[cp] = None
        elif c[0] == "P" or (cp < 0x7F and c[0] == "S") or _is_cjk(cp):
            keep[cp] = f" {ch} "
    # every other BMP character maps to itself: str.translate then finds each character it looks up
    # (a miss costs a raised and cleared KeyError), twice as fast on mixed text
    both = {**keep, **marks}
    for table in (keep, both):
        for cp in range(0x10000):
            table.setdefault(cp, cp)
    _wpm_cache.append((keep, both))
    return _wpm_cache[0]


def _is_cjk(cp: int) -> bool:
    return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF or
            0x2A700 <= cp <= 0x2B73F or 0x2B740 <= cp <= 0x2B81F or 0x2B920 <= cp <= 0x2CEAF or
            0xF900 <= cp <= 0xFAFF or 0x2F800 <= cp <= 0x2FA1F)


def _clean_spaces(data: bytes) -> bytes:
    """llama.cpp's clean_up_tokenization_spaces, three passes over the bytes: no space before
    ``? ! . ,``; `` ' `` loses both spaces; no space before ``'s 'm 're 've`` (kept before ``'t 'd 'll``)."""
    if b" " not in data:
        return data
    b = bytearray(data)
    # pass 1
    out = bytearray(b[:1])
    for i in range(1, len(b)):
        x = b[i]
        if b[i - 1] == 0x20 and x in b"?!.,":
            out.pop()
        out.append(x)
    b = out
    # pass 2: " ' " -> "'" (llama.cpp blanks the second space, so it cannot start another match)
    out = bytearray(b[:1])
    prev = b[0] if b else 0
    i, n = 1, len(b)
    while i < n:
        x = b[i]
        if x == 0x27 and i + 1 < n and prev == 0x20 and b[i + 1] == 0x20:
            out.pop()
            out.append(x)
            prev = 0
            i += 2
            continue
        out.append(x)
        prev = x
        i += 1
    b = out
    # pass 3
    out = bytearray(b[:1])
    n = len(b)
    for i in range(1, n):
        x = b[i]
        if b[i - 1] == 0x20 and x == 0x27 and i + 1 < n:
            x1 = b[i + 1]
            if x1 in b"sm" or (i + 2 < n and bytes(b[i + 1:i + 3]) in (b"re", b"ve")):
                out.pop()
        out.append(x)
    return bytes(out)


# --- UGM (T5-style Unigram, llama.cpp's llm_tokenizer_ugm) ----------------------------------------------

#: what llama.cpp takes off the lowest normal score to score a character no token holds
_UGM_UNK_PENALTY = 10.0
_UGM_SPACES = re.compile(" +")
_FLT_MAX = 3.4028234663852886e38
_charsmap_cache: dict = {}
_CHARSMAP_PATHS = 1 << 21


def _parse_charsmap(data: bytes, source: str) -> dict[str, str]:
    """SentencePiece's precompiled charsmap (``tokenizer.ggml.precompiled_charsmap``) as a dict of every
    input string it rewrites to its replacement.

    The blob is a 4-byte size, an XOR-compressed compact double array over UTF-8 bytes and the
    NUL-terminated replacements. llama.cpp walks the array at each place of the text for the longest
    matching key; listing every key once (every path the walk can take from the root) lets the
    walk be a dictionary look-up. The checks llama.cpp makes while it walks (an index outside the
    array or the replacements, an unterminated replacement) are made here for every key, when the
    file loads."""
    cached = _charsmap_cache.get(data)
    if cached is not None:
        return cached
    import numpy as np

    bad = f"{source}: tokenizer.ggml.precompiled_charsmap is malformed"
    if len(data) < 4:
        raise TokenizerError(f"{bad} (shorter than its size header)")
    blob = int.from_bytes(data[:4], "little")
    if blob + 4 >= len(data):
        raise TokenizerError(f"{bad} (its array of {blob} bytes leaves no replacement strings)")
    n = blob // 4
    repl = data[4 + blob:]
    keys: dict[bytes, bytes] = {}
    if n:
        arr = np.frombuffer(data, dtype="<u4", count=n, offset=4).astype(np.int64)
        base = ((arr >> 10) << ((arr & (1 << 9)) >> 6)).tolist()
        check = arr & ((1 << 31) | 0xFF)
        leaf = ((arr >> 8) & 1).tolist()
        value = (arr & ((1 << 31) - 1)).tolist()
        # the walk goes from node position p on byte c to entry p ^ c when that entry's check is c:
        # each entry with a check of 1..255 is the child of exactly one position
        kids = np.nonzero((check > 0) & (check < 256))[0]
        children: dict[int, list[int]] = {}
        for i, p in zip(kids.tolist(), (kids ^ check[kids]).tolist()):
            children.setdefault(p, []).append(i)
        stack = [(base[0], b"")]
        visited = 0
        while stack:
            pos, key = stack.pop()
            visited += 1
            # SentencePiece's have about 200 thousand paths of a few bytes; a crafted array could
            # share nodes to make exponentially many, or loop
            if len(key) >= 256 or visited > _CHARSMAP_PATHS:
                raise TokenizerError(f"{bad} (more than {_CHARSMAP_PATHS} keys, or a key of more than 255 bytes)")
            for i in children.get(pos, ()):
                k = key + bytes((i ^ pos,))
                nxt = i ^ base[i]
                if leaf[i]:
                    if nxt >= n:
                        raise TokenizerError(f"{bad} (an index outside the array)")
                    off = value[nxt]
                    end = repl.find(b"\0", off) if off < len(repl) else -1
                    if end < 0:
                        raise TokenizerError(f"{bad} (a replacement outside the data or not terminated)")
                    keys[k] = repl[off:end]
                stack.append((nxt, k))
    try:
        out = {k.decode("utf-8"): v.decode("utf-8") for k, v in keys.items()}
    except UnicodeDecodeError:
        raise TokenizerError(f"{source}: tokenizer.ggml.precompiled_charsmap rewrites bytes that are not whole "
                             f"UTF-8 characters; this is not supported") from None
    _charsmap_cache.clear()
    _charsmap_cache[data] = out
    return out


def _char_class(chars) -> re.Pattern:
    """A pattern matching any one of ``chars``, fast: Python's regular expressions test a class with
    characters beyond U+FFFF one range at a time, so those are only looked at after a cheap test."""
    bmp = "".join(map(re.escape, sorted(c for c in chars if ord(c) < 0x10000)))
    astral = "".join(map(re.escape, sorted(c for c in chars if ord(c) >= 0x10000)))
    alts = ([f"[{bmp}]"] if bmp else []) + ([f"[\U00010000-\U0010FFFF](?<=[{astral}])"] if astral else [])
    return re.compile("|".join(alts))


def _float32(x: float) -> float:
    import numpy as np

    return float(np.float32(x))


def _grain(scores) -> int:
    """The exponent e such that every score is a whole multiple of 2**e (float32: 24 significant bits)."""
    import math

    nz = [abs(s) for s in scores if s]
    return min(math.frexp(s)[1] for s in nz) - 24 if nz else 0


class _Ugm:
    """What llama.cpp's UGM tokenizer needs, built from one vocabulary: the normaliser (charsmap,
    whitespace), the scored pieces and the engine that runs the Viterbi search.

    llama.cpp's session, per text fragment (special tokens are split out before):

    * normalise: at each place the longest key of the precompiled charsmap is replaced (the output is
      not looked at again), other characters are kept; then every space (only U+0020, after the map:
      the usual charsmap has turned tabs and newlines into spaces) becomes ``▁``. With
      ``remove_extra_whitespaces`` runs of spaces and the spaces at the ends go, and every run of
      non-spaces gets one ``▁`` before it; else ``add_space_prefix`` puts one ``▁`` before the first
      non-space (after any leading spaces), and a fragment of spaces alone gets none. Each fragment
      is normalised on its own, so the text after a special token gets its own prefix. (llama.cpp
      never sets ``treat_whitespace_as_suffix`` from a file, so the suffix mode never applies; it
      matches user-defined tokens before the charsmap, but those were split out already.)
    * Viterbi over code points: normal, user-defined (score 0) and unused tokens, by their score
      summed in double precision, a later candidate replacing the best only when strictly better; a
      code point that no single-code-point token holds is also the unknown token, scored the lowest
      normal score minus 10 (in float32); runs of unknown tokens come out as one.

    The engine is Hugging Face's ``Unigram``, which is that same search (SentencePiece's), when the
    vocabulary allows it to be exact: it scores the unknown token from the lowest score of all its
    entries, so entries that cannot match (control, byte, unknown tokens) are given names with a
    space (the normalised text has none) and a score that does not lower that minimum, and an extra
    such entry sets it to llama.cpp's value. Unused tokens too long and too low to ever win (their
    code points one by one always score better: the ``[PAD…]`` tokens at -10000 in XLM-R
    vocabularies) are left out; a vocabulary the engine cannot reproduce uses :meth:`viterbi`, the
    same search in Python.

    Words: a normalised text may be cut where no token can span the cut, before a ``▁`` that follows
    a character no token has right before a ``▁``; every path then passes through the cut. With the
    sums exact (every score a multiple of 2**grain and no sum beyond 2**(53 + grain), which holds for
    texts up to :attr:`exact_len` code points) the choices after the cut do not depend on the score
    before it, so the parts give the same tokens as the whole. So the text is cut at every such
    place and each word's ids are kept (words repeat; the engine encodes the new ones in parallel),
    and runs of unknown tokens across cuts are joined afterwards, as llama.cpp joins them. A text
    longer than :attr:`exact_len` is searched whole."""

    def __init__(self, tok: Tokenizer, md: dict) -> None:
        import numpy as np

        self.unk = tok.unk
        self._unk_text = tok._texts[tok.unk] if tok.unk is not None else None
        self.merge_spaces = tok.remove_extra_whitespaces
        self.space_prefix = tok.add_space_prefix
        raw = md.get("tokenizer.ggml.precompiled_charsmap")
        cmap: dict[str, str] = {}
        if raw is not None and len(raw):
            if isinstance(raw, (bytes, bytearray)):
                data = bytes(raw)
            else:
                try:
                    data = np.asarray(raw).astype(np.uint8).tobytes()
                except (TypeError, ValueError):
                    raise TokenizerError(f"{tok.source}: tokenizer.ggml.precompiled_charsmap must be an array "
                                         f"of bytes") from None
            cmap = _parse_charsmap(data, tok.source)
        self.cmap = cmap
        # a key can only start where its first character is a one-character key, or where the next
        # character is the second of a longer key: the scan looks only there
        self.cmap_starts = frozenset(k[0] for k in cmap if len(k) > 1)
        trig = {k for k in cmap if len(k) == 1} | {k[1] for k in cmap if len(k) > 1}
        self.cmap_hit = _char_class(trig) if trig else None
        ascii_trig = {c for c in trig if c < "\x80"}
        self.cmap_hit_ascii = _char_class(ascii_trig) if ascii_trig else None
        # ASCII characters replaced before the scan, in C (tab and newline, to a space): no longer
        # key starts with them or holds them and no key holds a character of their replacement, so
        # the scan would visit them alone and, after the change, finds nothing new
        in_keys = set().union(*cmap) if cmap else set()
        later = {c for k in cmap for c in k[1:]}
        self.cmap_inert = [(k, r) for k, r in cmap.items()
                           if len(k) == 1 and k < "\x80" and r and k not in self.cmap_starts and k not in later
                           and not in_keys.intersection(r)]
        self.cmap_len = max(map(len, cmap), default=1)

        # the pieces llama.cpp's trie holds (a text held twice: the later id, as its trie)
        n = tok.n_vocab
        scores = tok._scores
        s32 = np.zeros(n, np.float32) if scores is None else np.asarray(scores, dtype=np.float32)[:n]
        attrs = tok._attrs
        normal, user, unused = int(TokenAttr.NORMAL), int(TokenAttr.USER_DEFINED), int(TokenAttr.UNUSED)
        texts = tok._texts
        score_list = s32.tolist()
        pieces: dict[str, tuple[int, float]] = {}
        low = _FLT_MAX
        for i, a in enumerate(attrs):
            if a & (normal | user | unused):
                pieces[texts[i]] = (i, 0.0 if a & user else score_list[i])
            if a & normal:
                low = min(low, score_list[i])
        self.pieces = pieces
        self.max_piece = max(map(len, pieces), default=1)
        self.unk_score = _float32(low - _UGM_UNK_PENALTY) if low < _FLT_MAX else _FLT_MAX
        self.hf = None
        self.exact_len = 0
        self.cut: Optional[re.Pattern] = None     # where a normalised text may be cut (None: before every ▁)
        self._words: dict[str, tuple] = {}
        self._words_limit = 1 << 17
        self._build_engine(n)

    def _build_engine(self, n: int) -> None:
        if self.unk_score >= 0 or not self.pieces:
            return
        if self.unk is not None and self.pieces.get(self._unk_text, (None,))[0] == self.unk:
            return      # an unknown id that is also a piece: the engine would join its matches by text
        # the lowest a code point can score on its own (a one-code-point token, else the unknown one)
        floor = min([self.unk_score] + [s for t, (_, s) in self.pieces.items() if len(t) == 1])
        # a longer token scoring below its code points one by one can never be on the best path
        # (the margin of 1 covers any rounding of the sums)
        kept = {t: v for t, v in self.pieces.items() if len(t) == 1 or v[1] + 1.0 >= len(t) * floor}
        target = self.unk_score + _UGM_UNK_PENALTY      # the engine scores unknowns from its minimum
        if target - _UGM_UNK_PENALTY != self.unk_score or any(s < target for _, s in kept.values()):
            return
        vocab: list[tuple[str, float]] = [(f" {i}", target) for i in range(n + 1)]
        for t, (i, s) in kept.items():
            vocab[i] = (t, s)
        if len({t for t, _ in vocab}) != n + 1:
            return
        from tokenizers import Tokenizer as _HFTokenizer
        from tokenizers import pre_tokenizers
        from tokenizers.models import Unigram

        # the engine's unknown id: the extra entry when the vocabulary has none (found and refused)
        self._unk_engine = self.unk if self.unk is not None else n
        model = Unigram(vocab, unk_id=self._unk_engine, byte_fallback=False)
        # its cache would keep every text it searched, long ones too; _by_word keeps the short words
        model._resize_cache(0)
        self.hf = _HFTokenizer(model)
        # words go in joined by spaces (see _engine_words); a normalised text has none to split
        self.hf.pre_tokenizer = pre_tokenizers.Split(" ", behavior="removed")
        grain = _grain([s for _, s in kept.values()] + [self.unk_score])
        top = max([abs(s) for _, s in kept.values()] + [abs(self.unk_score)])
        per_cp = max(abs(floor), max([s for _, s in kept.values()] + [0.0]))
        self.exact_len = max(0, int((2.0 ** (53 + grain) - top) / per_cp) - 1) if per_cp else 1 << 62
        before = sorted({t[k - 1] for t in kept for k in range(1, len(t)) if t[k] == _ESCAPED_SPACE})
        if before:
            self.cut = re.compile("(?<![" + "".join(map(re.escape, before)) + "])(?=" + _ESCAPED_SPACE + ")")

    # ------------------------------------------------------------------ normalise

    def charsmap(self, text: str) -> str:
        """The precompiled charsmap applied as llama.cpp walks it: the longest key at each place."""
        cmap = self.cmap
        if not cmap:
            return text
        for c, r in self.cmap_inert:
            if c in text:
                text = text.replace(c, r)
        pattern = self.cmap_hit_ascii if text.isascii() else self.cmap_hit
        if pattern is None:
            return text
        hit = pattern.search
        m = hit(text)
        if m is None:
            return text
        starts, longest, n = self.cmap_starts, self.cmap_len, len(text)
        out: list[str] = []
        p = 0
        while m is not None:
            h = m.start()
            j = h - 1 if h > p else h     # a key may start just before the character found
            out.append(text[p:j])
            while j <= h:
                c = text[j]
                if c in starts:
                    for k in range(min(longest, n - j), 0, -1):
                        r = cmap.get(text[j:j + k])
                        if r is not None:
                            out.append(r)
                            j += k
                            break
                    else:
                        out.append(c)
                        j += 1
                else:
                    r = cmap.get(c)
                    out.append(c if r is None else r)
                    j += 1
            p = j
            m = hit(text, p)
        out.append(text[p:])
        return "".join(out)

    def spaces(self, text: str) -> str:
        """The whitespace step of the normalisation, on the charsmap's output."""
        if self.merge_spaces:
            text = text.strip(" ")
            return _ESCAPED_SPACE + _UGM_SPACES.sub(_ESCAPED_SPACE, text) if text else ""
        if self.space_prefix:
            lead = len(text) - len(text.lstrip(" "))
            if lead < len(text):
                text = text[:lead] + " " + text[lead:]
        return text.replace(" ", _ESCAPED_SPACE)

    def normalize(self, text: str) -> str:
        """llama.cpp's UGM normalisation of one fragment (see the class)."""
        return self.spaces(self.charsmap(text))

    # ------------------------------------------------------------------ encode

    def encode(self, text: str) -> list[int]:
        """The ids of one fragment (raw text between special tokens), as llama.cpp's UGM session."""
        text = self.charsmap(text)
        if self.hf is None:
            return self._checked(self.spaces(text), self.viterbi)
        if self.merge_spaces and self.cut is None and len(text) < self.exact_len:
            # words are the runs of non-spaces, each after one ▁ (a ▁ of the text's own inside a word
            # just goes uncut)
            words = list(filter(None, text.split(" ")))
            return self.finish(self._by_word(words, None))
        text = self.spaces(text)
        if len(text) > self.exact_len:
            return self.finish(self._checked(text, self._engine_one))
        if self.cut is None:
            words = text.split(_ESCAPED_SPACE)
            head = words[0]
            ids = self._by_word(words[1:], None)
            return self.finish(self._engine_one(head) + ids if head else ids)
        return self.finish(self._by_word([w for w in self.cut.split(text) if w], ""))

    def _by_word(self, words: list[str], prefix: Optional[str]) -> list[int]:
        """Ids of the words in order, each word searched on its own (``prefix`` None: ``▁`` + word)."""
        known = self._words
        missing = set(words).difference(known)
        if missing:
            new = list(missing)
            pre = _ESCAPED_SPACE if prefix is None else prefix
            texts = [pre + w for w in new]
            for t in texts:
                if len(t) > _MAX_PIECE:
                    raise TokenizerError(f"encode: the text has a run of {len(t)} characters with no place where "
                                         f"it can be split (a space); at most {_MAX_PIECE} are encoded in one "
                                         f"piece: encode it in parts")
            found = dict(zip(new, self._engine_words(texts)))
            # kept for later texts up to a bound, long words never (they rarely repeat)
            keep = {w: v for w, v in found.items() if len(w) <= _LONG_WORD}
            stored = len(known) + len(keep) <= self._words_limit
            if stored:
                known.update(keep)
            if not stored or len(keep) != len(found):
                known = {**known, **found}
        return list(itertools.chain.from_iterable(map(known.__getitem__, words)))

    def _engine_words(self, texts: list[str]) -> list[tuple]:
        """Each text's ids, searched on its own. The texts go to the engine joined by spaces into
        pieces of about _CHUNK characters (its pre-tokenizer splits them there again; normalised
        text has no space), in parallel, in groups of about _GROUP characters; the word index of
        each token gives the words back."""
        from collections import Counter

        out: list[tuple] = []
        pieces: list[list[str]] = []
        cur: list[str] = []
        size = total = 0

        def run() -> None:
            try:
                encs = self.hf.encode_batch([" ".join(p) for p in pieces], add_special_tokens=False)
            except BaseException as e:
                if isinstance(e, (KeyboardInterrupt, SystemExit, MemoryError)):
                    raise
                raise TokenizerError(f"encode: the tokenizer engine failed on {sum(map(len, pieces))} words: "
                                     f"{e}") from None
            for p, enc in zip(pieces, encs):
                ids, count, at = enc.ids, Counter(enc.word_ids), 0
                for k in range(len(p)):
                    n = count[k]
                    out.append(tuple(ids[at:at + n]))
                    at += n

        for t in texts:
            cur.append(t)
            size += len(t) + 1
            if size >= _CHUNK:
                pieces.append(cur)
                total += size
                cur, size = [], 0
                if total >= _GROUP:
                    run()
                    pieces, total = [], 0
        if cur:
            pieces.append(cur)
        if pieces:
            run()
        return out

    def _engine_one(self, text: str) -> list[int]:
        try:
            return self.hf.encode(text, add_special_tokens=False).ids
        except BaseException as e:
            if isinstance(e, (KeyboardInterrupt, SystemExit, MemoryError)):
                raise
            raise TokenizerError(f"encode: the tokenizer engine failed on a piece of {len(text)} characters: "
                                 f"{e}") from None

    @staticmethod
    def _checked(text: str, search) -> list[int]:
        if len(text) > _MAX_PIECE:
            raise TokenizerError(f"encode: the text has a run of {len(text)} characters that this vocabulary "
                                 f"searches whole; at most {_MAX_PIECE} are encoded in one piece: encode it in "
                                 f"parts")
        return search(text)

    def viterbi(self, text: str) -> list[int]:
        """llama.cpp's UGM search in Python over one normalised text: the reference the engine is
        checked against, and the search for vocabularies the engine cannot reproduce."""
        n = len(text)
        if not n:
            return []
        pieces, longest, unk_score = self.pieces, self.max_piece, self.unk_score
        unk = -1 if self.unk is None else self.unk
        best = [0.0] + [float("-inf")] * n
        tid = [unk] * (n + 1)
        start = [0] * (n + 1)
        get = pieces.get
        for i in range(n):
            here = best[i]
            single = False
            for k in range(1, min(longest, n - i) + 1):
                e = get(text[i:i + k])
                if e is not None:
                    if k == 1:
                        single = True
                    s = here + e[1]
                    if s > best[i + k]:
                        best[i + k], tid[i + k], start[i + k] = s, e[0], i
            if not single:
                s = here + unk_score
                if s > best[i + 1]:
                    best[i + 1], tid[i + 1], start[i + 1] = s, unk, i
        out: list[int] = []
        pos = n
        while pos > 0:
            t = tid[pos]
            if not (t == unk and out and out[-1] == unk):
                out.append(t)
            pos = start[pos]
        out.reverse()
        if unk == -1 and -1 in out:
            raise TokenizerError("encode: the text has a character no token holds and the vocabulary defines no "
                                 "unknown token")
        return out

    def finish(self, ids: list[int]) -> list[int]:
        """The engine's ids of one fragment as llama.cpp gives them: runs of unknown tokens (split by
        cuts) as one; an unknown character with no unknown token refused."""
        unk = self._unk_engine
        if unk not in ids:
            return ids
        if self.unk is None:
            raise TokenizerError("encode: the text has a character no token holds and the vocabulary defines no "
                                 "unknown token")
        drop = set()
        k = ids.index(unk)
        try:
            while True:
                if k and ids[k - 1] == unk:
                    drop.add(k)
                k = ids.index(unk, k + 1)
        except ValueError:
            pass
        return [t for k, t in enumerate(ids) if k not in drop] if drop else ids


class Detokenizer:
    """Tokens in, text out as soon as it is whole UTF-8.

    :meth:`feed` returns the text a token completes: a character split across byte tokens is held
    back until its last byte arrives, never emitted broken. :meth:`flush` returns what is still held
    (an incomplete character as U+FFFD). The text fed piece by piece equals ``decode`` of all the ids
    without the first-space and space clean-up rules, which apply to a whole text only.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special
        self._held = b""

    def feed(self, tid: int) -> str:
        """The text completed by one more token (possibly ``""``)."""
        piece = self._tok.token_to_piece(tid, special=not self._skip)
        if not piece:
            return ""
        data = self._held + piece
        cut = _complete_utf8(data)
        self._held = data[cut:]
        return data[:cut].decode("utf-8", errors="replace")

    def flush(self) -> str:
        """Whatever is held back, as text (an incomplete character as U+FFFD); resets the stream."""
        data, self._held = self._held, b""
        return data.decode("utf-8", errors="replace")

    @property
    def pending(self) -> bytes:
        """Bytes held back: the start of a character not yet complete."""
        return self._held


def _complete_utf8(data: bytes) -> int:
    """Length of the longest prefix of ``data`` that does not end inside a UTF-8 character that could
    still be completed (invalid bytes count as complete: they decode to U+FFFD now)."""
    n = len(data)
    # a character is at most 4 bytes: look back at most 3 for an unfinished lead byte
    for back in range(1, min(4, n + 1)):
        b = data[n - back]
        if b & 0xC0 == 0x80:       # continuation byte: keep looking for its lead
            continue
        need = 2 if b & 0xE0 == 0xC0 else 3 if b & 0xF0 == 0xE0 else 4 if b & 0xF8 == 0xF0 else 1
        if need > back:
            # an unfinished lead: hold it if the bytes so far could start a valid character
            try:
                data[n - back:].decode("utf-8")
            except UnicodeDecodeError as e:
                if e.reason == "unexpected end of data":
                    return n - back
            return n
        return n
    return n
