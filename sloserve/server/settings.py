"""What a server instance is configured with, apart from the engine."""
from __future__ import annotations

from dataclasses import dataclass, field

from sloserve.server.qos import QoSRegistry


@dataclass
class ServerSettings:
    # Names clients may put in `model`; the first is the one responses report.
    served_model_names: list[str] = field(default_factory=list)
    registry: QoSRegistry = field(default_factory=QoSRegistry)
    # Requests beyond one full batch that may wait for the engine; more get 429.
    max_queue: int = 256
    max_body_bytes: int = 4 * 2**20
    grace_period_s: float = 30.0
    retry_after_s: int = 1

    def validate(self) -> None:
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.max_body_bytes <= 0:
            raise ValueError(f"max_body_bytes must be positive, got {self.max_body_bytes}")
        if self.grace_period_s < 0:
            raise ValueError(f"grace_period must be >= 0, got {self.grace_period_s}")
        if any(not n for n in self.served_model_names):
            raise ValueError("served model names must be non-empty")
