"""A lean decode-time forward of the EAGLE draft head (pure torch).

The head's `forward` (eagle_train.modeling.draft) goes through nn.Module calls, a RoPE module and
per-call mask building; at decode time on a CPU that per-call overhead is most of a draft step. This is
the same computation as a few fused tensor ops: q/k/v and gate/up weights concatenated once, the RoPE
table precomputed for every position, no module calls. Used by `spec.drafter.Drafter` when the head is a
Llama-style head with SiLU MLPs (the EAGLE head); `tests/spec/test_lean_draft.py` checks it against
`DraftHead.forward`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

_RMS_NORM = hasattr(F, "rms_norm")
_GQA_KWARG = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


@dataclass
class _LayerWeights:
    input_norm: torch.Tensor | None  # [d] (layer 0: none, the identity)
    qkv: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, d]
    qkv_bias: torch.Tensor | None
    qk_rot: torch.Tensor  # [(heads + kv_heads) * head_dim, d]: rotate_half of q and k, folded into weights
    qk_rot_bias: torch.Tensor | None
    o: torch.Tensor  # [d, heads * head_dim]
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor  # [d]
    gate_up: torch.Tensor  # [2 * intermediate, d]
    down: torch.Tensor  # [d, intermediate]


def supports(head) -> bool:
    """Whether `head` is the Llama-style EAGLE head this forward reproduces."""
    cfg = head.config
    return getattr(cfg, "hidden_act", "silu") == "silu" and not getattr(cfg, "mlp_bias", False)


def _rotate_rows(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of a projection rearranged so that x @ W.T = rotate_half(x @ W_orig.T) per head."""
    w = weight.view(-1, head_dim, *weight.shape[1:])
    half = head_dim // 2
    return torch.cat([-w[:, half:], w[:, :half]], dim=1).reshape(weight.shape)


def _layer_weights(layer, head_dim: int) -> _LayerWeights:
    attn, mlp = layer.self_attn, layer.mlp
    biases = [p.bias for p in (attn.q_proj, attn.k_proj, attn.v_proj)]
    norm = getattr(layer, "input_layernorm", None)
    qk = torch.cat([attn.q_proj.weight, attn.k_proj.weight])
    return _LayerWeights(
        input_norm=None if norm is None else norm.weight,
        qkv=torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
        qkv_bias=None if biases[0] is None else torch.cat(biases),
        qk_rot=_rotate_rows(qk, head_dim),
        qk_rot_bias=None if biases[0] is None else _rotate_rows(torch.cat(biases[:2]), head_dim),
        o=attn.o_proj.weight,
        o_bias=attn.o_proj.bias,
        post_norm=layer.post_attention_layernorm.weight,
        gate_up=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
        down=mlp.down_proj.weight,
    )


class LeanDraft:
    """`forward(tokens, features, positions, mask, cache) -> hidden`, equal to `DraftHead.forward`."""

    @torch.no_grad()
    def __init__(self, head, max_positions: int):
        cfg = head.config
        self.heads, self.kv_heads = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads)
        self.eps = float(cfg.rms_norm_eps)
        self.embed, self.fc, self.fc_bias = head.embed_tokens.weight, head.fc.weight, head.fc.bias
        self.lm_head = head.lm_head.weight
        self.layers = [_layer_weights(layer, self.head_dim) for layer in head.layers]
        self.rotary_emb = head.rotary_emb
        self.cos = self.sin = torch.empty(0)
        self.extend_positions(max_positions)

    @torch.no_grad()
    def extend_positions(self, max_positions: int) -> None:
        """Make the RoPE table cover positions [0, max_positions) (it only grows)."""
        if max_positions <= self.cos.shape[0]:
            return
        weight = self.fc
        positions = torch.arange(max_positions, device=weight.device).unsqueeze(0)
        cos, sin = self.rotary_emb(torch.zeros(1, 1, 1, dtype=weight.dtype, device=weight.device), positions)
        # [max_positions, (heads + kv_heads) * head_dim]: the RoPE table tiled over the q and k heads
        tiles = self.heads + self.kv_heads
        self.cos, self.sin = cos[0].repeat(1, tiles), sin[0].repeat(1, tiles)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if _RMS_NORM and x.dtype == torch.float32:
            return F.rms_norm(x, weight.shape, weight, self.eps)
        xf = x.float()
        return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    def _attention(self, i, w: _LayerWeights, h, cos, sin, mask, cache) -> torch.Tensor:
        m, hd = h.shape[0], self.head_dim
        qkv = F.linear(h, w.qkv, w.qkv_bias)
        n_qk = (self.heads + self.kv_heads) * hd
        qk = torch.addcmul(qkv[:, :n_qk] * cos, F.linear(h, w.qk_rot, w.qk_rot_bias), sin)  # RoPE
        q = qk[:, : self.heads * hd].view(m, self.heads, hd).transpose(0, 1)  # [heads, m, hd]
        k = qk[:, self.heads * hd :].view(m, self.kv_heads, hd).transpose(0, 1)
        v = qkv[:, n_qk:].view(m, self.kv_heads, hd).transpose(0, 1)
        k_all, v_all = cache.update(i, k.unsqueeze(0), v.unsqueeze(0))  # [1, kv_heads, kv, hd]
        if mask is None and m > 1:  # causal after the cached prefix
            kv = k_all.shape[2]
            mask = torch.ones(m, kv, dtype=torch.bool, device=h.device).tril(kv - m)
        if self.heads != self.kv_heads and not _GQA_KWARG:
            groups = self.heads // self.kv_heads
            k_all, v_all = k_all.repeat_interleave(groups, 1), v_all.repeat_interleave(groups, 1)
        extra = {"enable_gqa": True} if self.heads != self.kv_heads and _GQA_KWARG else {}
        out = F.scaled_dot_product_attention(q.unsqueeze(0), k_all, v_all, attn_mask=mask, **extra)
        return F.linear(out[0].transpose(0, 1).reshape(m, -1), w.o, w.o_bias)

    @torch.no_grad()
    def forward(
        self,
        tokens: torch.Tensor,  # [m]
        features: torch.Tensor,  # [m, d]
        positions: torch.Tensor | slice,  # [m], or a slice of m positions or of one (for all m inputs)
        mask: torch.Tensor | None,  # bool [1, 1, m, kv] or None (causal)
        cache,
    ) -> torch.Tensor:
        """Predicted features [m, d]; keys/values written to `cache` after its committed slots."""
        x = F.linear(torch.cat([self.embed[tokens].to(features.dtype), features], dim=-1), self.fc, self.fc_bias)
        cos, sin = self.cos[positions], self.sin[positions]  # [m or 1, (heads + kv_heads) * hd]
        for i, w in enumerate(self.layers):
            h = x if w.input_norm is None else self._norm(x, w.input_norm)
            x = x + self._attention(i, w, h, cos, sin, mask, cache)
            gate, up = F.linear(self._norm(x, w.post_norm), w.gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, w.down)
        return x

    def log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft log-probabilities [..., vocab] through the target's LM head."""
        return torch.log_softmax(F.linear(hidden, self.lm_head).float(), dim=-1)
