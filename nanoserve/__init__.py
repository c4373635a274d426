"""nanoserve: a small, fast, readable LLM inference engine and OpenAI-compatible server."""

from nanoserve.config import EngineArgs
from nanoserve.llm import LLM
from nanoserve.outputs import CompletionOutput, RequestOutput
from nanoserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineArgs", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
