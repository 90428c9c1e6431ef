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
import re
import signal
import sys
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

from tollgate.wire.subjects import model_token

log = logging.getLogger("tollgate.scaler")


@dataclass(frozen=True)
class Replicas:
    """What a backend runs for one model."""

    desired: int  # the count it is converging to
    running: int  # processes or pods that exist and are not being removed
    ready: int | None = None  # what the backend itself reports ready, if it knows


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
    started_at: float = field(default_factory=time.monotonic)
    drain_started_at: float | None = None
    killed: bool = False

    @property
    def draining(self) -> bool:
        return self.drain_started_at is not None


def _die_with_parent() -> None:
    """In the child: get SIGTERM (and drain) if the scaler dies, so none is orphaned."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: a crashed scaler leaves its workers to the operator


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


class LocalBackend:
    """``services.worker`` processes on this machine, restarted when they crash."""

    name = "local"

    def __init__(
        self,
        env: dict[str, str],
        logs_dir: Path,
        *,
        drain_timeout_s: float = 150.0,
        on_restart: Callable[[str], None] | None = None,
        reconcile_s: float = 0.25,
    ) -> None:
        self.env = env
        self.logs_dir = logs_dir
        self.drain_timeout_s = drain_timeout_s
        self.on_restart = on_restart
        self.reconcile_s = reconcile_s
        self.workers: dict[str, list[LocalWorker]] = {}
        self.target: dict[str, int] = {}
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
        return Replicas(self.target.get(model, 0), len(self.active(model)))

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
            worker.proc.send_signal(signal.SIGTERM)

    async def _spawn(self, model: str) -> None:
        worker_id = f"{model_token(model)[:48]}-{uuid.uuid4().hex[:8]}"
        path = self.logs_dir / f"worker-{model_token(model)[:48]}-{worker_id[-8:]}.log"
        log_file = open(path, "ab")  # kept open for the child's lifetime
        env = {**self.env, "TOLLGATE_WORKER_WORKER_ID": worker_id}
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "services.worker",
            "--model",
            model,
            env=env,
            stdout=log_file,
            stderr=log_file,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        self.workers.setdefault(model, []).append(LocalWorker(worker_id, model, proc, log_file))
        log.info(
            "worker started",
            extra={"worker_id": worker_id, "model": model, "pid": proc.pid},
        )

    async def _converge(self, model: str) -> None:
        """Reap exited workers; start missing ones (with back-off after crashes)."""
        now = time.monotonic()
        for worker in list(self.workers.get(model, [])):
            code = worker.proc.returncode
            if code is None:
                if worker.draining and not worker.killed:
                    overdue = now - (worker.drain_started_at or now) - self.drain_timeout_s
                    if overdue > 0:
                        worker.killed = True
                        with contextlib.suppress(ProcessLookupError):
                            worker.proc.kill()
                continue
            self.workers[model].remove(worker)
            worker.log_file.close()
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
            for _ in range(missing):
                await self._spawn(model)

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
        """Drain every worker this backend started and wait for them to exit."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        everyone = [w for ws in self.workers.values() for w in ws]
        for worker in everyone:
            if not worker.draining:
                self._drain(worker)
        for worker in everyone:
            try:
                await asyncio.wait_for(worker.proc.wait(), self.drain_timeout_s)
            except TimeoutError:
                worker.proc.kill()
                await worker.proc.wait()
            worker.log_file.close()
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
