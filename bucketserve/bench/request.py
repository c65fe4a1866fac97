"""One request of a workload, before it is sent (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass

WORKLOADS = ("short", "long", "mixed", "sharegpt", "prefix-flood")
REQUEST_KINDS = ("short", "long", "sharegpt", "chat", "doc")  # the part a request comes from


@dataclass(frozen=True)
class BenchRequest:
    """`prompt_len` is the prompt's token count under the model's tokenizer (as the server
    counts it); `kind` is the workload part it came from (short / long / sharegpt)."""

    index: int
    prompt: str
    prompt_len: int
    max_tokens: int
    kind: str
    tenant: str = "default"
