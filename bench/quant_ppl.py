"""Held-out perplexity of the trained target (modelkit/pair) through the engine, unquantized
vs int8/fp8 KV vs int8 / fp8 weights: `python -m bench.quant_ppl [WINDOWS]`.

The windows are the training script's held-out split (every 20th file), 128 tokens each,
scored with `prompt_logprobs` (the engine's own forward, the same numbers transformers
gives: the float32 row equals the training report's perplexity).  A 32-token step budget
makes most of each window's context come back out of the (quantized) paged cache rather
than from the chunk being computed.
"""

from __future__ import annotations

import math
import sys
import time

import torch

from modelkit import train
from scheduler.sampling_params import SamplingParams
from service import LLM

CONFIGS = [
    ("model dtype (float32)", {}),
    ("int8 KV", {"kv_cache_dtype": "int8"}),
    ("fp8 KV (e4m3)", {"kv_cache_dtype": "fp8"}),
    ("int8 weights", {"quantization": "int8"}),
    ("fp8 weights (W8A8)", {"quantization": "fp8"}),
]


def run(num_windows: int = 64, model: str = "modelkit/pair/target") -> str:
    torch.set_num_threads(1)
    _, held = train.token_streams(train._tokenizer(train.VOCAB_SIZE))
    w = train.SEQ_LEN
    windows = [held[i * w : (i + 1) * w + 1].tolist() for i in range(num_windows)]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    rows = []
    for name, kw in CONFIGS:
        t0 = time.perf_counter()
        llm = LLM(model, dtype="float32", max_num_batched_tokens=32, num_kv_blocks=512, **kw)
        try:
            outs = llm.generate(windows, params)
        finally:
            llm.shutdown()
        lps = [lp.logprob for o in outs for lp in o.prompt_logprobs[1:]]
        rows.append((name, math.exp(-sum(lps) / len(lps)), len(lps), time.perf_counter() - t0))
    base = rows[0][1]
    lines = [
        "| config | held-out perplexity | vs unquantized | tokens scored |",
        "|---|---|---|---|",
    ]
    lines += [f"| {n} | {p:.2f} | {100 * (p / base - 1):+.2f}% | {c} |" for n, p, c, _ in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    print(run(int(sys.argv[1]) if len(sys.argv) > 1 else 64))
