"""Cache-aware routing on the real engine: a conversation stays on the worker that caches it.

Two SmolLM2 workers (the session's and one this test starts), and a router
with ``TOLLGATE_ROUTER_AFFINITY=prefix``. One conversation with a long system
prompt sends turn after turn, each repeating the earlier ones: every turn is
served by the same worker (the usage events say which), and that worker's
vLLM finds the repeated prompt in its prefix cache (its heartbeats'
``prefix_cache_hits`` grow by at least half the system prompt a turn).
Without routing, six turns land on one of two workers by chance one time
in 32.
"""

from __future__ import annotations

import asyncio
import random
import string
import time

import httpx
import pytest

from tests.conftest import REAL_MODEL, HeartbeatWatch, Stack
from tests.lib.streams import read_subject
from tests.router.test_auth import make_key
from tollgate.wire import codec
from tollgate.wire.contracts import UsageEvent, WorkerHeartbeat
from tollgate.wire.subjects import Subjects

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(900),
    pytest.mark.usefixtures("api_key", "real_worker"),  # the stack's signing key, then the worker
]

TENANT = "routing-real"
TURNS = 6
SYSTEM_WORDS = 320  # random letters: about 1,150 tokens


def conversation_opening(seed: int) -> list[dict[str, str]]:
    """A system prompt no other test sends (random strings, so no cache holds it yet)."""
    rng = random.Random(seed)
    words = (
        "".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 8)))
        for _ in range(SYSTEM_WORDS)
    )
    return [{"role": "system", "content": "Remember these words: " + " ".join(words)}]


def hits(beat: WorkerHeartbeat) -> int:
    assert beat.prefix_cache_hits is not None, f"{beat.worker_id} reports no prefix cache"
    return beat.prefix_cache_hits


async def usage_events(stack: Stack, request_ids: list[str]) -> dict[str, UsageEvent]:
    """The usage event of each call (written just after its response: wait for them)."""
    nc = await stack.nats.connect(name="test-routing-usage")
    try:
        js = nc.jetstream()
        deadline = time.monotonic() + 60
        while True:
            found = {
                e.request_id: e
                for m in await read_subject(js, Subjects().usage_tenant(TENANT))
                if (e := codec.decode(UsageEvent, m.data)).request_id in request_ids
            }
            if len(found) == len(request_ids) or time.monotonic() > deadline:
                return found
            await asyncio.sleep(0.5)
    finally:
        await nc.close()


async def test_a_conversations_turns_meet_one_worker_and_its_prefix_cache(stack: Stack) -> None:
    key, _ = await make_key(stack, tenant=TENANT)
    async with HeartbeatWatch(stack.nats, Subjects()) as watch:
        stack.worker(REAL_MODEL)  # the second worker (stopped when the test ends)
        await watch.wait_for(lambda _: len(watch.ready(REAL_MODEL)) >= 2, timeout=600)
        _, base = stack.router(TOLLGATE_ROUTER_AFFINITY="prefix")
        # The router knows workers from their heartbeats: one more from each, sent
        # after it started, and it has heard both.
        since = time.time()
        ready = await watch.wait_for(
            lambda _: sum(b.sent_at > since for b in watch.ready(REAL_MODEL)) >= 2
        )
        before = {w: hits(b) for w, b in ready.items() if b.model == REAL_MODEL}

        messages = conversation_opening(seed=20261201)
        request_ids: list[str] = []
        prompt_tokens: list[int] = []
        async with httpx.AsyncClient(timeout=300) as http:
            for turn in range(TURNS):
                messages.append(
                    {"role": "user", "content": f"Turn {turn + 1}: which word comes first?"}
                )
                r = await http.post(
                    f"{base}/v1/chat/completions",
                    headers={"Authorization": f"Bearer {key}"},
                    json={
                        "model": REAL_MODEL,
                        "messages": messages,
                        "max_tokens": 8,
                        "temperature": 0,
                    },
                )
                assert r.status_code == 200, r.text
                request_ids.append(r.headers["x-request-id"])
                prompt_tokens.append(r.json()["usage"]["prompt_tokens"])
                reply = r.json()["choices"][0]["message"]["content"] or "I do not know."
                messages.append({"role": "assistant", "content": reply})
        ended = time.time()

        events = await usage_events(stack, request_ids)
        assert sorted(events) == sorted(request_ids)
        workers = {events[i].worker_id for i in request_ids}
        assert len(workers) == 1, [events[i].worker_id for i in request_ids]
        (served,) = workers
        assert served in before, (served, sorted(before))

        # The serving worker's counters after the last turn: a heartbeat sent since.
        beats = await watch.wait_for(lambda b: served in b and b[served].sent_at > ended + 0.1)
        grown = hits(beats[served]) - before[served]
    system_tokens = prompt_tokens[0] - 40  # less the first question and the chat template
    assert system_tokens >= 1000, prompt_tokens
    # Every turn after the first finds at least half its system prompt in the cache
    # (vLLM caches whole blocks: 128 tokens on the CPU, 16 on GPUs).
    assert grown >= (TURNS - 1) * system_tokens // 2, (grown, prompt_tokens)
