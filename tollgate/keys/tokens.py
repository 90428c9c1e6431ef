"""Key tokens: signing (private halves in a 0600 file) and verification.

Public halves of the signing keys are published on the bus, so every router
learns a rotation without a restart. Private halves stay in a file readable
only by the process that issues keys. HS256 secrets are never put on the bus:
routers get them from their own settings.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import time
import uuid
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, rsa

from tollgate.keys.records import Algorithm, KeyRecord, SigningKey


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
        write_secret(self.path, json.dumps({"keys": self.keys, "current": self.current}))

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


def write_secret(path: Path, text: str) -> None:
    """Write a file only its owner can read (mode 0600), whole or not at all.

    The text is written to a temporary file beside it, then moved into place;
    it ends with a newline.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text if text.endswith("\n") else text + "\n")
    os.replace(tmp, path)


def auth_dir(var_dir: Path) -> Path:
    return var_dir / "auth"
