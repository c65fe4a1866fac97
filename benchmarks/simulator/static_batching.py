"""The UELLM-like baseline: prefill and decode on the same accelerator (one replica each),
static batches. An idle replica takes the longest FCFS prefix of at most `max_num_seqs`
requests whose padded K/V, rows x (longest prompt + max_tokens), fits its memory; prefills
it padded to the longest prompt; then decodes every row until the batch's longest answer is
done, finished rows included, before it takes the next batch. Tokens stream as they are
made: a request's first token comes at the prefill's end, its last at its own EOS.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable

from benchmarks.simulator.cluster_config import ClusterConfig
from benchmarks.simulator.event_loop import EventLoop
from benchmarks.simulator.metrics import RequestRecord, RunResult
from benchmarks.simulator.workload import SimRequest


class StaticBatchingSimulator:
    def __init__(self, cluster: ClusterConfig, name: str = "static") -> None:
        self.name = name
        self.cluster = cluster
        self.cost = cluster.cost_model()
        self.capacity = cluster.num_kv_blocks() * cluster.block_size  # tokens of K/V
        self.loop = EventLoop()
        self.queue: deque[SimRequest] = deque()
        self.idle = list(range(cluster.num_workers))
        self.records: dict[int, RequestRecord] = {}
        self.busy_s = 0.0
        self.counts = {"batches": 0, "batched_requests": 0, "real_tokens": 0, "padded_tokens": 0}

    def run(self, requests: Iterable[SimRequest], until: float = math.inf) -> RunResult:
        for request in requests:
            if request.prompt_len + request.max_tokens > self.capacity:
                raise ValueError(
                    f"request {request.request_id} needs {request.prompt_len} + "
                    f"{request.max_tokens} tokens of K/V; a replica holds {self.capacity}"
                )
            self.loop.at(request.arrival, self._arrive, request)
        self.loop.run(until)
        for record in self.records.values():  # a bounded run sees only what happened by then
            if record.finish is not None and record.finish > self.loop.now:
                record.finish = None
            if record.first_token is not None and record.first_token > self.loop.now:
                record.first_token = None
        c = self.counts
        stats = {
            **c,
            "mean_batch_size": c["batched_requests"] / max(1, c["batches"]),
            "prefill_padding": 1 - c["real_tokens"] / max(1, c["padded_tokens"]),
        }
        records = list(self.records.values())
        return RunResult(
            self.name, records, self.cluster.num_workers, self.busy_s, self.loop.now, stats
        )

    def _arrive(self, request: SimRequest) -> None:
        self.records[request.request_id] = RequestRecord(
            request.prompt_len, request.output_len, request.arrival
        )
        self.queue.append(request)
        self._dispatch()

    def _dispatch(self) -> None:
        while self.idle and self.queue:
            self._start(self.idle.pop(), self._take())

    def _take(self) -> list[SimRequest]:
        batch: list[SimRequest] = []
        longest = 0
        for request in self.queue:
            wider = max(longest, request.prompt_len + request.max_tokens)
            if len(batch) == self.cluster.max_num_seqs or (len(batch) + 1) * wider > self.capacity:
                break
            batch.append(request)
            longest = wider
        for _ in batch:
            self.queue.popleft()
        return batch

    def _start(self, replica: int, batch: list[SimRequest]) -> None:
        rows = len(batch)
        prompt = max(r.prompt_len for r in batch)
        now = self.loop.now
        prefill = self.cost.prefill_time([r.prompt_len for r in batch], (rows, prompt))
        done_at = [now + prefill]  # done_at[i]: when every row holds i + 1 output tokens
        for step in range(max(r.output_len for r in batch) - 1):
            done_at.append(done_at[-1] + self.cost.decode_time(rows, rows * (prompt + step)))
        for request in batch:
            record = self.records[request.request_id]
            record.prefill_start = record.decode_start = now
            record.first_token = done_at[0]
            record.finish = done_at[request.output_len - 1]
        self.busy_s += done_at[-1] - now
        c = self.counts
        c["batches"] += 1
        c["batched_requests"] += rows
        c["real_tokens"] += sum(r.prompt_len for r in batch)
        c["padded_tokens"] += rows * prompt
        self.loop.at(done_at[-1], self._free, replica)

    def _free(self, replica: int) -> None:
        self.idle.append(replica)
        self._dispatch()
