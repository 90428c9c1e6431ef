"""vLLM runs with the priority policy: a request's class is its engine priority."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.worker.vllm_engine import EngineArgsError, build_engine_argv, parse_engine_args
from tollgate.models.catalog import ModelEntry


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
