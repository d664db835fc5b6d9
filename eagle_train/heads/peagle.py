"""P-EAGLE heads: an EAGLE-3 head that drafts K tokens in one forward from a learned placeholder (its mask
token's embedding row and `mask_hidden`; modeling.peagle.PEagleHead), trained on all K slots at once
(PEagleObjective). Its mask token is `draft.mask_token_id` or chosen here (`choose_mask_token`), and never
one the data holds or the target emits; its exports ship the target's embedding with the learned row in
place."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import torch

from eagle_train.heads.eagle3 import check_aux_layers, draft_vocab_size, set_vocabulary
from eagle_train.heads.kind import HeadKind
from eagle_train.modeling.draft import frozen_modules
from eagle_train.modeling.head_checkpoint import CONFIG_NAME
from eagle_train.modeling.peagle import (
    PEagleHead,
    check_placeholder_token,
    source_special_ids,
    target_special_ids,
)
from eagle_train.runtime.errors import InputError
from eagle_train.training.data import Source
from eagle_train.training.objective import PEagleObjective

log = logging.getLogger(__name__)


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


def fresh(cfg, target, source, train) -> PEagleHead:
    size = draft_vocab_size(cfg, target)
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
    return set_vocabulary(head, source, train, target, size)


def check_loaded(head, cfg, target, source) -> None:
    """The EAGLE-3 checks, and its mask token free in this target and data."""
    check_aux_layers(head, cfg, target, source)
    check_mask_token(head, cfg, target, source)


def check_mask_token(head, cfg, target, source) -> None:
    """A loaded head's mask token is free in this target and data (`check_placeholder_token`)."""
    check_placeholder_token(
        head.mask_token_id, target.vocab_size, target_special_ids(target),
        f"draft.path {cfg.path}: its mask token", token_usage(source, target.vocab_size),
    )  # fmt: skip


def hold_embedding(head, embed: torch.Tensor, recorded: dict, source: Path | str, ckpt: Path) -> None:
    """Export: the head's mask token checked against its target (none of its BOS / EOS / PAD ids, its
    generation config's stop ids and the stop ids training recorded: a placeholder the target emits would
    replace that token's embedding row in the export), then the target's embedding held by the head, to
    ship with the learned row in place."""
    block = recorded.get("target") if isinstance(recorded.get("target"), dict) else {}
    special = source_special_ids(source, block.get("stop_token_ids") or ())
    where = f"{ckpt / CONFIG_NAME}: mask_token_id"
    check_placeholder_token(head.mask_token_id, head.config.vocab_size, special, where)
    head.hold_frozen(frozen_modules(embed.to(head.fc.weight.dtype)))


KIND = HeadKind(
    model=PEagleHead,
    title="P-EAGLE",
    fresh=fresh,
    objective=PEagleObjective,
    check_loaded=check_loaded,
    # the target's own row of the mask token, now that the head holds the target's embedding
    on_shared_weights=lambda head: head.reset_mask_embedding(),
    ships_embedding=True,
    hold_embedding=hold_embedding,
)
