"""HTTP/1.1 over a bare socket: requests no client library would send.

Malformed request lines, bytes that are not UTF-8 in a header, conflicting
framing headers, and connections closed halfway through a body or a stream.
"""

from __future__ import annotations

import asyncio
import contextlib
from urllib.parse import urlsplit

from tests.fuzz.oracle import Answer


def address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 80


def request(
    method: bytes,
    target: bytes,
    headers: list[tuple[bytes, bytes]],
    body: bytes = b"",
    *,
    version: bytes = b"HTTP/1.1",
    length: bool = True,
) -> bytes:
    """One request's bytes; ``Content-Length`` is added unless ``length`` is false."""
    lines = [method + b" " + target + b" " + version, b"Host: 127.0.0.1", b"Connection: close"]
    lines += [name + b": " + value for name, value in headers]
    if length and body:
        lines.append(b"Content-Length: " + str(len(body)).encode())
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


async def exchange(url: str, data: bytes, timeout: float = 30) -> Answer:
    """Send ``data`` and read one answer (until the server closes, or the answer is whole)."""
    host, port = address(url)
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (OSError, TimeoutError) as exc:
        return Answer(None, [], b"", f"cannot connect: {type(exc).__name__}")
    try:
        try:
            writer.write(data)
            await writer.drain()
        except (ConnectionError, OSError):
            pass  # the server may answer and close before reading it all
        return await asyncio.wait_for(_read_answer(reader), timeout)
    except TimeoutError:
        return Answer(None, [], b"", f"no answer within {timeout:g} s")
    except (ConnectionError, OSError) as exc:
        return Answer(None, [], b"", f"connection {type(exc).__name__}")
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await writer.wait_closed()


async def _read_answer(reader: asyncio.StreamReader) -> Answer:
    raw = b""
    while b"\r\n\r\n" not in raw:
        chunk = await reader.read(65536)
        if not chunk:
            if not raw:
                return Answer(None, [], b"", "closed without an answer")
            break
        raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    try:
        status = int(lines[0].split(b" ")[1])
    except (IndexError, ValueError):
        return Answer(None, [], raw, f"not an HTTP status line: {lines[0][:80]!r}")
    headers = []
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers.append((name.decode("latin-1").strip(), value.decode("latin-1").strip()))
    answer = Answer(status, headers, b"")
    length = answer.header("content-length")
    chunked = "chunked" in (answer.header("transfer-encoding") or "").lower()
    if length is not None:
        while len(body) < int(length):
            chunk = await reader.read(65536)
            if not chunk:
                break
            body += chunk
        answer.body = body[: int(length)]
    else:
        while True:
            if chunked and body.endswith(b"0\r\n\r\n"):
                break
            chunk = await reader.read(65536)
            if not chunk:
                break
            body += chunk
        answer.body = _unchunk(body) if chunked else body
    return answer


def _unchunk(data: bytes) -> bytes:
    out = b""
    while data:
        size_line, _, rest = data.partition(b"\r\n")
        try:
            size = int(size_line.split(b";")[0], 16)
        except ValueError:
            return out + data
        if size == 0:
            break
        out += rest[:size]
        data = rest[size + 2 :]
    return out


async def hang_up(url: str, data: bytes, *, read_first: bytes | None = None) -> bytes:
    """Send ``data`` and close the connection: at once, or once ``read_first`` was read.

    Returns what was read before closing.
    """
    host, port = address(url)
    reader, writer = await asyncio.open_connection(host, port)
    seen = b""
    try:
        writer.write(data)
        await writer.drain()
        if read_first is not None:
            async with asyncio.timeout(30):
                while read_first not in seen:
                    chunk = await reader.read(4096)
                    if not chunk:
                        break
                    seen += chunk
    finally:
        writer.transport.abort()  # a reset, as a client that dies sends
    return seen
