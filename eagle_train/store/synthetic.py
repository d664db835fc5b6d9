"""A store of random features for a given target, written by the real writer: what benchmarks train on
when the speed or memory they measure does not depend on the features' values (scripts/bench_memory.py,
scripts/bench_train.py, scripts/gpu_check.py).

The manifest carries the target's real identity (config hash, weight fingerprint, sizes), so training
accepts the store as it accepts an extracted one; the data block names the seed instead of a file.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from eagle_train.store.manifest import feature_widths, store_hash, store_identity
from eagle_train.store.writer import plan_shards, prepare_out_dir, write_manifest, write_shard


def write_random_store(
    out_dir: str | Path,
    target,
    hf_config,
    lengths: Sequence[int],
    dtype: str = "bfloat16",
    seed: int = 0,
    shard_bytes: int = 256 << 20,
    aux_layers: list[int] | None = None,
) -> Path:
    """Samples of `lengths` tokens (random ids below the vocabulary, every token in the loss, features
    N(0, 1); with `aux_layers` EAGLE-3's aux features too) for `target` (a Target or FrozenTarget) in
    `dtype`, as a complete store at `out_dir`."""
    out_dir = Path(out_dir)
    data = {"name": "synthetic", "path": f"synthetic-seed{seed}", "sha256": f"synthetic-seed{seed}"}
    identity = store_identity(
        target, hf_config, dtype, "synthetic", max(lengths), data, aux_layers=aux_layers
    )
    prepare_out_dir(out_dir, identity, overwrite=True)
    widths = feature_widths(target.hidden_size, aux_layers)
    row_bytes = 2 * sum(widths.values())
    plan = plan_shards(lengths, row_bytes, None, shard_bytes)
    generator = torch.Generator().manual_seed(seed)
    for k, (start, stop) in enumerate(plan):
        samples = [
            {
                "id": f"synthetic_{i}",
                "input_ids": torch.randint(0, target.vocab_size, (lengths[i],), generator=generator).tolist(),
                "loss_mask": [1] * lengths[i],
                **{
                    name: torch.randn(lengths[i], width, generator=generator)
                    for name, width in widths.items()
                },
            }
            for i in range(start, stop)
        ]
        extra = {"start": start, "stop": stop, "store": store_hash(identity)}
        write_shard(out_dir, k, samples, dtype, target.vocab_size, extra)
    write_manifest(out_dir, identity, plan, {}, store_hash(identity))
    return out_dir
