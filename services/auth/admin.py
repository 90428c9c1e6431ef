"""Key lifecycle: the logic behind the admin API."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from services.auth.protocol import (
    CreateKey,
    CreateWebhook,
    RotateSigningKey,
    TenantLimits,
    UpdateKey,
)
from tollgate.keys.records import (
    KeyRecord,
    KeyState,
    SigningKey,
    TenantRecord,
    amount_text,
    budget_window,
    money_entry,
)
from tollgate.keys.store import KeyStore
from tollgate.keys.tenants import TenantStore, tenant_scope
from tollgate.keys.tokens import SigningKeySet
from tollgate.keys.webhooks import WebhookRecord, WebhookStore


class NotFoundError(Exception):
    pass


class KeyRevokedError(Exception):
    """A change to a revoked key: revoked is final (the admin API answers 409)."""


class TenantNotFoundError(Exception):
    """A tenant without limits of its own (the admin API answers 404)."""


class KeyAdmin:
    def __init__(
        self,
        store: KeyStore,
        signing: SigningKeySet,
        tenants: TenantStore | None = None,
        spent: Callable[[str], Awaitable[int]] | None = None,
        webhooks: WebhookStore | None = None,
    ) -> None:
        self.webhooks = webhooks
        self.store = store
        self.signing = signing
        self.tenants = tenants
        self.spent = spent  # spend entry -> what the ledger has counted there

    async def create(self, spec: CreateKey) -> tuple[str, KeyRecord]:
        limits = spec.model_dump(exclude={"tenant", "name", "models", "ttl_s"})
        return await self.store.create(
            self.signing,
            tenant=spec.tenant,
            name=spec.name,
            models=spec.models,
            ttl_s=spec.ttl_s,
            **limits,
        )

    async def get(self, key_id: str) -> KeyRecord:
        record = await self.store.get(key_id)
        if record is None:
            raise NotFoundError(key_id)
        return record

    async def list(self) -> list[KeyRecord]:
        return sorted(await self.store.all(), key=lambda r: r.created_at)

    async def update(self, key_id: str, change: UpdateKey) -> KeyRecord:
        fields = change.model_dump(exclude_unset=True)
        updated = await self.store.update(key_id, lambda _: fields)
        if updated is None:
            raise NotFoundError(key_id)
        if updated.state is KeyState.REVOKED:  # the store refused: nothing was written
            raise KeyRevokedError(key_id)
        return updated

    async def revoke(self, key_id: str) -> KeyRecord:
        record = await self.store.revoke(key_id)
        if record is None:
            raise NotFoundError(key_id)
        return record

    async def rotate(self, spec: RotateSigningKey) -> SigningKey:
        """A new key signs from now on; tokens of older keys verify until retired."""
        key = self.signing.generate(spec.alg)
        await self.store.publish_signing_key(key, "rotate")
        return key

    async def retire(self, kid: str) -> SigningKey:
        if kid not in self.signing.keys:
            raise NotFoundError(kid)
        if kid == self.signing.current:
            raise ValueError("the current signing key cannot be retired; rotate first")
        key = self.signing.public(kid)
        key.retired = True
        await self.store.publish_signing_key(key, "retire")
        return key

    # -- tenant-wide limits --------------------------------------------------

    def _tenant_store(self) -> TenantStore:
        if self.tenants is None:
            raise RuntimeError("the admin has no tenant store")
        return self.tenants

    async def tenant_view(self, record: TenantRecord) -> dict[str, Any]:
        """The record with its spend in the current budget period.

        ``spent_tokens`` with a token budget, ``spent_amount`` (a decimal
        string in the budget's currency) with a budget in money; else null.
        """
        view = record.model_dump(mode="json")
        view["spent_tokens"] = view["spent_amount"] = None
        if record.budget_period is None or self.spent is None:
            return view
        window = budget_window(record.budget_period, time.time())
        scope = tenant_scope(record.tenant)
        if record.budget_tokens is not None:
            view["spent_tokens"] = await self.spent(f"{scope}.{window}")
        if record.budget_amount is not None:
            nanos = await self.spent(money_entry(scope, window, record.budget_currency))
            view["spent_amount"] = amount_text(nanos)
        return view

    async def tenant(self, tenant: str) -> TenantRecord:
        record = await self._tenant_store().get(tenant)
        if record is None:
            raise TenantNotFoundError(tenant)
        return record

    async def tenant_list(self) -> Sequence[TenantRecord]:
        return await self._tenant_store().all()

    async def set_tenant(self, tenant: str, limits: TenantLimits) -> TenantRecord:
        return await self._tenant_store().set_limits(tenant, limits.model_dump())

    async def clear_tenant(self, tenant: str) -> TenantRecord:
        record = await self._tenant_store().clear(tenant)
        if record is None:
            raise TenantNotFoundError(tenant)
        return record

    # -- webhook endpoints of spend alerts -------------------------------------

    def _webhook_store(self) -> WebhookStore:
        if self.webhooks is None:
            raise RuntimeError("the admin has no webhook store")
        return self.webhooks

    async def add_webhook(self, spec: CreateWebhook) -> WebhookRecord:
        return await self._webhook_store().create(spec.url, spec.tenant)

    async def webhook_list(self) -> Sequence[WebhookRecord]:
        return await self._webhook_store().all()

    async def remove_webhook(self, webhook_id: str) -> WebhookRecord:
        record = await self._webhook_store().delete(webhook_id)
        if record is None:
            raise NotFoundError(webhook_id)
        return record
