"""The router's key mirror trusts a watch's "initial values are in" marker only
when the values are in.

nats.py sends the marker when its new consumer has nothing pending and its
subscription has received nothing, which also holds while the values the
server has just sent are still on their way. A router that counted its mirror
loaded then would refuse, for a moment, a key written just before it started.
A scripted watch (a test double for nats.py's) sends the marker first here.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from services.router import auth
from services.router.auth import KeyMirror
from tollgate.keys.records import KeyRecord


def _entry(key_id: str, revision: int, delta: int) -> Any:
    value = KeyRecord(key_id=key_id, tenant="t1").model_dump_json().encode()
    return SimpleNamespace(key=key_id, value=value, revision=revision, delta=delta, operation=None)


class ScriptedWatch:
    """Yields the marker, then (once let go) the entries the server had delivered."""

    def __init__(self, entries: list[Any], delivered: int, sent: int | None = None) -> None:
        """``delivered``: the last stream sequence the server sent; ``sent``: how
        many messages it sent (as many as the entries unless told)."""
        self.entries = entries
        self.go = asyncio.Event()
        self.marker_sent = asyncio.Event()
        self.info_fails = False
        count = len(entries) if sent is None else sent
        info = SimpleNamespace(delivered=SimpleNamespace(stream_seq=delivered, consumer_seq=count))

        async def consumer_info() -> Any:
            if self.info_fails:
                raise TimeoutError("nats: timeout")
            return info

        self._sub = SimpleNamespace(consumer_info=consumer_info)

    async def __aiter__(self) -> AsyncIterator[Any]:
        yield None
        self.marker_sent.set()
        await self.go.wait()
        for entry in self.entries:
            yield entry
        await asyncio.Event().wait()  # a watch goes on until it is stopped


class ScriptedBucket:
    def __init__(self, watch: ScriptedWatch, last_seq: int) -> None:
        self.watch = watch
        self.last_seq = last_seq

    async def status(self) -> Any:
        return SimpleNamespace(
            stream_info=SimpleNamespace(state=SimpleNamespace(last_seq=self.last_seq))
        )

    async def watchall(self) -> ScriptedWatch:
        return self.watch


async def _follow(mirror: KeyMirror, bucket: ScriptedBucket) -> asyncio.Task[None]:
    task = asyncio.create_task(mirror._follow(bucket, "keys", mirror._apply_key))
    async with asyncio.timeout(5):
        await bucket.watch.marker_sent.wait()
    await asyncio.sleep(0.05)  # the marker has been handled
    return task


async def test_a_marker_ahead_of_the_values_waits_for_them() -> None:
    mirror = KeyMirror()
    watch = ScriptedWatch([_entry("k1", 1, 1), _entry("k2", 2, 0)], delivered=2)
    task = await _follow(mirror, ScriptedBucket(watch, last_seq=2))
    try:
        assert not mirror._synced["keys"].is_set()  # k1 and k2 are on their way
        watch.go.set()
        async with asyncio.timeout(5):
            await mirror._synced["keys"].wait()
        assert set(mirror.records) == {"k1", "k2"}
        assert mirror._applied["keys"] == 2
    finally:
        task.cancel()


async def test_a_marker_after_everything_was_received_loads_at_once() -> None:
    mirror = KeyMirror()
    watch = ScriptedWatch([], delivered=0)  # an empty bucket
    task = await _follow(mirror, ScriptedBucket(watch, last_seq=0))
    try:
        assert mirror._synced["keys"].is_set()
    finally:
        task.cancel()


async def test_an_empty_bucket_that_held_values_loads_at_once() -> None:
    """Its last sequence is past zero, but the server sent nothing."""
    mirror = KeyMirror()
    watch = ScriptedWatch([], delivered=5)
    task = await _follow(mirror, ScriptedBucket(watch, last_seq=5))
    try:
        assert mirror._synced["keys"].is_set()
    finally:
        task.cancel()


async def test_a_marker_that_cannot_be_checked_is_not_trusted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(auth, "INITIAL_VALUES_GRACE_S", 30)
    mirror = KeyMirror()
    watch = ScriptedWatch([_entry("k1", 1, 0)], delivered=1)
    watch.info_fails = True
    task = await _follow(mirror, ScriptedBucket(watch, last_seq=1))
    try:
        assert not mirror._synced["keys"].is_set()
        watch.go.set()
        async with asyncio.timeout(5):
            await mirror._synced["keys"].wait()
        assert set(mirror.records) == {"k1"}
    finally:
        task.cancel()


async def test_the_grace_of_a_watch_that_ended_does_not_load_the_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(auth, "INITIAL_VALUES_GRACE_S", 1.0)
    mirror = KeyMirror()
    watch = ScriptedWatch([], delivered=3, sent=1)
    task = await _follow(mirror, ScriptedBucket(watch, last_seq=3))
    task.cancel()  # stopped (a reconnect, a stall) before its values came
    await asyncio.gather(task, return_exceptions=True)
    await asyncio.sleep(1.5)  # past the grace the ended watch had
    assert not mirror._synced["keys"].is_set()
    assert mirror._applied["keys"] == 0


async def test_values_that_never_come_hold_the_mirror_back_only_a_moment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A value the server sent but nats.py dropped (a marker it does not know)."""
    monkeypatch.setattr(auth, "INITIAL_VALUES_GRACE_S", 1.0)
    mirror = KeyMirror()
    watch = ScriptedWatch([], delivered=3, sent=1)
    task = await _follow(mirror, ScriptedBucket(watch, last_seq=3))
    try:
        assert not mirror._synced["keys"].is_set()
        async with asyncio.timeout(5):
            await mirror._synced["keys"].wait()
        assert mirror._applied["keys"] == 3  # the bucket as it was is covered
    finally:
        task.cancel()
