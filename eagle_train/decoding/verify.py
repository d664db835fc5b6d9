"""Verification of a draft tree against the target's outputs at every node (pure torch + stdlib).

Greedy: a child is accepted iff it is the target's argmax at its parent; the bonus token is the
argmax at the last accepted node.

Sampling (lossless; recursive rejection sampling over the children of the current node, in order):
  - children SAMPLED i.i.d. from q (tree.draft_probs set): accept x with probability min(1, p(x)/q(x));
    on rejection p <- norm(max(0, p - q)) and try the next child;
  - children chosen DETERMINISTICALLY (top-k): accept x with probability p(x); on rejection
    p <- p with x zeroed, renormalised, and try the next child.
When every child is rejected (or the node is a leaf) the bonus token is drawn from the residual p.
Either way the emitted tokens are distributed exactly as the target's (processed) distribution.
A q over a reduced draft vocabulary (EAGLE-3, `Tree.draft_vocab`) is q on the target vocabulary with
zero mass outside the kept tokens: it is placed there first, and the same rule stays exact.
"""

from __future__ import annotations

import torch

from eagle_train.decoding.tree import Tree


def process_logits(
    logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0
) -> torch.Tensor:
    """Sampling distribution [..., vocab] from logits: temperature, then top-k, then top-p (nucleus).
    The same processing is applied to the target and the draft."""
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        # drop a token when the mass strictly before it already reaches top_p (the top token is always kept)
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def accept_greedy(tree: Tree, target_logits: torch.Tensor) -> tuple[list[int], int]:
    """Longest accepted path (node ids, root first) and the bonus token, for target logits [n, vocab]."""
    best = target_logits.argmax(dim=-1).tolist()
    tokens = tree.token_list
    path, node = [0], 0
    while True:
        for child in tree.children[node]:
            if tokens[child] == best[node]:
                path.append(child)
                node = child
                break
        else:
            return path, best[node]


def _uniform(generator: torch.Generator | None, device: torch.device) -> float:
    return float(torch.rand((), generator=generator, device=device))


def on_target_vocab(tree: Tree, node: int, vocab_size: int) -> torch.Tensor:
    """The draft distribution q of a sampled node [vocab] (float64), moved from the draft vocabulary to
    the target ids `tree.draft_vocab` when it lives on a reduced one."""
    q = tree.draft_probs[node].double()
    if tree.draft_vocab is None:
        return q
    return q.new_zeros(vocab_size).index_copy_(0, tree.draft_vocab, q)


def accept_sampling(
    tree: Tree, target_probs: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[list[int], int]:
    """Recursive rejection sampling down the tree. target_probs [n, vocab]: the target's processed
    distribution at each node. Returns (accepted path of node ids, root first; bonus token)."""
    tokens = tree.token_list
    device = target_probs.device
    path, node = [0], 0
    while True:
        p = target_probs[node].double()
        q = None if tree.draft_probs is None else on_target_vocab(tree, node, p.shape[-1])
        accepted = None
        for child in tree.children[node]:
            x = tokens[child]
            if q is None:  # deterministic child: a point mass at x
                if _uniform(generator, device) < float(p[x]):
                    accepted = child
                    break
                p = p.clone()
                p[x] = 0.0
            else:  # child drawn from q
                if _uniform(generator, device) * float(q[x]) < float(p[x]):  # u < p/q without dividing
                    accepted = child
                    break
                p = (p - q).clamp_(min=0.0)
            total = p.sum()
            if float(total) <= 1e-12:  # only by rounding (acceptance was ~certain): keep the target's p
                p = target_probs[node].double()
                total = p.sum()
            p = p / total
        if accepted is None:
            bonus = int(torch.multinomial(p.float(), 1, generator=generator))
            return path, bonus
        path.append(accepted)
        node = accepted
