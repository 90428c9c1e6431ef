"""A local Hugging Face Hub mirror: a test double of the Hub HTTP API.

It serves just what the real ``huggingface_hub`` client needs to call
``HfApi.model_info``, ``hf_hub_download`` and ``snapshot_download`` when it is
pointed at it with ``endpoint=`` (or ``HF_ENDPOINT``):

- ``GET /api/models/{repo}[/revision/{rev}]``: model info (``?blobs=true`` adds sizes);
- ``GET /api/models/{repo}/tree/{rev}[/{path}]``: the file listing (``?recursive=true``);
- ``HEAD|GET /{repo}/resolve/{rev}/{path}``: file metadata and content, with ``Range``.

Files are served from memory, straight from the mirror: no redirect to a CDN and
no Xet headers, so the client always falls back to a plain HTTP download. Files
of at least ``LFS_MIN_SIZE`` bytes are described as LFS files, as the Hub does for
weights: their ETag is their sha256 and the listings carry their ``lfs`` info.
Errors carry the Hub's ``X-Error-Code`` / ``X-Error-Message`` headers, which the
client maps to ``RepositoryNotFoundError``, ``RevisionNotFoundError``,
``RemoteEntryNotFoundError`` and ``HfHubHTTPError``.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, Self
from urllib.parse import unquote

from aiohttp import web

# Matched against the raw (still percent-encoded) path: the client quotes a
# revision such as ``refs/pr/1`` as one segment, which decoding would split.
_INFO = re.compile(r"/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>[^/]+))?")
_TREE = re.compile(r"/api/models/(?P<repo>[^/]+/[^/]+)/tree/(?P<rev>[^/]+)(?:/(?P<path>.+))?")
_RESOLVE = re.compile(r"/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)")
_RANGE = re.compile(r"bytes=(?P<start>\d*)-(?P<end>\d*)")

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class _Blob:
    data: bytes
    lfs: bool

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def pointer(self) -> bytes:
        """The git-lfs pointer that git stores in place of an LFS file."""
        return b"version https://git-lfs.github.com/spec/v1\noid sha256:%s\nsize %d\n" % (
            self.sha256.encode(),
            len(self.data),
        )

    @property
    def git_sha1(self) -> str:
        # The Hub reports a file's git blob id, which for an LFS file is its pointer's.
        stored = self.pointer if self.lfs else self.data
        return hashlib.sha1(b"blob %d\0" % len(stored) + stored).hexdigest()

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else self.git_sha1

    def lfs_info(self) -> dict[str, Any]:
        return {"oid": self.sha256, "size": len(self.data), "pointerSize": len(self.pointer)}


@dataclass
class _Repo:
    commits: dict[str, dict[str, _Blob]] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)

    def resolve(self, revision: str) -> str | None:
        if revision in self.commits:
            return revision
        return self.branches.get(revision)


class _HubError(Exception):
    """An error answered the way the Hub answers it."""

    def __init__(
        self, status: int, message: str, code: str | None = None, commit: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.commit = status, message, code, commit

    def response(self) -> web.Response:
        headers = {"X-Error-Message": self.message}
        if self.code is not None:
            headers["X-Error-Code"] = self.code
        if self.commit is not None:
            # Lets the client remember that the file is absent at this commit.
            headers["X-Repo-Commit"] = self.commit
        return web.json_response({"error": self.message}, status=self.status, headers=headers)


class HubMirror:
    """A test double of the Hugging Face Hub API on 127.0.0.1 (aiohttp, own thread, free port).

    If ``token`` is set, every request must carry ``Authorization: Bearer <token>``:
    without one the answer is the Hub's 401 for a private repo (the client raises
    ``RepositoryNotFoundError``); with a wrong one it is the Hub's 401 for bad
    credentials (the client raises a plain ``HfHubHTTPError``).
    """

    LFS_MIN_SIZE = 1 << 20

    def __init__(self, token: str | None = None) -> None:
        self.token = token
        self.requests: list[tuple[str, str]] = []
        self._repos: dict[str, _Repo] = {}
        # Revisions are added from the test's thread while the server reads them.
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._url: str | None = None

    @property
    def url(self) -> str:
        if self._url is None:
            raise RuntimeError("the hub mirror is not started")
        return self._url

    def add_revision(self, repo_id: str, files: dict[str, bytes], branch: str = "main") -> str:
        """Commit ``files`` (the whole tree) to ``repo_id`` and point ``branch`` at it."""
        if not re.fullmatch(r"[^/]+/[^/]+", repo_id):
            raise ValueError(f"repo_id must be 'namespace/name', got {repo_id!r}")
        blobs = {
            path: _Blob(data, lfs=len(data) >= self.LFS_MIN_SIZE)
            for path, data in sorted(files.items())
        }
        digest = hashlib.sha1(repo_id.encode())
        for path, blob in blobs.items():
            digest.update(f"\0{path}\0{blob.git_sha1}".encode())
        commit = digest.hexdigest()
        with self._lock:
            repo = self._repos.setdefault(repo_id, _Repo())
            repo.commits[commit] = blobs
            repo.branches[branch] = commit
        return commit

    def start(self) -> None:
        started = threading.Event()
        failure: list[BaseException] = []

        def serve() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self._serve())
            except BaseException as exc:
                failure.append(exc)
                started.set()
                loop.close()
                return
            started.set()
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=serve, name="hub-mirror", daemon=True)
        self._thread.start()
        started.wait()
        if failure:
            raise RuntimeError("the hub mirror did not start") from failure[0]

    def stop(self) -> None:
        loop, runner, thread = self._loop, self._runner, self._thread
        if loop is None or thread is None:
            return
        if runner is not None:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        # ``url`` stays set, so that a test can point a client at a hub that is down.
        self._loop = self._thread = self._runner = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    async def _serve(self) -> None:
        app = web.Application(middlewares=[self._middleware])
        app.router.add_route("*", "/{tail:.*}", self._dispatch)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        self._runner, self._url = runner, f"http://{host}:{port}"

    @web.middleware
    async def _middleware(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        self.requests.append((request.method, request.path))
        try:
            self._authorize(request)
            return await handler(request)
        except _HubError as err:
            return err.response()

    def _authorize(self, request: web.Request) -> None:
        # The client never sends its token for the agent registry, which the Hub serves to anyone.
        if self.token is None or request.path == "/api/agent-harnesses":
            return
        given = request.headers.get("Authorization")
        if given is None:
            # The Hub hides private repos from anonymous callers.
            raise _HubError(401, "Invalid username or password.", "RepoNotFound")
        if given != f"Bearer {self.token}":
            raise _HubError(401, "Invalid credentials in Authorization header")

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        path = request.rel_url.raw_path
        if path == "/api/agent-harnesses":
            # Fetched once a day by the client (unless telemetry is off) to name the
            # AI agent in its User-Agent; an empty registry names none.
            return web.json_response({"standardEnvVars": [], "harnesses": {}})
        if request.method == "GET" and (match := _INFO.fullmatch(path)):
            return self._model_info(request, match)
        if request.method == "GET" and (match := _TREE.fullmatch(path)):
            return self._tree(request, match)
        if request.method in ("GET", "HEAD") and (match := _RESOLVE.fullmatch(path)):
            return self._resolve(request, match)
        raise _HubError(404, f"Sorry, we can't find the page you are looking for: {path}")

    def _commit(self, repo_id: str, revision: str) -> tuple[str, dict[str, _Blob]]:
        with self._lock:
            repo = self._repos.get(repo_id)
            if repo is None:
                raise _HubError(404, "Repository not found", "RepoNotFound")
            commit = repo.resolve(revision)
            if commit is None:
                raise _HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
            return commit, repo.commits[commit]

    def _model_info(self, request: web.Request, match: re.Match[str]) -> web.Response:
        repo_id = unquote(match["repo"])
        commit, blobs = self._commit(repo_id, unquote(match["rev"] or "main"))
        with_blobs = request.query.get("blobs", "").lower() in ("1", "true")
        siblings: list[dict[str, Any]] = []
        for path, blob in blobs.items():
            sibling: dict[str, Any] = {"rfilename": path}
            if with_blobs:
                sibling.update(size=len(blob.data), blobId=blob.git_sha1)
                if blob.lfs:
                    sibling["lfs"] = {
                        "size": len(blob.data),
                        "sha256": blob.sha256,
                        "pointerSize": len(blob.pointer),
                    }
            siblings.append(sibling)
        now = datetime.now(UTC).isoformat().replace("+00:00", "Z")
        return web.json_response(
            {
                "_id": commit[:24],
                "id": repo_id,
                "modelId": repo_id,
                "author": repo_id.split("/")[0],
                "sha": commit,
                "lastModified": now,
                "createdAt": now,
                "private": self.token is not None,
                "disabled": False,
                "gated": False,
                "downloads": 0,
                "likes": 0,
                "tags": [],
                "siblings": siblings,
            }
        )

    def _tree(self, request: web.Request, match: re.Match[str]) -> web.Response:
        commit, blobs = self._commit(unquote(match["repo"]), unquote(match["rev"]))
        base = unquote(match["path"] or "").strip("/")
        recursive = request.query.get("recursive", "").lower() in ("1", "true")
        prefix = f"{base}/" if base else ""
        if base and not any(path.startswith(prefix) for path in blobs):
            raise _HubError(404, f"{base} does not exist on {commit}", "EntryNotFound", commit)

        entries: dict[str, dict[str, Any]] = {}
        for path, blob in blobs.items():
            if not path.startswith(prefix):
                continue
            parts = path[len(prefix) :].split("/")
            # Every folder above a file is listed too, as the Hub does.
            depth = len(parts) if recursive else 1
            for i in range(1, min(depth, len(parts) - 1) + 1):
                folder = prefix + "/".join(parts[:i])
                oid = hashlib.sha1(f"{commit}\0{folder}".encode()).hexdigest()
                entries[folder] = {"type": "directory", "oid": oid, "size": 0, "path": folder}
            if recursive or len(parts) == 1:
                entry: dict[str, Any] = {
                    "type": "file",
                    "oid": blob.git_sha1,
                    "size": len(blob.data),
                    "path": path,
                }
                if blob.lfs:
                    entry["lfs"] = blob.lfs_info()
                entries[path] = entry
        return web.json_response([entries[path] for path in sorted(entries)])

    def _resolve(self, request: web.Request, match: re.Match[str]) -> web.Response:
        commit, blobs = self._commit(unquote(match["repo"]), unquote(match["rev"]))
        path = unquote(match["path"])
        blob = blobs.get(path)
        if blob is None:
            raise _HubError(404, "Entry not found", "EntryNotFound", commit)

        data, total = blob.data, len(blob.data)
        headers = {
            "X-Repo-Commit": commit,
            "ETag": f'"{blob.etag}"',
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
        }
        if blob.lfs:
            headers.update({"X-Linked-Etag": f'"{blob.etag}"', "X-Linked-Size": str(total)})

        # The client asks for a range only to resume a download cut mid-stream.
        wanted = request.headers.get("Range")
        if wanted is None:
            return web.Response(body=data, headers=headers)
        span = _byte_span(wanted, total)
        if span is None:
            headers["Content-Range"] = f"bytes */{total}"
            return web.Response(status=416, headers=headers)
        start, end = span
        headers["Content-Range"] = f"bytes {start}-{end}/{total}"
        return web.Response(status=206, body=data[start : end + 1], headers=headers)


def _byte_span(header: str, total: int) -> tuple[int, int] | None:
    """The inclusive byte span a one-range ``Range`` header asks for, or None if unsatisfiable."""
    match = _RANGE.fullmatch(header.strip())
    if match is None or not (match["start"] or match["end"]):
        return None
    if not match["start"]:
        start, end = max(total - int(match["end"]), 0), total - 1
    else:
        start = int(match["start"])
        end = min(int(match["end"]), total - 1) if match["end"] else total - 1
    if start >= total or start > end:
        return None
    return start, end
