"""Settings shared by every service (environment prefix ``TOLLGATE_``).

Each service adds its own ``BaseSettings`` with its own prefix
(``TOLLGATE_ROUTER_``, ``TOLLGATE_WORKER_``). Settings are loaded once in a
service's ``main()`` and passed down; nothing reads the environment later.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import AliasChoices, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from tollgate.wire.subjects import PREFIX_PATTERN, Subjects
from tollgate.wire.topology import Topology


def _env(name: str, *standard: str) -> AliasChoices:
    """Read ``TOLLGATE_<NAME>`` first, then the standard variables of that tool."""
    return AliasChoices(f"TOLLGATE_{name.upper()}", *standard)


class CommonSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOLLGATE_", extra="ignore", populate_by_name=True)

    nats_url: str = Field(default="nats://127.0.0.1:4222", description="NATS server URL(s).")
    subject_prefix: str = Field(
        default="tg",
        pattern=PREFIX_PATTERN.pattern,
        description="Prefix of every subject, stream and key-value bucket.",
    )
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
    model_fetch_concurrency: int = Field(
        default=8, ge=1, le=64, description="Parallel downloads (files and ranges) per model."
    )
    model_fetch_part_mb: float = Field(
        default=64.0, gt=0, description="Size of each ranged download of a large S3 object."
    )
    s3_endpoint_url: str | None = Field(
        default=None,
        validation_alias=_env("s3_endpoint_url", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"),
        description="S3-compatible endpoint (MinIO, Ceph, GCS); AWS S3 when unset.",
    )
    s3_region: str | None = Field(
        default=None,
        validation_alias=_env("s3_region", "AWS_REGION", "AWS_DEFAULT_REGION"),
        description="S3 region (us-east-1 when unset).",
    )
    s3_access_key_id: str | None = Field(
        default=None,
        validation_alias=_env("s3_access_key_id"),
        description="S3 access key; unset: AWS_* variables, AWS profile, then the pod's role.",
    )
    s3_secret_access_key: SecretStr | None = Field(
        default=None, validation_alias=_env("s3_secret_access_key"), description="S3 secret key."
    )
    s3_session_token: SecretStr | None = Field(
        default=None, validation_alias=_env("s3_session_token"), description="S3 session token."
    )
    hf_endpoint: str | None = Field(
        default=None,
        validation_alias=_env("hf_endpoint", "HF_ENDPOINT"),
        description="Hugging Face hub or mirror URL (https://huggingface.co when unset).",
    )
    hf_token: SecretStr | None = Field(
        default=None,
        validation_alias=_env("hf_token", "HF_TOKEN"),
        description="Hugging Face token for private or gated repositories.",
    )
    hf_offline: bool = Field(
        default=False,
        validation_alias=_env("hf_offline", "HF_HUB_OFFLINE"),
        description="Never ask the hub; hf:// models come from the cache only.",
    )
    log_level: str = Field(default="INFO", description="Logging level.")
    stream_replicas: int = Field(
        default=1, ge=1, le=5, description="Copies of each JetStream stream and KV bucket."
    )

    @property
    def subjects(self) -> Subjects:
        return Subjects(self.subject_prefix, self.stream_replicas)

    @property
    def topology(self) -> Topology:
        return Topology(self.subjects)

    @property
    def model_cache_budget(self) -> int | None:
        return int(self.model_cache_max_gb * 1e9) or None

    @property
    def model_cache_dir(self) -> Path:
        return self.model_cache or self.var_dir / "cache" / "models"
