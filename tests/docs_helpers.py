"""What the documentation's examples run on, and how their code blocks are found (tests/project/test_docs.py).

The README and the pages under ``docs/`` show code as a user would type it: ``model.gguf``,
``mmproj.gguf``, ``cat.png`` in the current folder. :func:`example_folder` makes those files, small and
without the network: the built-in ``tiny`` synthetic model (``ggmlpy.models.synthetic``) with a
512-token SentencePiece-style vocabulary and a ChatML chat template added, so that text and chat
work (random weights: the words are nonsense, the paths are real), a tiny Gemma 3 vision encoder in
the converter's layout (tests/gguf_fuzz.py's ``write_mmproj``) and a 64x64 PNG.

Fenced blocks, by language:

========  ======================================================================================
python    run, each in a fresh namespace, in that folder
bash      each line is a ``ggmlpy`` command (a comment after ``#`` is dropped), run in that folder
text      what a command prints, shown, never run
========  ======================================================================================

A block that must not run says why on the line just above its fence::

    <!-- no-test: needs the network (the Hugging Face hub) -->

(an HTML comment: invisible on GitHub and in the built site). Any other language, or a marker
without a reason, fails the test, so every block either runs or says why not.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: the marker: ``<!-- no-test: REASON -->`` alone on the line above a fence
NO_TEST = re.compile(r"^<!--\s*no-test:\s*(?P<reason>\S.*?)\s*-->\s*$")
#: fence languages the runner knows
RUN_LANGS = ("python", "bash")
SHOWN_LANGS = ("text",)

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>```+|~~~+)(?P<lang>[^\s`]*)[^\n]*$")

#: ChatML, which writes no BOS (the runner puts one first for a vocabulary that adds BOS), with image
#: parts as Gemma 3's template writes them (the vision encoder's placeholder, ``<start_of_image>``)
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
          "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
          "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '<start_of_image>' }}"
          "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
          "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")


@dataclass
class Block:
    """One fenced block of a Markdown file."""

    path: Path
    line: int            # 1-based line of the opening fence
    lang: str
    code: str
    skip: str | None     # the no-test reason, if marked

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """Every fenced block of ``path`` in order (indented ones too: a block inside a list item)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, indent = m["fence"], m["indent"]
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not (lines[j].strip().startswith(fence) and lines[j].strip().strip(fence[0]) == ""):
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        k = i - 1
        marker = NO_TEST.match(lines[k].strip()) if k >= 0 else None
        out.append(Block(path, i + 1, m["lang"], "\n".join(body) + "\n", marker["reason"] if marker else None))
        i = j + 1
    return out


def doc_files() -> list[Path]:
    """The README and every page of the guide."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def commands(block: Block) -> list[str]:
    """A bash block's commands: one a line, comments dropped, backslash continuations joined."""
    out: list[str] = []
    pending = ""
    for raw in block.code.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", raw).rstrip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = (pending + line).strip()
        pending = ""
        if line:
            out.append(line)
    return out


# ------------------------------------------------------------------------------------ the example files


def _vocabulary(n_vocab: int) -> dict:
    """A SentencePiece-style (``llama``) vocabulary of ``n_vocab`` tokens with byte fallback."""
    tokens = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>",
              "<start_of_image>", "<end_of_image>", "<image_soft_token>"]
    types = [2, 3, 3, 3, 3, 3, 3, 3]                  # UNKNOWN, then CONTROL
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256                                 # BYTE
    words = ["▁the", "▁a", "▁of", "▁and", "▁to", "▁in", "▁is", "▁it", "▁that", "▁was", "▁he", "▁she",
             "▁Hello", "▁Hi", "▁capital", "▁France", "▁Paris", "▁picture", "▁image", "▁what", "▁cat"]
    chars = ["▁", *"etaoinshrdlucmfwypvbgkjqxz", *"ETAOINSHRDLUCMFWYPVBGKJQXZ", *"0123456789",
             *".,!?;:'\"()-"]
    pieces = words + chars
    n = len(pieces)
    while len(tokens) + len(pieces) < n_vocab:          # two-letter pieces fill the rest
        pieces.append("▁" + chars[1 + (len(pieces) - n) % 26] + chars[1 + (len(pieces) - n) // 26 % 26])
    pieces = pieces[:n_vocab - len(tokens)]
    scores = [0.0] * len(tokens) + [-float(i) for i in range(len(pieces))]
    tokens += pieces
    types += [1] * len(pieces)                         # NORMAL
    return {"tokens": tokens, "scores": scores, "types": types}


def write_text_model(path: Path) -> Path:
    """The ``tiny`` synthetic model (F16) with :func:`_vocabulary` and :data:`CHATML` added."""
    from ggmlpy import gguf
    from ggmlpy.gguf import ValueType
    from ggmlpy.models.synthetic import write_synthetic

    plain = write_synthetic(path.with_suffix(".plain.gguf"), "tiny", "F16")
    with gguf.GGUFReader(plain) as r, gguf.GGUFWriter(path, arch=r.metadata["general.architecture"]) as w:
        arch = r.metadata["general.architecture"]
        for key in r.metadata:
            if not key.startswith("tokenizer.") and key not in ("general.architecture", "general.alignment"):
                w.add_from(r, key)
        v = _vocabulary(r.metadata[f"{arch}.vocab_size"])
        w.add("tokenizer.ggml.model", "llama")
        w.add_array("tokenizer.ggml.tokens", v["tokens"])
        w.add_array("tokenizer.ggml.scores", v["scores"], elem_type=ValueType.FLOAT32)
        w.add_array("tokenizer.ggml.token_type", v["types"], elem_type=ValueType.INT32)
        for key, value in (("bos_token_id", 1), ("eos_token_id", 2), ("unknown_token_id", 0)):
            w.add(f"tokenizer.ggml.{key}", value, type=ValueType.UINT32)
        w.add("tokenizer.ggml.add_bos_token", True)
        w.add("tokenizer.ggml.add_eos_token", False)
        w.add("tokenizer.chat_template", CHATML)
        for info in r.tensors:
            w.add_tensor(info.name, r.tensor_data(info.name, copy=True), type=info.type, ne=info.ne)
    plain.unlink()
    return path


def example_folder(folder: Path) -> Path:
    """``folder`` with ``model.gguf``, ``mmproj.gguf`` and ``cat.png`` in it (see the module docstring)."""
    import sys

    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    write_text_model(folder / "model.gguf")
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        from gguf_fuzz import write_mmproj
    finally:
        sys.path.remove(str(ROOT / "tests"))
    write_mmproj(folder / "mmproj.gguf", "gemma3", "F16")
    try:
        from PIL import Image
    except ImportError:
        pass
    else:
        rng = np.random.default_rng(0)
        Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(folder / "cat.png")
    return folder
