"""A lean decode-time forward of the EAGLE draft heads (pure torch): EAGLE-1/2, EAGLE-3 and P-EAGLE.

The head's `forward` (eagle_train.modeling.draft) goes through nn.Module calls, a RoPE module and
per-call mask building; at decode time on a CPU that per-call overhead is most of a draft step. This is
the same computation as a few fused tensor ops: one projection gives q, k, v and rotate_half(q, k) (RoPE
is then one multiply-add against a table precomputed for every position), keys and values are written
to the cache in one copy, gate/up is one projection, the residual adds ride in the output projections'
addmm, and there are no module calls. Used by `decoding.drafter.Drafter` when the head is a
Llama-style head with SiLU MLPs (`lean_forward` picks `LeanDraft` for the EAGLE-1/2 head, `LeanEagle3`
for the EAGLE-3 and P-EAGLE ones, any number of layers); `tests/decoding/test_lean_draft.py` checks them
against the heads' `forward`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eagle_train.decoding.kv_cache import attention_shape

_RMS_NORM = hasattr(F, "rms_norm")
_GQA_KWARG = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


@dataclass
class _LayerWeights:
    input_norm: torch.Tensor | None  # [d] (layer 0: none, the identity)
    # [2 * (heads + 2 * kv_heads) * head_dim, d]: q, k, v, then rotate_half of q and k folded into the
    # weights and zero rows for v, so one projection gives both halves of RoPE (see `_attention`)
    proj: torch.Tensor
    proj_bias: torch.Tensor | None
    o_t: torch.Tensor  # [heads * head_dim, d]: o_proj's weight transposed (a view), for addmm
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor  # [d]
    gate_up: torch.Tensor  # [2 * intermediate, d]
    down_t: torch.Tensor  # [intermediate, d]: down_proj's weight transposed (a view)


def supports(head) -> bool:
    """Whether `head` is the Llama-style EAGLE head this forward reproduces."""
    cfg = head.config
    return getattr(cfg, "hidden_act", "silu") == "silu" and not getattr(cfg, "mlp_bias", False)


def _rotate_rows(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of a projection rearranged so that x @ W.T = rotate_half(x @ W_orig.T) per head."""
    w = weight.view(-1, head_dim, *weight.shape[1:])
    half = head_dim // 2
    return torch.cat([-w[:, half:], w[:, :half]], dim=1).reshape(weight.shape)


def _layer_weights(layer, head_dim: int, input_norm: bool = True) -> _LayerWeights:
    attn, mlp = layer.self_attn, layer.mlp
    q, k, v = attn.q_proj, attn.k_proj, attn.v_proj
    norm = getattr(layer, "input_layernorm", None) if input_norm else None
    proj = torch.cat(
        [
            q.weight,
            k.weight,
            v.weight,
            _rotate_rows(torch.cat([q.weight, k.weight]), head_dim),
            torch.zeros_like(v.weight),
        ]
    )
    bias = None
    if q.bias is not None:
        bias = torch.cat(
            [
                q.bias,
                k.bias,
                v.bias,
                _rotate_rows(torch.cat([q.bias, k.bias]), head_dim),
                torch.zeros_like(v.bias),
            ]
        )
    return _LayerWeights(
        input_norm=None if norm is None else norm.weight,
        proj=proj,
        proj_bias=bias,
        o_t=attn.o_proj.weight.t(),
        o_bias=attn.o_proj.bias,
        post_norm=layer.post_attention_layernorm.weight,
        gate_up=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
        down_t=mlp.down_proj.weight.t(),
    )


def lean_forward(head, max_positions: int = 0):
    """The lean forward of `head` (`LeanDraft` or `LeanEagle3`), or None when `supports` says no."""
    if not supports(head):
        return None
    return (
        LeanEagle3(head, max_positions)
        if getattr(head, "reads_aux", False)
        else LeanDraft(head, max_positions)
    )


class LeanDraft:
    """`forward(tokens, features, positions, mask, cache) -> hidden`, equal to `DraftHead.forward`."""

    @torch.no_grad()
    def __init__(self, head, max_positions: int):
        cfg = head.config
        shape = attention_shape(cfg)
        self.heads, self.kv_heads, self.head_dim = shape.heads, shape.kv_heads, shape.head_dim
        self.eps = float(cfg.rms_norm_eps)
        self.embed, self.fc, self.fc_bias = head.embed_tokens.weight, head.fc.weight, head.fc.bias
        self.lm_head = head.lm_head.weight
        transform = getattr(head, "logit_transform", None)  # the target's output processing
        self.logit_transform = None if transform is None or transform.identity else transform
        self.layers = self._layers(head)
        self.rotary_emb = head.rotary_emb
        self.cos = self.sin = torch.empty(0)
        self.extend_positions(max_positions)

    def _layers(self, head) -> list[_LayerWeights]:
        return [_layer_weights(layer, self.head_dim) for layer in head.layers]

    @torch.no_grad()
    def extend_positions(self, max_positions: int) -> None:
        """Make the RoPE table cover positions [0, max_positions) (it only grows)."""
        if max_positions <= self.cos.shape[0]:
            return
        weight = self.fc
        positions = torch.arange(max_positions, device=weight.device).unsqueeze(0)
        cos, sin = self.rotary_emb(torch.zeros(1, 1, 1, dtype=weight.dtype, device=weight.device), positions)
        # [max_positions, (heads + 2 * kv_heads) * head_dim]: the RoPE table tiled over the q and k heads,
        # then cos 1 / sin 0 over v (v is not rotated: v * 1 + 0 * 0 is v exactly)
        tiles, v_width = self.heads + self.kv_heads, self.kv_heads * self.head_dim
        ones = cos.new_ones(max_positions, v_width)
        self.cos = torch.cat([cos[0].repeat(1, tiles), ones], dim=-1)
        self.sin = torch.cat([sin[0].repeat(1, tiles), torch.zeros_like(ones)], dim=-1)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if _RMS_NORM and x.dtype == torch.float32:
            return F.rms_norm(x, weight.shape, weight, self.eps)
        xf = x.float()
        return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    def _attention(self, i, w: _LayerWeights, h, cos, sin, mask, cache) -> torch.Tensor:
        """The attention heads' output [m, heads * head_dim], before the output projection."""
        m, hd = h.shape[0], self.head_dim
        both = F.linear(h, w.proj, w.proj_bias)  # [m, 2 * width]: q k v | rotate_half(q k), 0
        width = both.shape[-1] // 2
        qkv = torch.addcmul(both[:, :width] * cos, both[:, width:], sin)  # RoPE on q and k; v unchanged
        n_q = self.heads * hd
        q = qkv[:, :n_q].view(m, self.heads, hd).transpose(0, 1)  # [heads, m, hd]
        kv = qkv[:, n_q:].view(m, 2, 1, self.kv_heads, hd).permute(1, 2, 3, 0, 4)  # [2, 1, kv_heads, m, hd]
        k_all, v_all = cache.update_kv(i, kv)  # [1, kv_heads, kv, hd] each
        if mask is None and m > 1:  # causal after the cached prefix
            kv = k_all.shape[2]
            mask = torch.ones(m, kv, dtype=torch.bool, device=h.device).tril(kv - m)
        if self.heads != self.kv_heads and not _GQA_KWARG:
            groups = self.heads // self.kv_heads
            k_all, v_all = k_all.repeat_interleave(groups, 1), v_all.repeat_interleave(groups, 1)
        extra = {"enable_gqa": True} if self.heads != self.kv_heads and _GQA_KWARG else {}
        out = F.scaled_dot_product_attention(q.unsqueeze(0), k_all, v_all, attn_mask=mask, **extra)
        return out[0].transpose(0, 1).reshape(m, -1)

    def forward(
        self,
        tokens: torch.Tensor,  # [m]
        features: torch.Tensor,  # [m, d]
        positions: torch.Tensor | slice,  # [m], or a slice of m positions or of one (for all m inputs)
        mask: torch.Tensor | None,  # bool [1, 1, m, kv] or None (causal)
        cache,
    ) -> torch.Tensor:
        """Predicted features [m, d]; keys/values written to `cache` after its committed slots. No autograd
        context of its own (a no_grad entry costs ~2 us per call): call it under no_grad/inference_mode."""
        x = F.linear(
            torch.cat([F.embedding(tokens, self.embed).to(features.dtype), features], dim=-1),
            self.fc,
            self.fc_bias,
        )
        cos, sin = self.cos[positions], self.sin[positions]  # [m or 1, (heads + 2 * kv_heads) * hd]
        for i, w in enumerate(self.layers):
            x = self._layer(i, w, x, cos, sin, mask, cache)
        return x

    def _layer(self, i: int, w: _LayerWeights, x, cos, sin, mask, cache) -> torch.Tensor:
        """A plain (pre-norm; layer 0 of EAGLE-1: no input norm) Llama layer: [m, d] -> [m, d]."""
        h = x if w.input_norm is None else self._norm(x, w.input_norm)
        return self._residual_mlp(w, self._residual_attention(i, w, x, h, cos, sin, mask, cache))

    def _residual_attention(self, i, w: _LayerWeights, residual, h, cos, sin, mask, cache) -> torch.Tensor:
        """residual + o_proj(attention(h)), the add fused into the output projection's addmm."""
        x = torch.addmm(residual, self._attention(i, w, h, cos, sin, mask, cache), w.o_t)
        return x if w.o_bias is None else x + w.o_bias

    def _residual_mlp(self, w: _LayerWeights, x: torch.Tensor) -> torch.Tensor:
        """x + mlp(post_attention_layernorm(x))."""
        gate, up = F.linear(self._norm(x, w.post_norm), w.gate_up).chunk(2, dim=-1)
        return torch.addmm(x, F.silu(gate) * up, w.down_t)

    def log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft log-probabilities [..., vocab] through the target's LM head and output processing."""
        logits = F.linear(hidden, self.lm_head)
        if self.logit_transform is not None:
            logits = self.logit_transform(logits)
        return torch.log_softmax(logits.float(), dim=-1)


class LeanEagle3(LeanDraft):
    """`forward(tokens, features, positions, mask, cache) -> state`, equal to `Eagle3Head.forward` (and
    `PEagleHead.forward`: the learned row at its mask token): fc (after fc_norm) only on features wider
    than d, [norm(embedding) ; norm(h)] into the midlayer's fused projection, the residual from h, then
    layers 1..N-1 as plain pre-norm layers; `log_probs` over the draft vocabulary."""

    @torch.no_grad()
    def __init__(self, head, max_positions: int):
        super().__init__(head, max_positions)
        layer = head.midlayer
        self.width = int(head.config.hidden_size)
        self.fc_norms = None if head.fc_norm is None else [n.weight for n in head.fc_norm]
        self.embed_norm, self.hidden_norm = layer.input_layernorm.weight, layer.hidden_norm.weight
        self.final_norm, self.norm_output = head.norm.weight, head.norm_output
        mask = getattr(head, "mask_token_id", None)  # P-EAGLE: the learned embedding row of the mask token
        self.mask_token = None if mask is None else torch.tensor(mask, device=self.embed.device)
        self.mask_row = None if mask is None else head.mask_embedding.detach().to(self.embed.dtype)

    def _layers(self, head) -> list[_LayerWeights]:
        plain = [_layer_weights(layer, self.head_dim) for layer in head.layers.values()]
        return [_layer_weights(head.midlayer, self.head_dim, input_norm=False), *plain]

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        embeds = F.embedding(tokens, self.embed)
        if self.mask_token is None:
            return embeds
        return torch.where((tokens == self.mask_token).unsqueeze(-1), self.mask_row, embeds)

    def forward(self, tokens, features, positions, mask, cache) -> torch.Tensor:
        """The draft state [m, d] (see `LeanDraft.forward`)."""
        h = features
        if h.shape[-1] != self.width:
            if self.fc_norms is not None:
                chunks = h.chunk(len(self.fc_norms), dim=-1)
                h = torch.cat([self._norm(c, w) for c, w in zip(chunks, self.fc_norms, strict=True)], dim=-1)
            h = F.linear(h, self.fc)
        w = self.layers[0]
        embeds = self._embed(tokens).to(h.dtype)
        x = torch.cat([self._norm(embeds, self.embed_norm), self._norm(h, self.hidden_norm)], dim=-1)
        cos, sin = self.cos[positions], self.sin[positions]
        h = self._residual_mlp(w, self._residual_attention(0, w, h, x, cos, sin, mask, cache))
        for i, w in enumerate(self.layers[1:], start=1):
            h = self._layer(i, w, h, cos, sin, mask, cache)
        return self._norm(h, self.final_norm) if self.norm_output else h

    def log_probs(self, state: torch.Tensor) -> torch.Tensor:
        """Draft log-probabilities [..., draft_vocab] through the head's own LM head."""
        logits = F.linear(state if self.norm_output else self._norm(state, self.final_norm), self.lm_head)
        return torch.log_softmax(logits.float(), dim=-1)
