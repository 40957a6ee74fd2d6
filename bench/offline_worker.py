"""One local engine of the offline section (pagestream or transformers) in a process of
its own, driven like bench/vllm_offline.py: reads one JSON line {"engine", "model",
"dtype", "threads", "budget", "warm": [[prompt_ids, max_tokens], ...]}, warms up, prints
`READY {}`, then for every `run [[prompt_ids, max_tokens], ...]` line prints
`RESULT {"seconds", "tokens", "note"}`; exits at end of input.  With "beam": w in the spec
(pagestream only), each run is `LLM.beam_search` of width w, as bench/vllm_offline.py's;
with "embed": true, each run embeds the prompts (`LLM.embed`; transformers: its base
model's last hidden state over a left-padded batch), "tokens" counting prompt tokens, and
the result holds the first few vectors ("vectors") to compare engines by.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from bench.workloads import Item

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
EMBED_SHOWN = 4  # vectors a run returns, to compare the engines' by


class PagestreamEngine:
    label = "pagestream LLM.generate"

    def __init__(self, path: Path, dtype: str, args: argparse.Namespace, warm: list[Item]):
        from service.llm import LLM

        self.llm = LLM(
            str(path), dtype=dtype, max_num_batched_tokens=args.budget, threads=args.threads
        )
        self.width = args.beam
        self.beams: list[list[int]] | None = None
        self.embed = args.embed
        self.vectors: list[list[float]] | None = None
        if self.width:
            self._beams(warm)
        elif self.embed:
            self.llm.embed([w.prompt for w in warm])
        else:
            self.llm.generate([w.prompt for w in warm], self._params(warm))

    def _beams(self, items: list[Item]) -> list[list[int]]:
        from service.beam_search import BeamSearchParams

        params = BeamSearchParams(
            beam_width=self.width, max_tokens=items[0].max_tokens, ignore_eos=True
        )
        outs = self.llm.beam_search([w.prompt for w in items], params)
        return [o.sequences[0].tokens[len(w.prompt) :] for o, w in zip(outs, items, strict=True)]

    @staticmethod
    def _params(items: list[Item]):
        from scheduler.sampling_params import SamplingParams

        return [
            SamplingParams(temperature=0, max_tokens=w.max_tokens, ignore_eos=True) for w in items
        ]

    def run(self, work: list[Item]) -> tuple[float, int]:
        steps = self.llm.engine.core.num_steps
        t = time.perf_counter()
        if self.width:
            self.beams = self._beams(work)
            dt = time.perf_counter() - t
            self.note = f"{self.llm.engine.core.num_steps - steps} steps"
            return dt, sum(map(len, self.beams)) * self.width
        if self.embed:
            vecs = self.llm.embed([w.prompt for w in work])
            dt = time.perf_counter() - t
            self.vectors = [v.outputs.embedding for v in vecs[:EMBED_SHOWN]]
            self.note = f"{self.llm.engine.core.num_steps - steps} steps"
            return dt, sum(len(w.prompt) for w in work)
        outs = self.llm.generate([w.prompt for w in work], self._params(work))
        dt = time.perf_counter() - t
        got = sum(len(o.outputs[0].token_ids) for o in outs)
        assert got == sum(w.max_tokens for w in work), got
        self.note = f"{self.llm.engine.core.num_steps - steps} steps"
        return dt, got

    def close(self) -> None:
        self.llm.shutdown()


class TransformersEngine:
    """One padded batch: every row runs to the longest output (only the tokens each
    request asked for count as useful)."""

    label = "transformers generate() (padded batch)"
    note = ""

    def __init__(self, path: Path, dtype: str, args: argparse.Namespace, warm: list[Item]):
        from transformers import AutoModelForCausalLM

        self.embed = args.embed
        self.vectors: list[list[float]] | None = None
        if self.embed:
            from transformers import AutoModel

            self.hf = AutoModel.from_pretrained(path, dtype=DTYPES[dtype]).eval()
            self._embed(warm)
        else:
            self.hf = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).eval()
            self._generate(warm)

    @staticmethod
    def _left_padded(items: list[Item]) -> tuple[torch.Tensor, torch.Tensor]:
        maxlen = max(len(w.prompt) for w in items)
        ids = torch.zeros(len(items), maxlen, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, w in enumerate(items):
            ids[i, maxlen - len(w.prompt) :] = torch.tensor(w.prompt)
            mask[i, maxlen - len(w.prompt) :] = 1
        return ids, mask

    def _embed(self, items: list[Item]) -> list[list[float]]:
        """Last-token pooling as sentence-transformers runs it on a decoder: one padded
        batch (left-padded, so every row's last position is its last token)."""
        ids, mask = self._left_padded(items)
        with torch.inference_mode():
            h = self.hf(input_ids=ids, attention_mask=mask).last_hidden_state[:, -1]
        return torch.nn.functional.normalize(h.float(), dim=-1).tolist()

    def _generate(self, items: list[Item]) -> None:
        ids, mask = self._left_padded(items)
        longest = max(w.max_tokens for w in items)
        with torch.inference_mode():
            self.hf.generate(
                ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                do_sample=False, pad_token_id=0,
            )  # fmt: skip

    def run(self, work: list[Item]) -> tuple[float, int]:
        t = time.perf_counter()
        if self.embed:
            self.vectors = self._embed(work)[:EMBED_SHOWN]
            return time.perf_counter() - t, sum(len(w.prompt) for w in work)
        self._generate(work)
        return time.perf_counter() - t, sum(w.max_tokens for w in work)

    def close(self) -> None:
        del self.hf


ENGINES = {"pagestream": PagestreamEngine, "transformers": TransformersEngine}


def main() -> None:
    spec = json.loads(sys.stdin.readline())
    torch.set_num_threads(spec["threads"])
    args = argparse.Namespace(
        threads=spec["threads"],
        budget=spec.get("budget"),
        beam=spec.get("beam"),
        embed=bool(spec.get("embed")),
    )
    warm = [Item(p, m) for p, m in spec["warm"]]
    engine = ENGINES[spec["engine"]](Path(spec["model"]), spec["dtype"], args, warm)
    print("READY {}", flush=True)
    for line in sys.stdin:
        if not line.startswith("run "):
            break
        work = [Item(p, m) for p, m in json.loads(line[4:])]
        seconds, tokens = engine.run(work)
        result = {"seconds": seconds, "tokens": tokens, "note": engine.note}
        if getattr(engine, "beams", None) is not None:
            result["beams"] = engine.beams
        if getattr(engine, "vectors", None) is not None:
            result["vectors"] = engine.vectors
        print("RESULT " + json.dumps(result), flush=True)
    engine.close()


if __name__ == "__main__":
    main()
