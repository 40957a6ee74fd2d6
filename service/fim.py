"""Fill in the middle: a completion's `suffix` (OpenAI's insertion), for code models whose
tokenizer holds fill-in-the-middle tokens.

The prompt is the text before the hole and `suffix` the text after it; the model writes
the middle.  Each family lays the three parts out with its own special tokens, as its model
card and reference code do (tokenizing "<|fim_prefix|>" + prefix + "<|fim_suffix|>" + suffix +
"<|fim_middle|>" with the special tokens read as such).  The family is told by which
tokens the vocabulary holds; a tokenizer with none of them serves no `suffix` (a 400).
"""

from __future__ import annotations

from dataclasses import dataclass

from service.tokenizer import Tokenizer


@dataclass(frozen=True)
class FimFormat:
    """Where the parts go: `first` + (prefix | suffix) + `second` + (the other) + `last`;
    `suffix_first` for the suffix-prefix-middle order (Codestral's)."""

    family: str
    first: str
    second: str
    last: str | None = None
    suffix_first: bool = False


FORMATS = (
    # Qwen2.5-Coder, Qwen3-Coder, CodeGemma's names with bars
    FimFormat("qwen", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    # StarCoder, StarCoder2, Granite Code, SantaCoder
    FimFormat("starcoder", "<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    # DeepSeek-Coder
    FimFormat("deepseek", "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
    # Codestral: [SUFFIX] suffix [PREFIX] prefix, the middle follows
    FimFormat("codestral", "[SUFFIX]", "[PREFIX]", None, suffix_first=True),
)


@dataclass(frozen=True)
class FimLayout:
    """A format resolved to this tokenizer's ids."""

    format: FimFormat
    first: int
    second: int
    last: int | None
    bos: int | None  # what an encoded prompt starts with on this tokenizer

    def ids(self, prefix: list[int], suffix: list[int]) -> list[int]:
        a, b = (suffix, prefix) if self.format.suffix_first else (prefix, suffix)
        out = [self.bos] if self.bos is not None else []
        out += [self.first, *a, self.second, *b]
        if self.last is not None:
            out.append(self.last)
        return out


def fim_layout(tok: Tokenizer) -> FimLayout | None:
    """The first format whose tokens this tokenizer holds, or None."""
    backend = tok.backend
    for f in FORMATS:
        ids = [
            backend.token_to_id(t) if t is not None else None for t in (f.first, f.second, f.last)
        ]
        if ids[0] is not None and ids[1] is not None and (f.last is None or ids[2] is not None):
            return FimLayout(f, ids[0], ids[1], ids[2], tok.leading_bos)
    return None
