from __future__ import annotations

from typing import Sequence

from sloserve.cluster.migration.base import InstanceView, MigrationPolicy, Move, MoveCosts


class NoMigration(MigrationPolicy):
    """Requests stay where routing put them: the baseline every migration policy must beat."""

    name = "none"
    moves_anything = False

    def plan(self, now: float, views: Sequence[InstanceView], costs: MoveCosts) -> list[Move]:
        return []
