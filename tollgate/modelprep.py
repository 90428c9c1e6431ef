"""Model preparation: turn a catalog ``source`` into a folder vLLM can load.

Minimal sources for now: ``package://<python-package>/<file>`` (a file shipped
inside an installed package) and ``file:///path`` (a safetensors folder or a
``.gguf`` file). A GGUF file is converted once to a safetensors folder in the
cache: written to a temporary folder, then renamed in, under a file lock so
that concurrent workers convert it only once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

from tollgate.catalog import ModelEntry
from tollgate.subjects import model_token

log = logging.getLogger("tollgate.modelprep")

_COMPLETE = ".tollgate-complete"


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


def prepare_model(entry: ModelEntry, cache_dir: Path) -> Path:
    """Return a folder with safetensors weights and tokenizer for ``entry``."""
    path = resolve_source(entry)
    if path.is_dir():
        return path
    if path.suffix != ".gguf":
        raise ModelSourceError(f"model {entry.id!r}: {path.name} is not a folder or .gguf")
    target = cache_dir / _cache_key(entry, path)
    if (target / _COMPLETE).exists():
        return target
    with _locked(cache_dir / f"{target.name}.lock"):
        if (target / _COMPLETE).exists():  # another process finished it meanwhile
            return target
        tmp = cache_dir / f".tmp-{target.name}-{uuid.uuid4().hex[:8]}"
        started = time.monotonic()
        try:
            _convert_gguf(path, tmp)
            (tmp / _COMPLETE).write_text(entry.source + "\n")
            if target.exists():  # an incomplete leftover
                shutil.rmtree(target)
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        log.info(
            "prepared model",
            extra={"model": entry.id, "seconds": round(time.monotonic() - started, 2)},
        )
    return target


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
