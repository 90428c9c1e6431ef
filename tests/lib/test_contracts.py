import orjson
import pytest
from pydantic import ValidationError

from tollgate.wire import codec
from tollgate.wire.contracts import (
    ChunkKind,
    Endpoint,
    InferenceRequest,
    Outcome,
    ResponseChunk,
    Usage,
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
