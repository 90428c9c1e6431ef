"""The bus commands of `tollgate` print their answer and nothing else.

Each runs the real CLI in a subprocess against its own nats-server (TLS and
nkey identities, as the session's), so what reaches stdout and stderr is
what an operator or a script sees. Connection chatter ("nats disconnected"
at every exit, asyncio's TLS end-of-stream warning) was printed by every such
command; a connection lost while in use is still reported.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import NatsServer
from tests.lib.net import free_port, refused_port
from tollgate.keys.tokens import SigningKeySet, auth_dir
from tollgate.wire import bus
from tollgate.wire.topology import Role


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    nats = NatsServer(free_port(), tmp_path_factory.mktemp("quiet-nats"), tls=True)
    nats.start()
    yield nats
    nats.stop()


@pytest.fixture(scope="module")
def var_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("quiet-var")
    SigningKeySet(auth_dir(path) / "signing-keys.json").generate()
    return path


def tollgate(server: NatsServer, var_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOLLGATE_")}
    env.update(server.env(Role.ADMIN), TOLLGATE_VAR_DIR=str(var_dir))
    return subprocess.run(
        [sys.executable, "-m", "tollgate.app.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_keys_create_prints_the_key_alone_on_stdout(server: NatsServer, var_dir: Path) -> None:
    made = tollgate(server, var_dir, "keys", "create", "--tenant", "script-co", "--rpm", "5")
    assert made.returncode == 0, made.stderr
    # `KEY=$(tollgate keys create ...)` holds the key and nothing else
    key = made.stdout.removesuffix("\n")
    assert key.startswith("tg-") and "\n" not in key and " " not in key, made.stdout
    # the details go to stderr, for the person at the terminal
    lines = made.stderr.splitlines()
    assert lines[0].startswith("key id: ") and lines[1] == "tenant: script-co", made.stderr
    assert key not in made.stderr
    key_id = lines[0].removeprefix("key id: ")
    listed = tollgate(server, var_dir, "keys", "list")
    assert listed.returncode == 0 and listed.stderr == ""
    [row] = [line for line in listed.stdout.splitlines() if line.startswith(key_id)]
    assert "script-co" in row and "rpm 5" in row and key not in listed.stdout


def test_bus_commands_print_their_answer_and_nothing_else(
    server: NatsServer, var_dir: Path
) -> None:
    listed = tollgate(server, var_dir, "keys", "list")
    assert (listed.returncode, listed.stderr) == (0, "")
    revoked = tollgate(server, var_dir, "keys", "revoke", "k-none")
    assert (revoked.returncode, revoked.stdout, revoked.stderr) == (
        1,
        "",
        "error: no key 'k-none'\n",
    )
    status = tollgate(server, var_dir, "scaler", "status")
    assert (status.returncode, status.stdout, status.stderr) == (
        1,
        "",
        "error: no scaler answered (start it with `tollgate up`)\n",
    )
    query = tollgate(server, var_dir, "sql", "SELECT 1")
    assert query.returncode == 1 and query.stdout == ""
    [line] = query.stderr.splitlines()
    assert line.startswith("error: ") and "metering" in line, query.stderr


def test_an_unreachable_bus_or_a_bad_setting_is_one_line(
    server: NatsServer, var_dir: Path, tmp_path: Path
) -> None:
    with refused_port() as port:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TOLLGATE_")}
        env.update(
            server.env(Role.ADMIN),
            TOLLGATE_VAR_DIR=str(var_dir),
            TOLLGATE_NATS_URL=f"tls://operator:hunter2@127.0.0.1:{port}",
        )
        done = subprocess.run(
            [sys.executable, "-m", "tollgate.app.cli", "keys", "list"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    # given up after a while, not retried for ever one warning at a time
    assert (done.returncode, done.stdout) == (1, ""), done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith(f"error: NATS at 127.0.0.1:{port} did not answer within "), line
    assert "hunter2" not in line
    missing = tmp_path / "no-such-seed"
    env.update(server.env(Role.ADMIN), TOLLGATE_NATS_NKEY_FILE=str(missing))
    done = subprocess.run(
        [sys.executable, "-m", "tollgate.app.cli", "keys", "list"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (done.returncode, done.stdout) == (78, ""), done.stderr
    assert done.stderr == (
        f"error: TOLLGATE_NATS_NKEY_FILE: cannot read {missing}: No such file or directory\n"
    )


async def test_a_connection_lost_in_use_is_still_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    nats = NatsServer(free_port(), tmp_path / "nats", tls=True)
    nats.start()
    lost = asyncio.Event()

    class Watch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage() == "nats disconnected":
                lost.set()

    watch = Watch()
    logging.getLogger("tollgate.wire.bus").addHandler(watch)
    caplog.set_level(logging.DEBUG)
    try:
        nc = await nats.connect(name="quiet-test")
        try:
            nats.stop()
            await asyncio.wait_for(lost.wait(), 30)
        finally:
            await bus.close(nc)
    finally:
        logging.getLogger("tollgate.wire.bus").removeHandler(watch)
        nats.stop()
    said = [(r.name, r.levelname, r.getMessage()) for r in caplog.records]
    # the loss is a warning; the process's own close afterwards only a debug line
    assert said.count(("tollgate.wire.bus", "WARNING", "nats disconnected")) == 1, said
    assert ("tollgate.wire.bus", "DEBUG", "nats connection closed") in said, said
    assert not [s for s in said if "eof_received" in s[2]], said
