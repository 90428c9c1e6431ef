"""How a worker takes requests from its model's lanes in the work queue.

The work queue (one JetStream stream, work-queue retention, no consumers)
holds each request under its lane's subject: a shared lane per class, tenant
and key, and beside it each worker's direct lanes, where cache-aware routing
puts a request for the worker that likely holds its prompt's prefix. A
worker with a free slot:

1. knows how many requests wait in each lane of its model: the stream's
   per-subject counts, read at least every second and after a lost race,
   plus one for each arrival a router announces in a shared lane since, and
   each request offered in its own direct lanes (so a worker that keeps up
   takes each request without reading the counts again);
2. picks a lane by fair share (:class:`~services.worker.fairshare.FairShare`),
   counting a direct lane under its shared lane's class, tenant and key, and
   taking from its own direct lane before the shared one within that group;
   or, with fair share off, takes the oldest request of its own direct lanes
   and the shared ones (first come, first served). Either way it takes from
   another worker's direct lane only once the request there has waited
   ``spill_after_s`` (that worker is busy, draining or gone: the request
   spills to every worker);
3. reads that lane's oldest request (a direct get) and deletes it. The
   delete is the claim: of several workers that read the same request, the
   one whose delete succeeds runs it; the others read the next one.

A request stored in this worker's direct lane is *offered* to this worker
(:meth:`WorkClaims.offered`): the work queue sends a copy as it stores it
(a republish), with its sequence and lane, and the router announces no
arrival. When fair share picks that lane and every request known to wait there was
offered, the worker deletes the oldest offered one straight away, without
the read: a claim in one round trip instead of two. It does not wait for
that delete to start the request: the claim comes with it, unconfirmed
(:attr:`Claimed.confirm`), and nothing of the request leaves the worker
until the delete succeeded, so a reply that is not streamed has its engine
work overlap the round trip, and nothing runs twice. An offer whose delete
fails (another worker took the request after its wait, or its router
withdrew it) is dropped, and the work started for it is stopped and sent
nowhere; so is every offer once the queue turns out to have been created
again (a restarted server counts sequences from 1 again, so an old sequence
may name another request). An offer counts only as an arrival (and the
queue is read again) unless its router's read of the queue's creation time
(:data:`~tollgate.wire.subjects.QUEUE_HEADER`) is the one this worker read,
after its last reconnect.

Other workers learn of a direct request from the counts (read at least every
second): a lane first seen there opens at once, and the request's own
timestamp in the stream decides whether it has waited ``spill_after_s``.

A request stays in the stream until a worker claims it, so it survives a
cold start (no worker yet) and is never lost with a worker that dies before
claiming it. A router withdraws a request whose client left by deleting it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime

import orjson
from nats.aio.client import Client as NATS

from services.worker.fairshare import FairShare
from tollgate.wire.subjects import Lane, Subjects, model_token

log = logging.getLogger("tollgate.worker.claims")

# How old the lanes' counts may get before they are read again, when no
# arrival has been announced (arrivals mark them stale at once).
REFRESH_EVERY_S = 1.0
# How long a request waits in another worker's direct lane before any worker
# may take it (that worker is busy, draining or gone).
SPILL_AFTER_S = 0.5
# How many reads a claim may take before it gives up for now (each lost race
# or empty lane costs one).
_TRIES = 32
# The most offers a worker keeps, and their bodies' bytes (the oldest go
# first); an offer the worker had no slot for also waits in the queue, where
# the worker finds it by reading.
MAX_OFFERS = 256
MAX_OFFER_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class Claimed:
    """A request this worker took: its lane, body and headers (trace context).

    ``source`` says where it waited: ``direct`` (this worker's direct lane),
    ``shared``, or ``spilled`` (another worker's direct lane, after the wait).
    """

    subject: str
    data: bytes
    headers: dict[str, str]
    source: str = "shared"
    stamp: float | None = None  # when it entered the stream (Unix time), if known
    # An offer claimed ahead: True once this worker's delete succeeded (the
    # request is its own), False when another had it. None: claimed already.
    confirm: asyncio.Future[bool] | None = field(default=None, compare=False)


class WorkClaims:
    """Claims one model's requests from the work queue (see the module's docs)."""

    def __init__(
        self,
        nc: NATS,
        subjects: Subjects,
        model_id: str,
        worker_id: str | None = None,
        *,
        fair: bool = True,
        spill_after_s: float = SPILL_AFTER_S,
    ) -> None:
        self.nc = nc
        self.fair = fair
        self.spill_after_s = spill_after_s
        self.share = FairShare()
        self.stream = subjects.infer_stream
        self.lanes = subjects.infer_lanes(model_id)
        self._shared = subjects.infer_shared_lanes(model_id)
        self.me = model_token(worker_id) if worker_id else None
        self._mine = subjects.infer_direct_lanes(model_id, worker_id) if worker_id else None
        self._api = "$JS.API"
        self._backlog: dict[str, int] = {}
        # other workers' direct lanes: when (monotonic) their oldest request may be taken
        self._ripe_at: dict[str, float] = {}
        self._read_at = 0.0
        self._stale = True
        self._shared_waiting = False  # first come, first served: shared lanes hold requests
        self._prefix = self.lanes[:-1]  # "tg.infer.<model>."
        # True when the last take gave up after losing every race to other
        # workers: requests still wait
        self.contended = False
        # requests offered to this worker, by their sequence in the queue
        self._offers: dict[int, _Offer] = {}
        self._offered_bytes = 0
        # the queue as last read: its creation time (its identity: a restarted
        # server's memory stream counts sequences from 1 again), its first and
        # last sequence, and this connection's reconnects when it was read
        self._created: str | None = None
        self._first_seq = 0
        self._last_seq = 0
        self._read_reconnects = -1

    def arrived(self, lane: str | None = None) -> None:
        """A router announced a request for this model, in ``lane`` when it says."""
        if lane is not None and lane.startswith(self._prefix):
            self._backlog[lane] = self._backlog.get(lane, 0) + 1
            self._watch(lane, time.monotonic())
        else:
            self._stale = True

    def offered(
        self, lane: str, seq: int, data: bytes, headers: dict[str, str], queue: str | None
    ) -> bool:
        """The queue stored a request as ``seq`` in this worker's direct ``lane`` (see the docs).

        ``queue``: the queue's creation time as the request's router last read
        it (:data:`~tollgate.wire.subjects.QUEUE_HEADER`). False when the
        offer is only taken as news that a request waits: ``lane`` is not one
        of this worker's direct lanes; fair share is off (first come, first
        served compares the lanes' oldest requests, which only reading
        gives); or the offer may name a sequence of another queue than the one
        this worker last read, where that sequence may be another request:
        ``queue`` is not that one's creation time (the queue was made again,
        or the router has not read it since), or this worker has not read the
        queue since it last reconnected. The queue is then read again before
        the next take (which drops the offers held from an old one).
        """
        parsed = Lane.parse(lane) if lane.startswith(self._prefix) else None
        if parsed is None or self.me is None or parsed.worker != self.me or not self.fair:
            self.arrived(lane if parsed is not None else None)
            return False
        if (
            queue is None
            or queue != self._created
            or self.nc.stats["reconnects"] != self._read_reconnects
        ):
            self._stale = True  # read the queue again: the request is counted there
            return False
        if seq < self._first_seq:
            return False  # no longer in the queue
        self._drop_offer(seq)  # an offer of the same request again replaces it
        self._offers[seq] = _Offer(lane, data, headers)
        self._offered_bytes += len(data)
        while len(self._offers) > MAX_OFFERS or self._offered_bytes > MAX_OFFER_BYTES:
            self._drop_offer(next(iter(self._offers)))  # the one that came first
        if seq > self._last_seq:  # stored after the counts were read: not counted there
            self.arrived(lane)
        return True

    def _drop_offer(self, seq: int) -> _Offer | None:
        offer = self._offers.pop(seq, None)
        if offer is not None:
            self._offered_bytes -= len(offer.data)
        return offer

    def _take_offer(self, lane: str) -> tuple[int, Claimed] | None:
        """The oldest request offered in ``lane``, when every request known to wait there was."""
        seqs = [seq for seq, offer in self._offers.items() if offer.lane == lane]
        if not seqs or self._backlog.get(lane, 0) > len(seqs):
            return None
        seq = min(seqs)
        offer = self._offers.pop(seq)
        self._offered_bytes -= len(offer.data)
        return seq, Claimed(lane, offer.data, offer.headers, "direct")

    def _forget_offers(self, created_again: bool) -> None:
        """After a read of the queue: drop the offers whose requests are gone.

        All of them when the queue was created again; else those below its
        first sequence, and of those stored before the read (so counted by
        it) all but the newest as many as their lane holds: the others were
        taken from the lane's front (they spilled to other workers) or
        withdrawn. Offers stored after the read are added to the counts.
        """
        if created_again:
            self._offers.clear()
            self._offered_bytes = 0
            return
        read = dict(self._backlog)
        counted: dict[str, int] = {}  # per lane: offers kept that the read counted
        for seq in sorted(self._offers, reverse=True):  # newest first
            lane = self._offers[seq].lane
            if seq > self._last_seq:
                self._backlog[lane] = self._backlog.get(lane, 0) + 1
                continue
            counted[lane] = counted.get(lane, 0) + 1
            if seq < self._first_seq or counted[lane] > read.get(lane, 0):
                self._drop_offer(seq)

    def ripe_in(self) -> float | None:
        """Seconds until a request in another worker's direct lane may be taken (None: none)."""
        waiting = [at for lane, at in self._ripe_at.items() if self._backlog.get(lane, 0) > 0]
        return max(0.0, min(waiting) - time.monotonic()) if waiting else None

    def _outdated(self) -> bool:
        """Whether the lanes' counts must be read again before the next take."""
        return (
            self._stale
            or self._age() > REFRESH_EVERY_S
            # held offers may name sequences of a queue a restarted server lost
            or self.nc.stats["reconnects"] != self._read_reconnects
        )

    def take_offered(self) -> Claimed | None:
        """The next request for this worker when it is an offer, claimed ahead; else None.

        What :meth:`take` returns first when the counts are fresh and fair
        share picks a lane whose requests were all offered, without waiting
        for anything: a worker with a free slot starts an offer as it reads
        it. None leaves everything as it was (:meth:`take` then decides).
        """
        if not self.fair or self._outdated():
            return None
        subject = self._pick()
        offered = self._take_offer(subject) if subject is not None else None
        if offered is None:
            return None
        self.contended = False
        return self._taken(self._ahead(*offered))

    def _ahead(self, seq: int, claimed: Claimed) -> Claimed:
        """Claim an offer ahead: the delete runs while the request starts."""
        confirm = asyncio.ensure_future(self._confirm(seq, self._read_reconnects))
        return replace(claimed, confirm=confirm)

    def _taken(self, claimed: Claimed) -> Claimed:
        """Count a claimed request out of its lane."""
        left = self._backlog.get(claimed.subject, 1) - 1
        if left > 0:
            self._backlog[claimed.subject] = left
        else:
            self._backlog.pop(claimed.subject, None)
        if self.fair:
            self.share.took(claimed.subject)
        return claimed

    async def take(self) -> Claimed | None:
        """The next request for this worker; None when no lane holds one it may take."""
        self.contended = False
        for _ in range(_TRIES):
            if self._outdated():
                await self._read_backlog()
            subject = self._pick()
            if subject is None:
                return None
            reconnects = int(self.nc.stats["reconnects"])
            offered = self._take_offer(subject)
            got = offered or await self._oldest(subject)
            if got is None:
                if subject in self._backlog:
                    self._backlog.pop(subject)  # emptied by others since the counts
                else:
                    self._stale = True  # a wildcard (first come, first served) found nothing
                continue
            if not self.fair and subject == self._mine and self._shared_waiting:
                # first come, first served: the older of its own direct lanes' and
                # the shared lanes' oldest requests
                shared = await self._oldest(self._shared)
                if shared is not None and shared[0] < got[0]:
                    got = shared
            seq, claimed = got
            if claimed.source == "spilled" and not self._spills(claimed):
                continue  # the request there is younger than the wait: its worker may take it
            if got is offered:
                return self._taken(self._ahead(seq, claimed))
            if not self._connected_since(reconnects) or not await self._delete(seq):
                self._stale = True  # other workers are taking from these lanes, or NATS is away
                continue  # another worker had it first
            self._drop_offer(seq)  # claimed by reading: its offer, if any, is spent
            return self._taken(claimed)
        self.contended = True
        return None

    # -- which lane ---------------------------------------------------------

    def _source(self, lane: Lane) -> str:
        if lane.worker is None:
            return "shared"
        return "direct" if lane.worker == self.me else "spilled"

    def _open(self, subject: str, lane: Lane, now: float) -> bool:
        """Whether this worker may take from ``subject`` now."""
        if lane.worker is None or lane.worker == self.me:
            return True
        return self._ripe_at.get(subject, now + self.spill_after_s) <= now

    def _pick(self) -> str | None:
        """The subject to read the next request from (a lane, or a wildcard of lanes)."""
        now = time.monotonic()
        groups: dict[str, int] = {}
        spilling: dict[str, str] = {}  # group -> another worker's ripe direct lane in it
        own = shared = False
        for subject, count in self._backlog.items():
            lane = Lane.parse(subject) if count > 0 else None
            if lane is None or not self._open(subject, lane, now):
                continue
            groups[lane.group] = groups.get(lane.group, 0) + count
            source = self._source(lane)
            own = own or source == "direct"
            shared = shared or source == "shared"
            if source == "spilled":
                spilling.setdefault(lane.group, subject)
        if not self.fair:  # first come, first served: own and shared lanes, then spills
            self._shared_waiting = shared
            if own and self._mine is not None:
                return self._mine  # and the shared lanes' oldest, if older (see take)
            if shared:
                return self._shared
            return next(iter(spilling.values()), None)
        group = self.share.pick(groups)
        if group is None:
            return None
        if self.me is not None and self._backlog.get(f"{group}.{self.me}", 0) > 0:
            return f"{group}.{self.me}"
        if self._backlog.get(group, 0) > 0:
            return group
        return spilling.get(group)

    def _watch(self, subject: str, now: float, counted: bool = False) -> None:
        """Start the wait of another worker's direct lane that holds requests.

        A lane announced now waits from now; one first seen in the queue's
        counts (``counted``) may hold a request that has waited a while, so
        it opens at once and the request's own timestamp decides (:meth:`_spills`).
        """
        lane = Lane.parse(subject)
        if lane is not None and lane.worker is not None and lane.worker != self.me:
            self._ripe_at.setdefault(subject, now if counted else now + self.spill_after_s)

    def _spills(self, claimed: Claimed) -> bool:
        """Whether the request read from another worker's direct lane has waited long enough.

        Its age comes from the stream's own timestamp of the message; a lane
        whose request is younger opens again when it would be old enough.
        """
        if claimed.stamp is None:
            return True  # no timestamp: the lane has waited since it was first seen
        age = time.time() - claimed.stamp
        if age >= self.spill_after_s:
            return True
        self._ripe_at[claimed.subject] = time.monotonic() + self.spill_after_s - age
        return False

    # -- the stream ---------------------------------------------------------

    def _age(self) -> float:
        return time.monotonic() - self._read_at

    async def _read_backlog(self) -> None:
        self._stale = False
        now = self._read_at = time.monotonic()
        reconnects = int(self.nc.stats["reconnects"])
        request = orjson.dumps({"subjects_filter": self.lanes})
        try:
            reply = await self.nc.request(
                f"{self._api}.STREAM.INFO.{self.stream}", request, timeout=5
            )
            info = orjson.loads(reply.data)
            if "error" in info:
                raise RuntimeError(f"work queue: {info['error'].get('description', info['error'])}")
        except BaseException:
            self._stale = True  # not read: the counts and held offers are no fresher
            raise
        state = info.get("state", {})
        counts = state.get("subjects") or {}
        self._backlog = {subject: int(n) for subject, n in counts.items()}
        self._ripe_at = {s: at for s, at in self._ripe_at.items() if s in self._backlog}
        for subject in self._backlog:
            self._watch(subject, now, counted=True)
        created = info.get("created")
        created_again = created != self._created
        self._created, self._read_reconnects = created, reconnects
        self._first_seq = int(state.get("first_seq", 0))
        self._last_seq = int(state.get("last_seq", 0))
        self._forget_offers(created_again)

    async def _oldest(self, subject: str) -> tuple[int, Claimed] | None:
        """The oldest request on ``subject`` (a lane, or a wildcard of lanes) and its seq."""
        request = orjson.dumps({"seq": 0, "next_by_subj": subject})
        msg = await self.nc.request(f"{self._api}.DIRECT.GET.{self.stream}", request, timeout=5)
        headers = dict(msg.headers or {})
        if not msg.data and headers.get("Status"):
            if headers.get("Status") == "404":
                return None
            raise RuntimeError(f"work queue: {headers.get('Status')} {headers.get('Description')}")
        seq = int(headers.pop("Nats-Sequence"))
        lane = headers.pop("Nats-Subject", subject)
        stamp = _stamp(headers.pop("Nats-Time-Stamp", None))
        for name in ("Nats-Stream", "Nats-Last-Sequence"):
            headers.pop(name, None)
        parsed = Lane.parse(lane)
        source = self._source(parsed) if parsed is not None else "shared"
        return seq, Claimed(lane, msg.data, headers, source, stamp)

    async def _confirm(self, seq: int, reconnects: int) -> bool:
        """The delete of an offer claimed ahead: True when this worker has the request.

        ``reconnects``: this connection's reconnects when the queue was last
        read. The delete is not sent while the connection is down or after
        another reconnect (:meth:`_connected_since`): the request, if it still
        waits, is found by reading. A delete that fails on the way
        (NATS away) counts as lost: as with a claim by reading, the request may
        have been deleted without this worker hearing so, and it is not run
        on a guess.
        """
        try:
            if self._connected_since(reconnects) and await self._delete(seq):
                return True
        except Exception as exc:
            log.warning("claiming an offer failed: %s: %s", type(exc).__name__, exc)
        self._stale = True  # another worker took it, or the queue changed: read it again
        return False

    def _connected_since(self, reconnects: int) -> bool:
        """Whether the connection is up with no reconnect since it had ``reconnects``.

        Only then is a sequence read before sure to name the same request: a
        restarted server's memory queue counts sequences from 1 again, and a
        delete sent while NATS is away waits in the client's buffer and goes
        to whichever server it reconnects to. A window of one turn of the
        event loop is left: a delete written to the buffer just before the
        connection drops still goes out after the reconnect.
        """
        return bool(self.nc.is_connected) and self.nc.stats["reconnects"] == reconnects

    async def _delete(self, seq: int) -> bool:
        """Delete message ``seq``: True when this worker deleted it (and so has it)."""
        request = orjson.dumps({"seq": seq, "no_erase": True})
        reply = await self.nc.request(
            f"{self._api}.STREAM.MSG.DELETE.{self.stream}", request, timeout=5
        )
        return bool(orjson.loads(reply.data).get("success"))


@dataclass
class _Offer:
    """A request a router offered this worker (see :meth:`WorkClaims.offered`)."""

    lane: str
    data: bytes
    headers: dict[str, str]


def _stamp(value: str | None) -> float | None:
    """Unix time of a stream timestamp (RFC 3339, nanoseconds, UTC); None if unreadable."""
    if not value:
        return None
    try:
        whole, _, rest = value.rstrip("Z").partition(".")
        fraction = float(f"0.{rest}") if rest else 0.0
        return datetime.fromisoformat(whole).replace(tzinfo=UTC).timestamp() + fraction
    except ValueError:
        return None
