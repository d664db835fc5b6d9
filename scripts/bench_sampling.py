"""Acceptance when sampling (temperature > 0): children drawn from the draft's q (`sample_children=true`,
as the reference's EAGLE-1 does) against its top-k children (`false`), for the chain and the EAGLE-1
trees, with EAGLE-2 (always top-k children) beside them. Both rules are lossless; what differs is how
many draft tokens a round accepts, i.e. tau (accepted + 1 per round) and acceptance by position.

Every configuration decodes the same TinyStories prompts (not the ones a head is trained on) with the
same --seeds seeds each, on stories260K with a trained head (--draft DIR, e.g. one saved by
`scripts/bench_decode.py --save-draft DIR`). tau is pooled over all rounds; its spread is the standard
error over prompts x seeds.

    python scripts/bench_sampling.py --draft DIR [--prompts 16] [--seeds 4] [--temperatures 0.7 1.0]
Writes bench_results/sampling.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
from omegaconf import OmegaConf

from eagle_train.config import CONF_DIR, TargetConfig, data_path, to_schema
from eagle_train.config.decode import DecodeConfig
from eagle_train.decoding.decoder import SpeculativeDecoder
from eagle_train.decoding.stats import acceptance_by_position, mean_accept_length
from eagle_train.modeling.head_checkpoint import load_head
from eagle_train.modeling.target import load_target

REPO_ROOT = Path(__file__).resolve().parents[1]
METHODS = {
    "chain4": DecodeConfig(method="chain", chain_length=4),
    "eagle1_mc_sim_7b_63": DecodeConfig(method="static_tree", tree="mc_sim_7b_63"),
    "eagle1_cpu_small": DecodeConfig(method="static_tree", tree="cpu_small"),
}
EAGLE2 = DecodeConfig(method="dynamic_tree", depth=5, top_k=10, total_tokens=60)


def load_prompts(tokenizer, n: int) -> list[list[int]]:
    lines = (data_path("tinystories") / "tinystories_prompts.jsonl").read_text().splitlines()[:n]
    return [tokenizer(json.loads(line)["prompt"])["input_ids"] for line in lines]


def measure(target, head, cfg: DecodeConfig, prompts, seeds: int) -> dict:
    """tau pooled over every round of every (prompt, seed), acceptance by position, per-run tau spread."""
    accepted, depths, per_run = [], [], []
    for p, prompt in enumerate(prompts):
        for seed in range(seeds):
            decoder = SpeculativeDecoder(target, head, replace(cfg, seed=1000 * p + seed))
            stats = decoder.generate(prompt).stats
            accepted += stats.accepted_per_round
            depths += stats.tree_depth_per_round
            per_run.append(stats.tau)
    spread = statistics.stdev(per_run) / len(per_run) ** 0.5 if len(per_run) > 1 else 0.0
    return {
        "tau": mean_accept_length(a + 1 for a in accepted),
        "tau_stderr": spread,
        "rounds": len(accepted),
        "acceptance_by_position": acceptance_by_position(accepted, depths),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft", required=True, help="a trained stories260K head (save_head layout)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0])
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(REPO_ROOT / "bench_results" / "sampling.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(to_schema(OmegaConf.load(CONF_DIR / "target" / "stories260k.yaml"), TargetConfig))
    head, _ = load_head(args.draft)
    head.share_target_weights(target)
    head.eval()
    prompts = load_prompts(target.tokenizer, args.prompts)
    rows = []
    start = time.perf_counter()
    for temperature in args.temperatures:
        sampling = dict(temperature=temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens)
        for name, cfg in METHODS.items():
            pair = {
                children: measure(
                    target, head, replace(cfg, sample_children=children, **sampling), prompts, args.seeds
                )
                for children in (False, True)
            }
            rows.append(
                {"temperature": temperature, "method": name, "topk": pair[False], "sampled": pair[True]}
            )
        rows.append(
            {
                "temperature": temperature,
                "method": "eagle2_60_5_10",
                "topk": measure(target, head, replace(EAGLE2, **sampling), prompts, args.seeds),
                "sampled": None,
            }
        )
    print(
        f"{len(prompts)} prompts x {args.seeds} seeds, {args.max_new_tokens} new tokens, top_p {args.top_p}"
    )
    print(f"{'T':>4} {'method':22} | {'tau top-k children':>20} | {'tau sampled from q':>20} | {'ratio':>6}")
    for r in rows:
        t, s = r["topk"], r["sampled"]
        left = f"{t['tau']:.3f} +- {t['tau_stderr']:.3f}"
        right = f"{s['tau']:.3f} +- {s['tau_stderr']:.3f}" if s else "-"
        ratio = f"{t['tau'] / s['tau']:.3f}" if s else "-"
        print(f"{r['temperature']:4.1f} {r['method']:22} | {left:>20} | {right:>20} | {ratio:>6}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"args": vars(args), "rows": rows, "seconds": time.perf_counter() - start}, indent=2)
        + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
