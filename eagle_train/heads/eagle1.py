"""EAGLE-1/2 heads: fc over [token embedding ; the target's last hidden state], N decoder layers, the
target's own LM head (modeling.draft.DraftHead), trained on smooth-L1 regression + CE (EagleObjective)."""

from __future__ import annotations

from eagle_train.heads.kind import HeadKind
from eagle_train.modeling.draft import DraftHead
from eagle_train.training.objective import EagleObjective


def fresh(cfg, target, source, train) -> DraftHead:
    return DraftHead.from_target(
        target.config,
        cfg.num_layers,
        cfg.has_fc_bias,
        target=target,
        intermediate_size=cfg.intermediate_size,
    )


KIND = HeadKind(
    model=DraftHead,
    title="EAGLE-1/2",
    fresh=fresh,
    objective=lambda loss, lm_weight, transform, head: EagleObjective(loss, lm_weight, transform),
)
