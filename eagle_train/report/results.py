"""Evaluation reports: pure functions over answer records, a Markdown/JSON writer and PNG plots.

An answer record (one line of answers.jsonl) is one turn of one question decoded by one method:

    bench, method, question_id, turn       which answer
    new_tokens, wall_s                     generated tokens and decode time (prompt encoding included)
    accept_lengths: [int]                  tokens produced per target forward (accepted drafts + 1)
    draft_depths: [int]                    per round, the deepest draft node offered (0 for ar)
    confidence: [[float, 0|1]]             draft confidence (given its parent) of each draft token whose
                                           parent was accepted, and whether it was accepted itself
    tokens: [int], identical: bool|None    the answer, and (greedy) whether it equals ar's answer
    divergence: {kind, index, gap, ulp}    (a differing greedy answer) near_tie or divergence at its first
                                           differing token (eagle_train.decoding.identity)
    identity: "prompt_differs"             (greedy, not compared) an earlier turn parted from ar's
    model_check: {kind, index, ...}        (greedy) whether every token is the model's own choice by its
                                           teacher-forced cache-free forward: identical / near_tie / divergence

tau = mean accepted tokens per round (accepted + 1), over all rounds of a (bench, method). Acceptance at
position k = P(draft token k accepted | tokens 1..k-1 accepted), over rounds that drafted k tokens.
Speedup = the method's tokens/s over the faster of ar's and hf's (HF generate) on the same benchmark, in the
same run.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from eagle_train.config.decode import PLAIN_METHODS
from eagle_train.decoding.stats import (
    acceptance_by_position,
    mean_accept_length,
)
from eagle_train.runtime.atomic_files import atomic_path, atomic_write_json, atomic_write_text

BASELINE = "ar"
CALIBRATION_BINS = 10


def group_records(records: Iterable[dict]) -> dict[tuple[str, str], list[dict]]:
    """Records grouped by (bench, method), in first-seen order."""
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["bench"], r["method"])].append(r)
    return dict(groups)


def rounds_acceptance(records: list[dict]) -> list[float | None]:
    """Acceptance by position over every round of these records (eagle_train.decoding.stats)."""
    rounds = [
        (length - 1, depth)
        for r in records
        for length, depth in zip(r.get("accept_lengths", []), r.get("draft_depths", []), strict=True)
    ]
    return acceptance_by_position([a for a, _ in rounds], [d for _, d in rounds])


def add_spec_counts(total: dict[str, Any], more: dict[str, Any], sign: int = 1) -> dict[str, Any]:
    """total + sign * more, field by field (accepted_per_pos padded to the longer list)."""
    out = {k: total[k] + sign * more[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    a, b = list(total["accepted_per_pos"]), list(more["accepted_per_pos"])
    width = max(len(a), len(b))
    a, b = a + [0] * (width - len(a)), b + [0] * (width - len(b))
    out["accepted_per_pos"] = [x + sign * y for x, y in zip(a, b, strict=True)]
    return out


def spec_counts(records: Iterable[dict]) -> dict[str, Any]:
    """Speculative-decoding counters as vLLM keeps them: drafts (rounds that drafted), draft tokens,
    accepted draft tokens, and per position k the drafts whose token k was accepted (not conditional).
    A record carries vLLM's own counters (`spec`) or the built-in decoder's rounds (accept_lengths, draft_depths)."""
    total: dict[str, Any] = {
        "num_drafts": 0,
        "num_draft_tokens": 0,
        "num_accepted_tokens": 0,
        "accepted_per_pos": [],
    }
    for r in records:
        if "spec" in r:
            total = add_spec_counts(total, r["spec"])
            continue
        for length, depth in zip(r.get("accept_lengths", []), r.get("draft_depths", []), strict=True):
            if depth == 0:  # a plain decoding step, no draft
                continue
            per_pos = [1] * (length - 1) + [0] * (depth - length + 1)
            total = add_spec_counts(
                total,
                {
                    "num_drafts": 1,
                    "num_draft_tokens": depth,
                    "num_accepted_tokens": length - 1,
                    "accepted_per_pos": per_pos,
                },
            )
    return total


def calibration(records: list[dict], bins: int = CALIBRATION_BINS) -> list[dict[str, float]]:
    """Draft confidence binned into `bins` equal bins: mean confidence, acceptance rate and count per bin."""
    sums = [[0.0, 0.0, 0] for _ in range(bins)]  # [confidence sum, accepted count, n]
    for r in records:
        for conf, ok in r.get("confidence", []):
            b = min(int(conf * bins), bins - 1)
            sums[b][0] += conf
            sums[b][1] += float(ok)
            sums[b][2] += 1
    return [
        {
            "bin_low": i / bins,
            "bin_high": (i + 1) / bins,
            "confidence": s / n,
            "accept_rate": a / n,
            "count": n,
        }
        for i, (s, a, n) in enumerate(sums)
        if n
    ]


def summarize_group(records: list[dict]) -> dict[str, Any]:
    """Figures of one (bench, method): tau, acceptance by position, tokens/s, identity count."""
    lengths = [x for r in records for x in r.get("accept_lengths", [])]  # one per round
    new_tokens = sum(r["new_tokens"] for r in records)
    wall = sum(r["wall_s"] for r in records)
    checked = [r["identical"] for r in records if r.get("identical") is not None]
    near_ties = sum(1 for r in records if r.get("identical") is False and _divergence_kind(r) == "near_tie")
    model = [r["model_check"]["kind"] for r in records if r.get("model_check")]
    return {
        "bench": records[0]["bench"],
        "method": records[0]["method"],
        "answers": len(records),
        "questions": len({r["question_id"] for r in records}),
        "rounds": len(lengths),
        "new_tokens": new_tokens,
        "wall_s": wall,
        "tau": mean_accept_length(lengths),
        "tokens_per_s": new_tokens / wall if wall > 0 else None,
        "acceptance_by_position": rounds_acceptance(records),
        "identical": sum(checked) if checked else None,
        "identity_checked": len(checked),
        "near_ties": near_ties,  # differing answers whose first differing token is a near-tie
        "divergences": len(checked) - sum(checked) - near_ties,  # every other differing answer
        "identity_not_comparable": sum(1 for r in records if r.get("identity") == "prompt_differs"),
        # against the model's own teacher-forced forward (decoding.identity.check_against_model)
        "model_checked": len(model),
        "model_identical": sum(1 for kind in model if kind == "identical"),
        "model_near_ties": sum(1 for kind in model if kind == "near_tie"),
        "model_divergences": sum(1 for kind in model if kind == "divergence"),
        "prompts_cut": sum(1 for r in records if r.get("prompt_cut")),
    }


def _divergence_kind(record: dict) -> str | None:
    return (record.get("divergence") or {}).get("kind")


def summarize(records: list[dict]) -> list[dict[str, Any]]:
    """One summary row per (bench, method), with its speedup over the same benchmark's fastest plain decoding:
    the faster of ar and hf (HF generate) where both ran (`speedup_over` names it)."""
    rows = [summarize_group(group) for group in group_records(records).values()]
    plain: dict[str, tuple[float, str]] = {}
    for r in rows:
        if (
            r["method"] in PLAIN_METHODS
            and r["tokens_per_s"]
            and r["tokens_per_s"] > plain.get(r["bench"], (0,))[0]
        ):
            plain[r["bench"]] = (r["tokens_per_s"], r["method"])
    for row in rows:
        base, over = plain.get(row["bench"], (None, None))
        row["speedup"] = row["tokens_per_s"] / base if base and row["tokens_per_s"] else None
        row["speedup_over"] = over if row["speedup"] is not None else None
    return rows


def sanity_checks(rows: list[dict], min_rounds: int, greedy: bool) -> list[str]:
    """Reasons the figures cannot be trusted (empty list = none found)."""
    notes = []
    for row in rows:
        name = f"{row['bench']}/{row['method']}"
        if row["method"] != BASELINE and row["rounds"] < min_rounds:
            notes.append(
                f"{name}: only {row['rounds']} rounds (< {min_rounds}): tau and acceptance are noisy"
            )
        unchecked = row["answers"] - row["identity_checked"] - row.get("identity_not_comparable", 0)
        if greedy and row["method"] != BASELINE and unchecked > 0:
            notes.append(f"{name}: {unchecked} answers had no ar baseline to compare")
        if greedy and row["identical"] is not None and row.get("divergences", 0) > 0:
            notes.append(
                f"{name}: {row['divergences']} of {row['identity_checked']} greedy answers differ from ar "
                "other than at a near-tie: the decoder is not lossless here"
            )
        if row.get("model_divergences"):
            notes.append(
                f"{name}: {row['model_divergences']} of {row['model_checked']} greedy answers are not what the "
                "model itself chooses (its teacher-forced, cache-free forward) other than at a near-tie: the "
                "decode-time forward does not compute this model"
            )
        if row["method"] not in PLAIN_METHODS and row["speedup"] is None:
            notes.append(f"{name}: no plain decoding (ar or hf) in this run, so no speedup")
        if row.get("prompts_cut"):
            notes.append(
                f"{name}: {row['prompts_cut']} prompts were longer than the context allows and were cut"
            )
        if row["tau"] is not None and row["tau"] < 1.0:
            notes.append(f"{name}: tau {row['tau']:.2f} < 1 is impossible: the round statistics are wrong")
    return notes + slow_baseline_notes(rows)


def slow_baseline_notes(rows: list[dict]) -> list[str]:
    """A bench where HF generate (`hf`) decodes faster than the ar baseline (e.g. ar on sdpa, hf on
    flash_attention_2): the speedups are then over hf, and the report says by how much ar is behind it."""
    speed = {(r["bench"], r["method"]): r["tokens_per_s"] for r in rows}
    notes = []
    for (bench, method), hf in speed.items():
        ar = speed.get((bench, BASELINE))
        if method == "hf" and hf and ar and hf > 1.05 * ar:
            notes.append(
                f"{bench}: hf (HF generate) decodes at {hf / ar:.2f}x ar's tokens/s: ar is not the target's "
                "fastest plain decoding here, so every speedup is over hf"
            )
    return notes


def identity_lines(rows: list[dict], meta: dict[str, Any]) -> list[str]:
    """Greedy identity per (bench, method): identical, near-tie and real-divergence counts (the contract:
    eagle_train.decoding.identity). Empty when sampling."""
    if float(meta.get("temperature", 0.0)) != 0.0:
        return []
    ulps, dtype = meta.get("near_tie_ulps", "a few"), meta.get("target_dtype", "the target's dtype")
    lines = []
    for row in rows:
        if row.get("model_checked"):
            lines.append(
                f"{row['bench']}/{row['method']}: vs the model's own forward (teacher-forced, cache-free): "
                f"{row['model_identical']} identical, {row['model_near_ties']} near-tie, "
                f"{row['model_divergences']} real divergence, of {row['model_checked']}"
            )
        if row["method"] == BASELINE or not row["identity_checked"]:
            continue
        line = (
            f"{row['bench']}/{row['method']}: greedy identity: {row['identical']} identical, "
            f"{row['near_ties']} near-tie, {row['divergences']} real divergence, of {row['identity_checked']}"
        )
        if row.get("identity_not_comparable"):
            line += f" ({row['identity_not_comparable']} more not comparable: an earlier turn parted from ar)"
        lines.append(line)
    if any(row.get("near_ties") or row.get("model_near_ties") for row in rows):
        lines.append(
            f"near-tie: the first differing token's two candidates are within {ulps} ulps of the top logit "
            f"({dtype}): tree and one-token forwards round differently, expected below float32; only a real "
            "divergence breaks the greedy-identity promise"
        )
    return lines


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def markdown_table(rows: list[dict]) -> str:
    """The report table: one line per (bench, method)."""
    depth = max((len(r["acceptance_by_position"]) for r in rows), default=0)
    head = ["bench", "method", "answers", "rounds", "tau", "tokens/s", "speedup", "greedy identical"]
    head += [f"acc@{k}" for k in range(1, depth + 1)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        identical = "-" if r["identical"] is None else f"{r['identical']}/{r['identity_checked']}"
        if r.get("near_ties"):
            identical += f" ({r['near_ties']} near-tie)"
        acc = [_fmt(a) for a in r["acceptance_by_position"]] + ["-"] * (
            depth - len(r["acceptance_by_position"])
        )
        cells = [
            r["bench"],
            r["method"],
            str(r["answers"]),
            str(r["rounds"]),
            _fmt(r["tau"]),
            _fmt(r["tokens_per_s"], ".1f"),
            _fmt(r["speedup"]) + (f"x over {r['speedup_over']}" if r["speedup"] else ""),
            identical,
            *acc,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_markdown(
    rows: list[dict],
    notes: list[str],
    meta: dict[str, Any],
    plots: list[str],
    engines_markdown: str | None = None,
    identity: list[str] = (),
    shapes_markdown: str | None = None,
    serving_markdown: str | None = None,
) -> str:
    """report.md: run settings, the table, the engines side by side (if any), the serving sweep (if any), the
    sanity lines (warnings, then greedy identity), the plots."""
    parts = ["# Evaluation report", ""]
    parts += [f"- {k}: {v}" for k, v in meta.items()]
    parts += ["", markdown_table(rows), ""]
    parts.append(
        "tau = tokens per target forward (accepted drafts + 1); acc@k = P(draft token k accepted | 1..k-1 "
        "accepted); speedup = tokens/s over the faster of ar and hf (HF generate) on the same benchmark, timed "
        "in this run."
    )
    if shapes_markdown:
        parts += ["", shapes_markdown]
    if engines_markdown:
        parts += ["", engines_markdown]
    if serving_markdown:
        parts += ["", serving_markdown]
    parts += ["", "## Sanity", ""]
    parts += [f"- WARNING: {n}" for n in notes] or ["- all checks passed"]
    parts += [f"- {line}" for line in identity]
    if plots:
        parts += ["", "## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    return "\n".join(parts) + "\n"


def write_report(
    records: list[dict],
    out_dir: str | Path,
    meta: dict[str, Any],
    min_rounds: int = 20,
    plots: bool = True,
    engines: dict[str, Any] | None = None,
    notes: Sequence[str] = (),
    shapes: dict[str, Any] | None = None,
    serving: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write report.json, report.md and the PNG plots for `records` into `out_dir`; return the report.
    `engines`: the side-by-side engine section (`eagle_train.report.engine_section.engine_section`), if any.
    `notes`: warnings found before decoding (e.g. a head trained for another target), listed first.
    `shapes`: the tree-shape section of decode.shape=auto
    (`eagle_train.report.shape_section.shape_section`).
    `serving`: vLLM's serving benchmark by concurrency (`eagle_train.report.serving_section.serving_section`)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = summarize(records)
    greedy = float(meta.get("temperature", 0.0)) == 0.0
    sections = [s for s in (engines, shapes, serving) if s]
    notes = [
        *notes,
        *sanity_checks(rows, min_rounds, greedy),
        *(n for s in sections for n in s.get("sanity", [])),
    ]
    plot_files = write_plots(records, rows, out) if plots else []
    plot_files += [p for s in sections for p in s["plots"]]
    identity = identity_lines(rows, meta)
    calib = {m: calibration([r for r in records if r["method"] == m]) for m in {r["method"] for r in records}}
    report = {
        "meta": meta,
        "results": rows,
        "sanity": notes,
        "identity": identity,
        "calibration": calib,
        "plots": [Path(p).name for p in plot_files],
    }
    if engines:
        report["engines"] = engines["rows"]
    if shapes:
        report["shapes"] = {"chosen": shapes["rows"], "tuning": shapes["tuning"]}
    if serving:
        report["serving"] = {"setup": serving["setup"], "levels": serving["rows"]}
    atomic_write_json(out / "report.json", report, sort_keys=False)
    atomic_write_text(
        out / "report.md",
        render_markdown(
            rows,
            notes,
            meta,
            plot_files,
            engines["markdown"] if engines else None,
            identity,
            shapes["markdown"] if shapes else None,
            serving["markdown"] if serving else None,
        ),
    )
    return report


def _methods(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["method"] for r in rows))


def _benches(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["bench"] for r in rows))


def write_plots(records: list[dict], rows: list[dict], out: Path) -> list[Path]:
    """The four PNG plots; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    for name, draw in (
        ("acceptance_by_position", _plot_acceptance),
        ("tau_histogram", _plot_tau_hist),
        ("calibration", _plot_calibration),
        ("speedup", _plot_speedup),
    ):
        fig = draw(plt, records, rows)
        files.append(save_figure(plt, fig, out / f"{name}.png"))
    return files


def save_figure(plt, fig, path: Path) -> Path:
    """A matplotlib figure written to `path` as PNG (atomically, eagle_train.runtime.atomic_files) and
    closed: the one home of how the report's plots are saved."""
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def _bench_axes(plt, n: int):
    fig, axes = plt.subplots(1, n, figsize=(4.5 * n, 3.5), squeeze=False)
    return fig, axes[0]


def _plot_acceptance(plt, records: list[dict], rows: list[dict]):
    benches = _benches(rows)
    fig, axes = _bench_axes(plt, len(benches))
    for ax, bench in zip(axes, benches, strict=True):
        for row in (r for r in rows if r["bench"] == bench and r["acceptance_by_position"]):
            acc = row["acceptance_by_position"]
            ax.plot(
                range(1, len(acc) + 1),
                [float("nan") if a is None else a for a in acc],
                marker="o",
                label=row["method"],
            )
        ax.set(title=bench, xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1.05))
        ax.legend(fontsize=8)
    return fig


def _plot_tau_hist(plt, records: list[dict], rows: list[dict]):
    benches = _benches(rows)
    methods = [m for m in _methods(rows) if m != BASELINE]
    fig, axes = _bench_axes(plt, len(benches))
    for ax, bench in zip(axes, benches, strict=True):
        width = 0.8 / max(len(methods), 1)
        for i, method in enumerate(methods):
            lengths = [
                x
                for r in records
                if r["bench"] == bench and r["method"] == method
                for x in r["accept_lengths"]
            ]
            if not lengths:
                continue
            top = max(lengths)
            share = [lengths.count(k) / len(lengths) for k in range(1, top + 1)]
            ax.bar(
                [k + (i - (len(methods) - 1) / 2) * width for k in range(1, top + 1)],
                share,
                width,
                label=method,
            )
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set(title=bench, xlabel="tokens per round (accepted + 1)", ylabel="share of rounds")
        ax.legend(fontsize=8)
    return fig


def _plot_calibration(plt, records: list[dict], rows: list[dict]):
    fig, ax = plt.subplots(figsize=(4.5, 4))
    ax.plot([0, 1], [0, 1], color="gray", linestyle="--", linewidth=1, label="ideal")
    for method in _methods(rows):
        points = calibration([r for r in records if r["method"] == method])
        if points:
            ax.plot(
                [p["confidence"] for p in points],
                [p["accept_rate"] for p in points],
                marker="o",
                label=method,
            )
    ax.set(
        title="draft confidence vs acceptance",
        xlabel="draft confidence",
        ylabel="acceptance rate",
        xlim=(0, 1),
        ylim=(0, 1.05),
    )
    ax.legend(fontsize=8)
    return fig


def _plot_speedup(plt, records: list[dict], rows: list[dict]):
    benches = _benches(rows)
    methods = _methods(rows)
    fig, ax = plt.subplots(figsize=(max(4.5, 1.5 * len(benches)), 3.5))
    width = 0.8 / max(len(methods), 1)
    for i, method in enumerate(methods):
        values = [
            next((r["speedup"] or 0.0 for r in rows if r["bench"] == b and r["method"] == method), 0.0)
            for b in benches
        ]
        bars = ax.bar(
            [j + (i - (len(methods) - 1) / 2) * width for j in range(len(benches))],
            values,
            width,
            label=method,
        )
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(benches)), benches)
    ax.set(title="wall-clock speedup over ar", ylabel="speedup")
    ax.legend(fontsize=8)
    return fig
