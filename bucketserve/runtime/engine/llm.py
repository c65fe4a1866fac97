"""`LLM`: offline batch generation over the in-process engine, vLLM style."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from bucketserve.runtime.core.outputs import RequestOutput
from bucketserve.runtime.core.sampling_params import SamplingParams
from bucketserve.runtime.engine.llm_engine import LLMEngine
from bucketserve.runtime.io.tokenizer import Tokenizer
from bucketserve.runtime.worker.model_runner import ModelRunner

Prompt = str | list[int]
Messages = list[dict[str, Any]]


class LLM:
    """Generate for a list of prompts at once with continuous batching.

    `LLM(model=None)` loads the embedded SmolLM2; other keyword arguments are
    engine options (`max_num_seqs`, `num_kv_blocks`, `pipeline_depth`,
    `pipeline_parallel_size`, `tensor_parallel_size`, ..., see
    `EngineConfig.from_kwargs`). `runner` reuses an
    already loaded model.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        *,
        runner: ModelRunner | None = None,
        **config: Any,
    ) -> None:
        model = None if model is None else os.fspath(model)
        self.engine = LLMEngine.from_kwargs(runner=runner, model=model, **config)

    def close(self) -> None:
        """Stop what the engine started (pipeline stages, tensor-parallel ranks)."""
        self.engine.close()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def warmup(self, shapes: Sequence[tuple[int, int, int]]) -> dict:
        """Compile these step shapes `(batch, query, blocks)` now (`execution="graphs"`);
        a step later pads to the smallest that holds it, or compiles its own (a miss).
        Returns each shape's seconds."""
        return self.engine.runner.warmup(shapes)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Finished outputs in the order of `prompts` (texts or token id lists). `priority`:
        one per prompt, lower first, with `scheduling_policy="priority"` (as vLLM's)."""
        prompts = _as_list(prompts)
        return self._run([(p, None) for p in prompts], sampling_params, use_tqdm, priority)

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Like generate() for conversations ([{"role", "content"}, ...], or a list of them),
        rendered with the model's chat template, or `chat_template` (a file or the Jinja
        text) instead."""
        if isinstance(messages, list) and messages and isinstance(messages[0], dict):
            messages = [messages]
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a conversation or a non-empty list of them")
        requests = []
        for conversation in messages:
            text = self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=True, chat_template=chat_template
            )
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            requests.append((ids, text))
        return self._run(requests, sampling_params, use_tqdm)

    def _run(
        self,
        requests: list[tuple[Prompt, str | None]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        params = _params_per_prompt(sampling_params, len(requests))
        prompts, texts = [r[0] for r in requests], [r[1] for r in requests]
        ids = self.engine.add_requests(prompts, params, texts, priority)
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), disable=not use_tqdm, desc="generate") as bar:
            while len(done) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        return [done[i] for i in ids]

def _as_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a str, a list of token ids, or a non-empty list of them")
    if all(isinstance(p, int) for p in prompts):
        return [list(prompts)]
    return list(prompts)


def _params_per_prompt(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts; pass one or one each")
    return params
