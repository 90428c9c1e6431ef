"""The AsyncAPI document of the bus: generated from the topology, committed, complete."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tollgate.wire import contracts
from tollgate.wire.asyncapi import REGENERATE, document, render
from tollgate.wire.subjects import Subjects
from tollgate.wire.topology import Topology

DOC = Path(__file__).parents[2] / "docs" / "asyncapi.json"


def test_the_committed_document_is_the_generated_one() -> None:
    assert DOC.read_text() == render(Topology(Subjects())), (
        f"docs/asyncapi.json is out of date with tollgate/wire/topology.py: run `{REGENERATE}`"
    )


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return found + [r for value in node.values() for r in _refs(value)]
    if isinstance(node, list):
        return [r for value in node for r in _refs(value)]
    return []


def _resolve(doc: dict[str, Any], ref: str) -> Any:
    assert ref.startswith("#/"), ref
    node: Any = doc
    for part in ref[2:].split("/"):
        assert isinstance(node, dict) and part in node, f"{ref} does not resolve"
        node = node[part]
    return node


def test_every_reference_resolves_and_every_operation_has_a_channel() -> None:
    doc = document(Topology(Subjects()))
    assert doc["asyncapi"] == "3.0.0"
    for ref in _refs(doc):
        _resolve(doc, ref)
    for name, op in doc["operations"].items():
        assert op["action"] in ("send", "receive"), name
        assert op["channel"]["$ref"].startswith("#/channels/"), name
    for cid, channel in doc["channels"].items():
        for param in channel.get("parameters", {}):
            assert "{" + param + "}" in channel["address"], cid


def test_every_stream_bucket_and_subject_is_a_channel_with_its_contract() -> None:
    topology = Topology(Subjects("acme"))
    doc = document(topology)
    addresses = {c["address"]: c for c in doc["channels"].values() if c["address"]}
    for stream in topology.streams:
        channel = next(
            c
            for c in doc["channels"].values()
            if c.get("x-tollgate", {}).get("stream")
            == stream.name.replace("_3Cmodel_3E", "{model}")
        )
        if stream.contract is not None:
            name = stream.contract if isinstance(stream.contract, str) else stream.contract.__name__
            assert name in channel["messages"]
    for bucket in topology.buckets:
        assert f"$KV.{bucket.name}.{{key}}" in addresses
    for subject in topology.core:
        address = subject.pattern.replace("<", "{").replace(">", "}")
        assert address in addresses, address
    # The hot path is in it, not only the control plane.
    hot_path = (
        "acme.infer.{model}.{class}.{tenant}.{key}",
        "acme.reply.{router}.{request}",
        "acme.cancel.{request}",
    )
    for address in hot_path:
        assert address in addresses


def test_payload_schemas_are_the_contracts_json_schemas() -> None:
    schemas = document(Topology(Subjects()))["components"]["schemas"]
    usage = contracts.UsageEvent.model_json_schema(ref_template="#/components/schemas/{model}")
    defs = usage.pop("$defs")  # hoisted into the components
    assert schemas["UsageEvent"] == usage
    assert all(schemas[name] == schema for name, schema in defs.items())
    chunk = schemas["ResponseChunk"]
    assert chunk["properties"]["kind"]["$ref"] == "#/components/schemas/ChunkKind"
    assert "ChunkKind" in schemas and "Usage" in schemas


def test_a_durable_consumer_is_on_its_readers_operation() -> None:
    doc = document(Topology(Subjects()))
    op = doc["operations"]["auth.receives.usage"]
    assert op["x-tollgate-consumer"]["durable"] == "auth-budget"
    assert op["x-tollgate-consumer"]["filter_subject"] == "tg.usage.{tenant}.budget"
    worker = doc["operations"]["worker.receives.infer"]
    assert "x-tollgate-consumer" not in worker  # workers claim: read, then delete
    assert "delete" in worker["x-tollgate-claim"]
    query = doc["operations"]["metering.receives.metering.query"]
    assert query["bindings"] == {"nats": {"queue": "metering"}}
    assert query["reply"]["channel"]["$ref"] == "#/channels/metering.query.reply"
    assert json.dumps(doc)  # plain JSON all the way down


def test_contracts_named_by_type_id_are_those_contracts() -> None:
    """Key records, signing keys and audit events are above the wire layer: named, not imported."""
    from tollgate.keys.records import AuditEvent, KeyRecord, SigningKey

    topology = Topology(Subjects())
    named = {
        topology.keys.contract: KeyRecord,
        topology.signing_keys.contract: SigningKey,
        topology.audit.contract: AuditEvent,
    }
    for type_id, model in named.items():
        assert type_id == model.model_fields["type"].default, model.__name__
