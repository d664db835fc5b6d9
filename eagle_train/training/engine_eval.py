"""During training, the head in a real engine (`eval_engine=vllm`, every `eval_engine_every` steps).

The held-out conversations' prompts (their tokens before the first assistant token) are decoded greedily
by vLLM with the head as it is now (exported in vLLM's layout, re-expressed to the engine target's
head_dim when that differs), drafting chains of `eval_depth` tokens: vLLM's own counters give the
engine's tau and acceptance by position, logged next to the simulated `eval/accept_len`, with the
built-in chain decoder's tau on the same prompts (`engine/builtin_tau`) and whether the counters agree
exactly (`engine/agree`: 1 or 0).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from eagle_train.config.base import resolve_path
from eagle_train.config.decode import DecodeConfig
from eagle_train.config.train import TrainConfig
from eagle_train.decoding.decoder import SpeculativeDecoder
from eagle_train.decoding.stats import counts_acceptance, counts_tau
from eagle_train.engines.vllm_engine import run_vllm, speculative_config
from eagle_train.interop.layouts import export_head
from eagle_train.interop.reexpress import widen_head
from eagle_train.modeling.draft import DraftHead
from eagle_train.modeling.head_checkpoint import CONFIG_NAME
from eagle_train.modeling.target import Target
from eagle_train.report.results import spec_counts


def held_out_prompts(source, indices: list[int], count: int) -> list[list[int]]:
    """The first `count` held-out sequences cut before their first assistant (loss-masked) token."""
    prompts = []
    for i in indices:
        sample = source[i]
        mask = sample["loss_mask"].bool()
        start = int(mask.nonzero()[0]) if mask.any() else min(len(mask), 16)
        if start >= 1:
            prompts.append(sample["input_ids"][:start].tolist())
        if len(prompts) == count:
            break
    return prompts


def engine_target_dir(cfg: TrainConfig, target: Target) -> Path:
    """The model directory vLLM loads as the target (eval_engine_target, else the target itself)."""
    return (
        Path(resolve_path(cfg.eval_engine_target) or cfg.eval_engine_target)
        if cfg.eval_engine_target
        else Path(target.source)
    )


@torch.no_grad()
def engine_metrics(
    head: DraftHead, target: Target, prompts: list[list[int]], cfg: TrainConfig, work_dir: Path
) -> dict[str, float]:
    """`engine/vllm_tau`, `engine/vllm_acc{k}` (conditional, k = 1..eval_depth) and the log's
    weight-loading complaints, for the head as it is now."""
    model_dir = engine_target_dir(cfg, target)
    config = json.loads((model_dir / CONFIG_NAME).read_text())
    head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    export = head if head.config.head_dim == head_dim else widen_head(head, head_dim)
    head_dir = export_head(export, "vllm", work_dir / "head", meta={"target": target.cfg.name})
    result = run_vllm(
        model_dir,
        prompts,
        {"chain": speculative_config(head_dir, cfg.eval_depth)},
        work_dir,
        max_tokens=cfg.eval_engine_max_new_tokens,
        stop_token_ids=target.stop_token_ids,
        max_model_len=target.max_len,
        python=cfg.eval_engine_python,
        warmup=0,
        dtype=target.cfg.dtype,
    )
    counts = spec_counts(result.outputs("chain"))
    builtin = builtin_chain_counts(head, target, prompts, cfg)
    values = {
        "engine/vllm_tau": counts_tau(counts) or 1.0,
        "engine/builtin_tau": counts_tau(builtin) or 1.0,
        "engine/agree": float(counts == builtin),
        "engine/vllm_drafts": float(counts["num_drafts"]),
        "engine/vllm_load_warnings": float(len(result.runs["chain"].load_warnings)),
    }
    for k, rate in enumerate(counts_acceptance(counts), start=1):
        values[f"engine/vllm_acc{k}"] = rate if rate is not None else float("nan")
    return values


def builtin_chain_counts(head: DraftHead, target: Target, prompts: list[list[int]], cfg: TrainConfig) -> dict:
    """The built-in chain decoder's counters on the same prompts (what vLLM's must equal)."""
    decode = DecodeConfig(
        method="chain", chain_length=cfg.eval_depth, max_new_tokens=cfg.eval_engine_max_new_tokens
    )
    was_training = head.training
    head.eval()
    decoder = SpeculativeDecoder(target, head, decode)
    rounds = [decoder.generate(p).stats for p in prompts]
    head.train(was_training)
    return spec_counts(
        [
            {"accept_lengths": [a + 1 for a in r.accepted_per_round], "draft_depths": r.tree_depth_per_round}
            for r in rounds
        ]
    )
