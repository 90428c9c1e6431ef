"""The HTTP server every Tollgate service listens with: aiohttp's, hardened for hostile clients.

aiohttp parses HTTP/1.1 and runs the application; this module changes what
happens around a request, where the application never sees it:

- a request that is not valid HTTP (a header line over 8,190 bytes, a
  duplicated ``Content-Type``, a bad header character, method or version,
  conflicting ``Content-Length`` and ``Transfer-Encoding``) is answered with
  an OpenAI-shaped error (400; 431 for a line too long) that never repeats
  the request's bytes, and logged as one line that does not either.
  aiohttp's own answer is plain text that quotes the offending bytes, and its
  log line is a traceback that quotes them too: an ``Authorization`` header
  would end up in both;
- the head of a request must arrive within ``header_timeout_s`` (from the
  connection, or from the first byte of a later request on it), its body
  within ``body_timeout_s`` of the head. A client that trickles either is
  cut off: answered 408 where an answer is still possible, and closed;
- at most ``max_connections`` connections are open at once; another one is
  answered 503 (``Retry-After``) and closed at once;
- a connection idle between requests is closed after ``idle_timeout_s``.

:func:`serve` runs an application as ``aiohttp.web.run_app`` does (SIGTERM
and SIGINT stop it gracefully); :func:`start` starts one on a running loop,
for tests and embedding.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import ssl
import time
from http import HTTPStatus
from typing import Any, cast

from aiohttp import web
from aiohttp.http_exceptions import (
    BadHttpMethod,
    BadStatusLine,
    ContentEncodingError,
    HttpProcessingError,
    InvalidURLError,
    LineTooLong,
    PayloadEncodingError,
)
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest
from pydantic import BaseModel, Field

from tollgate.wire.errors import error_json

log = logging.getLogger("tollgate.http")

# aiohttp's parser limits (its defaults, stated in the answers that refer to them)
MAX_LINE_BYTES = 8190
# A connection over the cap is closed this long after its 503 (or when the client
# hangs up); at most this many at once, beyond which they are closed at once.
REFUSED_LINGER_S = 1.0
REFUSED_LINGERING_MAX = 256


class HttpLimits(BaseModel):
    """How long a client may take and how many may be connected (mixed into service settings)."""

    header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="A request's head (request line and headers) must arrive within this time.",
    )
    body_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="A request's body must arrive within this time of its head (then 408).",
    )
    idle_timeout_s: float = Field(
        default=75.0, gt=0, description="A keep-alive connection idle this long is closed."
    )
    max_connections: int = Field(
        default=1024, ge=1, description="Most open client connections; more are answered 503."
    )


class BodyTimeout(TimeoutError):
    """The request body did not arrive in time; reading it raises this (answer: 408)."""


# Errors a client causes: logged as one line at INFO, never as a traceback.
_CLIENT_FAULTS = (HttpProcessingError, web.RequestPayloadError, ConnectionError, TimeoutError)


def _describe(status: int, exc: BaseException | None) -> tuple[int, str, str]:
    """Status, code and message for a request aiohttp refused, from the kind of error only.

    Never from the error's text: aiohttp's messages quote the request's bytes.
    """
    if isinstance(exc, LineTooLong):
        # the request line and a header line hit the same limit, told apart by nothing
        return (
            431,
            "request_header_too_large",
            f"The request line or a request header is longer than {MAX_LINE_BYTES} bytes.",
        )
    if isinstance(exc, BadHttpMethod):
        return 400, "invalid_http_request", "The request method is not valid."
    if isinstance(exc, BadStatusLine):
        return (
            400,
            "invalid_http_request",
            "The request line is not valid HTTP/1.1 (method, target and version).",
        )
    if isinstance(exc, InvalidURLError):
        return 400, "invalid_http_request", "The request target is not a valid URL."
    if isinstance(exc, ContentEncodingError):
        # refused with the head: aiohttp has no decoder for it (br without brotli)
        return (
            415,
            "unsupported_content_encoding",
            "Content-Encoding must be gzip, deflate or identity.",
        )
    if isinstance(exc, PayloadEncodingError | web.RequestPayloadError):
        return (
            400,
            "invalid_body",
            "The request body could not be read: its framing or Content-Encoding is invalid.",
        )
    if isinstance(exc, HttpProcessingError) or 400 <= status < 500:
        return (
            400,
            "invalid_http_request",
            "The request is not valid HTTP/1.1: a malformed, duplicated, conflicting or "
            "excess header, or a malformed body framing.",
        )
    if status == 504:
        return 504, "timeout", "The server did not answer in time."
    return 500, "internal_error", "The server had an error processing your request."


def _raw_response(
    status: int, code: str, message: str, headers: dict[str, str] | None = None
) -> bytes:
    """A whole HTTP/1.1 error response, for a connection that has no request object."""
    body = error_json(message, _error_type(status), code=code)
    lines = [
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        "Connection: close",
        *(f"{name}: {value}" for name, value in (headers or {}).items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("ascii") + body


def _error_type(status: int) -> str:
    return "invalid_request_error" if status < 500 else "server_error"


class EdgeProtocol(RequestHandler):
    """aiohttp's protocol with OpenAI-shaped protocol errors, read timeouts and a connection cap."""

    def __init__(self, manager: EdgeServer, *, limits: HttpLimits, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._edge = manager
        self._limits = limits
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = False  # bytes of a head not yet complete have arrived
        self._body: StreamReader | None = None  # the body being received
        self._body_timer: asyncio.TimerHandle | None = None
        self._counted = False
        self._cut = False  # a body timeout: the answer (408) closes the connection
        self._refused: asyncio.Transport | None = None  # over the cap: answered 503, closing
        self._linger: asyncio.TimerHandle | None = None

    # -- connections ------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self._edge.open_connections >= self._limits.max_connections:
            self._refuse(cast(asyncio.Transport, transport))  # uvloop's is no asyncio subclass
            return
        self._counted = True
        self._edge.open_connections += 1
        super().connection_made(transport)
        self._arm_head()

    def _refuse(self, transport: asyncio.Transport) -> None:
        """Answer 503 and close, without reading a request."""
        self._edge.note_refused()
        transport.write(
            _raw_response(
                503,
                "too_many_connections",
                "The server has too many open connections. Please retry shortly.",
                {"Retry-After": "1"},
            )
        )
        if self._edge.lingering >= REFUSED_LINGERING_MAX:
            transport.close()
            return
        # What the client sends meanwhile is read and dropped for a moment before
        # the close: closing on unread bytes resets the connection, and a reset
        # can reach the client before it has read the 503.
        self._refused = transport
        self._edge.lingering += 1
        if transport.can_write_eof():
            transport.write_eof()
        self._linger = self._loop.call_later(REFUSED_LINGER_S, transport.close)

    def eof_received(self) -> None:
        if self._refused is not None:  # the client has read its 503 and hung up
            self._refused.close()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._refused is not None:
            self._refused = None
            self._edge.lingering -= 1
            if self._linger is not None:
                self._linger.cancel()
            return
        if not self._counted:  # refused: nothing was set up
            return
        self._counted = False
        self._edge.open_connections -= 1
        self._cancel_timers()
        super().connection_lost(exc)

    def _cancel_timers(self) -> None:
        for timer in (self._head_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = None

    # -- read timeouts ----------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if not self._counted:
            return
        if data and self._body is None and not (self._force_close or self._close):
            # bytes of a head: the first ones of a later request start its clock
            self._head_bytes = True
            if self._head_timer is None:
                self._arm_head()
        count = self._request_count
        super().data_received(data)
        if self._request_count != count:  # a head is complete (or refused)
            self._head_bytes = False
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            if self._messages:
                payload = self._messages[-1][1]
                if not payload.is_eof() and payload.exception() is None:
                    self._watch_body(payload)
        body = self._body
        if body is not None and (body.is_eof() or body.exception() is not None):
            self._body = None
            if self._body_timer is not None:
                self._body_timer.cancel()
                self._body_timer = None

    def _arm_head(self) -> None:
        self._head_timer = self._loop.call_later(
            self._limits.header_timeout_s, self._head_timed_out
        )

    def _watch_body(self, payload: StreamReader) -> None:
        self._body = payload
        if self._body_timer is not None:
            self._body_timer.cancel()
        self._body_timer = self._loop.call_later(self._limits.body_timeout_s, self._body_timed_out)

    def _idle(self) -> bool:
        """Waiting for the next request (no request being answered)."""
        return self._waiter is not None and not self._waiter.done()

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport is None or self._force_close:
            return
        if not self._idle():
            # A response is still being written (stray bytes after a request, or
            # a pipelined head): it is not cut; the head's clock runs again.
            self._arm_head()
            return
        log.info(
            "request head not received in time: connection closed",
            extra={"peer": _peer(self.transport), "timeout_s": self._limits.header_timeout_s},
        )
        if self._head_bytes:
            self.transport.write(
                _raw_response(
                    408,
                    "request_timeout",
                    f"The request head was not received within "
                    f"{self._limits.header_timeout_s:g} s.",
                )
            )
        self.force_close()

    def _body_timed_out(self) -> None:
        self._body_timer = None
        payload, self._body = self._body, None
        if payload is None or payload.is_eof() or self.transport is None:
            return
        log.info(
            "request body not received in time: answered 408 and closed",
            extra={"peer": _peer(self.transport), "timeout_s": self._limits.body_timeout_s},
        )
        self._cut = True
        self.close()  # nothing more is read; the connection ends with the answer
        payload.set_exception(
            BodyTimeout(
                f"The request body was not received within {self._limits.body_timeout_s:g} s."
            )
        )

    # -- answers ----------------------------------------------------------

    async def finish_response(
        self, request: BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        if self._cut:
            resp.force_close()
        return await super().finish_response(request, resp, start_time)

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """An OpenAI-shaped answer that does not quote the request (aiohttp's does)."""
        if self._cut or isinstance(exc, BodyTimeout):
            status, code, text = (
                408,
                "request_timeout",
                f"The request body was not received within {self._limits.body_timeout_s:g} s.",
            )
        else:
            status, code, text = _describe(status, exc)
        if status >= 500 and exc is not None and not isinstance(exc, _CLIENT_FAULTS):
            log.error("unhandled error in a request", exc_info=exc)
        else:
            log.info(
                "request refused by the HTTP layer",
                extra={
                    "status": status,
                    "code": code,
                    "error": type(exc).__name__ if exc is not None else None,
                    "peer": request.remote,
                },
            )
        if request.writer.output_size > 0:
            # part of a response is sent: no other can follow (aiohttp's rule)
            raise ConnectionError("a response was already started")
        resp = web.Response(
            status=status,
            body=error_json(text, _error_type(status), code=code),
            content_type="application/json",
        )
        resp.force_close()
        return resp

    def log_exception(self, *args: Any, **kw: Any) -> None:
        """A client's fault (a body that cannot be decoded, a reset) is one line, not a traceback.

        aiohttp logs the error a request body raised again when it discards the
        rest of that body after the answer; its message can quote the request.
        """
        exc = kw.get("exc_info")
        if isinstance(exc, _CLIENT_FAULTS):
            log.info(
                "connection closed after a bad request",
                extra={"error": type(exc).__name__, "peer": _peer(self.transport)},
            )
            return
        super().log_exception(*args, **kw)


def _peer(transport: asyncio.BaseTransport | None) -> str | None:
    if transport is None:
        return None
    peer = transport.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) and peer else None


class EdgeServer(web.Server):
    """aiohttp's server, making :class:`EdgeProtocol` connections and counting them."""

    def __init__(self, handler: Any, *, limits: HttpLimits, **kwargs: Any) -> None:
        super().__init__(handler, **kwargs)
        self.limits = limits
        self.open_connections = 0
        self.lingering = 0  # refused connections not closed yet
        self._refused = 0
        self._refused_logged_at = 0.0

    def __call__(self) -> EdgeProtocol:
        return EdgeProtocol(self, loop=self._loop, limits=self.limits, **self._kwargs)

    def note_refused(self) -> None:
        """Count a connection refused for the cap; log the count at most every 10 s."""
        self._refused += 1
        now = time.monotonic()
        if now - self._refused_logged_at >= 10:
            log.warning(
                "connections refused: %d open (the limit)",
                self.open_connections,
                extra={"refused": self._refused, "max_connections": self.limits.max_connections},
            )
            self._refused, self._refused_logged_at = 0, now


class EdgeRunner(web.AppRunner):
    """``web.AppRunner`` serving with :class:`EdgeServer`."""

    def __init__(self, app: web.Application, *, limits: HttpLimits, **kwargs: Any) -> None:
        super().__init__(app, keepalive_timeout=limits.idle_timeout_s, **kwargs)
        self.limits = limits

    async def _make_server(self) -> web.Server:
        # aiohttp has no setting for the protocol class: the server it builds
        # (after the app's startup) is rebuilt as an EdgeServer with the same arguments.
        server = await super()._make_server()
        return EdgeServer(
            server.request_handler,
            limits=self.limits,
            request_factory=server.request_factory,
            handler_cancellation=server.handler_cancellation,
            loop=asyncio.get_running_loop(),
            **server._kwargs,
        )


async def start(
    app: web.Application,
    host: str | None,
    port: int | None,
    *,
    limits: HttpLimits,
    ssl_context: ssl.SSLContext | None = None,
    shutdown_timeout: float = 60.0,
    handle_signals: bool = False,
) -> EdgeRunner:
    """Start serving ``app``; ``await runner.cleanup()`` stops it (gracefully)."""
    runner = EdgeRunner(
        app,
        limits=limits,
        access_log=None,
        shutdown_timeout=shutdown_timeout,
        handle_signals=handle_signals,
    )
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, ssl_context=ssl_context).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner


async def _serve_forever(app: web.Application, **kwargs: Any) -> None:
    runner = await start(app, **kwargs)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        # The first SIGTERM or SIGINT starts the graceful stop; later ones must
        # not cut it short (a parent-death signal can arrive more than once,
        # and an operator may press Ctrl-C twice): the calls in flight finish
        # and their usage is recorded either way.
        if stopping.is_set():
            log.info("already stopping; %s ignored", sig.name)
        stopping.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        await stopping.wait()
    finally:
        try:
            await runner.cleanup()
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)


def serve(
    app: web.Application,
    host: str | None,
    port: int | None,
    *,
    limits: HttpLimits,
    ssl_context: ssl.SSLContext | None = None,
    shutdown_timeout: float = 60.0,
) -> None:
    """Serve ``app`` until SIGTERM or SIGINT, then stop gracefully (as ``web.run_app``).

    Signals that arrive while it stops are logged and ignored.
    """
    loop = asyncio.new_event_loop()
    main = loop.create_task(
        _serve_forever(
            app,
            host=host,
            port=port,
            limits=limits,
            ssl_context=ssl_context,
            shutdown_timeout=shutdown_timeout,
        )
    )
    try:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(main)
    except (web.GracefulExit, KeyboardInterrupt):
        pass
    finally:
        try:
            if not main.done():
                main.cancel()  # runs the runner's cleanup: drain, then the app's cleanup
                with contextlib.suppress(asyncio.CancelledError):
                    loop.run_until_complete(main)
        finally:
            _cancel_all(loop)
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()


def _cancel_all(loop: asyncio.AbstractEventLoop) -> None:
    tasks = asyncio.all_tasks(loop)
    for task in tasks:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
