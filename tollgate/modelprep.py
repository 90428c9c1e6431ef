"""Model preparation and the local model cache.

Sources: ``package://<python-package>/<file>`` (a file shipped inside an
installed package) and ``file:///path`` (a safetensors folder or a ``.gguf``
file). A folder is used where it is. A GGUF file is converted once to a
safetensors folder in the cache: written to a temporary folder, given a
manifest (every file's size and sha256), then renamed in, under a file lock
so that concurrent workers convert it only once.

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
import importlib.util
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO
from urllib.parse import urlparse

from tollgate.catalog import ModelEntry
from tollgate.subjects import model_token

log = logging.getLogger("tollgate.modelprep")

MANIFEST = "tollgate-manifest.json"
_USED = ".tollgate-last-used"


class EntryInUse(Exception):
    """A cache entry that a running worker holds cannot be removed."""


class ModelSourceError(Exception):
    """The source of a model cannot be resolved or prepared."""


def resolve_source(entry: ModelEntry) -> Path:
    """The local path a source points at (before any conversion)."""
    uri = urlparse(entry.source)
    if uri.scheme == "package":
        spec = importlib.util.find_spec(uri.netloc)
        # find_spec does not import the package, so a package whose
        # __init__ needs other software still serves as a file carrier.
        if spec is None or not spec.submodule_search_locations:
            raise ModelSourceError(
                f"model {entry.id!r}: package {uri.netloc!r} of source {entry.source!r} "
                "is not installed"
            )
        path = Path(next(iter(spec.submodule_search_locations))) / uri.path.lstrip("/")
    elif uri.scheme == "file":
        path = Path(uri.path)
    else:
        raise ModelSourceError(
            f"model {entry.id!r}: source scheme {uri.scheme!r} of {entry.source!r} is not supported"
        )
    if not path.exists():
        raise ModelSourceError(f"model {entry.id!r}: {entry.source!r} does not exist")
    return path


def _cache_key(entry: ModelEntry, path: Path) -> str:
    stat = path.stat()
    digest = hashlib.sha256(f"{entry.source}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    return f"{model_token(path.stem)}-{digest.hexdigest()[:12]}"


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


def write_manifest(folder: Path, source: str) -> dict[str, object]:
    """Record every file's size and sha256 (the entry is complete once this exists)."""
    files = {
        str(p.relative_to(folder)): {"size": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name not in (MANIFEST, _USED)
    }
    manifest: dict[str, object] = {"source": source, "created_at": time.time(), "files": files}
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
        elif full and _sha256(path) != meta["sha256"]:
            problems.append(f"{name}: sha256 differs from the manifest")
    return problems


@dataclass
class CacheEntry:
    path: Path
    source: str
    size: int
    last_used: float
    in_use: bool


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
    entry: ModelEntry,
    cache_dir: Path,
    *,
    budget_bytes: int | None = None,
    timings: dict[str, float] | None = None,
) -> Path:
    """Return a folder with safetensors weights and tokenizer for ``entry``."""
    path = resolve_source(entry)
    if path.is_dir():
        return path
    if path.suffix != ".gguf":
        raise ModelSourceError(f"model {entry.id!r}: {path.name} is not a folder or .gguf")
    target = cache_dir / _cache_key(entry, path)
    if not check_entry(target):
        _touch(target)
        return target
    with _locked(cache_dir / f"{target.name}.lock"):
        problems = check_entry(target)
        if not problems:  # another process finished it meanwhile
            _touch(target)
            return target
        if target.exists():
            log.warning(
                "cached model is incomplete or corrupt; preparing it again",
                extra={"model": entry.id, "problems": problems[:5]},
            )
        tmp = cache_dir / f".tmp-{target.name}-{uuid.uuid4().hex[:8]}"
        started = time.monotonic()
        try:
            _convert_gguf(path, tmp)
            write_manifest(tmp, entry.source)
            if target.exists():
                shutil.rmtree(target)
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        seconds = round(time.monotonic() - started, 2)
        if timings is not None:
            timings["convert"] = seconds
        log.info("prepared model", extra={"model": entry.id, "seconds": seconds})
        _touch(target)
    if budget_bytes:
        evict(cache_dir, budget_bytes, keep=target)
    return target


def entries_for(entry: ModelEntry, cache_dir: Path) -> list[CacheEntry]:
    """The cache entries prepared from a catalog model's source."""
    return [e for e in cache_entries(cache_dir) if e.source == entry.source]


def _touch(folder: Path) -> None:
    with contextlib.suppress(OSError):
        (folder / _USED).touch()


def _convert_gguf(gguf: Path, out: Path) -> None:
    """De-quantise a GGUF checkpoint into a bfloat16 safetensors folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16
    )
    # The GGUF quantizer cannot serialise; the de-quantised weights are plain.
    setattr(model, "hf_quantizer", None)  # noqa: B010 - typed as a module by torch
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.mkdir(parents=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
