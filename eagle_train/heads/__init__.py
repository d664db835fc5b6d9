"""The kinds of draft head: one `HeadKind` per kind (heads/kind.py), one module each, registered here.

eagle1.py  EAGLE-1/2: the target's last hidden state and LM head
eagle3.py  EAGLE-3 / 3.1: three target layers, its own LM head over a draft vocabulary
peagle.py  P-EAGLE: an EAGLE-3 head drafting K tokens in one forward
dflash.py  DFlash: a block of B tokens in one forward, the context as keys and values

A kind's model class (eagle_train.modeling) states the drafting contract and recognises its checkpoints
(modeling.head_checkpoint.HEAD_MODELS lists the classes); its module here adds what the training and
export stages ask of it. A new kind is its model class plus one module here and one entry in `KINDS`
(and its name in config.draft.DRAFT_TYPES, which the configuration validates against);
tests/heads/test_registry.py checks the three agree.
"""

from __future__ import annotations

from eagle_train.heads import dflash, eagle1, eagle3, peagle
from eagle_train.heads.kind import HeadKind

KINDS: dict[str, HeadKind] = {k.name: k for k in (eagle1.KIND, eagle3.KIND, peagle.KIND, dflash.KIND)}


def head_kind(of) -> HeadKind:
    """The kind named `of` (draft.type) or of the head `of`."""
    name = of if isinstance(of, str) else of.kind
    try:
        return KINDS[name]
    except KeyError:
        raise ValueError(f"unknown draft head kind {name!r}; known: {sorted(KINDS)}") from None


__all__ = ["KINDS", "HeadKind", "head_kind"]
