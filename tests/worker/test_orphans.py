"""A final report no router acknowledged is kept in the orphans bucket, even
when NATS cannot take it at first (it went down with the router's host)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from nats.errors import NoRespondersError

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
    """A connection whose first requests find nobody listening (a router not yet back)."""

    def __init__(self, unheard: int, cut_off_s: float = 0.0) -> None:
        self.unheard = unheard
        self.cut_off_s = cut_off_s  # the first request waits this long for a reconnect
        self.sent = 0
        self.stats = {"reconnects": 0}

    async def request(self, subject: str, data: bytes, timeout: float) -> None:
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
