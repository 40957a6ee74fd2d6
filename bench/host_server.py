"""`pagestream serve` with a stand-in model, for the host benchmark (bench/host.py).

    python -m bench.host_server --step-ms 8 [--host-ms 0] [any `pagestream serve` flag]

Everything is the real server (HTTP, WebSocket, tokenizer, detokenizer, scheduler, engine
loop, metrics) except the model: `HostRunner` samples a fixed cycle of word tokens for
every row after `--step-ms` of sleep (0: at once), the time a device would take for the
step.  Sleeping releases the GIL, as a GPU step does, so what the host does meanwhile
overlaps it exactly as it would; what the host does between steps shows as the step
period above `--step-ms`.  `--host-ms` adds that much pure-Python work to every step on
the engine's side (a step hook holding the GIL, as scheduling, update and grammar work
do), to show what host work on the engine does to HTTP
(tests/service/test_engine_thread_http.py).  Bench-only: the product has no such flags.
With `--engine-process` the same stand-in engine is built in the engine's process.
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from scheduler.config import EngineConfig
from scheduler.contract import ModelOutput, SchedulerOutput
from scheduler.executor import ThreadExecutor

WORDS = " the quick brown fox jumps over a lazy dog while streams keep flowing"


class HostRunner:
    """Answers every step with the next word of WORDS for each sampling row."""

    def __init__(self, tokens: list[int], vocab_size: int, step_s: float, max_model_len: int):
        self.tokens = tokens
        self.step_s = step_s
        self.config = SimpleNamespace(vocab_size=vocab_size)
        self.device = torch.device("cpu")
        self.eos_token_ids: tuple[int, ...] = ()
        self.max_model_len = max_model_len
        self.num_kv_blocks = 1 << 16
        self.steps = 0

    def execute_model(self, so: SchedulerOutput) -> ModelOutput:
        if self.step_s:
            time.sleep(self.step_s)
        ids = list(so.decodes.req_ids)  # the columnar decodes sample first, in order
        for r in so.scheduled:
            if r.sample:
                ids.append(r.req_id)
                ids += r.fork_ids
        self.steps += 1
        toks, n = self.tokens, len(self.tokens)
        base = self.steps
        return ModelOutput(
            req_ids=ids, sampled_token_ids=[toks[(base + i) % n] for i in range(len(ids))]
        )


def _take(argv: list[str], flag: str) -> float:
    """Remove `flag VALUE` from argv; its value (0 when absent)."""
    if flag not in argv:
        return 0.0
    i = argv.index(flag)
    value = float(argv[i + 1])
    del argv[i : i + 2]
    return value


def _busy(seconds: float) -> None:
    """Pure-Python work for `seconds`: holds the GIL as host work does (the interpreter
    still hands it to other threads every switch interval)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def build_engine(model_dir: str, step_ms: float, host_ms: float, config: EngineConfig):
    """The real engine around HostRunner (in the server's process, or in the engine's
    own with --engine-process: then this runs there, see service/engine_proc.py)."""
    from service.async_engine import AsyncEngine
    from service.tokenizer import Tokenizer

    # The real checkpoint's tokenizer (and its vocabulary), never its weights.
    tok = Tokenizer.from_dir(Path(model_dir))
    runner = HostRunner(tok.encode(WORDS, add_special_tokens=False), tok.vocab_size,
                        step_ms / 1e3, 4096)  # fmt: skip
    engine = AsyncEngine._assemble(config, ThreadExecutor(runner), Path(model_dir), None)
    if host_ms:
        engine.add_step_hook(lambda info: _busy(host_ms / 1e3))
    return engine


def main(argv: list[str]) -> int:
    from service.async_engine import AsyncEngine
    from service.cli import build_parser, server_config
    from service.engine_setup import ensure_default_model

    step_ms = _take(argv, "--step-ms")
    host_ms = _take(argv, "--host-ms")
    a = build_parser().parse_args(["serve", *argv])
    config = server_config(a)
    model_dir = str(Path(a.model) if a.model else ensure_default_model())
    # By its module's name, not __main__'s: the engine's process unpickles it.
    from bench.host_server import build_engine as named

    build = functools.partial(named, model_dir, step_ms, host_ms)
    if config.engine.device.engine_process:
        engine = AsyncEngine.in_process(config.engine, build)
    else:
        engine = build(config.engine)
    from service.app import run_server

    return run_server(config, engine)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
