"""bucketserve as 1 prefill + 1 decode Ray actor (the disaggregated topology, KV through Ray's
object store) behind the Controller, as a peer worker; the project's venv.

The Controller's event loop runs on a thread of its own for the worker's life, so its
background tasks (dispatch, leases) keep running between commands."""

from __future__ import annotations

import asyncio
import itertools
import threading
from typing import Any

from benchmarks.disagg_overhead import controller_config, timed_stream
from benchmarks.peers.harness import Generate, Reset, serve_engine


def load(spec: dict[str, Any]) -> tuple[Generate, Reset, str]:
    from bucketserve.controller.controller import Controller
    from bucketserve.messages import ServeRequest
    from bucketserve.runtime.core.sampling_params import SamplingParams

    config = controller_config(
        spec["model"], "ray", spec["max_model_len"], spec["max_num_seqs"],
        spec["max_num_batched_tokens"], spec["dtype"],
    )
    caching = spec.get("enable_prefix_caching", True)
    runner = config.runner.model_copy(update={"enable_prefix_caching": caching})
    config = config.model_copy(update={"runner": runner})
    controller = Controller(config)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, name="controller", daemon=True).start()

    def call(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    call(controller.start())
    ids = itertools.count()

    async def run(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens)
        requests = [ServeRequest(f"peer-{next(ids)}", p, params) for p in prompts]
        runs = await asyncio.gather(*(timed_stream(controller, r) for r in requests))
        stats = await controller.drain(60)
        if stats.kv_blocks_leaked or stats.leases_open:
            raise RuntimeError(f"the pools did not drain: {stats}")
        return [tokens for tokens, _, _ in runs]

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        return call(run(prompts, max_tokens))

    def reset() -> None:
        call(controller.reset_prefix_cache())

    return generate, reset, "bucketserve 1 prefill + 1 decode Ray actors"


if __name__ == "__main__":
    serve_engine(load)
