"""The runtime both workers share; `from runtime import LLM, SamplingParams`.

Exports resolve lazily, so importing a torch-free module such as
`runtime.block_manager` or `runtime.scheduler` never imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "LLM": "runtime.llm",
    "LLMEngine": "runtime.engine",
    "EngineConfig": "runtime.engine_config",
    "EngineStats": "runtime.engine",
    "ModelRunner": "runtime.model_runner",
    "ModelRunnerConfig": "runtime.model_runner",
    "RequestOutput": "runtime.outputs",
    "CompletionOutput": "runtime.outputs",
    "SamplingParams": "runtime.sampling_params",
    "Sequence": "runtime.sequence",
    "SequenceStatus": "runtime.sequence",
    "FinishReason": "runtime.sequence",
    "BlockManager": "runtime.block_manager",
    "Scheduler": "runtime.scheduler",
    "SchedulerConfig": "runtime.scheduler",
    "SchedulerOutput": "runtime.scheduler_output",
    "Detokenizer": "runtime.detokenizer",
    "Tokenizer": "runtime.tokenizer",
}

__all__ = [
    "LLM",
    "BlockManager",
    "CompletionOutput",
    "Detokenizer",
    "EngineConfig",
    "EngineStats",
    "FinishReason",
    "LLMEngine",
    "ModelRunner",
    "ModelRunnerConfig",
    "RequestOutput",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "Sequence",
    "SequenceStatus",
    "Tokenizer",
]

if TYPE_CHECKING:
    from runtime.block_manager import BlockManager
    from runtime.detokenizer import Detokenizer
    from runtime.engine import EngineStats, LLMEngine
    from runtime.engine_config import EngineConfig
    from runtime.llm import LLM
    from runtime.model_runner import ModelRunner, ModelRunnerConfig
    from runtime.outputs import CompletionOutput, RequestOutput
    from runtime.sampling_params import SamplingParams
    from runtime.scheduler import Scheduler, SchedulerConfig
    from runtime.scheduler_output import SchedulerOutput
    from runtime.sequence import FinishReason, Sequence, SequenceStatus
    from runtime.tokenizer import Tokenizer


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
