"""Webhook endpoints for spend alerts (KV ``tg_webhooks``), and how their calls are signed.

An endpoint has a URL, a secret of its own (returned once, when it is
created) and optionally a tenant: it receives the spend alerts of that
tenant's keys and of the tenant, or every alert when it names none. The auth
service delivers each alert to each endpoint once (``services/auth/webhooks.py``).

Every delivery is signed like this::

    Tollgate-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>." + body)>

A receiver recomputes the HMAC over the timestamp, a dot and the raw body
with its secret, compares it in constant time, and refuses a timestamp too
far from its clock (a replayed call): :func:`verify` does exactly that.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
import uuid
from typing import Any, Literal

from nats.js.errors import KeyNotFoundError
from pydantic import BaseModel, ConfigDict, Field

from tollgate.wire.topology import Topology, bucket_keys

SIGNATURE_HEADER = "Tollgate-Signature"
# How far a signed timestamp may be from the receiver's clock (seconds).
TOLERANCE_S = 300


class WebhookRecord(BaseModel):
    """One endpoint; the value of ``tg_webhooks[<id>]`` (its secret included)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["tg.webhook.v1"] = Field(default="tg.webhook.v1", description="Contract type id.")
    webhook_id: str = Field(description="The endpoint's id.")
    url: str = Field(description="Where alerts are POSTed (http or https).")
    tenant: str | None = Field(
        default=None, description="Only this tenant's alerts; none: every tenant's."
    )
    secret: str = Field(description="The HMAC key of its signatures (shown once).")
    created_at: float = Field(default_factory=time.time, description="Unix creation time.")

    def wants(self, tenant: str) -> bool:
        return self.tenant is None or self.tenant == tenant

    def public(self) -> dict[str, Any]:
        """The record as it is listed: never its secret."""
        return self.model_dump(mode="json", exclude={"secret"})


def sign(secret: str, body: bytes, now: float | None = None) -> str:
    """The ``Tollgate-Signature`` header of ``body`` at ``now``."""
    stamp = str(int(time.time() if now is None else now))
    digest = hmac.new(secret.encode(), stamp.encode() + b"." + body, hashlib.sha256).hexdigest()
    return f"t={stamp},v1={digest}"


def verify(
    secret: str,
    header: str,
    body: bytes,
    now: float | None = None,
    tolerance_s: float = TOLERANCE_S,
) -> bool:
    """Whether ``header`` signs ``body`` with ``secret`` at a time within ``tolerance_s`` of now."""
    parts = dict(p.split("=", 1) for p in header.split(",") if "=" in p)
    stamp, given = parts.get("t", ""), parts.get("v1", "")
    if not stamp.isdigit() or abs((time.time() if now is None else now) - int(stamp)) > tolerance_s:
        return False
    expected = hmac.new(secret.encode(), stamp.encode() + b"." + body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, given)


class WebhookStore:
    def __init__(self, js: Any, topology: Topology) -> None:
        self.js = js
        self.topology = topology
        self.kv: Any = None

    async def open(self) -> WebhookStore:
        self.kv = await self.topology.bucket(self.js, self.topology.webhooks)
        return self

    async def create(self, url: str, tenant: str | None = None) -> WebhookRecord:
        record = WebhookRecord(
            webhook_id=uuid.uuid4().hex,
            url=url,
            tenant=tenant,
            secret=f"whsec_{secrets.token_urlsafe(32)}",
        )
        await self.kv.create(record.webhook_id, record.model_dump_json().encode())
        return record

    async def get(self, webhook_id: str) -> WebhookRecord | None:
        try:
            entry = await self.kv.get(webhook_id)
        except KeyNotFoundError:
            return None
        return WebhookRecord.model_validate_json(entry.value) if entry.value else None

    async def all(self) -> list[WebhookRecord]:
        names = await bucket_keys(self.js, self.topology.webhooks.name)
        records = [await self.get(name) for name in names]
        return sorted((r for r in records if r is not None), key=lambda r: r.created_at)

    async def delete(self, webhook_id: str) -> WebhookRecord | None:
        record = await self.get(webhook_id)
        if record is not None:
            await self.kv.delete(webhook_id)
        return record
