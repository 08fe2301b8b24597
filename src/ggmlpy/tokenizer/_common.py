"""What the tokenizer kinds share: the error, token types and attributes, the special-token texts
llama.cpp recognises, limits and checks of the text, and decoding's byte rules (llama.cpp's clean-up of
spaces, where UTF-8 text is whole)."""

from __future__ import annotations

import enum
import re

from ggmlpy._core import GGMLValueError


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


_CUT_WORDS = re.compile(r"(?<=\S\n)(?=\S)|(?<=[A-Za-z])(?= [A-Za-z])")
_NL_NONSPACE = re.compile(r"\n\S")
_LETTER_SPACE = re.compile("[A-Za-z]\u2581")
_CHUNK = 1 << 14
_HANGUL = re.compile("[\uAC00-\uD7A3]")
_HANGUL_LEAD = {cp: 0x1100 + (cp - 0xAC00) // 588 for cp in range(0xAC00, 0xD7A4)}
_GROUP = 1 << 20
_MAX_PIECE = 1 << 20
_LONG_WORD = 256
#: the longest vocabulary entry accepted, in characters: twice the longest of any vocabulary llama.cpp
#: ships (512, a run of spaces in GPT-NeoX-style BPE vocabularies; SentencePiece's are 16). Per-token
#: work (SPM merges, byte pieces, longest-match and Viterbi searches) grows with it, so a vocabulary's
#: load and search cost stay proportional to its size.
_MAX_TOKEN = 1024
#: an SPM vocabulary's merges (splits of a token into two tokens) per token, and their characters per
#: character of the vocabulary: at most these (llama.cpp's SPM vocabularies have about 2 of each)
_SPM_MERGES = 8
_SPM_MERGE_CHARS = 16
#: SPM merges: a part of at most this many characters is looked up directly (see Tokenizer._spm_merges)
_SHORT = 16
#: a token's decoded piece bigger than this (BPE text outside the byte mapping, which llama.cpp spells
#: out with the whole text per character) is made when asked for, not kept for every token; one bigger
#: than _MAX_TOKEN_PIECE is refused
_KEEP_PIECE = 1 << 8
_MAX_TOKEN_PIECE = 1 << 16
_AS_TEXT = int(TokenAttr.UNKNOWN | TokenAttr.CONTROL | TokenAttr.USER_DEFINED)
_NORMAL = int(TokenAttr.NORMAL)
_BYTE = int(TokenAttr.BYTE)


def _text_arg(text: str | bytes, what: str) -> str:
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


def _engine_model(source: str, what: str, make, *args, **kwargs):
    """``make(*args, **kwargs)``: a model of the Rust engine built from a vocabulary (checked before it
    gets here); should the engine still refuse it, a TokenizerError, not the engine's own exception or
    a Rust panic (a BaseException)."""
    try:
        return make(*args, **kwargs)
    except BaseException as e:
        if isinstance(e, (KeyboardInterrupt, SystemExit, MemoryError)):
            raise
        raise TokenizerError(f"{source}: the tokenizer engine cannot build this {what} vocabulary: {e}") from None


# --- decoding: bytes to text ------------------------------------------------------------------------


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
