"""Stage: the target writes the assistant replies itself (self-distillation data for the head).

    python -m eagle_train.regenerate target=... data.path=PROMPTS out=FILE.jsonl [turns=first|all]

For each conversation the target answers the first user turn (`turns=first`) or every user turn in
order with its own earlier replies in context (`turns=all`); the original replies, if any, are
dropped. Generation is the stock Hugging Face `generate` on LEFT-padded batches (position ids follow
the attention mask, so a batched greedy reply equals the one-at-a-time reply), greedy or sampled
(temperature, top_p, seed), stopping at the target's EOS / stop ids. A prompt whose length plus
`max_new_tokens` exceeds the context (the target's max_len, or data.max_len if smaller) is skipped and
counted; in `turns=all` a later turn that does not fit ends the conversation there (counted).
`backend=vllm` has vLLM write the replies instead, from its own environment, continuously batched
(eagle_train.engines.vllm_generate): the same prompts, groups, output and resume rules; one process.

Output: ShareGPT JSONL `{"id", "conversations": [{"from": "system"|"human"|"gpt", "value"}],
"finish_reasons": ["stop"|"length", ...]}`. `<out>.stats.json` records the settings that decide the
replies (target, data file and its sha256, turns, lengths, sampling) from the start, and the counts at
the end. Each process appends whole lines to `<out>.part<rank>` (flushed per conversation group; never
through a symlink); at the end the main process merges the parts with any existing `<out>` in input
order and replaces `<out>` atomically. A rerun drops a torn trailing line and skips every id already
written, so nothing is duplicated or truncated. `out` is refused when it is the input file, or when it
(or a part file) exists but is not this command's output: lines that are not this stage's records, no
stats file, or other settings (`overwrite=true` starts it over). The output is locked
(eagle_train.runtime.output_lock).
Several processes: `ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 -m
eagle_train.regenerate ...` (or plain `accelerate launch` on GPUs).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from tqdm import tqdm

from eagle_train.cli import stage_lock, stage_main
from eagle_train.config.base import mismatches, resolve_path
from eagle_train.config.regenerate import RegenerateConfig
from eagle_train.data.render import ChatRenderer
from eagle_train.data.sharegpt import SHAREGPT_ROLES, check_data_file, load_conversations
from eagle_train.engines.vllm_generate import VllmGenerator
from eagle_train.modeling.frozen import checkpoint_sha256, load_frozen_target
from eagle_train.modeling.target import Target, load_target, target_source
from eagle_train.runtime.atomic_files import (
    OutputError,
    atomic_write_json,
    atomic_write_lines,
    check_output_file,
    file_sha256,
    read_json,
    remove_partial_files,
)
from eagle_train.runtime.errors import InputError

log = logging.getLogger(__name__)

# a backend's replies: (prompts, max_new_tokens, temperature, top_p, seed) -> (reply ids, finish) per prompt
Generate = Callable[[list[list[int]], int, float, float, int], list[tuple[list[int], str]]]


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
    generate: Generate,
    tokenizer,
    renderer: ChatRenderer,
    group: list[Conversation],
    cfg: RegenerateConfig,
    limit: int,
    seed: int,
) -> tuple[list[dict], Counter]:
    """Answer every turn of a group of conversations, one batched `generate` per turn index (`generate`:
    the backend's, prompts -> (reply ids, finish) per prompt; `generate_batch` of the hf backend).

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
        replies = generate(prompts, cfg.max_new_tokens, cfg.temperature, cfg.top_p, seed + k)
        for conv, (reply, finish) in zip(active, replies, strict=True):
            text = tokenizer.decode(reply, skip_special_tokens=True)
            conv.history += [
                {"role": "user", "content": conv.users[k]},
                {"role": "assistant", "content": text},
            ]
            conv.finish.append(finish)
            stats["tokens"] += len(reply)
    return [c.record() for c in group if c.finish], stats


# ------------------------------------------------------------------------------------- resumable output


def read_records(path: Path, complete: bool = False) -> list[dict]:
    """The records of a JSONL file written by this stage. A torn trailing line (no newline: an
    interrupted append to a part file) is ignored, unless `complete` (the merged `out`, which is only
    ever written whole): then it is an error like any line that is not one of this stage's records."""
    if not path.is_file():
        return []
    data = read_no_follow(path)
    body, _, torn = data.rpartition(b"\n")  # torn: a last line without its newline
    if complete and torn.strip():
        raise OutputError(f"{path}: the last line has no newline: not a file this stage wrote whole")
    records = []
    for number, line in enumerate(body.split(b"\n") if body else [], 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError) as err:
            raise OutputError(f"{path}: line {number}: not JSON ({err})") from None
        if not is_record(record):
            raise OutputError(
                f"{path}: line {number}: not a record written by eagle_train.regenerate "
                "(an object with id, conversations and finish_reasons)"
            )
        records.append(record)
    return records


def is_record(record) -> bool:
    """A record this stage writes: {"id", "conversations": [...], "finish_reasons": [...]}."""
    return (
        isinstance(record, dict)
        and set(record) == {"id", "conversations", "finish_reasons"}
        and isinstance(record["conversations"], list)
        and isinstance(record["finish_reasons"], list)
    )


def read_no_follow(path: Path) -> bytes:
    """A file's bytes, refusing a symlink (a planted link must not make this stage read or write
    elsewhere)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as err:
        raise OutputError(f"{path}: cannot open ({err.strerror}); a symlink is never followed") from None
    with os.fdopen(fd, "rb") as f:
        return f.read()


def open_part(path: Path):
    """The part file for appending whole lines: created if missing, never through a symlink, a torn
    trailing line cut first."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666)
    except OSError as err:
        raise OutputError(f"{path}: cannot open ({err.strerror}); a symlink is never followed") from None
    f = os.fdopen(fd, "r+b")
    data = f.read()
    f.truncate(data.rfind(b"\n") + 1)  # cut a torn line so appends start on a fresh line
    f.seek(0, os.SEEK_END)
    return f


def settings(cfg: RegenerateConfig, data_file: Path) -> dict:
    """What decides the replies: a rerun into the same `out` must match (batch sizes and process
    counts do not: a batched greedy reply equals the one-at-a-time reply). The target is its settings and
    the sha256 of every weight file (modeling.frozen.checkpoint_sha256, cached): a fine-tune in place under
    the same path would otherwise add its replies to the earlier model's."""
    target = {k: v for k, v in asdict(cfg.target).items() if k != "name"}
    data = {k: getattr(cfg.data, k) for k in ("limit", "max_len", "leading_assistant", "repeated_roles")}
    return {
        "target": target,
        "target_weight_files": checkpoint_sha256(target_source(cfg.target), cfg.target.revision),
        "data": {"path": str(data_file), "sha256": file_sha256(data_file), **data},
        **{k: getattr(cfg, k) for k in ("turns", "max_new_tokens", "temperature", "top_p", "seed")},
        **(
            {"backend": cfg.backend} if cfg.backend != "hf" else {}
        ),  # vLLM's replies are its kernels' and draws
    }


def stats_path(out: Path) -> Path:
    return out.with_name(f"{out.name}.stats.json")


def check_output(out: Path, data_file: Path, wanted: dict, overwrite: bool) -> bool:
    """Refuse an `out` that is the input, or that exists (or has part files) without being this
    command's own output: records of this stage, settings equal to `wanted` in `<out>.stats.json`
    (eagle_train.runtime.atomic_files.check_output_file). Returns True when what exists must be cleared first
    (`overwrite` with other settings)."""
    if out.exists() and data_file.exists() and os.path.samefile(out, data_file):
        raise OutputError(
            f"out={out} is the input data file: regenerate writes a new file (choose another out)"
        )
    parts = part_files(out)

    def own() -> None:
        if out.exists():
            read_records(out, complete=True)
        for part in parts:
            read_records(part)
        stats = stats_path(out)
        if not stats.is_file():
            raise OutputError(f"{out}: not written by eagle_train.regenerate (no {stats.name} beside it)")
        recorded = read_json(stats, "regenerate settings")
        recorded = recorded.get("settings", {}) if isinstance(recorded, dict) else {}
        expected = dict(wanted)
        if "target_weight_files" not in recorded:  # written before the weights were recorded
            log.warning("%s: its target's weight files were not recorded; not checked", stats)
            expected.pop("target_weight_files")
        diffs = mismatches(expected, recorded)
        if diffs:
            raise OutputError(f"{out} was written with other settings: " + "; ".join(diffs))

    return check_output_file(out, own, overwrite, parts)


def clear_output(out: Path) -> None:
    """Remove `out`, its part files and its stats (overwrite=true)."""
    for path in [out, *part_files(out), stats_path(out)]:
        path.unlink(missing_ok=True)


def part_files(out: Path) -> list[Path]:
    return sorted(out.parent.glob(f"{out.name}.part*"))


def merge(out: Path, order: dict[str, int]) -> int:
    """Merge `out` and every part file into `out` in input order (first copy of an id wins), atomically;
    remove the parts. Returns the number of records."""
    unique: dict[str, dict] = {}
    for source in [out, *part_files(out)]:
        for record in read_records(source, complete=source == out):
            unique.setdefault(record["id"], record)
    records = sorted(unique.values(), key=lambda r: order.get(r["id"], len(order)))
    atomic_write_lines(out, (json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    for part in part_files(out):
        part.unlink()
    return len(records)


# --------------------------------------------------------------------------------------------- the stage


def run(cfg: RegenerateConfig, accelerator: Accelerator | None = None) -> dict:
    """Regenerate the replies of `cfg.data` into `cfg.out`; returns the counts (also in <out>.stats.json)."""
    if not cfg.out:
        raise InputError("regenerate: set out=FILE.jsonl")
    accelerator = accelerator or Accelerator()
    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)
    out = Path(resolve_path(cfg.out) or cfg.out)
    with stage_lock(out, "regenerate", accelerator):
        return regenerate(cfg, out, accelerator)


def regenerate(cfg: RegenerateConfig, out: Path, accelerator: Accelerator) -> dict:
    """The stage under its output lock: check `out` is this command's own, answer what is not done."""
    rank, world = accelerator.process_index, accelerator.num_processes
    dataset, report = load_conversations(cfg.data, require_replies=False)
    data_file = check_data_file(cfg.data.path)
    wanted = settings(cfg, data_file)
    clear = check_output(out, data_file, wanted, cfg.overwrite)  # every rank: the same verdict
    accelerator.wait_for_everyone()
    earlier: list[dict] = []  # the counts of the runs that wrote this output before (kept in the stats)
    if accelerator.is_main_process:
        out.parent.mkdir(parents=True, exist_ok=True)
        for name in (out.name, stats_path(out).name):  # what killed writes of this output left
            remove_partial_files(out.parent, name)
        if clear:
            clear_output(out)
        elif stats_path(out).is_file():
            earlier = earlier_runs(read_json(stats_path(out), "regenerate settings"))
        atomic_write_json(stats_path(out), {"settings": wanted, "complete": False, "runs": earlier})
    accelerator.wait_for_everyone()
    ids, order = dataset["id"], {i: n for n, i in enumerate(dataset["id"])}
    done = {r["id"] for source in [out, *part_files(out)] for r in read_records(source)}
    accelerator.wait_for_everyone()  # every rank read the same done set before anyone appends
    pending = [n for n, i in enumerate(ids) if i not in done][rank::world]

    if cfg.backend == "vllm" and world > 1:
        raise InputError(
            "backend=vllm runs one vLLM for the whole regeneration: launch one process and spread the target "
            f"with vllm.tensor_parallel_size (got {world} processes)"
        )
    target = (
        load_target(cfg.target, accelerator.device) if cfg.backend == "hf" else load_frozen_target(cfg.target)
    )
    # longest prompt + reply: the target's context, or the training length (data.max_len) if smaller
    limit = target.length_limit(cfg.data.max_len)
    renderer = ChatRenderer(target.tokenizer, cfg.target, limit)
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
    bar = tqdm(
        total=len(convs),
        desc=f"regenerate[{rank}]",
        disable=not (cfg.progress and accelerator.is_main_process),
    )
    start = time.perf_counter()
    engine = (
        VllmGenerator(target, cfg.vllm, out.with_name(f"{out.name}.vllm.log"), limit)
        if cfg.backend == "vllm" and convs  # nothing left to write: no vLLM started
        else None
    )
    generate = engine.generate if engine else functools.partial(generate_batch, target)
    with contextlib.ExitStack() as stack, open_part(out.with_name(f"{out.name}.part{rank}")) as f:
        if engine:
            stack.callback(engine.close)
        for number, lo in enumerate(range(0, len(convs), cfg.batch_size)):
            group = convs[lo : lo + cfg.batch_size]
            seed = cfg.seed + rank * 1_000_003 + number * 101
            records, counts = regenerate_group(generate, target.tokenizer, renderer, group, cfg, limit, seed)
            f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode())
            f.flush()
            stats.update(counts)
            stats["written"] += len(records)
            bar.update(len(group))
            bar.set_postfix(tok_s=f"{stats['tokens'] / (time.perf_counter() - start):.0f}")
    bar.close()
    stats["seconds"] = round(time.perf_counter() - start, 3)
    return finish(accelerator, out, order, stats, wanted, earlier)


RUN_COUNTS = ("written", "tokens", "seconds", "tokens_per_s", "processes")  # one run's figures in `runs`


def earlier_runs(recorded: dict) -> list[dict]:
    """The runs a stats file records (`runs`: every run that wrote this output, its own last; a file written
    before `runs` existed: its own counts if it finished a run that wrote something). A later run, even one
    that finds nothing left to do, keeps them; a killed run never wrote any."""
    if "runs" in recorded:
        return list(recorded["runs"])
    return (
        [{k: recorded.get(k) for k in RUN_COUNTS}]
        if recorded.get("complete") and recorded.get("written")
        else []
    )


def finish(
    accelerator: Accelerator,
    out: Path,
    order: dict[str, int],
    stats: Counter,
    wanted: dict,
    earlier: list[dict] | None = None,
) -> dict:
    """Gather every rank's counts; the main process merges the parts and writes the stats file: this run's
    counts, and under `runs` every run that wrote this output (the earlier ones', then this one's if it
    wrote something)."""
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
        this_run = [{k: total.get(k) for k in RUN_COUNTS}] if total.get("written") else []
        runs = [*(earlier or []), *this_run]
        atomic_write_json(stats_path(out), {**total, "settings": wanted, "complete": True, "runs": runs})
        log.info("regenerate: %s -> %s: %s", len(order), out, total)
    accelerator.wait_for_everyone()
    return total


main = stage_main("regenerate", run)


if __name__ == "__main__":
    main()
