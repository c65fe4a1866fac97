"""vLLM's offline `LLM.generate` as a peer worker; runs on the peer venv's interpreter.

Driven by offline.py; imports only vLLM and the stdlib-only harness, never bucketserve.
"""

from __future__ import annotations

import os
import runpy
from pathlib import Path
from typing import Any

from benchmarks.peers.harness import Generate, serve_engine


def load(spec: dict[str, Any]) -> tuple[Generate, str]:
    if os.environ.get("ATEN_CPU_CAPABILITY") == "avx2":  # offline.py --isa avx2
        # vLLM loads its AVX2 kernels where torch finds no AVX-512, in this process and
        # in the ones it spawns (they run avx2/sitecustomize.py first).
        site = Path(__file__).with_name("avx2")
        os.environ["PYTHONPATH"] = os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])
        runpy.run_path(str(site / "sitecustomize.py"))
    import vllm
    from vllm.inputs import TokensPrompt

    llm = vllm.LLM(
        model=spec["model"],
        dtype=spec["dtype"],
        max_num_seqs=spec["max_num_seqs"],
        max_num_batched_tokens=spec["max_num_batched_tokens"],
        max_model_len=spec["max_model_len"],
        enable_prefix_caching=False,
        seed=0,
    )

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = vllm.SamplingParams(temperature=0, max_tokens=max_tokens)
        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        outs = llm.generate(inputs, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    return generate, f"vllm {vllm.__version__}"


if __name__ == "__main__":
    serve_engine(load)
