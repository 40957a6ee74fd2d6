"""`pagestream bench serve`'s config, request/result records and the `random` workload
(arrival times, prompt lengths, prompts)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

# Words for text prompts (chat endpoint): common words that most BPE vocabularies hold as
# one token each, so the prompt length in tokens is close to the word count.
# fmt: off
_WORDS = (
    "the", "of", "and", "to", "in", "is", "was", "for", "on", "are", "with", "as", "by", "at",
    "from", "that", "this", "be", "or", "an", "it", "have", "not", "but", "which", "all", "were",
    "when", "we", "there", "can", "had", "one", "more", "out", "if", "has", "its", "so", "some",
    "what", "time", "only", "other", "new", "like", "into", "two", "may", "then", "first", "any",
    "year", "work", "these", "now", "people", "over",
)
# fmt: on


@dataclass
class BenchConfig:
    """What `pagestream bench serve` takes; the CLI flags map one to one."""

    base_url: str = "http://127.0.0.1:8000"
    transport: Literal["sse", "ws"] = "sse"
    endpoint: Literal["completions", "chat"] = "completions"
    api_key: str | None = None
    model: str | None = None  # None: the first id of /v1/models
    dataset: Literal["random"] = "random"
    num_prompts: int = 100
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0
    prefix_len: int = 0  # random tokens shared by every prompt, ahead of input_len
    vocab_size: int | None = None  # None: asked of the server
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    temperature: float = 0.0
    percentiles: tuple[float, ...] = (50.0, 90.0, 99.0)
    warmup: int = 0
    request_timeout: float = 600.0
    ws_connections: int = 256
    result_json: str | None = None

    def validate(self) -> None:
        if self.transport not in ("sse", "ws"):
            raise ValueError(f"transport must be sse or ws, not {self.transport!r}")
        if self.endpoint not in ("completions", "chat"):
            raise ValueError(f"endpoint must be completions or chat, not {self.endpoint!r}")
        if self.dataset != "random":
            raise ValueError(f"unknown dataset {self.dataset!r}; only 'random' is supported")
        if self.num_prompts < 1 or self.input_len < 1 or self.output_len < 1:
            raise ValueError("num_prompts, input_len and output_len must be at least 1")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError("range_ratio must be in [0, 1)")
        if self.prefix_len < 0 or self.warmup < 0:
            raise ValueError("prefix_len and warmup must not be negative")
        if not self.request_rate > 0 or not self.burstiness > 0:
            raise ValueError("request_rate and burstiness must be positive")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max_concurrency must be at least 1")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError("temperature must be in [0, 2]")
        if not self.percentiles or any(not 0.0 <= p <= 100.0 for p in self.percentiles):
            raise ValueError("percentiles must be in [0, 100]")
        if self.request_timeout <= 0 or self.ws_connections < 1:
            raise ValueError("request_timeout and ws_connections must be positive")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError("vocab_size must be positive")


@dataclass(frozen=True)
class SampleRequest:
    prompt: list[int] | str
    prompt_len: int  # exact for token ids; the word count for text
    output_len: int


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)  # seconds, one per gap between deltas
    e2e: float = 0.0
    start: float = 0.0  # when it was sent, seconds after the benchmark started
    finish_reason: str | None = None


# ----------------------------------------------------------------------------- workload
def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times (seconds after the start) of n requests.  Gaps are gamma distributed
    with mean 1/rate and shape `burstiness` (1: Poisson; < 1 burstier; > 1 steadier); the
    first request goes at 0.  An infinite rate sends everything at once."""
    if n <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    rng = np.random.default_rng([seed, 1])  # its own stream: the rate never moves prompts
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def _lengths(rng: np.random.Generator, n: int, mean: int, ratio: float) -> list[int]:
    lo = max(1, int(mean * (1.0 - ratio)))
    hi = max(lo, int(mean * (1.0 + ratio)))
    return rng.integers(lo, hi + 1, size=n).tolist()


def random_requests(
    n: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    vocab_size: int | None = None,
    prefix_len: int = 0,
    seed: int = 0,
    text: bool = False,
) -> list[SampleRequest]:
    """The `random` dataset: lengths uniform in [len*(1-r), len*(1+r)]; prompts are random
    token ids (needs vocab_size) or, with text=True, random words."""
    rng = np.random.default_rng([seed, 0])
    in_lens = _lengths(rng, n, input_len, range_ratio)
    out_lens = _lengths(rng, n, output_len, range_ratio)
    if text:
        words = np.array(_WORDS)
        prefix_words = " ".join(rng.choice(words, size=prefix_len).tolist())
        out = []
        for il, ol in zip(in_lens, out_lens):
            body = " ".join(rng.choice(words, size=il).tolist())
            prompt = f"{prefix_words} {body}" if prefix_len else body
            out.append(SampleRequest(prompt, prefix_len + il, ol))
        return out
    if vocab_size is None:
        raise ValueError("token-id prompts need vocab_size")
    prefix = rng.integers(0, vocab_size, size=prefix_len).tolist()
    return [
        SampleRequest(prefix + rng.integers(0, vocab_size, size=il).tolist(), prefix_len + il, ol)
        for il, ol in zip(in_lens, out_lens)
    ]
