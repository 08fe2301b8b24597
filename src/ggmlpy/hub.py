"""Models from the Hugging Face hub: an ``hf://`` reference (or llama.cpp's ``-hf org/repo[:quant]``) resolved
to GGUF files in the hub's own cache, downloaded by ``huggingface_hub`` when they are not there yet.

References::

    hf://ORG/REPO/PATH/FILE.gguf     that file (a split model's shard: the whole set)
    hf://ORG/REPO:QUANT              the model file tagged QUANT (Q8_0, q4_k_m: any case)
    hf://ORG/REPO                    Q4_K_M, else Q8_0 (llama.cpp's defaults), else the repository's one model
    hf://ORG/REPO@REVISION...        a branch, tag or commit (default: main)

How a file is chosen, as llama.cpp's ``-hf`` chooses it (``common/download.cpp``): among the repository's
``.gguf`` files, leaving out those that are not a model (``mmproj``, ``imatrix``, and the ``mtp-``,
``eagle3-``, ``dflash-``, ``dspark-`` drafts) and every shard of a split set but its first, the files
whose name has the tag followed by ``.`` or ``-`` (``model-Q8_0.gguf``, ``Q8_0/model-Q8_0-00001-of-00002.gguf``).
Where llama.cpp takes the first of several matches, ggmlpy refuses and lists them: two files that both
say ``Q4_K_M`` (``model-Q4_K_M.gguf`` and ``model-UD-Q4_K_M.gguf``) are two models, and which one a
listing's order puts first is no answer (``hf://ORG/REPO/FILE`` or ``-hff FILE`` names one). It also asks
the tag to start a word of the name (``Q4_0`` is not ``IQ4_0``).

A model with a vision encoder comes with an ``mmproj*.gguf`` beside it; llama.cpp's ``-hf`` downloads it
too. Here it is found (:attr:`HubModel.mmproj_file`, the one llama.cpp would take: in the model's folder or
above, the nearest, then the closest in bits to the model's quant) but downloaded only when asked for
(``mmproj=True``; the CLI asks when ``--image`` or ``--mmproj`` without a file is given): a text prompt does
not pay for an encoder.

Downloads are ``huggingface_hub``'s (``hf_hub_download``): into its cache (``HF_HUB_CACHE``, ``HF_HOME``;
``hf cache ls`` lists it), with its progress bars (``HF_HUB_DISABLE_PROGRESS_BARS=1`` hides them), its
token (``HF_TOKEN`` or ``hf auth login``) and its endpoint (``HF_ENDPOINT``). A file already in the cache
is used without downloading it again. A connection that breaks during a download is taken up again
where it broke (an HTTP range request). With ``HF_HUB_OFFLINE=1``, or when the hub cannot be reached,
the choice is made among the files in the cache and nothing is fetched: a file that is not there is an
error that names the repository and the file.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NoReturn, Optional

from ggmlpy._core import GGMLValueError
from ggmlpy.gguf.split import parse_split_name, split_path

__all__ = ["DEFAULT_QUANTS", "HubError", "HubModel", "HubRef", "choose_mmproj", "choose_model", "is_hub_ref",
           "local_files", "parse_ref", "resolve"]

log = logging.getLogger("ggmlpy")

SCHEME = "hf://"
#: the tags tried when a reference names none, in order (llama.cpp's ``find_best_model``)
DEFAULT_QUANTS = ("Q4_K_M", "Q8_0")
#: parts of a GGUF file's name that say it is not a model (llama.cpp's ``gguf_filename_is_model``)
_NOT_MODELS = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")
_PART = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_REF = re.compile(rf"^(?P<org>{_PART})/(?P<name>{_PART})(?:@(?P<rev>[^/:]+))?(?:/(?P<file>.+)|:(?P<quant>[^/]+))?$")


class HubError(GGMLValueError):
    """An ``hf://`` reference that does not resolve: a malformed one, no such repository, revision or
    file, no file or several with the quant tag, a file that is neither in the cache nor downloadable
    (offline). The message names the repository and the file."""


@dataclass(frozen=True)
class HubRef:
    """A parsed reference: ``repo`` (``org/name``), ``revision`` (None: the default branch), and
    ``file`` (a path in the repository) or ``quant`` (a tag), or neither."""

    repo: str
    revision: Optional[str] = None
    file: Optional[str] = None
    quant: Optional[str] = None

    def __str__(self) -> str:
        rev = f"@{self.revision}" if self.revision else ""
        tail = f"/{self.file}" if self.file else f":{self.quant}" if self.quant else ""
        return f"{SCHEME}{self.repo}{rev}{tail}"


@dataclass
class HubModel:
    """What :func:`resolve` chose and where it lies.

    Attributes
    ----------
    ref : HubRef
    revision : str
        The revision the files came from (``main`` unless the reference named one).
    files : tuple of str
        The model's files in the repository: one, or a split set's shards in order.
    paths : tuple of str
        Their local paths in the hub's cache (empty before :func:`resolve` fetched them).
    mmproj_file : str or None
        The repository's vision encoder for this model, when it has one (found, not always fetched).
    mmproj_path : str or None
        Its local path, once fetched (``resolve(..., mmproj=True)``).
    offline : bool
        The choice was made among the cached files (offline, or the hub out of reach).
    """

    ref: HubRef
    revision: str
    files: tuple[str, ...]
    mmproj_file: Optional[str] = None
    offline: bool = False
    paths: tuple[str, ...] = field(default=())
    mmproj_path: Optional[str] = None

    @property
    def path(self) -> str:
        """The local path to load: the model's file, or its split set's first shard."""
        if not self.paths:
            raise HubError(f"{self.ref}: not fetched yet")
        return self.paths[0]

    def describe(self) -> str:
        """One line: the reference, the file chosen and where it came from."""
        what = self.files[0] if len(self.files) == 1 else f"{self.files[0]} (+{len(self.files) - 1} more shards)"
        extra = f", vision encoder {self.mmproj_file}" if self.mmproj_path else ""
        where = " (offline: from the cache)" if self.offline else ""
        return f"{self.ref} -> {self.ref.repo}/{what} (revision {self.revision}){extra}{where}"


def is_hub_ref(text: object) -> bool:
    """Whether ``text`` is an ``hf://`` reference (a str starting with ``hf://``)."""
    return isinstance(text, str) and text.startswith(SCHEME)


def parse_ref(text: str) -> HubRef:
    """Parse ``hf://ORG/REPO[@REVISION][/FILE | :QUANT]`` (the ``hf://`` may be left out: llama.cpp's
    ``-hf ORG/REPO[:QUANT]``).

    Raises
    ------
    HubError
        Not of that form (the message shows the forms).
    """
    body = text[len(SCHEME):] if is_hub_ref(text) else text
    m = _REF.match(body)
    if m is None or (m["file"] is not None and not m["file"].strip("/")) or \
            (m["quant"] is not None and not m["quant"]):
        raise HubError(f"{text!r}: not a hub reference; expected hf://ORG/REPO/FILE.gguf, hf://ORG/REPO:QUANT or "
                       "hf://ORG/REPO (-hf ORG/REPO[:QUANT]), optionally ORG/REPO@REVISION")
    if m["org"] in ("datasets", "spaces"):
        raise HubError(f"{text!r}: only model repositories hold models here (hf://ORG/REPO...)")
    return HubRef(f"{m['org']}/{m['name']}", m["rev"], m["file"].strip("/") if m["file"] else None, m["quant"])


# ------------------------------------------------------------------------------------------- the choice


def _is_model(path: str) -> bool:
    base = path.rsplit("/", 1)[-1].lower()
    return base.endswith(".gguf") and not any(p in base for p in _NOT_MODELS)


def _stem(path: str) -> tuple[str, int, int]:
    """``(name without .gguf and shard suffix, shard number, count)`` (1, 1 for a plain file)."""
    parsed = parse_split_name(path)
    if parsed is not None:
        return parsed
    return (path[:-5] if path.lower().endswith(".gguf") else path), 1, 1


def _tag(path: str) -> str:
    """The quant tag a file's name ends with (``model-Q4_K_M.gguf`` -> ``Q4_K_M``), upper case; "" if none."""
    m = re.search(r"[-.]([A-Za-z0-9_]+)$", _stem(path)[0])
    return m[1].upper() if m else ""


def _bits(path: str) -> int:
    m = re.search(r"\d+", _tag(path))
    return int(m[0]) if m else 0


def _has_tag(path: str, tag: str) -> bool:
    # the tag starts the name or follows a separator, and a '.' or '-' follows it (llama.cpp: TAG[.-])
    return re.search(rf"(?:^|[/._-]){re.escape(tag)}[.-]", path, re.IGNORECASE) is not None


def _set_of(files: Sequence[str], first: str) -> list[str]:
    """``first`` and, for a split set's first shard, every shard's name (whether the repository lists them
    or not: a missing one is an error when it is fetched)."""
    parsed = parse_split_name(first)
    if parsed is None:
        return [first]
    prefix, _no, count = parsed
    return [split_path(prefix, k, count) for k in range(count)]


def _listing(files: Sequence[str]) -> str:
    models = [f for f in files if _is_model(f) and _stem(f)[1] == 1]
    if not models:
        ggufs = [f for f in files if f.lower().endswith(".gguf")]
        return "its GGUF files: " + (", ".join(ggufs) if ggufs else "none")
    return "its models: " + ", ".join(f"{f} ({_tag(f) or 'no tag'})" for f in models)


def choose_model(files: Sequence[str], quant: Optional[str] = None, where: str = "the repository") -> list[str]:
    """The files of the model to load among a repository's ``files`` (paths in it): one file, or a split
    set's shards in order. See the module docstring for the rules.

    Parameters
    ----------
    files : the repository's files
    quant : the tag asked for; None: :data:`DEFAULT_QUANTS`, then the repository's only model
    where : how the messages name the repository

    Raises
    ------
    HubError
        No model file with the tag (the message lists the models there), several (it lists them), no
        model at all.
    """
    models = [f for f in files if _is_model(f) and _stem(f)[1] == 1]
    quant = quant.upper() if quant else None        # matched in any case, named in upper case
    for tag in ([quant] if quant else DEFAULT_QUANTS):
        hits = [f for f in models if _has_tag(f, tag)]
        if len(hits) == 1:
            return _set_of(files, hits[0])
        if len(hits) > 1:
            return _ambiguous(hits, f"the tag {tag}" + ("" if quant else " (the default)"), where)
    if quant:
        raise HubError(f"{where} has no model file tagged {quant}; {_listing(files)}")
    if len(models) == 1:
        return _set_of(files, models[0])
    if not models:
        raise HubError(f"{where} has no GGUF model file; {_listing(files)}")
    return _ambiguous(models, f"none tagged {' or '.join(DEFAULT_QUANTS)} (the defaults)", where)


def _ambiguous(hits: Sequence[str], why: str, where: str) -> NoReturn:
    raise HubError(f"{where}: {len(hits)} model files match {why}, name one: "
                   + ", ".join(hits) + " (hf://ORG/REPO/FILE, or -hff FILE)")


def choose_mmproj(files: Sequence[str], model: str) -> Optional[str]:
    """The vision encoder llama.cpp's ``-hf`` takes for ``model``: among ``files`` named ``*mmproj*.gguf`` in
    the model's folder or a folder above it, the one in the deepest folder, then the closest in bits to
    the model's tag (``mmproj-F16.gguf`` for an F16 model, ``-Q8_0`` for a Q8_0 one); None if there is none."""
    folder = model.split("/")[:-1]
    best, best_key = None, None
    for f in files:
        base = f.rsplit("/", 1)[-1].lower()
        parts = f.split("/")[:-1]
        if not base.endswith(".gguf") or "mmproj" not in base or folder[:len(parts)] != parts:
            continue
        key = (-len(parts), abs(_bits(f) - _bits(model)))
        if best_key is None or key < best_key:
            best, best_key = f, key
    return best


# ------------------------------------------------------------------------------------------- the hub


def _hf():
    try:
        import huggingface_hub
        import huggingface_hub.constants
        import huggingface_hub.errors  # noqa: F401  (submodules: the package loads its names lazily)
    except ImportError as e:        # a dependency; only a broken install lacks it
        raise HubError(f"hf:// references need huggingface_hub (pip install huggingface_hub): {e}") from None
    return huggingface_hub


def _offline(hf) -> bool:
    consts = hf.constants
    fn = getattr(consts, "is_offline_mode", None)
    return bool(fn() if fn is not None else consts.HF_HUB_OFFLINE)


def _transport_errors() -> tuple:
    """What a request that cannot reach the hub raises: OSError (requests' errors, huggingface_hub's own),
    and httpx's transport errors for the versions built on httpx."""
    errs: list = [OSError]
    for name in ("httpx2", "httpx"):
        mod = sys.modules.get(name)
        if mod is not None and isinstance(getattr(mod, "TransportError", None), type):
            errs.append(mod.TransportError)
    return tuple(errs)


def _cached_listing(hf, repo: str, revision: str, cache_dir: Optional[str]) -> Optional[list[str]]:
    """The files of ``repo`` at ``revision`` in the cache (huggingface_hub's documented layout:
    ``models--ORG--NAME/refs/REVISION`` holds the commit, ``snapshots/COMMIT/`` its files); None when
    the cache has nothing of that revision."""
    from huggingface_hub.file_download import repo_folder_name

    root = os.path.join(cache_dir or hf.constants.HF_HUB_CACHE, repo_folder_name(repo_id=repo, repo_type="model"))
    commit = revision
    ref = os.path.join(root, "refs", revision)
    if os.path.isfile(ref):
        with open(ref) as f:
            commit = f.read().strip()
    snap = os.path.join(root, "snapshots", commit)
    if not os.path.isdir(snap):
        return None
    out = []
    for dirpath, _dirs, names in os.walk(snap):
        for n in names:
            full = os.path.join(dirpath, n)
            if os.path.exists(full):            # a link to a blob that is there
                out.append(os.path.relpath(full, snap).replace(os.sep, "/"))
    return sorted(out)


def _describe_error(e: BaseException, ref: HubRef, what: str, endpoint: str) -> str:
    errors = _hf().errors
    name = type(e).__name__
    if isinstance(e, errors.GatedRepoError):
        return (f"{ref}: {ref.repo} is gated: accept its conditions on {endpoint}/{ref.repo} and give a token "
                "(HF_TOKEN or `hf auth login`)")
    if isinstance(e, errors.RepositoryNotFoundError):
        return (f"{ref}: no repository {ref.repo} on {endpoint} (or it is private: give a token, HF_TOKEN or "
                "`hf auth login`)")
    if isinstance(e, errors.RevisionNotFoundError):
        return f"{ref}: {ref.repo} has no revision {ref.revision or 'main'}"
    if isinstance(e, errors.EntryNotFoundError) and not isinstance(e, errors.LocalEntryNotFoundError):
        return f"{ref}: {ref.repo} has no file {what} (revision {ref.revision or 'main'})"
    first = str(e).strip().splitlines()[0] if str(e).strip() else name
    return f"{ref}: {what}: {first} ({name})"


def resolve(ref: str | HubRef, *, mmproj: bool = False, download: bool = True, model: bool = True,
            token: Optional[str] = None, endpoint: Optional[str] = None, cache_dir: Optional[str] = None) -> HubModel:
    """Choose the model a reference names and fetch its files into the hub's cache (or find them there).

    Parameters
    ----------
    ref : ``hf://ORG/REPO[@REV][/FILE | :QUANT]``, ``ORG/REPO[:QUANT]``, or a :class:`HubRef`
    mmproj : also fetch the repository's vision encoder for this model (:attr:`HubModel.mmproj_file`);
        an error where there is none
    download : False to choose without fetching anything (``paths`` stays empty)
    model : False to fetch only the vision encoder (with ``mmproj``), not the model's files
    token, endpoint, cache_dir : huggingface_hub's (default: its own, ``HF_TOKEN``, ``HF_ENDPOINT`` (read
        at each call), ``HF_HUB_CACHE``)

    Returns
    -------
    HubModel
        ``model.path`` is the local file to load (a split set's first shard).

    Raises
    ------
    HubError
        The reference does not resolve (see the class); every message names the repository and, where
        one was chosen, the file.
    """
    hf = _hf()
    r = ref if isinstance(ref, HubRef) else parse_ref(ref)
    revision = r.revision or "main"
    # HF_ENDPOINT as it is now (huggingface_hub reads it once, when it is imported)
    endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or hf.constants.ENDPOINT).rstrip("/")
    where = f"{r}: {r.repo} (revision {revision})"          # how every message of the choice starts
    offline = _offline(hf)
    files: Optional[list[str]] = None
    unreachable: Optional[BaseException] = None
    if not offline:
        try:
            info = hf.HfApi(endpoint=endpoint, token=token).model_info(r.repo, revision=r.revision)
            files = [s.rfilename for s in (info.siblings or [])]
        except hf.errors.HfHubHTTPError as e:
            status = getattr(getattr(e, "response", None), "status_code", None)
            if isinstance(e, (hf.errors.RepositoryNotFoundError, hf.errors.RevisionNotFoundError)) or \
                    (status is not None and 400 <= status < 500):
                raise HubError(_describe_error(e, r, "the file list", endpoint)) from None
            unreachable = e                 # the hub is down: the cache may have what is needed
        except _transport_errors() as e:
            unreachable = e
    if files is None:
        files = _cached_listing(hf, r.repo, revision, cache_dir)
        if files is None:
            why = ("offline (HF_HUB_OFFLINE=1)" if offline else
                   f"{endpoint} could not be reached ({type(unreachable).__name__}: {unreachable})")
            raise HubError(f"{where} is not in the hub cache ({cache_dir or hf.constants.HF_HUB_CACHE}) and "
                           f"{why}: run once online to download it")
        why = "offline: HF_HUB_OFFLINE=1" if offline else f"{endpoint} out of reach"
        where = (f"{r}: the hub cache's copy of {r.repo} (revision {revision}; {why}, so only the files downloaded "
                 "before)")
    if r.file:
        chosen = _match_file(files, r.file, where, r)
    else:
        chosen = choose_model(files, r.quant, where)
    mmproj_file = choose_mmproj(files, chosen[0])
    found = HubModel(r, revision, tuple(chosen), mmproj_file, offline=offline or unreachable is not None)
    if mmproj and mmproj_file is None:
        raise HubError(f"{where} has no vision encoder (mmproj*.gguf) for {chosen[0]}; give one "
                       "(--mmproj FILE, mmproj=PATH)")
    if not download:
        return found
    if model:
        found.paths = tuple(_fetch(hf, r, f, revision, token, endpoint, cache_dir) for f in chosen)
    if mmproj:
        found.mmproj_path = _fetch(hf, r, mmproj_file, revision, token, endpoint, cache_dir)
    elif mmproj_file is not None:
        log.info("%s: %s also has a vision encoder, %s (not fetched: ask for it with mmproj)", r, r.repo,
                 mmproj_file)
    return found


def _match_file(files: Sequence[str], name: str, where: str, r: HubRef) -> list[str]:
    """The set a named file is in: the file as listed (exactly, else in any case, as llama.cpp's
    ``--hf-file``), or every shard of its split set."""
    hit = name if name in files else None
    if hit is None:
        folded = [f for f in files if f.lower() == name.lower()]
        hit = folded[0] if len(folded) == 1 else None
    if hit is None:
        raise HubError(f"{where} has no file {name}; {_listing(files)}")
    stem, no, count = _stem(hit)
    if count > 1:
        if no != 1:
            log.info("%s: %s is shard %d of %d: taking the whole set", r, hit, no, count)
        return [split_path(stem, k, count) for k in range(count)]
    return [hit]


#: downloads tried per file when the connection breaks: huggingface_hub takes a broken download up where
#: it broke, within one call (1.x and later: ``http_get``'s retries with a range) or at the next call (0.x:
#: from the ``.incomplete`` file it keeps), so a second call finishes what the first began
_ATTEMPTS = 3


def _fetch(hf, r: HubRef, filename: str, revision: str, token, endpoint: str, cache_dir) -> str:
    errors = hf.errors
    for attempt in range(1, _ATTEMPTS + 1):
        try:
            return hf.hf_hub_download(r.repo, filename, revision=revision, token=token, endpoint=endpoint,
                                      cache_dir=cache_dir)
        except errors.LocalEntryNotFoundError:
            why = "offline (HF_HUB_OFFLINE=1)" if _offline(hf) else f"{endpoint} could not be reached"
            raise HubError(f"{r}: {r.repo}/{filename} (revision {revision}) is not in the hub cache and {why}: "
                           "run once online to download it") from None
        except (errors.HfHubHTTPError, errors.EntryNotFoundError) as e:
            raise HubError(_describe_error(e, r, filename, endpoint)) from None
        except _transport_errors() as e:
            if attempt == _ATTEMPTS:
                raise HubError(f"{r}: downloading {r.repo}/{filename} failed {_ATTEMPTS} times, the last: "
                               f"{type(e).__name__}: {e}") from None
            log.warning("%s: downloading %s broke (%s: %s); taking it up again", r, filename, type(e).__name__, e)
    raise AssertionError("unreachable")


def local_files(path, mmproj=None) -> tuple:
    """``(path, mmproj)`` with each ``hf://`` reference resolved to its local file (fetched if need be);
    anything else as it is. An ``mmproj`` of ``hf://ORG/REPO`` (no file, no tag) is that repository's
    vision encoder: for the model ``path`` names when it is in the same repository and revision
    (:func:`choose_mmproj`), else for the repository's default model.

    What :func:`ggmlpy.load_model` does first with its ``path`` and ``mmproj``.

    Raises
    ------
    HubError
        As :func:`resolve`.
    """
    encoder = parse_ref(mmproj) if is_hub_ref(mmproj) else None
    beside = encoder is not None and encoder.file is None and encoder.quant is None    # "the repository's"
    if is_hub_ref(path):
        ref = parse_ref(path)
        same = beside and (encoder.repo, encoder.revision or "main") == (ref.repo, ref.revision or "main")
        model = resolve(ref, mmproj=same)
        log.info("%s", model.describe())
        path = model.path
        if same:
            return path, model.mmproj_path
    if encoder is not None:
        mmproj = resolve(encoder, mmproj=True, model=False).mmproj_path if beside else resolve(encoder).path
    return path, mmproj
