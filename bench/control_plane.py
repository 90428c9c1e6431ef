"""The control plane on FastStream vs on plain nats.py, side by side.

Each part runs the service's own handler both ways on one nats-server, in
alternating rounds, and reports the median of the rounds:

1. ledger: the auth service's budget ledger counting usage events from its
   durable consumer: keys with a budget (three KV round trips per event),
   keys without one (one), events without a key (the consumer alone);
2. query: the metering query responder (request/reply, queue group), with a
   stub store (the bus alone) and with embedded ClickHouse;
3. exchanges: the capture consumer into a table (batches of 500, one write
   per batch, acks after it), with a no-op table (the consumer alone) and
   with embedded ClickHouse;
4. signals: the scaler's heartbeat, arrival and usage subscriptions, fed by a
   publisher in another process; and its status request/reply.

The ledger is on FastStream in the service, so its nats.py baseline is the
loop it had before (:class:`FetchLoopLedger`). The other parts stayed on
nats.py, so the service's own subscription is the baseline and the FastStream
subscriber calling the same handler is kept here.

    python -m bench.control_plane [--quick] [--rounds N]   # prints the table
    python -m bench --only control                         # writes docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any

import orjson
import uvloop
from faststream import Context
from faststream.message import StreamMessage
from faststream.middlewares import AckPolicy
from faststream.nats import PullSub
from faststream.nats.message import NatsBatchMessage
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.errors import NotFoundError
from pydantic import BaseModel, ValidationError

from bench import procs as P
from bench.metering import event as usage_event
from services.auth.ledger import BudgetLedger
from services.metering.exchanges import StreamToTable
from services.metering.metrics import MeteringMetrics
from services.metering.queries import QueryResponder
from tollgate.keys.records import KeyRecord
from tollgate.keys.store import KeyStore
from tollgate.wire import bus, codec, control
from tollgate.wire.contracts import (
    Arrival,
    CaptureEvent,
    QueryRequest,
    QueryResult,
    UsageEvent,
    WorkerHeartbeat,
    WorkerState,
)
from tollgate.wire.subjects import Subjects
from tollgate.wire.topology import Role, Topology

ROOT = Path(__file__).resolve().parent.parent
KEYS = 50


def typed(model: type[BaseModel]) -> Callable[[StreamMessage[Any]], Awaitable[Any]]:
    """A FastStream decoder: the body read as ``model``, None when it is not one."""

    async def decode(message: StreamMessage[Any]) -> Any:
        try:
            return codec.decode(model, message.body)
        except (ValidationError, ValueError):
            return None

    return decode


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


async def wait_acked(js: Any, stream: str, durable: str, last: int, timeout: float = 600) -> None:
    """Until the consumer's ack floor reaches the stream's last message."""
    async with asyncio.timeout(timeout):
        while True:
            with contextlib.suppress(NotFoundError):  # not created yet
                info = await js.consumer_info(stream, durable)
                if info.ack_floor.stream_seq >= last and info.num_ack_pending == 0:
                    return
            await asyncio.sleep(0.01)


async def publish(js: Any, items: list[tuple[str, bytes, str]]) -> int:
    """Publish (subject, body, msg id) with a window of acks in flight; the last sequence."""
    last = 0
    for start in range(0, len(items), 2000):
        acks = await asyncio.gather(
            *(
                js.publish(subject, body, headers={"Nats-Msg-Id": mid})
                for subject, body, mid in items[start : start + 2000]
            )
        )
        last = max(a.seq for a in acks)
    return last


# -- 1. the budget ledger ------------------------------------------------------


class FetchLoopLedger(BudgetLedger):
    """The ledger's loop before FastStream: fetch 200, count each, ack each, reconcile."""

    async def run(self) -> None:
        consumer = self.topology.auth_budget
        sub = await self.js.pull_subscribe(
            consumer.filter_subject,
            durable=consumer.durable,
            stream=consumer.stream,
            config=consumer.config(max_ack_pending=10_000),
        )
        next_check = 0.0
        while not self._stopping.is_set():
            if time.monotonic() >= next_check:
                await self.reconcile()
                next_check = time.monotonic() + self.reactivate_every_s
            try:
                msgs = await sub.fetch(200, timeout=1.0)
            except TimeoutError:
                continue
            for msg in msgs:
                try:
                    event = codec.decode(UsageEvent, msg.data)
                except Exception:
                    await msg.ack()
                    continue
                await self.count(event, msg.metadata.sequence.stream)
                await msg.ack()
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


async def ledger_round(url: str, prefix: str, how: str, n: int, keys: str) -> float:
    """Events/s counted by the ledger (``how``: nats.py or faststream).

    ``keys``: "budget" (every event's key has a budget: three KV round trips
    per event), "no budget" (one), "none" (events without a key: none).
    """
    topology = Topology(Subjects(prefix))
    nc = await bus.connect(url, f"bench-ledger-{prefix}")
    js = nc.jetstream()
    try:
        await topology.ensure(js, Role.AUTH)
        store = await KeyStore(js, topology, actor="bench").open()
        for i in range(KEYS):
            record = KeyRecord(
                key_id=f"key-{i}",
                tenant="bench",
                budget_tokens=10**15 if keys == "budget" else None,
                budget_period="day" if keys == "budget" else None,
            )
            await store.keys.put(record.key_id, record.model_dump_json().encode())
        now = time.time()
        items = []
        for i in range(n):
            e = usage_event(i, "bench", now)
            if keys == "none":
                e["key_id"] = None
            items.append((topology.subjects.usage("bench"), orjson.dumps(e), e["request_id"]))
        last = await publish(js, items)
        kind = FetchLoopLedger if how == "nats.py" else BudgetLedger
        ledger = kind(js, store, topology, reactivate_every_s=3600)
        await ledger.open()
        broker = None
        started = time.perf_counter()
        if how == "faststream":
            broker = control.ControlBroker(nc, name="bench-auth")
            ledger.subscribe(broker)
            await broker.start()
        task = asyncio.create_task(ledger.run())
        await wait_acked(js, topology.usage.name, topology.auth_budget.durable, last)
        rate = n / (time.perf_counter() - started)
        ledger.stop()
        if broker is not None:
            await broker.stop()
        await asyncio.wait_for(task, 10)
        return rate
    finally:
        await bus.close(nc)


def bench_ledger(url: str, rounds: int, quick: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for keys, n in (
        ("budget", 2000 if quick else 5000),
        ("no budget", 5000 if quick else 15_000),
        ("none", 20_000 if quick else 50_000),
    ):
        rates: dict[str, list[float]] = {"nats.py": [], "faststream": []}
        for r in range(rounds):
            for how in rates:
                prefix = f"l{keys[:2].replace(' ', '')}{r}{how[0]}"
                rates[how].append(asyncio.run(ledger_round(url, prefix, how, n, keys)))
        out[keys] = {"events": n, **{how: median(v) for how, v in rates.items()}}
        print(f"ledger, keys {keys}: {out[keys]}", flush=True)
    return out


# -- 2. the metering query responder -------------------------------------------


class StubStore:
    """Answers every query at once: what is left is the bus."""

    def query(self, sql: str, parameters: dict[str, Any], max_rows: int) -> QueryResult:
        return QueryResult(columns=["x"], types=["UInt8"], rows=[[1]])


async def query_round(url: str, prefix: str, how: str, store: Any, n: int) -> dict[str, float]:
    subjects = Subjects(prefix)
    server = await bus.connect(url, f"bench-metering-{prefix}")
    client = await bus.connect(url, f"bench-client-{prefix}")
    responder = QueryResponder(server, store, subjects, 10_000, MeteringMetrics())
    broker = None
    try:
        if how == "faststream":
            broker = control.ControlBroker(server, name="bench-metering")
            decoder = typed(QueryRequest)
            broker.subscriber(subjects.metering_query, queue="metering", decoder=decoder)(
                responder.answer
            )
            await broker.start()
        else:
            await responder.start()
        await server.flush()
        body = codec.encode(QueryRequest(sql="SELECT 1"))
        latencies = []
        for _ in range(n):
            t0 = time.perf_counter()
            reply = await client.request(subjects.metering_query, body, timeout=5)
            latencies.append(time.perf_counter() - t0)
            assert codec.decode(QueryResult, reply.data).error is None
        latencies.sort()
        started = time.perf_counter()

        async def many(count: int) -> None:
            for _ in range(count):
                await client.request(subjects.metering_query, body, timeout=5)

        await asyncio.gather(*(many(n // 16) for _ in range(16)))
        return {
            "p50_ms": 1000 * latencies[len(latencies) // 2],
            "p99_ms": 1000 * latencies[int(len(latencies) * 0.99)],
            "per_s_c16": (n // 16) * 16 / (time.perf_counter() - started),
        }
    finally:
        if broker is not None:
            await broker.stop()
        await bus.close(server)
        await bus.close(client)


def bench_query(url: str, rounds: int, quick: bool, work: Path) -> dict[str, Any]:
    from services.metering.store import UsageStore

    n = 1000 if quick else 3000
    chdb = UsageStore(f"chdb://{work / 'clickhouse-query'}", "bench").open()
    chdb.migrate()
    out: dict[str, Any] = {}
    for label, store in (("stub store", StubStore()), ("embedded ClickHouse", chdb)):
        runs: dict[str, list[dict[str, float]]] = {"nats.py": [], "faststream": []}
        for r in range(rounds):
            for how in runs:
                prefix = f"q{label[0]}{r}{how[0]}"
                runs[how].append(asyncio.run(query_round(url, prefix, how, store, n)))
        out[label] = {how: {k: median([x[k] for x in v]) for k in v[0]} for how, v in runs.items()}
        out[label]["requests"] = n
        print(f"query {label}: {out[label]}", flush=True)
    chdb.close()
    return out


# -- 3. captured exchanges into a table ----------------------------------------


class NoStore:
    """A table that takes every insert at once: what is left is the consumer."""

    def insert_json(self, table: str, rows: list[dict[str, Any]], key: tuple[str, ...]) -> None:
        return None


def capture_event(i: int) -> bytes:
    e = CaptureEvent(
        request_id=f"cap-{i}",
        time=time.time(),
        tenant="bench",
        key_id=f"key-{i % KEYS}",
        model="sim/bench",
        endpoint="chat.completions",
        streamed=bool(i % 2),
        request_body='{"model":"sim/bench","messages":[{"role":"user","content":"hello"}]}',
        response_text="Hello! How can I help you today?" * 4,
        outcome="completed",
        http_status=200,
        prompt_tokens=12,
        completion_tokens=40,
        total_s=0.2,
    )
    return codec.encode(e)


async def exchanges_round(url: str, prefix: str, how: str, n: int, store: Any) -> float:
    """Captures/s stored."""
    topology = Topology(Subjects(prefix))
    nc = await bus.connect(url, f"bench-capture-{prefix}")
    js = nc.jetstream()

    async def write(fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.to_thread(fn, *args)

    try:
        await topology.ensure_stream(js, topology.capture)
        items = [(topology.subjects.capture("bench"), capture_event(i), f"c{i}") for i in range(n)]
        last = await publish(js, items)
        table = StreamToTable(
            nc,
            store,
            write,
            consumer=topology.metering_capture,
            table="exchanges",
            key="request_id",
            contract=CaptureEvent,
        )
        broker = None
        task = None
        started = time.perf_counter()
        if how == "faststream":
            await table.ensure_consumer()
            broker = control.ControlBroker(nc, name="bench-metering")
            consumer = topology.metering_capture

            async def store_batch(
                batch: Annotated[NatsBatchMessage, Context("message")],
            ) -> None:
                await table.store_batch(batch.raw_message)

            broker.subscriber(
                consumer.filter_subject,
                stream=control.stream(topology.capture),
                durable=consumer.durable,
                config=consumer.config(ack_wait=60, max_deliver=-1),
                pull_sub=PullSub(batch_size=500, timeout=0.5, batch=True),
                ack_policy=AckPolicy.MANUAL,
            )(store_batch)
            await broker.start()
        else:
            task = asyncio.create_task(table.run())
        await wait_acked(js, topology.capture.name, topology.metering_capture.durable, last)
        rate = n / (time.perf_counter() - started)
        if broker is not None:
            await broker.stop()
        if task is not None:
            table.stop()
            await asyncio.wait_for(task, 10)
        return rate
    finally:
        await bus.close(nc)


def bench_exchanges(url: str, rounds: int, quick: bool, work: Path) -> dict[str, Any]:
    from services.metering.store import UsageStore

    chdb = UsageStore(f"chdb://{work / 'clickhouse-capture'}", "bench").open()
    chdb.migrate()
    out: dict[str, Any] = {}
    for label, store, n in (
        ("no-op write", NoStore(), 20_000 if quick else 60_000),
        ("embedded ClickHouse", chdb, 10_000 if quick else 30_000),
    ):
        rates: dict[str, list[float]] = {"nats.py": [], "faststream": []}
        for r in range(rounds):
            for how in rates:
                prefix = f"x{label[0]}{r}{how[0]}"
                rates[how].append(asyncio.run(exchanges_round(url, prefix, how, n, store)))
        out[label] = {"messages": n, **{how: median(v) for how, v in rates.items()}}
        print(f"exchanges {label}: {out[label]}", flush=True)
    chdb.close()
    return out


# -- 4. the scaler's signals and status ----------------------------------------


def signal_messages(subjects: Subjects, n: int) -> list[tuple[str, bytes]]:
    """n heartbeats, n arrivals and n usage events, interleaved."""
    now = time.time()
    out = []
    for i in range(n):
        beat = WorkerHeartbeat(
            worker_id=f"w{i}",
            model="sim/bench",
            engine="simulated",
            state=WorkerState.READY,
            slots_used=i % 8,
            slots_total=8,
            interval_s=3600.0,
            sent_at=now,
        )
        arrival = Arrival(request_id=f"r{i}", model="sim/bench", at=now)
        usage = UsageEvent.model_validate(usage_event(i, "bench", now) | {"model": "sim/bench"})
        out += [
            (subjects.heartbeat("sim/bench"), codec.encode(beat)),
            (subjects.arrivals("sim/bench"), codec.encode(arrival)),
            (subjects.usage("bench"), codec.encode(usage)),
        ]
    return out


def publisher_main(url: str, prefix: str, n: int) -> None:
    """Child process: publish the signal messages as fast as NATS takes them."""

    async def go() -> None:
        nc = await bus.connect(url, "bench-signal-publisher")
        for subject, body in signal_messages(Subjects(prefix), n):
            await nc.publish(subject, body)
        await nc.flush()
        await nc.close()

    asyncio.run(go())


async def signals_round(url: str, prefix: str, how: str, n: int) -> dict[str, float]:
    subjects = Subjects(prefix)
    nc = await bus.connect(url, f"bench-scaler-{prefix}")
    try:
        signals, stop = await subscribe_signals(nc, subjects, how)
        await nc.flush()
        cpu0 = time.process_time()
        started = time.perf_counter()
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.control_plane", "--publish", url, prefix, str(n), cwd=ROOT
        )
        async with asyncio.timeout(300):
            while True:
                view = signals.models.get("sim/bench")
                if (
                    view is not None
                    and view.arrivals >= n
                    and len(view.tokens) >= n
                    and len(view.live(time.monotonic())) >= n
                ):
                    break
                await asyncio.sleep(0.005)
        wall = time.perf_counter() - started
        cpu = time.process_time() - cpu0
        await child.wait()
        await stop()
        return {"per_s": 3 * n / wall, "cpu_us_per_message": 1e6 * cpu / (3 * n)}
    finally:
        await bus.close(nc)


async def subscribe_signals(nc: NATS, subjects: Subjects, how: str) -> tuple[Any, Any]:
    """The scaler's subscriptions: as the service has them, or as FastStream handlers.

    The FastStream handlers take typed contracts and apply them as the
    service's callbacks do after decoding.
    """
    from services.scaler.signals import BusSignals

    signals = BusSignals(nc, subjects)
    if how == "nats.py":
        await signals.start()

        async def stop_subs() -> None:
            await signals.workers.stop()

        return signals, stop_subs
    broker = control.ControlBroker(nc, name="bench-scaler")

    async def on_beat(beat: WorkerHeartbeat | None) -> None:
        if beat is not None:
            signals.workers.observe(beat)

    async def on_arrival(arrival: Arrival | None) -> None:
        if arrival is None:
            return
        view = signals.view(arrival.model)
        view.arrivals += 1
        view.last_arrival_at = time.monotonic()
        signals.arrived.set()

    async def on_usage(event: UsageEvent | None) -> None:
        if event is None:
            return
        tokens = event.prompt_tokens + event.completion_tokens
        signals.view(event.model).tokens.append((time.monotonic(), tokens))

    for subject, model, handler in (
        (subjects.heartbeat_all, WorkerHeartbeat, on_beat),
        (subjects.arrivals_all, Arrival, on_arrival),
        (subjects.usage_all, UsageEvent, on_usage),
    ):
        broker.subscriber(subject, decoder=typed(model))(handler)
    await broker.start()
    return signals, broker.stop


async def status_round(url: str, prefix: str, how: str, n: int) -> dict[str, float]:
    """The scaler's status request/reply with a fixed status of 8 models."""
    subjects = Subjects(prefix)
    server = await bus.connect(url, f"bench-scaler-{prefix}")
    client = await bus.connect(url, f"bench-client-{prefix}")
    status = {
        "type": "tg.scaler_status.v1",
        "backend": "local",
        "models": {f"m{i}": {"desired": 1, "ready": 1, "decisions": []} for i in range(8)},
    }

    async def reply() -> bytes:
        return codec.dumps(status)

    broker = None
    try:
        if how == "faststream":
            broker = control.ControlBroker(server, name="bench-scaler")
            broker.subscriber(subjects.scaler_status)(reply)
            await broker.start()
        else:

            async def on_status(msg: Msg) -> None:
                if msg.reply:
                    await msg.respond(await reply())

            await server.subscribe(subjects.scaler_status, cb=on_status)
        await server.flush()
        latencies = []
        for _ in range(n):
            t0 = time.perf_counter()
            await client.request(subjects.scaler_status, b"{}", timeout=5)
            latencies.append(time.perf_counter() - t0)
        latencies.sort()
        return {
            "p50_ms": 1000 * latencies[len(latencies) // 2],
            "p99_ms": 1000 * latencies[int(len(latencies) * 0.99)],
        }
    finally:
        if broker is not None:
            await broker.stop()
        await bus.close(server)
        await bus.close(client)


def bench_signals(url: str, rounds: int, quick: bool) -> dict[str, Any]:
    n = 10_000 if quick else 30_000
    runs: dict[str, list[dict[str, float]]] = {"nats.py": [], "faststream": []}
    status: dict[str, list[dict[str, float]]] = {"nats.py": [], "faststream": []}
    for r in range(rounds):
        for how in runs:
            prefix = f"s{r}{how[0]}"
            runs[how].append(asyncio.run(signals_round(url, prefix, how, n)))
            status[how].append(asyncio.run(status_round(url, prefix, how, 1000)))
    out: dict[str, Any] = {
        "signals": {how: {k: median([x[k] for x in v]) for k in v[0]} for how, v in runs.items()},
        "status": {how: {k: median([x[k] for x in v]) for k in v[0]} for how, v in status.items()},
        "messages": 3 * n,
    }
    out["signals"]["messages"] = 3 * n
    print(f"signals: {out}", flush=True)
    return out


# -- report --------------------------------------------------------------------


def _row(label: str, a: float, b: float, fmt: str = ".0f") -> str:
    ratio = f"{b / a:.3f}" if a else "n/a"
    return f"| {label} | {a:{fmt}} | {b:{fmt}} | {ratio} |"


def render(results: dict[str, Any]) -> str:
    """The section of docs/benchmarks.md."""
    lines = [
        "## Control plane: FastStream vs nats.py",
        "",
        f"Measured {results['date']}, `{results['command']}` (`python -m bench --only "
        "control` reruns it): each part's own handler run both ways on one nats-server, "
        "in alternating rounds, median of "
        f"{results['rounds']}. nats.py is the code each part had before FastStream; "
        "FastStream is a `tollgate.wire.control.ControlBroker` subscriber (typed contract "
        "in, same handler) on the same connection.",
        "",
        "| part | nats.py | FastStream | FastStream / nats.py |",
        "|---|---|---|---|",
    ]
    if "ledger" in results:
        what = {"budget": "keys with a budget", "no budget": "keys without one", "none": "no key"}
        for keys, r in results["ledger"].items():
            label = f"ledger: events/s counted, {what[keys]} ({r['events']})"
            lines.append(_row(label, r["nats.py"], r["faststream"]))
    if "query" in results:
        for label, r in results["query"].items():
            a, b = r["nats.py"], r["faststream"]
            lines.append(_row(f"query ({label}) p50 ms", a["p50_ms"], b["p50_ms"], ".3f"))
            lines.append(_row(f"query ({label}) p99 ms", a["p99_ms"], b["p99_ms"], ".3f"))
            lines.append(_row(f"query ({label}) req/s, 16 at once", a["per_s_c16"], b["per_s_c16"]))
    if "exchanges" in results:
        for label, r in results["exchanges"].items():
            lines.append(
                _row(f"captures stored/s, {label} ({r['messages']})", r["nats.py"], r["faststream"])
            )
    if "signals" in results:
        s, st = results["signals"]["signals"], results["signals"]["status"]
        lines.append(
            _row(
                f"scaler signals handled/s ({s['messages']})",
                s["nats.py"]["per_s"],
                s["faststream"]["per_s"],
            )
        )
        lines.append(
            _row(
                "scaler signals, CPU µs per message",
                s["nats.py"]["cpu_us_per_message"],
                s["faststream"]["cpu_us_per_message"],
                ".1f",
            )
        )
        lines.append(
            _row("scaler status p50 ms", st["nats.py"]["p50_ms"], st["faststream"]["p50_ms"], ".3f")
        )
        lines.append(
            _row("scaler status p99 ms", st["nats.py"]["p99_ms"], st["faststream"]["p99_ms"], ".3f")
        )
    lines += [
        "",
        "The auth service's budget ledger runs on FastStream: its work is one to three KV "
        "round trips per usage event, and the two ways count at the same rate (the ratio "
        "falls on either side of 1 from run to run). The metering query responder, the "
        "capture and replay consumers and the scaler's signals and status stay on nats.py: "
        "there the bus is most of the cost, and FastStream's per-message work (context, "
        "middlewares, dependency injection, one `fetch` per batch call) made them slower.",
    ]
    return "\n".join(lines) + "\n"


def bench_control_plane(work: Path, quick: bool, rounds: int = 3) -> dict[str, Any]:
    """Every part, on a nats-server of its own; the results for :func:`render`."""
    results: dict[str, Any] = {"rounds": rounds}
    policy = asyncio.get_event_loop_policy()
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())  # the services run on uvloop
    try:
        with P.processes(work, {}) as procs:
            url = P.start_nats(procs)
            results["ledger"] = bench_ledger(url, rounds, quick)
            results["query"] = bench_query(url, rounds, quick, work)
            results["exchanges"] = bench_exchanges(url, rounds, quick, work)
            results["signals"] = bench_signals(url, rounds, quick)
    finally:
        asyncio.set_event_loop_policy(policy)
    return results


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--publish":
        publisher_main(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    ns = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tollgate-bench-") as tmp:
        results = bench_control_plane(Path(tmp), ns.quick, ns.rounds)
    results["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results["command"] = "python -m bench.control_plane" + (" --quick" if ns.quick else "")
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "control_plane.json").write_text(json.dumps(results, indent=2))
    print()
    print(render(results))


if __name__ == "__main__":
    main()
