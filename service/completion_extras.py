"""Completions' extras: best_of ranking, echo, and vLLM-shaped prompt_logprobs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from scheduler.contract import TokenLogprobs
from service.outputs import CompletionOutput

# Past this many logprob entries a non-streamed body is built off the event loop (enough
# work to delay other streams' frames; what one response may carry is bounded by
# Limits.max_prompt_logprob_entries and the sampled tokens).
OFF_LOOP_LOGPROB_ENTRIES = 20_000

# A token the grammar forbids has logprob -inf, which JSON cannot carry (it would go out as
# null, and clients such as lm-eval take max() over the values).  vLLM and OpenAI report
# this floor instead.
LOGPROB_FLOOR = -9999.0


def finite(v: float) -> float:
    return v if v > LOGPROB_FLOOR else LOGPROB_FLOOR


def best_of(outputs: list[CompletionOutput], n: int) -> list[CompletionOutput]:
    """The n samples with the highest cumulative logprob (OpenAI's best_of), reindexed."""
    if len(outputs) <= n:
        return outputs

    def score(o: CompletionOutput) -> float:
        return sum(lp.logprob for lp in o.logprobs or [])

    best = sorted(outputs, key=score, reverse=True)[:n]
    for i, o in enumerate(best):
        o.index = i
    return best


def prompt_logprobs_json(
    plp: list[TokenLogprobs | None] | None, text: Callable[[int], str]
) -> list[dict[str, Any] | None] | None:
    """vLLM's shape: per prompt token, {token id: {logprob, rank, decoded_token}} holding
    the prompt token and the top alternatives; None for the first token."""
    if plp is None:
        return None
    out: list[dict[str, Any] | None] = []
    for lp in plp:
        if lp is None:
            out.append(None)
            continue
        # vLLM's order: the prompt token first (with its rank in the whole vocabulary),
        # then the top alternatives by rank; a prompt token among them keeps that rank.
        entry = {
            str(lp.token_id): {
                "logprob": finite(lp.logprob),
                "rank": lp.rank,
                "decoded_token": text(lp.token_id),
            }
        }
        for r, (i, v) in enumerate(zip(lp.top_token_ids, lp.top_logprobs, strict=True), 1):
            entry[str(i)] = {"logprob": finite(v), "rank": r, "decoded_token": text(i)}
        out.append(entry)
    return out


def token_id_label(tid: int) -> str:
    """vLLM's return_tokens_as_token_ids name of a token in logprobs."""
    return f"token_id:{tid}"


def token_labels(as_ids: bool) -> Callable[[int], str] | None:
    """How a response's logprobs name tokens: by id (return_tokens_as_token_ids), or
    None for their text."""
    return token_id_label if as_ids else None


def echo_logprobs(
    plp: list[TokenLogprobs | None],
    text: Callable[[int], str],
    prompt_ids: list[int],
    label: Callable[[int], str] | None = None,
) -> dict[str, Any]:
    """The prompt's part of a completion's logprobs object when echo is on (the first
    token has none, as in OpenAI's legacy API).  label: how tokens are named (default
    their text); offsets count the text either way."""
    label = label or text
    tokens, lps, tops, offsets, pos = [], [], [], [], 0
    for tid, lp in zip(prompt_ids, plp, strict=True):
        t = text(tid)
        tokens.append(label(tid))
        offsets.append(pos)
        pos += len(t)
        if lp is None:
            lps.append(None)
            tops.append(None)
        else:
            lps.append(finite(lp.logprob))
            tops.append(
                {
                    label(i): finite(v)
                    for i, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)
                }
            )
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


class PromptLogprobs:
    """Each prompt's echo logprobs and vLLM-shaped prompt_logprobs, built once and shared
    by all its choices (n choices of one prompt carry the same values; `join_logprobs`
    copies, never mutates, what it is given)."""

    def __init__(
        self, text: Callable[[int], str], label: Callable[[int], str] | None = None
    ) -> None:
        self.text, self.label = text, label
        self._echo: dict[int, dict[str, Any]] = {}
        self._vllm: dict[int, list[dict[str, Any] | None]] = {}

    def echo(
        self, i: int, plp: list[TokenLogprobs | None], prompt_ids: list[int]
    ) -> dict[str, Any]:
        hit = self._echo.get(i)
        if hit is None:
            hit = self._echo[i] = echo_logprobs(plp, self.text, prompt_ids, self.label)
        return hit

    def vllm(self, i: int, plp: list[TokenLogprobs | None] | None) -> list[Any] | None:
        hit = self._vllm.get(i)
        if hit is None and (hit := prompt_logprobs_json(plp, self.text)) is not None:
            self._vllm[i] = hit
        return hit


def join_logprobs(head: dict[str, Any], tail: dict[str, Any] | None) -> dict[str, Any]:
    if tail is None:
        return head
    return {k: head[k] + tail[k] for k in head}
