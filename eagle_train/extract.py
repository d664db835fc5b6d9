"""Stage 1: run the frozen target over ShareGPT conversations and store its last hidden states
(with `aux=true` also the inputs of `target.aux_layers`, EAGLE-3's features).

    python -m eagle_train.extract data.path=FILE out_dir=DIR [target=...] [dtype=bfloat16|fp8]
    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 -m eagle_train.extract ...
    python -m eagle_train.extract backend=vllm ...     (vLLM computes the features: engines/vllm_features)
    python -m eagle_train.extract target.device_map=auto ...   (one target spread over a node's GPUs)

The data file is streamed: records are read, cleaned and tokenized in batches as they come, and a shard
is cut as soon as it is full (`store.writer.stream_shards`, the one shard planner: a pure function of
the token counts and the shard size), so memory holds one shard's token ids and one batch's hidden
states whatever the file's size, and the first shard is written after reading only its own
conversations. Every process streams the data the same way and so cuts the same shards; process r
extracts shards r, r + P, r + 2P, ... The loop is here, in `write_shard`: the features come batch by
batch from the backend (`batches(rows)`: here conversations batched by length and right-padded, a
causal decoder's real tokens never see the padding, so no mask is needed) and are pushed into the
shard (`store.writer.ShardWriter.put`: only real tokens are stored, straight into the file), each batch
written in a background thread while the next one runs. A shard with a valid sidecar is kept by a
rerun, so an interrupted extraction resumes; a kept shard is re-hashed when its file changed, when
training found it damaged, or with `verify=full`, and extracted again if its bytes differ
(store.writer.completed_shard). The output directory is prepared (and a different store
refused) when the first shard is cut, so bad input found before that (the first 256 conversations are
read before any shard) writes nothing; bad input found later stops the run naming the record, with no
manifest written. After a barrier the main process writes the one manifest.json (atomically: a complete store keeps its
manifest until a shard is written again). The output is locked
(eagle_train.runtime.output_lock). See `eagle_train.store`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from tqdm.auto import tqdm

from eagle_train.cli import on_main, stage_lock, stage_main
from eagle_train.config.data import DataConfig
from eagle_train.config.extract import ExtractConfig
from eagle_train.data.batching import bucket_batches
from eagle_train.data.render import ChatRenderer, tokenize_stream
from eagle_train.data.sharegpt import DataError, DropReport, check_data_file, stream_conversations
from eagle_train.engines.vllm_features import VllmFeatures
from eagle_train.modeling.frozen import load_frozen_target
from eagle_train.modeling.target import Target, load_target, load_target_config
from eagle_train.runtime.atomic_files import file_sha256
from eagle_train.runtime.errors import InputError
from eagle_train.store.codec import storage
from eagle_train.store.manifest import MANIFEST_NAME, feature_widths, store_hash, store_identity
from eagle_train.store.writer import (
    ShardWriter,
    completed_shard,
    prepare_out_dir,
    stream_shards,
    write_manifest,
)

log = logging.getLogger(__name__)


def data_source(cfg: DataConfig) -> dict[str, Any]:
    """The data block of the manifest: path, sha256, name and cleaning options (bad paths fail here)."""
    file = check_data_file(cfg.path)
    return {
        "name": cfg.name,
        "path": str(file),
        "sha256": file_sha256(file),
        "limit": cfg.limit,
        "leading_assistant": cfg.leading_assistant,
        "repeated_roles": cfg.repeated_roles,
    }


def feature_batches(
    target: Target,
    rows: Sequence[dict[str, Any]],
    max_tokens: int,
    max_batch_size: int,
    dtype: torch.dtype | None = None,
    attention_mask: bool = False,
    aux_layers: list[int] | None = None,
) -> Iterator[tuple[list[int], torch.Tensor, torch.Tensor | None]]:
    """The features of a slice of tokenized conversations (dicts with input_ids), one length-bucketed
    batch at a time: (row indices, hidden [b, T, hidden], aux [b, T, 3 * hidden] or None) on the CPU, row
    k right-padded after its own tokens; aux: with `aux_layers`, the inputs of those layers. Cast to
    `dtype` on the device first (None: as the target computes them, e.g. for fp8, which the shard writer
    encodes). `attention_mask` passes the (unneeded) padding mask anyway: the benchmark's comparison."""
    lengths = [len(row["input_ids"]) for row in rows]
    for batch in bucket_batches(lengths, max_tokens=max_tokens, max_batch_size=max_batch_size):
        longest = max(lengths[i] for i in batch)
        input_ids = torch.zeros(len(batch), longest, dtype=torch.long)  # [b, T], right padding
        for row, i in enumerate(batch):
            input_ids[row, : lengths[i]] = torch.as_tensor(rows[i]["input_ids"])
        # By default no attention mask: in a causal decoder a real token attends only to earlier
        # positions, all real under right padding, and its position ids are 0..L-1 either way. Without
        # a mask, SDPA runs its fused causal kernel instead of materialising a [b, heads, T, T] mask.
        mask = (torch.arange(longest)[None] < torch.tensor([lengths[i] for i in batch])[:, None]).long()
        ids, pad_mask = input_ids.to(target.device), mask.to(target.device) if attention_mask else None
        if aux_layers is None:
            hidden, aux = target.hidden_states(ids, pad_mask), None
        else:
            hidden, aux = target.aux_hidden_states(ids, pad_mask, aux_layers)  # [b, T, 3 * hidden]
            aux = (aux if dtype is None else aux.to(dtype)).cpu()
        hidden = (hidden if dtype is None else hidden.to(dtype)).cpu()  # [b, T, hidden]
        yield batch, hidden, aux


@dataclass
class HFFeatures:
    """The features of the Hugging Face target in this process (backend=hf): its last hidden states and,
    with `aux=true`, the inputs of `target.aux_layers` (EAGLE-3's)."""

    target: Target
    cfg: ExtractConfig

    @property
    def aux_layers(self) -> list[int] | None:
        return self.target.aux_layers if self.cfg.aux else None

    @property
    def widths(self) -> dict[str, int]:
        return feature_widths(self.target.hidden_size, self.aux_layers)

    def batches(
        self, rows: Sequence[dict[str, Any]]
    ) -> Iterator[tuple[list[int], torch.Tensor, torch.Tensor | None]]:
        """(row indices, hidden, aux) per length-bucketed batch of `rows` (`feature_batches`)."""
        kind = storage(self.cfg.dtype)
        return feature_batches(
            self.target,
            rows,
            self.cfg.max_tokens,
            self.cfg.max_batch_size,
            dtype=None if kind.scaled else kind.dtype,
            aux_layers=self.aux_layers,
        )

    def close(self) -> None:
        pass


class Progress:
    """The main process's tqdm bar: conversations extracted and tokens/s."""

    def __init__(self, enabled: bool):
        self.bar = tqdm(unit="conv", desc="extract", disable=not enabled)
        self.tokens, self.start = 0, time.perf_counter()

    def __call__(self, conversations: int, batch_tokens: int) -> None:
        self.tokens += batch_tokens
        self.bar.update(conversations)
        rate = self.tokens / max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(f"{rate:,.0f} tok/s", refresh=False)


def run(cfg: ExtractConfig) -> Path:
    """Extract the features of `cfg.data` with `cfg.target` into the store `cfg.out_dir`; return it."""
    storage(cfg.dtype).dtype  # noqa: B018 (dtype=fp8 on a torch without float8: refused before anything)
    accelerator = Accelerator()
    out_dir = Path(cfg.out_dir)
    with stage_lock(out_dir, "extract", accelerator):
        source = data_source(cfg.data)  # a missing or empty file fails here, before the model loads
        features = open_features(cfg, accelerator)
        try:
            target = features.target
            with accelerator.local_main_process_first():  # one process per node hashes the weight files
                target.weight_files  # noqa: B018 (cached on the target and on disk)
            max_len = target.length_limit(cfg.data.max_len)
            renderer = ChatRenderer(target.tokenizer, target.cfg, max_len)
            hf_config = load_target_config(cfg.target)
            identity = store_identity(
                target,
                hf_config,
                cfg.dtype,
                renderer.template_name,
                max_len,
                source,
                cfg.backend,
                target.aux_layers if cfg.aux else None,
            )
            report = DropReport()
            rows = tokenize_stream(stream_conversations(cfg.data, report), renderer, report)
            plan = extract_shards(cfg, features, identity, rows, accelerator)
        finally:
            features.close()
        if not plan:
            raise DataError(f"{source['path']}: no conversation left to extract ({report.format()})")
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            manifest = write_manifest(out_dir, identity, plan, report.to_dict(), store_hash(identity))
            log.info("feature store %s\n%s", out_dir / MANIFEST_NAME, format_summary(manifest["counts"]))
        accelerator.wait_for_everyone()
    return out_dir


def open_features(cfg: ExtractConfig, accelerator: Accelerator):
    """Where the features come from: the HF target here (backend=hf), or vLLM in its own environment
    (backend=vllm: this process holds only the target's embedding, LM head and final norm)."""
    if cfg.backend == "hf":
        if cfg.target.device_map is not None and accelerator.num_processes > 1:
            raise InputError(
                f"target.device_map={cfg.target.device_map} spreads one target over every GPU of the node: launch "
                f"one process, not {accelerator.num_processes}"
            )
        return HFFeatures(load_target(cfg.target, accelerator.device), cfg)
    if accelerator.num_processes > 1:
        raise InputError(
            "backend=vllm runs one vLLM for the whole extraction: launch one process and spread the target "
            f"with vllm.tensor_parallel_size (got {accelerator.num_processes} processes)"
        )
    target = load_frozen_target(cfg.target, norm=True)
    aux_layers = target.aux_layers if cfg.aux else None
    return VllmFeatures(
        target, cfg.vllm, Path(cfg.out_dir), target.length_limit(cfg.data.max_len), aux_layers
    )


def extract_shards(
    cfg: ExtractConfig,
    features,
    identity: dict[str, Any],
    rows: Iterable[dict[str, Any]],
    accelerator: Accelerator,
) -> list[tuple[int, int]]:
    """Cut the streamed rows into shards and extract this process's (index % num_processes ==
    process_index) that are not already complete; returns the plan. The output directory is prepared
    when the first shard is cut; a DataError raised later says which shards were kept."""
    out_dir, content_hash = Path(cfg.out_dir), store_hash(identity)
    target = features.target
    bytes_per_token = sum(
        storage(cfg.dtype).row_bytes(w, target.hidden_size) for w in features.widths.values()
    )
    progress = Progress(cfg.progress and accelerator.is_main_process)
    plan: list[tuple[int, int]] = []
    kept = 0
    shards = stream_shards(rows, tokens, bytes_per_token, cfg.shard_samples, cfg.shard_bytes)
    try:
        for k, (start, stop, shard_rows) in enumerate(shards):
            if k == 0:  # a different store is refused on every process
                on_main(accelerator, lambda: prepare_out_dir(out_dir, identity, cfg.overwrite))
            plan.append((start, stop))
            if k % accelerator.num_processes != accelerator.process_index:
                continue
            extra = {"start": start, "stop": stop, "store": content_hash}
            if completed_shard(out_dir, k, extra, full=cfg.verify == "full") is not None:
                kept += 1
                continue
            extra["process"] = accelerator.process_index
            write_shard(out_dir, k, shard_rows, features, cfg.dtype, extra, progress)
    except DataError as err:
        if plan:
            raise DataError(
                f"{err}. Shards before it were written, but the store has no manifest, so nothing uses it; "
                "a fixed file is another file (its sha256 is part of the store's identity): rerun with "
                "overwrite=true"
            ) from None
        raise
    finally:
        progress.bar.close()
    if kept:
        log.info("process %d: kept %d completed shards", accelerator.process_index, kept)
    return plan


def tokens(row: dict[str, Any]) -> int:
    """A tokenized conversation's length."""
    return len(row["input_ids"])


def write_shard(
    out_dir: Path,
    index: int,
    rows: Sequence[dict[str, Any]],
    features,
    dtype: str,
    extra: dict[str, Any],
    progress: Callable[[int, int], None],
) -> dict[str, Any]:
    """Extract the features of shard `index`'s rows and write the shard (then its sidecar); return the
    sidecar. One batch is written (in a background thread) while the next one runs, so the target does
    not wait for the disk."""
    vocab_size = features.target.vocab_size
    with (
        ShardWriter(out_dir, index, rows, dtype, vocab_size, features.widths, extra) as shard,
        ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-writer") as writer,
    ):
        pending: Future | None = None
        for batch, hidden, aux in features.batches(rows):
            if pending is not None:
                pending.result()  # the batch before is on disk (or its error raised here)
            pending = writer.submit(shard.put, batch, hidden, aux)
            progress(len(batch), sum(tokens(rows[i]) for i in batch))
        if pending is not None:
            pending.result()
    return shard.info


def format_summary(counts: dict[str, Any]) -> str:
    """The final summary, one figure per line."""
    skipped = ", ".join(f"{k}={v}" for k, v in sorted(counts["skipped"].items())) or "none"
    return (
        f"conversations: {counts['conversations']}  (skipped: {skipped})\n"
        f"tokens: {counts['tokens']}  assistant tokens: {counts['assistant_tokens']}\n"
        f"bytes on disk: {counts['bytes']}  bytes per token: {counts['bytes_per_token']:.1f}"
    )


main = stage_main("extract", run)


if __name__ == "__main__":
    main()
