"""Acceptance, replayed: the accepted length of every tree shape on calibration prompts (decode.shape=auto).

At temperature 0 a draft node is accepted iff its path from the root spells the target's greedy
continuation, so on a few calibration prompts decoded greedily once, the accepted length of ANY tree at
ANY position is a lookup: draft the tree with the real head (its draft state there is the one the decoder
has: pairs of the target's features and tokens), count how deep it matches the known continuation.
EAGLE-2's expansion never looks ahead, so one expansion of depth `max_depth` per top_k and position holds
every shallower shape's candidates (its first levels), and the rerank of each total_tokens is one sort; a
static tree's nodes are drafted once per position and any pruning of it read off their acceptance. The
decoder's rounds are then replayed exactly (`replay_tau`): a round at root position i accepts a(i) drafts
and the next round's root is at i + a(i) + 1. So the replayed tau of a shape is the tau the decoder
reaches on these prompts (tests/autotune/test_shapes.py checks it is, token for token); on other prompts
it is an estimate, and at temperature > 0 greedy acceptance stands in. autotune.shapes turns it into a
choice.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from eagle_train.autotune.budget import MIN_ROOTS, Budget
from eagle_train.config.decode import DecodeConfig
from eagle_train.decoding.decoder import SpeculativeDecoder, head_reads, parallel_slots
from eagle_train.decoding.drafter import Drafter
from eagle_train.decoding.expand import Candidates, dynamic_candidates, expand_static, plan_static
from eagle_train.decoding.stats import GenerationStats
from eagle_train.decoding.tree import TreeShape, shape_from_paths


@dataclass
class Calibration:
    """Per top_k, the accepted drafts at every calibration position for every (depth, total_tokens):
    accepted[k][i, d - 1, t - 2] (int16); `spans`: each sequence's [start, end) position range (the
    rounds of one sequence are replayed inside it)."""

    accepted: dict[int, torch.Tensor]
    spans: list[tuple[int, int]]
    max_depth: int
    max_nodes: int
    candidates: dict[int, list[int]] = field(default_factory=dict)  # k -> candidates of depth 1..max_depth
    static: TreeShape | None = None  # static_tree's candidate tree (decode.tree=auto prunes it)
    static_match: torch.Tensor | None = None  # [positions, nodes - 1] bool: draft node accepted there


def auto_tree_paths(base: list[list[int]], max_depth: int) -> list[list[int]]:
    """decode.tree=auto's candidate static tree: `base` (mc_sim_7b_63) plus the draft's top-1 chain to
    `max_depth` + 1 and the second-best child at every depth of it."""
    chain = [[0] * d for d in range(1, max_depth + 2)]
    seconds = [[0] * (d - 1) + [1] for d in range(1, max_depth + 2)]
    return [list(p) for p in dict.fromkeys(tuple(p) for p in [*base, *chain, *seconds])]


def greedy_sequences(
    target, prompts: list[list[int]], max_new_tokens: int, lookahead: int = 0, budget: Budget | None = None
) -> list[tuple[list[int], list[int]]]:
    """(prompt, the target's greedy continuation) of each prompt, decoded plainly: max_new_tokens tokens
    plus `lookahead` more (what the decoder's last round may accept beyond its limit), unless it stops.
    `budget`: fixed from the first prompt's seconds per token; the later prompts are decoded while its
    share for the sequences lasts."""
    decoder = SpeculativeDecoder(
        target, None, DecodeConfig(method="ar", max_new_tokens=max_new_tokens + lookahead)
    )
    sequences = []
    for i, prompt in enumerate(prompts):
        if budget is not None and i and budget.past("sequences"):
            break
        result = decoder.generate(prompt)
        if budget is not None and i == 0:
            stats = result.stats
            budget.fix((stats.time_total - stats.time_prefill) / max(stats.new_tokens - 1, 1))
        sequences.append((list(prompt), result.tokens))
    return sequences


def _parents(cands: Candidates) -> torch.Tensor:
    """Parent candidate id of every candidate (-1: the root), in candidate order."""
    plan = cands.plan
    num_fed = cands.ancestors.shape[1]
    fed_candidate = (
        torch.cat(cands.picks) + plan.feed_offsets[:num_fed]
    )  # [F]: candidate id of each fed input
    num_cands = sum(v.numel() for v in cands.values)
    lookup = torch.cat([fed_candidate, fed_candidate.new_full((1,), -1)])
    return lookup[plan.parent_feed[:num_cands]]


def _accepted_table(
    cands: Candidates, continuation: torch.Tensor, max_depth: int, max_nodes: int
) -> torch.Tensor:
    """[max_depth, max_nodes - 1]: accepted drafts of the tree (depth d, total t) cut from `cands`.
    continuation: the target's greedy tokens after the root (shorter near the end: no match beyond)."""
    values = torch.cat(cands.values)
    tokens = torch.cat(cands.tokens)
    parents = _parents(cands)
    depth = cands.plan.depth[: values.numel()]
    known = continuation.numel()
    expected = torch.where(depth <= known, continuation[(depth - 1).clamp(max=max(known - 1, 0))], -1)
    match = torch.zeros(values.numel() + 1, dtype=torch.bool, device=values.device)
    match[-1] = True  # index -1: the root
    own = tokens == expected
    lo = 0
    for size in (v.numel() for v in cands.values):  # level by level: a parent precedes its children
        match[lo : lo + size] = own[lo : lo + size] & match[parents[lo : lo + size]]
        lo += size
    match = match[:-1]
    # the rerank keeps the best values, ties to the earlier candidate: the sorted order of a shallower
    # shape's candidates is this order with the deeper ones left out
    order = torch.sort(values, descending=True, stable=True).indices
    deep, hit = depth[order], match[order]
    levels = torch.arange(2, max_depth + 2, device=values.device)[:, None]  # depth d keeps depths <= d + 1
    kept = deep[None] <= levels  # [max_depth, C]
    deepest = torch.where(kept & hit[None], deep[None], 0).cummax(1).values
    rank = kept.cumsum(1)  # [max_depth, C]: kept candidates up to each sorted position
    want = torch.arange(1, max_nodes, device=values.device).expand(max_depth, -1).contiguous()
    at = torch.searchsorted(rank, want).clamp(max=values.numel() - 1)  # where the t-1'th kept one sits
    return deepest.gather(1, at).to(torch.int16).cpu()


def calibrate(
    target,
    head,
    sequences: list[tuple[list[int], list[int]]],
    max_new_tokens: int | None = None,
    max_depth: int = 8,
    max_k: int = 10,
    max_nodes: int = 80,
    lean: bool = True,
    static_paths: list[list[int]] | None = None,
    deadline: float | None = None,
) -> Calibration:
    """Draft every top_k's deepest tree at every root position of each (prompt, greedy continuation) with
    the real head, and tabulate the accepted drafts of every (depth, total_tokens) cut (module docstring).
    Rounds are replayed while fewer than `max_new_tokens` tokens are out (the decoder's limit; None: the
    whole continuation); tokens beyond it only tell what the last round accepts. `static_paths`: a static
    tree drafted at every position too, its nodes' acceptance kept (decode.tree=auto). `deadline` (a
    perf_counter time): each sequence gets an equal slice of the time left and stops its root positions at
    its slice's end (a sequence's positions stay one span from its start); the first sequence calibrates
    at least MIN_ROOTS positions, a later one none once the deadline has passed."""
    device = target.device
    aux, vocab_map = head_reads(head, device)
    capacity = max(len(p) + len(c) for p, c in sequences)

    tables: dict[int, list[torch.Tensor]] = {k: [] for k in range(1, max_k + 1)}
    candidates: dict[int, list[int]] = {}
    static = shape_from_paths(static_paths) if static_paths else None
    inputs = max(max_depth * max_k, static.size if static else 0)
    drafter = Drafter(
        head, capacity, inputs, GenerationStats(), lean, parallel=parallel_slots(head, max_depth + 1)
    )
    plan = plan_static(static, device) if static else None
    static_match: list[torch.Tensor] = []
    spans, start = [], 0
    began = time.perf_counter()
    with torch.inference_mode():
        for j, (prompt, continuation) in enumerate(sequences):
            if len(continuation) < 2 or max_new_tokens == 1:
                continue
            slice_end = None if deadline is None else began + (deadline - began) * (j + 1) / len(sequences)
            floor = MIN_ROOTS if not spans else 0
            if slice_end is not None and floor == 0 and time.perf_counter() > deadline:
                break
            seq = torch.tensor(prompt + continuation, device=device)
            n, p = seq.numel(), len(prompt)
            cache = target.new_cache(n)
            causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
            _, features = target.decode(
                seq[None], torch.arange(n, device=device)[None], causal[None, None], cache, aux, True
            )
            features = features[0]
            drafter.reset(capacity, GenerationStats())
            root_logp = drafter.catch_up(seq[1 : p + 1], features[:p])  # the root: continuation[0]
            roots = min(len(continuation), max_new_tokens or len(continuation)) - 1
            for i in range(roots):  # root = seq[p + i]; the tree guesses seq[p + i + 1:]
                if slice_end is not None and i >= max(floor, 1) and time.perf_counter() > slice_end:
                    roots = i
                    break
                after = seq[p + i + 1 : p + i + 2 + max_depth]
                for k in tables:
                    drafter.drop_tree()
                    cands = dynamic_candidates(root_logp, drafter, max_depth, k, max_nodes, vocab_map)
                    candidates[k] = [
                        sum(v.numel() for v in cands.values[: d + 1]) for d in range(1, max_depth + 1)
                    ]
                    tables[k].append(_accepted_table(cands, after, max_depth, max_nodes))
                if plan is not None:
                    drafter.drop_tree()
                    tree = expand_static(plan, int(seq[p + i]), root_logp, drafter, vocab_map=vocab_map)
                    static_match.append(_static_accepted(tree, after))
                root_logp = drafter.catch_up(seq[p + i + 1 : p + i + 2], features[p + i : p + i + 1])
            spans.append((start, start + roots))
            start += roots
    if not spans:
        raise ValueError("calibration needs at least one prompt with a continuation of 2+ tokens")
    accepted = {k: torch.stack(t) for k, t in tables.items()}
    matched = torch.stack(static_match) if static_match else None
    return Calibration(accepted, spans, max_depth, max_nodes, candidates, static, matched)


def _static_accepted(tree, continuation: torch.Tensor) -> torch.Tensor:
    """[nodes - 1] bool: which draft nodes of a static tree spell the greedy continuation from the root."""
    known = continuation.numel()
    depth = tree.depth
    expected = torch.where(depth <= known, continuation[(depth - 1).clamp(0, max(known - 1, 0))], -1)
    match = tree.tokens == expected
    match[0] = True
    for i, parent in enumerate(tree.parents.tolist()[1:], start=1):  # parents precede children
        match[i] &= match[parent]
    return match[1:].cpu()


def replay_tau(accepted: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    """tau of many shapes at once: accepted [positions, shapes] drafts per position; the decoder's rounds
    replayed inside each span (round at i, next at i + accepted + 1). Returns [shapes]."""
    shapes = accepted.shape[1]
    tokens = torch.zeros(shapes, dtype=torch.float64)
    rounds = torch.zeros(shapes, dtype=torch.float64)
    columns = torch.arange(shapes)
    for lo, hi in spans:
        at = torch.full((shapes,), lo, dtype=torch.long)
        while True:
            live = at < hi
            if not bool(live.any()):
                break
            a = accepted[at.clamp(max=hi - 1), columns].long()
            tokens += torch.where(live, a + 1, 0)
            rounds += live.double()
            at = torch.where(live, at + a + 1, at)
    return tokens / rounds.clamp(min=1)
