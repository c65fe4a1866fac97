"""The lengths, block counts and bucket ranges every part of the service plans with, derived
in one place: from the config and the model at construction, then from the pools the
workers got. The service config (`bucketserve/deploy/serve_config.py`) asks the static methods here
for
the same values before a controller exists."""

from __future__ import annotations

import dataclasses
import math

from bucketserve.bucket_manager.config import (
    BatchingConfig,
    BucketManagerConfig,
    BucketRange,
    DecodeShapeConfig,
    PromptShapeConfig,
    ShapeBucketConfig,
)
from bucketserve.controller.config import ControllerConfig
from bucketserve.messages import ModelInfo
from bucketserve.runtime.io.model_config import ModelConfig
from bucketserve.runtime.io.tokenizer import Tokenizer
from bucketserve.runtime.loader.model_files import resolve_model
from bucketserve.runtime.models import load_model_config

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


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

    @staticmethod
    def max_model_len(config: ControllerConfig, model: ModelConfig) -> int:
        """The longest sequence served: `runner.max_model_len`, else the model's length.
        ValueError beyond the model's length."""
        limit, name = model.max_position_embeddings, config.runner.model
        wanted = config.runner.max_model_len or limit
        if wanted > limit:
            raise ValueError(
                f"{wanted} is beyond the model's length: allowed 2..{limit} "
                f"(max_position_embeddings of {name or 'the embedded ' + DEFAULT_MODEL})"
            )
        return wanted

    @staticmethod
    def bucket_config(config: ControllerConfig, max_model_len: int) -> BucketManagerConfig:
        """`config.buckets` sized for the model (the default buckets when it has none), so
        every admitted prompt has a request bucket and the shapes use the pool's blocks."""
        block_size = config.runner.block_size
        if config.buckets is None:
            max_num_seqs = config.decode.max_num_seqs
            return ServiceLimits.default_buckets(max_model_len, block_size, max_num_seqs)
        return _size_for_model(config.buckets, max_model_len, block_size)

    @staticmethod
    def default_buckets(
        max_model_len: int, block_size: int, max_num_seqs: int
    ) -> BucketManagerConfig:
        """Request buckets over the model's length; prompt shapes of batch 1..16 and query
        block_size..max_model_len in half-octave steps (fresh prompts only: no context
        blocks), about half the padding of doubling steps; decode shapes of
        batch 1..max_num_seqs and blocks (the batch's total) up to max_num_seqs max_model_len
        sequences; prefill batches
        of at most max_num_seqs, the decode batch they join."""
        return _size_for_model(
            BucketManagerConfig(
                batching=BatchingConfig(max_num_seqs=max_num_seqs),
                shape_buckets=ShapeBucketConfig(
                    prompt=PromptShapeConfig(
                        bs=BucketRange(1, 1, 16, 5),
                        query=_doubling(block_size, max_model_len, per_octave=2),
                        ctx=BucketRange(0, 1, 0, 1),
                    ),
                    decode=DecodeShapeConfig(
                        bs=_doubling(1, max_num_seqs),
                        # the batch's blocks in all: up to max_num_seqs full-length sequences
                        blocks=_doubling(1, max_num_seqs * -(-max_model_len // block_size)),
                    ),
                ),
            ),
            max_model_len,
            block_size,
        )

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
    runner = config.runner
    model_dir = resolve_model(runner.model, keep_blocks=runner.quantization == "auto")
    model_config = load_model_config(model_dir)
    try:
        max_model_len = ServiceLimits.max_model_len(config, model_config)
    except ValueError as exc:
        raise ValueError(f"max_model_len {exc}") from None
    tokenizer = Tokenizer.from_dir(model_dir, config.runner.chat_template)
    eos = {*model_config.eos_token_ids, tokenizer.eos_token_id} - {None}
    info = ModelInfo(
        name=config.runner.model or DEFAULT_MODEL,
        path=model_dir,
        max_model_len=max_model_len,
        max_prompt_len=max_model_len - 1,
        block_size=config.runner.block_size,
        vocab_size=model_config.vocab_size,
        eos_token_ids=frozenset(eos),
        tokenizer=tokenizer,
        tool_call_parser=runner.tool_call_parser,
    )
    return info, ServiceLimits.bucket_config(config, max_model_len)


def _size_for_model(
    config: BucketManagerConfig, max_model_len: int, block_size: int
) -> BucketManagerConfig:
    """`config` with its shape buckets' block size and length, and its request buckets'
    length range, set to the model's, so every admitted prompt has a bucket."""
    shapes = config.shape_buckets.model_copy(
        update={"block_size": block_size, "max_model_len": max_model_len}
    )
    requests = config.request_buckets.model_copy(update={"max_len": max(max_model_len, 2)})
    return dataclasses.replace(config, shape_buckets=shapes, request_buckets=requests)


def _doubling(low: int, high: int, per_octave: int = 1) -> BucketRange:
    """Exponential points from low to high, `per_octave` of them per doubling."""
    high = max(low, high)
    return BucketRange(low, low, high, per_octave * int(math.log2(high / low)) + 1)
