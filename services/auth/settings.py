from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from tollgate.keys.records import Algorithm


class AuthSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOLLGATE_AUTH_", extra="ignore")

    host: str = Field(default="127.0.0.1", description="Admin API listen address.")
    port: int = Field(default=8081, description="Admin API listen port.")
    admin_token: SecretStr | None = Field(
        default=None, description="Admin credential; <var>/auth/admin-token when unset."
    )
    signing_keys_file: Path | None = Field(
        default=None, description="Private signing keys; <var>/auth/signing-keys.json when unset."
    )
    algorithm: Algorithm = Field(
        default="EdDSA", description="Algorithm of the first signing key (EdDSA, RS256, HS256)."
    )
    reactivate_every_s: float = Field(
        default=30.0, gt=0, description="How often key states are reconciled with their spend."
    )
