"""Medusa speculation is lossless under greedy decoding: the whole engine, verifying the
heads' candidate trees in one pass with a tree mask, produces exactly HF transformers'
float32 greedy tokens, across architectures and attention paths, with chunked prefill,
forced preemption, prefix-cache hits and n > 1.

The heads start where Medusa's training starts (identity ResBlocks, the target's own LM
head) plus noise, so on these looping random models they are right part of the time:
both accepted paths (KV compaction) and rejected branches (rollback) are exercised.  One
test serves heads that `pagestream train-medusa` wrote.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.checkpoints import tiny_checkpoint
from tests.e2e.test_engine_parity import make_engine, run_engine
from tests.e2e.test_spec_parity import (
    CONFIGS,
    check,
    force_speculation,
    target_dir,
    workload,
)

pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_torch_thread")

_heads: dict[str, str] = {}


def medusa_dir(name: str, tmp_root: Path, num_heads: int = 4) -> str:
    """Heads for CONFIGS[name]'s target: Medusa's initialisation, then noise."""
    from modelkit.medusa_train import _target, initial_heads

    key = f"{name}-{num_heads}"
    if key not in _heads:
        model = target_dir(name)
        torch.manual_seed(5)
        heads = initial_heads(_target(Path(model)), num_heads, 1)
        with torch.no_grad():
            for p in heads.parameters():
                p.add_(torch.randn_like(p) * 0.02)
        out = tmp_root / key
        heads.save(out, model)
        _heads[key] = str(out)
    return _heads[key]


@pytest.fixture(scope="module")
def heads_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("medusa")


def medusa_config(heads: str, k: int = 4) -> dict:
    return {
        "method": "medusa",
        "model": heads,
        "num_speculative_tokens": k,
        # Speculate in every step, however many requests decode, and never stop for low
        # acceptance: every step verifies a tree.
        "disable_by_batch_size": 256,
        "min_acceptance_rate": 0.0,
    }


def assert_trees(engine) -> None:
    """Trees were verified, some levels accepted and some rejected."""
    st = engine.scheduler.spec.stats
    assert st.num_drafts > 0 and st.num_accepted_tokens > 0, st
    assert st.num_accepted_tokens < st.num_draft_tokens, f"nothing was rejected: {st}"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
async def test_medusa_greedy_identity_chunked_prefill_and_prefix_hits(name, heads_root):
    model = target_dir(name)
    work = workload(11, 10, shared_prefix=20)
    engine = make_engine(
        model,
        num_kv_blocks=256,
        max_num_batched_tokens=24,
        block_size=16,
        max_model_len=256,
        speculative_config=medusa_config(medusa_dir(name, heads_root)),
        threads=1,
    )
    force_speculation(engine)
    results = await run_engine(engine, work, stagger_steps=2)
    check(model, work, results)
    assert_trees(engine)
    assert engine.scheduler.kv.prefix_hits > 0


@pytest.mark.slow
async def test_medusa_greedy_identity_forced_preemption(heads_root):
    name = "llama-gqa"
    model = target_dir(name)
    work = workload(12, 12)
    engine = make_engine(
        model,
        num_kv_blocks=16,
        max_num_batched_tokens=48,
        block_size=16,
        max_model_len=224,
        speculative_config=medusa_config(medusa_dir(name, heads_root)),
        threads=1,
    )
    force_speculation(engine)
    results = await run_engine(engine, work, stagger_steps=1)
    check(model, work, results)
    assert engine.scheduler.num_preemptions > 0
    assert_trees(engine)


async def test_medusa_greedy_identity_parallel_samples(heads_root):
    name = "qwen2-gqa"
    model = target_dir(name)
    work = workload(13, 6)
    engine = make_engine(
        model,
        num_kv_blocks=128,
        max_num_batched_tokens=64,
        block_size=16,
        max_model_len=256,
        speculative_config=medusa_config(medusa_dir(name, heads_root), k=3),
        threads=1,
    )
    force_speculation(engine)
    results = await run_engine(engine, work, n=3, stagger_steps=1)
    check(model, work, results, n=3)
    assert_trees(engine)


@pytest.mark.parametrize("choice", ["sdpa", "kernel"])
async def test_medusa_greedy_identity_torch_paths(heads_root, monkeypatch, choice):
    """The torch backend's two prefill paths for the verify chunk: SDPA with the tree mask,
    and the compiled kernel with the tree bits."""
    from gpu.cpu import kernels as cpu_kernels

    if choice == "kernel" and not cpu_kernels.available():
        pytest.skip("no compiled CPU kernels on this machine")
    monkeypatch.setenv("PAGESTREAM_PREFILL_ATTENTION", choice)
    name = "mistral-mqa"
    model = target_dir(name)
    work = workload(14, 6)
    engine = make_engine(
        model,
        num_kv_blocks=128,
        max_num_batched_tokens=64,
        block_size=16,
        max_model_len=256,
        attention_backend="cpu",
        speculative_config=medusa_config(medusa_dir(name, heads_root)),
        threads=1,
    )
    force_speculation(engine)
    results = await run_engine(engine, work, stagger_steps=1)
    check(model, work, results)
    assert_trees(engine)


@pytest.mark.slow
async def test_medusa_greedy_identity_triton(heads_root):
    """The Triton backend (interpreted on a CPU) verifies the same trees."""
    if not os.environ.get("TRITON_INTERPRET") and not torch.cuda.is_available():
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    name = "llama-gqa"
    model = target_dir(name)
    work = workload(15, 2)  # (the interpreter runs every program in Python)
    engine = make_engine(
        model,
        num_kv_blocks=128,
        max_num_batched_tokens=64,
        block_size=16,
        max_model_len=256,
        attention_backend="triton",
        cuda_graphs=False,
        speculative_config=medusa_config(medusa_dir(name, heads_root)),
        threads=1,
    )
    force_speculation(engine)
    results = await run_engine(engine, work, stagger_steps=1)
    check(model, work, results)
    assert_trees(engine)


async def test_trained_heads_serve(tmp_path):
    """`pagestream train-medusa` on a tiny model writes the public layout; the engine
    serves those heads (depth bounded by their number) and its output is still HF's."""
    from service.cli import main

    model = str(tiny_checkpoint("llama", init_std=0.05, tie_word_embeddings=True))
    out = tmp_path / "heads"
    args = ["train-medusa", model, str(out), "--steps", "12", "--batch-size", "4",
            "--corpus-bytes", "60000", "--num-heads", "3", "--threads", "1"]  # fmt: skip
    assert main(args) == 0
    import json

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["medusa_num_heads"] == 3 and cfg["medusa_num_layers"] == 1
    assert cfg["base_model_name_or_path"] == model
    assert (out / "medusa_lm_head.safetensors").is_file()
    work = workload(16, 4)
    engine = make_engine(
        model,
        num_kv_blocks=128,
        max_num_batched_tokens=64,
        block_size=16,
        max_model_len=256,
        speculative_config=medusa_config(str(out)),
        threads=1,
    )
    force_speculation(engine)
    assert engine.scheduler.spec.k == 3  # bounded by the heads
    results = await run_engine(engine, work, stagger_steps=1)
    check(model, work, results)
    assert engine.scheduler.spec.stats.num_drafts > 0


def test_medusa_greedy_identity_under_grammars(heads_root, monkeypatch):
    """A constrained request drafts a tree: its first level is the heads' top tokens among
    those the grammar allows, every row is masked by the grammar after its path
    (Scheduler.draft_tree, walked depth first in the executor), nodes the grammar refuses
    are never accepted, and the tokens are those without speculation."""
    import asyncio

    import scheduler.scheduler as sched_mod
    from tests.e2e.test_spec_parity import GRAMMARS, _constrained

    walked, refused_first = [], []
    walk = sched_mod.tree_masks

    def counting(grammar, tokens, parents):
        walked.append(len(tokens))
        root = grammar.bitmask()
        # The first level was drawn under the root's mask: its best candidate (node 0) is
        # one the grammar allows (the others too, while it allows as many).
        if root is not None and not (root[tokens[0] // 8] >> (tokens[0] % 8)) & 1:
            refused_first.append(tokens[0])
        return walk(grammar, tokens, parents)

    monkeypatch.setattr(sched_mod, "tree_masks", counting)
    name = "llama-gqa"
    model = target_dir(name)
    plain = asyncio.run(_constrained(make_engine(model, max_num_batched_tokens=32), GRAMMARS))
    engine = make_engine(model, max_num_batched_tokens=32,
                         speculative_config=medusa_config(medusa_dir(name, heads_root)))  # fmt: skip
    force_speculation(engine)
    assert asyncio.run(_constrained(engine, GRAMMARS)) == plain
    st = engine.scheduler.spec.stats
    assert walked and st.num_drafts > 0 and st.num_accepted_tokens > 0, (walked, st)
    assert not refused_first, refused_first
