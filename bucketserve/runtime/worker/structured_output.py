"""Grammar state of the sequences a worker samples, and their token masks per step."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import numpy as np
import torch
from llguidance.numpy import fill_next_token_bitmask_par

from bucketserve.runtime.core.grammar_compiler import GrammarCompiler
from bucketserve.runtime.core.sequence import Sequence as Seq
from bucketserve.runtime.core.structured_outputs import StructuredOutputsParams
from bucketserve.runtime.io.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# A sequence's matcher is dropped once this many mask computations passed without it (it
# finished, moved to another worker, or waits preempted); if it comes back it is rebuilt.
_EVICT_AFTER = 32
_END_NOW = 'start: ""'  # accepts only the empty string: the mask allows EOS alone


@dataclass
class GrammarMask:
    """`disallowed[j]` (bool, one column per logits column) is True for the tokens the
    grammar forbids in sampled row `rows[j]`."""

    rows: list[int]
    disallowed: torch.Tensor


# row, seq id, spec, prompt length, output tokens
_Row = tuple[int, "int | str", StructuredOutputsParams, int, list[int]]


def _work(seqs: Sequence[Seq]) -> list[_Row]:
    work = []
    for row, seq in enumerate(seqs):
        spec = seq.sampling_params.structured_outputs
        if spec is not None:
            work.append((row, seq.seq_id, spec, seq.num_prompt_tokens, seq.output_token_ids))
    return work


class _SeqGrammar:
    """One sequence's matcher and what it has consumed: the count, the first and the last
    output token, with the prompt's length and the spec, enough to see that a sequence's
    tokens are no longer what it consumed (or that an id is another request's)."""

    __slots__ = ("first", "key", "last", "matcher", "num_consumed", "num_prompt", "used")

    def __init__(self, key: tuple, num_prompt: int, matcher: llguidance.LLMatcher) -> None:
        self.key = key
        self.num_prompt = num_prompt
        self.matcher = matcher
        self.num_consumed = 0
        self.first: int | None = None
        self.last: int | None = None
        self.used = 0

    def follows(self, key: tuple, num_prompt: int, output: list[int]) -> bool:
        """`output` extends what this matcher consumed."""
        n = self.num_consumed
        if key != self.key or num_prompt != self.num_prompt or n > len(output):
            return False
        return n == 0 or (output[0] == self.first and output[n - 1] == self.last)


class StructuredOutputManager:
    """Owns every constrained sequence's llguidance matcher on this worker.

    A matcher's state is a function of the sequence's output tokens alone: before each
    mask it consumes the tokens it has not seen, and when they disagree with what it
    consumed (fewer tokens, another last token) it is rebuilt from all of them. So a
    sequence arriving from a prefill worker, re-prefilled after a worker death or
    recomputed after preemption obeys its grammar with no state carried, and a matcher can
    be dropped whenever it goes unused for a while.

    `begin(seqs)` starts the step's masks on a thread of its own, which overlaps them with
    the forward pass (llguidance drops the GIL); `finish` waits for them. The thread runs
    no torch op that starts parallel work, so the worker's one OpenMP team stays the only
    one. `overlap=False` computes them on the caller's thread.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        eos_token_ids: Collection[int],
        overlap: bool = True,
    ) -> None:
        self.vocab_size = vocab_size
        self.compiler = GrammarCompiler(
            tokenizer, max(vocab_size, tokenizer.vocab_size), eos_token_ids
        )
        self.overlap = overlap
        self._grammars: dict[int | str, _SeqGrammar] = {}
        self._lock = threading.Lock()
        self._thread: ThreadPoolExecutor | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._calls = 0
        self._end_now: llguidance.LLMatcher | None = None

    def begin(self, seqs: Sequence[Seq]) -> Future[GrammarMask | None] | None:
        """Start the masks of `seqs`, the rows that sample this step (their output tokens
        are read now); None when none of them is constrained."""
        work = _work(seqs)
        if not work:
            return None
        if not self.overlap:
            done: Future[GrammarMask | None] = Future()
            done.set_result(self._compute(work))
            return done
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        return self._thread.submit(self._compute, work)

    @staticmethod
    def finish(pending: Future[GrammarMask | None] | None) -> GrammarMask | None:
        return None if pending is None else pending.result()

    def mask(self, seqs: Sequence[Seq]) -> GrammarMask | None:
        """The masks of `seqs`, computed now."""
        work = _work(seqs)
        return self._compute(work) if work else None

    def _compute(self, work: list[_Row]) -> GrammarMask:
        with self._lock:
            self._calls += 1
            matchers = []
            for index, (_, seq_id, params, num_prompt, output) in enumerate(work):
                grammar = self._synced(seq_id, params, num_prompt, output)
                grammar.used = self._calls
                matchers.append((grammar.matcher, index))
            words = (self.compiler.ll_tokenizer.vocab_size + 31) // 32
            bitmask = np.empty((len(work), words), dtype=np.int32)
            fill_next_token_bitmask_par(self._ll_executor(), matchers, bitmask)
            if self._calls % 8 == 0:
                self._evict()
        np.invert(bitmask, out=bitmask)
        bits = np.unpackbits(
            bitmask.view(np.uint8), axis=1, count=self.vocab_size, bitorder="little"
        )
        return GrammarMask([row for row, *_ in work], torch.from_numpy(bits.view(np.bool_)))

    def _synced(
        self, seq_id: int | str, params: StructuredOutputsParams, num_prompt: int, output: list[int]
    ) -> _SeqGrammar:
        grammar = self._grammars.get(seq_id)
        if grammar is None or not grammar.follows(params.key, num_prompt, output):
            grammar = _SeqGrammar(params.key, num_prompt, self._matcher(seq_id, params))
            self._grammars[seq_id] = grammar
        n = grammar.num_consumed
        if n < len(output):
            if not grammar.matcher.consume_tokens(output[n:]):
                logger.warning(
                    "sequence %s: its tokens do not follow its grammar (%s); it may end only",
                    seq_id,
                    grammar.matcher.get_error(),
                )
            grammar.num_consumed, grammar.first, grammar.last = len(output), output[0], output[-1]
        return grammar

    def _matcher(self, seq_id: int | str, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        try:
            return self.compiler.matcher(params)
        except ValueError as exc:  # the edge validates; here a bad spec only ends its sequence
            logger.warning("sequence %s: %s; it ends at once", seq_id, exc)
            if self._end_now is None:
                self._end_now = llguidance.LLMatcher(
                    self.compiler.ll_tokenizer, _END_NOW, log_level=0
                )
            return self._end_now.deep_copy()

    def _ll_executor(self) -> llguidance.LLExecutor:
        if self._executor is None:
            # a few threads at most: on a CPU worker they share the cores with the forward,
            # and a pinned worker's cores are its affinity, not the host's
            self._executor = llguidance.LLExecutor(max(1, min(4, _usable_cpus() // 8)))
        return self._executor

    def _evict(self) -> None:
        old = self._calls - _EVICT_AFTER
        for seq_id in [s for s, g in self._grammars.items() if g.used < old]:
            del self._grammars[seq_id]


def _usable_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
