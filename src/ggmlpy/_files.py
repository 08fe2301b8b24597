"""Writing a file so that a reader never sees half of it; the per-machine JSON caches."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def replacing(path: str | os.PathLike) -> Iterator[str]:
    """The name of a new temporary file beside ``path``, to write; when the block ends without an
    error it replaces ``path`` in one step (a reader sees the old file or the new one, never half of
    one), and on any error it is removed and ``path`` is left as it was.

    The name is unique to the call (process id and random bits), so concurrent writers of the same
    path do not write into each other's file; the caller creates it (with the usual permissions).
    """
    path = os.fspath(path)
    tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_machine_cache(path: str | os.PathLike, format: int) -> dict[str, Any]:
    """A JSON cache of per-machine measurements (``{"format": format, "machines": {key: entry}}``: the
    benchmark's ``roofline.json``, the kernels' ``kernels.json``); an empty one where the file is
    missing, unreadable or of another format (measured again)."""
    try:
        with open(path) as f:
            data = json.load(f)
        if isinstance(data, dict) and data.get("format") == format and isinstance(data.get("machines"), dict):
            return data
    except (OSError, ValueError):
        pass
    return {"format": format, "machines": {}}


def write_machine_cache(path: str | os.PathLike, data: dict[str, Any]) -> None:
    """Write such a cache whole (its folder made; readers see the old file or the new one)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with replacing(path) as tmp, open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
