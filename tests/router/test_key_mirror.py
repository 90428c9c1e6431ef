"""The router's whitelist mirror, in process: signing-key retirement and staleness.

A router runs in this process under a subject prefix of its own, with auth on,
against the session's nats-server; the test writes signing keys and key
records into that prefix's buckets as the auth service would.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client as NATS

from services.router.appkeys import KEYS, METRICS
from services.router.auth import KeyMirror
from tests.conftest import NatsServer
from tests.router.test_lifecycle import OpenRouter, Router
from tests.router.test_lifecycle import open_router as open_router
from tollgate.keys.records import Algorithm
from tollgate.keys.store import KeyStore
from tollgate.keys.tokens import SigningKeySet, new_key
from tollgate.wire.topology import Topology


class Keys:
    """The auth service's side of one prefix: signing keys and whitelist records."""

    def __init__(self, nc: NATS, store: KeyStore, signing: SigningKeySet) -> None:
        self.nc = nc
        self.store = store
        self.signing = signing

    async def publish_current(self) -> str:
        kid = self.signing.current
        assert kid is not None
        await self.store.publish_signing_key(self.signing.public(kid))
        return kid

    async def retire(self, kid: str) -> None:
        key = self.signing.public(kid)
        key.retired = True
        await self.store.publish_signing_key(key, "retire")

    async def issue(self, **limits: Any) -> tuple[str, str]:
        token, record = new_key(self.signing, tenant="t1", **limits)
        await self.store.put(record)
        return token, record.key_id


OpenKeys = Callable[[Router, SigningKeySet], Awaitable[Keys]]


@pytest.fixture
async def open_keys(nats_server: NatsServer) -> AsyncIterator[OpenKeys]:
    opened: list[NATS] = []

    async def open_(router: Router, signing: SigningKeySet) -> Keys:
        nc = await nats_server.connect(name="test-key-mirror")
        opened.append(nc)
        store = await KeyStore(nc.jetstream(), Topology(router.subjects)).open()
        return Keys(nc, store, signing)

    yield open_
    for nc in opened:
        await nc.close()


async def status_of(router: Router, token: str) -> tuple[int, dict[str, Any]]:
    r = await router.http.get("/v1/models", headers={"Authorization": f"Bearer {token}"})
    return r.status, await r.json()


async def wait_for(check: Callable[[], Awaitable[bool]], timeout: float = 15) -> float:
    start = time.monotonic()
    while not await check():
        assert time.monotonic() - start < timeout, "condition never held"
        await asyncio.sleep(0.02)
    return time.monotonic() - start


async def wait_status(router: Router, token: str, status: int, timeout: float = 15) -> None:
    async def check() -> bool:
        return (await status_of(router, token))[0] == status

    await wait_for(check, timeout)


def signing_keys(tmp_path: Path, alg: Algorithm) -> SigningKeySet:
    signing = SigningKeySet(tmp_path / "signing-keys.json")
    signing.generate(alg)
    return signing


# -- item: retiring a signing key refuses its tokens, whatever the algorithm ----------


@pytest.mark.parametrize("alg", ["HS256", "RS256", "EdDSA"])
@pytest.mark.parametrize("how", ["retired", "deleted"])
async def test_a_token_of_a_retired_or_absent_signing_key_is_refused(
    open_router: OpenRouter, open_keys: OpenKeys, tmp_path: Path, alg: Algorithm, how: str
) -> None:
    # The router gets the HS256 secret from its settings, as deployed; it must
    # still follow the signing-key record in the bucket.
    signing = signing_keys(tmp_path, alg)
    kid = signing.current
    signing.generate(alg)  # a newer signing key, so that the old one may be retired
    newest = signing.current
    assert kid is not None and newest is not None
    router = await open_router(auth=True, hs256_secrets=signing.hs256_secrets())
    keys = await open_keys(router, signing)
    for current in (kid, newest):
        signing.current = current
        await keys.publish_current()
    signing.current = kid
    token, _ = await keys.issue()
    signing.current = newest
    newer, _ = await keys.issue()
    await wait_status(router, token, 200)
    await wait_status(router, newer, 200)

    if how == "retired":
        await keys.retire(kid)
    else:
        await keys.store.signing.delete(kid)
    await wait_status(router, token, 401)
    status, body = await status_of(router, token)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert (await status_of(router, newer))[0] == 200  # the live key still verifies


async def test_an_hs256_secret_without_a_signing_key_record_verifies_nothing(
    open_router: OpenRouter, open_keys: OpenKeys, tmp_path: Path
) -> None:
    signing = signing_keys(tmp_path, "HS256")
    router = await open_router(auth=True, hs256_secrets=signing.hs256_secrets())
    keys = await open_keys(router, signing)
    token, _ = await keys.issue()  # whitelisted, but its kid was never published
    await asyncio.sleep(0.3)
    assert (await status_of(router, token))[0] == 401
    await keys.publish_current()
    await wait_status(router, token, 200)


# -- item: a stalled watch is noticed, refused and restarted ------------------------


async def readyz(router: Router) -> tuple[int, dict[str, Any]]:
    r = await router.http.get("/readyz")
    return r.status, await r.json()


def gauge(router: Router, name: str) -> float:
    value = router.app[METRICS].registry.get_sample_value(name)
    assert value is not None, name
    return value


async def test_a_stalled_whitelist_watch_makes_the_router_unready_and_refuse_then_recover(
    open_router: OpenRouter, open_keys: OpenKeys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    router = await open_router(auth=True, whitelist_max_lag_s=1.0)
    keys = await open_keys(router, signing_keys(tmp_path, "EdDSA"))
    await keys.publish_current()
    token, key_id = await keys.issue()
    await wait_status(router, token, 200)
    assert (await readyz(router))[0] == 200
    assert gauge(router, "tollgate_router_whitelist_stale") == 0

    # The watch stalls: it stops applying what the bucket delivers, with no
    # reconnect to restart it. Then the key is revoked. First a lag check has
    # seen the mirror current: one that ran while the key's issue was on its
    # way would date the lag from then, before the revoke.
    mirror: KeyMirror = router.app[KEYS]

    async def current() -> bool:
        return mirror.lag_s == 0

    await wait_for(current)
    monkeypatch.setattr(mirror, "_receive", lambda *args: None, raising=False)
    revoked_at = time.monotonic()
    assert await keys.store.revoke(key_id) is not None

    async def refused() -> bool:
        status, body = await status_of(router, token)
        return status == 503 and body["error"]["code"] == "whitelist_stale"

    await wait_for(refused)
    took = time.monotonic() - revoked_at
    assert 1.0 <= took < 5, took  # past the bound, and not long after it
    status, body = await readyz(router)
    assert status == 503 and body["checks"]["keys"] is False, body
    assert gauge(router, "tollgate_router_whitelist_stale") == 1
    assert gauge(router, "tollgate_router_whitelist_lag_seconds") > 1.0
    r = await router.post(max_tokens=1)  # a call is refused too, OpenAI-shaped
    assert r.status == 503 and r.headers["Retry-After"]
    error = (await r.json())["error"]
    assert error["type"] == "service_unavailable" and error["code"] == "whitelist_stale"

    # The stall ends; the watch is started again, replays the bucket and the
    # revocation lands.
    monkeypatch.undo()

    async def ready() -> bool:
        return (await readyz(router))[0] == 200

    await wait_for(ready)
    assert (await status_of(router, token))[0] == 401
    assert gauge(router, "tollgate_router_whitelist_stale") == 0
    assert gauge(router, "tollgate_router_whitelist_lag_seconds") == 0


async def test_a_current_mirror_stays_ready_through_key_changes(
    open_router: OpenRouter, open_keys: OpenKeys, tmp_path: Path
) -> None:
    router = await open_router(auth=True, whitelist_max_lag_s=0.5)
    keys = await open_keys(router, signing_keys(tmp_path, "EdDSA"))
    await keys.publish_current()
    for _ in range(5):
        token, key_id = await keys.issue()
        await wait_status(router, token, 200)
        await keys.store.revoke(key_id)
        await wait_status(router, token, 401)
    await asyncio.sleep(1.0)  # several lag checks
    assert (await readyz(router))[0] == 200
    assert gauge(router, "tollgate_router_whitelist_stale") == 0
