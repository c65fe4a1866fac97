"""What the gateway needs to know about the served model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from runtime.tokenizer import Tokenizer


@dataclass(frozen=True)
class ModelInfo:
    """`max_model_len` bounds prompt + output; `max_prompt_len` is the longest prompt
    the service admits (the decode pool bounds it too)."""

    name: str
    path: Path
    max_model_len: int
    max_prompt_len: int
    block_size: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    tokenizer: Tokenizer
