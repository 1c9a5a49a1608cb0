"""sloserve: SLO-driven LLM serving.

`import sloserve` stays light (no torch): the offline API is imported on first use, so the
scheduler, the memory manager and the simulator load without the engine.
"""
from sloserve.core.types import FinishReason, QoSClass, Request, RequestStatus, SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "AsyncLLMEngine", "LLMEngine", "FinishReason", "QoSClass", "Request", "RequestStatus", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":
        from sloserve.engine.llm import LLM
        return LLM
    if name == "LLMEngine":
        from sloserve.engine.llm_engine import LLMEngine
        return LLMEngine
    if name == "AsyncLLMEngine":
        from sloserve.engine.async_engine import AsyncLLMEngine
        return AsyncLLMEngine
    raise AttributeError(f"module 'sloserve' has no attribute {name!r}")
