"""Where model weights come from: one small adapter per URI scheme.

A catalog entry's ``source`` is a URI:

- ``file:///path``: a safetensors folder or a ``.gguf`` file on this machine;
- ``package://<python-package>/<file>``: a file inside an installed package;
- ``s3://bucket/prefix``: an object or every object under a prefix, on any
  S3-compatible store (endpoint, region and credentials from settings, the
  standard AWS variables, an AWS profile or the pod's web identity);
- ``hf://org/name[@revision][/file]``: a Hugging Face hub repository (or one
  file of it) through ``huggingface_hub``, honouring ``HF_ENDPOINT``,
  ``HF_TOKEN`` and ``HF_HUB_OFFLINE``.

Local sources are used where they are. Remote ones are listed first (a
``Snapshot``: the exact revision and every file's size, which key the cache)
and then fetched into a folder the cache owns (see ``tollgate.models.cache``).
Every failure is a ``ModelSourceError`` that names the model and the source.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib.util
import os
import re
import shutil
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from tollgate.models.catalog import Weights

if TYPE_CHECKING:
    from tollgate.runtime.settings import CommonSettings

# phase ("fetch", "convert"), bytes done, bytes in all (None: not known)
ProgressFn = Callable[[str, int, "int | None"], None]
# file name -> manifest record of digests computed while fetching (so the cache
# need not read the bytes a second time): {"size", "part_bytes", "part_sha256"}
FileDigests = dict[str, dict[str, Any]]


def no_progress(phase: str, done: int, total: int | None) -> None:
    """A progress callback that shows nothing."""


class ModelSourceError(Exception):
    """The source of a model cannot be resolved or fetched."""


class SourceUnreachable(ModelSourceError):
    """The source's server cannot be reached (a cached copy may still serve)."""


class SourceOffline(SourceUnreachable):
    """The source cannot be listed without the network, which is switched off."""


@dataclass(frozen=True)
class RemoteFile:
    name: str  # path inside the model folder
    size: int
    key: str = ""  # the adapter's own name for it (object key, repo path)
    etag: str = ""


@dataclass(frozen=True)
class Snapshot:
    """One exact revision of a remote source: what the cache entry is keyed by."""

    revision: str
    files: list[RemoteFile] = field(default_factory=list)

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)


@dataclass(frozen=True)
class FetchOptions:
    """How remote sources are reached (from ``CommonSettings``)."""

    concurrency: int = 8
    part_bytes: int = 64 << 20
    attempts: int = 5
    s3_endpoint_url: str | None = None
    s3_region: str | None = None
    s3_access_key_id: str | None = None
    s3_secret_access_key: str | None = None
    s3_session_token: str | None = None
    hf_endpoint: str | None = None
    hf_token: str | None = None
    hf_offline: bool = False

    @classmethod
    def from_settings(cls, common: CommonSettings) -> FetchOptions:
        # an empty value (a blank ConfigMap or Secret entry) means unset
        def secret(value: Any) -> str | None:
            return (value.get_secret_value() or None) if value is not None else None

        return cls(
            concurrency=common.model_fetch_concurrency,
            part_bytes=int(common.model_fetch_part_mb * (1 << 20)),
            s3_endpoint_url=common.s3_endpoint_url or None,
            s3_region=common.s3_region or None,
            s3_access_key_id=common.s3_access_key_id or None,
            s3_secret_access_key=secret(common.s3_secret_access_key),
            s3_session_token=secret(common.s3_session_token),
            hf_endpoint=common.hf_endpoint or None,
            hf_token=secret(common.hf_token),
            hf_offline=common.hf_offline,
        )


class Source(ABC):
    """One model source. Local sources return a path; remote ones list and fetch."""

    def __init__(self, entry: Weights, options: FetchOptions) -> None:
        self.entry = entry
        self.uri = entry.source
        self.options = options

    def error(self, reason: str) -> ModelSourceError:
        return ModelSourceError(f"model {self.entry.id!r}: {self.uri}: {reason}")

    def local_path(self) -> Path | None:
        """The file or folder to use in place; None for a source that must be fetched."""
        return None

    @abstractmethod
    def snapshot(self) -> Snapshot:
        """The current revision and its files (asks the remote side)."""

    @abstractmethod
    def fetch(self, snapshot: Snapshot, dest: Path, progress: ProgressFn) -> FileDigests:
        """Write every file of ``snapshot`` under ``dest`` (an empty folder).

        Returns the digests it computed on the way (any files it has none for
        are hashed by the cache afterwards).
        """

    @property
    def pinned(self) -> str | None:
        """The exact revision the URI itself names, if any (usable offline)."""
        return None

    @property
    def name(self) -> str:
        """A short readable name for cache folders."""
        return Path(urlparse(self.uri).path.rstrip("/")).name or self.entry.id


class LocalSource(Source):
    def __init__(self, entry: Weights, options: FetchOptions, path: Path) -> None:
        super().__init__(entry, options)
        self.path = path

    def local_path(self) -> Path:
        if not self.path.exists():
            raise self.error("does not exist")
        return self.path

    def snapshot(self) -> Snapshot:
        stat = self.local_path().stat()
        return Snapshot(revision=f"{stat.st_size}|{stat.st_mtime_ns}")

    def fetch(self, snapshot: Snapshot, dest: Path, progress: ProgressFn) -> FileDigests:
        raise self.error("a local source is used in place")


def _package_path(entry: Weights, package: str, inner: str) -> Path:
    spec = importlib.util.find_spec(package)
    # find_spec does not import the package, so a package whose __init__
    # needs other software still serves as a file carrier.
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(
            f"model {entry.id!r}: {entry.source}: package {package!r} is not installed"
        )
    return Path(next(iter(spec.submodule_search_locations))) / inner.lstrip("/")


# -- S3 ---------------------------------------------------------------------


class S3Source(Source):
    """``s3://bucket/prefix``: one object, or every object under ``prefix/``.

    Large objects are fetched as parallel ranged GETs (``part_bytes`` each,
    ``concurrency`` at once), each pinned to the listed ETag with If-Match so
    an object replaced mid-download fails instead of mixing two versions. A
    connection cut mid-part resumes that part where it stopped.
    """

    def __init__(self, entry: Weights, options: FetchOptions) -> None:
        super().__init__(entry, options)
        uri = urlparse(entry.source)
        self.bucket = uri.netloc
        self.prefix = uri.path.lstrip("/")
        if not self.bucket:
            raise self.error("no bucket in the URI (expected s3://bucket/prefix)")
        self._client: Any = None
        self._local = threading.local()

    @property
    def endpoint(self) -> str:
        return self.options.s3_endpoint_url or "https://s3.amazonaws.com"

    def _make_client(self) -> Any:
        import urllib3
        from minio import Minio
        from minio.credentials.providers import (
            AWSConfigProvider,
            ChainedProvider,
            EnvAWSProvider,
            IamAwsProvider,
            StaticProvider,
        )

        o = self.options
        endpoint = urlparse(self.endpoint)
        if o.s3_access_key_id and o.s3_secret_access_key:
            credentials: Any = StaticProvider(
                o.s3_access_key_id, o.s3_secret_access_key, o.s3_session_token
            )
        else:  # the AWS variables, then a profile, then the pod's or instance's role
            credentials = ChainedProvider([EnvAWSProvider(), AWSConfigProvider(), IamAwsProvider()])
        http = urllib3.PoolManager(
            maxsize=max(10, o.concurrency),
            timeout=urllib3.Timeout(connect=10, read=60),
            # connection errors and 5xx are retried here; a cut mid-body is
            # resumed by _fetch_range
            retries=urllib3.Retry(
                total=3, backoff_factor=0.2, status_forcelist=[500, 502, 503, 504]
            ),
        )
        return Minio(
            endpoint.netloc or endpoint.path,
            secure=endpoint.scheme != "http",
            region=o.s3_region or "us-east-1",
            credentials=credentials,
            http_client=http,
        )

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = self._make_client()
        return self._client

    def _explain(self, exc: Exception) -> ModelSourceError:
        from minio.error import S3Error

        if isinstance(exc, ModelSourceError):
            return exc
        if isinstance(exc, S3Error):
            reasons = {
                "NoSuchBucket": f"bucket {self.bucket!r} does not exist",
                "NoSuchKey": "no such object",
                "InvalidAccessKeyId": "the access key is not known to the store (credentials)",
                "SignatureDoesNotMatch": "the secret key is wrong (credentials)",
                "AccessDenied": "access denied (credentials or bucket policy)",
                "PreconditionFailed": "the object changed while it was being downloaded",
            }
            reason = reasons.get(exc.code or "", f"{exc.code}: {exc.message}")
            return self.error(f"{reason} [{self.endpoint}]")
        if isinstance(exc, ValueError):  # minio's own checks of names and credentials
            return self.error(str(exc))
        return SourceUnreachable(
            f"model {self.entry.id!r}: {self.uri}: cannot reach {self.endpoint}: "
            f"{type(exc).__name__}: {exc}"
        )

    def snapshot(self) -> Snapshot:
        from minio.error import S3Error

        try:
            files: list[RemoteFile] = []
            denied: S3Error | None = None
            if self.prefix and not self.prefix.endswith("/"):
                try:  # the URI names one object
                    stat = self.client.stat_object(self.bucket, self.prefix)
                    name = self.prefix.rsplit("/", 1)[-1]
                    files.append(RemoteFile(name, int(stat.size), self.prefix, stat.etag or ""))
                except S3Error as exc:
                    # A HEAD answer has no body: a 403 may be bad credentials or
                    # a prefix; listing says which, precisely.
                    if exc.code not in ("NoSuchKey", "NoSuchObject", "AccessDenied"):
                        raise
                    denied = exc if exc.code == "AccessDenied" else None
            if not files:
                folder = self.prefix.rstrip("/") + "/" if self.prefix else ""
                for obj in self.client.list_objects(self.bucket, prefix=folder, recursive=True):
                    if obj.is_dir or obj.object_name.endswith("/"):
                        continue
                    key = obj.object_name
                    if not key.startswith(folder):  # the store listed what was not asked
                        raise self.error(f"object key {key!r} is not under {folder!r}")
                    name = key[len(folder) :]
                    files.append(RemoteFile(name, int(obj.size), key, obj.etag or ""))
                if not files and denied is not None:
                    raise denied
        except Exception as exc:
            raise self._explain(exc) from exc
        if not files:
            raise self.error(f"no objects under {self.prefix or '/'!r} [{self.endpoint}]")
        for remote in files:  # before anything is written: a bad key fails the listing
            self._checked_name(remote)
        files.sort(key=lambda f: f.key)
        listing = "\n".join(f"{f.key} {f.etag} {f.size}" for f in files)
        return Snapshot(revision=hashlib.sha256(listing.encode()).hexdigest()[:16], files=files)

    def _checked_name(self, remote: RemoteFile) -> list[str]:
        """The segments of the object's path inside the model folder, or a clear error.

        An object key is the store's text, not a trusted path: an absolute name
        (a key with ``//`` after the prefix), an empty, ``.`` or ``..`` segment
        could put a file anywhere, so the listing is refused instead.
        """
        reason = _unsafe_name(remote.name)
        if reason is not None:
            raise self.error(
                f"object key {remote.key!r} is not a file name inside the model folder "
                f"({reason}); refusing to fetch"
            )
        return remote.name.split("/")

    def _create(self, root: int, remote: RemoteFile) -> int:
        """Open the object's file for writing, inside the folder ``root`` (a descriptor).

        Every folder on the way is opened relative to the one above it and
        none of them, nor the file, may be a symbolic link: what a listing or
        a planted link names is never written outside the entry.
        """
        *folders, file_name = self._checked_name(remote)
        where = os.dup(root)
        try:
            for folder in folders:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(folder, 0o755, dir_fd=where)
                inner = os.open(
                    folder,
                    os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                    dir_fd=where,
                )
                os.close(where)
                where = inner
            return os.open(
                file_name,
                os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o644,
                dir_fd=where,
            )
        except OSError as exc:
            raise self.error(
                f"object key {remote.key!r}: cannot write {remote.name!r} inside the model "
                f"folder ({_why(exc)}); refusing to fetch"
            ) from None
        finally:
            os.close(where)

    def fetch(self, snapshot: Snapshot, dest: Path, progress: ProgressFn) -> FileDigests:
        for remote in snapshot.files:  # all of them, before the first byte is written
            self._checked_name(remote)
        counter = _ByteCounter(snapshot.size, progress)
        abort = threading.Event()
        fds: list[int] = []
        root = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            jobs: list[tuple[RemoteFile, int, int, int]] = []
            for remote in snapshot.files:
                fd = self._create(root, remote)
                fds.append(fd)
                os.ftruncate(fd, remote.size)
                for start in range(0, remote.size, self.options.part_bytes):
                    end = min(start + self.options.part_bytes, remote.size)
                    jobs.append((remote, fd, start, end))
            with ThreadPoolExecutor(self.options.concurrency, "s3-fetch") as pool:
                futures: list[Future[str]] = [
                    pool.submit(self._fetch_range, remote, fd, start, end, counter, abort)
                    for remote, fd, start, end in jobs
                ]
                done, _ = wait(futures, return_when=FIRST_EXCEPTION)
                failed = [f for f in done if f.exception() is not None]
                if failed:
                    abort.set()
                    pool.shutdown(wait=True, cancel_futures=True)
                    exc = failed[0].exception()
                    if not isinstance(exc, Exception):  # KeyboardInterrupt and the like
                        raise exc  # type: ignore[misc]
                    raise self._explain(exc) from exc
        finally:
            for fd in fds:
                os.close(fd)
            os.close(root)
        counter.finish()
        # each part hashed as it arrived, in its own thread: no second read
        digests: FileDigests = {
            r.name: {"size": r.size, "part_bytes": self.options.part_bytes, "part_sha256": []}
            for r in snapshot.files
        }
        for (remote, _fd, _start, _end), future in zip(jobs, futures, strict=True):
            digests[remote.name]["part_sha256"].append(future.result())
        return digests

    def _fetch_range(
        self,
        remote: RemoteFile,
        fd: int,
        start: int,
        end: int,
        counter: _ByteCounter,
        abort: threading.Event,
    ) -> str:
        """Write bytes ``start..end`` of one object at their offset; their sha256."""
        from minio.error import S3Error

        buffer = getattr(self._local, "buffer", None)
        if buffer is None:
            buffer = self._local.buffer = memoryview(bytearray(1 << 20))
        pos = start
        digest = hashlib.sha256()
        for attempt in range(1, self.options.attempts + 1):
            response = None
            try:
                headers = {"If-Match": remote.etag} if remote.etag else None
                response = self.client.get_object(
                    self.bucket,
                    remote.key,
                    offset=pos,
                    length=end - pos,
                    request_headers=headers,
                )
                while pos < end and not abort.is_set():
                    n = response.readinto(buffer[: min(len(buffer), end - pos)])
                    if not n:
                        raise ConnectionError(f"{remote.key}: body ended at byte {pos} of {end}")
                    os.pwrite(fd, buffer[:n], pos)
                    digest.update(buffer[:n])
                    pos += n
                    counter.add(n)
                return digest.hexdigest()
            except S3Error:
                raise
            except Exception as exc:  # a cut connection: resume where the bytes stopped
                if abort.is_set():
                    return ""
                if attempt == self.options.attempts:
                    raise ConnectionError(
                        f"{remote.key}: connection lost {attempt} times, last at byte {pos} "
                        f"({type(exc).__name__}: {exc})"
                    ) from exc
                time.sleep(min(2.0, 0.1 * 2**attempt))
            finally:
                if response is not None:
                    response.close()
                    response.release_conn()
        raise AssertionError("unreachable: the last attempt returns or raises")


def _unsafe_name(name: str) -> str | None:
    """Why ``name`` is not a plain relative path inside a folder (None: it is)."""
    if not name:
        return "an empty name"
    if name.startswith("/"):
        return "an absolute path"
    if "\0" in name:
        return "a NUL character"
    for segment in name.split("/"):
        if segment == "":
            return "an empty path segment"
        if segment in (".", ".."):
            return f"a {segment!r} path segment"
    return None


def _why(exc: OSError) -> str:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EEXIST):
        return "a symbolic link or another file is in the way"
    return exc.strerror or type(exc).__name__


class _ByteCounter:
    """Bytes done across threads, reported at most ~10 times a second."""

    def __init__(self, total: int | None, progress: ProgressFn, phase: str = "fetch") -> None:
        self.total = total
        self.done = 0
        self.progress = progress
        self.phase = phase
        self._lock = threading.Lock()
        self._shown = 0.0
        progress(phase, 0, total)

    def add(self, n: int) -> None:
        with self._lock:
            self.done += n
            now = time.monotonic()
            if now - self._shown < 0.1:
                return
            self._shown = now
            done = self.done
        self.progress(self.phase, done, self.total)

    def finish(self) -> None:
        self.progress(self.phase, self.done, self.total)


# -- Hugging Face hub -------------------------------------------------------

_HF_URI = re.compile(r"^(?P<repo>[^/@]+/[^/@]+)(?:@(?P<rev>[^/]+))?(?:/(?P<file>.+))?$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
# Weights in another format than safetensors are not what vLLM needs here.
_SKIP_WITH_SAFETENSORS = (".bin", ".pt", ".pth", ".h5", ".msgpack", ".onnx", ".ot", ".gguf")


class HuggingFaceSource(Source):
    """``hf://org/name[@revision][/file]`` through ``huggingface_hub``.

    The revision (branch, tag or commit) is resolved to its commit first; the
    cache entry is keyed by that commit. Offline (``HF_HUB_OFFLINE``), a
    commit can still be served from the cache; a branch is served from the
    newest cached entry of the same URI (see ``modelprep``).
    """

    def __init__(self, entry: Weights, options: FetchOptions) -> None:
        super().__init__(entry, options)
        uri = urlparse(entry.source)
        match = _HF_URI.match(f"{uri.netloc}{uri.path}".rstrip("/"))
        if match is None:
            raise self.error("expected hf://org/name[@revision][/file]")
        self.repo = match["repo"]
        self.revision = match["rev"] or "main"
        self.file = match["file"]

    @property
    def name(self) -> str:
        return Path(self.file).name if self.file else self.repo.split("/")[1]

    @property
    def pinned(self) -> str | None:
        """The commit the URI names, if it names one."""
        return self.revision if _COMMIT.match(self.revision) else None

    def _api(self) -> Any:
        from huggingface_hub import HfApi

        return HfApi(endpoint=self.options.hf_endpoint, token=self.options.hf_token or False)

    def _explain(self, exc: Exception) -> ModelSourceError:
        from huggingface_hub import errors

        where = self.options.hf_endpoint or "the Hugging Face hub"
        if isinstance(exc, ModelSourceError):
            return exc
        if isinstance(exc, errors.GatedRepoError):
            return self.error(f"repository {self.repo!r} is gated: its terms need accepting")
        if isinstance(exc, errors.RepositoryNotFoundError):
            return self.error(
                f"repository {self.repo!r} not found at {where} (or HF_TOKEN may not read it)"
            )
        if isinstance(exc, errors.RevisionNotFoundError):
            return self.error(f"revision {self.revision!r} not found in {self.repo!r}")
        if isinstance(exc, errors.EntryNotFoundError):
            return self.error(f"file {self.file!r} not found in {self.repo}@{self.revision}")
        if isinstance(exc, errors.HfHubHTTPError):
            return self.error(f"{where} answered {exc}")
        if isinstance(exc, errors.OfflineModeIsEnabled):
            return SourceOffline(f"model {self.entry.id!r}: {self.uri}: HF_HUB_OFFLINE is set")
        return SourceUnreachable(
            f"model {self.entry.id!r}: {self.uri}: cannot reach {where}: "
            f"{type(exc).__name__}: {exc}"
        )

    def snapshot(self) -> Snapshot:
        if self.options.hf_offline:
            raise SourceOffline(
                f"model {self.entry.id!r}: {self.uri}: HF_HUB_OFFLINE is set and the model "
                "is not in the cache"
            )
        try:
            info = self._api().model_info(self.repo, revision=self.revision, files_metadata=True)
        except Exception as exc:
            raise self._explain(exc) from exc
        siblings = {s.rfilename: int(s.size or 0) for s in info.siblings or []}
        if self.file is not None:
            if self.file not in siblings:
                raise self.error(f"file {self.file!r} not found in {self.repo}@{self.revision}")
            names = [self.file]
        else:
            names = sorted(siblings)
            if any(n.endswith(".safetensors") for n in names):
                names = [n for n in names if not n.endswith(_SKIP_WITH_SAFETENSORS)]
        files = [RemoteFile(Path(n).name if self.file else n, siblings[n], n) for n in names]
        for remote in files:  # the hub's names become paths in the cache entry
            reason = _unsafe_name(remote.name)
            if reason is not None:
                raise self.error(
                    f"file {remote.key!r} is not a file name inside the model folder ({reason})"
                )
        return Snapshot(revision=str(info.sha), files=files)

    def fetch(self, snapshot: Snapshot, dest: Path, progress: ProgressFn) -> FileDigests:
        from huggingface_hub import snapshot_download
        from huggingface_hub.utils.tqdm import disable_progress_bars

        disable_progress_bars()  # progress is reported through ``progress``, as bytes
        with FolderWatch(dest, snapshot.size, progress):
            try:
                snapshot_download(
                    self.repo,
                    revision=snapshot.revision,
                    local_dir=dest,
                    allow_patterns=[f.key for f in snapshot.files],
                    endpoint=self.options.hf_endpoint,
                    token=self.options.hf_token or False,
                    max_workers=self.options.concurrency,
                )
            except Exception as exc:
                raise self._explain(exc) from exc
        if self.file is not None and "/" in self.file:  # one file: keep it at the top
            os.replace(dest / self.file, dest / Path(self.file).name)
        # the client's own bookkeeping, not model files
        shutil.rmtree(dest / ".cache", ignore_errors=True)
        for remote in snapshot.files:
            path = dest / remote.name
            if not path.is_file() or path.stat().st_size != remote.size:
                raise self.error(f"{remote.key}: downloaded size differs from the hub's listing")
        return {}


class FolderWatch:
    """Report the bytes under a folder every half second (for work without progress hooks)."""

    def __init__(
        self, folder: Path, total: int | None, progress: ProgressFn, phase: str = "fetch"
    ) -> None:
        self.folder = folder
        self.counter = _ByteCounter(total, progress, phase)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fetch-progress", daemon=True)

    def _size(self) -> int:
        return sum(p.stat().st_size for p in _files(self.folder))

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self.counter.progress(self.counter.phase, self._size(), self.counter.total)

    def __enter__(self) -> FolderWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        if exc[0] is None:
            done = self._size() if self.counter.total is None else self.counter.total
            self.counter.progress(self.counter.phase, done, self.counter.total)


def _files(folder: Path) -> Iterator[Path]:
    for root, _dirs, names in os.walk(folder):
        for name in names:
            path = Path(root) / name
            if path.is_file():
                yield path


# -- dispatch ---------------------------------------------------------------


def open_source(entry: Weights, options: FetchOptions | None = None) -> Source:
    """The adapter for ``entry.source`` (by its URI scheme)."""
    options = options or FetchOptions()
    uri = urlparse(entry.source)
    if uri.scheme == "file":
        return LocalSource(entry, options, Path(uri.path))
    if uri.scheme == "package":
        return LocalSource(entry, options, _package_path(entry, uri.netloc, uri.path))
    if uri.scheme == "s3":
        return S3Source(entry, options)
    if uri.scheme == "hf":
        return HuggingFaceSource(entry, options)
    raise ModelSourceError(
        f"model {entry.id!r}: {entry.source}: unknown source scheme {uri.scheme!r} "
        "(file, package, s3 or hf)"
    )
