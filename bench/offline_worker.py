"""One local engine of the offline section (pagestream or transformers) in a process of
its own, driven like bench/vllm_offline.py: reads one JSON line {"engine", "model",
"dtype", "threads", "budget", "warm": [[prompt_ids, max_tokens], ...]}, warms up, prints
`READY {}`, then for every `run [[prompt_ids, max_tokens], ...]` line prints
`RESULT {"seconds", "tokens", "note"}`; exits at end of input.  With "beam": w in the spec
(pagestream only), each run is `LLM.beam_search` of width w, as bench/vllm_offline.py's.
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


class PagestreamEngine:
    label = "pagestream LLM.generate"

    def __init__(self, path: Path, dtype: str, args: argparse.Namespace, warm: list[Item]):
        from service.llm import LLM

        self.llm = LLM(
            str(path), dtype=dtype, max_num_batched_tokens=args.budget, threads=args.threads
        )
        self.width = args.beam
        self.beams: list[list[int]] | None = None
        if self.width:
            self._beams(warm)
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

        self.hf = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).eval()
        self._generate(warm)

    def _generate(self, items: list[Item]) -> None:
        maxlen = max(len(w.prompt) for w in items)
        ids = torch.zeros(len(items), maxlen, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, w in enumerate(items):
            ids[i, maxlen - len(w.prompt) :] = torch.tensor(w.prompt)
            mask[i, maxlen - len(w.prompt) :] = 1
        longest = max(w.max_tokens for w in items)
        with torch.inference_mode():
            self.hf.generate(
                ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                do_sample=False, pad_token_id=0,
            )  # fmt: skip

    def run(self, work: list[Item]) -> tuple[float, int]:
        t = time.perf_counter()
        self._generate(work)
        return time.perf_counter() - t, sum(w.max_tokens for w in work)

    def close(self) -> None:
        del self.hf


ENGINES = {"pagestream": PagestreamEngine, "transformers": TransformersEngine}


def main() -> None:
    spec = json.loads(sys.stdin.readline())
    torch.set_num_threads(spec["threads"])
    args = argparse.Namespace(
        threads=spec["threads"], budget=spec.get("budget"), beam=spec.get("beam")
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
        print("RESULT " + json.dumps(result), flush=True)
    engine.close()


if __name__ == "__main__":
    main()
