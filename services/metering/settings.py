from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class MeteringSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOLLGATE_METERING_", extra="ignore")

    host: str = Field(default="127.0.0.1", description="Health and metrics listen address.")
    port: int = Field(default=8082, description="Health and metrics listen port.")
    clickhouse_dsn: SecretStr | None = Field(
        default=None,
        description=(
            "chdb:///path for the embedded engine (default <var>/clickhouse), or "
            "http(s)://user:password@host:8123 for a ClickHouse server."
        ),
    )
    query_dsn: SecretStr | None = Field(
        default=None,
        description=(
            "With a ClickHouse server: http(s)://analyst:password@host:8123, the read-only "
            "user analysts' queries (tollgate sql, tg.metering.query) run as; its profile "
            "holds their limits. Ignored with the embedded engine."
        ),
    )
    database: str = Field(default="tollgate", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    batch_max_rows: int = Field(default=5000, ge=1, description="Insert at most this many rows.")
    batch_max_wait_s: float = Field(
        default=1.0, gt=0, description="Insert a partial batch this long after its first event."
    )
    ack_wait_s: float = Field(
        default=60.0, gt=1, description="Redelivery delay for events not acked (a crashed writer)."
    )
    nice: int = Field(
        default=10,
        ge=0,
        le=19,
        description=(
            "CPU niceness added at start: on a shared host, request serving gets the CPU "
            "first and the meter uses what is left (its rows may lag, never drop)."
        ),
    )
    retry_max_s: float = Field(default=10.0, gt=0, description="Longest back-off between retries.")
    rollup_check_days: int = Field(
        default=2,
        ge=0,
        description="At start, check (and rebuild) the rollups of this many days, and of the "
        "days of the rows ingested in them.",
    )
    query_max_rows: int = Field(default=10_000, ge=1, description="Most rows a query returns.")
    query_timeout_s: float = Field(default=30.0, gt=0, description="max_execution_time of queries.")
    query_max_memory_bytes: int = Field(
        default=2 * 1024**3,
        ge=1024**2,
        description=(
            "max_memory_usage of analysts' queries (where no query DSN's profile sets it): "
            "on the embedded engine it is the metering service's own memory."
        ),
    )
    fault_file: Path | None = Field(
        default=None,
        description=(
            "Fault injection, for soak and chaos runs only; unset (off) by default. While this "
            "file exists every usage insert fails: refused before writing, or, when the file "
            "holds 'after', written and then reported as failed (an unclear failure)."
        ),
    )

    def dsn(self, var_dir: Path) -> str:
        if self.clickhouse_dsn is not None:
            return self.clickhouse_dsn.get_secret_value()
        return f"chdb://{(var_dir / 'clickhouse').resolve()}"

    capture_retention_days: int = Field(
        default=30, ge=1, description="Captured exchanges are deleted after this many days."
    )
