"""NATS connection helper: an identity, reconnect forever, log state changes, drain on exit."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

import nats
import nats.js.errors
import orjson
from nats.aio.client import NO_RESPONDERS_STATUS
from nats.aio.client import PING_PROTO as PING
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import Header, PubAck

# The largest message the bus carries (nats-server's max_payload; its default
# is 1 MiB). Every configuration Tollgate writes for nats-server sets it, so a
# request body up to the router's limit (4 MiB by default) fits in its
# envelope with room to spare; the router checks the server's own figure at start.
MAX_PAYLOAD = 8 * 1024 * 1024
# Room a request's envelope and headers take beside the client's body.
ENVELOPE_ROOM = 64 * 1024
# A request's reply token: this many random hex digits, then a counter.
TOKEN_RANDOM_HEX = 16
# Random bytes drawn at once for the tokens (one syscall per 256 requests).
_TOKEN_BATCH_BYTES = 2048

log = logging.getLogger("tollgate.wire.bus")


class BusRefused(Exception):
    """NATS refused the connection's identity: a missing, wrong or revoked nkey."""


@dataclass(frozen=True)
class Access:
    """How one identity reaches the bus.

    ``seed`` is the identity's nkey seed (it signs the server's nonce at each
    connect and never leaves the process); ``tls`` verifies the server's
    certificate (and shows the client's, for mutual TLS); ``inbox_prefix`` is
    where replies to this identity's requests arrive, the one inbox namespace
    its permissions let it read.
    """

    seed: str | None = None
    tls: ssl.SSLContext | None = None
    inbox_prefix: str = "_INBOX"

    def __repr__(self) -> str:  # never show the seed
        return f"Access(seed={'set' if self.seed else None}, tls={self.tls is not None})"


class _TlsEofNoise(logging.Filter):
    """Drops asyncio's warning that a TLS connection's end was half-closed.

    nats.py upgrades its socket to TLS after connecting, so asyncio's stream
    protocol does not know it runs over TLS, and when a connection closes
    asyncio logs "returning true from eof_received() has no effect when using
    ssl" (nats-io/nats.py#574). The connection still closes as it should.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return "eof_received() has no effect when using ssl" not in record.getMessage()


_TLS_EOF_NOISE = _TlsEofNoise()


class Client(NATS):
    """nats.py's client, with a message's handler run as the message is read.

    nats.py hands each message of a subscription to that subscription's own
    task, which runs its handler on the event loop's next turn. A
    subscription made with :func:`subscribe_at_once` runs its handler, a
    plain function that must not block, in the connection's reader as the
    message is read, in order; so do the replies to this client's requests
    (their handler only wakes the waiting request). On a router and a worker
    under load that is one task switch fewer per chunk, offer and reply
    (``docs/benchmarks.md``: CPU per call at concurrency 16).

    Its flush() also means what it says: the server has every command sent
    before it (nats.py's PING could overtake them; see ``_send_ping``).

    Its requests cost less: the random part of each reply token is cut from
    random bytes drawn a batch at a time (nats.py draws them per request,
    a syscall each) and the wait is one timer, not ``asyncio.wait_for``; its
    JetStream context reads acknowledgements with orjson (:class:`JetStream`).
    A router and a worker make four requests per call (``docs/benchmarks.md``:
    the stack). A token stays unguessable: a service that may answer some of
    this one's requests (metering answers auth's invoice requests) sees the
    inbox's prefix, and may publish into it, but cannot aim a forged reply at
    another request (a KV write's or a publish's acknowledgement).

    It uses nats.py's internals (``tests/lib/test_bus_client.py`` checks them
    against the version installed); everything else is nats.py's own.
    """

    def __init__(self) -> None:
        super().__init__()
        # sid -> handler; nats.py's own handler of request replies, a coroutine
        # that awaits nothing, is awaited in place
        self._at_once: dict[int, Callable[[Msg], Awaitable[None] | None]] = {}
        self._tokens = itertools.count()
        self._random_hex = ""
        self._random_at = 0

    def jetstream(self, **opts: Any) -> JetStream:
        return JetStream(self, **opts)

    async def request(
        self,
        subject: str,
        payload: bytes = b"",
        timeout: float | None = 0.5,
        old_style: bool = False,
        headers: dict[str, Any] | None = None,
    ) -> Msg:
        """nats.py's request, answered through the same inbox, at less cost (class docs).

        ``timeout`` None waits for the reply as long as it takes, as nats.py's does.
        """
        if old_style:
            # nats.py's own waits without a limit on None too (its type says float)
            wait = cast(float, timeout)
            return await super().request(subject, payload, wait, old_style, headers)
        if self.is_draining_pubs:
            raise nats.errors.ConnectionDrainingError
        if not self._resp_sub_prefix:
            await self._init_request_sub()
        # The prefix is read at each request: nats.py sets it before it
        # subscribes the inbox, so a request made while the first one's
        # subscribe is still on its way already has it.
        assert self._resp_sub_prefix is not None
        # nats.py's reply handler finds the request by what follows the prefix
        token = self._token()
        reply = self._resp_sub_prefix.decode() + token
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Msg] = loop.create_future()
        self._resp_map[token] = future
        try:
            await self.publish(subject, payload, reply=reply, headers=headers)
            timer = loop.call_later(timeout, _time_out, future) if timeout is not None else None
            try:
                msg = await future
            finally:
                if timer is not None:
                    timer.cancel()
        finally:
            self._resp_map.pop(token, None)
        if msg.headers and msg.headers.get(Header.STATUS) == NO_RESPONDERS_STATUS:
            raise nats.errors.NoRespondersError
        return msg

    def _token(self) -> str:
        """A reply token: random (unguessable), then a counter (unique on this connection)."""
        at = self._random_at
        if at + TOKEN_RANDOM_HEX > len(self._random_hex):
            self._random_hex, at = os.urandom(_TOKEN_BATCH_BYTES).hex(), 0
        self._random_at = at + TOKEN_RANDOM_HEX
        return self._random_hex[at : at + TOKEN_RANDOM_HEX] + str(next(self._tokens))

    def handle_at_once(self, sub: Subscription, handler: Callable[[Msg], None]) -> None:
        """Run ``handler`` in the reader for each message of ``sub`` (see the class's docs)."""
        self._at_once[sub._id] = handler

    async def _process_msg(
        self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes
    ) -> None:
        handler = self._at_once.get(sid)
        sub = self._subs.get(sid) if handler is not None else None
        if handler is None or sub is None:
            await super()._process_msg(sid, subject, reply, data, headers)
            return
        self.stats["in_msgs"] += 1
        self.stats["in_bytes"] += len(data)
        sub._received += 1
        msg = self._build_message(sid, subject, reply, data, await self._process_headers(headers))
        try:
            pending = handler(msg)
            if pending is not None:
                await pending
        except Exception as exc:  # as nats.py does with a handler's error
            if self._error_cb is not None:
                await self._error_cb(exc)

    async def _send_ping(self, future: asyncio.Future[Any] | None = None) -> None:
        # nats.py writes a PING straight to the socket, ahead of the commands
        # still waiting for its flusher (a SUB just made), so the PONG, and
        # flush() with it, could come back before the server had them: a
        # publish from another connection then found no subscriber. The PING
        # goes behind them instead, so flush() means the server has them.
        self._pongs.append(future if future is not None else asyncio.Future())
        await self._send_command(PING)
        await self._flush_pending()

    def _remove_sub(self, sid: int, max_msgs: int = 0) -> None:
        self._at_once.pop(sid, None)
        super()._remove_sub(sid, max_msgs)

    async def _init_request_sub(self) -> None:
        await super()._init_request_sub()
        for sub in self._subs.values():
            if sub._cb == self._request_sub_callback:
                self._at_once[sub._id] = self._request_sub_callback


def _time_out(future: asyncio.Future[Msg]) -> None:
    if not future.done():
        future.set_exception(nats.errors.TimeoutError())


class JetStream(JetStreamContext):
    """nats.py's JetStream context; a publish reads its acknowledgement with orjson."""

    async def publish(
        self,
        subject: str,
        payload: bytes = b"",
        timeout: float | None = None,
        stream: str | None = None,
        headers: dict[str, Any] | None = None,
        msg_ttl: float | None = None,
    ) -> PubAck:
        if stream is not None or msg_ttl is not None:
            return await super().publish(subject, payload, timeout, stream, headers, msg_ttl)
        try:
            msg = await self._nc.request(
                subject,
                payload,
                timeout=self._timeout if timeout is None else timeout,
                headers=headers,
            )
        except nats.errors.NoRespondersError:
            raise nats.js.errors.NoStreamResponseError from None
        resp = orjson.loads(msg.data)
        if "error" in resp:
            raise nats.js.errors.APIError.from_error(resp["error"])
        if resp.keys() <= _PLAIN_ACK:
            return PubAck(
                stream=resp["stream"],
                seq=resp["seq"],
                domain=resp.get("domain"),
                duplicate=resp.get("duplicate"),
            )
        return PubAck.from_response(resp)


# what the acknowledgement of a plain publish holds (no batch, no counter)
_PLAIN_ACK = frozenset({"stream", "seq", "domain", "duplicate"})


async def subscribe_at_once(nc: NATS, subject: str, handler: Callable[[Msg], None]) -> Subscription:
    """Subscribe ``handler``, a plain function that must not block, to ``subject``.

    On a :class:`Client` it runs as each message is read; on another client,
    in the subscription's task as usual.
    """

    async def queued(msg: Msg) -> None:
        handler(msg)

    sub = await nc.subscribe(subject, cb=queued)
    if isinstance(nc, Client):
        nc.handle_at_once(sub, handler)
    return sub


def _refused(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, nats.errors.AuthorizationError) or "authorization violation" in text


async def connect(url: str, name: str, access: Access | None = None) -> NATS:
    """Connect to NATS, retrying the first connect and every later disconnect.

    Raises :class:`BusRefused` at once when the server rejects the identity:
    retrying with the same key cannot succeed.
    """
    access = access or Access()
    refused = asyncio.Event()

    async def on_error(exc: Exception) -> None:
        if _refused(exc):
            refused.set()
        log.warning("nats error: %s: %s", type(exc).__name__, exc)

    async def on_disconnected() -> None:
        # nats.py calls this on every close as well, this process's own drain
        # included: only a connection lost while in use (it reconnects) is news.
        if nc.is_closed:
            log.debug("nats connection closed")
        else:
            log.warning("nats disconnected")

    async def on_reconnected() -> None:
        log.info("nats reconnected")

    if access.tls is not None:
        logging.getLogger("asyncio").addFilter(_TLS_EOF_NOISE)
    delay = 0.2
    while True:
        refused.clear()
        nc = Client()
        connecting = asyncio.ensure_future(
            nc.connect(
                servers=url.split(","),
                name=name,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.5,  # type: ignore[arg-type]  # seconds; typed int, read as float
                connect_timeout=2,
                allow_reconnect=True,
                error_cb=on_error,
                disconnected_cb=on_disconnected,
                reconnected_cb=on_reconnected,
                nkeys_seed_str=access.seed,
                tls=access.tls,
                inbox_prefix=access.inbox_prefix,
            )
        )
        # nats.py keeps retrying a refused first connect; the refusal reaches
        # the error callback, and then this gives up instead.
        watch = asyncio.ensure_future(refused.wait())
        try:
            await asyncio.wait({connecting, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        if not connecting.done():
            connecting.cancel()
            with contextlib.suppress(BaseException):
                await connecting
            with contextlib.suppress(Exception):
                await nc.close()
            raise BusRefused(f"NATS at {url} refused this identity")
        exc = connecting.exception()
        if exc is None:
            return nc
        if _refused(exc):
            raise BusRefused(f"NATS at {url} refused this identity") from None
        if not isinstance(exc, (OSError, nats.errors.NoServersError, TimeoutError)):
            raise exc
        # The first connect is retried too: services may start before NATS.
        log.warning("nats not reachable yet: %s: %s", type(exc).__name__, exc)
        await asyncio.sleep(delay)
        delay = min(delay * 2, 5.0)


async def close(nc: NATS) -> None:
    """Drain subscriptions and flush publishes, then close."""
    if nc.is_closed:
        return
    try:
        await nc.drain()
    except Exception as exc:  # a broken connection cannot be drained
        log.warning("nats drain failed: %s: %s", type(exc).__name__, exc)
        try:
            await nc.close()
        except Exception as close_exc:  # the server is gone: nothing left to flush
            log.warning("nats close failed: %s: %s", type(close_exc).__name__, close_exc)


class BatchPull:
    """Pull messages from a durable JetStream consumer in batches.

    A pull request asks for many messages at once, and a subscription callback
    collects what arrives. nats.py's ``fetch`` instead awaits every message
    separately (a task and a timer per message), which caps a consumer at
    about 28,000 messages/s on a 2-core machine; this reaches about 85,000
    (measured with ``bench.metering``'s event shape).

    While the consumer keeps up, a fetch asks for one message and, once that
    has come, for the rest only when its window has passed: the server sends
    what it holds then at once and says it has no more (unless the consumer is
    at its limit of unacknowledged messages: the server then holds the pull
    until acks make room; the fetch returns what it has after its wait, and
    what the pull brings later goes to the next fetch). The messages of a
    window arrive together instead of each as it is stored, so a slow trickle
    of events (one per call at low load) costs this process and nats-server
    one wake-up per batch, not one per event. A fetch that came back full
    (the consumer is behind) is followed by one that asks for a whole batch
    at once, without waiting, and so is a fetch whose first message says a
    whole batch waits behind it.

    Messages that arrive after a fetch returned (from a pull that was still
    open) are kept for the next fetch; none is dropped. Messages never
    returned are redelivered by the server after the consumer's ack wait.
    """

    def __init__(self, nc: NATS, stream: str, durable: str, prefix: str = "$JS.API") -> None:
        self.nc = nc
        self.subject = f"{prefix}.CONSUMER.MSG.NEXT.{stream}.{durable}"
        self._box: list[Msg] = []
        self._want = 0
        self._arrived = asyncio.Event()
        self._full = asyncio.Event()
        self._ended = asyncio.Event()
        self._inbox = ""
        self._sub: Any = None
        self._behind = False  # the last fetch came back full: more may wait

    async def start(self) -> BatchPull:
        self._inbox = self.nc.new_inbox()
        self._sub = await self.nc.subscribe(self._inbox, cb=self._on_message)
        return self

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None

    async def _on_message(self, msg: Msg) -> None:
        # Status messages (404, 408, 409, 100) come without a reply subject;
        # every stream message has one (its ack subject).
        status = msg.headers.get("Status") if msg.headers and not msg.reply else None
        if status is not None:
            if status != "100":  # 404 no messages, 408 expired, 409 ...: that pull is over
                self._ended.set()
            return  # 100: an idle heartbeat or flow control
        self._box.append(msg)
        self._arrived.set()
        if len(self._box) >= self._want:
            self._full.set()

    async def fetch(self, batch: int, timeout: float, window: float) -> list[Msg]:
        """Up to ``batch`` messages: wait ``timeout`` for a first one, then ``window`` more."""
        self._want = batch
        if not self._box and not self._behind:
            # one message, whenever it comes within the timeout
            await self._pull({"batch": 1, "expires": int(timeout * 1e9)})
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._arrived.wait()
        if self._box and not self._behind and len(self._box) + _waiting(self._box[-1]) < batch:
            await asyncio.sleep(window)  # the rest gathers on the server meanwhile
        if (self._box or self._behind) and len(self._box) < batch:
            # What the server holds now, at once; it ends the pull with a status.
            # (No expiry: with one, a server holding nothing more would wait for it.
            # A consumer at its limit of unacked messages holds this pull until acks
            # make room; what it then sends is kept for the next fetch.)
            await self._pull({"batch": batch - len(self._box), "no_wait": True})
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(timeout, window)):
                    await _first(self._full, self._ended)
        got, self._box = self._box[:batch], self._box[batch:]
        self._behind = len(got) == batch
        return got

    async def _pull(self, request: dict[str, Any]) -> None:
        self._arrived.clear()
        self._full.clear()
        self._ended.clear()
        await self.nc.publish(self.subject, orjson.dumps(request), reply=self._inbox)


def _waiting(msg: Msg) -> int:
    """How many messages the server held for the consumer after ``msg`` (0 if unsaid)."""
    try:
        return int(msg.metadata.num_pending or 0)
    except Exception:
        return 0


async def _first(*events: asyncio.Event) -> None:
    waits = [asyncio.create_task(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in waits:
            task.cancel()
