from __future__ import annotations

import os
import socket
import uuid

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


def _default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class WorkerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOLLGATE_WORKER_", extra="ignore")

    model: str = Field(default="SmolLM2-135M-Instruct", description="Catalog id to serve.")
    worker_id: str = Field(default_factory=_default_worker_id, description="Unique worker id.")
    heartbeat_interval_s: float = Field(default=1.0, gt=0, le=60, description="Heartbeat period.")
    drain_timeout_s: float = Field(
        default=120.0,
        gt=0,
        description="How long SIGTERM waits for in-flight requests and their final reports.",
    )
    fair_share: bool = Field(
        default=True,
        description="Take requests by weighted fair share between tenants and keys "
        "(off: first come, first served).",
    )
    spill_after_s: float = Field(
        default=0.5,
        ge=0,
        description="How long a request waits in another worker's direct lane (cache-aware "
        "routing) before this worker may take it.",
    )
    host: str = Field(default="127.0.0.1", description="Health and metrics listen address.")
    port: int | None = Field(
        default=None, description="Serve /healthz, /readyz and /metrics on this port (off: unset)."
    )
