"""Which lane a worker takes its next request from: weighted fair share.

A model's work queue has one lane per class, tenant and key
(:meth:`~tollgate.wire.subjects.Subjects.infer_lane`). When the worker has a
free slot it looks at the lanes that hold requests and picks one:

1. **Class first.** Interactive lanes before batch lanes: batch work only
   takes slots that no interactive request is waiting for.
2. **Tenant by weight.** Among the tenants waiting in that class, the one
   with the smallest virtual time. Each slot granted to tenant ``t`` moves its
   virtual time on by ``1 / weight(t)``, so under saturation the slots split
   in proportion to the weights, whatever each tenant's backlog.
3. **Key by weight** within the tenant, the same way.

Virtual times follow start-time fair queuing: the class (or tenant) keeps a
clock at the start tag of the last grant, and a lane that comes back after
being idle starts at that clock, not at the time it left, so it gets its
share from now on but no burst for the time it was away.

The weights come with the requests (the key's and its tenant's settings);
a worker learns a lane's weights from the requests it takes from it, and a
lane it has not taken from yet counts with weight 1.

Each worker decides alone: with several workers the shares hold per worker,
and so in sum.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from tollgate.wire.contracts import Priority
from tollgate.wire.subjects import Lane

# Classes in the order they are served.
CLASSES = (Priority.INTERACTIVE.value, Priority.BATCH.value)

# How many lanes' virtual times a worker keeps; beyond it, idle ones are forgotten.
_KEPT = 10_000


@dataclass
class _Clock:
    """Virtual times of the members of one group (the tenants of a class, the keys of a tenant)."""

    now: float = 0.0
    finish: dict[str, float] = field(default_factory=dict)
    # the number of each member's latest grant: equal finish tags do not tell
    # who was served longer ago (one back from idle starts at the others' finish)
    last: dict[str, int] = field(default_factory=dict)
    grants: int = 0

    def start(self, member: str) -> float:
        """The start tag ``member`` would get if served next."""
        return max(self.finish.get(member, 0.0), self.now)

    def grant(self, member: str, weight: float) -> None:
        start = self.start(member)
        self.now = start
        self.finish[member] = start + 1.0 / weight
        self.grants += 1
        self.last[member] = self.grants

    def pick(self, members: list[str]) -> str:
        # ties go to the member served longest ago, then by name
        return min(members, key=lambda m: (self.start(m), self.last.get(m, 0), m))

    def forget(self, keep: set[str]) -> None:
        if len(self.finish) > _KEPT:
            self.finish = {m: f for m, f in self.finish.items() if m in keep}
            self.last = {m: n for m, n in self.last.items() if m in keep}


class FairShare:
    """Weighted fair share over a model's lanes (see the module's docs)."""

    def __init__(self) -> None:
        self._tenants: dict[str, _Clock] = {}  # by class
        self._keys: dict[tuple[str, str], _Clock] = {}  # by class and tenant
        self._tenant_weight: dict[tuple[str, str], float] = {}
        self._key_weight: dict[str, float] = {}  # by lane subject

    def learn(self, subject: str, tenant_weight: float, key_weight: float) -> None:
        """The weights that came with a request from lane ``subject``."""
        lane = Lane.parse(subject)
        if lane is None:
            return
        self._tenant_weight[(lane.priority, lane.tenant)] = tenant_weight
        self._key_weight[lane.group] = key_weight

    def pick(self, backlog: Mapping[str, int]) -> str | None:
        """The lane to take from next, among those with requests waiting (None: all empty).

        ``backlog`` counts requests by shared lane (a worker's direct lanes
        count under theirs: :attr:`~tollgate.wire.subjects.Lane.group`).
        """
        if len(backlog) == 1:  # one lane: nothing to share (the common case)
            subject, count = next(iter(backlog.items()))
            return subject if count > 0 and Lane.parse(subject) is not None else None
        waiting: dict[str, dict[str, list[Lane]]] = {}
        for subject, count in backlog.items():
            lane = Lane.parse(subject) if count > 0 else None
            if lane is not None:
                waiting.setdefault(lane.priority, {}).setdefault(lane.tenant, []).append(lane)
        for cls in (*CLASSES, *sorted(set(waiting) - set(CLASSES))):
            tenants = waiting.get(cls)
            if not tenants:
                continue
            tenant = self._tenants.setdefault(cls, _Clock()).pick(sorted(tenants))
            keys = {lane.key: lane for lane in tenants[tenant]}
            key = self._keys.setdefault((cls, tenant), _Clock()).pick(sorted(keys))
            return keys[key].subject
        return None

    def took(self, subject: str) -> None:
        """A request from lane ``subject`` (shared or direct) got a slot: move its clocks."""
        lane = Lane.parse(subject)
        if lane is None:
            return
        cls, tenant = lane.priority, lane.tenant
        tenants = self._tenants.setdefault(cls, _Clock())
        tenants.grant(tenant, self._tenant_weight.get((cls, tenant), 1.0))
        keys = self._keys.setdefault((cls, tenant), _Clock())
        keys.grant(lane.key, self._key_weight.get(lane.group, 1.0))
        if len(self._key_weight) > _KEPT:
            self._key_weight = {lane.group: self._key_weight.get(lane.group, 1.0)}
            self._tenant_weight = {(cls, tenant): self._tenant_weight.get((cls, tenant), 1.0)}
            tenants.forget({tenant})
            self._keys = {(cls, tenant): keys}
