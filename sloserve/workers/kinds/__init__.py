"""Engine kinds: how the front and the fleet speak to each kind of worker server (base.py says
what a kind answers): sloserve's own worker, and a stock vLLM server (vllm.py)."""
from sloserve.workers.kinds.base import SLOSERVE, EngineKind

__all__ = ["EngineKind", "SLOSERVE"]
