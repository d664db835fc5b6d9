"""What the integrity checks cost: the target's weight-file identity at 8B scale, and the start of
extraction, training, evaluation and export on stories260K, with and without the checks, side by side.

    python scripts/bench_integrity.py [--gb 4] [--files 4] [--dir /tmp] [--base DIR] [--repeats 5]

Part 1, the identity (eagle_train.modeling.frozen.checkpoint_sha256): writes `--files` random weight files
of `--gb` GB in all plus a safetensors index (a checkpoint's layout; the hash reads bytes, never
tensors), then times the first-time identity with the files out of the page cache
(posix_fadvise DONTNEED: as after a download or a reboot), with the files in the page cache, one file
at a time against the parallel hash, and the cached identity (a stat per file). The 8B figure is
16 GB (bf16) at the measured cold rate; the cached cost is per file (an 8B checkpoint has 4).

Part 2 (with `--base DIR`: a checkout of the code without the checks, e.g. `git archive REV | tar -x -C DIR`
for a revision REV before them): the same hot paths timed with each code tree in its own process,
alternated, best of `--repeats`: an extraction rerun over a complete store (every shard kept), offline
training's start (the target's frozen parts and the store's checks, train.prepare_data), the
evaluation's start (the target, the head and the report note: evaluate.load_head + draft_notes) and
the export's head load (modeling.head_checkpoint.load_head). The weight-file hash cache is warm (the first
time is part 1's figure). One thread; prints a table and writes bench_results/integrity.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
BLOCK = 64 * 2**20


def write_checkpoint(directory: Path, gb: float, files: int) -> list[Path]:
    """`files` files of random bytes, `gb` GB in all, named as a sharded checkpoint, with its index."""
    import numpy as np

    rng = np.random.default_rng(0)
    paths, weight_map = [], {}
    per_file = int(gb * 1e9 / files)
    for k in range(files):
        path = directory / f"model-{k + 1:05d}-of-{files:05d}.safetensors"
        with path.open("wb") as f:
            left = per_file
            while left > 0:
                f.write(rng.bytes(min(BLOCK, left)))
                left -= BLOCK
            f.flush()
            os.fsync(f.fileno())
        paths.append(path)
        weight_map[f"model.layers.{k}.weight"] = path.name
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return paths


def evict(paths: list[Path]) -> None:
    """Drop the files' pages from the page cache (their next read comes from the disk)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def identity_cost(gb: float, files: int, where: str | None) -> dict:
    """Part 1: seconds of the weight-file identity, first time (cold, warm; parallel, serial) and cached."""
    from eagle_train.modeling.frozen import checkpoint_sha256
    from eagle_train.runtime.atomic_files import cached_sha256

    root = Path(tempfile.mkdtemp(prefix="bench_integrity_", dir=where))
    try:
        paths = write_checkpoint(root, gb, files)
        size = sum(p.stat().st_size for p in paths) / 1e9
        cache = root / "cache"
        os.environ["EAGLE_TRAIN_CACHE"] = str(cache)

        def first(parallel: bool, cold: bool) -> float:
            shutil.rmtree(cache, ignore_errors=True)
            if cold:
                evict(paths)
            run = (
                (lambda: checkpoint_sha256(str(root)))
                if parallel
                else (lambda: [cached_sha256(p) for p in paths])
            )
            return timed(run)

        out = {
            "gb": size,
            "files": files,
            "cpus": os.cpu_count(),
            "cold_parallel_s": first(True, True),
            "cold_serial_s": first(False, True),
            "warm_parallel_s": first(True, False),
            "warm_serial_s": first(False, False),
        }
        out["cached_s"] = min(timed(lambda: checkpoint_sha256(str(root))) for _ in range(20))
        for key in ("cold_parallel", "cold_serial", "warm_parallel", "warm_serial"):
            out[f"{key}_gb_s"] = size / out[f"{key}_s"]
        out["8b_first_time_s"] = 16.0 / out["cold_parallel_gb_s"]
        out["8b_first_time_serial_s"] = 16.0 / out["cold_serial_gb_s"]
        out["8b_cached_s"] = out["cached_s"] / files * 4
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)


def checks_alone(repeats: int) -> dict:
    """Each new check on its own, this code, stories260K (best of `repeats`, in milliseconds)."""
    from eagle_train.config.base import data_path
    from eagle_train.modeling.draft import DraftHead
    from eagle_train.modeling.frozen import checkpoint_sha256
    from eagle_train.modeling.head_checkpoint import check_head_files, save_head
    from eagle_train.modeling.target import load_target_config
    from eagle_train.runtime.atomic_files import cached_sha256
    from eagle_train.train import final_logged

    model = str(data_path("models/stories260K"))
    with tempfile.TemporaryDirectory(prefix="bench_integrity_") as work:
        os.environ["EAGLE_TRAIN_CACHE"] = str(Path(work) / "cache")
        out = {"weight files, first time": timed(lambda: checkpoint_sha256(model))}
        out["weight files, cached"] = min(timed(lambda: checkpoint_sha256(model)) for _ in range(repeats))
        from eagle_train.config.target import TargetConfig

        head = DraftHead.from_target(load_target_config(TargetConfig(path=model)))
        head_dir = save_head(head, Path(work) / "head")
        out["head checksum (check_head_files)"] = min(
            timed(lambda: check_head_files(head_dir)) for _ in range(repeats)
        )
        metrics = Path(work) / "metrics.jsonl"
        line = json.dumps({"step": 1, "loss": 1.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1e5}) + "\n"
        metrics.write_text(line * 20000)
        out["final_logged over 20k metric lines"] = min(
            timed(lambda: final_logged(Path(work), 20000)) for _ in range(3)
        )
        blob = Path(work) / "shard.bin"
        blob.write_bytes(os.urandom(256 * 2**20))
        out["verify=full: sha256 of 256 MB of shards"] = min(
            timed(lambda: cached_sha256(blob)) for _ in range(1)
        )
    return {name: seconds * 1e3 for name, seconds in out.items()}


# ------------------------------------------------------------------------------- part 2: one code tree


def child(work: Path, repeats: int) -> dict:
    """The hot paths with whatever eagle_train is on the path (this runs in its own process)."""
    import torch

    torch.set_num_threads(1)
    from accelerate import Accelerator

    from eagle_train.cli import compose
    from eagle_train.config.base import to_schema
    from eagle_train.config.evaluate import EvaluateConfig
    from eagle_train.config.extract import ExtractConfig
    from eagle_train.config.train import TrainConfig
    from eagle_train.evaluate import draft_notes
    from eagle_train.evaluate import load_head as evaluate_head
    from eagle_train.extract import run as extract
    from eagle_train.modeling.head_checkpoint import load_head, save_head
    from eagle_train.modeling.target import load_target
    from eagle_train.train import prepare_data
    from eagle_train.training.sources import checkpoint_identity

    store = work / "store"
    extract_cfg = to_schema(
        compose("extract", [f"out_dir={store}", "data.limit=64", "dtype=float32", "progress=false"]),
        ExtractConfig,
    )
    extract(extract_cfg)  # the complete store every rerun keeps
    train_cfg = to_schema(
        compose("train", ["+recipe=stories260k_cpu", f"features={store}", f"out_dir={work / 'run'}"]),
        TrainConfig,
    )
    accelerator = Accelerator(cpu=True)
    data, target = prepare_data(train_cfg, accelerator)
    from eagle_train.modeling.draft import DraftHead

    head_dir = save_head(
        DraftHead.from_target(target.config), work / "head", checkpoint_identity(target, target.config)
    )
    eval_cfg = to_schema(
        compose("evaluate", [f"draft.path={head_dir}", f"out_dir={work / 'eval'}"]), EvaluateConfig
    )

    def evaluate_start() -> None:
        full = load_target(eval_cfg.target)
        evaluate_head(eval_cfg, full)
        draft_notes(eval_cfg, full)

    paths = {
        "extraction rerun (complete store)": lambda: extract(extract_cfg),
        "training start (offline: frozen parts + store checks)": lambda: prepare_data(train_cfg, accelerator),
        "evaluate start (target + head + note)": evaluate_start,
        "export start (head load)": lambda: load_head(head_dir),
    }
    return {name: min(timed(fn) for _ in range(repeats)) for name, fn in paths.items()}


def side_by_side(base: Path, repeats: int, rounds: int = 2) -> dict:
    """Part 2: each code tree in its own processes, alternated; the best of each."""
    best: dict[str, dict[str, float]] = {"before": {}, "after": {}}
    for _ in range(rounds):
        for label, tree in (("before", base), ("after", REPO_ROOT)):
            with tempfile.TemporaryDirectory(prefix="bench_integrity_") as work:
                env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
                env["EAGLE_TRAIN_CACHE"] = str(Path(work) / "cache")
                out = Path(work) / "result.json"
                command = [sys.executable, __file__, "--child", str(out), "--repeats", str(repeats)]
                subprocess.run(command, cwd=tree, env=env, check=True, capture_output=True)
                for name, seconds in json.loads(out.read_text()).items():
                    best[label][name] = min(seconds, best[label].get(name, float("inf")))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gb", type=float, default=4.0, help="size of the weight files of part 1")
    parser.add_argument("--files", type=int, default=4, help="weight files of part 1")
    parser.add_argument("--dir", default=None, help="where part 1 writes them (default: the temp dir)")
    parser.add_argument("--base", default=None, help="the code before the change: runs part 2")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        with tempfile.TemporaryDirectory(prefix="bench_integrity_child_") as work:
            Path(args.child).write_text(json.dumps(child(Path(work), args.repeats)))
        return
    results = {"checks_ms": checks_alone(args.repeats)}
    print("each new check alone (stories260K, best of runs):")
    for name, ms in results["checks_ms"].items():
        print(f"  {name:45s} {ms:9.3f} ms")
    results["identity"] = identity_cost(args.gb, args.files, args.dir)
    ident = results["identity"]
    print(f"weight-file identity over {ident['gb']:.2f} GB in {ident['files']} files ({ident['cpus']} CPUs):")
    for key in ("cold_parallel", "cold_serial", "warm_parallel", "warm_serial"):
        print(
            f"  first time, {key.replace('_', ', '):16s} {ident[key + '_s']:7.2f} s  {ident[key + '_gb_s']:.2f} GB/s"
        )
    print(f"  cached (a stat per file)         {ident['cached_s'] * 1e3:7.3f} ms")
    print(
        f"  8B (16 GB, 4 files): first time {ident['8b_first_time_s']:.1f} s "
        f"(one file at a time {ident['8b_first_time_serial_s']:.1f} s), then {ident['8b_cached_s'] * 1e3:.2f} ms"
    )
    if args.base:
        results["hot_paths"] = side_by_side(Path(args.base).resolve(), args.repeats)
        before, after = results["hot_paths"]["before"], results["hot_paths"]["after"]
        print(f"\n{'stories260K hot path':55s} {'before':>9s} {'after':>9s} {'ratio':>6s}")
        for name in before:
            print(
                f"{name:55s} {before[name] * 1e3:7.1f}ms {after[name] * 1e3:7.1f}ms {after[name] / before[name]:6.2f}"
            )
    out = REPO_ROOT / "bench_results" / "integrity.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
