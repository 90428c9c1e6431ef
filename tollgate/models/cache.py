"""Model preparation and the local model cache.

A model's weights come from its source (``tollgate.models.sources``): local
folders are used where they are; remote sources (``s3://``, ``hf://``) are
fetched into the cache, keyed by source and exact revision; a GGUF file,
local or fetched, is converted once to a safetensors folder, cached as its
own entry. Every entry is built in a temporary folder, given a manifest
(every file's size and sha256) and renamed in, under a file lock, so that
concurrent workers on one host do the work once and a failure leaves no
half-written entry.

The cache checks an entry against its manifest before use (sizes on every
use; sizes and hashes with ``tollgate models verify``) and prepares a corrupt
or partial entry again. A worker holds a shared lock on the entry it serves;
with a size budget (``TOLLGATE_MODEL_CACHE_MAX_GB``) the least recently used
entries that no worker holds are evicted.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from tollgate.models.catalog import Weights
from tollgate.models.sources import (
    FetchOptions,
    FileDigests,
    FolderWatch,
    ModelSourceError,
    ProgressFn,
    Source,
    SourceOffline,
    SourceUnreachable,
    no_progress,
    open_source,
)
from tollgate.wire.subjects import model_token

__all__ = ["EntryInUse", "ModelSourceError", "prepare_model"]

log = logging.getLogger("tollgate.models.cache")

MANIFEST = "tollgate-manifest.json"
_USED = ".tollgate-last-used"


class EntryInUse(Exception):
    """A cache entry that a running worker holds cannot be removed."""


def _cache_key(name: str, identity: str) -> str:
    digest = hashlib.sha256(identity.encode()).hexdigest()[:12]
    return f"{model_token(Path(name).stem)}-{digest}"


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _part_sha256(path: Path, part_bytes: int) -> list[str]:
    digests = []
    with open(path, "rb") as fh:
        while part := fh.read(part_bytes):
            digests.append(hashlib.sha256(part).hexdigest())
    return digests


def write_manifest(
    folder: Path, source: str, known: FileDigests | None = None, **about: str
) -> dict[str, object]:
    """Record every file's size and sha256 (the entry is complete once this exists).

    Files in ``known`` keep the digests their fetch computed (sha256 per part
    of ``part_bytes``); the others are hashed whole here. ``about`` adds what
    the entry is: ``kind`` (fetched, converted) and ``revision``.
    """
    known = known or {}
    files: dict[str, dict[str, object]] = {}
    for p in sorted(folder.rglob("*")):
        if not p.is_file() or p.name in (MANIFEST, _USED):
            continue
        name, size = str(p.relative_to(folder)), p.stat().st_size
        given = known.get(name)
        if given is not None and given.get("size") == size:
            files[name] = dict(given)
        else:
            files[name] = {"size": size, "sha256": _sha256(p)}
    manifest: dict[str, object] = {
        "source": source,
        **about,
        "created_at": time.time(),
        "files": files,
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def check_entry(folder: Path, full: bool = False) -> list[str]:
    """What is wrong with a cache entry: missing or resized files, and (full) changed bytes."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return ["no manifest (incomplete entry)"]
    problems = []
    for name, meta in manifest["files"].items():
        path = folder / name
        if not path.is_file():
            problems.append(f"{name}: missing")
        elif path.stat().st_size != meta["size"]:
            problems.append(f"{name}: {path.stat().st_size} bytes, expected {meta['size']}")
        elif full and not _same_bytes(path, meta):
            problems.append(f"{name}: sha256 differs from the manifest")
    return problems


def _same_bytes(path: Path, meta: dict[str, Any]) -> bool:
    if "part_sha256" in meta:
        return bool(_part_sha256(path, int(meta["part_bytes"])) == meta["part_sha256"])
    return bool(_sha256(path) == meta["sha256"])


@dataclass
class CacheEntry:
    path: Path
    source: str
    size: int
    last_used: float
    in_use: bool
    kind: str = "converted"
    revision: str = ""


def _lease_path(folder: Path) -> Path:
    return folder.parent / f"{folder.name}.inuse"


def hold_entry(folder: Path) -> IO[str] | None:
    """A shared lock on a cache entry for as long as the returned file stays open.

    Held by a worker for its lifetime: eviction and ``models rm`` leave the entry alone.
    Returns None for a folder that is not a cache entry (a source used in place).
    """
    if not (folder / MANIFEST).exists():
        return None
    lease = open(_lease_path(folder), "a")
    fcntl.flock(lease, fcntl.LOCK_SH)
    return lease


def _in_use(folder: Path) -> bool:
    try:
        with open(_lease_path(folder), "a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(fh, fcntl.LOCK_UN)
    except BlockingIOError:
        return True
    return False


def cache_entries(cache_dir: Path) -> list[CacheEntry]:
    """Complete entries in the cache, least recently used first."""
    entries: list[CacheEntry] = []
    if not cache_dir.exists():
        return entries
    for folder in cache_dir.iterdir():
        manifest_path = folder / MANIFEST
        if not folder.is_dir() or not manifest_path.exists():
            continue
        try:
            manifest = json.loads(manifest_path.read_text())
        except ValueError:
            continue
        used = folder / _USED
        entries.append(
            CacheEntry(
                path=folder,
                source=str(manifest.get("source", "")),
                size=sum(int(f["size"]) for f in manifest["files"].values()),
                last_used=used.stat().st_mtime if used.exists() else manifest_path.stat().st_mtime,
                in_use=_in_use(folder),
                kind=str(manifest.get("kind", "converted")),
                revision=str(manifest.get("revision", "")),
            )
        )
    return sorted(entries, key=lambda e: e.last_used)


def remove_entry(folder: Path) -> None:
    """Delete a cache entry no worker holds (an exclusive lock while it goes)."""
    with open(_lease_path(folder), "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise EntryInUse(f"{folder.name} is in use by a running worker") from None
        # rename first: a reader never sees a half-deleted entry
        doomed = folder.parent / f".rm-{folder.name}-{uuid.uuid4().hex[:8]}"
        os.rename(folder, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    _lease_path(folder).unlink(missing_ok=True)


def evict(cache_dir: Path, budget_bytes: int, keep: Path | None = None) -> list[Path]:
    """Remove least recently used entries no worker holds until the cache fits the budget."""
    entries = cache_entries(cache_dir)
    total = sum(e.size for e in entries)
    removed = []
    for entry in entries:
        if total <= budget_bytes:
            break
        if entry.in_use or entry.path == keep:
            continue
        try:
            remove_entry(entry.path)
        except (EntryInUse, OSError):
            continue
        total -= entry.size
        removed.append(entry.path)
        log.info("evicted model from the cache", extra={"entry": entry.path.name})
    return removed


def prepare_model(
    entry: Weights,
    cache_dir: Path,
    *,
    options: FetchOptions | None = None,
    budget_bytes: int | None = None,
    timings: dict[str, float] | None = None,
    progress: ProgressFn = no_progress,
) -> Path:
    """Return a folder with safetensors weights and tokenizer for ``entry``.

    ``timings`` receives the seconds spent on ``fetch`` and ``convert`` (work
    actually done; a cache hit adds nothing); ``progress`` gets bytes as they
    arrive.
    """
    timings = timings if timings is not None else {}
    source = open_source(entry, options)
    local = source.local_path()
    held: IO[str] | None = None
    if local is not None:
        if local.is_dir():
            return local
        gguf = local
        key = _cache_key(local.name, f"{entry.source}|{source.snapshot().revision}")
    else:
        fetched = _fetched_entry(source, cache_dir, timings, progress)
        ggufs = sorted(p for p in fetched.iterdir() if p.suffix == ".gguf")
        if not ggufs:
            return _finish(fetched, cache_dir, budget_bytes)
        if len(ggufs) > 1:
            raise source.error(
                f"holds {len(ggufs)} .gguf files; name one in the source (…/{ggufs[0].name})"
            )
        gguf = ggufs[0]
        key = f"{fetched.name}-safetensors"
        # the fetched GGUF stays while it is converted, whatever else evicts
        held = hold_entry(fetched)
    try:
        target = _build_entry(
            cache_dir / key,
            source,
            "convert",
            lambda tmp: _convert_gguf(gguf, tmp, progress),
            timings,
        )
    finally:
        if held is not None:
            held.close()
    return _finish(target, cache_dir, budget_bytes)


def _fetched_entry(
    source: Source, cache_dir: Path, timings: dict[str, float], progress: ProgressFn
) -> Path:
    """The cache entry holding the remote files of the source's current revision."""
    try:
        snapshot = source.snapshot()
    except SourceUnreachable as exc:
        cached = _newest_cached(source, cache_dir)
        if cached is None:
            raise
        if not isinstance(exc, SourceOffline):
            log.warning(
                "model source unreachable; using the cached copy",
                extra={"model": source.entry.id, "entry": cached.name, "error": str(exc)},
            )
        return cached
    return _build_entry(
        cache_dir / _cache_key(source.name, f"{source.uri}|{snapshot.revision}"),
        source,
        "fetch",
        lambda tmp: source.fetch(snapshot, tmp, progress),
        timings,
        revision=snapshot.revision,
    )


def _newest_cached(source: Source, cache_dir: Path) -> Path | None:
    """The newest complete fetched entry of this source (the pinned revision, if any)."""
    found = [
        e
        for e in cache_entries(cache_dir)
        if e.source == source.uri
        and e.kind == "fetched"
        and (source.pinned is None or e.revision == source.pinned)
        and not check_entry(e.path)
    ]
    if not found:
        return None
    return max(found, key=lambda e: (e.path / MANIFEST).stat().st_mtime).path


def _build_entry(
    target: Path,
    source: Source,
    part: str,
    build: Callable[[Path], FileDigests | None],
    timings: dict[str, float],
    revision: str = "",
) -> Path:
    """An entry, built once: in a temporary folder, given a manifest, then renamed in."""
    if not check_entry(target):
        _touch(target)
        return target
    cache_dir = target.parent
    with _locked(cache_dir / f"{target.name}.lock"):
        problems = check_entry(target)
        if not problems:  # another process finished it meanwhile
            _touch(target)
            return target
        if target.exists():
            log.warning(
                "cached model is incomplete or corrupt; preparing it again",
                extra={"model": source.entry.id, "problems": problems[:5]},
            )
        for stale in cache_dir.glob(f".tmp-{target.name}-*"):  # left by a killed process
            shutil.rmtree(stale, ignore_errors=True)
        tmp = cache_dir / f".tmp-{target.name}-{uuid.uuid4().hex[:8]}"
        started = time.monotonic()
        try:
            tmp.mkdir(parents=True)
            known = build(tmp)
            kind = "fetched" if part == "fetch" else "converted"
            about = {"kind": kind, "revision": revision} if revision else {"kind": kind}
            write_manifest(tmp, source.uri, known, **about)
            if target.exists():
                shutil.rmtree(target)
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        seconds = round(time.monotonic() - started, 3)
        timings[part] = round(timings.get(part, 0.0) + seconds, 3)
        size = sum(f.stat().st_size for f in target.rglob("*") if f.is_file())
        log.info(
            f"model {kind}",
            extra={
                "model": source.entry.id,
                "entry": target.name,
                "bytes": size,
                "seconds": seconds,
            },
        )
        _touch(target)
    return target


def _finish(target: Path, cache_dir: Path, budget_bytes: int | None) -> Path:
    if budget_bytes:
        evict(cache_dir, budget_bytes, keep=target)
    return target


def entries_for(entry: Weights, cache_dir: Path) -> list[CacheEntry]:
    """The cache entries prepared from a catalog model's source."""
    return [e for e in cache_entries(cache_dir) if e.source == entry.source]


def _touch(folder: Path) -> None:
    with contextlib.suppress(OSError):
        (folder / _USED).touch()


def _convert_gguf(gguf: Path, out: Path, progress: ProgressFn = no_progress) -> None:
    """De-quantise a GGUF checkpoint into a bfloat16 safetensors folder."""
    progress("convert", 0, None)  # the step starts here; importing torch takes a while
    import torch
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # bfloat16 output: two bytes per weight. The watch reports the bytes written
    # with no total: the folder passes that size (tokenizer and config files
    # come on top of the weights) before the step ends, and a total reached
    # would end the progress there. The step's own end is reported after it.
    expected = 2 * sum(int(t.n_elements) for t in GGUFReader(gguf).tensors)
    with FolderWatch(out, None, progress, phase="convert"):
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16
        )
        # The GGUF quantizer cannot serialise; the de-quantised weights are plain.
        setattr(model, "hf_quantizer", None)  # noqa: B010 - typed as a module by torch
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(str(out))
        tokenizer.save_pretrained(str(out))
    progress("convert", expected, expected)
