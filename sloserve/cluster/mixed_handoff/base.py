"""Hand-off from a mixed instance: the interface.

In a colocated fleet every instance prefills and decodes. Llumnix showed a mixed instance can
also act as the prefill side of a disaggregated pair for one request: once the request has its
first token, its KV moves to another instance and it decodes there, on the same transfer path
as a prefill/decode hand-off. Whether that pays is a per-request decision at that moment: the
request's next tokens share steps with whatever prefill work its instance has queued. A policy
says whether to look for a target at all (`considers`, on the source's state) and whether the
target the decode router picked is better for the request than staying (`pays`). Asked once per
request, at its first token; a request that stays decodes where it was prefilled."""
from __future__ import annotations

from abc import ABC, abstractmethod

from sloserve.sched.state import InstanceState


class MixedHandoff(ABC):
    name: str = ""
    hands_off_anything: bool = True  # False only for `never`: no hand-off machinery needed

    @abstractmethod
    def considers(self, source: InstanceState) -> bool:
        """Whether a request that just got its first token on `source` might leave it."""

    @abstractmethod
    def pays(self, source: InstanceState, target: InstanceState) -> bool:
        """Whether decoding on `target` (the decode router's pick) beats staying on `source`."""
