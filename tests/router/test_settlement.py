"""A call's reservation is settled exactly once: through a NATS restart, and by the
next run of a router killed before it settled (real nats-server, real outbox)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS

from services.router.limits import (
    BUDGETS,
    Change,
    ConcurrencyLimited,
    CounterStore,
    Limiter,
    Reservation,
    journaled,
)
from services.router.settlement import Settler
from services.router.usage import Outbox, UsagePublisher
from tests.conftest import NatsServer, free_port
from tests.router.test_limits import counter
from tollgate.keys.records import KeyRecord
from tollgate.wire import bus
from tollgate.wire.contracts import UsageEvent
from tollgate.wire.subjects import Subjects
from tollgate.wire.topology import Topology

SUBJECTS = Subjects()
BUDGET = KeyRecord(key_id="k1", tenant="acme", budget_tokens=100_000, budget_period="total")
RESERVED, USED = 500, 56  # the call's worst case, and what it used


def event(request_id: str) -> UsageEvent:
    return UsageEvent(
        request_id=request_id,
        time=time.time(),
        tenant="acme",
        key_id="k1",
        model="m",
        prompt_tokens=50,
        completion_tokens=USED - 50,
        outcome="completed",
        streamed=False,
        total_s=0.1,
        http_status=200,
    )


async def until_made(settler: Settler, within_s: float = 30) -> None:
    """Polls: the retries run on their own timer, with no event to await."""
    deadline = time.monotonic() + within_s
    while settler.unmade:
        assert time.monotonic() < deadline, f"still unmade: {settler.unmade}"
        await asyncio.sleep(0.05)


async def test_a_counter_write_with_an_id_counts_once(nats_server: NatsServer) -> None:
    """The same write again (after a failure that hid whether it landed) adds nothing,
    even after another router changed the counter in between."""
    topology = Topology(Subjects("settle-once"))
    nc = await nats_server.connect(name="test-settle-once")
    try:
        kv = await topology.bucket(nc.jetstream(), topology.budgets)
        mine, other = CounterStore(kv), CounterStore(kv)
        await mine.add("k.total", 500)
        assert await mine.add("k.total", -444, floor=0, write_id="call-1.k.total") == (True, 56)
        await other.add("k.total", 500)  # another router's reservation
        # this router tries again from its stale view: read, retried, dropped as a copy
        await mine.add("k.total", -444, floor=0, write_id="call-1.k.total")
        # and so does the router's next run, which has no view at all
        await CounterStore(kv).add("k.total", -444, floor=0, write_id="call-1.k.total")
        assert await counter(mine, "k.total") == 556
        # another call's write is its own
        await mine.add("k.total", -400, floor=0, write_id="call-2.k.total")
        assert await counter(mine, "k.total") == 156
    finally:
        await bus.close(nc)


@pytest.fixture
def own_nats(tmp_path: Path) -> Iterator[NatsServer]:
    server = NatsServer(free_port(), tmp_path / "nats")
    server.start()
    yield server
    server.stop()


@pytest.fixture
async def router_nc(own_nats: NatsServer) -> AsyncIterator[NATS]:
    nc = await own_nats.connect(name="test-router")
    yield nc
    await bus.close(nc)


async def finish(
    settler: Settler, publisher: UsagePublisher, request_id: str, held: Reservation
) -> None:
    """What the router does when a call ends: the event and its settlement, then settle."""
    settlement = settler.plan(held, USED, 50)
    publisher.emit(event(request_id), budget=True, settlement=journaled(settlement))
    await settler.settle(request_id, settlement)


@dataclass
class Router:
    """A router's usage publisher, limiter and settler, on its own nats-server."""

    publisher: UsagePublisher
    limiter: Limiter
    settler: Settler

    async def finish(self, request_id: str, held: Reservation) -> None:
        await finish(self.settler, self.publisher, request_id, held)

    async def budget(self, key_id: str = BUDGET.key_id) -> int:
        return await counter(self.limiter.budgets, f"{key_id}.total")


@pytest.fixture
async def router(router_nc: NATS, tmp_path: Path) -> AsyncIterator[Router]:
    js = router_nc.jetstream(timeout=1.0)  # a write NATS does not answer fails within 1 s
    publisher = UsagePublisher(js, SUBJECTS, Outbox(tmp_path / "outbox.db"), retry_every_s=0.2)
    await publisher.start()
    limiter = await Limiter.open(js, Topology(SUBJECTS))
    settler = Settler(limiter, publisher, retry_every_s=0.2)
    settler.start()
    yield Router(publisher, limiter, settler)
    await settler.stop()
    await publisher.flush(timeout=1)
    await limiter.close()


async def test_settlements_cut_off_by_a_nats_restart_are_made_once_it_is_back(
    own_nats: NatsServer, router: Router
) -> None:
    held = [await router.limiter.reserve(BUDGET, RESERVED) for _ in range(3)]
    assert await router.budget() == 3 * RESERVED

    await router.finish("call-0", held[0])
    assert await router.budget() == 2 * RESERVED + USED
    assert not router.settler.unmade and router.publisher.outbox.settlements() == []

    # NATS restarts while two calls settle: their writes fail, and stay journaled
    own_nats.stop()
    await asyncio.gather(*(router.finish(f"call-{i}", held[i]) for i in (1, 2)))
    assert sorted(router.settler.unmade) == ["call-1", "call-2"]
    journal = router.publisher.outbox.settlements()
    assert sorted(rid for rid, _ in journal) == ["call-1", "call-2"]

    own_nats.start()
    await until_made(router.settler)
    # each call's worst case replaced by its count once: none kept, none given back twice
    assert await router.budget() == 3 * USED
    assert router.publisher.outbox.settlements() == []


async def test_a_write_that_landed_after_it_was_given_up_on_counts_once(
    own_nats: NatsServer, router: Router
) -> None:
    """nats-server stalls while a budget's write is on its way: the router gives up
    on its answer, and the server stores the write once it runs again. The write
    made again is dropped as its copy."""
    held = await router.limiter.reserve(BUDGET, RESERVED)
    assert own_nats.proc is not None
    os.kill(own_nats.proc.pid, signal.SIGSTOP)
    try:
        await router.finish("call-1", held)
        assert list(router.settler.unmade) == ["call-1"]  # no answer within the timeout
    finally:
        os.kill(own_nats.proc.pid, signal.SIGCONT)
    await until_made(router.settler)
    # the stalled write landed (56), and the one made again did not take 444 more
    assert await router.budget() == USED


async def test_a_give_back_cut_off_by_a_nats_restart_frees_no_later_call(
    own_nats: NatsServer, router_nc: NATS, router: Router
) -> None:
    """The rate limits' bucket is kept in memory: a restart empties it. A unit whose
    give-back failed is gone with it, and giving it back later would free the unit
    of a call that took it since; only the budget's write is made again."""
    key = BUDGET.model_copy(update={"key_id": "k2", "max_concurrent": 1})
    first = await router.limiter.reserve(key, RESERVED)
    own_nats.stop()
    await router.finish("call-a", first)
    assert router.settler.unmade == {"call-a": [Change(BUDGETS, "k2.total", USED - RESERVED)]}
    own_nats.start()
    async with asyncio.timeout(20):
        while not router_nc.is_connected:  # noqa: ASYNC110 - nats.py reconnects on its timer
            await asyncio.sleep(0.05)
    second = await router.limiter.reserve(key, RESERVED)  # the only unit, in the emptied bucket
    await until_made(router.settler)
    with pytest.raises(ConcurrencyLimited):
        await router.limiter.reserve(key, RESERVED)
    assert await router.budget("k2") == USED + RESERVED
    await router.finish("call-b", second)
    await router.limiter.reserve(key, RESERVED)  # given back: the unit is free again


async def test_a_router_killed_before_it_settled_settles_in_its_next_run(
    router_nc: NATS, tmp_path: Path
) -> None:
    js = router_nc.jetstream()
    topology = Topology(SUBJECTS)
    path = tmp_path / "outbox.db"
    publisher = UsagePublisher(js, SUBJECTS, Outbox(path))
    limiter = await Limiter.open(js, topology)
    settler = Settler(limiter, publisher)
    budget = f"{BUDGET.key_id}.total"
    first, second = [await limiter.reserve(BUDGET, RESERVED) for _ in range(2)]
    # killed after the first call's event was written, before any of its writes
    publisher.emit(
        event("call-a"), budget=True, settlement=journaled(settler.plan(first, USED, 50))
    )
    # and after the second call's writes were made, before their journal entry went
    made = settler.plan(second, USED, 50)
    publisher.emit(event("call-b"), budget=True, settlement=journaled(made))
    assert await limiter.apply(made, "call-b") == []
    assert await counter(limiter.budgets, budget) == RESERVED + USED
    await publisher.flush()  # (what a kill leaves is the journal; this test's tasks end)
    await limiter.close()

    # the next run on the same outbox makes what is journaled, each write once
    publisher = UsagePublisher(js, SUBJECTS, Outbox(path))
    limiter = await Limiter.open(js, topology)
    settler = Settler(limiter, publisher, retry_every_s=0.05)
    assert sorted(settler.unmade) == ["call-a", "call-b"]
    settler.start()
    await until_made(settler)
    assert await counter(limiter.budgets, budget) == 2 * USED
    assert Outbox(path).settlements() == []
    await settler.stop()
    publisher.outbox.close()
    await limiter.close()
