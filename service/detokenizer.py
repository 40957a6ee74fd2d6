"""Incremental detokenization and stop strings, one instance per output stream.

The server turns sampled token ids into text deltas as they arrive.  Two rules keep the
deltas honest: a character whose UTF-8 bytes are split over several byte-level tokens is
held back until it is complete, and text that might be the start of a stop string is held
back until it is known not to be one, so a client never sees part of a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
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
        if len(token_ids) == 1:  # a decode step's one token: most calls
            i = token_ids[0]
            self._output_ids.append(i)
            text = self._stream.step(self._tok, i)
            if text:
                self._emitted.append(text)
                return text
            return ""
        # One id at a time: a batch of ids (speculative decoding) that ends inside a
        # character would otherwise hold back the complete characters before it too.
        self._output_ids += token_ids
        stream, tok = self._stream, self._tok
        text = "".join([t for i in token_ids if (t := stream.step(tok, i))])
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


class _StopAutomaton:
    """Aho-Corasick over the stop strings.  A state is the longest suffix of the text so
    far that is a prefix of some stop string, so its depth is exactly how much text must
    be held back; memory is one trie node per character of the stop strings (linear in
    their total length, unlike a set of every prefix, which is quadratic)."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.goto: list[dict[str, int]] = [{}]
        self.depth = [0]
        self.fail = [0]
        self.match: list[int] = [-1]  # the longest stop ending at this state (index), or -1
        for k, s in enumerate(stops):
            node = 0
            for ch in s:
                nxt = self.goto[node].get(ch)
                if nxt is None:
                    nxt = len(self.goto)
                    self.goto[node][ch] = nxt
                    self.goto.append({})
                    self.depth.append(self.depth[node] + 1)
                    self.fail.append(0)
                    self.match.append(-1)
                node = nxt
            self.match[node] = k
        # Breadth first: a node's failure link is shallower, so it is final before use.
        queue = list(self.goto[0].values())
        for node in queue:
            for ch, child in self.goto[node].items():
                f = self.fail[node]
                while f and ch not in self.goto[f]:
                    f = self.fail[f]
                self.fail[child] = self.goto[f].get(ch, 0) if self.goto[f].get(ch) != child else 0
                if self.match[child] < 0:
                    self.match[child] = self.match[self.fail[child]]
                queue.append(child)

    def step(self, state: int, ch: str) -> int:
        goto = self.goto
        while state and ch not in goto[state]:
            state = self.fail[state]
        return goto[state].get(ch, 0)


@lru_cache(maxsize=64)
def _automaton(stops: tuple[str, ...]) -> _StopAutomaton:
    # Shared by the n samples of a request (and by requests with the same stops): the
    # automaton is read-only once built; each checker keeps only its state and held text.
    return _StopAutomaton(stops)


class StopChecker:
    """Stop strings over a stream of text deltas.

    A stop string ends the stream at the point where it completes; when two complete at
    the same point the longer wins.  Text that could still become the start of a stop string
    is held back until it cannot (or until `flush`).
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        self._stops = tuple(dict.fromkeys(s for s in stop if s))
        self._include = include_stop_str_in_output
        self._ac = _automaton(self._stops)
        self._state = 0
        self._held = ""  # always the last depth(state) characters of the text
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the stream

    def push(self, delta: str) -> tuple[str, bool]:
        """Feed a delta; return (text to emit now, whether a stop string completed)."""
        if self.stopped:
            return "", True
        if not self._stops:
            return delta, False
        text = self._held + delta
        base = len(self._held)
        ac, state = self._ac, self._state
        for j, ch in enumerate(delta):
            state = ac.step(state, ch)
            k = ac.match[state]
            if k >= 0:
                s = self._stops[k]
                end = base + j + 1
                self.stopped, self.matched, self._held = True, s, ""
                return text[: end if self._include else end - len(s)], True
        self._state = state
        hold = ac.depth[state]
        self._held = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold], False

    def flush(self) -> str:
        """At the end of generation: release the held-back text."""
        held, self._held = self._held, ""
        return "" if self.stopped else held
