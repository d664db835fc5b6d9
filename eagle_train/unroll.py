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
    """Per layer, the keys/values of every unrolled step so far ([batch, kv_heads, n, head_dim] each);
    `attend` adds this step's and returns the prefix + diagonal attention. The draft head's attention
    calls `attend` instead of running its own attention when handed this cache."""

    def __init__(self) -> None:
        self.keys: dict[int, list[torch.Tensor]] = {}
        self.values: dict[int, list[torch.Tensor]] = {}

    def attend(
        self,
        layer_idx: int,
        q: torch.Tensor,  # [batch, heads, n, head_dim] (RoPE applied)
        k: torch.Tensor,  # [batch, kv_heads, n, head_dim] (RoPE applied)
        v: torch.Tensor,  # [batch, kv_heads, n, head_dim]
    ) -> torch.Tensor:
        """Attention output [batch, heads, n, head_dim] of this step's queries."""
        keys = self.keys.setdefault(layer_idx, [])
        values = self.values.setdefault(layer_idx, [])
        keys.append(k)
        values.append(v)
        groups = q.shape[1] // k.shape[1]
        keys = [x.repeat_interleave(groups, dim=1) if groups > 1 else x for x in keys]
        values = [x.repeat_interleave(groups, dim=1) if groups > 1 else x for x in values]
        n, scale = q.shape[2], 1.0 / math.sqrt(q.shape[-1])
        prefix = (q @ keys[0].transpose(-1, -2)) * scale  # [b, h, n, n]: step 0's keys
        future = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        prefix = prefix.masked_fill(future, float("-inf"))
        diagonal = [(q * key).sum(-1, keepdim=True) * scale for key in keys[1:]]  # [b, h, n, 1] each
        scores = torch.cat([prefix, *diagonal], dim=-1)
        weights = torch.softmax(scores, dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype)
        out = weights[..., :n] @ values[0]
        for i, value in enumerate(values[1:]):
            out = out + weights[..., n + i : n + i + 1] * value
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
