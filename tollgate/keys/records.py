"""Key records: the whitelist entries, signing-key records and audit events.

A key is a JWT (key id ``jti``, tenant ``sub``, ``iat``, optional ``exp``)
signed with one of Tollgate's signing keys (``kid`` in its header). The
whitelist maps key id -> :class:`KeyRecord`; the token itself is never stored,
and a key is revoked by changing its record. Revoked is final: no writer turns
a revoked record into anything else (see :meth:`KeyStore.update`).
"""

from __future__ import annotations

import fnmatch
import time
from decimal import Decimal
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tollgate.wire.contracts import Priority

Algorithm = Literal["EdDSA", "RS256", "HS256"]


BudgetPeriod = Literal["day", "month", "total"]
DEFAULT_THRESHOLDS = [80, 95, 100]  # percent of a budget: when spend alerts are sent


def budget_window(period: str, now: float) -> str:
    """The budget period a moment falls in: ``20261129`` (day), ``202611`` (month), ``total``."""
    if period == "total":
        return "total"
    return time.strftime("%Y%m%d" if period == "day" else "%Y%m", time.gmtime(now))


class Limits(BaseModel):
    """What a key or a tenant may use: rates, calls in flight and a token budget."""

    rpm: int | None = Field(default=None, ge=1, description="Requests per minute, or none.")
    tpm: int | None = Field(default=None, ge=1, description="Tokens per minute, or none.")
    budget_tokens: int | None = Field(default=None, ge=1, description="Tokens per period.")
    budget_period: BudgetPeriod | None = Field(default=None, description="Budget period.")
    max_concurrent: int | None = Field(
        default=None,
        ge=1,
        description="Calls in flight at once, across every router; none: no limit.",
    )
    budget_amount: Decimal | None = Field(
        default=None,
        gt=0,
        max_digits=21,
        decimal_places=9,
        description="Money per budget period (the same period as the token budget), in "
        "budget_currency, at the catalog's prices; none: no money budget.",
    )
    budget_currency: str = Field(
        default="USD", pattern="^[A-Z]{3}$", description="The money budget's currency."
    )
    alert_thresholds: list[int] | None = Field(
        default=None,
        max_length=10,
        description="Percentages of each budget at which a spend alert is sent, once per "
        "period; none: 80, 95 and 100; an empty list: no alerts.",
    )

    @field_validator("alert_thresholds")
    @classmethod
    def _thresholds(cls, value: list[int] | None) -> list[int] | None:
        if value is None:
            return None
        if any(not 1 <= pct <= 100 for pct in value):
            raise ValueError("alert thresholds are percentages from 1 to 100")
        return sorted(set(value))

    @property
    def thresholds(self) -> list[int]:
        """The alert thresholds in force (the defaults when none are set)."""
        return DEFAULT_THRESHOLDS if self.alert_thresholds is None else self.alert_thresholds

    @property
    def has_budget(self) -> bool:
        """Whether a token budget applies (an amount and its period)."""
        return self.budget_tokens is not None and self.budget_period is not None

    @property
    def has_money_budget(self) -> bool:
        """Whether a budget in money applies (an amount and its period)."""
        return self.budget_amount is not None and self.budget_period is not None

    @property
    def budgeted(self) -> bool:
        """Whether any budget applies: the ledger counts the key's (or tenant's) usage."""
        return self.has_budget or self.has_money_budget

    @property
    def budget_nanos(self) -> int | None:
        """The money budget in billionths of its currency (the counters' unit)."""
        if self.budget_amount is None:
            return None
        return int(self.budget_amount * 1_000_000_000)

    @property
    def limited(self) -> bool:
        """Whether any limit applies (without one, the shared counters are never touched)."""
        return (
            self.max_concurrent is not None
            or self.rpm is not None
            or self.tpm is not None
            or self.budgeted
        )


def amount_text(nanos: int) -> str:
    """Billionths of a currency as a plain decimal string: ``"0.000005"``, ``"100"``, never
    ``"1E+2"``."""
    return f"{Decimal(nanos).scaleb(-9).normalize():f}"


def money_entry(name: str, window: str, currency: str) -> str:
    """The counter and spend entry of a budget in money: ``money.<name>.<window>.<currency>``.

    ``name`` is a key id or ``t.<tenant>``; the value counts billionths of the currency.
    """
    return f"money.{name}.{window}.{currency}"


class KeyState(StrEnum):
    ACTIVE = "active"
    REVOKED = "revoked"
    OVER_BUDGET = "over_budget"


class KeyRecord(Limits):
    """One whitelisted key; the value of ``tg_keys[key_id]``."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["tg.key.v1"] = Field(default="tg.key.v1", description="Contract type id.")
    key_id: str = Field(description="The token's jti.")
    tenant: str = Field(description="Who pays (the token's sub).")
    name: str = Field(default="", description="A label for people.")
    models: list[str] = Field(
        default_factory=lambda: ["*"], description="Model ids or globs the key may use."
    )
    expires_at: float | None = Field(default=None, description="Unix expiry; none: never.")
    weight: float = Field(
        default=1.0,
        gt=0,
        le=1000,
        allow_inf_nan=False,
        description="The key's share of a saturated model within its tenant, against the "
        "weights of the tenant's other keys.",
    )
    priority: Priority = Field(
        default=Priority.INTERACTIVE,
        description="The key's class: batch work fills free capacity and yields to interactive.",
    )
    priority_header: bool = Field(
        default=False,
        description="Whether a call of a batch key may raise itself to interactive with "
        "X-Tollgate-Priority (any key may lower itself to batch).",
    )
    capture: bool = Field(
        default=False, description="Keep this key's requests and responses for analysis."
    )
    replay: bool = Field(
        default=False,
        description="A replay identity (tollgate replay): its calls marked X-Tollgate-Replay "
        "are not captured again. Set by the operator when the key is created.",
    )
    state: KeyState = Field(
        default=KeyState.ACTIVE, description="Lifecycle state; revoked is final."
    )
    created_at: float = Field(default_factory=time.time, description="Unix creation time.")
    updated_at: float = Field(default_factory=time.time, description="Unix time of last change.")

    def allows(self, names: list[str]) -> bool:
        """Whether any of a model's names (id, aliases) matches the key's models."""
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.models for name in names)

    def usable(self, now: float) -> bool:
        return self.state is KeyState.ACTIVE and (self.expires_at is None or now < self.expires_at)


class TenantRecord(Limits):
    """One tenant's own limits, over all its keys; the value of ``tg_tenants[<tenant>]``.

    A call must fit both its key's limits and its tenant's. A tenant without a
    record (most of them) has no limits of its own.
    """

    model_config = ConfigDict(extra="ignore")

    type: Literal["tg.tenant.v1"] = Field(default="tg.tenant.v1", description="Contract type id.")
    tenant: str = Field(description="The tenant (every key whose token names it as sub).")
    over_budget: bool = Field(
        default=False,
        description="Set by the budget ledger while the period's budget is spent: every "
        "key of the tenant is refused (429) until a new period or a larger budget.",
    )
    updated_at: float = Field(default_factory=time.time, description="Unix time of last change.")


class SigningKey(BaseModel):
    """The public half of a signing key; the value of ``tg_signing_keys[kid]``."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["tg.signing-key.v1"] = Field(
        default="tg.signing-key.v1", description="Contract type id."
    )
    kid: str = Field(description="Key id, in every token's header.")
    alg: Algorithm = Field(description="The one algorithm tokens of this key may use.")
    public_pem: str | None = Field(default=None, description="PEM public key (none for HS256).")
    retired: bool = Field(default=False, description="Retired keys no longer verify.")
    created_at: float = Field(default_factory=time.time, description="Unix creation time.")


class AuditEvent(BaseModel):
    """A change to the whitelist or the signing keys, on ``tg.audit.keys``."""

    type: Literal["tg.audit.v1"] = Field(default="tg.audit.v1", description="Contract type id.")
    at: float = Field(default_factory=time.time, description="Unix time of the change.")
    actor: str = Field(description="Who changed it (admin API, CLI user, service).")
    action: str = Field(description="create, update, revoke, over_budget, rotate, retire, ...")
    key_id: str | None = Field(default=None, description="The key changed, if any.")
    kid: str | None = Field(default=None, description="The signing key changed, if any.")
    tenant: str | None = Field(default=None, description="The tenant whose limits changed, if any.")
    record: dict[str, Any] | None = Field(
        default=None, description="The record after the change (never a token)."
    )
