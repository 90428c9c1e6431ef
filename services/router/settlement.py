"""Each call's budget settled once, through NATS outages and router restarts.

A call of a key with limits holds a reservation (:mod:`services.router.limits`):
a unit in flight, tokens of the minute's window, and tokens and money of its
budgets at the call's worst case. Once the call's count is known,
:meth:`Limiter.plan <services.router.limits.Limiter.plan>` turns the
reservation into counter writes, and :class:`Settler` makes them.

- The budgets' writes (``tg_budgets``, file storage, counted for a day, a
  month or for good) are journaled in the outbox in the same transaction as
  the call's usage event. One that fails (NATS is restarting) is made again
  every ``retry_every_s`` until it is made, and what a stopping or killed
  router leaves unmade, its next run makes: a budget does not keep a call's
  worst case counted because the bus or the router went away at the wrong
  moment.
- The rate limits' writes (``tg_ratelimits``: the unit in flight, the
  minute's tokens) are made once, as before: that bucket is kept in memory
  and a NATS restart empties it, so a give-back made again after a restart
  would free units other calls have taken since. A unit whose give-back
  failed is freed when its counter expires (:mod:`services.router.limits`).
- Each write carries ``<request id>.<counter>`` as its ``Nats-Msg-Id``, so a
  write that failed but landed anyway (its acknowledgement lost; nats.py also
  sends what it buffered once it reconnects) is dropped as a copy when it is
  made again. nats-server remembers the ids for the bucket's duplicate window
  (two minutes), and after its own restart only those of writes still stored
  (a budget counter keeps its last write). A write made again past that, one
  that had landed, is counted twice: after a NATS outage longer than two
  minutes, or a NATS restart after another write to the same counter, or a
  router killed or stopped after a write landed and before its entry was
  removed, whose next run starts more than two minutes later. The budget
  ledger in the auth service counts spend from the usage events, not from
  these counters, and marks a key over budget whatever they say.
"""

from __future__ import annotations

import asyncio
import logging

from services.router.limits import Change, Limiter, Reservation, journaled
from services.router.usage import UsagePublisher

log = logging.getLogger("tollgate.router.settlement")


class Settler:
    """Makes the counter writes that settle calls; retries the budgets' until they are made."""

    def __init__(
        self,
        limiter: Limiter,
        usage: UsagePublisher | None = None,
        retry_every_s: float = 1.0,
    ) -> None:
        self.limiter = limiter
        self.usage = usage
        self.retry_every_s = retry_every_s
        # request id -> the budgets' writes still to make, oldest first
        self.unmade: dict[str, list[Change]] = {}
        if usage is not None:
            self.unmade.update(usage.outbox.settlements())
        self._retrier: asyncio.Task[None] | None = None
        self._sleeping = False
        self._stopping = False

    def start(self) -> None:
        """Make what an earlier run of this router left unmade."""
        if self.unmade:
            log.warning(
                "an earlier run of this router left %d settlement(s) unmade; making them",
                len(self.unmade),
            )
            self._retry_soon()

    def plan(
        self, held: Reservation, tokens: int, prompt_tokens: int | None = None
    ) -> list[Change]:
        """The writes that replace ``held`` by the call's count (none if that fails).

        Journal :func:`journaled` of them with the call's event, then :meth:`settle`.
        """
        try:
            return self.limiter.plan(held, tokens, prompt_tokens)
        except Exception:  # the call's usage event must still be written
            log.exception("a reservation could not be settled")
            return []

    async def settle(self, request_id: str, changes: list[Change]) -> None:
        """Make the call's writes now; the budgets' that fail are made later (never raises)."""
        if not changes:
            return
        failed = journaled(await self.limiter.apply(changes, request_id))
        if failed:
            log.warning(
                "settling a budget deferred: %d counter write(s) failed; retrying",
                len(failed),
                extra={"request_id": request_id},
            )
            self.unmade[request_id] = failed
            self._retry_soon()
        elif journaled(changes):
            self._made(request_id)

    def _made(self, request_id: str) -> None:
        if self.usage is not None:
            self.usage.settled(request_id)

    def _retry_soon(self) -> None:
        if not self._stopping and (self._retrier is None or self._retrier.done()):
            self._retrier = asyncio.create_task(self._retry(), name="settlements")

    async def _retry(self) -> None:
        while self.unmade and not self._stopping:
            self._sleeping = True
            try:
                await asyncio.sleep(self.retry_every_s)
            except asyncio.CancelledError:  # stop: cancelled only while it sleeps
                return
            finally:
                self._sleeping = False
            await self._round()

    async def _round(self) -> None:
        """Try each unmade settlement, oldest first, until one fails (the bus is away).

        One that fails goes to the back, so a settlement that cannot be made
        does not hold back the others.
        """
        for request_id, changes in list(self.unmade.items()):
            failed = await self.limiter.apply(changes, request_id)
            del self.unmade[request_id]
            if failed:
                self.unmade[request_id] = failed
                return
            self._made(request_id)
            log.info("settlement made", extra={"request_id": request_id})

    async def stop(self) -> None:
        """Make one last round; what is still unmade stays in the outbox.

        Nothing is cut short: a write cut off after it left would stay
        journaled although it landed. A round ends at its first failure, and
        each write waits for its answer at most JetStream's timeout.
        """
        self._stopping = True
        if self._retrier is not None and not self._retrier.done():
            if self._sleeping:
                self._retrier.cancel()
            await asyncio.gather(self._retrier, return_exceptions=True)
        if self.unmade:
            await self._round()
        if self.unmade:
            log.warning(
                "%d settlement(s) left unmade in the outbox for the next run", len(self.unmade)
            )
