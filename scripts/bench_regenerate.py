"""Regeneration throughput: new tokens/s of batched left-padded `generate` against one prompt at a time.

Same prompts (TinyStories first sentences), same target (stories260K), greedy, measured side by side
in one run: each repeat times every setting once, interleaved; medians over repeats. Also counts
replies where the batched greedy output differs from the one-at-a-time output (should be 0).

    python scripts/bench_regenerate.py [--prompts 16] [--new-tokens 48] [--repeats 3] [--threads 2 1]
Writes bench_results/regenerate.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from omegaconf import OmegaConf

from eagle_train.config import TargetConfig, to_schema
from eagle_train.config.base import CONF_DIR, REPO_ROOT
from eagle_train.data.render import ChatRenderer
from eagle_train.modeling.target import load_target
from eagle_train.regenerate import generate_batch

PROMPTS = REPO_ROOT / ".." / "shared" / "data" / "tinystories" / "tinystories_prompts.jsonl"


def timed(target, prompts, batch_size, new_tokens):
    """(seconds, new tokens, replies) for all prompts in batches of `batch_size`."""
    start, replies = time.perf_counter(), []
    for lo in range(0, len(prompts), batch_size):
        replies += generate_batch(target, prompts[lo : lo + batch_size], new_tokens)
    return time.perf_counter() - start, sum(len(r) for r, _ in replies), replies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    args = parser.parse_args()

    target = load_target(to_schema(OmegaConf.load(CONF_DIR / "target" / "stories260k.yaml"), TargetConfig))
    renderer = ChatRenderer(target.tokenizer, target.cfg)
    lines = PROMPTS.resolve().read_text().splitlines()[: args.prompts]
    prompts = [renderer.render_prompt([{"role": "user", "content": json.loads(x)["prompt"]}]) for x in lines]
    settings = [(t, b) for t in args.threads for b in args.batch_sizes]
    times: dict = {s: [] for s in settings}
    tokens, outputs = {}, {}
    for _ in range(args.repeats):
        for threads, batch in settings:
            torch.set_num_threads(threads)
            seconds, tokens[(threads, batch)], outputs[(threads, batch)] = timed(
                target, prompts, batch, args.new_tokens
            )
            times[(threads, batch)].append(seconds)
    base = outputs[settings[0]]
    rows = []
    for threads, batch in settings:
        median = statistics.median(times[(threads, batch)])
        single = statistics.median(times[(threads, 1)]) if (threads, 1) in times else None
        rows.append(
            {
                "threads": threads,
                "batch_size": batch,
                "median_s": round(median, 3),
                "tokens_per_s": round(tokens[(threads, batch)] / median, 1),
                "speedup_vs_batch1": round(single / median, 2) if single else None,
                "replies_differing_from_first_setting": sum(
                    a != b for a, b in zip(outputs[(threads, batch)], base, strict=True)
                ),
                "all_times_s": [round(t, 3) for t in times[(threads, batch)]],
            }
        )
    print(f"{'threads':>7} {'batch':>5} {'median s':>9} {'tok/s':>8} {'x batch1':>8} {'differ':>6}")
    for r in rows:
        print(
            f"{r['threads']:>7} {r['batch_size']:>5} {r['median_s']:>9} {r['tokens_per_s']:>8} "
            f"{r['speedup_vs_batch1']!s:>8} {r['replies_differing_from_first_setting']:>6}"
        )
    out = REPO_ROOT / "bench_results" / "regenerate.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "prompts": len(prompts), "rows": rows}, indent=2) + "\n")
    print(f"saved {out}")


if __name__ == "__main__":
    main()
