"""Held-out quality of a draft head as pure tensor functions (torch only).

All figures compare the draft against the TARGET's greedy token (argmax of lm_head(f_{j+1})), the token
greedy verification accepts, not against the data token.

- first-step top-1 / top-3: the head fed real features (f_j, t_{j+1}).
- k-step accuracy: a chain started at head position j, the head fed its OWN outputs for steps 2..k
  (input (f^_{j+k-1}, t_{j+k})), exactly as a chain is drafted at decode time: each step attends to
  the real prefix and its own chain (eagle_train.training.ttt, the same unroll EAGLE-3 trains with).
- simulated acceptance length for a chain of K: 1 + the number of leading steps whose top-1 equals the
  target's greedy token (the +1 is the target's bonus token), averaged over the chain starts.
The tokens fed are the data's, so the simulation is exact when the data is the target's own greedy
output (regenerated replies) and an approximation on other text. A P-EAGLE head's chain is drafted the
way vLLM drafts it, [context | next token | K-1 placeholders] in one causal forward (`parallel_unroll`):
its k-step accuracy is the accuracy of the draft at slot k.
"""

from __future__ import annotations

import torch
from torch import nn

from eagle_train.training.loss import shift_left
from eagle_train.training.ttt import parallel_unroll, unroll


@torch.no_grad()
def chain_topk(
    head: nn.Module,
    input_ids: torch.Tensor,  # [batch, n] t_{j+1}
    features: torch.Tensor,  # [batch, n, feature width] f_j (EAGLE-3: a_j)
    depth: int,
    k: int = 3,
) -> list[torch.Tensor]:
    """Top-k draft tokens [batch, n, k] (target ids: an EAGLE-3 head's draft ids mapped through its
    `vocab_map`) at each chain step 1..depth for the chains started at every j."""
    vocab_map = getattr(head, "vocab_map", None)
    drafts = parallel_unroll if getattr(head, "drafts_in_catch_up", False) else unroll
    tops = []
    for state in drafts(head, input_ids, features, depth):
        top = head.logits(state).topk(k, dim=-1).indices
        tops.append(top if vocab_map is None else vocab_map[top])
    return tops


@torch.no_grad()
def draft_metric_sums(
    head: nn.Module,
    batch: dict[
        str, torch.Tensor
    ],  # input_ids [b, n], features [b, n, d], target_hidden [b, n, d], loss_mask [b, n]
    depth: int = 5,
    target_lm_head: torch.Tensor | None = None,  # [vocab, d]; None: the head's logits are the target's
) -> dict[str, float]:
    """Counts over one batch; sum them over batches and pass to `finalize_metrics`."""
    mask = batch["loss_mask"].bool()
    target = batch["target_hidden"]
    # [b, n] the target's greedy t_{j+2}
    greedy = (head.logits(target) if target_lm_head is None else target @ target_lm_head.T).argmax(-1)
    tops = chain_topk(head, batch["input_ids"], batch["features"], depth)
    sums = {
        "first_tokens": float(mask.sum()),
        "top1": float(((tops[0][..., 0] == greedy) & mask).sum()),
        "top3": float(((tops[0] == greedy[..., None]).any(-1) & mask).sum()),
    }
    # Chains whose `depth` predicted tokens all lie in an assistant reply.
    valid = torch.stack([shift_left(mask, s, False) for s in range(depth)]).all(0)  # [b, n]
    accepted = torch.ones_like(valid)
    accept_len = torch.ones(valid.shape, dtype=torch.float32, device=valid.device)
    for step, top in enumerate(tops):
        hit = top[..., 0] == shift_left(greedy, step, -1)
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
