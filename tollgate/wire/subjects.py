"""Subject and stream names on the bus.

Model ids such as ``HuggingFaceTB/SmolLM2-135M-Instruct`` are not valid NATS
subject tokens or JetStream stream names (``.`` splits tokens; ``/``, ``*``,
``>`` and whitespace are not allowed). :func:`model_token` is the one function
that turns a model id into a token; every subject and stream name for a model
is built from it.
"""

from __future__ import annotations

import functools
import re
import string
from dataclasses import dataclass

# One lower-case subject token: it is also the start of every stream name
# (upper-cased) and bucket name. Lower case only, so that two prefixes never
# name the same stream; no ``_``, so that a prefix never ends where another
# prefix's stream or bucket name continues.
PREFIX_PATTERN = re.compile(r"[a-z][a-z0-9-]{0,31}")

# Characters kept as they are. Everything else, ``_`` included, is escaped as
# ``_XX`` per UTF-8 byte, so the mapping is injective (two different ids never
# share a token) and reversible.
_SAFE = frozenset(string.ascii_letters + string.digits + "-")


@functools.lru_cache(maxsize=4096)
def model_token(model_id: str) -> str:
    """Return the subject-safe token for ``model_id``.

    The token uses only ``[A-Za-z0-9_-]``, so it is valid as a subject token,
    a stream name and a consumer name.
    """
    if not model_id:
        raise ValueError("model id must not be empty")
    out: list[str] = []
    for ch in model_id:
        if ch in _SAFE:
            out.append(ch)
        else:
            out.extend(f"_{b:02X}" for b in ch.encode("utf-8"))
    return "".join(out)


# The header of a request in a worker's direct lane that its worker may claim
# by its sequence: the work queue's creation time as its router last read it.
# The queue's copy carries it to the worker, which uses that sequence only if
# the copy comes from the queue the worker read (a queue made again counts
# sequences from 1, so an old sequence may name another request there).
QUEUE_HEADER = "Tollgate-Queue"


@dataclass(frozen=True)
class Lane:
    """The parts of a lane subject (:meth:`Subjects.infer_lane`), tokens as they are.

    ``worker`` is set on a worker's direct lane (cache-aware routing): the
    request waits there for that worker first. ``group`` is the shared lane
    of the same class, tenant and key, which fair share counts it under.
    """

    subject: str
    priority: str
    tenant: str
    key: str
    worker: str | None = None

    @staticmethod
    def parse(subject: str) -> Lane | None:
        """The lane of a work-queue subject; None for anything else."""
        return _parse_lane(subject)

    @property
    def group(self) -> str:
        """The shared lane's subject (this subject less its worker token)."""
        return self.subject if self.worker is None else self.subject.rpartition(".")[0]


@functools.lru_cache(maxsize=4096)
def _parse_lane(subject: str) -> Lane | None:
    # cached: a worker parses the same few lanes on every take (a Lane is immutable)
    parts = subject.split(".")
    if len(parts) not in (6, 7) or parts[1] != "infer":
        return None
    worker = parts[6] if len(parts) == 7 else None
    return Lane(subject, parts[3], parts[4], parts[5], worker)


def model_id_from_token(token: str) -> str:
    """Invert :func:`model_token`."""
    raw = bytearray()
    i = 0
    while i < len(token):
        ch = token[i]
        if ch == "_":
            raw.append(int(token[i + 1 : i + 3], 16))
            i += 3
        else:
            raw.extend(ch.encode("ascii"))
            i += 1
    return raw.decode("utf-8")


@dataclass(frozen=True)
class Subjects:
    """All subject and stream names, under one configurable prefix.

    ``replicas`` is how many copies JetStream keeps of each stream and
    key-value bucket Tollgate creates (1 on one server, 3 on a cluster).
    """

    prefix: str = "tg"
    replicas: int = 1

    def __post_init__(self) -> None:
        if not PREFIX_PATTERN.fullmatch(self.prefix):
            raise ValueError(
                f"subject prefix {self.prefix!r} must match {PREFIX_PATTERN.pattern} "
                "(it also names streams and key-value buckets)"
            )

    @property
    def stream_prefix(self) -> str:
        return self.prefix.upper()

    def bucket(self, name: str) -> str:
        """A key-value bucket's name under this prefix (``tg_keys``)."""
        return f"{self.prefix}_{name}"

    def infer_lane(
        self,
        model_id: str,
        priority: str,
        tenant: str,
        key_id: str | None,
        worker_id: str | None = None,
    ) -> str:
        """The work-queue subject of one lane: a model's requests of one class, tenant and key.

        ``tg.infer.<model>.<class>.<tenant>.<key>``: the workers of a model take
        from its lanes by weight (:mod:`services.worker.fairshare`), so that one
        tenant's backlog does not hold up another's requests. With ``worker_id``,
        that worker's direct lane of the same class, tenant and key
        (``...<key>.<worker>``): cache-aware routing sends a request there, to
        the worker that likely holds its prompt's prefix.
        """
        lane = (
            f"{self.prefix}.infer.{model_token(model_id)}.{priority}."
            f"{model_token(tenant)}.{model_token(key_id) if key_id else '-'}"
        )
        return lane if worker_id is None else f"{lane}.{model_token(worker_id)}"

    def infer_lanes(self, model_id: str) -> str:
        """Every lane of one model, shared and direct (a wildcard)."""
        return f"{self.prefix}.infer.{model_token(model_id)}.>"

    def infer_shared_lanes(self, model_id: str) -> str:
        """The shared lanes of one model, without the workers' direct ones (a wildcard)."""
        return f"{self.prefix}.infer.{model_token(model_id)}.*.*.*"

    def infer_direct_lanes(self, model_id: str, worker_id: str) -> str:
        """One worker's direct lanes for one model (a wildcard)."""
        return f"{self.prefix}.infer.{model_token(model_id)}.*.*.*.{model_token(worker_id)}"

    @property
    def infer_direct_all(self) -> str:
        """Every worker's direct lanes, of every model (a wildcard: a lane and one more token)."""
        return f"{self.prefix}.infer.*.*.*.*.*"

    @property
    def offers_by_lane(self) -> str:
        """Where the work queue sends a copy of each request stored in a direct lane.

        A subject mapping of :attr:`infer_direct_all`: the lane's model and
        worker, as in :meth:`offer`.
        """
        return f"{self.prefix}.queued.{{{{wildcard(1)}}}}.{{{{wildcard(5)}}}}"

    @property
    def infer_all(self) -> str:
        return f"{self.prefix}.infer.>"

    @property
    def infer_stream(self) -> str:
        """The work-queue stream that holds every model's waiting requests (a subject per lane)."""
        return f"{self.stream_prefix}_INFER"

    def reply_prefix(self, router_id: str) -> str:
        """Prefix of the reply subjects of one router instance."""
        return f"{self.prefix}.reply.{router_id}"

    def reply(self, router_id: str, request_id: str) -> str:
        return f"{self.reply_prefix(router_id)}.{request_id}"

    def cancel(self, request_id: str) -> str:
        return f"{self.prefix}.cancel.{request_id}"

    @property
    def cancel_all(self) -> str:
        return f"{self.prefix}.cancel.*"

    def heartbeat(self, model_id: str) -> str:
        return f"{self.prefix}.workers.{model_token(model_id)}"

    @property
    def heartbeat_all(self) -> str:
        return f"{self.prefix}.workers.*"

    def usage(self, tenant: str, budget: bool = True) -> str:
        """Usage events of one tenant (tenant ids are escaped like model ids).

        ``budget``: the call's key has a token budget, so the budget ledger
        counts the event as well as metering (``.budget``); else metering
        alone reads it (``.plain``), and the ledger never sees it.
        """
        return f"{self.prefix}.usage.{model_token(tenant)}.{'budget' if budget else 'plain'}"

    def usage_tenant(self, tenant: str) -> str:
        """Every usage event of one tenant, budget or not."""
        return f"{self.prefix}.usage.{model_token(tenant)}.*"

    @property
    def usage_all(self) -> str:
        """Every usage event (and those of routers that named the tenant only)."""
        return f"{self.prefix}.usage.>"

    @property
    def usage_budget(self) -> str:
        """The usage events of keys with a token budget: what the budget ledger counts."""
        return f"{self.prefix}.usage.*.budget"

    @property
    def usage_stream(self) -> str:
        return f"{self.stream_prefix}_USAGE"

    @property
    def usage_dead_letter(self) -> str:
        """Usage messages the metering service could not read, with the reason."""
        return f"{self.prefix}.deadletter.usage"

    @property
    def dead_letter_stream(self) -> str:
        return f"{self.stream_prefix}_DEADLETTER"

    @property
    def metering_query(self) -> str:
        """Request/reply: read-only queries that the metering service runs."""
        return f"{self.prefix}.metering.query"

    @property
    def metering_invoice(self) -> str:
        """Request/reply: a tenant's monthly invoice, computed by the metering service."""
        return f"{self.prefix}.metering.invoice"

    def drain(self, worker_id: str) -> str:
        """Control subject that tells one worker to drain and exit."""
        return f"{self.prefix}.control.drain.{worker_id}"

    def scale(self, model_id: str) -> str:
        """The scaler's decisions for one model (JetStream, for audit and dashboards)."""
        return f"{self.prefix}.scale.{model_token(model_id)}"

    @property
    def scale_all(self) -> str:
        return f"{self.prefix}.scale.*"

    @property
    def scale_stream(self) -> str:
        return f"{self.stream_prefix}_SCALE"

    @property
    def scaler_status(self) -> str:
        """Request/reply: the scaler's view of every model it manages."""
        return f"{self.prefix}.scaler.status"

    def capture(self, tenant: str) -> str:
        """Captured requests and responses of one tenant (JetStream)."""
        return f"{self.prefix}.capture.{model_token(tenant)}"

    @property
    def capture_all(self) -> str:
        return f"{self.prefix}.capture.*"

    @property
    def capture_stream(self) -> str:
        return f"{self.stream_prefix}_CAPTURE"

    def replay(self, model_id: str) -> str:
        """Results of `tollgate replay` runs against one model (JetStream)."""
        return f"{self.prefix}.replay.{model_token(model_id)}"

    @property
    def replay_all(self) -> str:
        return f"{self.prefix}.replay.*"

    @property
    def replay_stream(self) -> str:
        return f"{self.stream_prefix}_REPLAY"

    def arrivals(self, model_id: str) -> str:
        """A small event per request entering a model's queue (no body): wakes the scaler."""
        return f"{self.prefix}.arrivals.{model_token(model_id)}"

    @property
    def arrivals_all(self) -> str:
        return f"{self.prefix}.arrivals.*"

    def offer(self, model_id: str, worker_id: str) -> str:
        """A copy of each request stored in one worker's direct lane, which the queue sends it."""
        return f"{self.prefix}.queued.{model_token(model_id)}.{model_token(worker_id)}"

    @property
    def audit(self) -> str:
        """Changes to the whitelist and the signing keys (JetStream)."""
        return f"{self.prefix}.audit.keys"

    def spend_alert(self, tenant: str) -> str:
        """Spend alerts of one tenant's keys and of the tenant (JetStream)."""
        return f"{self.prefix}.alerts.spend.{model_token(tenant)}"

    @property
    def spend_alerts_all(self) -> str:
        return f"{self.prefix}.alerts.spend.*"

    @property
    def alerts_stream(self) -> str:
        return f"{self.stream_prefix}_ALERTS"

    def webhook_call(self, tenant: str) -> str:
        """The delivery log: each attempt to deliver a tenant's spend alert (JetStream)."""
        return f"{self.prefix}.billing.webhooks.{model_token(tenant)}"

    @property
    def webhook_calls_all(self) -> str:
        return f"{self.prefix}.billing.webhooks.*"

    @property
    def webhook_log_stream(self) -> str:
        return f"{self.stream_prefix}_WEBHOOK_LOG"

    def budget(self, tenant: str) -> str:
        """A tenant's or its keys' budgets as set, each time they change (JetStream)."""
        return f"{self.prefix}.billing.budgets.{model_token(tenant)}"

    @property
    def budgets_all(self) -> str:
        return f"{self.prefix}.billing.budgets.*"

    @property
    def budgets_stream(self) -> str:
        return f"{self.stream_prefix}_BUDGETS"

    @property
    def audit_stream(self) -> str:
        return f"{self.stream_prefix}_AUDIT"

    @property
    def keys_bucket(self) -> str:
        """The whitelist: key id -> key record."""
        return self.bucket("keys")

    @property
    def signing_bucket(self) -> str:
        """Public halves of the signing keys: kid -> signing-key record."""
        return self.bucket("signing_keys")

    @property
    def tenants_bucket(self) -> str:
        """Tenant-wide limits: tenant token -> tenant record."""
        return self.bucket("tenants")

    @property
    def webhooks_bucket(self) -> str:
        """Webhook endpoints of spend alerts: id -> endpoint record (its secret included)."""
        return self.bucket("webhooks")

    @property
    def spend_bucket(self) -> str:
        """Tokens spent per key and budget period, counted by the auth ledger."""
        return self.bucket("spend")

    @property
    def orphan_bucket(self) -> str:
        """Final reports (END chunks) no router took, by request id: the router had died."""
        return self.bucket("orphans")

    @property
    def ratelimit_bucket(self) -> str:
        """Requests and tokens per key and minute (routers, compare-and-set)."""
        return self.bucket("ratelimits")

    @property
    def budget_bucket(self) -> str:
        """Tokens reserved and used per key and budget period (routers, compare-and-set)."""
        return self.bucket("budgets")
