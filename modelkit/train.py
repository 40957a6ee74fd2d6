"""`pagestream train-pair`: train a small target model and a much smaller draft on local text.

The default model used to be random noise: it printed garbage on the chat page and made
speculative decoding's acceptance rates meaningless.  This trains, on this machine and in
a fixed CPU budget, two Llama checkpoints that share one byte-level BPE tokenizer (the one
`make-model` trains) on the Python standard library's sources, and writes them in Hugging
Face's layout with the ChatML template.  Training is a fixed number of steps from fixed
seeds over a fixed corpus order, so two runs on the same torch build write the same pair.

transformers' LlamaForCausalLM does the training (its parameter names are the checkpoint's);
the result is saved in bfloat16 like a released checkpoint.  The forward passes run under
bfloat16 autocast only where the CPU multiplies bf16 natively (AVX512-BF16, AMX): elsewhere
torch emulates bf16 products, an order of magnitude slower than float32.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from gpu.cpu.features import detect
from modelkit.make_model import (
    ENDOFTEXT_ID,
    IM_END_ID,
    Preset,
    _write_json,
    build_config,
    load_corpus,
    param_count,
    tokenizer_files,
    trained_tokenizer_json,
)

# Where the trained pair ships (committed: ~10 MB in bfloat16).
PAIR_DIR = Path(__file__).parent / "pair"

VOCAB_SIZE = 4096
CORPUS_BYTES = 6 << 20  # the licences, then the stdlib in path order, up to 6 MB
HELD_OUT_EVERY = 20  # every 20th file is held out for perplexity
SEQ_LEN = 128

# One tokenizer for both; the shapes are what separates them.
TARGET = Preset(
    hidden_size=256,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    intermediate_size=768,
    vocab_size=VOCAB_SIZE,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    init_std=0.02,
    dtype="bfloat16",
)
DRAFT = Preset(
    hidden_size=128,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=64,
    intermediate_size=384,
    vocab_size=VOCAB_SIZE,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    init_std=0.02,
    dtype="bfloat16",
)


@dataclass(frozen=True)
class TrainPlan:
    steps: int
    batch_size: int
    lr: float
    seed: int


TARGET_PLAN = TrainPlan(steps=1000, batch_size=8, lr=3e-3, seed=0)
DRAFT_PLAN = TrainPlan(steps=750, batch_size=8, lr=5e-3, seed=1)


def _tokenizer(vocab_size: int) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_str(trained_tokenizer_json(vocab_size, CORPUS_BYTES))


def token_streams(tok: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out) token ids: each file's tokens then an end-of-text token."""
    texts = load_corpus(CORPUS_BYTES)
    train: list[int] = []
    held: list[int] = []
    encs = tok.encode_batch(list(texts), add_special_tokens=False)
    for i, enc in enumerate(encs):
        dst = held if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else train
        dst += enc.ids
        dst.append(ENDOFTEXT_ID)
    return torch.tensor(train, dtype=torch.long), torch.tensor(held, dtype=torch.long)


def _hf_model(cfg: dict[str, Any], seed: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    conf = LlamaConfig(**{**cfg, "torch_dtype": "float32"})
    return LlamaForCausalLM(conf)


def _autocast() -> Any:
    """bf16 autocast where the CPU computes bf16 natively; float32 everywhere else."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=detect().native_bf16)


def _loss(model: Any, batch: torch.Tensor) -> torch.Tensor:
    with _autocast():
        logits = model(input_ids=batch[:, :-1]).logits
    return torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)
    )


def _distill_loss(model: Any, teacher: Any, batch: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) over every next-token distribution: a draft that imitates
    the target (rather than the data) is what speculative decoding accepts."""
    x = batch[:, :-1]
    with torch.no_grad(), _autocast():
        t_logits = teacher(input_ids=x).logits
    with _autocast():
        s_logits = model(input_ids=x).logits
    v = s_logits.shape[-1]
    return torch.nn.functional.kl_div(
        torch.log_softmax(s_logits.float().reshape(-1, v), -1),
        torch.log_softmax(t_logits.float().reshape(-1, v), -1),
        log_target=True,
        reduction="batchmean",
    )


def _step(model: Any, opt: Any, batch: torch.Tensor, teacher: Any) -> torch.Tensor:
    loss = _loss(model, batch) if teacher is None else _distill_loss(model, teacher, batch)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss


def _optimizer(model: Any, plan: TrainPlan) -> Any:
    return torch.optim.AdamW(model.parameters(), lr=plan.lr, weight_decay=0.1, betas=(0.9, 0.95))


def seconds_per_step(
    cfg: dict[str, Any], data: torch.Tensor, plan: TrainPlan, teacher: Any
) -> float:
    """Time of one training step on this machine (a throwaway model; median of 3 after a
    warm-up), so a time budget can be turned into a step count before training starts."""
    model = _hf_model(cfg, plan.seed).train()
    opt = _optimizer(model, plan)
    batch = data[: plan.batch_size * (SEQ_LEN + 1)].view(plan.batch_size, SEQ_LEN + 1)
    times = []
    for _ in range(4):
        t = time.perf_counter()
        _step(model, opt, batch, teacher)
        times.append(time.perf_counter() - t)
    return sorted(times[1:])[1]


def train_one(
    cfg: dict[str, Any], data: torch.Tensor, plan: TrainPlan, name: str, teacher: Any = None
) -> Any:
    """AdamW with warm-up and cosine decay over random windows of the training stream;
    with a teacher, distillation instead of the data's next tokens."""
    model = _hf_model(cfg, plan.seed)
    model.train()
    opt = _optimizer(model, plan)
    rng = random.Random(plan.seed)
    warm = max(1, plan.steps // 20)
    t0 = time.perf_counter()
    for step in range(plan.steps):
        lr = plan.lr * min(1.0, (step + 1) / warm)
        lr *= 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / plan.steps))
        for g in opt.param_groups:
            g["lr"] = lr
        starts = [rng.randrange(len(data) - SEQ_LEN - 1) for _ in range(plan.batch_size)]
        batch = torch.stack([data[s : s + SEQ_LEN + 1] for s in starts])
        loss = _step(model, opt, batch, teacher)
        if step % 25 == 0 or step == plan.steps - 1:
            print(
                f"  {name} step {step + 1}/{plan.steps} loss {loss.item():.3f} "
                f"({time.perf_counter() - t0:.0f} s)",
                file=sys.stderr,
            )
    model.eval()
    return model


@torch.inference_mode()
def agreement(draft: Any, target: Any, data: torch.Tensor, max_windows: int = 64) -> float:
    """How often the draft's greedy next token is the target's (held-out windows): the
    acceptance rate of one greedy draft token."""
    n = min(max_windows, (len(data) - 1) // SEQ_LEN)
    same = total = 0
    for i in range(n):
        w = data[i * SEQ_LEN : (i + 1) * SEQ_LEN].unsqueeze(0)
        a = draft(input_ids=w).logits.argmax(-1)
        b = target(input_ids=w).logits.argmax(-1)
        same += int((a == b).sum())
        total += a.numel()
    return same / total


@torch.inference_mode()
def perplexity(model: Any, data: torch.Tensor, max_windows: int = 64) -> float:
    """exp(mean token loss) over consecutive held-out windows."""
    n = min(max_windows, (len(data) - 1) // SEQ_LEN)
    total = 0.0
    for i in range(n):
        w = data[i * SEQ_LEN : (i + 1) * SEQ_LEN + 1].unsqueeze(0)
        total += _loss(model, w).item()
    return math.exp(total / n)


def save_checkpoint(model: Any, cfg: dict[str, Any], tok_json: str, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(tok_json, encoding="utf-8")
    for fname, obj in tokenizer_files(cfg["max_position_embeddings"]).items():
        _write_json(out / fname, obj)
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": ENDOFTEXT_ID,
            "eos_token_id": [ENDOFTEXT_ID, IM_END_ID],
            "pad_token_id": ENDOFTEXT_ID,
        },
    )
    sd = model.state_dict()
    if cfg.get("tie_word_embeddings"):
        sd.pop("lm_head.weight", None)
    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in sd.items()}
    save_file(tensors, str(out / "model.safetensors"), {"format": "pt"})
    (out / "model.safetensors").chmod(0o644)
    _write_json(out / "config.json", cfg)  # last: a dir with config.json is complete


def budget_scale(minutes: float, spent: float, train: torch.Tensor, eval_windows: int) -> float:
    """The share of the default plans' steps that fits what is left of `minutes` (after
    `spent` seconds of set-up), from timing a few steps of each model here; at most 1."""
    t_cfg, d_cfg = build_config(TARGET, "llama"), build_config(DRAFT, "llama")
    t0 = time.perf_counter()
    t_step = seconds_per_step(t_cfg, train, TARGET_PLAN, None)
    teacher = _hf_model(t_cfg, 0).eval()  # untrained: a distillation step costs the same
    d_step = seconds_per_step(d_cfg, train, DRAFT_PLAN, teacher)
    # Evaluation: perplexity of both and agreement, forward passes over eval windows.
    evals = 3 * eval_windows * t_step / TARGET_PLAN.batch_size
    left = minutes * 60 - spent - (time.perf_counter() - t0) - evals
    full = TARGET_PLAN.steps * t_step + DRAFT_PLAN.steps * d_step
    print(
        f"budget {minutes:g} min: {t_step:.2f} s/target step, {d_step:.2f} s/draft step, "
        f"{max(left, 0):.0f} s left for {full:.0f} s of default training",
        file=sys.stderr,
    )
    return max(0.0, min(1.0, left / full))


def train_pair(
    out_dir: Path,
    *,
    scale: float = 1.0,
    threads: int = 1,
    eval_windows: int = 64,
    reuse_target: bool = False,
    minutes: float | None = None,
) -> dict[str, Any]:
    """Train and write `out_dir/target` and `out_dir/draft`; return their report.  With
    `minutes`, the steps are scaled (from `scale`, at most) to fit that wall-clock budget."""
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    tok_json = trained_tokenizer_json(VOCAB_SIZE, CORPUS_BYTES)
    tok = _tokenizer(VOCAB_SIZE)
    train, held = token_streams(tok)
    print(
        f"corpus: {len(train)} training tokens, {len(held)} held out (vocab {VOCAB_SIZE})",
        file=sys.stderr,
    )
    report: dict[str, Any] = {"vocab_size": VOCAB_SIZE, "train_tokens": len(train)}
    if minutes is not None and not reuse_target:
        spent = time.perf_counter() - t0
        scale = min(scale, budget_scale(minutes, spent, train, eval_windows))
        report["budget_minutes"] = minutes
    report["scale"] = scale
    # bf16 autocast vs float32 changes the weights: two runs match only on like CPUs.
    report["compute_dtype"] = "bfloat16" if detect().native_bf16 else "float32"
    teacher = None
    for name, preset, plan in (("target", TARGET, TARGET_PLAN), ("draft", DRAFT, DRAFT_PLAN)):
        cfg = build_config(preset, "llama")
        steps = max(1, int(plan.steps * scale))
        p = TrainPlan(steps, plan.batch_size, plan.lr, plan.seed)
        ts = time.perf_counter()
        if name == "target" and reuse_target:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(out_dir / "target", dtype=torch.float32)
            report["target"] = json.loads((out_dir / "report.json").read_text())["target"]
            teacher = model.eval()
            continue
        model = train_one(cfg, train, p, name, teacher=teacher)
        model.to(torch.bfloat16).float()  # in place: evaluate the weights as saved
        ppl = perplexity(model, held, eval_windows)
        save_checkpoint(model, cfg, tok_json, out_dir / name)
        report[name] = {
            "params": param_count(cfg),
            "steps": steps,
            "tokens_seen": steps * plan.batch_size * SEQ_LEN,
            "held_out_perplexity": round(ppl, 2),
            "seconds": round(time.perf_counter() - ts, 1),
        }
        if teacher is not None:
            report[name]["greedy_agreement_with_target"] = round(
                agreement(model, teacher, held, eval_windows), 3
            )
        teacher = model.eval()
        print(f"{name}: {report[name]}", file=sys.stderr)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    _write_json(out_dir / "report.json", report)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="pagestream train-pair",
        description="Train a small Llama target and a much smaller draft (same tokenizer) on "
        "the Python standard library's sources; write both as HF checkpoints.",
    )
    ap.add_argument("dir", type=Path, help="output directory: DIR/target, DIR/draft")
    ap.add_argument(
        "--minutes",
        type=float,
        default=10.0,
        help="wall-clock budget for the whole run: the training steps are scaled down to fit "
        "it (timed on this machine); 0 = no budget, the full default plans",
    )
    ap.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="multiply the training steps (1.0 = the default plans, which trained the shipped "
        "pair; with --minutes, the most that is used)",
    )
    # One thread: the shipped pair was trained so, and float sums depend on the split.
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--draft-only",
        action="store_true",
        help="keep DIR/target (and its report) and retrain only the draft against it",
    )
    args = ap.parse_args(argv)
    report = train_pair(
        args.dir,
        scale=args.scale,
        threads=args.threads,
        reuse_target=args.draft_only,
        minutes=args.minutes or None,
    )
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
