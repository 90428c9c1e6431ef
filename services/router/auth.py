"""API-key checks on the hot path, from an in-memory mirror of the whitelist.

The mirror watches the KV buckets ``tg_keys``, ``tg_signing_keys`` and
``tg_tenants`` (tenant-wide limits); a check is a signature verification and
dict lookups, with no network call. Until
both buckets are loaded the router is not ready, so no call gets through on a
half-loaded whitelist.

A token verifies only under a signing key whose record in ``tg_signing_keys``
is present and not retired, whatever the algorithm: HS256 secrets come from
the router's settings (they never go on the bus), but a secret is used only
while its kid's record says the key is live, so retiring an HS256 key works
like retiring any other.

The mirror is only as good as its watch. Every few seconds it compares each
bucket's last sequence (the stream info of ``KV_<bucket>``) with the last one
it applied; behind for longer than ``max_lag_s`` it is stale: the router is
not ready and refuses keys (503) rather than honour a key that may have been
revoked, and the watch is started again. It recovers once it has caught up.
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

from services.router.errors import (
    InvalidRequest,
    ModelNotFound,
    PermissionDenied,
    QuotaExceeded,
    TollgateError,
)
from tollgate.keys.records import KeyRecord, KeyState, SigningKey, TenantRecord
from tollgate.keys.store import KeyStore
from tollgate.keys.tenants import TenantStore
from tollgate.keys.tokens import InvalidToken, TokenVerifier, strip_prefix
from tollgate.models.catalog import Target
from tollgate.wire.contracts import Priority
from tollgate.wire.topology import Role, Topology

log = logging.getLogger("tollgate.router.auth")


class InvalidApiKey(TollgateError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class WhitelistStale(TollgateError):
    """The whitelist mirror has fallen behind its buckets: no key can be trusted."""

    status = 503
    type = "service_unavailable"
    code = "whitelist_stale"


@dataclass(frozen=True)
class Principal:
    key_id: str
    tenant: str
    record: KeyRecord
    tenant_record: TenantRecord | None = None  # the tenant's own limits, if it has any

    @property
    def limited(self) -> bool:
        """Whether the key's or the tenant's limits apply (else no shared counter is touched)."""
        return self.record.limited or (
            self.tenant_record is not None and self.tenant_record.limited
        )

    @property
    def priced(self) -> bool:
        """Whether a budget in money (the key's or the tenant's) prices its calls."""
        return self.record.has_money_budget or (
            self.tenant_record is not None and self.tenant_record.has_money_budget
        )


PRIORITY_HEADER = "X-Tollgate-Priority"


def request_priority(record: KeyRecord | None, header: str | None) -> Priority:
    """A call's class: its key's, or the one ``X-Tollgate-Priority`` chooses.

    Any call may lower itself to ``batch``. Raising a batch key's call to
    ``interactive`` needs the key's ``priority_header`` (else a 403): the class
    is what the key was sold, and the header must not buy it up. Without a key
    (the router runs without auth) the header is taken as it is. The value is
    read without regard to case or surrounding spaces; any other value is a 400.
    """
    default = record.priority if record is not None else Priority.INTERACTIVE
    if header is None:
        return default
    try:
        chosen = Priority(header.strip().lower())
    except ValueError:
        raise InvalidRequest(
            f"Invalid value for {PRIORITY_HEADER}: it must be 'interactive' or 'batch'.",
            param=PRIORITY_HEADER,
            code="invalid_priority",
        ) from None
    if (
        chosen is Priority.INTERACTIVE
        and record is not None
        and record.priority is Priority.BATCH
        and not record.priority_header
    ):
        raise PermissionDenied(
            "This key's calls are batch calls: it may not choose interactive with "
            f"{PRIORITY_HEADER}. Ask the key's owner to allow the header, or send none."
        )
    return chosen


def _token(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    # Azure-style clients send api-key, Anthropic's SDKs x-api-key
    api_key = request.headers.get("api-key", "") or request.headers.get("x-api-key", "")
    return api_key.strip() or None


BUCKETS = ("keys", "signing", "tenants")
# A watch whose "initial values are in" marker came before the values counts as
# loaded once they are in, or at the latest this long after the marker (a value
# the server sent that nats.py does not hand on would otherwise hold it back).
INITIAL_VALUES_GRACE_S = 2.0


class KeyMirror:
    def __init__(
        self,
        hs256_secrets: dict[str, str] | None = None,
        max_lag_s: float = 10.0,
        retry_after_s: int = 5,
    ) -> None:
        self.records: dict[str, KeyRecord] = {}
        self.tenants: dict[str, TenantRecord] = {}  # by tenant name: those with limits set
        self._tenant_by_token: dict[str, str] = {}  # KV key -> tenant name
        self.signing_keys: dict[str, SigningKey] = {}  # the bucket's records, retired included
        self._hs256 = dict(hs256_secrets or {})
        # No secret verifies until its kid's signing-key record says it is live.
        self.verifier = TokenVerifier()
        self.max_lag_s = max_lag_s
        self.retry_after_s = retry_after_s
        self._synced = {name: asyncio.Event() for name in BUCKETS}
        self._restart = {name: asyncio.Event() for name in BUCKETS}
        self._applied = dict.fromkeys(BUCKETS, 0)  # last stream sequence applied
        self._floor = dict.fromkeys(BUCKETS, 0)  # covered once a new watch has loaded
        self._behind_since: dict[str, float | None] = dict.fromkeys(BUCKETS)
        self._progress_at = dict.fromkeys(BUCKETS, time.monotonic())
        self._restarted_at = dict.fromkeys(BUCKETS, 0.0)
        self.stale = False
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def ready(self) -> bool:
        return not self.stale and all(event.is_set() for event in self._synced.values())

    @property
    def lag_s(self) -> float:
        """How long the mirror has been behind its buckets (0 when current)."""
        now = time.monotonic()
        return max((now - t for t in self._behind_since.values() if t is not None), default=0.0)

    async def start(self, nc: NATS, topology: Topology) -> None:
        store = await KeyStore(nc.jetstream(), topology, role=Role.ROUTER).open()
        tenants = await TenantStore(nc.jetstream(), topology, role=Role.ROUTER).open()
        buckets = {"keys": store.keys, "signing": store.signing, "tenants": tenants.kv}
        self._tasks = [
            asyncio.create_task(self._watch(nc, store.keys, "keys", self._apply_key)),
            asyncio.create_task(self._watch(nc, store.signing, "signing", self._apply_signing)),
            asyncio.create_task(self._watch(nc, tenants.kv, "tenants", self._apply_tenant)),
            asyncio.create_task(self._check_lag(buckets)),
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
        key, and delete markers for removed keys. The lag check starts a new
        watch the same way when this one has stalled.
        """
        restart = self._restart[name]
        while True:
            reconnects = nc.stats["reconnects"]
            restart.clear()
            follow = asyncio.create_task(self._follow(kv, name, apply))
            try:
                while (
                    not follow.done()
                    and nc.stats["reconnects"] == reconnects
                    and not restart.is_set()
                ):
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
                # The new watch delivers at least what the bucket holds now.
                status = await kv.status()
                self._floor[name] = max(self._floor[name], status.stream_info.state.last_seq)
                watcher = await kv.watchall()
                last = 0  # the highest sequence this watch delivered
                grace: asyncio.TimerHandle | None = None  # this watch's only
                try:
                    async for entry in watcher:
                        if entry is None:  # nats.py: the initial values are all in
                            if await self._all_received(watcher, last):
                                self._loaded(name)
                            else:  # on their way: the last of them has delta 0
                                grace = asyncio.get_running_loop().call_later(
                                    INITIAL_VALUES_GRACE_S, self._loaded, name
                                )
                            continue
                        self._receive(name, apply, entry)
                        last = max(last, entry.revision or 0)
                        if entry.delta == 0:
                            self._loaded(name)
                finally:
                    if grace is not None:
                        grace.cancel()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # NATS restarting: watch again from the start
                log.warning("watch of %s failed: %s: %s", name, type(exc).__name__, exc)
                await asyncio.sleep(0.5)

    @staticmethod
    async def _all_received(watcher: Any, last: int) -> bool:
        """Whether a watch's "initial values are in" marker holds.

        nats.py sends the marker when its new consumer has nothing pending and
        its subscription has received nothing yet, which is also the case
        while the values the server has just sent are still on their way.
        They are in once this watch has delivered what the server sent
        (nothing, or up to the last sequence sent). Unknown (NATS busy or
        restarting): not yet, and the grace timer or the value with delta 0
        decides.
        """
        try:
            info = await watcher._sub.consumer_info()
            return bool(info.delivered.consumer_seq == 0 or info.delivered.stream_seq <= last)
        except Exception:
            return False

    def _receive(self, name: str, apply: Callable[[str, bytes | None], None], entry: Any) -> None:
        """Apply one entry of a watch and remember its sequence."""
        deleted = entry.operation in ("DEL", "PURGE")
        apply(entry.key, None if deleted else entry.value)
        self._advance(name, entry.revision or 0)

    def _loaded(self, name: str) -> None:
        """A watch delivered the bucket as it was when it started."""
        self._synced[name].set()
        # The bucket's last sequence when this watch started is covered now, even
        # when no watch delivers it (a delete marker purged since).
        self._advance(name, self._floor[name])

    def _advance(self, name: str, seq: int) -> None:
        if seq > self._applied[name]:
            self._applied[name] = seq
            self._progress_at[name] = time.monotonic()

    def _apply_key(self, key: str, value: bytes | None) -> None:
        if value is None:
            self.records.pop(key, None)
            return
        try:
            self.records[key] = KeyRecord.model_validate_json(value)
        except ValueError:
            log.error("malformed key record ignored", extra={"key_id": key})

    def _apply_tenant(self, key: str, value: bytes | None) -> None:
        """``key`` is the tenant's KV token; the record names the tenant itself."""
        if value is None:
            self.tenants.pop(self._tenant_by_token.pop(key, ""), None)
            return
        try:
            record = TenantRecord.model_validate_json(value)
        except ValueError:
            log.error("malformed tenant record ignored", extra={"tenant_key": key})
            return
        self._tenant_by_token[key] = record.tenant
        self.tenants[record.tenant] = record

    def _apply_signing(self, kid: str, value: bytes | None) -> None:
        if value is None:
            self.signing_keys.pop(kid, None)
        else:
            try:
                self.signing_keys[kid] = SigningKey.model_validate_json(value)
            except ValueError:
                log.error("malformed signing key ignored", extra={"kid": kid})
                return
        self.verifier = self._verifier()

    def _verifier(self) -> TokenVerifier:
        """A verifier for the live signing keys: a record present and not retired.

        Signing keys change rarely, so the verifier is built anew (which also
        empties its cache of verified tokens).
        """
        live = [key for key in self.signing_keys.values() if not key.retired]
        hs256 = {
            k.kid: self._hs256[k.kid] for k in live if k.alg == "HS256" and k.kid in self._hs256
        }
        verifier = TokenVerifier(hs256)
        for key in live:
            if key.alg == "HS256":
                continue
            try:
                verifier.set_key(key)
            except ValueError:
                log.error(
                    "signing key with an unreadable public key ignored", extra={"kid": key.kid}
                )
        return verifier

    # -- staleness ---------------------------------------------------------

    async def _check_lag(self, buckets: dict[str, Any]) -> None:
        """Compare each bucket's last sequence with the last applied, periodically."""
        period = min(1.0, self.max_lag_s / 4)
        while True:
            await asyncio.sleep(period)
            for name, kv in buckets.items():
                try:
                    status = await kv.status()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # NATS away: the lag keeps counting
                    log.debug("stream info of %s failed: %s: %s", name, type(exc).__name__, exc)
                    continue
                self.observe(name, status.stream_info.state.last_seq)
            self._judge()

    def observe(self, name: str, last_seq: int) -> None:
        """The bucket's stream is at ``last_seq``: note whether the mirror is behind."""
        now = time.monotonic()
        if self._applied[name] >= last_seq:
            self._behind_since[name] = None
            return
        if self._behind_since[name] is None:
            self._behind_since[name] = now
        behind_for = now - (self._behind_since[name] or now)
        stuck_for = now - max(self._progress_at[name], self._restarted_at[name])
        if behind_for > self.max_lag_s and stuck_for > self.max_lag_s:
            log.warning(
                "watch of %s stalled (applied %d of %d): watching it again",
                name,
                self._applied[name],
                last_seq,
            )
            self._restarted_at[name] = now
            self._restart[name].set()

    def _judge(self) -> None:
        lag = self.lag_s
        stale = lag > self.max_lag_s
        if stale and not self.stale:
            log.error(
                "key whitelist stale: %.1f s behind its buckets (bound %.1f s); "
                "refusing keys and not ready until it catches up",
                lag,
                self.max_lag_s,
                extra={"applied": dict(self._applied)},
            )
        elif self.stale and not stale:
            log.warning("key whitelist caught up with its buckets: serving keys again")
        self.stale = stale

    # -- the hot path ------------------------------------------------------

    def authenticate(self, request: web.Request) -> Principal:
        if self.stale:
            raise WhitelistStale(
                "The server cannot check API keys right now. Please retry shortly.",
                headers={"Retry-After": str(self.retry_after_s)},
            )
        token = _token(request)
        if token is None:
            raise InvalidApiKey(
                "You didn't provide an API key. Provide it in the Authorization header "
                "(Authorization: Bearer YOUR_KEY)."
            )
        if not token.isascii():  # bytes that are not text (aiohttp keeps them as surrogates)
            raise self._incorrect()
        try:
            claims = self.verifier.verify(strip_prefix(token))
        except InvalidToken:
            raise self._incorrect() from None
        record = self.records.get(str(claims["jti"]))
        if record is None or record.tenant != claims["sub"]:
            raise self._incorrect()
        if record.state is KeyState.OVER_BUDGET:
            raise QuotaExceeded(
                "You exceeded your current quota: this key's budget is spent "
                f"for this {record.budget_period or 'period'}."
            )
        if not record.usable(time.time()):
            raise self._incorrect()
        tenant = self.tenants.get(record.tenant)
        if tenant is not None and tenant.over_budget and tenant.budget_period is not None:
            raise QuotaExceeded(
                "You exceeded your current quota: the budget of this key's tenant "
                f"(all its keys together) is spent for this {tenant.budget_period}."
            )
        return Principal(record.key_id, record.tenant, record, tenant)

    @staticmethod
    def _incorrect() -> InvalidApiKey:
        return InvalidApiKey("Incorrect API key provided.")

    @staticmethod
    def authorize(principal: Principal, target: Target, requested: str) -> None:
        """A model the key may not use is reported as not found, as OpenAI does.

        An adapter is matched by its own names: a key allowed its base model
        is not thereby allowed its adapters, nor the other way round.
        """
        if not principal.record.allows(target.names):
            raise ModelNotFound(requested)
