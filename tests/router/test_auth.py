"""Every call needs a whitelisted key for a model it may use (on a running stack)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import time

import httpx
import jwt
import pytest

from tests.conftest import SIM_MODEL, SLOW_MODEL, Stack
from tollgate.keys.records import KeyState
from tollgate.keys.store import KeyStore
from tollgate.keys.tokens import SigningKeySet, auth_dir, new_key, strip_prefix
from tollgate.wire.subjects import Subjects
from tollgate.wire.topology import Topology

CHAT = "/v1/chat/completions"
BODY = {"model": SIM_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def signing_keys(stack: Stack) -> SigningKeySet:
    return SigningKeySet(auth_dir(stack.var_dir) / "signing-keys.json")


async def make_key(stack: Stack, **kwargs: object) -> tuple[str, str]:
    """Issue and whitelist a key; returns (token, key id)."""
    token, record = new_key(signing_keys(stack), tenant=str(kwargs.pop("tenant", "t1")), **kwargs)  # type: ignore[arg-type]
    nc = await stack.nats.connect(name="test-keys")
    try:
        await (await KeyStore(nc.jetstream(), Topology(Subjects())).open()).put(record)
    finally:
        await nc.close()
    return token, record.key_id


async def wait_status(url: str, token: str, status: int, timeout: float = 30) -> float:
    """Poll until a call with `token` gets `status`; the time it took."""
    start = time.monotonic()
    async with httpx.AsyncClient(timeout=5) as http:
        while time.monotonic() - start < timeout:
            r = await http.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {token}"})
            if r.status_code == status:
                return time.monotonic() - start
            await asyncio.sleep(0.005)
    raise AssertionError(f"never got {status}")


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def assert_401(r: httpx.Response) -> None:
    assert r.status_code == 401, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"


def post(url: str, token: str | None, header: str = "Authorization") -> httpx.Response:
    headers = {}
    if token is not None:
        headers[header] = f"Bearer {token}" if header == "Authorization" else token
    return httpx.post(f"{url}{CHAT}", json=BODY, headers=headers, timeout=10)


def test_missing_key(router_url: str) -> None:
    assert_401(post(router_url, None))
    assert "didn't provide an API key" in post(router_url, None).json()["error"]["message"]


def test_malformed_token(router_url: str) -> None:
    assert_401(post(router_url, "not.a.jwt"))
    assert_401(post(router_url, "tg-garbage"))


def test_bad_signature(router_url: str, api_key: str) -> None:
    head, body, sig = strip_prefix(api_key).split(".")
    flipped = sig[:-2] + ("AA" if sig[-2:] != "AA" else "BB")
    assert_401(post(router_url, f"{head}.{body}.{flipped}"))


def test_alg_none(router_url: str, stack: Stack, api_key: str) -> None:
    claims = jwt.decode(strip_prefix(api_key), options={"verify_signature": False})
    header = {"alg": "none", "typ": "JWT", "kid": signing_keys(stack).current}
    token = f"{b64(json.dumps(header).encode())}.{b64(json.dumps(claims).encode())}."
    assert_401(post(router_url, token))


def test_hs256_signed_with_the_public_key(router_url: str, stack: Stack, api_key: str) -> None:
    keys = signing_keys(stack)
    public = keys.public(keys.current or "").public_pem or ""
    claims = jwt.decode(strip_prefix(api_key), options={"verify_signature": False})
    header = {"alg": "HS256", "typ": "JWT", "kid": keys.current}
    signing_input = f"{b64(json.dumps(header).encode())}.{b64(json.dumps(claims).encode())}"
    mac = hmac.new(public.encode(), signing_input.encode(), hashlib.sha256).digest()
    assert_401(post(router_url, f"{signing_input}.{b64(mac)}"))


async def test_expired_key(router_url: str, stack: Stack) -> None:
    token, _ = await make_key(stack, ttl_s=5)
    await wait_status(router_url, token, 200)
    exp = jwt.decode(strip_prefix(token), options={"verify_signature": False})["exp"]
    await asyncio.sleep(max(0.0, exp - time.time()) + 0.05)
    assert_401(post(router_url, token))


def test_signed_but_not_on_the_whitelist(router_url: str, stack: Stack) -> None:
    token, _ = new_key(signing_keys(stack), tenant="t1")  # never stored in KV
    assert_401(post(router_url, token))


async def test_revoked_key(router_url: str, stack: Stack) -> None:
    token, key_id = await make_key(stack)
    await wait_status(router_url, token, 200)
    nc = await stack.nats.connect(name="test-revoke")
    try:
        record = await (await KeyStore(nc.jetstream(), Topology(Subjects())).open()).revoke(key_id)
    finally:
        await nc.close()
    assert record is not None and record.state is KeyState.REVOKED
    await wait_status(router_url, token, 401)
    assert_401(post(router_url, token))


@pytest.mark.usefixtures("sim_workers")
async def test_azure_style_api_key_header(router_url: str, api_key: str) -> None:
    r = post(router_url, api_key, header="api-key")
    assert r.status_code == 200, r.text


@pytest.mark.usefixtures("sim_workers")
async def test_models_outside_the_key_are_not_found_and_not_listed(
    router_url: str, stack: Stack
) -> None:
    token, _ = await make_key(stack, models=["sim/echo-?"])  # not its adapters (sim/echo-…)
    await wait_status(router_url, token, 200)
    headers = {"Authorization": f"Bearer {token}"}
    listed = httpx.get(f"{router_url}/v1/models", headers=headers, timeout=10).json()
    assert [m["id"] for m in listed["data"]] == [SIM_MODEL]
    ok = httpx.post(f"{router_url}{CHAT}", json=BODY, headers=headers, timeout=10)
    assert ok.status_code == 200
    denied = httpx.post(
        f"{router_url}{CHAT}", json={**BODY, "model": SLOW_MODEL}, headers=headers, timeout=10
    )
    assert denied.status_code == 404 and denied.json()["error"]["code"] == "model_not_found"
    hidden = httpx.get(f"{router_url}/v1/models/{SLOW_MODEL}", headers=headers, timeout=10)
    assert hidden.status_code == 404


async def test_revocation_reaches_every_router(router_url: str, stack: Stack) -> None:
    _, second = stack.router()
    token, key_id = await make_key(stack)
    for url in (router_url, second):
        await wait_status(url, token, 200)
    nc = await stack.nats.connect(name="test-revoke")
    try:
        store = await KeyStore(nc.jetstream(), Topology(Subjects())).open()
        started = time.monotonic()
        await store.revoke(key_id)
        took = await asyncio.gather(*(wait_status(u, token, 401) for u in (router_url, second)))
    finally:
        await nc.close()
    elapsed = time.monotonic() - started
    print(f"revocation reached both routers in {1000 * elapsed:.1f} ms ({took})")
