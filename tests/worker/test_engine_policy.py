"""vLLM runs with the priority policy: a request's class is its engine priority."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.worker.vllm_engine import EngineArgsError, build_engine_argv, parse_engine_args
from tollgate.models.catalog import AdapterEntry, ModelEntry


def entry(*engine_args: str) -> ModelEntry:
    return ModelEntry.model_validate(
        {"id": "org/m", "source": "file:///x", "engine_args": list(engine_args)}
    )


def test_the_worker_asks_for_the_priority_policy() -> None:
    argv = build_engine_argv(entry("--seed", "0"), Path("/m"))
    assert argv[argv.index("--scheduling-policy") + 1] == "priority"
    assert argv[-2:] == ["--seed", "0"], "the catalog's own arguments come last"


@pytest.mark.parametrize(
    "args",
    [(), ("--scheduling-policy", "priority"), ("--scheduling_policy=priority",)],
    ids=["unset", "same", "same-underscores"],
)
def test_vllm_parses_the_priority_policy(args: tuple[str, ...]) -> None:
    pytest.importorskip("vllm")
    parsed = parse_engine_args(entry(*args, "--max-num-seqs", "4"), Path("/m"))
    assert parsed.scheduling_policy == "priority"
    assert parsed.max_num_seqs == 4


@pytest.mark.parametrize(
    "args",
    [
        ("--scheduling-policy", "fcfs"),
        ("--scheduling-policy=fcfs",),
        ("--scheduling_policy", "fcfs"),
        ("--scheduling-pol", "fcfs"),  # argparse takes an unambiguous abbreviation
    ],
)
def test_a_catalog_that_turns_it_off_is_refused(args: tuple[str, ...]) -> None:
    pytest.importorskip("vllm")
    with pytest.raises(EngineArgsError, match=r"org/m: .*'fcfs'.*--scheduling-policy priority"):
        parse_engine_args(entry(*args), Path("/m"))


def adapter(name: str, rank: int) -> AdapterEntry:
    return AdapterEntry(id=name, base="org/m", source=f"file:///{name}", rank=rank)


def test_a_model_with_adapters_runs_with_lora_sized_for_the_largest() -> None:
    assert "--enable-lora" not in build_engine_argv(entry(), Path("/m"))
    adapters = [adapter(f"a{i}", rank) for i, rank in enumerate([8, 64, 16, 8, 8])]
    argv = build_engine_argv(entry("--seed", "0"), Path("/m"), adapters)
    assert "--enable-lora" in argv
    assert argv[argv.index("--max-lora-rank") + 1] == "64"
    assert argv[argv.index("--max-loras") + 1] == "4"  # a batch mixes at most four
    assert argv[-2:] == ["--seed", "0"], "the catalog's own arguments still come last"
    pytest.importorskip("vllm")
    parsed = parse_engine_args(entry(), Path("/m"), adapters[:2])
    assert parsed.enable_lora and parsed.max_lora_rank == 64 and parsed.max_loras == 2
