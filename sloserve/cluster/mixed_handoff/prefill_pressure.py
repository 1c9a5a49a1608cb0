from __future__ import annotations

from sloserve.cluster.mixed_handoff.base import MixedHandoff
from sloserve.sched.state import InstanceState


class PrefillPressureHandOff(MixedHandoff):
    """Leave an instance whose queued prefill work will crowd the request's next steps.

    A request's tokens after the first wait on every step of its instance; steps that carry
    prefill chunks are the long ones (chunked prefill's TBT cost). So a request moves when its
    source has at least `queued_tokens` prompt tokens still to compute (the steps ahead carry
    chunks) and the target has fewer than that (its steps ahead are mostly decode), no more
    running requests than the source, and free KV blocks. Leaving also shortens the source's
    decode batch, so its backlog (the queued requests' TTFT) clears sooner."""

    name = "prefill-pressure"

    def __init__(self, queued_tokens: int = 1024) -> None:
        if queued_tokens < 1:
            raise ValueError(f"the hand-off's queued prefill tokens must be >= 1, got {queued_tokens}")
        self.queued_tokens = queued_tokens

    def considers(self, source: InstanceState) -> bool:
        return source.queued_prefill_tokens >= self.queued_tokens

    def pays(self, source: InstanceState, target: InstanceState) -> bool:
        return (target.queued_prefill_tokens < min(self.queued_tokens, source.queued_prefill_tokens)
                and target.num_running <= source.num_running and target.kv_blocks_free > 0)
