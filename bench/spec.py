"""`make bench` section `spec`: speculative decoding on the trained pair.

Output tokens per CPU-second and per wall-second, and mean acceptance length (tokens a
verify step emits: 1 + accepted drafts per verify) at batch 1, 4 and 32, speculation off vs
n-gram prompt lookup vs the draft model vs Medusa heads (trained on the target by
`pagestream train-medusa` once, into the cache, unless --spec-medusa names them), on two
workloads built from Python standard-library sources the pair was not
trained on (the files its training held out):
- free: the first ~160 tokens of a file, continued;
- copy: a function, a comment saying it follows again, and its first line: the
  continuation repeats text already in the prompt (code editing, summarising);
- copy+grammar: the same, under a grammar that takes any text (a regex), so every step
  computes masks and a verify chunk one per row: what speculation keeps under
  structured output (n-gram, the draft model drafting under the grammar, Medusa's trees
  verified under it).
- predicted: the free prompts, each sent with OpenAI's `prediction` (SamplingParams.prediction):
  its plain greedy continuation with one token in EDIT_EVERY changed, a mostly right guess
  as a code edit's original text is.  n-gram speculation drafts from it first
  (scheduler/prediction.py), as does the draft model; Medusa does not read it.
Greedy, `ignore_eos`, fixed output length, so every mode emits the same tokens.

Each round runs plain decoding before and after every mode (round_order), and a mode's
speed-up is the median over rounds of its ratio to the mean of the two plain runs beside
it (paired_ratios): on a machine whose load drifts, a ratio of medians taken minutes apart
carries the drift, a paired one mostly not.  The engines live through all rounds, so the
first round also pays the cost policy's first timings at each batch size, as a server
does once; the median leaves that round out.

Why the trained pair and not a larger bench model (`mid`): what speculation gains or loses
is the accepted tokens against a verify step's cost, and acceptance needs a target and a
draft (or heads) trained on the same text; on random weights greedy text falls into loops
that n-gram lookup copies perfectly, so its figures would say nothing about either side.
The tiny target is also the hard case for the policy: its plain step is nearly all fixed
cost, so a verify step costs several of them.
"""

from __future__ import annotations

import argparse
import hashlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

OUT_TOKENS = 64
K = 4
REPEATS = 3
BATCH1_PROMPTS = 4  # batch 1: this many prompts one after another
GRAMMAR_WORKLOAD = "copy+grammar"
PREDICTED_WORKLOAD = "predicted"
EDIT_EVERY = 16


def _measure(llm: Any, groups: list[list[list[int]]], params: Any) -> tuple[float, float, float]:
    """(output tokens per wall second, per CPU second of this process, mean acceptance
    length: tokens per verify step) of running the groups one after another.  `params`:
    one SamplingParams, or a function of the prompt giving its own.

    CPU seconds count every thread of this process (engine loop, model, detokenizer), so
    on a machine shared with other jobs they track the work a mode does rather than the
    share of the cores it happened to get; wall time is what a user sees on an idle one."""
    spec = llm.engine.scheduler.spec
    before = (spec.stats.num_drafts, spec.stats.num_accepted_tokens) if spec else (0, 0)
    t, c = time.perf_counter(), time.process_time()
    toks = 0
    for g in groups:
        ps = [params(p) for p in g] if callable(params) else params
        toks += sum(len(o.outputs[0].token_ids) for o in llm.generate(g, ps))
    secs, cpu = time.perf_counter() - t, time.process_time() - c
    mal = 1.0
    if spec is not None:
        d = spec.stats.num_drafts - before[0]
        mal = 1 + (spec.stats.num_accepted_tokens - before[1]) / d if d else 1.0
    return toks / secs, toks / cpu, mal


def _medians(rs: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    return tuple(sorted(col)[len(col) // 2] for col in zip(*rs))  # type: ignore[return-value]


def paired_ratios(
    runs: list[tuple[str, tuple[float, float, float]]], mode: str
) -> list[tuple[float, float]]:
    """(per-CPU-second, per-wall-second) ratio of each run of `mode` to the mean of the
    plain runs on either side of it: a slow drift of the machine's load moves both alike,
    where a ratio of medians taken minutes apart would carry it whole."""
    out = []
    for i, (m, fig) in enumerate(runs):
        if m != mode:
            continue
        near = [runs[j][1] for j in (i - 1, i + 1) if 0 <= j < len(runs) and runs[j][0] == "off"]
        if near:
            wall = sum(f[0] for f in near) / len(near)
            cpu = sum(f[1] for f in near) / len(near)
            out.append((fig[1] / cpu, fig[0] / wall))
    return out


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def prompts(tok: Any, n: int) -> dict[str, list[list[int]]]:
    from modelkit.make_model import load_corpus
    from modelkit.train import CORPUS_BYTES, HELD_OUT_EVERY

    texts = [
        t
        for i, t in enumerate(load_corpus(CORPUS_BYTES))
        if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 and "\ndef " in t
    ]
    free: list[list[int]] = []
    copy: list[list[int]] = []
    for t in texts:
        ids = tok.encode(t)
        if len(ids) >= 200:
            free.append(ids[:160])
        start = t.find("\ndef ")
        end = t.find("\n\n", start + 5)
        body = t[start + 1 : end]
        if 40 < len(body) < 700:
            first = body.split("\n", 1)[0]
            text = f"{body}\n\n\n# The same function again:\n{first}\n"
            copy.append(tok.encode(text))
        if len(free) >= n and len(copy) >= n:
            break
    return {"free": free[:n], "copy": copy[:n]}


MODES = ("ngram", "draft", "medusa")


def _rows(
    workloads: list[str],
    runs: dict[tuple[str, int], list[tuple[str, tuple[float, float, float]]]],
    batches: tuple[int, ...] = (1, 4, 32),
    sizes: dict[tuple[str, int], int] | None = None,
) -> list[list[str]]:
    """One table row per workload and batch: off's figures, then each mode's, its median
    paired ratio to off and its mean acceptance length.  `sizes`: the rows a batch really
    had where the corpus held fewer prompts than asked (the row says both)."""
    rows = []
    for wl in workloads:
        for batch in batches:
            seq = runs[(wl, batch)]
            base_wall, base_cpu, _ = _medians([f for m, f in seq if m == "off"])
            got = (sizes or {}).get((wl, batch), batch)
            label = str(batch) if got == batch else f"{got} (of {batch} asked)"
            row = [wl, label, f"{base_cpu:.0f} ({base_wall:.0f})"]
            for mode in MODES:
                _, cpu, mal = _medians([f for m, f in seq if m == mode])
                pairs = paired_ratios(seq, mode)
                rc, rw = _median([p[0] for p in pairs]), _median([p[1] for p in pairs])
                row.append(f"{cpu:.0f} ({rc:.2f}x; wall {rw:.2f}x; {mal:.2f})")
            rows.append(row)
    return rows


def predicted_params(llm: Any, ps: list[list[int]], params: Any) -> Callable[[list[int]], Any]:
    """Each prompt's params with its prediction: its plain greedy output (from `llm`,
    which speculates not), one token in EDIT_EVERY changed."""
    import msgspec

    outs = llm.generate(ps, params)
    by_prompt = {}
    for p, o in zip(ps, outs, strict=True):
        guess = list(o.outputs[0].token_ids)
        for i in range(EDIT_EVERY // 2, len(guess), EDIT_EVERY):
            guess[i] = (guess[i] + 1) % llm.engine.vocab_size
        by_prompt[tuple(p)] = msgspec.structs.replace(params, prediction=guess)
    return lambda p: by_prompt[tuple(p)]


def round_order(rep: int) -> list[str]:
    """One round's runs: plain before and after every speculating mode, the modes in an
    order that rotates from round to round."""
    turn = rep % len(MODES)
    order = ["off"]
    for mode in MODES[turn:] + MODES[:turn]:
        order += [mode, "off"]
    return order


def medusa_heads(target: Path, given: str | None, minutes: float) -> Path:
    """The Medusa heads to bench: --spec-medusa, else those trained for this target into
    the cache (once; `pagestream train-medusa` with a time budget)."""
    if given:
        return Path(given)
    from modelkit.make_model import cache_root
    from modelkit.medusa_train import train_medusa

    key = hashlib.sha256(str(target.resolve()).encode()).hexdigest()[:12]
    out = cache_root() / "models" / f"medusa-{key}"
    if not (out / "config.json").is_file():
        print(f"  spec: training Medusa heads for {target} into {out}", flush=True)
        train_medusa(target, out, minutes=minutes)
    return out


def run(args: argparse.Namespace, print_table: Callable[..., str], _model_dir: Any) -> str:
    import msgspec
    import torch

    from scheduler.sampling_params import SamplingParams, StructuredOutputsParams
    from service.engine_setup import default_draft_dir, default_model_dir
    from service.llm import LLM
    from service.tokenizer import Tokenizer

    target, draft = default_model_dir(), default_draft_dir()
    if args.model:
        target = Path(args.model)
        draft = Path(args.spec_draft) if args.spec_draft else draft
    batches = tuple(int(b) for b in str(getattr(args, "spec_batches", "1,4,32")).split(","))
    out_tokens = getattr(args, "spec_out_tokens", OUT_TOKENS)
    repeats = getattr(args, "spec_repeats", REPEATS)
    heads = medusa_heads(
        target, getattr(args, "spec_medusa", None), getattr(args, "spec_medusa_minutes", 10.0)
    )
    tok = Tokenizer.from_dir(target)
    work = prompts(tok, max(max(batches), BATCH1_PROMPTS))
    modes: dict[str, dict | None] = {
        "off": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": K},
        "draft": {"method": "draft", "model": str(draft), "num_speculative_tokens": K},
        "medusa": {"method": "medusa", "model": str(heads), "num_speculative_tokens": K},
    }
    params = SamplingParams(temperature=0, max_tokens=out_tokens, ignore_eos=True)
    work[GRAMMAR_WORKLOAD] = work["copy"]
    anything = StructuredOutputsParams(regex=r"[\s\S]*")
    by_workload = {GRAMMAR_WORKLOAD: msgspec.structs.replace(params, structured_outputs=anything)}
    llms = {
        mode: LLM(
            str(target),
            dtype=args.dtype,
            threads=args.threads,
            num_kv_blocks=2048,
            max_num_batched_tokens=512,
            speculative_config=cfg,
            enforce_eager=args.enforce_eager,
        )
        for mode, cfg in modes.items()
    }
    for llm in llms.values():
        llm.generate(work["free"][:2], params)  # warm-up
    work[PREDICTED_WORKLOAD] = work["free"]
    by_workload[PREDICTED_WORKLOAD] = predicted_params(
        llms["off"], work["free"][: max(max(batches), BATCH1_PROMPTS)], params
    )
    runs: dict[tuple[str, int], list[tuple[str, tuple[float, float, float]]]] = {}
    sizes: dict[tuple[str, int], int] = {}
    try:
        # Each round runs plain next to every mode (round_order), `repeats` rounds, and a
        # mode's speed-up is the median of its ratios to the plain runs beside it.
        for wl, ps in work.items():
            for batch in batches:
                groups = [[p] for p in ps[:BATCH1_PROMPTS]] if batch == 1 else [ps[:batch]]
                sizes[(wl, batch)] = 1 if batch == 1 else len(ps[:batch])
                seq = runs.setdefault((wl, batch), [])
                for rep in range(repeats):
                    for mode in round_order(rep):
                        wl_params = by_workload.get(wl, params)
                        seq.append((mode, _measure(llms[mode], groups, wl_params)))
                for mode in MODES:
                    pairs = paired_ratios(seq, mode)
                    rc, rw = _median([p[0] for p in pairs]), _median([p[1] for p in pairs])
                    print(f"  spec {wl} batch {batch} {mode}: {rc:.2f}x per CPU-second, "
                          f"{rw:.2f}x per wall-second", flush=True)  # fmt: skip
    finally:
        for llm in llms.values():
            llm.shutdown()
    rows = _rows(list(work), runs, batches, sizes)
    where = f"{args.threads} threads"
    if torch.cuda.is_available():  # the LLM runs on the GPU then
        graphs = "eager" if args.enforce_eager else "CUDA graphs"
        where = f"{torch.cuda.get_device_name()}, {graphs}"
    return print_table(
        f"speculative decoding, trained pair, k={K}, {out_tokens} greedy tokens, {args.dtype}, "
        f"{where}, {repeats} rounds (output tokens per CPU-second, median; speed-up: median "
        "ratio to the plain runs beside each run, per CPU-second; per wall-second; mean "
        "acceptance length)",
        ["workload", "batch", "off tok/CPU-s (tok/s)", "n-gram", "draft model", "Medusa"],
        rows,
    )
