"""The soak in short: two minutes of mixed load on `tollgate up` while five faults arrive.

``make soak`` runs the same harness (``bench/soak.py``) for ten minutes with
every fault; this shorter run keeps it working in ``make test``. Every
invariant the harness checks must hold: one usage row per accepted call and
none doubled, tokens equal to the engine's counts, errors only while a fault
was in flight, the budget and the revocation held, nothing left running.
"""

from __future__ import annotations

import time
from pathlib import Path

import orjson
import pytest

from bench.soak import SHORT_FAULTS, Call, EngineReports, Fault, Soak, _expected_tokens


@pytest.mark.timeout(600)  # about 5 min: the stack's start, 2 min of load, the settling
async def test_a_short_soak_with_faults_keeps_every_invariant(
    prepared_model: Path, tmp_path: Path
) -> None:
    soak = Soak(tmp_path / "soak", 2.0, SHORT_FAULTS, prepared_model.parent.parent, seed=7)
    report = await soak.run()
    assert [f["name"] for f in report["faults"]] == SHORT_FAULTS
    # a failure shows the calls behind each problem, not only their count
    examples = {
        k: report[k]
        for k in (
            "mismatch_examples",
            "unexplained_errors",
            "missing_examples",
            "lost_report_examples",
        )
    }
    assert report["problems"] == [], (report["problems"], examples, report.get("stack_story"))
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


# -- the harness's own rules, without a stack ------------------------------------


def _done_line(request_id: str, report: str, ts: float, counts: tuple[int, int]) -> bytes:
    return orjson.dumps(
        {
            "msg": "request done",
            "ts": ts,
            "request_id": request_id,
            "report": report,
            "prompt_tokens": counts[0],
            "completion_tokens": counts[1],
        }
    )


def test_the_workers_lines_say_where_each_report_went(tmp_path: Path) -> None:
    soak = Soak(tmp_path, 0.1, [], tmp_path)
    logs = soak.var / "logs"
    logs.mkdir(parents=True)
    now = time.time()
    lines = [
        _done_line("a", "acknowledged", now, (5, 7)),
        _done_line("k", "kept", now, (5, 3)),
        _done_line("l", "lost", now - 10, (5, 1)),
        b'{"msg": "worker ready"}',
        b"not json",
    ]
    (logs / "worker-1.log").write_bytes(b"\n".join(lines))
    reports = soak.engine_reports()
    assert reports.acknowledged == {"a": (5, 7)}
    assert reports.kept == {"k": (5, 3)}
    # when the report was given up, on the harness's monotonic clock
    assert abs(reports.lost["l"] - (time.monotonic() - 10)) < 1


def test_a_row_is_held_to_the_report_its_router_billed() -> None:
    reports = EngineReports(acknowledged={"a": (5, 7)}, kept={"k": (5, 3)})
    hung_up = Call("plain", "stream_hangup", "m", 0.0, request_id="a")
    assert _expected_tokens(hung_up, "client_disconnected", reports) == (5, 7)
    # kept: the router stopped waiting for it and billed what it relayed
    hung_up.request_id = "k"
    assert _expected_tokens(hung_up, "client_disconnected", reports) is None
    # a lost router's call is billed from the kept report, or at zero without one
    assert _expected_tokens(hung_up, "router_lost", reports) == (5, 3)
    hung_up.request_id = "none"
    assert _expected_tokens(hung_up, "router_lost", reports) == (0, 0)


def test_a_report_lost_after_its_client_finished_is_put_down_to_the_fault_then(
    tmp_path: Path,
) -> None:
    soak = Soak(tmp_path, 0.1, [], tmp_path)
    soak.injected = [Fault("supervisor_kill9", start=100.0, end=120.0)]
    call = Call("plain", "stream", "m", t0=99.0, t1=99.9, request_id="r")
    assert soak.explained_by(call) is None  # the client was done before the fault
    assert soak.explained_by(call, until=100.2) == "supervisor_kill9"  # its report was not
    assert soak.explained_by(call, until=99.95) is None  # lost before the fault: unexplained
