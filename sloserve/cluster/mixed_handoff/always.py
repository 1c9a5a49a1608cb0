from __future__ import annotations

from sloserve.cluster.mixed_handoff.base import MixedHandoff
from sloserve.sched.state import InstanceState


class AlwaysHandOff(MixedHandoff):
    """Every request decodes on another instance than the one that prefilled it (the decode
    router's pick): disaggregation by request rather than by instance, the bound of the option."""

    name = "always"

    def considers(self, source: InstanceState) -> bool:
        return True

    def pays(self, source: InstanceState, target: InstanceState) -> bool:
        return True
