"""A tiny random-weight Llama with llama.cpp's real ``llama-bpe`` vocabulary and a Llama-3 chat template,
converted once per test process by llama.cpp's own converter (tests/hf_convert.py), for the text tests
of the runner and the CLI.

Random weights give garbage text, so the tests compare the text paths against the token-id paths and
the tokenizer's own decode, never against expected words.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

#: Meta-Llama-3-8B-Instruct's chat template (the text puts ``bos_token`` first itself)
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

#: a ChatML template, which writes no BOS (the runner puts it first for a vocabulary that adds BOS)
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

_lock = threading.Lock()
_cache: dict = {}


def llama_chat_gguf(tmp_path_factory) -> Path:
    """The converted model's path (F32 weights, 2 layers of width 64, the llama-bpe vocabulary of
    128,256 tokens, :data:`LLAMA3_TEMPLATE` as ``tokenizer.chat_template``); made once per process."""
    with _lock:
        if "path" in _cache:
            return _cache["path"]
        torch = pytest.importorskip("torch")
        transformers = pytest.importorskip("transformers")
        import hf_convert

        tok = hf_convert.tokenizer("llama-bpe")
        cfg = transformers.LlamaConfig(
            vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
            rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id, attn_implementation="eager")
        torch.manual_seed(5)
        hf = transformers.LlamaForCausalLM(cfg).float().eval()
        hf_convert.perturb_constant_weights(hf, seed=6)
        save = hf_convert.save_model_dir

        def save_with_template(*a, **kw):
            # the converter copies tokenizer_config.json's chat_template into tokenizer.chat_template
            d = Path(save(*a, **kw))
            cfg_path = d / "tokenizer_config.json"
            tc = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
            tc["chat_template"] = LLAMA3_TEMPLATE
            cfg_path.write_text(json.dumps(tc), encoding="utf-8")
            (d / "chat_template.jinja").unlink(missing_ok=True)
            return d

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(hf_convert, "save_model_dir", save_with_template)
            path = hf_convert.convert(hf, tmp_path_factory.mktemp("text-llama"), "llama-bpe")
        _cache["path"] = path
        return path


class FakeDetokenizer:
    """A streaming detokenizer written independently of ggmlpy's: Python's incremental UTF-8 decoder
    (it holds an unfinished character, replaces invalid bytes with U+FFFD as ``bytes.decode`` does)."""

    def __init__(self, tok: FakeTokenizer, skip_special: bool) -> None:
        import codecs

        self._tok, self._skip = tok, skip_special
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token: int) -> str:
        return self._dec.decode(self._tok.token_to_piece(token, special=not self._skip))

    def flush(self) -> str:
        out = self._dec.decode(b"", final=True)
        self._dec.reset()
        return out


class FakeTokenizer:
    """A byte-level tokenizer for the tests' 320-token models (tests/hf_helpers.py): ids 0-255 are the
    bytes, 256-263 multi-byte pieces (one with a whole 2-byte character, one a 6-byte word), 300 BOS,
    301 an end-of-turn token, 319 EOS (the three are control tokens, left out of the text), the rest
    ``<tN>`` pieces. ``pieces`` may be replaced to test other byte patterns."""

    n_vocab = 320
    bos, eot, eos = 300, 301, 319
    add_bos, add_eos = True, False
    SPECIAL = {300: "<s>", 301: "<|end|>", 319: "</s>"}

    def __init__(self, add_bos: bool = True) -> None:
        self.add_bos = add_bos
        self.pieces = [bytes([i]) for i in range(256)]
        self.pieces += [s.encode() for s in ("hello", " world", "é", "日本", " the", "</", "s>", "\n")]
        self.pieces += [f"<t{i}>".encode() for i in range(len(self.pieces), 320)]
        for i, s in self.SPECIAL.items():
            self.pieces[i] = s.encode()
        self.eog = frozenset({self.eot, self.eos})
        self.chat_template = "fake"
        self.rendered: list = []          # what apply_chat_template returned, for the tests to look at

    def token_to_piece(self, token: int, special: bool = True) -> bytes:
        if token in self.SPECIAL and not special:
            return b""
        return self.pieces[token]

    def detokenizer(self, skip_special: bool = False) -> FakeDetokenizer:
        return FakeDetokenizer(self, skip_special)

    def text_of(self, tokens) -> str:
        """The text of ``tokens`` as the runner should give it: control tokens left out, one decode."""
        return b"".join(self.token_to_piece(t, special=False) for t in tokens).decode("utf-8", "replace")

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list:
        ids: list = []
        rest = text
        while rest:
            for i, s in self.SPECIAL.items():
                if parse_special and rest.startswith(s):
                    ids.append(i)
                    rest = rest[len(s):]
                    break
            else:
                ids.extend(rest[0].encode())
                rest = rest[1:]
        return ([self.bos] if add_special and self.add_bos else []) + ids

    def apply_chat_template(self, messages, add_generation_prompt=True, tools=None, template=None, **kw) -> str:
        if template == "with-bos":
            out = "<s>"
        else:
            out = ""
        for m in messages:
            out += f"[{m['role']}]{m['content']}<|end|>"
        if add_generation_prompt:
            out += "[assistant]"
        self.rendered.append(out)
        return out


class WideFakeTokenizer(FakeTokenizer):
    """:class:`FakeTokenizer` widened to the tiny synthetic model's 512 ids (``<tN>`` pieces after 320)."""

    n_vocab = 512

    def __init__(self) -> None:
        super().__init__()
        self.pieces += [f"<t{i}>".encode() for i in range(len(self.pieces), self.n_vocab)]
