"""Anthropic's Messages API: Tollgate's /v1/messages vs vllm serve, on the same model.

Three targets, loaded side by side on this machine and measured in
alternating rounds: ``vllm serve``'s /v1/chat/completions (the baseline the
issue names), ``vllm serve``'s own /v1/messages, and Tollgate's /v1/messages
(router, NATS, worker running vLLM's Anthropic layer in-process). Every call
is a greedy stream of the same prompts, so each reply is the same length on
every target; output tokens per second and time to first token compare.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from bench import procs as P
from bench.load import RunStats, run_load
from tollgate.models.cache import prepare_model
from tollgate.models.catalog import load_catalog

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = [
    "Explain how a bicycle works.",
    "Write a short poem about the sea.",
    "What are the primary colours?",
    "Give three tips for learning to cook.",
]
MAX_TOKENS = 64


def chat_bodies(count: int) -> list[dict[str, Any]]:
    return [
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        for i in range(count)
    ]


def message_bodies(count: int) -> list[dict[str, Any]]:
    return [
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "stream": True,
        }
        for i in range(count)
    ]


def bench_messages(work: Path, env: dict[str, str], quick: bool, rounds: int = 2) -> dict[str, Any]:
    entry = load_catalog(work / "models.toml").get(MODEL)
    model_path = prepare_model(entry, work / "cache" / "models")
    out: dict[str, Any] = {"model": MODEL, "max_tokens": MAX_TOKENS, "rounds": rounds}
    print("messages: vllm serve (chat and messages) and Tollgate's /v1/messages", flush=True)
    with P.processes(work, env) as procs:
        vllm = P.start_vllm_serve(procs, "vllm-serve-messages", entry, model_path)
        nats = P.start_nats(procs)
        headers = P.api_key(nats, work)
        base = P.start_router(procs, nats)
        P.start_worker(procs, nats, MODEL)
        # name -> (url, headers, bodies, Anthropic stream)
        targets = {
            "vllm_chat": (f"{vllm}/v1/chat/completions", None, chat_bodies, False),
            "vllm_messages": (f"{vllm}/v1/messages", None, message_bodies, True),
            "tollgate_messages": (f"{base}/v1/messages", headers, message_bodies, True),
        }
        for url, auth, bodies, anthropic in targets.values():  # warm-up
            asyncio.run(run_load(url, bodies(4), 2, headers=auth, anthropic=anthropic))
        merged: dict[tuple[str, int], RunStats] = {}
        for round_no in range(rounds):
            order = list(targets.items())
            if round_no % 2:
                order.reverse()
            for concurrency, count in ((1, 4 if quick else 8), (16, 16 if quick else 32)):
                for name, (url, auth, bodies, anthropic) in order:
                    stats = asyncio.run(
                        run_load(url, bodies(count), concurrency, headers=auth, anthropic=anthropic)
                    )
                    into = merged.setdefault((name, concurrency), RunStats())
                    into.samples += stats.samples
                    into.errors += stats.errors
                    into.wall += stats.wall
        for (name, concurrency), stats in merged.items():
            out.setdefault(name, {})[f"c{concurrency}"] = stats.summary()
            print(f"  {name} c={concurrency}: {stats.summary()['output_tokens_per_s']:.1f} tok/s")
    out["measured_at"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return out


def render(r: dict[str, Any]) -> list[str]:
    lines = [
        "## Anthropic Messages API",
        "",
        f"`{r['model']}` on vLLM (CPU), greedy streams of at most {r['max_tokens']} tokens, "
        "the same prompts on every target, loaded side by side and measured in alternating "
        f"rounds ({r['rounds']}). Ratios are against `vllm serve`'s /v1/chat/completions.",
        "",
        "| target | concurrency | output tokens/s | ratio | TTFT p50 (ms) | ITL p50 (ms) "
        "| errors |",
        "|---|---|---|---|---|---|---|",
    ]
    for concurrency in ("c1", "c16"):
        base = r["vllm_chat"][concurrency]["output_tokens_per_s"]
        for name, label in (
            ("vllm_chat", "vllm serve /v1/chat/completions"),
            ("vllm_messages", "vllm serve /v1/messages"),
            ("tollgate_messages", "Tollgate /v1/messages"),
        ):
            s = r[name][concurrency]
            ratio = s["output_tokens_per_s"] / base if base else 0.0
            lines.append(
                f"| {label} | {concurrency[1:]} | {s['output_tokens_per_s']:.1f} | {ratio:.2f} "
                f"| {s['ttft_p50_ms']:.1f} | {s['itl_p50_ms']:.1f} | {int(s['errors'])} |"
            )
    lines.append("")
    return lines
