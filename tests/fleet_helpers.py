"""A real front's fleet bookkeeping with no workers behind it: stand-in handles that are always running."""
from __future__ import annotations


class StandInHandle:
    url = "http://127.0.0.1:9"

    def is_running(self) -> bool:
        return True

    def kill(self) -> None:
        pass

    def describe(self) -> dict:
        return {}
