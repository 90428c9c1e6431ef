"""The scaler: one decision per model per tick, applied through a backend.

Each tick (and at once when a request arrives for a model with no worker) it
gathers the model's signals, asks the model's :class:`Policy`, and when the
desired count changes it applies it through the backend and publishes the
decision, with its inputs and reason, on ``tg.scale.<model-token>``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from services.scaler.backends import Backend, KubernetesBackend, LocalBackend, Replicas
from services.scaler.metrics import ScalerMetrics
from services.scaler.policy import Decision, Policy, PolicyState, Signals
from services.scaler.profile import HISTORY_SQL, DemandProfile
from services.scaler.settings import ScalerSettings
from services.scaler.signals import BusSignals
from tollgate.analytics import MeteringUnavailable, run_query
from tollgate.models.catalog import Catalog, ModelEntry
from tollgate.runtime.ops import add_ops_routes
from tollgate.runtime.settings import CommonSettings
from tollgate.wire import bus, codec
from tollgate.wire.contracts import WorkerState
from tollgate.wire.topology import Role, Topology

log = logging.getLogger("tollgate.scaler")

# The least time between two rounds of decisions that arrivals woke.
_MIN_TICK_GAP_S = 0.2

SCALER = web.AppKey("scaler", object)


def catalog_slots(entry: ModelEntry) -> int:
    """A worker's slots before its first heartbeat says: from the catalog's engine settings."""
    if entry.simulated is not None:
        return entry.simulated.max_num_seqs
    args = " ".join(entry.engine_args)
    match = re.search(r"--max-num-seqs[ =](\d+)", args)
    return int(match.group(1)) if match else 256  # vLLM's default


class Scaler:
    def __init__(
        self,
        nc: NATS,
        settings: ScalerSettings,
        common: CommonSettings,
        catalog: Catalog,
        backend: Backend,
        metrics: ScalerMetrics,
    ) -> None:
        self.nc = nc
        self.settings = settings
        self.subjects = common.subjects
        self.catalog = catalog
        self.backend = backend
        self.metrics = metrics
        self.signals = BusSignals(nc, self.subjects, settings.heartbeat_misses)
        ids = settings.models or list(catalog.models)
        self.entries = {mid: catalog.get(mid) for mid in ids}
        self.policies: dict[str, Policy] = {}
        self.decisions: dict[str, deque[dict[str, Any]]] = {
            mid: deque(maxlen=settings.decisions_kept) for mid in self.entries
        }
        self.profile = DemandProfile()
        self._last: dict[str, Signals] = {}
        self._replicas: dict[str, Replicas] = {}
        self._task: asyncio.Task[None] | None = None
        self._profile_task: asyncio.Task[None] | None = None

    # -- lifecycle -----------------------------------------------------------

    async def start(self) -> None:
        js = self.nc.jetstream()
        await Topology(self.subjects).ensure(js, Role.SCALER)
        await self.backend.start()
        warm = {self.catalog.get(m).id for m in self.settings.warm}
        now = time.monotonic()
        for mid, entry in self.entries.items():
            config = entry.scaling
            if mid in warm:
                config = config.model_copy(update={"min_replicas": max(1, config.min_replicas)})
            current = await self.backend.current(mid)
            state = PolicyState(
                desired=current.desired, last_active_at=now if current.desired else None
            )
            self.policies[mid] = Policy(config, state)
        await self.signals.start()
        await self.nc.subscribe(self.subjects.scaler_status, cb=self._on_status)
        self._task = asyncio.create_task(self._loop(), name="scaler")
        self._profile_task = asyncio.create_task(self._refresh_profile(), name="profile")
        log.info(
            "scaler started",
            extra={"backend": self.backend.name, "models": list(self.entries), "warm": list(warm)},
        )

    async def stop(self) -> None:
        for task in (self._task, self._profile_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await self.backend.close()

    # -- the loop ------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            started = time.monotonic()
            for model in self.entries:
                try:
                    await self.tick(model)
                    # a model without a ready worker wakes the loop on each arrival
                    await self.signals.follow_arrivals(model, self._last[model].ready == 0)
                except Exception:
                    log.exception("scaling decision failed", extra={"model": model})
            self.signals.arrived.clear()
            # an arrival for a model at zero must not wait for the next tick
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.tick_s):
                    await self.signals.arrived.wait()
            # a burst of arrivals during a cold start wakes a few ticks, not one each
            await asyncio.sleep(max(0.0, _MIN_TICK_GAP_S - (time.monotonic() - started)))

    async def gather(self, model: str) -> Signals:
        now_mono = time.monotonic()
        view = self.signals.view(model)
        beats = view.live(now_mono)
        ready = [b for b in beats if b.state is WorkerState.READY]
        draining = [b for b in beats if b.state is WorkerState.DRAINING]
        replicas = await self.backend.current(model)
        starting = max(0, replicas.running - len(ready))
        entry = self.entries[model]
        ttr = view.startup_s or entry.scaling.time_to_ready_s
        now = time.time()
        low = high = None
        for override in self.settings.schedule:
            if override.applies(model, now):
                low = override.min_replicas if override.min_replicas is not None else low
                high = override.max_replicas if override.max_replicas is not None else high
        self._replicas[model] = replicas
        return Signals(
            now=now_mono,
            queued=await self.signals.queued(model),
            running=sum(b.slots_used for b in ready + draining),
            slots_per_worker=view.slots_per_worker or catalog_slots(entry),
            ready=len(ready),
            starting=starting,
            draining=len(draining),
            tokens_per_s=round(view.tokens_per_s(now_mono), 3),
            predicted_load=self.profile.ahead(model, now, ttr + self.settings.tick_s),
            min_override=low,
            max_override=high,
        )

    async def tick(self, model: str) -> Decision:
        signals = await self.gather(model)
        self._last[model] = signals
        decision = self.policies[model].decide(signals)
        m = self.metrics
        m.desired.labels(model).set(decision.desired)
        m.ready.labels(model).set(signals.ready)
        m.starting.labels(model).set(signals.starting)
        m.draining.labels(model).set(signals.draining)
        m.queued.labels(model).set(signals.queued)
        m.predicted.labels(model).set(signals.predicted_load or 0)
        view = self.signals.view(model)
        if view.startup_s is not None:
            m.time_to_ready.labels(model).set(view.startup_s)
        replicas = self._replicas[model]
        if decision.changed or replicas.desired != decision.desired:
            await self.backend.scale(model, decision.desired, self._victims(model))
        if decision.changed:
            m.decisions.labels(model, decision.reason).inc()
            await self._publish(model, decision)
        return decision

    def _victims(self, model: str) -> list[str]:
        """Workers to remove first: starting ones, then the least busy."""
        beats = self.signals.view(model).live(time.monotonic())
        order = {WorkerState.STARTING: 0, WorkerState.READY: 1, WorkerState.DRAINING: 2}
        ranked = sorted(beats, key=lambda b: (order.get(b.state, 3), b.slots_used, b.worker_id))
        return [b.worker_id for b in ranked]

    async def _publish(self, model: str, decision: Decision) -> None:
        record = {
            "type": "tg.scale.v1",
            "model": model,
            "time": time.time(),
            "backend": self.backend.name,
            **decision.to_dict(),
        }
        self.decisions[model].append(record)
        log.info(
            "scale",
            extra={
                "model": model,
                "desired": decision.desired,
                "previous": decision.previous,
                "reason": decision.reason,
            },
        )
        try:
            await self.nc.jetstream().publish(self.subjects.scale(model), codec.dumps(record))
        except Exception as exc:  # the decision stands; only its audit record is late
            log.warning("decision not recorded: %s: %s", type(exc).__name__, exc)

    # -- history -------------------------------------------------------------

    async def _refresh_profile(self) -> None:
        if not any(p.config.predictive for p in self.policies.values()):
            return
        while True:
            wait = self.settings.history_refresh_s
            try:
                result = await run_query(
                    self.nc,
                    self.subjects,
                    HISTORY_SQL,
                    {"weeks": self.settings.history_weeks},
                    max_rows=200_000,
                )
                if result.error is not None:
                    log.warning("usage history query failed", extra={"error": result.error})
                    wait = min(wait, 60.0)
                else:
                    self.profile = DemandProfile.from_rows(result.rows, self.settings.history_weeks)
                    log.info("demand profile built", extra={"models": len(self.profile.loads)})
            except MeteringUnavailable as exc:
                log.warning("no usage history yet: %s", exc)
                wait = min(wait, 10.0)  # the metering service may still be starting
            await asyncio.sleep(wait)

    # -- status --------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        models = {}
        for mid, policy in self.policies.items():
            last = self._last.get(mid)
            replicas = self._replicas.get(mid)
            models[mid] = {
                "desired": policy.state.desired,
                "ready": last.ready if last else 0,
                "starting": last.starting if last else 0,
                "draining": last.draining if last else 0,
                "queued": last.queued if last else 0,
                "running": last.running if last else 0,
                "min_replicas": policy.config.min_replicas,
                "max_replicas": policy.config.max_replicas,
                "time_to_ready_s": self.signals.view(mid).startup_s,
                # local backend with TOLLGATE_SCALER_GPUS: workers wanted, not started
                "waiting_for_gpus": replicas.waiting_for_gpus if replicas else 0,
                "decisions": list(self.decisions[mid]),
            }
        return {"type": "tg.scaler_status.v1", "backend": self.backend.name, "models": models}

    async def _on_status(self, msg: Msg) -> None:
        if msg.reply:
            await msg.respond(codec.dumps(self.status()))


def make_backend(
    settings: ScalerSettings,
    common: CommonSettings,
    env: dict[str, str],
    metrics: ScalerMetrics,
    catalog: Catalog,
) -> Backend:
    if settings.backend == "kubernetes":
        return KubernetesBackend(settings.namespace, settings.deployments)
    return LocalBackend(
        env,
        common.var_dir / "logs",
        drain_timeout_s=settings.drain_timeout_s,
        on_restart=lambda model: metrics.restarts.labels(model).inc(),
        gpus=settings.gpus,
        gpus_per_worker=lambda model: catalog.get(model).tensor_parallel_size,
    )


def create_app(
    settings: ScalerSettings,
    common: CommonSettings,
    catalog: Catalog,
    env: dict[str, str],
) -> web.Application:
    app = web.Application()
    metrics = ScalerMetrics()

    async def service_ctx(app: web.Application) -> AsyncIterator[None]:
        nc = await common.connect(Role.SCALER, "scaler")
        scaler = Scaler(
            nc,
            settings,
            common,
            catalog,
            make_backend(settings, common, env, metrics, catalog),
            metrics,
        )
        await scaler.start()
        app[SCALER] = scaler
        yield
        await scaler.stop()  # local backend: drains the workers it started
        await bus.close(nc)

    app.cleanup_ctx.append(service_ctx)
    add_ops_routes(app, metrics.registry, {"scaler": lambda app: SCALER in app})
    return app
