"""The fuzz suite's fixtures: its seed, the admin API, and what each test checks at its end.

The seed is ``TOLLGATE_FUZZ_SEED`` when set, a fresh random one otherwise;
every failure message names it with the command that replays the run. Each
test draws from its own ``random.Random`` made from the seed and its name, so
a test replays alone.

The soak run (tests marked ``slow``) is skipped unless the marker expression
selects it: ``pytest -m slow tests/fuzz`` (``TOLLGATE_FUZZ_SOAK_S`` sets its
length, 900 s by default).
"""

from __future__ import annotations

import os
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from tests.conftest import EMBED_MODEL, SIM_MODEL, SLOW_MODEL, NatsServer, Service, Stack
from tests.fuzz.oracle import (
    Findings,
    error_lines,
    gauges,
    log_files,
    secret_parts,
    secrets_in_logs,
    settled_gauges,
)
from tests.router.test_auth import wait_status

SEED_ENV = "TOLLGATE_FUZZ_SEED"
SOAK_ENV = "TOLLGATE_FUZZ_SOAK_S"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "slow" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason=f"soak run: select it with -m slow ({SOAK_ENV} sets its length)")
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def fuzz_seed() -> int:
    given = os.environ.get(SEED_ENV)
    return int(given) if given else random.SystemRandom().randrange(2**32)


@pytest.fixture(scope="session")
def admin_api(stack: Stack, api_key: str) -> tuple[str, str]:
    """The auth service's admin API on the session stack: (base URL, admin token)."""
    _, base = stack.auth()
    return base, stack.admin_token()


@dataclass
class Fuzz:
    """What a fuzz test works with, and the checks every one ends with."""

    seed: int
    nodeid: str
    stack: Stack = field(repr=False)
    nats: NatsServer = field(repr=False)
    router_url: str
    admin_url: str
    api_key: str = field(repr=False)
    admin_token: str = field(repr=False)
    secrets: dict[str, str] = field(default_factory=dict, repr=False)
    log_offsets: dict[Path, int] = field(default_factory=dict, repr=False)
    gauges_at_start: dict[str, float] = field(default_factory=dict, repr=False)

    def rng(self, name: str = "") -> random.Random:
        return random.Random(f"{self.seed}:{self.nodeid}:{name}")

    def findings(self) -> Findings:
        rerun = f"{SEED_ENV}={self.seed} .venv/bin/pytest '{self.nodeid}'"
        return Findings(self.seed, rerun, self.secrets)

    def add_secret(self, name: str, token: str) -> None:
        for i, part in enumerate(secret_parts(token)):
            self.secrets[f"{name}{'' if i == 0 else f' (part {i})'}"] = part

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    @property
    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"}

    def logs(self) -> list[Path]:
        return log_files(self.stack.var_dir, self.nats.log.parent)

    def mark_logs(self) -> None:
        self.log_offsets = {s.log: s.log.stat().st_size for s in self._services()}

    def _services(self) -> list[Service]:
        """The services the suite drives: the session's router, the admin API's auth
        service and the simulated models' workers (not what other tests left running)."""
        ports = {str(urlsplit(url).port) for url in (self.router_url, self.admin_url)}
        return [
            s
            for s in self.stack.services
            if s.log.exists()
            and s.proc.poll() is None
            and (
                s.name in {f"worker-{m}" for m in (SIM_MODEL, SLOW_MODEL, EMBED_MODEL)}
                or (s.name in ("router", "auth") and ports & set(map(str, s.proc.args)))
            )
        ]

    async def create_key(self, **spec: object) -> tuple[str, str]:
        """A key issued by the admin API, known to the router: (token, key id)."""
        async with httpx.AsyncClient(timeout=30) as http:
            r = await http.post(f"{self.admin_url}/admin/keys", json=spec, headers=self.admin)
        assert r.status_code == 201, r.text
        token, key_id = r.json()["key"], r.json()["record"]["key_id"]
        self.add_secret(f"key of tenant {spec.get('tenant')!r}", token)
        await wait_status(self.router_url, token, 200)
        return token, key_id

    async def finish(self, findings: Findings) -> None:
        """The end of every fuzz test: gauges back to 0, no secret in a log, no error logged."""
        values = await settled_gauges(self.router_url)
        if any(values.values()):
            findings.note(
                "the router's gauges are not back to 0 after 30 s",
                f"{values} (at the start of the test: {self.gauges_at_start})",
            )
        for leak in secrets_in_logs(self.logs(), self.secrets):
            findings.note("a secret is in a log file", leak)
        for service in self._services():
            lines = error_lines(service.log, self.log_offsets.get(service.log, 0))
            if lines:
                findings.note(f"{service.name} logged errors", " || ".join(lines[:6]))
        findings.assert_clean()


@pytest.fixture
async def fuzz(
    request: pytest.FixtureRequest,
    fuzz_seed: int,
    stack: Stack,
    nats_server: NatsServer,
    router_url: str,
    api_key: str,
    admin_api: tuple[str, str],
    sim_workers: None,
) -> AsyncIterator[Fuzz]:
    admin_url, admin_token = admin_api
    context = Fuzz(
        fuzz_seed,
        request.node.nodeid,
        stack,
        nats_server,
        router_url,
        admin_url,
        api_key,
        admin_token,
    )
    context.add_secret("API key", api_key)
    context.secrets["admin token"] = admin_token
    context.mark_logs()
    context.gauges_at_start = await gauges(router_url)
    print(f"fuzz seed {fuzz_seed} (replay: {SEED_ENV}={fuzz_seed})")
    yield context
