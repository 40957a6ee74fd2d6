"""Speculative decoding is lossless under greedy decoding: the whole engine with n-gram or
draft-model speculation produces exactly the tokens of HF transformers' float32
`generate()` (and so of speculation off), across architectures and attention layouts,
with chunked prefill, forced preemption, prefix-cache hits and n > 1.

The models are random but tied and low-variance, so they fall into loops as small models
do; n-gram lookup then has something to find, and a different random draft model is
right part of the time, so both acceptance and rejection (KV rollback) are exercised.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from tests.checkpoints import tiny_checkpoint
from tests.e2e.test_engine_parity import make_engine, run_engine

transformers = pytest.importorskip("transformers")

# (arch, config overrides): GQA, MQA, tied embeddings, Qwen2's biases, Qwen3's q/k norms.
CONFIGS = {
    "llama-gqa": ("llama", {}),
    "mistral-mqa": ("mistral", {"num_key_value_heads": 1}),
    "qwen2-gqa": ("qwen2", {}),
    "qwen3-mqa": ("qwen3", {"num_key_value_heads": 1}),
}


def target_dir(name: str) -> str:
    arch, over = CONFIGS[name]
    return str(tiny_checkpoint(arch, init_std=0.05, tie_word_embeddings=True, **over))


def draft_dir(name: str) -> str:
    arch, over = CONFIGS[name]
    return str(
        tiny_checkpoint(
            arch, seed=7, init_std=0.05, tie_word_embeddings=True, num_hidden_layers=1, **over
        )
    )


_hf: dict[str, object] = {}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def hf_model(path: str):
    if path not in _hf:
        _hf[path] = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32
        ).eval()
    return _hf[path]


_oracle: dict[tuple[str, tuple[int, ...], int], list[int]] = {}


@torch.inference_mode()
def check(model: str, work, results, n: int = 1) -> None:
    """Every sample equals HF's greedy generate() on the same weights."""
    hf = hf_model(model)
    for (prompt, max_tokens), outs in zip(work, results, strict=True):
        key = (model, tuple(prompt), max_tokens)
        if key not in _oracle:
            out = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            _oracle[key] = out[0, len(prompt) :].tolist()
        assert len(outs) == n
        for o in outs:
            assert o == _oracle[key]


def workload(seed: int, n_req: int, shared_prefix: int = 0) -> list[tuple[list[int], int]]:
    """Prompts that repeat part of themselves (what prompt lookup feeds on)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 2000) for _ in range(shared_prefix)]
    work = []
    for _ in range(n_req):
        body = [rng.randrange(3, 2000) for _ in range(rng.randint(2, 12))]
        work.append((prefix + body * rng.randint(1, 3), rng.randint(8, 48)))
    return work


def spec_config(method: str, name: str, k: int = 3) -> dict:
    cfg = {
        "method": method,
        "num_speculative_tokens": k,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
        # Speculate in every step, however many requests decode, to exercise batches.
        "disable_by_batch_size": 256,
        # Never stop speculating for low acceptance: every step verifies something.
        "min_acceptance_rate": 0.0,
    }
    if method == "draft":
        cfg["model"] = draft_dir(name)
    return cfg


def force_speculation(engine) -> None:
    """Every decode step speculates: the cost policy picks by this machine's timing, and
    what these tests check must not depend on how loaded it is."""
    engine.scheduler.spec.policy.choose = lambda *a, **k: True


def assert_speculated(engine) -> None:
    st = engine.scheduler.spec.stats
    assert st.num_drafts > 0 and st.num_accepted_tokens > 0, st
    assert st.num_accepted_tokens < st.num_draft_tokens, f"nothing was rejected: {st}"


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("name", list(CONFIGS))
async def test_greedy_identity_chunked_prefill_and_prefix_hits(name, method):
    model = target_dir(name)
    work = workload(11, 14, shared_prefix=20)
    engine = make_engine(
        model,
        num_kv_blocks=256,
        max_num_batched_tokens=24,
        block_size=8,
        max_model_len=256,
        speculative_config=spec_config(method, name),
        threads=1,
    )
    results = await run_engine(engine, work, stagger_steps=2)
    check(model, work, results)
    assert_speculated(engine)
    assert engine.scheduler.kv.prefix_hits > 0


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft"])
async def test_greedy_identity_forced_preemption(method):
    name = "llama-gqa"
    model = target_dir(name)
    work = workload(12, 16)
    engine = make_engine(
        model,
        num_kv_blocks=14,
        max_num_batched_tokens=32,
        block_size=16,
        max_model_len=224,
        speculative_config=spec_config(method, name, k=4),
        threads=1,
    )
    # Every decode step speculates: with arrivals every step most steps carry a prompt
    # chunk, where the cost policy starts no timing run, and this is about preemption.
    engine.scheduler.spec.policy.choose = lambda *a, **k: True
    results = await run_engine(engine, work, stagger_steps=1)
    check(model, work, results)
    assert engine.scheduler.num_preemptions > 0
    assert_speculated(engine)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft"])
async def test_greedy_identity_parallel_samples(method):
    name = "qwen2-gqa"
    model = target_dir(name)
    work = workload(13, 8)
    engine = make_engine(
        model,
        num_kv_blocks=128,
        max_num_batched_tokens=40,
        block_size=16,
        max_model_len=256,
        speculative_config=spec_config(method, name),
        threads=1,
    )
    engine.scheduler.spec.policy.choose = lambda *a, **k: True  # (as under preemption)
    results = await run_engine(engine, work, n=3, stagger_steps=1)
    check(model, work, results, n=3)
    assert_speculated(engine)


@pytest.mark.slow
async def test_greedy_identity_draft_through_decode_graphs():
    """With the Triton backend and CUDA graphs (captured on a GPU; on a CPU the same static
    buffers, interpreted), the draft model's one-token rounds run through its own decode
    graphs and the target's verify steps through the piecewise graphs: HF's tokens, and
    the same drafts as without graphs (speculation is lossless whatever the draft says,
    so the tokens alone could not show a wrong draft)."""
    import os

    if not os.environ.get("TRITON_INTERPRET") and not torch.cuda.is_available():
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    name = "llama-gqa"
    model = target_dir(name)
    # Interpreted Triton costs ~1 s a step here: outputs of at most 16 tokens still give
    # every request several draft rounds through the graphs (the full lengths took 80 s).
    work = [(prompt, min(n, 16)) for prompt, n in workload(11, 3)]
    runs = {}
    for graphs in (False, True):
        engine = make_engine(
            model,
            num_kv_blocks=128,
            max_num_batched_tokens=32,
            block_size=16,
            max_model_len=256,
            attention_backend="triton",
            cuda_graphs=graphs,
            speculative_config=spec_config("draft", name),
            threads=1,
        )
        # Every decode step speculates: both runs must draft alike, which a choice made from
        # measured step times (and acceptance so far) cannot promise on a loaded machine.
        engine.scheduler.spec.policy.choose = lambda *a, **k: True
        runner = engine.runner
        pieces, draft_graphs = runner.piecewise, runner.spec.draft.graphs  # (freed at shutdown)
        assert (pieces is not None, draft_graphs is not None) == (graphs, graphs)
        results = await run_engine(engine, work, stagger_steps=1)
        check(model, work, results)
        assert_speculated(engine)
        if graphs:
            assert pieces.replays > 0 and draft_graphs.replays > 0
        st = engine.scheduler.spec.stats
        runs[graphs] = (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens)
    assert runs[True] == runs[False]


async def _constrained(engine, specs) -> list[list[int]]:
    """Each (prompt, spec) greedy under its grammar; the engine drained and closed."""
    from scheduler.sampling_params import SamplingParams, StructuredOutputsParams

    await engine.start()

    async def one(i, prompt, spec):
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                structured_outputs=StructuredOutputsParams(**spec))  # fmt: skip
        last = None
        async for out in engine.generate(prompt, params, request_id=f"g{i}"):
            last = out
        assert last.outputs[0].finish_reason in ("stop", "length"), last.outputs[0]
        return last.outputs[0].token_ids

    try:
        return await asyncio.gather(*(one(i, p, s) for i, (p, s) in enumerate(specs)))
    finally:
        sched = engine.scheduler
        assert not sched.requests and sched.kv.pool.num_free == sched.kv.pool.num_blocks
        await engine.shutdown()


GRAMMARS = [
    ([5, 6, 7], {"regex": "(ab ){3,30}c"}),  # forced text: the drafts repeat it
    ([9, 10], {"json": '{"type": "array", "items": {"type": "integer"}, "maxItems": 12}'}),
    ([11, 12, 13], {"choice": ("red green red green", "blue")}),
    ([14], {"regex": "[a-z ]{10,60}"}),  # free text: drafts the grammar refuses are cut
]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_identity_under_grammars_with_drafts(monkeypatch, method):
    """A constrained request drafts (n-gram: the scheduler's drafts; a draft model: the
    executor's, walked through the grammar there): each verify row is masked by the
    grammar at its position, the drafts it refuses are cut before the verify pass, and
    the tokens are those of the same requests without speculation."""
    import scheduler.scheduler as sched_mod

    cuts = []
    walk = sched_mod._draft_masks

    def counting(grammar, drafts):
        masks, keep = walk(grammar, drafts)
        cuts.append(keep < len(drafts))
        return masks, keep

    monkeypatch.setattr(sched_mod, "_draft_masks", counting)
    walked = []  # a draft model's walks: the drafts each took under its grammar
    finish = sched_mod.DraftWalk.finish

    def recording(self):
        walked.append(self.taken)
        return finish(self)

    monkeypatch.setattr(sched_mod.DraftWalk, "finish", recording)
    model = target_dir("llama-gqa")
    plain = asyncio.run(_constrained(make_engine(model, max_num_batched_tokens=32), GRAMMARS))
    engine = make_engine(model, max_num_batched_tokens=32,
                         speculative_config=spec_config(method, "llama-gqa", k=4))  # fmt: skip
    force_speculation(engine)
    got = asyncio.run(_constrained(engine, GRAMMARS))
    assert got == plain
    st = engine.scheduler.spec.stats
    assert st.num_drafts > 0 and st.num_accepted_tokens > 0, st
    if method == "ngram":
        assert any(cuts) and not all(cuts), cuts  # chunks cut at a refused draft, and whole
    else:
        # The draft model drafted under the grammar (so its drafts always fit it).
        assert not cuts and sum(walked) >= st.num_accepted_tokens > 0, walked


def test_greedy_identity_after_thinking_with_ngram_drafts(tmp_path):
    """A reasoning model's request with a grammar after `</think>` (AfterReasoning) drafts
    too: its thinking rows verify free, its answer rows under the grammar, and the tokens
    are those without speculation."""
    from service.tokenizer import Tokenizer
    from tests.checkpoints import THINK_PROMPT, thinking_model

    model = thinking_model(tmp_path / "thinker")
    tok = Tokenizer.from_dir(model)
    prompt = tok.encode(tok.apply_chat_template(THINK_PROMPT, add_generation_prompt=True),
                        add_special_tokens=False)  # fmt: skip
    end = tok.backend.token_to_id("</think>")
    schema = '{"type": "array", "items": {"type": "integer"}, "maxItems": 8}'
    work = [(prompt, {"json": schema, "reasoning_end": end})] * 2
    plain = asyncio.run(_constrained(make_engine(model), work))
    engine = make_engine(model, speculative_config=spec_config("ngram", "llama-gqa", k=4))
    got = asyncio.run(_constrained(engine, work))
    assert got == plain and end in got[0]
    assert engine.scheduler.spec.stats.num_drafts > 0


def test_a_trained_draft_under_grammars_stops_where_the_grammar_completes():
    """The shipped trained pair drafts well enough to reach a grammar's end inside a
    chunk (the JSON closes, then only end-of-text fits): drafting stops at the token
    that completes it, and the tokens are those without speculation."""
    from service.engine_setup import default_draft_dir, default_model_dir

    model = str(default_model_dir())
    cfg = spec_config("ngram", "llama-gqa", k=3) | {
        "method": "draft", "model": str(default_draft_dir()),
    }  # fmt: skip
    plain = asyncio.run(_constrained(make_engine(model, max_num_batched_tokens=32), GRAMMARS))
    engine = make_engine(model, max_num_batched_tokens=32, speculative_config=cfg)
    force_speculation(engine)
    assert asyncio.run(_constrained(engine, GRAMMARS)) == plain
    assert engine.scheduler.spec.stats.num_accepted_tokens > 0
