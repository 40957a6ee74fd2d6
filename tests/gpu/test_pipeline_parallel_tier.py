"""Prefix-tier payloads under pipeline parallelism keep the PP=1 layout (every layer, in
order; every KV head under TP too), so engines of different pipeline sizes share one
namespace.  (A module of its own: the engines of test_pipeline_parallel.py live until
that module ends, and a process runs one at a time.)"""

from __future__ import annotations

import pytest

from service.llm import LLM
from tests.checkpoints import tiny_checkpoint
from tests.gpu.test_tensor_parallel import ENGINE, GREEDY
from tests.gpu.test_tensor_parallel_tier import _published


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_prefix_tier_payloads_cross_pp_sizes(tp):
    """A PP=2 engine (x TP) loads what a PP=1 engine published and publishes what a PP=1
    engine loads, and both answer as a cold engine.  Three layers: stages of 2 and 1."""
    # A checkpoint of its own, so no other test shares the in-process tier namespace.
    path = str(tiny_checkpoint("llama", num_hidden_layers=3, seed=29 + tp))
    kw = dict(ENGINE, num_kv_blocks=64, max_model_len=None, redis_url="memory://")
    first = [[7] * 40 + [50 + i] for i in range(2)]
    second = [[9] * 40 + [60 + i] for i in range(2)]
    with LLM(path, **dict(ENGINE, num_kv_blocks=64, max_model_len=None)) as cold:
        want = [o.outputs[0].token_ids for o in cold.generate(first + second, GREEDY)]
    with LLM(path, **kw) as a:  # PP=1 publishes `first`'s blocks (the second hits them)
        a.generate(first, GREEDY)
        _published(a, 10)
    with LLM(path, pipeline_parallel_size=2, tensor_parallel_size=tp,
             tensor_parallel_timeout=60, **kw) as b:  # fmt: skip
        got = [o.outputs[0].token_ids for o in b.generate(first, GREEDY)]
        assert b.engine.tier.stats.blocks_loaded >= 10
        got += [o.outputs[0].token_ids for o in b.generate(second, GREEDY)]
        _published(b, 20)
    with LLM(path, **kw) as c:
        got2 = [o.outputs[0].token_ids for o in c.generate(second, GREEDY)]
        assert c.engine.tier.stats.blocks_loaded >= 10
    assert got == want and got2 == want[2:]
