"""TokenSpeed: an LLM inference engine for agentic workloads."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenspeed.scheduler.sampling_params import SamplingParams
from tokenspeed.scheduler.structured_outputs import GuidedDecodingParams, StructuredOutputsParams

__version__ = "0.1.0"
__all__ = [
    "LLM", "SamplingParams", "StructuredOutputsParams", "GuidedDecodingParams", "RequestOutput",
    "CompletionOutput", "EngineConfig", "__version__",
]

if TYPE_CHECKING:
    from tokenspeed.config import EngineConfig
    from tokenspeed.engine.llm import LLM
    from tokenspeed.engine.outputs import CompletionOutput, RequestOutput


def __getattr__(name: str) -> object:
    """Import torch-heavy pieces lazily so `import tokenspeed.scheduler` stays torch-free."""
    if name == "LLM":
        from tokenspeed.engine.llm import LLM

        return LLM
    if name in ("RequestOutput", "CompletionOutput"):
        from tokenspeed.engine import outputs

        return getattr(outputs, name)
    if name == "EngineConfig":
        from tokenspeed.config import EngineConfig

        return EngineConfig
    raise AttributeError(name)
