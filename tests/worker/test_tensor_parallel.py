"""A catalog model's tensor-parallel size: one field, passed to vLLM as its own argument."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from services.worker.vllm_engine import build_engine_argv
from tollgate.models.catalog import ModelEntry, load_catalog


def entry(**fields: object) -> ModelEntry:
    return ModelEntry.model_validate({"id": "org/m", "source": "file:///x", **fields})


def test_a_worker_uses_one_gpu_unless_the_catalog_says_more(tmp_path: Path) -> None:
    argv = build_engine_argv(entry(), tmp_path)
    assert argv[argv.index("--tensor-parallel-size") + 1] == "1"
    argv = build_engine_argv(entry(tensor_parallel_size=4, engine_args=["--seed", "0"]), tmp_path)
    assert argv[argv.index("--tensor-parallel-size") + 1] == "4"
    assert argv[-2:] == ["--seed", "0"], "the catalog's own arguments come last"


def test_vllms_parser_takes_the_argument() -> None:
    pytest.importorskip("vllm")
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())  # type: ignore[no-untyped-call]
    args = parser.parse_args(build_engine_argv(entry(tensor_parallel_size=2), Path("/m")))
    assert args.tensor_parallel_size == 2


@pytest.mark.parametrize(
    "arg",
    [
        "-tp",
        "-tp=2",
        "--tensor-parallel-size",
        "--tensor_parallel_size",
        "--tensor-parallel-size=2",
    ],
)
def test_the_size_is_not_also_an_engine_argument(arg: str) -> None:
    with pytest.raises(ValidationError, match="tensor_parallel_size"):
        entry(engine_args=[arg, "2"] if "=" not in arg else [arg])


def test_tensor_parallel_size_is_at_least_one() -> None:
    with pytest.raises(ValidationError):
        entry(tensor_parallel_size=0)


def test_the_packaged_catalog_runs_on_one_gpu() -> None:
    assert {m.tensor_parallel_size for m in load_catalog().models.values()} == {1}
