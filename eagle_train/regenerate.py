"""Stage: the target writes the assistant replies itself (self-distillation data for the head).

    python -m eagle_train.regenerate target=... data.path=PROMPTS out=FILE.jsonl [turns=first|all]

For each conversation the target answers the first user turn (`turns=first`) or every user turn in
order with its own earlier replies in context (`turns=all`); the original replies, if any, are
dropped. Generation is the stock Hugging Face `generate` on LEFT-padded batches (position ids follow
the attention mask, so a batched greedy reply equals the one-at-a-time reply), greedy or sampled
(temperature, top_p, seed), stopping at the target's EOS / stop ids. A prompt whose length plus
`max_new_tokens` exceeds the context (the target's max_len, or data.max_len if smaller) is skipped and
counted; in `turns=all` a later turn that does not fit ends the conversation there (counted).

Output: ShareGPT JSONL `{"id", "conversations": [{"from": "system"|"human"|"gpt", "value"}],
"finish_reasons": ["stop"|"length", ...]}`. Each process appends whole lines to `<out>.part<rank>`
(flushed per conversation group); at the end the main process merges the parts with any existing
`<out>` in input order and replaces `<out>` atomically, and writes `<out>.stats.json`. A rerun drops
a torn trailing line and skips every id already written, so nothing is duplicated or truncated.
Several processes: `ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 -m
eagle_train.regenerate ...` (or plain `accelerate launch` on GPUs).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import hydra
import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from omegaconf import DictConfig
from tqdm import tqdm

from eagle_train.config.base import CONF_DIR, resolve_path, to_schema
from eagle_train.config.regenerate import RegenerateConfig
from eagle_train.data.render import ChatRenderer
from eagle_train.data.sharegpt import load_conversations
from eagle_train.modeling.target import Target, load_target

log = logging.getLogger(__name__)
SHAREGPT_ROLES = {"system": "system", "user": "human", "assistant": "gpt"}


# ------------------------------------------------------------------------------------------ generation


@torch.no_grad()
def generate_batch(
    target: Target,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
) -> list[tuple[list[int], str]]:
    """Replies to token-id prompts in one left-padded `generate` call.

    Returns per prompt (reply ids without the stop token, "stop" | "length").
    """
    stop_ids = target.stop_token_ids
    pad_id = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else stop_ids[0]
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # [batch, width], padded on the left
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    if temperature > 0:
        torch.manual_seed(seed)
        sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0}
    else:
        sampling = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    out = target.model.generate(
        input_ids=ids.to(target.device),
        attention_mask=mask.to(target.device),
        max_new_tokens=max_new_tokens,
        eos_token_id=stop_ids,
        pad_token_id=pad_id,
        **sampling,
    )
    stops = set(stop_ids)
    replies = []
    for row in out[:, width:].tolist():  # the new tokens; rows that stopped early are padded
        cut = next((j for j, t in enumerate(row) if t in stops), None)
        replies.append((row[:cut], "stop") if cut is not None else (row, "length"))
    return replies


@dataclass
class Conversation:
    """One conversation being regenerated: the prompt turns and what the target has written so far."""

    id: str
    system: list[dict]  # a leading system message, if any
    users: list[str]  # user turns to answer, in order
    history: list[dict] = field(default_factory=list)  # system + user/assistant turns so far
    finish: list[str] = field(default_factory=list)  # finish reason per reply
    alive: bool = True

    @classmethod
    def from_messages(cls, conv_id: str, messages: list[dict], turns: str) -> Conversation:
        system = [m for m in messages[:1] if m["role"] == "system"]
        users = [m["content"] for m in messages if m["role"] == "user"]
        conv = cls(conv_id, system, users[:1] if turns == "first" else users)
        conv.history = list(system)
        return conv

    def record(self) -> dict:
        """The ShareGPT record of what was written."""
        turns = [{"from": SHAREGPT_ROLES[m["role"]], "value": m["content"]} for m in self.history]
        return {"id": self.id, "conversations": turns, "finish_reasons": self.finish}


def regenerate_group(
    target: Target,
    renderer: ChatRenderer,
    group: list[Conversation],
    cfg: RegenerateConfig,
    limit: int,
    seed: int,
) -> tuple[list[dict], Counter]:
    """Answer every turn of a group of conversations, one batched `generate` per turn index.

    Returns the records of conversations with at least one reply, and counts (too_long, turns_cut, tokens).
    """
    stats: Counter = Counter()
    for k in range(max(len(c.users) for c in group)):
        active, prompts = [], []
        for conv in (c for c in group if c.alive and k < len(c.users)):
            prompt = renderer.render_prompt(conv.history + [{"role": "user", "content": conv.users[k]}])
            if len(prompt) + cfg.max_new_tokens > limit:
                conv.alive = False
                stats["too_long" if k == 0 else "turns_cut"] += 1
                continue
            active.append(conv)
            prompts.append(prompt)
        if not active:
            continue
        replies = generate_batch(target, prompts, cfg.max_new_tokens, cfg.temperature, cfg.top_p, seed + k)
        for conv, (reply, finish) in zip(active, replies, strict=True):
            text = target.tokenizer.decode(reply, skip_special_tokens=True)
            conv.history += [
                {"role": "user", "content": conv.users[k]},
                {"role": "assistant", "content": text},
            ]
            conv.finish.append(finish)
            stats["tokens"] += len(reply)
    return [c.record() for c in group if c.finish], stats


# ------------------------------------------------------------------------------------- resumable output


def read_records(path: Path) -> list[dict]:
    """Whole records of a JSONL file written by this stage; a torn trailing line (no newline or not
    JSON: an interrupted write) is ignored; a bad line inside the file is an error naming it."""
    if not path.is_file():
        return []
    complete, _, _torn = path.read_bytes().rpartition(b"\n")  # _torn: a last line without its newline
    records = []
    for number, line in enumerate(complete.split(b"\n") if complete else [], 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as err:
            raise ValueError(
                f"{path}: line {number}: not JSON ({err}); remove or fix that line and rerun"
            ) from err
        if not isinstance(record, dict) or "id" not in record:
            raise ValueError(
                f"{path}: line {number}: not a record with an id; remove or fix that line and rerun"
            )
        records.append(record)
    return records


def repair(path: Path) -> None:
    """Cut a torn trailing line (everything after the last newline) so appends start on a fresh line."""
    if path.is_file():
        data = path.read_bytes()
        keep = data.rfind(b"\n") + 1
        if keep != len(data):
            with path.open("r+b") as f:
                f.truncate(keep)


def part_files(out: Path) -> list[Path]:
    return sorted(out.parent.glob(f"{out.name}.part*"))


def merge(out: Path, order: dict[str, int]) -> int:
    """Merge `out` and every part file into `out` in input order (first copy of an id wins), atomically;
    remove the parts. Returns the number of records."""
    unique: dict[str, dict] = {}
    for source in [out, *part_files(out)]:
        for record in read_records(source):
            unique.setdefault(record["id"], record)
    records = sorted(unique.values(), key=lambda r: order.get(r["id"], len(order)))
    tmp = out.with_name(f".{out.name}.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out)
    for part in part_files(out):
        part.unlink()
    return len(records)


def write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------- the stage


def context_limit(cfg: RegenerateConfig, target: Target) -> int:
    """Longest prompt + reply: the target's context, or the training length (data.max_len) if smaller."""
    return min(target.max_len, cfg.data.max_len or target.max_len)


def run(cfg: RegenerateConfig, accelerator: Accelerator | None = None) -> dict:
    """Regenerate the replies of `cfg.data` into `cfg.out`; returns the counts (also in <out>.stats.json)."""
    if not cfg.out:
        raise ValueError("regenerate: set out=FILE.jsonl")
    accelerator = accelerator or Accelerator()
    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)
    rank, world = accelerator.process_index, accelerator.num_processes
    out = Path(resolve_path(cfg.out) or cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    dataset, report = load_conversations(cfg.data, require_replies=False)
    ids, order = dataset["id"], {i: n for n, i in enumerate(dataset["id"])}
    done = {r["id"] for source in [out, *part_files(out)] for r in read_records(source)}
    accelerator.wait_for_everyone()  # every rank read the same done set before anyone appends
    pending = [n for n, i in enumerate(ids) if i not in done][rank::world]

    target = load_target(cfg.target, accelerator.device)
    renderer = ChatRenderer(target.tokenizer, cfg.target, context_limit(cfg, target))
    convs = [Conversation.from_messages(ids[n], dataset[n]["messages"], cfg.turns) for n in pending]
    first_len = {
        c.id: len(renderer.render_prompt(c.history + [{"role": "user", "content": c.users[0]}]))
        for c in convs
    }
    convs.sort(key=lambda c: first_len[c.id])  # similar lengths per batch: less padding
    stats = Counter(
        conversations=len(ids),
        dropped_on_load=report.total,
        already_done=len(done),
        too_long=0,
        turns_cut=0,
        written=0,
        tokens=0,
    )
    part = out.with_name(f"{out.name}.part{rank}")
    repair(part)
    bar = tqdm(
        total=len(convs),
        desc=f"regenerate[{rank}]",
        disable=not (cfg.progress and accelerator.is_main_process),
    )
    start = time.perf_counter()
    with part.open("a", encoding="utf-8") as f:
        for number, lo in enumerate(range(0, len(convs), cfg.batch_size)):
            group = convs[lo : lo + cfg.batch_size]
            seed = cfg.seed + rank * 1_000_003 + number * 101
            records, counts = regenerate_group(target, renderer, group, cfg, context_limit(cfg, target), seed)
            f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
            f.flush()
            stats.update(counts)
            stats["written"] += len(records)
            bar.update(len(group))
            bar.set_postfix(tok_s=f"{stats['tokens'] / (time.perf_counter() - start):.0f}")
    bar.close()
    stats["seconds"] = round(time.perf_counter() - start, 3)
    return finish(accelerator, out, order, stats)


def finish(accelerator: Accelerator, out: Path, order: dict[str, int], stats: Counter) -> dict:
    """Gather every rank's counts; the main process merges the parts and writes the stats file."""
    everyone = gather_object([dict(stats)])
    accelerator.wait_for_everyone()
    total: dict = dict(everyone[0])
    for other in everyone[1:]:
        for key in ("written", "too_long", "turns_cut", "tokens"):
            total[key] = total.get(key, 0) + other.get(key, 0)
        total["seconds"] = max(total.get("seconds", 0), other.get("seconds", 0))
    total["processes"] = len(everyone)
    total["tokens_per_s"] = (
        round(total.get("tokens", 0) / total["seconds"], 1) if total.get("seconds") else 0.0
    )
    if accelerator.is_main_process:
        total["records"] = merge(out, order)
        write_json_atomic(out.with_name(f"{out.name}.stats.json"), total)
        log.info("regenerate: %s -> %s: %s", len(order), out, total)
    accelerator.wait_for_everyone()
    return total


@hydra.main(config_path=str(CONF_DIR), config_name="regenerate", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run(to_schema(cfg, RegenerateConfig))


if __name__ == "__main__":
    main()
