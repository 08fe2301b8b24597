"""A Hugging Face hub on loopback, for the ``hf://`` tests: a thread serving, over HTTP on 127.0.0.1, the
part of the hub's API that ``huggingface_hub`` calls to list a model repository and download its files
(point ``HF_ENDPOINT``, or ``huggingface_hub.constants.ENDPOINT``, at :attr:`LoopbackHub.url`).

* ``GET /api/models/ORG/NAME`` and ``.../revision/REV``: the repository's info, ``{"id", "sha",
  "siblings": [{"rfilename"}...]}``; an unknown repository is a 404 with ``X-Error-Code: RepoNotFound``,
  an unknown revision one with ``RevisionNotFound`` (what the hub answers).
* ``HEAD``/``GET /ORG/NAME/resolve/REV/PATH``: the file, with ``ETag`` (its sha256, quoted, as the hub
  gives LFS files), ``X-Repo-Commit``, ``Content-Length``, ``Accept-Ranges: bytes``; ``Range:
  bytes=N-`` is answered with 206 and ``Content-Range``. An unknown file: 404 ``EntryNotFound``.
* :meth:`LoopbackHub.cut` makes the first GET of a file send its headers (the whole length) and half its
  bytes, then close the connection: a download broken midway.

Every request is recorded (:attr:`LoopbackHub.requests`: method, path, Range header; and
:attr:`LoopbackHub.authorizations`), so a test can see what the library asked for. Only the standard library is used.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import re
import threading
from pathlib import Path
from urllib.parse import unquote, urlsplit

#: the one revision served besides its commit hash
MAIN = "main"


class LoopbackHub:
    """The server; ``with LoopbackHub() as hub:`` starts and stops it.

    ``hub.add(repo, {path_in_repo: local_file_or_bytes})`` publishes a repository (its commit is a hash
    of its contents); ``hub.listed(repo, names)`` hides files from the listing (they are still served
    when asked for: a listing may be out of date).
    """

    def __init__(self) -> None:
        self.repos: dict[str, dict[str, bytes]] = {}
        self.commits: dict[str, str] = {}
        self.unlisted: dict[str, set[str]] = {}
        self.requests: list[tuple[str, str, str | None]] = []
        #: each request's Authorization header (None: none), in the order of ``requests``
        self.authorizations: list[str | None] = []
        self._cut: set[tuple[str, str]] = set()
        self._stopped = False
        self._lock = threading.Lock()
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:      # quiet
                pass

            def do_HEAD(self) -> None:
                hub._serve(self, head=True)

            def do_GET(self) -> None:
                hub._serve(self, head=False)

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def add(self, repo: str, files: dict[str, str | Path | bytes]) -> str:
        """Publish ``repo`` with these files; returns its commit hash."""
        data = {name: (f if isinstance(f, bytes) else Path(f).read_bytes()) for name, f in files.items()}
        h = hashlib.sha1(repo.encode())
        for name in sorted(data):
            h.update(name.encode() + b"\0" + hashlib.sha256(data[name]).digest())
        with self._lock:
            self.repos[repo] = data
            self.commits[repo] = h.hexdigest()
        return self.commits[repo]

    def listed(self, repo: str, hidden: set[str]) -> None:
        self.unlisted[repo] = set(hidden)

    def cut(self, repo: str, name: str) -> None:
        """Break the next GET of ``repo``'s ``name`` after half its bytes."""
        self._cut.add((repo, name))

    def gets(self, name: str) -> list[str | None]:
        """The Range headers of the GETs of files called ``name`` so far (None: the whole file)."""
        return [rng for method, path, rng in self.requests if method == "GET" and path.endswith("/" + name)]

    # ------------------------------------------------------------------ serving

    def _send(self, h, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False) -> None:
        h.send_response(status)
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if not head and body:
            h.wfile.write(body)

    def _error(self, h, status: int, code: str, repo: str | None, head: bool) -> None:
        headers = {"X-Error-Code": code, "Content-Type": "application/json"}
        if repo in self.commits:
            headers["X-Repo-Commit"] = self.commits[repo]
        self._send(h, status, json.dumps({"error": code}).encode(), headers, head)

    def _revision_ok(self, repo: str, rev: str) -> bool:
        return rev in (MAIN, self.commits[repo])

    def _serve(self, h, head: bool) -> None:
        if self._stopped:
            # a kept-alive connection outlives the listening socket: a stopped hub answers nothing on it
            h.close_connection = True
            return
        path = unquote(urlsplit(h.path).path)
        rng = h.headers.get("Range")
        with self._lock:
            self.requests.append(("HEAD" if head else "GET", path, rng))
            self.authorizations.append(h.headers.get("Authorization"))
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
        if m:
            repo, rev = m[1], m[2] or MAIN
            if repo not in self.repos:
                return self._error(h, 404, "RepoNotFound", None, head)
            if not self._revision_ok(repo, rev):
                return self._error(h, 404, "RevisionNotFound", repo, head)
            hidden = self.unlisted.get(repo, set())
            body = json.dumps({"id": repo, "modelId": repo, "sha": self.commits[repo], "private": False,
                               "siblings": [{"rfilename": n} for n in sorted(self.repos[repo]) if n not in hidden]})
            return self._send(h, 200, body.encode(), {"Content-Type": "application/json"}, head)
        m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if not m:
            return self._error(h, 404, "NotFound", None, head)
        repo, rev, name = m[1], m[2], m[3]
        if repo not in self.repos:
            return self._error(h, 404, "RepoNotFound", None, head)
        if not self._revision_ok(repo, rev):
            return self._error(h, 404, "RevisionNotFound", repo, head)
        data = self.repos[repo].get(name)
        if data is None:
            return self._error(h, 404, "EntryNotFound", repo, head)
        headers = {"ETag": f'"{hashlib.sha256(data).hexdigest()}"', "X-Repo-Commit": self.commits[repo],
                   "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        start = 0
        r = re.fullmatch(r"bytes=(\d+)-", rng or "")
        if r and not head:
            start = int(r[1])
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        body = data[start:]
        if head:
            # a HEAD's Content-Length is the file's
            h.send_response(200)
            for k, v in headers.items():
                h.send_header(k, v)
            h.send_header("Content-Length", str(len(data)))
            h.end_headers()
            return
        if (repo, name) in self._cut:
            self._cut.discard((repo, name))
            h.send_response(206 if start else 200)
            for k, v in headers.items():
                h.send_header(k, v)
            h.send_header("Content-Length", str(len(body)))
            h.end_headers()
            h.wfile.write(body[:len(body) // 2])
            h.wfile.flush()
            h.close_connection = True
            return
        self._send(h, 206 if start else 200, body, headers)

    # ------------------------------------------------------------------ lifetime

    def start(self) -> LoopbackHub:
        self._thread = threading.Thread(target=self._server.serve_forever, name="loopback-hub", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped = True
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join()
            self._thread = None
        self._server.server_close()

    def __enter__(self) -> LoopbackHub:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
