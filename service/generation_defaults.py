"""Sampling defaults from the model's `generation_config.json`, as vLLM applies them
(`--generation-config auto`, its default): a model's creator recommends its sampling
(Qwen3: temperature 0.6, top_p 0.95, top_k 20), and a request that leaves a field out
gets the recommendation, not the API's neutral default.  `max_new_tokens` there caps
every request's output.  `--generation-config vllm` ignores the file (the API's
defaults), a directory reads that directory's file instead, and
`--override-generation-config '{"temperature": 0.5}'` sets fields over either.

Only these keys are read, as vLLM reads them; `do_sample` is not (a config that sets
temperature expects it used).  A value a request could not carry is refused at start.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scheduler.config import ConfigError
from scheduler.sampling_params import SamplingParams

FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
_KEYS = (*FIELDS, "max_new_tokens")
_MAX_BYTES = 1 << 20  # a generation_config.json is a few hundred bytes


@dataclass(frozen=True)
class GenerationDefaults:
    """What a request that leaves a field out gets (`values`), and the cap on its output
    (`max_tokens`, the config's `max_new_tokens`); empty: the API's own defaults."""

    values: dict[str, float | int] = field(default_factory=dict)
    max_tokens: int | None = None

    @classmethod
    def load(
        cls, mode: str, model_dir: str | Path, override: dict[str, Any] | None = None
    ) -> GenerationDefaults:
        """`mode`: "auto" (the model's file), "vllm" (none), or a directory holding a
        generation_config.json.  ConfigError names the flag and the field it refuses."""
        raw: dict[str, Any] = {}
        if mode != "vllm":
            where = Path(model_dir) if mode == "auto" else Path(mode)
            path = where / "generation_config.json"
            if mode != "auto" and not path.is_file():
                raise ConfigError(f"--generation-config: no generation_config.json in {where}")
            raw = {k: v for k, v in _read(path).items() if k in _KEYS}
        for k, v in (override or {}).items():
            if k not in _KEYS:
                raise ConfigError(
                    f"--override-generation-config: {k!r} is not one of {', '.join(_KEYS)}"
                )
            raw[k] = v
        cap = raw.pop("max_new_tokens", None)
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise ConfigError(f"generation config: max_new_tokens must be a positive int: {cap!r}")
        values = {k: v for k, v in raw.items() if v is not None}
        for k, v in values.items():
            bad = isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v)
            if k == "top_k" and not isinstance(v, int):
                bad = True
            try:
                if not bad:
                    SamplingParams(**{k: v})
            except ValueError:
                bad = True
            if bad:
                raise ConfigError(f"generation config: {k} = {v!r} is not a valid value")
        return cls(values, cap)

    def __bool__(self) -> bool:
        return bool(self.values) or self.max_tokens is not None

    def pick(self, name: str, given: Any) -> Any:
        """The request's value, else the model's recommendation, else the API's default
        (SamplingParams')."""
        if given is not None:
            return given
        return self.values.get(name, getattr(_API, name))

    def cap(self, max_tokens: int | None) -> int | None:
        if self.max_tokens is None:
            return max_tokens
        return self.max_tokens if max_tokens is None else min(max_tokens, self.max_tokens)

    def describe(self) -> str:
        parts = [f"{k}={v}" for k, v in self.values.items()]
        if self.max_tokens is not None:
            parts.append(f"max_tokens<={self.max_tokens}")
        return ", ".join(parts)


NONE = GenerationDefaults()
_API = SamplingParams()


def _read(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            data = f.read(_MAX_BYTES + 1)
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise ConfigError(f"generation config: cannot read {path}: {e}") from e
    if len(data) > _MAX_BYTES:
        raise ConfigError(f"generation config: {path} is over {_MAX_BYTES} bytes")
    try:
        obj = json.loads(data)
    except ValueError as e:
        raise ConfigError(f"generation config: {path} is not JSON: {e}") from e
    if not isinstance(obj, dict):
        raise ConfigError(f"generation config: {path} is not a JSON object")
    return obj
