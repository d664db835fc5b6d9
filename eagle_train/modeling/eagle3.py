"""The EAGLE-3 draft head (arXiv:2503.01840) with the EAGLE-3.1 switches.

    features a_j = cat[x^low_j, x^mid_j, x^high_j]  (the inputs of three target layers, [3 d_t])
    h    = fc(a_j)                        fc: 3 d_t -> d, no bias (EAGLE-3.1 `fc_norm`: an RMSNorm on
                                          each of the three features first, as vLLM and SpecForge do)
    x    = cat[input_layernorm(e(t_{j+1})), hidden_norm(h)]        [2d]: q/k/v read 2d inputs
    h'   = h + o_proj(attention(x));  h'' = h' + mlp(post_attention_layernorm(h'))
    q    = softmax(lm_head(norm(h'')))    over the REDUCED draft vocabulary (`d2t`, `t2d`)

With N decoder layers (`num_hidden_layers`, vLLM's multi-layer EAGLE-3), layers 1..N-1 are plain pre-norm
Llama layers over h'' (keys `layers.1.*` ... `layers.{N-1}.*`, vLLM's names) before the final norm.
The next step is fed h'' itself (d wide, so fc is skipped: it applies only to inputs wider than d);
EAGLE-3.1's `norm_output` feeds norm(h'') instead. `forward` returns what the next step is fed (the
draft *state*) and `logits` maps a state to draft logits, so drafters and metrics never ask which.
The embedding is the target's, frozen; the LM head is the draft's own (trained; initialised from the
target's rows of the kept tokens). Key names are the serving layout every engine loads:
fc.weight, fc_norm.{0,1,2}.weight, midlayer.{input_layernorm, hidden_norm, self_attn.{q,k,v,o}_proj,
mlp.{gate,up,down}_proj, post_attention_layernorm}.weight, norm.weight, lm_head.weight, d2t, t2d.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig, PretrainedConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from eagle_train.config.target import NUM_AUX_LAYERS
from eagle_train.modeling.draft import (
    AttendingCache,
    DraftAttention,
    DraftDecoderLayer,
    FrozenParts,
    KVCache,
    draft_llama_config,
    frozen_modules,
)
from eagle_train.modeling.draft_vocab import d2t_from_t2d, draft_ids
from eagle_train.runtime.errors import InputError


class Eagle3Layer(nn.Module):
    """The `midlayer`: attention over [norm(embedding) ; norm(h)] with a residual from h, then the MLP."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = LlamaRMSNorm(d, eps=eps)
        self.hidden_norm = LlamaRMSNorm(d, eps=eps)
        self.self_attn = DraftAttention(config, 0, in_features=2 * d)
        self.post_attention_layernorm = LlamaRMSNorm(d, eps=eps)
        self.mlp = LlamaMLP(config)

    def forward(self, embeds, hidden, cos_sin, attention_mask=None, cache=None) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # [b, s, 2d]
        hidden = hidden + self.self_attn(x, cos_sin, attention_mask, cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Head(FrozenParts, nn.Module):
    """fc over three target features, the `midlayer` (and N-1 plain layers), a final norm and the draft's
    own LM head over `draft_vocab_size` tokens; the target's frozen embedding."""

    kind = "eagle3"  # the head protocol: modeling.draft.DraftHead
    reads_aux = True
    own_lm_head = True
    drafts_in_catch_up = False
    drafts_block = False

    @classmethod
    def recognise(cls, raw: dict) -> bool:
        return is_eagle3_config(raw)

    @classmethod
    def from_checkpoint(cls, config: LlamaConfig, raw: dict, meta: dict, file: Path, target=None):
        return eagle3_from_config(config, raw, recorded_aux_layers(raw), target=target)

    def checkpoint_fields(self) -> dict:
        return eagle3_config_fields(self)

    def check_checkpoint_state(self, state: dict, file: Path) -> None:
        return None

    def __init__(
        self,
        config: LlamaConfig,
        aux_layers: list[int],
        draft_vocab_size: int,
        fc_norm: bool = False,
        norm_output: bool = False,
        target_hidden_size: int | None = None,
        target=None,
    ):
        super().__init__()
        if len(aux_layers) != NUM_AUX_LAYERS:
            raise ValueError(f"an EAGLE-3 head fuses {NUM_AUX_LAYERS} target layers, got {aux_layers}")
        self.config = config
        self.aux_layers = [int(i) for i in aux_layers]
        self.draft_vocab_size, self.norm_output = int(draft_vocab_size), bool(norm_output)
        d, eps = config.hidden_size, config.rms_norm_eps
        self.target_hidden_size = int(target_hidden_size or d)
        self.fc = nn.Linear(NUM_AUX_LAYERS * self.target_hidden_size, d, bias=False)
        self.fc_norm = (
            nn.ModuleList(LlamaRMSNorm(self.target_hidden_size, eps=eps) for _ in range(NUM_AUX_LAYERS))
            if fc_norm
            else None
        )
        self.midlayer = Eagle3Layer(config)
        # layers 1..N-1, keyed by their index so the state keys are vLLM's `layers.i.*`
        self.layers = nn.ModuleDict(
            {str(i): DraftDecoderLayer(config, i) for i in range(1, config.num_hidden_layers)}
        )
        self.norm = LlamaRMSNorm(d, eps=eps)
        self.lm_head = nn.Linear(d, self.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        # The target's, frozen and not registered (modeling.draft.FrozenParts): with `target` (anything with
        # `embed_tokens`), its own tensor; else a random one until `share_target_weights`.
        embed = (
            target.embed_tokens.weight if target is not None else nn.Embedding(config.vocab_size, d).weight
        )
        self.hold_frozen(frozen_modules(embed.detach()))
        # The draft vocabulary (`set_vocabulary`); until then the first draft_vocab_size ids.
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[: self.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)

    @classmethod
    def from_target(
        cls,
        target_config: PretrainedConfig,
        aux_layers: list[int],
        draft_vocab_size: int,
        fc_norm: bool = False,
        norm_output: bool = False,
        target=None,
        num_layers: int = 1,
        intermediate_size: int | None = None,
    ) -> Eagle3Head:
        config = draft_llama_config(target_config, num_layers, intermediate_size)
        return cls(config, aux_layers, draft_vocab_size, fc_norm, norm_output, target=target)

    def with_config(self, config: LlamaConfig) -> Eagle3Head:
        """An untrained head of this one's kind (aux layers, vocabulary size, switches) for `config`, sharing
        this one's frozen embedding."""
        return Eagle3Head(
            config, self.aux_layers, self.draft_vocab_size, self.fc_norm_enabled, self.norm_output,
            self.target_hidden_size, target=self,
        )  # fmt: skip

    @property
    def fc_norm_enabled(self) -> bool:
        return self.fc_norm is not None

    @property
    def vocab_map(self) -> torch.Tensor:
        """[draft_vocab] the target id of each draft token (d2t + arange)."""
        return draft_ids(self.d2t)

    @torch.no_grad()
    def share_target_weights(self, target, dtype: torch.dtype | None = None) -> None:
        """Take the target's embedding (`target.embed_tokens`) as the frozen slot, in `dtype` (default: the
        slot's current dtype) on the slot's device: the target's own tensor when nothing needs converting
        (the LM head is the draft's own, and so is its distribution: no target output processing)."""
        device, dtype = self.embed_tokens.weight.device, dtype or self.embed_tokens.weight.dtype
        self.hold_frozen(frozen_modules(target.embed_tokens.weight.to(device, dtype)))

    @torch.no_grad()
    def set_vocabulary(self, t2d: torch.Tensor, target_lm_head: torch.Tensor | None = None) -> None:
        """Keep the tokens `t2d` (bool [vocab]); with the target's LM head weight [vocab, d], start the
        draft's LM head from its rows of the kept tokens (the draft's normed state imitates the
        target's last hidden state, so these rows are a good start)."""
        t2d = t2d.to(self.t2d.device, torch.bool)
        if t2d.shape != self.t2d.shape or int(t2d.sum()) != self.draft_vocab_size:
            raise ValueError(
                f"t2d keeps {int(t2d.sum())} of {t2d.numel()} tokens; this head has {self.draft_vocab_size} "
                f"of {self.t2d.numel()}"
            )
        self.t2d.copy_(t2d)
        self.d2t.copy_(d2t_from_t2d(t2d.cpu()).to(self.d2t.device))
        if target_lm_head is not None and target_lm_head.shape[1] == self.lm_head.in_features:
            rows = target_lm_head[self.vocab_map.to(target_lm_head.device)]
            self.lm_head.weight.copy_(rows.to(self.lm_head.weight))

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The head's own tensors in the serving key layout (no embedding, no RoPE buffers)."""
        own = ("fc.", "fc_norm.", "midlayer.", "layers.", "norm.", "lm_head.", "d2t", "t2d")
        return {k: v for k, v in self.state_dict().items() if k.startswith(own)}

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """fc (after the per-feature norms of `fc_norm`): [..., 3 d_t] -> [..., d]."""
        if self.fc_norm is not None:
            chunks = features.chunk(NUM_AUX_LAYERS, dim=-1)
            features = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks, strict=True)], dim=-1)
        return self.fc(features)

    def forward(
        self,
        input_ids: torch.Tensor,  # [batch, seq]: t_{j+1}
        features: torch.Tensor,  # [batch, seq, 3 d_t] target features a_j, or [batch, seq, d] a state
        position_ids: torch.Tensor | None = None,  # [batch, seq]; default 0..seq-1
        attention_mask: torch.Tensor | None = None,  # bool [batch|1, 1, seq, kv_len]; None = causal
        cache: KVCache | AttendingCache | None = None,
    ) -> torch.Tensor:
        """The draft state [batch, seq, d] the next step is fed (see the module docstring)."""
        hidden = self.fuse(features) if features.shape[-1] != self.config.hidden_size else features
        embeds = self.embed(input_ids).to(hidden.dtype)
        if position_ids is None:
            position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        cos_sin = self.rotary_emb(hidden, position_ids)
        hidden = self.midlayer(embeds, hidden, cos_sin, attention_mask, cache)
        for layer in self.layers.values():
            hidden = layer(hidden, cos_sin, attention_mask, cache)
        return self.norm(hidden) if self.norm_output else hidden

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embedding of the draft's inputs: [...] -> [..., d] (the target's, frozen)."""
        return self.embed_tokens(input_ids)

    def logits(self, state: torch.Tensor) -> torch.Tensor:
        """Draft logits over the draft vocabulary: [..., d] -> [..., draft_vocab]."""
        return self.lm_head(state if self.norm_output else self.norm(state))


# ---------------------------------------------------------------------------------------------- config

ARCHITECTURE = "LlamaForCausalLMEagle3"  # SGLang requires it; vLLM maps it to its Eagle3LlamaForCausalLM
# config.json fields of an EAGLE-3 head beyond the Llama shape (read by load_draft and the checkpoints)
EAGLE3_FIELDS = (
    "draft_vocab_size",
    "target_hidden_size",
    "eagle_config",
    "eagle_aux_hidden_state_layer_ids",
    "fc_norm",
    "norm_output",
    "norm_before_residual",
    "norm_before_fc",
)


def is_eagle3_config(raw: dict) -> bool:
    """Whether a head's config.json describes an EAGLE-3 head (P-EAGLE heads are EAGLE-3 heads too)."""
    archs = raw.get("architectures") or []
    kind = (raw.get("eagle_train") or {}).get("type")
    return any("Eagle3" in a for a in archs) or kind in ("eagle3", "peagle")


def eagle3_config_fields(head: Eagle3Head) -> dict:
    """What vLLM, SGLang and the reference read beyond the Llama shape: the architecture, the layers, the
    draft vocabulary, the target's width, the aux layer ids (in `eagle_config`, where SGLang looks, and
    which vLLM reads too) and the EAGLE-3.1 switches (`norm_before_residual: false`: the residual is the
    un-normed h, as in the reference; the speculators format defaults it to true)."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": int(head.config.num_hidden_layers),
        "vocab_size": int(head.config.vocab_size),
        "draft_vocab_size": head.draft_vocab_size,
        "target_hidden_size": head.target_hidden_size,
        "tie_word_embeddings": False,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(head.aux_layers),
            "use_aux_hidden_state": True,
        },
        "fc_norm": head.fc_norm_enabled,
        "norm_output": head.norm_output,
        "norm_before_residual": False,
    }


def recorded_aux_layers(raw: dict) -> list[int] | None:
    """The aux layer ids a config.json names (top level or `eagle_config`), or None."""
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids"
    )
    return [int(i) for i in ids] if ids else None


def eagle3_head_args(config: LlamaConfig, raw: dict) -> dict:
    """The head's constructor arguments beyond the Llama shape and aux layers that a config.json gives
    (draft vocabulary, EAGLE-3.1 switches, the target's width), after refusing what it cannot hold."""
    if raw.get("norm_before_fc"):
        raise InputError("norm_before_fc (one RMSNorm over the fused 3d input) is not supported")
    if raw.get("norm_before_residual"):
        raise InputError("norm_before_residual: true (the residual taken after hidden_norm) is not supported")
    return {
        "draft_vocab_size": int(raw.get("draft_vocab_size") or config.vocab_size),
        "fc_norm": bool(raw.get("fc_norm")),
        "norm_output": bool(raw.get("norm_output")),
        "target_hidden_size": raw.get("target_hidden_size"),
    }


def eagle3_from_config(config: LlamaConfig, raw: dict, aux_layers: list[int], target=None) -> Eagle3Head:
    """An (untrained) head of the shape a config.json describes; `aux_layers` as resolved by the caller
    (the recorded ids, or the reference's default for the target); with `target`, its frozen embedding."""
    return Eagle3Head(config, aux_layers, **eagle3_head_args(config, raw), target=target)
