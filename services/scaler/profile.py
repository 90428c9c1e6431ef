"""Hour-of-week demand per model, from the usage history in ClickHouse.

Demand is requests in flight: per five-minute slot, the seconds that requests
spent in the gateway divided by the slot's length (Little's law), and per
hour the busiest slot. An hour of the week expects the mean of that peak
over the weeks of history that include it. The predictive policy looks one
worker start-up ahead, so replicas are warm when the peak arrives.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

HOURS_PER_WEEK = 168
WEEK_S = 7 * 86400
# 1970-01-01 was a Thursday; 1970-01-05 a Monday: index 0 is Monday 00:00 UTC.
_EPOCH_MONDAY_OFFSET_S = 4 * 86400

# Parameters: weeks (UInt32). Rows: model, hour of week (0 = Monday 00-01 UTC),
# summed peak load over the weeks, first event seen for the model.
HISTORY_SQL = """
SELECT model, how, sum(peak) AS peak_sum, min(first_seen) AS first_seen
FROM
(
    SELECT
        model,
        (toDayOfWeek(slot) - 1) * 24 + toHour(slot) AS how,
        toStartOfHour(slot) AS hour,
        max(busy) AS peak,
        min(first_time) AS first_seen
    FROM
    (
        SELECT
            model,
            toStartOfFiveMinutes(time) AS slot,
            sum(total_s) / 300 AS busy,
            min(time) AS first_time
        FROM usage_events
        WHERE time >= now() - toIntervalWeek({weeks:UInt32})
          AND outcome != 'not_dispatched'
        GROUP BY model, slot
    )
    GROUP BY model, how, hour
)
GROUP BY model, how
ORDER BY model, how
"""


def hour_of_week(at: float) -> int:
    return int(((at - _EPOCH_MONDAY_OFFSET_S) % WEEK_S) // 3600)


@dataclass
class DemandProfile:
    """Expected requests in flight per model and hour of week."""

    loads: dict[str, list[float]] = field(default_factory=dict)
    built_at: float = 0.0

    def expected(self, model: str, at: float) -> float | None:
        hours = self.loads.get(model)
        if hours is None:
            return None
        return hours[hour_of_week(at)]

    def ahead(self, model: str, now: float, lead_s: float) -> float | None:
        """The load to be ready for: the larger of this hour's and the one ``lead_s`` ahead."""
        here = self.expected(model, now)
        there = self.expected(model, now + lead_s)
        if here is None or there is None:
            return None
        return max(here, there)

    @classmethod
    def from_rows(
        cls, rows: Iterable[Sequence[object]], weeks: int, now: float | None = None
    ) -> DemandProfile:
        """Build from :data:`HISTORY_SQL` rows (model, how, peak_sum, first_seen)."""
        now = time.time() if now is None else now
        sums: dict[str, list[float]] = {}
        first: dict[str, float] = {}
        for model, how, peak_sum, first_seen in rows:
            hours = sums.setdefault(str(model), [0.0] * HOURS_PER_WEEK)
            hours[int(str(how))] = float(str(peak_sum))
            seen = _unix(first_seen)
            first[str(model)] = min(first.get(str(model), seen), seen)
        loads: dict[str, list[float]] = {}
        for model, hours in sums.items():
            covered = [_weeks_covering(how, first[model], now, weeks) for how in range(168)]
            loads[model] = [s / c if c else 0.0 for s, c in zip(hours, covered, strict=True)]
        return cls(loads, now)

    @classmethod
    def from_day(cls, model: str, hourly: Sequence[float], now: float = 0.0) -> DemandProfile:
        """The same 24-hour shape on every day of the week (for simulations)."""
        if len(hourly) != 24:
            raise ValueError("a day profile has 24 hourly values")
        return cls({model: [hourly[h % 24] for h in range(HOURS_PER_WEEK)]}, now)


def _weeks_covering(how: int, first_seen: float, now: float, weeks: int) -> int:
    """How many times hour-of-week ``how`` occurred between ``first_seen`` and ``now``."""
    start = max(first_seen, now - weeks * WEEK_S)
    # the first occurrence of that hour at or after the start of its hour
    hour_start = math.floor(start / 3600) * 3600
    offset = (how - hour_of_week(hour_start)) % HOURS_PER_WEEK
    first = hour_start + offset * 3600
    if first > now:
        return 0
    return min(weeks, int((now - first) // WEEK_S) + 1)


def _unix(value: object) -> float:
    if isinstance(value, int | float):
        return float(value)
    text = str(value).replace(" ", "T")
    parsed = datetime.fromisoformat(text)
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return parsed.timestamp()
