"""When a mixed instance hands a request it prefilled to another instance, by name
(`--mixed-handoff`). A new policy is one file plus one line here."""
from __future__ import annotations

from typing import Optional

from sloserve.cluster.mixed_handoff.always import AlwaysHandOff
from sloserve.cluster.mixed_handoff.base import MixedHandoff
from sloserve.cluster.mixed_handoff.never import NeverHandOff
from sloserve.cluster.mixed_handoff.prefill_pressure import PrefillPressureHandOff

MIXED_HANDOFFS: dict[str, type[MixedHandoff]] = {p.name: p for p in (NeverHandOff, AlwaysHandOff,
                                                                    PrefillPressureHandOff)}
DEFAULT_QUEUED_TOKENS = 1024


def make_mixed_handoff(name: str, queued_tokens: Optional[int] = None) -> MixedHandoff:
    """`queued_tokens`: prefill-pressure's threshold (None: DEFAULT_QUEUED_TOKENS)."""
    if queued_tokens is None:
        queued_tokens = DEFAULT_QUEUED_TOKENS
    if name not in MIXED_HANDOFFS:
        raise ValueError(f"unknown mixed hand-off policy {name!r}; choose from {sorted(MIXED_HANDOFFS)}")
    if name == PrefillPressureHandOff.name:
        return PrefillPressureHandOff(queued_tokens)
    return MIXED_HANDOFFS[name]()


__all__ = ["MixedHandoff", "MIXED_HANDOFFS", "DEFAULT_QUEUED_TOKENS", "make_mixed_handoff", "NeverHandOff",
           "AlwaysHandOff", "PrefillPressureHandOff"]
