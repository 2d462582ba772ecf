"""prefixserve engine: paged KV cache, continuous batching, prefix sharing.

    from engine import LLM, SamplingParams
"""
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine import openai_compat
from engine.engine import Engine
from engine.frontend import ModelInfo
from engine.errors import (
    ContextLengthExceededError,
    EngineDeadError,
    EngineOverloadedError,
    InvalidConfigError,
    InvalidRequestError,
    PrefixServeError,
)
from engine.llm import LLM, BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from engine.json_schemas import close_json_schema
from engine.tool_calls import ToolChat

__all__ = [
    "AsyncEngine", "BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence", "CompletionOutput", "ContextLengthExceededError", "Engine", "EngineConfig", "EngineDeadError",
    "EngineOverloadedError", "InvalidConfigError", "InvalidRequestError", "LLM", "Logprob", "ModelInfo",
    "PrefixServeError", "RequestOutput",
    "SamplingParams", "StructuredOutputsParams", "ToolChat", "close_json_schema", "openai_compat",
]
