"""The scaling decision for one model: pure, no I/O, fed one set of signals per tick.

Need is measured in requests: those running on the model's workers plus those
waiting in its work queue. A worker is sized to ``slots * target_utilization``
of them. On top of that reactive need come a predicted need (the demand the
usage history expects one start-up time ahead), a scale-to-zero rule and the
bounds of the policy and of any schedule override in force.

Scale-up is fast and scale-down slow, as in Kubernetes' HPA: the decision
takes the lowest recommendation of the short up-window and the highest of the
long down-window, and waits a cooldown after any change before going down.
A request waiting for a model with no workers starts one at once.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from tollgate.models.catalog import ScalingPolicy


@dataclass(frozen=True)
class Signals:
    """What the scaler knows about one model at one instant."""

    now: float
    queued: int = 0  # requests waiting in the work queue
    running: int = 0  # requests the workers are running (heartbeats)
    slots_per_worker: int = 1  # a worker's slots (max_num_seqs), from heartbeats
    ready: int = 0
    starting: int = 0
    draining: int = 0
    tokens_per_s: float = 0.0  # prompt + completion tokens/s over the last minute
    predicted_load: float | None = None  # expected requests in flight one start-up ahead
    min_override: int | None = None  # a schedule override in force
    max_override: int | None = None

    @property
    def load(self) -> int:
        return self.running + self.queued


@dataclass(frozen=True)
class Decision:
    desired: int
    previous: int
    reason: str
    recommendation: int
    signals: Signals

    @property
    def changed(self) -> bool:
        return self.desired != self.previous

    def to_dict(self) -> dict[str, Any]:
        return {
            "desired": self.desired,
            "previous": self.previous,
            "reason": self.reason,
            "recommendation": self.recommendation,
            "signals": asdict(self.signals),
        }


@dataclass
class PolicyState:
    """What a model's policy remembers between ticks."""

    desired: int = 0
    last_change_at: float | None = None
    last_active_at: float | None = None
    history: deque[tuple[float, int]] = field(default_factory=deque)


class Policy:
    def __init__(self, config: ScalingPolicy, state: PolicyState | None = None) -> None:
        self.config = config
        self.state = state or PolicyState()

    def capacity(self, signals: Signals) -> float:
        """Requests one worker should hold at the target utilization."""
        return max(1.0, signals.slots_per_worker * self.config.target_utilization)

    def recommend(self, signals: Signals) -> tuple[int, str]:
        """Workers needed right now, before stabilisation, and why."""
        cfg = self.config
        capacity = self.capacity(signals)
        need, reason = math.ceil(signals.load / capacity), "load"
        if cfg.target_tokens_per_s is not None:
            by_tokens = math.ceil(signals.tokens_per_s / cfg.target_tokens_per_s)
            if by_tokens > need:
                need, reason = by_tokens, "tokens_per_s"
        if cfg.predictive and signals.predicted_load is not None:
            predicted = math.ceil(signals.predicted_load / capacity - 1e-9)
            if predicted > need:
                need, reason = predicted, "predicted"
        if need == 0 and self._recently_active(signals.now):
            need, reason = 1, "recently_active"
        if need == 0:
            reason = "idle"
        low = signals.min_override if signals.min_override is not None else cfg.min_replicas
        high = signals.max_override if signals.max_override is not None else cfg.max_replicas
        low = min(low, high)
        if need < low:
            need, reason = low, "min_replicas"
        if need > high:
            need, reason = high, "max_replicas"
        return need, reason

    def _recently_active(self, now: float) -> bool:
        after = self.config.scale_to_zero_after_s
        if after is None:
            return True  # scale to zero is off: keep one once it has been used
        last = self.state.last_active_at
        return last is not None and now - last < after

    def decide(self, signals: Signals) -> Decision:
        cfg, state = self.config, self.state
        now = signals.now
        if signals.load > 0:
            state.last_active_at = now
        recommendation, reason = self.recommend(signals)
        state.history.append((now, recommendation))
        horizon = max(cfg.scale_up_window_s, cfg.scale_down_window_s)
        while state.history and state.history[0][0] < now - horizon:
            state.history.popleft()
        up = min(r for t, r in state.history if t >= now - cfg.scale_up_window_s)
        down = max(r for t, r in state.history if t >= now - cfg.scale_down_window_s)
        previous = state.desired
        desired = previous
        if signals.queued > 0 and previous == 0 and recommendation > 0:
            desired, reason = max(1, up), "from_zero"  # a request is waiting: no window
        elif up > previous:
            desired = up
        elif down < previous:
            cooled = state.last_change_at is None or now - state.last_change_at >= (
                cfg.scale_down_cooldown_s
            )
            if cooled:
                desired = down
                if desired == 0:
                    reason = "scale_to_zero"
        if desired == previous:
            reason = "hold"
        else:
            state.desired = desired
            state.last_change_at = now
        return Decision(desired, previous, reason, recommendation, signals)
