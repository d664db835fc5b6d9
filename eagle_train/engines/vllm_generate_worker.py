"""Runs inside vLLM's own environment: vLLM writes the target's replies for regeneration.

    .venv-vllm/bin/python vllm_generate_worker.py REPLY_FD      (requests on stdin, one JSON line each)

Standard library and vllm only, never this package. Every request's prompts (token ids, rendered by the
caller with the target's chat template) go to vLLM at once: its continuous batching keeps up to
`max_num_seqs` of them running. Greedy at temperature 0; sampled replies draw with vLLM's own generator,
seeded per prompt by the caller.

    first line:  {model, dtype, max_model_len, tensor_parallel_size, max_num_seqs, gpu_memory_utilization}
                                                     -> {"ready": true, "vllm_version": "..."}
    then:        {"prompts": [[int]], "seeds": [int], max_tokens, temperature, top_p, stop_token_ids}
                                                     -> {"replies": [{"tokens": [int], "finish": str}]}
    at the end:  {"quit": true}
"""

from __future__ import annotations

import sys

from vllm_worker_loop import load_llm, serve  # a sibling: this directory is first on sys.path


def generate(llm, request: dict) -> dict:
    """Every prompt's reply: its token ids as vLLM returns them and vLLM's finish reason (stop / length)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    greedy = request["temperature"] == 0
    params = [
        SamplingParams(
            temperature=request["temperature"],
            top_p=1.0 if greedy else request["top_p"],
            seed=None if greedy else seed,
            max_tokens=request["max_tokens"],
            stop_token_ids=request["stop_token_ids"],
            detokenize=False,
        )
        for seed in request["seeds"]
    ]
    prompts = [TokensPrompt(prompt_token_ids=p) for p in request["prompts"]]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return {
        "replies": [
            {"tokens": list(o.outputs[0].token_ids), "finish": o.outputs[0].finish_reason} for o in outputs
        ]
    }


if __name__ == "__main__":
    sys.exit(serve(sys.argv, load_llm, generate))
