"""Real GGUF files for tests, written by llama.cpp's own converter from tiny random-weight HF models.

``convert_hf_to_gguf.py``, the per-architecture ``conversion/`` package, the gguf-py it was written
against and llama.cpp's reference vocabularies (``models/ggml-vocab-*.gguf``) come from the
llama-cpp-python 0.3.36 sdist (llama.cpp 0c1e570, the same archive ``vendor/ggml/PIN`` takes ggml's
source from). It is downloaded with pip once per machine, checked against its sha256, and only those
parts are extracted into ggmlpy's cache folder (``ggmlpy cache path``: ``$GGMLPY_CACHE``,
``$XDG_CACHE_HOME/ggmlpy`` or ``~/.cache/ggmlpy``, as for the synthetic models), under a lock so
parallel pytest processes fetch it once. Nothing of it is in this repository.

When the registry cannot be reached the tests that need the converter skip, except under ``CI=true``,
where they fail: CI must run them.

The converter refuses a model folder without a tokenizer, and BPE converters recognise the
pre-tokenizer by hashing its output, so a made-up tokenizer is rejected: :func:`tokenizer_dir` rebuilds
the real HF tokenizer from one of llama.cpp's vocabulary files, and :func:`spm_tokenizer_model` trains
a small SentencePiece model for converters that read ``tokenizer.model`` (gemma, phi3).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Optional

import pytest

from ggmlpy.models.synthetic import cache_dir as _ggmlpy_cache_dir

PACKAGE = "llama-cpp-python"
VERSION = "0.3.36"
SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
#: inside the sdist's top folder
LLAMA_CPP = "vendor/llama.cpp"
#: what is extracted from LLAMA_CPP. The converter must run with the gguf-py of its own commit: with
#: PyPI's gguf 0.19.0 it stops on ``gguf.LazyChunkedTensor``, which only the sdist's gguf-py has.
#: LICENSE is llama.cpp's (MIT), kept beside its code. grammars/: llama.cpp's example GBNF grammars
#: (tests/runner/test_grammar.py constrains generations with them).
PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/gguf/", "LICENSE", "models/templates/", "grammars/")
VOCABS = "models/ggml-vocab-"
#: what a vocabulary file may end with: the GGUF, and the reference tokenizations llama.cpp's
#: test-tokenizer-0 checks it against (``.inp``: texts joined by ``VOCAB_TEST_SEPARATOR``; ``.out``: one
#: line of ids per text)
VOCAB_SUFFIXES = (".gguf", ".gguf.inp", ".gguf.out")
VOCAB_TEST_SEPARATOR = "\n__ggml_vocab_test__\n"
#: bump when PARTS grows: the extracted tree lives in a folder named after it, so an older, smaller
#: extraction is never taken for complete
PARTS_VERSION = 3
#: name of the vocabulary that :func:`convert` takes as "copy :func:`spm_tokenizer_model` in"
SPM = "spm"
#: name of the vocabulary :func:`tokenizer_dir` makes as an XLM-RoBERTa tokenizer (``tokenizer.json``, Unigram)
#: over :func:`unigram_model`: the converter's route for ``XLMRoberta*`` models without
#: ``sentencepiece.bpe.model`` (which it would read through protobuf, not a test dependency)
XLMR = "xlmr-unigram"
#: BPE vocabularies to which llama.cpp adds BOS when the file does not say (llama-vocab.cpp: the llama3
#: pre-tokenizers). Llama 3's tokenizer.json adds it through its post-processor, which transformers'
#: GGUF reader does not rebuild; without it the converter's pre-tokenizer hash (of encode() with
#: special tokens) is Smaug's and the file says tokenizer.ggml.pre = "smaug-bpe", not "llama-bpe".
ADD_BOS = frozenset({"llama-bpe"})
#: bump when the way tokenizers or the SentencePiece model are made changes (a new cache entry)
FORMAT = 2


class ConverterError(RuntimeError):
    """The converter (or the download of it) failed; the message ends with its stderr."""


def cache_dir() -> Path:
    """``<ggmlpy cache>/converter``: the extracted llama.cpp parts and the tokenizers made from them."""
    return _ggmlpy_cache_dir() / "converter"


def _unavailable(reason: str):
    # hf_helpers' rule for torch: CI installs everything and must run these tests, so a missing
    # prerequisite there is a failure; on a developer's machine without the registry it is a skip.
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI=true: the converter tests must run)", pytrace=False)
    pytest.skip(reason)


def _require(module: str):
    """Import a test dependency the converter needs (sentencepiece: every Llama-like converter tries
    ``tokenizer.model`` first and imports it, BPE ones included)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        _unavailable(f"{module} is not installed (pip install '.[test]')")


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on ``path`` (created): one pytest process builds, the others wait and
    then find the result. fcntl: the project supports Linux and macOS only."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


#: why pip could not download the sdist, once per process: without a registry, each test that needs
#: the converter would otherwise wait on pip's retries again
_download_failed: str | None = None


def _download(into: Path) -> Path:
    global _download_failed
    if _download_failed is not None:
        _unavailable(_download_failed)
    # --no-binary names only the package: ':all:' would also build its build requirements (cmake)
    # from source just to read the sdist's metadata, many minutes for nothing (see vendor/ggml/fetch.py).
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", PACKAGE,
           "--disable-pip-version-check", "--retries", "2", f"{PACKAGE}=={VERSION}", "-d", str(into)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    files = [p for p in into.iterdir() if p.is_file()]
    if proc.returncode != 0 or len(files) != 1:
        _download_failed = (f"cannot download {PACKAGE}=={VERSION} (llama.cpp's converter) with pip, "
                            f"exit {proc.returncode}: {proc.stderr.strip()[-1000:]}")
        _unavailable(_download_failed)
    got = _sha256(files[0])
    if got != SHA256:
        # never a skip: the registry answered with something other than what is pinned
        raise ConverterError(f"{files[0].name}: sha256 {got}, pinned {SHA256}")
    return files[0]


def _wanted(name: str) -> str | None:
    """The path inside the llama.cpp folder for an archive member we extract, else None."""
    _top, _, rest = name.partition("/")
    if not rest.startswith(LLAMA_CPP + "/") or ".." in name.split("/"):
        return None
    rel = rest[len(LLAMA_CPP) + 1:]
    if any(rel == p or (p.endswith("/") and rel.startswith(p)) for p in PARTS):
        return rel
    if rel.startswith(VOCABS) and rel.endswith(VOCAB_SUFFIXES) and "/" not in rel[len("models/"):]:
        return rel
    return None


def llama_cpp_dir() -> Path:
    """The extracted llama.cpp parts (``convert_hf_to_gguf.py``, ``conversion/``, ``gguf-py/``,
    ``models/ggml-vocab-*.gguf``), fetched on first use.

    Skips the calling test (fails it under ``CI=true``) when pip cannot download the sdist; raises
    :class:`ConverterError` when the download does not match the pinned sha256.
    """
    dest = cache_dir() / f"{PACKAGE}-{VERSION}-p{PARTS_VERSION}"
    if (dest / "convert_hf_to_gguf.py").is_file():
        return dest      # only ever renamed into place whole, so present means complete
    with _locked(cache_dir() / f"{dest.name}.lock"):
        if (dest / "convert_hf_to_gguf.py").is_file():
            return dest  # another process fetched it while we waited
        with tempfile.TemporaryDirectory(prefix="fetch-", dir=cache_dir()) as tmp:
            (Path(tmp) / "dl").mkdir()
            archive = _download(Path(tmp) / "dl")
            staging = Path(tmp) / "tree"
            with tarfile.open(archive) as tf:
                for m in tf.getmembers():
                    rel = _wanted(m.name)
                    if rel is None or not m.isfile():
                        continue
                    out = staging / rel
                    out.parent.mkdir(parents=True, exist_ok=True)
                    with tf.extractfile(m) as src, open(out, "wb") as dst:
                        shutil.copyfileobj(src, dst)
            if not (staging / "convert_hf_to_gguf.py").is_file() or not (staging / "gguf-py/gguf").is_dir():
                raise ConverterError(f"{archive.name} has no {LLAMA_CPP}/convert_hf_to_gguf.py or gguf-py")
            # atomic: a process killed half-way leaves a temporary folder, never a partial tree
            os.replace(staging, dest)
    return dest


def vocab_file(vocab: str) -> Path:
    """``models/ggml-vocab-<vocab>.gguf`` of llama.cpp (``llama-bpe``, ``qwen2``, ``llama-spm``, ``phi-3``,
    ``gpt-2``, ...)."""
    path = llama_cpp_dir() / f"{VOCABS}{vocab}.gguf"
    if not path.is_file():
        have = sorted(p.name[len("ggml-vocab-"):-len(".gguf")] for p in path.parent.glob("ggml-vocab-*.gguf"))
        raise ValueError(f"no llama.cpp vocabulary {vocab!r}; there are {have}")
    return path


def vocab_tests(vocab: str) -> list[tuple[str, list[int]]]:
    """llama.cpp's reference tokenizations for ``ggml-vocab-<vocab>.gguf``: (text, ids) pairs, ids as
    llama.cpp's tokenizer gives them without BOS/EOS and without parsing special tokens. Empty when the
    vocabulary has no test files."""
    path = vocab_file(vocab)
    inp, out = Path(f"{path}.inp"), Path(f"{path}.out")
    if not inp.is_file():
        return []
    texts = inp.read_text(encoding="utf-8").split(VOCAB_TEST_SEPARATOR)
    lines = out.read_text(encoding="utf-8").split("\n")
    # test-tokenizer-0 drops the text after the last separator (empty) and the .out's last newline
    if texts and texts[-1] == "":
        texts.pop()
    lines = lines[:len(texts)]
    if len(lines) != len(texts):
        raise ValueError(f"{inp.name}: {len(texts)} texts but {out.name} has {len(lines)} lines")
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts, lines)]


def vocabs() -> list[str]:
    """Every vocabulary name of llama.cpp's ``models/ggml-vocab-*.gguf``."""
    models = llama_cpp_dir() / "models"
    return sorted(p.name[len("ggml-vocab-"):-len(".gguf")] for p in models.glob("ggml-vocab-*.gguf"))


def chat_templates() -> dict[str, str]:
    """llama.cpp's ``models/templates/*.jinja`` (real models' chat templates), by file stem."""
    folder = llama_cpp_dir() / "models" / "templates"
    return {p.stem: p.read_text(encoding="utf-8") for p in sorted(folder.glob("*.jinja"))}


def grammars() -> dict[str, str]:
    """llama.cpp's ``grammars/*.gbnf`` (its example GBNF grammars: json, arithmetic, list, c, ...), by
    file stem."""
    folder = llama_cpp_dir() / "grammars"
    return {p.stem: p.read_text(encoding="utf-8") for p in sorted(folder.glob("*.gbnf"))}


def tokenizer_dir(vocab: str) -> Path:
    """A folder holding the real HF tokenizer rebuilt from ``ggml-vocab-<vocab>.gguf`` (cached).

    transformers reads the GGUF vocabulary into a fast tokenizer (identical to llama.cpp's on the
    strings tried), which the converter then recognises by its pre-tokenizer hash. Keyed by the
    transformers version: its saved files are not readable by every other version.
    """
    import transformers

    dest = cache_dir() / "tokenizers" / f"{vocab}-transformers{transformers.__version__}-v{FORMAT}"
    if (dest / "tokenizer_config.json").is_file():
        return dest
    src = vocab_file(vocab) if vocab != XLMR else None
    with _locked(dest.with_name(dest.name + ".lock")):
        if (dest / "tokenizer_config.json").is_file():
            return dest
        if vocab == XLMR:
            tok = _xlmr_tokenizer()
        elif _gguf_tokenizer_model(src) == "bert":
            tok = _wpm_tokenizer(src)
        else:
            tok = transformers.AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
        if src is not None and _adds_bos(src, vocab):
            tok.add_bos_token = True    # rebuilds the post-processor, saved in tokenizer.json
        tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
        try:
            tok.save_pretrained(str(tmp))
            os.replace(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return dest


def _gguf_tokenizer_model(path: Path) -> str:
    from ggmlpy import gguf

    with gguf.GGUFReader(str(path)) as r:
        return r.metadata.get("tokenizer.ggml.model", "")


def _wpm_tokenizer(path: Path):
    """A BERT tokenizer (WordPiece, lower-cased) over a ``bert`` vocabulary file (transformers cannot read
    those): the converter stored each word-start token as ``▁word`` and each continuation as ``piece``
    (its "phantom space"); undone, they are BERT's ``word`` and ``##piece``, control tokens as they are."""
    import transformers

    from ggmlpy import gguf

    with gguf.GGUFReader(str(path)) as r:
        tokens, types = r.metadata["tokenizer.ggml.tokens"], r.metadata["tokenizer.ggml.token_type"]
    vocab: dict = {}
    for i, (t, ty) in enumerate(zip(tokens, types)):
        word = t if int(ty) == 3 else t[1:] if t.startswith("\u2581") else "##" + t
        vocab.setdefault(word, i)
    return transformers.BertTokenizerFast(vocab=vocab, do_lower_case=True)


def unigram_model(vocab_size: int = 1000) -> Path:
    """A small SentencePiece Unigram model (XLM-RoBERTa's kind; cached), trained as :func:`spm_tokenizer_model`
    with SentencePiece's default normalisation (NFKC: a real charsmap) and XLM-R's ids (unk 0, bos 1, eos 2)."""
    sentencepiece = _require("sentencepiece")
    dest = cache_dir() / f"spm-unigram-{vocab_size}-sentencepiece{sentencepiece.__version__}-v{FORMAT}.model"
    if dest.is_file():
        return dest
    sources = sorted((llama_cpp_dir() / "conversion").glob("*.py"))
    with _locked(dest.with_name(dest.name + ".lock")):
        if dest.is_file():
            return dest
        with tempfile.TemporaryDirectory(prefix="spm-", dir=cache_dir()) as tmp:
            text = Path(tmp) / "text.txt"
            text.write_text("".join(p.read_text(encoding="utf-8") for p in sources), encoding="utf-8")
            sentencepiece.SentencePieceTrainer.train(
                input=str(text), model_prefix=str(Path(tmp) / "m"), vocab_size=vocab_size, model_type="unigram",
                unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1, minloglevel=2)
            os.replace(Path(tmp) / "m.model", dest)
    return dest


def _proto_fields(buf: bytes):
    """(field number, bytes or None) of a protobuf message, read by hand (protobuf is not a test dependency)."""
    def varint(i):
        n, shift = 0, 0
        while True:
            b = buf[i]
            i += 1
            n |= (b & 0x7F) << shift
            shift += 7
            if b < 0x80:
                return n, i
    i = 0
    while i < len(buf):
        key, i = varint(i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            _, i = varint(i)
            yield field, None
        elif wire == 2:
            n, i = varint(i)
            yield field, buf[i:i + n]
            i += n
        elif wire in (1, 5):
            i += 8 if wire == 1 else 4
            yield field, None
        else:
            raise ValueError(f"protobuf wire type {wire}")


def _xlmr_tokenizer():
    """XLM-RoBERTa's fast tokenizer over :func:`unigram_model`, ids as fairseq's: ``<s> <pad> </s> <unk>``,
    then the model's pieces from its 4th (each one up), then ``<mask>``; its NFKC charsmap as the normaliser
    (``ModelProto.normalizer_spec.precompiled_charsmap``: fields 3 and 2)."""
    import transformers

    sentencepiece = _require("sentencepiece")
    sp = sentencepiece.SentencePieceProcessor(model_file=str(unigram_model()))
    proto = sp.serialized_model_proto()
    spec = next(v for f, v in _proto_fields(proto) if f == 3)
    charsmap = next(v for f, v in _proto_fields(spec) if f == 2)
    vocab = [("<s>", 0.0), ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    vocab += [(sp.id_to_piece(i), sp.get_score(i)) for i in range(3, sp.vocab_size())] + [("<mask>", 0.0)]
    return transformers.XLMRobertaTokenizerFast(vocab=vocab, _spm_precompiled_charsmap=charsmap)


def _adds_bos(path: Path, vocab: str) -> bool:
    from ggmlpy import gguf

    r = gguf.GGUFReader(str(path))
    try:
        md = r.metadata
        said = md.get("tokenizer.ggml.add_bos_token")
        return bool(said) if said is not None else md.get("tokenizer.ggml.model") == "gpt2" and vocab in ADD_BOS
    finally:
        r.close()


@functools.cache
def tokenizer(vocab: str):
    """The HF tokenizer of :func:`tokenizer_dir` (loaded once per process). ``len(tokenizer(v))`` is
    the ``vocab_size`` a model converted with vocabulary ``v`` needs."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir(vocab)))


def spm_tokenizer_model(vocab_size: int = 1000) -> Path:
    """A small SentencePiece BPE model (``tokenizer.model``) for converters that read one (cached).

    Trained on the converter's own sources (a fixed text) with Llama's settings: unk 0, bos 1, eos 2,
    no pad, byte fallback, digits split, whitespace kept as it is (no normalisation). transformers 5's
    slow tokenizers no longer load such a file by themselves; the converter only needs the file.
    """
    sentencepiece = _require("sentencepiece")
    dest = cache_dir() / f"spm-bpe-{vocab_size}-sentencepiece{sentencepiece.__version__}-v{FORMAT}.model"
    if dest.is_file():
        return dest
    sources = sorted((llama_cpp_dir() / "conversion").glob("*.py"))
    with _locked(dest.with_name(dest.name + ".lock")):
        if dest.is_file():
            return dest
        with tempfile.TemporaryDirectory(prefix="spm-", dir=cache_dir()) as tmp:
            text = Path(tmp) / "text.txt"
            text.write_text("".join(p.read_text(encoding="utf-8") for p in sources), encoding="utf-8")
            sentencepiece.SentencePieceTrainer.train(
                input=str(text), model_prefix=str(Path(tmp) / "m"), vocab_size=vocab_size, model_type="bpe",
                byte_fallback=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, split_digits=True,
                normalization_rule_name="identity", remove_extra_whitespaces=False,
                allow_whitespace_only_pieces=True, num_threads=1, minloglevel=2)
            os.replace(Path(tmp) / "m.model", dest)
    return dest


def perturb_constant_weights(model, seed: int = 0, scale: float = 0.1) -> list[str]:
    """Make every constant parameter random, in place; return their names.

    HF initialises RMSNorm weights to 1 (Gemma's to 0, used as 1 + w), biases and some projectors to 0:
    a loader that dropped such a tensor, or read the wrong one, would still match. A constant c != 0
    becomes c + scale * N(0, 1), a zero tensor N(0, 0.05).
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    names = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            flat = p.detach().reshape(-1)
            if flat.numel() == 0 or not bool((flat == flat[0]).all()):
                continue
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype)
            p.copy_(noise * 0.05 if float(flat[0]) == 0.0 else p + noise * scale)
            names.append(name)
    return names


def save_model_dir(hf_model, hf_dir: str | os.PathLike, vocab: str, config_edit=None, tokenizer=None) -> Path:
    """``save_pretrained`` the model (safetensors) and beside it the tokenizer of ``vocab``: the files of
    :func:`tokenizer_dir`, or for ``vocab="spm"`` :func:`spm_tokenizer_model` as ``tokenizer.model``; or
    ``tokenizer`` itself (a transformers tokenizer: ``vocab``'s with tokens added that a converter looks up,
    such as GLM's ``[gMASK]``). ``config_edit(config)`` changes the saved ``config.json`` (a dict) in place
    first, where the converter reads what this transformers writes otherwise than the published checkpoints do."""
    import json

    hf_dir = Path(hf_dir)
    hf_model.save_pretrained(str(hf_dir))
    if config_edit is not None:
        path = hf_dir / "config.json"
        config = json.loads(path.read_text())
        config_edit(config)
        path.write_text(json.dumps(config, indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(hf_dir))
    elif vocab == SPM:
        shutil.copyfile(spm_tokenizer_model(), hf_dir / "tokenizer.model")
    else:
        shutil.copytree(tokenizer_dir(vocab), hf_dir, dirs_exist_ok=True)
    return hf_dir


def convert(hf_model, out_dir: str | os.PathLike, vocab: str, outtype: str = "f32",
            extra_args: Sequence[str] = (), name: str = "model", timeout: float = 600, config_edit=None,
            tokenizer=None, files: Optional[dict] = None) -> Path:
    """Convert ``hf_model`` with llama.cpp's ``convert_hf_to_gguf.py``; return the GGUF file's path.

    The model is saved with its tokenizer (:func:`save_model_dir`) into ``out_dir/name-hf`` and
    converted in a subprocess (the converter is a script and imports torch) to ``out_dir/name-outtype.gguf``.

    Parameters
    ----------
    hf_model
        A transformers ``PreTrainedModel``; a text model's ``config.vocab_size`` should be
        ``len(tokenizer(vocab))`` (the converter pads a larger one with ``[PAD<n>]`` tokens).
    out_dir
        Folder for the model folder and the GGUF file (created).
    vocab
        llama.cpp vocabulary name (``llama-bpe``, ``qwen2``, ...) or ``"spm"``.
    outtype
        The converter's ``--outtype``: f32, f16, bf16, q8_0, ...
    extra_args
        More converter arguments (``--mmproj`` writes the projector file instead).
    config_edit
        Changes the saved ``config.json`` first (see :func:`save_model_dir`).
    tokenizer
        A transformers tokenizer to save beside the model instead of ``vocab``'s files
        (:func:`save_model_dir`).
    files
        More files for the model folder: relative path -> text (sentence-transformers' ``modules.json`` and
        ``1_Pooling/config.json``, from which the converter writes ``pooling_type``).

    Raises
    ------
    ConverterError
        The converter exited with an error; the message holds the end of its stderr.
    """
    _require("sentencepiece")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    hf_dir = save_model_dir(hf_model, out_dir / f"{name}-hf", vocab, config_edit, tokenizer)
    for rel, text in (files or {}).items():
        (hf_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (hf_dir / rel).write_text(text, encoding="utf-8")
    return convert_dir(hf_dir, out_dir / f"{name}-{outtype}.gguf", outtype, extra_args, timeout)


def convert_dir(hf_dir: str | os.PathLike, outfile: str | os.PathLike, outtype: str = "f32",
                extra_args: Sequence[str] = (), timeout: float = 600) -> Path:
    """Run llama.cpp's ``convert_hf_to_gguf.py`` on a model folder made ready (:func:`convert` saves one;
    a test may write its own, as for a checkpoint layout transformers does not save); return ``outfile``.

    Raises
    ------
    ConverterError
        As :func:`convert`.
    """
    _require("sentencepiece")
    script = llama_cpp_dir() / "convert_hf_to_gguf.py"
    hf_dir, outfile = Path(hf_dir), Path(outfile)
    env = dict(os.environ)
    env.pop("NO_LOCAL_GGUF", None)   # that would make it import PyPI's gguf, which it does not work with
    # nothing is fetched from a hub: the model folder is complete, and a test must not wait on a network
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cmd = [sys.executable, str(script), str(hf_dir), "--outfile", str(outfile), "--outtype", outtype,
           *extra_args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise ConverterError(f"convert_hf_to_gguf.py took over {timeout} s on {hf_dir}") from e
    if proc.returncode != 0 or not outfile.is_file():
        raise ConverterError(f"convert_hf_to_gguf.py failed (exit {proc.returncode}) on {hf_dir}:\n"
                             f"{proc.stderr[-4000:]}")
    return outfile


#: Qwen-VL's vision tokens, at their ids in Qwen's vocabulary (llama.cpp's qwen2 vocabulary has padding there)
QWEN_VISION_TOKENS = {151652: "<|vision_start|>", 151653: "<|vision_end|>", 151654: "<|vision_pad|>",
                      151655: "<|image_pad|>", 151656: "<|video_pad|>"}


def qwen_vision_tokens(hf_dir: str | os.PathLike) -> None:
    """Put Qwen-VL's vision tokens (special) at their ids in a model directory saved with the qwen2 vocabulary
    (``save_model_dir(..., "qwen2")``), in tokenizer.json and tokenizer_config.json."""
    d = Path(hf_dir)
    p = d / "tokenizer.json"
    j = json.loads(p.read_text())
    voc = j["model"]["vocab"]
    for a in j["added_tokens"]:
        if a["id"] in QWEN_VISION_TOKENS:
            voc.pop(a["content"], None)
            a["content"], a["special"] = QWEN_VISION_TOKENS[a["id"]], True
            voc[a["content"]] = a["id"]
    p.write_text(json.dumps(j, ensure_ascii=False))
    c = d / "tokenizer_config.json"
    cfg = json.loads(c.read_text())
    for i, s in QWEN_VISION_TOKENS.items():
        if str(i) in cfg.get("added_tokens_decoder", {}):
            cfg["added_tokens_decoder"][str(i)].update(content=s, special=True)
    c.write_text(json.dumps(cfg))

