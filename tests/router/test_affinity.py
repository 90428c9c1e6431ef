"""Cache-aware routing's choices: the key a request routes by, and the worker it picks."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from services.router.affinity import Affinity, Decision, affinity_key
from services.router.dispatch import Call, Dispatcher
from tollgate.runtime.workers import WorkerView
from tollgate.wire.contracts import Endpoint, InferenceRequest, WorkerHeartbeat, WorkerState
from tollgate.wire.subjects import Subjects

MODEL = "m"
SYSTEM = {"role": "system", "content": "You are a careful assistant. " * 20}


def beat(
    worker_id: str, used: int = 0, total: int = 4, state: WorkerState = WorkerState.READY
) -> WorkerHeartbeat:
    return WorkerHeartbeat(
        worker_id=worker_id,
        model=MODEL,
        engine="simulated",
        state=state,
        slots_used=used,
        slots_total=total,
        interval_s=1.0,
        sent_at=time.time(),
    )


def view(*beats: WorkerHeartbeat) -> WorkerView:
    workers = WorkerView()
    for b in beats:
        workers.observe(b)
    return workers


def chat_key(messages: list[dict[str, str]], prefix_chars: int = 2048) -> bytes | None:
    return affinity_key(Endpoint.CHAT, {"messages": messages}, None, prefix_chars)


# -- the key ----------------------------------------------------------------------


def test_every_turn_of_a_conversation_has_its_first_turn_s_key() -> None:
    first = [SYSTEM, {"role": "user", "content": "What is a tollgate?"}]
    second = [
        *first,
        {"role": "assistant", "content": "A gate where a toll is paid."},
        {"role": "user", "content": "And who pays it?"},
    ]
    third = [
        *second,
        {"role": "assistant", "content": "Travellers."},
        {"role": "user", "content": "Why?"},
    ]
    assert chat_key(first) == chat_key(second) == chat_key(third) is not None
    other = [SYSTEM, {"role": "user", "content": "Something else entirely"}]
    assert chat_key(other) != chat_key(first)


def test_a_long_shared_system_prompt_is_the_key_by_itself() -> None:
    long_system = {"role": "system", "content": "Policy. " * 1000}
    one = chat_key([long_system, {"role": "user", "content": "a"}], prefix_chars=2048)
    two = chat_key([long_system, {"role": "user", "content": "b"}], prefix_chars=2048)
    assert one == two is not None


def test_a_session_header_then_the_user_field_come_before_the_prompt() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "user": "u-1"}
    by_session = affinity_key(Endpoint.CHAT, body, "conv-9", 2048)
    by_user = affinity_key(Endpoint.CHAT, body, None, 2048)
    by_prompt = affinity_key(Endpoint.CHAT, {"messages": body["messages"]}, None, 2048)
    assert len({by_session, by_user, by_prompt}) == 3
    other_prompt = {"messages": [{"role": "user", "content": "bye"}], "user": "u-1"}
    assert affinity_key(Endpoint.CHAT, other_prompt, None, 2048) == by_user
    assert affinity_key(Endpoint.CHAT, other_prompt, "conv-9", 2048) == by_session


def test_only_the_first_prefix_chars_count() -> None:
    a = affinity_key(Endpoint.COMPLETIONS, {"prompt": "x" * 100 + "a"}, None, 100)
    b = affinity_key(Endpoint.COMPLETIONS, {"prompt": "x" * 100 + "b"}, None, 100)
    c = affinity_key(Endpoint.COMPLETIONS, {"prompt": "y" + "x" * 100}, None, 100)
    assert a == b != c


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": [1, 2, 3]},
        {"prompt": [[1, 2, 3], [4, 5]]},
        {"prompt": ["one", "two"]},
        {"prompt": "text"},
    ],
)
def test_completion_prompts_of_every_shape_have_a_key(body: dict[str, object]) -> None:
    assert affinity_key(Endpoint.COMPLETIONS, body, None, 2048) is not None


def test_content_parts_and_odd_messages_do_not_break_the_key() -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image_url"}]}]
    assert chat_key(parts) is not None
    assert chat_key(parts) == chat_key(
        [{"role": "user", "content": [{"type": "text", "text": "look"}, {}]}]
    )
    assert affinity_key(Endpoint.CHAT, {"messages": []}, None, 2048) is None
    assert affinity_key(Endpoint.COMPLETIONS, {"prompt": ""}, None, 2048) is None
    # a huge session id counts only in part, and is never refused
    assert affinity_key(Endpoint.CHAT, {}, "s" * 100_000, 2048) == affinity_key(
        Endpoint.CHAT, {}, "s" * 256, 2048
    )


# -- the worker -------------------------------------------------------------------


def keys(n: int) -> list[bytes]:
    return [f"conversation {i}".encode() for i in range(n)]


def test_a_key_keeps_its_worker_and_keys_spread_over_workers() -> None:
    affinity = Affinity(view(beat("w1"), beat("w2"), beat("w3")))
    chosen = [affinity.choose(MODEL, key) for key in keys(300)]
    assert all(decision == Decision.DIRECT for _, decision in chosen)
    assert [affinity.choose(MODEL, key)[0] for key in keys(300)] == [w for w, _ in chosen]
    spread = Counter(w for w, _ in chosen)
    assert set(spread) == {"w1", "w2", "w3"}
    assert min(spread.values()) > 50, spread  # about 100 each


def test_a_new_worker_takes_keys_only_from_the_others_not_between_them() -> None:
    before = Affinity(view(beat("w1"), beat("w2"), beat("w3")))
    after = Affinity(view(beat("w1"), beat("w2"), beat("w3"), beat("w4")))
    moved = 0
    for key in keys(400):
        old, new = before.choose(MODEL, key)[0], after.choose(MODEL, key)[0]
        if old != new:
            assert new == "w4"  # a key moves only to the new worker
            moved += 1
    assert 50 < moved < 150, moved  # about a quarter


def test_a_full_worker_sends_its_keys_to_the_shared_queue() -> None:
    affinity = Affinity(view(beat("w1", used=4, total=4)))
    assert affinity.choose(MODEL, b"k") == (None, Decision.FULL)
    roomy = Affinity(view(beat("w1", used=4, total=4)), load=1.5)
    assert roomy.choose(MODEL, b"k") == ("w1", Decision.DIRECT)


def test_requests_the_heartbeat_cannot_count_yet_fill_the_worker() -> None:
    sent = Counter({"w1": 3})
    affinity = Affinity(view(beat("w1", used=1, total=4)), busy=lambda w, used: used + sent[w])
    assert affinity.choose(MODEL, b"k") == (None, Decision.FULL)
    sent["w1"] = 2
    assert affinity.choose(MODEL, b"k") == ("w1", Decision.DIRECT)


def test_draining_and_starting_workers_get_no_direct_requests() -> None:
    affinity = Affinity(
        view(beat("w1", state=WorkerState.DRAINING), beat("w2", state=WorkerState.STARTING))
    )
    assert affinity.choose(MODEL, b"k") == (None, Decision.NO_WORKER)
    affinity.workers.observe(beat("w3"))
    assert affinity.choose(MODEL, b"k") == ("w3", Decision.DIRECT)


def test_off_and_keyless_requests_go_to_the_shared_queue() -> None:
    assert Affinity(view(beat("w1")), enabled=False).choose(MODEL, b"k") == (None, Decision.OFF)
    assert Affinity(view(beat("w1"))).choose(MODEL, None) == (None, Decision.NO_KEY)
    assert Affinity(view()).choose(MODEL, b"k") == (None, Decision.NO_WORKER)


# -- what the router counts on a worker ------------------------------------------


class _Topology:
    subjects = Subjects()


class _Bus:
    def jetstream(self) -> None:
        return None


def started_call(dispatcher: Dispatcher, n: int, worker_id: str, direct: bool) -> Call:
    request = InferenceRequest(
        request_id=f"r{n}",
        model=MODEL,
        endpoint=Endpoint.CHAT,
        body={},
        reply_to="r",
        enqueued_at=0.0,
        start_by=1.0,
        deadline=1.0,
    )
    call = Call(request)
    call.direct_to = worker_id if direct else None
    dispatcher._calls[call.token] = call
    if direct:
        dispatcher._direct.setdefault(worker_id, set()).add(call.token)
    return call


def test_the_router_counts_its_own_calls_exactly_and_others_from_the_beat() -> None:
    dispatcher = Dispatcher(_Bus(), _Topology(), "r1")  # type: ignore[arg-type]  # no bus needed
    calls = [started_call(dispatcher, n, "w1", direct=True) for n in range(3)]
    assert dispatcher.busy("w1", slots_used=0) == 3  # sent, not started
    for call in calls:
        call.worker_id = "w1"
        dispatcher.started(call)
    assert dispatcher.busy("w1", slots_used=0) == 3  # running now
    dispatcher.heard("w1")  # a beat that counts the three, and two of another router's
    assert dispatcher.busy("w1", slots_used=5) == 5
    dispatcher.finish(calls[0])
    dispatcher.finish(calls[0])  # twice: counted once
    assert dispatcher.busy("w1", slots_used=5) == 4
    dispatcher.heard("w1")
    assert dispatcher.busy("w1", slots_used=4) == 4
    spilled = started_call(dispatcher, 9, "w1", direct=True)
    spilled.worker_id = "w2"  # another worker took it from w1's lane
    dispatcher.started(spilled)
    assert dispatcher.busy("w1", slots_used=4) == 4
    assert dispatcher.busy("w2", slots_used=0) == 1
