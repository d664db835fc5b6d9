"""Runs inside vLLM's own environment (`.venv-vllm/bin/python vllm_worker.py REQUEST.json RESULT.json`):
standard library and vllm only, never this package (whose torch may differ).

The request names the target, the prompts (token ids), the decoding limits and a list of runs, each an
`LLM(...)` with or without a `speculative_config`. Each run decodes every prompt greedily, one at a
time (batch size 1, as the built-in decoder), and reads vLLM's own cumulative spec-decode counters
(`llm.get_metrics()`) after the warm-up and after each prompt (the caller takes the differences):

    request: {model, dtype, max_model_len, seed, max_tokens, stop_token_ids, prompts: [[int]], warmup,
              runs: [{name, speculative_config: {method, model, num_speculative_tokens} | null}]}
    result:  {vllm_version, runs: [{name, load_s, spec_start: COUNTS, outputs: [{tokens, wall_s,
              spec_total: COUNTS}]}]}     COUNTS = {num_drafts, num_draft_tokens, num_accepted_tokens,
                                                    accepted_per_pos: [int]}

A run that vLLM refuses (a head it cannot load) is reported as {name, error} and the next run goes on;
put runs expected to fail last. The result file is written once, at the end.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback

COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"
RUN_MARK = "@@ eagle_train run: "


def spec_counters(llm) -> dict:
    """vLLM's cumulative spec-decode counters so far (zeros without speculation)."""
    counts = {field: 0 for field in COUNTERS.values()}
    counts["accepted_per_pos"] = []
    for metric in llm.get_metrics():
        if metric.name in COUNTERS:
            counts[COUNTERS[metric.name]] = int(metric.value)
        elif metric.name == PER_POSITION:
            counts["accepted_per_pos"] = [int(v) for v in metric.values]
    return counts


def run_one(request: dict, run: dict) -> dict:
    """One LLM (loaded, used on every prompt, released)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    llm = LLM(
        model=request["model"],
        speculative_config=run.get("speculative_config"),
        dtype=request["dtype"],
        max_model_len=request["max_model_len"],
        seed=request["seed"],
        enforce_eager=True,
        disable_log_stats=False,
        max_num_seqs=1,
        max_num_batched_tokens=request["max_model_len"],
    )
    load_s = time.perf_counter() - start
    params = SamplingParams(
        temperature=0.0,
        max_tokens=request["max_tokens"],
        stop_token_ids=request["stop_token_ids"],
        detokenize=False,
    )
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]]
    for prompt in prompts[: request.get("warmup", 0)]:  # untimed, uncounted
        llm.generate([prompt], params, use_tqdm=False)
    spec_start, outputs = spec_counters(llm), []
    for prompt in prompts:
        start = time.perf_counter()
        result = llm.generate([prompt], params, use_tqdm=False)[0]
        wall = time.perf_counter() - start
        outputs.append(
            {"tokens": list(result.outputs[0].token_ids), "wall_s": wall, "spec_total": spec_counters(llm)}
        )
    del llm
    gc.collect()
    return {"name": run["name"], "load_s": load_s, "spec_start": spec_start, "outputs": outputs}


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: vllm_worker.py REQUEST.json RESULT.json", file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        request = json.load(f)
    import vllm

    runs = []
    for run in request["runs"]:
        print(f"{RUN_MARK}{run['name']}", flush=True)  # the caller splits the log into runs here
        sys.stderr.flush()
        try:
            runs.append(run_one(request, run))
        except Exception as err:  # this run's head or config was refused: report it, go on with the next
            traceback.print_exc()
            runs.append({"name": run["name"], "error": f"{type(err).__name__}: {err}"})
    tmp = argv[2] + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"vllm_version": vllm.__version__, "runs": runs}, f)
    os.replace(tmp, argv[2])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
