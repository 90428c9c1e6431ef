"""Process lifetimes: nothing outlives ``tollgate up``, and a stop is never cut short.

- A router told to stop more than once (a parent-death signal can arrive once
  per thread of the parent that died; an operator presses Ctrl-C twice) still
  finishes the calls in flight.
- ``kill -9`` of ``tollgate up`` takes every process it started with it.
- What an earlier instance left running is stopped by the next ``tollgate up``,
  which names each process; a port held by something else is reported with
  the process that holds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import httpx
import orjson

from tests.conftest import SIM_MODEL, SLOW_MODEL, Stack, free_port
from tests.lib.streams import read_subject
from tollgate.runtime.procs import INSTANCE_ENV, marked_processes, process_info
from tollgate.wire import codec
from tollgate.wire.contracts import Outcome, UsageEvent
from tollgate.wire.subjects import Subjects


async def stream_to_end(base: str, key: str, started: asyncio.Event) -> tuple[str, bool, int]:
    """One slow stream: (request id, whether it reached [DONE], completion tokens)."""
    body = {
        "model": SLOW_MODEL,
        "messages": [{"role": "user", "content": "a slow reply, please"}],
        "max_tokens": 25,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    done, completion = False, -1
    async with (
        httpx.AsyncClient(timeout=60) as http,
        http.stream(
            "POST",
            f"{base}/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {key}"},
        ) as r,
    ):
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: {"):
                started.set()
                event = orjson.loads(line[6:])
                if event.get("usage"):
                    completion = event["usage"]["completion_tokens"]
        return r.headers["x-request-id"], done, completion


async def test_a_router_told_to_stop_again_still_finishes_its_calls(
    stack: Stack, api_key: str, sim_workers: None
) -> None:
    service, base = stack.router()
    started = [asyncio.Event(), asyncio.Event()]
    calls = [asyncio.create_task(stream_to_end(base, api_key, s)) for s in started]
    await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 30)
    for sig in (signal.SIGTERM, signal.SIGTERM, signal.SIGINT, signal.SIGTERM):
        service.proc.send_signal(sig)
        await asyncio.sleep(0.2)
    results = await asyncio.gather(*calls)
    code = await asyncio.to_thread(service.proc.wait, 60)
    assert code == 0
    log = service.log_text()
    assert "already stopping; SIGTERM ignored" in log and "SIGINT ignored" in log
    done_lines = [orjson.loads(ln) for ln in log.splitlines() if '"request done"' in ln]
    for request_id, reached_done, completion in results:
        # the streams ran to their end, and each call's ending was recorded
        assert reached_done and completion == 25, (request_id, reached_done, completion)
        ends = [e for e in done_lines if e["request_id"] == request_id]
        assert [e["outcome"] for e in ends] == ["completed"], ends


def up_argv(port: int) -> list[str]:
    argv = [sys.executable, "-m", "tollgate.app.cli", "up", "--port", str(port)]
    for flag in ("--nats-port", "--auth-port", "--metering-port", "--scaler-port"):
        argv += [flag, str(free_port())]
    return [*argv, "--model", SIM_MODEL]


def up_env(var_dir: Path, var: Path) -> dict[str, str]:
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith("TOLLGATE_")},
        "TOLLGATE_CATALOG": str(var_dir / "models.toml"),
        "TOLLGATE_VAR_DIR": str(var),
        "TOLLGATE_MODEL_CACHE": str(var_dir / "cache" / "models"),
    }


def read_until(out: IO[str], text: str, timeout: float = 180) -> list[str]:
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = out.readline()
        if not line:
            break
        lines.append(line)
        if text in line:
            return lines
    raise AssertionError(f"no {text!r} in {lines}")


def test_a_port_in_use_is_reported_with_its_holder(var_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import socket, time\n"
            f"s = socket.socket(); s.bind(('127.0.0.1', {port})); s.listen()\n"
            "print('listening', flush=True); time.sleep(120)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "listening"
        up = subprocess.run(
            up_argv(port),
            env=up_env(var_dir, tmp_path / "var"),
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        holder.kill()
        holder.wait()
    assert up.returncode == 1
    assert f"Port {port} for the router is in use by pid {holder.pid} (" in up.stderr + up.stdout


def test_up_stops_what_a_killed_instance_left_and_dies_with_everything(
    var_dir: Path, prepared_model: Path, tmp_path: Path
) -> None:
    var = tmp_path / "var"
    var.mkdir(mode=0o700)
    # What an instance killed before its processes had stopped leaves behind:
    # its up.json, and a process that carries its mark.
    (var / "up.json").write_text(json.dumps({"pid": 4194304, "instance": "killed-earlier"}))
    leftover = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"],
        env={**os.environ, INSTANCE_ENV: "killed-earlier"},
    )
    up = subprocess.Popen(
        up_argv(free_port()),
        env=up_env(var_dir, var),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert up.stdout is not None
        lines = read_until(up.stdout, "Press Ctrl-C to stop.")
        said = "".join(lines)
        assert "An earlier Tollgate instance" in said and "left 1 process(es)" in said, said
        assert f"pid {leftover.pid} (" in said, said
        assert leftover.wait(5) == -signal.SIGTERM

        instance = json.loads((var / "up.json").read_text())["instance"]
        started = marked_processes(instance)
        names = " ".join(p.command for p in started)
        for part in ("nats-server", "services.router", "services.auth", "services.metering"):
            assert part in names, names
        assert "services.scaler" in names and "services.worker" in names, names

        up.kill()  # kill -9: no chance to stop anything itself
        up.wait()
        deadline = time.monotonic() + 120
        while (left := marked_processes(instance)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert left == [], f"processes outlived tollgate up: {left}"
        assert all(process_info(p.pid) is None for p in started)
    finally:
        if leftover.poll() is None:
            leftover.kill()
        if up.poll() is None:
            up.kill()
        up.wait()
        for p in marked_processes("killed-earlier"):
            os.kill(p.pid, signal.SIGKILL)


async def test_the_calls_of_a_killed_router_are_billed_by_its_next_run(
    stack: Stack, api_key: str, sim_workers: None, tmp_path: Path
) -> None:
    """SIGKILL mid-stream: the next run on the same outbox bills the worker's final report."""
    outbox = str(tmp_path / "outbox.db")
    first, base = stack.router(TOLLGATE_ROUTER_OUTBOX=outbox)
    started = asyncio.Event()
    call = asyncio.create_task(stream_to_end(base, api_key, started))
    await asyncio.wait_for(started.wait(), 30)
    first.stop(signal.SIGKILL)
    with contextlib.suppress(httpx.HTTPError):
        await call  # the client's connection breaks with its router
    rows = sqlite3.connect(outbox).execute("SELECT request_id FROM open_calls").fetchall()
    assert len(rows) == 1, rows  # the call the killed router held
    request_id = rows[0][0]

    second, _ = stack.router(TOLLGATE_ROUTER_OUTBOX=outbox)
    nc = await stack.nats.connect(name="test-lost-calls")
    try:
        js = nc.jetstream()
        subject = Subjects().usage_tenant("demo")
        deadline = time.monotonic() + 60
        events: list[UsageEvent] = []
        while time.monotonic() < deadline and not events:
            found = [codec.decode(UsageEvent, m.data) for m in await read_subject(js, subject)]
            events = [e for e in found if e.request_id == request_id]
            await asyncio.sleep(0.5)
    finally:
        await nc.close()
    assert len(events) == 1, events
    event = events[0]
    # the worker ran the call to its end; its final report went to the orphans
    # bucket (no router acknowledged it), and the next run billed it
    assert event.outcome is Outcome.ROUTER_LOST
    assert (event.completion_tokens, event.finish_reason) == (25, "length")
    assert event.prompt_tokens > 0 and event.worker_id is not None
    assert "lost call billed" in second.log_text()
    assert sqlite3.connect(outbox).execute("SELECT count(*) FROM open_calls").fetchone()[0] == 0
