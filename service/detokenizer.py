"""Incremental detokenization and stop strings, one instance per output stream.

The server turns sampled token ids into text deltas as they arrive.  Two rules keep the
deltas honest: a character whose UTF-8 bytes are split over several byte-level tokens is
held back until it is complete, and text that might be the start of a stop string is held
back until it is known not to be one, so a client never sees part of a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.decoders import DecodeStream

# Prompt tokens decoded ahead of the output, so that decoders which drop a leading space
# on the first token (SentencePiece's Metaspace) keep the space before the first output
# word.  Byte-level decoders do not depend on it.
_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class _HasBackend(Protocol):
    @property
    def backend(self) -> _HFTokenizer: ...


class IncrementalDetokenizer:
    """Token ids in, text deltas out, using the `tokenizers` library's `DecodeStream`.

    The concatenation of all `push` results and the final `flush` equals the full decode of
    the output ids (for byte-level BPE; for SentencePiece-style decoders it keeps the
    leading space of the first output word, as a continuation of the prompt should).
    """

    def __init__(
        self,
        tokenizer: _HasBackend | _HFTokenizer,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        backend = tokenizer if isinstance(tokenizer, _HFTokenizer) else tokenizer.backend
        self._tok = backend
        self._skip = skip_special_tokens
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._context_text = backend.decode(context, skip_special_tokens=skip_special_tokens)
        if self._context_text.endswith(_REPLACEMENT):
            # The prompt ends inside a character (a prompt given as token ids can); the
            # output must not complete it, or its text would not be the output's decode.
            context, self._context_text = [], ""
        self._context = context
        self._stream = DecodeStream(context, skip_special_tokens=skip_special_tokens)
        self._output_ids: list[int] = []
        self._emitted: list[str] = []

    def push(self, token_ids: Sequence[int]) -> str:
        """Feed new token ids; return the text they complete (possibly "")."""
        # One id at a time: a batch of ids (speculative decoding) that ends inside a
        # character would otherwise hold back the complete characters before it too.
        new: list[str] = []
        for i in token_ids:
            self._output_ids.append(i)
            text = self._stream.step(self._tok, i)
            if text:
                new.append(text)
        text = "".join(new)
        if text:
            self._emitted.append(text)
        return text

    def flush(self) -> str:
        """At the end of generation: the text still held back (an incomplete character
        decodes to U+FFFD, exactly as the full decode renders it)."""
        full = self._tok.decode(self._context + self._output_ids, skip_special_tokens=self._skip)
        if full.startswith(self._context_text):
            full = full[len(self._context_text) :]
        emitted = "".join(self._emitted)
        if not full.startswith(emitted):  # never for byte-level tokenizers
            return ""
        rest = full[len(emitted) :]
        self._emitted = [full]
        return rest

    @property
    def output_token_ids(self) -> list[int]:
        return self._output_ids

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._emitted)


class StopChecker:
    """Stop strings over a stream of text deltas.

    A stop string ends the stream at the point where it completes; when two complete at
    the same point the longer wins.  Text that could still become the start of a stop string
    is held back until it cannot (or until `flush`).
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        self._stops = tuple(dict.fromkeys(s for s in stop if s))
        self._include = include_stop_str_in_output
        # Every proper prefix of every stop string: what may have to be held back.
        self._prefixes = {s[:k] for s in self._stops for k in range(1, len(s))}
        self._max_hold = max((len(s) - 1 for s in self._stops), default=0)
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the stream

    def push(self, delta: str) -> tuple[str, bool]:
        """Feed a delta; return (text to emit now, whether a stop string completed)."""
        if self.stopped:
            return "", True
        if not self._stops:
            return delta, False
        text = self._held + delta
        best: tuple[int, int, str] | None = None  # (end, -len, stop)
        for s in self._stops:
            i = text.find(s)
            if i >= 0:
                key = (i + len(s), -len(s), s)
                if best is None or key < best:
                    best = key
        if best is not None:
            end, neg_len, s = best
            self.stopped, self.matched, self._held = True, s, ""
            return text[: end if self._include else end + neg_len], True
        hold = 0
        for k in range(min(self._max_hold, len(text)), 0, -1):
            if text[-k:] in self._prefixes:
                hold = k
                break
        self._held = text[len(text) - hold :]
        return text[: len(text) - hold], False

    def flush(self) -> str:
        """At the end of generation: release the held-back text."""
        held, self._held = self._held, ""
        return "" if self.stopped else held
