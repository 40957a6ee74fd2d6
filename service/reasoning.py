"""Reasoning models' thinking, separated from their answer (`--reasoning-parser`).

A reasoning model writes `<think> ... </think>` before its answer.  The parser splits the
text at the tags: what lies between goes to the client as `reasoning` (chat deltas and
messages carry it as `reasoning_content` too: SGLang's and DeepSeek's name, which many
clients read), what follows as `content`.  Tool calls are parsed from the content only,
and a grammar (`response_format`, a tool_choice that constrains) starts after the
closing tag (`StructuredOutputsParams.reasoning_end`), so the model thinks freely and then
answers in the required shape.

Where the output starts is read from the prompt, not guessed from the output:
- the prompt leaves `<think>` open (a template that opens it, as Qwen3's thinking models
  and DeepSeek-R1's newer ones do): the output starts in reasoning;
- the prompt ends with a closed, empty `<think></think>` (Qwen3's `enable_thinking=False`):
  the output is all content;
- otherwise `deepseek_r1` takes the output as reasoning until `</think>` (R1 thinks
  without opening the tag), and `qwen3` as content unless the output opens with `<think>`.

Both tags must be single tokens of the vocabulary (the server refuses to start
otherwise): the grammar switches on the closing tag's token id.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from scheduler.sampling_params import ReasoningBudget, StructuredOutputsParams

# name -> (opening tag, closing tag, output without a tag starts in reasoning)
PARSERS: dict[str, tuple[str, str, bool]] = {
    "deepseek_r1": ("<think>", "</think>", True),
    "qwen3": ("<think>", "</think>", False),
}

# A prompt whose last closing tag is followed by at most this many tokens, all whitespace,
# closed the thinking at the generation prompt (thinking disabled).
_CLOSED_TAIL = 8


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    name: str
    start: str
    end: str
    start_id: int
    end_id: int
    implicit: bool  # output with no opening tag is reasoning (until the closing one)

    @classmethod
    def load(cls, name: str, tokenizer: Any) -> ReasoningParser:
        """The parser for a tokenizer (pagestream's Tokenizer); ValueError naming what is
        missing when the tags are not single tokens that decode to themselves."""
        if name not in PARSERS:
            raise ValueError(
                f"--reasoning-parser: unknown parser {name!r}; choose from {', '.join(PARSERS)}"
            )
        start, end, implicit = PARSERS[name]
        ids = []
        for tag in (start, end):
            tid = tokenizer.backend.token_to_id(tag)
            if tid is None:
                raise ValueError(
                    f"--reasoning-parser {name}: the tokenizer has no {tag!r} token "
                    "(the model is not a reasoning model of this family)"
                )
            if tid in tokenizer.all_special_ids or tokenizer.decode([tid]) != tag:
                raise ValueError(
                    f"--reasoning-parser {name}: the tokenizer's {tag!r} is a special token "
                    "that decoding drops, so its text cannot be split"
                )
            ids.append(tid)
        return cls(name, start, end, ids[0], ids[1], implicit)

    def opening_state(self, prompt_ids: Sequence[int], tail_text: Any) -> bool | None:
        """How the output starts: True in reasoning, False in content (thinking was
        closed by the prompt), None in content unless it opens with the tag.
        tail_text(ids) decodes a few tokens (to tell a whitespace-only tail)."""
        last_start = _last_index(prompt_ids, self.start_id)
        last_end = _last_index(prompt_ids, self.end_id)
        if last_start > last_end:
            return True
        if last_end >= 0:
            tail = prompt_ids[last_end + 1 :]
            if len(tail) <= _CLOSED_TAIL and not tail_text(list(tail)).strip():
                return False
        return True if self.implicit else None

    def constrain(
        self, spec: StructuredOutputsParams, opening: bool | None
    ) -> StructuredOutputsParams:
        """A grammar moved past the thinking, as `opening` says the output starts."""
        if opening is False:
            return spec
        start = self.start_id if opening is None else None
        return msgspec.structs.replace(spec, reasoning_end=self.end_id, reasoning_start=start)

    def budget(self, tokens: int, opening: bool | None) -> ReasoningBudget | None:
        """At most `tokens` of thinking for an output that starts as `opening` says
        (None: thinking was closed by the prompt, there is none to bound)."""
        if opening is False:
            return None
        start = self.start_id if opening is None else None
        return ReasoningBudget(end=self.end_id, budget=tokens, start=start)


class ThinkingCount:
    """Output tokens spent thinking, counted on the token ids as they come (OpenAI's
    usage `reasoning_tokens`): the tags and what lies between."""

    __slots__ = ("count", "p", "state")

    def __init__(self, parser: ReasoningParser, opening: bool | None) -> None:
        self.p = parser
        self.state = {True: 1, None: 0, False: 2}[opening]  # 0 may open, 1 in, 2 past
        self.count = 0

    @property
    def closed(self) -> bool:
        """The thinking ended (or never began)."""
        return self.state == 2

    def feed(self, ids: Sequence[int]) -> None:
        for tok in ids:
            if self.state == 0:
                self.state = 1 if tok == self.p.start_id else 2
            if self.state != 1:
                return
            self.count += 1
            if tok == self.p.end_id:
                self.state = 2


def _last_index(ids: Sequence[int], tid: int) -> int:
    # (reversed and searched in C: a long prompt without the tags is two full scans, on
    # the event loop)
    try:
        return len(ids) - 1 - list(reversed(ids)).index(tid)
    except ValueError:
        return -1


class ReasoningStream:
    """One choice's text split as it streams: `feed` takes each delta and returns the
    (reasoning, content) it releases.  Text that may be the start of a tag is held until
    the next delta tells; `finish` releases the rest."""

    __slots__ = ("_lead", "held", "p", "reasoned", "state")

    def __init__(self, parser: ReasoningParser, opening: bool | None) -> None:
        self.p = parser
        # "open": may still open with the tag; "think"; "answer"
        self.state = "think" if opening else ("open" if opening is None else "answer")
        self.held = ""
        self.reasoned = bool(opening)
        # The blank lines a model writes after the closing tag are not part of its answer.
        self._lead = False

    def feed(self, text: str) -> tuple[str, str]:
        reasoning = content = ""
        buf = self.held + text
        self.held = ""
        if self.state == "open":
            body = buf.lstrip()
            if body.startswith(self.p.start):
                self.state, self.reasoned = "think", True
                buf = body[len(self.p.start) :]
            elif self.p.start.startswith(body):
                self.held = buf  # blank, or a prefix of the tag
                return "", ""
            else:
                self.state = "answer"
        if self.state == "think":
            i = buf.find(self.p.end)
            if i < 0:
                keep = _partial_suffix(buf, self.p.end)
                reasoning, self.held = buf[: len(buf) - keep], buf[len(buf) - keep :]
                return reasoning, ""
            reasoning, buf = buf[:i], buf[i + len(self.p.end) :]
            self.state, self._lead = "answer", True
        if self._lead:
            stripped = buf.lstrip()
            if not stripped:
                return reasoning, ""
            self._lead = False
            buf = stripped
        content = buf
        return reasoning, content

    def take(self, text: str, last: bool) -> tuple[str, str]:
        """`feed`, and `finish` too when `text` is the choice's last delta."""
        reasoning, answer = self.feed(text)
        if last:
            more, rest = self.finish()
            reasoning, answer = reasoning + more, answer + rest
        return reasoning, answer

    def finish(self) -> tuple[str, str]:
        """What is still held: an unfinished tag's text goes where it was headed."""
        held, self.held = self.held, ""
        if self.state == "think":
            return held, ""
        if self._lead:
            return "", ""
        return "", held


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def split(parser: ReasoningParser, opening: bool | None, text: str) -> tuple[str, str, bool]:
    """A whole output's (reasoning, content, reasoned)."""
    s = ReasoningStream(parser, opening)
    r1, c1 = s.feed(text)
    r2, c2 = s.finish()
    return r1 + r2, c1 + c2, s.reasoned
