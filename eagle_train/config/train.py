"""Stage 2, `accelerate launch train.py`: train the EAGLE draft head on target features.

Defaults follow the reference recipe where it makes sense for a 7B target; `conf/recipe/stories260k_cpu.yaml`
(`+recipe=stories260k_cpu`) is the CPU-sized preset for the embedded target.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from eagle_train.config.data import DataConfig
from eagle_train.config.draft import EAGLE3_FAMILY, DraftConfig
from eagle_train.config.target import TargetConfig, check_eagle3_aux_layers

SOURCES = ("offline", "online")
SCHEDULES = ("constant", "linear", "cosine")
SCHEDULE_UNITS = ("step", "process")
CLIPS = ("norm", "value", "none")
NOISE_MODES = ("uniform", "length_scaled", "none")
PRECISIONS = ("auto", "no", "bf16", "fp16")
EVAL_ENGINES = ("none", "vllm")


@dataclass
class TrainDataConfig(DataConfig):
    """The conversations (online mode) or just the held-out share (offline mode: the store's ids)."""

    source: str = (
        "offline"  # offline: features from the store at `features` | online: the target runs in training
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.source not in SOURCES:
            raise ValueError(f"data.source must be one of {SOURCES}, got {self.source!r}")


@dataclass
class OptimConfig:
    """AdamW with warmup then decay, gradient clipping.

    The default schedule: 2000 warmup optimizer steps, then linear decay to 0 at the run's last step,
    whatever the process count (a run means the same on 1 or 8 GPUs, and its lr ends where it ends).
    The reference's own (`+recipe=eagle_reference`): accelerate steps its prepared scheduler once per
    process per optimizer step, so it warms up over 2000 / processes steps and decays toward 0 at
    800000 / processes steps: about 0.58x the peak after 20 epochs of 68k conversations on 4 GPUs.
    """

    lr: float = 3e-5  # peak learning rate (reference, 7B targets; 1e-2 for stories260K: conf/recipe/stories260k_cpu.yaml)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW betas
    weight_decay: float = 0.0  # AdamW decoupled weight decay (the reference: 0.01, torch's AdamW default)
    eps: float = 1e-8  # AdamW epsilon
    warmup_steps: int = 2000  # linear warmup from 0 to lr over this many schedule steps
    schedule: str = "linear"  # after warmup: constant | linear (to min_lr_ratio * lr) | cosine
    min_lr_ratio: float = 0.0  # final lr as a share of lr (linear and cosine)
    decay_steps: int | None = None  # schedule step where the decay reaches min_lr_ratio; null = the run's end
    # what one optimizer step advances the schedule by: step (1) | process (the process count, as
    # accelerate's prepared scheduler does: the reference)
    schedule_unit: str = "step"
    clip: str = "value"  # gradient clipping: norm | value | none (reference: value 0.5)
    clip_value: float = 0.5  # the max norm (clip=norm) or the max absolute value (clip=value)

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"optim.schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.clip not in CLIPS:
            raise ValueError(f"optim.clip must be one of {CLIPS}, got {self.clip!r}")
        if self.schedule_unit not in SCHEDULE_UNITS:
            raise ValueError(
                f"optim.schedule_unit must be one of {SCHEDULE_UNITS}, got {self.schedule_unit!r}"
            )
        if self.decay_steps is not None and self.decay_steps <= self.warmup_steps:
            raise ValueError(
                f"optim.decay_steps ({self.decay_steps}) must exceed warmup_steps ({self.warmup_steps})"
            )
        if self.lr <= 0 or self.warmup_steps < 0 or len(self.betas) != 2:
            raise ValueError(f"optim: need lr > 0, warmup_steps >= 0, two betas; got {self}")


DIVERGENCES = ("ce", "kl")
COD_WEIGHTINGS = ("uniform", "accepted")


@dataclass
class CodConfig:
    """P-EAGLE's COD sampling (eagle_train.training.cod): which (anchor, depth) elements a sequence trains."""

    num_depths: int = 8  # K: the longest chain trained (speculators' and NeMo's default 8)
    # depth d keeps int((N - d) * max(r^d, r_min)) elements, N the loss-masked positions (r 0.8 / r_min 0.2:
    # SpecForge's and NeMo's defaults; speculators' r is 0.7)
    r: float = 0.8
    r_min: float = 0.2
    max_anchors: int | None = None  # at most this many loss-masked positions start chains (null: all)
    # uniform: every element's loss counts (the paper, SpecForge, speculators, NeMo); accepted: a depth-d
    # element's loss counts only where the head's greedy drafts at depths 0..d-1 of its own chain are the
    # target's greedy tokens (a chain reaches depth d only then; docs/peagle.md measures both). Training
    # only: the held-out CE and accuracies are every element's, comparable across weightings
    weighting: str = "uniform"

    def __post_init__(self) -> None:
        if self.num_depths < 1 or not 0.0 < self.r <= 1.0 or not 0.0 <= self.r_min <= 1.0:
            raise ValueError(f"loss.cod: need num_depths >= 1, r in (0, 1], r_min in [0, 1]; got {self}")
        if self.weighting not in COD_WEIGHTINGS:
            raise ValueError(f"loss.cod.weighting must be one of {COD_WEIGHTINGS}, got {self.weighting!r}")
        if self.max_anchors is not None and self.max_anchors < 1:
            raise ValueError(f"loss.cod.max_anchors must be >= 1 or null, got {self.max_anchors}")


@dataclass
class LossConfig:
    """EAGLE-1: feature_weight * SmoothL1(features) + token_weight * CE(tokens), noise on the input
    features. EAGLE-3: sum over ttt_steps unrolled steps of ttt_decay^k * CE_k, no regression. P-EAGLE:
    the CE (or KL) of every COD element (`cod`) of one forward, averaged with no depth decay."""

    feature_weight: float = 1.0  # weight of the feature regression (SmoothL1); the reference's w_v
    token_weight: float = 0.1  # weight of the token cross entropy; the reference's w_p
    # CE against the target's distribution softmax(lm_head(f_{j+1})); False = the data token
    soft: bool = True
    # uniform U(-scale, scale) | length_scaled (reference code) | none; null = the head type's default:
    # uniform for eagle1, none for eagle3 (its training-time test feeds it its own errors instead)
    noise: str | None = None
    noise_scale: float = 0.1  # noise amplitude
    ttt_steps: int = 7  # eagle3: training-time test, steps unrolled over the head's own outputs
    ttt_decay: float = 0.8  # eagle3: weight of step k (0-based) is ttt_decay ** k
    cod: CodConfig = field(default_factory=CodConfig)  # peagle: the elements trained (COD sampling)
    # peagle: ce (soft CE: SpecForge) | kl (KL(target || draft): speculators, NeMo; the same gradient, the
    # value lower by the target's entropy)
    divergence: str = "ce"
    # dflash: the most anchors (blocks) a sequence trains per step, drawn anew each step among its
    # supervised positions with room for a block (the published trainers: 512)
    num_anchors: int = 512
    # dflash: slot k's loss weight exp(-(k - 1) / gamma); null = the published value for the block size
    # (16: 7, 10: 5, 8: 4), else block_size / 2 (training/dflash.default_gamma)
    dflash_gamma: float | None = None

    def __post_init__(self) -> None:
        if self.noise is not None and self.noise not in NOISE_MODES:
            raise ValueError(f"loss.noise must be one of {NOISE_MODES}, got {self.noise!r}")
        if self.divergence not in DIVERGENCES:
            raise ValueError(f"loss.divergence must be one of {DIVERGENCES}, got {self.divergence!r}")
        if self.ttt_steps < 1 or not 0.0 < self.ttt_decay <= 1.0:
            raise ValueError(f"loss.ttt_steps must be >= 1 and loss.ttt_decay in (0, 1], got {self}")
        if self.num_anchors < 1 or (self.dflash_gamma is not None and self.dflash_gamma <= 0):
            raise ValueError(
                f"loss.num_anchors must be >= 1 and loss.dflash_gamma > 0 or null, got {self.num_anchors}, "
                f"{self.dflash_gamma}"
            )


@dataclass
class TrainConfig:
    """One training run: data, model, optimisation, checkpoints and metrics."""

    target: TargetConfig = field(default_factory=TargetConfig)  # the frozen target model
    draft: DraftConfig = field(default_factory=DraftConfig)  # head shape (draft.path: initial weights)
    data: TrainDataConfig = field(default_factory=TrainDataConfig)  # online data / held-out share
    optim: OptimConfig = field(default_factory=OptimConfig)  # optimizer and schedule
    loss: LossConfig = field(default_factory=LossConfig)  # loss terms and noise
    features: str | None = None  # feature store directory (offline mode)
    out_dir: str = "outputs/train/${target.name}"  # run directory: checkpoints/, final/, metrics.jsonl
    # auto: continue from the newest checkpoint in out_dir that verifies, if its run had the same settings
    # (processes, grad_accum, epochs, max_steps, optimizer, data, target...) | never: start over, removing
    # the earlier run's checkpoints/, final/ and metrics.jsonl
    resume: str = "auto"
    seed: int = 0  # seeds the head init, batch order and noise
    max_steps: int | None = None  # optimizer steps; null = `epochs` full passes
    epochs: int = 20  # passes over the training split when max_steps is null (reference: 20)
    stop_at_step: int | None = None  # stop early after this step (schedule still follows max_steps)
    max_tokens: int = 8192  # padded tokens per micro-batch per process (reference: 4 x 2048)
    max_batch_size: int | None = 4  # most sequences per micro-batch (reference: 4 per GPU)
    bucket: bool = True  # length-bucketed micro-batches (False: shuffled, cut in order)
    # bucketed batches are sorted by length * (1 + U(0, jitter)), drawn anew each epoch: samples within ~5% of
    # each other's length get new batch mates every epoch (measured: ~1.3% more padding; 0 = the same batches)
    bucket_jitter: float = 0.05
    grad_accum: int = 1  # micro-batches per process per optimizer step
    loader_workers: int = 2  # DataLoader worker processes reading and padding micro-batches (0: in the loop)
    loader_prefetch: int = 4  # micro-batches each worker keeps ready ahead of the loop
    mixed_precision: str = (
        "auto"  # auto (bf16 on GPU, fp32 on CPU; a launcher setting wins) | no | bf16 | fp16
    )
    log_every: int = 10  # optimizer steps between metric lines
    eval_every: int = 500  # optimizer steps between held-out evaluations (0 = only at the end)
    eval_max_samples: int | None = 256  # held-out sequences evaluated (null = all)
    eval_depth: int = 5  # chain length K for k-step accuracy and the simulated acceptance length
    save_every: int = 1000  # optimizer steps between checkpoints (0 = only the final one)
    keep_last: int = 3  # full checkpoints kept in out_dir/checkpoints
    # none | vllm: every eval_engine_every steps (and at the end) run the head in a real vLLM (its own
    # environment) on held-out prompts and log its tau / acceptance (engine/vllm_*) next to eval/accept_len
    eval_engine: str = "none"
    eval_engine_every: int = 0  # optimizer steps between engine evaluations (0 = only at the end)
    eval_engine_prompts: int = 8  # held-out prompts the engine decodes
    eval_engine_max_new_tokens: int = 64  # tokens generated per prompt
    eval_engine_python: str | None = None  # vLLM's python (null = .venv-vllm/bin/python, `make vllm-env`)
    # the model vLLM loads as the target (null = target.path); e.g. a head_dim-32 re-expression of a target
    # whose head_dim vLLM's CPU attention refuses (python -m eagle_train.interop.reexpress)
    eval_engine_target: str | None = None
    wandb: bool = False  # also log to wandb (accelerate tracker; WANDB_MODE=offline unless set)
    wandb_project: str = "eagle-train"  # wandb project name
    progress: bool = True  # tqdm progress bar on the main process

    def __post_init__(self) -> None:
        if self.data.source == "offline" and not self.features:
            raise ValueError(
                "offline training needs `features=DIR` (a store from `python -m eagle_train.extract`)"
            )
        if self.resume not in ("auto", "never"):
            raise ValueError(f"resume must be auto or never, got {self.resume!r}")
        if self.mixed_precision not in PRECISIONS:
            raise ValueError(f"mixed_precision must be one of {PRECISIONS}, got {self.mixed_precision!r}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1 or null, got {self.max_steps}")
        if self.eval_engine not in EVAL_ENGINES:
            raise ValueError(f"eval_engine must be one of {EVAL_ENGINES}, got {self.eval_engine!r}")
        if self.eval_engine_every < 0 or self.eval_engine_prompts < 1 or self.eval_engine_max_new_tokens < 1:
            raise ValueError(
                "eval_engine_every must be >= 0, eval_engine_prompts and eval_engine_max_new_tokens >= 1"
            )
        if not 0.0 <= self.bucket_jitter <= 1.0:
            raise ValueError(f"bucket_jitter must be in [0, 1], got {self.bucket_jitter}")
        if self.loader_workers < 0 or self.loader_prefetch < 1:
            raise ValueError(
                f"loader_workers must be >= 0 and loader_prefetch >= 1, got {self.loader_workers}, {self.loader_prefetch}"
            )
        if self.grad_accum < 1 or self.max_tokens < 1 or self.eval_depth < 1 or self.keep_last < 1:
            raise ValueError("grad_accum, max_tokens, eval_depth and keep_last must be >= 1")
        if self.log_every < 1 or self.epochs < 1 or (self.stop_at_step is not None and self.stop_at_step < 1):
            raise ValueError(
                f"log_every and epochs must be >= 1 and stop_at_step >= 1 or null, got log_every={self.log_every}, "
                f"epochs={self.epochs}, stop_at_step={self.stop_at_step}"
            )
        if self.eval_every < 0 or self.save_every < 0:
            raise ValueError(
                f"eval_every and save_every must be >= 0 (0 = only at the end), got {self.eval_every}, {self.save_every}"
            )
        if self.draft.type in EAGLE3_FAMILY:
            check_eagle3_aux_layers(self.target.aux_layers)
        if self.loss.noise is None:
            self.loss.noise = "uniform" if self.draft.type == "eagle1" else "none"
