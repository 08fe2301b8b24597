"""UGM (T5-style Unigram): llama.cpp's llm_tokenizer_ugm (normaliser, scores, Viterbi; see :class:`_Ugm`)."""

from __future__ import annotations

import itertools
import re
from typing import TYPE_CHECKING

from ._common import (
    _CHUNK,
    _ESCAPED_SPACE,
    _GROUP,
    _LONG_WORD,
    _MAX_PIECE,
    TokenAttr,
    TokenizerError,
    _engine_model,
)
from ._meta import meta_bytes

if TYPE_CHECKING:
    from .vocab import Tokenizer

# --- UGM (T5-style Unigram, llama.cpp's llm_tokenizer_ugm) ----------------------------------------------

#: what llama.cpp takes off the lowest normal score to score a character no token holds
_UGM_UNK_PENALTY = 10.0
_UGM_SPACES = re.compile(" +")
_FLT_MAX = 3.4028234663852886e38
_charsmap_cache: dict = {}
_CHARSMAP_PATHS = 1 << 21
_CHARSMAP_KEY_BYTES = 32


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
        # SentencePiece's have about 200 thousand paths of a few bytes (8 bytes of keys per byte of
        # the blob); a crafted array could share nodes to make exponentially many, or loop
        budget = _CHARSMAP_KEY_BYTES * len(data) + (1 << 20)
        while stack:
            pos, key = stack.pop()
            visited += 1
            budget -= len(key)
            if len(key) >= 256 or visited > _CHARSMAP_PATHS or budget < 0:
                raise TokenizerError(f"{bad} (more than {_CHARSMAP_PATHS} keys, a key of more than 255 bytes, "
                                     f"or more than {_CHARSMAP_KEY_BYTES} bytes of keys per byte of the map)")
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
        self._source = tok.source
        self._unk_text = tok._texts[tok.unk] if tok.unk is not None else None
        self.merge_spaces = tok.remove_extra_whitespaces
        self.space_prefix = tok.add_space_prefix
        data = meta_bytes(md, "tokenizer.ggml.precompiled_charsmap", tok.source)
        cmap: dict[str, str] = _parse_charsmap(data, tok.source) if data is not None else {}
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
        self.cut: re.Pattern | None = None     # where a normalised text may be cut (None: before every ▁)
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
        model = _engine_model(self._source, "UGM", Unigram, vocab, unk_id=self._unk_engine, byte_fallback=False)
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

    def _by_word(self, words: list[str], prefix: str | None) -> list[int]:
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
