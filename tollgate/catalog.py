"""The model catalog: which models exist, where they come from, how they run."""

from __future__ import annotations

import tomllib
from datetime import date
from decimal import Decimal
from importlib import resources
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SimulatedEngineConfig(BaseModel):
    """Behaviour of the simulated engine (a test double for vLLM)."""

    model_config = ConfigDict(extra="forbid")

    tokens_per_s: float = Field(default=200.0, gt=0, description="Output rate per request.")
    ttft_ms: float = Field(default=20.0, ge=0, description="Time to first token.")
    natural_tokens: int = Field(
        default=48, ge=1, description="Tokens a reply has when max_tokens does not cut it."
    )
    max_num_seqs: int = Field(default=16, ge=1, description="Concurrent requests (slots).")


class Price(BaseModel):
    """A model's price per million tokens from ``valid_from`` (until the next price)."""

    model_config = ConfigDict(extra="forbid")

    valid_from: date = Field(description="First day (UTC) the price applies.")
    valid_to: date | None = Field(default=None, description="First day it no longer applies.")
    prompt: Decimal = Field(ge=0, description="Price per million prompt tokens.")
    completion: Decimal = Field(ge=0, description="Price per million completion tokens.")
    currency: str = Field(default="USD", min_length=3, max_length=3)


class ModelEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    source: str = Field(description="Where the weights come from (a URI).")
    aliases: list[str] = Field(default_factory=list)
    max_model_len: int = Field(default=2048, ge=16)
    engine: Literal["vllm", "simulated"] = "vllm"
    engine_args: list[str] = Field(default_factory=list)
    simulated: SimulatedEngineConfig | None = None
    prices: list[Price] = Field(default_factory=list, description="Billing prices over time.")

    @model_validator(mode="after")
    def _simulated_defaults(self) -> ModelEntry:
        if self.engine == "simulated" and self.simulated is None:
            self.simulated = SimulatedEngineConfig()
        return self

    @property
    def names(self) -> list[str]:
        return [self.id, *self.aliases]


class Catalog(BaseModel):
    models: dict[str, ModelEntry]

    def resolve(self, name: str) -> ModelEntry | None:
        """The entry whose id or alias is ``name``."""
        entry = self.models.get(name)
        if entry is not None:
            return entry
        for candidate in self.models.values():
            if name in candidate.aliases:
                return candidate
        return None

    def get(self, model_id: str) -> ModelEntry:
        entry = self.resolve(model_id)
        if entry is None:
            raise KeyError(f"model {model_id!r} is not in the catalog")
        return entry


def load_catalog(path: Path | None = None) -> Catalog:
    """Read a catalog file; the packaged ``models.toml`` when ``path`` is None."""
    if path is None:
        text = resources.files("tollgate").joinpath("models.toml").read_text()
    else:
        text = Path(path).read_text()
    raw = tomllib.loads(text).get("models", {})
    models = {mid: ModelEntry.model_validate({"id": mid, **spec}) for mid, spec in raw.items()}
    seen: dict[str, str] = {}
    for entry in models.values():
        for name in entry.names:
            if name in seen and seen[name] != entry.id:
                raise ValueError(f"name {name!r} is used by {seen[name]!r} and {entry.id!r}")
            seen[name] = entry.id
    return Catalog(models=models)
