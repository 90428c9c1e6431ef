"""The AsyncAPI 3.0 document of the whole bus, built from the one topology.

Every stream, key-value bucket and core subject of :class:`Topology` becomes a
channel, with the JSON schema of its contract as the message payload; every
writer and reader role becomes a send or receive operation, a durable
consumer's name and filter go on its reader's operation, and a request/reply
subject's answer is the operation's reply. Hot-path channels are in it as
much as the control plane's: the document describes the bus, not one client
library's handlers.

Contracts defined above the wire layer (key records, signing keys, audit
events, the scaler's decisions and status) are named by their type id; their
schemas are not part of this document.

The committed copy is ``docs/asyncapi.json``; ``tests/lib/test_asyncapi.py``
fails when it differs from what this module generates. Regenerate it with::

    python -m tollgate.wire.asyncapi > docs/asyncapi.json
"""

from __future__ import annotations

import json
import re
from importlib.metadata import version
from typing import Any

from nats.js.api import RetentionPolicy
from pydantic import BaseModel

from tollgate.wire.subjects import Subjects, model_token
from tollgate.wire.topology import (
    BucketSpec,
    ConsumerSpec,
    Contract,
    Role,
    StreamSpec,
    SubjectSpec,
    Topology,
)

VERSION = "3.0.0"
REGENERATE = "python -m tollgate.wire.asyncapi > docs/asyncapi.json"

# What the wildcard token of a stream's subjects stands for, by the stream's
# subject root (``tg.usage.*``: a tenant).
_WILDCARD = {
    "infer": "model",
    "usage": "tenant",
    "capture": "tenant",
    "replay": "model",
    "scale": "model",
}
_PARAMETER = {
    "tenant": "Tenant id, escaped as a subject token (tollgate.wire.subjects.model_token).",
    "model": "Model token of the canonical model id (tollgate.wire.subjects.model_token).",
    "router": "Id of the router instance that holds the call.",
    "request": "Request id.",
    "worker": "Worker id.",
    "key": "Key in the bucket.",
    "readers": "budget: the call's key has a token budget, so the budget ledger reads the "
    "event as well as metering; plain: metering alone.",
}
_PLACEHOLDER = re.compile(r"<(\w+)>")
_MODEL = "<model>"
_MODEL_TOKEN = model_token(_MODEL)  # what the placeholder becomes in stream subjects


class _Document:
    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self.prefix = topology.subjects.prefix
        self.channels: dict[str, Any] = {}
        self.operations: dict[str, Any] = {}
        self.messages: dict[str, Any] = {}
        self.schemas: dict[str, Any] = {}

    # -- messages --------------------------------------------------------------

    def message(self, contract: Contract) -> str | None:
        """The component message for ``contract`` (added once); its name."""
        if contract is None:
            return None
        if isinstance(contract, str):
            name = contract
            if name not in self.messages:
                self.messages[name] = {
                    "name": name,
                    "title": name,
                    "summary": "Defined above the wire layer; its schema is not in this document.",
                    "contentType": "application/json",
                    "payload": {"type": "object", "properties": {"type": {"const": name}}},
                }
            return name
        name = contract.__name__
        if name not in self.messages:
            self.messages[name] = {
                "name": name,
                "title": _type_id(contract) or name,
                "summary": _first_line(contract.__doc__),
                "contentType": "application/json",
                "payload": {"$ref": f"#/components/schemas/{name}"},
            }
            self.schema(contract)
        return name

    def schema(self, model: type[BaseModel]) -> None:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        for sub, body in schema.pop("$defs", {}).items():
            self.schemas.setdefault(sub, body)
        self.schemas[model.__name__] = schema

    # -- channels and operations ----------------------------------------------

    def channel(
        self, cid: str, address: str | None, what: str, contract: Contract, **extra: Any
    ) -> None:
        message = self.message(contract)
        channel: dict[str, Any] = {"address": address, "description": what}
        if address is not None:
            names = re.findall(r"\{(\w+)\}", address)
            if names:
                channel["parameters"] = {
                    n: {"description": _PARAMETER.get(n, n)} for n in dict.fromkeys(names)
                }
        channel["messages"] = (
            {message: {"$ref": f"#/components/messages/{message}"}} if message else {}
        )
        if extra:
            channel["x-tollgate"] = extra
        self.channels[cid] = channel

    def operation(
        self,
        role: Role,
        action: str,
        cid: str,
        *,
        reply: str | None = None,
        queue: str | None = None,
        consumer: ConsumerSpec | None = None,
        claim: str | None = None,
    ) -> None:
        verb = "sends" if action == "send" else "receives"
        op: dict[str, Any] = {
            "action": action,
            "channel": {"$ref": f"#/channels/{cid}"},
            "summary": f"{role.value} {verb} on {cid}",
        }
        if queue:
            op["bindings"] = {"nats": {"queue": queue}}
        if consumer is not None:
            op["x-tollgate-consumer"] = {
                "stream": consumer.stream,
                "durable": consumer.durable,
                "filter_subject": _address(consumer.filter_subject, cid),
                "ack": "explicit",
                "what": consumer.what,
            }
        if claim is not None:
            op["x-tollgate-claim"] = claim
        if reply is not None:
            op["reply"] = {
                "address": {
                    "location": "$message.header#/reply",
                    "description": "The requester's inbox.",
                },
                "channel": {"$ref": f"#/channels/{reply}"},
            }
        self.operations[f"{role.value}.{verb}.{cid}"] = op

    # -- the topology -----------------------------------------------------------

    def stream(self, spec: StreamSpec, consumers: list[ConsumerSpec]) -> None:
        subject = spec.subjects[0]
        cid = self.channel_id(subject)
        address = _lanes(spec.pattern) if spec.pattern else _address(subject, cid)
        kind = "work-queue stream" if spec.retention is RetentionPolicy.WORK_QUEUE else "stream"
        self.channel(
            cid,
            address,
            spec.what,
            spec.contract,
            kind=kind,
            stream=spec.name,
            storage=spec.storage.value,
            retention=spec.retention.value,
            max_age_s=spec.max_age_s,
            duplicate_window_s=spec.duplicate_window_s,
        )
        for role in sorted(spec.writers):
            self.operation(role, "send", cid)
        for role in sorted(spec.readers):
            mine = [c for c in consumers if c.stream == spec.name and c.reader is role]
            claim = None
            if role in spec.claimers:
                claim = (
                    "no consumer: a lane's oldest message is read (direct get) and deleted; "
                    "whoever deletes it has it"
                )
            self.operation(role, "receive", cid, consumer=mine[0] if mine else None, claim=claim)

    def bucket(self, spec: BucketSpec) -> None:
        name = spec.name.removeprefix(f"{self.prefix}_")
        cid = f"kv.{name}"
        self.channel(
            cid,
            f"$KV.{spec.name}.{{key}}",
            spec.what,
            spec.contract,
            kind="key-value bucket",
            bucket=spec.name,
            storage=spec.storage.value,
            history=spec.history,
            ttl_s=spec.ttl_s,
        )
        for role in sorted(spec.writers):
            self.operation(role, "send", cid)
        for role in sorted(spec.readers):
            self.operation(role, "receive", cid)

    def subject(self, spec: SubjectSpec) -> None:
        cid = self.channel_id(spec.pattern)
        address = _PLACEHOLDER.sub(r"{\1}", spec.pattern)
        kind = "request/reply" if spec.request_reply else "core subject"
        self.channel(cid, address, spec.what, spec.contract, kind=kind)
        reply = None
        if spec.request_reply:
            reply = f"{cid}.reply"
            self.channel(reply, None, f"answers on {cid}", spec.reply, kind="reply inbox")
        # One instance per service answers a request (the metering queue group).
        queue = "metering" if spec.request_reply and Role.METERING in spec.subscribers else None
        for role in sorted(spec.publishers):
            self.operation(role, "send", cid, reply=reply)
        for role in sorted(spec.subscribers):
            self.operation(role, "receive", cid, reply=reply, queue=queue)

    def channel_id(self, subject: str) -> str:
        """The literal tokens after the prefix: ``tg.usage.*`` is ``usage``."""
        literal = [
            t
            for t in subject.split(".")[1:]
            if t not in ("*", ">", _MODEL_TOKEN) and not _PLACEHOLDER.fullmatch(t)
        ]
        return ".".join(literal)

    def build(self) -> dict[str, Any]:
        t = self.topology
        consumers = list(t.consumers)
        for spec in t.streams:
            self.stream(spec, consumers)
        for bucket in t.buckets:
            self.bucket(bucket)
        for subject in t.core:
            self.subject(subject)
        document = {
            "asyncapi": VERSION,
            "info": {
                "title": "Tollgate bus",
                "version": version("tollgate"),
                "description": (
                    f"Every channel on the bus with the default prefix `{self.prefix}`: "
                    "JetStream streams, key-value buckets (as their `$KV` subjects) and "
                    "core subjects, with the roles that send and receive on each. "
                    "Bodies are JSON (orjson), each with a versioned `type` id. "
                    f"Generated from tollgate/wire/topology.py: `{REGENERATE}`."
                ),
            },
            "defaultContentType": "application/json",
            "servers": {
                "nats": {
                    "host": "localhost:4222",
                    "protocol": "nats",
                    "description": "TOLLGATE_NATS_URL; JetStream enabled.",
                }
            },
            "channels": self.channels,
            "operations": self.operations,
            "components": {
                "messages": dict(sorted(self.messages.items())),
                "schemas": dict(sorted(self.schemas.items())),
            },
        }
        # The model placeholder is escaped in stream names and subjects.
        text = json.dumps(document).replace(_MODEL_TOKEN, "{model}")
        loaded: dict[str, Any] = json.loads(text)
        return loaded


def _lanes(pattern: str) -> str:
    """A documented pattern with its parts named: ``tg.infer.<model>`` is ``tg.infer.{model}``."""
    return pattern.replace("<", "{").replace(">", "}")


def _address(subject: str, cid: str) -> str:
    """A subject with its wildcard named: ``tg.usage.*`` is ``tg.usage.{tenant}``."""
    root = cid.split(".")[0]
    return subject.replace("*", "{" + _WILDCARD.get(root, "token") + "}")


def _type_id(model: type[BaseModel]) -> str | None:
    field = model.model_fields.get("type")
    default = field.default if field is not None else None
    return default if isinstance(default, str) else None


def _first_line(doc: str | None) -> str:
    return (doc or "").strip().split("\n\n")[0].replace("\n", " ")


def document(topology: Topology) -> dict[str, Any]:
    """The AsyncAPI 3.0 document of ``topology``."""
    return _Document(topology).build()


def render(topology: Topology) -> str:
    """The document as the JSON text committed in ``docs/asyncapi.json``."""
    return json.dumps(document(topology), indent=2, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    print(render(Topology(Subjects())), end="")
