"""Settings shared by every service (environment prefix ``TOLLGATE_``).

Each service adds its own ``BaseSettings`` with its own prefix
(``TOLLGATE_ROUTER_``, ``TOLLGATE_WORKER_``). Settings are loaded once in a
service's ``main()`` and passed down; nothing reads the environment later.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from urllib.parse import urlsplit

from nats.aio.client import Client as NATS
from pydantic import AliasChoices, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from tollgate.wire import bus
from tollgate.wire.permissions import inbox_prefix
from tollgate.wire.subjects import PREFIX_PATTERN, Subjects
from tollgate.wire.topology import Role, Topology


class SettingError(Exception):
    """A setting that cannot work. The message names the setting, never a secret."""


def _env(name: str, *standard: str) -> AliasChoices:
    """Read ``TOLLGATE_<NAME>`` first, then the standard variables of that tool."""
    return AliasChoices(f"TOLLGATE_{name.upper()}", *standard)


class CommonSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOLLGATE_", extra="ignore", populate_by_name=True)

    nats_url: str = Field(default="nats://127.0.0.1:4222", description="NATS server URL(s).")
    nats_nkey_file: Path | None = Field(
        default=None,
        description="This process's identity on the bus: a file holding its role's nkey seed.",
    )
    nats_tls_ca: Path | None = Field(
        default=None,
        description="CA certificate(s) the NATS server's certificate must chain to (turns on TLS).",
    )
    nats_tls_cert: Path | None = Field(
        default=None, description="Client certificate, for a NATS server that requires mutual TLS."
    )
    nats_tls_key: Path | None = Field(
        default=None, description="The client certificate's private key."
    )
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

    def bus_access(self, role: Role) -> bus.Access:
        """This process's identity and TLS settings on the bus, read and checked now."""
        seed = None
        nkey_file = self.nats_nkey_file
        if nkey_file is None:
            # `tollgate up` keeps each role's seed here; the operator's tools find theirs.
            kept = self.var_dir / "nats" / "identities" / f"{self.subject_prefix}-{role.value}.nk"
            nkey_file = kept if kept.exists() else None
        if nkey_file is not None:
            try:
                seed = nkey_file.read_text().strip()
            except OSError as exc:
                raise SettingError(
                    f"TOLLGATE_NATS_NKEY_FILE: cannot read {nkey_file}: {exc.strerror}"
                ) from None
            if not (seed.startswith("SU") and len(seed) == 58):
                raise SettingError(
                    f"TOLLGATE_NATS_NKEY_FILE: {nkey_file} does not hold a user nkey seed"
                )
        tls = None
        wants_tls = any(u.strip().startswith("tls://") for u in self.nats_url.split(","))
        if self.nats_tls_ca is not None or wants_tls:
            try:
                tls = ssl.create_default_context(
                    cafile=str(self.nats_tls_ca) if self.nats_tls_ca else None
                )
                if self.nats_tls_cert is not None:
                    key = str(self.nats_tls_key) if self.nats_tls_key else None
                    tls.load_cert_chain(str(self.nats_tls_cert), key)
            except (OSError, ssl.SSLError) as exc:
                raise SettingError(f"TOLLGATE_NATS_TLS_CA/_CERT/_KEY: cannot load: {exc}") from None
        return bus.Access(seed, tls, inbox_prefix(self.topology, role))

    async def connect(self, role: Role, name: str) -> NATS:
        """Connect to the bus as ``role``; a refused identity is a :class:`SettingError`."""
        access = self.bus_access(role)
        try:
            return await bus.connect(self.nats_url, name, access)
        except bus.BusRefused:
            where = ", ".join(
                urlsplit(u.strip()).netloc.rpartition("@")[2] for u in self.nats_url.split(",")
            )
            given = "the key in it" if self.nats_nkey_file else "no key (it is not set)"
            raise SettingError(
                f"TOLLGATE_NATS_NKEY_FILE: NATS at {where} refused {given} for the "
                f"{role.value} identity"
            ) from None

    @property
    def model_cache_budget(self) -> int | None:
        return int(self.model_cache_max_gb * 1e9) or None

    @property
    def model_cache_dir(self) -> Path:
        return self.model_cache or self.var_dir / "cache" / "models"
