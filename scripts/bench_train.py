"""Training throughput on CPU: the DataLoader path against the in-loop reading it replaced, bucketed vs
unbucketed batches, offline (store) vs online (target in the loop).

    python scripts/bench_train.py                       # throughput table -> bench_results/train.json
    python scripts/bench_train.py --quality [--regenerated FILE] [--minutes 10]
                                                        # held-out quality -> bench_results/train_quality.json

Throughput: each variant trains stories260K for `--steps` optimizer steps with the default batch budget in a
fresh child process (so peak RSS is its own), repeated `--repeats` times in interleaved order; the table
shows medians of tokens/s (real head positions per second, setup excluded) and peak RSS, and ratios
against offline + bucketed (the default: a DataLoader whose batch sampler is the epoch plan, 2 workers
reading and padding micro-batches ahead, features in their stored dtype until the device) and the same
store read in the loop (`loader_workers=0`: how every micro-batch was read before, in the training
process between steps). Quality: the CPU preset (conf/recipe/stories260k_cpu.yaml) on the
TinyStories conversations (and, with --regenerated, on the target's own replies), held-out first-step
top-1 against the target's greedy token and the simulated acceptance length of a 5-token chain.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = {
    "offline+bucketed": ["bucket=true"],
    "offline+read-in-loop": ["bucket=true", "loader_workers=0"],
    "offline+unbucketed": ["bucket=false"],
    "online+bucketed": ["bucket=true", "data.source=online"],
}


def build_store(workdir: Path, limit: int | None, data_file: Path | None = None) -> tuple[Path, Path]:
    """Conversations (TinyStories, or `data_file`) and their feature store, with the real stages."""
    from omegaconf import OmegaConf

    from eagle_train.config.base import to_schema
    from eagle_train.config.data import DataConfig
    from eagle_train.config.extract import ExtractConfig
    from eagle_train.config.target import TargetConfig
    from eagle_train.data.tinystories import build_tinystories_conversations
    from eagle_train.extract import run as extract

    conversations = data_file or workdir / "tinystories.jsonl"
    if data_file is None:
        build_tinystories_conversations(out_path=conversations, limit=limit)
    target = to_schema(OmegaConf.load(REPO / "conf" / "target" / "stories260k.yaml"), TargetConfig)
    data = DataConfig(name=conversations.stem, path=str(conversations), limit=limit)
    store = workdir / f"store_{conversations.stem}"
    extract(ExtractConfig(target=target, data=data, out_dir=str(store), dtype="bfloat16", progress=False))
    return conversations, store


def train_child(overrides: list[str], threads: int) -> dict:
    """Run one training in this process (called in a child); metrics + peak RSS as a dict."""
    import torch

    from eagle_train.cli import compose
    from eagle_train.config.base import to_schema
    from eagle_train.config.train import TrainConfig
    from eagle_train.train import run

    torch.set_num_threads(threads)
    cfg = to_schema(compose("train", overrides=overrides), TrainConfig)
    start = time.perf_counter()
    final = run(cfg)
    lines = [json.loads(x) for x in (Path(cfg.out_dir) / "metrics.jsonl").read_text().splitlines()]
    rates = [m["tokens_per_s"] for m in lines if "tokens_per_s" in m][1:]  # the first window has warm-up
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "tokens_per_s": statistics.median(rates),
        "peak_rss_mb": peak_mb,
        "wall_s": time.perf_counter() - start,
        "final": final,
    }


def spawn(overrides: list[str], threads: int) -> dict:
    """train_child in a fresh interpreter."""
    code = (
        f"import json, sys; sys.path.insert(0, {str(REPO / 'scripts')!r}); from bench_train import train_child; "
        f"print('RESULT' + json.dumps(train_child({overrides!r}, {threads})))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": str(threads)},
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])


def throughput(args: argparse.Namespace, workdir: Path) -> dict:
    from eagle_train.data.batching import padding_fraction
    from eagle_train.store.reader import FeatureStore
    from eagle_train.training.data import plan_epoch

    conversations, store = build_store(workdir, args.limit)
    lengths = FeatureStore(store).lengths
    common = [
        f"features={store}",
        f"data.path={conversations}",
        f"data.limit={args.limit}",
        "progress=false",
        f"max_steps={args.steps}",
        "log_every=5",
        "eval_every=0",
        "save_every=0",
        "eval_max_samples=1",
        "resume=never",
        "optim.lr=1e-3",
        "optim.warmup_steps=10",
    ]
    results: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for repeat in range(args.repeats):
        for name, extra in VARIANTS.items():
            out = workdir / f"run_{name}_{repeat}"
            results[name].append(spawn([*common, *extra, f"out_dir={out}"], args.threads))
    base = statistics.median(r["tokens_per_s"] for r in results["offline+bucketed"])
    table = {}
    for name, runs in results.items():
        bucket = "bucket=true" in VARIANTS[name]
        plan = plan_epoch(list(range(len(lengths))), lengths, 8192, 4, bucket, 0)
        rate = statistics.median(r["tokens_per_s"] for r in runs)
        table[name] = {
            "tokens_per_s": rate,
            "ratio": rate / base,
            "padding": padding_fraction(lengths, plan),
            "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in runs),
            "runs": [r["tokens_per_s"] for r in runs],
        }
    print(f"{'variant':<28} {'tokens/s':>10} {'ratio':>6} {'padding':>8} {'peak RSS MB':>12}")
    for name, row in table.items():
        print(
            f"{name:<28} {row['tokens_per_s']:>10.0f} {row['ratio']:>6.2f} {row['padding']:>8.1%} {row['peak_rss_mb']:>12.0f}"
        )
    return {
        "steps": args.steps,
        "repeats": args.repeats,
        "threads": args.threads,
        "conversations": args.limit,
        "batch": "max_tokens 8192, max_batch_size 4 (default config)",
        "variants": table,
    }


def quality(args: argparse.Namespace, workdir: Path) -> dict:
    datasets = {"tinystories": None}
    if args.regenerated:
        datasets["regenerated"] = Path(args.regenerated).resolve()
    report = {}
    for name, data_file in datasets.items():
        conversations, store = build_store(workdir, None, data_file)
        overrides = [
            "+recipe=stories260k_cpu",
            f"features={store}",
            f"out_dir={workdir / ('q_' + name)}",
            "progress=false",
            "resume=never",
            "eval_max_samples=null",
            f"max_steps={args.quality_steps}",
        ]
        result = spawn(overrides, args.threads)
        report[name] = {"wall_s": result["wall_s"], "tokens_per_s": result["tokens_per_s"], **result["final"]}
        print(
            f"{name:<12} top1 {result['final']['eval/top1']:.3f}  top3 {result['final']['eval/top3']:.3f}  "
            f"tau(K=5) {result['final']['eval/accept_len']:.2f}  wall {result['wall_s']:.0f}s"
        )
    return {
        "preset": "conf/recipe/stories260k_cpu.yaml",
        "max_steps": args.quality_steps,
        "threads": args.threads,
        "results": report,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per throughput run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--limit", type=int, default=400, help="conversations in the throughput store")
    parser.add_argument("--quality", action="store_true", help="run the held-out quality benchmark instead")
    parser.add_argument("--regenerated", help="also train on this ShareGPT file (target-regenerated replies)")
    parser.add_argument("--quality_steps", type=int, default=1500)
    args = parser.parse_args()
    out_dir = REPO / "bench_results"
    out_dir.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench_train_") as tmp:
        result = quality(args, Path(tmp)) if args.quality else throughput(args, Path(tmp))
    name = "train_quality.json" if args.quality else "train.json"
    (out_dir / name).write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {out_dir / name}")


if __name__ == "__main__":
    main()
