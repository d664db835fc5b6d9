"""Peak memory of offline training per process against what it must hold, for targets of 8 and 16 layers.

    python scripts/bench_memory.py [--layers 8 16] [--steps 3] [--keep DIR]

For each depth: a random Llama target of shape `llama-1b-32k` (d 2048, GQA 32/8, MLP 8192, vocab 32000,
untied; eagle_train.modeling.random_target) saved as sharded bf16 safetensors (500 MB shards), a store of
random bf16 features for it (eagle_train.store.synthetic: 64 conversations of 64-256 tokens), then
`eagle_train.train.run` in a fresh process (one thread, fp32 on the CPU, loader_workers=0 so the one
process holds everything, a checkpoint and the final evaluation included): its peak resident memory
(VmHWM) against the sum of what it must hold: the frozen embedding and LM head in the working dtype,
the head's trained weights, their gradients and AdamW's two moments (all fp32). Goal: peak <= 1.3 x sum
+ 500 MB, and the same for 8 and 16 layers (the decoder layers are never read). Prints a table and writes
bench_results/memory.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SHAPE = "llama-1b-32k"
CHILD = r"""
import json, os, random, sys
import torch
torch.set_num_threads(1)
from eagle_train.config.base import to_schema
from eagle_train.config.train import TrainConfig
from eagle_train.cli import compose
from eagle_train.train import run
cfg = to_schema(compose("train", overrides=sys.argv[1:]), TrainConfig)
run(cfg)
status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
print("RESULT " + json.dumps({"peak_rss_mb": int(status["VmHWM"].split()[0]) / 1024}))
"""


def prepare(work: Path, layers: int) -> tuple[Path, Path, dict]:
    """The saved random target of `layers` layers, its random store, and the sizes of what training holds."""
    import torch
    from transformers import AutoConfig

    from eagle_train.config.target import TargetConfig
    from eagle_train.modeling.draft import DraftHead
    from eagle_train.modeling.frozen import load_frozen_target
    from eagle_train.modeling.random_target import llama_config, save_random_llama
    from eagle_train.store.synthetic import write_random_store

    target_dir, store_dir = work / f"target-{layers}", work / f"store-{layers}"
    config = llama_config(SHAPE, layers)
    save_random_llama(target_dir, config, max_shard_size="500MB")
    cfg = TargetConfig(name=f"random-{layers}", path=str(target_dir), dtype="bfloat16")
    frozen = load_frozen_target(cfg)
    lengths = [64 + (i * 37) % 193 for i in range(64)]
    write_random_store(store_dir, frozen, AutoConfig.from_pretrained(target_dir), lengths)
    with torch.device("meta"):  # the head's trained parameters, counted without allocating them
        head = DraftHead.from_target(config)
    head_params = sum(p.numel() for p in head.parameters() if p.requires_grad)
    vocab_matrices = 2 * config.vocab_size * config.hidden_size  # embedding + LM head (untied)
    sizes = {
        "checkpoint_mb": sum(f.stat().st_size for f in target_dir.glob("*.safetensors")) / 2**20,
        "frozen_mb": vocab_matrices * 4 / 2**20,  # fp32: the CPU's working dtype
        "head_params": head_params,
        "head_mb": head_params * 4 / 2**20,
        "grads_mb": head_params * 4 / 2**20,
        "adam_mb": 2 * head_params * 4 / 2**20,
    }
    return target_dir, store_dir, sizes


def train_peak(target_dir: Path, store_dir: Path, out_dir: Path, steps: int) -> float:
    """Peak resident MB of one offline training process on this store."""
    overrides = [
        f"target.path={target_dir}",
        f"target.name={target_dir.name}",
        "target.dtype=bfloat16",
        f"features={store_dir}",
        f"out_dir={out_dir}",
        f"max_steps={steps}",
        f"save_every={steps}",
        "eval_every=0",
        "eval_max_samples=4",
        "loader_workers=0",
        "max_tokens=512",
        "progress=false",
        "optim.warmup_steps=1",
    ]
    env = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, *overrides], capture_output=True, text=True, env=env, cwd=REPO_ROOT
    )
    if done.returncode != 0:
        raise RuntimeError(f"training failed:\n{done.stderr[-3000:]}")
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))["peak_rss_mb"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--keep", default=None, help="a directory for the targets and stores (kept)")
    args = parser.parse_args()
    work = Path(args.keep or tempfile.mkdtemp(prefix="bench_memory_"))
    work.mkdir(parents=True, exist_ok=True)
    rows = {}
    try:
        for layers in args.layers:
            target_dir, store_dir, sizes = prepare(work, layers)
            peak = train_peak(target_dir, store_dir, work / f"run-{layers}", args.steps)
            held = sizes["frozen_mb"] + sizes["head_mb"] + sizes["adam_mb"]
            rows[layers] = {
                **sizes,
                "must_hold_mb": held,
                "must_hold_with_grads_mb": held + sizes["grads_mb"],
                "peak_rss_mb": peak,
                "goal_mb": 1.3 * held + 500,
                "peak_over_must_hold": peak / held,
                "within_goal": peak <= 1.3 * held + 500,
            }
            print(
                f"{layers:>3} layers: checkpoint {sizes['checkpoint_mb']:,.0f} MB; peak RSS {peak:,.0f} MB; "
                f"embedding+LM head+head+AdamW {held:,.0f} MB (+ grads {held + sizes['grads_mb']:,.0f}); "
                f"goal {1.3 * held + 500:,.0f} MB",
                flush=True,
            )
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    result = {"shape": SHAPE, "steps": args.steps, "threads": 1, "device": "cpu", "by_layers": rows}
    out = REPO_ROOT / "bench_results" / "memory.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
