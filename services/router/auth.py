"""API-key checks on the hot path, from an in-memory mirror of the whitelist.

The mirror watches the KV buckets ``tg_keys`` and ``tg_signing_keys``; a check
is a signature verification and a dict lookup, with no network call. Until
both buckets are loaded the router is not ready, so no call gets through on a
half-loaded whitelist.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from nats.aio.client import Client as NATS

from services.router.errors import ModelNotFound, QuotaExceeded, TollgateError
from tollgate.keys.records import KeyRecord, KeyState, SigningKey
from tollgate.keys.store import KeyStore
from tollgate.keys.tokens import InvalidToken, TokenVerifier, strip_prefix
from tollgate.models.catalog import ModelEntry
from tollgate.wire.topology import Role, Topology

log = logging.getLogger("tollgate.router.auth")


class InvalidApiKey(TollgateError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


@dataclass(frozen=True)
class Principal:
    key_id: str
    tenant: str
    record: KeyRecord


def _token(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    api_key = request.headers.get("api-key", "").strip()  # Azure-style clients
    return api_key or None


class KeyMirror:
    def __init__(self, hs256_secrets: dict[str, str] | None = None) -> None:
        self.records: dict[str, KeyRecord] = {}
        self.verifier = TokenVerifier(hs256_secrets)
        self._synced = {"keys": asyncio.Event(), "signing": asyncio.Event()}
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def ready(self) -> bool:
        return all(event.is_set() for event in self._synced.values())

    async def start(self, nc: NATS, topology: Topology) -> None:
        store = await KeyStore(nc.jetstream(), topology, role=Role.ROUTER).open()
        self._tasks = [
            asyncio.create_task(self._watch(nc, store.keys, "keys", self._apply_key)),
            asyncio.create_task(self._watch(nc, store.signing, "signing", self._apply_signing)),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _watch(
        self, nc: NATS, kv: Any, name: str, apply: Callable[[str, bytes | None], None]
    ) -> None:
        """Mirror one bucket; after every reconnect, watch it again from the start.

        A watch is an ephemeral consumer that a NATS restart deletes, and
        nats.py's ordered consumer does not always recover it (its activity
        check stops at the first failed reset), so a new watch is started
        instead. Replaying the bucket is idempotent: the latest value of every
        key, and delete markers for removed keys.
        """
        while True:
            reconnects = nc.stats["reconnects"]
            follow = asyncio.create_task(self._follow(kv, name, apply))
            try:
                while not follow.done() and nc.stats["reconnects"] == reconnects:
                    await asyncio.wait({follow}, timeout=0.5)
            finally:
                follow.cancel()
                await asyncio.gather(follow, return_exceptions=True)
            if nc.stats["reconnects"] != reconnects:
                log.info("NATS reconnected: watching %s again", name)

    async def wait_synced(self, timeout: float) -> bool:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                for event in self._synced.values():
                    await event.wait()
        return self.ready

    async def _follow(self, kv: Any, name: str, apply: Callable[[str, bytes | None], None]) -> None:
        while True:
            try:
                watcher = await kv.watchall()
                async for entry in watcher:
                    if entry is None:  # the initial values are all in
                        self._synced[name].set()
                        continue
                    deleted = entry.operation in ("DEL", "PURGE")
                    apply(entry.key, None if deleted else entry.value)
                    if entry.delta == 0:
                        self._synced[name].set()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # NATS restarting: watch again from the start
                log.warning("watch of %s failed: %s: %s", name, type(exc).__name__, exc)
                await asyncio.sleep(0.5)

    def _apply_key(self, key: str, value: bytes | None) -> None:
        if value is None:
            self.records.pop(key, None)
            return
        try:
            self.records[key] = KeyRecord.model_validate_json(value)
        except ValueError:
            log.error("malformed key record ignored", extra={"key_id": key})

    def _apply_signing(self, kid: str, value: bytes | None) -> None:
        if value is None:
            self.verifier.remove(kid)
            return
        try:
            self.verifier.set_key(SigningKey.model_validate_json(value))
        except ValueError:
            log.error("malformed signing key ignored", extra={"kid": kid})

    # -- the hot path ------------------------------------------------------

    def authenticate(self, request: web.Request) -> Principal:
        token = _token(request)
        if token is None:
            raise InvalidApiKey(
                "You didn't provide an API key. Provide it in the Authorization header "
                "(Authorization: Bearer YOUR_KEY)."
            )
        try:
            claims = self.verifier.verify(strip_prefix(token))
        except InvalidToken:
            raise self._incorrect() from None
        record = self.records.get(str(claims["jti"]))
        if record is None or record.tenant != claims["sub"]:
            raise self._incorrect()
        if record.state is KeyState.OVER_BUDGET:
            raise QuotaExceeded(
                "You exceeded your current quota: this key's token budget is spent "
                f"for this {record.budget_period or 'period'}."
            )
        if not record.usable(time.time()):
            raise self._incorrect()
        return Principal(record.key_id, record.tenant, record)

    @staticmethod
    def _incorrect() -> InvalidApiKey:
        return InvalidApiKey("Incorrect API key provided.")

    @staticmethod
    def authorize(principal: Principal, entry: ModelEntry, requested: str) -> None:
        """A model the key may not use is reported as not found, as OpenAI does."""
        if not principal.record.allows(entry.names):
            raise ModelNotFound(requested)
