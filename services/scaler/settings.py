from __future__ import annotations

import fnmatch
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


class ScheduleOverride(BaseModel):
    """Replica bounds for some models during some hours (UTC), e.g. fewer at night."""

    model_config = ConfigDict(extra="forbid")

    models: list[str] = Field(default_factory=lambda: ["*"], description="Ids or globs.")
    days: list[int] = Field(
        default_factory=lambda: list(range(7)), description="Weekdays, 0 = Monday."
    )
    start: str = Field(description="HH:MM (UTC) the override begins.")
    end: str = Field(description="HH:MM (UTC) it ends; before start means past midnight.")
    min_replicas: int | None = Field(default=None, ge=0)
    max_replicas: int | None = Field(default=None, ge=0)

    @field_validator("start", "end")
    @classmethod
    def _clock(cls, value: str) -> str:
        hours, _, minutes = value.partition(":")
        if not (hours.isdigit() and minutes.isdigit() and int(hours) < 24 and int(minutes) < 60):
            raise ValueError(f"expected HH:MM, not {value!r}")
        return value

    def applies(self, model: str, at: float) -> bool:
        if not any(fnmatch.fnmatchcase(model, pattern) for pattern in self.models):
            return False
        moment = datetime.fromtimestamp(at, UTC)
        minute = moment.hour * 60 + moment.minute
        start, end = _minutes(self.start), _minutes(self.end)
        if start <= end:
            return moment.weekday() in self.days and start <= minute < end
        # past midnight: the late part belongs to the day it started
        if minute >= start:
            return moment.weekday() in self.days
        return (moment.weekday() - 1) % 7 in self.days and minute < end


def _minutes(clock: str) -> int:
    hours, _, minutes = clock.partition(":")
    return int(hours) * 60 + int(minutes)


class ScalerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOLLGATE_SCALER_", extra="ignore")

    host: str = Field(default="127.0.0.1", description="Health and metrics listen address.")
    port: int = Field(default=8083, description="Health and metrics listen port.")
    backend: Literal["local", "kubernetes"] = Field(
        default="local", description="Where workers run."
    )
    models: list[str] | None = Field(
        default=None, description="Models to manage (JSON list); every catalog model when unset."
    )
    warm: list[str] = Field(
        default_factory=list, description="Models kept at one worker or more (JSON list)."
    )
    tick_s: float = Field(default=1.0, gt=0, description="Seconds between decisions.")
    heartbeat_misses: int = Field(
        default=3, ge=1, description="Missed worker heartbeats before a worker counts as gone."
    )
    schedule: list[ScheduleOverride] = Field(
        default_factory=list, description="Replica bounds by time of day (JSON list)."
    )
    history_weeks: int = Field(default=4, ge=1, description="Usage history for the profile.")
    history_refresh_s: float = Field(
        default=3600.0, gt=0, description="How often the demand profile is rebuilt."
    )
    drain_timeout_s: float = Field(
        default=150.0, gt=0, description="Local workers still running this long after SIGTERM die."
    )
    namespace: str = Field(default="tollgate", description="Kubernetes namespace of the workers.")
    deployments: dict[str, str] = Field(
        default_factory=dict,
        description="Model id -> worker Deployment name; tollgate-worker-<slug> when absent.",
    )
    decisions_kept: int = Field(default=20, ge=1, description="Decisions shown per model.")
    worker_nkey_file: Path | None = Field(
        default=None,
        description="Local backend: the workers' identity on the bus (their nkey seed file).",
    )
    gpus: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Local backend: GPU ids (or UUIDs) to share out, e.g. 0,1,2,3 or a JSON "
        "list; each worker gets its model's tensor_parallel_size of them as "
        "CUDA_VISIBLE_DEVICES. Empty: no assignment, workers see every GPU.",
    )

    @field_validator("gpus", mode="before")
    @classmethod
    def _device_list(cls, value: object) -> object:
        if isinstance(value, str):
            text = value.strip()
            if not text:
                return []
            value = json.loads(text) if text.startswith("[") else text.split(",")
        if not isinstance(value, list):
            return value
        devices = [str(d).strip() for d in value]
        if any(not d or "," in d for d in devices):
            raise ValueError(f"expected GPU ids such as 0,1 or GPU-<uuid>, not {value!r}")
        if len(set(devices)) != len(devices):
            raise ValueError(f"a GPU is listed twice: {devices}")
        return devices
