"""The DFlash draft head (arXiv 2602.06036, z-lab): a block of B tokens drafted in ONE forward.

    ctx   = hidden_norm(fc(cat[outputs of the target layers `target_layer_ids`]))   fc: L d_t -> d, no bias
    block = embed([t_a, MASK x (B-1)])      the target's embedding (frozen), at positions a..a+B-1
    layer i (Qwen3-style, pre-norm):  h = input_layernorm(x)
          Q = q_norm(q_proj(h)),  K = k_norm(k_proj([ctx ; h])),  V = v_proj([ctx ; h])   (per-head norms)
          x = x + o_proj(attention(Q, K, V)),  x = x + mlp(post_attention_layernorm(x))
    out   = norm(x);  logits = the target's LM head (and its output processing)

The context is keys and values in every layer and never a query; RoPE takes absolute positions (the
context's own, the block's a..a+B-1). Slot k predicts t_{a+k} (no EAGLE shift). Which keys a slot sees is
the caller's mask (training.dflash.block_attention_mask; None: all of them, one block after its context).
Parameter names are vLLM's DFlash contract without the `model.` prefix (fc, hidden_norm,
layers.{i}.self_attn.{q,k,v,o}_proj, layers.{i}.self_attn.{q,k}_norm, layers.{i}.{input,post_attention}_
layernorm, layers.{i}.mlp.{gate,up,down}_proj, norm), so an export writes them as they are
(interop.dflash_layouts: vLLM's layout and the speculators format).
At decode time the context's keys and values are cached per layer (`write_context`, appended as positions
are committed) and a block attends to them and to itself (`draft_block`; decoding.drafter.BlockDrafter).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, PretrainedConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    rotate_half,
)

from eagle_train.config.target import dflash_aux_layers
from eagle_train.modeling.draft import (
    DraftHead,
    FrozenParts,
    SharedTarget,
    draft_llama_config,
    frozen_modules,
)
from eagle_train.modeling.logit_transform import LogitTransform
from eagle_train.modeling.peagle import check_placeholder_token
from eagle_train.runtime.errors import InputError

ARCHITECTURE = "DFlashDraftModel"  # what vLLM's DFlash loader requires
DFLASH_FIELDS = ("dflash_config", "block_size", "target_hidden_size")  # config.json fields beyond Llama's


def rotate(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """RoPE on x [b, heads, s, head_dim] with cos, sin [b, s, head_dim] of x's own positions."""
    cos, sin = (t.unsqueeze(1) for t in cos_sin)
    return x * cos + rotate_half(x) * sin


class DFlashAttention(nn.Module):
    """Grouped-query attention whose queries are the block and whose keys / values are [context ; block],
    with Qwen3's per-head RMSNorm on queries and keys."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim, d = config.head_dim, config.hidden_size
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(d, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=bias)
        self.q_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def heads(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        return x.view(*x.shape[:2], heads, self.head_dim)  # [b, s, heads, head_dim]

    def keys_values(
        self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated at x's positions) and values [b, kv_heads, s, head_dim] of inputs x [b, s, d]:
        the context's depend on the context alone, so decoding caches them (`DFlashHead.write_context`)."""
        k = rotate(self.k_norm(self.heads(self.k_proj(x), self.num_kv_heads)).transpose(1, 2), cos_sin)
        return k, self.heads(self.v_proj(x), self.num_kv_heads).transpose(1, 2)

    def attend(
        self,
        block: torch.Tensor,  # [b, S, d] the normed layer input of the block slots
        rope_block: tuple[torch.Tensor, torch.Tensor],  # cos, sin [b, S, head_dim]
        keys: torch.Tensor,  # [b, kv_heads, K, head_dim] rotated
        values: torch.Tensor,  # [b, kv_heads, K, head_dim]
        attention_mask: torch.Tensor | None,  # bool [b, 1, S, K], True = attend; None: all
    ) -> torch.Tensor:
        """The block's queries over `keys` / `values`, through o_proj: [b, S, d]."""
        q = rotate(self.q_norm(self.heads(self.q_proj(block), self.num_heads)).transpose(1, 2), rope_block)
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:
            keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=attention_mask)  # [b, heads, S, hd]
        return self.o_proj(out.transpose(1, 2).reshape(*block.shape[:2], -1))

    def forward(
        self,
        block: torch.Tensor,  # [b, S, d] the normed layer input of the block slots
        context: torch.Tensor,  # [b, C, d] ctx
        rope_block: tuple[torch.Tensor, torch.Tensor],  # cos, sin [b, S, head_dim]
        rope_keys: tuple[torch.Tensor, torch.Tensor],  # cos, sin [b, C + S, head_dim]
        attention_mask: torch.Tensor | None,  # bool [b, 1, S, C + S], True = attend; None: all
    ) -> torch.Tensor:
        keys, values = self.keys_values(torch.cat([context, block], dim=1), rope_keys)  # [b, kv, C + S, hd]
        return self.attend(block, rope_block, keys, values, attention_mask)


class DFlashLayer(nn.Module):
    """A pre-norm Qwen3 decoder layer over the block, the context injected as keys and values."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = LlamaRMSNorm(d, eps=eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = LlamaRMSNorm(d, eps=eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x, context, rope_block, rope_keys, attention_mask=None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), context, rope_block, rope_keys, attention_mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def cached(self, x, rope_block, cache, index: int) -> torch.Tensor:
        """`forward` with the context's keys / values read from layer `index` of `cache` (`write_context`):
        the block's are written after its committed slots (not committed) and it attends to all of them."""
        h = self.input_layernorm(x)
        keys, values = cache.update(index, *self.self_attn.keys_values(h, rope_block))
        x = x + self.self_attn.attend(h, rope_block, keys, values, None)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashHead(FrozenParts, nn.Module):
    """fc over L target layers' outputs, hidden_norm, N DFlash layers, the final norm; the target's frozen
    embedding and LM head (held outside the state, modeling.draft.FrozenParts)."""

    kind = "dflash"  # the head protocol: modeling.draft.DraftHead
    reads_aux = True  # fed the outputs of `target_layer_ids` (the store's aux features: `aux_layers`)
    own_lm_head = False  # the target's LM head (no reduced draft vocabulary yet)
    drafts_in_catch_up = False
    drafts_block = True  # a round: one forward of [root, MASK x (B-1)] (decoding.drafter.BlockDrafter)
    vocab_map = None

    def __init__(
        self,
        config: LlamaConfig,
        target_layer_ids: list[int],
        block_size: int,
        mask_token_id: int,
        target_hidden_size: int | None = None,
        target: SharedTarget | None = None,
    ):
        super().__init__()
        self.config = config
        self.target_layer_ids = [int(i) for i in target_layer_ids]
        self.block_size = int(block_size)
        self.mask_token_id = check_placeholder_token(mask_token_id, config.vocab_size, {}, "mask_token_id")
        d, eps = config.hidden_size, config.rms_norm_eps
        self.target_hidden_size = int(target_hidden_size or d)
        self.fc = nn.Linear(len(self.target_layer_ids) * self.target_hidden_size, d, bias=False)
        self.hidden_norm = LlamaRMSNorm(d, eps=eps)
        self.layers = nn.ModuleList(DFlashLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = LlamaRMSNorm(d, eps=eps)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        if target is not None:
            self.hold_frozen(frozen_modules(target.embed_tokens.weight, target.lm_head.weight))
        else:  # random until `share_target_weights`
            embed = nn.Embedding(config.vocab_size, d).weight.detach()
            self.hold_frozen(
                frozen_modules(embed, nn.Linear(d, config.vocab_size, bias=False).weight.detach())
            )
        self.logit_transform = target.logit_transform if target is not None else LogitTransform()

    @classmethod
    def from_target(
        cls,
        target_config: PretrainedConfig,
        target_layer_ids: list[int],
        block_size: int,
        mask_token_id: int,
        target: SharedTarget | None = None,
        num_layers: int = 1,
        intermediate_size: int | None = None,
    ) -> DFlashHead:
        config = draft_llama_config(target_config, num_layers, intermediate_size)
        return cls(config, target_layer_ids, block_size, mask_token_id, target=target)

    @property
    def aux_layers(self) -> list[int]:
        """The feature store's names of the layers it reads (the input of layer i + 1 = the output of i)."""
        return dflash_aux_layers(self.target_layer_ids)

    @property
    def lm_head(self) -> nn.Linear:
        """The target's LM head (frozen, shared)."""
        return self.frozen["lm_head"]

    # the target's frozen embedding and LM head taken, and logits formed, exactly as an EAGLE-1 head does
    share_target_weights = DraftHead.share_target_weights
    logits = DraftHead.logits

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The head's own weights in the serving key layout (no embedding, LM head or RoPE buffers)."""
        own = ("fc.", "hidden_norm.", "layers.", "norm.")
        return {k: v for k, v in self.state_dict().items() if k.startswith(own)}

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """ctx = hidden_norm(fc(features)): [b, C, L d_t] -> [b, C, d]."""
        return self.hidden_norm(self.fc(features))

    def forward(
        self,
        block_ids: torch.Tensor,  # [b, S] the blocks' tokens: anchors and mask tokens
        features: torch.Tensor,  # [b, C, L d_t] the context's target features
        block_positions: torch.Tensor,  # [b, S] absolute positions of the slots
        context_positions: torch.Tensor | None = None,  # [b, C]; default 0..C-1
        attention_mask: torch.Tensor | None = None,  # bool [b, 1, S, C + S]; None: every key
    ) -> torch.Tensor:
        """The normed states [b, S, d] of the block slots (`logits` maps them to the target's vocabulary)."""
        context = self.context(features)
        x = self.embed_tokens(block_ids).to(context.dtype)
        if context_positions is None:
            context_positions = torch.arange(context.shape[1], device=x.device).expand(x.shape[0], -1)
        rope_block = self.rotary_emb(x, block_positions)
        rope_keys = self.rotary_emb(x, torch.cat([context_positions, block_positions], dim=1))
        for layer in self.layers:
            x = layer(x, context, rope_block, rope_keys, attention_mask)
        return self.norm(x)

    # ------------------------------------------------------------------------------- decoding

    def write_context(self, features: torch.Tensor, positions: torch.Tensor, cache) -> None:
        """Append the context of new committed positions to a decode-time cache (a
        `decoding.kv_cache.StaticKVCache` of this head's layers): every layer's keys and values of
        ctx = hidden_norm(fc(features)) [1, m, L d_t] at `positions` [1, m], committed after its slots."""
        context = self.context(features)
        rope = self.rotary_emb(context, positions)
        for i, layer in enumerate(self.layers):
            cache.update(i, *layer.self_attn.keys_values(context, rope))
        cache.advance(features.shape[1])

    def draft_block(self, block_ids: torch.Tensor, block_positions: torch.Tensor, cache) -> torch.Tensor:
        """The normed states [1, S, d] of a block [1, S] at `block_positions` [1, S] attending to every
        context entry of `cache` (`write_context`) and to the whole block: `forward` for one block after its
        context, the context's keys and values read from the cache (the block's are left uncommitted)."""
        x = self.embed_tokens(block_ids).to(self.fc.weight.dtype)
        rope_block = self.rotary_emb(x, block_positions)
        for i, layer in enumerate(self.layers):
            x = layer.cached(x, rope_block, cache, i)
        return self.norm(x)

    # ------------------------------------------------------------------------------- checkpoints

    @classmethod
    def recognise(cls, raw: dict) -> bool:
        return is_dflash_config(raw)

    @classmethod
    def from_checkpoint(cls, config: LlamaConfig, raw: dict, meta: dict, file: Path, target=None):
        block = raw.get("dflash_config")
        if not isinstance(block, dict) or not block.get("target_layer_ids"):
            raise InputError(
                f"{file}: dflash_config.target_layer_ids: missing (a DFlash head's target layers)"
            )
        mask = check_placeholder_token(
            block.get("mask_token_id"), config.vocab_size, {}, f"{file}: dflash_config.mask_token_id"
        )
        size = raw.get("block_size")
        if isinstance(size, bool) or not isinstance(size, int) or size < 2:
            raise InputError(f"{file}: block_size: {size!r} is not a block size (an integer >= 2)")
        return cls(config, block["target_layer_ids"], size, mask, raw.get("target_hidden_size"), target)

    def checkpoint_fields(self) -> dict:
        """vLLM's DFlash fields (z-lab's convention: the layers' own ids, the mask token) and the block."""
        return {
            "architectures": [ARCHITECTURE],
            "num_hidden_layers": int(self.config.num_hidden_layers),
            "target_hidden_size": self.target_hidden_size,
            "block_size": self.block_size,
            "dflash_config": {
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
            },
        }

    def check_checkpoint_state(self, state: dict, file: Path) -> None:
        return None

    def with_config(self, config: LlamaConfig) -> DFlashHead:
        """An untrained head of this one's kind for `config`, sharing this one's frozen parts."""
        return DFlashHead(
            config, self.target_layer_ids, self.block_size, self.mask_token_id, self.target_hidden_size, self
        )


def is_dflash_config(raw: dict) -> bool:
    """Whether a head's config.json describes a DFlash head (this project's, vLLM's contract, or the
    speculators format's type `dflash`)."""
    archs = raw.get("architectures") or []
    kind = (raw.get("eagle_train") or {}).get("type")
    return (
        kind == "dflash"
        or ARCHITECTURE in archs
        or "dflash_config" in raw
        or raw.get("speculators_model_type") == "dflash"
    )
