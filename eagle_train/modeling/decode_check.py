"""Does the decode-time forward compute the model? Checked on a probe before a target is decoded.

The built-in decoder (and its `ar` baseline) runs the stock model through its own cache and tree mask
(`Target.decode`). A mechanism that code does not reproduce (a sliding window, recurrent state, an
attention variant transformers adds in a later release) would make every decode-time method compute
another model, identically, and an ar-vs-speculative comparison could not see it. So before its first
decode-time use a target runs a probe and is refused unless it passes:

    a prefill of a prefix longer than its widest sliding window (by `PAST_WINDOW` tokens), a tree
    verification over that prefix, and one plain step after keeping a path, each against the model's
    own cache-free forward (`Target.features`, the model's own masks) over the same tokens: logits
    and features (and EAGLE-3's aux hidden states) equal up to the dtype's rounding.

Cost: a few forwards of the probe's length, once per loaded target (stories260K: milliseconds).
"""

from __future__ import annotations

import torch

from eagle_train.decoding.tree import build_tree
from eagle_train.modeling.attention_layout import UnsupportedAttention, attention_implementation

PAST_WINDOW = 24  # probe tokens past the widest sliding window (and the probe's length without one)
LONGEST_PROBE = 4096  # a window wider than this is probed over this many tokens
PROBE_TREE = [-1, 0, 0, 1, 1, 2, 3]  # parents of the probe tree's nodes (three paths, depth 3)
# the relative L2 difference per position tolerated between a cached and a cache-free forward
TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
HALF_TOLERANCE = 5e-2  # bfloat16 / float16: another summation order moves logits by a few ulps


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """max over positions of |ours - theirs| / |theirs| (L2 over the last axis)."""
    ours, theirs = ours.float(), theirs.float()
    scale = theirs.norm(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)
    return float(((ours - theirs).norm(dim=-1) / scale).max())


def check_decode(target) -> None:
    """Refuse (UnsupportedAttention) a target whose decode-time forward differs from its own forward. The
    reference forwards run the decode-time attention kernel too (flash_attention_2 takes no 4-D mask and
    decodes through sdpa): what is compared is the cache and the masks, not two kernels' rounding."""
    with torch.no_grad(), attention_implementation(target.decoder.config, target.decode_attention):
        _probe(target)


def _probe(target) -> None:
    # the widest window the masks know, or the config states (a misread layout still gets a long probe)
    windows = (target.attention_layout.max_window, getattr(target.decoder.config, "sliding_window", None))
    window = max((int(w) for w in windows if w), default=0)
    length = min(window + PAST_WINDOW, LONGEST_PROBE, target.max_len - len(PROBE_TREE) - 2)
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, target.vocab_size, (length,), generator=generator).to(target.device)
    nodes = torch.randint(0, target.vocab_size, (len(PROBE_TREE),), generator=generator)
    tree = build_tree(nodes.to(target.device), PROBE_TREE)
    aux = target.aux_layers if target.num_layers >= 3 else None
    cache = target._cache(length + 2 * tree.size)
    failures = []

    def compare(what: str, ours: torch.Tensor, theirs: torch.Tensor) -> None:
        error = relative_error(ours, theirs)
        if not error <= TOLERANCE.get(target.dtype, HALF_TOLERANCE):  # NaN fails too
            failures.append(f"{what}: relative difference {error:.3g}")

    causal = torch.ones(length, length, dtype=torch.bool, device=target.device).tril()[None, None]
    logits, hidden = target.decode(
        prefix[None], torch.arange(length, device=target.device)[None], causal, cache
    )
    reference_logits, reference_hidden = target.features(prefix[None])
    compare(f"prefill of {length} tokens, logits", logits, reference_logits)
    compare(f"prefill of {length} tokens, last hidden state", hidden, reference_hidden)
    cache.advance(length)

    n = tree.size
    mask = torch.cat([torch.ones(n, length, dtype=torch.bool, device=target.device), tree.attention_mask], 1)
    logits, features = target.decode(
        tree.tokens[None], (tree.depth + length)[None], mask[None, None], cache, aux
    )
    for leaf in tree.retrieve_indices.tolist():
        path = [i for i in leaf if i >= 0]
        sequence = torch.cat([prefix, tree.tokens[path]])[None]
        reference_logits, _ = target.features(sequence)
        compare(f"tree verification, path {path}, logits", logits[0, path], reference_logits[0, length:])
        if aux is not None:
            _, reference_aux = target.aux_hidden_states(sequence, None, aux)
            compare(
                f"tree verification, path {path}, aux hidden states",
                features[0, path],
                reference_aux[0, length:],
            )

    keep = [i for i in tree.retrieve_indices[-1].tolist() if i >= 0]  # a path that is not the first nodes
    cache.compact(length, torch.tensor(keep, device=target.device))
    step = tree.tokens[:1]
    position = torch.tensor([[length + len(keep)]], device=target.device)
    ones = torch.ones(1, 1, 1, cache.seq_len + 1, dtype=torch.bool, device=target.device)
    logits, _ = target.decode(step[None], position, ones, cache)
    reference_logits, _ = target.features(torch.cat([prefix, tree.tokens[keep], step])[None])
    compare("a plain step after keeping a path, logits", logits[0], reference_logits[0, -1:])
    if failures:
        raise UnsupportedAttention(
            f"{target.config.model_type}: the built-in decoder's cached tree-mask forward does not reproduce the "
            f"model's own forward on a {length}-token probe ({'; '.join(failures)}); decoding this target would "
            "silently differ from the model, so it is refused"
        )
