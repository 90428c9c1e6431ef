"""The admin API's OpenAPI document (``GET /openapi.json``), generated from its models.

Request bodies are the admin API's own models (services/auth/protocol.py),
answers the key and signing-key records (tollgate/keys/records.py).
docs/openapi/admin.yaml is the hand-written reference the generated document
is checked against (tests/lib/test_openapi.py).

The document is served without the admin token, like ``/healthz``: it is the
same text as the repository's reference, names no key, tenant or setting of
this deployment, and a client needs it before it has a token to send.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from services.auth.protocol import (
    CreateKey,
    CreateWebhook,
    RotateSigningKey,
    TenantLimits,
    UpdateKey,
)
from tollgate.keys.records import KeyRecord, SigningKey, TenantRecord
from tollgate.runtime.openapi import (
    I_JSON,
    SAME_ORIGIN,
    Answer,
    Api,
    Error,
    Header,
    Operation,
    PathParameter,
    ops_operations,
)


class CreatedKey(BaseModel):
    key: str = Field(description="The token (`tg-<JWT>`): returned once, here, stored nowhere.")
    record: KeyRecord


class KeyList(BaseModel):
    data: list[KeyRecord] = Field(description="Every key's record, oldest first.")


class TenantView(TenantRecord):
    spent_tokens: int | None = Field(
        description="Tokens the budget ledger has counted in the current budget period "
        "(null without a token budget)."
    )
    spent_amount: str | None = Field(
        description="Money the budget ledger has counted in the current budget period, a "
        "decimal string in budget_currency (null without a budget in money)."
    )


class TenantList(BaseModel):
    data: list[TenantView] = Field(description="Every tenant with limits of its own, by name.")


class Webhook(BaseModel):
    type: Literal["tg.webhook.v1"] = "tg.webhook.v1"
    webhook_id: str
    url: str
    tenant: str | None = Field(description="Only this tenant's alerts; null: every tenant's.")
    created_at: float


class CreatedWebhook(Webhook):
    secret: str = Field(
        description="The HMAC-SHA256 key of its signatures: returned once, here, never listed."
    )


class WebhookList(BaseModel):
    data: list[Webhook] = Field(description="Every endpoint, oldest first (never a secret).")


class InvoiceLine(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="The billed model (an adapter's own id for its calls).")
    kind: Literal["prompt", "completion"]
    price_from: str = Field(
        description="The price's start: an ISO date, or an instant (`2026-11-02T10:00:00Z`) "
        "for a price not starting at midnight."
    )
    quantity: int = Field(ge=0, description="Tokens.")
    unit_price: str = Field(description="Price per million tokens, a decimal string.")
    currency: str
    amount: str = Field(description="`quantity * unit_price / 1000000`, exact, a decimal string.")


class UnpricedUsage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    requests: int = Field(ge=0)
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)


class InvoiceCheck(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ok: bool = Field(description="The raw rows, the hourly rollup and `usage_cost` agree.")
    differences: list[str] = Field(description="Each difference found, named by its line.")


class Invoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    object: Literal["invoice"]
    tenant: str
    period: str = Field(description="The month, `YYYY-MM` (UTC).")
    source: Literal["raw"] = Field(description="Computed from the deduplicated raw rows.")
    requests: int = Field(ge=0, description="Requests in the month, priced or not.")
    lines: list[InvoiceLine] = Field(description="Per model, token kind and price period.")
    totals: dict[str, str] = Field(description="The exact sum of the amounts, per currency.")
    due: dict[str, str] = Field(description="Each total rounded to cents, half up.")
    unpriced: list[UnpricedUsage] = Field(description="Usage no price covers: not billed.")
    check: InvoiceCheck


def _error(description: str, **headers: Header) -> Answer:
    return Answer(description, Error, headers=headers)


BAD_REQUEST = _error(
    "The body is not JSON, has an unknown field or an invalid value (`invalid_request`)."
)
UNAUTHORIZED = _error(
    "No admin token, or a wrong one (`invalid_admin_key`).",
    **{"WWW-Authenticate": Header("`Bearer`")},
)
NOT_FOUND = _error("No such key, signing key or webhook (`not_found`).")
KEY_ID = PathParameter(
    "key_id",
    "The key's id (its token's `jti`). An id of another shape (not letters, digits, `-`, `_`, "
    "`=` in dot-separated parts, or over 128 characters) cannot exist: 404.",
    {"type": "string", "minLength": 1, "maxLength": 128},
)
KID = PathParameter("kid", "The signing key's id (in every token's header).")
WEBHOOK_ID = PathParameter(
    "webhook_id",
    "The endpoint's id (from `GET /admin/webhooks`).",
    {"type": "string", "minLength": 1, "maxLength": 128},
)
TENANT = PathParameter(
    "tenant",
    "The tenant (as its keys name it).",
    {"type": "string", "minLength": 1, "maxLength": 200},
)
MONTH = PathParameter(
    "month",
    "The month, `YYYY-MM` (UTC), from 1970-01 to 2105-12.",
    {"type": "string", "pattern": "^(19[7-9][0-9]|20[0-9][0-9]|210[0-5])-(0[1-9]|1[0-2])$"},
)


def admin_api() -> Api:
    operations = [
        Operation(
            "POST",
            "/admin/keys",
            "createKey",
            "Issue a key; the token is in this response only and stored nowhere.",
            ("keys",),
            {
                201: Answer("The new key's token and its whitelist record.", CreatedKey),
                400: BAD_REQUEST,
                401: UNAUTHORIZED,
            },
            body=CreateKey,
        ),
        Operation(
            "GET",
            "/admin/keys",
            "listKeys",
            "Every key's record, oldest first (never a token).",
            ("keys",),
            {200: Answer("The records.", KeyList), 401: UNAUTHORIZED},
        ),
        Operation(
            "GET",
            "/admin/keys/{key_id}",
            "showKey",
            "One key's record.",
            ("keys",),
            {200: Answer("The record.", KeyRecord), 401: UNAUTHORIZED, 404: NOT_FOUND},
            parameters=(KEY_ID,),
        ),
        Operation(
            "PATCH",
            "/admin/keys/{key_id}",
            "updateKey",
            "Change a key's name, models, limits, share, class or expiry; reaches every router "
            "within milliseconds.",
            ("keys",),
            {
                200: Answer("The record after the change.", KeyRecord),
                400: BAD_REQUEST,
                401: UNAUTHORIZED,
                404: NOT_FOUND,
                409: _error("The key is revoked and cannot change (`key_revoked`)."),
            },
            body=UpdateKey,
            parameters=(KEY_ID,),
        ),
        Operation(
            "DELETE",
            "/admin/keys/{key_id}",
            "revokeKey",
            "Revoke a key; revoked is final. Revoking a revoked key changes nothing.",
            ("keys",),
            {
                200: Answer("The record, now `revoked`.", KeyRecord),
                401: UNAUTHORIZED,
                404: NOT_FOUND,
            },
            parameters=(KEY_ID,),
        ),
        Operation(
            "POST",
            "/admin/signing-keys/rotate",
            "rotateSigningKey",
            "A new signing key signs from now on; tokens of older keys verify until those "
            "are retired.",
            ("signing-keys",),
            {
                201: Answer("The new signing key (public half).", SigningKey),
                400: BAD_REQUEST,
                401: UNAUTHORIZED,
            },
            body=RotateSigningKey,
            body_required=False,
        ),
        Operation(
            "POST",
            "/admin/signing-keys/{kid}/retire",
            "retireSigningKey",
            "Retire a signing key; every token it signed stops verifying.",
            ("signing-keys",),
            {
                200: Answer("The signing key, now retired.", SigningKey),
                400: _error("The current signing key cannot be retired (rotate first)."),
                401: UNAUTHORIZED,
                404: NOT_FOUND,
            },
            parameters=(KID,),
        ),
        Operation(
            "GET",
            "/admin/tenants",
            "listTenants",
            "Every tenant with limits of its own, with its spend this budget period.",
            ("tenants",),
            {200: Answer("The tenants' records.", TenantList), 401: UNAUTHORIZED},
        ),
        Operation(
            "GET",
            "/admin/tenants/{tenant}",
            "showTenant",
            "One tenant's limits over all its keys, with its spend this budget period.",
            ("tenants",),
            {
                200: Answer("The record.", TenantView),
                400: _error("The tenant name is longer than 200 characters (`invalid_request`)."),
                401: UNAUTHORIZED,
                404: _error("The tenant has no limits of its own (`not_found`)."),
            },
            parameters=(TENANT,),
        ),
        Operation(
            "PUT",
            "/admin/tenants/{tenant}",
            "setTenant",
            "Set a tenant's limits over all its keys (replacing those it had); every call "
            "must fit its key's limits and its tenant's. Reaches every router within "
            "milliseconds.",
            ("tenants",),
            {
                200: Answer("The record after the change.", TenantView),
                400: BAD_REQUEST,
                401: UNAUTHORIZED,
            },
            body=TenantLimits,
            body_required=False,
            parameters=(TENANT,),
        ),
        Operation(
            "DELETE",
            "/admin/tenants/{tenant}",
            "clearTenant",
            "Remove a tenant's own limits (its keys keep theirs).",
            ("tenants",),
            {
                200: Answer("The record as it was.", TenantRecord),
                400: _error("The tenant name is longer than 200 characters (`invalid_request`)."),
                401: UNAUTHORIZED,
                404: _error("The tenant has no limits of its own (`not_found`)."),
            },
            parameters=(TENANT,),
        ),
        Operation(
            "POST",
            "/admin/webhooks",
            "addWebhook",
            "Add an endpoint for spend alerts (every tenant's, or one tenant's); its signing "
            "secret is in this response only.",
            ("alerts",),
            {
                201: Answer("The endpoint and its secret.", CreatedWebhook),
                400: BAD_REQUEST,
                401: UNAUTHORIZED,
            },
            body=CreateWebhook,
        ),
        Operation(
            "GET",
            "/admin/webhooks",
            "listWebhooks",
            "Every endpoint for spend alerts, oldest first (never a secret).",
            ("alerts",),
            {200: Answer("The endpoints.", WebhookList), 401: UNAUTHORIZED},
        ),
        Operation(
            "DELETE",
            "/admin/webhooks/{webhook_id}",
            "removeWebhook",
            "Remove an endpoint: it receives no more alerts.",
            ("alerts",),
            {
                200: Answer("The endpoint as it was.", Webhook),
                401: UNAUTHORIZED,
                404: NOT_FOUND,
            },
            parameters=(WEBHOOK_ID,),
        ),
        Operation(
            "GET",
            "/admin/invoices/{tenant}/{month}",
            "showInvoice",
            "A tenant's invoice for a month, in exact decimals, checked against the rollups.",
            ("billing",),
            {
                200: Answer("The invoice and its check (`tollgate invoice --check`).", Invoice),
                400: _error("The month is not `YYYY-MM` (`invalid_request`)."),
                401: UNAUTHORIZED,
                503: _error(
                    "The metering service did not answer, or could not compute it "
                    "(`metering_unavailable`, `metering_error`)."
                ),
            },
            parameters=(TENANT, MONTH),
        ),
        *ops_operations(
            "Readiness; 503 until connected to NATS.",
            "Prometheus metrics (keys by state, budget ledger; docs/metrics.md).",
        ),
    ]
    return Api(
        title="Tollgate admin API",
        summary="API keys, signing keys, tenant limits and invoices, on the auth service.",
        description="Issue, list, change and revoke API keys, and rotate the keys that sign "
        "them (the `tollgate keys` commands). Every call under `/admin/` needs the admin "
        "token, exactly as `Authorization: Bearer <token>`. Errors are OpenAI-shaped: "
        f'`{{"error": {{"message", "type", "param", "code"}}}}`. {I_JSON}',
        servers=[SAME_ORIGIN],
        security_schemes={
            "adminToken": {
                "type": "http",
                "scheme": "bearer",
                "description": "The admin token, exactly `Authorization: Bearer <token>`.",
            }
        },
        operations=operations,
        tags=("keys", "signing-keys", "tenants", "alerts", "billing", "operations"),
    )
