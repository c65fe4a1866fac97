"""Real English text cut to an exact token count under the model's tokenizer."""

from __future__ import annotations

from typing import Any

import numpy as np

PASSAGES = (
    "The harbour town woke slowly. Fishing boats came in before sunrise, their decks stacked "
    "with crates of silver herring, and the gulls followed them in wide, complaining circles. "
    "By seven the market square was full of carts, and the baker on the corner had already "
    "sold his first batch of rye loaves to the dock workers.",
    "A compiler translates a program written in one language into another, usually a lower "
    "level one that a machine can run. It reads the source text, builds a tree that describes "
    "its structure, checks that names and types are used consistently, and then emits code, "
    "often after many passes that make the result smaller or faster.",
    "Bees communicate the direction of a food source through a dance. A forager returning to "
    "the hive walks a figure of eight, and the angle of the straight middle run relative to "
    "vertical tells the others where to fly relative to the sun. The length of the run encodes "
    "the distance, so a longer waggle means a longer journey.",
    "When you plan a long walk in the mountains, check the weather forecast the evening before "
    "and again in the morning. Pack water, a warm layer, a map, and something to eat, and tell "
    "someone where you are going. Turn back if the clouds come down; the summit will still be "
    "there next week.",
    "The library had been built in the last years of the old century with money from a "
    "merchant who had never learned to read. He insisted that the reading room face south, so "
    "that the light would fall across the tables all afternoon, and he asked that the doors "
    "stay open until the last lamp in the street was lit.",
    "Water boils at a lower temperature at high altitude because the air pressure is lower. "
    "Cooks in mountain villages therefore simmer beans and grains for longer, and bakers "
    "adjust their recipes, using a little less yeast and a hotter oven, so that the bread "
    "rises without collapsing.",
    "Please summarise the following meeting notes in three bullet points. The team agreed to "
    "move the release to the second week of the month, to freeze new features on Friday, and "
    "to spend the remaining days on testing, documentation and the migration guide that "
    "several customers had asked for.",
    "Rivers carve their valleys over thousands of years. In the upper course the water is fast "
    "and the valley is narrow and steep; further down the slope eases, the river begins to "
    "meander, and in the lowlands it spreads across a wide flood plain before it reaches the "
    "sea through a delta of shifting channels.",
)


class TextCorpus:
    """The passages tokenized once, end to end; a prompt is a window of it, re-encoded until
    its length is exact (BPE merges across a cut can shift the count by a token or two)."""

    def __init__(self, tokenizer: Any, passages: tuple[str, ...] = PASSAGES) -> None:
        self.tokenizer = tokenizer
        self.ids = tokenizer.encode(" ".join(passages), add_special_tokens=False)
        self._special = len(tokenizer.encode("", add_special_tokens=True))

    def count(self, text: str) -> int:
        """Tokens the server counts for `text` (special tokens included)."""
        return len(self.tokenizer.encode(text))

    def prompt(self, n_tokens: int, rng: np.random.Generator) -> tuple[str, int]:
        """Text of `n_tokens` tokens (or the nearest reached) and its actual count."""
        if n_tokens < 1:
            raise ValueError(f"a prompt needs at least 1 token, got {n_tokens}")
        start = int(rng.integers(len(self.ids)))
        want = max(1, n_tokens - self._special)
        take = want
        best: tuple[str, int] = ("", 0)
        for _ in range(8):
            text = self.tokenizer.decode(self._window(start, take)).strip()
            got = self.count(text)
            if abs(got - n_tokens) < abs(best[1] - n_tokens) or not best[0]:
                best = (text, got)
            if got == n_tokens:
                break
            take = max(1, take + n_tokens - got)
        return best

    def _window(self, start: int, n: int) -> list[int]:
        reps = -(-(start + n) // len(self.ids))
        return (self.ids * reps)[start : start + n]
