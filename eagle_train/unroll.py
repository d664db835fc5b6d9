"""A draft head unrolled over its own outputs: EAGLE-3's training-time test and the chain metrics.

Step 0 runs the head on the real pairs (feature_j, t_{j+1}) of every position j at once. Step k (k >= 1)
feeds each position its own step k-1 output with the token k further on, (h^{k-1}_j, t_{j+1+k}), at
position id j + k, exactly what a chain drafted from j is fed at decode time. Attention at step k from
position j sees what that chain sees: the real prefix (step 0's keys of positions 0..j, causal) and its
own earlier drafts (the keys of steps 1..k at position j: the "diagonal"). `DiagonalCache` computes
this attention with one [n, n] score block and one [n] column per later step, O(n^2 + k n) instead of
the O(k n^2) of a dense [n, (k+1) n] mask. Pure torch.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from eagle_train.loss import shift_left


class DiagonalCache:
    """Per layer, the keys/values of every unrolled step so far (expanded to the query heads once, when
    they are added); `attend` adds this step's and returns the prefix + diagonal attention. The draft
    head's attention calls `attend` instead of running its own attention when handed this cache."""

    def __init__(self) -> None:
        self.keys: dict[int, list[torch.Tensor]] = {}  # [batch, heads, n, head_dim] per step
        self.values: dict[int, list[torch.Tensor]] = {}
        self.future: torch.Tensor | None = None  # [n, n] bool, True above the diagonal

    def attend(
        self,
        layer_idx: int,
        q: torch.Tensor,  # [batch, heads, n, head_dim] (RoPE applied)
        k: torch.Tensor,  # [batch, kv_heads, n, head_dim] (RoPE applied)
        v: torch.Tensor,  # [batch, kv_heads, n, head_dim]
    ) -> torch.Tensor:
        """Attention output [batch, heads, n, head_dim] of this step's queries."""
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        keys, values = self.keys.setdefault(layer_idx, []), self.values.setdefault(layer_idx, [])
        keys.append(k)
        values.append(v)
        n, q = q.shape[2], q * (1.0 / math.sqrt(q.shape[-1]))  # scaled once, before every product
        if self.future is None or self.future.shape[0] != n:
            self.future = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        scores = [(q @ keys[0].transpose(-1, -2)).masked_fill(self.future, float("-inf"))]  # [b, h, n, n]
        if len(keys) > 1:  # this query with its own key at steps 1..k: [b, h, n, k]
            scores.append((q.unsqueeze(-2) * torch.stack(keys[1:], dim=-2)).sum(-1))
        dtype = torch.promote_types(q.dtype, torch.float32)
        weights = torch.softmax(torch.cat(scores, dim=-1), dim=-1, dtype=dtype).to(q.dtype)
        out = weights[..., :n] @ values[0]
        if len(keys) > 1:
            out = out + (weights[..., n:].unsqueeze(-1) * torch.stack(values[1:], dim=-2)).sum(-2)
        return out


def unroll(
    head: nn.Module,
    input_ids: torch.Tensor,  # [batch, n] t_{j+1}
    features: torch.Tensor,  # [batch, n, feature width] the real features of position j
    steps: int,
) -> list[torch.Tensor]:
    """The head's outputs [batch, n, hidden] at steps 0..steps-1 (see the module docstring). Padded
    columns past a row's end see only earlier columns, so right padding needs no mask."""
    cache = DiagonalCache()
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
    outputs, fed = [], features
    for k in range(steps):
        fed = head(shift_left(input_ids, k, 0), fed, positions + k, None, cache)
        outputs.append(fed)
    return outputs
