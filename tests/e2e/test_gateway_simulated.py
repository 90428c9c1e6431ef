"""The gateway's behaviour on a real nats-server with simulated-engine workers."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import openai
import pytest

from tests.conftest import ORPHAN_MODEL, SIM_MODEL, SLOW_MODEL, HeartbeatWatch, Stack, wait_ready
from tollgate.wire.subjects import Subjects

pytestmark = pytest.mark.usefixtures("sim_workers")

MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def aclient(router_url: str, api_key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{router_url}/v1", api_key=api_key, max_retries=0)


async def test_alias_and_usage_on_the_simulated_model(aclient: openai.AsyncOpenAI) -> None:
    resp = await aclient.chat.completions.create(model="echo", messages=MESSAGES, max_tokens=7)
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage is not None and resp.usage.completion_tokens == 7


async def test_stream_relays_every_chunk_in_order(aclient: openai.AsyncOpenAI) -> None:
    stream = await aclient.chat.completions.create(
        model=SIM_MODEL, messages=MESSAGES, stream=True, stream_options={"include_usage": True}
    )
    pieces, usage = [], None
    async for chunk in stream:
        usage = chunk.usage or usage
        pieces += [c.delta.content for c in chunk.choices if c.delta.content]
    assert "".join(pieces).startswith("Tollgate is a simulated engine reply.")
    assert usage is not None and usage.completion_tokens == len(pieces) == 24


async def test_models_endpoint_lists_the_catalog(aclient: openai.AsyncOpenAI) -> None:
    ids = [m.id async for m in aclient.models.list()]
    assert SIM_MODEL in ids and ORPHAN_MODEL in ids
    model = await aclient.models.retrieve("echo")
    assert model.id == SIM_MODEL
    with pytest.raises(openai.NotFoundError):
        await aclient.models.retrieve("does-not-exist")


async def test_disconnect_frees_the_slot(
    router_url: str, stack: Stack, auth_headers: dict[str, str]
) -> None:
    body = {"model": SLOW_MODEL, "stream": True, "messages": MESSAGES}
    async with HeartbeatWatch(stack.nats, Subjects()) as watch:
        async with httpx.AsyncClient(timeout=30, headers=auth_headers) as http:
            async with http.stream("POST", f"{router_url}/v1/chat/completions", json=body) as r:
                request_id = r.headers["x-request-id"]
                # Hold the iterator: a dropped one is closed, and so the connection.
                lines = r.aiter_lines()
                async for line in lines:
                    if line.startswith("data: ") and '"content":"T' in line:
                        break
                # Still connected: the worker reports the slot as busy.
                await watch.wait_for(
                    lambda b: any(x.model == SLOW_MODEL and x.slots_used == 1 for x in b.values())
                )
        # Disconnected: the slot is free long before the 1000-token reply would end.
        await watch.wait_for(
            lambda b: any(x.model == SLOW_MODEL and x.slots_used == 0 for x in b.values())
        )
    log = next(s for s in stack.services if s.name == f"worker-{SLOW_MODEL}").log_text()
    done = [ln for ln in log.splitlines() if request_id in ln and "request done" in ln]
    assert len(done) == 1 and '"outcome":"cancelled"' in done[0]


async def test_worker_killed_mid_stream_ends_the_stream_with_an_error(
    router_url: str, stack: Stack, var_dir: object, auth_headers: dict[str, str]
) -> None:
    # A dedicated worker for the slow model, so killing it spares the others.
    victim = stack.worker(SLOW_MODEL)
    await wait_ready(stack.nats, SLOW_MODEL, count=2)
    # 100 tokens at 10/s: streams outlive the 3 s heartbeat window by far.
    body = {"model": SLOW_MODEL, "stream": True, "messages": MESSAGES, "max_tokens": 100}
    async with httpx.AsyncClient(timeout=30, headers=auth_headers) as http:
        # Fill both workers' slots so that two requests surely run on the victim;
        # kill it once all four streams are under way.
        streaming = 0

        async def stream_one() -> list[str]:
            nonlocal streaming
            lines: list[str] = []
            async with http.stream("POST", f"{router_url}/v1/chat/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line:
                        lines.append(line)
                    if len(lines) == 3:
                        streaming += 1
                        if streaming == 4:
                            victim.proc.send_signal(signal.SIGKILL)
            return lines

        started = time.monotonic()
        results = await asyncio.wait_for(
            asyncio.gather(*(stream_one() for _ in range(4)), return_exceptions=True), 30
        )
    assert time.monotonic() - started < 30
    lost = [
        lines
        for lines in results
        if isinstance(lines, list) and any("worker_lost" in ln for ln in lines)
    ]
    assert lost, results
    for lines in lost:
        assert lines[-1] == "data: [DONE]"


async def test_queue_timeout_gives_503_with_retry_after(
    stack: Stack, auth_headers: dict[str, str]
) -> None:
    _, base = stack.router(TOLLGATE_ROUTER_QUEUE_TIMEOUT_S="1")
    async with httpx.AsyncClient(timeout=30, headers=auth_headers) as http:
        r = await http.post(
            f"{base}/v1/chat/completions", json={"model": ORPHAN_MODEL, "messages": MESSAGES}
        )
    assert r.status_code == 503
    assert int(r.headers["Retry-After"]) > 0
    assert r.json()["error"]["code"] == "no_capacity"


async def test_stream_waiting_in_the_queue_gets_keepalives_then_an_error(
    stack: Stack, auth_headers: dict[str, str]
) -> None:
    _, base = stack.router(
        TOLLGATE_ROUTER_QUEUE_TIMEOUT_S="1.5",
        TOLLGATE_ROUTER_FIRST_BYTE_WAIT_S="0.2",
        TOLLGATE_ROUTER_KEEPALIVE_INTERVAL_S="0.3",
    )
    body = {"model": ORPHAN_MODEL, "messages": MESSAGES, "stream": True}
    async with httpx.AsyncClient(timeout=30, headers=auth_headers) as http:
        async with http.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines = [ln async for ln in r.aiter_lines() if ln]
    assert lines.count(": waiting") >= 2
    assert "no_capacity" in lines[-2] and lines[-1] == "data: [DONE]"


async def test_request_waits_in_the_queue_until_a_worker_starts(
    router_url: str, stack: Stack, var_dir: object, auth_headers: dict[str, str]
) -> None:
    """A model with no worker: the request waits and completes once one starts."""
    model = "sim/late"
    catalog = stack.var_dir / "models.toml"
    assert model in catalog.read_text(), "the catalog has a model for this test"
    async with httpx.AsyncClient(timeout=60, headers=auth_headers) as http:
        pending = asyncio.create_task(
            http.post(
                f"{router_url}/v1/chat/completions",
                json={"model": model, "messages": MESSAGES, "max_tokens": 3},
            )
        )
        await asyncio.sleep(0.5)
        assert not pending.done()
        stack.worker(model)
        r = await pending
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


async def test_sigterm_drains_in_flight_streams(
    router_url: str, stack: Stack, auth_headers: dict[str, str]
) -> None:
    model = "sim/drain"
    worker = stack.worker(model)
    await wait_ready(stack.nats, model)
    body = {"model": model, "stream": True, "messages": MESSAGES, "max_tokens": 20}
    async with httpx.AsyncClient(timeout=30, headers=auth_headers) as http:
        async with http.stream("POST", f"{router_url}/v1/chat/completions", json=body) as r:
            lines = []
            async for line in r.aiter_lines():
                if line:
                    lines.append(line)
                if len(lines) == 2:
                    worker.proc.send_signal(signal.SIGTERM)
    assert lines[-1] == "data: [DONE]"
    assert sum('"content":' in ln for ln in lines) == 21  # role chunk + 20 tokens
    assert worker.proc.wait(30) == 0


async def test_a_request_whose_client_left_in_the_queue_is_never_run(
    router_url: str, stack: Stack, auth_headers: dict[str, str]
) -> None:
    body = {"model": SLOW_MODEL, "stream": True, "messages": MESSAGES, "max_tokens": 200}
    async with HeartbeatWatch(stack.nats, Subjects()) as watch:
        await watch.wait_for(lambda _: bool(watch.ready(SLOW_MODEL)))
        slots = sum(b.slots_total for b in watch.ready(SLOW_MODEL))
        async with httpx.AsyncClient(timeout=30, headers=auth_headers) as http:
            busy = []
            for _ in range(slots):  # every slot of the model taken
                busy.append(
                    await http.send(
                        http.build_request("POST", f"{router_url}/v1/chat/completions", json=body),
                        stream=True,
                    )
                )
            await watch.wait_for(
                lambda b: sum(x.slots_used for x in watch.ready(SLOW_MODEL)) == slots
            )
            async with http.stream("POST", f"{router_url}/v1/chat/completions", json=body) as r:
                queued_id = r.headers["x-request-id"]
                async for line in r.aiter_lines():
                    if line.startswith(": waiting"):
                        break  # still queued: hang up
            # The router notices at its next keep-alive and cancels the request.
            routers = [s for s in stack.services if s.name == "router"]
            deadline = time.monotonic() + 30
            while True:
                text = "\n".join(r.log_text() for r in routers)
                if any(queued_id in ln and "client_disconnected" in ln for ln in text.splitlines()):
                    break
                assert time.monotonic() < deadline, "the router never noticed the hang-up"
                await asyncio.sleep(0.05)
            for response in busy:  # free the slots: the worker fetches the queued one
                await response.aclose()
        await watch.wait_for(lambda b: sum(x.slots_used for x in watch.ready(SLOW_MODEL)) == 0)
    # The router withdrew it from the queue: no worker ever took it, and the
    # model's lanes are empty.
    logs = "\n".join(s.log_text() for s in stack.services if s.name == f"worker-{SLOW_MODEL}")
    lines = [ln for ln in logs.splitlines() if queued_id in ln]
    assert not any('"msg":"request done"' in ln for ln in lines), lines
    subjects = Subjects()
    nc = await stack.nats.connect(name="test-queue", prefix=subjects.prefix)
    try:
        info = await nc.jetstream().stream_info(
            subjects.infer_stream, subjects_filter=subjects.infer_lanes(SLOW_MODEL)
        )
    finally:
        await nc.close()
    assert not info.state.subjects, info.state.subjects
