"""Held-out quality of a draft head as pure tensor functions (torch only).

All figures compare the draft against the TARGET's greedy token (argmax of lm_head(f_{j+1})), the token
greedy verification accepts, not against the data token.

- first-step top-1 / top-3: the head fed real features (f_j, t_{j+1}).
- k-step accuracy: a chain started at head position j, the head fed its OWN predicted features
  for steps 2..k (input (f^_{j+k-1}, t_{j+k})), exactly as a chain is drafted at decode time: each
  step attends to the real prefix and its own chain, through the head's KV-cache protocol.
- simulated acceptance length for a chain of K: 1 + the number of leading steps whose top-1 equals the
  target's greedy token (the +1 is the target's bonus token), averaged over the chain starts.
The tokens fed are the data's, so the simulation is exact when the data is the target's own greedy
output (regenerated replies) and an approximation on other text.
"""

from __future__ import annotations

import torch
from torch import nn


class ChainCache:
    """Keys/values of every unrolled step, concatenated along the sequence axis, per layer."""

    def __init__(self) -> None:
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def update(
        self, layer_idx: int, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx in self.keys:
            key = torch.cat([self.keys[layer_idx], key], dim=2)
            value = torch.cat([self.values[layer_idx], value], dim=2)
        self.keys[layer_idx], self.values[layer_idx] = key, value
        return key, value


def chain_attention_mask(n: int, step: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """bool [1, 1, n, n * step]: at `step` (1-based) the chain started at j attends to the real
    prefix (step-1 keys 0..j) and to its own earlier steps (column j of the blocks 2..step)."""
    blocks = [torch.ones(n, n, dtype=torch.bool, device=device).tril()]
    blocks += [torch.eye(n, dtype=torch.bool, device=device)] * (step - 1)
    return torch.cat(blocks, dim=1)[None, None]


def _shift_left(x: torch.Tensor, k: int, fill: int | bool) -> torch.Tensor:
    """x[:, j + k] at column j, `fill` past the end ([batch, n, ...])."""
    if k == 0:
        return x
    out = torch.full_like(x, fill)
    out[:, :-k] = x[:, k:]
    return out


@torch.no_grad()
def chain_topk(
    head: nn.Module,
    input_ids: torch.Tensor,  # [batch, n] t_{j+1}
    features: torch.Tensor,  # [batch, n, hidden] f_j
    depth: int,
    k: int = 3,
) -> list[torch.Tensor]:
    """Top-k draft tokens [batch, n, k] at each chain step 1..depth for the chains started at every j."""
    n = input_ids.shape[1]
    cache = ChainCache()
    positions = torch.arange(n, device=input_ids.device)[None]
    tops, feats = [], features
    for step in range(1, depth + 1):
        mask = None if step == 1 else chain_attention_mask(n, step, input_ids.device)
        hidden = head(_shift_left(input_ids, step - 1, 0), feats, positions + step - 1, mask, cache)
        tops.append(head.logits(hidden).topk(k, dim=-1).indices)
        feats = hidden
    return tops


@torch.no_grad()
def draft_metric_sums(
    head: nn.Module,
    batch: dict[
        str, torch.Tensor
    ],  # input_ids [b, n], features [b, n, d], target_hidden [b, n, d], loss_mask [b, n]
    depth: int = 5,
) -> dict[str, float]:
    """Counts over one batch; sum them over batches and pass to `finalize_metrics`."""
    mask = batch["loss_mask"].bool()
    greedy = head.logits(batch["target_hidden"]).argmax(-1)  # [b, n] target's greedy t_{j+2}
    tops = chain_topk(head, batch["input_ids"], batch["features"], depth)
    sums = {
        "first_tokens": float(mask.sum()),
        "top1": float(((tops[0][..., 0] == greedy) & mask).sum()),
        "top3": float(((tops[0] == greedy[..., None]).any(-1) & mask).sum()),
    }
    # Chains whose `depth` predicted tokens all lie in an assistant reply.
    valid = torch.stack([_shift_left(mask, s, False) for s in range(depth)]).all(0)  # [b, n]
    accepted = torch.ones_like(valid)
    accept_len = torch.ones(valid.shape, dtype=torch.float32, device=valid.device)
    for step, top in enumerate(tops):
        hit = top[..., 0] == _shift_left(greedy, step, -1)
        sums[f"step{step + 1}"] = float((hit & valid).sum())
        accepted = accepted & hit
        accept_len += accepted.float()
    sums["chains"] = float(valid.sum())
    sums["accept_len"] = float(accept_len[valid].sum())
    return sums


def finalize_metrics(sums: dict[str, float], depth: int) -> dict[str, float]:
    """Ratios from summed counts: top1, top3, acc_step{k}, accept_len (tau for a chain of `depth`)."""
    first, chains = max(sums.get("first_tokens", 0.0), 1.0), max(sums.get("chains", 0.0), 1.0)
    out = {"top1": sums.get("top1", 0.0) / first, "top3": sums.get("top3", 0.0) / first}
    for step in range(1, depth + 1):
        out[f"acc_step{step}"] = sums.get(f"step{step}", 0.0) / chains
    out["accept_len"] = sums.get("accept_len", 0.0) / chains
    out["eval_tokens"] = sums.get("first_tokens", 0.0)
    return out
