"""The router's HTTP layer against hostile clients, spoken by hand over raw sockets.

Requests no HTTP client would send (malformed heads, bodies that lie about
their encoding, bytes that are not text in ``Authorization``), clients that
trickle, and clients that hang up mid-upload: each gets an OpenAI-shaped
answer with the right status, or is cut off within a bound; and the API key
is in no response and no line of the router's log.
"""

from __future__ import annotations

import asyncio
import gzip
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import orjson
import pytest

from tests.conftest import SLOW_MODEL, Service, Stack
from tests.lib.rawhttp import (
    assert_openai_error,
    exchange,
    parse,
    reset_mid_body,
    trickle,
)

HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.5
CUT_SLACK_S = 1.5  # timers and scheduling, on a loaded test machine
CHAT = "/v1/chat/completions"
UNKNOWN = {"model": "no/such-model", "messages": [{"role": "user", "content": "hi"}]}


@dataclass
class Edge:
    service: Service
    port: int
    key: str

    def log(self) -> str:
        return self.service.log_text()


@pytest.fixture(scope="module")
def edge(stack: Stack, api_key: str) -> Iterator[Edge]:
    """A router of its own, with short read timeouts."""
    service, base = stack.router(
        TOLLGATE_ROUTER_HEADER_TIMEOUT_S=str(HEADER_TIMEOUT_S),
        TOLLGATE_ROUTER_BODY_TIMEOUT_S=str(BODY_TIMEOUT_S),
    )
    yield Edge(service, int(base.rsplit(":", 1)[1]), api_key)
    assert service.stop() == 0  # SIGTERM: a graceful stop


def request(
    method: str, path: str, headers: list[tuple[str, str]] | list[bytes], body: bytes = b""
) -> bytes:
    """One request, ``Connection: close`` (headers as pairs, or as raw lines)."""
    lines = [f"{method} {path} HTTP/1.1".encode(), b"Host: 127.0.0.1", b"Connection: close"]
    for header in headers:
        lines.append(header if isinstance(header, bytes) else ": ".join(header).encode())
    if body:
        lines.append(f"Content-Length: {len(body)}".encode())
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def assert_no_key(edge: Edge, raw: bytes) -> None:
    assert edge.key.encode() not in raw
    assert edge.key not in edge.log()


def malformed(key: str) -> dict[str, tuple[bytes, int]]:
    """Heads aiohttp refuses, each with the key in the bytes it would quote back."""
    k = key.encode()
    auth = b"Authorization: Bearer " + k
    head = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n"
    return {
        "header line over 8190 bytes": (head + auth + b"a" * 9000 + b"\r\n\r\n", 431),
        "request line over 8190 bytes": (
            b"GET /v1/models?k=" + k + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
            431,
        ),
        "control character in a header value": (head + auth + b"\x01\r\n\r\n", 400),
        "bad character in a header name": (
            head + b"Auth\x01orization: Bearer " + k + b"\r\n\r\n",
            400,
        ),
        "duplicate Content-Type": (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + auth + b"\r\n"
            b"Content-Type: application/json\r\nContent-Type: text/plain\r\n"
            b"Content-Length: 2\r\n\r\n{}",
            400,
        ),
        "bad method": (b"G@T /v1/models?k=" + k + b" HTTP/1.1\r\nHost: x\r\n\r\n", 400),
        "bad HTTP version": (b"GET /v1/models?k=" + k + b" HTTP/9.9\r\nHost: x\r\n\r\n", 400),
        "Content-Length with Transfer-Encoding": (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + auth + b"\r\n"
            b"Content-Length: 2\r\nTransfer-Encoding: chunked, " + k + b"\r\n\r\n{}",
            400,
        ),
    }


CASES = list(malformed("tg-x"))


@pytest.mark.parametrize("case", CASES)
async def test_malformed_http_is_an_openai_error_that_quotes_nothing(edge: Edge, case: str) -> None:
    raw, status = malformed(edge.key)[case]
    received = await exchange(edge.port, raw)
    reply = parse(received)
    assert_openai_error(reply, status)
    assert reply.headers.get("connection", "").lower() == "close" or reply.raw.startswith(
        b"HTTP/1.0"
    )
    assert_no_key(edge, received)


def auth(edge: Edge) -> list[tuple[str, str]]:
    return [("Authorization", f"Bearer {edge.key}"), ("Content-Type", "application/json")]


async def test_a_body_that_is_not_in_its_content_encoding_is_a_400(edge: Edge) -> None:
    raw = request("POST", CHAT, [*auth(edge), ("Content-Encoding", "gzip")], orjson.dumps(UNKNOWN))
    received = await exchange(edge.port, raw)
    assert_openai_error(parse(received), 400, "invalid_body")
    assert "unhandled error" not in edge.log()
    assert_no_key(edge, received)


@pytest.mark.parametrize(
    ("encoding", "compress"), [("gzip", gzip.compress), ("deflate", zlib.compress)]
)
async def test_a_compressed_body_is_decoded(
    edge: Edge, encoding: str, compress: Callable[[bytes], bytes]
) -> None:
    body = compress(orjson.dumps(UNKNOWN))
    raw = request("POST", CHAT, [*auth(edge), ("Content-Encoding", encoding)], body)
    # read and parsed: the model it names is unknown
    reply = parse(await exchange(edge.port, raw))
    error = assert_openai_error(reply, 404, "model_not_found", param="model")
    assert "no/such-model" in error["message"]


async def test_a_zip_bomb_is_bounded_by_the_body_limit(edge: Edge) -> None:
    big = orjson.dumps({**UNKNOWN, "pad": "a" * (16 * 1024 * 1024)})
    body = gzip.compress(big)
    assert len(body) < 64 * 1024  # 16 MiB decompressed from a few KiB
    raw = request("POST", CHAT, [*auth(edge), ("Content-Encoding", "gzip")], body)
    assert_openai_error(parse(await exchange(edge.port, raw)), 413, "request_too_large")


@pytest.mark.parametrize("encoding", ["br", "compress", "gzip, gzip", "x-custom"])
async def test_an_unsupported_content_encoding_is_a_415(edge: Edge, encoding: str) -> None:
    body = orjson.dumps(UNKNOWN)
    raw = request("POST", CHAT, [*auth(edge), ("Content-Encoding", encoding)], body)
    received = await exchange(edge.port, raw)
    error = assert_openai_error(parse(received), 415, "unsupported_content_encoding")
    assert encoding not in error["message"]  # no header value is echoed


@pytest.mark.parametrize(
    "header",
    [
        b"Authorization: Bearer \xff\xfe\xfd",
        b"Authorization: Bearer tg-\xc3\x28abc",
        b"api-key: \xff\xfe",
    ],
)
@pytest.mark.parametrize(("method", "path"), [("POST", CHAT), ("GET", "/v1/models")])
async def test_an_authorization_that_is_not_utf8_is_a_401(
    edge: Edge, header: bytes, method: str, path: str
) -> None:
    body = orjson.dumps(UNKNOWN) if method == "POST" else b""
    raw = request(method, path, [header, b"Content-Type: application/json"], body)
    assert_openai_error(parse(await exchange(edge.port, raw)), 401, "invalid_api_key")
    assert "unhandled error" not in edge.log()


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("GET", CHAT, "POST"),
        ("PUT", "/v1/completions", "POST"),
        ("DELETE", "/v1/models", "GET, HEAD"),
    ],
)
async def test_a_405_names_the_allowed_methods(
    edge: Edge, method: str, path: str, allow: str
) -> None:
    raw = request(method, path, auth(edge))
    reply = parse(await exchange(edge.port, raw))
    assert_openai_error(reply, 405, "method_not_allowed")
    assert reply.headers["allow"] == allow


async def test_clients_trickling_their_heads_are_cut_off(edge: Edge) -> None:
    first = f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {edge.key}\r\n".encode()
    more = b"X-Slow: " + b"a" * 500 + b"\r\n\r\n"  # 50 s at one byte per 0.1 s
    results = await asyncio.gather(*(trickle(edge.port, first, more) for _ in range(20)))
    for received, closed_after in results:
        assert closed_after < HEADER_TIMEOUT_S + CUT_SLACK_S, closed_after
        assert_openai_error(parse(received), 408, "request_timeout")
        assert_no_key(edge, received)


async def test_a_client_that_sends_nothing_is_closed(edge: Edge) -> None:
    received, closed_after = await trickle(edge.port, b"", b"")
    assert received == b"" and closed_after < HEADER_TIMEOUT_S + CUT_SLACK_S


async def test_clients_trickling_their_bodies_are_cut_off_with_a_408(edge: Edge) -> None:
    body = orjson.dumps({**UNKNOWN, "pad": "a" * 500})
    head = request("POST", CHAT, auth(edge), body)[: -len(body)]
    results = await asyncio.gather(*(trickle(edge.port, head, body) for _ in range(20)))
    for received, closed_after in results:
        assert closed_after < BODY_TIMEOUT_S + CUT_SLACK_S, closed_after
        reply = parse(received)
        assert_openai_error(reply, 408, "request_timeout")
        assert reply.headers["connection"].lower() == "close"
        assert_no_key(edge, received)


async def test_a_keep_alive_connection_may_idle_longer_than_the_head_timeout(edge: Edge) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", edge.port)
    try:
        for _ in range(2):
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            reply = parse(head)
            await reader.readexactly(int(reply.headers["content-length"]))
            assert reply.status == 200
            await asyncio.sleep(2 * HEADER_TIMEOUT_S)  # idle: the head clock is not running
    finally:
        writer.close()


@pytest.mark.usefixtures("sim_workers")
async def test_a_stream_longer_than_the_read_timeouts_is_not_cut(edge: Edge) -> None:
    body = orjson.dumps(
        {
            "model": SLOW_MODEL,
            "stream": True,
            "max_tokens": 30,  # 3 s at the model's 10 tokens per second
            "messages": [{"role": "user", "content": "hi"}],
        }
    )
    started = time.monotonic()
    received = await exchange(edge.port, request("POST", CHAT, auth(edge), body), timeout=30)
    assert time.monotonic() - started > HEADER_TIMEOUT_S + BODY_TIMEOUT_S
    assert parse(received).status == 200
    # every token, [DONE], and the chunked body's last chunk: the stream ended whole
    assert received.count(b'"content":') == 31  # the role chunk and 30 tokens
    assert b"data: [DONE]" in received and received.endswith(b"\r\n0\r\n\r\n")


async def test_an_aborted_upload_is_a_499_logged_at_info(edge: Edge) -> None:
    before = len(edge.log())
    body = orjson.dumps({**UNKNOWN, "pad": "a" * 100_000})
    raw = request("POST", CHAT, auth(edge), body)
    head = raw[: -len(body)]
    await reset_mid_body(edge.port, head, body[:1000])
    deadline = time.monotonic() + 10
    while "client closed the request" not in edge.log()[before:]:
        assert time.monotonic() < deadline, edge.log()[before:]
        await asyncio.sleep(0.05)
    lines = [orjson.loads(line) for line in edge.log()[before:].splitlines() if line]
    ending = next(line for line in lines if line["msg"] == "client closed the request")
    assert ending["level"] == "info" and ending["status"] == 499
    new = edge.log()[before:]
    assert "unhandled error" not in new and "Traceback" not in new, new
    assert_no_key(edge, b"")


async def test_connections_over_the_cap_are_refused_with_a_503(stack: Stack, api_key: str) -> None:
    cap = 8
    _, base = stack.router(TOLLGATE_ROUTER_MAX_CONNECTIONS=str(cap))
    port = int(base.rsplit(":", 1)[1])
    held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(cap)]
    try:
        reply = parse(await exchange(port, request("GET", "/healthz", [])))
        assert_openai_error(reply, 503, "too_many_connections")
        assert reply.headers["retry-after"] == "1"
        for reader, writer in held:  # the connections under the cap are served
            writer.write(request("GET", "/healthz", []))
            assert parse(await asyncio.wait_for(reader.read(), 10)).status == 200
    finally:
        for _, writer in held:
            writer.close()
    deadline = time.monotonic() + 10  # closed connections free their places
    while parse(await exchange(port, request("GET", "/healthz", []))).status != 200:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
