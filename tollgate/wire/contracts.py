"""Wire contracts: every message body on the bus, versioned.

Each contract carries a ``type`` id such as ``tg.infer.v1``. A field is added,
never repurposed; a breaking change is a new version with a new type id.
"""

from __future__ import annotations

import math
import re
import time as _time
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator


class _Contract(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=False)


class Endpoint(StrEnum):
    """OpenAI-compatible operations a worker can serve."""

    CHAT = "chat.completions"
    COMPLETIONS = "completions"
    EMBEDDINGS = "embeddings"
    RESPONSES = "responses"
    MESSAGES = "messages"
    TOKENIZE = "tokenize"
    DETOKENIZE = "detokenize"
    RERANK = "rerank"
    SCORE = "score"

    @property
    def path(self) -> str:
        """The HTTP path clients call it on."""
        return _PATHS[self]


_PATHS = {
    Endpoint.CHAT: "/v1/chat/completions",
    Endpoint.COMPLETIONS: "/v1/completions",
    Endpoint.EMBEDDINGS: "/v1/embeddings",
    Endpoint.RESPONSES: "/v1/responses",
    Endpoint.MESSAGES: "/v1/messages",
    Endpoint.TOKENIZE: "/tokenize",  # vllm serve's paths
    Endpoint.DETOKENIZE: "/detokenize",
    Endpoint.RERANK: "/v1/rerank",
    Endpoint.SCORE: "/v1/score",
}


class Priority(StrEnum):
    """A request's class: batch work fills free capacity and yields to interactive."""

    INTERACTIVE = "interactive"
    BATCH = "batch"


# The engine's own request priority for each class (vLLM: lower runs first).
ENGINE_PRIORITY = {Priority.INTERACTIVE: 0, Priority.BATCH: 10}

# The longest a heartbeat may say the next one can take (a worker whose engine
# start holds its event loop says how long it may be silent).
MAX_BEAT_INTERVAL_S = 3600.0

# How long a worker may hold back a compact reply's START (see
# InferenceRequest.compact_reply): a call answered by then needs one message.
START_HOLD_S = 0.05


class InferenceRequest(_Contract):
    """A call waiting in a model's work-queue stream for a worker."""

    type: Literal["tg.infer.v1"] = Field(default="tg.infer.v1", description="Contract type id.")
    request_id: str = Field(description="Tollgate request id; also the client's x-request-id.")
    model: str = Field(description="Canonical model id from the catalog.")
    adapter: str | None = Field(
        default=None,
        description="The catalog id of the LoRA adapter of ``model`` the call names, if any: "
        "run on the model's workers, billed under the adapter's id.",
    )
    endpoint: Endpoint = Field(description="Which OpenAI operation to run.")
    body: dict[str, Any] = Field(description="The client's JSON body, passed to the serving layer.")
    reply_to: str = Field(description="Core NATS subject where the worker sends response chunks.")
    enqueued_at: float = Field(description="Unix time the router published the request.")
    start_by: float = Field(
        description="Unix time after which no worker may start it (the router gave up)."
    )
    deadline: float = Field(description="Unix time by which the whole request must be finished.")
    tenant: str | None = Field(default=None, description="Tenant of the API key (who pays).")
    key_id: str | None = Field(default=None, description="Id of the API key used.")
    priority: Priority = Field(
        default=Priority.INTERACTIVE, description="Its class: interactive or batch."
    )
    tenant_weight: float = Field(
        default=1.0, gt=0, le=1000, description="The tenant's share of a saturated model."
    )
    key_weight: float = Field(
        default=1.0, gt=0, le=1000, description="The key's share within its tenant."
    )
    attempt: int = Field(
        default=0, ge=0, le=8, description="0; 1 when queued again after its worker was lost."
    )
    compact_reply: bool = Field(
        default=False,
        description="The router reads compact replies: a non-stream call that ends within "
        "START_HOLD_S of its start may have no START (its first chunk carries worker_id), and "
        "a non-stream body may ride on END instead of a DATA chunk before it.",
    )

    @property
    def billed_model(self) -> str:
        """The id its usage row carries: the adapter's, else the model's."""
        return self.adapter or self.model


class Arrival(_Contract):
    """A request entered a model's work queue: what the scaler counts, without the body."""

    type: Literal["tg.arrival.v1"] = Field(default="tg.arrival.v1", description="Contract type id.")
    request_id: str = Field(description="The request that arrived.")
    model: str = Field(description="Canonical model id.")
    at: float = Field(description="Unix time the router queued it.")
    lane: str | None = Field(
        default=None, description="The work-queue subject it waits on (its lane)."
    )


class ChunkKind(StrEnum):
    START = "start"  # a worker took the request; carries worker_id
    DATA = "data"  # serving-layer output, relayed untouched
    USAGE = "usage"  # the stream's usage event; relayed only if the client asked
    END = "end"  # last chunk: usage counts and outcome
    ERROR = "error"  # an error response from the serving layer, with status


class Usage(_Contract):
    """Tokens counted by an engine. A negative count is an engine error: refused here,
    where the worker builds it, so it never reaches a usage row or a ledger."""

    prompt_tokens: int = Field(
        default=0, ge=0, description="Prompt tokens after the chat template."
    )
    completion_tokens: int = Field(default=0, ge=0, description="Tokens the engine generated.")

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


_OUTCOME_SHAPE = re.compile(r"[a-z][a-z_]{0,31}")


class Outcome(StrEnum):
    """How a request ended: on a worker's END chunk, and in every usage row.

    A worker sets the first five on its END chunk; the router sets the others
    for endings a worker cannot see. The values are stored in usage rows
    (``docs/analytics.md`` explains each): a value is added, never renamed or
    given another meaning.
    """

    # A worker's END chunk (and the usage row, when the router saw the end too):
    COMPLETED = "completed"  # the serving layer finished the response
    CANCELLED = "cancelled"  # the router cancelled (client gone or deadline)
    EXPIRED = "expired"  # dropped before start: start_by had passed
    ERROR = "error"  # the serving layer returned an error response
    DRAINED = "drained"  # never run because the worker was shutting down
    # Only in usage rows, set by the router:
    CLIENT_DISCONNECTED = "client_disconnected"  # the client went away before the end
    WORKER_LOST = "worker_lost"  # the worker stopped heartbeating, or its chunks broke off
    DEADLINE_EXCEEDED = "deadline_exceeded"  # the request ran past its deadline
    NO_CAPACITY = "no_capacity"  # no worker took it within the queue timeout (503)
    NOT_DISPATCHED = "not_dispatched"  # the model's queue could not be reached (503)
    LOST = "lost"  # the worker's final report never came (after an error response)
    INTERNAL_ERROR = "internal_error"  # the router failed while relaying (500)
    # The router that held the call stopped before its end (killed); its next
    # run billed the worker's final report, or nothing when none came:
    ROUTER_LOST = "router_lost"

    @classmethod
    def _missing_(cls, value: object) -> Outcome | None:
        # A reader older than the writer keeps an outcome it does not know, as
        # it is: a usage event is billed, never refused for a new value. Only
        # a value shaped like ours is kept (a short snake_case word), so no
        # publisher can put arbitrary text into the billing column.
        if not isinstance(value, str) or not _OUTCOME_SHAPE.fullmatch(value):
            return None
        member = str.__new__(cls, value)
        member._name_ = "UNKNOWN"
        member._value_ = value
        return member


class ResponseChunk(_Contract):
    """One ordered piece of a response, sent on the request's reply subject."""

    type: Literal["tg.chunk.v1"] = Field(default="tg.chunk.v1", description="Contract type id.")
    request_id: str = Field(description="The request this chunk belongs to.")
    seq: int = Field(description="0-based sequence number; the router checks the order.")
    kind: ChunkKind = Field(description="What the chunk carries.")
    data: str | None = Field(
        default=None,
        description="Serving-layer output: one SSE event ('data: ...\\n\\n') or a JSON body "
        "(on DATA; on END of a compact reply, the non-stream body).",
    )
    status: int | None = Field(default=None, description="HTTP status for ERROR chunks.")
    worker_id: str | None = Field(
        default=None,
        description="Set on START and END: who runs it (a compact reply without START: END).",
    )
    usage: Usage | None = Field(
        default=None,
        description="On END: the engine's counts. On streamed DATA: the counts so far.",
    )
    outcome: Outcome | None = Field(default=None, description="Set on END: how it ended.")
    finish_reason: str | None = Field(
        default=None, description="Set on END when known: stop, length, ..."
    )


class CancelRequest(_Contract):
    type: Literal["tg.cancel.v1"] = Field(default="tg.cancel.v1", description="Contract type id.")
    request_id: str = Field(description="The request to abort.")
    reason: str = Field(default="client_disconnected", description="Why it is cancelled.")


class WorkerState(StrEnum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"


class WorkerHeartbeat(_Contract):
    """A worker's load, published every ``interval_s`` on its model's subject."""

    type: Literal["tg.heartbeat.v1"] = Field(
        default="tg.heartbeat.v1", description="Contract type id."
    )
    worker_id: str = Field(description="Unique id of the worker process.")
    model: str = Field(description="Canonical model id it serves.")
    engine: str = Field(description="'vllm' or 'simulated'.")
    state: WorkerState = Field(description="Lifecycle state.")
    slots_used: int = Field(description="Requests it is running now.")
    slots_total: int = Field(description="Requests it runs at most at once (max_num_seqs).")
    queue: int = Field(default=0, description="Requests waiting inside its engine.")
    kv_cache_usage: float | None = Field(default=None, description="KV cache use, 0..1.")
    interval_s: float = Field(
        gt=0,
        le=MAX_BEAT_INTERVAL_S,
        description="Seconds until the next heartbeat (at most an hour: a beat cannot keep a "
        "silent worker counted for longer).",
    )
    sent_at: float = Field(description="Unix time it was sent.")
    startup_s: float | None = Field(
        default=None, description="Once ready: seconds from the process start to ready."
    )
    startup_parts: dict[str, float] | None = Field(
        default=None,
        description="Once ready: startup_s by part (process, fetch, convert, engine, warmup).",
    )
    started_at: float | None = Field(
        default=None, description="Unix time the worker process started."
    )
    prefix_cache_queries: int | None = Field(
        default=None,
        ge=0,
        description="Prompt tokens its engine looked up in its prefix cache since the worker "
        "started (vLLM's vllm:prefix_cache_queries); None when the engine does not report it.",
    )
    prefix_cache_hits: int | None = Field(
        default=None,
        ge=0,
        description="Of those, tokens found in the cache (computed once, reused) since the "
        "worker started (vLLM's vllm:prefix_cache_hits); None when the engine does not "
        "report it.",
    )
    prefix_cache_hit_rate: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="Hits / queries over the last 10 seconds (a few heartbeats); None when "
        "no prompt token was looked up then, or the engine does not report its cache.",
    )
    tokens_total: int | None = Field(
        default=None,
        ge=0,
        description="Prompt + completion tokens of the requests it has finished since it "
        "started: the scaler's tokens per second, without reading every usage event.",
    )
    takes_offers: bool = Field(
        default=False,
        description="It claims the requests routers offer it on tg.offers.<model>.<worker> "
        "(its direct lanes, under fair share). Set only by earlier versions: routers no "
        "longer send these offers, and announce an arrival to a worker that says only this.",
    )
    takes_queued: bool = Field(
        default=False,
        description="It claims the copies the work queue sends it on "
        "tg.queued.<model>.<worker> of the requests stored in its direct lanes (under fair "
        "share); a router announces no arrival for a direct request of a worker that says "
        "so while the queue sends those copies, and announces one otherwise.",
    )


# Bounds every reader of a usage event applies (the contract's own validation):
# no request reaches MAX_TOKENS of either kind, and no event ended before 2000
# or more than a day after the reader's clock.
MAX_TOKENS = 10_000_000
EARLIEST_TIME = 946_684_800.0  # 2000-01-01
LATEST_AHEAD_S = 86_400.0


def _clamped_duration(value: Any, unknown: float | None) -> Any:
    """A negative duration is 0, a non-finite one unknown: timings never cost the row."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return value  # None, or not a number at all: the field's own type decides
    if not math.isfinite(value):
        return unknown
    return max(0.0, float(value))


class UsageEvent(_Contract):
    """One per accepted request, whatever its ending: what billing counts.

    Every consumer (the metering writer, the budget ledger) reads it through
    this contract, so an event either passes the same checks everywhere or is
    refused everywhere: token counts are between 0 and 10,000,000, the
    time between 2000 and a day ahead of the reader's clock (``now`` in the
    validation context, else the clock), the HTTP status a 16-bit number.
    Timings do not decide the bill: a negative one is read as 0 and a
    non-finite one as unknown, never a reason to refuse the event.
    """

    type: Literal["tg.usage.v1"] = Field(default="tg.usage.v1", description="Contract type id.")
    request_id: str = Field(description="The request (also Nats-Msg-Id and x-request-id).")
    time: float = Field(
        ge=EARLIEST_TIME,
        allow_inf_nan=False,
        description="Unix time the request ended (at most a day ahead of the reader's clock).",
    )
    tenant: str = Field(description="Who pays.")
    key_id: str | None = Field(default=None, description="The API key used (none: auth off).")
    model: str = Field(description="Canonical model id.")
    worker_id: str | None = Field(default=None, description="Worker that ran it, if any.")
    prompt_tokens: int = Field(
        ge=0, le=MAX_TOKENS, description="Prompt tokens, as the engine counted them."
    )
    completion_tokens: int = Field(
        ge=0, le=MAX_TOKENS, description="Completion tokens, as the engine counted them."
    )
    outcome: Outcome = Field(
        description="How it ended (completed, client_disconnected, worker_lost, ...); the "
        "wire value is the enum's string."
    )
    finish_reason: str | None = Field(default=None, description="stop, length, ... when known.")
    streamed: bool = Field(description="Whether the client asked for a stream.")
    queue_s: float | None = Field(default=None, ge=0, description="Seconds until a worker took it.")
    ttft_s: float | None = Field(default=None, ge=0, description="Seconds until the first output.")
    total_s: float = Field(ge=0, description="Seconds from arrival to the end.")
    http_status: int = Field(ge=0, lt=2**16, description="HTTP status the client got.")
    attempts: int = Field(
        default=1,
        ge=1,
        le=9,
        description="Times it was queued: 2 when its first worker was lost before any "
        "output and another served it.",
    )
    priority: Priority = Field(default=Priority.INTERACTIVE, description="Its class.")
    endpoint: str = Field(
        default="",
        description="The operation called (chat.completions, completions, embeddings, ...); "
        "empty from routers that do not say.",
    )

    @field_validator("queue_s", "ttft_s", mode="before")
    @classmethod
    def _optional_duration(cls, value: Any) -> Any:
        return _clamped_duration(value, unknown=None)

    @field_validator("total_s", mode="before")
    @classmethod
    def _duration(cls, value: Any) -> Any:
        return _clamped_duration(value, unknown=0.0)

    @field_validator("time")
    @classmethod
    def _not_in_the_future(cls, value: float, info: ValidationInfo) -> float:
        context = info.context if isinstance(info.context, dict) else {}
        now = context.get("now")
        latest = (now if isinstance(now, int | float) else _time.time()) + LATEST_AHEAD_S
        if value > latest:
            raise ValueError(f"more than {LATEST_AHEAD_S:.0f} s ahead of the reader's clock")
        return value


class QueryRequest(_Contract):
    """A read-only ClickHouse query for the metering service (``tg.metering.query``)."""

    type: Literal["tg.query.v1"] = Field(default="tg.query.v1", description="Contract type id.")
    sql: str = Field(description="One SELECT-like statement; server-side {name:Type} parameters.")
    parameters: dict[str, Any] = Field(
        default_factory=dict, description="Values for the statement's {name:Type} parameters."
    )
    max_rows: int = Field(default=10_000, ge=1, description="Most rows to return.")


class QueryResult(_Contract):
    """The answer to a :class:`QueryRequest`: rows, or an error message."""

    type: Literal["tg.query_result.v1"] = Field(
        default="tg.query_result.v1", description="Contract type id."
    )
    columns: list[str] = Field(default_factory=list, description="Column names.")
    types: list[str] = Field(default_factory=list, description="ClickHouse column types.")
    rows: list[list[Any]] = Field(default_factory=list, description="Rows, JSON-encoded values.")
    truncated: bool = Field(default=False, description="More rows matched than max_rows.")
    error: str | None = Field(default=None, description="Why the query failed.")


class InvoiceRequest(_Contract):
    """A tenant's invoice for a month, asked of the metering service (``tg.metering.invoice``).

    The admin API asks this, not a query: the auth service gets invoices, never
    the usage data itself (captured exchanges included).
    """

    type: Literal["tg.invoice_request.v1"] = Field(
        default="tg.invoice_request.v1", description="Contract type id."
    )
    tenant: str = Field(min_length=1, max_length=200, description="The tenant to invoice.")
    month: str = Field(
        pattern=r"^(19[7-9][0-9]|20[0-9][0-9]|210[0-5])-(0[1-9]|1[0-2])$",
        description="The month, YYYY-MM (UTC).",
    )


class InvoiceAnswer(_Contract):
    """The answer to an :class:`InvoiceRequest`: the invoice with its check, or an error."""

    type: Literal["tg.invoice.v1"] = Field(default="tg.invoice.v1", description="Contract type id.")
    invoice: dict[str, Any] | None = Field(
        default=None, description="The invoice (tollgate/invoices.py) and its `check`."
    )
    error: str | None = Field(default=None, description="Why it could not be computed.")


class CaptureEvent(_Contract):
    """A request and its response, kept for traffic analysis and replay (``tg.capture.*``).

    Only for keys or tenants with capture switched on. Bodies are cut at the
    router's size cap (``*_truncated`` says so).
    """

    type: Literal["tg.capture.v1"] = Field(default="tg.capture.v1", description="Contract type id.")
    request_id: str = Field(description="Same id as the usage row and x-request-id.")
    time: float = Field(description="Unix time the request ended.")
    tenant: str = Field(description="Who pays.")
    key_id: str | None = Field(default=None, description="The API key used.")
    model: str = Field(description="Canonical model id.")
    endpoint: str = Field(description="chat.completions or completions.")
    streamed: bool = Field(description="Whether the client asked for a stream.")
    request_body: str = Field(description="The client's JSON body.")
    request_truncated: bool = Field(default=False, description="request_body was cut.")
    response_text: str = Field(default="", description="The generated text (streams reassembled).")
    response_body: str = Field(default="", description="The JSON response (a stream: rebuilt).")
    response_truncated: bool = Field(default=False, description="The response was cut.")
    finish_reason: str | None = Field(default=None, description="stop, length, ...")
    outcome: Outcome = Field(description="As in the usage row.")
    http_status: int = Field(description="HTTP status the client got.")
    prompt_tokens: int = Field(default=0, description="Engine's prompt tokens.")
    completion_tokens: int = Field(default=0, description="Engine's completion tokens.")
    ttft_s: float | None = Field(default=None, description="Seconds until the first output.")
    total_s: float = Field(description="Seconds from arrival to the end.")

    @classmethod
    def from_usage(cls, event: UsageEvent, **fields: Any) -> CaptureEvent:
        """The capture of the request ``event`` bills.

        Every field the two contracts share by name (request, tenant, model,
        outcome, status, tokens, timings) comes from the usage event, so the
        capture row always agrees with the usage row; ``fields`` give the rest
        (endpoint, bodies, ...) and win over the shared ones.
        """
        shared = (cls.model_fields.keys() & UsageEvent.model_fields.keys()) - {"type"}
        return cls(**{**{name: getattr(event, name) for name in shared}, **fields})


class ReplayResult(_Contract):
    """One captured request sent again to a model, compared with the original (``tg.replay.*``)."""

    type: Literal["tg.replay.v1"] = Field(default="tg.replay.v1", description="Contract type id.")
    replay_id: str = Field(description="One id per `tollgate replay` run.")
    request_id: str = Field(description="The captured request replayed.")
    time: float = Field(description="Unix time of the replay.")
    original_model: str = Field(description="Model that answered the capture.")
    model: str = Field(description="Model the replay went to.")
    http_status: int = Field(description="Status of the replayed call.")
    original_completion_tokens: int = Field(description="Length of the captured answer.")
    completion_tokens: int = Field(description="Length of the replayed answer.")
    original_finish_reason: str | None = Field(default=None, description="Captured finish reason.")
    finish_reason: str | None = Field(default=None, description="Replayed finish reason.")
    original_total_s: float = Field(description="Captured latency.")
    total_s: float = Field(description="Replayed latency.")
    exact_match: bool = Field(description="Replayed text equals the captured text.")
    original_repetition: float = Field(description="Repetition score of the captured text.")
    repetition: float = Field(description="Repetition score of the replayed text (0..1).")


class SpendAlert(_Contract):
    """A key's or tenant's spend passed a threshold of its budget for the period.

    Published once per threshold, budget and period (``alert_id`` is its
    ``Nats-Msg-Id``, and a marker in ``tg_spend`` records it as sent), by the
    budget ledger that counted the usage that passed it.
    """

    type: Literal["tg.spend-alert.v1"] = "tg.spend-alert.v1"
    alert_id: str = Field(
        description="<key id or t.<tenant>>.<window>.<tokens|CUR>.<budget>.<threshold>: the "
        "same alert has the same id, however often it is sent."
    )
    at: float = Field(description="Unix time it was found.")
    scope: Literal["key", "tenant"] = Field(description="Whose budget: a key's or a tenant's.")
    tenant: str
    key_id: str | None = Field(default=None, description="The key, for a key's budget.")
    period: Literal["day", "month", "total"]
    window: str = Field(description="The period it counts in: 20261130, 202611 or total.")
    unit: str = Field(description="`tokens`, or the money budget's currency (`USD`).")
    threshold_pct: int = Field(ge=1, le=100, description="The threshold passed, in percent.")
    budget: str = Field(description="The budget: tokens, or an amount in `unit` (decimal).")
    spent: str = Field(description="What was spent when it was passed (same unit).")


class WebhookCall(_Contract):
    """One attempt to deliver a spend alert to a webhook endpoint: the delivery log.

    Published by the auth service after every POST, before the alert counts as
    delivered to that endpoint; the metering service keeps it in ClickHouse
    (``webhook_calls``).
    """

    type: Literal["tg.webhook-call.v1"] = "tg.webhook-call.v1"
    call_id: str = Field(min_length=1, max_length=200, description="This attempt's own id.")
    alert_id: str = Field(max_length=400, description="The alert (`Tollgate-Delivery`).")
    webhook_id: str = Field(max_length=200)
    tenant: str = Field(description="The alert's tenant.")
    url: str = Field(
        max_length=2048,
        description="Where it was sent: scheme, host, port and path (no credentials, no query).",
    )
    attempt: int = Field(ge=1, description="1 for the alert's first delivery round, then 2, ...")
    time: float = Field(description="Unix time the POST was sent.")
    outcome: Literal["delivered", "refused", "unreachable"] = Field(
        description="delivered: a 2xx; refused: any other status; unreachable: no answer in time."
    )
    http_status: int | None = Field(default=None, ge=100, le=999)
    error: str | None = Field(
        default=None, max_length=200, description="Why there was no answer (unreachable)."
    )
    seconds: float = Field(ge=0, description="How long the endpoint took.")


class BudgetSet(_Contract):
    """A key's or tenant's budgets as set now: published whenever its record changes.

    The auth service follows the key and tenant records and publishes each
    version, so that ClickHouse (``budgets``) can put spend beside budgets.
    ``revision`` orders the versions of one key's or tenant's record.
    """

    type: Literal["tg.budget.v1"] = "tg.budget.v1"
    scope: Literal["key", "tenant"]
    tenant: str
    key_id: str | None = Field(default=None, description="The key, for a key's budgets.")
    revision: int = Field(ge=0, description="The record's revision in its bucket.")
    time: float = Field(description="Unix time this version was seen.")
    period: Literal["day", "month", "total"] | None = None
    budget_tokens: int | None = Field(default=None, ge=0)
    budget_amount: str | None = Field(
        default=None, max_length=40, description="A money budget (decimal) in budget_currency."
    )
    budget_currency: str | None = Field(default=None, max_length=3)
    state: Literal["active", "over_budget", "revoked", "removed"] = Field(
        description="removed: the record is gone (a tenant's limits cleared)."
    )
