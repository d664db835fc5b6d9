"""The report's tree-shape section (decode.shape=auto): what was chosen, predicted against measured, the
predicted sweep and the measured cost curves (`cost_curves.png`). Pure functions over the tuning records
of the evaluate stage (`eagle_train.evaluate.tune_bench`) and the report's summary rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle_train.report.results import save_figure

SWEEP_ROWS = 5  # fastest predicted shapes listed per benchmark


def _label(method: str, fields: dict[str, int]) -> str:
    if method == "dynamic_tree":
        return f"depth {fields['depth']} / top_k {fields['top_k']} / {fields['total_tokens']} tokens"
    if method == "static_tree":
        return f"{len(fields['tree_paths']) + 1} nodes, depth {max(len(p) for p in fields['tree_paths'])}"
    return f"{fields['chain_length']} drafts"


def shape_rows(tuning: dict[str, dict], rows: list[dict]) -> list[dict[str, Any]]:
    """Per (bench, auto method): the chosen shape, predicted and measured tau, tokens/s and speedup."""
    measured = {(r["bench"], r["method"]): r for r in rows}
    out = []
    for bench, tuned in tuning.items():
        choice = tuned["choice"]
        for method, fields in tuned["methods"].items():
            predicted, row = choice[method], measured.get((bench, method), {})
            out.append(
                {
                    "bench": bench,
                    "method": method,
                    "shape": fields,
                    "predicted_tau": predicted["tau"],
                    "measured_tau": row.get("tau"),
                    "predicted_tokens_per_s": predicted["tokens_per_s"],
                    "measured_tokens_per_s": row.get("tokens_per_s"),
                    "predicted_speedup": predicted["tokens_per_s"] / choice["ar_tokens_per_s"],
                    "measured_speedup": row.get("speedup"),
                    "predicted_round_ms": {k: v * 1e3 for k, v in predicted["round_s"].items()},
                }
            )
    return out


def _f(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def shape_markdown(tuning: dict[str, dict], table: list[dict], threads: str | None = None) -> str:
    """The section's Markdown: the chosen shapes against the measured run, then per benchmark the fastest
    predicted EAGLE-2 shapes and how the prediction was made."""
    lines = ["## Tree shapes (decode.shape=auto)", ""]
    if threads:
        lines += [f"- threads: {threads}", ""]
    head = "| bench | method | chosen | tau predicted / measured | tokens/s predicted / measured | speedup predicted / measured | predicted ms per round (draft / verify / other) |"
    lines += [head, "|---|---|---|---|---|---|---|"]
    for r in table:
        ms = r["predicted_round_ms"]
        lines.append(
            f"| {r['bench']} | {r['method']} | {_label(r['method'], r['shape'])} | "
            f"{_f(r['predicted_tau'])} / {_f(r['measured_tau'])} | "
            f"{_f(r['predicted_tokens_per_s'], '.1f')} / {_f(r['measured_tokens_per_s'], '.1f')} | "
            f"{_f(r['predicted_speedup'])}x / {_f(r['measured_speedup'])}x | "
            f"{ms['draft']:.2f} / {ms['verify']:.2f} / {ms['other']:.2f} |"
        )
    for bench, tuned in tuning.items():
        info, choice = tuned["info"], tuned["choice"]
        model = info["round_model"]
        source = "held-out questions" if info["held_out"] else "evaluated questions (none held out)"
        if choice.get("verdict"):
            lines += ["", f"**{bench}: {choice['verdict']}.**"]
        lines += [
            "",
            f"{bench}: calibrated on {info['calibration_prompts']} {source} ({info['tokens']} tokens each, "
            f"{info['calibration_rounds_positions']} root positions, {info['calibration_s']:.1f} s); costs at "
            f"context {info['context']} {'reused from' if info['costs_reused'] else 'measured into'} "
            f"{Path(info['costs_file']).name} ({info['costs_s']:.1f} s); fitted to the real decoder's "
            f"phases on the calibration prompts: draft {model['draft_fixed_s'] * 1e3:.2f} ms + "
            f"x{model['draft_scale']:.2f}, verify {model['verify_fixed_s'] * 1e3:.2f} ms + "
            f"x{model['verify_scale']:.2f}, other {model['other_s'] * 1e3:.2f} ms per round. "
            f"{choice['shapes_predicted']} EAGLE-2 shapes predicted; the fastest:",
            "",
            "| depth | top_k | total_tokens | predicted tau | predicted tokens/s |",
            "|---|---|---|---|---|",
        ]
        budget = budget_line(info)
        for r in choice["sweep"][:SWEEP_ROWS]:
            lines.append(
                f"| {r['depth']} | {r['top_k']} | {r['total_tokens']} | {r['tau']:.2f} | {r['tokens_per_s']:.1f} |"
            )
        if budget:
            lines += ["", budget]
        if choice.get("race"):
            lines += [
                "",
                f"Then the best predicted shape of the {len(choice['race'])} fastest predicted depth / top_k "
                f"pairs, timed side by side on the calibration prompts ({info.get('race_s', 0.0):.1f} s); "
                "the fastest measured is the choice:",
                "",
                "| depth | top_k | total_tokens | predicted tokens/s | measured tau | measured tokens/s |",
                "|---|---|---|---|---|---|",
            ]
            for r in choice["race"]:
                lines.append(
                    f"| {r['depth']} | {r['top_k']} | {r['total_tokens']} | {r['tokens_per_s']:.1f} | "
                    f"{r['race_tau']:.2f} | {r['race_tokens_per_s']:.1f} |"
                )
    return "\n".join(lines)


def tuning_seconds(info: dict) -> float:
    """What a benchmark's tuning took, the cost curves left out (cached per machine): greedy calibration
    decoding and replay, the real decoder's phases, the race."""
    return info["calibration_s"] + info.get("phases_s", 0.0) + info.get("race_s", 0.0)


def budget_line(info: dict) -> str | None:
    """One line: the tuning's seconds against the evaluation it served (measured), and its budget
    (autotune.budget); None for records without a budget."""
    budget = info.get("budget")
    if not budget:
        return None
    spent = tuning_seconds(info)
    parts = (
        f"tuning {spent:.1f} s (greedy decoding {info.get('sequences_s', 0.0):.1f}, replay "
        f"{info['calibration_s'] - info.get('sequences_s', 0.0):.1f}, phases {info.get('phases_s', 0.0):.1f}, "
        f"race {info.get('race_s', 0.0):.1f})"
    )
    if budget.get("eval_s"):
        parts += f", {spent / budget['eval_s']:.0%} of this benchmark's evaluation ({budget['eval_s']:.1f} s)"
    if budget.get("budget_s") is not None:
        parts += (
            f"; budget {budget['share']:.0%} of an estimated {budget['eval_estimate_s']:.1f} s = "
            f"{budget['budget_s']:.1f} s"
        )
    else:
        parts += "; unbounded (tune_share=null)"
    if info.get("race_note"):
        parts += f"; race: {info['race_note']}"
    return parts + "."


def plot_costs(tuning: dict[str, dict], out: Path) -> Path:
    """cost_curves.png: per benchmark, the verification time by tree tokens, the EAGLE-2 drafting time by
    top_k (a line per depth) and the predicted tokens/s of the chosen depth / top_k by total_tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(tuning), 3, figsize=(13.5, 3.5 * len(tuning)), squeeze=False)
    for row, (bench, tuned) in zip(axes, tuning.items(), strict=True):
        costs, chosen = tuned["costs"], tuned["choice"]["dynamic_tree"]
        verify = [s * 1e3 for s in costs["verify_s"]]
        row[0].plot(range(1, len(verify) + 1), verify, marker=".")
        row[0].axvline(chosen["total_tokens"], color="gray", linestyle="--", linewidth=1)
        row[0].set(
            title=f"{bench}: verification (context {costs['key']['context']})",
            xlabel="tree tokens",
            ylabel="ms",
        )
        expand = costs["expand_s"]
        for depth in sorted({1, 2, 4, len(expand)} & set(range(1, len(expand) + 1))):
            values = [s * 1e3 for s in expand[depth - 1]]
            row[1].plot(range(1, len(values) + 1), values, marker=".", label=f"depth {depth}")
        row[1].set(title="EAGLE-2 drafting", xlabel="top_k", ylabel="ms")
        row[1].legend(fontsize=8)
        totals, speed = zip(*tuned["curve"], strict=True) if tuned["curve"] else ((), ())
        row[2].plot(totals, speed, marker=".")
        row[2].axhline(
            tuned["choice"]["ar_tokens_per_s"], color="gray", linestyle="--", linewidth=1, label="ar"
        )
        row[2].set(
            title=f"predicted, depth {chosen['depth']} / top_k {chosen['top_k']}",
            xlabel="total_tokens",
            ylabel="tokens/s",
        )
        row[2].legend(fontsize=8)
    fig.tight_layout()
    return save_figure(plt, fig, out / "cost_curves.png")


def shape_section(
    tuning: dict[str, dict], rows: list[dict], out: Path, plots: bool = True, threads: str | None = None
) -> dict[str, Any]:
    """{rows, markdown, plots, tuning}: the section for write_report (`shapes=`)."""
    table = shape_rows(tuning, rows)
    return {
        "rows": table,
        "markdown": shape_markdown(tuning, table, threads),
        "plots": [plot_costs(tuning, Path(out))] if plots else [],
        "tuning": {b: {k: v for k, v in t.items() if k != "costs"} for b, t in tuning.items()},
    }
