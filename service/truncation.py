"""`truncation: "auto"`: a conversation longer than the context window loses its oldest
turns instead of failing, as OpenAI's Responses API does, and does it so the prefix cache
keeps working.

Dropping the fewest turns that make a conversation fit moves the cut every turn once the
window is full: every later turn's prompt differs from the last one's right after the
system prompt, and nothing past it hits the cache (each turn recomputes the whole window).
Here the cut moves in steps of about half the window instead.  The places it may fall are
a chain fixed by the conversation's own turns: the first turn, then the first turn at
least `step` tokens after it, and so on (`chain`), where `step` is half of what the window
leaves the turns.  A request takes the earliest place in the chain from which its
conversation fits.  Adding turns never moves an earlier place, so the cut stays put, and
the turns after it keep hitting the previous turn's KV (pinned for the conversation), until
the conversation outgrows it; then it jumps half a window ahead, one turn recomputes, and
the turns after that hit again.  The cut is stateless: any replica computes the same one
from the same history.

What is kept: the leading system / developer messages (the instructions), and whole turns,
each from a user message to the next, so an assistant's tool calls stay with their outputs
and the kept part starts with a user message as templates expect.  The last turn (this
request's input) is always kept; if it alone does not fit, the request fails as it would
have without truncation.  Room is left for the output: `max_tokens` as the generation
config caps it, else a quarter of the window.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from itertools import pairwise
from typing import Any

from service.protocol import BadRequest


def head_and_turns(messages: Sequence[dict[str, Any]]) -> tuple[int, list[int]]:
    """(where the leading system / developer messages end, where each turn after them
    starts): a turn starts at a user message, and the first turn right after the head
    whatever its role."""
    head = 0
    while head < len(messages) and messages[head]["role"] in ("system", "developer"):
        head += 1
    starts = [head] if head < len(messages) else []
    starts += [i for i in range(head + 1, len(messages)) if messages[i]["role"] == "user"]
    return head, starts


def message_text(m: dict[str, Any]) -> str:
    """What a template message (`ChatMessage.as_template_dict`) says, as one text: what its
    length in tokens is measured on."""
    parts = [m.get("content") or "", m.get("reasoning_content") or ""]
    for c in m.get("tool_calls") or ():
        parts += [c["function"]["name"], str(c["function"]["arguments"])]
    return "\n".join(p for p in parts if p)


def chain(costs: Sequence[int], step: int) -> list[int]:
    """The turns a cut may fall before: 0, then each turn that starts at least `step` cost
    after the last one.  Each place depends only on the turns before it, so a conversation
    that grows keeps its chain."""
    places = [0]
    run = 0
    for i in range(1, len(costs)):
        run += costs[i - 1]
        if run >= step:
            places.append(i)
            run = 0
    return places


_PROBE_TEXTS = ("a", "b")


async def _template_costs(
    render: Render, head: list[dict[str, Any]], a: int, b: int
) -> tuple[int, int]:
    """(the tokens the template adds to a message, the prompt's size without its turns:
    the head, tools and the generation prompt), from two small conversations rendered
    after this head.  A turn's cost is its text's tokens plus the first for each message,
    so the chain's steps are in prompt tokens; both depend only on the head, the tools
    and the template, which keeps the chain the same from turn to turn."""
    ask = {"role": "user", "content": _PROBE_TEXTS[0]}
    try:
        one = len(await render([*head, ask]))
        three = len(
            await render([*head, ask, {"role": "assistant", "content": _PROBE_TEXTS[1]}, ask])
        )
    except BadRequest:  # a template that refuses the probes: texts alone
        return 0, 0
    per_message = max(0, (three - one - a - b) // 2)
    return per_message, max(0, one - a - per_message)


def output_room(max_tokens: int | None, max_model_len: int) -> int:
    """The tokens left for the output when choosing the cut: the request's max_tokens as
    the generation config caps it, else a quarter of the window."""
    return max_tokens or max(1, max_model_len // 4)


class PromptTooLong(BadRequest):
    """A rendered prompt longer than max_model_len by its bytes alone (prep's bound)."""


Render = Callable[[list[dict[str, Any]]], Awaitable[list[int]]]
Measure = Callable[[list[str]], Awaitable[list[int]]]


async def truncated_ids(
    messages: list[dict[str, Any]],
    render: Render,
    measure: Measure,
    max_model_len: int,
    room: int,
    max_bytes: int | None = None,
) -> tuple[list[int], int]:
    """The prompt's token ids with the oldest turns dropped as the module docs say, and how
    many messages were dropped.  `render` turns messages into prompt ids (raising
    PromptTooLong for a text that cannot fit); `measure` gives each text's token count;
    a part whose contents are over `max_bytes` (UTF-8) cannot fit and is not rendered, so
    a huge history costs its search no renders."""
    budget = max_model_len - room
    head, starts = head_and_turns(messages)
    texts = [message_text(m) for m in messages]
    # UTF-8 bytes of the contents from message i on (contents only: a template may leave
    # out a past turn's thinking, never its content)
    after = [0] * (len(messages) + 1)
    for i in range(len(messages) - 1, -1, -1):
        after[i] = after[i + 1] + len((messages[i].get("content") or "").encode())

    def kept(start: int) -> list[dict[str, Any]]:
        return messages[:head] + messages[start:]

    async def fits(start: int) -> list[int] | None:
        """The ids of the head and the messages from `start` on, if they fit."""
        if max_bytes is not None and after[0] - after[head] + after[start] > max_bytes:
            return None
        try:
            ids = await render(kept(start))
        except PromptTooLong:
            return None
        return ids if len(ids) <= budget else None

    if (ids := await fits(head)) is not None:
        return ids, 0
    if len(starts) < 2:  # one turn: nothing may go
        return await render(messages), 0
    bounds = [*starts, len(messages)]
    sizes = await measure([*("\n".join(texts[a:b]) for a, b in pairwise(bounds)), *_PROBE_TEXTS])
    per_message, head_size = await _template_costs(render, messages[:head], *sizes[-2:])
    costs = [size + per_message * (b - a) for size, (a, b) in zip(sizes, pairwise(bounds))]
    places = chain(costs, max(1, (budget - head_size) // 2))
    if places[-1] != len(starts) - 1:
        places.append(len(starts) - 1)  # the last turn alone: the last resort

    # The earliest place that fits (a later place only drops more): the whole conversation
    # did not, so search places[1:].
    lo, hi, found = 1, len(places) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        if (got := await fits(starts[places[mid]])) is not None:
            found, hi = (mid, got), mid - 1
        else:
            lo = mid + 1
    if found is None:  # even the last turn alone: refused (or served short) as before
        return await render(kept(starts[places[-1]])), starts[places[-1]] - head
    place, ids = found
    return ids, starts[places[place]] - head


def check_mode(mode: str | None, truncate_prompt_tokens: int | None) -> bool:
    """Whether auto truncation is on; a 400 naming `truncation` for a combination that
    would cut the prompt twice."""
    if mode != "auto":
        return False
    if truncate_prompt_tokens is not None:
        raise BadRequest(
            'truncation "auto" drops whole turns; it cannot be combined with '
            "truncate_prompt_tokens",
            "truncation",
        )
    return True
