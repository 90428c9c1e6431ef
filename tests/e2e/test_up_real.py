"""The first call after ``tollgate up`` with the real engine: it waits for the starting worker.

``tollgate up`` prints its base URL as soon as the router is ready, while the
vLLM worker is still starting (a minute or more on this CPU, longer than the
router's queue timeout). A call sent at that moment is held until the
worker is ready and then answered, not refused.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import REAL_MODEL, free_port
from tests.e2e.test_lifetimes import read_until, up_env

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def test_a_call_sent_as_soon_as_up_prints_its_url_is_answered(
    var_dir: Path, prepared_model: Path, tmp_path: Path
) -> None:
    port = free_port()
    argv = [
        *(sys.executable, "-m", "tollgate.app.cli", "up", "--port", str(port)),
        *("--nats-port", str(free_port()), "--auth-port", str(free_port())),
        *("--metering-port", str(free_port()), "--scaler-port", str(free_port())),
        *("--model", REAL_MODEL),
    ]
    # The default queue timeout (60 s), as `make run` has it: shorter than the
    # engine's start, and the worker is silent for most of that start (vLLM's
    # engine build holds its event loop), so the hold must outlast the silence.
    env = up_env(var_dir, tmp_path / "var")
    up = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        assert up.stdout is not None
        lines = read_until(up.stdout, "Tollgate is up", timeout=300)
        key_line = next(i for i, ln in enumerate(lines) if "Demo API key" in ln)
        demo_key = lines[key_line + 1].strip()
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            headers={"Authorization": f"Bearer {demo_key}"},
            json={
                "model": REAL_MODEL,
                "messages": [{"role": "user", "content": "Say hello."}],
                "max_tokens": 8,
            },
            timeout=600,
        )
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] > 0 and 0 < usage["completion_tokens"] <= 8
        said = "".join(lines + read_until(up.stdout, f"Model {REAL_MODEL} is ready", 60))
        assert f"Model {REAL_MODEL} is starting; expected ready in about" in said, said
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(120)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()
