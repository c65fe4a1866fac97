"""Memory-safe batch size: Eq. 5-6, counted in KV blocks of the decode pool."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from fractions import Fraction

from bucketserve.bucket_manager.config import BatchingConfig
from bucketserve.bucket_manager.request import BucketRequest
from bucketserve.utils.checks import check_int


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def largest_prefix(values: Iterable[int], budget: int, cap: int | None = None) -> int:
    """The largest N (at most `cap`) whose first N values sum to at most `budget`."""
    used, n = 0, 0
    for value in values:
        if n == cap or used + value > budget:
            break
        used += value
        n += 1
    return n


class BatchingController:
    def __init__(self, config: BatchingConfig) -> None:
        self.config = config
        self._safety = Fraction(str(config.safety_fraction))  # exact: 0.9 x 1000 is 900

    def safe_blocks(self, free_blocks: int) -> int:
        """Eq. 5: M_safe = 0.9 x M_remain, with memory counted in free KV blocks."""
        return int(self._safety * free_blocks)

    def room_for(self, num_blocks: int) -> int:
        """The fewest free blocks whose safe share (Eq. 5) holds `num_blocks`: the room a
        decode worker needs to take a batch that needs them."""
        return ceil_div(num_blocks * self._safety.denominator, self._safety.numerator)

    def kv_blocks(self, request: BucketRequest, block_size: int) -> int:
        """Blocks one request takes; n > 1 samples share the prompt's full blocks but the
        one holding its last token, and each grows on its own."""
        one = ceil_div(request.kv_tokens(self.config.count_output_tokens), block_size)
        shared = (request.prompt_len - 1) // block_size
        return one + (request.samples - 1) * (one - shared)

    def admit(self, needs: Iterable[int], free_blocks: int) -> int:
        """Eq. 6: the largest N whose first N block needs sum to at most the safe blocks."""
        return largest_prefix(needs, self.safe_blocks(free_blocks), self.config.max_num_seqs)

    def within_token_budget(self, prompt_lens: Sequence[int]) -> int:
        """How many of these prompts (the tokens each computes), in order, one forward takes
        under `max_batched_tokens` (at least the first: a prompt over the budget is not
        starved)."""
        budget = self.config.max_batched_tokens
        if budget is None:
            return len(prompt_lens)
        return max(min(1, len(prompt_lens)), largest_prefix(prompt_lens, budget))

    def n_max(self, free_blocks: int, mean_blocks: float) -> int:
        """Eq. 6 for a queue of mean-sized requests; Algorithm 1's split size m (at least 1)."""
        if mean_blocks <= 0:
            return self.config.max_num_seqs
        fits = int(self.safe_blocks(free_blocks) // mean_blocks)
        return max(1, min(self.config.max_num_seqs, fits))

    def max_batch_size_from_memory(
        self,
        seq_lens: Sequence[int],
        memory_remain_bytes: int,
        num_layers: int,
        num_heads: int,
        head_dim: int,
        dtype_bytes: int,
    ) -> int:
        """Eq. 6 in bytes, as [BucketServe] writes it: sum(S_i) <= M_safe / (2 L H D B)."""
        for name, value in (
            ("memory_remain_bytes", memory_remain_bytes),
            ("num_layers", num_layers),
            ("num_heads", num_heads),
            ("head_dim", head_dim),
            ("dtype_bytes", dtype_bytes),
        ):
            check_int(name, value, 0 if name == "memory_remain_bytes" else 1)
        per_token = 2 * num_layers * num_heads * head_dim * dtype_bytes  # Eq. 1 for one token
        return largest_prefix(seq_lens, int(self._safety * memory_remain_bytes / per_token))
