"""Migration policies, selected by name; "balance,priority" combines several. A new policy is one
file plus one line here."""
from __future__ import annotations

from typing import Optional

from sloserve.cluster.migration.balance import BalancePolicy
from sloserve.cluster.migration.base import (InstanceView, MigrationOptions, MigrationPolicy, Move, MovableRequest,
                                             MoveCosts)
from sloserve.cluster.migration.combined import CombinedPolicy
from sloserve.cluster.migration.defrag import DefragPolicy
from sloserve.cluster.migration.drain import DrainPolicy
from sloserve.cluster.migration.none import NoMigration
from sloserve.cluster.migration.priority import PriorityPolicy

MIGRATION_POLICIES: dict[str, type[MigrationPolicy]] = {p.name: p for p in (
    NoMigration, BalancePolicy, DefragPolicy, PriorityPolicy, DrainPolicy)}


def parse_migration(spec: str) -> list[str]:
    """The policy names of a spec like "balance,priority" ("none" and empty parts dropped)."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    for name in names:
        if name not in MIGRATION_POLICIES:
            raise ValueError(f"unknown migration policy {name!r}; choose from {sorted(MIGRATION_POLICIES)}")
    return [n for n in dict.fromkeys(names) if n != "none"]


def make_migration_policy(spec: str, options: Optional[MigrationOptions] = None) -> MigrationPolicy:
    """The policy named by `spec`: one policy, several combined, or `NoMigration` for "none"."""
    opts = options or MigrationOptions()
    policies = [MIGRATION_POLICIES[n].from_options(opts) for n in parse_migration(spec)]
    if not policies:
        return NoMigration()
    return policies[0] if len(policies) == 1 else CombinedPolicy(policies)


__all__ = ["MigrationPolicy", "MigrationOptions", "MovableRequest", "InstanceView", "Move", "MoveCosts",
           "MIGRATION_POLICIES", "make_migration_policy", "parse_migration", "NoMigration", "BalancePolicy",
           "DefragPolicy", "PriorityPolicy", "DrainPolicy", "CombinedPolicy"]
