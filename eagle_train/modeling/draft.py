"""The EAGLE draft head.

h = fc(cat[e(t_{j+1}), f_j]) -> Llama decoder layer(s) -> predicted feature f^_{j+1}.
Layer 0 has no input norm (the identity), the head has no final norm; the token embedding and the
LM head are the target's, frozen and shared: held outside the module's parameters, so they are never
trained, never in a state_dict (a checkpoint, an accelerate training state, a DDP broadcast), and one
copy serves target and head; `.to()` / `.float()` move and cast them with the head.
Key names follow the serving contract: fc.*, layers.N.self_attn.{q,k,v,o}_proj, layers.N.mlp.*,
layers.N.post_attention_layernorm (+ layers.N.input_layernorm for N >= 1).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, PretrainedConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from eagle_train.decoding.kv_cache import attention_shape
from eagle_train.modeling.logit_transform import LogitTransform

# Fields of a target config that shape the draft's Llama layer.
_LLAMA_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "attention_bias",
    "mlp_bias",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)


class SharedTarget(Protocol):
    """What a head takes from its target (modeling.target.Target and FrozenTarget provide it)."""

    embed_tokens: nn.Embedding
    lm_head: nn.Linear
    logit_transform: LogitTransform


class KVCache(Protocol):
    """What the draft's attention needs from a cache: append this step's keys/values for one layer
    and return the layer's keys/values so far ([batch, kv_heads, seq, head_dim])."""

    def update(
        self, layer_idx: int, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class AttendingCache(Protocol):
    """A cache that computes the attention itself from this step's queries, keys and values (RoPE applied;
    the training-time test's `training.ttt.DiagonalCache`): output [batch, heads, q_len, head_dim]."""

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


def draft_llama_config(
    target_config: PretrainedConfig, num_layers: int = 1, intermediate_size: int | None = None
) -> LlamaConfig:
    """The draft's Llama config: the target's shapes and RoPE with `num_layers` layers (and an MLP
    `intermediate_size` wide: None = the target's). The draft is a Llama
    layer whatever the target (as vLLM and SGLang build it): SiLU MLP; an MLA target's `head_dim` (its RoPE
    width) is not an attention head's width, so the draft's heads are hidden_size / heads wide; a target
    with RoPE per layer type (Gemma-3: local and global) gives the draft its global (full-attention) RoPE."""
    src = target_config.to_dict()
    kwargs = {k: src[k] for k in _LLAMA_FIELDS if k in src and src[k] is not None}
    kwargs["hidden_act"] = "silu"
    if intermediate_size is not None:
        kwargs["intermediate_size"] = intermediate_size
    if "qk_rope_head_dim" in src:
        kwargs.pop("head_dim", None)
    rope = kwargs.get("rope_parameters")
    if isinstance(rope, dict) and isinstance(rope.get("full_attention"), dict):
        kwargs["rope_parameters"] = dict(rope["full_attention"])
        kwargs.pop("rope_theta", None)
    shape = attention_shape(kwargs)
    kwargs.update(head_dim=shape.head_dim, num_key_value_heads=shape.kv_heads)
    config = LlamaConfig(**kwargs, num_hidden_layers=num_layers, tie_word_embeddings=False)
    config.architectures = ["LlamaForCausalLM"]
    return config


class DraftAttention(nn.Module):
    """Grouped-query self-attention with RoPE and an optional external KV cache; q/k/v read inputs of
    `in_features` (the hidden size; EAGLE-3: twice that, [embedding ; feature]). An `AttendingCache`
    (training-time test, chain metrics) computes the attention itself."""

    def __init__(self, config: LlamaConfig, layer_idx: int, in_features: int | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        d = config.hidden_size
        width = in_features or d
        self.q_proj = nn.Linear(width, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=bias)

    def forward(
        self,
        x: torch.Tensor,  # [batch, q_len, hidden]
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,  # bool [batch|1, 1, q_len, kv_len], True = attend
        cache: KVCache | AttendingCache | None,
    ) -> torch.Tensor:
        bsz, q_len, _ = x.shape
        q = self.q_proj(x).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(bsz, q_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(bsz, q_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *cos_sin)
        if hasattr(cache, "attend"):
            out = cache.attend(self.layer_idx, q, k, v)
            return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, -1))
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        if attention_mask is None and q_len > 1:
            if k.shape[2] == q_len:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:  # new tokens after a cached prefix: causal with an offset
                offset = k.shape[2] - q_len
                mask = torch.ones(q_len, k.shape[2], dtype=torch.bool, device=x.device).tril(offset)
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, -1))


class DraftDecoderLayer(nn.Module):
    """A Llama decoder layer; layer 0 has no input norm (EAGLE: the fc output goes in directly)."""

    def __init__(self, config: LlamaConfig, layer_idx: int):
        super().__init__()
        if layer_idx > 0:
            self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DraftAttention(config, layer_idx)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x, cos_sin, attention_mask=None, cache=None) -> torch.Tensor:
        h = self.input_layernorm(x) if hasattr(self, "input_layernorm") else x
        x = x + self.self_attn(h, cos_sin, attention_mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class FrozenParts:
    """What a head holds of its target outside its registered modules (mixed into nn.Module heads): the
    frozen embedding (and LM head) in `self.frozen`, never trained, never in a state_dict (a checkpoint,
    an accelerate training state, a DDP broadcast); `.to()` / `.float()` / `.cuda()` move them along."""

    frozen: nn.ModuleDict

    def hold_frozen(self, frozen: nn.ModuleDict) -> None:
        object.__setattr__(self, "frozen", frozen)  # not registered: outside parameters and state_dict

    @property
    def embed_tokens(self) -> nn.Embedding:
        """The target's token embedding (frozen, shared)."""
        return self.frozen["embed_tokens"]

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.frozen._apply(fn, recurse)
        return self


class DraftHead(FrozenParts, nn.Module):
    """fc over [embedding ; feature] + decoder layer(s); frozen shared embedding and LM head."""

    def __init__(self, config: LlamaConfig, fc_bias: bool = True, target: SharedTarget | None = None):
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.fc = nn.Linear(2 * d, d, bias=fc_bias)
        self.layers = nn.ModuleList(DraftDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.rotary_emb = LlamaRotaryEmbedding(config)
        # The target's, frozen and not registered (FrozenParts): with `target`, its own tensors (nothing
        # vocabulary-sized is allocated); else random ones until `share_target_weights`.
        if target is not None:
            self.hold_frozen(frozen_modules(target.embed_tokens.weight, target.lm_head.weight))
        else:
            embed, lm_head = nn.Embedding(config.vocab_size, d), nn.Linear(d, config.vocab_size, bias=False)
            self.hold_frozen(nn.ModuleDict({"embed_tokens": embed, "lm_head": lm_head}).requires_grad_(False))
        # the target's output processing (eagle_train.modeling.logit_transform), taken with its LM head
        self.logit_transform = target.logit_transform if target is not None else LogitTransform()

    @property
    def lm_head(self) -> nn.Linear:
        """The target's LM head (frozen, shared)."""
        return self.frozen["lm_head"]

    @classmethod
    def from_target(
        cls,
        target_config: PretrainedConfig,
        num_layers: int = 1,
        fc_bias: bool = True,
        target: SharedTarget | None = None,
        intermediate_size: int | None = None,
    ) -> DraftHead:
        config = draft_llama_config(target_config, num_layers, intermediate_size)
        return cls(config, fc_bias=fc_bias, target=target)

    @torch.no_grad()
    def share_target_weights(self, target: SharedTarget, dtype: torch.dtype | None = None) -> None:
        """Take the target's embedding and LM head (anything with `embed_tokens` and `lm_head`: a Target,
        a FrozenTarget, another head) as the frozen slots, in `dtype` (default: the slots' current dtype)
        and on the slots' device: the target's own tensors when nothing needs converting (one copy). Its
        output processing comes along, so the draft's distribution is formed as the target's is."""
        device, dtype = self.lm_head.weight.device, dtype or self.lm_head.weight.dtype
        frozen = frozen_modules(
            target.embed_tokens.weight.to(device, dtype), target.lm_head.weight.to(device, dtype)
        )
        self.hold_frozen(frozen)
        self.logit_transform = target.logit_transform

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The head's own weights in the serving key layout (no embedding, no LM head, no RoPE buffers)."""
        return {k: v for k, v in self.state_dict().items() if k.startswith(("fc.", "layers."))}

    def forward(
        self,
        input_ids: torch.Tensor,  # [batch, seq]: t_{j+1}
        features: torch.Tensor,  # [batch, seq, hidden]: f_j
        position_ids: torch.Tensor | None = None,  # [batch, seq]; default 0..seq-1 (+ cache offset)
        attention_mask: torch.Tensor | None = None,  # bool [batch|1, 1, seq, kv_len]; None = causal
        cache: KVCache | AttendingCache | None = None,
    ) -> torch.Tensor:
        """Predicted features f^_{j+1} [batch, seq, hidden]."""
        x = self.fc(torch.cat([self.embed_tokens(input_ids).to(features.dtype), features], dim=-1))
        if position_ids is None:
            position_ids = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        cos_sin = self.rotary_emb(x, position_ids)
        for layer in self.layers:
            x = layer(x, cos_sin, attention_mask, cache)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits through the target's LM head and output processing: [..., hidden] -> [..., vocab]
        (in the LM head's dtype, which may be the working bf16 while the trained weights are float32)."""
        return self.logit_transform(self.lm_head(hidden.to(self.lm_head.weight.dtype)))

    # The head protocol the decoder, the metrics, the trainer and the checkpoints read (every head class
    # states it; the head kinds' registry, eagle_train.heads, is built on it):
    kind = "eagle1"
    reads_aux = False  # features: the target's last hidden state, not the inputs of some of its layers
    own_lm_head = False  # logits through the target's LM head and output processing, not a draft vocabulary
    drafts_in_catch_up = False  # a round drafts one forward per tree level (P-EAGLE: all in its catch-up)
    drafts_block = False  # a round's drafts are one block forward over a cached context (DFlash)
    aux_layers = None
    vocab_map = None  # logits are over the target's vocabulary (EAGLE-3: the draft id -> target id map)

    @classmethod
    def recognise(cls, raw: dict) -> bool:
        """Whether a head's config.json describes a head of this class (checked most specific first,
        modeling.head_checkpoint.HEAD_MODELS): an EAGLE-1/2 head is what no other class claims."""
        return True

    @classmethod
    def from_checkpoint(cls, config: LlamaConfig, raw: dict, meta: dict, file: Path, target=None):
        """An (untrained) head of the shape a checkpoint's config.json (`file`, read as `raw`; `config`:
        its Llama shape, `meta`: its eagle_train block) describes; with `target`, its frozen parts."""
        return cls(config, fc_bias=bool(meta.get("fc_bias", True)), target=target)

    def checkpoint_fields(self) -> dict:
        """config.json fields beyond the Llama shape that this head's checkpoint records."""
        return {}

    def with_config(self, config: LlamaConfig) -> DraftHead:
        """An untrained head of this one's kind (fc bias) for `config`, sharing this one's frozen parts."""
        return DraftHead(config, fc_bias=self.fc.bias is not None, target=self)

    def check_checkpoint_state(self, state: dict, file: Path) -> None:
        """InputError naming `file` when tensors of a checkpoint's `state` cannot be this head's (beyond
        what load_state_dict checks)."""


def frozen_modules(embed_weight: torch.Tensor, lm_weight: torch.Tensor | None = None) -> nn.ModuleDict:
    """An embedding (and a bias-free LM head) around these tensors (no copy), frozen: the target's parts
    a head holds outside its registered modules (never trained, never in a state_dict)."""
    modules = {"embed_tokens": nn.Embedding.from_pretrained(embed_weight, freeze=True)}
    if lm_weight is not None:
        lm_head = nn.Linear(lm_weight.shape[1], lm_weight.shape[0], bias=False, device="meta")
        lm_head.weight = nn.Parameter(lm_weight, requires_grad=False)
        modules["lm_head"] = lm_head
    return nn.ModuleDict(modules)
