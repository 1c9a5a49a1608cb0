"""The demand an autoscaler sees: arrivals counted in fixed windows, read as the request rate of
every window that has ended. The real front and the simulator meter demand with this one class;
time is passed in (seconds since the fleet started)."""
from __future__ import annotations


class DemandMeter:
    def __init__(self, step_s: float) -> None:
        if not step_s > 0:
            raise ValueError(f"the demand window must be > 0 s, got {step_s}")
        self.step_s = step_s
        self.counts: list[int] = []  # arrivals per window, from time 0

    def observe(self, t: float, count: int = 1) -> None:
        """`count` requests arrived at time `t`."""
        k = int(t // self.step_s)
        if k >= len(self.counts):
            self.counts.extend([0] * (k + 1 - len(self.counts)))
        self.counts[k] += count

    def rates(self, t: float) -> tuple[float, ...]:
        """Requests/s in each window that has ended by time `t` (a window nobody arrived in: 0)."""
        done = int(t // self.step_s)
        counts = self.counts[:done] + [0] * max(0, done - len(self.counts))
        return tuple(c / self.step_s for c in counts)
