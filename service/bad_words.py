"""vLLM's `bad_words`: token sequences a request may not generate.

Each word is banned both as it would begin the text and as it would follow a space (a
BPE tokenizer spells the two differently), as vLLM does: the word with its leading
whitespace dropped, then with one space before it, the second kept only where it is a
different spelling of the same length (else it would ban an unrelated token).  The sampler
(gpu/sampler.py) bans a sequence's last token whenever the output so far ends with the rest
of it (a one-token word is banned outright).  Only output tokens count, not the prompt.

Bounded as vLLM bounds it (128 words, 1,024 tokens in all): the sampler checks the
sequences every step, and each sample of a request holds them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler.sampling_params import SamplingParams

MAX_BAD_WORDS = 128
MAX_BAD_WORD_TOKENS = 1024


def spellings(words: Sequence[str]) -> list[str]:
    """The two texts to tokenize for each word (without special tokens), in order."""
    out = []
    for w in words:
        out += [w.lstrip(), " " + w.lstrip()]
    return out


def token_sequences(words: Sequence[str], encoded: Sequence[list[int]]) -> list[list[int]]:
    """The banned sequences from `spellings(words)` tokenized; ValueError naming the field
    when they hold more than MAX_BAD_WORD_TOKENS tokens."""
    out: list[list[int]] = []
    for i in range(len(words)):
        plain, spaced = encoded[2 * i], encoded[2 * i + 1]
        if not plain:
            continue
        out.append(plain)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    total = sum(map(len, out))
    if total > MAX_BAD_WORD_TOKENS:
        raise ValueError(
            f"bad_words: the words are {total} tokens, more than {MAX_BAD_WORD_TOKENS}"
        )
    return out


def check_words(words: Sequence[str]) -> None:
    """ValueError naming the field for too many words or one without text."""
    if len(words) > MAX_BAD_WORDS:
        raise ValueError(f"bad_words: {len(words)} words, more than {MAX_BAD_WORDS}")
    if any(not w.strip() for w in words):
        raise ValueError("bad_words: a word must have text other than whitespace")


def encode_words(
    words: Sequence[str], encode_batch: Callable[[list[str]], list[list[int]]]
) -> list[list[int]]:
    """check_words, then the banned sequences, tokenized by `encode_batch` (texts ->
    ids, no special tokens) where it runs (the offline engine; the server tokenizes off
    its event loop and calls token_sequences itself)."""
    check_words(words)
    return token_sequences(words, encode_batch(spellings(words)))


def nothing_allowed(params: SamplingParams, eos_token_ids: Sequence[int]) -> str | None:
    """Why no token could ever be sampled, or None.  allowed_token_ids must leave a token
    that is neither banned as a one-token bad word nor (with min_tokens) held back as eos
    or a stop token id.  Masked away entirely, a row would sample id 0 (greedy) or the
    last id (random), as vLLM's does; this is the part known before the first step
    (multi-token bans and grammars depend on the text)."""
    allowed = params.allowed_token_ids
    if not allowed:
        return None
    left = set(allowed) - {s[0] for s in params.bad_words_token_ids or () if len(s) == 1}
    if not left:
        return "every id in allowed_token_ids is banned by bad_words: no token could be generated"
    if params.min_tokens and not left - {*eos_token_ids, *params.stop_token_ids}:
        return (
            f"min_tokens ({params.min_tokens}) holds back eos and stop_token_ids, and "
            "allowed_token_ids allows nothing else: no token could be generated"
        )
    return None
