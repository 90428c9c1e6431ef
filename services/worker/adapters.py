"""The LoRA adapters of a worker's model: prepared and loaded into the engine on first use.

A call that names an adapter reaches its base model's workers with
``InferenceRequest.adapter`` set. The first such call on a worker fetches the
adapter's files through the model cache (cached and verified like any
model's weights), then has the engine load it; later calls find it loaded.
Calls for one adapter that arrive while it loads wait for that one load.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import IO

from services.worker.engine import ErrorResult
from tollgate.models.cache import hold_entry
from tollgate.models.catalog import AdapterEntry
from tollgate.wire.errors import error_json

log = logging.getLogger("tollgate.worker")

# Fetch (and verify) an adapter's files; blocking, so it runs in a thread.
Prepare = Callable[[AdapterEntry], Path]
# Load prepared files into the engine under the adapter's id; an ErrorResult if it
# refuses (its message may name local paths: it is logged, never relayed).
Load = Callable[[str, Path], Awaitable[ErrorResult | None]]


class Adapters:
    def __init__(self, model_id: str, adapters: list[AdapterEntry], prepare: Prepare) -> None:
        self.model_id = model_id
        self._known = {a.id: a for a in adapters if a.base == model_id}
        self._prepare = prepare
        self._loaded: set[str] = set()
        self._locks: dict[str, asyncio.Lock] = {}
        self._leases: list[IO[str]] = []  # cached files in use: eviction skips them

    @property
    def enabled(self) -> bool:
        """Whether the model has adapters (its engine then runs with LoRA on)."""
        return bool(self._known)

    @property
    def loaded(self) -> set[str]:
        return set(self._loaded)

    async def ready(self, adapter_id: str, load: Load) -> ErrorResult | None:
        """Load ``adapter_id`` unless it is loaded; the error a call gets when it cannot be."""
        if adapter_id in self._loaded:
            return None
        adapter = self._known.get(adapter_id)
        if adapter is None:  # not an adapter of this worker's model
            message = f"The model `{adapter_id}` does not exist."
            return ErrorResult(error_json(message, "NotFoundError", None, 404).decode(), 404)
        lock = self._locks.setdefault(adapter_id, asyncio.Lock())
        async with lock:
            if adapter_id in self._loaded:
                return None
            try:
                path = await asyncio.to_thread(self._prepare, adapter)
            except Exception as exc:  # the detail (URIs, paths) is for operators only
                log.error(
                    "adapter files could not be prepared",
                    extra={"adapter": adapter_id, "error": f"{type(exc).__name__}: {exc}"},
                )
                return _unavailable(adapter_id)
            refused = await load(adapter_id, path)
            if refused is not None:  # the catalog's adapter does not fit its model
                log.error(
                    "the engine refused an adapter",
                    extra={"adapter": adapter_id, "status": refused.status, "body": refused.body},
                )
                message = f"The adapter `{adapter_id}` could not be loaded."
                body = error_json(message, "InternalServerError", None, 500).decode()
                return ErrorResult(body, 500)
            lease = hold_entry(path)
            if lease is not None:
                self._leases.append(lease)
            self._loaded.add(adapter_id)
            log.info("adapter loaded", extra={"adapter": adapter_id, "model": self.model_id})
        return None

    def close(self) -> None:
        for lease in self._leases:
            lease.close()
        self._leases.clear()


def _unavailable(adapter_id: str) -> ErrorResult:
    message = f"The adapter `{adapter_id}` cannot be loaded right now. Please retry later."
    return ErrorResult(error_json(message, "ServiceUnavailableError", None, 503).decode(), 503)
