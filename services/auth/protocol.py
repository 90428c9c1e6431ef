"""Admin API request bodies."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from tollgate.keys.records import Algorithm, BudgetPeriod


class CreateKey(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenant: str = Field(min_length=1, max_length=200)
    name: str = ""
    models: list[str] = Field(default_factory=lambda: ["*"], min_length=1)
    rpm: int | None = Field(default=None, ge=1)
    tpm: int | None = Field(default=None, ge=1)
    budget_tokens: int | None = Field(default=None, ge=1)
    budget_period: BudgetPeriod | None = None
    ttl_s: float | None = Field(default=None, gt=0, description="Lifetime; none: never expires.")


class UpdateKey(BaseModel):
    """Only the fields present change; ``null`` clears a limit."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = None
    models: list[str] | None = Field(default=None, min_length=1)
    rpm: int | None = Field(default=None, ge=1)
    tpm: int | None = Field(default=None, ge=1)
    budget_tokens: int | None = Field(default=None, ge=1)
    budget_period: BudgetPeriod | None = None
    expires_at: float | None = None


class RotateSigningKey(BaseModel):
    model_config = ConfigDict(extra="forbid")

    alg: Algorithm = "EdDSA"
