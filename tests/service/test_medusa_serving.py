"""A live server speculating with Medusa heads trained on the shipped pair's target by
`pagestream train-medusa` (a short run, cached between test runs): the same greedy text as
without speculation, several tokens per streamed delta (trees accepted), sampling through
the tree (temperature > 0) ending normally, cancellation with no leaked blocks, and the
speculation metrics."""

from __future__ import annotations

import asyncio
import hashlib
import json
import urllib.request
from pathlib import Path

import openai
import pytest
import websockets

from modelkit.make_model import cache_root
from scheduler.sampling_params import SamplingParams
from service.engine_setup import default_model_dir
from service.llm import LLM
from tests.service.live_server import live_server
from tests.service.test_spec_serving import PROMPT, TIE_MARGIN

# (training the heads takes a minute or two on 2 cores)
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def heads() -> str:
    from modelkit.medusa_train import train_medusa

    target = default_model_dir()
    weights = (target / "model.safetensors").read_bytes()
    key = hashlib.sha256(weights).hexdigest()[:12]
    out = cache_root() / "test-medusa" / f"pair-{key}"
    if not (out / "config.json").is_file():
        tmp = out.with_name(out.name + ".tmp")
        train_medusa(target, tmp, steps=60, batch_size=4, corpus_bytes=300_000)
        tmp.rename(out)
    return str(out)


@pytest.fixture(scope="module")
def reference() -> list[int]:
    llm = LLM(str(default_model_dir()), dtype="float32", num_kv_blocks=128, threads=1)
    try:
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
        out = llm.generate([PROMPT], params)[0].outputs[0]
    finally:
        llm.shutdown()
    gaps = [t.top_logprobs[0] - t.top_logprobs[1] for t in out.logprobs]
    decided = next((i for i, g in enumerate(gaps) if g < TIE_MARGIN), len(gaps))
    assert decided >= 20, f"near-tie at token {decided}: pick another prompt"
    return out.token_ids[:decided]


@pytest.fixture(scope="module")
def server(heads):
    cfg = {"method": "medusa", "model": heads, "num_speculative_tokens": 4,
           "min_acceptance_rate": 0.0}  # fmt: skip
    kw = {"speculative_config": cfg, "threads": 1, "num_kv_blocks": 128}
    with live_server(str(default_model_dir()), served_model_name="pair", engine_kwargs=kw) as s:
        # Every decode step speculates: these tests are about the tree's path through the
        # server, and the cost policy may rightly find speculating not worth it on a
        # loaded machine (its own tests are in tests/scheduler).
        s.engine.scheduler.spec.policy.choose = lambda *a, **k: True
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_greedy_stream_equals_no_speculation_and_trees_are_accepted(server, reference):
    async def run() -> list[list[int]]:
        async with websockets.connect(server.ws_url) as ws:
            params = {"temperature": 0, "max_tokens": 40, "ignore_eos": True}
            await ws.send(
                json.dumps({"type": "generate", "id": "a", "prompt": PROMPT, "params": params})
            )
            deltas = []
            while True:
                frame = json.loads(await ws.recv())
                if frame["type"] == "delta":
                    deltas.append(frame["token_ids"])
                elif frame["type"] == "done":
                    return deltas
                else:
                    raise AssertionError(frame)

    deltas = asyncio.run(run())
    streamed = [t for d in deltas for t in d]
    assert len(streamed) == 40
    assert streamed[: len(reference)] == reference
    assert max(len(d) for d in deltas) > 1, "no step accepted a tree level"
    server.wait_kv_free()


def test_sampling_through_the_tree(client, server):
    """Unseeded sampling drafts (seeded requests never do): it runs the tree's rejection
    sampling and ends normally, with logprobs for every token."""
    r = client.completions.create(
        model="pair", prompt=PROMPT, max_tokens=24, temperature=0.8, logprobs=1,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    c = r.choices[0]
    assert r.usage.completion_tokens == 24 and c.finish_reason == "length"
    assert len(c.logprobs.tokens) == 24
    server.wait_kv_free()


def test_cancel_mid_stream_frees_blocks(client, server):
    stream = client.completions.create(
        model="pair", prompt=PROMPT, max_tokens=200, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    server.wait_kv_free(timeout=20)


def test_spec_metrics(client, server):
    client.completions.create(model="pair", prompt=PROMPT, max_tokens=16, temperature=0)
    with urllib.request.urlopen(server.url + "/metrics") as r:
        text = r.read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith("pagestream_spec_decode_"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    drafts = values['pagestream_spec_decode_drafts_total{model_name="pair"}']
    levels = values['pagestream_spec_decode_draft_tokens_total{model_name="pair"}']
    accepted = values['pagestream_spec_decode_accepted_tokens_total{model_name="pair"}']
    # Medusa counts tree levels (its depth), not nodes: at most 4 a verify.
    assert drafts > 0 and drafts <= levels <= 4 * drafts and 0 < accepted <= levels


def test_heads_dir_is_a_public_layout_checkpoint(heads):
    cfg = json.loads((Path(heads) / "config.json").read_text())
    assert cfg["medusa_num_heads"] == 4 and cfg["medusa_num_layers"] == 1
    assert (Path(heads) / "medusa_lm_head.safetensors").is_file()
