"""A final report no router acknowledged is kept in the orphans bucket, even
when NATS cannot take it at first (it went down with the router's host)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from nats.errors import NoRespondersError, OutboundBufferLimitError
from nats.errors import TimeoutError as NatsTimeoutError

from services.worker import consumer
from services.worker.consumer import Delivery, _Reply, keep_orphan
from tollgate.wire.contracts import Endpoint, InferenceRequest, Outcome


class _Bucket:
    def __init__(self, owner: _FlakyOrphans) -> None:
        self.owner = owner

    async def put(self, key: str, value: bytes) -> None:
        if self.owner.failures_left > 0:
            self.owner.failures_left -= 1
            raise TimeoutError("nats: timeout")
        self.owner.kept[key] = value


class _FlakyOrphans:
    """The consumer's orphans callable, over a bucket whose first puts fail."""

    def __init__(self, failures: int) -> None:
        self.failures_left = failures
        self.kept: dict[str, bytes] = {}
        self.opened: list[bool] = []  # each call's ``fresh``

    async def __call__(self, fresh: bool = False) -> Any:
        self.opened.append(fresh)
        return _Bucket(self)


async def test_a_report_is_kept_once_nats_takes_it_again() -> None:
    orphans = _FlakyOrphans(failures=2)
    assert await keep_orphan(orphans, "req-1", b"end", retry_s=10)
    assert orphans.kept == {"req-1": b"end"}
    # the bucket is opened anew after a failure: a restarted server may have lost it
    assert orphans.opened == [False, True, True]


async def test_a_report_nats_never_takes_is_given_up_after_the_retry_time() -> None:
    orphans = _FlakyOrphans(failures=1_000)
    assert not await keep_orphan(orphans, "req-1", b"end", retry_s=1.2)
    assert orphans.kept == {}
    assert 2 <= len(orphans.opened) <= 4  # tried again while the time lasted


class _Bus:
    """A connection whose first requests find nobody listening (a router not yet back).

    ``down_s``: NATS is away that long from the start (nats.py holds a request
    made meanwhile and times it out; the reconnect counts once it is back).
    ``refused``: the first requests the client refuses to send (its buffer full).
    """

    def __init__(
        self, unheard: int, cut_off_s: float = 0.0, down_s: float = 0.0, refused: int = 0
    ) -> None:
        self.unheard = unheard
        self.cut_off_s = cut_off_s  # the first request waits this long for a reconnect
        self.back_at = time.monotonic() + down_s if down_s else None
        self.refused = refused
        self.sent = 0
        self.stats = {"reconnects": 0}
        self.is_closed = False

    @property
    def is_connected(self) -> bool:
        if self.back_at is not None and time.monotonic() >= self.back_at:
            self.back_at = None
            self.stats["reconnects"] += 1
        return self.back_at is None

    async def request(self, subject: str, data: bytes, timeout: float) -> None:
        if not self.is_connected:  # held in the client's buffer until the ack's wait ends
            await asyncio.sleep(timeout)
            raise NatsTimeoutError
        if self.refused:
            self.refused -= 1
            raise OutboundBufferLimitError
        self.sent += 1
        if self.sent == 1 and self.cut_off_s:
            await asyncio.sleep(self.cut_off_s)
            self.stats["reconnects"] += 1
        if self.sent <= self.unheard:
            raise NoRespondersError


def _reply(nc: _Bus) -> _Reply:
    now = time.time()
    request = InferenceRequest(
        request_id="req-end",
        model="m/x",
        endpoint=Endpoint.CHAT,
        body={"model": "m/x", "messages": []},
        reply_to="tg.reply.r1.req-end",
        enqueued_at=now,
        start_by=now + 30,
        deadline=now + 60,
    )
    return _Reply(nc, request, "w-1")  # type: ignore[arg-type]


async def test_a_report_nobody_hears_yet_is_sent_again_before_it_is_kept() -> None:
    """After NATS comes back, the router may subscribe again after this worker reconnected."""
    nc = _Bus(unheard=3)
    orphans = _FlakyOrphans(failures=0)
    assert await _reply(nc).end(orphans, outcome=Outcome.COMPLETED) is Delivery.ACKNOWLEDGED
    assert nc.sent == 4 and orphans.kept == {}


async def test_a_report_nobody_hears_for_long_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(consumer, "END_RESEND_FOR_S", 0.3)
    nc = _Bus(unheard=1000)
    orphans = _FlakyOrphans(failures=0)
    assert await _reply(nc).end(orphans, outcome=Outcome.COMPLETED) is Delivery.KEPT
    assert 2 <= nc.sent <= 4  # every 0.25 s for 0.3 s
    assert list(orphans.kept) == ["req-end"]


async def test_a_report_neither_heard_nor_kept_is_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    """NATS went down with the router and stays away past the retries: the worker says so."""
    monkeypatch.setattr(consumer, "END_RESEND_FOR_S", 0.3)
    monkeypatch.setattr(consumer, "ORPHAN_RETRY_S", 0.8)
    nc = _Bus(unheard=1000)
    orphans = _FlakyOrphans(failures=1000)
    assert await _reply(nc).end(orphans, outcome=Outcome.COMPLETED) is Delivery.LOST
    assert orphans.kept == {} and len(orphans.opened) >= 2


async def test_a_report_sent_while_cut_off_is_sent_again_once_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sent while this worker was cut off, it went out on the reconnect, found nobody
    yet (its router reconnecting too), and is sent again: the wait starts anew."""
    monkeypatch.setattr(consumer, "END_RESEND_FOR_S", 0.3)
    nc = _Bus(unheard=1, cut_off_s=0.5)
    orphans = _FlakyOrphans(failures=0)
    assert await _reply(nc).end(orphans, outcome=Outcome.COMPLETED) is Delivery.ACKNOWLEDGED
    assert nc.sent == 2 and orphans.kept == {}


async def test_a_report_made_while_nats_is_away_longer_than_the_ack_wait_goes_once_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NATS is away longer than the wait for an acknowledgement and the resends:
    that time does not count, and the report goes to the router once both are back."""
    monkeypatch.setattr(consumer, "END_ACK_TIMEOUT_S", 0.2)
    monkeypatch.setattr(consumer, "END_RESEND_FOR_S", 0.3)
    nc = _Bus(unheard=1, down_s=1.0)  # back after 1 s, its router a moment later
    orphans = _FlakyOrphans(failures=0)
    assert await _reply(nc).end(orphans, outcome=Outcome.COMPLETED) is Delivery.ACKNOWLEDGED
    assert nc.sent == 2 and orphans.kept == {}


async def test_a_report_the_client_refuses_to_send_is_tried_again() -> None:
    nc = _Bus(unheard=0, refused=2)
    orphans = _FlakyOrphans(failures=0)
    assert await _reply(nc).end(orphans, outcome=Outcome.COMPLETED) is Delivery.ACKNOWLEDGED
    assert nc.sent == 1 and orphans.kept == {}


async def test_a_report_on_a_closed_connection_is_lost_at_once() -> None:
    nc = _Bus(unheard=0)
    nc.is_closed = True
    orphans = _FlakyOrphans(failures=0)
    started = time.monotonic()
    assert await _reply(nc).end(orphans, outcome=Outcome.COMPLETED) is Delivery.LOST
    assert nc.sent == 0 and orphans.opened == []
    assert time.monotonic() - started < 1.0  # not the orphans' two minutes of retries
