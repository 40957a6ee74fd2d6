"""Embeddings from the served model: what /v1/embeddings, /v1/score, /rerank and
`LLM.embed` do with the vector the runner returns (SamplingParams.embed), and what
/classify and the cross-encoder /score and /rerank do with a sequence classifier's.

The runner pools the final (normed) hidden states of each prompt as the request says
(SamplingParams.pooling, gpu/pooling.py).  The last position's state is what decoder
embedding models (Qwen3-Embedding, gte-Qwen2, e5-mistral) are trained for and the
default.  A sentence-transformers checkpoint names its own pipeline in modules.json: its
Pooling module's modes (mean, CLS, max, ...; several are concatenated), then Dense
projections and Normalize.  This module reads that pipeline (or vLLM's --pooler-config),
runs the Dense layers on the pooled vectors, then cuts (Matryoshka dimensions from
config.json) and normalizes them.

A sequence classifier (`*ForSequenceClassification`: the base model and a `score` head)
runs the same pass with the last token's state; the runner applies the head, so its
vector is the label logits, turned into probabilities here (softmax; a one-label head, a
cross-encoder reranker's relevance, by sigmoid, as transformers' and vLLM's defaults do).
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from gpu.hf_labels import classifier_labels
from scheduler.sampling_params import SamplingParams
from service.protocol import BadRequest

log = logging.getLogger(__name__)

# sentence-transformers' pooling modes: 1_Pooling/config.json's `pooling_mode` names
# (one, or a list concatenated in its order), and the older files' switches (concatenated
# in this order).
_ST_NAMES = {
    "cls": "cls",
    "max": "max",
    "mean": "mean",
    "mean_sqrt_len_tokens": "mean_sqrt_len",
    "weightedmean": "weightedmean",
    "lasttoken": "last",
}
_ST_SWITCHES = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "last",
}
# vLLM's --pooler-config pooling_type names this server runs.
POOLING_TYPES = {"LAST": "last", "MEAN": "mean", "CLS": "cls"}
_POOLER_KEYS = ("pooling_type", "normalize")
# A Dense module's activation_function, as sentence-transformers saves it.
_ACTIVATIONS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "torch.nn.modules.linear.Identity": lambda x: x,
    "torch.nn.modules.activation.Tanh": np.tanh,
    "torch.nn.modules.activation.ReLU": lambda x: np.maximum(x, 0.0),
    "torch.nn.modules.activation.Sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)),
}
# Modules after the pooling that change nothing this server computes: Normalize is what
# `normalize` (on by default) does.
_PASSIVE_MODULES = ("Normalize",)


def check_pooler_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """vLLM's --pooler-config: {"pooling_type": "LAST" | "MEAN" | "CLS", "normalize":
    bool}.  ValueError naming what is wrong."""
    for key, value in cfg.items():
        if key not in _POOLER_KEYS:
            raise ValueError(
                f"--pooler-config: {key!r} is not supported (this server reads "
                f"{', '.join(_POOLER_KEYS)})"
            )
        if key == "pooling_type" and str(value).upper() not in POOLING_TYPES:
            raise ValueError(
                f"--pooler-config: pooling_type must be one of {', '.join(POOLING_TYPES)}, "
                f"got {value!r}"
            )
        if key == "normalize" and not isinstance(value, bool):
            raise ValueError(f"--pooler-config: normalize must be true or false, got {value!r}")
    return cfg


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _pooling_modes(conf: Any, where: str) -> tuple[str, ...]:
    """A Pooling module's modes (SamplingParams.pooling), in concatenation order."""
    conf = conf if isinstance(conf, dict) else {}
    named = conf.get("pooling_mode")
    if named is not None:
        names = [named] if isinstance(named, str) else named
        bad = [n for n in names if n not in _ST_NAMES] if isinstance(names, list) else [named]
        if bad or not names or len(set(names)) != len(names):
            raise ValueError(f"{where}/config.json: pooling_mode {named!r} is not supported")
        return tuple(_ST_NAMES[n] for n in names)
    modes = tuple(mode for key, mode in _ST_SWITCHES.items() if conf.get(key))
    if not modes:
        raise ValueError(f"{where}/config.json names no pooling mode")
    return modes


class Dense:
    """A sentence-transformers Dense module: activation(x @ W.T + b)."""

    def __init__(self, where: Path) -> None:
        conf = _read_json(where / "config.json")
        if not isinstance(conf, dict):
            raise ValueError(f"{where.name}/config.json is missing or not JSON")
        act = str(conf.get("activation_function", "torch.nn.modules.activation.Tanh"))
        if act not in _ACTIVATIONS:
            raise ValueError(f"{where.name}: activation {act} is not supported")
        self.activation = _ACTIVATIONS[act]
        weights = where / "model.safetensors"
        if not weights.is_file():
            raise ValueError(f"{where.name} has no model.safetensors (save it with safetensors)")
        from safetensors.numpy import load_file

        tensors = load_file(str(weights))
        w = tensors.get("linear.weight")
        n_in, n_out = conf.get("in_features"), conf.get("out_features")
        if w is None or w.shape != (n_out, n_in):
            shape = None if w is None else tuple(w.shape)
            raise ValueError(
                f"{where.name}: linear.weight is {shape}, config says ({n_out}, {n_in})"
            )
        self.weight = w.astype(np.float32).T  # [in, out]
        b = tensors.get("linear.bias")
        if conf.get("bias", True) and (b is None or b.shape != (n_out,)):
            raise ValueError(f"{where.name}: linear.bias is missing or not ({n_out},)")
        self.bias = b.astype(np.float32) if b is not None and conf.get("bias", True) else None
        self.in_features, self.out_features = int(n_in), int(n_out)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        y = x @ self.weight
        if self.bias is not None:
            y += self.bias
        return self.activation(y)


class Pooler:
    """One model's embedding rules, read once from its directory (and --pooler-config)."""

    def __init__(self, model_dir: Path | None, override: dict[str, Any] | None = None) -> None:
        cfg = _read_json(model_dir / "config.json") if model_dir else None
        cfg = cfg if isinstance(cfg, dict) else {}
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
        override = override or {}
        self.normalize: bool = override.get("normalize", True)  # a request's default
        self.modes: tuple[str, ...] = ("last",)
        self.dense: list[Dense] = []
        # Why this model's embeddings cannot be served, if they cannot.
        self.unsupported: str | None = None
        if not self.classifier and model_dir is not None:
            try:
                self._read_pipeline(model_dir)
            except ValueError as e:
                self.unsupported = str(e)
                log.warning("embeddings are off for this model: %s", e)
        if not self.classifier and "pooling_type" in override:
            self.modes = (POOLING_TYPES[str(override["pooling_type"]).upper()],)
        hidden = cfg.get("hidden_size")
        # The pooled vector's size: the modes' states side by side, or the last Dense's.
        self.hidden_size: int | None = (
            self.dense[-1].out_features
            if self.dense
            else hidden * len(self.modes)
            if isinstance(hidden, int)
            else None
        )
        # An embedding request: one greedy token, which nobody reads, and the pooled
        # vector (SamplingParams.embed).
        self.params = SamplingParams(
            max_tokens=1, temperature=0.0, ignore_eos=True, embed=True, pooling=self.modes
        )

    def _read_pipeline(self, model_dir: Path) -> None:
        """A sentence-transformers checkpoint's modules after its Transformer: the
        Pooling's modes, Dense projections, Normalize.  Anything else, or a Dense this
        server cannot run, raises ValueError: served as last-token vectors it would give
        wrong embeddings, so it is refused instead."""
        modules = _read_json(model_dir / "modules.json")
        for m in modules if isinstance(modules, list) else ():
            if not isinstance(m, dict):
                raise ValueError(f"modules.json: an entry is not an object: {m!r:.80}")
            kind = str(m.get("type", "")).rsplit(".", 1)[-1]
            where = model_dir / str(m.get("path", ""))
            if kind == "Transformer" or kind in _PASSIVE_MODULES:
                continue
            if kind == "Pooling":
                self.modes = _pooling_modes(_read_json(where / "config.json"), where.name)
            elif kind == "Dense":
                self.dense.append(Dense(where))
            else:
                raise ValueError(
                    f"modules.json: the sentence-transformers module {m.get('type')} is not "
                    "supported (Transformer, Pooling, Dense and Normalize are)"
                )

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

    def finish(
        self, vectors: list[list[float]], normalize: bool | None, dimensions: int | None
    ) -> np.ndarray:
        """[N, H] float32: the checkpoint's Dense projections, then cut to `dimensions`
        (Matryoshka), then L2-normalized (`normalize` None: the model's default)."""
        x = np.asarray(vectors, dtype=np.float32)
        for dense in self.dense:
            x = dense(x)
        if normalize is None:
            normalize = self.normalize
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
