"""HTTP/1.1 spoken by hand over raw sockets, for requests no HTTP client would send."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any

import orjson


@dataclass
class Reply:
    status: int
    headers: dict[str, str]  # names lowercased
    body: bytes
    raw: bytes  # every byte the server sent

    def json(self) -> Any:
        return orjson.loads(self.body)


def parse(raw: bytes) -> Reply:
    """The first response in ``raw``."""
    head, sep, rest = raw.partition(b"\r\n\r\n")
    assert sep, f"no complete response: {raw[:200]!r}"
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", len(rest)))
    return Reply(status, headers, rest[:length], raw)


async def exchange(port: int, raw: bytes, *, timeout: float = 10.0) -> bytes:
    """Send ``raw`` and read until the server closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        await writer.drain()
        async with asyncio.timeout(timeout):
            return await reader.read()
    finally:
        writer.close()


def assert_openai_error(
    reply: Reply, status: int, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    """An OpenAI-shaped error body (``{"error": {message, type, param, code}}``) with ``status``."""
    assert reply.status == status, reply.raw[:500]
    assert reply.headers["content-type"].startswith("application/json"), reply.raw[:500]
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["message"] and error["param"] == param
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if code is not None:
        assert error["code"] == code, error
    return dict(error)


async def trickle(port: int, first: bytes, more: bytes, every: float = 0.1) -> tuple[bytes, float]:
    """Send ``first``, then ``more`` one byte at a time until the server hangs up.

    Returns what the server sent and how long after connecting it closed the
    connection (a client that the server never cuts off fails the caller's bound).
    """
    started = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(first)
    received = bytearray()

    async def drip() -> None:
        for byte in more:
            await asyncio.sleep(every)
            if received or reader.at_eof() or writer.is_closing():
                return  # answered: a write now would only draw a reset
            writer.write(bytes([byte]))

    dripping = asyncio.create_task(drip())
    try:
        with contextlib.suppress(ConnectionResetError):
            while chunk := await reader.read(65536):
                received += chunk
        return bytes(received), time.monotonic() - started
    finally:
        dripping.cancel()
        with contextlib.suppress(asyncio.CancelledError, ConnectionError):
            await dripping
        writer.close()


async def reset_mid_body(port: int, head: bytes, part: bytes) -> None:
    """Send a request's head and part of its body, then reset the connection (RST)."""
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head + part)
    await writer.drain()
    await asyncio.sleep(0.3)  # the router is reading the body
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
