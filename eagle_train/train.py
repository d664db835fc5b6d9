"""Stage 2: train the EAGLE draft head on the target's features.

    accelerate launch train.py features=DIR out_dir=DIR max_steps=N          (offline: a feature store)
    accelerate launch train.py data.source=online data.path=FILE ...         (online: the target runs here)

One optimizer step consumes `num_processes * grad_accum` micro-batches of an epoch's plan (rank r takes
every num_processes-th), and the loss is averaged over the masked positions of the WHOLE step (all
micro-batches, all processes), so 2 processes x 1 micro-batch == 1 process x 2 micro-batches.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, InitProcessGroupKwargs
from tqdm import tqdm

from eagle_train.cli import on_main, stage_lock, stage_main
from eagle_train.config.base import resolve_path
from eagle_train.config.train import TrainConfig
from eagle_train.data.batching import padding_fraction
from eagle_train.engines.vllm_engine import check_engine_python
from eagle_train.heads import head_kind
from eagle_train.modeling.frozen import load_frozen_target
from eagle_train.modeling.head_checkpoint import save_head
from eagle_train.modeling.target import Target, TargetParts, load_target, load_target_config
from eagle_train.runtime.allocator import map_large_allocations
from eagle_train.runtime.atomic_files import atomic_write_lines, file_sha256, remove_partial_files
from eagle_train.runtime.errors import InputError
from eagle_train.training import resume as ckpt
from eagle_train.training.data import (
    MicroBatch,
    Source,
    head_batch,
    make_loader,
    pad_samples,
    plan_epoch,
    split_by_id,
    step_schedule,
)
from eagle_train.training.engine_eval import engine_metrics, held_out_prompts
from eagle_train.training.heads import build_head
from eagle_train.training.metrics import draft_metric_sums, finalize_metrics
from eagle_train.training.objective import Objective
from eagle_train.training.optim import NonFiniteError, build_optimizer, check_finite, grad_norm, lr_at, set_lr
from eagle_train.training.sources import online_features, open_online, open_store, source_identity


@dataclass
class RunData:
    """The samples, the split and how a padded host batch becomes the head's batch on the device."""

    source: Source
    train: list[int]
    held_out: list[int]
    # online: the target's forward (ids, attention) -> {"hidden", "aux"?} on the device (None: the store's)
    features_fn: Callable[[torch.Tensor, torch.Tensor], dict[str, torch.Tensor]] | None
    identity: dict[str, Any]  # target identity for checkpoint meta
    source_identity: dict[str, Any]  # the data and target part of the run's identity (resume checks it)

    def to_head(self, padded: dict[str, torch.Tensor], device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """A padded host batch (training.data.pad_samples) -> the head's batch on `device`."""
        return head_batch(padded, device, dtype, self.features_fn)

    def batch(self, indices: list[int], device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The head's batch of these samples on `device` (evaluation)."""
        return self.to_head(pad_samples([self.source[i] for i in indices]), device, dtype)


def make_accelerator(cfg: TrainConfig) -> Accelerator:
    """bf16 on GPU and fp32 on CPU unless the launcher (or cfg.mixed_precision) says otherwise."""
    precision = cfg.mixed_precision
    if precision == "auto":  # `accelerate launch` always sets the variable; "no" there means "not asked"
        launcher = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
        precision = launcher if launcher != "no" else ("bf16" if torch.cuda.is_available() else "no")
    if cfg.wandb:
        os.environ.setdefault("WANDB_MODE", "offline")
    handlers = []
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false") == "true" and not torch.cuda.is_available():
        # DeepSpeed on a CPU-only machine: without this its process group stays uninitialised (gloo).
        handlers.append(InitProcessGroupKwargs(backend="gloo"))
    return Accelerator(
        mixed_precision=precision,
        gradient_accumulation_steps=cfg.grad_accum,
        log_with="wandb" if cfg.wandb else None,
        step_scheduler_with_optimizer=False,
        kwargs_handlers=handlers,
    )


def configure_deepspeed(accelerator: Accelerator, cfg: TrainConfig) -> None:
    """Fill the DeepSpeed config from the run config (there is no dataloader for accelerate to read).

    Micro-batches are token-budgeted, so the per-GPU batch size is nominal (1); DeepSpeed accumulates
    `grad_accum` micro-batches and clips by norm (it cannot clip by value)."""
    if cfg.optim.clip == "value":
        raise InputError("DeepSpeed clips gradients by norm only: set optim.clip=norm (or none)")
    ds = accelerator.state.deepspeed_plugin.deepspeed_config
    ds["train_micro_batch_size_per_gpu"] = 1
    ds["gradient_accumulation_steps"] = cfg.grad_accum
    ds["train_batch_size"] = cfg.grad_accum * accelerator.num_processes
    ds["gradient_clipping"] = cfg.optim.clip_value if cfg.optim.clip == "norm" else 0.0


def prepare_data(cfg: TrainConfig, accelerator: Accelerator) -> tuple[RunData, TargetParts]:
    """The target's parts and the samples. Online: the whole target on the device (it computes the
    features there). Offline: only its config, tokenizer, embedding and LM head, read from the checkpoint
    in the working dtype (modeling.frozen: no decoder layer is built or read); the store is checked
    against them."""
    hf_config = load_target_config(cfg.target)
    if cfg.data.source == "online":
        target = load_target(cfg.target, accelerator.device)
    else:
        target = load_frozen_target(cfg.target, dtype=frozen_dtype(accelerator))
    kind = head_kind(cfg.draft.type)
    aux_layers = kind.layers_read(cfg.draft, target)  # EAGLE-3's features, DFlash's target layers
    with accelerator.local_main_process_first():  # one process per node hashes the weight files, once
        target.weight_files  # noqa: B018 (cached on the target and on disk)
    if cfg.data.source == "online":
        with accelerator.main_process_first():
            source, identity = open_online(cfg, target, hf_config)
        features_fn = online_features(target, aux_layers)
        data = {"sha256": file_sha256(resolve_path(cfg.data.path))}
    else:
        source, identity = open_store(
            resolve_path(cfg.features), target, hf_config, aux_layers, f"draft.type={kind.name}"
        )
        features_fn, data = None, {"store": source.content_hash()}
    train, held_out = split_by_id(source.ids, source.lengths, cfg.data.eval_fraction)
    if not train:
        raise InputError(f"no training sequences (of {len(source)}) after the held-out split")
    sources = source_identity(target, hf_config, data)
    return RunData(source, train, held_out, features_fn, identity, sources), target


def frozen_dtype(accelerator: Accelerator) -> torch.dtype:
    """The dtype of the frozen embedding and LM head: the working one (bf16 / fp16 under mixed precision,
    else float32), one copy per process: at a 128k vocabulary an fp32 copy of each costs 2.1 GB."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(
        str(accelerator.mixed_precision), torch.float32
    )


def train_step(
    model,
    batches: list[dict[str, torch.Tensor]],  # the head's batches on the device (RunData.to_head)
    objective: Objective,
    cfg: TrainConfig,
    accelerator: Accelerator,
    noise_seeds: list[int],
) -> dict[str, torch.Tensor]:
    """Forward/backward over this process's micro-batches; returns the summed terms of the objective
    plus `positions` (real head positions), not yet reduced across processes.

    The loss is normalised by the normalisers of the WHOLE step (all micro-batches, all processes).
    Each micro-batch's noise (and P-EAGLE's COD sample, drawn first) comes from its own seed (a function of
    its place in the epoch plan), so neither depends on how the micro-batches are spread over processes."""
    generators = [torch.Generator(device=accelerator.device).manual_seed(seed) for seed in noise_seeds]
    batches = [objective.prepare(b, g) for b, g in zip(batches, generators, strict=True)]
    local = torch.stack([objective.normalisers(b) for b in batches]).sum(0)
    global_normalisers = accelerator.reduce(local.clone(), "sum")
    # The loss is already a mean over the whole step; undo DDP's/DeepSpeed's average over processes and
    # accelerate's/DeepSpeed's division by the accumulation steps.
    scale = accelerator.num_processes * cfg.grad_accum
    totals = dict.fromkeys((*objective.terms, "positions"), 0.0)
    for batch, generator in zip(batches, generators, strict=True):
        with accelerator.accumulate(model), accelerator.autocast():  # gradient sync on the last one only
            sums = objective.sums(model, batch, generator)
            accelerator.backward(objective.loss(sums, global_normalisers) * scale)
        for key in objective.terms:
            totals[key] = totals[key] + sums[key].detach().float()
        totals["positions"] = totals["positions"] + batch["positions"].sum().float()
    return totals


def clip_and_step(model, optimizer, cfg: TrainConfig, accelerator: Accelerator) -> float:
    """Clip (norm or value), step, zero the gradients; returns the gradient norm before clipping.
    NonFiniteError before the step when the (all-reduced, so identical on every process) norm is not
    finite; under DeepSpeed the engine steps and the loss check in `fit` is the guard."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:  # the engine clips and steps
        optimizer.step()
        optimizer.zero_grad()
        engine_norm = model.get_global_grad_norm()
        return float(engine_norm) if engine_norm is not None else float("nan")
    params = [p for p in model.parameters() if p.requires_grad]
    norm = grad_norm(params)
    check_finite("gradient norm", norm)
    if cfg.optim.clip == "norm":
        accelerator.clip_grad_norm_(params, cfg.optim.clip_value)
    elif cfg.optim.clip == "value":
        accelerator.clip_grad_value_(params, cfg.optim.clip_value)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


@torch.no_grad()
def evaluate(
    head, data: RunData, cfg: TrainConfig, accelerator: Accelerator, objective: Objective, lm_weight
):
    """Held-out metrics (eagle_train.training.metrics: first-step top-1/3, k-step chain accuracy, simulated
    acceptance length) plus the objective's terms without noise, over all processes."""
    held_out = data.held_out[: cfg.eval_max_samples] if cfg.eval_max_samples else data.held_out
    mine = held_out[accelerator.process_index :: accelerator.num_processes]
    plan = plan_epoch(mine, data.source.lengths, cfg.max_tokens, cfg.max_batch_size, True, 0) if mine else []
    keys = [
        "first_tokens",
        "top1",
        "top3",
        *[f"step{k}" for k in range(1, cfg.eval_depth + 1)],
        "chains",
        "accept_len",
        *objective.terms,
    ]
    totals = dict.fromkeys(keys, 0.0)
    chains = head_kind(head).chain_metrics  # DFlash: its objective's per-slot figures alone
    head.eval()
    for indices in plan:
        batch = objective.prepare(data.batch(indices, accelerator.device, head.fc.weight.dtype))
        with accelerator.autocast():
            eagle3_lm = lm_weight if head.own_lm_head else None  # EAGLE-1: the head's logits are the target's
            for key, value in (
                draft_metric_sums(head, batch, cfg.eval_depth, eagle3_lm) if chains else {}
            ).items():
                totals[key] += value
            for key, value in objective.sums(head, batch, None).items():
                totals[key] += float(value)
    head.train()
    reduced = accelerator.reduce(torch.tensor([totals[k] for k in keys], device=accelerator.device), "sum")
    totals = dict(zip(keys, reduced.tolist(), strict=True))
    out = finalize_metrics(totals, cfg.eval_depth) if chains else {}
    out.update({k: v for k, v in objective.summary(totals).items() if k != "top1" or not chains})
    return {f"eval/{k}": v for k, v in out.items()}


def log_metrics(accelerator: Accelerator, out_dir: Path, step: int, values: dict[str, float]) -> None:
    """One JSON line in out_dir/metrics.jsonl (main process) and the trackers."""
    if accelerator.is_main_process:
        with open(out_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": step, **values}) + "\n")
    accelerator.log(values, step=step)


def trim_metrics(out_dir: Path, step: int) -> None:
    """Keep the metric lines up to `step` (the resumed checkpoint's): what a killed run logged after its
    last checkpoint is logged again by the resumed one, once. A torn last line is dropped too."""
    path = out_dir / "metrics.jsonl"
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line + "\n")
        except (ValueError, KeyError, TypeError):
            continue
    atomic_write_lines(path, kept)


def final_logged(out_dir: Path, step: int) -> bool:
    """Whether metrics.jsonl holds the final evaluation of `step` already: a rerun of a run that stopped
    there (nothing left to train) must not log it again. The loop evaluates only before its last step,
    so a line with eval/ values at the last step is the final evaluation."""
    path = out_dir / "metrics.jsonl"
    if not path.is_file():
        return False
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if (
            isinstance(record, dict)
            and record.get("step") == step
            and any(k.startswith("eval/") for k in record)
        ):
            return True
    return False


def total_steps(cfg: TrainConfig, data: RunData, per_step: int) -> int:
    """max_steps, or `epochs` full passes over the training plans (each epoch's own: with bucket_jitter or
    bucket=false an epoch's micro-batch count varies a little)."""
    if cfg.max_steps is not None:
        return cfg.max_steps
    return sum(len(epoch_plan(cfg, data, epoch)) // per_step for epoch in range(cfg.epochs))


def prepare_run_dir(cfg: TrainConfig, out_dir: Path) -> None:
    """Under the output lock (main process): remove what killed writes left (`.NAME.partial-*`); with
    resume=never, the earlier run's checkpoints, final head and metrics, so a later rerun cannot resume it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for directory in (out_dir, out_dir / ckpt.CHECKPOINT_DIR):
        if directory.is_dir():
            remove_partial_files(directory)
    if cfg.resume == "never":
        ckpt.clear_run(out_dir)


def resume_state(cfg: TrainConfig, s: Session) -> dict[str, Any]:
    """Trainer state from the newest valid checkpoint (resume=auto) whose run identity matches, else a
    fresh one (and a fresh metrics file); metric lines logged after the checkpoint are dropped."""
    state = ckpt.resume(s.accelerator, s.out_dir, s.identity) if cfg.resume == "auto" else None
    if state is None:
        on_main(s.accelerator, lambda: (s.out_dir / "metrics.jsonl").unlink(missing_ok=True))
        return {"step": 0, "epoch": 0, "cursor": 0}
    on_main(s.accelerator, lambda: trim_metrics(s.out_dir, state["step"]))
    return state


@dataclass
class Session:
    """Everything a run holds after setup."""

    accelerator: Accelerator
    model: Any  # the prepared head (DDP / DeepSpeed engine / plain module)
    optimizer: Any  # the prepared AdamW
    data: RunData
    objective: Objective  # what a step computes for this head type (training/objective.py)
    lm_weight: (
        torch.Tensor
    )  # the target's frozen LM head [vocab, hidden], working dtype, on the device (EAGLE-1: the head's)
    feature_dtype: torch.dtype  # the head's parameter dtype: features are decoded to it on the device
    out_dir: Path
    meta: dict[str, Any]  # checkpoint meta: target identity, max_len
    identity: dict[str, Any]  # the run's identity (training/resume.py: run_identity), checked on resume
    per_step: int  # micro-batches per optimizer step over all processes
    steps_per_epoch: int  # of the first epoch (the others may differ by a few: see total_steps)
    total: int  # optimizer steps of the whole schedule
    stop: int  # where this invocation stops (stop_at_step or total)
    target: Target | None = (
        None  # the whole target, online only (offline: loaded if the engine evaluation runs)
    )


def setup(cfg: TrainConfig, accelerator: Accelerator) -> tuple[Session, dict[str, Any]]:
    """Data, head, optimizer and the (resumed) trainer state (under the output lock). out_dir is made (or,
    with resume=never, cleared) only once every check of the data, target and head has passed: a refused
    run leaves nothing behind."""
    out_dir = Path(cfg.out_dir)
    data, target = prepare_data(cfg, accelerator)
    dtype = frozen_dtype(accelerator)
    head = build_head(cfg.draft, target, data.source, data.train, cfg.seed, dtype)
    optimizer = build_optimizer(head, cfg.optim)
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        configure_deepspeed(accelerator, cfg)
    model, optimizer = accelerator.prepare(head, optimizer)
    prepared = accelerator.unwrap_model(model)  # the frozen parts moved with it: one copy on the device
    feature_dtype = prepared.fc.weight.dtype
    if not prepared.own_lm_head:
        lm_weight = prepared.lm_head.weight  # the head's own frozen copy, no other
    else:  # an EAGLE-3 head has its own LM head: the target's is held once, for the soft targets
        lm_weight = target.lm_head.weight.detach().to(accelerator.device, dtype)
    objective = head_kind(prepared).objective(cfg.loss, lm_weight, target.logit_transform, prepared)
    if accelerator.num_processes > 1 and torch.distributed.get_world_size() != accelerator.num_processes:
        raise RuntimeError(
            f"accelerate sees {accelerator.num_processes} processes, torch.distributed "
            f"{torch.distributed.get_world_size()}: the launch is misconfigured"
        )
    per_step = accelerator.num_processes * cfg.grad_accum
    first_plan = epoch_plan(cfg, data, 0)
    steps_per_epoch = len(first_plan) // per_step
    if steps_per_epoch == 0:
        raise InputError(
            f"{len(first_plan)} micro-batches per epoch < {per_step} needed for one optimizer step "
            f"({accelerator.num_processes} processes x grad_accum {cfg.grad_accum}): lower max_tokens"
        )
    total = total_steps(cfg, data, per_step)
    identity = ckpt.run_identity(
        cfg, data.source_identity, accelerator.num_processes, precision_of(accelerator)
    )
    if cfg.wandb:
        accelerator.init_trackers(cfg.wandb_project, config=json.loads(json.dumps(asdict(cfg), default=str)))
    accelerator.print(
        f"train {len(data.train)} / held-out {len(data.held_out)} sequences, {steps_per_epoch} "
        f"steps per epoch, {total} steps, padding {padding_fraction(data.source.lengths, first_plan):.1%}"
    )
    meta = {**data.identity, "max_len": max(data.source.lengths)}
    session = Session(
        accelerator,
        model,
        optimizer,
        data,
        objective,
        lm_weight,
        feature_dtype,
        out_dir,
        meta,
        identity,
        per_step,
        steps_per_epoch,
        total,
        min(total, cfg.stop_at_step or total),
        target if isinstance(target, Target) else None,
    )
    on_main(accelerator, lambda: prepare_run_dir(cfg, out_dir))
    return session, resume_state(cfg, session)


def precision_of(accelerator: Accelerator) -> str:
    """The precision training really runs in (mixed_precision=auto resolved)."""
    return str(accelerator.mixed_precision)


def epoch_plan(cfg: TrainConfig, data: RunData, epoch: int) -> list[list[int]]:
    """The micro-batches of one epoch (a pure function of the config and the epoch: resumable)."""
    return plan_epoch(
        data.train,
        data.source.lengths,
        cfg.max_tokens,
        cfg.max_batch_size,
        cfg.bucket,
        cfg.seed + epoch,
        cfg.bucket_jitter,
    )


def noise_seeds(cfg: TrainConfig, state: dict[str, Any], accelerator: Accelerator, count: int) -> list[int]:
    """One seed per micro-batch of this process, from its place in the epoch plan, so the noise is the
    same for any process layout (2 processes x 1 micro-batch == 1 process x 2)."""
    first = cfg.seed * 1_000_003 + state["epoch"] * 100_003 + state["cursor"] + accelerator.process_index
    return [first + i * accelerator.num_processes for i in range(count)]


def window_metrics(
    totals: dict[str, float], objective: Objective, seconds: float, steps: int
) -> dict[str, float]:
    """The objective's averages of the summed train terms over a log window of `steps` optimizer steps,
    and the throughput (head positions per second, seconds per optimizer step)."""
    values = objective.summary(totals)
    values["train_top1"] = values.pop("top1")
    for key in [k for k in values if k.startswith(("ttt_acc_step", "cod_acc_depth"))]:
        values[f"train_{key}"] = values.pop(key)
    seconds = max(seconds, 1e-9)
    return {**values, "tokens_per_s": totals["positions"] / seconds, "step_s": seconds / max(steps, 1)}


def step_loader(cfg: TrainConfig, s: Session, state: dict[str, Any]) -> Iterator[tuple[MicroBatch, dict]]:
    """This process's micro-batches from the state's (epoch, cursor) to the stop, read ahead by
    `loader_workers` processes (training.data.make_loader): the same batches in the same order as an
    uninterrupted run, so a resumed run continues exactly."""
    acc = s.accelerator
    schedule = step_schedule(
        functools.partial(epoch_plan, cfg, s.data),
        state["epoch"],
        state["cursor"],
        s.per_step,
        acc.process_index,
        acc.num_processes,
        s.stop - state["step"],
    )
    pin = acc.device.type == "cuda"
    return make_loader(s.data.source, schedule, cfg.loader_workers, cfg.loader_prefetch, pin)


def fit(cfg: TrainConfig, s: Session, state: dict[str, Any]) -> None:
    """The loop: one optimizer step per iteration, logging, evaluation and checkpoints."""
    acc = s.accelerator
    bar = tqdm(total=s.stop, initial=state["step"], disable=not (cfg.progress and acc.is_local_main_process))
    loader = step_loader(cfg, s, state)
    keys = (*s.objective.terms, "positions")
    window_start, window = time.perf_counter(), torch.zeros(len(keys), device=acc.device)
    window_from = state["step"]  # the step the log window started after
    while state["step"] < s.stop:
        micro = [next(loader) for _ in range(cfg.grad_accum)]  # this process's share of the step
        state["epoch"], state["cursor"] = micro[0][0].epoch, micro[0][0].cursor
        mine = [m.indices for m, _ in micro]
        batches = [s.data.to_head(padded, acc.device, s.feature_dtype) for _, padded in micro]
        lr = lr_at(state["step"], s.total, cfg.optim, acc.num_processes)
        set_lr(s.optimizer, lr)
        sums = train_step(s.model, batches, s.objective, cfg, acc, noise_seeds(cfg, state, acc, len(batches)))
        terms = torch.stack([torch.as_tensor(sums[k], dtype=torch.float32, device=acc.device) for k in keys])
        try:
            check_finite(
                f"training loss terms ({', '.join(s.objective.terms)})", acc.reduce(terms.clone(), "sum")
            )
            norm = clip_and_step(s.model, s.optimizer, cfg, acc)
        except NonFiniteError as err:
            raise NonFiniteError(nonfinite_report(err, state, s, mine)) from None
        window += terms
        state["step"], state["cursor"] = state["step"] + 1, state["cursor"] + s.per_step
        step = state["step"]
        bar.update(1)
        if step % cfg.log_every == 0 or step == s.stop:
            totals = dict(zip(keys, acc.reduce(window, "sum").tolist(), strict=True))
            values = window_metrics(
                totals, s.objective, time.perf_counter() - window_start, step - window_from
            )
            log_metrics(
                acc, s.out_dir, step, {**values, "lr": lr, "grad_norm": norm, "epoch": state["epoch"]}
            )
            bar.set_postfix(loss=f"{values['loss']:.4f}", top1=f"{values['train_top1']:.3f}")
            window_start, window = time.perf_counter(), torch.zeros(len(keys), device=acc.device)
            window_from = step
        if cfg.eval_every and step % cfg.eval_every == 0 and step < s.stop and s.data.held_out:
            held_out = evaluate(acc.unwrap_model(s.model), s.data, cfg, acc, s.objective, s.lm_weight)
            log_metrics(acc, s.out_dir, step, held_out)
        if cfg.eval_engine != "none" and (
            (cfg.eval_engine_every and step % cfg.eval_engine_every == 0) or step == s.stop
        ):
            log_engine_metrics(cfg, s, step)
        if (cfg.save_every and step % cfg.save_every == 0) or step == s.stop:
            ckpt.save_checkpoint(acc, s.model, s.out_dir, step, s.meta, state, s.identity, cfg.keep_last)
    bar.close()


def log_engine_metrics(cfg: TrainConfig, s: Session, step: int) -> None:
    """The head in a real engine (main process; the others wait): engine/vllm_* in metrics.jsonl and wandb."""
    acc = s.accelerator
    if acc.is_main_process:
        prompts = held_out_prompts(s.data.source, s.data.held_out or s.data.train, cfg.eval_engine_prompts)
        if s.target is None:  # offline: the built-in decoder beside the engine needs the whole target
            s.target = load_target(cfg.target, acc.device)
        values = engine_metrics(acc.unwrap_model(s.model), s.target, prompts, cfg, s.out_dir / "engine_eval")
        log_metrics(acc, s.out_dir, step, values)
    acc.wait_for_everyone()


def nonfinite_report(err: NonFiniteError, state: dict[str, Any], s: Session, mine: list[list[int]]) -> str:
    """Where a non-finite value appeared: the step, the micro-batches of the epoch plan and this process's
    sample ids, and what was not done about it."""
    ids = [s.data.source.ids[i] for batch in mine for i in batch]
    shown = ", ".join(ids[:8]) + (", ..." if len(ids) > 8 else "")
    first = state["cursor"]
    return (
        f"{err} at step {state['step'] + 1} (epoch {state['epoch']}, micro-batches {first}..{first + s.per_step - 1} "
        f"of the epoch plan; this process's samples: {shown}). Stopped before the optimizer step: no "
        "checkpoint holds these weights. Check the data (a feature store is verified when read) or lower optim.lr."
    )


def run(cfg: TrainConfig) -> dict[str, float]:
    """Train the head; returns the final held-out metrics. Writes out_dir/{checkpoints,final,metrics.jsonl}
    under an exclusive lock on out_dir (eagle_train.runtime.output_lock)."""
    accelerator = make_accelerator(cfg)
    with stage_lock(cfg.out_dir, "train", accelerator):
        return train(cfg, accelerator)


def train(cfg: TrainConfig, accelerator: Accelerator) -> dict[str, float]:
    """The stage under its lock: setup, the loop, the final evaluation and head."""
    if cfg.eval_engine == "vllm":  # before any work: a broken engine stops the run at once
        on_main(accelerator, lambda: check_engine_python(cfg.eval_engine_python))
    session, state = setup(cfg, accelerator)
    # a large target trained on the CPU: freed activations go back to the OS (eagle_train.runtime.allocator)
    map_large_allocations(session.accelerator.device.type, session.lm_weight.numel())
    fit(cfg, session, state)
    acc = session.accelerator
    head = acc.unwrap_model(session.model)
    final = (
        evaluate(head, session.data, cfg, acc, session.objective, session.lm_weight)
        if session.data.held_out
        else {}
    )
    if final and not final_logged(session.out_dir, state["step"]):
        log_metrics(acc, session.out_dir, state["step"], final)
    if acc.is_main_process and state["step"] >= session.total:
        save_head(head, session.out_dir / "final", {**session.meta, "step": state["step"], **final})
    acc.wait_for_everyone()
    acc.end_training()
    return final


main = stage_main("train", run)


if __name__ == "__main__":
    main()
