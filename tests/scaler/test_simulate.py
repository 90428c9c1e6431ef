"""`tollgate scaler simulate` over the shipped synthetic day."""

from __future__ import annotations

import subprocess
import sys

import pytest

from services.scaler.simulate import load_trace, simulate, synthetic_day


def test_the_shipped_trace_is_the_synthetic_day() -> None:
    rates = load_trace(None)
    assert rates == synthetic_day()
    assert rates[3 * 60] == 0.5  # night
    assert rates[12 * 60 + 5] == 30.0  # lunch peak
    assert max(rates) == 30.0


@pytest.fixture(scope="module")
def outcomes() -> dict[str, object]:
    return {o.strategy: o for o in simulate(load_trace(None), startup_s=300)}


def test_fixed_max_costs_every_replica_all_day(outcomes: dict[str, object]) -> None:
    fixed = outcomes["fixed-max"]
    assert fixed.replica_hours == 12 * 24  # type: ignore[attr-defined]
    assert fixed.waited_over == 0  # type: ignore[attr-defined]


def test_scaling_strategies_cost_less_and_see_the_same_requests(
    outcomes: dict[str, object],
) -> None:
    fixed, reactive, predictive = (
        outcomes[k] for k in ("fixed-max", "reactive", "reactive+predictive")
    )
    assert fixed.requests == reactive.requests == predictive.requests > 500_000  # type: ignore[attr-defined]
    for o in (reactive, predictive):
        assert o.replica_hours < 0.6 * fixed.replica_hours  # type: ignore[attr-defined]
    # with a slow start, reacting alone leaves requests waiting at the lunch step;
    # the profile has the workers ready before it
    assert reactive.waited_over > 1000  # type: ignore[attr-defined]
    assert predictive.waited_over < reactive.waited_over / 100  # type: ignore[attr-defined]


def test_cli_prints_the_table() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tollgate.app.cli", "scaler", "simulate", "--startup-s", "70"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    lines = out.stdout.splitlines()
    assert lines[0].startswith("| strategy | replica-hours")
    assert [ln.split("|")[1].strip() for ln in lines[2:]] == [
        "fixed-max",
        "reactive",
        "reactive+predictive",
    ]
