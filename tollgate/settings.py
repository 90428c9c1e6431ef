"""Settings shared by every service (environment prefix ``TOLLGATE_``).

Each service adds its own ``BaseSettings`` with its own prefix
(``TOLLGATE_ROUTER_``, ``TOLLGATE_WORKER_``). Settings are loaded once in a
service's ``main()`` and passed down; nothing reads the environment later.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from tollgate.subjects import Subjects


class CommonSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOLLGATE_", extra="ignore")

    nats_url: str = Field(default="nats://127.0.0.1:4222", description="NATS server URL(s).")
    subject_prefix: str = Field(default="tg", description="Prefix of every subject.")
    catalog: Path | None = Field(
        default=None, description="Model catalog file; the packaged models.toml when unset."
    )
    var_dir: Path = Field(default=Path("var"), description="State directory (data, keys, logs).")
    model_cache: Path | None = Field(
        default=None, description="Prepared-model cache; <var_dir>/cache/models when unset."
    )
    model_cache_max_gb: float = Field(
        default=0.0,
        ge=0,
        description="Cache size budget; least recently used models go first (0: no limit).",
    )
    log_level: str = Field(default="INFO", description="Logging level.")
    stream_replicas: int = Field(
        default=1, ge=1, le=5, description="Copies of each JetStream stream and KV bucket."
    )

    @property
    def subjects(self) -> Subjects:
        return Subjects(self.subject_prefix, self.stream_replicas)

    @property
    def model_cache_budget(self) -> int | None:
        return int(self.model_cache_max_gb * 1e9) or None

    @property
    def model_cache_dir(self) -> Path:
        return self.model_cache or self.var_dir / "cache" / "models"
