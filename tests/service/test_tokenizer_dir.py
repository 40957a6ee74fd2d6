"""--tokenizer DIR (vLLM's): a checkpoint without tokenizer files is served with another
directory's, and text, chat, grammars and stop tokens all go through it: the output is the
one of the same checkpoint with its own files."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from gpu.config import ModelLoadError
from scheduler.sampling_params import SamplingParams, StructuredOutputsParams
from service.llm import LLM
from tests.checkpoints import tiny_checkpoint

ENGINE = dict(dtype="float32", num_kv_blocks=64, max_model_len=128, threads=1)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")  # fmt: skip


def _split(src: Path, root: Path) -> tuple[Path, Path]:
    """The checkpoint's weights and config in one directory, its tokenizer in another."""
    weights, tok = root / "weights", root / "tokenizer"
    weights.mkdir()
    tok.mkdir()
    for f in src.iterdir():
        shutil.copy(f, (tok if f.name in TOKENIZER_FILES else weights) / f.name)
    assert not (weights / "tokenizer.json").exists() and (tok / "tokenizer.json").exists()
    return weights, tok


def _outputs(llm: LLM) -> list[list[int]]:
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    json_list = SamplingParams(
        temperature=0, max_tokens=24,
        structured_outputs=StructuredOutputsParams(json='{"type": "array", "maxItems": 3}'),
    )  # fmt: skip
    texts = [o.outputs[0].token_ids for o in llm.generate(["one two three", "def f():"], greedy)]
    chat = llm.chat([{"role": "user", "content": "hello there"}], greedy)[0].outputs[0]
    constrained = llm.generate(["a list:"], json_list)[0].outputs[0]
    return [*texts, chat.token_ids, constrained.token_ids]


def test_a_checkpoint_served_with_another_directorys_tokenizer(tmp_path: Path) -> None:
    src = tiny_checkpoint("llama")
    weights, tok = _split(src, tmp_path)
    with pytest.raises((ModelLoadError, ValueError), match=r"tokenizer\.json"):
        LLM(str(weights), **ENGINE)
    with LLM(str(src), **ENGINE) as own:
        want = _outputs(own)
    with LLM(str(weights), tokenizer=str(tok), **ENGINE) as split:
        assert split.engine.config.model.tokenizer == str(tok)
        got = _outputs(split)
    assert got == want
