"""pagestream's service layer: the server, the offline LLM API and the CLI.

`from service import LLM, SamplingParams` is the offline entry point; the imports are
lazy so that `import service` does not pull in torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from scheduler.sampling_params import SamplingParams

if TYPE_CHECKING:
    from service.async_engine import AsyncEngine, EngineConfig, RequestOutput
    from service.beam_search import BeamSearchParams
    from service.llm import LLM

__all__ = [
    "LLM",
    "AsyncEngine",
    "BeamSearchParams",
    "EngineConfig",
    "RequestOutput",
    "SamplingParams",
]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from service.llm import LLM

        return LLM
    if name == "BeamSearchParams":
        from service.beam_search import BeamSearchParams

        return BeamSearchParams
    if name in ("AsyncEngine", "EngineConfig", "RequestOutput"):
        from service import async_engine as engine

        return getattr(engine, name)
    raise AttributeError(name)
