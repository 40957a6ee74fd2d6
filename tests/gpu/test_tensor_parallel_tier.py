"""Prefix-tier payloads under tensor parallelism keep the TP=1 layout, so engines of
different TP sizes share one namespace.  (A module of its own: the TP=2 engines of
test_tensor_parallel.py live until that module ends, and a process runs one at a time.)"""

from __future__ import annotations

import time

import pytest

from service.llm import LLM
from tests.checkpoints import tiny_checkpoint
from tests.gpu.test_tensor_parallel import ENGINE, GREEDY


def _published(llm: LLM, n: int) -> None:
    deadline = time.monotonic() + 10
    while llm.engine.tier.stats.blocks_published < n and time.monotonic() < deadline:
        time.sleep(0.02)
    assert llm.engine.tier.stats.blocks_published >= n


@pytest.mark.slow
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_prefix_tier_payloads_cross_tp_sizes(kv_heads):
    """Tier payloads are laid out as a TP=1 cache, whatever the TP size: a TP=2 engine
    loads what a TP=1 engine published and publishes what a TP=1 engine loads, and both
    answer as a cold engine.  MQA: the lone KV head is on both ranks, stored once."""
    # A checkpoint of its own, so no other test shares the in-process tier namespace.
    path = str(tiny_checkpoint("llama", num_hidden_layers=2, seed=23, num_key_value_heads=kv_heads))
    kw = dict(ENGINE, num_kv_blocks=64, max_model_len=None, redis_url="memory://")
    first = [[7] * 40 + [50 + i] for i in range(2)]
    second = [[9] * 40 + [60 + i] for i in range(2)]
    with LLM(path, **dict(ENGINE, num_kv_blocks=64, max_model_len=None)) as cold:
        want = [o.outputs[0].token_ids for o in cold.generate(first + second, GREEDY)]
    with LLM(path, **kw) as a:  # TP=1 publishes `first`'s blocks (the second hits them)
        a.generate(first, GREEDY)
        _published(a, 10)
    with LLM(path, tensor_parallel_size=2, tensor_parallel_timeout=30, **kw) as b:
        got = [o.outputs[0].token_ids for o in b.generate(first, GREEDY)]
        assert b.engine.tier.stats.blocks_loaded >= 10
        got += [o.outputs[0].token_ids for o in b.generate(second, GREEDY)]
        _published(b, 20)
    with LLM(path, **kw) as c:
        got2 = [o.outputs[0].token_ids for o in c.generate(second, GREEDY)]
        assert c.engine.tier.stats.blocks_loaded >= 10
    assert got == want and got2 == want[2:]
