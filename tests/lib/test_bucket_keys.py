"""Listing a bucket's keys: every record written is listed at once, by any connection.

On a real nats-server, as the CLI lists keys: a new connection each time,
right after another one wrote.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson

from tests.conftest import NatsServer
from tollgate.keys.store import KeyStore
from tollgate.keys.tokens import SigningKeySet
from tollgate.keys.webhooks import WebhookStore
from tollgate.wire.subjects import Subjects
from tollgate.wire.topology import Topology, bucket_keys


async def test_a_key_just_created_is_listed_by_the_next_connection(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    signing = SigningKeySet(tmp_path / "signing-keys.json")
    signing.generate("EdDSA")
    topology = Topology(Subjects(f"list-{uuid.uuid4().hex[:10]}"))
    writer = await nats_server.connect(name="test-writer")
    try:
        store = await KeyStore(writer.jetstream(), topology, actor="test").open()
        created: list[str] = []
        for _ in range(30):
            _, record = await store.create(signing, tenant="acme")
            created.append(record.key_id)
            reader = await nats_server.connect(name="test-lister")
            try:
                listed = await KeyStore(reader.jetstream(), topology, actor="test").open()
                assert sorted(r.key_id for r in await listed.all()) == sorted(created)
            finally:
                await reader.close()
    finally:
        await writer.close()


async def test_a_deleted_record_is_not_listed_and_an_empty_bucket_lists_none(
    nats_server: NatsServer,
) -> None:
    topology = Topology(Subjects(f"list-{uuid.uuid4().hex[:10]}"))
    nc = await nats_server.connect(name="test-webhooks")
    try:
        hooks = await WebhookStore(nc.jetstream(), topology).open()
        assert await hooks.all() == []
        made = [await hooks.create(f"https://example.com/{i}") for i in range(3)]
        await hooks.delete(made[1].webhook_id)
        assert [h.webhook_id for h in await hooks.all()] == [made[0].webhook_id, made[2].webhook_id]
        # the deleted one's marker is still in the stream: listed, then told apart by a get
        names = await bucket_keys(nc.jetstream(), topology.webhooks.name)
        assert sorted(names) == sorted(h.webhook_id for h in made)
    finally:
        await nc.close()


async def test_keys_are_read_page_by_page() -> None:
    """The server sends the counts per subject in pages; every page is read."""
    pages = [{"a": 1, "b": 1}, {"c": 1}]
    asked: list[int] = []

    async def request(subject: str, data: bytes, timeout: float) -> Any:
        assert subject == "$JS.API.STREAM.INFO.KV_things"
        offset = orjson.loads(data)["offset"]
        asked.append(offset)
        page = pages[len(asked) - 1]
        info = {
            "total": 3,
            "offset": offset,
            "state": {"subjects": {f"$KV.things.{k}": n for k, n in page.items()}},
        }
        return SimpleNamespace(data=orjson.dumps(info))

    js = SimpleNamespace(_nc=SimpleNamespace(request=request), _prefix="$JS.API")
    assert await bucket_keys(js, "things") == ["a", "b", "c"]  # type: ignore[arg-type]
    assert asked == [0, 2]
