import orjson
import pytest
from pydantic import ValidationError

from tollgate.wire import codec
from tollgate.wire.contracts import (
    MAX_TOKENS,
    ChunkKind,
    Endpoint,
    InferenceRequest,
    Outcome,
    ResponseChunk,
    Usage,
    UsageEvent,
    WorkerHeartbeat,
    WorkerState,
)


def _request() -> InferenceRequest:
    return InferenceRequest(
        request_id="r1",
        model="m",
        endpoint=Endpoint.CHAT,
        body={"model": "m", "messages": [{"role": "user", "content": "hi ✓"}]},
        reply_to="tg.reply.x.r1",
        enqueued_at=1.0,
        start_by=2.0,
        deadline=3.0,
    )


def test_request_round_trip_keeps_the_body_and_type_id() -> None:
    req = _request()
    data = codec.encode(req)
    assert orjson.loads(data)["type"] == "tg.infer.v1"
    assert codec.decode(InferenceRequest, data) == req


def test_chunk_round_trip_and_none_fields_are_omitted() -> None:
    chunk = ResponseChunk(
        request_id="r1",
        seq=3,
        kind=ChunkKind.END,
        usage=Usage(prompt_tokens=5, completion_tokens=7),
        outcome=Outcome.COMPLETED,
    )
    raw = orjson.loads(codec.encode(chunk))
    assert "data" not in raw and "status" not in raw
    back = codec.decode(ResponseChunk, codec.encode(chunk))
    assert back.usage is not None and back.usage.total_tokens == 12
    assert back.kind is ChunkKind.END


def test_unknown_fields_from_newer_senders_are_ignored() -> None:
    raw = orjson.loads(codec.encode(_request()))
    raw["added_in_a_later_version"] = 1
    assert codec.decode(InferenceRequest, orjson.dumps(raw)).request_id == "r1"


def test_missing_required_field_is_an_error() -> None:
    raw = orjson.loads(codec.encode(_request()))
    del raw["reply_to"]
    with pytest.raises(ValidationError):
        codec.decode(InferenceRequest, orjson.dumps(raw))


def test_heartbeat_state_values() -> None:
    beat = WorkerHeartbeat(
        worker_id="w",
        model="m",
        engine="simulated",
        state=WorkerState.READY,
        slots_used=1,
        slots_total=4,
        interval_s=1.0,
        sent_at=0.0,
    )
    assert orjson.loads(codec.encode(beat))["state"] == "ready"


def test_every_contract_field_is_described() -> None:
    for model in (InferenceRequest, ResponseChunk, WorkerHeartbeat):
        for name, info in model.model_fields.items():
            assert info.description, f"{model.__name__}.{name} has no description"


def _usage(**fields: object) -> bytes:
    body: dict[str, object] = {
        "type": "tg.usage.v1",
        "request_id": "r1",
        "time": 1_700_000_000.5,
        "tenant": "acme",
        "key_id": "k1",
        "model": "m/a",
        "prompt_tokens": 12,
        "completion_tokens": 5,
        "outcome": "completed",
        "streamed": False,
        "total_s": 0.5,
        "http_status": 200,
    }
    return orjson.dumps({**body, **fields})


@pytest.mark.parametrize(
    ("fields", "where"),
    [
        ({"prompt_tokens": -1000}, "prompt_tokens"),
        ({"completion_tokens": -1}, "completion_tokens"),
        ({"prompt_tokens": MAX_TOKENS + 1}, "prompt_tokens"),
        ({"completion_tokens": 2**40}, "completion_tokens"),
        ({"time": 12.0}, "time"),
        ({"time": 4_000_000_000.0}, "time"),  # the year 2096: a broken clock
        ({"http_status": 70_000}, "http_status"),
        ({"http_status": -1}, "http_status"),
    ],
)
def test_a_usage_event_out_of_range_is_refused_by_the_contract(
    fields: dict[str, object], where: str
) -> None:
    """One validation for every consumer: what the contract refuses, no reader counts."""
    with pytest.raises(ValidationError) as err:
        codec.decode(UsageEvent, _usage(**fields))
    assert [e["loc"] for e in err.value.errors()] == [(where,)]


def test_usage_event_bounds_and_timings() -> None:
    most = codec.decode(UsageEvent, _usage(prompt_tokens=MAX_TOKENS, completion_tokens=0))
    assert most.prompt_tokens == MAX_TOKENS
    # a day ahead of the reader's clock at most; the clock may be given
    ahead = UsageEvent.model_validate_json(_usage(time=1_700_050_000.0))
    assert ahead.time == 1_700_050_000.0
    with pytest.raises(ValidationError, match="ahead of the reader's clock"):
        UsageEvent.model_validate_json(_usage(time=1_700_100_000.0), context={"now": 1.7e9})
    # timings never refuse an event: negative is 0, non-finite unknown
    odd = codec.decode(UsageEvent, _usage(queue_s=-0.001, total_s=-2.0))
    assert (odd.queue_s, odd.total_s) == (0.0, 0.0)
    raw = orjson.loads(_usage())
    unknown = UsageEvent.model_validate({**raw, "ttft_s": float("inf"), "total_s": float("nan")})
    assert (unknown.ttft_s, unknown.total_s) == (None, 0.0)
    schema = UsageEvent.model_json_schema()["properties"]
    assert schema["prompt_tokens"]["minimum"] == 0
    assert schema["prompt_tokens"]["maximum"] == MAX_TOKENS
    assert schema["total_s"]["minimum"] == 0
