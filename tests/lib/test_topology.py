"""The bus topology: complete, documented, idempotent to create."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
from nats.js.api import StreamConfig
from nats.js.errors import BadRequestError, NotFoundError

from tests.conftest import NatsServer
from tollgate.wire.subjects import Subjects
from tollgate.wire.topology import Role, Topology, describe

DOC = Path(__file__).parents[2] / "docs" / "architecture.md"
MARKED = re.compile(r"<!-- topology:begin -->\n(.*?)<!-- topology:end -->", re.S)


def test_the_documented_table_is_the_topology() -> None:
    found = MARKED.search(DOC.read_text())
    assert found is not None, "docs/architecture.md lost its topology markers"
    assert found.group(1) == describe(Topology(Subjects())), (
        "docs/architecture.md is out of date: put the output of "
        "`python -m tollgate.wire.topology` between its topology markers"
    )


def test_every_name_carries_the_prefix() -> None:
    topology = Topology(Subjects("acme"))
    for stream in topology.streams:
        assert stream.name.startswith("ACME_")
        assert all(s.startswith("acme.") for s in stream.subjects)
    for bucket in topology.buckets:
        assert bucket.name.startswith("acme_")
    for consumer in topology.consumers:
        assert consumer.filter_subject.startswith("acme.")
    for subject in topology.core:
        assert subject.pattern.startswith("acme.")


def test_every_entry_has_a_writer_and_a_reader() -> None:
    topology = Topology(Subjects())
    for entry in (*topology.streams, *topology.buckets):
        assert entry.writers and entry.readers, entry.name
    streams = {s.name: s for s in topology.streams}
    for subject in topology.core:
        assert subject.subscribers, subject.pattern
        if subject.republished_by is None:
            assert subject.publishers, subject.pattern
        else:  # a stream sends here, and no service may
            assert not subject.publishers, subject.pattern
            assert streams[subject.republished_by].republish is not None, subject.pattern
    for consumer in topology.consumers:
        assert consumer.reader in streams[consumer.stream].readers, consumer.durable
    for stream in topology.streams:  # who claims or withdraws messages reads or writes them
        assert stream.claimers <= stream.readers, stream.name
        assert stream.withdrawers <= stream.writers, stream.name


async def _exists(js: Any, name: str) -> bool:
    try:
        await js.stream_info(name)
    except NotFoundError:
        return False
    return True


async def test_ensure_is_idempotent_and_per_role(nats_server: NatsServer) -> None:
    topology = Topology(Subjects("topo"))
    nc = await nats_server.connect(name="test-topology")
    js = nc.jetstream()
    try:
        await topology.ensure(js, Role.SCALER)
        # asked by name: a shared server can hold more streams than one listing page
        assert await _exists(js, "TOPO_SCALE") and not await _exists(js, "TOPO_USAGE")
        await topology.ensure(js)
        await topology.ensure(js)  # again: no error, same shape
        expected = {s.name for s in topology.streams}
        expected |= {f"KV_{b.name}" for b in topology.buckets}
        for name in expected:
            assert await _exists(js, name), name
        info = await js.stream_info(topology.usage.name)
        assert info.config.duplicate_window == topology.usage.duplicate_window_s
    finally:
        await nc.close()


async def test_ensure_reshapes_a_stream_but_raises_on_an_overlapping_one(
    nats_server: NatsServer,
) -> None:
    topology = Topology(Subjects("reshape"))
    nc = await nats_server.connect(name="test-topology-reshape")
    js = nc.jetstream()
    try:
        spec = topology.work
        await js.add_stream(dataclasses.replace(spec.config(1), max_age=3600))
        # a reader leaves the other shape alone: only writers may update it
        await topology.ensure_stream(js, spec, Role.WORKER)
        assert (await js.stream_info(spec.name)).config.max_age == 3600
        await topology.ensure_stream(js, spec, Role.ROUTER)  # its writer updates it
        info = await js.stream_info(spec.name)
        assert info.config.max_age == spec.max_age_s
        # Another stream holds the subjects: the server's reason, not an update's.
        taken = topology.capture
        await js.add_stream(StreamConfig(name="RESHAPE_SQUATTER", subjects=list(taken.subjects)))
        with pytest.raises(BadRequestError) as refused:
            await topology.ensure_stream(js, taken)
        assert refused.value.err_code == 10065  # JSStreamSubjectOverlapErr
    finally:
        await nc.close()
