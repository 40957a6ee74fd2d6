"""lm-eval, unchanged, against a live server: `local-completions` (multiple choice,
greedy generation, rolling loglikelihood) and `local-chat-completions` (greedy generation
through the chat template) on small local tasks, compared item by item with lm-eval's own
`hf` backend on the same checkpoint: loglikelihoods within 1e-4, the same greedy flags,
identical generations.

Nothing is downloaded: the tasks are YAML written here over JSONL files (read by the
`datasets` package's json builder), and the checkpoint is the directory the server reads.
"""

from __future__ import annotations

import json
import math
from operator import itemgetter
from pathlib import Path
from typing import Any

import lm_eval
import pytest
from lm_eval.models.openai_completions import LocalCompletionsAPI
from lm_eval.tasks import TaskManager

from tests.clients.conftest import MODEL_NAME as MODEL

LL_TOL = 1e-4

MC = [
    ("def add(a, b):\n    return", [" a + b", " a - b", " None"], 0),
    ("import", [" os", " banana", " 42"], 0),
    ("for i in", [" range(10):", " the house", ")"], 0),
    ("class Parser(", ["object):", "import", "12"], 0),
    ("    def __init__(self", ["):", ", name):", " + 1"], 1),
    ("if __name__ ==", [' "__main__":', " 3", " import"], 0),
]
GEN = [
    "import os\nimport",
    "class Parser:\n    def",
    "def main():\n    ",
    "    for key, value in",
    "try:\n    import",
    '"""Return the',
]
ROLLING = [
    "def f(x):\n    return x * 2\n",
    "import sys\n\nprint(sys.argv)\n",
    "class A:\n    pass\n",
]


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory) -> TaskManager:
    d = tmp_path_factory.mktemp("lm_eval_tasks")
    cache = d / "hf_datasets"

    def task(name: str, rows: list[dict[str, Any]], body: str) -> None:
        data = _jsonl(d / f"{name}.jsonl", rows)
        head = (
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {data}\n  cache_dir: {cache}\ntest_split: test\n"
        )
        (d / f"{name}.yaml").write_text(head + body)

    gen_body = (
        'output_type: generate_until\ndoc_to_text: "{{prompt}}"\ndoc_to_target: ""\n'
        'generation_kwargs:\n  until: ["\\n\\n"]\n  max_gen_toks: 24\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n"
    )
    task(
        "ps_mc",
        [{"q": q, "choices": c, "gold": g} for q, c, g in MC],
        'output_type: multiple_choice\ndoc_to_text: "{{q}}"\ndoc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{gold}}"\nmetric_list:\n  - metric: acc\n',
    )
    task("ps_gen", [{"prompt": p} for p in GEN], gen_body)
    task(
        "ps_rolling",
        [{"text": t} for t in ROLLING],
        'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n",
    )
    task("ps_chat", [{"prompt": p} for p in GEN[:4]], gen_body)
    return TaskManager(include_path=str(d), include_defaults=False)


COMPLETION_TASKS = ["ps_mc", "ps_gen", "ps_rolling"]


def _run(model: Any, tasks: TaskManager, names: list[str], **kw: Any) -> dict[str, list]:
    out = lm_eval.simple_evaluate(
        model=model, tasks=names, task_manager=tasks, log_samples=True, batch_size=1, **kw
    )
    return {t: sorted(out["samples"][t], key=itemgetter("doc_id")) for t in names}


@pytest.fixture(scope="module")
def hf(model_dir: Path, tasks: TaskManager) -> dict[str, list]:
    """lm-eval's own transformers backend on the directory the server reads, float32
    both sides."""
    args = {"pretrained": str(model_dir), "dtype": "float32", "device": "cpu"}
    samples = _run("hf", tasks, COMPLETION_TASKS, model_args=args)
    samples |= _run("hf", tasks, ["ps_chat"], model_args=args, apply_chat_template=True)
    return samples


def _completions_args(server: Any, model_dir: Path) -> dict[str, Any]:
    return {
        "model": MODEL,
        "base_url": server.url + "/v1/completions",
        "tokenizer_backend": "huggingface",  # the same token ids as the hf backend
        "tokenizer": str(model_dir),
        "num_concurrent": 1,
        "max_retries": 1,  # a refused request must fail the test, not loop
    }


def _assert_same(api: dict[str, list], ref: dict[str, list], names: list[str]) -> None:
    for name in names:
        assert len(api[name]) == len(ref[name]) > 0, name
        for a, b in zip(api[name], ref[name], strict=True):
            assert a["doc_id"] == b["doc_id"]
            for (got,), (want,) in zip(a["resps"], b["resps"], strict=True):
                where = f"{name} doc {a['doc_id']}"
                if isinstance(want, str):
                    assert got == want, where  # greedy text, identical
                elif isinstance(want, float):
                    assert math.isclose(got, want, abs_tol=LL_TOL), where  # rolling
                else:
                    (ll, greedy), (ll_ref, greedy_ref) = got, want
                    assert math.isclose(ll, ll_ref, abs_tol=LL_TOL), (where, ll, ll_ref)
                    assert greedy == greedy_ref, where


def test_local_completions_matches_hf(server, model_dir, tasks, hf):
    api = _run("local-completions", tasks, COMPLETION_TASKS,
               model_args=_completions_args(server, model_dir))  # fmt: skip
    _assert_same(api, hf, COMPLETION_TASKS)
    assert any(g for s in hf["ps_gen"] for (g,) in s["resps"])  # not all empty


def test_local_chat_completions_matches_hf(server, tasks, hf):
    args = {"model": MODEL, "base_url": server.url + "/v1/chat/completions",
            "num_concurrent": 1, "max_retries": 1}  # fmt: skip
    api = _run("local-chat-completions", tasks, ["ps_chat"], model_args=args,
               apply_chat_template=True)  # fmt: skip
    _assert_same(api, hf, ["ps_chat"])


class EchoOnlyCompletions(LocalCompletionsAPI):
    """lm-eval 0.4.3's loglikelihood request, replayed through this version's client:
    `echo: true, logprobs: 1, max_tokens: 0`, so the reply holds the prompt alone and
    every token from the context's end on is scored (0.4.13 asks for one token more
    and drops it)."""

    def _create_payload(self, messages, generate=False, gen_kwargs=None, seed=1234, **kw):
        payload = super()._create_payload(messages, generate, gen_kwargs, seed, **kw)
        if not generate:
            payload["max_tokens"] = 0
        return payload

    @staticmethod
    def parse_logprobs(outputs, tokens=None, ctxlens=None, **kw) -> list[tuple[float, bool]]:
        res = []
        for out in outputs if isinstance(outputs, list) else [outputs]:
            choices = sorted(out["choices"], key=itemgetter("index"))
            for choice, ctxlen in zip(choices, ctxlens, strict=True):
                lps = choice["logprobs"]["token_logprobs"][ctxlen:]
                tops = choice["logprobs"]["top_logprobs"][ctxlen:]
                greedy = all(v == max(top.values()) for v, top in zip(lps, tops, strict=True))
                res.append((sum(lps), greedy))
        return res


def test_echo_only_loglikelihood_requests_match_hf(server, model_dir, tasks, hf):
    lm = EchoOnlyCompletions(**_completions_args(server, model_dir))
    api = _run(lm, tasks, ["ps_mc", "ps_rolling"])
    _assert_same(api, hf, ["ps_mc", "ps_rolling"])
