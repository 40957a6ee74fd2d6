"""`make bench --sections sampler`: top-p on flat and peaked distributions, the sampler's
cut (`gpu/sampler.py` `_top_p_`: a top-256 window, else mass histograms) against the same
cut found by sorting the whole vocabulary, timed in the same run.  Both must keep exactly
the same tokens; the section fails otherwise."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from gpu.sampler import _quantized, _top_p_

VOCABS = (32000, 151936)
TOP_P = (0.9, 0.95, 0.8, 0.99, 0.5, 0.9, 0.7, 0.95)


def top_p_full_sort_(probs: torch.Tensor, top_p: list[float]) -> None:
    """The reference: sort each row, walk the exact cumulative mass, cut at the floor."""
    desc = probs.sort(dim=-1, descending=True).values
    q = _quantized(desc)
    cum = q.cumsum(-1)
    limit = torch.tensor(top_p, dtype=torch.float64).unsqueeze(1) * q.sum(-1, keepdim=True)
    n_keep = ((cum - q) < limit).sum(-1, keepdim=True)
    probs.masked_fill_(probs < desc.gather(1, n_keep - 1), 0.0)


def _time(fn: Callable[[torch.Tensor, list[float]], None], probs, top_p, reps: int):
    best, out = float("inf"), probs
    for _ in range(reps):
        out = probs.clone()
        t = time.perf_counter()
        fn(out, top_p)
        best = min(best, time.perf_counter() - t)
    return best, out


def run(args: argparse.Namespace, print_table: Callable[..., str]) -> str:
    rows = []
    g = torch.Generator().manual_seed(0)
    for vocab in VOCABS:
        for label, scale in (("flat", 0.3), ("peaked", 6.0)):
            for batch in (1, 8):
                probs = torch.softmax(torch.randn(batch, vocab, generator=g) * scale, -1)
                top_p = list(TOP_P[:batch])
                ref_s, ref = _time(top_p_full_sort_, probs, top_p, 3)
                our_s, ours = _time(_top_p_, probs, top_p, 3)
                assert torch.equal(ours, ref), "top-p differs from the full-sort reference"
                kept = int((ours > 0).sum(-1).float().mean())
                rows.append(
                    [
                        f"{vocab}",
                        label,
                        str(batch),
                        str(kept),
                        f"{ref_s * 1e3:.2f}",
                        f"{our_s * 1e3:.2f}",
                        f"{ref_s / our_s:.1f}x",
                    ]
                )
    return print_table(
        f"Top-p cut, exact same kept tokens as a full sort ({torch.get_num_threads()} threads, "
        "best of 3)",
        ["vocab", "distribution", "rows", "mean kept", "full sort ms", "pagestream ms", "speed-up"],
        rows,
    )
