"""`pagestream train-medusa`: Medusa heads for a target checkpoint, trained on this machine.

The target stays frozen (Medusa-1): its last hidden states (after the final norm, what the
serving runner hands the heads) over the local corpus (modelkit.make_model.load_corpus,
the Python standard library's sources the tokenizer and the pair were trained on) are the
heads' inputs.  Head k at position t learns the target's own greedy guess for token
t + 2 + k (its argmax at t + 1 + k, given the text so far): what verification will
compare against, so the heads imitate the target rather than the corpus.  Each head
starts as Medusa's do: ResBlock weights zero (an identity block) and the output layer a
copy of the target's LM head; the per-head losses are weighted 0.8 ** k.

The result is a Medusa checkpoint in the public layout (gpu/medusa.py), for
`--speculative-method medusa --speculative-model DIR`.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from gpu.medusa import MedusaHeads
from modelkit.make_model import load_corpus

SEQ_LEN = 128
HELD_OUT_EVERY = 20  # every 20th corpus file is held out (as train-pair does)
DEFAULT_CORPUS_BYTES = 2 << 20
LOSS_DECAY = 0.8


def _target(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def token_streams(model_dir: Path, corpus_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out) token ids of the corpus under the target's own tokenizer."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    train: list[int] = []
    held: list[int] = []
    texts = list(load_corpus(corpus_bytes))
    for i, enc in enumerate(tok.encode_batch(texts, add_special_tokens=False)):
        (held if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else train).extend(enc.ids)
    if len(train) < SEQ_LEN + 2:
        raise SystemExit(f"the corpus gave {len(train)} tokens; need more than {SEQ_LEN + 2}")
    return torch.tensor(train), torch.tensor(held or train[-(SEQ_LEN + 1) :])


@torch.inference_mode()
def _features(target: Any, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(last hidden states [B, L, H], the target's greedy next token at each [B, L])."""
    out = target.model(input_ids=batch)
    h = out.last_hidden_state
    return h, target.lm_head(h).argmax(-1)


def _head_losses(heads: MedusaHeads, h: torch.Tensor, guess: torch.Tensor) -> list[torch.Tensor]:
    """Head k at t against the target's guess at t + 1 + k (the token at t + 2 + k)."""
    losses = []
    for k, head in enumerate(heads.heads):
        n = h.shape[1] - 1 - k
        if n <= 0:
            break
        logits = head(h[:, :n])
        losses.append(
            torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), guess[:, 1 + k : 1 + k + n].reshape(-1)
            )
        )
    return losses


@torch.inference_mode()
def head_accuracy(
    target: Any, heads: MedusaHeads, data: torch.Tensor, max_windows: int = 16
) -> list[float]:
    """Per head, how often its top-1 is the target's greedy token there (held out)."""
    n = max(1, min(max_windows, (len(data) - 1) // SEQ_LEN))
    hits = [0] * heads.num_heads
    total = [0] * heads.num_heads
    for i in range(n):
        w = data[i * SEQ_LEN : (i + 1) * SEQ_LEN].unsqueeze(0)
        h, guess = _features(target, w)
        for k, head in enumerate(heads.heads):
            m = h.shape[1] - 1 - k
            if m <= 0:
                continue
            top = head(h[:, :m]).argmax(-1)
            hits[k] += int((top == guess[:, 1 + k : 1 + k + m]).sum())
            total[k] += m
    return [hits[k] / total[k] if total[k] else 0.0 for k in range(heads.num_heads)]


def initial_heads(target: Any, num_heads: int, num_layers: int) -> MedusaHeads:
    """Medusa's starting point: identity ResBlocks and the target's own LM head."""
    cfg = target.config
    heads = MedusaHeads(cfg.hidden_size, cfg.vocab_size, num_heads, num_layers)
    lm_head = target.get_output_embeddings().weight.detach()
    with torch.no_grad():
        for head in heads.heads:
            for block in list(head)[:-1]:
                torch.nn.init.zeros_(block.linear.weight)
            head[-1].weight.copy_(lm_head[: cfg.vocab_size])
    return heads


def train_medusa(
    model_dir: Path,
    out: Path,
    *,
    num_heads: int = 4,
    num_layers: int = 1,
    steps: int = 300,
    batch_size: int = 8,
    lr: float = 1e-3,
    minutes: float | None = None,
    corpus_bytes: int = DEFAULT_CORPUS_BYTES,
    seed: int = 0,
) -> dict[str, Any]:
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    target = _target(model_dir)
    for p in target.parameters():
        p.requires_grad_(False)
    heads = initial_heads(target, num_heads, num_layers)
    train, held = token_streams(model_dir, corpus_bytes)
    opt = torch.optim.AdamW(heads.parameters(), lr=lr, weight_decay=0.0)
    rng = random.Random(seed)
    deadline = None if not minutes else t0 + 60 * minutes
    done = 0
    last = float("nan")
    for step in range(steps):
        if deadline is not None and time.perf_counter() > deadline:
            break
        for g in opt.param_groups:
            g["lr"] = lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
        starts = [rng.randrange(len(train) - SEQ_LEN) for _ in range(batch_size)]
        batch = torch.stack([train[s : s + SEQ_LEN] for s in starts])
        h, guess = _features(target, batch)
        h = h.clone()  # out of inference mode: autograd may save it
        guess = guess.clone()
        losses = _head_losses(heads, h, guess)
        loss = sum(LOSS_DECAY**k * lk for k, lk in enumerate(losses))
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[union-attr]
        opt.step()
        done, last = step + 1, float(loss.detach())  # type: ignore[union-attr]
        if step % 25 == 0 or step == steps - 1:
            print(
                f"  medusa step {step + 1}/{steps} loss {last:.3f} "
                f"({time.perf_counter() - t0:.0f} s)",
                file=sys.stderr,
            )
    heads.eval()
    acc = head_accuracy(target, heads, held)
    report = {
        "steps": done,
        "final_loss": round(last, 4),
        "held_out_top1_vs_target": [round(a, 4) for a in acc],
        "train_tokens": len(train),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    heads.save(out, str(model_dir), {"training": report})
    return report


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="pagestream train-medusa",
        description="Train Medusa heads for a target checkpoint on its own hidden states over "
        "the local corpus; write them in the public Medusa layout.",
    )
    ap.add_argument("model", type=Path, help="the target checkpoint (HF directory)")
    ap.add_argument("out", type=Path, help="output directory for the heads")
    ap.add_argument("--num-heads", type=int, default=4, help="heads (tree depth), default 4")
    ap.add_argument("--num-layers", type=int, default=1, help="ResBlocks per head")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument(
        "--minutes", type=float, default=10.0,
        help="wall-clock budget; training stops early when it is spent (0: none)",
    )  # fmt: skip
    ap.add_argument("--corpus-bytes", type=int, default=DEFAULT_CORPUS_BYTES)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    for name in ("num_heads", "num_layers", "steps", "batch_size", "corpus_bytes"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if not (a.model / "config.json").is_file():
        ap.error(f"{a.model}: no config.json (not a checkpoint directory)")
    if a.threads:
        torch.set_num_threads(a.threads)
    report = train_medusa(
        a.model, a.out, num_heads=a.num_heads, num_layers=a.num_layers, steps=a.steps,
        batch_size=a.batch_size, lr=a.lr, minutes=a.minutes or None,
        corpus_bytes=a.corpus_bytes, seed=a.seed,
    )  # fmt: skip
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
