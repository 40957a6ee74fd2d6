"""Long conversations past the context window: the server's `truncation: "auto"` against
what a client does without it (drops its oldest turns until the conversation fits, counted
with the server's own /tokenize), on one server with `--max-model-len` `--trunc-window`.

Conversations of `--trunc-turns` turns (user messages of `--trunc-input` words, answers of
`--trunc-output` tokens, greedy) run one kind after the other, both with a
`conversation_id` (their turns pinned).  Printed per kind, over the turns after the window
first fills: the prompt tokens each turn had to compute (prompt - cached), TTFT p50 / p99,
and how many turns found less than half their prompt cached.  The answers differ between the kinds (they see other
turns), so the token counts, not only the times, are the figure.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from bench.fair import pct_ms, start_server

WORDS = ["river", "mountain", "quiet", "lantern", "orbit", "copper", "meadow", "signal",
         "harbor", "velvet", "thunder", "pencil", "garden", "marble", "echo", "canvas"]  # fmt: skip


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--trunc-window", type=int, default=2048, help="truncation: max_model_len")
    ap.add_argument("--trunc-conversations", type=int, default=2, help="truncation: per kind")
    ap.add_argument("--trunc-turns", type=int, default=40, help="truncation: turns each")
    ap.add_argument("--trunc-input", type=int, default=60, help="truncation: words a message")
    ap.add_argument("--trunc-output", type=int, default=32, help="truncation: answer tokens")


def _post(session, url: str, path: str, body: dict) -> dict:
    r = session.post(url + path, json=body, timeout=300)
    if r.status_code != 200:
        raise RuntimeError(f"{path}: HTTP {r.status_code}: {r.text[:300]}")
    return r.json()


def _turn(session, url: str, messages: list[dict], out: int, conv: str, auto: bool) -> dict:
    body = {"messages": messages, "max_tokens": out, "temperature": 0, "ignore_eos": True,
            "conversation_id": conv, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    if auto:
        body["truncation"] = "auto"
    t0 = time.perf_counter()
    first, text, usage = None, "", None
    with session.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            for c in chunk.get("choices") or []:
                if first is None and c["delta"].get("content"):
                    first = time.perf_counter() - t0
                text += c["delta"].get("content") or ""
            usage = chunk.get("usage") or usage
    assert first is not None and usage is not None
    return {"ttft": first, "text": text, "prompt": usage["prompt_tokens"],
            "cached": usage["prompt_tokens_details"]["cached_tokens"]}  # fmt: skip


def _fit_by_client(session, url: str, messages: list[dict], room: int, window: int) -> list:
    """What a client does without the server's truncation: drop the oldest turn (a user
    message and its answer) until the conversation fits, counted with /tokenize."""
    kept = list(messages)
    while True:
        n = _post(session, url, "/tokenize", {"messages": kept})["count"]
        if n + room <= window or len(kept) <= 2:
            return kept
        kept = kept[:1] + kept[3:]


def _conversations(url: str, args: argparse.Namespace) -> dict[str, list[dict]]:
    import httpx

    rng = random.Random(5)
    out: dict[str, list[dict]] = {"client drops the fewest": [], 'truncation: "auto"': []}
    with httpx.Client() as s:
        _post(s, url, "/v1/chat/completions",
              {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})  # fmt: skip
        for c in range(args.trunc_conversations):
            for kind in out:
                auto = kind.startswith("truncation")
                msgs = [{"role": "system", "content": "You answer questions about words."}]
                filled = False
                for t in range(args.trunc_turns):
                    words = " ".join(rng.choice(WORDS) for _ in range(args.trunc_input))
                    msgs.append({"role": "user", "content": f"Turn {t}: {words}"})
                    whole = _post(s, url, "/tokenize", {"messages": msgs})["count"]
                    filled = filled or whole + args.trunc_output > args.trunc_window
                    send = msgs if auto else _fit_by_client(
                        s, url, msgs, args.trunc_output, args.trunc_window)  # fmt: skip
                    got = _turn(s, url, send, args.trunc_output, f"{kind}-{c}", auto)
                    msgs.append({"role": "assistant", "content": got["text"]})
                    out[kind].append({**got, "filled": filled, "conv": c})
    return out


def run(args: argparse.Namespace, table: Callable, model_dir: Callable) -> str:
    from bench.serve_vllm import _stop

    path: Path = model_dir(args)
    flags = ["--max-model-len", str(args.trunc_window), "--enable-prompt-tokens-details"]
    proc, url = start_server(args, path, flags)
    try:
        turns = _conversations(url, args)
    finally:
        _stop(proc)
    rows, base = [], None
    for kind, ts in turns.items():
        late = [t for t in ts if t["filled"]] or ts
        computed = statistics.mean(t["prompt"] - t["cached"] for t in late)
        ttft = [t["ttft"] for t in late]
        misses = sum(1 for t in late if t["cached"] < t["prompt"] / 2)
        base = base or (computed, pct_ms(ttft, 50))
        rows.append([
            kind, str(len(late)), f"{statistics.mean(t['prompt'] for t in late):.0f}",
            f"{computed:.0f}", f"{base[0] / computed:.2f}x",
            f"{pct_ms(ttft, 50):.0f} / {pct_ms(ttft, 99):.0f}", f"{base[1] / pct_ms(ttft, 50):.2f}x",
            str(misses),
        ])  # fmt: skip
    return table(
        f"conversations past a {args.trunc_window}-token window ({args.dtype}): "
        f"{args.trunc_conversations} per kind, {args.trunc_turns} turns of "
        f"{args.trunc_input} words + {args.trunc_output} tokens; turns after the window filled",
        ["kind", "turns", "prompt tokens", "computed a turn", "less computed",
         "TTFT p50 / p99 ms", "TTFT p50 vs client", "turns mostly computed"],
        rows,
    )  # fmt: skip
