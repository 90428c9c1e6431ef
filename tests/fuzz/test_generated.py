"""Requests generated from docs/openapi/ against the whole stack (simulated engine).

Bounded for ``make test``: 45 s (at most 1,500 requests) of router traffic
from 6 concurrent callers, 15 s (at most 300) of admin calls and 20 s with a
rate-limited key. The soak run
(``-m slow``) sends the same traffic for ``TOLLGATE_FUZZ_SOAK_S`` seconds.
"""

from __future__ import annotations

import os
import time
from typing import Any

import httpx
import orjson
import pytest

from tests.conftest import SIM_MODEL
from tests.fuzz.conftest import SOAK_ENV, Fuzz
from tests.fuzz.corpus import TOKEN_LIMITS
from tests.fuzz.oracle import Case, Findings, settled_gauges
from tests.fuzz.traffic import (
    CHAT,
    COMPLETIONS,
    JSON,
    AdminTraffic,
    Request,
    RouterTraffic,
    run_admin,
    run_concurrently,
    send,
)

SOAK_S = float(os.environ.get(SOAK_ENV, "900"))


async def router_traffic(fuzz: Fuzz, findings: Findings, seconds: float, most: int) -> None:
    traffic = RouterTraffic(fuzz.rng("router"), fuzz.api_key)
    sent = await run_concurrently(
        traffic.draw, fuzz.router_url, findings, seconds=seconds, most=most, concurrency=6
    )
    print(f"router: {sent} generated requests")


async def admin_traffic(fuzz: Fuzz, findings: Findings, seconds: float, most: int) -> None:
    traffic = AdminTraffic(
        fuzz.rng("admin"), fuzz.admin_token, lambda token: fuzz.add_secret("created key", token)
    )
    sent = await run_admin(traffic, fuzz.admin_url, findings, seconds=seconds, most=most)
    print(f"admin: {sent} generated calls, {len(traffic.keys)} keys created")


async def test_generated_router_requests(fuzz: Fuzz) -> None:
    findings = fuzz.findings()
    await router_traffic(fuzz, findings, seconds=45, most=1500)
    await fuzz.finish(findings)


async def test_generated_admin_calls(fuzz: Fuzz) -> None:
    findings = fuzz.findings()
    await admin_traffic(fuzz, findings, seconds=15, most=300)
    await fuzz.finish(findings)


def token_limit_requests(token: str) -> list[Request]:
    """The token limits that a reservation could get wrong, on both endpoints."""
    headers = {"Authorization": f"Bearer {token}", **JSON}
    requests = []
    for path, base in (
        (CHAT, {"model": SIM_MODEL, "messages": [{"role": "user", "content": "a"}], "n": 4}),
        (COMPLETIONS, {"model": SIM_MODEL, "prompt": [1], "n": 4}),
    ):
        for name in ("max_completion_tokens", "max_tokens"):
            values: list[Any] = [*TOKEN_LIMITS, 0, -(2**63), 2**63, -1.5]
            for value in values:
                body = {**base, name: value}
                case = Case(f"POST {path}", f"{name} {value!r}", f"{name} {value!r}", str(body))
                requests.append(Request(case, "POST", path, headers, orjson.dumps(body)))
    return requests


def minute() -> int:
    return int(time.time() // 60)


async def limited_traffic(fuzz: Fuzz, findings: Findings, seconds: float) -> None:
    """Probe the key's remaining tokens between hostile and generated calls.

    A probe is the same small call each time, sent when every earlier call
    has ended (the gauges are 0, so each reservation is settled), so within
    one minute's window its ``x-ratelimit-remaining-tokens`` can only fall:
    every call in between used zero tokens or more.
    """
    token, _ = await fuzz.create_key(tenant="fuzz-limited", tpm=10**9, ttl_s=3600)
    rng = fuzz.rng("limited")
    traffic = RouterTraffic(rng, token)
    pending = token_limit_requests(token)
    probe_body = {"model": SIM_MODEL, "messages": [{"role": "user", "content": "probe"}]}
    probe = Request(
        Case(f"POST {CHAT}", "probe", "probe", str(probe_body), valid=True),
        "POST",
        CHAT,
        {"Authorization": f"Bearer {token}", **JSON},
        orjson.dumps({**probe_body, "max_tokens": 1}),
    )
    previous: tuple[int, int] | None = None
    between: list[str] = []
    deadline = time.monotonic() + seconds
    probes = 0
    async with httpx.AsyncClient() as http:
        while time.monotonic() < deadline:
            settled = await settled_gauges(fuzz.router_url, timeout=10)
            if any(settled.values()):
                # calls that never end (an earlier failure): the probes cannot wait for them
                findings.note("calls stay in flight between probes", str(settled))
                previous = None
            before = minute()
            answer = await send(http, fuzz.router_url, probe)
            window = minute()
            findings.check(probe.case, answer)
            remaining = answer.header("x-ratelimit-remaining-tokens")
            if answer.status != 200 or remaining is None:
                findings.fail(probe.case, "the probe has no x-ratelimit-remaining-tokens")
                break
            probes += 1
            now = (window, int(remaining)) if before == window else None
            if previous is not None and now is not None and previous[0] == now[0]:
                if now[1] > previous[1]:
                    findings.note(
                        "the limited key's remaining tokens went up",
                        f"{previous[1]} -> {now[1]} after: {'; '.join(between)}",
                    )
            previous, between = now, []
            for _ in range(4):
                if pending:
                    request = pending.pop(0)
                else:
                    path = CHAT if rng.random() < 0.5 else COMPLETIONS
                    request = traffic.completion(path, valid=rng.random() < 0.3)
                findings.check(request.case, await send(http, fuzz.router_url, request))
                between.append(f"{request.case.target} {request.case.label}")
    print(f"limited key: {probes} probes")
    if probes < 2:
        findings.note("too few probes to compare", f"{probes} in {seconds:g} s")


async def test_a_limited_keys_remaining_tokens_never_go_up(fuzz: Fuzz) -> None:
    findings = fuzz.findings()
    await limited_traffic(fuzz, findings, seconds=20)
    await fuzz.finish(findings)


@pytest.mark.slow
@pytest.mark.timeout(int(SOAK_S) + 600)
async def test_soak(fuzz: Fuzz) -> None:
    findings = fuzz.findings()
    await router_traffic(fuzz, findings, seconds=SOAK_S * 0.7, most=10**7)
    await admin_traffic(fuzz, findings, seconds=SOAK_S * 0.15, most=10**7)
    await limited_traffic(fuzz, findings, seconds=SOAK_S * 0.15)
    await fuzz.finish(findings)
