"""The runtime both workers share; `from bucketserve.runtime import LLM, SamplingParams`.

Exports resolve lazily, so importing a torch-free module such as
`bucketserve.runtime.core.block_manager` or `bucketserve.runtime.core.scheduler` never imports
torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "LLM": "bucketserve.runtime.engine.llm",
    "LLMEngine": "bucketserve.runtime.engine.llm_engine",
    "EngineConfig": "bucketserve.runtime.engine.engine_config",
    "EngineStats": "bucketserve.runtime.engine.llm_engine",
    "ModelRunner": "bucketserve.runtime.worker.model_runner",
    "ModelRunnerConfig": "bucketserve.runtime.worker.runner_config",
    "RequestOutput": "bucketserve.runtime.core.outputs",
    "CompletionOutput": "bucketserve.runtime.core.outputs",
    "SamplingParams": "bucketserve.runtime.core.sampling_params",
    "Sequence": "bucketserve.runtime.core.sequence",
    "SequenceStatus": "bucketserve.runtime.core.sequence",
    "FinishReason": "bucketserve.runtime.core.sequence",
    "BlockManager": "bucketserve.runtime.core.block_manager",
    "Scheduler": "bucketserve.runtime.core.scheduler",
    "SchedulerConfig": "bucketserve.runtime.core.scheduler",
    "SchedulerOutput": "bucketserve.runtime.core.scheduler_output",
    "Detokenizer": "bucketserve.runtime.io.detokenizer",
    "Tokenizer": "bucketserve.runtime.io.tokenizer",
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
    from bucketserve.runtime.core.block_manager import BlockManager
    from bucketserve.runtime.core.outputs import CompletionOutput, RequestOutput
    from bucketserve.runtime.core.sampling_params import SamplingParams
    from bucketserve.runtime.core.scheduler import Scheduler, SchedulerConfig
    from bucketserve.runtime.core.scheduler_output import SchedulerOutput
    from bucketserve.runtime.core.sequence import FinishReason, Sequence, SequenceStatus
    from bucketserve.runtime.engine.engine_config import EngineConfig
    from bucketserve.runtime.engine.llm import LLM
    from bucketserve.runtime.engine.llm_engine import EngineStats, LLMEngine
    from bucketserve.runtime.io.detokenizer import Detokenizer
    from bucketserve.runtime.io.tokenizer import Tokenizer
    from bucketserve.runtime.worker.model_runner import ModelRunner
    from bucketserve.runtime.worker.runner_config import ModelRunnerConfig


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'bucketserve.runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
