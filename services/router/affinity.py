"""Cache-aware routing: the worker a request should go to first.

An engine's prefix cache is the biggest lever on time to first token: a
request whose prompt opens as an earlier one did skips most of its prefill on
the worker that served the earlier one. So the router sends requests that
open alike to the same worker:

1. **The key** (:func:`affinity_key`): the request's ``X-Tollgate-Session``
   header when given, else its body's ``user`` field, else the opening of its
   prompt: a chat's messages up to and including the first user message (the
   system prompt and the first question, which every later turn of the
   conversation repeats), or a completion's prompt, cut at
   ``TOLLGATE_ROUTER_AFFINITY_PREFIX_CHARS`` characters. A long system prompt
   shared by many conversations is the key by itself, so they all meet the
   one worker that holds it.
2. **The worker** (:meth:`Affinity.choose`): rendezvous hashing of the key
   over the model's ready workers, known from their heartbeats. Each worker
   scores ``hash(key, worker id)`` and the highest wins, so a key keeps its
   worker while the set of workers changes elsewhere, and a new worker takes
   over an even share of keys.
3. **Bounded load**: the chosen worker gets the request only while its
   requests (running as last heard, and those this router sent it that have
   not started) stay below its slots times ``TOLLGATE_ROUTER_AFFINITY_LOAD``;
   otherwise the request goes to the model's shared queue, where any worker
   with a free slot takes it. A prefix is worth less than a free slot.

A direct request waits in that worker's direct lane of the work queue
(:meth:`~tollgate.wire.subjects.Subjects.infer_lane`), under the same fair
share as the shared lanes. If the worker does not take it within
``TOLLGATE_WORKER_SPILL_AFTER_S`` (busy, draining, or gone), every worker of
the model may take it (:mod:`services.worker.claims`): affinity is a
preference, never a wait for one worker.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import Any

from services.router.endpoints import SPECS
from tollgate.runtime.workers import WorkerView
from tollgate.wire.contracts import Endpoint, WorkerState

SESSION_HEADER = "X-Tollgate-Session"
# The most of a session header or user field that counts (the rest is ignored).
_MAX_ID_CHARS = 256


class Decision:
    """Why a request went where it went (the ``decision`` label of the router's counter)."""

    DIRECT = "direct"  # to the key's worker
    FULL = "shared_full"  # the key's worker had no room
    NO_WORKER = "shared_no_worker"  # no ready worker (a cold start): the shared queue
    NO_KEY = "shared_no_key"  # nothing in the request to route by
    OFF = "shared_off"  # cache-aware routing is off


def affinity_key(
    endpoint: Endpoint, body: Mapping[str, Any], session: str | None, prefix_chars: int
) -> bytes | None:
    """What picks a request's worker (see the module's docs); None when nothing does."""
    if session:
        return b"s\0" + session[:_MAX_ID_CHARS].encode("utf-8", "replace")
    user = body.get("user")
    if isinstance(user, str) and user:
        return b"u\0" + user[:_MAX_ID_CHARS].encode("utf-8", "replace")
    opening = SPECS[endpoint].opening(body, prefix_chars)
    return b"p\0" + opening.encode("utf-8", "replace") if opening else None


def _score(key: bytes, worker_id: str) -> bytes:
    return hashlib.blake2b(key + b"\0" + worker_id.encode(), digest_size=8).digest()


class Affinity:
    """Chooses a request's worker by its key, with bounded load (see the module's docs)."""

    def __init__(
        self,
        workers: WorkerView,
        *,
        enabled: bool = True,
        load: float = 1.0,
        busy: Callable[[str, int], int] = lambda worker_id, slots_used: slots_used,
    ) -> None:
        self.workers = workers
        self.enabled = enabled
        self.load = load
        # a worker's requests from its latest slots_used and what this router
        # knows since (:meth:`~services.router.dispatch.Dispatcher.busy`)
        self.busy = busy

    def choose(self, model: str, key: bytes | None) -> tuple[str | None, str]:
        """The worker to send to (None: the shared queue), and why."""
        if not self.enabled:
            return None, Decision.OFF
        if key is None:
            return None, Decision.NO_KEY
        ready = [
            beat
            for beat in self.workers.live(model)
            if beat.state is WorkerState.READY and beat.slots_total > 0
        ]
        if not ready:
            return None, Decision.NO_WORKER
        best = max(ready, key=lambda beat: _score(key, beat.worker_id))
        if self.busy(best.worker_id, best.slots_used) >= best.slots_total * self.load:
            return None, Decision.FULL
        return best.worker_id, Decision.DIRECT
