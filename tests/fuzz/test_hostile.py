"""The hostile corpus (tests/fuzz/corpus.py) and clients that hang up, against the whole stack."""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
import orjson

from tests.conftest import SIM_MODEL, SLOW_MODEL
from tests.fuzz.conftest import Fuzz
from tests.fuzz.corpus import CHAT, Hostile, admin_cases, router_cases
from tests.fuzz.oracle import Answer, Case, Findings, gauges
from tests.fuzz.rawhttp import address, exchange, hang_up
from tests.fuzz.rawhttp import request as raw_request
from tests.fuzz.traffic import JSON, Request, send
from tests.router.test_auth import wait_status

TENANTS = ["*", ">", "a.*", "tg.usage.>", " spaced ", "é", "a/b", "$JS.API.>"]


async def hit(base: str, hostile: Hostile) -> Answer:
    """One case on a connection of its own, so that no answer is blamed on another case."""
    if hostile.raw is not None:
        return await exchange(base, hostile.raw)
    request = Request(
        hostile.case(), hostile.method, hostile.path, hostile.headers, hostile.content
    )
    async with httpx.AsyncClient(headers={"Connection": "close"}) as http:
        return await send(http, base, request)


async def run_corpus(base: str, cases: list[Hostile], findings: Findings) -> None:
    for hostile in cases:
        answer = await hit(base, hostile)
        case = hostile.case()
        findings.check(case, answer)
        if hostile.no_echo and hostile.no_echo in answer.body:
            findings.fail(
                case,
                "the answer repeats bytes of the request",
                answer.body[:200].decode("utf-8", "replace"),
            )


def marker(fuzz: Fuzz) -> bytes:
    """Bytes no answer has a reason to contain, unless it echoes the request."""
    return b"ECHO%09d" % fuzz.rng("marker").randrange(10**9)


async def test_hostile_router_requests(fuzz: Fuzz) -> None:
    findings = fuzz.findings()
    await run_corpus(fuzz.router_url, router_cases(fuzz.api_key, marker(fuzz)), findings)
    await fuzz.finish(findings)


async def test_hostile_admin_requests(fuzz: Fuzz) -> None:
    findings = fuzz.findings()
    await run_corpus(fuzz.admin_url, admin_cases(fuzz.admin_token, marker(fuzz)), findings)
    # tenants that are NATS wildcards: their usage subjects must stay one token
    async with httpx.AsyncClient(timeout=30) as http:
        for tenant in TENANTS:
            case = Case(
                "POST /admin/keys",
                f"tenant {tenant!r}",
                "wildcard tenant",
                tenant,
                expect=frozenset({201}),
            )
            r = await http.post(
                f"{fuzz.admin_url}/admin/keys",
                json={"tenant": tenant, "ttl_s": 600},
                headers=fuzz.admin,
            )
            findings.check(case, Answer.of(r))
            if r.status_code != 201:
                continue
            token = r.json()["key"]
            fuzz.add_secret(f"key of tenant {tenant!r}", token)
            try:
                await wait_status(fuzz.router_url, token, 200)
            except AssertionError:
                findings.fail(case, "the router never accepted the key")
                continue
            body = {
                "model": SIM_MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
            }
            call = Case(
                f"POST {CHAT}",
                f"key of tenant {tenant!r}",
                "wildcard tenant's call",
                str(body),
                expect=frozenset({200}),
            )
            answer = await send(http, fuzz.router_url, _post(CHAT, token, body, call))
            findings.check(call, answer)
    await fuzz.finish(findings)


def _post(path: str, token: str, body: object, case: Case) -> Request:
    return Request(
        case, "POST", path, {"Authorization": f"Bearer {token}", **JSON}, orjson.dumps(body)
    )


async def test_clients_that_hang_up(fuzz: Fuzz) -> None:
    """Mid-upload, mid-stream and mid-wait: nothing stays in flight, no slot stays taken."""
    findings = fuzz.findings()
    url = fuzz.router_url
    bearer = (b"Authorization", f"Bearer {fuzz.api_key}".encode())
    json_ct = (b"Content-Type", b"application/json")
    chat = CHAT.encode()
    start = b'{"model": "' + SIM_MODEL.encode() + b'", "messages": [{"role": "user", "content": "'
    await hang_up(
        url,
        raw_request(
            b"POST",
            chat,
            [bearer, json_ct, (b"Content-Length", b"3000000")],
            start + b"x" * 65536,
            length=False,
        ),
    )
    await hang_up(
        url,
        raw_request(
            b"POST",
            chat,
            [bearer, json_ct, (b"Transfer-Encoding", b"chunked")],
            b"%x\r\n" % len(start) + start + b"\r\n",
            length=False,
        ),
    )
    await hang_up(
        url,
        raw_request(b"POST", chat, [bearer, json_ct, (b"Content-Length", b"100")], length=False),
    )
    admin_bearer = (b"Authorization", f"Bearer {fuzz.admin_token}".encode())
    await hang_up(
        fuzz.admin_url,
        raw_request(
            b"POST",
            b"/admin/keys",
            [admin_bearer, json_ct, (b"Content-Length", b"100000")],
            b'{"tenant": "' + b"t" * 5000,
            length=False,
        ),
    )
    for model, extra in ((SLOW_MODEL, {}), (SLOW_MODEL, {}), (SIM_MODEL, {"n": 16})):
        body = orjson.dumps(
            {
                "model": model,
                "messages": [{"role": "user", "content": "hi"}],
                "stream": True,
                **extra,
            }
        )
        seen = await hang_up(
            url, raw_request(b"POST", chat, [bearer, json_ct], body), read_first=b"data: "
        )
        if b"data: " not in seen:
            findings.note("a stream never started", seen[:300].decode("utf-8", "replace"))
    # a whole (not streamed) call, dropped while its worker runs it
    body = orjson.dumps({"model": SLOW_MODEL, "messages": [{"role": "user", "content": "hi"}]})
    host, port = address(url)
    _, writer = await asyncio.open_connection(host, port)
    writer.write(raw_request(b"POST", chat, [bearer, json_ct], body))
    await writer.drain()
    deadline = time.monotonic() + 10
    while (await gauges(url)).get("tollgate_router_requests_in_flight", 0) < 1:
        if time.monotonic() > deadline:
            findings.note("a whole call never showed in flight", "")
            break
        await asyncio.sleep(0.05)
    writer.transport.abort()
    with contextlib.suppress(ConnectionError, OSError):
        await writer.wait_closed()
    # the slow model's two slots are free again: a short call to it completes
    body = {
        "model": SLOW_MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "stream": True,
    }
    case = Case(
        f"POST {CHAT}",
        "the slow model after hang-ups",
        "after hang-ups",
        str(body),
        expect=frozenset({200}),
        valid=True,
    )
    async with httpx.AsyncClient() as http:
        findings.check(
            case, await send(http, url, _post(CHAT, fuzz.api_key, body, case), timeout=90)
        )
    await fuzz.finish(findings)
