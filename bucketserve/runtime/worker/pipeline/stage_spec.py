"""Which layers one pipeline stage holds."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageSpec:
    """Stage `index` of `num_stages` holds decoder layers `[start, stop)`; the first stage
    also embeds the tokens, the last applies the final norm, the LM head and sampling."""

    index: int
    num_stages: int
    start: int
    stop: int

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    @property
    def layers(self) -> range:
        return range(self.start, self.stop)

    @property
    def num_layers(self) -> int:
        return self.stop - self.start


def split_layers(num_layers: int, num_stages: int) -> list[StageSpec]:
    """Contiguous slices as even as possible; the first `num_layers % num_stages` stages take
    one layer more (the last stage also runs the LM head, so it gets the smaller share)."""
    if not isinstance(num_stages, int) or isinstance(num_stages, bool) or num_stages < 1:
        raise ValueError(f"pipeline_parallel_size must be a positive integer, got {num_stages!r}")
    if num_stages > num_layers:
        raise ValueError(
            f"pipeline_parallel_size {num_stages} exceeds the model's {num_layers} layers"
        )
    base, extra = divmod(num_layers, num_stages)
    specs, start = [], 0
    for i in range(num_stages):
        stop = start + base + (i < extra)
        specs.append(StageSpec(i, num_stages, start, stop))
        start = stop
    return specs
