"""Weighted fair share over a model's lanes: the scheduler alone, then claims on a real bus.

:class:`FairShare` is pure (a backlog in, a lane out), so most of it is tested
by feeding it backlogs and counting grants. :class:`WorkClaims` is tested
against a real nats-server with Tollgate's identities: a router publishes,
a worker claims.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator

import orjson
import pytest
from nats.aio.client import Client as NATS

from services.worker.claims import WorkClaims, _Offer
from services.worker.fairshare import FairShare
from tests.conftest import NatsServer
from tests.lib.net import free_port
from tollgate.wire.subjects import Lane, Subjects
from tollgate.wire.topology import Role, Topology

S = Subjects()
T = Topology(S)
MODEL = "sim/fair-unit"


def lane(tenant: str, key: str = "k1", cls: str = "interactive", model: str = MODEL) -> str:
    return S.infer_lane(model, cls, tenant, key)


def serve(share: FairShare, backlog: dict[str, int], n: int) -> list[str]:
    """Grant ``n`` slots as a worker would: pick, take one from that lane, tell the share."""
    granted = []
    for _ in range(n):
        subject = share.pick(backlog)
        if subject is None:
            break
        backlog[subject] -= 1
        share.took(subject)
        granted.append(subject)
    return granted


def tenants(granted: list[str]) -> list[str]:
    return [parsed.tenant for s in granted if (parsed := Lane.parse(s)) is not None]


def longest_run(values: list[str]) -> int:
    return max((len(list(run)) for _, run in itertools.groupby(values)), default=0)


# -- FairShare ----------------------------------------------------------------


def test_two_backlogged_tenants_alternate() -> None:
    share = FairShare()
    backlog = {lane("acme"): 50, lane("globex"): 50}
    order = tenants(serve(share, backlog, 40))
    assert len(order) == 40
    assert all(a != b for a, b in itertools.pairwise(order)), order
    assert Counter(order) == {"acme": 20, "globex": 20}


def test_learned_weights_split_the_slots_three_to_one() -> None:
    share = FairShare()
    heavy, light = lane("heavy"), lane("light")
    share.learn(heavy, tenant_weight=3.0, key_weight=1.0)
    share.learn(light, tenant_weight=1.0, key_weight=1.0)
    order = tenants(serve(share, {heavy: 1000, light: 1000}, 400))
    assert Counter(order) == {"heavy": 300, "light": 100}
    # the share holds at every scale, not only on the whole: each window of
    # eight grants gives the light tenant two
    for start in range(0, 400, 8):
        assert order[start : start + 8].count("light") == 2, (start, order[start : start + 8])


def test_interactive_lanes_go_before_batch_lanes() -> None:
    share = FairShare()
    batch = lane("bulk", cls="batch")
    share.learn(batch, tenant_weight=100.0, key_weight=100.0)  # no weight buys its way ahead
    backlog = {batch: 20, lane("acme"): 3, lane("globex", "k2"): 2, lane("bulk", "k9"): 1}
    granted = serve(share, backlog, 6)
    classes = [parsed.priority for s in granted if (parsed := Lane.parse(s)) is not None]
    assert classes == ["interactive"] * 6, granted
    # batch gets a slot only once no interactive request waits...
    assert share.pick(backlog) == batch
    assert serve(share, backlog, 2) == [batch, batch]
    # ...and an interactive arrival goes first again at once
    backlog[lane("acme")] = 1
    assert share.pick(backlog) == lane("acme")


def test_keys_of_a_tenant_share_by_key_weight() -> None:
    share = FairShare()
    big, small = lane("acme", "big"), lane("acme", "small")
    share.learn(big, tenant_weight=1.0, key_weight=2.0)
    share.learn(small, tenant_weight=1.0, key_weight=1.0)
    granted = serve(share, {big: 1000, small: 1000}, 300)
    assert Counter(granted) == {big: 200, small: 100}


def test_key_weights_do_not_change_the_tenants_share() -> None:
    share = FairShare()
    many = [lane("acme", f"k{i}") for i in range(4)]
    for subject in many:
        share.learn(subject, tenant_weight=1.0, key_weight=5.0)
    backlog = {subject: 100 for subject in many}
    backlog[lane("globex")] = 100
    order = tenants(serve(share, backlog, 200))
    # four keys with weight 5 still make one tenant with weight 1
    assert Counter(order) == {"acme": 100, "globex": 100}


# the names' order decides ties last: both orders are checked
NAMES = pytest.mark.parametrize("busy_name, back_name", [("busy", "back"), ("back", "busy")])


@NAMES
def test_a_tenant_back_from_idle_gets_its_share_and_no_burst(
    busy_name: str, back_name: str
) -> None:
    share = FairShare()
    busy, back = lane(busy_name), lane(back_name)
    backlog = {busy: 1000, back: 1}
    assert sorted(tenants(serve(share, backlog, 2))) == sorted([busy_name, back_name])
    # the other idles while this one is served many times
    assert set(serve(share, backlog, 300)) == {busy}
    backlog[back] = 100
    order = tenants(serve(share, backlog, 40))
    # from now on it interleaves at its share (1:1), never owed the 300 it missed
    assert longest_run(order) == 1, order
    assert Counter(order) == {busy_name: 20, back_name: 20}


@NAMES
def test_a_new_tenant_starts_at_the_current_share(busy_name: str, back_name: str) -> None:
    share = FairShare()
    backlog = {lane(busy_name): 1000}
    serve(share, backlog, 500)
    backlog[lane(back_name)] = 1000
    order = tenants(serve(share, backlog, 20))
    assert longest_run(order) == 1, order
    assert Counter(order)[back_name] == 10


def test_lanes_without_requests_are_never_picked() -> None:
    share = FairShare()
    empty, waiting = lane("acme"), lane("globex")
    share.learn(empty, tenant_weight=1000.0, key_weight=1000.0)
    assert share.pick({}) is None
    assert share.pick({empty: 0}) is None
    assert share.pick({empty: -1}) is None
    assert share.pick({lane("acme", cls="batch"): 0, empty: 0}) is None
    assert serve(share, {empty: 0, waiting: 3}, 10) == [waiting] * 3


@pytest.mark.parametrize(
    "subject",
    [
        "",
        "garbage",
        "tg.usage.acme",
        "tg.infer.model.interactive.acme",  # one token short
        "tg.infer.model.interactive.acme.k1.w1.extra",  # one more than a direct lane
        "tg.notinfer.model.interactive.acme.k1",
    ],
)
def test_subjects_that_are_not_lanes_are_ignored(subject: str) -> None:
    share = FairShare()
    share.learn(subject, tenant_weight=50.0, key_weight=50.0)
    share.took(subject)
    assert share.pick({subject: 10}) is None
    real = lane("acme")
    assert share.pick({subject: 10, real: 1}) == real
    # nothing it was told about the subject moved any clock
    backlog = {lane("acme"): 10, lane("globex"): 10}
    assert tenants(serve(share, backlog, 4)) == tenants(serve(FairShare(), dict(backlog), 4))


# -- WorkClaims on a real nats-server ------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    server = NatsServer(free_port(), tmp_path_factory.mktemp("claims"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
async def router(server: NatsServer) -> AsyncIterator[NATS]:
    nc = await server.connect(Role.ROUTER, name="test-router")
    await T.ensure_work(nc.jetstream())
    yield nc
    await nc.close()


@pytest.fixture
async def worker(server: NatsServer) -> AsyncIterator[NATS]:
    nc = await server.connect(Role.WORKER, name="test-worker")
    yield nc
    await nc.close()


async def publish(router: NATS, subjects: list[str]) -> list[bytes]:
    """Publish one request per subject, in order; their bodies."""
    js = router.jetstream()
    bodies = []
    for i, subject in enumerate(subjects):
        body = f'{{"n": {i}}}'.encode()
        await js.publish(subject, body)
        bodies.append(body)
    return bodies


async def queued(server: NatsServer, model: str) -> int:
    nc = await server.connect(name="test-count")
    try:
        info = await nc.jetstream().stream_info(
            S.infer_stream, subjects_filter=S.infer_lanes(model)
        )
    finally:
        await nc.close()
    return sum((info.state.subjects or {}).values())


async def test_claims_interleave_the_tenants_of_a_backlog(
    router: NATS, worker: NATS, server: NatsServer
) -> None:
    model = "sim/claims-fair"
    a, b = lane("acme", model=model), lane("globex", model=model)
    await publish(router, [a] * 5 + [b] * 5)  # all of acme's first
    claims = WorkClaims(worker, S, model)
    taken = [await claims.take() for _ in range(10)]
    order = tenants([c.subject for c in taken if c is not None])
    assert len(order) == 10
    assert all(x != y for x, y in itertools.pairwise(order)), order
    assert Counter(order) == {"acme": 5, "globex": 5}
    assert await claims.take() is None
    assert await queued(server, model) == 0


async def test_claims_without_fair_share_take_the_oldest_first(
    router: NATS, worker: NATS, server: NatsServer
) -> None:
    model = "sim/claims-fifo"
    a, b = lane("acme", model=model), lane("globex", model=model)
    bodies = await publish(router, [a] * 5 + [b] * 5)
    claims = WorkClaims(worker, S, model, fair=False)
    taken = [await claims.take() for _ in range(10)]
    assert [c.data for c in taken if c is not None] == bodies
    assert [c.subject for c in taken if c is not None] == [a] * 5 + [b] * 5
    assert await claims.take() is None
    assert await queued(server, model) == 0


@pytest.mark.parametrize("fair", [True, False], ids=["fair", "fifo"])
async def test_two_workers_racing_claim_each_request_exactly_once(
    router: NATS, server: NatsServer, fair: bool
) -> None:
    model = f"sim/claims-race-{'fair' if fair else 'fifo'}"
    lanes = [lane(f"t{i % 5}", f"k{i % 2}", model=model) for i in range(50)]
    bodies = await publish(router, lanes)
    first = await server.connect(Role.WORKER, name="test-worker-1")
    second = await server.connect(Role.WORKER, name="test-worker-2")

    async def drain(claims: WorkClaims) -> list[bytes]:
        got = []
        while True:
            claimed = await claims.take()
            if claimed is not None:
                got.append(claimed.data)
                await asyncio.sleep(0)  # let the other worker in between claims
                continue
            # None may also mean "lost every race this time": done only when empty
            if await queued(server, model) == 0:
                return got
            claims.arrived()

    try:
        one, two = await asyncio.gather(
            drain(WorkClaims(first, S, model, fair=fair)),
            drain(WorkClaims(second, S, model, fair=fair)),
        )
    finally:
        await first.close()
        await second.close()
    assert sorted(one + two) == sorted(bodies)  # every request once, none twice
    assert len(one) + len(two) == 50
    assert one and two, (len(one), len(two))  # both really raced


# -- direct lanes (cache-aware routing) -----------------------------------------


def direct(tenant: str, worker_id: str, model: str, key: str = "k1") -> str:
    return S.infer_lane(model, "interactive", tenant, key, worker_id)


async def test_a_worker_takes_its_own_direct_lane_before_the_shared_one(
    router: NATS, worker: NATS, server: NatsServer
) -> None:
    model = "sim/claims-direct-fair"
    shared = lane("acme", model=model)
    mine = direct("acme", "w-1", model)
    await publish(router, [shared, shared, mine])
    claims = WorkClaims(worker, S, model, "w-1")
    taken = [await claims.take() for _ in range(3)]
    assert [(c.subject, c.source) for c in taken if c is not None] == [
        (mine, "direct"),
        (shared, "shared"),
        (shared, "shared"),
    ]
    assert await queued(server, model) == 0


async def test_without_fair_share_a_direct_request_does_not_jump_the_queue(
    router: NATS, worker: NATS, server: NatsServer
) -> None:
    """First come, first served: the oldest of its own direct lanes' and the shared ones'."""
    model = "sim/claims-direct-fifo"
    shared = lane("acme", model=model)
    mine = direct("globex", "w-1", model)
    bodies = await publish(router, [shared, mine, shared, mine])
    claims = WorkClaims(worker, S, model, "w-1", fair=False)
    taken = [await claims.take() for _ in range(4)]
    assert [c.data for c in taken if c is not None] == bodies
    assert [c.source for c in taken if c is not None] == ["shared", "direct"] * 2
    assert await claims.take() is None
    assert await queued(server, model) == 0


@pytest.mark.parametrize("fair", [True, False], ids=["fair", "fifo"])
async def test_another_worker_s_direct_request_spills_only_after_its_wait(
    router: NATS, worker: NATS, server: NatsServer, fair: bool
) -> None:
    model = f"sim/claims-spill-{'fair' if fair else 'fifo'}"
    theirs = direct("acme", "w-busy", model)
    [body] = await publish(router, [theirs])
    patient = WorkClaims(worker, S, model, "w-other", fair=fair, spill_after_s=600)
    assert await patient.take() is None  # w-busy may still take it
    assert patient.ripe_in() is not None
    assert await queued(server, model) == 1
    eager = WorkClaims(worker, S, model, "w-other", fair=fair, spill_after_s=0)
    claimed = await eager.take()
    assert claimed is not None
    assert (claimed.subject, claimed.source, claimed.data) == (theirs, "spilled", body)
    assert claimed.stamp is not None
    assert await queued(server, model) == 0


async def test_a_spilling_request_younger_than_the_wait_is_left_for_its_worker(
    router: NATS, worker: NATS, server: NatsServer
) -> None:
    """The lane looked old enough, but the stream's timestamp of its request says no."""
    model = "sim/claims-young"
    theirs = direct("acme", "w-busy", model)
    await publish(router, [theirs])
    claims = WorkClaims(worker, S, model, "w-other", spill_after_s=600)
    await claims.take()  # reads the counts: the lane is watched from now
    claims._ripe_at[theirs] = 0.0  # as if first seen long ago
    assert await claims.take() is None
    assert claims._ripe_at[theirs] > 0.0  # opens again when the request is old enough
    assert await queued(server, model) == 1


@pytest.mark.parametrize("fair", [True, False], ids=["fair", "fifo"])
async def test_a_direct_request_first_seen_in_the_counts_spills_by_its_own_age(
    router: NATS, worker: NATS, server: NatsServer, fair: bool
) -> None:
    """Direct requests are not announced to other workers: one that has already
    waited its time when another worker first reads the counts spills at once,
    not a whole wait after it was seen."""
    model = f"sim/claims-spill-age-{'fair' if fair else 'fifo'}"
    theirs = direct("acme", "w-gone", model)
    [body] = await publish(router, [theirs])
    await asyncio.sleep(0.4)  # its worker is gone: the request waits its wait
    claims = WorkClaims(worker, S, model, "w-other", fair=fair, spill_after_s=0.3)
    claimed = await claims.take()  # the first read of the counts
    assert claimed is not None and (claimed.source, claimed.data) == ("spilled", body)


async def test_fair_share_counts_a_direct_lane_under_its_tenant_and_key(
    router: NATS, worker: NATS, server: NatsServer
) -> None:
    model = "sim/claims-direct-share"
    acme_direct = direct("acme", "w-1", model)
    acme_shared = lane("acme", model=model)
    globex = lane("globex", model=model)
    await publish(router, [acme_direct] * 4 + [acme_shared] * 4 + [globex] * 4)
    claims = WorkClaims(worker, S, model, "w-1")
    taken = [await claims.take() for _ in range(12)]
    order = tenants([c.subject for c in taken if c is not None])
    assert len(order) == 12
    # acme's direct and shared requests are one lane for fair share: globex
    # gets every other slot while it waits, not one in three
    assert order[:8].count("globex") == 4, order
    acme = [c.subject for c in taken if c is not None and "acme" in c.subject]
    assert acme == [acme_direct] * 4 + [acme_shared] * 4  # its own lane first
    assert await queued(server, model) == 0


# -- offers (a direct request sent to its worker with its body) -----------------


async def publish_offered(router: NATS, subjects: list[str]) -> list[tuple[int, bytes]]:
    """Publish one request per subject as a router does for direct lanes: (seq, body) each."""
    js = router.jetstream()
    sent = []
    for i, subject in enumerate(subjects):
        body = f'{{"offered": {i}}}'.encode()
        ack = await js.publish(subject, body, headers={"Tollgate-Request-Id": f"r{i}"})
        sent.append((ack.seq, body))
    return sent


class CountingReads(WorkClaims):
    """WorkClaims that counts its reads of the queue (direct gets)."""

    reads = 0

    async def _oldest(self, subject: str):  # type: ignore[no-untyped-def]
        self.reads += 1
        return await super()._oldest(subject)


async def test_an_offered_request_is_claimed_without_reading_the_queue(
    router: NATS, worker: NATS, server: NatsServer
) -> None:
    model = "sim/claims-offer"
    mine = direct("acme", "w-1", model)
    claims = CountingReads(worker, S, model, "w-1")
    claims.arrived()
    await claims.take()  # nothing yet: the worker has read the queue
    sent = await publish_offered(router, [mine, mine])
    for seq, body in sent:
        assert claims.offered(mine, seq, body, {"Tollgate-Request-Id": "r"}, claims._created)
    taken = [await claims.take() for _ in range(2)]
    assert [(c.data, c.source, c.subject) for c in taken if c is not None] == [
        (body, "direct", mine) for _, body in sent
    ]
    assert taken[0] is not None and taken[0].headers == {"Tollgate-Request-Id": "r"}
    # claimed ahead: each comes with its delete, which succeeds
    assert [await c.confirm for c in taken if c is not None and c.confirm is not None] == [
        True,
        True,
    ]
    assert claims.reads == 0  # claimed by deleting the offered message alone
    assert await claims.take() is None
    assert await queued(server, model) == 0


async def test_an_offer_another_worker_took_first_is_dropped_and_runs_nowhere_twice(
    router: NATS, worker: NATS, server: NatsServer
) -> None:
    model = "sim/claims-offer-taken"
    mine = direct("acme", "w-1", model)
    claims = CountingReads(worker, S, model, "w-1")
    await claims._read_backlog()
    [(seq, body)] = await publish_offered(router, [mine])
    other = WorkClaims(worker, S, model, "w-2", spill_after_s=0)  # it spilled to w-2
    spilled = await other.take()
    assert spilled is not None and (spilled.data, spilled.source) == (body, "spilled")
    assert claims.offered(mine, seq, body, {}, claims._created)
    ahead = await claims.take()  # claimed ahead: its delete fails, so it is not this worker's
    assert ahead is not None and ahead.confirm is not None and await ahead.confirm is False
    assert claims._offers == {} and claims._offered_bytes == 0
    assert claims._stale  # the counts are read again before the next take
    assert await claims.take() is None


async def test_a_lane_holding_more_than_its_offers_is_read_oldest_first(
    router: NATS, worker: NATS, server: NatsServer
) -> None:
    """A request queued and not offered (its offer was lost) goes first; the
    offers of requests the counts already hold are not counted twice."""
    model = "sim/claims-offer-older"
    mine = direct("acme", "w-1", model)
    sent = await publish_offered(router, [mine, mine, mine])
    claims = CountingReads(worker, S, model, "w-1")
    await claims._read_backlog()  # 3 waiting
    for seq, body in sent[1:]:  # the first was never offered
        assert claims.offered(mine, seq, body, {}, claims._created)
    assert claims._backlog == {mine: 3}
    taken = [await claims.take() for _ in range(3)]
    assert [c.data for c in taken if c is not None] == [body for _, body in sent]
    assert claims.reads == 1  # the unoffered one; the two offered ones by their delete
    assert [c.confirm is None for c in taken if c is not None] == [True, False, False]
    assert all([await c.confirm for c in taken if c is not None and c.confirm is not None])
    assert claims._offers == {}
    assert await queued(server, model) == 0


async def test_a_request_claimed_by_reading_spends_its_offer(
    router: NATS, worker: NATS, server: NatsServer
) -> None:
    model = "sim/claims-offer-read"
    mine = direct("acme", "w-1", model)
    claims = CountingReads(worker, S, model, "w-1")
    await claims._read_backlog()
    [(seq, body)] = await publish_offered(router, [mine])
    assert claims.offered(mine, seq, body, {}, claims._created)
    claims._backlog[mine] = 2  # more waits than was offered (one offer lost): read the lane
    got = await claims.take()
    assert got is not None and got.data == body and claims.reads == 1
    assert claims._offers == {} and claims._offered_bytes == 0


async def reconnected(router: NATS, worker: NATS, before: tuple[int, int]) -> None:
    """Wait until both connections reconnected since ``before``; then make the queue again."""
    deadline = time.monotonic() + 30
    while not (
        router.stats["reconnects"] > before[0]
        and worker.stats["reconnects"] > before[1]
        and router.is_connected
        and worker.is_connected
    ):
        assert time.monotonic() < deadline, "no reconnect"
        await asyncio.sleep(0.05)
    await T.ensure_work(router.jetstream())


async def test_offers_from_before_a_server_restart_are_never_claimed_by_their_sequence(
    router: NATS, worker: NATS, server: NatsServer
) -> None:
    """A restarted server's memory queue counts sequences from 1 again: an offer
    from before names a sequence that may now be another model's request."""
    model, victims = "sim/claims-offer-again", "sim/claims-offer-victim"
    mine = direct("acme", "w-1", model)
    claims = CountingReads(worker, S, model, "w-1")
    await claims._read_backlog()
    old = await publish_offered(router, [mine, mine])
    old_created = claims._created
    assert claims.offered(mine, old[0][0], old[0][1], {}, old_created)  # held (no free slot)

    before = (router.stats["reconnects"], worker.stats["reconnects"])
    server.stop()
    server.start()
    await reconnected(router, worker, before)
    many = max(seq for seq, _ in old) + 1
    victim = await publish_offered(router, [lane("globex", model=victims)] * many)
    assert {seq for seq, _ in old} <= {seq for seq, _ in victim}  # the same numbers again

    assert await claims.take() is None  # read again after the reconnect: the offer is gone
    assert claims._offers == {} and claims._created != old_created
    # the old queue's copy of the second, handled only now (it waited in this
    # worker's buffers over the restart): stored before the queue it read was made
    assert not claims.offered(mine, old[1][0], old[1][1], {}, old_created)
    assert await claims.take() is None
    assert await queued(server, victims) == many  # no other request was taken


async def queue_created(nc: NATS) -> str:
    """The work queue's creation time, as a router reads it (its identity)."""
    reply = await nc.request(f"$JS.API.STREAM.INFO.{S.infer_stream}", b"", timeout=5)
    return str(orjson.loads(reply.data)["created"])


async def test_offers_held_from_a_queue_made_again_are_never_claimed_by_their_sequence(
    router: NATS, worker: NATS, server: NatsServer
) -> None:
    """The queue is deleted and made again while the worker stays connected.

    The worker holds an offer of the old queue; the new one counts sequences
    from 1 again, so that sequence names another model's request there. The
    first copy from the new queue says so (its router's read of the queue's
    creation time): the worker reads the queue again, drops the old offer
    and takes its new request by reading.
    """
    model, victims = "sim/claims-offer-made-again", "sim/claims-offer-made-again-victim"
    mine = direct("acme", "w-1", model)
    claims = CountingReads(worker, S, model, "w-1")
    await claims._read_backlog()
    old = await publish_offered(router, [mine])
    assert claims.offered(mine, old[0][0], old[0][1], {}, claims._created)  # held

    admin = await server.connect(Role.ADMIN, name="test-admin")
    try:
        await admin.jetstream().delete_stream(S.infer_stream)
    finally:
        await admin.close()
    await T.ensure_work(router.jetstream())
    assert worker.stats["reconnects"] == claims._read_reconnects  # no reconnect to tell
    many = old[0][0] + 1
    victim = await publish_offered(router, [lane("globex", model=victims)] * many)
    assert old[0][0] in {seq for seq, _ in victim}  # the old sequence names a victim now
    [(seq, body)] = await publish_offered(router, [mine])
    assert not claims.offered(mine, seq, body, {}, await queue_created(router))
    assert claims._stale

    got = await claims.take()  # read again: the old offer is dropped, the new request read
    assert got is not None and got.data == body and got.confirm is None
    assert claims._offers == {}
    assert await queued(server, victims) == many  # no victim was deleted


async def test_an_offer_after_a_reconnect_waits_for_the_queue_to_be_read_again(
    router: NATS, worker: NATS, server: NatsServer
) -> None:
    model = "sim/claims-offer-reconnect"
    mine = direct("acme", "w-1", model)
    claims = CountingReads(worker, S, model, "w-1")
    await claims._read_backlog()
    [(seq, body)] = await publish_offered(router, [mine])
    claims._read_reconnects -= 1  # read before this connection's latest reconnect
    assert not claims.offered(mine, seq, body, {}, claims._created)
    assert claims._stale  # read again first: the request is counted there
    got = await claims.take()
    assert got is not None and got.data == body and claims.reads == 1


@pytest.mark.parametrize(
    "subject_of",
    [
        lambda model: direct("acme", "w-2", model),  # another worker's direct lane
        lambda model: lane("acme", model=model),  # a shared lane
        lambda model: direct("acme", "w-1", "sim/another-model"),  # another model's
        lambda model: "tg.usage.acme.plain",  # not a lane
    ],
    ids=["others-direct", "shared", "other-model", "not-a-lane"],
)
async def test_offers_outside_the_worker_s_own_direct_lanes_are_not_taken_as_offers(
    router: NATS, worker: NATS, server: NatsServer, subject_of
) -> None:  # type: ignore[no-untyped-def]
    model = "sim/claims-offer-foreign"
    claims = WorkClaims(worker, S, model, "w-1")
    await claims._read_backlog()
    assert not claims.offered(subject_of(model), 1, b"{}", {}, claims._created)
    assert claims._offers == {}


async def test_without_fair_share_offers_are_only_arrivals(
    router: NATS, worker: NATS, server: NatsServer
) -> None:
    model = "sim/claims-offer-fifo"
    mine = direct("acme", "w-1", model)
    claims = WorkClaims(worker, S, model, "w-1", fair=False)
    await claims._read_backlog()
    assert not claims.offered(mine, 1, b"{}", {}, claims._created)
    assert claims._offers == {} and claims._backlog == {mine: 1}


async def test_offers_are_bounded_the_first_to_come_dropped_first(
    worker: NATS, server: NatsServer
) -> None:
    from services.worker import claims as module

    model = "sim/claims-offer-bound"
    claims = WorkClaims(worker, S, model, "w-1")
    await claims._read_backlog()
    mine = direct("acme", "w-1", model)
    base = claims._last_seq + 1
    for seq in range(base, base + module.MAX_OFFERS + 10):
        assert claims.offered(mine, seq, b"x" * 10, {}, claims._created)
    assert len(claims._offers) == module.MAX_OFFERS
    assert min(claims._offers) == base + 10  # the ten that came first went
    assert claims.offered(
        mine, base + 10, b"x" * 10, {}, claims._created
    )  # offered twice: one kept
    assert len(claims._offers) == module.MAX_OFFERS
    assert claims._offered_bytes == 10 * module.MAX_OFFERS
    big = b"y" * (module.MAX_OFFER_BYTES // 2 + 1)
    claims.offered(mine, base + 10_000, big, {}, claims._created)
    claims.offered(mine, base + 10_001, big, {}, claims._created)
    assert claims._offered_bytes <= module.MAX_OFFER_BYTES
    assert base + 10_001 in claims._offers
    assert claims._offered_bytes == sum(len(o.data) for o in claims._offers.values())


async def test_an_offer_claimed_ahead_is_not_deleted_after_a_reconnect(
    router: NATS, worker: NATS, server: NatsServer
) -> None:
    """Its sequence may name a request of a queue a restarted server made anew:
    the claim counts as lost, and the request, if it still waits, is read."""
    model = "sim/claims-offer-reconnect"
    mine = direct("acme", "w-1", model)
    claims = CountingReads(worker, S, model, "w-1")
    await claims._read_backlog()
    [(seq, body)] = await publish_offered(router, [mine])
    assert claims.offered(mine, seq, body, {}, claims._created)
    ahead = await claims.take()
    assert ahead is not None and ahead.confirm is not None
    worker.stats["reconnects"] += 1  # the connection came back before the delete went out
    try:
        assert await ahead.confirm is False
        assert await queued(server, model) == 1  # not deleted
        again = await claims.take()  # read again: found by reading, and claimed so
        assert again is not None and again.data == body and again.confirm is None
    finally:
        worker.stats["reconnects"] -= 1
    assert await queued(server, model) == 0


async def test_offers_of_requests_that_spilled_are_dropped_at_the_next_read(
    router: NATS, worker: NATS, server: NatsServer
) -> None:
    """Other workers took the lane's oldest requests after their wait: of the
    offers held, only the newest as many as the lane still holds are kept, so
    the next take claims the one left, with no claim made in vain."""
    model = "sim/claims-offer-spilled"
    mine = direct("acme", "w-1", model)
    claims = CountingReads(worker, S, model, "w-1")
    await claims._read_backlog()
    sent = await publish_offered(router, [mine, mine, mine])
    for seq, body in sent:
        assert claims.offered(mine, seq, body, {}, claims._created)
    other = WorkClaims(worker, S, model, "w-2", spill_after_s=0)
    spilled = [await other.take() for _ in range(2)]
    assert [c.data for c in spilled if c is not None] == [body for _, body in sent[:2]]
    await claims._read_backlog()
    assert claims._backlog == {mine: 1}
    assert list(claims._offers) == [sent[2][0]]
    assert claims._offered_bytes == len(sent[2][1])
    taken = await claims.take()
    assert taken is not None and taken.data == sent[2][1] and taken.confirm is not None
    assert await taken.confirm is True
    assert claims.reads == 0
    assert await queued(server, model) == 0


def test_offers_stored_after_a_read_do_not_keep_older_ones_that_left_the_lane() -> None:
    """The read counted one request in the lane; of the offers it counted, only
    the newest is kept, whatever offers came after the read."""
    mine = direct("acme", "w-1", "sim/claims-forget")
    claims = WorkClaims(None, S, "sim/claims-forget", "w-1")  # type: ignore[arg-type]
    for seq in (3, 4, 5, 6):
        claims._offers[seq] = _Offer(mine, b"x", {})
    claims._offered_bytes = 4
    # as a read leaves them: 1 request in the lane, sequences 1 to 5 in the queue
    claims._backlog, claims._first_seq, claims._last_seq = {mine: 1}, 1, 5
    claims._forget_offers(created_again=False)
    assert sorted(claims._offers) == [5, 6]  # 6 was stored after the read
    assert claims._backlog == {mine: 2} and claims._offered_bytes == 2


async def test_an_offer_is_not_claimed_while_nats_is_away(
    router: NATS, worker: NATS, server: NatsServer
) -> None:
    """A delete sent while the connection is down would wait in the client's
    buffer and reach whichever server it reconnects to, where the sequence
    may be another request: the claim ahead fails at once, and nothing is sent."""
    model = "sim/claims-offer-away"
    mine = direct("acme", "w-1", model)
    claims = CountingReads(worker, S, model, "w-1")
    await claims._read_backlog()
    [(seq, body)] = await publish_offered(router, [mine])
    assert claims.offered(mine, seq, body, {}, claims._created)
    before = (router.stats["reconnects"], worker.stats["reconnects"])
    server.stop()
    try:
        deadline = time.monotonic() + 10
        while worker.is_connected:
            assert time.monotonic() < deadline, "the worker never noticed"
            await asyncio.sleep(0.01)
        ahead = await claims.take()  # the counts were read just now
        assert ahead is not None and ahead.data == body and ahead.confirm is not None
        async with asyncio.timeout(1):  # not held until the reconnect
            assert await ahead.confirm is False
        assert claims._stale
        assert worker.pending_data_size == 0  # no delete waits in the buffer
    finally:
        server.start()
        await reconnected(router, worker, before)
