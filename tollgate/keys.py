"""API keys: signed JWTs that must also be on the whitelist.

A key is a JWT (key id ``jti``, tenant ``sub``, ``iat``, optional ``exp``)
signed with one of Tollgate's signing keys (``kid`` in its header). The
whitelist is the JetStream KV bucket ``tg_keys``: key id -> :class:`KeyRecord`.
The token itself is never stored; a key is revoked by changing its record.

Public halves of the signing keys live in the KV bucket ``tg_signing_keys``,
so every router learns a rotation without a restart. Private halves stay in a
file readable only by the process that issues keys. HS256 secrets are never
put on the bus: routers get them from their own settings.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import secrets
import time
import uuid
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, rsa
from pydantic import BaseModel, ConfigDict, Field

KEYS_BUCKET = "tg_keys"
SIGNING_BUCKET = "tg_signing_keys"

Algorithm = Literal["EdDSA", "RS256", "HS256"]
BudgetPeriod = Literal["day", "month", "total"]


def budget_window(period: str, now: float) -> str:
    """The budget period a moment falls in: ``20261129`` (day), ``202611`` (month), ``total``."""
    if period == "total":
        return "total"
    return time.strftime("%Y%m%d" if period == "day" else "%Y%m", time.gmtime(now))


class KeyState(StrEnum):
    ACTIVE = "active"
    REVOKED = "revoked"
    OVER_BUDGET = "over_budget"


class KeyRecord(BaseModel):
    """One whitelisted key; the value of ``tg_keys[key_id]``."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["tg.key.v1"] = Field(default="tg.key.v1", description="Contract type id.")
    key_id: str = Field(description="The token's jti.")
    tenant: str = Field(description="Who pays (the token's sub).")
    name: str = Field(default="", description="A label for people.")
    models: list[str] = Field(
        default_factory=lambda: ["*"], description="Model ids or globs the key may use."
    )
    rpm: int | None = Field(default=None, ge=1, description="Requests per minute, or none.")
    tpm: int | None = Field(default=None, ge=1, description="Tokens per minute, or none.")
    budget_tokens: int | None = Field(default=None, ge=1, description="Tokens per period.")
    budget_period: BudgetPeriod | None = Field(default=None, description="Budget period.")
    expires_at: float | None = Field(default=None, description="Unix expiry; none: never.")
    capture: bool = Field(
        default=False, description="Keep this key's requests and responses for analysis."
    )
    state: KeyState = Field(default=KeyState.ACTIVE, description="Lifecycle state.")
    created_at: float = Field(default_factory=time.time, description="Unix creation time.")
    updated_at: float = Field(default_factory=time.time, description="Unix time of last change.")

    def allows(self, names: list[str]) -> bool:
        """Whether any of a model's names (id, aliases) matches the key's models."""
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.models for name in names)

    @property
    def limited(self) -> bool:
        """Whether any limit applies (unlimited keys skip the shared counters)."""
        return (
            self.rpm is not None
            or self.tpm is not None
            or (self.budget_tokens is not None and self.budget_period is not None)
        )

    def usable(self, now: float) -> bool:
        return self.state is KeyState.ACTIVE and (self.expires_at is None or now < self.expires_at)


class SigningKey(BaseModel):
    """The public half of a signing key; the value of ``tg_signing_keys[kid]``."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["tg.signing-key.v1"] = Field(
        default="tg.signing-key.v1", description="Contract type id."
    )
    kid: str = Field(description="Key id, in every token's header.")
    alg: Algorithm = Field(description="The one algorithm tokens of this key may use.")
    public_pem: str | None = Field(default=None, description="PEM public key (none for HS256).")
    retired: bool = Field(default=False, description="Retired keys no longer verify.")
    created_at: float = Field(default_factory=time.time, description="Unix creation time.")


class InvalidToken(Exception):
    """The token is not a valid Tollgate key (which check failed stays internal)."""


class TokenVerifier:
    """Verifies tokens against known signing keys, pinning each key's algorithm.

    The algorithm comes from our record of the key, never from the token's
    header: ``alg: none`` and algorithm confusion (an HS256 token "signed"
    with a public key) fail because the header's algorithm is not the key's.
    """

    # Verified tokens, so a signature is checked once, not on every call. A
    # token cannot change, and the cache is emptied whenever a signing key
    # changes; expiry is checked again on every use.
    CACHE_SIZE = 50_000

    def __init__(self, hs256_secrets: dict[str, str] | None = None) -> None:
        self._keys: dict[str, tuple[str, Any]] = {
            kid: ("HS256", secret.encode()) for kid, secret in (hs256_secrets or {}).items()
        }
        self._verified: dict[str, dict[str, Any]] = {}

    def set_key(self, key: SigningKey) -> None:
        self._verified.clear()
        if key.retired or key.alg == "HS256" or key.public_pem is None:
            if key.alg != "HS256":
                self._keys.pop(key.kid, None)
            return
        public = serialization.load_pem_public_key(key.public_pem.encode())
        self._keys[key.kid] = (key.alg, public)

    def remove(self, kid: str) -> None:
        self._verified.clear()
        self._keys.pop(kid, None)

    def verify(self, token: str) -> dict[str, Any]:
        cached = self._verified.get(token)
        if cached is not None:
            if "exp" in cached and time.time() >= cached["exp"]:
                raise InvalidToken("ExpiredSignatureError")
            return cached
        claims = self._verify(token)
        if len(self._verified) >= self.CACHE_SIZE:
            self._verified.clear()
        self._verified[token] = claims
        return claims

    def _verify(self, token: str) -> dict[str, Any]:
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            raise InvalidToken("malformed") from None
        entry = self._keys.get(str(header.get("kid")))
        if entry is None:
            raise InvalidToken("unknown signing key")
        alg, key = entry
        try:
            claims: dict[str, Any] = jwt.decode(
                token, key, algorithms=[alg], options={"require": ["jti", "sub", "iat"]}
            )
        except jwt.PyJWTError as exc:
            raise InvalidToken(type(exc).__name__) from None
        return claims


class SigningKeySet:
    """Private signing keys, kept in a file with mode 0600; the newest one signs."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.keys: dict[str, dict[str, Any]] = {}
        self.current: str | None = None
        if path.exists():
            data = json.loads(path.read_text())
            self.keys, self.current = data["keys"], data["current"]

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump({"keys": self.keys, "current": self.current}, fh)
        os.replace(tmp, self.path)

    def generate(self, alg: Algorithm = "EdDSA") -> SigningKey:
        """Add a new key and make it the one that signs."""
        kid = f"k{int(time.time())}-{secrets.token_hex(3)}"
        public_pem: str | None = None
        if alg == "HS256":
            self.keys[kid] = {"alg": alg, "secret": secrets.token_urlsafe(48)}
        else:
            private: ed25519.Ed25519PrivateKey | rsa.RSAPrivateKey = (
                ed25519.Ed25519PrivateKey.generate()
                if alg == "EdDSA"
                else rsa.generate_private_key(public_exponent=65537, key_size=2048)
            )
            pem = private.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
            public_pem = (
                private.public_key()
                .public_bytes(
                    serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
                )
                .decode()
            )
            self.keys[kid] = {"alg": alg, "private_pem": pem.decode(), "public_pem": public_pem}
        self.current = kid
        self.save()
        return SigningKey(kid=kid, alg=alg, public_pem=public_pem)

    def public(self, kid: str) -> SigningKey:
        entry = self.keys[kid]
        return SigningKey(kid=kid, alg=entry["alg"], public_pem=entry.get("public_pem"))

    def hs256_secrets(self) -> dict[str, str]:
        return {kid: e["secret"] for kid, e in self.keys.items() if e["alg"] == "HS256"}

    def sign(self, claims: dict[str, Any]) -> str:
        if self.current is None:
            raise RuntimeError("no signing key: generate one first")
        entry = self.keys[self.current]
        key: Any
        if entry["alg"] == "HS256":
            key = entry["secret"]
        else:
            key = serialization.load_pem_private_key(entry["private_pem"].encode(), None)
        return jwt.encode(claims, key, algorithm=entry["alg"], headers={"kid": self.current})


def new_key(
    signing: SigningKeySet,
    *,
    tenant: str,
    name: str = "",
    models: list[str] | None = None,
    ttl_s: float | None = None,
    **limits: Any,
) -> tuple[str, KeyRecord]:
    """A new key: the token (shown once) and its whitelist record."""
    now = time.time()
    # JWT times are whole seconds: round the expiry up, so that a key lives at
    # least its TTL, and keep the whitelist record equal to the token's claim.
    expires_at = float(math.ceil(now + ttl_s)) if ttl_s else None
    record = KeyRecord(
        key_id=uuid.uuid4().hex,
        tenant=tenant,
        name=name,
        models=models or ["*"],
        expires_at=expires_at,
        created_at=now,
        updated_at=now,
        **limits,
    )
    claims: dict[str, Any] = {"jti": record.key_id, "sub": tenant, "iat": int(now)}
    if expires_at is not None:
        claims["exp"] = int(expires_at)
    return "tg-" + signing.sign(claims), record


TOKEN_PREFIX = "tg-"


def strip_prefix(token: str) -> str:
    return token[len(TOKEN_PREFIX) :] if token.startswith(TOKEN_PREFIX) else token


class AuditEvent(BaseModel):
    """A change to the whitelist or the signing keys, on ``tg.audit.keys``."""

    type: Literal["tg.audit.v1"] = Field(default="tg.audit.v1", description="Contract type id.")
    at: float = Field(default_factory=time.time, description="Unix time of the change.")
    actor: str = Field(description="Who changed it (admin API, CLI user, service).")
    action: str = Field(description="create, update, revoke, over_budget, rotate, retire, ...")
    key_id: str | None = Field(default=None, description="The key changed, if any.")
    kid: str | None = Field(default=None, description="The signing key changed, if any.")
    record: dict[str, Any] | None = Field(
        default=None, description="The record after the change (never a token)."
    )


AUDIT_STREAM = "TG_AUDIT"
AUDIT_SUBJECT = "tg.audit.keys"


class KeyStore:
    """The whitelist and the public signing keys in JetStream KV.

    Every change also goes to the audit stream.
    """

    def __init__(self, js: Any, actor: str = "tollgate", replicas: int = 1) -> None:
        self.js = js
        self.actor = actor
        self.replicas = replicas  # copies of the buckets and the audit stream, when created
        self.keys: Any = None
        self.signing: Any = None

    async def audit(self, action: str, **fields: Any) -> None:
        event = AuditEvent(actor=self.actor, action=action, **fields)
        await self.js.publish(AUDIT_SUBJECT, event.model_dump_json().encode())

    async def open(self) -> KeyStore:
        from nats.js.api import KeyValueConfig, StorageType, StreamConfig
        from nats.js.errors import BadRequestError

        try:
            await self.js.add_stream(
                StreamConfig(
                    name=AUDIT_STREAM,
                    subjects=[AUDIT_SUBJECT],
                    storage=StorageType.FILE,
                    num_replicas=self.replicas,
                )
            )
        except BadRequestError:
            pass  # exists

        for attr, bucket in (("keys", KEYS_BUCKET), ("signing", SIGNING_BUCKET)):
            try:
                kv = await self.js.key_value(bucket)
            except Exception:
                kv = await self.js.create_key_value(
                    KeyValueConfig(
                        bucket=bucket, storage=StorageType.FILE, history=5, replicas=self.replicas
                    )
                )
            setattr(self, attr, kv)
        return self

    async def put(self, record: KeyRecord, action: str = "update") -> None:
        await self.keys.put(record.key_id, record.model_dump_json().encode())
        await self.audit(action, key_id=record.key_id, record=record.model_dump(mode="json"))

    async def get(self, key_id: str) -> KeyRecord | None:
        from nats.js.errors import KeyNotFoundError

        try:
            entry = await self.keys.get(key_id)
        except KeyNotFoundError:
            return None
        if entry.value is None:
            return None
        return KeyRecord.model_validate_json(entry.value)

    async def all(self) -> list[KeyRecord]:
        from nats.js.errors import NoKeysError

        try:
            names = await self.keys.keys()
        except NoKeysError:
            return []
        records = [await self.get(name) for name in names]
        return [r for r in records if r is not None]

    async def revoke(self, key_id: str) -> KeyRecord | None:
        record = await self.get(key_id)
        if record is None:
            return None
        record.state = KeyState.REVOKED
        record.updated_at = time.time()
        await self.put(record, "revoke")
        return record

    async def publish_signing_key(self, key: SigningKey, action: str = "publish") -> None:
        await self.signing.put(key.kid, key.model_dump_json().encode())
        await self.audit(action, kid=key.kid)


def write_secret(path: Path, text: str) -> None:
    """Write a file only its owner can read (mode 0600)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text + "\n")


def auth_dir(var_dir: Path) -> Path:
    return var_dir / "auth"


async def bootstrap(js: Any, var_dir: Path, alg: Algorithm = "EdDSA") -> str:
    """First start of the embedded stack: signing key, admin credential, demo key.

    Idempotent: later starts reuse what ``var/auth`` holds. Returns the demo key.
    """
    folder = auth_dir(var_dir)
    signing = SigningKeySet(folder / "signing-keys.json")
    if signing.current is None:
        signing.generate(alg)
    store = await KeyStore(js, actor="tollgate up").open()
    for kid in signing.keys:
        await store.publish_signing_key(signing.public(kid))
    admin = folder / "admin-token"
    if not admin.exists():
        write_secret(admin, "tga-" + secrets.token_urlsafe(32))
    demo = folder / "demo-key"
    if demo.exists():
        token = demo.read_text().strip()
        key_id = jwt.decode(strip_prefix(token), options={"verify_signature": False})["jti"]
        if await store.get(key_id) is not None:
            return token
    token, record = new_key(signing, tenant="demo", name="demo key")
    await store.put(record, "create")
    write_secret(demo, token)
    return token
