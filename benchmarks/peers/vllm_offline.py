"""vLLM's offline `LLM.generate` as a peer worker; runs on the peer venv's interpreter.

Driven by offline.py; imports only vLLM and the stdlib-only harness, never bucketserve.
"""

from __future__ import annotations

from typing import Any

from benchmarks.peers.harness import Generate, Reset, serve_engine


def load(spec: dict[str, Any]) -> tuple[Generate, Reset, str]:
    import vllm
    from vllm.inputs import TokensPrompt

    llm = vllm.LLM(
        model=spec["model"],
        dtype=spec["dtype"],
        max_num_seqs=spec["max_num_seqs"],
        max_num_batched_tokens=spec["max_num_batched_tokens"],
        max_model_len=spec["max_model_len"],
        enable_prefix_caching=spec.get("enable_prefix_caching", True),
        seed=0,
    )

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = vllm.SamplingParams(temperature=0, max_tokens=max_tokens)
        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        outs = llm.generate(inputs, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def reset() -> None:
        if not llm.reset_prefix_cache():
            raise RuntimeError("vLLM did not reset its prefix cache")

    return generate, reset, f"vllm {vllm.__version__}"


if __name__ == "__main__":
    serve_engine(load)
