"""LoRA adapters (gpu/lora.py) against HF transformers + PEFT, float32.

Adapters are made and saved by PEFT itself (random A and B, so each changes the output),
and served by one engine beside the base model: greedy tokens of a batch mixing the base
and two adapters, with chunked prefill and the same prompt under each, must be the ones
PEFT's unmerged model generates; a prompt cached for one of them is never a hit for
another.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from scheduler.config import ConfigError, EngineConfig
from scheduler.sampling_params import SamplingParams
from service.llm import LLM
from tests.checkpoints import peft_adapter, tiny_checkpoint

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

# Two adapters unlike each other: attention only, rank 4; every projection, rank 8, rsLoRA.
EVERY = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {
    "qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all": dict(r=8, lora_alpha=4, use_rslora=True, target_modules=EVERY),
}


def _hf(model: str):
    return transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def adapters(model, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora")
    return {
        name: peft_adapter(model, root / name, 100 + i, **lora)
        for i, (name, lora) in enumerate(ADAPTERS.items())
    }


@torch.inference_mode()
def _oracle(model: str, adapter: str | None, prompts: list[list[int]], n: int) -> list[list[int]]:
    hf = _hf(model)
    if adapter is not None:
        hf = peft.PeftModel.from_pretrained(hf, adapter).eval()
    outs = []
    for p in prompts:
        got = hf.generate(
            input_ids=torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
            max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
        outs.append(got[0, len(p) :].tolist())
    return outs


def _prompts(seed: int, k: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 2000, (int(n),), generator=g).tolist() for n in (5, 37, 70, 19)[:k]]


def _check_mixed_batch(llm: LLM, prompts: list[list[int]], want: dict, n: int) -> None:
    """Every prompt under the base and each adapter, in one batch: PEFT's tokens."""
    jobs = [(name, p) for p in prompts for name in (None, *ADAPTERS)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, lora=name)
              for name, _ in jobs]  # fmt: skip
    got = llm.generate([p for _, p in jobs], params)
    for (name, p), out in zip(jobs, got, strict=True):
        assert out.outputs[0].token_ids == want[name][prompts.index(p)], name


def test_a_mixed_batch_is_what_peft_generates(model, adapters):
    prompts = _prompts(0, 4)
    n = 12
    want = {name: _oracle(model, adapters.get(name), prompts, n) for name in (None, *ADAPTERS)}
    assert want["qv"] != want[None] and want["all"] != want[None] and want["qv"] != want["all"]
    llm = LLM(
        model, dtype="float32", num_kv_blocks=128, max_num_batched_tokens=48,
        lora_modules=adapters,
    )  # fmt: skip
    try:
        _check_mixed_batch(llm, prompts, want, n)
        # One at a time, base first: each prompt's blocks are cached before the adapters'
        # turns, which must not hit them (their KV is another model's).
        for name in (None, *ADAPTERS):
            sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, lora=name)
            for p, w in zip(prompts, want[name], strict=True):
                assert llm.generate([p], sp)[0].outputs[0].token_ids == w, name
        s = llm.engine.scheduler
        assert not s.has_unfinished() and s.kv.pool.num_free == s.kv.pool.num_blocks
    finally:
        llm.shutdown()
    # vLLM's --max-loras 1: one adapter's requests at a time, the base beside them; the
    # same tokens.
    with LLM(model, dtype="float32", num_kv_blocks=128, max_num_batched_tokens=48,
             lora_modules=adapters, max_loras=1) as llm:  # fmt: skip
        _check_mixed_batch(llm, prompts, want, n)
        assert llm.engine.scheduler.config.max_loras == 1


@pytest.mark.parametrize(
    ("kv_heads", "layout"),
    [(4, {"tensor_parallel_size": 2}), (1, {"tensor_parallel_size": 2}),
     (4, {"pipeline_parallel_size": 2})],
    ids=["tp2-gqa", "tp2-kv-replicated", "pp2"],
)  # fmt: skip
def test_parallel_ranks_serve_their_share_of_each_adapter(adapters, tmp_path, kv_heads, layout):
    """TP=2: each rank holds its heads' rows of B for q/k/v (and its intermediate slice
    for gate/up), its input columns of A for o/down, whose partial products the all-reduce
    adds up with the base's.  PP=2: each stage its layers' updates, for each micro-batch's
    rows.  PEFT's tokens, beside the base, under chunked prefill."""
    model = str(tiny_checkpoint("llama", num_hidden_layers=2, num_key_value_heads=kv_heads))
    ads = {
        name: peft_adapter(model, tmp_path / name, 200 + i, **lora)
        for i, (name, lora) in enumerate(ADAPTERS.items())
    }
    prompts = _prompts(1, 3)
    n = 8
    want = {name: _oracle(model, ads.get(name), prompts, n) for name in (None, *ADAPTERS)}
    with LLM(model, dtype="float32", num_kv_blocks=128, max_num_batched_tokens=32, threads=1,
             lora_modules=ads, tensor_parallel_timeout=60, **layout) as llm:  # fmt: skip
        _check_mixed_batch(llm, prompts, want, n)


def test_an_unknown_adapter_is_refused(model, adapters):
    llm = LLM(model, dtype="float32", num_kv_blocks=32, lora_modules={"qv": adapters["qv"]})
    try:
        with pytest.raises(Exception, match="no LoRA adapter named 'nope'"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, lora="nope"))
    finally:
        llm.shutdown()


def _broken(adapters: dict[str, str], tmp_path: Path, **conf) -> str:
    out = tmp_path / "broken"
    shutil.copytree(adapters["qv"], out)
    cfg = json.loads((out / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps(cfg | conf))
    return str(out)


@pytest.mark.parametrize(
    "conf, why",
    [
        ({"r": 4, "modules_to_save": [], "rank_pattern": {}, "bias": "none"}, None),
        ({"bias": "lora_only"}, "bias='lora_only' is not supported"),
        ({"use_dora": True}, "use_dora=True is not supported"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"r": 2}, r"A \(4, 256\) / B \(256, 4\), the model needs \(2, 256\)"),
        ({"peft_type": "IA3"}, "is not LORA"),
    ],
)
def test_adapters_that_cannot_be_served_are_refused_at_start(model, adapters, tmp_path, conf, why):
    path = _broken(adapters, tmp_path, **conf)
    if why is None:
        LLM(model, dtype="float32", num_kv_blocks=16, lora_modules={"x": path}).shutdown()
        return
    with pytest.raises(Exception, match=why):
        LLM(model, dtype="float32", num_kv_blocks=16, lora_modules={"x": path})


def test_rank_bound_and_combinations_are_said(model, adapters):
    with pytest.raises(Exception, match="rank 8 is not in"):
        LLM(model, dtype="float32", num_kv_blocks=16, max_lora_rank=4,
            lora_modules={"all": adapters["all"]})  # fmt: skip
    with pytest.raises(ConfigError, match="names must match"):
        EngineConfig.from_kwargs(model=model, lora_modules={"bad name": adapters["qv"]})


def test_the_benchmarks_adapters_are_peft_checkpoints(model, tmp_path):
    """modelkit.lora writes what `make bench` serves: PEFT reads it as its own, and the
    engine's output on it is PEFT's."""
    from modelkit.lora import write_lora_adapter

    path = str(write_lora_adapter(model, tmp_path / "mk", rank=4, alpha=6.0, std=0.3,
                                  targets=("k_proj", "o_proj", "up_proj")))  # fmt: skip
    prompts = _prompts(5, 2)
    want = _oracle(model, path, prompts, 8)
    assert want != _oracle(model, None, prompts, 8)
    llm = LLM(model, dtype="float32", num_kv_blocks=64, lora_modules={"mk": path})
    try:
        sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, lora="mk")
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == want
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    "layout",
    [
        ["a"] * 5,  # every row one adapter: one run, however short
        [None] * 3 + ["a"] * 20 + ["b"] * 17,  # long runs (prompt chunks)
        ["a", "b", None, "b", "a"] + ["b"] * 18,  # decodes of several, then a chunk
        ["b"] * 18 + ["a", None, "b"] + ["a"] * 16 + ["b", "b"],  # short rows apart
    ],
)
def test_each_row_gets_its_own_adapters_update(model, adapters, layout):
    """The manager's three ways (a run alone, a range masked, rows gathered) against the
    update written out row by row in float64."""
    from gpu.config import ModelConfig
    from gpu.lora import LoRAManager, read_adapter

    cfg = ModelConfig.from_dir(model)
    cpu = torch.device("cpu")
    ads = {n: read_adapter(n, adapters[p], cfg, 64, torch.float32, cpu)
           for n, p in (("a", "qv"), ("b", "all"))}  # fmt: skip
    m = LoRAManager(ads)
    key = (1, "self_attn.qkv_proj")
    x = torch.randn(len(layout), cfg.hidden_size)
    y0 = torch.randn(len(layout), cfg.q_size + 2 * cfg.kv_size)
    assert m.set_rows([(n, 1) for n in layout], cpu)
    got = m.add(key, x, y0.clone())
    want = y0.double().clone()
    for r, name in enumerate(layout):
        d = ads[name].deltas.get(key) if name else None
        for off, out, a, b in d.parts if d else ():
            want[r, off : off + out] += (x[r].double() @ a.double().T) @ b.double().T
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(got, y0)


def test_a_base_request_cannot_take_an_adapters_salt(model, adapters):
    """A client's cache_salt spelled as an adapter's KV key must not let base KV be read
    by (or written for) that adapter's requests."""
    from service.async_engine import AsyncEngine

    prompt = _prompts(9, 1)[0] + list(range(40, 80))
    want = _oracle(model, adapters["qv"], [prompt], 6)[0]
    llm = LLM(model, dtype="float32", num_kv_blocks=64, lora_modules={"qv": adapters["qv"]})
    try:
        engine: AsyncEngine = llm.engine
        forged = engine.lora_salts["qv"]
        sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

        async def base_with(salt: str) -> None:
            async for _ in engine.generate("", sp, "forged", prompt_token_ids=prompt,
                                           cache_salt=salt):  # fmt: skip
                pass

        llm._run(base_with(forged))
        before = engine.scheduler.kv.pool.num_free
        lora = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, lora="qv")
        assert llm.generate([prompt], lora)[0].outputs[0].token_ids == want
        assert engine.scheduler.kv.pool.num_free == before
    finally:
        llm.shutdown()


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation_verifies_with_the_adapter(model, adapters, method):
    """Drafts (n-gram, or a draft model that knows no adapter) are verified by the model
    with each row's adapter: greedy output is PEFT's, base and adapter rows in the same
    verify steps."""
    spec = {
        "method": method, "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3, "disable_by_batch_size": 256, "min_acceptance_rate": 0.0,
    }  # fmt: skip
    if method == "draft":
        spec["model"] = str(tiny_checkpoint("llama", seed=7, num_hidden_layers=1))
    # Copy-heavy prompts: the n-gram proposer finds their repeats.
    prompts = [[5, 6, 7, 8] * 6, [40, 41, 42] * 9 + [43]]
    n = 16
    want = {name: _oracle(model, adapters.get(name), prompts, n) for name in (None, "all")}
    llm = LLM(model, dtype="float32", num_kv_blocks=128, max_num_batched_tokens=64,
              lora_modules={"all": adapters["all"]}, speculative_config=spec)  # fmt: skip
    try:
        jobs = [(name, p) for p in prompts for name in (None, "all")]
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, lora=name)
                  for name, _ in jobs]  # fmt: skip
        got = llm.generate([p for _, p in jobs], params)
        for (name, p), out in zip(jobs, got, strict=True):
            assert out.outputs[0].token_ids == want[name][prompts.index(p)], name
        stats = llm.engine.scheduler.stats().spec
        assert stats is not None and stats.num_draft_tokens > 0
    finally:
        llm.shutdown()


def test_stacks_of_adapter_sets_stay_within_the_adapters_bytes(model, adapters):
    """Steps mixing different sets of adapters keep copies of those sets' weights: no
    more bytes of them than the adapters hold, the least recently used let go."""
    from gpu.config import ModelConfig
    from gpu.lora import LoRAManager, read_adapter

    cfg = ModelConfig.from_dir(model)
    cpu = torch.device("cpu")
    paths = {"a": adapters["qv"], "b": adapters["all"], "c": adapters["qv"], "d": adapters["all"]}
    m = LoRAManager({n: read_adapter(n, p, cfg, 64, torch.float32, cpu) for n, p in paths.items()})
    x = torch.randn(4, cfg.hidden_size)
    key = (0, "self_attn.qkv_proj")
    for pair in [("a", "b"), ("b", "c"), ("c", "d"), ("a", "d"), ("a", "b"), ("b", "d")]:
        assert m.set_rows([(pair[0], 1), (pair[1], 1), (pair[0], 1), (None, 1)], cpu)
        m.add(key, x, torch.zeros(4, cfg.q_size + 2 * cfg.kv_size))
        held = sum(m._stack_bytes[k] for k in m._stacks)
        assert held <= m.max_stack_bytes and tuple(sorted(pair)) in m._stacks
        assert set(m._stacks) == set(m._stack_bytes)
    assert len(m._stacks) < 6  # some were let go
