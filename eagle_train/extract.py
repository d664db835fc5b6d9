"""Stage 1: run the frozen target over ShareGPT conversations and store its last hidden states
(with `aux=true` also the inputs of `target.aux_layers`, EAGLE-3's features).

    python -m eagle_train.extract data.path=FILE out_dir=DIR [target=...] [dtype=float16]
    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 -m eagle_train.extract ...

Every process loads and tokenizes the data the same way and cuts it into the same shards (a pure
function of the token counts and the shard size); process r extracts shards r, r + P, r + 2P, ... Within
a shard, conversations are batched by length and right-padded (a causal decoder's real tokens never see
the padding, so no mask is needed; only real tokens are stored). A shard with a valid sidecar is kept by
a rerun, so an interrupted extraction resumes. After a barrier the main process writes the one
manifest.json. See `eagle_train.store` for the layout.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import torch
from accelerate import Accelerator
from tqdm.auto import tqdm

from eagle_train.config.base import config_hash
from eagle_train.config.data import DataConfig
from eagle_train.config.extract import ExtractConfig
from eagle_train.data.batching import bucket_batches
from eagle_train.data.render import ChatRenderer, tokenize_conversations
from eagle_train.data.sharegpt import DataError, DropReport, check_data_file, load_conversations
from eagle_train.entry import stage_main
from eagle_train.files import file_sha256
from eagle_train.modeling.target import Target, load_target, load_target_config
from eagle_train.store import (
    HIDDEN_DTYPES,
    MANIFEST_NAME,
    SCHEMA_VERSION,
    completed_shard,
    content_key,
    plan_shards,
    prepare_out_dir,
    target_config_hash,
    write_manifest,
    write_shard,
)

log = logging.getLogger(__name__)


@dataclass
class Conversations:
    """The tokenized conversations of one data file, with where they came from."""

    dataset: datasets.Dataset  # columns id, input_ids, loss_mask, num_tokens, num_assistant_tokens
    report: DropReport  # what loading and tokenizing dropped or fixed
    template: str  # the chat template's name
    max_len: int  # sequences are truncated to this many tokens
    source: dict[str, Any]  # the data block of the manifest: path, sha256, name and cleaning options

    @property
    def lengths(self) -> list[int]:
        return [int(n) for n in self.dataset["num_tokens"]]


def tokenize(
    cfg: DataConfig, messages: datasets.Dataset, report: DropReport, target: Target
) -> Conversations:
    """Render and tokenize with the target's template, truncated to data.max_len or the target's."""
    max_len = target.length_limit(cfg.max_len)
    renderer = ChatRenderer(target.tokenizer, target.cfg, max_len)
    dataset, token_report = tokenize_conversations(messages, renderer)
    report = report.merge(token_report)
    file = check_data_file(cfg.path)
    if len(dataset) == 0:
        raise DataError(f"{file}: no conversation left to extract ({report.format()})")
    source = {
        "name": cfg.name,
        "path": str(file),
        "sha256": file_sha256(file),
        "limit": cfg.limit,
        "leading_assistant": cfg.leading_assistant,
        "repeated_roles": cfg.repeated_roles,
    }
    return Conversations(dataset, report, renderer.template_name, max_len, source)


def store_identity(cfg: ExtractConfig, target: Target, data: Conversations) -> dict[str, Any]:
    """The manifest fields that decide the store's contents (a rerun must match them). `aux_layers`
    appears only in a store that holds them, so an EAGLE-1 store's identity is what it always was."""
    identity = {
        "schema_version": SCHEMA_VERSION,
        "target": {
            "name": cfg.target.name,
            "source": target.source,
            "config_hash": target_config_hash(load_target_config(cfg.target).to_dict()),
            "hidden_size": target.hidden_size,
            "vocab_size": target.vocab_size,
            "model_type": str(target.config.model_type),
            "dtype": str(target.dtype).removeprefix("torch."),
            "revision": cfg.target.revision,
            "system_prompt": cfg.target.system_prompt,
        },
        "dtype": cfg.dtype,
        "template": data.template,
        "max_len": data.max_len,
        "data": data.source,
    }
    if cfg.aux:
        identity["aux_layers"] = target.aux_layers
    return identity


def extract_rows(
    target: Target,
    rows: dict[str, list],
    max_tokens: int,
    max_batch_size: int,
    dtype: torch.dtype,
    attention_mask: bool = False,
    on_batch: Callable[[int, int], None] | None = None,
    aux_layers: list[int] | None = None,
) -> list[dict[str, Any]]:
    """Features of a slice of tokenized conversations, in the slice's order.

    rows: columns id, input_ids, loss_mask (lists). Conversations are batched by length and right-padded;
    only the real tokens' hidden states are kept. Returns one dict per conversation with "hidden"
    [L, hidden] in `dtype` on the CPU (and with `aux_layers` "aux" [L, 3 * hidden], the inputs of those
    layers). `on_batch(conversations, tokens)` is called after each forward.
    `attention_mask` passes the (unneeded) padding mask anyway: the benchmark's comparison.
    """
    lengths = [len(ids) for ids in rows["input_ids"]]
    hidden_out: list[torch.Tensor | None] = [None] * len(lengths)
    aux_out: list[torch.Tensor | None] = [None] * len(lengths)
    for batch in bucket_batches(lengths, max_tokens=max_tokens, max_batch_size=max_batch_size):
        longest = max(lengths[i] for i in batch)
        input_ids = torch.zeros(len(batch), longest, dtype=torch.long)  # [b, T], right padding
        for row, i in enumerate(batch):
            input_ids[row, : lengths[i]] = torch.as_tensor(rows["input_ids"][i])
        # By default no attention mask: in a causal decoder a real token attends only to earlier positions, all
        # real under right padding, and its position ids are 0..L-1 either way. Without a mask, SDPA
        # runs its fused causal kernel instead of materialising a [b, heads, T, T] mask.
        mask = (
            torch.arange(longest)[None] < torch.tensor([lengths[i] for i in batch])[:, None]
        ).long()  # [b, T]
        ids, pad_mask = input_ids.to(target.device), mask.to(target.device) if attention_mask else None
        if aux_layers is None:
            hidden, aux = target.hidden_states(ids, pad_mask), None
        else:
            hidden, aux = target.aux_hidden_states(ids, pad_mask, aux_layers)
            aux = aux.to(dtype).cpu()  # [b, T, 3 * hidden]
        hidden = hidden.to(dtype).cpu()  # [b, T, hidden]
        for row, i in enumerate(batch):
            hidden_out[i] = hidden[row, : lengths[i]].clone()  # [L, hidden]: the real tokens only
            if aux is not None:
                aux_out[i] = aux[row, : lengths[i]].clone()  # [L, 3 * hidden]
        if on_batch is not None:
            on_batch(len(batch), sum(lengths[i] for i in batch))
    samples = [
        {
            "id": rows["id"][i],
            "input_ids": rows["input_ids"][i],
            "loss_mask": rows["loss_mask"][i],
            "hidden": h,
        }
        for i, h in enumerate(hidden_out)
    ]
    if aux_layers is not None:
        for sample, aux in zip(samples, aux_out, strict=True):
            sample["aux"] = aux
    return samples


def extract_shards(
    cfg: ExtractConfig,
    target: Target,
    data: Conversations,
    plan: list[tuple[int, int]],
    accelerator: Accelerator,
) -> None:
    """Extract this process's shards (index % num_processes == process_index) not already complete."""
    out_dir = Path(cfg.out_dir)
    mine = [k for k in range(len(plan)) if k % accelerator.num_processes == accelerator.process_index]
    todo = [k for k in mine if completed_shard(out_dir, k, shard_extra(plan[k])) is None]
    if len(todo) < len(mine):
        log.info("process %d: keeping %d completed shards", accelerator.process_index, len(mine) - len(todo))
    total = sum(plan[k][1] - plan[k][0] for k in todo)
    bar = tqdm(
        total=total, unit="conv", desc="extract", disable=not (cfg.progress and accelerator.is_main_process)
    )
    tokens, start = 0, time.perf_counter()

    def on_batch(conversations: int, batch_tokens: int) -> None:
        nonlocal tokens
        tokens += batch_tokens
        bar.update(conversations)
        bar.set_postfix_str(f"{tokens / max(time.perf_counter() - start, 1e-9):,.0f} tok/s", refresh=False)

    for k in todo:
        begin, end = plan[k]
        rows = data.dataset[begin:end]
        samples = extract_rows(
            target,
            rows,
            cfg.max_tokens,
            cfg.max_batch_size,
            HIDDEN_DTYPES[cfg.dtype],
            on_batch=on_batch,
            aux_layers=target.aux_layers if cfg.aux else None,
        )
        extra = {**shard_extra(plan[k]), "process": accelerator.process_index}
        write_shard(out_dir, k, samples, cfg.dtype, target.vocab_size, extra=extra)
    bar.close()


def shard_extra(span: tuple[int, int]) -> dict[str, int]:
    """The sidecar fields that tie a shard to its place in the plan."""
    return {"start": span[0], "stop": span[1]}


def run(cfg: ExtractConfig) -> Path:
    """Extract the features of `cfg.data` with `cfg.target` into the store `cfg.out_dir`; return it."""
    accelerator = Accelerator()
    with accelerator.main_process_first():  # a data file built on first use is built once
        messages, report = load_conversations(cfg.data)  # bad input fails here, before anything is written
    target = load_target(cfg.target, accelerator.device)
    data = tokenize(cfg.data, messages, report, target)
    identity = store_identity(cfg, target, data)
    out_dir = Path(cfg.out_dir)
    if accelerator.is_main_process:
        prepare_out_dir(out_dir, identity, cfg.overwrite)
    accelerator.wait_for_everyone()
    states = 1 + (len(target.aux_layers) if cfg.aux else 0)  # hidden states stored per token
    bytes_per_token = states * target.hidden_size * HIDDEN_DTYPES[cfg.dtype].itemsize
    plan = plan_shards(data.lengths, bytes_per_token, cfg.shard_samples, cfg.shard_bytes)
    extract_shards(cfg, target, data, plan, accelerator)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        manifest = write_manifest(
            out_dir, identity, plan, data.report.to_dict(), config_hash(content_key(identity))
        )
        log.info("feature store %s\n%s", out_dir / MANIFEST_NAME, format_summary(manifest["counts"]))
    accelerator.wait_for_everyone()
    return out_dir


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
