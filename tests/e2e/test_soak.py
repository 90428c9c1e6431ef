"""The soak in short: two minutes of mixed load on `tollgate up` while five faults arrive.

``make soak`` runs the same harness (``bench/soak.py``) for ten minutes with
every fault; this shorter run keeps it working in ``make test``. Every
invariant the harness checks must hold: one usage row per accepted call and
none doubled, tokens equal to the engine's counts, errors only while a fault
was in flight, the budget and the revocation held, nothing left running.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.soak import SHORT_FAULTS, Soak


@pytest.mark.timeout(600)  # about 5 min: the stack's start, 2 min of load, the settling
async def test_a_short_soak_with_faults_keeps_every_invariant(
    prepared_model: Path, tmp_path: Path
) -> None:
    soak = Soak(tmp_path / "soak", 2.0, SHORT_FAULTS, prepared_model.parent.parent, seed=7)
    report = await soak.run()
    assert [f["name"] for f in report["faults"]] == SHORT_FAULTS
    # a failure shows the calls behind each problem, not only their count
    examples = {
        k: report[k] for k in ("mismatch_examples", "unexplained_errors", "missing_examples")
    }
    assert report["problems"] == [], (report["problems"], examples)
    # the figures behind "no problems", stated once more so a failure reads plainly
    assert report["accepted"] > 500
    assert report["missing_rows"] == 0, report["missing_examples"]
    assert report["duplicates"] == 0 and report["refused_with_rows"] == 0
    assert report["token_mismatches"] == 0 and report["unexplained_errors"] == []
    assert report["revocation"]["accepted_after_grace"] == 0
    assert report["revocation"]["refused_401"] > 0  # the revoked key kept trying
    assert report["refused"].get("429 insufficient_quota", 0) > 0  # the budget ran out
    assert report["budget"]["billed_tokens"] <= report["budget"]["budget_tokens"] + (
        report["budget"]["max_calls_in_flight"] * report["budget"]["worst_case_per_call"]
    )
    assert report["orphans"] == []
