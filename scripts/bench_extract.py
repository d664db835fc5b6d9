"""Feature extraction throughput against its limit, the target's bare forward, side by side in one run.

    python scripts/bench_extract.py [--repeats 3] [--limit 1000] [--target DIR] [--dtype bfloat16]

Extracts the shipped data/sharegpt/alpaca_cleaned_1000_as_sharegpt.json (template `plain`, max_len 512)
with the default settings (length-bucketed batches, no attention mask, each batch written in a
background thread while the next runs), in bf16 and fp8, with batch size 1 and with a padding mask, and
times the bare forward: the same batches through the target and nothing else (no copy to the host, no
store). Interleaved, `--repeats` times each; tokens/s is the median, timed over the forwards plus shard
writing (data and model loading are shared and left out). The goal: extraction >= 80% of the bare
forward. Then random access on the default store: a sample read through the store's reader (safetensors
`safe_open(...).get_slice`) against a hand-written memory-mapped read (the reader before this one).
`--target DIR` measures another model (e.g. a random Llama of python -m eagle_train.modeling.random_target).
Prints a table, writes bench_results/extract.json.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from datasets.utils.logging import disable_progress_bar
from omegaconf import OmegaConf

import eagle_train.extract as extract
from eagle_train.config.base import CONF_DIR, data_path, to_schema
from eagle_train.config.data import DataConfig
from eagle_train.config.extract import ExtractConfig
from eagle_train.config.target import TargetConfig
from eagle_train.data.batching import bucket_batches
from eagle_train.data.render import ChatRenderer, tokenize_stream
from eagle_train.data.sharegpt import DropReport, stream_conversations
from eagle_train.modeling.target import load_target, load_target_config
from eagle_train.store.codec import storage
from eagle_train.store.manifest import store_hash, store_identity
from eagle_train.store.reader import FeatureStore
from eagle_train.store.writer import plan_shards, prepare_out_dir, write_manifest

ALPACA = (data_path("sharegpt/alpaca_cleaned_1000_as_sharegpt.json")).resolve()
VARIANTS = {  # name -> (ExtractConfig overrides, attention mask)
    "extract (default, bf16)": ({}, False),
    "extract fp8": ({"dtype": "fp8"}, False),
    "extract, batch size 1": ({"max_batch_size": 1}, False),
    "extract + padding mask": ({}, True),
}
BARE = "bare forward"


@dataclass
class Tokenized:
    """The tokenized conversations once, shared by every variant."""

    rows: list[dict]
    report: DropReport
    template: str
    max_len: int
    source: dict

    @property
    def lengths(self) -> list[int]:
        return [len(r["input_ids"]) for r in self.rows]


def tokenize(cfg: ExtractConfig, target) -> Tokenized:
    """Stream, clean and tokenize cfg.data as extraction does, keeping the rows."""
    max_len = target.length_limit(cfg.data.max_len)
    renderer = ChatRenderer(target.tokenizer, target.cfg, max_len)
    report = DropReport()
    rows = list(tokenize_stream(stream_conversations(cfg.data, report), renderer, report))
    return Tokenized(rows, report, renderer.template_name, max_len, extract.data_source(cfg.data))


@dataclass
class MaskedFeatures:
    """The hf backend's features, with the (unneeded) padding mask passed when `attention_mask`."""

    hf: extract.HFFeatures
    attention_mask: bool

    @property
    def target(self):
        return self.hf.target

    @property
    def widths(self) -> dict[str, int]:
        return self.hf.widths

    def batches(self, rows):
        kind = storage(self.hf.cfg.dtype)
        cfg = self.hf.cfg
        dtype = None if kind.scaled else kind.dtype
        return extract.feature_batches(
            self.target, rows, cfg.max_tokens, cfg.max_batch_size, dtype, self.attention_mask
        )


def extract_once(cfg: ExtractConfig, target, data: Tokenized, attention_mask: bool) -> tuple[float, Path]:
    """Wall seconds to extract and write every shard into a fresh store (the loop of
    `extract.extract_shards`, one process), and the store's directory."""
    out_dir = Path(tempfile.mkdtemp(prefix="bench_extract_"))
    identity = store_identity(
        target, load_target_config(cfg.target), cfg.dtype, data.template, data.max_len, data.source
    )
    prepare_out_dir(out_dir, identity, overwrite=False)
    kind = storage(cfg.dtype)
    plan = plan_shards(
        data.lengths,
        kind.row_bytes(target.hidden_size, target.hidden_size),
        cfg.shard_samples,
        cfg.shard_bytes,
    )
    features = MaskedFeatures(extract.HFFeatures(target, cfg), attention_mask)
    start = time.perf_counter()
    for k, (begin, end) in enumerate(plan):
        extra = {"start": begin, "stop": end, "store": store_hash(identity)}
        extract.write_shard(out_dir, k, data.rows[begin:end], features, cfg.dtype, extra, lambda *_: None)
    seconds = time.perf_counter() - start
    write_manifest(out_dir, identity, plan, data.report.to_dict(), "bench")
    return seconds, out_dir


@torch.no_grad()
def bare_forward(cfg: ExtractConfig, target, data: Tokenized) -> float:
    """Wall seconds of the target's forwards alone over the batches extraction runs (same shard plan, same
    length buckets, same padded inputs): nothing leaves the device, nothing is written."""
    kind = storage(cfg.dtype)
    plan = plan_shards(
        data.lengths,
        kind.row_bytes(target.hidden_size, target.hidden_size),
        cfg.shard_samples,
        cfg.shard_bytes,
    )
    batches = []
    for begin, end in plan:
        lengths = data.lengths[begin:end]
        for batch in bucket_batches(lengths, max_tokens=cfg.max_tokens, max_batch_size=cfg.max_batch_size):
            ids = torch.zeros(len(batch), max(lengths[i] for i in batch), dtype=torch.long)
            for row, i in enumerate(batch):
                ids[row, : lengths[i]] = torch.as_tensor(data.rows[begin + i]["input_ids"])
            batches.append(ids.to(target.device))
    sync = torch.cuda.synchronize if target.device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for ids in batches:
        target.hidden_states(ids)
    sync()
    return time.perf_counter() - start


def read_benchmark(store_dir: Path, samples: int = 300) -> dict[str, float]:
    """Median microseconds to read one random sample (hidden, ids, mask): the store's reader
    (safe_open slices) against memory-mapped numpy views (the hand-written reader it replaced)."""
    store = FeatureStore(store_dir)
    store.verify()  # both timed without the first-read checks
    order = random.Random(0).sample(range(len(store)), min(samples, len(store)))
    where = [(s, j) for s, shard in enumerate(store._shards) for j in range(len(shard.ids))]
    maps = [np.memmap(shard.path, dtype=np.uint8, mode="r") for shard in store._shards]

    def via_mmap(i: int) -> list[torch.Tensor]:
        s, j = where[i]
        shard = store._shards[s]
        begin, end = int(shard.offsets[j]), int(shard.offsets[j + 1])
        out = []
        for name, np_dtype, torch_dtype in (
            ("hidden", np.uint16, torch.bfloat16),
            ("input_ids", np.uint16, None),
            ("loss_mask", np.uint8, None),
        ):
            spec = shard.header[name]
            first, last = spec["data_offsets"]
            raw = (
                maps[s][shard.data_start + first : shard.data_start + last]
                .view(np_dtype)
                .reshape(spec["shape"])
            )
            rows = torch.from_numpy(np.array(raw[begin:end]))
            out.append(rows.view(torch_dtype) if torch_dtype else rows)
        return out

    results = {}
    for name, fn in {
        "store reader (safe_open get_slice)": store.__getitem__,
        "mmap views (before)": via_mmap,
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
    parser.add_argument("--target", default=None, help="a model directory (default: stories260K, float32)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    disable_progress_bar()
    target_cfg = to_schema(OmegaConf.load(CONF_DIR / "target" / "stories260k.yaml"), TargetConfig)
    if args.target:
        target_cfg = replace(target_cfg, name=Path(args.target).name, path=args.target, dtype="auto")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = ExtractConfig(
        target=target_cfg, data=DataConfig(name="alpaca", path=str(ALPACA), limit=args.limit), progress=False
    )
    target = load_target(target_cfg, device)
    data = tokenize(cfg, target)
    tokens = sum(data.lengths)

    seconds: dict[str, list[float]] = {name: [] for name in [BARE, *VARIANTS]}
    store_dirs: dict[str, Path] = {}
    for _ in range(args.repeats):
        took = bare_forward(cfg, target, data)
        seconds[BARE].append(took)
        print(f"  {BARE:<26}{tokens / took:>10,.0f} tokens/s", flush=True)
        for name, (overrides, mask) in VARIANTS.items():
            took, store_dir = extract_once(replace(cfg, **overrides), target, data, mask)
            seconds[name].append(took)
            print(f"  {name:<26}{tokens / took:>10,.0f} tokens/s", flush=True)
            if name in store_dirs:
                shutil.rmtree(store_dirs[name])
            store_dirs[name] = store_dir
    rates = {name: tokens / statistics.median(s) for name, s in seconds.items()}
    default = "extract (default, bf16)"
    manifests = {name: FeatureStore(store_dirs[name]).manifest for name in (default, "extract fp8")}
    reads = read_benchmark(store_dirs[default])

    print(
        f"\n{target_cfg.name} ({target.dtype}, {device}) over {ALPACA.name}: {len(data.lengths)} conversations, "
        f"{tokens} tokens, median of {args.repeats}, torch threads {args.threads}"
    )
    print(f"{'setting':<26}{'tokens/s':>12}{'x bare forward':>16}")
    for name, rate in rates.items():
        print(f"{name:<26}{rate:>12,.0f}{rate / rates[BARE]:>15.2f}x")
    for name, manifest in manifests.items():
        counts = manifest["counts"]
        print(f"{name}: {counts['bytes']:,} bytes on disk, {counts['bytes_per_token']:.1f} bytes/token")
    for name, micros in reads.items():
        print(f"random sample read, {name:<36}{micros:>8.0f} us")

    result = {
        "target": target_cfg.name,
        "target_dtype": str(target.dtype),
        "device": device,
        "threads": args.threads,
        "conversations": len(data.lengths),
        "tokens": tokens,
        "repeats": args.repeats,
        "settings": {"max_tokens": cfg.max_tokens, "max_batch_size": cfg.max_batch_size},
        "tokens_per_s": rates,
        "seconds": seconds,
        "extract_vs_bare_forward": rates[default] / rates[BARE],
        "fp8_vs_bare_forward": rates["extract fp8"] / rates[BARE],
        "bytes_per_token": {name: m["counts"]["bytes_per_token"] for name, m in manifests.items()},
        "read_us_median": reads,
    }
    out = (
        Path(__file__).resolve().parents[1]
        / "bench_results"
        / f"extract{'_' + target_cfg.name if args.target else ''}.json"
    )
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    for store_dir in store_dirs.values():
        shutil.rmtree(store_dir)


if __name__ == "__main__":
    main()
