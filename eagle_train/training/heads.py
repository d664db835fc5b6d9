"""The head a training run starts from: fresh (seeded) for the configured type, or the one at draft.path.

An EAGLE-3 (and P-EAGLE) head's draft vocabulary (`t2d`, `d2t`) is the `draft.vocab_size` most frequent
assistant tokens of the TRAINING split (held-out sequences excluded), counted from token ids alone (no
hidden state is read); its LM head starts from the target's rows of those tokens. A P-EAGLE head's mask
token is `draft.mask_token_id` or chosen here (`choose_mask_token`), and never one the data holds.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch

from eagle_train.config.base import resolve_path
from eagle_train.config.draft import DraftConfig
from eagle_train.interop.layouts import warn_other_target
from eagle_train.modeling.draft import DraftHead
from eagle_train.modeling.draft_vocab import count_assistant_tokens, default_draft_vocab_size, top_tokens
from eagle_train.modeling.eagle3 import Eagle3Head
from eagle_train.modeling.head_checkpoint import load_head
from eagle_train.modeling.peagle import PEagleHead, check_placeholder_token, target_special_ids
from eagle_train.modeling.target import TargetParts
from eagle_train.runtime.errors import InputError
from eagle_train.training.data import Source

log = logging.getLogger(__name__)


def draft_vocabulary(source: Source, indices: Sequence[int], vocab_size: int, size: int) -> torch.Tensor:
    """t2d [vocab] of the `size` most frequent assistant tokens of the samples `indices`."""
    counts = count_assistant_tokens((source.tokens(i) for i in indices), vocab_size)
    return top_tokens(counts, size)


def token_usage(source: Source, vocab_size: int) -> torch.Tensor:
    """[vocab] bool: every token id any sample of `source` holds (training and held-out alike)."""
    used = torch.zeros(vocab_size, dtype=torch.bool)
    for i in range(len(source)):
        ids = source.tokens(i)[0].long()
        used[ids[(ids >= 0) & (ids < vocab_size)]] = True
    return used


def mask_token_candidates(tokenizer, vocab_size: int) -> list[tuple[int, str]]:
    """(id, why) in the order they are tried: the tokenizer's own mask token, the first embedding row past
    the tokenizer (a padded vocabulary: no text ever maps there), its reserved special tokens, unk."""
    found = [(getattr(tokenizer, "mask_token_id", None), "the tokenizer's mask token")]
    if len(tokenizer) < vocab_size:
        found.append(
            (len(tokenizer), f"the first embedding row past the tokenizer's {len(tokenizer)} tokens")
        )
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    found += [(i, f"the reserved special token {t.content!r}") for i, t in sorted(added.items())
              if "reserved" in str(t.content).lower()]  # fmt: skip
    found += [(getattr(tokenizer, "unk_token_id", None), "the unknown token")]
    return [(int(i), why) for i, why in found if i is not None and 0 <= int(i) < vocab_size]


def choose_mask_token(
    tokenizer, vocab_size: int, special: Mapping[int, str], used: torch.Tensor, explicit: int | None = None
) -> tuple[int, str]:
    """P-EAGLE's mask token and why it was chosen: `explicit` (draft.mask_token_id), else the first of
    `mask_token_candidates`; either must pass `check_placeholder_token` (inside the vocabulary, none of
    the target's `special` ids: BOS / EOS / PAD / stop, absent from the data: `used`, [vocab] bool,
    `token_usage`). InputError naming what was tried when none qualifies."""
    if explicit is not None:
        where = "draft.mask_token_id"
        return check_placeholder_token(explicit, vocab_size, special, where, used), where
    tried = []
    for i, reason in mask_token_candidates(tokenizer, vocab_size):
        try:
            return check_placeholder_token(i, vocab_size, special, reason, used), reason
        except InputError as err:
            tried.append(str(err))
    raise InputError(
        "no token is free to be P-EAGLE's mask token (tried: " + ("; ".join(tried) or "none") + "): set "
        "draft.mask_token_id to a token id the target never emits and the data never holds"
    )


def fresh_head(cfg: DraftConfig, target: TargetParts, source: Source, train: Sequence[int], seed: int):
    """A new head of type `cfg.type` (weights seeded by `seed`)."""
    torch.manual_seed(seed)
    if cfg.type == "eagle1":
        return DraftHead.from_target(
            target.config,
            cfg.num_layers,
            cfg.has_fc_bias,
            target=target,
            intermediate_size=cfg.intermediate_size,
        )
    size = cfg.vocab_size or default_draft_vocab_size(target.vocab_size)
    if size > target.vocab_size:
        raise InputError(f"draft.vocab_size={size}: more than the target's {target.vocab_size} tokens")
    if cfg.type == "peagle":
        mask, why = choose_mask_token(
            target.tokenizer, target.vocab_size, target_special_ids(target),
            token_usage(source, target.vocab_size), cfg.mask_token_id,
        )  # fmt: skip
        log.info("P-EAGLE mask token: %d (%s)", mask, why)
        head = PEagleHead.from_target(
            target.config,
            target.aux_layers,
            size,
            mask,
            cfg.fc_norm,
            target=target,
            num_layers=cfg.num_layers,
            intermediate_size=cfg.intermediate_size,
        )
    else:
        head = Eagle3Head.from_target(
            target.config, target.aux_layers, size, cfg.fc_norm, cfg.norm_output, target=target,
            num_layers=cfg.num_layers, intermediate_size=cfg.intermediate_size,
        )  # fmt: skip
    head.set_vocabulary(draft_vocabulary(source, train, target.vocab_size, size), target.lm_head.weight)
    return head


def build_head(
    cfg: DraftConfig,
    target: TargetParts,
    source: Source,
    train: Sequence[int],
    seed: int,
    frozen_dtype: torch.dtype = torch.float32,
):
    """A fresh head or the one at draft.path (its type and vocabulary kept), sharing the target's frozen
    embedding (EAGLE-1: and LM head, with its output processing).

    The trained weights are float32 (mixed precision keeps fp32 masters); the frozen vocabulary-sized
    matrices are held once, outside the head's state (modeling.draft.FrozenParts), in the working dtype
    (`frozen_dtype`: bf16 under bf16 mixed precision; no copy when the target's already are): at a 128k
    vocabulary an fp32 copy of each costs 2.1 GB per process."""
    if cfg.path:
        head, meta = load_head(resolve_path(cfg.path), target=target)
        if head.kind != cfg.type:
            raise InputError(f"draft.path {cfg.path} is an {head.kind} head, but draft.type={cfg.type}")
        if head.kind != "eagle1" and head.aux_layers != target.aux_layers:
            raise InputError(
                f"draft.path {cfg.path} reads target layers {head.aux_layers}, target.aux_layers "
                f"resolves to {target.aux_layers}: set target.aux_layers={head.aux_layers}"
            )
        if head.kind == "peagle":
            check_placeholder_token(
                head.mask_token_id, target.vocab_size, target_special_ids(target),
                f"draft.path {cfg.path}: its mask token", token_usage(source, target.vocab_size),
            )  # fmt: skip
        warn_other_target(resolve_path(cfg.path), meta, target)  # initial weights for another target
    else:
        head = fresh_head(cfg, target, source, train, seed)
    for module in head.children():  # the registered (trained) modules; the frozen parts are not among them
        module.float()
    head.share_target_weights(target, frozen_dtype)
    if head.kind == "peagle" and not cfg.path:
        head.reset_mask_embedding()  # the target's own row, now that the head holds the target's embedding
    return head
