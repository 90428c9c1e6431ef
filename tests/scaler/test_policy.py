"""The scaling policy over signal sequences: spike, ramp, idle, flapping and the edges."""

from __future__ import annotations

import pytest

from services.scaler.policy import Decision, Policy, Signals
from tollgate.models.catalog import ScalingPolicy

SLOTS = 4  # requests per worker at target_utilization 1.0


def policy(**overrides: object) -> Policy:
    config = {
        "min_replicas": 0,
        "max_replicas": 4,
        "target_utilization": 1.0,
        "scale_up_window_s": 0,
        "scale_down_window_s": 30,
        "scale_down_cooldown_s": 10,
        "scale_to_zero_after_s": 60,
        "predictive": False,
        **overrides,
    }
    return Policy(ScalingPolicy.model_validate(config))


def run(p: Policy, loads: list[int], start: float = 0.0, **fields: object) -> list[Decision]:
    """One decision per second; each load is split into running (up to capacity) and queued."""
    decisions = []
    for i, load in enumerate(loads):
        capacity = p.state.desired * SLOTS
        running = min(load, capacity)
        signals = Signals(
            now=start + i,
            running=running,
            queued=load - running,
            slots_per_worker=SLOTS,
            ready=p.state.desired,
            **fields,  # type: ignore[arg-type]
        )
        decisions.append(p.decide(signals))
    return decisions


def desired(decisions: list[Decision]) -> list[int]:
    return [d.desired for d in decisions]


def test_spike_scales_up_at_once_and_down_slowly_then_to_zero() -> None:
    p = policy()
    seq = run(p, [0] * 5 + [14] * 20 + [0] * 100)
    counts = desired(seq)
    assert counts[:5] == [0] * 5  # never used: nothing runs
    # requests waiting at zero: 14 requests / 4 slots, all four at once
    assert counts[5] == 4 and seq[5].reason == "from_zero"
    assert max(counts) == 4
    # the load is gone at t=25; the 30 s down-window holds the peak until t=55
    assert counts[25:55] == [4] * 30
    # then one worker, kept while recently active (60 s after the last request)
    assert counts[55] == 1 and seq[55].reason == "recently_active"
    # zero once idle for scale_to_zero_after_s, plus the down-window (last request at t=24)
    first_zero = counts.index(0, 25)
    assert first_zero == 24 + 60 + 30 and seq[first_zero].reason == "scale_to_zero"
    changes = [d for d in seq if d.changed]
    assert [d.desired for d in changes] == [4, 1, 0]


def test_ramp_follows_the_load_step_by_step() -> None:
    p = policy(max_replicas=10)
    loads = list(range(0, 40))
    counts = desired(run(p, loads))
    assert counts == sorted(counts), "a ramp never scales down"
    # after the first worker, each tick sizes to the load of that tick
    for load, count in list(zip(loads, counts, strict=True))[2:]:
        assert count == -(-load // SLOTS)


def test_idle_model_stays_at_zero_and_min_replicas_is_kept() -> None:
    assert set(desired(run(policy(), [0] * 200))) == {0}
    kept = run(policy(min_replicas=1), [0] * 200)
    assert set(desired(kept)) == {1}
    assert kept[0].reason == "min_replicas"


def test_flapping_load_does_not_flap_the_workers() -> None:
    p = policy()
    seq = run(p, [0, 8] * 60)  # 8 requests every other second
    changes = [d for d in seq if d.changed]
    assert [d.desired for d in changes] == [2], "up once, and never down while it flaps"


def test_cooldown_delays_a_scale_down_after_a_change() -> None:
    p = policy(scale_down_window_s=0, scale_down_cooldown_s=10)
    seq = run(p, [16] * 3 + [4] * 20)
    counts = desired(seq)
    assert counts[1] == 4  # one tick for from_zero, then sized
    change_at = next(i for i, d in enumerate(seq) if d.changed and d.desired == 4)
    down_at = next(i for i, c in enumerate(counts) if i > change_at and c < 4)
    assert down_at - change_at >= 10


def test_up_window_ignores_one_tick_spikes_but_not_a_waiting_model_at_zero() -> None:
    p = policy(scale_up_window_s=5, min_replicas=1)
    seq = run(p, [0, 0, 16, 0, 0, 0, 0, 0])
    assert set(desired(seq)) == {1}, "a one-second spike is inside the up-window"
    cold = policy(scale_up_window_s=60)
    first = run(cold, [3])
    assert first[0].desired == 1 and first[0].reason == "from_zero"


def test_max_replicas_caps_and_is_the_reason() -> None:
    p = policy(max_replicas=2, min_replicas=1)
    seq = run(p, [0, 100, 100])
    assert desired(seq) == [1, 2, 2]
    assert seq[1].reason == "max_replicas" and seq[1].recommendation == 2
    assert seq[2].reason == "hold"


def test_tokens_per_second_target() -> None:
    p = policy(target_tokens_per_s=100, max_replicas=8)
    p.state.desired = 1
    d = p.decide(Signals(now=0, running=1, slots_per_worker=SLOTS, ready=1, tokens_per_s=350))
    assert d.desired == 4 and d.reason == "tokens_per_s"


def test_predicted_load_prewarms_and_is_only_used_when_enabled() -> None:
    signals = Signals(now=0, slots_per_worker=SLOTS, predicted_load=10.0)
    on = policy(predictive=True).decide(signals)
    assert on.desired == 3 and on.reason == "predicted"
    off = policy(predictive=False).decide(signals)
    assert off.desired == 0


def test_schedule_overrides_bound_the_count() -> None:
    capped = policy(max_replicas=8).decide(
        Signals(now=0, queued=40, slots_per_worker=SLOTS, max_override=1)
    )
    assert capped.desired == 1
    floored = policy().decide(Signals(now=0, slots_per_worker=SLOTS, min_override=2))
    assert floored.desired == 2 and floored.reason == "min_replicas"


def test_scale_to_zero_off_keeps_one_worker_once_used() -> None:
    p = policy(scale_to_zero_after_s=None)
    counts = desired(run(p, [4] * 3 + [0] * 500))
    assert counts[-1] == 1


def test_utilization_target_leaves_headroom() -> None:
    p = policy(target_utilization=0.5, max_replicas=10)
    d = p.decide(Signals(now=0, running=0, queued=8, slots_per_worker=SLOTS))
    assert d.desired == 4, "8 requests at 2 per worker (half of 4 slots)"


def test_decision_records_its_inputs() -> None:
    d = policy().decide(Signals(now=5, queued=2, slots_per_worker=SLOTS))
    assert d.recommendation == 1
    record = d.to_dict()
    assert record["signals"]["queued"] == 2 and record["previous"] == 0
    assert record["desired"] == 1 and record["reason"] == "from_zero"


def test_min_above_max_is_refused() -> None:
    with pytest.raises(ValueError, match="min_replicas"):
        ScalingPolicy(min_replicas=3, max_replicas=2)
