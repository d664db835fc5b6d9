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

A placeholder token (P-EAGLE's mask token; any head that drafts through placeholders) must be an id the
target never emits: an integer inside the vocabulary, none of its BOS / EOS / PAD / stop ids, and at
training absent from the data. `check_placeholder_token` is the one check, at training (the id chosen or
given), export and import (the id a config.json records: missing, not an integer or out of range is an
InputError naming the file and the key); `check_placeholder_tensors` refuses a `mask_hidden` or
`mask_embedding` of the wrong shape, naming the file and the tensor.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, PretrainedConfig

from eagle_train.config.target import NUM_AUX_LAYERS
from eagle_train.modeling.draft import draft_llama_config
from eagle_train.modeling.eagle3 import (
    Eagle3Head,
    eagle3_config_fields,
    eagle3_head_args,
    recorded_aux_layers,
)
from eagle_train.runtime.errors import InputError

MASK_KEYS = ("mask_hidden", "mask_embedding")
PEAGLE_FIELDS = ("mask_token_id", "pard_token", "ptd_token_id")  # config.json fields beyond EAGLE-3's


class PEagleHead(Eagle3Head):
    """`Eagle3Head` + `mask_hidden` [1, 1, 3 d_t] + the learned embedding row of `mask_token_id`."""

    kind = "peagle"  # the head protocol: modeling.draft.DraftHead
    drafts_in_catch_up = True

    @classmethod
    def recognise(cls, raw: dict) -> bool:
        return is_peagle_config(raw)

    @classmethod
    def from_checkpoint(cls, config: LlamaConfig, raw: dict, meta: dict, file: Path, target=None):
        mask = recorded_mask_token(raw, file, config.vocab_size, required=True)
        return peagle_from_config(config, raw, recorded_aux_layers(raw), mask, target=target)

    def checkpoint_fields(self) -> dict:
        return peagle_config_fields(self)

    def check_checkpoint_state(self, state: dict, file: Path) -> None:
        check_placeholder_tensors(self, state, file)

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
        self.mask_token_id = check_placeholder_token(mask_token_id, config.vocab_size, {}, "mask_token_id")
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


def special_token_ids(tokenizer, stop_ids: Iterable[int] = ()) -> dict[int, str]:
    """{id: what it is} of the ids a placeholder token may never be: the tokenizer's BOS, EOS and PAD and
    every stop id (the preset's and the generation config's: `Target.stop_token_ids`)."""
    special = {int(i): "a stop id the target emits" for i in stop_ids}
    for name in ("pad", "eos", "bos"):
        i = getattr(tokenizer, f"{name}_token_id", None)
        if i is not None:
            special[int(i)] = f"the target's {name.upper()} token"
    return special


def target_special_ids(target) -> dict[int, str]:
    """`special_token_ids` of a loaded target (a `Target`, with its generation config's stop ids, or a
    frozen one: its preset's)."""
    stop_ids = getattr(target, "stop_token_ids", None)
    return special_token_ids(target.tokenizer, target.cfg.stop_token_ids if stop_ids is None else stop_ids)


def source_special_ids(source: str | Path, stop_ids: Iterable[int] = ()) -> dict[int, str]:
    """`special_token_ids` of the target at `source` (its tokenizer and generation_config.json) plus
    `stop_ids` (a head's record of its preset's): what export checks a head's mask token against."""
    stop_ids = [int(i) for i in stop_ids]
    if (Path(source) / "generation_config.json").is_file():
        eos = GenerationConfig.from_pretrained(str(source)).eos_token_id
        stop_ids += [int(i) for i in (eos if isinstance(eos, list) else [eos]) if i is not None]
    return special_token_ids(AutoTokenizer.from_pretrained(str(source)), stop_ids)


def check_placeholder_token(
    value: Any,
    vocab_size: int,
    special: Mapping[int, str],
    where: str,
    used: torch.Tensor | None = None,
) -> int:
    """The placeholder token id `value` read from `where` (a file and its key, or a setting), as an int:
    an integer in [0, vocab_size) that is none of `special` (`special_token_ids`) and, with `used`
    ([vocab] bool: the training data's token ids), absent from the data. InputError naming `where`, the
    value and why otherwise: a placeholder that the target emits, or that the data holds, would stand for
    a real token."""
    if value is None:
        raise InputError(f"{where}: missing (a P-EAGLE head needs the id of its mask token)")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InputError(f"{where}: {value!r} is not an integer token id")
    token = int(value)
    if not 0 <= token < vocab_size:
        raise InputError(f"{where}: {token} is outside the vocabulary [0, {vocab_size})")
    if token in special:
        raise InputError(
            f"{where}: {token} is {special[token]}: a placeholder must be a token the target never emits"
        )
    if used is not None and bool(used[token]):
        raise InputError(
            f"{where}: {token} occurs in the training data: the placeholder would stand for a real token"
        )
    return token


def mask_token_entries(raw: dict) -> dict[str, Any]:
    """{key: value} of the mask token fields a config.json holds (mask_token_id, pard_token, ptd_token_id)."""
    return {key: raw[key] for key in PEAGLE_FIELDS if raw.get(key) is not None}


def recorded_mask_token(
    raw: dict,
    file: str | Path,
    vocab_size: int,
    special: Mapping[int, str] | None = None,
    required: bool = False,
) -> int | None:
    """The mask token a config.json (`file`) names, checked (`check_placeholder_token`, naming the file
    and the key), or None when it names none (`required`: an InputError naming `mask_token_id`). Fields
    that name different ids are refused."""
    if required and not mask_token_entries(raw):
        check_placeholder_token(raw.get("mask_token_id"), vocab_size, {}, f"{file}: mask_token_id")
    checked = {
        key: check_placeholder_token(value, vocab_size, special or {}, f"{file}: {key}")
        for key, value in mask_token_entries(raw).items()
    }
    if len(set(checked.values())) > 1:
        raise InputError(f"{file}: its mask token fields disagree ({checked})")
    return next(iter(checked.values()), None)


def check_placeholder_tensors(head: PEagleHead, state: Mapping[str, torch.Tensor], file: str | Path) -> None:
    """InputError naming the file and the tensor when `mask_hidden` or `mask_embedding` in `state` has
    another shape than `head`'s ([1, 1, 3 d_t] and [d])."""
    for key in MASK_KEYS:
        if key in state and tuple(state[key].shape) != tuple(getattr(head, key).shape):
            raise InputError(
                f"{file}: {key} has shape {list(state[key].shape)}; a P-EAGLE head of this config.json "
                f"needs {list(getattr(head, key).shape)}"
            )


def peagle_from_config(
    config: LlamaConfig, raw: dict, aux_layers: list[int], mask_token_id: int, target=None
) -> PEagleHead:
    """An (untrained) P-EAGLE head of the shape a config.json describes (see `eagle3_from_config`)."""
    args = eagle3_head_args(config, raw)
    if args.pop("norm_output"):
        raise InputError("a P-EAGLE head never feeds a state back: norm_output is not supported")
    return PEagleHead(config, aux_layers, mask_token_id=mask_token_id, **args, target=target)
