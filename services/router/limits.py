"""Per-key and per-tenant limits that hold across every router replica.

A call must fit its key's limits and, when its tenant has a record in
``tg_tenants``, its tenant's: the same counters, one set per key and one per
tenant (``rpm.<key id>.<minute>`` and ``rpm.t.<tenant>.<minute>``, and so on).

Counters live in JetStream KV and change only by compare-and-set, so
concurrent routers cannot both take the last unit. A router remembers the
last revision it saw of each counter and tries its update against it first:
one round trip when it is the only writer, a read and a retry when not.

- requests/min and tokens/min: fixed one-minute windows (the ``ratelimits`` bucket,
  memory storage, entries expire after two minutes);
- token budgets per day, month or in total (the ``budgets`` bucket, file storage);
- calls in flight per key (``conc.<key_id>``, ``conc.t.<tenant>`` in the ``ratelimits`` bucket): one
  unit taken before dispatch, given back when the call is settled.

The in-flight counter lives in a bucket whose entries expire two minutes after
their last write, and a call may run far longer (``request_timeout_s``). So a
router rewrites, every :attr:`Limiter.refresh_s` seconds, each counter it holds
units of: a long call keeps its unit, and the counter vanishes only once no
router has held it for two minutes. The same expiry is what frees units a
router never gave back: one killed mid-call gives its units back when it starts
again on its outbox (the lost calls are settled), and if it never does, they
are freed once the counter has gone two minutes unwritten (a key whose every
unit is lost refuses calls without writing, so that is two minutes; a key that
keeps running at its remaining units keeps its counter, and the lost units,
until it is quiet that long). A NATS restart loses the bucket: counting starts
again from zero, and a unit given back to a counter at zero leaves it at zero.

Tokens are reserved before dispatch at the worst case (the endpoint's
:meth:`~services.router.endpoints.EndpointSpec.worst_case_tokens`:
an upper bound of every prompt plus the completion limit for each prompt and
each of its ``n`` choices) and settled to the engine's count after, so an
overshoot is bounded by the reservations in flight, never by how many
requests raced. A settlement is a list of counter writes
(:meth:`Limiter.plan`), each idempotent when made with the call's id
(:meth:`Limiter.apply`), which :mod:`services.router.settlement` journals and
makes exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from nats.errors import NoRespondersError
from nats.js.errors import (
    APIError,
    BucketNotFoundError,
    KeyDeletedError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NoStreamResponseError,
    NotFoundError,
)

from services.router.errors import PermissionDenied, QuotaExceeded, RateLimited
from tollgate.keys.records import KeyRecord, Limits, TenantRecord, budget_window, money_entry
from tollgate.keys.tenants import tenant_scope
from tollgate.models.catalog import Price
from tollgate.wire.topology import Topology

log = logging.getLogger("tollgate.router.limits")


RATES = "rates"  # the ratelimits bucket: per-minute windows and calls in flight
BUDGETS = "budgets"  # the budgets bucket: token and money budgets


class Change(NamedTuple):
    """One counter write of a settlement: ``amount`` added to ``counter`` (floor zero)."""

    store: str  # RATES or BUDGETS
    counter: str
    amount: int


def journaled(changes: list[Change]) -> list[Change]:
    """The writes of a settlement that are journaled and made until they are made:
    the budgets' (:mod:`services.router.settlement` says why not the rate limits')."""
    return [change for change in changes if change.store == BUDGETS]


@dataclass
class Reservation:
    """What one request holds, to settle once its usage is known.

    A call holds units of its key's counters and of its tenant's: lists of
    counter names, one per scope that limits it.
    """

    tokens: int = 0
    tpm_keys: list[str] = field(default_factory=list)
    budget_keys: list[str] = field(default_factory=list)
    concurrency_keys: list[str] = field(default_factory=list)  # emptied once given back
    # a budget in money: what is reserved (billionths of the price's currency), where
    # and at what price the call is settled
    nanos: int = 0
    money_keys: list[str] = field(default_factory=list)
    price: Price | None = None
    headers: dict[str, str] = field(default_factory=dict)
    # taken by this run of this router, which keeps its units in flight alive;
    # one rebuilt from an outbox (a lost call's) is not
    live: bool = field(default=True, compare=False)

    @property
    def budget(self) -> bool:
        """Whether a budget (tokens or money, the key's or the tenant's) holds part of it."""
        return bool(self.budget_keys or self.money_keys)

    def held(self) -> dict[str, Any]:
        """What the outbox keeps, to settle the call should this router die."""
        return {
            "tokens": self.tokens,
            "tpm_keys": self.tpm_keys,
            "budget_keys": self.budget_keys,
            "concurrency_keys": self.concurrency_keys,
            "nanos": self.nanos,
            "money_keys": self.money_keys,
            "price": None if self.price is None else self.price.model_dump(mode="json"),
        }

    @classmethod
    def from_held(cls, held: dict[str, Any]) -> Reservation:
        """A reservation from :meth:`held`, or from an outbox of the one-key format."""

        def names(plural: str, single: str) -> list[str]:
            if plural in held:
                return [str(name) for name in held[plural] or []]
            return [str(held[single])] if held.get(single) else []

        price = held.get("price")
        return cls(
            tokens=int(held.get("tokens") or 0),
            tpm_keys=names("tpm_keys", "tpm_key"),
            budget_keys=names("budget_keys", "budget_key"),
            concurrency_keys=names("concurrency_keys", "concurrency_key"),
            nanos=int(held.get("nanos") or 0),
            money_keys=names("money_keys", "money_key"),
            price=None if price is None else Price.model_validate(price),
            live=False,
        )


@dataclass(frozen=True)
class Scope:
    """Whose limits a counter enforces: a key's or its tenant's (named in messages)."""

    who: str  # "key" or "tenant"
    ident: str  # the key id, or ``t.<tenant key>``
    limits: Limits

    @classmethod
    def of_key(cls, record: KeyRecord) -> Scope:
        return cls("key", record.key_id, record)

    @classmethod
    def of_tenant(cls, record: TenantRecord) -> Scope:
        return cls("tenant", tenant_scope(record.tenant), record)

    def counter(self, kind: str, *parts: object) -> str:
        """A counter's name: ``rpm.<key id>.<minute>`` for a key, ``rpm.t.<tenant>.<minute>``
        for a tenant (:func:`~tollgate.keys.tenants.tenant_scope`)."""
        return ".".join([kind, self.ident, *map(str, parts)])

    def budget_counter(self, window: str) -> str:
        """``<key id>.<window>`` (as ever) or ``t.<tenant>.<window>``."""
        return f"{self.ident}.{window}"

    def money_counter(self, window: str, currency: str) -> str:
        """``money.<key id or t.<tenant>>.<window>.<currency>``: billionths spent."""
        return money_entry(self.ident, window, currency)


class UnpricedModel(PermissionDenied):
    """A key or tenant with a budget in money calls a model the catalog has no price for."""

    code = "model_not_priced"

    def __init__(self, model: str, who: str, currency: str) -> None:
        whose = "This key has" if who == "key" else "This key's tenant has"
        super().__init__(
            f"{whose} a budget in {currency}, and `{model}` has no price in {currency} "
            "for today: it cannot be used with this key. Ask the provider to price it."
        )


class ConcurrencyLimited(RateLimited):
    """The key has ``max_concurrent`` calls in flight already (429).

    It carries no ``Retry-After``: when a slot frees depends on how fast the
    key's calls finish, which the serving layer measures and adds.
    """

    code = "concurrency_limit_exceeded"

    def __init__(self, limit: int, who: str = "key") -> None:
        whose = "this key" if who == "key" else "this key's tenant (all its keys together)"
        super().__init__(
            f"Too many concurrent requests for {whose}: {limit} at once. "
            "Please retry when one finishes."
        )


# What the bus answers when a bucket's stream is gone: a NATS restart loses a
# bucket kept in memory (the per-minute rate counters).
_BUCKET_GONE = (NoStreamResponseError, NoRespondersError, BucketNotFoundError, NotFoundError)
# nats-server's error codes for a write whose expected revision is not the last
_WRONG_LAST_SEQUENCE = (10071, 10164)


class CounterStore:
    """Integer counters in one KV bucket, changed by compare-and-set.

    ``reopen`` gets the bucket again (creating it) when its stream is gone;
    the counters then start again from zero.
    """

    def __init__(self, kv: Any, reopen: Callable[[], Awaitable[Any]] | None = None) -> None:
        self.kv = kv
        self.reopen = reopen
        self._seen: dict[str, tuple[int, int]] = {}  # key -> (value, revision)

    async def add(
        self,
        key: str,
        amount: int,
        limit: int | None = None,
        floor: int | None = None,
        write_id: str | None = None,
    ) -> tuple[bool, int]:
        """Add ``amount`` unless the result would pass ``limit``; (done, value after).

        With ``floor``, the result is never below it: taking back more than a
        counter holds (it expired, or NATS restarted, since the units were
        taken) leaves it at ``floor``, and writes nothing when it is there.
        Adding 0 rewrites the counter as it is, which renews its expiry.

        ``write_id`` makes the addition idempotent: the write carries it as
        its ``Nats-Msg-Id``, so adding again with the same id, after a failure
        that may have hidden a write that landed, adds nothing more as long
        as the first write is inside the bucket's duplicate window (two
        minutes). The stream checks the expected revision first and the id
        second, so a retry that meets a changed counter reads it, tries
        again, and is then dropped as the duplicate it is.
        """
        try:
            return await self._add(key, amount, limit, floor, write_id)
        except _BUCKET_GONE:
            if self.reopen is None:
                raise
        log.warning("counter bucket gone (NATS restarted?); creating it again")
        self.kv = await self.reopen()
        self._seen.clear()
        return await self._add(key, amount, limit, floor, write_id)

    async def _read(self, key: str) -> tuple[int, int]:
        try:
            entry = await self.kv.get(key)
        except KeyNotFoundError:
            return 0, 0
        except KeyDeletedError as exc:  # a delete marker: the next write goes over it
            marker = getattr(exc, "entry", None)
            return 0, int(marker.revision) if marker is not None and marker.revision else 0
        value = int(entry.value or b"0")
        self._seen[key] = (value, entry.revision)
        return value, entry.revision

    async def _add(
        self,
        key: str,
        amount: int,
        limit: int | None,
        floor: int | None = None,
        write_id: str | None = None,
    ) -> tuple[bool, int]:
        value, revision = self._seen.get(key) or await self._read(key)
        for _ in range(100):
            new = value + amount if floor is None else max(floor, value + amount)
            refused = limit is not None and amount > 0 and new > limit
            if refused or (amount and new == value):
                # Refuse, or leave as it is, only on a fresh read: the remembered
                # value may be stale.
                fresh, fresh_revision = await self._read(key)
                if fresh_revision == revision:
                    return not refused, fresh
                value, revision = fresh, fresh_revision
                continue
            try:
                if write_id is not None:
                    written, revision = await self._write_once(key, new, revision, write_id)
                    if not written:  # an earlier try landed: the counter already has it
                        self._seen.pop(key, None)
                        return True, new
                elif revision == 0:
                    revision = await self.kv.create(key, str(new).encode())
                else:
                    revision = await self.kv.update(key, str(new).encode(), last=revision)
            except KeyWrongLastSequenceError:
                value, revision = await self._read(key)  # another router was first
                continue
            self._seen[key] = (new, revision)
            return True, new
        raise RuntimeError(f"counter {key} kept changing under us")

    async def _write_once(
        self, key: str, value: int, revision: int, write_id: str
    ) -> tuple[bool, int]:
        """Write ``value`` over ``revision`` with ``write_id``: (stored, its revision).

        nats.py's ``KeyValue.update`` sends no headers of ours, so this is
        its publish with the message id added (``_js`` and ``_pre`` are the
        bucket handle's JetStream context and subject prefix).
        """
        headers = {
            "Nats-Expected-Last-Subject-Sequence": str(revision),
            "Nats-Msg-Id": write_id,
        }
        try:
            ack = await self.kv._js.publish(
                f"{self.kv._pre}{key}", str(value).encode(), headers=headers
            )
        except APIError as exc:
            if exc.err_code in _WRONG_LAST_SEQUENCE:
                raise KeyWrongLastSequenceError(description=exc.description) from None
            raise
        return not ack.duplicate, int(ack.seq)


class Limiter:
    # How often a router rewrites the in-flight counters it holds units of: well
    # inside the two minutes after which the ratelimits bucket forgets an entry.
    REFRESH_S = 30.0

    def __init__(
        self, rates: CounterStore, budgets: CounterStore, refresh_s: float = REFRESH_S
    ) -> None:
        self.rates = rates
        self.budgets = budgets
        self.refresh_s = refresh_s
        self._holding: dict[str, int] = {}  # in-flight counter -> units this router holds
        self._nothing_held = asyncio.Event()
        self._keeper: asyncio.Task[None] | None = None

    @classmethod
    async def open(cls, js: Any, topology: Topology) -> Limiter:
        rates = await topology.bucket(js, topology.ratelimits)
        budgets = await topology.bucket(js, topology.budgets)
        return cls(
            CounterStore(rates, lambda: topology.bucket(js, topology.ratelimits)),
            CounterStore(budgets, lambda: topology.bucket(js, topology.budgets)),
        )

    async def reserve(
        self,
        record: KeyRecord,
        worst_tokens: int,
        tenant: TenantRecord | None = None,
        price: Price | None = None,
        model: str = "",
    ) -> Reservation:
        """Take one call in flight, one request and ``worst_tokens`` tokens, or raise a 429.

        Each is taken from the key's limits and then from its tenant's
        (``tenant``: the tenant's record, if it has one): a call must fit both.
        A budget in money reserves what ``worst_tokens`` cost at ``price``
        (the call's model's price today) at most; without a price in the
        budget's currency the call is refused (403, :class:`UnpricedModel`).
        Whatever refuses (or fails), every unit already taken is given back.
        """
        if worst_tokens < 0:
            raise ValueError(f"a reservation cannot be negative: {worst_tokens}")
        scopes = [Scope.of_key(record)]
        if tenant is not None and tenant.limited:
            scopes.append(Scope.of_tenant(tenant))
        now = time.time()
        minute = int(now // 60)
        reset = str(60 - int(now % 60))
        held = Reservation(tokens=worst_tokens)
        rpm_keys: list[str] = []
        try:
            for scope in scopes:
                limits = scope.limits
                if limits.max_concurrent is not None:
                    key = scope.counter("conc")
                    ok, _ = await self.rates.add(key, 1, limits.max_concurrent)
                    if not ok:
                        raise ConcurrencyLimited(limits.max_concurrent, scope.who)
                    held.concurrency_keys.append(key)
                    self._hold(key)
            for scope in scopes:
                limits = scope.limits
                if limits.rpm is not None:
                    key = scope.counter("rpm", minute)
                    await self._take(held, scope, key, 1, limits.rpm, "requests", reset)
                    rpm_keys.append(key)
            for scope in scopes:
                limits = scope.limits
                if limits.tpm is not None:
                    key = scope.counter("tpm", minute)
                    await self._take(held, scope, key, worst_tokens, limits.tpm, "tokens", reset)
                    held.tpm_keys.append(key)
            for scope in scopes:
                limits = scope.limits
                if limits.budget_tokens is not None and limits.budget_period is not None:
                    key = scope.budget_counter(budget_window(limits.budget_period, now))
                    ok, _ = await self.budgets.add(key, worst_tokens, limits.budget_tokens)
                    if not ok:
                        whose = "this key's" if scope.who == "key" else "this key's tenant's"
                        raise QuotaExceeded(
                            f"You exceeded your current quota: {whose} token budget for the "
                            f"{limits.budget_period} cannot cover this request.",
                            headers=held.headers,
                        )
                    held.budget_keys.append(key)
            for scope in scopes:
                limits = scope.limits
                if limits.budget_nanos is None or limits.budget_period is None:
                    continue
                if price is None or price.currency != limits.budget_currency:
                    raise UnpricedModel(model, scope.who, limits.budget_currency)
                held.price = price
                held.nanos = price.worst_nanos(worst_tokens)
                window = budget_window(limits.budget_period, now)
                key = scope.money_counter(window, limits.budget_currency)
                ok, _ = await self.budgets.add(key, held.nanos, limits.budget_nanos)
                if not ok:
                    whose = "this key's" if scope.who == "key" else "this key's tenant's"
                    raise QuotaExceeded(
                        f"You exceeded your current quota: {whose} budget of "
                        f"{limits.budget_amount} {limits.budget_currency} for the "
                        f"{limits.budget_period} cannot cover this request.",
                        headers=held.headers,
                    )
                held.money_keys.append(key)
        except BaseException:
            await self._give_back(held, rpm_keys)
            raise
        return held

    async def _give_back(self, held: Reservation, rpm_keys: list[str]) -> None:
        """Return what a refused reservation took: the call, the request, the tokens."""
        for key in rpm_keys:
            try:
                await self.rates.add(key, -1, floor=0)
            except Exception as exc:
                log.error("giving back a request failed: %s: %s", type(exc).__name__, str(exc))
        await self.settle(held, 0)

    async def _take(
        self,
        held: Reservation,
        scope: Scope,
        key: str,
        amount: int,
        limit: int,
        kind: str,
        reset: str,
    ) -> None:
        """Take ``amount`` from a per-minute window, or raise a 429 with OpenAI's headers.

        The ``x-ratelimit-*`` headers describe the tighter of the key's and the
        tenant's windows: the one with fewer units left.
        """
        ok, used = await self.rates.add(key, amount, limit)
        remaining = max(0, limit - used)
        shown = held.headers.get(f"x-ratelimit-remaining-{kind}")
        if not ok or shown is None or remaining < int(shown):
            held.headers.update(
                {
                    f"x-ratelimit-limit-{kind}": str(limit),
                    f"x-ratelimit-remaining-{kind}": str(remaining),
                    f"x-ratelimit-reset-{kind}": f"{reset}s",
                }
            )
        if not ok:
            whose = "" if scope.who == "key" else " for this key's tenant (all its keys together)"
            raise RateLimited(
                f"Rate limit reached for {kind}{whose}: {limit} per minute"
                + (f" (this request may use up to {amount})" if kind == "tokens" else "")
                + f". Please try again in {reset}s.",
                headers={**held.headers, "Retry-After": reset},
            )

    def plan(
        self, held: Reservation, actual_tokens: int, prompt_tokens: int | None = None
    ) -> list[Change]:
        """The counter writes that replace the reservation by the real count.

        It gives back the call's units in flight (once: a second plan of the
        same reservation has none left to give) and moves each token and
        money counter by the difference between the count and what was
        reserved; the reservation then holds the real count, so planning it
        again plans nothing more. ``prompt_tokens`` (of ``actual_tokens``)
        prices a budget in money exactly; without it, every token is priced
        at the dearer kind. A count below zero cannot come from an engine
        (the usage contract refuses it); should one arrive, it settles as
        zero, so a ledger is never given back more than was reserved.
        """
        if actual_tokens < 0:
            log.error("negative token count %d settled as 0", actual_tokens)
            actual_tokens = 0
        delta = actual_tokens - held.tokens
        changes = self._released(held)
        changes += [Change(RATES, key, delta) for key in held.tpm_keys]
        changes += [Change(BUDGETS, key, delta) for key in held.budget_keys]
        if held.price is not None and held.money_keys:
            if prompt_tokens is not None and 0 <= prompt_tokens <= actual_tokens:
                nanos = held.price.cost_nanos(prompt_tokens, actual_tokens - prompt_tokens)
            else:
                nanos = held.price.worst_nanos(actual_tokens)
            changes += [Change(BUDGETS, key, nanos - held.nanos) for key in held.money_keys]
            held.nanos = nanos
        held.tokens = actual_tokens
        return [change for change in changes if change.amount]

    async def apply(self, changes: list[Change], call_id: str | None = None) -> list[Change]:
        """Make the writes of :meth:`plan`; the ones that failed (never raises).

        With ``call_id`` each write is idempotent (its id: the call's and the
        counter's; see :meth:`CounterStore.add`), so a failed one can be made
        again (:mod:`services.router.settlement`): if it landed after all, it
        is not counted twice. No counter goes below zero.
        """
        stores = {RATES: self.rates, BUDGETS: self.budgets}
        failed = []
        for change in changes:
            store = stores[change.store]
            write_id = None if call_id is None else f"{call_id}.{change.counter}"
            try:
                await store.add(change.counter, change.amount, floor=0, write_id=write_id)
            except Exception as exc:
                log.error(
                    "settling a reservation failed: %s: %s",
                    type(exc).__name__,
                    str(exc),
                    extra={"request_id": call_id, "counter": change.counter},
                )
                log.debug("settling a reservation failed", exc_info=True)
                failed.append(change)
        return failed

    async def settle(
        self,
        held: Reservation,
        actual_tokens: int,
        prompt_tokens: int | None = None,
        call_id: str | None = None,
    ) -> list[Change]:
        """Replace the reservation by the real count: :meth:`plan`, then :meth:`apply`."""
        return await self.apply(self.plan(held, actual_tokens, prompt_tokens), call_id)

    async def release(self, held: Reservation) -> None:
        """Give back the reservation's calls in flight (key's and tenant's), once (never raises).

        A second call, or a settle after it, gives back nothing more. A
        counter never goes below zero.
        """
        await self.apply(self._released(held))

    def _released(self, held: Reservation) -> list[Change]:
        """The writes that give back the reservation's units in flight, taken from it once;
        this run stops renewing the counters of the units it took itself."""
        keys, held.concurrency_keys = held.concurrency_keys, []
        if held.live:
            for key in keys:
                self._unhold(key)
        return [Change(RATES, key, -1) for key in keys]

    def _hold(self, key: str) -> None:
        self._holding[key] = self._holding.get(key, 0) + 1
        self._nothing_held.clear()
        if self._keeper is None or self._keeper.done():
            self._keeper = asyncio.create_task(self._keep_counters())

    def _unhold(self, key: str) -> None:
        if key not in self._holding:
            return
        self._holding[key] -= 1
        if self._holding[key] <= 0:
            del self._holding[key]
        if not self._holding:
            self._nothing_held.set()

    async def _keep_counters(self) -> None:
        """While this router holds calls in flight, rewrite their counters so they stay."""
        while self._holding:
            try:
                await asyncio.wait_for(self._nothing_held.wait(), self.refresh_s)
            except TimeoutError:
                for key in list(self._holding):
                    try:
                        await self.rates.add(key, 0)
                    except Exception as exc:
                        log.warning(
                            "renewing a call-in-flight counter failed: %s: %s",
                            type(exc).__name__,
                            str(exc),
                        )

    async def close(self) -> None:
        """Stop renewing counters (the router is stopping)."""
        if self._keeper is not None:
            self._keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keeper
            self._keeper = None
