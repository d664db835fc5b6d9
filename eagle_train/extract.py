"""Stage 1: run the frozen target over ShareGPT conversations and store its last hidden states
(with `aux=true` also the inputs of `target.aux_layers`, EAGLE-3's features).

    python -m eagle_train.extract data.path=FILE out_dir=DIR [target=...] [dtype=bfloat16|fp8]
    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 -m eagle_train.extract ...
    python -m eagle_train.extract backend=vllm ...     (vLLM computes the features: engines/vllm_features)
    python -m eagle_train.extract target.device_map=auto ...   (one target spread over a node's GPUs)

The data file is streamed: records are read, cleaned and tokenized in batches as they come, and a shard
is cut as soon as it is full (`store.shard_closes`, a pure function of the token counts and the shard
size), so memory holds one shard's token ids and one batch's hidden states whatever the file's size,
and the first shard is written after reading only its own conversations. Every process streams the
data the same way and so cuts the same shards; process r extracts shards r, r + P, r + 2P, ... Within a
shard, conversations are batched by length and right-padded (a causal decoder's real tokens never see
the padding, so no mask is needed; only real tokens are stored), and each batch's hidden states go
straight into the shard file (written in a background thread while the next batch runs). A shard with a valid sidecar is kept by a rerun, so an interrupted
extraction resumes. The output directory is prepared (and a different store refused) when the first
shard is cut, so bad input found before that (the first 256 conversations are read before any shard)
writes nothing; bad input found later stops the run naming the record, with no manifest written. After a barrier the main process
writes the one manifest.json. The output is locked (eagle_train.runtime.output_lock). See `eagle_train.store`.
"""

from __future__ import annotations

import functools
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
from eagle_train.store.codec import storage
from eagle_train.store.manifest import MANIFEST_NAME, feature_widths, store_hash, store_identity
from eagle_train.store.shard import Fill, Put
from eagle_train.store.writer import (
    completed_shard,
    prepare_out_dir,
    shard_closes,
    write_manifest,
    write_shard,
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


def stream_shards(
    rows: Iterable[dict[str, Any]], bytes_per_token: int, shard_samples: int | None, shard_bytes: int
) -> Iterator[tuple[int, int, list[dict[str, Any]]]]:
    """(start, stop, rows) of each shard as soon as it is full: `store.plan_shards` over a stream."""
    start, size, pending = 0, 0, []
    for row in rows:
        nbytes = len(row["input_ids"]) * bytes_per_token
        if shard_closes(len(pending), size, nbytes, shard_samples, shard_bytes):
            yield start, start + len(pending), pending
            start, size, pending = start + len(pending), 0, []
        pending.append(row)
        size += nbytes
    if pending:
        yield start, start + len(pending), pending


def extract_rows(
    target: Target,
    rows: Sequence[dict[str, Any]],
    max_tokens: int,
    max_batch_size: int,
    put: Put,
    dtype: torch.dtype | None = None,
    attention_mask: bool = False,
    on_batch: Callable[[int, int], None] | None = None,
    aux_layers: list[int] | None = None,
) -> None:
    """Features of a slice of tokenized conversations: `put(i, hidden [L_i, hidden])` (with `aux_layers`
    also aux=[L_i, 3 * hidden], the inputs of those layers) on the CPU for each row i, one
    length-bucketed batch at a time (in batch order, not row order), cast to `dtype` on the device first
    (None: as the target computes them, e.g. for fp8, which the shard writer encodes).

    rows: dicts with input_ids. Conversations are batched by length and right-padded; only the real
    tokens' hidden states are kept. One batch is written (in a background thread) while the next one
    runs, so the target does not wait for the disk. `on_batch(conversations, tokens)` is called after
    each forward. `attention_mask` passes the (unneeded) padding mask anyway: the benchmark's comparison.
    """
    lengths = [len(row["input_ids"]) for row in rows]

    def write(hidden: torch.Tensor, aux: torch.Tensor | None, batch: list[int]) -> None:
        for row, i in enumerate(batch):  # [L, hidden] (and [L, 3 * hidden]): the real tokens only
            more = {} if aux is None else {"aux": aux[row, : lengths[i]]}
            put(i, hidden[row, : lengths[i]], **more)

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-writer") as writer:
        pending: Future | None = None
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
            if pending is not None:
                pending.result()  # the batch before is on disk (or its error raised here)
            pending = writer.submit(write, hidden, aux, batch)
            if on_batch is not None:
                on_batch(len(batch), sum(lengths[i] for i in batch))
        if pending is not None:
            pending.result()


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

    def fill(self, rows: Sequence[dict[str, Any]], on_batch: Callable[[int, int], None]) -> Fill:
        kind = storage(self.cfg.dtype)
        return functools.partial(
            extract_rows,
            self.target,
            rows,
            self.cfg.max_tokens,
            self.cfg.max_batch_size,
            dtype=None if kind.scaled else kind.dtype,
            on_batch=on_batch,
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
            raise ValueError(
                f"target.device_map={cfg.target.device_map} spreads one target over every GPU of the node: launch "
                f"one process, not {accelerator.num_processes}"
            )
        return HFFeatures(load_target(cfg.target, accelerator.device), cfg)
    if accelerator.num_processes > 1:
        raise ValueError(
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
    target, widths = features.target, features.widths
    bytes_per_token = sum(storage(cfg.dtype).row_bytes(w, target.hidden_size) for w in widths.values())
    progress = Progress(cfg.progress and accelerator.is_main_process)
    plan: list[tuple[int, int]] = []
    kept = 0
    try:
        for k, (start, stop, shard_rows) in enumerate(
            stream_shards(rows, bytes_per_token, cfg.shard_samples, cfg.shard_bytes)
        ):
            if k == 0:  # a different store is refused on every process
                on_main(accelerator, lambda: prepare_out_dir(out_dir, identity, cfg.overwrite))
            plan.append((start, stop))
            if k % accelerator.num_processes != accelerator.process_index:
                continue
            extra = {"start": start, "stop": stop, "store": content_hash}
            if completed_shard(out_dir, k, extra) is not None:
                kept += 1
                continue
            fill = features.fill(shard_rows, progress)  # fill(put): put(i, hidden) for every row of the shard
            extra["process"] = accelerator.process_index
            write_shard(out_dir, k, shard_rows, cfg.dtype, target.vocab_size, extra, fill, widths)
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
