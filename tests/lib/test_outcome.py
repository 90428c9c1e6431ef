"""Outcome: one enum for every ending, with the values usage rows have always held."""

from __future__ import annotations

import time
from pathlib import Path

import orjson
import pytest
from pydantic import ValidationError

from tollgate.wire import codec
from tollgate.wire.contracts import Outcome, ResponseChunk, UsageEvent

# Every outcome a router or worker has ever written to a usage row or an END chunk.
STORED = [
    "completed",
    "cancelled",
    "expired",
    "error",
    "drained",
    "client_disconnected",
    "worker_lost",
    "deadline_exceeded",
    "no_capacity",
    "not_dispatched",
    "lost",
    "router_lost",
]


def usage_event(outcome: str) -> bytes:
    return orjson.dumps(
        {
            "type": "tg.usage.v1",
            "request_id": "r1",
            "time": time.time(),
            "tenant": "acme",
            "model": "m/a",
            "prompt_tokens": 3,
            "completion_tokens": 2,
            "outcome": outcome,
            "streamed": False,
            "total_s": 0.1,
            "http_status": 200,
        }
    )


@pytest.mark.parametrize("value", STORED)
def test_every_stored_value_is_a_member_and_keeps_its_string(value: str) -> None:
    event = codec.decode(UsageEvent, usage_event(value))
    assert event.outcome in list(Outcome) and event.outcome.value == value
    assert orjson.loads(codec.encode(event))["outcome"] == value


def test_every_member_is_documented_for_analysts() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "analytics.md").read_text()
    missing = [o.value for o in Outcome if f"| `{o.value}` |" not in doc]
    assert missing == []


def test_an_outcome_this_reader_does_not_know_is_kept_not_refused() -> None:
    """A newer router may add an outcome before metering is upgraded: still billed."""
    event = codec.decode(UsageEvent, usage_event("some_new_ending"))
    assert event.outcome == "some_new_ending" and event.outcome not in list(Outcome)
    chunk = ResponseChunk(request_id="r1", seq=0, kind="end", outcome="some_new_ending")
    assert chunk.outcome == "some_new_ending"


@pytest.mark.parametrize("value", ["x" * 33, "Completed", "rm -rf", "a\nb", "", "1st"])
def test_an_outcome_not_shaped_like_ours_is_refused(value: str) -> None:
    with pytest.raises(ValidationError):
        codec.decode(UsageEvent, usage_event(value))
