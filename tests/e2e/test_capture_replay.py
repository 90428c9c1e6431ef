"""Capture per key and per tenant, into ClickHouse; replay of captured inputs.

On the shared stack (real nats-server, router, simulated and vLLM workers)
with a metering service on the embedded ClickHouse.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import REAL_MODEL, SIM_MODEL, Service, Stack
from tests.router.test_auth import make_key, wait_status
from tollgate.analytics import run_query
from tollgate.wire.subjects import Subjects

pytestmark = pytest.mark.usefixtures("sim_workers")


@pytest.fixture(scope="module")
def metering(stack: Stack) -> Iterator[Service]:
    service, _ = stack.metering(TOLLGATE_METERING_BATCH_MAX_WAIT_S="0.3")
    yield service
    service.stop()


async def rows(stack: Stack, sql: str, want: int, timeout: float = 30) -> list[list[Any]]:
    """Poll a read-only query until it returns ``want`` rows."""
    nc = await stack.nats.connect(name="test-capture")
    try:
        deadline = time.monotonic() + timeout
        while True:
            result = await run_query(nc, Subjects(), sql, timeout=30)
            assert result.error is None, result.error
            if len(result.rows) >= want or time.monotonic() > deadline:
                return result.rows
            await asyncio.sleep(0.3)
    finally:
        await nc.close()


def client(url: str, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


async def test_capture_follows_the_key_and_the_tenant(
    metering: Service, stack: Stack, router_url: str
) -> None:
    captured, _ = await make_key(stack, tenant="cap-key", capture=True)
    plain, _ = await make_key(stack, tenant="cap-plain")
    by_tenant, _ = await make_key(stack, tenant="cap-tenant")
    _, tenant_router = stack.router(
        TOLLGATE_ROUTER_CAPTURE_TENANTS='["cap-tenant"]', TOLLGATE_ROUTER_CAPTURE_MAX_BYTES="1024"
    )
    for url, key in ((router_url, captured), (router_url, plain), (tenant_router, by_tenant)):
        await wait_status(url, key, 200)
    messages = [{"role": "user", "content": "Tell me about capture."}]

    # a streamed answer (reassembled at capture) and a full one, for the capturing key
    raw = await client(router_url, captured).chat.completions.with_raw_response.create(
        model=SIM_MODEL, messages=messages, max_tokens=9, stream=True
    )
    streamed_id = raw.headers["x-request-id"]
    streamed_text = ""
    async for chunk in raw.parse():  # type: ignore[attr-defined]
        for choice in chunk.choices:
            streamed_text += choice.delta.content or ""
    full = await client(router_url, captured).chat.completions.with_raw_response.create(
        model=SIM_MODEL, messages=messages, max_tokens=5
    )
    full_id = full.headers["x-request-id"]
    # a key without capture
    other = await client(router_url, plain).chat.completions.with_raw_response.create(
        model=SIM_MODEL, messages=messages, max_tokens=3
    )
    other_id = other.headers["x-request-id"]
    # a tenant with capture on, and a body over the 1 KiB cap
    long = [{"role": "user", "content": "x" * 3000}]
    cut = await client(tenant_router, by_tenant).chat.completions.with_raw_response.create(
        model=SIM_MODEL, messages=long, max_tokens=3
    )
    cut_id = cut.headers["x-request-id"]

    ids = (streamed_id, full_id, other_id, cut_id)
    got = await rows(
        stack,
        "SELECT request_id, streamed, request_body, request_truncated, response_text,"
        " response_body, finish_reason, completion_tokens FROM exchanges FINAL"
        f" WHERE request_id IN {ids!r}",
        want=3,
    )
    await asyncio.sleep(1.0)  # a capture of the plain key would have arrived with the others
    by_id = {r[0]: r for r in got}
    assert set(by_id) == {streamed_id, full_id, cut_id}, "captured: the key's and the tenant's"

    s = by_id[streamed_id]
    assert s[1] is True and s[4] == streamed_text and s[6] == "length" and s[7] == 9
    assert json.loads(s[2])["messages"] == messages and json.loads(s[2])["stream"] is True
    rebuilt = json.loads(s[5])
    assert rebuilt["choices"][0]["message"]["content"] == streamed_text
    f = by_id[full_id]
    assert json.loads(f[5])["choices"][0]["message"]["content"] == f[4] and f[7] == 5
    c = by_id[cut_id]
    assert c[3] is True and len(c[2].encode()) <= 1024, "the body is cut at the cap"

    # one request id everywhere: header, usage row, capture row, worker log line
    usage = await rows(
        stack, f"SELECT request_id FROM usage_events WHERE request_id = '{full_id}'", want=1
    )
    assert usage == [[full_id]]
    worker_log = next(s for s in stack.services if s.name == f"worker-{SIM_MODEL}").log_text()
    done = [
        json.loads(line)
        for line in worker_log.splitlines()
        if full_id in line and '"request done"' in line
    ]
    assert len(done) == 1 and done[0]["request_id"] == full_id
    router_log = next(s for s in stack.services if s.name == "router").log_text()
    assert any(full_id in line and '"request done"' in line for line in router_log.splitlines())


async def captured_traffic(stack: Stack, router_url: str, tenant: str, n: int) -> str:
    key, _ = await make_key(stack, tenant=tenant, capture=True)
    await wait_status(router_url, key, 200)
    topics = ["the sea", "bicycles", "colours", "cooking", "forests"]
    await asyncio.gather(
        *(
            client(router_url, key).chat.completions.create(
                model=SIM_MODEL,
                messages=[{"role": "user", "content": f"Write about {topics[i % 5]} ({i})."}],
                max_tokens=4 + i % 8,
                temperature=0,
            )
            for i in range(n)
        )
    )
    await rows(stack, f"SELECT request_id FROM exchanges WHERE tenant = '{tenant}'", want=n)
    return key


def run_replay(stack: Stack, router_url: str, key: str, where: str, model: str, out: Path) -> str:
    result = subprocess.run(
        [
            sys.executable,
            *("-m", "tollgate.app.cli", "replay", "--where", where, "--model", model),
            *("--limit", "20", "--base-url", router_url, "--api-key", key, "--out", str(out)),
        ],
        env=stack.env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.timeout(900)
async def test_replay_of_twenty_captured_requests(
    metering: Service, stack: Stack, router_url: str, real_worker: None, tmp_path: Path
) -> None:
    key = await captured_traffic(stack, router_url, "replay-src", 20)
    where = "tenant = 'replay-src'"

    # the same simulated model: deterministic, so every answer matches
    same = run_replay(stack, router_url, key, where, SIM_MODEL, tmp_path / "sim.md")
    report = (tmp_path / "sim.md").read_text()
    assert "20 replayed, 20 answered, 0 skipped" in report
    assert "| exact match | | 100% |" in report
    details = json.loads((tmp_path / "sim.json").read_text())
    assert len(details["pairs"]) == 20
    assert all(p["completion_tokens"] == p["original_completion_tokens"] for p in details["pairs"])
    replay_id = details["summary"]["replay_id"]
    captured_ids = {p["request_id"] for p in details["pairs"]}
    stored = await rows(
        stack,
        f"SELECT request_id, exact_match FROM replays FINAL WHERE replay_id = '{replay_id}'",
        want=20,
    )
    assert len(stored) == 20 and all(r[1] is True for r in stored)
    print(same)

    # another model: SmolLM2 on vLLM answers the same inputs
    real = run_replay(stack, router_url, key, where, REAL_MODEL, tmp_path / "real.md")
    report = (tmp_path / "real.md").read_text()
    assert "20 replayed, 20 answered, 0 skipped" in report
    details = json.loads((tmp_path / "real.json").read_text())
    assert {p["model"] for p in details["pairs"]} == {REAL_MODEL}
    # the same 20 captured inputs: replayed requests are not captured again
    assert {p["request_id"] for p in details["pairs"]} == captured_ids
    assert {p["original_model"] for p in details["pairs"]} == {SIM_MODEL}
    assert all(p["http_status"] == 200 and p["text"] for p in details["pairs"])
    assert all(0.0 <= p["repetition"] <= 1.0 for p in details["pairs"])
    print(real)


async def test_captured_responses_api_calls_replay_to_the_same_answers(
    metering: Service, stack: Stack, router_url: str, tmp_path: Path
) -> None:
    """/v1/responses calls, whole and streamed, are captured and replayed like chat."""
    tenant = "replay-responses"
    key, _ = await make_key(stack, tenant=tenant, capture=True)
    await wait_status(router_url, key, 200)
    openai_client = client(router_url, key)
    for i in range(4):
        made = openai_client.responses.create(
            model=SIM_MODEL,
            instructions="Be brief.",
            input=f"Write about the sea ({i}).",
            max_output_tokens=4 + 60 * (i % 2),  # cut short, and ended by itself
            stream=i >= 2,
        )
        answer = await made
        if i >= 2:  # read the stream to its end
            async for _ in answer:  # type: ignore[union-attr]
                pass
    await rows(stack, f"SELECT request_id FROM exchanges WHERE tenant = '{tenant}'", want=4)

    run_replay(stack, router_url, key, f"tenant = '{tenant}'", SIM_MODEL, tmp_path / "r.md")
    report = (tmp_path / "r.md").read_text()
    assert "4 replayed, 4 answered, 0 skipped" in report
    pairs = json.loads((tmp_path / "r.json").read_text())["pairs"]
    assert len(pairs) == 4 and all(p["exact_match"] for p in pairs)
    assert all(p["text"] for p in pairs)
    assert {p["finish_reason"] for p in pairs} == {"length", "stop"}
    for pair in pairs:
        assert pair["finish_reason"] == pair["original_finish_reason"]
        assert pair["completion_tokens"] == pair["original_completion_tokens"]


async def test_replay_refuses_a_bad_condition(
    metering: Service, stack: Stack, router_url: str, tmp_path: Path
) -> None:
    result = subprocess.run(
        [
            sys.executable,
            *("-m", "tollgate.app.cli", "replay", "--where", "no_such_column = 1"),
            *("--model", SIM_MODEL, "--base-url", router_url, "--api-key", "unused"),
            *("--out", str(tmp_path / "x.md")),
        ],
        env=stack.env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1 and "no_such_column" in result.stderr
    assert not (tmp_path / "x.md").exists()
    async with httpx.AsyncClient() as http:
        assert (await http.get(f"{router_url}/healthz")).status_code == 200
