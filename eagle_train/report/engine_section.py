"""The report's engine section: the built-in decoder and a serving engine (vLLM) side by side on the same
prompt token ids, pure functions over answer records plus one plot.

An engine record (one line of engine_answers.jsonl) is one turn of one question decoded by an engine:

    bench, question_id, turn, engine ("vllm"), method ("ar": no speculation | "chain": K draft tokens)
    new_tokens, wall_s, tokens            the answer and its decode time (batch size 1)
    spec: {num_drafts, num_draft_tokens, num_accepted_tokens, accepted_per_pos}   the engine's own counters

The built-in side is the evaluation's own `chain` and `ar` records. A difference in the counters (exact:
integer counts, no tolerance), a lossy engine (its speculative answers differ from its plain ones), or
answers that differ between the engines go into the report's sanity section.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle_train.decoding.stats import counts_acceptance, counts_tau
from eagle_train.report.results import BASELINE, _bench_axes, _fmt, save_figure, spec_counts

BUILTIN = "builtin"
SPECULATIVE = "chain"


def _tokens_per_s(records: list[dict]) -> float | None:
    wall = sum(r["wall_s"] for r in records)
    return sum(r["new_tokens"] for r in records) / wall if wall > 0 else None


def _key(r: dict) -> tuple:
    return r["bench"], r["question_id"], r["turn"]


def engine_row(bench: str, engine: str, records: list[dict], builtin_chain: list[dict]) -> dict[str, Any]:
    """Figures of one (bench, engine): counters, tau, acceptance, tokens/s with and without speculation."""
    spec = [r for r in records if r["method"] == SPECULATIVE]
    plain = {_key(r): r["tokens"] for r in records if r["method"] == BASELINE}
    counts = spec_counts(spec)
    with_plain = [r for r in spec if _key(r) in plain]
    speculative, base = _tokens_per_s(spec), _tokens_per_s([r for r in records if r["method"] == BASELINE])
    builtin = {_key(r): r["tokens"] for r in builtin_chain}
    same = [r["tokens"] == builtin[_key(r)] for r in spec if _key(r) in builtin] if engine != BUILTIN else []
    return {
        "bench": bench,
        "engine": engine,
        "answers": len(spec),
        "counts": counts,
        "tau": counts_tau(counts),
        "acceptance_by_position": counts_acceptance(counts),
        "tokens_per_s": speculative,
        "plain_tokens_per_s": base,
        "speedup": speculative / base if speculative and base else None,
        "identical": sum(r["tokens"] == plain[_key(r)] for r in with_plain),
        "identity_checked": len(with_plain),
        "same_as_builtin": sum(same) if same else None,
        "compared_with_builtin": len(same),
    }


def engine_rows(records: list[dict], engine_records: list[dict]) -> list[dict[str, Any]]:
    """One row per (bench, engine), the built-in decoder first."""
    rows = []
    for bench in dict.fromkeys(r["bench"] for r in engine_records):
        mine = [r for r in records if r["bench"] == bench and r["method"] in (BASELINE, SPECULATIVE)]
        chain = [r for r in mine if r["method"] == SPECULATIVE]
        rows.append(engine_row(bench, BUILTIN, mine, chain))
        for engine in dict.fromkeys(r["engine"] for r in engine_records):
            theirs = [r for r in engine_records if r["bench"] == bench and r["engine"] == engine]
            rows.append(engine_row(bench, engine, theirs, chain))
    return rows


def engine_sanity(rows: list[dict]) -> list[str]:
    """Disagreements between the engines, and an engine that is not lossless."""
    notes = []
    builtin = {r["bench"]: r for r in rows if r["engine"] == BUILTIN}
    for row in (r for r in rows if r["engine"] != BUILTIN):
        name, ours = f"{row['bench']}/{row['engine']}", builtin[row["bench"]]
        if row["counts"] != ours["counts"]:
            notes.append(
                f"{name}: the engine's acceptance (tau {_fmt(row['tau'], '.4f')}, accepted per position "
                f"{row['counts']['accepted_per_pos']} of {row['counts']['num_drafts']} drafts) differs from the "
                f"built-in chain decoder's (tau {_fmt(ours['tau'], '.4f')}, {ours['counts']['accepted_per_pos']} "
                f"of {ours['counts']['num_drafts']}) on the same prompts: the head does not run in the engine "
                "as it was evaluated here"
            )
        if row["identical"] < row["identity_checked"]:
            notes.append(
                f"{name}: {row['identity_checked'] - row['identical']} of {row['identity_checked']} greedy "
                "answers with speculation differ from the engine's answers without it"
            )
        if row["same_as_builtin"] is not None and row["same_as_builtin"] < row["compared_with_builtin"]:
            notes.append(
                f"{name}: {row['compared_with_builtin'] - row['same_as_builtin']} of "
                f"{row['compared_with_builtin']} answers differ from the built-in decoder's"
            )
    return notes


def engines_markdown(rows: list[dict], num_tokens: int) -> str:
    """The side-by-side table: one column per engine, one line per figure and benchmark."""
    engines = list(dict.fromkeys(r["engine"] for r in rows))
    depth = max((len(r["acceptance_by_position"]) for r in rows), default=0)
    lines = [
        f"## Engines (the same prompt token ids; chain of {num_tokens} draft tokens, greedy)",
        "",
        "| bench | figure | " + " | ".join(engines) + " |",
        "|---|---|" + "---|" * len(engines),
    ]
    for bench in dict.fromkeys(r["bench"] for r in rows):
        by = {r["engine"]: r for r in rows if r["bench"] == bench}
        figures = [("tau", lambda r: _fmt(r["tau"], ".4f"))]
        figures += [
            (
                f"acc@{k + 1}",
                lambda r, k=k: (
                    _fmt(r["acceptance_by_position"][k], ".3f")
                    if k < len(r["acceptance_by_position"])
                    else "-"
                ),
            )
            for k in range(depth)
        ]
        figures += [
            (
                "accepted / draft tokens / drafts",
                lambda r: "{num_accepted_tokens} / {num_draft_tokens} / {num_drafts}".format(**r["counts"]),
            ),
            ("tokens/s speculative", lambda r: _fmt(r["tokens_per_s"], ".1f")),
            ("tokens/s plain", lambda r: _fmt(r["plain_tokens_per_s"], ".1f")),
            ("speedup", lambda r: _fmt(r["speedup"]) + ("x" if r["speedup"] else "")),
            ("greedy identical (speculative = plain)", lambda r: f"{r['identical']}/{r['identity_checked']}"),
            (
                "answers = built-in's",
                lambda r: (
                    "-"
                    if r["same_as_builtin"] is None
                    else f"{r['same_as_builtin']}/{r['compared_with_builtin']}"
                ),
            ),
        ]
        for label, cell in figures:
            lines.append(
                f"| {bench} | {label} | "
                + " | ".join(cell(by[e]) if e in by else "-" for e in engines)
                + " |"
            )
    lines += [
        "",
        "Counters as vLLM keeps them (spec_decode_num_drafts, _num_draft_tokens, _num_accepted_tokens, "
        "_per_pos); the built-in figures are the `chain` method's. tokens/s: one prompt at a time in each engine.",
    ]
    return "\n".join(lines)


def plot_engine_acceptance(rows: list[dict], out: Path) -> Path:
    """acceptance_by_position_engines.png: conditional acceptance by draft position, one line per engine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    benches = list(dict.fromkeys(r["bench"] for r in rows))
    fig, axes = _bench_axes(plt, len(benches))
    for ax, bench in zip(axes, benches, strict=True):
        for row in (r for r in rows if r["bench"] == bench):
            acc = row["acceptance_by_position"]
            ax.plot(
                range(1, len(acc) + 1),
                [float("nan") if a is None else a for a in acc],
                marker="o",
                linestyle="-" if row["engine"] == BUILTIN else "--",
                label=row["engine"],
            )
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set(
            title=bench,
            xlabel="draft position",
            ylabel="acceptance rate (given the earlier ones)",
            ylim=(0, 1.05),
        )
        ax.legend(fontsize=8)
    return save_figure(plt, fig, out / "acceptance_by_position_engines.png")


def engine_section(
    records: list[dict], engine_records: list[dict], out: Path, num_tokens: int, plots: bool = True
) -> dict[str, Any]:
    """What `report.write_report(engines=...)` adds: rows, the Markdown table, sanity notes, the plot."""
    rows = engine_rows(records, engine_records)
    return {
        "rows": rows,
        "markdown": engines_markdown(rows, num_tokens),
        "sanity": engine_sanity(rows),
        "plots": [plot_engine_acceptance(rows, out)] if plots else [],
    }
