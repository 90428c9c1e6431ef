"""Who reads a call's usage event: metering always, the budget ledger only for budget keys.

On the shared stack (real nats-server, router, auth service, simulated
workers: test doubles). The router publishes the event of a key with a token
budget on ``tg.usage.<tenant>.budget`` and any other on ``….plain``; the
budget ledger's consumer reads only the first, and counts it.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import orjson
from nats.js.errors import KeyNotFoundError

from tests.conftest import SIM_MODEL, Stack
from tests.lib.streams import read_subject
from tests.router.test_auth import make_key
from tollgate.keys.records import budget_window
from tollgate.wire import codec
from tollgate.wire.contracts import UsageEvent
from tollgate.wire.subjects import Subjects
from tollgate.wire.topology import Topology

TENANT = "usage-readers"


async def test_only_budget_keys_events_reach_the_budget_ledger(
    stack: Stack, router_url: str, sim_workers: None
) -> None:
    stack.auth()  # its budget ledger
    budget, budget_id = await make_key(
        stack, tenant=TENANT, budget_tokens=1_000_000, budget_period="day"
    )
    plain, plain_id = await make_key(stack, tenant=TENANT)
    sent: dict[str, str] = {}  # request id -> key id
    async with httpx.AsyncClient(timeout=60) as http:
        for token, key_id in [(budget, budget_id), (plain, plain_id)] * 3:
            r = await http.post(
                f"{router_url}/v1/chat/completions",
                json={
                    "model": SIM_MODEL,
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 3,
                },
                headers={"Authorization": f"Bearer {token}"},
            )
            assert r.status_code == 200, r.text
            sent[r.headers["x-request-id"]] = key_id

    subjects = Subjects()
    topology = Topology(subjects)
    nc = await stack.nats.connect(name="test-usage-readers")
    try:
        js = nc.jetstream()
        deadline = time.monotonic() + 30
        while True:
            msgs = [
                m
                for m in await read_subject(js, subjects.usage_tenant(TENANT))
                if codec.decode(UsageEvent, m.data).request_id in sent
            ]
            if len(msgs) == len(sent) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        assert len(msgs) == len(sent)
        billed = 0
        for m in msgs:
            event = codec.decode(UsageEvent, m.data)
            budgeted = sent[event.request_id] == budget_id
            assert m.subject == subjects.usage(TENANT, budget=budgeted), m.subject
            if budgeted:
                billed += event.prompt_tokens + event.completion_tokens
        assert billed > 0

        # the ledger counted the budget key's calls, and only those
        spend = await js.key_value(topology.spend.name)
        window = budget_window("day", time.time())

        async def spent(key_id: str) -> int:
            try:
                entry = await spend.get(f"{key_id}.{window}")
            except KeyNotFoundError:
                return 0
            return int(orjson.loads(entry.value or b"{}").get("tokens", 0))

        deadline = time.monotonic() + 30
        while True:
            counted = await spent(budget_id)
            if counted == billed or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        assert counted == billed
        assert await spent(plain_id) == 0
    finally:
        await nc.close()
