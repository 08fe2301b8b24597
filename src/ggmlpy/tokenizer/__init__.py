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

Every ``tokenizer.ggml.*`` key is checked as it is read, from a file or a caller's dict (``_meta``): a
value of the wrong type, length or range is a :class:`TokenizerError` that names the key, never
another exception. A vocabulary's load time and memory grow with its size: tokens are at most
``_MAX_TOKEN`` (1024) characters, twice the longest of any vocabulary llama.cpp ships, and what grows
faster than a token's length (SPM's merge table, BPE's spelled-out pieces) is bounded per token.
Where each part lives:

* :mod:`~ggmlpy.tokenizer.vocab`: :class:`Tokenizer` (the vocabulary read and checked, special tokens,
  encode and decode); :mod:`~ggmlpy.tokenizer.detokenizer`: the streaming :class:`Detokenizer`;
* one module per algorithm: :mod:`~ggmlpy.tokenizer._bpe` (the pre-tokenizers, GPT-2's byte mapping),
  :mod:`~ggmlpy.tokenizer._wpm` (BERT's word splitting and greedy match), :mod:`~ggmlpy.tokenizer._ugm`
  (the charsmap normaliser and the Viterbi search); :mod:`~ggmlpy.tokenizer._common` (what they share:
  errors, token types, limits, decoding's byte rules) and :mod:`~ggmlpy.tokenizer._meta` (every
  ``tokenizer.ggml.*`` key checked as it is read);
* :mod:`~ggmlpy.tokenizer.chat_template`: :class:`ChatTemplate`, a GGUF's chat template rendered as
  transformers does, in a bounded sandbox (:mod:`~ggmlpy.tokenizer._sandbox`, the Jinja environment;
  :mod:`~ggmlpy.tokenizer._limits`, each render's budget; :mod:`~ggmlpy.tokenizer._prechecks`, sizes
  estimated before an operation runs). Imported when first asked for: tokenizing needs neither jinja2
  nor the sandbox built at its import.
"""

from __future__ import annotations

from ._common import TokenAttr, TokenizerError, TokenType
from .detokenizer import Detokenizer
from .vocab import Tokenizer


def __getattr__(name: str):
    # ChatTemplate and its error are imported when first asked for, as Tokenizer.apply_chat_template
    # imports them: importing the renderer imports jinja2 and builds the sandboxed environment
    if name in ("ChatTemplate", "ChatTemplateError"):
        from . import chat_template

        return getattr(chat_template, name)
    raise AttributeError(f"module 'ggmlpy.tokenizer' has no attribute {name!r}")


__all__ = ["ChatTemplate", "ChatTemplateError", "Detokenizer", "TokenAttr", "TokenType", "Tokenizer",
           "TokenizerError"]
