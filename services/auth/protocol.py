"""Admin API request bodies."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, model_validator
from pydantic_core import PydanticCustomError

from tollgate.keys.records import Algorithm, BudgetPeriod
from tollgate.wire.contracts import Priority


def _a_json_number(value: Any) -> Any:
    """A JSON number only, as the document types it: pydantic's lax mode would also take
    ``true`` as 1 and ``"60"`` as 60 (an integral ``60.0`` is a JSON integer, and is 60)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise PydanticCustomError("number_type", "Input should be a JSON number")
    return value


JsonNumber = BeforeValidator(_a_json_number)
# The most a limit may be: the largest integer a double holds exactly (2**53 - 1), so a
# limit reads the same in every JSON reader (RFC 7493's interoperable range), and far
# beyond any real rate or budget.
MAX_LIMIT = 2**53 - 1
Limit = Annotated[int, Field(ge=1, le=MAX_LIMIT), JsonNumber]
Weight = Annotated[float, Field(gt=0, le=1000, allow_inf_nan=False), JsonNumber]
# An amount of money as a decimal string, exact (never a float): above zero, at most
# twelve digits before the point and nine after ("25", "0.50", "1000000.000000001").
Money = Annotated[
    str,
    Field(
        pattern=r"^(?=[0-9.]*[1-9])(0|[1-9][0-9]{0,11})(\.[0-9]{1,9})?$",
        description="A decimal string above zero (at most 9 decimals).",
    ),
]
Currency = Annotated[str, Field(pattern="^[A-Z]{3}$", description="ISO 4217 code.")]
Thresholds = Annotated[
    list[Annotated[int, Field(ge=1, le=100), JsonNumber]],
    Field(
        max_length=10,
        description="Percentages of each budget at which a spend alert is sent, once per "
        "period; null: 80, 95 and 100; []: no alerts.",
    ),
]


class CreateKey(BaseModel):
    model_config = ConfigDict(extra="forbid", regex_engine="python-re")  # Money's look-ahead

    tenant: str = Field(min_length=1, max_length=200)
    name: str = ""
    models: list[str] = Field(default_factory=lambda: ["*"], min_length=1)
    rpm: Limit | None = None
    tpm: Limit | None = None
    budget_tokens: Limit | None = None
    budget_period: BudgetPeriod | None = None
    max_concurrent: Limit | None = Field(
        default=None, description="Calls in flight at once, across every router; none when null."
    )
    budget_amount: Money | None = Field(
        default=None, description="Money per budget period, at the catalog's prices."
    )
    budget_currency: Currency = Field(default="USD", description="The money budget's currency.")
    alert_thresholds: Thresholds | None = None
    weight: Weight = Field(
        default=1.0, description="The key's share of a saturated model within its tenant."
    )
    priority: Priority = Field(default=Priority.INTERACTIVE, description="The key's class.")
    priority_header: StrictBool = Field(
        default=False,
        description="A batch key's calls may raise themselves to interactive with "
        "X-Tollgate-Priority.",
    )
    ttl_s: Annotated[float, Field(gt=0, allow_inf_nan=False), JsonNumber] | None = Field(
        default=None, description="Lifetime; none: never expires."
    )


class UpdateKey(BaseModel):
    """Only the fields present change; ``null`` clears a limit.

    ``name``, ``models``, ``weight``, ``priority`` and ``priority_header`` are
    not limits: they have no null (an absent field keeps its value; the
    default of ``None`` only marks it absent).
    """

    model_config = ConfigDict(extra="forbid", regex_engine="python-re")

    name: str = None  # type: ignore[assignment]
    models: list[str] = Field(default=None, min_length=1)  # type: ignore[arg-type]
    rpm: Limit | None = None
    tpm: Limit | None = None
    budget_tokens: Limit | None = None
    budget_period: BudgetPeriod | None = None
    max_concurrent: Limit | None = None
    budget_amount: Money | None = None
    budget_currency: Currency = None  # type: ignore[assignment]
    alert_thresholds: Thresholds | None = None
    weight: Weight = None  # type: ignore[assignment]
    priority: Priority = None  # type: ignore[assignment]
    priority_header: StrictBool = None  # type: ignore[assignment]
    expires_at: Annotated[float, Field(allow_inf_nan=False), JsonNumber] | None = None


# A budget is an amount and its period: one set without the other is refused (400).
_BUDGET_WHOLE: dict[str, Any] = {
    "allOf": [
        {
            "if": {"properties": {name: {"type": kind}}, "required": [name]},
            "then": {
                "properties": {"budget_period": {"type": "string"}},
                "required": ["budget_period"],
            },
        }
        for name, kind in [("budget_tokens", "integer"), ("budget_amount", "string")]
    ]
    + [
        {
            "if": {
                "properties": {"budget_period": {"type": "string"}},
                "required": ["budget_period"],
            },
            "then": {
                "anyOf": [
                    {
                        "properties": {"budget_tokens": {"type": "integer"}},
                        "required": ["budget_tokens"],
                    },
                    {
                        "properties": {"budget_amount": {"type": "string"}},
                        "required": ["budget_amount"],
                    },
                ]
            },
        }
    ]
}


class TenantLimits(BaseModel):
    """A tenant's limits over all its keys; ``PUT`` replaces them (absent or null: none)."""

    model_config = ConfigDict(
        extra="forbid", json_schema_extra=_BUDGET_WHOLE, regex_engine="python-re"
    )

    rpm: Limit | None = Field(default=None, description="Requests per minute, all keys together.")
    tpm: Limit | None = Field(default=None, description="Tokens per minute, all keys together.")
    max_concurrent: Limit | None = Field(
        default=None, description="Calls in flight at once, all keys, every router."
    )
    budget_tokens: Limit | None = Field(default=None, description="Tokens per budget period.")
    budget_amount: Money | None = Field(
        default=None, description="Money per budget period, at the catalog's prices."
    )
    budget_currency: Currency = Field(default="USD", description="The money budget's currency.")
    alert_thresholds: Thresholds | None = None
    budget_period: BudgetPeriod | None = Field(
        default=None,
        description="`day`, `month` (UTC) or `total`: the period of both budgets; needed with "
        "either.",
    )

    @model_validator(mode="after")
    def _budget_whole(self) -> TenantLimits:
        amounts = self.budget_tokens is not None or self.budget_amount is not None
        if amounts != (self.budget_period is not None):
            raise ValueError(
                "a budget is budget_tokens or budget_amount (or both) and its budget_period"
            )
        return self


class CreateWebhook(BaseModel):
    """An endpoint for spend alerts: every tenant's, or one tenant's."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(
        min_length=8,
        max_length=2048,
        pattern=r"^https?://[!-~]",  # ASCII: every regex engine reads it alike
        description="Where alerts are POSTed: an http or https URL.",
    )
    tenant: str | None = Field(
        default=None, min_length=1, max_length=200, description="Only this tenant's alerts."
    )


class RotateSigningKey(BaseModel):
    model_config = ConfigDict(extra="forbid")

    alg: Algorithm = "EdDSA"
