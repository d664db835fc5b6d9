"""A draft head unrolled over its own outputs: EAGLE-3's training-time test and the chain metrics (and a
P-EAGLE head unrolled over its placeholders: `parallel_unroll`, the chain metrics of P-EAGLE).

Step 0 runs the head on the real pairs (feature_j, t_{j+1}) of every position j at once. Step k (k >= 1)
feeds each position its own step k-1 output with the token k further on, (h^{k-1}_j, t_{j+1+k}), at
position id j + k, exactly what a chain drafted from j is fed at decode time. Attention at step k from
position j sees what that chain sees: the real prefix (step 0's keys of positions 0..j, causal) and its
own earlier drafts (the keys of steps 1..k at position j: the "diagonal"). `DiagonalCache` computes
this attention with one [n, n] score block and one [n] column per later step, O(n^2 + k n) instead of
the O(k n^2) of a dense [n, (k+1) n] mask. On the CPU the prefix block is the fused causal kernel
(`PrefixDiagonalAttention`: no [n, n] scores in memory, the masked half skipped), joined to the diagonal
by its log-sum-exp. Pure torch.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from eagle_train.training.loss import shift_left


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
        if len(keys) == 1:  # step 0: the prefix alone
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        diagonal = torch.stack(keys[1:], dim=-2), torch.stack(values[1:], dim=-2)  # [b, h, n, k, head_dim]
        if q.device.type == "cpu" and FLASH_CPU is not None:
            return PrefixDiagonalAttention.apply(q, keys[0], values[0], *diagonal)
        return dense_prefix_diagonal(q, keys[0], values[0], *diagonal, self.future_mask(q))

    def future_mask(self, q: torch.Tensor) -> torch.Tensor:
        """[n, n] bool, True above the diagonal (made once per length)."""
        n = q.shape[2]
        if self.future is None or self.future.shape[0] != n:
            self.future = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        return self.future


def dense_prefix_diagonal(q, k0, v0, kd, vd, future: torch.Tensor) -> torch.Tensor:
    """Softmax attention of q [b, h, m, e] over the prefix k0, v0 [b, h, n, e] and each query's own
    diagonal keys kd, vd [b, h, m, k, e], with the [m, n] scores in memory (`future` [.., m, n], True: the
    masked part; the unroll's is causal, m = n)."""
    n, q = k0.shape[2], q * (1.0 / math.sqrt(q.shape[-1]))  # scaled once, before every product
    prefix = (q @ k0.transpose(-1, -2)).masked_fill(future, float("-inf"))  # [b, h, n, n]
    diagonal = (q.unsqueeze(-2) * kd).sum(-1)  # [b, h, n, k]
    dtype = torch.promote_types(q.dtype, torch.float32)
    weights = torch.softmax(torch.cat([prefix, diagonal], dim=-1), dim=-1, dtype=dtype).to(q.dtype)
    return weights[..., :n] @ v0 + (weights[..., n:].unsqueeze(-1) * vd).sum(-2)


# The CPU's fused attention kernel with its log-sum-exp (private in torch; None where a build lacks it).
FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
FLASH_CPU_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


class PrefixDiagonalAttention(torch.autograd.Function):
    """`dense_prefix_diagonal`'s result and gradients without the [n, n] block: the fused causal kernel
    gives the prefix's output o_p and log-sum-exp l_p; with the diagonal scores d [.., k],
    l = logaddexp(l_p, logsumexp(d)) and out = exp(l_p - l) o_p + sum_i exp(d_i - l) vd_i. Backward: the
    kernel's own backward handed the JOINT out and l recomputes the prefix weights exp(s - l) of the joint
    softmax and its row term grad . out, so it returns the prefix's exact gradients; the diagonal's are
    written out (scores d_i = q . kd_i / sqrt(e), weights w_i = exp(d_i - l))."""

    @staticmethod
    def forward(ctx, q, k0, v0, kd, vd, mask=None):
        """mask: None (the prefix is causal) or an additive float mask [b|1, 1, m, n] (0 / -inf)."""
        scale = 1.0 / math.sqrt(q.shape[-1])
        prefix, prefix_lse = FLASH_CPU(
            q, k0, v0, 0.0, mask is None, attn_mask=mask, scale=scale
        )  # [b, h, m, e]
        dtype = torch.promote_types(q.dtype, torch.float32)
        diagonal = (q.unsqueeze(-2) * kd).sum(-1).to(dtype) * scale  # [b, h, n, k]
        lse = torch.logaddexp(prefix_lse, diagonal.logsumexp(-1))  # [b, h, n]
        weights = (diagonal - lse.unsqueeze(-1)).exp()  # [b, h, n, k]
        out = prefix * (prefix_lse - lse).exp().unsqueeze(-1) + (weights.unsqueeze(-1) * vd).sum(-2)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k0, v0, kd, vd, weights, out, lse)
        ctx.scale, ctx.mask = scale, mask
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k0, v0, kd, vd, weights, out, lse = ctx.saved_tensors
        grad = grad.contiguous()
        causal, mask = ctx.mask is None, ctx.mask
        dq, dk0, dv0 = FLASH_CPU_BACKWARD(
            grad, q, k0, v0, out, lse, 0.0, causal, attn_mask=mask, scale=ctx.scale
        )
        row = (grad * out).sum(-1, keepdim=True).to(weights.dtype)  # [b, h, n, 1]: grad . out
        dd = (
            weights * ((grad.unsqueeze(-2) * vd).sum(-1) - row) * ctx.scale
        )  # [b, h, n, k] d loss / d (q.kd_i)
        dq = dq + (dd.unsqueeze(-1) * kd).sum(-2).to(q.dtype)
        dkd = (dd.unsqueeze(-1) * q.unsqueeze(-2)).to(kd.dtype)
        dvd = (weights.unsqueeze(-1) * grad.unsqueeze(-2)).to(vd.dtype)
        return dq, dk0, dv0, dkd, dvd, None


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


def parallel_unroll(
    head: nn.Module,
    input_ids: torch.Tensor,  # [batch, n] t_{j+1}
    features: torch.Tensor,  # [batch, n, 3 d_t] the real features of position j
    steps: int,
) -> list[torch.Tensor]:
    """A P-EAGLE head's outputs [batch, n, hidden] at steps 0..steps-1: step 0 the real pairs, step k >= 1
    the placeholders (mask token, mask_hidden: `head.placeholders`) at position j + k. With the prefix +
    diagonal attention above, step k at column j is the draft vLLM makes at slot k of a chain anchored at
    j: one causal forward over [pairs 0..j | k placeholders] (tests/training/test_cod.py checks it)."""
    cache = DiagonalCache()
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
    outputs = [head(input_ids, features, positions, None, cache)]
    ids, fed = head.placeholders(input_ids, features, torch.ones_like(input_ids, dtype=torch.bool))
    for k in range(1, steps):
        outputs.append(head(ids, fed, positions + k, None, cache))
    return outputs
