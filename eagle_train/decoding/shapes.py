"""The tree shape that decodes fastest here: measured acceptance x measured costs (`decode.shape=auto`).

Acceptance is replayed, not modelled. At temperature 0 a draft node is accepted iff its path from the
root spells the target's greedy continuation, so on a few calibration prompts decoded greedily once,
the accepted length of ANY tree at ANY position is a lookup: draft the tree with the real head (its
draft state there is the one the decoder has: pairs of the target's features and tokens), count how
deep it matches the known continuation. EAGLE-2's expansion never looks ahead, so one expansion of
depth `max_depth` per top_k and position holds every shallower shape's candidates (its first levels),
and the rerank of each total_tokens is one sort. The decoder's rounds are then replayed exactly: a
round at root position i accepts a(i) drafts and the next round's root is at i + a(i) + 1. So the
predicted tau of a shape is the tau the decoder would reach on these prompts (up to near-tie
rounding); on other prompts it is an estimate, and at temperature > 0 greedy acceptance stands in.

A round's time comes from `decoding.costs` (catch-up + drafting + verification, measured in isolation),
scaled per phase to what the real decoder took on the calibration prompts with two probe shapes, plus
its per-round overhead (`RoundModel`, `measure_phases`), so predicted tokens/s = tau / round time, for every EAGLE-2 shape (depth 1..max_depth, top_k 1..max_k,
total_tokens 2..max_nodes; totals beyond a shape's candidates are the same tree and left out) and every
chain length; `choose_shapes` keeps the fastest of each.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eagle_train.config.decode import DecodeConfig
from eagle_train.decoding.costs import CostCurves, cache_path, cached_costs, cost_key, measure_costs
from eagle_train.decoding.decoder import SpeculativeDecoder, head_reads
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
    static: TreeShape | None = None  # eagle1's candidate tree (decode.tree=auto prunes it)
    static_match: torch.Tensor | None = None  # [positions, nodes - 1] bool: draft node accepted there


def auto_tree_paths(base: list[list[int]], max_depth: int) -> list[list[int]]:
    """decode.tree=auto's candidate static tree: `base` (mc_sim_7b_63) plus the draft's top-1 chain to
    `max_depth` + 1 and the second-best child at every depth of it."""
    chain = [[0] * d for d in range(1, max_depth + 2)]
    seconds = [[0] * (d - 1) + [1] for d in range(1, max_depth + 2)]
    return [list(p) for p in dict.fromkeys(tuple(p) for p in [*base, *chain, *seconds])]


def greedy_sequences(
    target, prompts: list[list[int]], max_new_tokens: int, lookahead: int = 0
) -> list[tuple[list[int], list[int]]]:
    """(prompt, the target's greedy continuation) of each prompt, decoded plainly: max_new_tokens tokens
    plus `lookahead` more (what the decoder's last round may accept beyond its limit), unless it stops."""
    decoder = SpeculativeDecoder(
        target, None, DecodeConfig(method="ar", max_new_tokens=max_new_tokens + lookahead)
    )
    return [(list(p), decoder.generate(p).tokens) for p in prompts]


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
) -> Calibration:
    """Draft every top_k's deepest tree at every root position of each (prompt, greedy continuation) with
    the real head, and tabulate the accepted drafts of every (depth, total_tokens) cut (module docstring).
    Rounds are replayed while fewer than `max_new_tokens` tokens are out (the decoder's limit; None: the
    whole continuation); tokens beyond it only tell what the last round accepts. `static_paths`: a static
    tree drafted at every position too, its nodes' acceptance kept (decode.tree=auto)."""
    device = target.device
    aux, vocab_map = head_reads(head, device)
    capacity = max(len(p) + len(c) for p, c in sequences)

    tables: dict[int, list[torch.Tensor]] = {k: [] for k in range(1, max_k + 1)}
    candidates: dict[int, list[int]] = {}
    static = shape_from_paths(static_paths) if static_paths else None
    inputs = max(max_depth * max_k, static.size if static else 0)
    drafter = Drafter(head, capacity, inputs, GenerationStats(), lean)
    plan = plan_static(static, device) if static else None
    static_match: list[torch.Tensor] = []
    spans, start = [], 0
    with torch.inference_mode():
        for prompt, continuation in sequences:
            if len(continuation) < 2 or max_new_tokens == 1:
                continue
            seq = torch.tensor(prompt + continuation, device=device)
            n, p = seq.numel(), len(prompt)
            cache = target.new_cache(n)
            causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
            _, features = target.decode(
                seq[None], torch.arange(n, device=device)[None], causal[None, None], cache, aux
            )
            features = features[0]
            drafter.reset(capacity, GenerationStats())
            root_logp = drafter.catch_up(seq[1 : p + 1], features[:p])  # the root: continuation[0]
            roots = min(len(continuation), max_new_tokens or len(continuation)) - 1
            for i in range(roots):  # root = seq[p + i]; the tree guesses seq[p + i + 1:]
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


@dataclass
class ShapeChoice:
    """The fastest predicted EAGLE-2 shape, chain length and static tree, with the predictions they rest
    on (tau, tokens_per_s, round_s: predicted seconds per round of draft / verify / other)."""

    eagle2: dict[str, Any]  # depth, top_k, total_tokens, tau, tokens_per_s, round_s
    chain: dict[str, Any]  # chain_length, tau, tokens_per_s, round_s
    ar_tokens_per_s: float
    sweep: list[dict[str, Any]]  # every EAGLE-2 shape, fastest first
    eagle1: dict[str, Any] | None = None  # tree_paths, nodes, tau, tokens_per_s, round_s (decode.tree=auto)

    def decode_fields(self, method: str) -> dict[str, int]:
        """The DecodeConfig fields that fix `method`'s chosen shape."""
        if method == "eagle2":
            return {k: self.eagle2[k] for k in ("depth", "top_k", "total_tokens")}
        if method == "chain":
            return {"chain_length": self.chain["chain_length"]}
        if method == "eagle1" and self.eagle1 is not None:
            return {"tree_paths": self.eagle1["tree_paths"]}
        return {}

    def to_dict(self, sweep_rows: int = 20) -> dict[str, Any]:
        return {
            "eagle2": self.eagle2,
            "chain": self.chain,
            "eagle1": self.eagle1,
            "ar_tokens_per_s": self.ar_tokens_per_s,
            "sweep": self.sweep[:sweep_rows],
            "shapes_predicted": len(self.sweep),
        }


@dataclass
class RoundModel:
    """A round's predicted seconds: the measured curves, scaled to what the real decoder took per phase
    on the calibration prompts (`measure_phases`: the decoder's own loop, its Python and the load of the
    moment are in those figures, not in the isolated timings), plus its per-round overhead."""

    costs: CostCurves
    draft_scale: float = 1.0
    verify_scale: float = 1.0
    other_s: float = 0.0  # per round, outside the draft and verify phases
    ar_token_s: float | None = None  # the ar baseline's seconds per token (None: verify(1))

    def predict(self, tau: float, draft: float, nodes: int) -> dict[str, Any]:
        parts = {
            "draft": self.draft_scale * (draft + self.costs.catch_up(tau)),
            "verify": self.verify_scale * self.costs.verify(nodes),
            "other": self.other_s,
        }
        return {"tau": tau, "tokens_per_s": tau / sum(parts.values()), "round_s": parts}

    @property
    def ar_tokens_per_s(self) -> float:
        return 1.0 / (self.ar_token_s or self.costs.verify(1))


PROBE_SHAPES = ((2, 2, 8), (6, 6, 48))  # a small and a large tree: both ends of the draft / verify balance


def measure_phases(
    target, head, sequences, costs: CostCurves, max_new_tokens: int, probes=PROBE_SHAPES, lean: bool = True
) -> RoundModel:
    """Decode the calibration prompts with the real decoder (ar, and EAGLE-2 with each probe shape,
    interleaved per prompt) and scale the curves to its phase times: draft_scale = the draft phase's
    seconds over the curves' expansion + catch-up of the same rounds, verify_scale likewise, other_s =
    the rest of a round; ar_token_s = ar's seconds per token."""
    ar = SpeculativeDecoder(target, None, DecodeConfig(method="ar", max_new_tokens=max_new_tokens))
    grid = (len(costs.expand_s), len(costs.expand_s[0]), costs.max_nodes)
    probes = sorted({tuple(min(x, top) for x, top in zip(p, grid, strict=True)) for p in probes})
    decoders = [
        SpeculativeDecoder(
            target,
            head,
            DecodeConfig(
                method="eagle2",
                depth=d,
                top_k=k,
                total_tokens=t,
                max_new_tokens=max_new_tokens,
                lean_draft=lean,
            ),
        )
        for d, k, t in probes
    ]
    sums = dict.fromkeys(("draft", "verify", "other", "draft_curve", "verify_curve", "rounds"), 0.0)
    ar_time, ar_tokens = 0.0, 0
    for prompt, _ in sequences:
        stats = ar.generate(prompt).stats
        ar_time += stats.time_total - stats.time_prefill
        ar_tokens += max(stats.new_tokens - 1, 0)  # the first token comes from the prefill
        for decoder in decoders:
            stats = decoder.generate(prompt).stats
            cfg = decoder.cfg
            expand = costs.expand(cfg.depth, cfg.top_k)
            sums["draft"] += stats.time_draft
            sums["verify"] += stats.time_verify
            sums["other"] += stats.time_total - stats.time_prefill - stats.time_draft - stats.time_verify
            sums["draft_curve"] += sum(expand + costs.catch_up(a + 1) for a in stats.accepted_per_round)
            sums["verify_curve"] += sum(costs.verify(n) for n in stats.tree_size_per_round)
            sums["rounds"] += stats.rounds
    if not sums["rounds"]:
        return RoundModel(costs)
    return RoundModel(
        costs,
        draft_scale=sums["draft"] / sums["draft_curve"],
        verify_scale=sums["verify"] / sums["verify_curve"],
        other_s=max(sums["other"], 0.0) / sums["rounds"],
        ar_token_s=ar_time / ar_tokens if ar_tokens else None,
    )


def choose_shapes(calibration: Calibration, model: RoundModel | CostCurves) -> ShapeChoice:
    """Predicted tokens/s of every EAGLE-2 shape and chain length (module docstring); the fastest of each."""
    model = model if isinstance(model, RoundModel) else RoundModel(model)
    costs = model.costs
    sweep = []
    max_depth, max_nodes = calibration.max_depth, min(calibration.max_nodes, costs.max_nodes)
    for k, accepted in calibration.accepted.items():
        if k > len(costs.expand_s[0]):
            continue
        flat = accepted[:, :, : max_nodes - 1].flatten(1)  # [positions, depth * totals]
        tau = replay_tau(flat, calibration.spans).view(max_depth, max_nodes - 1)
        for d in range(1, min(max_depth, len(costs.expand_s)) + 1):
            for total in range(2, min(max_nodes, calibration.candidates[k][d - 1] + 1) + 1):
                row = model.predict(float(tau[d - 1, total - 2]), costs.expand(d, k), total)
                sweep.append({"depth": d, "top_k": k, "total_tokens": total, **row})
    sweep.sort(key=lambda r: -r["tokens_per_s"])
    chains = []
    ones = calibration.accepted[1]
    for length in range(1, max_depth + 2):  # a chain of c drafts = depth max(c - 1, 1), top_k 1, c + 1 nodes
        column = ones[:, max(length - 1, 1) - 1, length - 1 : length]
        tau = float(replay_tau(column, calibration.spans)[0])
        chains.append(
            {"chain_length": length, **model.predict(tau, costs.static_draft([1] * length), length + 1)}
        )
    chain = max(chains, key=lambda r: r["tokens_per_s"])
    eagle1 = choose_static(calibration, model) if calibration.static is not None else None
    return ShapeChoice(sweep[0], chain, model.ar_tokens_per_s, sweep, eagle1)


def choose_static(calibration: Calibration, model: RoundModel) -> dict[str, Any]:
    """decode.tree=auto: the candidate tree pruned to the n nodes accepted most often on the calibration
    prompts (a connected tree: a node is never accepted more often than its parent, and ties keep the
    parent first), for the n with the fastest predicted tokens/s. The accepted drafts of every such
    tree are read off the per-node acceptance and replayed like the dynamic trees'."""
    shape, match = calibration.static, calibration.static_match
    depth = torch.tensor(shape.depths[1:])
    order = torch.sort(match.float().mean(0), descending=True, stable=True).indices  # [nodes - 1]
    deepest = torch.where(match[:, order], depth[order], 0).cummax(1).values  # [positions, n]
    taus = replay_tau(deepest, calibration.spans).tolist()
    best = None
    for n, tau in enumerate(taus, start=1):
        kept = order[:n].tolist()
        widths = [sum(1 for i in kept if shape.depths[i + 1] == d) for d in range(1, int(depth.max()) + 1)]
        row = model.predict(tau, model.costs.static_draft([w for w in widths if w]), n + 1)
        if best is None or row["tokens_per_s"] > best["tokens_per_s"]:
            best = {"tree_paths": [list(shape.paths[i + 1]) for i in sorted(kept)], "nodes": n + 1, **row}
    return best


def context_bucket(prompts: list[list[int]], max_new_tokens: int, limit: int, step: int = 64) -> int:
    """The context length costs are measured at: the mean prompt plus half the answer, rounded up to
    `step` (so nearby runs share a cost cache), within `limit`."""
    mean = sum(len(p) for p in prompts) / max(len(prompts), 1) + max_new_tokens / 2
    return max(1, min(limit, step * math.ceil(mean / step)))


def tune_shapes(
    target,
    head,
    prompts: list[list[int]],
    max_new_tokens: int,
    cache_dir: str | Path,
    max_depth: int = 8,
    max_k: int = 10,
    max_nodes: int = 80,
    repeats: int = 5,
    lean: bool = True,
    static_base: list[list[int]] | None = None,
) -> tuple[ShapeChoice, CostCurves, dict[str, Any]]:
    """Calibrate on `prompts` (decoded greedily here), measure (or reuse from `cache_dir`) the cost
    curves at their context length, and choose (the static tree too when `static_base` is given: its
    candidates are `auto_tree_paths(static_base)`). Returns (choice, costs, what it took)."""
    start = time.perf_counter()
    sequences = greedy_sequences(target, prompts, max_new_tokens, lookahead=max_depth + 1)
    static = auto_tree_paths(static_base, max_depth) if static_base is not None else None
    calibration = calibrate(
        target, head, sequences, max_new_tokens, max_depth, max_k, max_nodes, lean, static
    )
    calibrate_s = time.perf_counter() - start
    context = context_bucket(prompts, max_new_tokens, target.max_len - max_nodes - 1)
    key = cost_key(target, head, context, max_nodes, max_depth, max_k, repeats)
    costs, reused = cached_costs(
        cache_dir, key, lambda: measure_costs(target, head, context, max_nodes, max_depth, max_k, repeats)
    )
    phases_start = time.perf_counter()
    model = measure_phases(target, head, sequences, costs, max_new_tokens, lean=lean)
    info = {
        "calibration_prompts": len(prompts),
        "calibration_rounds_positions": sum(hi - lo for lo, hi in calibration.spans),
        "calibration_s": calibrate_s,
        "context": context,
        "costs_s": costs.seconds,
        "costs_reused": reused,
        "costs_file": str(cache_path(cache_dir, key)),
        "phases_s": time.perf_counter() - phases_start,
        "round_model": {
            "draft_scale": model.draft_scale,
            "verify_scale": model.verify_scale,
            "other_s": model.other_s,
            "ar_token_s": model.ar_token_s,
        },
    }
    return choose_shapes(calibration, model), costs, info
