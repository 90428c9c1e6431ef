"""The scaler end to end with the local backend: real NATS, router and simulated-engine workers.

The model ``sim/scaled`` (two slots per worker, 5 s replies of 100 tokens) starts at zero
workers; its policy scales to at most 3 and back to zero after 4 s idle.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import SCALE_MODEL, HeartbeatWatch, Service, Stack
from tests.lib.streams import read_subject
from tollgate.wire.subjects import Subjects

MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def scaler(stack: Stack, router_url: str) -> Iterator[tuple[Service, str]]:
    service, base = stack.scaler(
        TOLLGATE_SCALER_MODELS=json.dumps([SCALE_MODEL]), TOLLGATE_SCALER_TICK_S="0.5"
    )
    yield service, base
    service.stop()
    assert workers_of(service) == [], "the scaler drains its workers when it stops"


@pytest.fixture(scope="module")
def aclient(router_url: str, api_key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{router_url}/v1", api_key=api_key, max_retries=0)


def workers_of(service: Service) -> list[int]:
    """Pids of the scaler's worker processes."""
    out = subprocess.run(
        ["pgrep", "-P", str(service.proc.pid)], capture_output=True, text=True, check=False
    )
    return [int(pid) for pid in out.stdout.split()]


def scaler_status(stack: Stack) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "tollgate.app.cli", "scaler", "status", "--json"],
        env=stack.env(),
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    status: dict[str, Any] = json.loads(out.stdout)["models"][SCALE_MODEL]
    return status


async def wait_until(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.2)


async def stream(aclient: openai.AsyncOpenAI, max_tokens: int | None = None) -> tuple[int, str]:
    """One streamed chat; (content pieces, finish reason)."""
    extra: dict[str, Any] = {} if max_tokens is None else {"max_tokens": max_tokens}
    chunks = await aclient.chat.completions.create(
        model=SCALE_MODEL,
        messages=MESSAGES,
        stream=True,
        stream_options={"include_usage": True},
        **extra,
    )
    pieces, finish, usage = 0, "", None
    async for chunk in chunks:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            pieces += 1 if choice.delta.content else 0
            finish = choice.finish_reason or finish
    assert usage is not None and usage.completion_tokens == pieces
    return pieces, finish


async def test_a_request_to_a_model_at_zero_completes_after_a_worker_starts(
    scaler: tuple[Service, str], stack: Stack, aclient: openai.AsyncOpenAI
) -> None:
    service, _ = scaler
    assert workers_of(service) == []
    status = scaler_status(stack)
    assert status["desired"] == 0 and status["ready"] == 0
    started = time.monotonic()
    resp = await aclient.chat.completions.create(model=SCALE_MODEL, messages=MESSAGES)
    waited = time.monotonic() - started
    assert resp.choices[0].finish_reason == "stop" and resp.usage is not None
    assert resp.usage.completion_tokens == 100
    status = scaler_status(stack)
    first = status["decisions"][0]
    assert first["previous"] == 0 and first["desired"] >= 1 and first["reason"] == "from_zero"
    assert first["signals"]["queued"] >= 1
    print(f"cold start of a simulated worker, request to answer: {waited:.2f} s")

    # every decision is also an event on tg.scale.<model-token>
    nc = await stack.nats.connect(name="test-scale-events")
    try:
        js = nc.jetstream()
        events = [json.loads(m.data) for m in await read_subject(js, Subjects().scale(SCALE_MODEL))]
        # this scaler's decisions (the stream also holds other tests' scalers')
        ours = [e for e in events if e["backend"] == "local" and e["time"] >= first["time"] - 1]
        assert ours and ours[0]["type"] == "tg.scale.v1" and ours[0]["reason"] == "from_zero"
        assert ours[0]["model"] == SCALE_MODEL and ours[0]["desired"] == first["desired"]
    finally:
        await nc.close()


async def test_a_burst_scales_up_and_idle_scales_to_zero(
    scaler: tuple[Service, str], stack: Stack, aclient: openai.AsyncOpenAI
) -> None:
    service, base = scaler
    async with HeartbeatWatch(stack.nats, Subjects()) as watch:
        burst = [asyncio.create_task(stream(aclient)) for _ in range(12)]
        # 12 requests at two per worker want 6: the policy caps at 3
        await watch.wait_for(lambda _: len(watch.ready(SCALE_MODEL)) == 3, timeout=60)
        results = await asyncio.gather(*burst)
    # scale-down starts while part of the burst still streams: nothing is cut short
    assert results == [(100, "stop")] * 12
    await wait_until(lambda: workers_of(service) == [], 60, "the model to scale to zero")
    status = scaler_status(stack)
    assert status["desired"] == 0
    reasons = [d["reason"] for d in status["decisions"]]
    assert "max_replicas" in reasons or "load" in reasons
    assert reasons[-1] == "scale_to_zero"
    peak = max(d["desired"] for d in status["decisions"])
    assert peak == 3
    metrics = httpx.get(f"{base}/metrics").text
    assert f'tollgate_scaler_desired_replicas{{model="{SCALE_MODEL}"}} 0.0' in metrics
    assert "tollgate_scaler_decisions_total" in metrics


async def test_a_crashed_worker_is_restarted(
    scaler: tuple[Service, str], stack: Stack, aclient: openai.AsyncOpenAI
) -> None:
    service, base = scaler
    hold = asyncio.create_task(stream(aclient))  # 5 s: keeps one worker
    async with HeartbeatWatch(stack.nats, Subjects()) as watch:
        await watch.wait_for(
            lambda b: any(x.model == SCALE_MODEL and x.slots_used == 1 for x in b.values()), 30
        )
    [victim] = workers_of(service)
    os.kill(victim, 9)
    with pytest.raises(openai.APIError):
        await hold  # that stream ends with an error: its worker died
    # the model still has demand in its policy window: a new worker replaces it
    await wait_until(
        lambda: len(workers_of(service)) == 1 and workers_of(service) != [victim],
        30,
        "a replacement worker",
    )
    metrics = httpx.get(f"{base}/metrics").text
    assert f'tollgate_scaler_worker_restarts_total{{model="{SCALE_MODEL}"}} 1.0' in metrics
    pieces, finish = await stream(aclient)
    assert (pieces, finish) == (100, "stop")
