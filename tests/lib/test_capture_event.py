"""tg.capture.v1 built from the usage event: same row values, same wire format."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from tollgate.wire import codec
from tollgate.wire.contracts import CaptureEvent, Outcome, UsageEvent


def _usage(**fields: Any) -> UsageEvent:
    values: dict[str, Any] = {
        "request_id": "r1",
        "time": 1700000000.5,
        "tenant": "acme",
        "key_id": "k1",
        "model": "org/m",
        "worker_id": "w1",
        "prompt_tokens": 12,
        "completion_tokens": 5,
        "outcome": "completed",
        "finish_reason": "length",
        "streamed": True,
        "queue_s": 0.01,
        "ttft_s": 0.2,
        "total_s": 0.9,
        "http_status": 200,
    }
    return UsageEvent(**{**values, **fields})


def _capture(event: UsageEvent) -> CaptureEvent:
    return CaptureEvent.from_usage(
        event,
        endpoint="chat.completions",
        request_body='{"model":"org/m"}',
        response_text="hello",
        response_body='{"choices":[]}',
        response_truncated=True,
        finish_reason="stop",
    )


def test_the_wire_format_is_unchanged() -> None:
    wire = orjson.loads(codec.encode(_capture(_usage())))
    assert wire == {
        "type": "tg.capture.v1",
        "request_id": "r1",
        "time": 1700000000.5,
        "tenant": "acme",
        "key_id": "k1",
        "model": "org/m",
        "endpoint": "chat.completions",
        "streamed": True,
        "request_body": '{"model":"org/m"}',
        "request_truncated": False,
        "response_text": "hello",
        "response_body": '{"choices":[]}',
        "response_truncated": True,
        "finish_reason": "stop",  # what the caller gave wins over the usage event's
        "outcome": "completed",
        "http_status": 200,
        "prompt_tokens": 12,
        "completion_tokens": 5,
        "ttft_s": 0.2,
        "total_s": 0.9,
    }


def test_shared_fields_come_from_the_usage_event() -> None:
    event = _usage(key_id=None, ttft_s=None, outcome="worker_lost", http_status=502)
    capture = _capture(event)
    for name in ("request_id", "tenant", "key_id", "model", "ttft_s", "total_s", "http_status"):
        assert getattr(capture, name) == getattr(event, name)
    assert capture.outcome == "worker_lost"
    wire = orjson.loads(codec.encode(capture))
    assert "key_id" not in wire and "ttft_s" not in wire  # None fields are left out, as before
    assert "worker_id" not in wire and "queue_s" not in wire  # usage-only fields stay out


@pytest.mark.parametrize("outcome", [Outcome.CANCELLED, "cancelled"])
def test_outcome_as_enum_or_string_has_one_wire_value(outcome: Outcome | str) -> None:
    event = _usage().model_copy(update={"outcome": outcome})
    wire = orjson.loads(codec.encode(_capture(event)))
    assert wire["outcome"] == "cancelled"
    assert codec.decode(CaptureEvent, codec.encode(_capture(event))).outcome == "cancelled"
