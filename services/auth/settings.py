from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from tollgate.keys.records import Algorithm
from tollgate.runtime.httpserver import HttpLimits
from tollgate.runtime.settings import SettingError

# An admin token shorter than this is refused: `tollgate up` generates 47 characters.
ADMIN_TOKEN_MIN_CHARS = 32
# The placeholders shipped in .env.example and deploy/ (and any token that
# still carries their words): a copied example never opens the admin API.
ADMIN_TOKEN_PLACEHOLDERS = frozenset({"tga-change-me", "tga-replace-me", "tga-..."})
_PLACEHOLDER_WORDS = ("change-me", "changeme", "replace-me", "replaceme")


class AuthSettings(BaseSettings, HttpLimits):
    """The auth service's settings; ``HttpLimits`` adds the admin API's client bounds."""

    model_config = SettingsConfigDict(env_prefix="TOLLGATE_AUTH_", extra="ignore")

    host: str = Field(default="127.0.0.1", description="Admin API listen address.")
    port: int = Field(default=8081, description="Admin API listen port.")
    admin_token: SecretStr | None = Field(
        default=None,
        description="Admin credential (at least 32 characters, no placeholder); "
        "<var>/auth/admin-token when unset.",
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
    webhook_retry_s: float = Field(
        default=5.0,
        gt=0,
        description="The first retry of a webhook that did not acknowledge a spend alert "
        "(doubling to ten minutes).",
    )


def load_admin_token(settings: AuthSettings, auth_folder: Path) -> str:
    """The admin credential, from the setting or ``<var>/auth/admin-token``.

    Raises :class:`SettingError` (the service does not start, exit status 78)
    when there is none, it is shorter than :data:`ADMIN_TOKEN_MIN_CHARS`, or it
    is a shipped placeholder. The message names the setting, never the value.
    """
    if settings.admin_token is not None:
        token = settings.admin_token.get_secret_value()
        where = "TOLLGATE_AUTH_ADMIN_TOKEN"
    else:
        path = auth_folder / "admin-token"
        where = f"TOLLGATE_AUTH_ADMIN_TOKEN (unset; read from {path})"
        try:
            token = path.read_text().strip()
        except OSError as exc:
            raise SettingError(
                f"{where}: cannot read it ({exc.strerror or type(exc).__name__}); "
                "set TOLLGATE_AUTH_ADMIN_TOKEN or run `tollgate up` once"
            ) from None
    lowered = token.lower()
    if token in ADMIN_TOKEN_PLACEHOLDERS or any(w in lowered for w in _PLACEHOLDER_WORDS):
        raise SettingError(f"{where}: is a placeholder; set a random secret")
    if len(token) < ADMIN_TOKEN_MIN_CHARS:
        raise SettingError(
            f"{where}: must be at least {ADMIN_TOKEN_MIN_CHARS} characters"
            f" ({'it is empty' if not token else f'it has {len(token)}'}); set a random secret,"
            " e.g. python -c \"import secrets; print('tga-' + secrets.token_urlsafe(32))\""
        )
    return token
