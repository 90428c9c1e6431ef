"""The bus client (:class:`tollgate.wire.bus.Client`) on a real nats-server.

The client reaches into nats.py's internals, so these tests also check that
the installed nats.py still has what it uses: a handler subscribed with
``subscribe_at_once`` runs in the connection's reader task, in order, through
errors, unsubscribes and reconnects, and replies to requests are taken there
too, and a flush means the server has what was sent before it. Its own
requests and JetStream publishes answer as nats.py's do: replies, timeouts,
no responders, cancels, acknowledgements and errors. The session's server
speaks TLS; the reconnect test runs its own.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

import nats
import nats.js.errors
import pytest
from nats.aio.msg import Msg
from nats.js.api import StorageType, StreamConfig

from tests.conftest import NatsServer
from tests.lib.net import free_port
from tollgate.wire import bus


async def eventually(check: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_the_services_connect_with_the_bus_client(nats_server: NatsServer) -> None:
    nc = await nats_server.connect()
    try:
        assert isinstance(nc, bus.Client)
    finally:
        await nc.close()


async def test_an_at_once_handler_runs_in_the_reader_in_order(nats_server: NatsServer) -> None:
    nc = await nats_server.connect()
    sender = await nats_server.connect()
    got: list[tuple[bytes, bool]] = []

    def handler(msg: Msg) -> None:
        got.append((msg.data, asyncio.current_task() is nc._reading_task))

    try:
        sub = await bus.subscribe_at_once(nc, "tg.test.reader", handler)
        await nc.flush()
        for i in range(200):
            await sender.publish("tg.test.reader", str(i).encode(), headers={"H": str(i)})
        await eventually(lambda: len(got) == 200)
        assert [data for data, _ in got] == [str(i).encode() for i in range(200)]
        assert all(in_reader for _, in_reader in got)
        assert sub.delivered == 200  # nats.py's own count
        assert nc.stats["in_msgs"] >= 200

        await sub.unsubscribe()
        assert sub._id not in nc._at_once
        await sender.publish("tg.test.reader", b"after")
        await sender.flush()
        await nc.flush()
        assert len(got) == 200
    finally:
        await nc.close()
        await sender.close()


async def test_a_flush_returns_once_the_server_has_the_subscription(
    nats_server: NatsServer,
) -> None:
    """What a connection sent before a flush is on the server when the flush returns.

    nats.py writes its PING ahead of commands still waiting for its flusher,
    so a subscription just made and flushed could miss a message another
    connection published at once (measured on this test's loop: 37 of 300
    lost with nats.py's own client).
    """
    nc = await nats_server.connect()
    sender = await nats_server.connect()
    try:
        lost = []
        for i in range(300):
            got = asyncio.Event()
            await bus.subscribe_at_once(nc, f"tg.test.flushed.{i}", lambda msg, got=got: got.set())
            await nc.flush()
            await sender.publish(f"tg.test.flushed.{i}", b"x")
            await sender.flush()
            try:
                await asyncio.wait_for(got.wait(), 2)
            except TimeoutError:
                lost.append(i)
        assert lost == []
    finally:
        await nc.close()
        await sender.close()


async def test_a_handlers_error_is_reported_and_the_next_message_still_comes(
    nats_server: NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    nc = await nats_server.connect()
    got: list[bytes] = []

    def handler(msg: Msg) -> None:
        if msg.data == b"bad":
            raise ValueError("no good")
        got.append(msg.data)

    try:
        with caplog.at_level(logging.WARNING, logger="tollgate.wire.bus"):
            await bus.subscribe_at_once(nc, "tg.test.errors", handler)
            for data in (b"a", b"bad", b"b"):
                await nc.publish("tg.test.errors", data)
            await eventually(lambda: got == [b"a", b"b"])
        assert any("ValueError: no good" in r.getMessage() for r in caplog.records)
        assert nc.is_connected
    finally:
        await nc.close()


async def test_replies_to_requests_are_taken_in_the_reader(nats_server: NatsServer) -> None:
    nc = await nats_server.connect()
    responder = await nats_server.connect()

    async def echo(msg: Msg) -> None:
        await msg.respond(b"re:" + msg.data)

    try:
        await responder.subscribe("tg.test.echo", cb=echo)
        await responder.flush()
        replies = await asyncio.gather(
            *(nc.request("tg.test.echo", str(i).encode(), timeout=5) for i in range(50))
        )
        assert [r.data for r in replies] == [f"re:{i}".encode() for i in range(50)]
        # the replies' subscription is an at-once one
        (mux,) = [s for s in nc._subs.values() if s._cb == nc._request_sub_callback]
        assert nc._at_once[mux._id] == nc._request_sub_callback
        assert not nc._resp_map  # every request's future was resolved and dropped
    finally:
        await nc.close()
        await responder.close()


async def test_a_request_nobody_answers_times_out_and_leaves_nothing_behind(
    nats_server: NatsServer,
) -> None:
    nc = await nats_server.connect()
    try:
        await nc.subscribe("tg.test.silent", cb=_ignore)  # heard, never answered
        await nc.flush()
        started = asyncio.get_running_loop().time()
        with pytest.raises(nats.errors.TimeoutError) as raised:
            await nc.request("tg.test.silent", b"x", timeout=0.3)
        waited = asyncio.get_running_loop().time() - started
        assert isinstance(raised.value, TimeoutError)  # what callers catch
        assert 0.3 <= waited < 2.0
        assert not nc._resp_map
    finally:
        await nc.close()


async def test_a_request_nobody_hears_is_answered_no_responders(nats_server: NatsServer) -> None:
    nc = await nats_server.connect()
    try:
        started = asyncio.get_running_loop().time()
        with pytest.raises(nats.errors.NoRespondersError):
            await nc.request("tg.test.nobody", b"x", timeout=5)
        assert asyncio.get_running_loop().time() - started < 2.0  # not the timeout
        assert not nc._resp_map
    finally:
        await nc.close()


async def test_a_cancelled_request_leaves_nothing_behind_and_its_late_reply_is_dropped(
    nats_server: NatsServer,
) -> None:
    nc = await nats_server.connect()
    responder = await nats_server.connect()
    held: list[Msg] = []
    try:
        await responder.subscribe("tg.test.held", cb=_keep(held))
        await responder.flush()
        waiting = asyncio.create_task(nc.request("tg.test.held", b"x", timeout=5))
        await eventually(lambda: len(held) == 1)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert not nc._resp_map
        await held[0].respond(b"late")
        # the next request gets its own reply, not the late one
        reply = asyncio.create_task(nc.request("tg.test.held", b"y", timeout=5))
        await eventually(lambda: len(held) == 2)
        await held[1].respond(b"second")
        assert (await reply).data == b"second"
    finally:
        await nc.close()
        await responder.close()


async def test_requests_made_while_the_inbox_is_being_subscribed_get_their_replies(
    nats_server: NatsServer,
) -> None:
    # nats.py names the requests' inbox, then subscribes it; the subscribe
    # waits while more than its pending limit (2 MiB) is queued to be sent,
    # so the requests made meanwhile find the inbox named but not subscribed.
    nc = await nats_server.connect()
    responder = await nats_server.connect()
    replied_to: list[str] = []
    try:
        await responder.subscribe("tg.test.first", cb=_echo(replied_to))
        await responder.flush()
        big = b"x" * (1536 * 1024)
        sends = [asyncio.create_task(nc.publish("tg.test.sink", big)) for _ in range(2)]
        replies = await asyncio.gather(
            *(nc.request("tg.test.first", str(i).encode(), timeout=5) for i in range(3))
        )
        await asyncio.gather(*sends)
        assert [r.data for r in replies] == [b"re:0", b"re:1", b"re:2"]
        assert nc._resp_sub_prefix is not None
        inbox = nc._resp_sub_prefix.decode()
        assert len(replied_to) == 3 and all(r.startswith(inbox) for r in replied_to)
        assert not nc._resp_map
    finally:
        await nc.close()
        await responder.close()


async def test_reply_tokens_cannot_be_foretold_from_earlier_ones(nats_server: NatsServer) -> None:
    # A service that answers some of this one's requests sees their reply
    # subjects and may publish into the inbox; the tokens of the others must
    # not follow from what it saw (more requests than one batch of random bytes).
    nc = await nats_server.connect()
    responder = await nats_server.connect()
    replied_to: list[str] = []
    try:
        await responder.subscribe("tg.test.tokens", cb=_echo(replied_to))
        await responder.flush()
        for _ in range(3):
            await asyncio.gather(*(nc.request("tg.test.tokens", timeout=5) for _ in range(100)))
        assert nc._resp_sub_prefix is not None
        inbox = nc._resp_sub_prefix.decode()
        tokens = [reply.removeprefix(inbox) for reply in replied_to]
        assert len(tokens) == 300 and len(set(tokens)) == 300
        randoms = [int(token[: bus.TOKEN_RANDOM_HEX], 16) for token in tokens]
        assert all(len(token) > bus.TOKEN_RANDOM_HEX for token in tokens)
        assert len(set(randoms)) == 300
        steps = {b - a for a, b in itertools.pairwise(randoms)}
        assert len(steps) > 250  # no counter, no fixed stride
    finally:
        await nc.close()
        await responder.close()


async def test_a_request_without_a_timeout_waits_for_its_reply(nats_server: NatsServer) -> None:
    nc = await nats_server.connect()
    responder = await nats_server.connect()
    held: list[Msg] = []
    try:
        await responder.subscribe("tg.test.patient", cb=_keep(held))
        await responder.flush()
        waiting = asyncio.create_task(nc.request("tg.test.patient", b"x", timeout=None))
        await eventually(lambda: len(held) == 1)
        await asyncio.sleep(0.7)  # past the default timeout (0.5 s)
        assert not waiting.done()
        await held[0].respond(b"at last")
        assert (await waiting).data == b"at last"
        assert not nc._resp_map
    finally:
        await nc.close()
        await responder.close()


async def test_jetstream_publishes_are_acknowledged_as_nats_py_acknowledges_them(
    nats_server: NatsServer,
) -> None:
    nc = await nats_server.connect()
    js = nc.jetstream()
    assert isinstance(js, bus.JetStream)
    try:
        await js.add_stream(
            StreamConfig(name="TGTESTACKS", subjects=["tg.test.acks.>"], storage=StorageType.MEMORY)
        )
        first = await js.publish("tg.test.acks.a", b"1", headers={"Nats-Msg-Id": "one"})
        second = await js.publish("tg.test.acks.a", b"2", headers={"Nats-Msg-Id": "two"})
        copy = await js.publish("tg.test.acks.a", b"1", headers={"Nats-Msg-Id": "one"})
        assert (first.stream, first.seq, first.duplicate) == ("TGTESTACKS", 1, None)
        assert (second.seq, second.duplicate) == (2, None)
        assert (copy.seq, copy.duplicate) == (1, True)  # the stream's copy, not stored again
        # a refused publish raises the server's error
        with pytest.raises(nats.js.errors.APIError) as refused:
            await js.publish("tg.test.acks.a", b"3", headers={"Nats-Expected-Last-Sequence": "1"})
        assert refused.value.err_code == 10071  # wrong last sequence
        # a subject no stream takes
        with pytest.raises(nats.js.errors.NoStreamResponseError):
            await js.publish("tg.test.nostream", b"x", timeout=2)
        assert not nc._resp_map
    finally:
        await js.delete_stream("TGTESTACKS")
        await nc.close()


async def _ignore(msg: Msg) -> None:
    return None


def _keep(into: list[Msg]) -> Callable[[Msg], Awaitable[None]]:
    async def keep(msg: Msg) -> None:
        into.append(msg)

    return keep


def _echo(replied_to: list[str]) -> Callable[[Msg], Awaitable[None]]:
    """A responder that answers ``re:<data>`` and notes each request's reply subject."""

    async def echo(msg: Msg) -> None:
        replied_to.append(msg.reply)
        await msg.respond(b"re:" + msg.data)

    return echo


async def test_another_client_runs_the_handler_in_the_subscriptions_task(
    nats_server: NatsServer,
) -> None:
    plain = await nats.connect(nats_server.url, **_plain_options(nats_server))
    got: list[bool] = []
    try:
        await bus.subscribe_at_once(
            plain, "tg.test.plain", lambda msg: got.append(asyncio.current_task() is not None)
        )
        await plain.publish("tg.test.plain", b"x")
        await eventually(lambda: got == [True])
    finally:
        await plain.close()


def _plain_options(server: NatsServer) -> dict[str, object]:
    access = server.access()
    return {"nkeys_seed_str": access.seed, "tls": access.tls, "inbox_prefix": access.inbox_prefix}


async def test_an_at_once_subscription_and_publishes_go_on_after_a_reconnect(
    tmp_path: Path,
) -> None:
    server = NatsServer(free_port(), tmp_path / "nats")
    server.start()
    nc = await server.connect()
    sender = await server.connect()
    got: list[bytes] = []
    try:
        await bus.subscribe_at_once(nc, "tg.test.again", lambda msg: got.append(msg.data))
        await nc.flush()
        await sender.publish("tg.test.again", b"before")
        await eventually(lambda: got == [b"before"])

        reconnects = nc.stats["reconnects"]
        server.stop()
        await eventually(lambda: not nc.is_connected)
        server.start()
        await eventually(
            lambda: nc.is_connected and sender.is_connected and nc.stats["reconnects"] > reconnects,
            timeout=20,
        )
        await nc.flush()
        await sender.publish("tg.test.again", b"after")
        await eventually(lambda: got == [b"before", b"after"])
        # and this client's own publishes reach the server again
        echo: list[bytes] = []
        await bus.subscribe_at_once(sender, "tg.test.back", lambda msg: echo.append(msg.data))
        await sender.flush()
        await nc.publish("tg.test.back", b"back")
        await eventually(lambda: echo == [b"back"])
    finally:
        await nc.close()
        await sender.close()
        server.stop()
