"""`tollgate up`: the whole stack as supervised children, one instance per var dir."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.conftest import SIM_MODEL, free_port
from tollgate.wire.topology import Role


def test_up_serves_refuses_a_second_instance_and_stops_cleanly(
    var_dir: Path, prepared_model: Path, tmp_path: Path
) -> None:
    port, nats_port, auth_port, metering_port, scaler_port = (free_port() for _ in range(5))
    env = {
        **os.environ,
        "TOLLGATE_CATALOG": str(var_dir / "models.toml"),
        "TOLLGATE_VAR_DIR": str(tmp_path / "var"),
        "TOLLGATE_MODEL_CACHE": str(var_dir / "cache" / "models"),
    }
    argv = [
        sys.executable,
        "-m",
        "tollgate.app.cli",
        "up",
        "--port",
        str(port),
        "--nats-port",
        str(nats_port),
        "--auth-port",
        str(auth_port),
        "--metering-port",
        str(metering_port),
        "--scaler-port",
        str(scaler_port),
        "--model",
        SIM_MODEL,
    ]
    up = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        assert up.stdout is not None
        lines: list[str] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = up.stdout.readline()
            lines.append(line)
            if "is ready" in line or not line:
                break
        assert any(f"http://127.0.0.1:{port}/v1" in ln for ln in lines), lines
        assert any(f"Model {SIM_MODEL} is ready" in ln for ln in lines), lines
        key_line = lines[lines.index(next(ln for ln in lines if "Demo API key" in ln)) + 1]
        demo_key = key_line.strip()
        assert demo_key.startswith("tg-")
        key_file = tmp_path / "var" / "auth" / "demo-key"
        assert key_file.read_text().strip() == demo_key
        assert key_file.stat().st_mode & 0o777 == 0o600
        assert (tmp_path / "var" / "auth" / "admin-token").stat().st_mode & 0o777 == 0o600

        # The bus is closed: NATS asks every client for an identity, and each
        # role's seed is private like everything else under var/.
        with socket.create_connection(("127.0.0.1", nats_port), timeout=5) as sock:
            greeting = sock.recv(4096).decode()
        assert json.loads(greeting[5:])["auth_required"] is True
        var = tmp_path / "var"
        assert var.stat().st_mode & 0o777 == 0o700
        seeds = sorted((var / "nats" / "identities").iterdir())
        assert [s.name for s in seeds] == sorted(f"tg-{r.value}.nk" for r in Role)
        for path in var.rglob("*"):
            if path.is_file() and not path.is_symlink():
                assert path.stat().st_mode & 0o077 == 0, path

        unauthenticated = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10)
        assert unauthenticated.status_code == 401
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            headers={"Authorization": f"Bearer {demo_key}"},
            json={
                "model": SIM_MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3,
            },
            timeout=30,
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3

        # The usage row reaches the stack's ClickHouse; the CLI reads it back.
        cli_env = {**env, "TOLLGATE_NATS_URL": f"nats://127.0.0.1:{nats_port}"}
        request_id = r.headers["x-request-id"]
        query = f"SELECT completion_tokens FROM usage_events WHERE request_id = '{request_id}'"
        deadline = time.monotonic() + 60
        while True:
            sql = subprocess.run(
                [sys.executable, "-m", "tollgate.app.cli", "sql", query, "--format", "csv"],
                env=cli_env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            if sql.stdout.splitlines()[1:] == ["3"] or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert sql.returncode == 0 and sql.stdout.splitlines() == ["completion_tokens", "3"], sql
        report = subprocess.run(
            [
                sys.executable,
                *("-m", "tollgate.app.cli", "usage", "report", "--tenant", "demo"),
                "--format",
                "json",
            ],
            env=cli_env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert report.returncode == 0, report.stderr
        rows = json.loads(report.stdout)
        assert [(row["model"], row["requests"], row["completion_tokens"]) for row in rows] == [
            (SIM_MODEL, 1, 3)
        ]
        month = time.strftime("%Y-%m", time.gmtime())
        invoice = subprocess.run(
            [
                *(sys.executable, "-m", "tollgate.app.cli", "invoice"),
                *("--tenant", "demo", "--month", month, "--check"),
            ],
            env=cli_env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert invoice.returncode == 0, invoice.stderr
        assert "agree" in invoice.stderr
        body = json.loads(invoice.stdout)
        assert body["tenant"] == "demo" and body["period"] == month and body["requests"] == 1
        billed = [line for line in body["lines"] if line["kind"] == "completion"]
        unbilled = sum(u["completion_tokens"] for u in body["unpriced"])
        assert sum(line["quantity"] for line in billed) + unbilled == 3, body

        # The scaler runs the workers: the warm model has one, the others none yet.
        status = subprocess.run(
            [sys.executable, "-m", "tollgate.app.cli", "scaler", "status", "--json"],
            env=cli_env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert status.returncode == 0, status.stderr
        models = json.loads(status.stdout)["models"]
        assert models[SIM_MODEL]["desired"] == 1 and models[SIM_MODEL]["ready"] == 1
        assert models[SIM_MODEL]["min_replicas"] == 1
        assert all(m["desired"] == 0 for mid, m in models.items() if mid != SIM_MODEL)

        second = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
        assert second.returncode == 1
        assert "already running" in second.stderr and f":{port}/v1" in second.stderr
    except BaseException:
        # A failed check must not leave the stack running.
        up.send_signal(signal.SIGINT)
        try:
            up.wait(90)
        except subprocess.TimeoutExpired:
            up.kill()
        raise

    up.send_signal(signal.SIGINT)
    rest, _ = up.communicate(timeout=90)
    assert up.returncode == 0, rest
    assert "Stopped." in rest
    # the scaler drained its worker on the way out
    worker_logs = list((tmp_path / "var" / "logs").glob("worker-*.log"))
    assert worker_logs and all("worker stopped" in p.read_text() for p in worker_logs)
    # every child is gone: the ports are free again
    for p in (port, nats_port, auth_port, metering_port, scaler_port):
        try:
            httpx.get(f"http://127.0.0.1:{p}/", timeout=1)
            raise AssertionError(f"port {p} still answers")
        except httpx.ConnectError:
            pass
