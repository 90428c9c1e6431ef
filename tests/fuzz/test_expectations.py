"""The fuzz suite's own expectations, without a stack: what a drawn body obliges."""

from __future__ import annotations

import random

import orjson

from tests.fuzz.generate import Mutation
from tests.fuzz.oracle import Answer, Case, Findings
from tests.fuzz.traffic import COMPLETIONS, EMPTY_PROMPT, RouterTraffic, engine_refusal

SSE = [("content-type", "text/event-stream")]


def traffic(seed: int = 0) -> RouterTraffic:
    return RouterTraffic(random.Random(seed), "tg-test")


def test_the_refusal_follows_the_final_body_not_the_mutations() -> None:
    router = traffic()
    checked = router.checked[COMPLETIONS]
    body = {"model": "m", "prompt": "x", "stream": "abc"}
    assert router.gen.edge_refusal(body, checked, lax_numbers=True) is not None
    # a later mutation that makes the field valid again, or drops it
    for final in ({"model": "m", "prompt": "x", "stream": True}, {"model": "m", "prompt": "x"}):
        assert router.gen.edge_refusal(final, checked, lax_numbers=True) is None
    assert router.gen.edge_refusal({"model": "m"}, checked, lax_numbers=True) == "prompt missing"
    assert router.gen.edge_refusal({"model": "m", "prompt": []}, checked, True) is not None
    # a lax number is not a refusal the document can promise
    assert router.gen.edge_refusal({"model": "m", "prompt": "x", "n": "2"}, checked, True) is None


def test_nested_fields_are_judged_where_they_are() -> None:
    router = traffic()
    checked = router.checked["/v1/chat/completions"]
    ok = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert router.gen.edge_refusal(ok, checked, True) is None
    no_role = {"model": "m", "messages": [{"content": "hi"}]}
    assert router.gen.edge_refusal(no_role, checked, True) == "messages.0.role missing"
    bad_options = {**ok, "stream": True, "stream_options": {"include_usage": "yes"}}
    assert router.gen.edge_refusal(bad_options, checked, True) is not None


def test_mutated_bodies_are_judged_again_from_scratch() -> None:
    """Over many draws, the expectation equals a judgment of the body as sent."""
    router = traffic(7)
    schema = router.bodies[COMPLETIONS]
    assert schema is not None
    for _ in range(300):
        drawn = router.gen.mutate(
            router.completion_body(COMPLETIONS),
            schema,
            3,
            strict_fields=router.checked[COMPLETIONS],
            lax_numbers=True,
        )
        again = router.gen.edge_refusal(drawn.body, router.checked[COMPLETIONS], True)
        assert drawn.strict == (again is not None or drawn.refusal == "not valid JSON text")
        assert all(isinstance(m, Mutation) for m in drawn.mutations)


def test_an_empty_prompt_in_a_batch_is_the_engines_refusal() -> None:
    assert engine_refusal({"prompt": ["", "x"]}) == EMPTY_PROMPT
    assert engine_refusal({"prompt": ["x"]}) is None
    assert engine_refusal({"prompt": "x"}) is None
    assert engine_refusal({"messages": []}) is None


def findings() -> Findings:
    return Findings(seed=0, rerun="", secrets={})


def stream(*events: bytes) -> Answer:
    return Answer(200, SSE, b"".join(b"data: " + e + b"\n\n" for e in (*events, b"[DONE]")))


def test_the_oracle_takes_the_refusal_as_an_error_event_or_a_400() -> None:
    case = Case("POST /v1/completions", "valid", valid=True, engine_refusal=EMPTY_PROMPT)
    error = orjson.dumps({"error": {"message": EMPTY_PROMPT, "type": "BadRequestError"}})
    for answer in (
        stream(error),
        Answer(
            400,
            [("content-type", "application/json")],
            orjson.dumps(
                {"error": {"message": EMPTY_PROMPT, "type": "x", "param": None, "code": 400}}
            ),
        ),
    ):
        seen = findings()
        seen.check(case, answer)
        assert not seen.groups, seen.report()
    for answer in (
        stream(b'{"id": "c", "object": "text_completion", "choices": []}'),
        stream(orjson.dumps({"error": {"message": "something else"}})),
        Answer(200, [("content-type", "application/json")], b"{}"),
    ):
        seen = findings()
        seen.check(case, answer)
        assert seen.groups, answer
    # without the refusal, a valid stream's error event is still a failure
    seen = findings()
    seen.check(Case("POST /v1/completions", "valid", valid=True), stream(error))
    assert "a valid stream ended with an error event" in seen.report()
