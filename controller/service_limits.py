"""The lengths and block counts every part of the service plans with, derived in one place:
from the config and the model at construction, then from the pools the workers got."""

from __future__ import annotations

import dataclasses

from bucket_manager.config import BucketManagerConfig
from controller.config import ControllerConfig, default_buckets, fit_buckets
from kv_worker.messages import ModelInfo
from runtime.model_config import ModelConfig
from runtime.tokenizer import Tokenizer
from runtime.weights import resolve_model


class ServiceLimits:
    """`model`: what the gateway admits against (its `max_prompt_len` tightens once the
    pools are known); `buckets`: the bucket manager's config sized for `max_model_len`
    and `block_size`; `max_seq_len` and `decode_capacity` (blocks one batch may take from
    an empty decode pool, Eq. 5) bound what a request is planned with."""

    def __init__(self, config: ControllerConfig) -> None:
        self.model, self.buckets = describe_model(config)
        self.block_size = self.model.block_size
        self.max_seq_len = self.model.max_model_len
        self.decode_capacity = 0

    def bound_by_pools(self, decode_blocks: int, prefill_blocks: int, safe_blocks: int) -> None:
        """Tighten the bounds to the smallest decode and prefill pools the workers got;
        `safe_blocks` is the batching controller's share of an empty decode pool."""
        bs = self.block_size
        self.max_seq_len = min(self.model.max_model_len, decode_blocks * bs)
        self.decode_capacity = safe_blocks
        longest = min(self.max_seq_len - 1, prefill_blocks * bs, safe_blocks * bs - 1)
        if longest < 1:
            raise ValueError(
                f"the KV pools are too small: decode {decode_blocks} and prefill "
                f"{prefill_blocks} blocks of {bs} tokens cannot hold a 1-token prompt"
            )
        self.model = dataclasses.replace(self.model, max_prompt_len=longest)

    def max_tokens_hint(self, max_tokens_left: int, num_tokens: int) -> int:
        """The output length the bucket manager plans blocks for: what is left of max_tokens,
        capped by the length limit and by what an empty decode pool can hold."""
        room = min(self.max_seq_len, self.decode_capacity * self.block_size) - num_tokens
        return max(1, min(max_tokens_left, room))


def describe_model(config: ControllerConfig) -> tuple[ModelInfo, BucketManagerConfig]:
    """The served model's limits and tokenizer, and the bucket config sized for them."""
    model_dir = resolve_model(config.runner.model)
    model_config = ModelConfig.from_dir(model_dir)
    max_model_len = config.runner.max_model_len or model_config.max_position_embeddings
    if max_model_len > model_config.max_position_embeddings:
        raise ValueError(
            f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
            f"{model_config.max_position_embeddings}"
        )
    block_size = config.runner.block_size
    buckets = (
        default_buckets(max_model_len, block_size, config.scheduler.max_num_seqs)
        if config.buckets is None
        else fit_buckets(config.buckets, max_model_len, block_size)
    )
    tokenizer = Tokenizer.from_dir(model_dir)
    eos = {*model_config.eos_token_ids, tokenizer.eos_token_id} - {None}
    info = ModelInfo(
        name=config.runner.model or "SmolLM2-135M-Instruct",
        path=model_dir,
        max_model_len=max_model_len,
        max_prompt_len=max_model_len - 1,
        block_size=block_size,
        vocab_size=model_config.vocab_size,
        eos_token_ids=frozenset(eos),
        tokenizer=tokenizer,
    )
    return info, buckets
