"""The tree shape that decodes fastest here: replayed acceptance x measured costs (`decode.shape=auto`,
`decode.tree=auto`).

autotune.replay gives the accepted length of every shape on calibration prompts; autotune.costs the
measured cost curves of a round's parts. A round's time is those curves fitted per phase (a fixed part + a
scale) to what the real decoder took on the calibration prompts with three probe shapes, plus its
per-round overhead (`RoundModel`,
`measure_phases`: the loop's own Python and the load of the moment are in those figures, not in the
isolated timings), so predicted tokens/s = tau / round time, for every EAGLE-2 shape (depth 1..max_depth,
top_k 1..max_k, total_tokens 2..max_nodes; totals beyond a shape's candidates are the same tree and left
out), every chain length and every pruning of the static tree; `choose_shapes` keeps the fastest of each.
The model's error between shapes it predicts within a few percent of each other is settled by measurement:
`race_shapes` decodes the calibration prompts with the best predicted shape of the fastest few (depth,
top_k) pairs, side by side, and the EAGLE-2 choice is the one that measured fastest.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eagle_train.autotune.budget import Budget, race_plan
from eagle_train.autotune.costs import CostCurves, cache_path, cached_costs, cost_key, measure_costs
from eagle_train.autotune.replay import Calibration, auto_tree_paths, calibrate, greedy_sequences, replay_tau
from eagle_train.config.decode import DecodeConfig
from eagle_train.decoding.decoder import SpeculativeDecoder
from eagle_train.decoding.timing import median_pass, pass_orders
from eagle_train.runtime.errors import InputError


@dataclass
class ShapeChoice:
    """The fastest predicted EAGLE-2 shape, chain length and static tree, with the predictions they rest
    on (tau, tokens_per_s, round_s: predicted seconds per round of draft / verify / other)."""

    dynamic_tree: dict[str, Any]  # depth, top_k, total_tokens, tau, tokens_per_s, round_s
    chain: dict[str, Any]  # chain_length, tau, tokens_per_s, round_s
    ar_tokens_per_s: float
    sweep: list[dict[str, Any]]  # every EAGLE-2 shape, fastest first
    static_tree: dict[str, Any] | None = (
        None  # tree_paths, nodes, tau, tokens_per_s, round_s (decode.tree=auto)
    )
    # race_shapes' candidates with what they measured, fastest measured first (empty: no race)
    race: list[dict[str, Any]] = field(default_factory=list)
    # one line when no shape is predicted to beat plain decoding (`no_shape_pays`), else None
    verdict: str | None = None

    def decode_fields(self, method: str) -> dict[str, int]:
        """The DecodeConfig fields that fix `method`'s chosen shape."""
        if method == "dynamic_tree":
            return {k: self.dynamic_tree[k] for k in ("depth", "top_k", "total_tokens")}
        if method == "chain":
            return {"chain_length": self.chain["chain_length"]}
        if method == "static_tree" and self.static_tree is not None:
            return {"tree_paths": self.static_tree["tree_paths"]}
        return {}

    def to_dict(self, sweep_rows: int = 20) -> dict[str, Any]:
        return {
            "dynamic_tree": self.dynamic_tree,
            "chain": self.chain,
            "static_tree": self.static_tree,
            "ar_tokens_per_s": self.ar_tokens_per_s,
            "sweep": self.sweep[:sweep_rows],
            "shapes_predicted": len(self.sweep),
            "race": self.race,
            "verdict": self.verdict,
        }


@dataclass
class RoundModel:
    """A round's predicted seconds: per phase, a line through what the real decoder took on the calibration
    prompts against what the measured curves say for the same rounds (`measure_phases`: the decoder's
    own loop, its Python and the load of the moment are in those figures, not in the isolated timings):
    draft = draft_fixed + draft_scale x (expansion + catch-up), verify = verify_fixed + verify_scale x
    verify(nodes), plus the rest of a round (other_s)."""

    costs: CostCurves
    draft_scale: float = 1.0
    verify_scale: float = 1.0
    other_s: float = 0.0  # per round, outside the draft and verify phases
    ar_token_s: float | None = None  # the ar baseline's seconds per token (None: verify(1))
    draft_fixed: float = 0.0  # seconds per round of the draft phase that no curve accounts for
    verify_fixed: float = 0.0

    def predict(self, tau: float, draft: float, nodes: int, placeholders: int = 0) -> dict[str, Any]:
        """`placeholders`: a P-EAGLE head's per round (its tree depth - 1), drafted in the catch-up."""
        catch_up = self.costs.catch_up(tau, placeholders)
        parts = {
            "draft": self.draft_fixed + self.draft_scale * (draft + catch_up),
            "verify": self.verify_fixed + self.verify_scale * self.costs.verify(nodes),
            "other": self.other_s,
        }
        return {"tau": tau, "tokens_per_s": tau / sum(parts.values()), "round_s": parts}

    @property
    def ar_tokens_per_s(self) -> float:
        return 1.0 / (self.ar_token_s or self.costs.verify(1))


def dynamic_tree_decoder(
    target, head, shape: tuple[int, int, int], max_new_tokens: int, lean: bool
) -> SpeculativeDecoder:
    """The real decoder for an EAGLE-2 shape (depth, top_k, total_tokens), greedy."""
    depth, top_k, total = shape
    cfg = DecodeConfig(
        method="dynamic_tree",
        depth=depth,
        top_k=top_k,
        total_tokens=total,
        max_new_tokens=max_new_tokens,
        lean_draft=lean,
    )
    return SpeculativeDecoder(target, head, cfg)


# a small, a middle and a large tree: the draft / verify balance at both ends and between
PROBE_SHAPES = ((2, 2, 8), (4, 4, 16), (6, 6, 48))


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through (curve seconds, measured seconds) per round;
    through the origin (intercept 0) when the points cannot carry an intercept (fewer than two distinct
    x, or a fit with a negative intercept or slope)."""
    n = len(points)
    sx, sy = sum(x for x, _ in points), sum(y for _, y in points)
    sxx, sxy = sum(x * x for x, _ in points), sum(x * y for x, y in points)
    through_origin = (0.0, sxy / sxx if sxx > 0 else 1.0)
    spread = n * sxx - sx * sx
    if n < 2 or spread <= 1e-12 * max(sxx, 1e-30) * n:
        return through_origin
    slope = (n * sxy - sx * sy) / spread
    intercept = (sy - slope * sx) / n
    return (intercept, slope) if slope > 0 and intercept >= 0 else through_origin


def measure_phases(
    target,
    head,
    sequences,
    costs: CostCurves,
    max_new_tokens: int,
    probes=PROBE_SHAPES,
    lean: bool = True,
    deadline: float | None = None,
) -> RoundModel:
    """Decode the calibration prompts with the real decoder (ar, and EAGLE-2 with each probe shape,
    interleaved per prompt) and fit each phase per round against the curves (`fit_line`): the draft
    phase's seconds against the curves' expansion + catch-up of the same rounds, the verify phase's
    against verify(tree size); other_s = the rest of a round; ar_token_s = ar's seconds per token.
    `deadline` (a perf_counter time): no prompt after the first is started past it."""
    ar = SpeculativeDecoder(target, None, DecodeConfig(method="ar", max_new_tokens=max_new_tokens))
    grid = (len(costs.expand_s), len(costs.expand_s[0]), costs.max_nodes)
    probes = sorted({tuple(min(x, top) for x, top in zip(p, grid, strict=True)) for p in probes})
    decoders = [dynamic_tree_decoder(target, head, (d, k, t), max_new_tokens, lean) for d, k, t in probes]
    keys = ("draft", "verify", "other", "draft_curve", "verify_curve", "rounds")
    sums = [dict.fromkeys(keys, 0.0) for _ in decoders]  # per probe
    ar_time, ar_tokens = 0.0, 0
    for i, (prompt, _) in enumerate(sequences):
        if deadline is not None and i and time.perf_counter() > deadline:
            break
        stats = ar.generate(prompt).stats
        ar_time += stats.time_total - stats.time_prefill
        ar_tokens += max(stats.new_tokens - 1, 0)  # the first token comes from the prefill
        for decoder, probe in zip(decoders, sums, strict=True):
            stats = decoder.generate(prompt).stats
            expand = costs.expand(decoder.cfg.depth, decoder.cfg.top_k)
            probe["draft"] += stats.time_draft
            probe["verify"] += stats.time_verify
            probe["other"] += stats.time_total - stats.time_prefill - stats.time_draft - stats.time_verify
            probe["draft_curve"] += sum(
                expand + costs.catch_up(a + 1, decoder.cfg.depth) for a in stats.accepted_per_round
            )
            probe["verify_curve"] += sum(costs.verify(n) for n in stats.tree_size_per_round)
            probe["rounds"] += stats.rounds
    done = [p for p in sums if p["rounds"]]
    if not done:
        return RoundModel(costs)
    per_round = lambda name: [(p[f"{name}_curve"] / p["rounds"], p[name] / p["rounds"]) for p in done]  # noqa: E731
    draft_fixed, draft_scale = fit_line(per_round("draft"))
    verify_fixed, verify_scale = fit_line(per_round("verify"))
    return RoundModel(
        costs,
        draft_scale=draft_scale,
        verify_scale=verify_scale,
        other_s=max(sum(p["other"] for p in done), 0.0) / sum(p["rounds"] for p in done),
        ar_token_s=ar_time / ar_tokens if ar_tokens else None,
        draft_fixed=draft_fixed,
        verify_fixed=verify_fixed,
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
                row = model.predict(float(tau[d - 1, total - 2]), costs.expand(d, k), total, d)
                sweep.append({"depth": d, "top_k": k, "total_tokens": total, **row})
    sweep.sort(key=lambda r: -r["tokens_per_s"])
    chains = []
    ones = calibration.accepted[1]
    for length in range(1, max_depth + 2):  # a chain of c drafts = depth max(c - 1, 1), top_k 1, c + 1 nodes
        column = ones[:, max(length - 1, 1) - 1, length - 1 : length]
        tau = float(replay_tau(column, calibration.spans)[0])
        draft = costs.static_draft([1] * length)
        chains.append({"chain_length": length, **model.predict(tau, draft, length + 1, length - 1)})
    chain = max(chains, key=lambda r: r["tokens_per_s"])
    static_tree = choose_static(calibration, model) if calibration.static is not None else None
    return ShapeChoice(sweep[0], chain, model.ar_tokens_per_s, sweep, static_tree)


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
        widths = [w for w in widths if w]
        row = model.predict(tau, model.costs.static_draft(widths), n + 1, len(widths) - 1)
        if best is None or row["tokens_per_s"] > best["tokens_per_s"]:
            best = {"tree_paths": [list(shape.paths[i + 1]) for i in sorted(kept)], "nodes": n + 1, **row}
    return best


def no_shape_pays(choice: ShapeChoice) -> str | None:
    """One line when the fastest predicted shape of every method (EAGLE-2, chain, static tree) is no faster
    than plain decoding: its prediction against ar's, and the tau or round time it would need to break even
    (tokens/s = tau / round time). None when a shape is predicted to pay."""
    best = max(
        filter(None, (choice.dynamic_tree, choice.chain, choice.static_tree)), key=lambda r: r["tokens_per_s"]
    )
    ar = choice.ar_tokens_per_s
    if best["tokens_per_s"] > ar:
        return None
    round_s = sum(best["round_s"].values())
    if "chain_length" in best:
        name = f"a chain of {best['chain_length']}"
    elif "tree_paths" in best:
        name = f"a static tree of {best['nodes']} nodes"
    else:
        name = f"EAGLE-2 depth {best['depth']} top_k {best['top_k']} total_tokens {best['total_tokens']}"
    return (
        f"no shape is predicted to beat plain decoding: the fastest, {name}, {best['tokens_per_s']:.1f} tokens/s "
        f"against ar's {ar:.1f} ({best['tokens_per_s'] / ar:.2f}x); to break even its tau would have to reach "
        f"{ar * round_s:.2f} (predicted {best['tau']:.2f}) or its round take {best['tau'] / ar * 1e3:.1f} ms "
        f"(predicted {round_s * 1e3:.1f}): on this machine, serve without this head"
    )


def race_candidates(sweep: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """The best predicted shape of each of the `n` fastest predicted (depth, top_k) pairs (`sweep` is
    fastest first): shapes that differ by a node or two are the same tree to a timer, so the race spends
    its time on trees that really differ."""
    best: dict[tuple[int, int], dict[str, Any]] = {}
    for row in sweep:
        best.setdefault((row["depth"], row["top_k"]), row)
        if len(best) == n:
            break
    return list(best.values())


def race_shapes(
    target,
    head,
    prompts: list[list[int]],
    candidates: list[dict[str, Any]],
    max_new_tokens: int,
    repeats: int = 3,
    lean: bool = True,
) -> list[dict[str, Any]]:
    """Decode every prompt with every candidate EAGLE-2 shape (greedy, the real decoder), `repeats` times
    round-robin, each pass starting at another candidate, so the load of the moment falls on all alike.
    Per candidate: the median seconds per prompt (the prefill left out: it is the same for every shape),
    summed; measured tokens/s = tokens / those seconds. Returns the candidates with `race_tokens_per_s`,
    `race_tau` and `race_s` added, fastest measured first."""
    decoders = [
        dynamic_tree_decoder(target, head, (c["depth"], c["top_k"], c["total_tokens"]), max_new_tokens, lean)
        for c in candidates
    ]
    seconds, tokens, rounds = [0.0] * len(decoders), [0] * len(decoders), [[0, 0] for _ in decoders]
    for i, prompt in enumerate(prompts):
        times: list[list[float]] = [[] for _ in decoders]
        for r, order in enumerate(pass_orders(len(decoders), i, repeats)):
            for j in order:
                stats = decoders[j].generate(prompt).stats
                times[j].append(stats.time_total - stats.time_prefill)
                if r == 0:
                    tokens[j] += max(stats.new_tokens - 1, 0)  # the first token comes from the prefill
                    rounds[j][0] += stats.rounds
                    rounds[j][1] += sum(a + 1 for a in stats.accepted_per_round)
        for j, t in enumerate(times):
            seconds[j] += median_pass(t)
    out = [
        {
            **c,
            "race_s": s,
            "race_tokens_per_s": n / s if s > 0 else 0.0,
            "race_tau": emitted / count if count else 1.0,
        }
        for c, s, n, (count, emitted) in zip(candidates, seconds, tokens, rounds, strict=True)
    ]
    return sorted(out, key=lambda r: -r["race_tokens_per_s"])


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
    race: int = 4,
    race_repeats: int = 3,
    budget: Budget | None = None,
    decisive: float | None = None,
) -> tuple[ShapeChoice, CostCurves, dict[str, Any]]:
    """Calibrate on `prompts` (decoded greedily here), measure (or reuse from `cache_dir`) the cost
    curves at their context length, and choose (the static tree too when `static_base` is given: its
    candidates are `auto_tree_paths(static_base)`); then, when `race` > 1, time the best predicted shape of
    the `race` fastest (depth, top_k) pairs on the same prompts (`race_shapes`) and keep the fastest
    measured as the EAGLE-2 choice, unless no shape is predicted to pay (`no_shape_pays`), the fastest
    predicted pair beats the next by the factor `decisive` or more, or the race does not fit what is left
    of `budget` (autotune.budget: every part but the cost curves within its share of the evaluation).
    Returns (choice, costs, what it took)."""
    if getattr(head, "drafts_block", False):  # its replay and cost curves assume a draft forward per depth
        raise InputError(
            f"decode.shape=auto does not tune a {head.kind} head's chain yet: give decode.chain_length=K "
            f"(K <= {head.block_size - 1}, its block's mask slots)"
        )
    budget = budget or Budget(None)
    start = time.perf_counter()
    sequences = greedy_sequences(target, prompts, max_new_tokens, lookahead=max_depth + 1, budget=budget)
    sequences_s = time.perf_counter() - start
    static = auto_tree_paths(static_base, max_depth) if static_base is not None else None
    calibration = calibrate(
        target,
        head,
        sequences,
        max_new_tokens,
        max_depth,
        max_k,
        max_nodes,
        lean,
        static,
        deadline=budget.deadline("calibration") if budget.bounded else None,
    )
    calibrate_s = time.perf_counter() - start
    context = context_bucket(prompts, max_new_tokens, target.max_len - max_nodes - 1)
    key = cost_key(target, head, context, max_nodes, max_depth, max_k, repeats)
    costs_start = time.perf_counter()
    costs, reused = cached_costs(
        cache_dir, key, lambda: measure_costs(target, head, context, max_nodes, max_depth, max_k, repeats)
    )
    budget.start += time.perf_counter() - costs_start  # the curves are cached per machine: not in the budget
    phases_start = time.perf_counter()
    probe_tokens = budget.probe_tokens(1 + len(PROBE_SHAPES), max_new_tokens)
    model = measure_phases(
        target,
        head,
        sequences,
        costs,
        probe_tokens,
        lean=lean,
        deadline=budget.deadline("phases") if budget.bounded else None,
    )
    phases_s = time.perf_counter() - phases_start
    choice = choose_shapes(calibration, model)
    choice.verdict = no_shape_pays(choice)
    race_start = time.perf_counter()
    race_note = None
    if race > 1 and choice.verdict is None:  # nothing pays: no race among shapes that lose
        candidates = race_candidates(choice.sweep, race)
        plan = race_plan(candidates, len(sequences), race_repeats, max_new_tokens, budget.left())
        if len(candidates) < 2:
            race_note = "one depth / top_k pair: nothing to race"
        elif decisive and candidates[0]["tokens_per_s"] >= decisive * candidates[1]["tokens_per_s"]:
            race_note = (
                f"decisive: the fastest predicted pair, {candidates[0]['tokens_per_s']:.1f} tokens/s, is "
                f"{candidates[0]['tokens_per_s'] / candidates[1]['tokens_per_s']:.2f}x the next"
            )
        elif plan is None:
            race_note = f"not raced: two shapes on one prompt do not fit the {budget.left():.1f} s left"
        else:
            n, p, r = plan
            race_prompts = [s[0] for s in sequences[:p]]
            choice.race = race_shapes(target, head, race_prompts, candidates[:n], max_new_tokens, r, lean)
            choice.dynamic_tree = {k: v for k, v in choice.race[0].items() if not k.startswith("race_")}
            race_note = f"{n} shapes x {p} prompts x {r} passes"
    info = {
        "calibration_prompts": len(sequences),
        "calibration_rounds_positions": sum(hi - lo for lo, hi in calibration.spans),
        "sequences_s": sequences_s,
        "calibration_s": calibrate_s,
        "context": context,
        "costs_s": costs.seconds,
        "costs_reused": reused,
        "costs_file": str(cache_path(cache_dir, key)),
        "phases_s": phases_s,
        "probe_tokens": probe_tokens,
        "race_s": time.perf_counter() - race_start,
        "race_note": race_note,
        "budget": budget.to_dict(),
        "round_model": {
            "draft_fixed_s": model.draft_fixed,
            "draft_scale": model.draft_scale,
            "verify_fixed_s": model.verify_fixed,
            "verify_scale": model.verify_scale,
            "other_s": model.other_s,
            "ar_token_s": model.ar_token_s,
        },
    }
    return choice, costs, info
