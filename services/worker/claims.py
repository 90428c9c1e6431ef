"""How a worker takes requests from its model's lanes in the work queue.

The work queue (one JetStream stream, work-queue retention, no consumers)
holds each request under its lane's subject. A worker with a free slot:

1. knows how many requests wait in each lane of its model: the stream's
   per-subject counts, read at least every second and after a lost race,
   plus one for each arrival a router announces in a lane since (so a worker
   that keeps up takes each request without reading the counts again);
2. picks a lane by fair share (:class:`~services.worker.fairshare.FairShare`),
   or, with fair share off, takes the model's oldest request whatever its
   lane (first come, first served);
3. reads that lane's oldest request (a direct get) and deletes it. The
   delete is the claim: of several workers that read the same request, the
   one whose delete succeeds runs it; the others read the next one.

A request stays in the stream until a worker claims it, so it survives a
cold start (no worker yet) and is never lost with a worker that dies before
claiming it. A router withdraws a request whose client left by deleting it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import orjson
from nats.aio.client import Client as NATS

from services.worker.fairshare import FairShare
from tollgate.wire.subjects import Subjects

log = logging.getLogger("tollgate.worker.claims")

# How old the lanes' counts may get before they are read again, when no
# arrival has been announced (arrivals mark them stale at once).
REFRESH_EVERY_S = 1.0
# How many reads a claim may take before it gives up for now (each lost race
# or empty lane costs one).
_TRIES = 32


@dataclass(frozen=True)
class Claimed:
    """A request this worker took: its lane, body and headers (trace context)."""

    subject: str
    data: bytes
    headers: dict[str, str]


class WorkClaims:
    """Claims one model's requests from the work queue (see the module's docs)."""

    def __init__(self, nc: NATS, subjects: Subjects, model_id: str, *, fair: bool = True) -> None:
        self.nc = nc
        self.fair = fair
        self.share = FairShare()
        self.stream = subjects.infer_stream
        self.lanes = subjects.infer_lanes(model_id)
        self._api = "$JS.API"
        self._backlog: dict[str, int] = {}
        self._read_at = 0.0
        self._stale = True
        self._prefix = self.lanes[:-1]  # "tg.infer.<model>."
        # True when the last take gave up after losing every race to other
        # workers: requests still wait
        self.contended = False

    def arrived(self, lane: str | None = None) -> None:
        """A router announced a request for this model, in ``lane`` when it says."""
        if lane is not None and lane.startswith(self._prefix):
            self._backlog[lane] = self._backlog.get(lane, 0) + 1
        else:
            self._stale = True

    async def take(self) -> Claimed | None:
        """The next request for this worker; None when the model's lanes are empty."""
        self.contended = False
        for _ in range(_TRIES):
            if self.fair:
                if self._stale or self._age() > REFRESH_EVERY_S:
                    await self._read_backlog()
                subject = self.share.pick(self._backlog)
                if subject is None:
                    return None
            else:
                subject = self.lanes
            got = await self._oldest(subject)
            if got is None:
                if not self.fair:
                    return None
                self._backlog.pop(subject, None)  # emptied by others since the counts
                continue
            seq, claimed = got
            if not await self._delete(seq):
                self._stale = True  # other workers are taking from these lanes
                continue  # another worker had it first
            if self.fair:
                left = self._backlog.get(claimed.subject, 1) - 1
                if left > 0:
                    self._backlog[claimed.subject] = left
                else:
                    self._backlog.pop(claimed.subject, None)
                self.share.took(claimed.subject)
            return claimed
        self.contended = True
        return None

    def _age(self) -> float:
        return time.monotonic() - self._read_at

    async def _read_backlog(self) -> None:
        self._stale = False
        self._read_at = time.monotonic()
        request = orjson.dumps({"subjects_filter": self.lanes})
        reply = await self.nc.request(f"{self._api}.STREAM.INFO.{self.stream}", request, timeout=5)
        info = orjson.loads(reply.data)
        if "error" in info:
            raise RuntimeError(f"work queue: {info['error'].get('description', info['error'])}")
        counts = info.get("state", {}).get("subjects") or {}
        self._backlog = {subject: int(n) for subject, n in counts.items()}

    async def _oldest(self, subject: str) -> tuple[int, Claimed] | None:
        """The oldest request on ``subject`` (a lane, or every lane of the model) and its seq."""
        request = orjson.dumps({"seq": 0, "next_by_subj": subject})
        msg = await self.nc.request(f"{self._api}.DIRECT.GET.{self.stream}", request, timeout=5)
        headers = dict(msg.headers or {})
        if not msg.data and headers.get("Status"):
            if headers.get("Status") == "404":
                return None
            raise RuntimeError(f"work queue: {headers.get('Status')} {headers.get('Description')}")
        seq = int(headers.pop("Nats-Sequence"))
        lane = headers.pop("Nats-Subject", subject)
        for name in ("Nats-Stream", "Nats-Time-Stamp", "Nats-Last-Sequence"):
            headers.pop(name, None)
        return seq, Claimed(lane, msg.data, headers)

    async def _delete(self, seq: int) -> bool:
        """Delete message ``seq``: True when this worker deleted it (and so has it)."""
        request = orjson.dumps({"seq": seq, "no_erase": True})
        reply = await self.nc.request(
            f"{self._api}.STREAM.MSG.DELETE.{self.stream}", request, timeout=5
        )
        return bool(orjson.loads(reply.data).get("success"))
