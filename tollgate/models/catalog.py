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
    startup_s: float = Field(
        default=0.0, ge=0, le=600, description="Seconds the engine takes to start (a slow load)."
    )
    startup_blocks: bool = Field(
        default=False,
        description="The start holds the worker's event loop (no heartbeats meanwhile), as "
        "vLLM's engine client build does.",
    )
    prefix_cache_tokens: int = Field(
        default=0,
        ge=0,
        description="Tokens its simulated prefix cache holds, least recently used evicted "
        "first (0: no cache, every prompt computed in full).",
    )
    prefix_block_tokens: int = Field(
        default=16, ge=1, description="Tokens per cached block (vLLM's --block-size)."
    )
    prefill_tokens_per_s: float = Field(
        default=0.0,
        ge=0,
        description="Prompt tokens computed per second before the first token, cached ones "
        "excepted (0: prefill is free).",
    )


class Price(BaseModel):
    """A model's price per million tokens from ``valid_from`` (until the next price)."""

    model_config = ConfigDict(extra="forbid")

    valid_from: date = Field(description="First day (UTC) the price applies.")
    valid_to: date | None = Field(default=None, description="First day it no longer applies.")
    prompt: Decimal = Field(ge=0, description="Price per million prompt tokens.")
    completion: Decimal = Field(ge=0, description="Price per million completion tokens.")
    currency: str = Field(default="USD", min_length=3, max_length=3)


class ScalingPolicy(BaseModel):
    """How the scaler sizes one model's workers (see docs/scaling.md)."""

    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(default=0, ge=0, description="Never fewer workers than this.")
    max_replicas: int = Field(default=2, ge=1, description="Never more workers than this.")
    target_utilization: float = Field(
        default=0.75,
        gt=0,
        le=1,
        description="Aim for this share of each worker's slots busy (requests running + queued).",
    )
    target_tokens_per_s: float | None = Field(
        default=None, gt=0, description="Also size by tokens/s: this many per worker."
    )
    scale_up_window_s: float = Field(
        default=0.0, ge=0, description="Scale up to the lowest need seen over this window."
    )
    scale_down_window_s: float = Field(
        default=120.0,
        ge=0,
        description="Scale down only to the highest need seen over this window.",
    )
    scale_down_cooldown_s: float = Field(
        default=60.0, ge=0, description="At least this long between a change and a scale-down."
    )
    scale_to_zero_after_s: float | None = Field(
        default=600.0, gt=0, description="Stop the last worker after this long idle (None: never)."
    )
    time_to_ready_s: float = Field(
        default=60.0,
        gt=0,
        description="Expected worker start-up time until one has been measured.",
    )
    predictive: bool = Field(
        default=True, description="Pre-warm ahead of the hour-of-week demand in the usage history."
    )

    @model_validator(mode="after")
    def _bounds(self) -> ScalingPolicy:
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must not exceed max_replicas")
        return self


class ModelEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    source: str = Field(description="Where the weights come from (a URI).")
    aliases: list[str] = Field(default_factory=list)
    max_model_len: int = Field(default=2048, ge=16)
    engine: Literal["vllm", "simulated"] = "vllm"
    task: Literal["generate", "embed"] = Field(
        default="generate",
        description="generate: chat and text completions; embed: /v1/embeddings "
        "(vLLM's pooling runner).",
    )
    engine_args: list[str] = Field(default_factory=list)
    tensor_parallel_size: int = Field(
        default=1,
        ge=1,
        description="GPUs one worker uses: vLLM's --tensor-parallel-size, and the share of "
        "the scaler's GPUs (TOLLGATE_SCALER_GPUS) each local worker gets.",
    )
    cache: Literal["keep", "none"] = Field(
        default="keep",
        description="keep: prepared weights stay in the shared cache; none: each worker "
        "fetches into a private folder removed when it stops (stateless).",
    )
    simulated: SimulatedEngineConfig | None = None
    prices: list[Price] = Field(default_factory=list, description="Billing prices over time.")
    scaling: ScalingPolicy = Field(default_factory=ScalingPolicy, description="Autoscaling.")

    @model_validator(mode="after")
    def _one_tensor_parallel_size(self) -> ModelEntry:
        for arg in self.engine_args:
            # vLLM's parser also takes underscores and --flag=value
            if arg.split("=", 1)[0].replace("_", "-") in ("-tp", "--tensor-parallel-size"):
                raise ValueError(
                    f"{self.id}: set tensor_parallel_size, not {arg!r} in engine_args "
                    "(the scaler sizes each worker's GPUs from it)"
                )
        return self

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
        text = resources.files("tollgate.models").joinpath("models.toml").read_text()
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
