"""The eight chat prompts of seeds/batching-and-paged-attention.md's latency demo on the real
SmolLM2, transformers' greedy output for them, and the check that ours equals it.

The reference is computed once a session (`smollm_prompts` / `smollm_reference` in
tests/runtime/conftest.py): test_engine_smollm and test_pipeline_smollm compare with it."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from bucketserve.runtime.core.sampling_params import SamplingParams

SHORT_PROMPTS = [
    "What is the capital of France?",
    "Is Python interpreted or compiled? Answer in one sentence.",
    "What is 2 + 2?",
    "Name one fruit.",
]
LONG_PROMPTS = [
    "Explain in detail how the attention mechanism works in a transformer.",
    "Write a short story about a robot who learns to paint.",
    "Describe the history of the Roman Empire in significant detail.",
    "What are the key differences between supervised and unsupervised learning?",
]
NEW_TOKENS = 32
TIE = 1e-4  # a reference step whose top-two logits are this close may flip under rounding
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)

# (tokens, the top-two logit gap of each step) per prompt
Reference = list[tuple[list[int], list[float]]]


def chat_prompts(model_dir: Path) -> list[list[int]]:
    """The prompts as the model's chat template renders them, as token ids."""
    from bucketserve.runtime.io.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    chats = [[{"role": "user", "content": p}] for p in SHORT_PROMPTS + LONG_PROMPTS]
    return [tok.encode(tok.apply_chat_template(c), add_special_tokens=False) for c in chats]


def transformers_reference(model_dir: Path, prompts: list[list[int]]) -> Reference:
    """transformers generate, one prompt at a time: tokens and each step's top-two gap."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    refs = []
    for ids in prompts:
        with torch.inference_mode():
            out = hf.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                output_logits=True,
                return_dict_in_generate=True,
            )
        top2 = torch.stack([step[0] for step in out.logits]).topk(2).values
        refs.append((out.sequences[0, len(ids) :].tolist(), (top2[:, 0] - top2[:, 1]).tolist()))
    return refs


def assert_matches(got: list[list[int]], refs: Reference) -> None:
    """Token-identical, except after a step where the reference itself was a near-tie."""
    for i, (ours, (theirs, gaps)) in enumerate(zip(got, refs, strict=True)):
        diverged = next(
            (j for j, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
            None if len(ours) == len(theirs) else min(len(ours), len(theirs)),
        )
        if diverged is None:
            continue
        gap = gaps[diverged]
        assert gap < TIE, (
            f"prompt {i}: token {diverged} differs ({ours[diverged:diverged + 3]} vs "
            f"{theirs[diverged:diverged + 3]}) and the reference's top-two gap is {gap:.2e}"
        )
        warnings.warn(
            f"prompt {i}: accepted a divergence at token {diverged}, where the reference's "
            f"top-two logits differ by only {gap:.2e}",
            stacklevel=2,
        )
