"""The :class:`Tokenizer`: text to ids and back, as llama.cpp does (the package's docstring says how for
each kind of vocabulary)."""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from . import _meta
from ._bpe import (
    _BYTE_LEVEL,
    _CHAR_TO_BYTE,
    _CHAR_TO_BYTE_TABLE,
    _NOT_BYTE_LEVEL,
    _PRE_TOKENIZERS,
    _Pre,
)
from ._common import (
    _AS_TEXT,
    _BYTE,
    _C_SPACE,
    _CHUNK,
    _CUT_WORDS,
    _EOG_TEXTS,
    _EOT_TEXTS,
    _ESCAPED_SPACE,
    _FIM_TEXTS,
    _GROUP,
    _KEEP_PIECE,
    _LETTER_SPACE,
    _MAX_PIECE,
    _MAX_TOKEN_PIECE,
    _NL_NONSPACE,
    _NORMAL,
    _PARTITIONED,
    _SHORT,
    _SPECIAL,
    _SPECIAL_IDS,
    _SPM_MERGE_CHARS,
    _SPM_MERGES,
    _TYPE_TO_ATTR,
    TokenAttr,
    TokenizerError,
    TokenType,
    _check_encodable,
    _clean_spaces,
    _engine_model,
    _text_arg,
)
from ._ugm import _Ugm
from ._wpm import _WpmMethods
from .detokenizer import Detokenizer

__all__ = ["TokenAttr", "TokenType", "Tokenizer", "TokenizerError"]


class Tokenizer(_WpmMethods):
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
    chat_templates : dict of str to str
        The file's named templates, ``tokenizer.chat_template.<name>`` by name (a reranker's ``rerank``,
        with ``{query}`` and ``{document}`` to fill in).
    """

    def __init__(self, md: dict, source: str = "<metadata>") -> None:
        if not isinstance(md, Mapping):
            raise TypeError(f"Tokenizer: the metadata must be a mapping (a GGUF file's metadata), not "
                            f"{type(md).__name__}")
        self.source = source
        # every key is checked as it is read (see _meta): a malformed one is a TokenizerError naming it
        model = md.get("tokenizer.ggml.model")
        if model is not None and not isinstance(model, str):
            raise _meta._bad(source, "tokenizer.ggml.model", f"must be a string, not {_meta._kind(model)}")
        if model is None or model in ("none", "no_vocab"):
            raise TokenizerError(f"{source}: the file has no tokenizer (tokenizer.ggml.model is "
                                 f"{'missing' if model is None else repr(model)}); pass token ids instead of text")
        self.model = model
        self.pre = _meta.meta_str(md, "tokenizer.ggml.pre", source) or ""
        tokens = _meta.meta_tokens(md, source)
        n = len(tokens)
        # llama.cpp names empty tokens so every text maps back to one id
        self._texts: list[str] = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        self.n_vocab = n
        self._scores = _meta.meta_scores(md, n, source)
        types = _meta.meta_token_types(md, n, source)
        undefined = int(TokenAttr.UNDEFINED)
        type_attr = {int(t): int(a) for t, a in _TYPE_TO_ATTR.items()}
        self._attrs: list[int] = ([int(TokenAttr.NORMAL)] * n if types is None else
                                  [type_attr.get(t, undefined) for t in types])
        self._ids: dict[str, int] = {t: i for i, t in enumerate(self._texts)}   # last wins, as llama.cpp
        self.chat_template: str | None = md.get("tokenizer.chat_template")
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            self.chat_template = None
        named = "tokenizer.chat_template."
        self.chat_templates: dict[str, str] = {k[len(named):]: v for k, v in md.items()
                                               if k.startswith(named) and isinstance(v, str)}
        self._setup_type(md)
        self._setup_special(md)
        # None: a piece too big to keep for every token, made when it is asked for (see _piece)
        self._pieces: list[bytes | None] = [self._piece(i, keep=True) for i in range(n)]
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
            (the message names the key and value), or malformed vocabulary metadata: a key of the
            wrong type (a flag that is not a bool, a token id that is not an unsigned integer, tokens
            or merges that are not strings), arrays whose length is not the number of tokens, scores
            that are not finite float32 numbers, token types outside :class:`TokenType`, a token of
            more than 1024 characters, an SPM vocabulary whose tokens split into other tokens in
            more than 8 ways per token, a BPE token that decodes to more than 64 KiB. The message
            names the key (and the entry). A special token id past the vocabulary is dropped with a
            warning, as llama.cpp does.
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

    def _setup_type(self, md: dict) -> None:
        self.add_space_prefix = False
        self.clean_spaces = False
        self.add_sep = False
        self._escape_ws = False
        self.remove_extra_whitespaces = False
        self._pre_cfg: _Pre | None = None
        bos: int | None
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
            self.remove_extra_whitespaces = _meta.meta_bool(md, "tokenizer.ggml.remove_extra_whitespaces",
                                                            self.source, False)
        else:
            kinds = {"rwkv": "RWKV", "plamo2": "PLaMo-2", "hybriddna": "HybridDNA"}
            raise TokenizerError(f"{self.source}: tokenizer.ggml.model = {self.model!r}"
                                 f"{' (' + kinds[self.model] + ')' if self.model in kinds else ''} is not supported "
                                 f"(supported: 'llama' (SPM), 'gpt2' (BPE), 'gemma4', 'bert' (WPM), 't5' (UGM))")
        self.add_space_prefix = _meta.meta_bool(md, "tokenizer.ggml.add_space_prefix", self.source,
                                                self.add_space_prefix)
        self.unk, self.sep, self.pad, self.mask = unk, sep, pad, mask
        self.bos, self.eos = bos, eos
        self.eot = self.eom = None

    def _setup_special(self, md: dict) -> None:
        n = self.n_vocab
        ids: dict[str, int | None] = {"bos": self.bos, "eos": self.eos, "eot": None, "eom": None,
                                         "unknown": self.unk, "seperator": self.sep, "padding": self.pad,
                                         "mask": self.mask}
        ids.update({k: None for k in _FIM_TEXTS})
        for k in ids:
            if ids[k] is not None and ids[k] >= n:
                ids[k] = None
        src = self.source
        for k in _SPECIAL_IDS:
            v = _meta.meta_id(md, f"tokenizer.ggml.{k}_token_id", n, src)
            if v is not None:
                ids[k] = v
        self.add_bos = _meta.meta_bool(md, "tokenizer.ggml.add_bos_token", src, self.add_bos)
        self.add_eos = _meta.meta_bool(md, "tokenizer.ggml.add_eos_token", src, self.add_eos)
        self.add_sep = _meta.meta_bool(md, "tokenizer.ggml.add_sep_token", src, self.add_sep)
        if self._pre_cfg is not None and self._pre_cfg.add_bos and self.model == "gemma4":
            self.add_bos = True
        self.lowercase = _meta.meta_bool(md, "tokenizer.ggml.normalizer.lowercase", src, False)
        self.strip_accents = _meta.meta_bool(md, "tokenizer.ggml.normalizer.strip_accents", src, self.lowercase)
        if self.model == "bert" and "tokenizer.ggml.normalizer.lowercase" not in md:
            self.lowercase = self.strip_accents = True   # llama.cpp's BertNormalizer defaults for WPM

        attrs = self._attrs
        control = int(TokenAttr.CONTROL)

        def mark(tid: int) -> None:
            attrs[tid] |= control

        # tokens recognised by text: llama.cpp takes the first it meets in its (unordered) map; the first
        # in the order of its list of texts is deterministic and agrees with it on every vocabulary
        # llama.cpp ships (<|eot_id|> over <|end_of_text|>, <|im_end|> over <|endoftext|>)
        def by_text(texts) -> int | None:
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
        # model-specific attributes, by name: a name that is not a string is no name (these keys are
        # the model's, not the vocabulary's)
        name = md.get("general.name")
        name = name.lower() if isinstance(name, str) else ""
        arch = md.get("general.architecture")
        arch = arch if isinstance(arch, str) else ""
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

    def _piece(self, tid: int, keep: bool = False) -> bytes | None:
        """llama.cpp's token_to_piece(special=True) for one token. ``keep``: None instead of a piece
        that is not worth keeping for every token (see below)."""
        text, attr = self._texts[tid], self._attrs[tid]
        if attr & _AS_TEXT:
            return text.encode("utf-8")
        if attr & _NORMAL:
            if self.kind == "BPE" and not self._escape_ws:
                if _BYTE_LEVEL.fullmatch(text):         # every character stands for one byte
                    return text.translate(_CHAR_TO_BYTE_TABLE).encode("latin-1")
                # llama.cpp writes the whole text again for each character outside the byte mapping:
                # a piece quadratic in the token's length. One bigger than _MAX_TOKEN_PIECE is refused
                # (llama.cpp's vocabularies have single characters there: 25 bytes), and a big one is
                # made when asked for, not kept for every token
                if keep:
                    odd = _NOT_BYTE_LEVEL.findall(text)
                    size = (len(text) - len(odd) + len(odd) * (13 + len(text.encode("utf-8")))
                            + 2 * len("".join(odd).encode("utf-8")))
                    if size > _MAX_TOKEN_PIECE:
                        raise _meta._bad(self.source, "tokenizer.ggml.tokens",
                                         f"entry {tid} has {len(odd)} characters outside GPT-2's byte mapping; "
                                         f"llama.cpp decodes it to {size} bytes (at most {_MAX_TOKEN_PIECE} are "
                                         f"accepted)")
                    if size > _KEEP_PIECE:
                        return None
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
            self._build_wpm()     # its own engine (see _WpmMethods)
            return
        vocab = dict(self._ids)
        if self.kind == "SPM":
            merges = self._spm_merges()
            unk = self._texts[self.unk] if self.unk is not None else None
            model = _engine_model(self.source, "SPM", BPE, vocab, merges, unk_token=unk, byte_fallback=True,
                                  fuse_unk=False)
            tok = _HFTokenizer(model)
        else:
            merges = []
            for m in _meta.meta_merges(md, self.source):
                pos = m.find(" ", 1)
                a, b = m[:pos], m[pos + 1:]
                # a merge of pieces the vocabulary lacks can never apply (llama.cpp keeps it unused)
                if a in vocab and b in vocab and a + b in vocab:
                    merges.append((a, b))
            cfg = self._pre_cfg
            model = _engine_model(self.source, "BPE", BPE, vocab, merges, ignore_merges=cfg.ignore_merges,
                                  byte_fallback=not cfg.byte_encode, fuse_unk=False)
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
        the score of the text it makes (higher first), as llama.cpp's SPM session picks its bigrams.

        Cutting each text at every place and looking both parts up is quadratic in its length, so that
        is done only where a part is short (at most _SHORT characters). The splits into two long parts
        come from the long texts alone: in sorted order the texts that are prefixes of a text are the
        chain of earlier texts it extends (a stack), so one pass gives each long text a bit mask of its
        long prefixes, and a pass over the reversed texts one of its long suffixes. The work is
        proportional to the vocabulary's characters. The merges are bounded by _SPM_MERGES per token
        and their characters by _SPM_MERGE_CHARS per character of the vocabulary (SentencePiece
        vocabularies have about 2 of each): beyond, a vocabulary is refused, not given a merge table
        that grows with the square of its tokens' lengths."""
        ids, texts, attrs = self._ids, self._texts, self._attrs
        scores = self._scores.tolist() if self._scores is not None else None
        byte = int(TokenAttr.BYTE)
        n = self.n_vocab
        total = sum(map(len, ids))
        max_merges = _SPM_MERGES * n + (1 << 16)
        max_chars = _SPM_MERGE_CHARS * total + (1 << 22)
        short = _SHORT
        long_texts = [t for t in ids if len(t) > short]
        # bit m of prefix[t] / suffix[t]: a long text of length m begins / ends the long text t
        prefix: dict[str, int] = {}
        suffix: dict[str, int] = {}
        for out, key in ((prefix, None), (suffix, True)):
            stack: list[tuple[str, int]] = []      # (text, mask of the lengths in the chain up to it)
            for r in sorted(t[::-1] for t in long_texts) if key else sorted(long_texts):
                while stack and not r.startswith(stack[-1][0]):
                    stack.pop()
                if stack:
                    out[r[::-1] if key else r] = stack[-1][1]
                stack.append((r, (stack[-1][1] if stack else 0) | (1 << len(r))))
        cands = []
        chars = 0
        for t, i in ids.items():
            n_t = len(t)
            if n_t < 2 or attrs[i] & byte:
                continue
            s = -scores[i] if scores is not None else 0.0
            found = len(cands)
            if n_t <= 2 * short:
                ks: Iterable[int] = range(1, n_t)
            else:
                ks = itertools.chain(range(1, short + 1), range(n_t - short, n_t))
            for k in ks:
                a = t[:k]
                if a in ids:
                    b = t[k:]
                    if b in ids:
                        cands.append((s, i, k, texts[ids[a]], texts[ids[b]]))
            if n_t > 2 * short:
                # bit k: a long prefix of length k and a long suffix starting at k (the suffix
                # lengths' mask reversed over n_t + 1 bits)
                ends = suffix.get(t, 0)
                splits = prefix.get(t, 0) & int(format(ends, f"0{n_t + 1}b")[::-1], 2) if ends else 0
                while splits:
                    low = splits & -splits
                    splits ^= low
                    k = low.bit_length() - 1
                    cands.append((s, i, k, texts[ids[t[:k]]], texts[ids[t[k:]]]))
            chars += n_t * (len(cands) - found)
            if len(cands) > max_merges or chars > max_chars:
                raise _meta._bad(self.source, "tokenizer.ggml.tokens",
                                 f"has {len(cands)} or more splits of a token into two tokens ({chars} characters) "
                                 f"for {n} tokens of {total} characters; an SPM vocabulary may have at most "
                                 f"{max_merges} ({_SPM_MERGES} per token) and {max_chars} characters of them "
                                 f"(SentencePiece's have about 2 per token)")
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

    def token_id(self, text: str) -> int | None:
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

    def encode(self, text: str | bytes, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of ``text`` (llama.cpp's ``llama_tokenize``).

        Parameters
        ----------
        text : str or bytes
            bytes must be UTF-8.
        add_special : bool
            Add BOS/EOS as the vocabulary says (:attr:`add_bos`, :attr:`add_eos`); a BERT (WPM) vocabulary
            always gets its BOS ([CLS]) and SEP ([SEP]) and nothing else, as in llama.cpp.
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
            # llama.cpp's WPM session ends with SEP whatever add_eos says (the converter writes add_eos true
            # for BERT vocabularies: their EOS is [SEP] too, which must not come twice)
            if self.add_eos and self.kind != "WPM":
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

    def encode_batch(self, texts: Iterable[str | bytes], add_special: bool = True,
                     parse_special: bool = False) -> list[list[int]]:
        """:meth:`encode` of each text, one after the other (each long text is itself cut into pieces
        that the engine encodes on every core)."""
        return [self.encode(t, add_special, parse_special) for t in texts]
    # ------------------------------------------------------------------ decode

    def token_to_piece(self, tid: int, special: bool = True) -> bytes:
        """The bytes ``tid`` stands for (llama.cpp's ``llama_token_to_piece``): part of a UTF-8 character
        for byte tokens; ``b""`` for control tokens when ``special`` is false."""
        i = self._check_id(tid, "token_to_piece")
        if not special and self._special_mask[i]:
            return b""
        piece = self._pieces[i]
        return self._piece(i) if piece is None else piece

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
            kept = [i for i in ids if not mask[i]]
            first = kept[0] if kept else None
        else:
            kept = ids
            first = ids[0] if ids else None
        parts = [pieces[i] for i in kept]
        if None in parts:
            parts = [self._piece(i) if p is None else p for i, p in zip(kept, parts)]
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
                            tools: Sequence[dict] | None = None, template: str | None = None,
                            **kwargs: Any) -> str:
        """Render ``messages`` with the file's chat template (``tokenizer.chat_template``), sandboxed
        (see :mod:`ggmlpy.tokenizer.chat_template`); ``template`` overrides the file's.

        Raises
        ------
        TokenizerError
            The file has no chat template and none was given.
        ChatTemplateError
            The template failed (its own ``raise_exception``, a loop or output over the limits).
        """
        from .chat_template import ChatTemplate

        src = template if template is not None else self.chat_template
        if src is None:
            raise TokenizerError(f"apply_chat_template: {self.source} has no tokenizer.chat_template; pass "
                                 f"template=")
        bos = self._texts[self.bos] if self.bos is not None else ""
        eos = self._texts[self.eos] if self.eos is not None else ""
        return ChatTemplate(src, bos_token=bos, eos_token=eos).render(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs)
