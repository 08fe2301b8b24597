"""Writing a file so that a reader never sees half of it."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator


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
