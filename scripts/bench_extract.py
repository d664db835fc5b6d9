"""Feature extraction throughput on stories260K, side by side in one run, and the store's reader.

    python scripts/bench_extract.py [--repeats 3] [--limit 1000]

Extracts the shipped data/sharegpt/alpaca_cleaned_1000_as_sharegpt.json (template `plain`, max_len 512)
with the default settings (length-bucketed batches, no attention mask), batch size 1, and the default
batches with a padding mask, interleaved, `--repeats` times each; tokens/s is the median, timed over
the target forwards plus shard writing (data loading and model loading are shared and left out). Then
random access on the default store: a sample read through the memory-mapped reader against
safetensors' `safe_open(...).get_slice`. Prints a table, writes bench_results/extract.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from datasets.utils.logging import disable_progress_bar
from omegaconf import OmegaConf
from safetensors import safe_open

import eagle_train.extract as extract
from eagle_train.config.base import CONF_DIR, data_path, to_schema
from eagle_train.config.data import DataConfig
from eagle_train.config.extract import ExtractConfig
from eagle_train.config.target import TargetConfig
from eagle_train.data.render import ChatRenderer, tokenize_stream
from eagle_train.data.sharegpt import DropReport, stream_conversations
from eagle_train.modeling.target import load_target
from eagle_train.store import (
    HIDDEN_DTYPES,
    FeatureStore,
    plan_shards,
    prepare_out_dir,
    store_hash,
    write_manifest,
    write_shard,
)

ALPACA = (data_path("sharegpt/alpaca_cleaned_1000_as_sharegpt.json")).resolve()
VARIANTS = {  # name -> (ExtractConfig overrides, attention mask)
    "default": ({}, False),
    "batch size 1": ({"max_batch_size": 1}, False),
    "default + padding mask": ({}, True),
}


@dataclass
class Tokenized:
    """The tokenized conversations once, shared by every variant."""

    rows: list[dict]
    identity: dict
    report: DropReport

    @property
    def lengths(self) -> list[int]:
        return [len(r["input_ids"]) for r in self.rows]


def tokenize(cfg: ExtractConfig, target) -> Tokenized:
    """Stream, clean and tokenize cfg.data as extraction does, keeping the rows."""
    max_len = target.length_limit(cfg.data.max_len)
    renderer = ChatRenderer(target.tokenizer, target.cfg, max_len)
    report = DropReport()
    rows = list(tokenize_stream(stream_conversations(cfg.data, report), renderer, report))
    source = extract.data_source(cfg.data)
    return Tokenized(
        rows, extract.store_identity(cfg, target, renderer.template_name, max_len, source), report
    )


def extract_once(cfg: ExtractConfig, target, data: Tokenized, attention_mask: bool) -> tuple[float, Path]:
    """Wall seconds to extract and write every shard into a fresh store (the loop of
    `extract.extract_shards`, one process), and the store's directory."""
    out_dir = Path(tempfile.mkdtemp(prefix="bench_extract_"))
    prepare_out_dir(out_dir, data.identity, overwrite=False)
    bytes_per_token = target.hidden_size * HIDDEN_DTYPES[cfg.dtype].itemsize
    plan = plan_shards(data.lengths, bytes_per_token, cfg.shard_samples, cfg.shard_bytes)
    start = time.perf_counter()
    for k, (begin, end) in enumerate(plan):
        rows = data.rows[begin:end]
        fill = functools.partial(
            extract.extract_rows,
            target,
            rows,
            cfg.max_tokens,
            cfg.max_batch_size,
            HIDDEN_DTYPES[cfg.dtype],
            attention_mask=attention_mask,
        )
        extra = {"start": begin, "stop": end, "store": store_hash(data.identity)}
        write_shard(out_dir, k, rows, cfg.dtype, target.vocab_size, extra, fill, target.hidden_size)
    seconds = time.perf_counter() - start
    write_manifest(out_dir, data.identity, plan, data.report.to_dict(), "bench")
    return seconds, out_dir


def read_benchmark(store_dir: Path, samples: int = 300) -> dict[str, float]:
    """Median microseconds to read one random sample (hidden, ids, mask), the mmap reader vs safe_open."""
    store = FeatureStore(store_dir)
    order = random.Random(0).sample(range(len(store)), min(samples, len(store)))
    shards = [safe_open(str(store_dir / s["file"]), "pt") for s in store.manifest["shards"]]
    where = [
        (k, j) for k, shard in enumerate(store._shards) for j in range(len(shard.ids))
    ]  # sample -> (shard, row)

    def via_safe_open(i: int) -> list[torch.Tensor]:
        k, j = where[i]
        begin, end = int(store._shards[k].offsets[j]), int(store._shards[k].offsets[j + 1])
        return [shards[k].get_slice(name)[begin:end] for name in ("hidden", "input_ids", "loss_mask")]

    results = {}
    for name, fn in {
        "mmap reader (FeatureStore)": store.__getitem__,
        "safe_open get_slice": via_safe_open,
    }.items():
        times = []
        for i in order:
            start = time.perf_counter()
            fn(i)
            times.append(time.perf_counter() - start)
        results[name] = statistics.median(times) * 1e6
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--limit", type=int, default=None, help="first N conversations (default: all 1000)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    disable_progress_bar()
    target_cfg = to_schema(OmegaConf.load(CONF_DIR / "target" / "stories260k.yaml"), TargetConfig)
    cfg = ExtractConfig(
        target=target_cfg, data=DataConfig(name="alpaca", path=str(ALPACA), limit=args.limit), progress=False
    )
    target = load_target(target_cfg)
    data = tokenize(cfg, target)
    tokens = sum(data.lengths)

    seconds: dict[str, list[float]] = {name: [] for name in VARIANTS}
    store_dirs: dict[str, Path] = {}
    for _ in range(args.repeats):
        for name, (overrides, mask) in VARIANTS.items():
            took, store_dir = extract_once(replace(cfg, **overrides), target, data, mask)
            seconds[name].append(took)
            print(f"  {name:<26}{tokens / took:>10,.0f} tokens/s", flush=True)
            if name in store_dirs:
                shutil.rmtree(store_dirs[name])
            store_dirs[name] = store_dir
    rates = {name: tokens / statistics.median(s) for name, s in seconds.items()}
    manifest = FeatureStore(store_dirs["default"]).manifest
    reads = read_benchmark(store_dirs["default"])

    print(f"\nstories260K over {ALPACA.name}: {len(data.lengths)} conversations, {tokens} tokens, "
          f"median of {args.repeats}, torch threads 2")  # fmt: skip
    print(f"{'setting':<26}{'tokens/s':>12}{'x batch 1':>11}")
    for name, rate in rates.items():
        print(f"{name:<26}{rate:>12,.0f}{rate / rates['batch size 1']:>10.2f}x")
    counts = manifest["counts"]
    print(
        f"bytes on disk {counts['bytes']:,} ({manifest['dtype']}), {counts['bytes_per_token']:.1f} bytes/token"
    )
    for name, micros in reads.items():
        print(f"random sample read, {name:<28}{micros:>8.0f} us")

    result = {
        "conversations": len(data.lengths),
        "tokens": tokens,
        "repeats": args.repeats,
        "settings": {"max_tokens": cfg.max_tokens, "max_batch_size": cfg.max_batch_size, "dtype": cfg.dtype},
        "tokens_per_s": rates,
        "seconds": seconds,
        "speedup_default_vs_batch1": rates["default"] / rates["batch size 1"],
        "bytes_on_disk": counts["bytes"],
        "bytes_per_token": counts["bytes_per_token"],
        "read_us_median": reads,
    }
    out = Path(__file__).resolve().parents[1] / "bench_results" / "extract.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    for store_dir in store_dirs.values():
        shutil.rmtree(store_dir)


if __name__ == "__main__":
    main()
