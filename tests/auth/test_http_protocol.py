"""The admin API's HTTP layer against hostile clients, spoken by hand over raw sockets.

The auth app comes from its factory, served as ``python -m services.auth``
serves it (``tollgate.runtime.httpserver``) on a free port, under a subject
prefix of its own. Every refusal is OpenAI-shaped, and the admin token is in
no response and no log record.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import orjson
import pytest
from pydantic import SecretStr

from services.auth.app import create_app
from services.auth.settings import AuthSettings
from tests.conftest import NatsServer
from tests.lib.net import free_port
from tests.lib.rawhttp import assert_openai_error, exchange, parse, reset_mid_body, trickle
from tollgate.runtime.httpserver import HttpLimits, start
from tollgate.wire.topology import Role

TOKEN = "tga-http-protocol-test-0123456789abcdefghij"
HEADER_TIMEOUT_S = 0.5
BODY_TIMEOUT_S = 0.5
CUT_SLACK_S = 1.5


@dataclass
class Admin:
    port: int
    caplog: pytest.LogCaptureFixture

    def assert_no_token(self, raw: bytes) -> None:
        assert TOKEN.encode() not in raw
        assert TOKEN not in self.caplog.text


@pytest.fixture
async def admin(
    nats_server: NatsServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> AsyncIterator[Admin]:
    caplog.set_level(logging.DEBUG)  # aiohttp's own traces included
    prefix = f"authhttp-{uuid.uuid4().hex[:10]}"
    common = nats_server.settings(Role.AUTH, prefix, var_dir=tmp_path)
    settings = AuthSettings(
        admin_token=SecretStr(TOKEN), signing_keys_file=tmp_path / "signing-keys.json"
    )
    port = free_port()
    limits = HttpLimits(header_timeout_s=HEADER_TIMEOUT_S, body_timeout_s=BODY_TIMEOUT_S)
    runner = await start(create_app(settings, common), "127.0.0.1", port, limits=limits)
    try:
        yield Admin(port, caplog)
    finally:
        await runner.cleanup()


def request(method: str, path: str, headers: list[bytes], body: bytes = b"") -> bytes:
    lines = [f"{method} {path} HTTP/1.1".encode(), b"Host: 127.0.0.1", b"Connection: close"]
    lines += headers
    if body:
        lines.append(f"Content-Length: {len(body)}".encode())
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


AUTH = b"Authorization: Bearer " + TOKEN.encode()


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"GET /admin/keys HTTP/1.1\r\nHost: x\r\n" + AUTH + b"a" * 9000 + b"\r\n\r\n", 431),
        (b"GET /admin/keys HTTP/1.1\r\nHost: x\r\n" + AUTH + b"\x01\r\n\r\n", 400),
        (b"G@T /admin/keys?t=" + TOKEN.encode() + b" HTTP/1.1\r\nHost: x\r\n\r\n", 400),
        (b"GET /admin/keys?t=" + TOKEN.encode() + b" HTTP/2.7\r\nHost: x\r\n\r\n", 400),
    ],
    ids=["header line over 8190 bytes", "control character", "bad method", "bad version"],
)
async def test_malformed_http_is_an_openai_error_that_quotes_nothing(
    admin: Admin, raw: bytes, status: int
) -> None:
    received = await exchange(admin.port, raw)
    assert_openai_error(parse(received), status)
    admin.assert_no_token(received)


@pytest.mark.parametrize(
    "header", [b"Authorization: Bearer \xff\xfe", b"Authorization: Bearer tga-\xc3\x28" + b"a" * 40]
)
async def test_an_authorization_that_is_not_utf8_is_a_401(admin: Admin, header: bytes) -> None:
    reply = parse(await exchange(admin.port, request("GET", "/admin/keys", [header])))
    assert_openai_error(reply, 401, "invalid_admin_key")
    assert "admin request failed" not in admin.caplog.text


# ids no key can have: not NATS KV keys (wildcards, empty tokens, spaces, NUL,
# non-ASCII), or longer than any id Tollgate makes
BAD_IDS = ["*", ">", ".", "a.*", "a..b", ".a", "a b", "\x00", "é", "a>b", "x" * 200, "x" * 5000]


@pytest.mark.parametrize("key_id", BAD_IDS, ids=lambda v: v if len(v) < 20 else f"{len(v)} chars")
async def test_a_key_id_that_cannot_exist_is_a_404(admin: Admin, key_id: str) -> None:
    path = f"/admin/keys/{quote(key_id, safe='')}"
    body = orjson.dumps({"name": "x"})
    for method, payload in (("GET", b""), ("PATCH", body), ("DELETE", b"")):
        headers = [AUTH, b"Content-Type: application/json"]
        reply = parse(await exchange(admin.port, request(method, path, headers, payload)))
        assert_openai_error(reply, 404, "not_found")
    retire = f"/admin/signing-keys/{quote(key_id, safe='')}/retire"
    reply = parse(await exchange(admin.port, request("POST", retire, [AUTH])))
    assert_openai_error(reply, 404, "not_found")
    assert "admin request failed" not in admin.caplog.text


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("PUT", "/admin/keys", "GET, HEAD, POST"),
        ("POST", "/admin/keys/abc", "DELETE, GET, HEAD, PATCH"),
        ("GET", "/admin/signing-keys/rotate", "POST"),
    ],
)
async def test_a_405_names_the_allowed_methods(
    admin: Admin, method: str, path: str, allow: str
) -> None:
    reply = parse(await exchange(admin.port, request(method, path, [AUTH])))
    assert_openai_error(reply, 405, "method_not_allowed")
    assert reply.headers["allow"] == allow


@pytest.mark.parametrize("encoding", ["br", "compress", "x-custom"])
async def test_an_unsupported_content_encoding_is_a_415(admin: Admin, encoding: str) -> None:
    headers = [AUTH, b"Content-Type: application/json", f"Content-Encoding: {encoding}".encode()]
    body = orjson.dumps({"tenant": "acme"})
    reply = parse(await exchange(admin.port, request("POST", "/admin/keys", headers, body)))
    assert_openai_error(reply, 415)


async def test_a_body_that_is_not_in_its_content_encoding_is_a_400(admin: Admin) -> None:
    headers = [AUTH, b"Content-Type: application/json", b"Content-Encoding: gzip"]
    body = orjson.dumps({"tenant": "acme"})
    reply = parse(await exchange(admin.port, request("POST", "/admin/keys", headers, body)))
    assert_openai_error(reply, 400, "invalid_body")
    assert "admin request failed" not in admin.caplog.text


async def test_slow_clients_are_cut_off(admin: Admin) -> None:
    slow_heads = [
        trickle(admin.port, b"GET /admin/keys HTTP/1.1\r\n", b"X-Slow: " + b"a" * 200)
        for _ in range(10)
    ]
    body = orjson.dumps({"tenant": "acme", "name": "a" * 100})
    head = request("POST", "/admin/keys", [AUTH, b"Content-Type: application/json"], body)
    slow_bodies = [trickle(admin.port, head[: -len(body)], body) for _ in range(10)]
    results = await asyncio.gather(*slow_heads, *slow_bodies)
    for received, closed_after in results:
        bound = max(HEADER_TIMEOUT_S, BODY_TIMEOUT_S) + CUT_SLACK_S
        assert closed_after < bound, closed_after
        assert_openai_error(parse(received), 408, "request_timeout")
        admin.assert_no_token(received)


async def test_an_aborted_upload_is_a_499_logged_at_info(admin: Admin) -> None:
    body = orjson.dumps({"tenant": "acme", "name": "a" * 100_000})
    head = request("POST", "/admin/keys", [AUTH, b"Content-Type: application/json"], body)
    await reset_mid_body(admin.port, head[: -len(body)], body[:1000])
    deadline = time.monotonic() + 10
    while not [r for r in admin.caplog.records if r.msg == "client closed the request"]:
        assert time.monotonic() < deadline, admin.caplog.text
        await asyncio.sleep(0.05)
    ending = next(r for r in admin.caplog.records if r.msg == "client closed the request")
    assert ending.levelno == logging.INFO and ending.status == 499  # type: ignore[attr-defined]
    assert not [r for r in admin.caplog.records if r.exc_info], admin.caplog.text
