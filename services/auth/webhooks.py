"""Spend alerts to their webhooks: signed, retried until acknowledged, each delivered once.

The durable ``auth-webhooks`` consumer reads ``TG_ALERTS``. Each alert is
POSTed to every endpoint that wants its tenant (``tg_webhooks``), as JSON,
signed (:func:`tollgate.keys.webhooks.sign`) and named by the headers
``Tollgate-Delivery`` (the alert's id: a receiver may use it to drop a
duplicate) and ``Tollgate-Webhook``. An endpoint has acknowledged an alert
when it answers 2xx within the timeout; a marker ``hook.<alert id>.<webhook
id>`` in ``tg_spend`` then records it, so a redelivered alert, or one read
again after a restart, never reaches that endpoint twice. The alert is acked
once every endpoint has it; until then it is handed back with a delay that
doubles from ``retry_s`` to ten minutes, so an endpoint that is down gets it
when it comes back, and the others are not called again.

Every attempt goes to the delivery log (``tg.webhook-call.v1`` on
``TG_WEBHOOK_LOG``; the metering service keeps it in ClickHouse,
``webhook_calls``): where it went (without credentials or query), the
status or why there was none, and how long it took.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import Annotated, Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
from faststream import Context
from faststream.middlewares import AckPolicy
from faststream.nats import PullSub
from faststream.nats.message import NatsBatchMessage
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from services.auth.metrics import AuthMetrics
from tollgate.keys.webhooks import SIGNATURE_HEADER, WebhookRecord, WebhookStore, sign
from tollgate.wire import codec, control
from tollgate.wire.contracts import SpendAlert, WebhookCall
from tollgate.wire.permissions import inbox_prefix
from tollgate.wire.topology import Role, Topology

log = logging.getLogger("tollgate.auth.webhooks")

TIMEOUT_S = 10.0  # an endpoint's answer; longer is a failed attempt
MAX_RETRY_S = 600.0


class WebhookDispatcher:
    def __init__(
        self,
        js: Any,
        topology: Topology,
        retry_s: float = 5.0,
        metrics: AuthMetrics | None = None,
    ) -> None:
        self.js = js
        self.topology = topology
        self.retry_s = retry_s
        self.metrics = metrics
        self.store = WebhookStore(js, topology)
        self.spend: Any = None
        self.http: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        await self.topology.ensure_stream(self.js, self.topology.alerts, Role.AUTH)
        await self.topology.ensure_stream(self.js, self.topology.webhook_log, Role.AUTH)
        await self.store.open()
        self.spend = await self.topology.bucket(self.js, self.topology.spend)
        consumer = self.topology.auth_webhooks
        await self.js.add_consumer(consumer.stream, self._consumer_config())
        self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT_S))

    async def close(self) -> None:
        if self.http is not None:
            await self.http.close()

    def _consumer_config(self) -> Any:
        # an alert is handed back (nak with a delay) until every endpoint has it
        return self.topology.auth_webhooks.config(ack_wait=TIMEOUT_S * 4, max_deliver=-1)

    def subscribe(self, broker: control.ControlBroker) -> None:
        consumer = self.topology.auth_webhooks
        broker.subscriber(
            consumer.filter_subject,
            stream=control.stream(self.topology.alerts),
            durable=consumer.durable,
            config=self._consumer_config(),
            pull_sub=PullSub(batch_size=20, timeout=0.5, batch=True),
            inbox_prefix=f"{inbox_prefix(self.topology, Role.AUTH)}.".encode(),
            ack_policy=AckPolicy.MANUAL,
            decoder=control.contracts(SpendAlert),
            title="auth-webhooks",
            description=consumer.what,
        )(self.deliver_batch)

    async def deliver_batch(
        self,
        alerts: list[SpendAlert | None],
        batch: Annotated[NatsBatchMessage, Context("message")],
    ) -> None:
        """Deliver each alert of the batch at once; ack each once every endpoint has it."""
        await asyncio.gather(
            *(
                self._settle(alert, msg)
                for alert, msg in zip(alerts, batch.raw_message, strict=True)
            )
        )

    async def _settle(self, alert: SpendAlert | None, msg: Any) -> None:
        if alert is None:
            log.error("invalid spend alert skipped", extra={"subject": msg.subject})
            await msg.ack()
            return
        attempt = int(msg.metadata.num_delivered or 1)
        try:
            done = await self.deliver(alert, attempt)
        except Exception as exc:  # NATS away: the alert comes again
            log.warning("delivering a spend alert failed: %s: %s", type(exc).__name__, exc)
            done = False
        if done:
            await msg.ack()
            return
        await msg.nak(delay=min(MAX_RETRY_S, self.retry_s * 2 ** (attempt - 1)))

    async def deliver(self, alert: SpendAlert, attempt: int = 1) -> bool:
        """POST the alert to every endpoint that wants it and does not have it; all have it?"""
        endpoints = [w for w in await self.store.all() if w.wants(alert.tenant)]
        results = await asyncio.gather(
            *(self._to(endpoint, alert, attempt) for endpoint in endpoints)
        )
        return all(results)

    async def _to(self, endpoint: WebhookRecord, alert: SpendAlert, attempt: int) -> bool:
        marker = f"hook.{alert.alert_id}.{endpoint.webhook_id}"
        with contextlib.suppress(KeyNotFoundError):
            await self.spend.get(marker)
            return True  # delivered before
        body = codec.encode(alert)
        headers = {
            "Content-Type": "application/json",
            "User-Agent": "Tollgate-Webhooks/1",
            SIGNATURE_HEADER: sign(endpoint.secret, body),
            "Tollgate-Delivery": alert.alert_id,
            "Tollgate-Webhook": endpoint.webhook_id,
        }
        assert self.http is not None
        sent, started = time.time(), time.monotonic()
        status: int | None = None
        error: str | None = None
        try:
            # a redirect is not followed: the alert goes to the URL the operator set, or fails
            async with self.http.post(
                endpoint.url, data=body, headers=headers, allow_redirects=False
            ) as response:
                status = response.status
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            error = type(exc).__name__
        ok = status is not None and 200 <= status < 300
        call = WebhookCall(
            call_id=uuid.uuid4().hex,
            alert_id=alert.alert_id,
            webhook_id=endpoint.webhook_id,
            tenant=alert.tenant,
            url=public_url(endpoint.url),
            attempt=attempt,
            time=sent,
            outcome="delivered" if ok else ("unreachable" if status is None else "refused"),
            http_status=status,
            error=error,
            seconds=round(time.monotonic() - started, 6),
        )
        if self.metrics is not None:
            self.metrics.webhook_calls.labels("delivered" if ok else "failed").inc()
        extra = {
            "webhook_id": endpoint.webhook_id,
            "alert_id": alert.alert_id,
            "status": status,
            "error": error,
            "seconds": round(call.seconds, 3),
        }
        # The log first: an alert counts as delivered to an endpoint only once
        # its delivery is on record (a failed publish: the alert comes again).
        await self.js.publish(
            self.topology.subjects.webhook_call(alert.tenant),
            codec.encode(call),
            headers={"Nats-Msg-Id": call.call_id},
            timeout=5,
        )
        if not ok:
            log.info("webhook not acknowledged", extra=extra)
            return False
        with contextlib.suppress(KeyWrongLastSequenceError):
            await self.spend.create(marker, b"1")
        log.info("webhook delivered", extra=extra)
        return True


def public_url(url: str) -> str:
    """``url`` without what may hold a secret: credentials, query and fragment."""
    try:
        parts = urlsplit(url)
    except ValueError:  # an unparsable host: nothing of it is kept
        return "unparsable"
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, host, parts.path, "", ""))[:2048]
