"""Demand profile from usage history, and schedule overrides."""

from __future__ import annotations

from datetime import UTC, datetime

from services.scaler.profile import WEEK_S, DemandProfile, hour_of_week
from services.scaler.settings import ScheduleOverride


def ts(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


def test_hour_of_week_starts_on_monday() -> None:
    assert hour_of_week(ts("2026-11-30T00:30:00")) == 0  # a Monday
    assert hour_of_week(ts("2026-11-29T23:59:00")) == 167  # the Sunday before
    assert hour_of_week(ts("2026-12-02T13:00:00")) == 2 * 24 + 13


def test_profile_divides_by_the_weeks_that_include_the_hour() -> None:
    now = ts("2026-12-02T12:00:00")  # Wednesday noon
    first_seen = now - 2.5 * WEEK_S  # three Wednesdays 09:00 in the last four weeks
    how = 2 * 24 + 9
    rows = [("m", how, 30.0, datetime.fromtimestamp(first_seen, UTC).isoformat())]
    profile = DemandProfile.from_rows(rows, weeks=4, now=now)
    assert profile.loads["m"][how] == 10.0
    # an hour with no rows expects nothing; an unknown model has no profile
    assert profile.loads["m"][how + 1] == 0.0
    assert profile.expected("other", now) is None


def test_ahead_takes_the_larger_of_now_and_one_start_up_later() -> None:
    hourly = [0.0] * 24
    hourly[12] = 40.0
    profile = DemandProfile.from_day("m", hourly)
    before_noon = ts("2026-12-01T11:59:00")
    assert profile.ahead("m", before_noon, lead_s=30) == 0.0
    assert profile.ahead("m", before_noon, lead_s=90) == 40.0  # warm before the peak
    assert profile.ahead("m", ts("2026-12-01T12:59:00"), lead_s=300) == 40.0  # until it ends


def test_schedule_override_windows() -> None:
    night = ScheduleOverride(start="22:00", end="06:00", max_replicas=1, days=[0, 1, 2, 3, 4])
    assert night.applies("any", ts("2026-11-30T23:00:00"))  # Monday night
    assert night.applies("any", ts("2026-12-01T05:59:00"))  # ... into Tuesday morning
    assert not night.applies("any", ts("2026-12-01T06:00:00"))
    assert not night.applies("any", ts("2026-12-05T23:00:00"))  # Saturday
    assert night.applies("any", ts("2026-12-05T03:00:00"))  # Friday night, past midnight
    only = ScheduleOverride(models=["Llama-*"], start="09:00", end="17:00", min_replicas=2)
    assert only.applies("Llama-3-8B", ts("2026-12-01T10:00:00"))
    assert not only.applies("SmolLM2", ts("2026-12-01T10:00:00"))
