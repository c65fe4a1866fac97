"""bucketserve's in-process engine (`runtime.LLM`) as a peer worker; the project's venv."""

from __future__ import annotations

from typing import Any

from benchmarks.peers.harness import Generate, Reset, serve_engine


def load(spec: dict[str, Any]) -> tuple[Generate, Reset, str]:
    from bucketserve.runtime.core.sampling_params import SamplingParams
    from bucketserve.runtime.engine.llm import LLM

    llm = LLM(
        spec["model"],
        dtype=spec["dtype"],
        device="cpu",
        max_num_seqs=spec["max_num_seqs"],
        max_num_batched_tokens=spec["max_num_batched_tokens"],
        max_model_len=spec["max_model_len"],
        execution=spec.get("execution", "eager"),
        enable_prefix_caching=spec.get("enable_prefix_caching", True),
    )

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens)
        return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    def reset() -> None:
        llm.engine.block_manager.reset_prefix_cache()

    return generate, reset, "bucketserve"


if __name__ == "__main__":
    serve_engine(load)
