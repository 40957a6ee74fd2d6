"""Seeded synthetic workloads shared by the benchmarks."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Item:
    prompt: list[int]
    max_tokens: int


def mixed(
    n: int = 64,
    prompt_range: tuple[int, int] = (32, 512),
    output_range: tuple[int, int] = (16, 256),
    vocab: int = 49152,
    seed: int = 0,
    first_id: int = 16,
) -> list[Item]:
    """Random token-id prompts and output lengths, uniform in the given ranges."""
    rng = random.Random(seed)
    return [
        Item(
            prompt=[rng.randrange(first_id, vocab) for _ in range(rng.randint(*prompt_range))],
            max_tokens=rng.randint(*output_range),
        )
        for _ in range(n)
    ]


def uniform(n: int, prompt_len: int, max_tokens: int, vocab: int, seed: int = 0) -> list[Item]:
    return mixed(n, (prompt_len, prompt_len), (max_tokens, max_tokens), vocab, seed)
