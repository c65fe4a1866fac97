"""The offline benchmark's chat workload: half short questions, half long-answer requests."""

from __future__ import annotations

SHORT_QUESTIONS = [
    "What is the capital of {}?",
    "Name the official language of {}.",
    "Which continent is {} on? One word.",
    "What currency does {} use?",
]
LONG_REQUESTS = [
    "Explain in detail how {} works, step by step.",
    "Write a short story about {}.",
    "Describe the history of {} in significant detail.",
    "Write an essay on the advantages and drawbacks of {}.",
]
COUNTRIES = ["France", "Japan", "Brazil", "Kenya", "Canada", "Egypt", "India", "Norway"]
TOPICS = [
    "the attention mechanism in a transformer",
    "a robot who learns to paint",
    "the Roman Empire",
    "renewable energy",
    "the internet",
    "a lighthouse keeper and a storm",
    "vaccines",
    "public transport in big cities",
]


def chat_prompts(n: int) -> list[str]:
    """`n` user messages alternating short question / long-answer request, so every static
    batch mixes both (as in the blog's latency demo)."""
    if n < 2 or n % 2:
        raise ValueError(f"the workload needs an even number of prompts >= 2, got {n}")
    short = [q.format(c) for c in COUNTRIES for q in SHORT_QUESTIONS]
    long = [r.format(t) for t in TOPICS for r in LONG_REQUESTS]
    half = n // 2
    if half > len(short):
        raise ValueError(f"at most {2 * len(short)} prompts are defined, got {n}")
    return [p for pair in zip(short[:half], long[:half], strict=True) for p in pair]


def encode_chats(tokenizer, messages: list[str]) -> list[list[int]]:
    """Token ids of each message as a one-turn chat through the model's template; a base
    model without one gets each message as plain text after its BOS."""
    if not tokenizer.chat_template:
        return [tokenizer.encode(m) for m in messages]
    return [
        tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": m}]),
            add_special_tokens=False,
        )
        for m in messages
    ]
