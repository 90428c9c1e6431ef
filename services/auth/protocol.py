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


class CreateKey(BaseModel):
    model_config = ConfigDict(extra="forbid")

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

    model_config = ConfigDict(extra="forbid")

    name: str = None  # type: ignore[assignment]
    models: list[str] = Field(default=None, min_length=1)  # type: ignore[arg-type]
    rpm: Limit | None = None
    tpm: Limit | None = None
    budget_tokens: Limit | None = None
    budget_period: BudgetPeriod | None = None
    max_concurrent: Limit | None = None
    weight: Weight = None  # type: ignore[assignment]
    priority: Priority = None  # type: ignore[assignment]
    priority_header: StrictBool = None  # type: ignore[assignment]
    expires_at: Annotated[float, Field(allow_inf_nan=False), JsonNumber] | None = None


# A budget is an amount and its period: one set without the other is refused (400).
_BUDGET_WHOLE: dict[str, Any] = {
    "allOf": [
        {
            "if": {
                "properties": {"budget_tokens": {"type": "integer"}},
                "required": ["budget_tokens"],
            },
            "then": {
                "properties": {"budget_period": {"type": "string"}},
                "required": ["budget_period"],
            },
        },
        {
            "if": {
                "properties": {"budget_period": {"type": "string"}},
                "required": ["budget_period"],
            },
            "then": {
                "properties": {"budget_tokens": {"type": "integer"}},
                "required": ["budget_tokens"],
            },
        },
    ]
}


class TenantLimits(BaseModel):
    """A tenant's limits over all its keys; ``PUT`` replaces them (absent or null: none)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=_BUDGET_WHOLE)

    rpm: Limit | None = Field(default=None, description="Requests per minute, all keys together.")
    tpm: Limit | None = Field(default=None, description="Tokens per minute, all keys together.")
    max_concurrent: Limit | None = Field(
        default=None, description="Calls in flight at once, all keys, every router."
    )
    budget_tokens: Limit | None = Field(default=None, description="Tokens per budget period.")
    budget_period: BudgetPeriod | None = Field(
        default=None, description="`day`, `month` (UTC) or `total`; needed with budget_tokens."
    )

    @model_validator(mode="after")
    def _budget_whole(self) -> TenantLimits:
        if (self.budget_tokens is None) != (self.budget_period is None):
            raise ValueError("budget_tokens and budget_period are set together")
        return self


class RotateSigningKey(BaseModel):
    model_config = ConfigDict(extra="forbid")

    alg: Algorithm = "EdDSA"
