"""Medusa in the scheduler: the config asks for a heads directory, the depth is bounded by
the heads, a speculating decode reserves the static tree's slots for its wanted depth
(cut by the token budget), acceptance is counted in tree levels, and the step-cost policy
weighs a Medusa step as it weighs the other methods' (expected tokens, measured time)."""

from __future__ import annotations

import json

import pytest

from scheduler.contract import ModelOutput
from scheduler.medusa_tree import tree_depth, tree_size
from scheduler.request import Request
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler, SchedulerConfig
from scheduler.spec import SpecConfig, SpecDecoder, medusa_num_heads
from service.cli import build_parser, speculative_config
from tests.scheduler.helpers import EOS


@pytest.fixture
def heads_dir(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 1})
    )
    return str(tmp_path)


def test_config(heads_dir, tmp_path):
    with pytest.raises(ValueError, match="Medusa heads directory"):
        SpecConfig(method="medusa")
    assert medusa_num_heads(heads_dir) == 3
    with pytest.raises(ValueError, match="not a Medusa checkpoint"):
        SpecDecoder(SpecConfig(method="medusa", model=str(tmp_path / "nowhere")))
    spec = SpecDecoder(SpecConfig(method="medusa", model=heads_dir, num_speculative_tokens=6))
    assert spec.k == 3 and spec.in_executor and spec.tree


def test_cli_flag_builds_the_config(heads_dir):
    a = build_parser().parse_args(
        ["serve", "--speculative-method", "medusa", "--speculative-model", heads_dir,
         "--num-speculative-tokens", "3"]
    )  # fmt: skip
    cfg = speculative_config(a)
    assert cfg is not None and cfg["method"] == "medusa" and cfg["model"] == heads_dir
    assert SpecConfig.from_dict(cfg).num_speculative_tokens == 3


def test_observe_counts_levels_not_nodes(heads_dir):
    spec = SpecDecoder(SpecConfig(method="medusa", model=heads_dir, num_speculative_tokens=3))
    r = Request("a", [1, 2], SamplingParams(max_tokens=50), eos_token_ids=(EOS,), max_tokens=50)
    # Two levels of a depth-3 tree accepted: two successes and one failure, whatever the
    # tree's node count (16 nodes at depth 4, 13 at 3).
    spec.observe(r, tree_size(3), 2)
    assert spec.stats.num_draft_tokens == 3 and spec.stats.num_accepted_tokens == 2
    assert spec.stats.accepted_by_position[:3] == [1, 1, 0]
    assert tree_depth(tree_size(3)) == 3


def _scheduler(heads_dir: str, budget: int) -> Scheduler:
    cfg = SchedulerConfig(
        num_kv_blocks=64, block_size=4, max_num_batched_tokens=budget, max_num_seqs=8,
        max_model_len=256,
    )  # fmt: skip
    spec = SpecDecoder(
        SpecConfig(
            method="medusa", model=heads_dir, num_speculative_tokens=3, min_acceptance_rate=0.0
        )
    )
    return Scheduler(cfg, spec=spec)


@pytest.mark.parametrize(("budget", "slots"), [(64, tree_size(3)), (8, 7)])
def test_a_decode_reserves_the_trees_slots(heads_dir, budget, slots):
    s = _scheduler(heads_dir, budget)
    r = Request("a", [1, 2, 3], SamplingParams(max_tokens=40, ignore_eos=True),
                eos_token_ids=(EOS,), max_tokens=40)  # fmt: skip
    s.add_request([r])
    so = s.schedule()  # the prompt
    s.update_from_output(so, ModelOutput(req_ids=["a"], sampled_token_ids=[9]))
    so = s.schedule()  # its first decode: no time measured yet, so it speculates
    (sr,) = so.all_scheduled()
    assert sr.draft_ids == [] and sr.num_draft == slots  # the executor fills the tree
    assert so.num_scheduled_tokens == 1 + slots <= budget
    # The runner accepted two levels: the request keeps 2 drafts + the bonus, and its
    # computed tokens end after the accepted path (the rest is rolled back).
    mo = ModelOutput(req_ids=["a"], sampled_token_ids=[7], spec_accepted={"a": [5, 6]})
    s.update_from_output(so, mo)
    assert r.token_ids[-4:] == [9, 5, 6, 7]
    assert r.num_computed_tokens == len(r.token_ids) - 1


def test_policy_weighs_medusa_by_time_and_expected_levels(heads_dir):
    """A measured slow speculating step (at its rows' acceptance) is declined; a cheap one
    is taken: the same StepCostPolicy rule as for n-gram and draft steps."""
    spec = SpecDecoder(SpecConfig(method="medusa", model=heads_dir, num_speculative_tokens=3))
    pol = spec.policy
    for _ in range(pol.RUN):
        pol.observe(1, True, 0.040)  # a tree verify 4x a plain step
    for _ in range(pol.RUN):
        pol.observe(1, False, 0.010)
    r = Request("a", [1], SamplingParams(max_tokens=50), eos_token_ids=(EOS,), max_tokens=50)
    r.spec_accepted, r.spec_trials = 0.5, 1.0  # half the levels accepted
    gain = spec.expected_accepted(r, spec.wanted(r, 10))
    assert 0 < gain < 3
    assert not pol.choose(1, 1 + gain, 1 + gain)
    for _ in range(pol.SAMPLES):
        pol.observe(1, True, 0.011)  # a verify barely dearer than a plain step
    assert pol.choose(1, 1 + gain, 1 + gain)
