"""JWT keys: every way a token can be wrong is refused."""

from __future__ import annotations

import base64
import json
import math
import time
from pathlib import Path

import jwt
import pytest

from tollgate.keys.records import KeyRecord, KeyState
from tollgate.keys.tokens import InvalidToken, SigningKeySet, TokenVerifier, new_key, strip_prefix


@pytest.fixture(params=["EdDSA", "RS256", "HS256"])
def signing(request: pytest.FixtureRequest, tmp_path: Path) -> SigningKeySet:
    keys = SigningKeySet(tmp_path / "signing.json")
    keys.generate(request.param)
    return keys


def verifier_for(keys: SigningKeySet) -> TokenVerifier:
    verifier = TokenVerifier(keys.hs256_secrets())
    for kid in keys.keys:
        verifier.set_key(keys.public(kid))
    return verifier


def test_a_new_key_verifies_and_carries_its_claims(signing: SigningKeySet) -> None:
    token, record = new_key(signing, tenant="acme", models=["SmolLM2-*"], ttl_s=60)
    claims = verifier_for(signing).verify(strip_prefix(token))
    assert claims["jti"] == record.key_id and claims["sub"] == "acme"
    assert claims["exp"] == int(record.expires_at or 0)


def test_a_key_lives_at_least_its_ttl(signing: SigningKeySet) -> None:
    before = time.time()
    token, record = new_key(signing, tenant="acme", ttl_s=1)
    claims = verifier_for(signing).verify(strip_prefix(token))
    assert claims["exp"] >= before + 1 and claims["exp"] < before + 2
    assert record.expires_at == claims["exp"]


def test_keys_file_is_private(signing: SigningKeySet) -> None:
    assert signing.path.stat().st_mode & 0o777 == 0o600
    assert SigningKeySet(signing.path).current == signing.current


def _forge(header: dict, claims: dict, signature: bytes = b"") -> str:
    def enc(part: bytes) -> str:
        return base64.urlsafe_b64encode(part).rstrip(b"=").decode()

    return ".".join(
        [enc(json.dumps(header).encode()), enc(json.dumps(claims).encode()), enc(signature)]
    )


def test_alg_none_is_refused(signing: SigningKeySet) -> None:
    token = _forge({"alg": "none", "kid": signing.current}, {"jti": "x", "sub": "t", "iat": 1})
    with pytest.raises(InvalidToken):
        verifier_for(signing).verify(token)


def test_hs256_signed_with_the_public_key_is_refused(tmp_path: Path) -> None:
    keys = SigningKeySet(tmp_path / "s.json")
    public = keys.generate("RS256").public_pem
    assert public is not None
    header = {"alg": "HS256", "kid": keys.current, "typ": "JWT"}
    import hashlib
    import hmac

    signing_input = _forge(header, {"jti": "x", "sub": "t", "iat": 1}).rsplit(".", 1)[0]
    mac = hmac.new(public.encode(), signing_input.encode(), hashlib.sha256).digest()
    token = signing_input + "." + base64.urlsafe_b64encode(mac).rstrip(b"=").decode()
    with pytest.raises(InvalidToken):
        verifier_for(keys).verify(token)


def test_bad_signature_malformed_and_unknown_kid(signing: SigningKeySet, tmp_path: Path) -> None:
    token, _ = new_key(signing, tenant="acme")
    raw = strip_prefix(token)
    verifier = verifier_for(signing)
    head, body, sig = raw.split(".")
    tampered = ".".join([head, body, sig[:-4] + ("AAAA" if sig[-4:] != "AAAA" else "BBBB")])
    for bad in (tampered, "not-a-jwt", "", raw + "x"):
        with pytest.raises(InvalidToken):
            verifier.verify(bad)
    other = SigningKeySet(tmp_path / "other.json")
    other.generate("EdDSA")
    foreign, _ = new_key(other, tenant="acme")
    with pytest.raises(InvalidToken):
        verifier.verify(strip_prefix(foreign))


def test_expired_token_is_refused(signing: SigningKeySet) -> None:
    token = signing.sign({"jti": "x", "sub": "t", "iat": 1, "exp": int(time.time()) - 60})
    with pytest.raises(InvalidToken):
        verifier_for(signing).verify(token)


def test_missing_claims_are_refused(signing: SigningKeySet) -> None:
    with pytest.raises(InvalidToken):
        verifier_for(signing).verify(signing.sign({"sub": "t", "iat": 1}))


def test_rotation_keeps_old_tokens_valid_until_retired(tmp_path: Path) -> None:
    keys = SigningKeySet(tmp_path / "s.json")
    keys.generate("EdDSA")
    old_token, _ = new_key(keys, tenant="acme")
    keys.generate("EdDSA")
    new_token, _ = new_key(keys, tenant="acme")
    verifier = verifier_for(keys)
    for token in (old_token, new_token):
        verifier.verify(strip_prefix(token))
    old_kid = jwt.get_unverified_header(strip_prefix(old_token))["kid"]
    retired = keys.public(old_kid)
    retired.retired = True
    verifier.set_key(retired)
    with pytest.raises(InvalidToken):
        verifier.verify(strip_prefix(old_token))
    verifier.verify(strip_prefix(new_token))


def test_record_model_globs_and_usability() -> None:
    record = KeyRecord(key_id="k", tenant="t", models=["SmolLM2-*", "org/exact"])
    assert record.allows(["SmolLM2-135M-Instruct"])
    assert record.allows(["other", "org/exact"])
    assert not record.allows(["Llama-3"])
    now = time.time()
    assert record.usable(now)
    assert not record.model_copy(update={"expires_at": now - 1}).usable(now)
    assert not record.model_copy(update={"state": KeyState.REVOKED}).usable(now)


def test_cached_verification_still_expires_and_forgets_retired_keys(tmp_path: Path) -> None:
    keys = SigningKeySet(tmp_path / "s.json")
    keys.generate("EdDSA")
    verifier = verifier_for(keys)
    exp = math.ceil(time.time()) + 2
    soon = keys.sign({"jti": "x", "sub": "t", "iat": 1, "exp": exp})
    assert verifier.verify(soon)["jti"] == "x"
    assert verifier.verify(soon)["jti"] == "x"  # served from the cache
    time.sleep(max(0.0, exp - time.time()) + 0.1)
    with pytest.raises(InvalidToken):
        verifier.verify(soon)
    token, _ = new_key(keys, tenant="t")
    verifier.verify(strip_prefix(token))
    retired = keys.public(keys.current or "")
    retired.retired = True
    verifier.set_key(retired)
    with pytest.raises(InvalidToken):
        verifier.verify(strip_prefix(token))
