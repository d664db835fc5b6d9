"""The P-EAGLE draft head (arXiv 2602.01469): an EAGLE-3 head that drafts K tokens in ONE forward.

    inputs   [pairs of the context (a_j, t_{j+1}) | K-1 placeholders (mask_hidden, mask token)]
    outputs  the draft token at the last real pair and at each placeholder (one causal forward)

Everything of `Eagle3Head` (fc over three target features, the fusion `midlayer` and N-1 plain layers,
the final norm, its own LM head over the draft vocabulary, d2t / t2d) plus two learned placeholders:

- `mask_hidden` [1, 1, 3 d_t]: the feature of every placeholder slot, fused by the same fc (and
  fc_norm) as a real one (vLLM: `combine_hidden_states(mask_hidden)`);
- the mask token `mask_token_id` (a token the target never emits in the training data) whose
  embedding row is learned: `mask_embedding` [d]. Only that row is trained: the rest of the embedding
  stays the target's frozen one (held outside the state, modeling.draft.FrozenParts). Training the whole
  embedding, as SpecForge and speculators do, would hold a float32 copy with its gradient and AdamW's
  two moments: 4 x V x d x 4 bytes = 8.4 GB per process at V = 128256, d = 4096; the row costs 64 KB.

The serving layouts (vLLM, speculators) carry the whole embedding with the learned row in place
(`serving_embedding`), the id as `mask_token_id` and as vLLM's `pard_token`.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig, PretrainedConfig

from eagle_train.config.target import NUM_AUX_LAYERS
from eagle_train.modeling.draft import draft_llama_config
from eagle_train.modeling.eagle3 import Eagle3Head, eagle3_config_fields, eagle3_head_args

MASK_KEYS = ("mask_hidden", "mask_embedding")
PEAGLE_FIELDS = ("mask_token_id", "pard_token", "ptd_token_id")  # config.json fields beyond EAGLE-3's


class PEagleHead(Eagle3Head):
    """`Eagle3Head` + `mask_hidden` [1, 1, 3 d_t] + the learned embedding row of `mask_token_id`."""

    kind = "peagle"

    def __init__(
        self,
        config: LlamaConfig,
        aux_layers: list[int],
        draft_vocab_size: int,
        mask_token_id: int,
        fc_norm: bool = False,
        target_hidden_size: int | None = None,
        target=None,
    ):
        super().__init__(config, aux_layers, draft_vocab_size, fc_norm, False, target_hidden_size, target)
        if not 0 <= int(mask_token_id) < config.vocab_size:
            raise ValueError(
                f"mask token id {mask_token_id} is outside the vocabulary [0, {config.vocab_size})"
            )
        self.mask_token_id = int(mask_token_id)
        self.mask_hidden = nn.Parameter(torch.randn(1, 1, NUM_AUX_LAYERS * self.target_hidden_size))
        self.mask_embedding = nn.Parameter(
            self.embed_tokens.weight[self.mask_token_id].detach().float().clone()
        )

    @classmethod
    def from_target(
        cls,
        target_config: PretrainedConfig,
        aux_layers: list[int],
        draft_vocab_size: int,
        mask_token_id: int,
        fc_norm: bool = False,
        target=None,
        num_layers: int = 1,
        intermediate_size: int | None = None,
    ) -> PEagleHead:
        config = draft_llama_config(target_config, num_layers, intermediate_size)
        return cls(config, aux_layers, draft_vocab_size, mask_token_id, fc_norm, target=target)

    def with_config(self, config: LlamaConfig) -> PEagleHead:
        """An untrained head of this one's kind for `config`, sharing this one's frozen embedding."""
        return PEagleHead(
            config, self.aux_layers, self.draft_vocab_size, self.mask_token_id, self.fc_norm_enabled,
            self.target_hidden_size, target=self,
        )  # fmt: skip

    @torch.no_grad()
    def reset_mask_embedding(self) -> None:
        """Start the learned row from the (frozen) embedding's own row of the mask token."""
        self.mask_embedding.copy_(self.embed_tokens.weight[self.mask_token_id].to(self.mask_embedding))

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        state = super().trainable_state_dict()
        return {**state, **{k: v for k, v in self.state_dict().items() if k in MASK_KEYS}}

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The target's embedding, the learned row at the mask token: [...] -> [..., d]."""
        embeds = self.embed_tokens(input_ids)
        is_mask = (input_ids == self.mask_token_id).unsqueeze(-1)
        return torch.where(is_mask, self.mask_embedding.to(embeds.dtype), embeds)

    def placeholders(self, input_ids: torch.Tensor, features: torch.Tensor, is_mask: torch.Tensor):
        """(ids, features) with the placeholder (mask token, mask_hidden) wherever `is_mask` [..] is set;
        features [..., 3 d_t]. mask_hidden enters the graph even where nothing is masked (a zero
        gradient), so every process of a distributed run uses every parameter."""
        ids = torch.where(is_mask, torch.full_like(input_ids, self.mask_token_id), input_ids)
        mask_hidden = self.mask_hidden.reshape(-1).to(features.dtype)
        return ids, torch.where(is_mask.unsqueeze(-1), mask_hidden, features)

    @torch.no_grad()
    def serving_embedding(self) -> torch.Tensor:
        """[vocab, d] the embedding an engine loads: the frozen one with the learned mask row in place."""
        embed = self.embed_tokens.weight.detach().clone()
        embed[self.mask_token_id] = self.mask_embedding.to(embed)
        return embed


def peagle_config_fields(head: PEagleHead) -> dict:
    """EAGLE-3's config.json fields plus the mask token, under the name the speculators format and vLLM
    read (`mask_token_id`) and vLLM's own (`pard_token`)."""
    return {
        **eagle3_config_fields(head),
        "mask_token_id": head.mask_token_id,
        "pard_token": head.mask_token_id,
    }


def is_peagle_config(raw: dict) -> bool:
    """Whether a head's config.json describes a P-EAGLE head (this project's, the speculators format's,
    SpecForge's architecture, or an EAGLE-3 directory with vLLM's parallel-drafting token)."""
    archs = raw.get("architectures") or []
    return (
        (raw.get("eagle_train") or {}).get("type") == "peagle"
        or raw.get("speculators_model_type") == "peagle"
        or any("PEagle" in a or "Peagle" in a for a in archs)
        or any(k in raw for k in ("pard_token", "ptd_token_id"))
    )


def recorded_mask_token(raw: dict) -> int | None:
    """The mask token a config.json names (mask_token_id, pard_token or ptd_token_id), or None."""
    for key in PEAGLE_FIELDS:
        if raw.get(key) is not None:
            return int(raw[key])
    return None


def peagle_from_config(
    config: LlamaConfig, raw: dict, aux_layers: list[int], mask_token_id: int, target=None
) -> PEagleHead:
    """An (untrained) P-EAGLE head of the shape a config.json describes (see `eagle3_from_config`)."""
    args = eagle3_head_args(config, raw)
    if args.pop("norm_output"):
        raise ValueError("a P-EAGLE head never feeds a state back: norm_output is not supported")
    return PEagleHead(config, aux_layers, mask_token_id=mask_token_id, **args, target=target)
