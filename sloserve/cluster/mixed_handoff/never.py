from __future__ import annotations

from sloserve.cluster.mixed_handoff.base import MixedHandoff
from sloserve.sched.state import InstanceState


class NeverHandOff(MixedHandoff):
    """Colocated serving: a request decodes where it was prefilled (the default)."""

    name = "never"
    hands_off_anything = False

    def considers(self, source: InstanceState) -> bool:
        return False

    def pays(self, source: InstanceState, target: InstanceState) -> bool:
        return False
