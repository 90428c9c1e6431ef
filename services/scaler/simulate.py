"""``tollgate scaler simulate``: replay a demand trace against scaling strategies.

A trace gives the request rate per minute of one day (CSV ``minute,requests_per_s``;
a synthetic day with a morning ramp, a lunch peak and a quiet night ships in
``services/scaler/traces/``). The simulation runs that day in accelerated time,
one-second steps: Poisson arrivals, exponential request durations, workers
with a fixed number of slots and a start-up delay, a FIFO queue in front of
them. It compares three strategies with the same arrivals:

- ``fixed-max``: ``max_replicas`` workers all day;
- ``reactive``: the scaler's :class:`Policy` without history;
- ``reactive+predictive``: the same policy with a demand profile built, as the
  scaler builds it from ClickHouse, from a different simulated day of the trace.

It reports replica-hours (the GPU cost; a worker counts from its start until
it has drained), the wait before a request starts (p50/p95/p99, max) and how
many requests waited longer than ``--slow-s`` seconds.
"""

from __future__ import annotations

import argparse
import csv
import heapq
import math
import random
import sys
from collections import deque
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import orjson

from services.scaler.policy import Policy, Signals
from services.scaler.profile import DemandProfile
from tollgate.models.catalog import ScalingPolicy

MODEL = "simulated"
# Monday 1970-01-05 00:00 UTC: the simulated day starts on a Monday.
_DAY0 = 4 * 86400.0


def load_trace(path: Path | None) -> list[float]:
    """Requests per second for each minute of the day (1440 values)."""
    if path is None:
        text = resources.files("services.scaler").joinpath("traces/synthetic-day.csv").read_text()
    else:
        text = Path(path).read_text()
    rows = [r for r in csv.DictReader(text.splitlines()) if r]
    rates = [0.0] * 1440
    for row in rows:
        rates[int(row["minute"]) % 1440] = float(row["requests_per_s"])
    return rates


def synthetic_day() -> list[float]:
    """The shipped trace: quiet night, morning ramp, lunch peak, afternoon, evening decline."""
    rates = []
    for minute in range(1440):
        h = minute / 60
        if h < 6:
            rate = 0.5
        elif h < 9:
            rate = 0.5 + 11.5 * (1 - math.cos(math.pi * (h - 6) / 3)) / 2
        elif h < 12:
            rate = 12.0
        elif h < 13.5:
            rise = min(1.0, (h - 12) * 30)  # to the top in two minutes
            rate = 12.0 + 18.0 * rise
        elif h < 18:
            rate = 14.0
        elif h < 22:
            rate = 14.0 - 12.0 * (h - 18) / 4
        else:
            rate = 2.0 - 1.5 * (h - 22) / 2
        rates.append(round(rate, 3))
    return rates


def write_trace(path: Path, rates: list[float]) -> None:
    lines = ["minute,requests_per_s", *(f"{m},{r}" for m, r in enumerate(rates))]
    path.write_text("\n".join(lines) + "\n")


@dataclass(frozen=True)
class Workload:
    rates: list[float]
    service_s: float = 8.0
    seed: int = 1

    def arrivals(self) -> list[tuple[int, float]]:
        """(arrival second, duration) for every request of the day."""
        rng = random.Random(self.seed)
        out: list[tuple[int, float]] = []
        for second in range(86400):
            lam = self.rates[second // 60]
            # Poisson arrivals: inter-arrival gaps within this second
            t = rng.expovariate(lam) if lam > 0 else 2.0
            while t < 1.0:
                out.append((second, rng.expovariate(1.0 / self.service_s)))
                t += rng.expovariate(lam)
        return out


def history_profile(workload: Workload) -> DemandProfile:
    """Hour-of-week load from another day of the same trace, computed as the scaler does."""
    busy = [0.0] * (86400 // 300)
    for second, duration in Workload(
        workload.rates, workload.service_s, workload.seed + 1000
    ).arrivals():
        busy[min(len(busy) - 1, int(second + duration) // 300)] += duration
    hourly = [max(busy[h * 12 : h * 12 + 12]) / 300 for h in range(24)]
    return DemandProfile.from_day(MODEL, hourly)


@dataclass
class Outcome:
    strategy: str
    requests: int
    replica_hours: float
    wait_p50: float
    wait_p95: float
    wait_p99: float
    wait_max: float
    waited_over: int
    scale_events: int


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def rates_at_start(requests: list[tuple[int, float]]) -> float:
    """Requests in flight at midnight, estimated from the first minute."""
    first = [d for t, d in requests if t < 60]
    return sum(first) / 60


def run_strategy(
    strategy: str,
    requests: list[tuple[int, float]],
    config: ScalingPolicy,
    *,
    slots: int,
    startup_s: float,
    tick_s: float,
    slow_s: float,
    profile: DemandProfile | None,
) -> Outcome:
    fixed = strategy == "fixed-max"
    policy = Policy(config)
    # each worker: the second it is ready; replica-seconds are summed as they pass
    workers: list[float] = [0.0] * config.max_replicas if fixed else []
    draining_until: list[float] = []
    queue: deque[tuple[int, float]] = deque()
    running: list[float] = []  # end times (heap)
    waits: list[float] = []
    replica_s = 0.0
    events = 0
    index = 0
    if not fixed:
        # the day starts as the previous night ended: the load's workers are up
        start = max(config.min_replicas, math.ceil(rates_at_start(requests) / slots))
        workers = [0.0] * start
        policy.state.desired = start
        policy.state.last_active_at = 0.0 if start else None
    for now in range(86400):
        while index < len(requests) and requests[index][0] == now:
            queue.append(requests[index])
            index += 1
        while running and running[0] <= now:
            heapq.heappop(running)
        ready = sum(1 for r in workers if r <= now)
        free = ready * slots - len(running)
        while free > 0 and queue:
            arrived, duration = queue.popleft()
            waits.append(now - arrived)
            heapq.heappush(running, now + duration)
            free -= 1
        if not fixed and now % tick_s == 0:
            ttr = startup_s + tick_s
            signals = Signals(
                now=float(now),
                queued=len(queue),
                running=len(running),
                slots_per_worker=slots,
                ready=ready,
                starting=len(workers) - ready,
                predicted_load=profile.ahead(MODEL, _DAY0 + now, ttr) if profile else None,
            )
            decision = policy.decide(signals)
            if decision.changed:
                events += 1
                while len(workers) < decision.desired:
                    workers.append(now + startup_s)
                while len(workers) > decision.desired:
                    # remove a starting worker first, else a ready one (it drains)
                    workers.sort()
                    gone = workers.pop()
                    if gone <= now:
                        longest = max(running, default=float(now))
                        draining_until.append(longest)  # until its requests finish
        draining_until = [t for t in draining_until if t > now]
        replica_s += len(workers) + len(draining_until)
    return Outcome(
        strategy=strategy,
        requests=len(requests),
        replica_hours=round(replica_s / 3600, 1),
        wait_p50=round(_quantile(waits, 0.50), 2),
        wait_p95=round(_quantile(waits, 0.95), 2),
        wait_p99=round(_quantile(waits, 0.99), 2),
        wait_max=round(max(waits, default=0.0), 2),
        waited_over=sum(1 for w in waits if w > slow_s),
        scale_events=events,
    )


def simulate(
    rates: list[float],
    *,
    max_replicas: int = 12,
    slots: int = 32,
    service_s: float = 8.0,
    startup_s: float = 70.0,
    tick_s: int = 5,
    slow_s: float = 10.0,
    seed: int = 1,
    policy: ScalingPolicy | None = None,
) -> list[Outcome]:
    workload = Workload(rates, service_s, seed)
    requests = workload.arrivals()
    base = policy or ScalingPolicy(
        min_replicas=0,
        max_replicas=max_replicas,
        scale_down_window_s=300,
        scale_down_cooldown_s=60,
        scale_to_zero_after_s=900,
        time_to_ready_s=startup_s,
    )
    profile = history_profile(workload)
    strategies = [
        ("fixed-max", base, None),
        ("reactive", base.model_copy(update={"predictive": False}), None),
        ("reactive+predictive", base.model_copy(update={"predictive": True}), profile),
    ]
    return [
        run_strategy(
            name,
            requests,
            config,
            slots=slots,
            startup_s=startup_s,
            tick_s=tick_s,
            slow_s=slow_s,
            profile=prof,
        )
        for name, config, prof in strategies
    ]


def render(outcomes: list[Outcome], slow_s: float) -> str:
    fixed = outcomes[0]
    lines = [
        f"| strategy | replica-hours | vs fixed | wait p50 s | wait p95 s | wait p99 s | "
        f"max wait s | waited > {slow_s:g} s | scale events |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        share = o.replica_hours / fixed.replica_hours if fixed.replica_hours else 0.0
        lines.append(
            f"| {o.strategy} | {o.replica_hours} | {share:.0%} | {o.wait_p50} | {o.wait_p95} | "
            f"{o.wait_p99} | {o.wait_max} | {o.waited_over} of {o.requests} | {o.scale_events} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tollgate scaler simulate", description=__doc__)
    parser.add_argument("--trace", type=Path, help="CSV minute,requests_per_s (default: shipped)")
    parser.add_argument("--max-replicas", type=int, default=12)
    parser.add_argument("--slots", type=int, default=32, help="requests a worker runs at once")
    parser.add_argument("--service-s", type=float, default=8.0, help="mean request duration")
    parser.add_argument("--startup-s", type=float, default=70.0, help="worker time-to-ready")
    parser.add_argument("--tick-s", type=int, default=5, help="seconds between decisions")
    parser.add_argument("--slow-s", type=float, default=10.0, help="report waits over this")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ns = parser.parse_args(argv)
    try:
        rates = load_trace(ns.trace)
    except (OSError, KeyError, ValueError) as exc:
        print(f"error: cannot read the trace: {exc}", file=sys.stderr)
        return 2
    outcomes = simulate(
        rates,
        max_replicas=ns.max_replicas,
        slots=ns.slots,
        service_s=ns.service_s,
        startup_s=ns.startup_s,
        tick_s=ns.tick_s,
        slow_s=ns.slow_s,
        seed=ns.seed,
    )
    if ns.json:
        print(orjson.dumps([o.__dict__ for o in outcomes], option=orjson.OPT_INDENT_2).decode())
    else:
        print(render(outcomes, ns.slow_s))
    return 0
