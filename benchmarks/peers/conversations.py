"""The multi-turn workload: conversations whose every turn resends the whole history.

Turn k of a conversation is its first k user messages and the k - 1 replies between them,
rendered with the model's chat template, so turn k + 1's prompt starts with turn k's whole
prompt: a server with prefix caching computes only the newest reply and question. The
replies are fixed text of the output length (a client resends what it was given, and a
benchmark cannot know the server's reply in advance), so a turn reuses the previous turn's
prompt, not its generated tokens, on either server.

Requests are ordered turn by turn (every conversation's first turn, then every second
turn, ...), so under a Poisson load the next turn of a conversation arrives about
`num_conversations / rate` seconds after its previous one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bucketserve.bench.text_corpus import TextCorpus


@dataclass(frozen=True)
class ConversationSpec:
    num_conversations: int = 8
    num_turns: int = 6
    user_len: int = 96  # tokens of each user message
    reply_len: int = 64  # tokens of each resent reply (the output length asked for)

    def __post_init__(self) -> None:
        if min(self.num_conversations, self.num_turns, self.user_len, self.reply_len) < 1:
            raise ValueError(f"every size of a conversation must be >= 1: {self}")

    @property
    def num_requests(self) -> int:
        return self.num_conversations * self.num_turns


def conversation_prompts(tokenizer: Any, spec: ConversationSpec, seed: int = 0) -> list[str]:
    """Every turn's prompt text (chat template applied), turn by turn across conversations."""
    rng = np.random.default_rng(seed)
    corpus = TextCorpus(tokenizer)
    histories: list[list[dict[str, str]]] = [[] for _ in range(spec.num_conversations)]
    prompts = []
    for turn in range(spec.num_turns):
        for c, history in enumerate(histories):
            if turn:
                history.append({"role": "assistant", "content": _text(corpus, spec.reply_len,
                                                                      rng)})
            # The tag keeps two conversations from starting alike by chance.
            question = f"[conversation {c}, turn {turn + 1}] " + _text(corpus, spec.user_len, rng)
            history.append({"role": "user", "content": question})
            prompts.append(tokenizer.apply_chat_template(history, add_generation_prompt=True))
    return prompts


def write_jsonl(prompts: list[str], path: Path) -> Path:
    """`vllm bench serve --dataset-name custom`'s format: one `{"prompt": ...}` a line."""
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path


def _text(corpus: TextCorpus, n_tokens: int, rng: np.random.Generator) -> str:
    return corpus.prompt(n_tokens, rng)[0]
