"""Two stacks with different subject prefixes share one nats-server and stay apart.

Each has its own router, key whitelist and (for the first) a simulated worker.
Neither sees the other's keys, work, usage events or audit trail: every
stream, bucket and subject comes from the one topology, under the prefix.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import httpx
import orjson
import pytest
from nats.js.errors import NotFoundError

from tests.conftest import CATALOG, SIM_MODEL, NatsServer, Stack, wait_ready
from tests.lib.streams import read_subject
from tollgate.keys.store import bootstrap
from tollgate.wire.subjects import Subjects
from tollgate.wire.topology import Role, Topology

BODY = {"model": SIM_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


async def _bootstrap(stack: Stack, prefix: str) -> str:
    nc = await stack.nats.connect(name=f"test-{prefix}")
    try:
        return await bootstrap(nc.jetstream(), Topology(Subjects(prefix)), stack.var_dir)
    finally:
        await nc.close()


def _stack(nats: NatsServer, root: Path, prefix: str, models: Path) -> Stack:
    var = root / prefix
    var.mkdir()
    (var / "models.toml").write_text(CATALOG)
    stack = Stack(nats, var)
    original = stack.env

    def env(role: Role = Role.ADMIN, **extra: str) -> dict[str, str]:
        # each stack's services on their own prefix's identities
        return original(
            role, TOLLGATE_SUBJECT_PREFIX=prefix, TOLLGATE_MODEL_CACHE=str(models), **extra
        )

    stack.env = env  # type: ignore[method-assign]
    return stack


async def _key_ids(js: object, subjects: Subjects) -> set[str]:
    kv = await js.key_value(subjects.keys_bucket)  # type: ignore[attr-defined]
    return set(await kv.keys())


async def _ids(js: object, subjects: Subjects, subject: str, field: str) -> set[str]:
    messages = await read_subject(js, subject)
    return {orjson.loads(m.data).get(field) for m in messages} - {None}


async def test_two_prefixes_on_one_server_do_not_see_each_other(
    nats_server: NatsServer, tmp_path: Path, var_dir: Path, prepared_model: Path
) -> None:
    models = var_dir / "cache" / "models"
    one = _stack(nats_server, tmp_path, "tga", models)
    two = _stack(nats_server, tmp_path, "tgb", models)
    try:
        key_one, key_two = await _bootstrap(one, "tga"), await _bootstrap(two, "tgb")
        one.worker(SIM_MODEL)
        await wait_ready(nats_server, SIM_MODEL, subjects=Subjects("tga"))
        _, url_one = one.router()
        _, url_two = two.router(TOLLGATE_ROUTER_QUEUE_TIMEOUT_S="2")

        async with httpx.AsyncClient(timeout=60) as http:

            async def call(url: str, key: str) -> httpx.Response:
                headers = {"Authorization": f"Bearer {key}"}
                return await http.post(f"{url}/v1/chat/completions", json=BODY, headers=headers)

            served = await call(url_one, key_one)
            assert served.status_code == 200, served.text
            # Keys: each router knows only its own stack's keys.
            assert (await call(url_two, key_one)).status_code == 401
            assert (await call(url_one, key_two)).status_code == 401
            # Work: the second stack has no worker, and the first one's is not its.
            waiting = await call(url_two, key_two)
            assert waiting.status_code == 503, waiting.text

        nc = await nats_server.connect(name="test-prefixes")
        js = nc.jetstream()
        try:
            a, b = Subjects("tga"), Subjects("tgb")
            served_id = served.headers["x-request-id"]
            waiting_id = waiting.headers["x-request-id"]
            usage_a = await _ids(js, a, a.usage_all, "request_id")
            usage_b = await _ids(js, b, b.usage_all, "request_id")
            assert served_id in usage_a and served_id not in usage_b
            assert waiting_id in usage_b and waiting_id not in usage_a

            keys_a, keys_b = await _key_ids(js, a), await _key_ids(js, b)
            assert keys_a and keys_b and not keys_a & keys_b
            audit_a = await _ids(js, a, a.audit, "key_id")
            audit_b = await _ids(js, b, b.audit, "key_id")
            assert audit_a == keys_a and audit_b == keys_b

            # Every stream of a stack holds only its own prefix's subjects.
            # (asked by name: a shared server can hold more streams than one listing page)
            for prefix in ("tga", "tgb"):
                own = {}
                for spec in Topology(Subjects(prefix)).streams:
                    with contextlib.suppress(NotFoundError):
                        own[spec.name] = (await js.stream_info(spec.name)).config.subjects
                assert len(own) >= 3, own  # usage, audit, the work queue at least
                assert all(x.startswith(f"{prefix}.") for s in own.values() for x in s or [])
        finally:
            await nc.close()
    finally:
        one.stop_all()
        two.stop_all()


@pytest.mark.parametrize("prefix", ["TG", "tg.a", "tg_a", "", "tg>"])
def test_a_prefix_that_could_collide_is_refused(prefix: str) -> None:
    with pytest.raises(ValueError):
        Subjects(prefix)
