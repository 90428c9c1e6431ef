"""Counters shared by router replicas: compare-and-set writes, a lost race read again."""

from __future__ import annotations

import asyncio

from services.router.limits import CounterStore
from tests.conftest import NatsServer
from tollgate.wire import bus
from tollgate.wire.subjects import Subjects
from tollgate.wire.topology import Topology


async def test_two_routers_racing_on_one_counter_stop_at_its_limit(
    nats_server: NatsServer,
) -> None:
    topology = Topology(Subjects("counters"))
    nc = await nats_server.connect(name="test-counters")
    try:
        kv = await topology.bucket(nc.jetstream(), topology.ratelimits)
        routers = (CounterStore(kv), CounterStore(kv))
        # Every add starts from a stale view: creates and updates lose races.
        results = await asyncio.gather(
            *(routers[i % 2].add("key.rpm", 1, limit=10) for i in range(40))
        )
        assert sum(done for done, _ in results) == 10
        assert (await kv.get("key.rpm")).value == b"10"
    finally:
        await bus.close(nc)
