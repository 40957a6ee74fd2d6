"""Part 3: decode tokens/s of a random Llama-shaped model through the model runner."""

from __future__ import annotations

import gc
import inspect
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest.mock import patch

from bench.gpu_check.common import Report, Row, Sizes, fmt_pct, guarded

BLOCK_SIZE = 16  # the runner's KV block size here


def write_checkpoint(out_dir: Path, s: Sizes, device: Any) -> tuple[Path, int]:
    """A random-weight Llama checkpoint (config.json + model.safetensors); returns
    (dir, weight bytes).  No tokenizer: the runner does not need one."""
    import torch
    from safetensors.torch import save_file

    overrides = dict(s.model)
    try:
        from modelkit.make_model import build_config, state_dict_shapes

        cfg = build_config(
            "mid",
            "llama",
            vocab_size=overrides["vocab_size"],
            dtype="bfloat16",
            init_std=0.02,
            overrides=overrides,
        )
        shapes = state_dict_shapes(cfg)
    except ImportError:  # written by hand when the generator is missing
        cfg, shapes = _llama_config_and_shapes(overrides)
    gen = torch.Generator(device=device).manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, device=device, generator=gen)
        else:
            t = 0.02 * torch.randn(shape, device=device, generator=gen)
        tensors[name] = t.to(torch.bfloat16).cpu().contiguous()
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(tensors, str(out_dir / "model.safetensors"), {"format": "pt"})
    return out_dir, nbytes


def _llama_config_and_shapes(o: dict[str, Any]) -> tuple[dict[str, Any], dict[str, tuple]]:
    h, inter, heads = o["hidden_size"], o["intermediate_size"], o["num_attention_heads"]
    kvh, d, v = o["num_key_value_heads"], o["head_dim"], o["vocab_size"]
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "torch_dtype": "bfloat16",
        "initializer_range": 0.02,
        "bos_token_id": 0,
        "eos_token_id": 1,
        **o,
    }
    shapes: dict[str, tuple] = {"model.embed_tokens.weight": (v, h)}
    for i in range(o["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes |= {
            f"{p}.self_attn.q_proj.weight": (heads * d, h),
            f"{p}.self_attn.k_proj.weight": (kvh * d, h),
            f"{p}.self_attn.v_proj.weight": (kvh * d, h),
            f"{p}.self_attn.o_proj.weight": (h, heads * d),
            f"{p}.mlp.gate_proj.weight": (inter, h),
            f"{p}.mlp.up_proj.weight": (inter, h),
            f"{p}.mlp.down_proj.weight": (h, inter),
            f"{p}.input_layernorm.weight": (h,),
            f"{p}.post_attention_layernorm.weight": (h,),
        }
    shapes["model.norm.weight"] = (h,)
    if not o.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (v, h)
    return cfg, shapes


@dataclass
class _Batch:
    """The requests of one decode measurement: ids, prompts and their (scattered) blocks."""

    ids: list[str]
    prompts: dict[str, list[int]]
    tables: dict[str, list[int]]
    block_size: int
    step: int = 0
    last: dict[str, int] = field(default_factory=dict)

    def table(self, rid: str, upto: int) -> list[int]:  # blocks covering positions [0, upto)
        return self.tables[rid][: -(-upto // self.block_size)]


def _make_batch(runner: Any, s: Sizes, batch: int, vocab: int, tag: str) -> _Batch:
    import random

    bs = runner.block_size
    total = s.e2e_prompt + s.e2e_warmup + s.e2e_steps + 1
    blocks_each = -(-total // bs)
    free = list(range(runner.num_kv_blocks))
    random.Random(batch).shuffle(free)  # scattered blocks, as after some serving
    rng = random.Random(1)
    ids = [f"{tag}-b{batch}-{i}" for i in range(batch)]
    tables = {rid: [free.pop() for _ in range(blocks_each)] for rid in ids}
    prompts = {rid: [rng.randrange(vocab) for _ in range(s.e2e_prompt)] for rid in ids}
    return _Batch(ids, prompts, tables, bs)


def _prefill(runner: Any, b: _Batch, prompt_len: int) -> list[float]:
    """Prefill in chunks of up to 16 prompts, like a token budget would; returns each
    step's wall seconds (a step ends with its sampled tokens on the host)."""
    from scheduler.contract import NewRequestData, ScheduledRequest, SchedulerOutput
    from scheduler.sampling_params import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=None)
    secs = []
    for i in range(0, len(b.ids), 16):
        group = b.ids[i : i + 16]
        new = [
            NewRequestData(req_id=r, prompt_len=prompt_len, token_ids=b.prompts[r], sampling=greedy)
            for r in group
        ]
        scheduled = [
            ScheduledRequest(
                req_id=r,
                input_ids=b.prompts[r],
                start_pos=0,
                new_block_ids=b.table(r, prompt_len),
                sample=True,
            )
            for r in group
        ]
        t0 = time.perf_counter()
        out = runner.execute_model(
            SchedulerOutput(step=b.step, new_requests=new, scheduled=scheduled, finished_req_ids=[])
        )
        secs.append(time.perf_counter() - t0)
        b.last.update(zip(out.req_ids, out.sampled_token_ids))
        b.step += 1
    return secs


def _decodes(b: _Batch, pos: int) -> list[Any]:
    """Every request's decode row at `pos`."""
    from scheduler.contract import ScheduledRequest

    return [
        ScheduledRequest(
            req_id=r,
            input_ids=[b.last[r]],
            start_pos=pos,
            new_block_ids=b.table(r, pos + 1),
            sample=True,
        )
        for r in b.ids
    ]


def _decode_step(runner: Any, b: _Batch, pos: int) -> float:
    """One decode step of every request at `pos`; returns its wall seconds."""
    from scheduler.contract import SchedulerOutput

    scheduled = _decodes(b, pos)
    so = SchedulerOutput(step=b.step, new_requests=[], scheduled=scheduled, finished_req_ids=[])
    t0 = time.perf_counter()
    out = runner.execute_model(so)  # returns host ints: the step is complete
    secs = time.perf_counter() - t0
    b.last.update(zip(out.req_ids, out.sampled_token_ids))
    b.step += 1
    return secs


def decode_tokens_per_s(
    runner: Any, s: Sizes, batch: int, vocab: int, tag: str
) -> dict[str, float]:
    """Prefill `batch` prompts, then time decode steps; returns tokens/s and context."""
    from scheduler.contract import SchedulerOutput

    b = _make_batch(runner, s, batch, vocab, tag)
    prefill = _prefill(runner, b, s.e2e_prompt)
    pos = s.e2e_prompt
    elapsed = 0.0
    for k in range(s.e2e_warmup + s.e2e_steps):
        secs = _decode_step(runner, b, pos)
        if k >= s.e2e_warmup:
            elapsed += secs
        pos += 1
    runner.execute_model(
        SchedulerOutput(step=b.step, new_requests=[], scheduled=[], finished_req_ids=b.ids)
    )
    steps = s.e2e_steps
    return {
        "tok_s": batch * steps / elapsed,
        "ms_step": 1e3 * elapsed / steps,
        "avg_ctx": s.e2e_prompt + s.e2e_warmup + steps / 2,
        # The fastest of the full prefill steps (16 prompts each; the first may compile).
        "prefill_ms": 1e3 * min(prefill[: batch // 16] or prefill),
        "prefill_tokens": min(batch, 16) * s.e2e_prompt,
    }


def mixed_step_ms(runner: Any, s: Sizes, vocab: int, tag: str, decodes: int = 32) -> float:
    """The serving step: `decodes` running requests decode while a new prompt of
    e2e_prompt tokens is prefilled beside them; the median of 5 such steps, in ms."""
    import random

    from scheduler.contract import NewRequestData, ScheduledRequest, SchedulerOutput
    from scheduler.sampling_params import SamplingParams

    b = _make_batch(runner, s, decodes, vocab, tag)
    _prefill(runner, b, s.e2e_prompt)
    greedy = SamplingParams(temperature=0.0, max_tokens=None)
    rng = random.Random(2)
    n, pos, times = s.e2e_prompt, s.e2e_prompt, []
    finished: list[str] = []
    for k in range(6):
        rid = f"{tag}-chunk-{k}"
        prompt = [rng.randrange(vocab) for _ in range(n)]
        # Timing only: the new prompt borrows the first request's blocks (as many as it
        # needs), so the decodes' tokens after this are not meaningful.
        chunk = ScheduledRequest(
            req_id=rid,
            input_ids=prompt,
            start_pos=0,
            new_block_ids=b.table(b.ids[0], n),
            sample=True,
        )
        scheduled = [*_decodes(b, pos), chunk]
        so = SchedulerOutput(
            step=b.step,
            new_requests=[
                NewRequestData(req_id=rid, prompt_len=n, token_ids=prompt, sampling=greedy)
            ],
            scheduled=scheduled,
            finished_req_ids=finished,
        )
        t0 = time.perf_counter()
        out = runner.execute_model(so)
        times.append(time.perf_counter() - t0)
        b.last.update((r, t) for r, t in zip(out.req_ids, out.sampled_token_ids) if r in b.last)
        b.step, pos, finished = b.step + 1, pos + 1, [rid]
    runner.execute_model(
        SchedulerOutput(
            step=b.step, new_requests=[], scheduled=[], finished_req_ids=[*b.ids, *finished]
        )
    )
    times = sorted(times[1:])  # the first may compile
    return 1e3 * times[len(times) // 2]


@dataclass(frozen=True)
class _Model:
    """The checkpoint under test and what one decode step must read of it."""

    path: Path
    weight_bytes: int
    kv_per_token: int  # bytes of K+V per cached token, all layers, bf16
    vocab: int

    @property
    def billions(self) -> float:
        return self.weight_bytes / 2 / 1e9


def _runner_kwargs(
    params: Any, s: Sizes, device: Any, graphs: bool, num_blocks: int
) -> dict[str, Any]:
    """ModelRunner's arguments, passing the optional ones only where the runner has them."""
    kwargs: dict[str, Any] = dict(
        dtype="bfloat16",
        device=str(device),
        block_size=BLOCK_SIZE,
        num_kv_blocks=num_blocks,
        attention_backend="triton",
    )
    if "max_num_batched_tokens" in params:
        kwargs["max_num_batched_tokens"] = 16 * s.e2e_prompt
    if "cuda_graphs" in params:
        kwargs["cuda_graphs"] = graphs
    return kwargs


def _decode_rows(
    report: Report, runner: Any, s: Sizes, m: _Model, mode: str, copy_bw: float | None
) -> None:
    """One row per batch size: tokens/s against the roofline of reading weights + KV."""
    for b in s.e2e_batches:
        with guarded(report, "e2e", f"decode b{b} {mode}"):
            r = decode_tokens_per_s(runner, s, b, m.vocab, mode[:5])
            bytes_step = m.weight_bytes + b * r["avg_ctx"] * m.kv_per_token
            roof = b / (bytes_step / copy_bw) if copy_bw else 0.0
            report.add(
                Row(
                    "e2e",
                    f"decode b{b}, {mode}, {m.billions:.2f}B Llama bf16",
                    f"{r['ms_step']:.2f} ms/step",
                    f"{r['tok_s']:.0f} tok/s",
                    f"roofline {roof:.0f} tok/s" if roof else "",
                    fmt_pct(r["tok_s"] / roof) if roof else "",
                    f"weights {m.weight_bytes / 1e9:.2f} GB + KV at ctx "
                    f"~{r['avg_ctx']:.0f}, read once per step",
                )
            )
            if b != max(s.e2e_batches):
                continue
            decodes = min(b, 32)
            ms = mixed_step_ms(runner, s, m.vocab, f"mix{mode[:5]}", decodes)
            report.add(
                Row(
                    "e2e",
                    f"mixed step, {decodes} decodes + a {s.e2e_prompt}-token prompt, {mode}",
                    f"{ms:.2f} ms/step",
                    notes="the serving step while a prompt arrives; median of 5",
                )
            )
            # Prefill steps: eager, or the piecewise graphs where the decode graphs run.
            tokens, secs = r["prefill_tokens"], r["prefill_ms"] / 1e3
            report.add(
                Row(
                    "e2e",
                    f"prefill step, {min(b, 16)} x {s.e2e_prompt} tokens, {mode}",
                    f"{r['prefill_ms']:.2f} ms/step",
                    f"{2 * m.weight_bytes / 2 * tokens / secs / 1e12:.1f} TFLOP/s",
                    "",
                    "",
                    f"{tokens / secs:.0f} prompt tok/s; 2 x params FLOPs a token, "
                    "attention not counted",
                )
            )


def engine_step_ms(
    ckpt: Path, device: Any, batch: int, steps: int, *, graphs: bool, async_on: bool
) -> tuple[float, float | None]:
    """A decode step's period through the whole engine (scheduler, executor, sampling,
    outputs: `LLM`), `batch` rows: the time of batch x (8 + steps) tokens less that of
    batch x 8, over `steps` (prompt steps and start-up cancel out); and the bare decode
    graph's replay for that batch on CUDA (None elsewhere)."""
    import torch

    from scheduler.sampling_params import SamplingParams
    from service.llm import LLM

    per_req = -(-(4 + 8 + steps + 8) // BLOCK_SIZE)
    llm = LLM(
        str(ckpt), dtype="bfloat16" if device.type == "cuda" else "float32",
        device=str(device), block_size=BLOCK_SIZE,
        num_kv_blocks=per_req * batch + 16,
        attention_backend="triton" if device.type == "cuda" else "auto",
        cuda_graphs=graphs, async_scheduling=async_on, engine_thread=False,
        max_num_seqs=batch,  # graphs captured up to this batch only
    )  # fmt: skip
    try:
        prompts = [[5 + i % 97, 6, 7, 8] for i in range(batch)]

        def run(n: int) -> float:
            t0 = time.perf_counter()
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
            return time.perf_counter() - t0

        run(8)  # warm-up
        short, long = run(8), run(8 + steps)
        period = (long - short) / steps * 1e3
        replay = None
        dg = getattr(llm.engine.runner, "graphs", None)
        if dg is not None and device.type == "cuda" and batch in dg.graphs:
            g = dg.graphs[batch]
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            for _ in range(20):
                g.replay()
            torch.cuda.synchronize(device)
            replay = (time.perf_counter() - t0) / 20 * 1e3
        return period, replay
    finally:
        llm.shutdown()


def _engine_rows(report: Report, s: Sizes, device: Any) -> None:
    """Issue 47's GPU bar: a batch-64 decode step with async scheduling within 10% of its
    graph's replay; the synchronous engine beside it.  The served bench's 1B checkpoint
    (a tokenizer with it: the engine detokenizes), written once and cached."""
    from bench.gpu_serve import checkpoint

    b = max(s.e2e_batches)
    graphs = device.type == "cuda"
    shape = None
    with guarded(report, "e2e", "engine checkpoint"):
        shape = checkpoint("llama1b", str(device)) if graphs else checkpoint("tiny", "cpu")
    if shape is None:
        return
    for async_on in (True, False):
        mode = "async scheduling" if async_on else "synchronous"
        case = f"engine decode b{b}, {mode}, {'CUDA graphs' if graphs else 'eager'}"
        case += f", {shape.params / 1e9:.2f}B Llama"
        with guarded(report, "e2e", case):
            ms, replay = engine_step_ms(
                shape.path, device, b, max(s.e2e_steps, 2), graphs=graphs, async_on=async_on
            )
            report.add(
                Row(
                    "e2e",
                    case,
                    f"{ms:.2f} ms/step",
                    "",
                    f"graph replay {replay:.2f} ms" if replay else "",
                    fmt_pct(replay / ms) if replay else "",
                    "LLM.generate: scheduling, the step, logits, sampling, outputs; "
                    "the replay is the decode graph alone (issue 47 asks within 10%)",
                )
            )


def part_e2e(report: Report, device: Any, s: Sizes, copy_bw: float | None) -> None:
    try:
        from gpu.model_runner import ModelRunner
    except Exception as e:
        report.add(
            Row("e2e", "decode tokens/s", notes=f"skipped: model runner not importable ({e})")
        )
        return
    import torch

    params = set(inspect.signature(ModelRunner).parameters)
    try:  # a runner built from the engine's config takes its settings as keywords too
        from scheduler.config import FIELD_GROUP

        params |= set(FIELD_GROUP)
    except ImportError:
        pass
    tmp = Path(tempfile.mkdtemp(prefix="pagestream-gpucheck-"))
    try:
        t0 = time.perf_counter()
        ckpt, weight_bytes = write_checkpoint(tmp / "model", s, device)
        cfgd = dict(s.model)
        kv_per_token = 2 * cfgd["num_hidden_layers"] * cfgd["num_key_value_heads"]
        kv_per_token *= cfgd["head_dim"] * 2  # bytes, bf16
        m = _Model(ckpt, weight_bytes, kv_per_token, cfgd["vocab_size"])
        print(f"  checkpoint: {m.billions:.2f}B params, {time.perf_counter() - t0:.0f}s")
        per_req = -(-(s.e2e_prompt + s.e2e_warmup + s.e2e_steps + 2) // BLOCK_SIZE)
        num_blocks = per_req * max(s.e2e_batches) + 16
        # The second eager run keeps torch's RMSNorm / rotary ops (PAGESTREAM_TRITON_
        # ELEMENTWISE=0): what the Triton kernels save in an eager step.
        for mode, graphs, elementwise in (
            ("eager", False, None),
            ("eager, torch norm/rope", False, "0"),
            ("CUDA graphs", True, None),
        ):
            if graphs and "cuda_graphs" not in params:
                report.add(
                    Row(
                        "e2e",
                        f"decode, {mode}",
                        notes="skipped: the runner has no cuda_graphs option",
                    )
                )
                continue
            if graphs and device.type != "cuda":
                continue
            # The flag is read when the model is built; patch.dict puts the env back after.
            env = {} if elementwise is None else {"PAGESTREAM_TRITON_ELEMENTWISE": elementwise}
            with guarded(report, "e2e", f"runner ({mode})"), patch.dict(os.environ, env):
                runner = ModelRunner(ckpt, **_runner_kwargs(params, s, device, graphs, num_blocks))
                try:
                    _decode_rows(report, runner, s, m, mode, copy_bw)
                finally:
                    del runner
                    gc.collect()
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
        _engine_rows(report, s, device)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
