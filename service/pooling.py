"""Embeddings from the served model: what /v1/embeddings, /v1/score, /rerank and
`LLM.embed` do with the vector the runner returns (SamplingParams.embed), and what
/classify and the cross-encoder /score and /rerank do with a sequence classifier's.

The runner hands back the final (normed) hidden state of each prompt's last position:
last-token pooling, what decoder embedding models (Qwen3-Embedding, gte-Qwen2, e5-mistral)
are trained for and what vLLM runs them with.  This module reads the checkpoint's own
word on pooling (sentence-transformers' modules.json / 1_Pooling) and Matryoshka
dimensions (config.json), then normalizes and cuts the vectors.

A sequence classifier (`*ForSequenceClassification`: the base model and a `score` head)
runs the same pass; the runner applies the head, so its vector is the label logits,
turned into probabilities here (softmax; a one-label head, a cross-encoder reranker's
relevance, by sigmoid, as transformers' and vLLM's defaults do).
"""

from __future__ import annotations

import base64
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from gpu.hf_labels import classifier_labels
from scheduler.sampling_params import SamplingParams
from service.protocol import BadRequest

log = logging.getLogger(__name__)

# An embedding request: one greedy token, which nobody reads (SamplingParams.embed).
EMBED_PARAMS = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, embed=True)

# 1_Pooling/config.json's keys for the poolings a runner that returns one position's
# state cannot give.
_OTHER_POOLINGS = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_weightedmean_tokens": "weightedmean",
}


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class Pooler:
    """One model's embedding rules, read once from its directory."""

    def __init__(self, model_dir: Path | None) -> None:
        cfg = _read_json(model_dir / "config.json") if model_dir else None
        cfg = cfg if isinstance(cfg, dict) else {}
        self.hidden_size: int | None = cfg.get("hidden_size")
        dims = cfg.get("matryoshka_dimensions")
        # vLLM's reading: `matryoshka_dimensions` lists the sizes the model was trained to
        # be cut to; `is_matryoshka` alone allows any size.
        self.matryoshka: list[int] | None = list(dims) if isinstance(dims, list) else None
        self.any_dimensions = bool(cfg.get("is_matryoshka")) and self.matryoshka is None
        archs = cfg.get("architectures")
        arch = str(archs[0]) if isinstance(archs, list) and archs else ""
        self.classifier = arch.endswith("ForSequenceClassification")
        # A classifier's label names in id order (transformers' LABEL_i where unnamed);
        # the engine loaded this config, so it has them.
        self.labels: list[str] = classifier_labels(cfg) if self.classifier else []
        # Why this model cannot be served by last-token pooling, if it cannot.
        self.unsupported: str | None = self._pooling_refusal(model_dir)
        if self.unsupported:
            log.warning("embeddings are off for this model: %s", self.unsupported)

    @staticmethod
    def _pooling_refusal(model_dir: Path | None) -> str | None:
        """A sentence-transformers checkpoint names its pooling; one other than the last
        token's would get wrong vectors, so it is refused rather than served."""
        if model_dir is None:
            return None
        modules = _read_json(model_dir / "modules.json")
        for m in modules if isinstance(modules, list) else ():
            if not isinstance(m, dict) or not str(m.get("type", "")).endswith("Pooling"):
                continue
            conf = _read_json(model_dir / str(m.get("path", "")) / "config.json")
            if not isinstance(conf, dict) or conf.get("pooling_mode_lasttoken"):
                return None
            other = [name for key, name in _OTHER_POOLINGS.items() if conf.get(key)]
            if other:
                return (
                    f"the checkpoint pools by {', '.join(other)} ({m.get('path')}/config.json); "
                    "this server pools the last token"
                )
        return None

    def check_classifier(self, cross_encoder: bool = False) -> None:
        """A 400 before any work unless this model is a sequence classifier (one with a
        single label for `cross_encoder`)."""
        if not self.classifier:
            raise BadRequest(
                "this model is not a sequence classifier (its config.json names no "
                "*ForSequenceClassification architecture): /classify needs one",
                "model",
            )
        if cross_encoder and len(self.labels) != 1:
            raise BadRequest(
                f"this classifier has {len(self.labels)} labels; scoring text pairs needs a "
                "cross-encoder, a classifier with one",
                "model",
            )

    @staticmethod
    def probabilities(logits: list[list[float]], activation: bool = True) -> np.ndarray:
        """[N, labels] float32: softmax over the labels, sigmoid for a single label, or
        the logits as they are without `activation`."""
        x = np.asarray(logits, dtype=np.float32)
        if not activation:
            return x
        if x.shape[1] == 1:
            return 1.0 / (1.0 + np.exp(-x))  # type: ignore[no-any-return]
        e = np.exp(x - x.max(axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True)  # type: ignore[no-any-return]

    def check(self, dimensions: int | None) -> None:
        """A 400 before any work for a model or `dimensions` this server cannot serve."""
        if self.classifier:
            raise BadRequest(
                "this model is a sequence classifier: it serves /classify, and /score and "
                "/rerank as a cross-encoder, not embeddings",
                "model",
            )
        if self.unsupported:
            raise BadRequest(f"this model cannot serve embeddings: {self.unsupported}", "model")
        if dimensions is None:
            return
        if self.matryoshka is not None:
            if dimensions not in self.matryoshka:
                raise BadRequest(
                    f"dimensions must be one of the model's Matryoshka dimensions "
                    f"{self.matryoshka}, got {dimensions}",
                    "dimensions",
                )
            return
        if not self.any_dimensions:
            raise BadRequest(
                "this model does not support Matryoshka representations (its config.json "
                "sets neither is_matryoshka nor matryoshka_dimensions): changing the output "
                "dimensions would give poor embeddings",
                "dimensions",
            )
        if self.hidden_size is not None and dimensions > self.hidden_size:
            raise BadRequest(
                f"dimensions ({dimensions}) is more than the model's {self.hidden_size}",
                "dimensions",
            )

    @staticmethod
    def finish(vectors: list[list[float]], normalize: bool, dimensions: int | None) -> np.ndarray:
        """[N, H] float32: cut to `dimensions` first (Matryoshka), then L2-normalized."""
        x = np.asarray(vectors, dtype=np.float32)
        if dimensions is not None:
            x = x[:, :dimensions]
        if normalize:
            norms = np.linalg.norm(x, axis=1, keepdims=True)
            x = x / np.maximum(norms, 1e-12)
        return x


def encode_vectors(x: np.ndarray, encoding_format: str) -> list[Any]:
    """Each row as OpenAI's `embedding` value: a list of floats, or base64 of its
    little-endian float32 bytes (what the openai SDK asks for and decodes)."""
    if encoding_format == "base64":
        le = x.astype("<f4", copy=False)
        return [base64.b64encode(row.tobytes()).decode("ascii") for row in le]
    return x.tolist()  # type: ignore[no-any-return]


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity of two [N, H] arrays (vLLM's score for embedding
    models)."""
    na = np.maximum(np.linalg.norm(a, axis=1), 1e-12)
    nb = np.maximum(np.linalg.norm(b, axis=1), 1e-12)
    return (a * b).sum(axis=1) / (na * nb)  # type: ignore[no-any-return]
