"""The model catalog: which models exist, where they come from, how they run."""

from __future__ import annotations

import tomllib
from datetime import UTC, date, datetime
from decimal import ROUND_CEILING, Decimal
from importlib import resources
from pathlib import Path
from typing import Literal, NamedTuple, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Weights(Protocol):
    """What the model cache prepares files for: a model or an adapter."""

    @property
    def id(self) -> str: ...

    @property
    def source(self) -> str: ...


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

    def applies(self, day: date) -> bool:
        return self.valid_from <= day and (self.valid_to is None or day < self.valid_to)

    def cost_nanos(self, prompt_tokens: int, completion_tokens: int) -> int:
        """What the tokens cost, in billionths of the currency, rounded up.

        Budgets in money count in these units (integers, so they can live in
        compare-and-set counters); an invoice's exact amount is at most one
        unit below.
        """
        exact = (prompt_tokens * self.prompt + completion_tokens * self.completion) * 1000
        return int(exact.to_integral_value(rounding=ROUND_CEILING))

    def worst_nanos(self, tokens: int) -> int:
        """An upper bound of what ``tokens`` cost, whichever kind each turns out to be."""
        return (
            self.cost_nanos(tokens, 0)
            if self.prompt >= self.completion
            else (self.cost_nanos(0, tokens))
        )


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


# The LoRA ranks vLLM's --max-lora-rank takes.
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class AdapterEntry(BaseModel):
    """A LoRA adapter of a catalog model, served by that model's workers.

    Clients name it as a model; its calls queue with its base model's, run on
    the base model's workers (vLLM loads the adapter on first use) and are
    billed under the adapter's id.
    """

    model_config = ConfigDict(extra="forbid")

    id: str
    base: str = Field(description="The catalog id of the model it adapts.")
    source: str = Field(description="Where the adapter's files come from (a URI).")
    aliases: list[str] = Field(default_factory=list)
    rank: int = Field(
        default=16,
        description="The adapter's LoRA rank at most; its base model's workers make room "
        "for the largest rank among its adapters (vLLM's --max-lora-rank).",
    )
    prices: list[Price] = Field(
        default_factory=list, description="Billing prices over time (none: its base model's)."
    )

    @model_validator(mode="after")
    def _known_rank(self) -> AdapterEntry:
        if self.rank not in LORA_RANKS:
            raise ValueError(f"{self.id}: rank must be one of {', '.join(map(str, LORA_RANKS))}")
        return self

    @property
    def names(self) -> list[str]:
        return [self.id, *self.aliases]


class Target(NamedTuple):
    """What a model name in a call runs: a catalog model, and the adapter on it if any."""

    entry: ModelEntry
    adapter: AdapterEntry | None = None

    @property
    def billed(self) -> str:
        """The id usage rows carry: the adapter's, else the model's."""
        return self.adapter.id if self.adapter is not None else self.entry.id

    @property
    def names(self) -> list[str]:
        """The names a key's model globs are matched against."""
        return self.adapter.names if self.adapter is not None else self.entry.names


class Catalog(BaseModel):
    models: dict[str, ModelEntry]
    adapters: dict[str, AdapterEntry] = Field(default_factory=dict)

    def target(self, name: str) -> Target | None:
        """What a call naming ``name`` (a model or an adapter, by id or alias) runs."""
        entry = self.resolve(name)
        if entry is not None:
            return Target(entry)
        adapter = self.resolve_adapter(name)
        if adapter is None:
            return None
        return Target(self.models[adapter.base], adapter)

    def resolve_adapter(self, name: str) -> AdapterEntry | None:
        """The adapter whose id or alias is ``name``."""
        adapter = self.adapters.get(name)
        if adapter is not None:
            return adapter
        return next((a for a in self.adapters.values() if name in a.aliases), None)

    def adapters_of(self, model_id: str) -> list[AdapterEntry]:
        """The adapters whose base is ``model_id``."""
        return [a for a in self.adapters.values() if a.base == model_id]

    def prices_of(self, billed: str) -> list[Price]:
        """The prices a usage row's model is billed at (an adapter: its own, else its base's)."""
        adapter = self.adapters.get(billed)
        if adapter is not None:
            return adapter.prices or self.models[adapter.base].prices
        entry = self.models.get(billed)
        return entry.prices if entry is not None else []

    def price_at(self, billed: str, when: float) -> Price | None:
        """The price a call of ``billed`` at unix time ``when`` is billed at (None: unpriced).

        The latest price whose ``valid_from`` is at or before the day (UTC),
        as the ``usage_cost`` view applies the ``prices`` table the catalog writes.
        """
        day = datetime.fromtimestamp(when, UTC).date()
        prices = sorted(self.prices_of(billed), key=lambda p: p.valid_from)
        current = [p for p in prices if p.valid_from <= day]
        if not current or not current[-1].applies(day):
            return None
        return current[-1]

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
    data = tomllib.loads(text)
    raw = data.get("models", {})
    models = {mid: ModelEntry.model_validate({"id": mid, **spec}) for mid, spec in raw.items()}
    adapters = {
        aid: AdapterEntry.model_validate({"id": aid, **spec})
        for aid, spec in data.get("adapters", {}).items()
    }
    seen: dict[str, str] = {}
    items: list[ModelEntry | AdapterEntry] = [*models.values(), *adapters.values()]
    for item in items:
        for name in item.names:
            if name in seen and seen[name] != item.id:
                raise ValueError(f"name {name!r} is used by {seen[name]!r} and {item.id!r}")
            seen[name] = item.id
    for adapter in adapters.values():
        base = models.get(adapter.base)
        if base is None:
            raise ValueError(f"adapter {adapter.id!r}: base {adapter.base!r} is not a catalog id")
        if base.task != "generate":
            raise ValueError(f"adapter {adapter.id!r}: base {base.id!r} is not a generative model")
    return Catalog(models=models, adapters=adapters)
