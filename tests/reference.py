"""Slow, plain references the package is tested against, written from the facts (EAGLE.md, the shared notes),
not from the package's code: a dense-mask unroll (every step's keys concatenated, an explicit
[n, (k+1) n] mask) and the EAGLE-3 head's forward written out token by token."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from transformers import LlamaConfig


class ChainCache:
    """Keys/values of every unrolled step, concatenated along the sequence axis, per layer."""

    def __init__(self) -> None:
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def update(self, layer_idx, key, value):
        if layer_idx in self.keys:
            key = torch.cat([self.keys[layer_idx], key], dim=2)
            value = torch.cat([self.values[layer_idx], value], dim=2)
        self.keys[layer_idx], self.values[layer_idx] = key, value
        return key, value


def tiny_head_config(vocab_size: int, **extra) -> LlamaConfig:
    """The tiny one-layer head shape the head tests share (d 16, GQA 4/2, head_dim 4)."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=16,
        intermediate_size=24,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=4,
        max_position_embeddings=64,
        num_hidden_layers=1,
        **extra,
    )


def chain_attention_mask(n: int, step: int) -> torch.Tensor:
    """bool [1, 1, n, n * step]: at `step` (1-based) the chain started at j attends to the real prefix
    (step-1 keys 0..j) and to its own earlier steps (column j of the blocks 2..step)."""
    blocks = [torch.ones(n, n, dtype=torch.bool).tril()] + [torch.eye(n, dtype=torch.bool)] * (step - 1)
    return torch.cat(blocks, dim=1)[None, None]


def dense_unroll(head, input_ids, features, steps: int) -> list[torch.Tensor]:
    """The unroll with the head's own KV-cache attention and dense masks."""
    n = input_ids.shape[1]
    cache, positions, outs, fed = ChainCache(), torch.arange(n)[None], [], features
    for k in range(steps):
        ids = torch.zeros_like(input_ids)
        ids[:, : n - k] = input_ids[:, k:]
        mask = None if k == 0 else chain_attention_mask(n, k + 1)
        fed = head(ids, fed, positions + k, mask, cache)
        outs.append(fed)
    return outs


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def rotate(x: torch.Tensor, position: int, theta: float) -> torch.Tensor:
    """RoPE on one head vector [head_dim] (Llama's rotate_half convention)."""
    half = x.shape[-1] // 2
    freq = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / x.shape[-1])
    angle = position * freq
    cos, sin = torch.cos(angle).to(x.dtype), torch.sin(angle).to(x.dtype)
    x1, x2 = x[:half], x[half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin])


def eagle3_reference_logits(
    weights: dict[str, torch.Tensor],
    embedding: torch.Tensor,  # [vocab, d] the target's
    tokens: list[int],
    features: list[torch.Tensor],  # per position: [3d] target features, or [d] a fed-back state
    heads: int,
    kv_heads: int,
    eps: float,
    theta: float,
    fc_norm: bool = False,
    norm_output: bool = False,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """An EAGLE-3 head on one causal sequence, a position at a time, from the serving keys:
    h = fc(a) (fc_norm: each third RMS-normed first); x = [in_norm(e(t)) ; hidden_norm(h)]; causal
    attention with RoPE at position i; h += o(attn); h += down(silu(gate(p)) * up(p)), p =
    post_norm(h); logits = lm_head(norm(h)); the state fed on is h (norm_output: norm(h)).
    Returns (draft logits per position, states per position)."""
    w = {k: v.double() for k, v in weights.items()}
    d = w["norm.weight"].shape[0]
    head_dim = w["midlayer.self_attn.q_proj.weight"].shape[0] // heads
    keys, values, logits, states = [], [], [], []
    for i, (token, a) in enumerate(zip(tokens, features, strict=True)):
        a = a.double()
        if a.shape[0] != d:
            if fc_norm:
                a = torch.cat([rms_norm(c, w[f"fc_norm.{n}.weight"], eps) for n, c in enumerate(a.chunk(3))])
            h = w["fc.weight"] @ a
        else:
            h = a
        x = torch.cat(
            [
                rms_norm(embedding[token].double(), w["midlayer.input_layernorm.weight"], eps),
                rms_norm(h, w["midlayer.hidden_norm.weight"], eps),
            ]
        )
        q = (w["midlayer.self_attn.q_proj.weight"] @ x).view(heads, head_dim)
        k = (w["midlayer.self_attn.k_proj.weight"] @ x).view(kv_heads, head_dim)
        v = (w["midlayer.self_attn.v_proj.weight"] @ x).view(kv_heads, head_dim)
        keys.append(torch.stack([rotate(k[g], i, theta) for g in range(kv_heads)]))
        values.append(v)
        out = []
        for hd in range(heads):
            g = hd // (heads // kv_heads)
            qh = rotate(q[hd], i, theta)
            scores = torch.stack([qh @ key[g] for key in keys]) / math.sqrt(head_dim)
            p = torch.softmax(scores, 0)
            out.append(sum(p[j] * values[j][g] for j in range(len(values))))
        h = h + w["midlayer.self_attn.o_proj.weight"] @ torch.cat(out)
        post = rms_norm(h, w["midlayer.post_attention_layernorm.weight"], eps)
        mlp = F.silu(w["midlayer.mlp.gate_proj.weight"] @ post) * (w["midlayer.mlp.up_proj.weight"] @ post)
        h = h + w["midlayer.mlp.down_proj.weight"] @ mlp
        normed = rms_norm(h, w["norm.weight"], eps)
        logits.append(w["lm_head.weight"] @ normed)
        states.append(normed if norm_output else h)
    return logits, states
