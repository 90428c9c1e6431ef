"""Where workers run: local processes or Kubernetes Deployments, behind one interface.

A backend is told how many workers a model should have and, for a scale-down,
which workers to remove first (the least busy). Removing a worker is always a
drain: it gets SIGTERM, stops fetching, finishes what it runs and exits
(``services.worker`` drains on SIGTERM; on Kubernetes the kubelet sends it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

from tollgate.runtime.procs import die_with_parent
from tollgate.wire.subjects import model_token

log = logging.getLogger("tollgate.scaler")


@dataclass(frozen=True)
class Replicas:
    """What a backend runs for one model."""

    desired: int  # the count it is converging to
    running: int  # processes or pods that exist and are not being removed
    ready: int | None = None  # what the backend itself reports ready, if it knows
    waiting_for_gpus: int = 0  # wanted, but not started: no free GPUs for them (local)


class Backend(Protocol):
    name: str

    async def start(self) -> None: ...

    async def current(self, model: str) -> Replicas: ...

    async def scale(self, model: str, replicas: int, victims: list[str]) -> None: ...

    async def close(self) -> None: ...


# -- local processes ---------------------------------------------------------


@dataclass
class LocalWorker:
    worker_id: str
    model: str
    proc: asyncio.subprocess.Process
    log_file: IO[bytes]
    gpus: list[str] = field(default_factory=list)  # its CUDA_VISIBLE_DEVICES, held until it exits
    started_at: float = field(default_factory=time.monotonic)
    drain_started_at: float | None = None
    killed: bool = False

    @property
    def draining(self) -> bool:
        return self.drain_started_at is not None


def kill_group(pgid: int) -> bool:
    """SIGKILL every process left in a worker's process group; whether there was one.

    A worker starts in its own session, so its group id is its pid, and its
    engine processes (vLLM's engine core, its GPU workers) are in that group.
    Called only for a worker that is still running or that this backend has
    just reaped: while the group has members its id is not handed out again,
    and an empty group's id would have to be reused, within one reconcile
    round, by a new process that also leads its own group.
    """
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return False  # nothing left
    except PermissionError:  # pragma: no cover - a group of another user's: not ours
        return False
    return True


def group_exists(pgid: int) -> bool:
    """Whether any process (a zombie included) is left in the process group."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - someone else's group
        return True
    return True


class GpuPool:
    """The GPUs local workers share: each worker gets its own devices, none shared.

    ``devices`` are CUDA device ids or UUIDs, as ``CUDA_VISIBLE_DEVICES`` takes
    them. A worker is given the first free devices in the order configured.
    """

    def __init__(self, devices: Sequence[str]) -> None:
        self.devices = list(devices)
        self._free = list(devices)

    @property
    def free(self) -> list[str]:
        return list(self._free)

    def take(self, count: int) -> list[str] | None:
        """``count`` free devices, now held by the caller; None when fewer are free."""
        if count > len(self._free):
            return None
        taken, self._free = self._free[:count], self._free[count:]
        return taken

    def give(self, devices: Sequence[str]) -> None:
        """Devices a worker no longer holds (it exited)."""
        back = set(devices) & (set(self.devices) - set(self._free))
        self._free = [d for d in self.devices if d in back or d in self._free]


# What a local worker process inherits from the scaler's environment: the
# process basics, the engine's and the model sources' own variables, and
# Tollgate's common and worker settings. Other services' settings (the
# scaler's own, admin tokens, ClickHouse passwords) and the scaler's identity
# on the bus stay with the scaler.
_WORKER_ENV = re.compile(
    r"(PATH|HOME|USER|LANG|LC_\w+|TZ|TMPDIR|PYTHON\w*|VIRTUAL_ENV|LD_LIBRARY_PATH"
    r"|VLLM_\w+|CUDA_\w+|NVIDIA_\w+|OMP_\w+|MKL_\w+|TORCH\w*|HF_\w+|TRANSFORMERS_\w+"
    r"|AWS_\w+|OTEL_\w+|TOLLGATE_WORKER_\w+)"
)
_NOT_COMMON = ("ROUTER", "AUTH", "METERING", "SCALER", "ADMIN", "API", "NATS_NKEY")


def worker_environment(environ: Mapping[str, str], nkey_file: Path | None) -> dict[str, str]:
    """The environment a local worker starts with: only what a worker needs.

    ``nkey_file`` is the workers' own identity on the bus; without one they
    connect with none (a bus without authentication).
    """
    env = {}
    for name, value in environ.items():
        common = name.startswith("TOLLGATE_") and not name[9:].startswith(_NOT_COMMON)
        if common or _WORKER_ENV.fullmatch(name):
            env[name] = value
    if nkey_file is not None:
        env["TOLLGATE_NATS_NKEY_FILE"] = str(nkey_file)
    return env


def worker_argv(model: str) -> list[str]:
    """The command line of a local worker for ``model``."""
    return [sys.executable, "-m", "services.worker", "--model", model]


class LocalBackend:
    """``services.worker`` processes on this machine, restarted when they crash.

    Each worker runs in its own session: its process group holds its engine
    processes too. A worker still running ``drain_timeout_s`` after SIGTERM is
    killed with its whole group; a worker that exits (drained, crashed, killed
    from outside) has whatever is left of its group killed when it is reaped,
    so no engine outlives its worker.

    With ``gpus`` (device ids), each worker gets ``gpus_per_worker(model)`` of
    them as ``CUDA_VISIBLE_DEVICES``, held until it exits; a worker that finds
    too few free waits (the target stands) and starts when enough are freed.
    Without, workers see the GPUs the scaler sees.
    """

    name = "local"

    def __init__(
        self,
        env: dict[str, str],
        logs_dir: Path,
        *,
        drain_timeout_s: float = 150.0,
        on_restart: Callable[[str], None] | None = None,
        reconcile_s: float = 0.25,
        gpus: Sequence[str] = (),
        gpus_per_worker: Callable[[str], int] = lambda model: 1,
        argv: Callable[[str], list[str]] | None = None,
    ) -> None:
        self.env = env
        self.logs_dir = logs_dir
        self.drain_timeout_s = drain_timeout_s
        self.on_restart = on_restart
        self.reconcile_s = reconcile_s
        self.gpus = GpuPool(gpus) if gpus else None
        self.gpus_per_worker = gpus_per_worker
        self.argv = argv or worker_argv  # tests start stand-ins
        self.workers: dict[str, list[LocalWorker]] = {}
        self.target: dict[str, int] = {}
        self.waiting_for_gpus: dict[str, int] = {}
        self._gpu_line: list[str] = []  # models waiting for GPUs, first come first
        self._crashes: dict[str, int] = {}
        self._not_before: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        self._task = asyncio.create_task(self._reconcile_loop(), name="local-backend")

    def active(self, model: str) -> list[LocalWorker]:
        return [w for w in self.workers.get(model, []) if not w.draining]

    async def current(self, model: str) -> Replicas:
        return Replicas(
            self.target.get(model, 0),
            len(self.active(model)),
            waiting_for_gpus=self.waiting_for_gpus.get(model, 0),
        )

    async def scale(self, model: str, replicas: int, victims: list[str]) -> None:
        async with self._lock:
            self.target[model] = replicas
            active = self.active(model)
            excess = len(active) - replicas
            if excess > 0:
                rank = {wid: i for i, wid in enumerate(victims)}
                # named victims first (least busy first), then the newest processes
                ordered = sorted(
                    active, key=lambda w: (rank.get(w.worker_id, len(rank)), -w.started_at)
                )
                for worker in ordered[:excess]:
                    self._drain(worker)
            await self._converge(model)

    def _drain(self, worker: LocalWorker) -> None:
        log.info("draining worker", extra={"worker_id": worker.worker_id, "model": worker.model})
        worker.drain_started_at = time.monotonic()
        with contextlib.suppress(ProcessLookupError):
            # the worker alone: it drains, then shuts its engine down itself
            worker.proc.send_signal(signal.SIGTERM)

    def _kill(self, worker: LocalWorker) -> None:
        """The worker and its engine processes, at once."""
        worker.killed = True
        kill_group(worker.proc.pid)

    async def _spawn(self, model: str, gpus: list[str]) -> None:
        worker_id = f"{model_token(model)[:48]}-{uuid.uuid4().hex[:8]}"
        path = self.logs_dir / f"worker-{model_token(model)[:48]}-{worker_id[-8:]}.log"
        log_file = open(path, "ab")  # kept open for the child's lifetime
        env = {**self.env, "TOLLGATE_WORKER_WORKER_ID": worker_id}
        if self.gpus is not None:
            # nvidia-smi's numbering, not CUDA's fastest-first default
            env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.argv(model),
                env=env,
                stdout=log_file,
                stderr=log_file,
                start_new_session=True,  # its own process group, with its engine
                # SIGTERM (a drain) if the scaler dies, so no worker is orphaned
                preexec_fn=die_with_parent,
            )
        except BaseException:
            log_file.close()
            raise
        worker = LocalWorker(worker_id, model, proc, log_file, gpus)
        self.workers.setdefault(model, []).append(worker)
        log.info(
            "worker started",
            extra={"worker_id": worker_id, "model": model, "pid": proc.pid, "gpus": gpus},
        )

    def _reap(self, worker: LocalWorker, code: int) -> None:
        """A worker has exited: what is left of its process group goes, its GPUs are free."""
        self.workers[worker.model].remove(worker)
        worker.log_file.close()
        if kill_group(worker.proc.pid):
            log.warning(
                "worker left processes behind; killed them",
                extra={"worker_id": worker.worker_id, "model": worker.model, "code": code},
            )
        if self.gpus is not None:
            self.gpus.give(worker.gpus)

    def _take_gpus(self, model: str) -> list[str] | None:
        """The devices a new worker of ``model`` gets ([] without a pool); None: not now.

        Models that wait for GPUs get them in the order they began to wait, so
        a model that needs several is not starved by smaller ones that would
        take each GPU as it is freed. A model that needs more than the pool
        has waits for ever and holds up no one.
        """
        if self.gpus is None:
            return []
        total = len(self.gpus.devices)
        for waiter in self._gpu_line:
            if waiter == model:
                break
            if self.gpus_per_worker(waiter) <= total:
                return None  # another model waits ahead of this one
        return self.gpus.take(self.gpus_per_worker(model))

    def _waiting(self, model: str, count: int) -> None:
        """Note (and log once per episode) the workers that wait for GPUs."""
        before = self.waiting_for_gpus.get(model, 0)
        self.waiting_for_gpus[model] = count
        if count and model not in self._gpu_line:
            self._gpu_line.append(model)
        elif not count and model in self._gpu_line:
            self._gpu_line.remove(model)
        if count and not before and self.gpus is not None:
            need = self.gpus_per_worker(model)
            extra = {
                "model": model,
                "waiting": count,
                "gpus_per_worker": need,
                "gpus_free": len(self.gpus.free),
                "gpus": len(self.gpus.devices),
            }
            if need > len(self.gpus.devices):
                log.error("a worker needs more GPUs than the scaler has; none starts", extra=extra)
            else:
                log.warning("not enough free GPUs; workers start as GPUs are freed", extra=extra)
        elif before and not count:
            log.info("no worker waits for GPUs any more", extra={"model": model})

    async def _converge(self, model: str) -> None:
        """Reap exited workers; start missing ones (with back-off after crashes)."""
        now = time.monotonic()
        for worker in list(self.workers.get(model, [])):
            code = worker.proc.returncode
            if code is None:
                if worker.draining and not worker.killed:
                    overdue = now - (worker.drain_started_at or now) - self.drain_timeout_s
                    if overdue > 0:
                        log.warning(
                            "worker still draining after the drain timeout; killed",
                            extra={"worker_id": worker.worker_id, "model": model},
                        )
                        self._kill(worker)
                continue
            self._reap(worker, code)
            if worker.draining:
                log.info("worker stopped", extra={"worker_id": worker.worker_id, "code": code})
                continue
            crashes = self._crashes.get(model, 0) + 1 if now - worker.started_at < 30 else 1
            self._crashes[model] = crashes
            self._not_before[model] = now + min(60.0, 2.0 ** (crashes - 1))
            log.warning(
                "worker exited unexpectedly; restarting",
                extra={"worker_id": worker.worker_id, "model": model, "code": code},
            )
            if self.on_restart is not None:
                self.on_restart(model)
        missing = self.target.get(model, 0) - len(self.active(model))
        if missing > 0 and now >= self._not_before.get(model, 0.0):
            while missing > 0:
                gpus = self._take_gpus(model)
                if gpus is None:
                    break
                try:
                    await self._spawn(model, gpus)
                except BaseException:
                    if self.gpus is not None:
                        self.gpus.give(gpus)
                    raise
                missing -= 1
        self._waiting(model, max(0, missing) if self.gpus is not None else 0)

    async def _reconcile_loop(self) -> None:
        while True:
            await asyncio.sleep(self.reconcile_s)
            async with self._lock:
                for model in list(self.workers.keys() | self.target.keys()):
                    try:
                        await self._converge(model)
                    except Exception:
                        log.exception("reconciling workers failed", extra={"model": model})

    async def close(self) -> None:
        """Drain every worker this backend started and wait for them (and their engines) to exit."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        everyone = [w for ws in self.workers.values() for w in ws]
        for worker in everyone:
            if not worker.draining:
                self._drain(worker)

        async def stopped(worker: LocalWorker) -> None:
            try:
                await asyncio.wait_for(worker.proc.wait(), self.drain_timeout_s)
            except TimeoutError:
                self._kill(worker)
                await worker.proc.wait()
            self._reap(worker, worker.proc.returncode or 0)
            # what was killed is gone before the scaler is (bounded: a zombie
            # nobody reaps would otherwise hold us up); no event says so
            for _ in range(100):
                if not group_exists(worker.proc.pid):
                    break
                await asyncio.sleep(0.05)

        await asyncio.gather(*(stopped(w) for w in everyone))
        self.workers.clear()


# -- Kubernetes ----------------------------------------------------------------

# Annotation that makes the ReplicaSet controller remove this pod first on a
# scale-down (lower cost goes first).
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"


def deployment_name(model: str) -> str:
    """Default Deployment name for a model: ``tollgate-worker-<slug>`` (DNS-1123)."""
    slug = re.sub(r"[^a-z0-9]+", "-", model.lower()).strip("-")[:40].strip("-")
    return f"tollgate-worker-{slug or 'model'}"


class KubernetesBackend:
    """One Deployment per model; replicas set through its ``scale`` subresource.

    API calls it makes (and the only RBAC verbs it needs, see
    ``deploy/kubernetes/base/scaler-rbac.yaml``):

    - ``get deployments``: spec and ready replicas;
    - ``patch deployments/scale``: the replica count;
    - ``patch pods``: the deletion-cost annotation on the workers to remove first.
    """

    name = "kubernetes"

    def __init__(
        self,
        namespace: str,
        deployments: dict[str, str] | None = None,
        api_client: Any = None,
    ) -> None:
        self.namespace = namespace
        self.deployments = deployments or {}
        self._client = api_client
        self.apps: Any = None
        self.core: Any = None

    def deployment(self, model: str) -> str:
        return self.deployments.get(model) or deployment_name(model)

    async def start(self) -> None:
        from kubernetes import client, config

        if self._client is None:
            try:
                config.load_incluster_config()  # type: ignore[no-untyped-call]
            except config.ConfigException:
                await asyncio.to_thread(config.load_kube_config)
            self._client = client.ApiClient()
        self.apps = client.AppsV1Api(self._client)
        self.core = client.CoreV1Api(self._client)

    async def current(self, model: str) -> Replicas:
        from kubernetes.client.exceptions import ApiException

        try:
            dep = await asyncio.to_thread(
                self.apps.read_namespaced_deployment, self.deployment(model), self.namespace
            )
        except ApiException as exc:
            if exc.status == 404:
                return Replicas(0, 0, 0)
            raise
        desired = dep.spec.replicas or 0
        ready = (dep.status.ready_replicas or 0) if dep.status else 0
        return Replicas(desired, desired, ready)

    async def scale(self, model: str, replicas: int, victims: list[str]) -> None:
        from kubernetes.client.exceptions import ApiException

        current = await self.current(model)
        for pod in victims[: max(0, current.desired - replicas)]:
            patch = {"metadata": {"annotations": {DELETION_COST: "-1000"}}}
            try:
                await asyncio.to_thread(self.core.patch_namespaced_pod, pod, self.namespace, patch)
            except ApiException as exc:
                if exc.status != 404:  # the pod is gone already: nothing to mark
                    raise
        await asyncio.to_thread(
            self.apps.patch_namespaced_deployment_scale,
            self.deployment(model),
            self.namespace,
            {"spec": {"replicas": replicas}},
        )

    async def close(self) -> None:
        if self._client is not None:
            await asyncio.to_thread(self._client.close)
