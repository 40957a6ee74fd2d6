"""Third-party clients, run unchanged against a live `pagestream serve` on 127.0.0.1.

One server for the package: the embedded trained pair's target (real text, so greedy runs
and lm-eval's comparisons mean something), read as float32 so lm-eval's own `hf` backend
can load the same directory and compute the same numbers, with a Hermes chat template
(tools in the system block, calls in `<tool_call>`) and `--tool-call-parser hermes`.
The versions these tests prove are pinned in pyproject.toml's `clients` extra.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.reliability.watch import ServeProcess, serve_process
from tests.service.test_structured_api import HERMES_TEMPLATE

# Nothing here may reach a hub: the checkpoint, tokenizer and lm-eval's data are local.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

PAIR_TARGET = Path(__file__).resolve().parents[2] / "modelkit" / "pair" / "target"
MODEL_NAME = "tiny"


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dst = tmp_path_factory.mktemp("clients") / "model"
    shutil.copytree(PAIR_TARGET, dst)
    cfg_path = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = HERMES_TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="session")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    args = ("--dtype", "float32", "--served-model-name", MODEL_NAME, "--tool-call-parser", "hermes")
    with serve_process(str(model_dir), *args, log_dir=tmp_path_factory.mktemp("serve")) as s:
        yield s


@pytest.fixture(scope="module")
def oai(server: ServeProcess) -> openai.OpenAI:
    """The official openai client on the server: the oracle the other clients meet."""
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def greedy_chat(client: openai.OpenAI, messages: list[dict], max_tokens: int) -> str:
    """The server's greedy answer to `messages`, through the openai client."""
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=max_tokens, temperature=0
    )
    return r.choices[0].message.content or ""
