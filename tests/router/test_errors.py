import orjson
import pytest

from services.router.errors import (
    DeadlineExceeded,
    InvalidRequest,
    ModelNotFound,
    ServiceUnavailable,
    WorkerLost,
    error_body,
    sse_error_event,
)


@pytest.mark.parametrize(
    ("exc", "status", "type_", "code"),
    [
        (InvalidRequest("bad", param="n"), 400, "invalid_request_error", None),
        (ModelNotFound("x"), 404, "invalid_request_error", "model_not_found"),
        (ServiceUnavailable("busy"), 503, "service_unavailable", "no_capacity"),
        (WorkerLost("gone"), 502, "server_error", "worker_lost"),
        (DeadlineExceeded("slow"), 504, "timeout", "deadline_exceeded"),
    ],
)
def test_typed_errors_map_to_status_and_openai_body(
    exc: Exception, status: int, type_: str, code: str | None
) -> None:
    got_status, body, _ = error_body(exc)
    error = orjson.loads(body)["error"]
    assert got_status == status
    assert error["type"] == type_ and error["code"] == code
    assert set(error) == {"message", "type", "param", "code"}


def test_unexpected_exceptions_leak_nothing() -> None:
    secret = "/srv/secret/path.py line 42 password=hunter2"
    status, body, _ = error_body(RuntimeError(secret))
    assert status == 500
    assert b"hunter2" not in body and b"RuntimeError" not in body
    assert orjson.loads(body)["error"]["type"] == "server_error"


def test_headers_travel_with_the_error() -> None:
    _, _, headers = error_body(ServiceUnavailable("busy", headers={"Retry-After": "5"}))
    assert headers == {"Retry-After": "5"}


def test_sse_error_event_is_one_data_line() -> None:
    event = sse_error_event(WorkerLost("gone"))
    assert event.startswith(b"data: {") and event.endswith(b"}\n\n")
    assert orjson.loads(event[6:])["error"]["code"] == "worker_lost"
