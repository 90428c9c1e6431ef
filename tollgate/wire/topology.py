"""The bus, declared once: every stream, key-value bucket, durable consumer and subject.

Everything is derived from the subject prefix and the replica count
(:class:`~tollgate.wire.subjects.Subjects`), so two stacks with different
prefixes share one NATS server without seeing each other's keys, work,
usage or audit trail.

Each entry names the roles that publish to it and the roles that read it.
A service creates what it uses (:meth:`Topology.ensure` with its role), and
the same table is what each service's NATS permissions are derived from.
:func:`describe` renders it for ``docs/architecture.md``, and
:mod:`tollgate.wire.asyncapi` builds the bus's AsyncAPI document from it, with
each channel's contract.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import orjson
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DiscardPolicy,
    KeyValueConfig,
    RePublish,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import BadRequestError, BucketNotFoundError, NotFoundError
from pydantic import BaseModel

from tollgate.wire import contracts as c
from tollgate.wire.subjects import Subjects

log = logging.getLogger("tollgate.topology")

# How long a request may wait in a model's work queue at most. Routers give
# up much sooner (their queue timeout); this only clears what nobody fetched.
INFER_MAX_AGE_S = 600.0
# Bounds of the work queue, enforced by the server (new messages refused when
# full): every model's lanes together, and one lane (one key's requests of one
# class). The routers refuse a model's requests sooner, at its own pending
# limit (TOLLGATE_ROUTER_MAX_QUEUED_PER_MODEL), with a Retry-After. No byte
# bound: a memory stream's byte limit is reserved from the server's JetStream
# memory up front, and the server's own max_memory_store bounds it anyway.
WORK_MAX_MSGS = 100_000
WORK_MAX_MSGS_PER_LANE = 10_000
DEDUPE_WINDOW_S = 600.0
# nats-server's JSStreamNameExistErr: "stream name already in use with a
# different configuration" (the same configuration is no error).
_STREAM_NAME_EXISTS = 10058


class Role(StrEnum):
    """The identities on the bus: one per service, plus the operator's tools."""

    ROUTER = "router"
    WORKER = "worker"
    AUTH = "auth"
    METERING = "metering"
    SCALER = "scaler"
    ADMIN = "admin"  # the tollgate command: keys, replay, sql, supervisor


R = Role

# What a channel carries: a wire contract, or the type id of a contract defined
# above the wire layer (key records, signing keys and audit events live in
# tollgate.keys.records; the scaler's decisions and status are plain JSON with a
# type id). None: no declared contract (a drain order has no body, dead letters
# keep the bytes as they came, counters are small JSON their one owner reads).
Contract = type[BaseModel] | str | None


@dataclass(frozen=True)
class StreamSpec:
    """A JetStream stream: who writes to its subjects and who reads it.

    ``readers`` read its messages through durable consumers; ``listeners``
    subscribe to its subjects as messages are published (no replay);
    ``observers`` may read the stream's state (message counts per subject)
    and never a message.
    """

    what: str
    name: str
    subjects: tuple[str, ...]
    storage: StorageType
    writers: frozenset[Role]
    readers: frozenset[Role]
    listeners: frozenset[Role] = frozenset()
    observers: frozenset[Role] = frozenset()
    # who may create it when missing; None: its writers and readers
    creators: frozenset[Role] | None = None
    retention: RetentionPolicy = RetentionPolicy.LIMITS
    max_age_s: float | None = None
    duplicate_window_s: float | None = None
    contract: Contract = None
    # readers that take messages by reading one (direct get) and deleting it:
    # whoever deletes it has it (a work queue without consumers)
    claimers: frozenset[Role] = frozenset()
    # writers that may delete a message they wrote (a request withdrawn)
    withdrawers: frozenset[Role] = frozenset()
    # limits the server enforces by refusing new messages (None: unlimited)
    max_msgs: int | None = None
    max_msgs_per_subject: int | None = None
    max_bytes: int | None = None
    # the shape of its subjects, for the documents (its subjects are wildcards)
    pattern: str | None = None
    # (source, destination): the server sends a copy of each message stored
    # under the source subjects to the destination (a subject mapping), with
    # its sequence, subject and timestamp in headers
    republish: tuple[str, str] | None = None

    @property
    def may_create(self) -> frozenset[Role]:
        return self.creators if self.creators is not None else self.writers | self.readers

    def config(self, replicas: int) -> StreamConfig:
        bounded = self.max_msgs is not None or self.max_msgs_per_subject is not None
        return StreamConfig(
            name=self.name,
            subjects=list(self.subjects),
            retention=self.retention,
            storage=self.storage,
            max_age=self.max_age_s,
            duplicate_window=self.duplicate_window_s or 0.0,
            num_replicas=replicas,
            max_msgs=self.max_msgs if self.max_msgs is not None else -1,
            max_msgs_per_subject=(
                self.max_msgs_per_subject if self.max_msgs_per_subject is not None else -1
            ),
            max_bytes=self.max_bytes if self.max_bytes is not None else -1,
            discard=DiscardPolicy.NEW if bounded else DiscardPolicy.OLD,
            discard_new_per_subject=self.max_msgs_per_subject is not None,
            allow_direct=True if self.claimers else None,
            republish=(
                RePublish(src=self.republish[0], dest=self.republish[1])
                if self.republish is not None
                else None
            ),
        )


@dataclass(frozen=True)
class BucketSpec:
    """A JetStream key-value bucket: who writes it and who reads or watches it."""

    what: str
    name: str
    storage: StorageType
    writers: frozenset[Role]
    readers: frozenset[Role]
    history: int = 1
    ttl_s: float | None = None
    contract: Contract = None  # of a value
    # bounds for a bucket its writers could otherwise fill (None: the server's)
    max_bytes: int | None = None
    max_value_size: int | None = None

    def config(self, replicas: int) -> KeyValueConfig:
        return KeyValueConfig(
            bucket=self.name,
            storage=self.storage,
            history=self.history,
            ttl=self.ttl_s,
            replicas=replicas,
            max_bytes=self.max_bytes,
            max_value_size=self.max_value_size,
        )


@dataclass(frozen=True)
class ConsumerSpec:
    """A durable pull consumer: which stream, which subjects, which role reads it.

    ``creator`` creates it (its reader when None). Whoever may create a
    consumer chooses its configuration, a push consumer's deliver subject
    included, so a role that only reads gets a consumer made for it.
    """

    what: str
    stream: str
    durable: str
    filter_subject: str
    reader: Role
    creator: Role | None = None
    # Its reader acks only the last message of each batch, which acks every
    # earlier one (AckPolicy.ALL): one ack per batch instead of one per message.
    ack_all: bool = False

    @property
    def created_by(self) -> Role:
        return self.creator or self.reader

    def config(self, **tuning: Any) -> ConsumerConfig:
        """The consumer's config; ``tuning`` sets ack wait, pending limits and the like."""
        return ConsumerConfig(
            durable_name=self.durable,
            filter_subject=self.filter_subject,
            ack_policy=AckPolicy.ALL if self.ack_all else AckPolicy.EXPLICIT,
            **tuning,
        )


@dataclass(frozen=True)
class SubjectSpec:
    """A core NATS subject (no stream): fire-and-forget or request/reply."""

    what: str
    pattern: str
    publishers: frozenset[Role]
    subscribers: frozenset[Role]
    request_reply: bool = False
    contract: Contract = None
    reply: Contract = None  # of the answer, for request/reply
    # the stream whose republish sends here (then no service publishes)
    republished_by: str | None = None


def _roles(*roles: Role) -> frozenset[Role]:
    return frozenset(roles)


class Topology:
    """Every name and shape on the bus for one prefix."""

    def __init__(self, subjects: Subjects) -> None:
        self.subjects = s = subjects
        self.replicas = subjects.replicas
        self.usage = StreamSpec(
            "usage events, one per accepted request",
            s.usage_stream,
            (s.usage_all,),
            StorageType.FILE,
            writers=_roles(R.ROUTER),
            readers=_roles(R.METERING, R.AUTH),
            duplicate_window_s=DEDUPE_WINDOW_S,
            contract=c.UsageEvent,
            # <readers>: "budget" when the call's key has a token budget (the
            # budget ledger reads those too), else "plain" (metering alone)
            pattern=f"{s.prefix}.usage.<tenant>.<readers>",
        )
        # Requests live in memory: each belongs to an open client connection on
        # a router, so there is nothing to recover from disk after a NATS
        # restart. One stream for every model, so that permissions on it do not
        # depend on which models exist; one subject per lane (a model's
        # requests of one class, tenant and key). A model's workers take from
        # its lanes by weight: they read a lane's oldest request (direct get)
        # and delete it, and whoever deletes it runs it. No consumer: a pull
        # consumer hands out messages in arrival order only.
        self.work = StreamSpec(
            "requests waiting for a worker, one subject per lane (model, class, tenant, key; "
            "and a worker's direct lanes)",
            s.infer_stream,
            (s.infer_all,),
            StorageType.MEMORY,
            writers=_roles(R.ROUTER),
            readers=_roles(R.WORKER),
            observers=_roles(R.SCALER),  # queue depth per model, never a request
            # Workers run model code: they create nothing on the bus. Routers
            # create the stream.
            creators=_roles(R.ROUTER),
            retention=RetentionPolicy.WORK_QUEUE,
            max_age_s=INFER_MAX_AGE_S,
            duplicate_window_s=120.0,
            contract=c.InferenceRequest,
            claimers=_roles(R.WORKER),
            withdrawers=_roles(R.ROUTER),  # a request whose client left, before a worker took it
            max_msgs=WORK_MAX_MSGS,
            max_msgs_per_subject=WORK_MAX_MSGS_PER_LANE,
            pattern=f"{s.prefix}.infer.<model>.<class>.<tenant>.<key>",
            # a request stored in a worker's direct lane is offered to that worker
            republish=(s.infer_direct_all, s.offers_by_lane),
        )
        self.dead_letter = StreamSpec(
            "usage messages metering could not read, with the reason",
            s.dead_letter_stream,
            (s.usage_dead_letter,),
            StorageType.FILE,
            writers=_roles(R.METERING),
            readers=_roles(R.ADMIN),
            duplicate_window_s=DEDUPE_WINDOW_S,
        )
        self.capture = StreamSpec(
            "captured requests and responses, on their way to ClickHouse",
            s.capture_stream,
            (s.capture_all,),
            StorageType.FILE,
            writers=_roles(R.ROUTER),
            readers=_roles(R.METERING),
            max_age_s=86400.0,
            duplicate_window_s=DEDUPE_WINDOW_S,
            contract=c.CaptureEvent,
        )
        self.replay = StreamSpec(
            "replay results, on their way to ClickHouse",
            s.replay_stream,
            (s.replay_all,),
            StorageType.FILE,
            writers=_roles(R.ADMIN),
            readers=_roles(R.METERING),
            max_age_s=86400.0,
            duplicate_window_s=DEDUPE_WINDOW_S,
            contract=c.ReplayResult,
        )
        self.scale = StreamSpec(
            "the scaler's decisions with their reasons",
            s.scale_stream,
            (s.scale_all,),
            StorageType.FILE,
            writers=_roles(R.SCALER),
            readers=_roles(R.ADMIN),
            max_age_s=30 * 86400.0,
            contract="tg.scale.v1",
        )
        self.audit = StreamSpec(
            "every change to the whitelist and the signing keys",
            s.audit_stream,
            (s.audit,),
            StorageType.FILE,
            writers=_roles(R.AUTH, R.ADMIN),
            readers=_roles(R.ADMIN),
            contract="tg.audit.v1",
        )
        self.alerts = StreamSpec(
            "spend alerts: a key's or tenant's budget passed a threshold, once each",
            s.alerts_stream,
            (s.spend_alerts_all,),
            StorageType.FILE,
            writers=_roles(R.AUTH),
            readers=_roles(R.AUTH, R.ADMIN),
            max_age_s=90 * 86400.0,
            duplicate_window_s=DEDUPE_WINDOW_S,
            contract=c.SpendAlert,
            pattern=f"{s.prefix}.alerts.spend.<tenant>",
        )
        self.webhook_log = StreamSpec(
            "the delivery log: every attempt to deliver a spend alert, on its way to ClickHouse",
            s.webhook_log_stream,
            (s.webhook_calls_all,),
            StorageType.FILE,
            writers=_roles(R.AUTH),
            readers=_roles(R.METERING),
            max_age_s=30 * 86400.0,
            duplicate_window_s=DEDUPE_WINDOW_S,
            contract=c.WebhookCall,
            pattern=f"{s.prefix}.billing.webhooks.<tenant>",
        )
        self.budget_log = StreamSpec(
            "keys' and tenants' budgets as set, each change, on their way to ClickHouse",
            s.budgets_stream,
            (s.budgets_all,),
            StorageType.FILE,
            writers=_roles(R.AUTH),
            readers=_roles(R.METERING),
            max_age_s=30 * 86400.0,
            duplicate_window_s=DEDUPE_WINDOW_S,
            contract=c.BudgetSet,
            pattern=f"{s.prefix}.billing.budgets.<tenant>",
        )
        self.keys = BucketSpec(
            "the whitelist: key id -> key record",
            s.keys_bucket,
            StorageType.FILE,
            writers=_roles(R.AUTH, R.ADMIN),
            readers=_roles(R.ROUTER, R.AUTH, R.ADMIN),
            history=5,
            contract="tg.key.v1",
        )
        self.signing_keys = BucketSpec(
            "public halves of the signing keys: kid -> record",
            s.signing_bucket,
            StorageType.FILE,
            writers=_roles(R.AUTH, R.ADMIN),
            readers=_roles(R.ROUTER, R.AUTH, R.ADMIN),
            history=5,
            contract="tg.signing-key.v1",
        )
        self.tenants = BucketSpec(
            "tenant-wide limits: tenant -> tenant record",
            s.tenants_bucket,
            StorageType.FILE,
            writers=_roles(R.AUTH, R.ADMIN),
            readers=_roles(R.ROUTER, R.AUTH, R.ADMIN),
            history=5,
            contract="tg.tenant.v1",
        )
        self.webhooks = BucketSpec(
            "webhook endpoints of spend alerts: id -> endpoint (its signing secret included)",
            s.webhooks_bucket,
            StorageType.FILE,
            writers=_roles(R.AUTH, R.ADMIN),
            readers=_roles(R.AUTH, R.ADMIN),
            history=1,
            contract="tg.webhook.v1",
        )
        self.spend = BucketSpec(
            "tokens and money spent per key or tenant and budget period; spend alerts sent "
            "and delivered",
            s.spend_bucket,
            StorageType.FILE,
            writers=_roles(R.AUTH),
            readers=_roles(R.AUTH, R.ADMIN),
        )
        self.orphans = BucketSpec(
            "final reports no router took (it had died): request id -> END chunk",
            s.orphan_bucket,
            StorageType.FILE,
            writers=_roles(R.WORKER),
            readers=_roles(R.ROUTER),
            ttl_s=86400.0,
            contract=c.ResponseChunk,
            # workers write it: bounded (a full bucket refuses new reports; they expire in a day)
            max_bytes=256 * 1024 * 1024,
            max_value_size=64 * 1024,
        )
        self.ratelimits = BucketSpec(
            "requests and tokens per key or tenant and minute, calls in flight (compare-and-set)",
            s.ratelimit_bucket,
            StorageType.MEMORY,
            writers=_roles(R.ROUTER),
            readers=_roles(R.ROUTER),
            ttl_s=120.0,
        )
        self.budgets = BucketSpec(
            "tokens reserved and used per key or tenant and budget period (compare-and-set)",
            s.budget_bucket,
            StorageType.FILE,
            writers=_roles(R.ROUTER),
            readers=_roles(R.ROUTER),
        )
        self.metering_usage = ConsumerSpec(
            "usage events into ClickHouse",
            s.usage_stream,
            "metering",
            s.usage_all,
            R.METERING,
            ack_all=True,
        )
        self.auth_budget = ConsumerSpec(
            "usage events into the budget ledger",
            s.usage_stream,
            "auth-budget",
            s.usage_budget,
            R.AUTH,
        )
        self.auth_webhooks = ConsumerSpec(
            "spend alerts to their webhooks",
            s.alerts_stream,
            "auth-webhooks",
            s.spend_alerts_all,
            R.AUTH,
        )
        self.metering_capture = ConsumerSpec(
            "captures into ClickHouse",
            s.capture_stream,
            "metering-capture",
            s.capture_all,
            R.METERING,
        )
        self.metering_replay = ConsumerSpec(
            "replay results into ClickHouse",
            s.replay_stream,
            "metering-replay",
            s.replay_all,
            R.METERING,
        )
        self.metering_webhook_log = ConsumerSpec(
            "webhook delivery attempts into ClickHouse",
            s.webhook_log_stream,
            "metering-webhook-log",
            s.webhook_calls_all,
            R.METERING,
        )
        self.metering_budgets = ConsumerSpec(
            "budgets into ClickHouse",
            s.budgets_stream,
            "metering-budgets",
            s.budgets_all,
            R.METERING,
        )
        p = s.prefix
        self.core = (
            SubjectSpec(
                "response chunks to the router that holds the call",
                f"{p}.reply.<router>.<request>",
                _roles(R.WORKER),
                _roles(R.ROUTER),
                # the END chunk is a request: the router that holds the call acknowledges it
                request_reply=True,
                contract=c.ResponseChunk,
                reply="an empty acknowledgement of the END chunk",
            ),
            SubjectSpec(
                "cancel a running request",
                f"{p}.cancel.<request>",
                _roles(R.ROUTER),
                _roles(R.WORKER),
                contract=c.CancelRequest,
            ),
            SubjectSpec(
                "worker heartbeats (load, state, KV-cache use)",
                f"{p}.workers.<model>",
                _roles(R.WORKER),
                _roles(R.ROUTER, R.SCALER, R.ADMIN),
                contract=c.WorkerHeartbeat,
            ),
            SubjectSpec(
                "arrivals: one small event per request queued in a shared lane (no body); "
                "wakes the model's idle workers",
                f"{p}.arrivals.<model>",
                _roles(R.ROUTER),
                _roles(R.SCALER, R.WORKER),
                contract=c.Arrival,
            ),
            SubjectSpec(
                "offers: a copy of each request stored in one worker's direct lane, sent "
                "to that worker by the work queue itself as it stores it (a republish; "
                "headers Nats-Sequence and Nats-Subject: its sequence and lane; the "
                "router's Tollgate-Queue: the queue's creation time as it read it), so "
                "the worker claims it without reading the queue. No service publishes here",
                f"{p}.queued.<model>.<worker>",
                frozenset(),
                _roles(R.WORKER),
                contract=c.InferenceRequest,
                republished_by=s.infer_stream,
            ),
            SubjectSpec(
                "offers as earlier versions send them (a router, after the queue's ack, "
                "with headers Tollgate-Seq, Tollgate-Lane and Tollgate-Stream); kept so "
                "that routers and workers of the version before mix with this one's "
                "during a roll-out. This version neither sends nor reads them",
                f"{p}.offers.<model>.<worker>",
                _roles(R.ROUTER),
                _roles(R.WORKER),
                contract=c.InferenceRequest,
            ),
            SubjectSpec(
                "tell one worker to drain and exit",
                f"{p}.control.drain.<worker>",
                _roles(R.SCALER, R.ADMIN),
                _roles(R.WORKER),
            ),
            SubjectSpec(
                "read-only ClickHouse queries",
                s.metering_query,
                _roles(R.SCALER, R.ADMIN),
                _roles(R.METERING),
                request_reply=True,
                contract=c.QueryRequest,
                reply=c.QueryResult,
            ),
            SubjectSpec(
                "a tenant's monthly invoice and its check (the admin API's invoices)",
                s.metering_invoice,
                _roles(R.AUTH, R.ADMIN),
                _roles(R.METERING),
                request_reply=True,
                contract=c.InvoiceRequest,
                reply=c.InvoiceAnswer,
            ),
            SubjectSpec(
                "the scaler's view of every model",
                s.scaler_status,
                _roles(R.ADMIN),
                _roles(R.SCALER),
                request_reply=True,
                reply="tg.scaler_status.v1",
            ),
        )

    async def ensure_work(self, js: JetStreamContext) -> None:
        """The work queue (the router's part of ensure)."""
        await self.ensure_stream(js, self.work, R.ROUTER)

    # -- the table ------------------------------------------------------------

    @property
    def streams(self) -> tuple[StreamSpec, ...]:
        return (
            self.work,
            self.usage,
            self.dead_letter,
            self.capture,
            self.replay,
            self.scale,
            self.audit,
            self.alerts,
            self.webhook_log,
            self.budget_log,
        )

    @property
    def buckets(self) -> tuple[BucketSpec, ...]:
        return (
            self.keys,
            self.signing_keys,
            self.tenants,
            self.webhooks,
            self.spend,
            self.ratelimits,
            self.budgets,
            self.orphans,
        )

    @property
    def consumers(self) -> tuple[ConsumerSpec, ...]:
        return (
            self.metering_usage,
            self.auth_budget,
            self.auth_webhooks,
            self.metering_capture,
            self.metering_replay,
            self.metering_webhook_log,
            self.metering_budgets,
        )

    def used_by(self, role: Role | None) -> tuple[list[StreamSpec], list[BucketSpec]]:
        """The streams and buckets a role writes or reads (all of them for ``None``).

        A role that only listens to or observes a stream does not create it.
        """
        streams = [s for s in self.streams if role is None or role in s.may_create]
        buckets = [b for b in self.buckets if role is None or role in b.writers | b.readers]
        return streams, buckets

    # -- creating it ----------------------------------------------------------

    async def ensure(self, js: JetStreamContext, role: Role | None = None) -> None:
        """Create what ``role`` uses (everything: None), and update what it writes.

        Idempotent: every service calls it at start for its own part.
        """
        streams, buckets = self.used_by(role)
        for spec in streams:
            await self.ensure_stream(js, spec, role)
        for bucket in buckets:
            await self.bucket(js, bucket)

    async def ensure_stream(
        self, js: JetStreamContext, spec: StreamSpec, role: Role | None = None
    ) -> None:
        """Create the stream; bring it to the declared shape if ``role`` writes it.

        A stream's readers may create it when it is missing (with the declared
        shape, so creating changes nothing for anyone), but only its writers
        and the operator (``role`` None) may update one that exists: that is
        what their NATS permissions allow (:mod:`tollgate.wire.permissions`).
        """
        config = spec.config(self.replicas)
        try:
            await js.add_stream(config)
        except BadRequestError as exc:
            if exc.err_code != _STREAM_NAME_EXISTS:
                raise  # an invalid or overlapping config: updating would only hide why
            if role is not None and role not in spec.writers:
                log.warning(
                    "stream %s exists with another shape; its writers bring it up to date",
                    spec.name,
                )
                return
            await js.update_stream(config)  # it exists with another shape: bring it to this one

    async def bucket(self, js: JetStreamContext, spec: BucketSpec) -> Any:
        """The bucket's handle, created first when it does not exist."""
        try:
            return await js.key_value(spec.name)
        except (BucketNotFoundError, NotFoundError):
            return await js.create_key_value(spec.config(self.replicas))


async def bucket_keys(js: JetStreamContext, name: str) -> list[str]:
    """The keys bucket ``name`` holds, from its stream's count per subject.

    A deleted or purged key is among them (its marker stays): a get tells.
    nats.py's ``KeyValue.keys()`` is not used: its listing ends when the
    consumer it creates reports nothing pending, which can be before the
    messages already on their way arrive, so a key written just before may
    be missing. The server sends the counts in pages (100,000 subjects each).
    """
    prefix = f"$KV.{name}."
    keys: list[str] = []
    while True:
        request = orjson.dumps({"subjects_filter": f"{prefix}>", "offset": len(keys)})
        reply = await js._nc.request(f"{js._prefix}.STREAM.INFO.KV_{name}", request, timeout=5)
        info = orjson.loads(reply.data)
        if "error" in info:
            raise RuntimeError(f"bucket {name}: {info['error'].get('description', info['error'])}")
        page = (info.get("state") or {}).get("subjects") or {}
        keys.extend(subject.removeprefix(prefix) for subject in page)
        if not page or len(keys) >= int(info.get("total") or 0):
            return keys


def describe(topology: Topology) -> str:
    """The topology as a Markdown table (kept in ``docs/architecture.md``)."""

    def who(roles: frozenset[Role]) -> str:
        return ", ".join(sorted(r.value for r in roles))

    rows = [
        "| kind | name | subjects | writers | readers | what |",
        "|---|---|---|---|---|---|",
    ]
    for spec in topology.streams:
        kind = "stream (work queue)" if spec.retention is RetentionPolicy.WORK_QUEUE else "stream"
        readers = who(spec.readers)
        if spec.listeners:
            readers += f"; live: {who(spec.listeners)}"
        if spec.observers:
            readers += f"; counts only: {who(spec.observers)}"
        rows.append(
            f"| {kind}, {spec.storage.value} | `{spec.name}` | `{', '.join(spec.subjects)}` "
            f"| {who(spec.writers)} | {readers} | {spec.what} |"
        )
    for bucket in topology.buckets:
        rows.append(
            f"| KV bucket, {bucket.storage.value} | `{bucket.name}` | | {who(bucket.writers)} "
            f"| {who(bucket.readers)} | {bucket.what} |"
        )
    for consumer in topology.consumers:
        rows.append(
            f"| durable consumer | `{consumer.stream}/{consumer.durable}` "
            f"| `{consumer.filter_subject}` | | {consumer.reader.value} | {consumer.what} |"
        )
    for subject in topology.core:
        kind = "request/reply" if subject.request_reply else "core subject"
        publishers = who(subject.publishers) or f"(the stream `{subject.republished_by}`)"
        rows.append(
            f"| {kind} | | `{subject.pattern}` | {publishers} "
            f"| {who(subject.subscribers)} | {subject.what} |"
        )
    return "\n".join(rows).replace("_3Cmodel_3E", "<model>") + "\n"


if __name__ == "__main__":
    print(describe(Topology(Subjects())), end="")
