"""Seeded workloads: short (Alpaca-like), long (LongBench-like), mixed, ShareGPT, and
prefix-flood (chat turns behind one shared system prompt beside long unique documents)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bucketserve.bench.length_distribution import ALPACA, LONGBENCH, LengthDistribution
from bucketserve.bench.request import WORKLOADS, BenchRequest
from bucketserve.bench.sharegpt_reader import ShareGPTReader, first_exchange
from bucketserve.bench.tenant_mix import TenantMix
from bucketserve.bench.text_corpus import TextCorpus

OUTPUT = LengthDistribution(mean=128.0, sigma=0.5, low=8, high=512)


@dataclass(frozen=True)
class WorkloadConfig:
    """`long_fraction`: share of long requests in `mixed` (of `doc` ones in `prefix-flood`,
    whose `chat` requests open with one `system_prompt_len`-token system prompt). Synthetic
    output lengths follow `output`; ShareGPT's are its replies' token counts, clipped to
    `output.high`. Every prompt + output fits `max_model_len`."""

    name: str = "mixed"
    num_requests: int = 100
    seed: int = 0
    max_model_len: int = 2048
    long_fraction: float = 0.2
    short: LengthDistribution = ALPACA
    long: LengthDistribution = LONGBENCH
    output: LengthDistribution = OUTPUT
    sharegpt_path: str | None = None
    sharegpt_max_records: int = 0  # 0: read every complete record
    system_prompt_len: int = 1024

    def __post_init__(self) -> None:
        if self.name not in WORKLOADS:
            raise ValueError(f"workload must be one of {WORKLOADS}, got {self.name!r}")
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if not 0.0 <= self.long_fraction <= 1.0:
            raise ValueError(f"long_fraction must be in [0, 1], got {self.long_fraction}")
        if self.name == "prefix-flood" and (
            self.system_prompt_len + 64 + self.output.high > self.max_model_len
        ):
            raise ValueError(
                f"a {self.system_prompt_len}-token system prompt, a question and up to "
                f"{self.output.high} output tokens do not fit max_model_len "
                f"{self.max_model_len}: shorten --system-prompt-len or the outputs"
            )
        if self.max_model_len <= self.output.high + 8:
            raise ValueError(
                f"max_model_len {self.max_model_len} leaves no room for prompts beside outputs "
                f"of up to {self.output.high} tokens: lower the output maximum"
            )


@dataclass
class Workload:
    requests: list[BenchRequest]
    info: dict[str, Any] = field(default_factory=dict)


class WorkloadGenerator:
    def __init__(self, config: WorkloadConfig, tokenizer: Any, tenants: TenantMix | None = None):
        self.config = config
        self.tokenizer = tokenizer
        self.tenants = tenants or TenantMix()
        self.corpus = TextCorpus(tokenizer)

    @property
    def max_prompt_len(self) -> int:
        return self.config.max_model_len - self.config.output.high

    def generate(self) -> Workload:
        rng = np.random.default_rng(self.config.seed)
        if self.config.name == "sharegpt":
            items, info = self._sharegpt(rng)
        else:
            items, info = self._synthetic(rng), {}
        requests = [
            BenchRequest(i, text, n, out, kind, self.tenants.pick(kind, rng))
            for i, (text, n, out, kind) in enumerate(items)
        ]
        info |= _length_stats(requests) | {"workload": self.config.name, "seed": self.config.seed}
        return Workload(requests, info)

    def _kinds(self, rng: np.random.Generator) -> list[str]:
        n, name = self.config.num_requests, self.config.name
        pair = {"mixed": ("long", "short"), "prefix-flood": ("doc", "chat")}.get(name)
        if pair is None:
            return [name] * n
        return [pair[0] if x else pair[1] for x in rng.random(n) < self.config.long_fraction]

    def _synthetic(self, rng: np.random.Generator) -> list[tuple[str, int, int, str]]:
        kinds = self._kinds(rng)
        cap = self.max_prompt_len
        system = ""
        if "chat" in kinds:
            system, _ = self.corpus.prompt(self.config.system_prompt_len, rng)
        question_cap = cap - self.config.system_prompt_len - 16
        lengths = {
            "short": self.config.short.capped(cap).sample(rng, len(kinds)),
            "long": self.config.long.capped(cap).sample(rng, len(kinds)),
            "chat": self.config.short.capped(question_cap).sample(rng, len(kinds)),
            "doc": self.config.long.capped(cap - 16).sample(rng, len(kinds)),
        }
        outputs = self.config.output.sample(rng, len(kinds))
        items = []
        for i, kind in enumerate(kinds):
            text, n = self.corpus.prompt(lengths[kind][i], rng)
            if kind == "chat":  # one shared prefix
                text = f"{system}\n\nQuestion {i}: {text}"
            elif kind == "doc":  # unique from its first block on
                text = f"Document {i}. {text}"
            if kind in ("chat", "doc"):
                n = self.corpus.count(text)
            items.append((text, n, outputs[i], kind))
        return items

    def _sharegpt(self, rng: np.random.Generator) -> tuple[list, dict[str, Any]]:
        reader = ShareGPTReader(self.config.sharegpt_path)
        limit = self.config.sharegpt_max_records
        exchanges = []
        for record in reader.records():
            pair = first_exchange(record)
            if pair is not None:
                exchanges.append(pair)
            if limit and reader.stats.complete_records >= limit:
                break
        items, too_long = [], 0
        out_cap = self.config.output.high
        for j in rng.permutation(len(exchanges)):
            prompt, reply = exchanges[j]
            n = len(self.tokenizer.encode(prompt))
            out = len(self.tokenizer.encode(reply, add_special_tokens=False))
            if n > self.max_prompt_len or out < 1:
                too_long += 1
                continue
            items.append((prompt, n, min(out, out_cap), "sharegpt"))
            if len(items) == self.config.num_requests:
                break
        if len(items) < self.config.num_requests:
            raise ValueError(
                f"ShareGPT gave only {len(items)} usable conversations of the "
                f"{self.config.num_requests} asked for: ask for fewer or raise the model length"
            )
        info = {
            "sharegpt_complete_records": reader.stats.complete_records,
            "sharegpt_truncated_tail_bytes": reader.stats.truncated_tail_bytes,
            "sharegpt_conversations": len(exchanges),
            "sharegpt_skipped_too_long": too_long,
            "sharegpt_used": len(items),
        }
        return items, info


def _length_stats(requests: list[BenchRequest]) -> dict[str, Any]:
    prompts = np.array([r.prompt_len for r in requests])
    outputs = np.array([r.max_tokens for r in requests])
    return {
        "num_requests": len(requests),
        "prompt_len_mean": float(prompts.mean()),
        "prompt_len_p50": float(np.percentile(prompts, 50)),
        "prompt_len_p99": float(np.percentile(prompts, 99)),
        "prompt_len_max": int(prompts.max()),
        "output_len_mean": float(outputs.mean()),
        "kinds": _counts(r.kind for r in requests),
        "tenants": _counts(r.tenant for r in requests),
    }


def _counts(values: Iterable[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return dict(sorted(out.items()))
