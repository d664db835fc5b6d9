"""fp8 feature stores against bf16: bytes per token, the features' error, and the tau of heads trained on each.

    python scripts/bench_store_dtype.py [--conversations 2000] [--steps 600]

Extracts the same TinyStories conversations with stories260K twice, `dtype=bfloat16` and `dtype=fp8`
(float8 e4m3 + one float32 scale per token: eagle_train.store.codec), and reports each store's bytes per
token (the manifest's count, ids and masks included) and the fp8 features' relative error against the
bf16 ones, per-token scales next to a finer grouping (one scale per 16 channels) as the alternative.
Then trains one head on each store with the same budget (the stories260k_cpu recipe, the same seed and
`--steps` optimizer steps) and evaluates both on the SAME held-out features, the bf16 store's (a served
head sees the target's real features, not fp8 ones): simulated acceptance length tau of a chain of 5,
top-1. Goal: half the bytes, tau within 2%. One thread; prints a table and writes
bench_results/store_dtype.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from eagle_train.cli import compose
from eagle_train.config.base import to_schema
from eagle_train.config.extract import ExtractConfig
from eagle_train.config.train import TrainConfig
from eagle_train.extract import run as extract
from eagle_train.store.codec import decode, encode, storage
from eagle_train.store.reader import FeatureStore
from eagle_train.train import build_head, evaluate, make_accelerator, prepare_data
from eagle_train.train import run as train

REPO_ROOT = Path(__file__).resolve().parents[1]
DTYPES = ("bfloat16", "fp8")


def extract_store(out_dir: Path, dtype: str, conversations: int) -> Path:
    cfg = compose(
        "extract",
        overrides=[f"out_dir={out_dir}", f"dtype={dtype}", f"data.limit={conversations}", "progress=false"],
    )
    return extract(to_schema(cfg, ExtractConfig))


def train_cfg(store: Path, out_dir: Path, *overrides: str) -> TrainConfig:
    cfg = compose(
        "train",
        overrides=[
            "+recipe=stories260k_cpu",
            f"features={store}",
            f"out_dir={out_dir}",
            "progress=false",
            "loader_workers=0",
            "eval_max_samples=null",
            *overrides,
        ],
    )
    return to_schema(cfg, TrainConfig)


def feature_error(bf16: FeatureStore, fp8: FeatureStore, samples: int = 200) -> dict[str, float]:
    """Relative L2 error of the fp8 store's features against the bf16 store's (same samples), and of a
    per-16-channel fp8 code of the same bf16 features (the finer alternative)."""
    errors = {"fp8 per-token scale (stored)": [], "fp8 per-16-channel scale": []}
    kind = storage("fp8")
    for i in range(min(samples, len(bf16))):
        ref = bf16[i]["hidden"].float()  # [L, d]
        got = fp8[i]
        stored = decode(got["hidden"], got["hidden_scale"], torch.float32)
        fine = decode(*encode(ref, kind, 16), torch.float32)
        norm = ref.norm()
        errors["fp8 per-token scale (stored)"].append(float((stored - ref).norm() / norm))
        errors["fp8 per-16-channel scale"].append(float((fine - ref).norm() / norm))
    return {k: sum(v) / len(v) for k, v in errors.items()}


def held_out_metrics(head_dir: Path, store: Path, work: Path) -> dict[str, float]:
    """A trained head's held-out metrics on `store` (training's own evaluation, eagle_train.train.evaluate)."""
    cfg = train_cfg(store, work, f"draft.path={head_dir}")
    accelerator = make_accelerator(cfg)
    data, target = prepare_data(cfg, accelerator)
    head = build_head(cfg, target).to(accelerator.device)
    return evaluate(head, data, cfg, accelerator)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=600)
    args = parser.parse_args()
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="bench_store_dtype_"))
    try:
        stores, seconds = {}, {}
        for dtype in DTYPES:
            start = time.perf_counter()
            stores[dtype] = extract_store(work / f"store-{dtype}", dtype, args.conversations)
            seconds[dtype] = time.perf_counter() - start
        opened = {dtype: FeatureStore(path) for dtype, path in stores.items()}
        counts = {dtype: s.manifest["counts"] for dtype, s in opened.items()}
        errors = feature_error(opened["bfloat16"], opened["fp8"])
        heads = {}
        for dtype in DTYPES:
            run_dir = work / f"run-{dtype}"
            train(
                train_cfg(stores[dtype], run_dir, f"max_steps={args.steps}", "eval_every=0", "save_every=0")
            )
            heads[dtype] = held_out_metrics(run_dir / "final", stores["bfloat16"], work / f"eval-{dtype}")
    finally:
        shutil.rmtree(work, ignore_errors=True)

    bpt = {dtype: c["bytes_per_token"] for dtype, c in counts.items()}
    tau = {dtype: m["eval/accept_len"] for dtype, m in heads.items()}
    print(
        f"stories260K (d=64), {counts['bfloat16']['conversations']} conversations, {counts['bfloat16']['tokens']} tokens"
    )
    print(f"{'store':<10}{'bytes/token':>12}{'extract s':>11}{'tau (chain 5)':>15}{'top-1':>8}")
    for dtype in DTYPES:
        top1 = heads[dtype]["eval/top1"]
        print(f"{dtype:<10}{bpt[dtype]:>12.1f}{seconds[dtype]:>11.1f}{tau[dtype]:>15.3f}{top1:>8.3f}")
    print(
        f"fp8 / bf16 bytes per token: {bpt['fp8'] / bpt['bfloat16']:.3f}; tau fp8 / bf16: {tau['fp8'] / tau['bfloat16']:.4f}"
    )
    for name, err in errors.items():
        print(f"relative feature error, {name}: {err:.4f}")
    result = {
        "target": "stories260K",
        "hidden_size": 64,
        "conversations": counts["bfloat16"]["conversations"],
        "tokens": counts["bfloat16"]["tokens"],
        "steps": args.steps,
        "threads": 1,
        "bytes_per_token": bpt,
        "bytes_ratio_fp8_over_bf16": bpt["fp8"] / bpt["bfloat16"],
        "extract_seconds": seconds,
        "held_out_on_bf16_features": heads,
        "tau_ratio_fp8_over_bf16": tau["fp8"] / tau["bfloat16"],
        "relative_feature_error": errors,
    }
    out = REPO_ROOT / "bench_results" / "store_dtype.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
