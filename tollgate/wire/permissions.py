"""What each identity may publish and subscribe to, derived from the topology.

Every service connects to NATS as its role (:class:`~tollgate.wire.topology.Role`)
and the server allows it exactly the subjects below, nothing else. They are
computed from the same table that creates the streams
(:class:`~tollgate.wire.topology.Topology`), so adding a stream, a consumer or a
subject there changes who may touch it here.

The rules, per entry of the topology:

- a stream's **writers** publish to its subjects; its creators (writers and
  readers unless the topology names them) may create it with the declared
  shape (``ensure``); everyone who uses it reads its info; only writers may
  update it;
- a stream's **readers** fetch from and acknowledge their durable consumers,
  by consumer name; each consumer's creator (its reader unless named) creates
  it. Creating a consumer means choosing its configuration, a push
  consumer's deliver subject included (the server then publishes the
  stream's messages there), so workers, which run model code, create none;
- a stream's **claimers** (the work queue's workers) read its messages one
  at a time (direct get) and delete the one they take; its **withdrawers**
  (the routers) may delete a message, a request whose client left;
- a stream's **listeners** subscribe to its subjects as they are published,
  and its **observers** read its info (message counts per subject) only;
- a key-value bucket's readers get, watch and list it; its writers also put;
- a core subject's publishers publish and its subscribers subscribe; the
  responders of a request/reply subject may answer only into the inboxes of
  the roles that may ask.

Each role's replies come to its own inbox prefix (:func:`inbox_prefix`), and
only that role may subscribe there, so no identity reads another's replies
(key records, pub acks, query results). Deleting or purging streams and
consumers, and everything else, is the operator's (``admin``) alone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tollgate.wire.topology import BucketSpec, ConsumerSpec, Role, StreamSpec, Topology

API = "$JS.API"
_PLACEHOLDER = re.compile(r"<[a-z_]+>")


@dataclass(frozen=True)
class Grant:
    """The subjects one identity may publish to and subscribe to (NATS wildcards)."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]

    def allows(self, action: str, subject: str) -> bool:
        """Whether NATS would let this identity ``publish`` or ``subscribe`` to ``subject``."""
        patterns = self.publish if action == "publish" else self.subscribe
        return any(subject_matches(pattern, subject) for pattern in patterns)


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS wildcard matching: ``*`` is one token, a final ``>`` one or more."""
    want, got = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(got) > i
        if i >= len(got) or (token != "*" and token != got[i]):
            return False
    return len(want) == len(got)


def inbox_prefix(topology: Topology, role: Role) -> str:
    """Where replies to this role's requests arrive (``_INBOX.tg.router``)."""
    return f"_INBOX.{topology.subjects.prefix}.{role.value}"


def _wild(pattern: str) -> str:
    """A topology pattern (``tg.reply.<router>.<request>``) as a NATS wildcard."""
    return _PLACEHOLDER.sub("*", pattern)


class _Rules:
    def __init__(self) -> None:
        self.publish: list[str] = []
        self.subscribe: list[str] = []

    def pub(self, *subjects: str) -> None:
        self.publish.extend(s for s in subjects if s not in self.publish)

    def sub(self, *subjects: str) -> None:
        self.subscribe.extend(s for s in subjects if s not in self.subscribe)

    def stream(self, spec: StreamSpec, role: Role) -> None:
        if role in spec.writers | spec.readers | spec.observers:
            self.pub(f"{API}.STREAM.INFO.{spec.name}")
        if role in spec.may_create:
            self.pub(f"{API}.STREAM.CREATE.{spec.name}")
        if role in spec.writers:
            self.pub(f"{API}.STREAM.UPDATE.{spec.name}", *spec.subjects)
        if role in spec.listeners:
            self.sub(*spec.subjects)
        if role in spec.claimers:
            self.pub(f"{API}.DIRECT.GET.{spec.name}")
        if role in spec.claimers | spec.withdrawers:
            self.pub(f"{API}.STREAM.MSG.DELETE.{spec.name}")

    def consumer(self, spec: ConsumerSpec, durable: str, role: Role) -> None:
        stream = spec.stream
        if role in (spec.reader, spec.created_by):
            self.pub(f"{API}.CONSUMER.INFO.{stream}.{durable}")
        if role is spec.created_by:
            self.pub(
                f"{API}.CONSUMER.CREATE.{stream}.{durable}",
                f"{API}.CONSUMER.CREATE.{stream}.{durable}.>",
                f"{API}.CONSUMER.DURABLE.CREATE.{stream}.{durable}",
            )
        if role is spec.reader:
            self.pub(
                f"{API}.CONSUMER.MSG.NEXT.{stream}.{durable}",
                f"$JS.ACK.{stream}.{durable}.>",
            )

    def bucket(self, spec: BucketSpec, role: Role) -> None:
        if role not in spec.readers | spec.writers:
            return
        stream = f"KV_{spec.name}"
        self.pub(
            f"{API}.STREAM.INFO.{stream}",
            f"{API}.STREAM.CREATE.{stream}",
            f"{API}.DIRECT.GET.{stream}",
            f"{API}.DIRECT.GET.{stream}.>",
            f"{API}.STREAM.MSG.GET.{stream}",
            # watching (and listing keys) runs an ordered consumer of its own
            f"{API}.CONSUMER.CREATE.{stream}",
            f"{API}.CONSUMER.CREATE.{stream}.>",
            f"{API}.CONSUMER.INFO.{stream}.*",
            f"{API}.CONSUMER.DELETE.{stream}.*",
            f"$JS.FC.{stream}.>",
        )
        if role in spec.writers:
            self.pub(f"$KV.{spec.name}.>")


def grant(topology: Topology, role: Role) -> Grant:
    """Everything ``role`` may publish and subscribe to on this prefix's bus."""
    if role is Role.ADMIN:
        return Grant(publish=(">",), subscribe=(">",))
    rules = _Rules()
    rules.sub(f"{inbox_prefix(topology, role)}.>")
    for stream in topology.streams:
        rules.stream(stream, role)
    for consumer in topology.consumers:
        rules.consumer(consumer, consumer.durable, role)
    for bucket in topology.buckets:
        rules.bucket(bucket, role)
    for subject in topology.core:
        pattern = _wild(subject.pattern)
        if role in subject.publishers:
            rules.pub(pattern)
        if role in subject.subscribers:
            rules.sub(pattern)
            if subject.request_reply:
                asking = sorted(subject.publishers, key=lambda r: r.value)
                rules.pub(*(f"{inbox_prefix(topology, r)}.>" for r in asking))
    return Grant(publish=tuple(rules.publish), subscribe=tuple(rules.subscribe))


def grants(topology: Topology) -> dict[Role, Grant]:
    """Every role's grant on this prefix's bus."""
    return {role: grant(topology, role) for role in Role}


def describe(topology: Topology) -> str:
    """The permission table as Markdown (kept in ``docs/deploy.md``)."""
    rows = ["| role | may publish to | may subscribe to |", "|---|---|---|"]
    for role, g in grants(topology).items():
        pub = "<br>".join(f"`{s}`" for s in g.publish)
        sub = "<br>".join(f"`{s}`" for s in g.subscribe)
        rows.append(f"| {role.value} | {pub} | {sub} |")
    return "\n".join(rows) + "\n"
