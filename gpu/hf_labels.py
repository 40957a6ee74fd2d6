"""A sequence classifier's labels as its config.json gives them (no torch here: the HTTP
process reads them too, service/pooling.py).

Most classifiers carry a `score` head and name its rows in `id2label`.  A causal LM can
be served as one through vLLM's `hf_overrides` (`--hf-overrides`): `classifier_from_token`
names vocabulary tokens whose LM-head rows become the head (gpu/loader.py).  With two
tokens and `is_original_qwen3_reranker` (or `method: "from_2_way_softmax"`), as
Qwen3-Reranker is served, the head is one row, the second token's minus the first's:
its sigmoid is the second token's softmax probability against the first ("yes" vs "no").
"""

from __future__ import annotations

from typing import Any


def from_tokens(raw: dict[str, Any]) -> list[str]:
    """classifier_from_token's tokens ([] when the head is the checkpoint's own)."""
    tokens = raw.get("classifier_from_token")
    if tokens is None:
        return []
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"classifier_from_token must be a list of token strings, got {tokens!r}")
    if two_way(raw) and len(tokens) != 2:
        raise ValueError(
            f"a two-way classifier_from_token takes 2 tokens (false, true), got {len(tokens)}"
        )
    return tokens


def two_way(raw: dict[str, Any]) -> bool:
    return bool(raw.get("is_original_qwen3_reranker")) or raw.get("method") == "from_2_way_softmax"


def classifier_labels(raw: dict[str, Any]) -> list[str]:
    """The label names in head-row order: id2label's (transformers' LABEL_i where it has
    none, num_labels of them, 2 by default), or the tokens a head is built from."""
    tokens = from_tokens(raw)
    if tokens:
        return tokens[1:] if two_way(raw) else tokens
    id2label = raw.get("id2label")
    if isinstance(id2label, dict) and id2label:
        try:
            return [str(v) for _, v in sorted((int(k), v) for k, v in id2label.items())]
        except (TypeError, ValueError):
            raise ValueError(f"id2label's keys must be label indices, got {id2label!r}") from None
    n = raw.get("num_labels", 2)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"num_labels {n!r} is not a positive integer")
    return [f"LABEL_{i}" for i in range(n)]
