"""A generation request as a front end or the SDK reads it, before validation (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class GenerateInput:
    """A request as a front end parsed it: exactly one of `prompt`, `prompt_token_ids` or
    `messages`; `sampling` holds SamplingParams keywords (max_tokens None: the rest of the
    model's context)."""

    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    request_id: str | None = None
    priority: int = 0
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    cache_salt: str | None = None  # narrows the tenant's prefix-cache domain
    tools: list[dict[str, Any]] | None = None  # chat: rendered by the template (HF's `tools`)
    tool_choice: str | None = None  # none / auto / required (None: auto)
    tool_function: str | None = None  # tool_choice naming a function: exactly one call of it
    parallel_tool_calls: bool | None = None  # None: true
    structured_name: str = "structured_outputs"  # the field a constraint came in, for errors
