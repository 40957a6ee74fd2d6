"""One configuration from the command line (or LLM(...)) to the runner and the scheduler
(scheduler/config.py `EngineConfig`): every engine flag lands in exactly one field, the
built engine's parts read those values, LLM and `serve` build the same tree for the same
settings, and a bad value is refused before anything loads, naming its flag."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
from typing import Any

import pytest

from scheduler.config import (
    ATTENTION_BACKENDS,
    FIELD_GROUP,
    ConfigError,
    EngineConfig,
    flag_of,
)
from service.cli import ACCEPTED_VLLM_FLAGS, build_parser, engine_config, main, server_config
from tests.checkpoints import tiny_checkpoint
from tests.tls_certs import make_certs

SPEC_BASE = ["--speculative-method", "draft", "--speculative-model", "/draft"]
TLS = ["--ssl-certfile", "{cert}", "--ssl-keyfile", "{key}"]
KEYS = ["--api-key", "k1", "--api-key", "k2"]  # two keys: --prefix-tier-key-share applies
# Flags whose default gives no value to derive another from (None), or whose values are
# constrained: the value to set, and the line it is set on (default: KEYS + SPEC_BASE).
SPECIAL: dict[str, tuple[list[str], list[str] | None]] = {
    "--model": (["/m"], None),
    "--tokenizer": (["/tok"], None),
    "--max-log-len": (["100"], None),
    "--gpu-memory-utilization": (["0.9"], None),
    "--quantization": (["int8"], None),
    "--lora-modules": (["sea=/adapters/sea"], KEYS),  # (not with speculation)
    "--max-loras": (["2"], None),
    # (a model directory without a tokenizer: the check of its tags is the load's)
    "--reasoning-parser": (["qwen3"], [*KEYS, *SPEC_BASE, "--model", "/m"]),
    "--generation-config": (["vllm"], None),
    "--override-generation-config": (['{{"temperature": 0.5}}'], None),  # (format-escaped)
    "--hf-overrides": (['{{"num_labels": 3}}'], None),
    "--pooler-config": (['{{"pooling_type": "MEAN"}}'], None),
    "--num-kv-blocks": (["64"], None),
    "--kv-cache-memory": (["0.5"], None),
    "--block-size": (["32"], None),
    "--max-num-batched-tokens": (["96"], None),
    "--max-model-len": (["256"], None),
    "--redis-url": (["memory://"], None),
    "--prefix-tier-key-share": (["0.75"], None),  # above 1 / the two keys
    "--max-waiting-tokens": (["100"], None),
    "--speculative-model": (["/other"], None),
    "--speculative-method": (["medusa"], None),
    "--speculative-disable-by-batch-size": (["8"], None),
    "--ngram-min": (["3"], None),
    "--device": (["cpu"], None),
    "--threads": (["3"], None),
    "--switch-interval-ms": (["0.5"], None),
    "--master-addr": (["10.0.0.1"], None),
    "--master-port": (["29500"], None),
    # Pipeline stages do not run with speculation: these are set on a line without it.
    "--tensor-parallel-size": (["2"], KEYS),
    "--pipeline-parallel-size": (["2"], KEYS),
    "--nnodes": (["2"], KEYS),
    "--node-rank": (["1"], [*KEYS, "--nnodes", "2"]),
    # One key (no share of the prefix tier to change with it), weight 1.
    "--api-key": (["k3"], SPEC_BASE),
    "--admin-api-key": (["ops"], None),
    "--api-key-file": (["{key_file}"], SPEC_BASE),
    "--host": (["0.0.0.0"], None),
    "--served-model-name": (["name"], None),
    "--allowed-origins": (["https://chat.example.com"], None),
    "--allowed-methods": (["GET,POST"], None),
    "--allowed-headers": (['["Authorization"]'], None),
    "--allowed-hosts": (["chat.example.com"], None),
    "--forwarded-allow-ips": (["10.0.0.0/8"], None),
    "--socket-send-buffer": (["65536"], None),
    "--max-logprobs": (["5"], None),
    # vLLM's form of the speculative flags: one of its fields, on a line that uses it.
    "--speculative-config": (
        ['{{"method": "ngram", "num_speculative_tokens": 3}}'],
        [*KEYS, "--speculative-config", '{{"method": "ngram"}}'],
    ),
    "--chat-template": (["{template}"], None),
    "--uds": (["/tmp/pagestream.sock"], None),
    "--root-path": (["/llm"], None),
    # TLS files are read at start: real ones, on a line that already serves TLS.
    "--ssl-certfile": (["{cert2}"], [*SPEC_BASE, *TLS]),
    "--ssl-keyfile": (["{key2}"], [*SPEC_BASE, *TLS]),
    "--ssl-ca-certs": (["{ca}"], [*SPEC_BASE, *TLS]),
    "--ssl-cert-reqs": (["2"], [*SPEC_BASE, *TLS, "--ssl-ca-certs", "{ca}"]),
}
# Flags that set no field of the server's config, and why.
PROCESS_FLAGS = {
    # oneDNN reads its cache bound from the environment once, before torch loads: cmd_serve
    # sets it first thing.
    "--onednn-cache-capacity",
    # Its file's flags are set as if given on the line (test_vllm_cli.py).
    "--config",
    # vLLM's, for what pagestream does anyway (test_vllm_cli.py runs a line with them).
    *ACCEPTED_VLLM_FLAGS,
}


def _serve_flags() -> list[argparse.Action]:
    sub = build_parser()._subparsers._group_actions[0]  # type: ignore[union-attr]
    serve = sub.choices["serve"]  # type: ignore[index]
    return [a for a in serve._actions if a.option_strings and a.dest != "help"]


def _engine_flags() -> set[str]:
    sub = build_parser()._subparsers._group_actions[0]  # type: ignore[union-attr]
    (group,) = [g for g in sub.choices["serve"]._action_groups if g.title == "engine"]  # type: ignore[index]
    return {a.option_strings[0] for a in group._group_actions}


def _other_value(action: argparse.Action, files: dict[str, str]) -> list[str]:
    """A valid value for the flag other than its default."""
    flag = action.option_strings[0]
    if flag in SPECIAL:
        return [v.format(**files) for v in SPECIAL[flag][0]]
    if action.nargs == 0:  # store_true
        return []
    if action.choices:
        return [next(str(c) for c in action.choices if c != action.default)]
    assert action.default is not None, f"{flag}: add a value for it to SPECIAL"
    return [str(action.default * 2 or 1)]


def _leaves(config: Any, prefix: str = "") -> dict[str, Any]:
    """Every setting by its path in the tree (nested groups flattened)."""
    out = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            out.update(_leaves(value, f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = value
    return out


def _server(argv: list[str]) -> Any:
    return server_config(build_parser().parse_args(["serve", *argv]))


def _config(argv: list[str]) -> EngineConfig:
    return _server(argv).engine


@pytest.fixture(autouse=True)
def _no_env_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    # Flags whose default comes from the environment would differ between machines.
    for name in ("PAGESTREAM_MODEL", "PAGESTREAM_REDIS_URL", "PAGESTREAM_API_KEY",
                 "PAGESTREAM_API_KEY_FILE"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)


def _flag_files(tmp_path: Any) -> dict[str, str]:
    """Files some flags' values name: an API key file, TLS certificates (a second copy of
    the pair under other names), a chat template."""
    import shutil

    (tmp_path / "keys").write_text("k4\n")
    certs = make_certs(tmp_path / "tls")
    shutil.copy(certs.server_cert, tmp_path / "cert2.pem")
    shutil.copy(certs.server_key, tmp_path / "key2.pem")
    (tmp_path / "template.jinja").write_text("{{ messages[0]['content'] }}")
    return {
        "key_file": str(tmp_path / "keys"), "cert": str(certs.server_cert),
        "key": str(certs.server_key), "ca": str(certs.ca), "cert2": str(tmp_path / "cert2.pem"),
        "key2": str(tmp_path / "key2.pem"), "template": str(tmp_path / "template.jinja"),
    }  # fmt: skip


def test_every_serve_flag_lands_in_exactly_one_field(tmp_path):
    files = _flag_files(tmp_path)
    engine_flags, landed = _engine_flags(), {}
    for action in _serve_flags():
        flag = action.option_strings[0]
        if flag in PROCESS_FLAGS:
            continue
        base = SPECIAL.get(flag, ([], None))[1]
        base = [*KEYS, *SPEC_BASE] if base is None else [v.format(**files) for v in base]
        before = _leaves(_server(base))
        after = _leaves(_server([*base, flag, *_other_value(action, files)]))
        changed = [k for k in after if after[k] != before[k]]
        assert len(changed) == 1, f"{flag} changed {changed}"
        landed[flag] = changed[0]
        assert changed[0].startswith("engine.") == (flag in engine_flags), (flag, changed)
        group, _, field = changed[0].rpartition(".")
        if group.startswith("engine.") and group != "engine.speculative":
            # The name a ConfigError gives the field is the flag that sets it.
            assert flag_of(field) == flag, (field, flag)
    fields = list(landed.values())
    # Only --api-key and --api-key-file share a field (the file's keys add to the flag's),
    # and --speculative-config sets what the --speculative-* flags set, in vLLM's form.
    shared = {"api_keys", "engine.speculative.num_speculative_tokens"}
    assert {f for f in fields if fields.count(f) > 1} == shared, "two flags, one field"
    # Every engine setting has its flag, but those only LLM(...), tests or other flags set.
    reached = {k.removeprefix("engine.") for k in landed.values()} | {"speculative"}
    every = {f"{g}.{n}" for n, g in FIELD_GROUP.items()} | {"speculative", "fault_injection"}
    assert every - reached == {"fault_injection", "scheduler.tenant_weights"}


def test_key_file_weights_land_in_tenant_weights(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("k1 weight=3\nk2\n")
    weights = _config(["--api-key-file", str(keys)]).scheduler.tenant_weights
    assert weights is not None and sorted(weights.values()) == [3.0]


def test_llm_and_serve_build_the_same_config():
    from service.llm import LLM

    model = "/some/model"
    settings = dict(
        dtype="float32", block_size=32, num_kv_blocks=48, kv_cache_dtype="int8", seed=3,
        max_num_batched_tokens=96, max_num_seqs=7, max_model_len=256, device="cpu",
        scheduling_policy="fcfs", max_waiting_requests=9, max_waiting_per_key=5,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                            "prompt_lookup_min": 1, "prompt_lookup_max": 3},
        enforce_eager=True, enable_prefix_caching=False,
    )  # fmt: skip
    argv = [
        "--model", model, "--dtype", "float32", "--block-size", "32", "--num-kv-blocks", "48",
        "--kv-cache-dtype", "int8", "--seed", "3", "--max-num-batched-tokens", "96",
        "--max-num-seqs", "7", "--max-model-len", "256", "--device", "cpu",
        "--scheduling-policy", "fcfs", "--max-waiting-requests", "9",
        "--max-waiting-requests-per-key", "5", "--speculative-method", "ngram",
        "--num-speculative-tokens", "3", "--ngram-min", "1", "--ngram-max", "3",
        "--enforce-eager", "--no-prefix-caching",
    ]  # fmt: skip
    assert LLM.engine_config(model, **settings) == _config(argv)
    # Left alone, they differ only where offline batches and a server should.
    llm, serve = LLM.engine_config(model).flat(), _config(["--model", model]).flat()
    differ = {k for k in llm if llm[k] != serve[k]}
    assert differ == {"max_num_batched_tokens", "max_waiting_requests", "max_waiting_per_key"}


def test_the_engine_parts_read_their_groups():
    """A CLI line's values reach the runner, the scheduler and the engine core, and the
    runner holds the very tree the engine was built from."""
    from service.async_engine import AsyncEngine

    model = str(tiny_checkpoint("llama"))
    argv = [
        "--model", model, "--dtype", "float32", "--device", "cpu", "--threads", "1",
        "--attention-backend", "cpu", "--block-size", "32", "--num-kv-blocks", "48",
        "--kv-cache-dtype", "int8", "--max-model-len", "256", "--max-num-seqs", "7",
        "--max-num-batched-tokens", "96", "--scheduling-policy", "fcfs",
        "--pinned-kv-fraction", "0.5", "--session-ttl", "60", "--no-prefix-caching",
        "--max-waiting-requests", "9", "--max-waiting-tokens", "999",
        "--max-waiting-requests-per-key", "5", "--engine-thread", "off",
        "--speculative-method", "ngram", "--num-speculative-tokens", "3",
    ]  # fmt: skip
    config = _config(argv)
    engine = AsyncEngine.from_config(config)
    try:
        runner, sched, core = engine.runner, engine.scheduler, engine.core
        assert engine.config is config and runner.engine_config is config  # type: ignore[attr-defined]
        r = runner  # type: Any
        assert (r.block_size, r.num_kv_blocks, r.max_model_len) == (32, 48, 256)
        assert (str(r.dtype), r.kv_cache_dtype, r.device.type) == ("torch.float32", "int8", "cpu")
        assert r.attn_backend.name == "cpu" and r.spec is not None and r.spec.draft is None
        c = sched.config
        assert (c.block_size, c.num_kv_blocks, c.max_model_len) == (32, 48, 256)
        assert (c.max_num_batched_tokens, c.max_num_seqs) == (96, 7)
        assert (c.scheduling_policy, c.pinned_kv_fraction, c.session_ttl) == ("fcfs", 0.5, 60)
        assert c.enable_prefix_caching is False
        assert sched.spec is not None and sched.spec.k == 3
        assert (core.max_waiting_requests, core.max_waiting_tokens) == (9, 999)
        assert core.max_waiting_per_tenant == 5 and core.own_thread is False
    finally:
        asyncio.run(engine.shutdown())


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--block-size", "12"], "--block-size"),
        (["--pinned-kv-fraction", "1.5"], "--pinned-kv-fraction"),
        (["--max-num-seqs", "0"], "--max-num-seqs"),
        (["--nnodes", "2", "--node-rank", "2"], "--node-rank"),
        (["--speculative-method", "ngram", "--num-speculative-tokens", "40"], "--speculative-"),
        (["--pipeline-parallel-size", "2", *SPEC_BASE], "--speculative-"),
        (["--device", "tpu"], "--device"),
    ],
)
def test_a_bad_flag_is_refused_before_loading_naming_it(capsys, argv, flag):
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert "pagestream serve: error:" in err and flag in err


def test_hf_overrides_must_be_a_json_object(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--hf-overrides", "[1]"])
    assert e.value.code == 2 and "--hf-overrides" in capsys.readouterr().err
    a = build_parser().parse_args(["serve", "--hf-overrides", '{"num_labels": 3}'])
    assert engine_config(a).model.hf_overrides == {"num_labels": 3}


def test_llm_refuses_a_bad_or_unknown_setting_before_loading():
    from service.llm import LLM

    with pytest.raises(ConfigError, match=r"block_size \(--block-size\)"):
        LLM("/nowhere", block_size=12)
    with pytest.raises(ConfigError, match="unknown engine setting 'blocksize'"):
        LLM("/nowhere", blocksize=16)


def test_a_runner_takes_a_config_or_settings_not_both():
    from gpu.model_runner import ModelRunner

    with pytest.raises(TypeError, match="dtype"):
        ModelRunner("/nowhere", EngineConfig(), dtype="float32")


def test_the_attention_choices_are_the_backends():
    from gpu.attention import BACKEND_NAMES

    assert ATTENTION_BACKENDS == BACKEND_NAMES


def test_replace_and_flat_round_trip():
    c = EngineConfig.from_kwargs(model="m", block_size=64, speculative_config={"method": "ngram"})
    assert EngineConfig.from_kwargs(**c.flat()) == c
    assert c.replace(device="cuda:1").device.device == "cuda:1"
    assert c.replace(device="cuda:1").cache == c.cache
    with pytest.raises(ConfigError, match="--block-size"):
        c.replace(block_size=3)


def test_the_prefix_tier_and_the_ranks_read_their_groups(tmp_path):
    """The groups the engine test above does not reach on one CPU rank: the shared prefix
    tier's settings reach its TierConfig, the parallel ones every rank's Topology."""
    from types import SimpleNamespace

    from gpu.tp_executor import Topology
    from service.engine_setup import build_prefix_tier

    argv = [
        "--redis-url", "memory://", "--redis-hit-threshold", "3", "--redis-max-kv-memory",
        "0.5", "--redis-lookup-deadline", "0.25", "--block-size", "32", *KEYS,
        "--prefix-tier-key-share", "0.75", "--tensor-parallel-size", "2",
        "--pipeline-parallel-size", "2", "--pipeline-micro-batches", "3", "--nnodes", "2",
        "--master-addr", "10.0.0.1", "--master-port", "29500", "--tensor-parallel-timeout", "9",
    ]  # fmt: skip
    config = _config(argv)
    runner = SimpleNamespace(dtype="torch.float32", quantization=None, kv_payload_bytes=4096)
    tier = build_prefix_tier(config, runner, tmp_path)
    t = tier.cfg
    assert (t.hit_threshold, t.max_kv_bytes, t.lookup_deadline) == (3, 1 << 29, 0.25)
    assert t.tenant_share == 0.75 and t.meta["block_size"] == "32" and tier.name == "memory"
    topo = Topology.from_settings(config.parallel)
    assert (topo.tp_size, topo.pp_size, topo.micro_batches, topo.nnodes) == (2, 2, 3, 2)
    assert (topo.master_addr, topo.master_port, topo.timeout_s) == ("10.0.0.1", 29500, 9.0)


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        ([], None),
        (["--engine-process"], True),
        (["--engine-process", "on"], True),
        (["--engine-process", "off"], False),
        (["--engine-process", "auto"], None),
    ],
)
def test_engine_process_flag(argv, want):
    assert _config(argv).device.engine_process is want


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        (["--device", "cpu"], False),
        (["--device", "cuda"], True),
        (["--device", "cuda:1"], True),
        (["--device", "cuda", "--engine-process", "off"], False),
        (["--device", "cpu", "--engine-process"], True),
        (["--device", "cuda", "--redis-url", "redis://127.0.0.1:1"], True),
        (["--device", "cuda", "--tensor-parallel-size", "2"], True),
        (["--device", "cuda", "--pipeline-parallel-size", "2"], True),
        # A mode asked for by name keeps it here.
        (["--device", "cuda", "--engine-thread", "on"], False),
        (["--device", "cuda", "--engine-thread", "off"], False),
    ],
)
def test_serve_takes_the_engine_process_on_cuda_where_it_carries_everything(argv, want):
    from service.async_engine import engine_process_default

    assert engine_process_default(_config(argv)) is want


@pytest.mark.parametrize(
    "items, why",
    [(["sea"], "takes NAME=PATH"), (["sea=/a", "sea=/b"], "given twice"), (["=/a"], "NAME=PATH")],
)
def test_lora_modules_flag_is_checked(items, why):
    with pytest.raises(ConfigError, match=rf"--lora-modules\)? .*{why}|{why}"):
        _config(["--lora-modules", *items])
    assert _config(["--lora-modules", "a=/x", "b=/y"]).model.lora_modules == {"a": "/x", "b": "/y"}
