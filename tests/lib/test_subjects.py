import re

import pytest

from tollgate.wire.subjects import Lane, Subjects, model_id_from_token, model_token

VALID_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")

IDS = [
    "SmolLM2-135M-Instruct",
    "HuggingFaceTB/SmolLM2-135M-Instruct",
    "meta-llama/Llama-3.1-8B-Instruct",
    "qwen2.5:7b",
    "model.with.dots",
    "with space",
    "wild*card>",
    "ünïcødé/模型",
    "under_score",
    "_5F",
]


@pytest.mark.parametrize("model_id", IDS)
def test_token_is_subject_and_stream_safe(model_id: str) -> None:
    token = model_token(model_id)
    assert VALID_TOKEN.match(token), token
    assert model_id_from_token(token) == model_id


def test_tokens_are_injective() -> None:
    # "_" is escaped too, so an id that looks like an escape cannot collide.
    tokens = {model_token(i) for i in [*IDS, "a/b", "a_2Fb", "a.b", "a_2Eb"]}
    assert len(tokens) == len(IDS) + 4


def test_safe_ids_stay_readable() -> None:
    assert model_token("SmolLM2-135M-Instruct") == "SmolLM2-135M-Instruct"
    assert model_token("org/name") == "org_2Fname"


def test_empty_id_is_refused() -> None:
    with pytest.raises(ValueError):
        model_token("")


def test_subject_names_use_the_prefix_and_the_token() -> None:
    s = Subjects("acme")
    lane = s.infer_lane("org/m.1", "batch", "t.1", "k1")
    assert lane == "acme.infer.org_2Fm_2E1.batch.t_2E1.k1"
    assert (
        s.infer_lane("m", "interactive", "anonymous", None)
        == "acme.infer.m.interactive.anonymous.-"
    )
    assert s.infer_lanes("org/m.1") == "acme.infer.org_2Fm_2E1.>"
    assert s.infer_stream == "ACME_INFER"
    assert s.heartbeat("org/m.1") == "acme.workers.org_2Fm_2E1"
    assert s.cancel("abc") == "acme.cancel.abc"
    assert s.reply("r1", "abc") == "acme.reply.r1.abc"
    # every subject for a model has exactly one token for the model
    assert len(s.infer_lane("a.b/c d", "batch", "a.b c", "k.1 2").split(".")) == 6
    parsed = Lane.parse(lane)
    assert parsed is not None
    assert (parsed.priority, parsed.tenant, parsed.key) == ("batch", "t_2E1", "k1")
    assert Lane.parse("acme.workers.m") is None


def test_a_worker_s_direct_lane_is_its_shared_lane_and_its_worker_token() -> None:
    s = Subjects("acme")
    shared = s.infer_lane("org/m.1", "batch", "t.1", "k1")
    mine = s.infer_lane("org/m.1", "batch", "t.1", "k1", "host.a-1")
    assert mine == shared + ".host_2Ea-1"
    parsed = Lane.parse(mine)
    assert parsed is not None
    assert (parsed.priority, parsed.tenant, parsed.key, parsed.worker) == (
        "batch",
        "t_2E1",
        "k1",
        "host_2Ea-1",
    )
    assert parsed.group == shared
    shared_lane = Lane.parse(shared)
    assert shared_lane is not None and shared_lane.worker is None
    assert shared_lane.group == shared
    # the wildcards tell the shared lanes and one worker's direct lanes apart
    assert s.infer_shared_lanes("org/m.1") == "acme.infer.org_2Fm_2E1.*.*.*"
    assert s.infer_direct_lanes("org/m.1", "host.a-1") == "acme.infer.org_2Fm_2E1.*.*.*.host_2Ea-1"
