"""The report's serving section: what a head is worth under load, from vLLM's own serving benchmark (pure
functions over its result files, plus one plot).

Each concurrency level ran `vllm bench serve` twice, on a server without the head ("plain") and on one with
it ("head"), on the same requests. vLLM writes one result JSON per run (`--save-result --save-detailed`);
every figure here is read from those files as vLLM computed it, never recomputed:

    output_throughput                     output tokens/s over the run
    mean_tpot_ms, p99_tpot_ms             time per output token after the first, per request (ms)
    mean_ttft_ms, p99_ttft_ms             time to first token (ms)
    spec_decode_acceptance_length / _rate / _per_position_acceptance_rates / _num_drafts / ...
                                          the server's spec-decode counters over the run (/metrics)
    completed, failed, duration, generated_texts, errors

speedup = the head's output_throughput / plain's, at the same concurrency in the same evaluation. Greedy
answers of the two servers are compared request by request (`compare_answers`): vLLM's benchmark keeps the
answers' text, not their token ids, so a differing pair is classified on the re-tokenized text. Servers with
vLLM's own training-free speculation (the baselines: ngram, suffix), when the sweep ran them, are read and
compared with plain the same way, in a second table: what the head is worth against what costs no training.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from eagle_train.report.results import _fmt, save_figure

PLAIN, HEAD = "plain", "head"
SERVERS = (PLAIN, HEAD)
# vLLM's result fields copied into the report for each server and level
FIELDS = (
    "completed",
    "failed",
    "duration",
    "total_output_tokens",
    "output_throughput",
    "request_throughput",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "mean_ttft_ms",
    "p99_ttft_ms",
    "mean_e2el_ms",
)
SPEC_FIELDS = (
    "spec_decode_acceptance_length",
    "spec_decode_acceptance_rate",
    "spec_decode_num_drafts",
    "spec_decode_draft_tokens",
    "spec_decode_accepted_tokens",
    "spec_decode_per_position_acceptance_rates",
)


def compare_answers(
    prompts: list[str],
    plain: dict[str, Any],
    head: dict[str, Any],
    classify: Callable[[str, str, str], dict | None] | None = None,
) -> dict[str, Any]:
    """The greedy answers of the two servers to the same requests (vLLM's detailed results, in request
    order), compared as the greedy-identity contract does (eagle_train.decoding.identity): identical,
    near-tie or real divergence; `classify(prompt, plain_text, head_text)` places a differing pair."""
    pairs = [
        (i, a, b)
        for i, (a, b, error_a, error_b) in enumerate(
            zip(
                plain["generated_texts"],
                head["generated_texts"],
                plain["errors"],
                head["errors"],
                strict=True,
            )
        )
        if not error_a and not error_b  # a failed request has no answer to compare
    ]
    differ = []
    for i, a, b in pairs:
        if a != b:
            found = classify(prompts[i], a, b) if classify else None
            differ.append({"request": i, **(found or {"kind": "unclassified"})})
    kinds = [d["kind"] for d in differ]
    return {
        "compared": len(pairs),
        "identical": len(pairs) - len(differ),
        "near_tie": kinds.count("near_tie"),
        "divergence": kinds.count("divergence"),
        "unclassified": kinds.count("unclassified"),
        "differ": differ,
    }


def _spec_counters(result: dict) -> dict[str, Any]:
    """A server's spec-decode counters, named without vLLM's `spec_decode_` prefix (absent: None)."""
    return {k.removeprefix("spec_decode_"): result.get(k) for k in SPEC_FIELDS}


def _speedup(result: dict, plain: dict) -> float | None:
    base, spec = plain.get("output_throughput"), result.get("output_throughput")
    return spec / base if spec and base else None


def serving_row(
    concurrency: int, results: dict[str, dict], identity: dict[str, dict] | None
) -> dict[str, Any]:
    """One concurrency level: each server's figures as vLLM wrote them, the head's acceptance, the speedup;
    each baseline server's figures, acceptance, speedup over plain and identity with plain under
    "baselines". `identity`: server name -> `compare_answers` with plain."""
    plain, head = results[PLAIN], results[HEAD]
    identity = identity or {}
    return {
        "concurrency": concurrency,
        "requests": (head.get("completed") or 0) + (head.get("failed") or 0),
        **{name: {k: results[name].get(k) for k in FIELDS} for name in SERVERS},
        **_spec_counters(head),
        "speedup": _speedup(head, plain),
        "identity": identity.get(HEAD),
        "baselines": {
            name: {
                **{k: result.get(k) for k in FIELDS},
                **_spec_counters(result),
                "speedup": _speedup(result, plain),
                "identity": identity.get(name),
            }
            for name, result in results.items()
            if name not in SERVERS
        },
    }


def _pair(row: dict, field: str, spec: str = ".1f") -> str:
    return f"{_fmt(row[PLAIN][field], spec)} / {_fmt(row[HEAD][field], spec)}"


def _identity_cell(identity: dict | None) -> str:
    if not identity:
        return "-"
    cell = f"{identity['identical']}/{identity['compared']}"
    extra = [
        f"{identity[k]} {k.replace('_', '-')}"
        for k in ("near_tie", "divergence", "unclassified")
        if identity[k]
    ]
    return cell + (f" ({', '.join(extra)})" if extra else "")


def _acceptance_cell(row: dict) -> str:
    rate = row["acceptance_rate"]
    return _fmt(row["acceptance_length"], ".3f") + (f" ({rate:.1f}%)" if rate is not None else "")


def baselines_markdown(rows: list[dict]) -> list[str]:
    """The second table: the head beside vLLM's own training-free speculation, level by level."""
    names = list(rows[0]["baselines"]) if rows else []
    if not names:
        return []
    lines = [
        "",
        f"The head beside vLLM's own training-free speculation ({', '.join(names)}), same requests, same levels:",
        "",
        "| concurrency | server | output tok/s | speedup over plain | TPOT mean ms | acceptance length (rate) "
        "| greedy identical to plain |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        servers = {HEAD: {**row[HEAD], **row}, **row["baselines"]}
        for name, server in servers.items():
            cells = [
                str(row["concurrency"]),
                name,
                _fmt(server["output_throughput"], ".1f"),
                _fmt(server["speedup"]) + ("x" if server["speedup"] else ""),
                _fmt(server["mean_tpot_ms"], ".2f"),
                _acceptance_cell(server),
                _identity_cell(server["identity"]),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def serving_markdown(rows: list[dict], setup: dict[str, Any]) -> str:
    """The table: one line per concurrency, plain / head side by side; then the baselines' table if any."""
    lines = [
        "## Serving under load (vLLM's serving benchmark, `vllm bench serve`)",
        "",
        *[f"- {k}: {v}" for k, v in setup.items()],
        "",
        "| concurrency | requests | output tok/s plain | output tok/s head | speedup | TPOT mean ms plain / head "
        "| TPOT p99 ms plain / head | TTFT mean ms plain / head | acceptance length (rate) | greedy identical |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        accept = _acceptance_cell(row)
        cells = [
            str(row["concurrency"]),
            str(row["requests"]),
            _fmt(row[PLAIN]["output_throughput"], ".1f"),
            _fmt(row[HEAD]["output_throughput"], ".1f"),
            _fmt(row["speedup"]) + ("x" if row["speedup"] else ""),
            _pair(row, "mean_tpot_ms", ".2f"),
            _pair(row, "p99_tpot_ms", ".2f"),
            _pair(row, "mean_ttft_ms", ".1f"),
            accept,
            _identity_cell(row["identity"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Every figure is vLLM's own, read from its result files (`--save-result --save-detailed`, listed "
        "above); speedup = output tok/s with the head / without it at the same concurrency, in this run. TPOT = "
        "time per output token after the first; acceptance length = 1 + accepted / drafts (the server's "
        "spec-decode counters over the run). Greedy identical: the two servers' answers to the same requests "
        "(text), a differing pair placed at its first differing token of the re-tokenized text "
        "(near-tie or real divergence, as the greedy-identity contract counts them). How to read the curve: "
        "docs/serving-under-load.md.",
        *baselines_markdown(rows),
    ]
    return "\n".join(lines)


def serving_sanity(rows: list[dict]) -> list[str]:
    """Warnings: a level where speculation is slower than plain decoding, failed requests, a level that
    never filled, a real divergence between the servers' greedy answers."""
    notes = []
    for row in rows:
        level = f"serving at concurrency {row['concurrency']}"
        if row["speedup"] is not None and row["speedup"] < 1:
            notes.append(
                f"{level}: the server with the head is SLOWER than without it ({row['speedup']:.2f}x output "
                "tokens/s): at this load speculation costs more than it saves"
            )
        failed = {name: row[name]["failed"] for name in SERVERS if row[name]["failed"]}
        if failed:
            notes.append(f"{level}: failed requests {failed} (their errors are in vLLM's result files)")
        if row["requests"] and row["requests"] < row["concurrency"]:
            notes.append(
                f"{level}: only {row['requests']} requests, so never {row['concurrency']} in flight "
                "(raise engine_num_prompts)"
            )
        identity = row["identity"] or {}
        if identity.get("divergence") or identity.get("unclassified"):
            notes.append(
                f"{level}: {identity['divergence'] + identity['unclassified']} of {identity['compared']} greedy "
                "answers with the head differ from those without it beyond a near-tie: the engine is not "
                "lossless with this head at this load"
            )
        for name, baseline in row["baselines"].items():
            if (
                baseline["speedup"] is not None
                and row["speedup"] is not None
                and baseline["speedup"] > row["speedup"]
            ):
                notes.append(
                    f"{level}: vLLM's own {name} ({baseline['speedup']:.2f}x) is faster than the head "
                    f"({row['speedup']:.2f}x), with no training"
                )
            found = baseline["identity"] or {}
            if found.get("divergence") or found.get("unclassified"):
                notes.append(
                    f"{level}: {found['divergence'] + found['unclassified']} of {found['compared']} greedy answers "
                    f"with vLLM's {name} differ from plain beyond a near-tie"
                )
    return notes


def plot_speedup_by_concurrency(rows: list[dict], out: Path) -> Path:
    """serving_speedup.png: speedup against concurrency (the 1.0 break-even line), and both servers'
    output tokens/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = [r["concurrency"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    left.plot(levels, [r["speedup"] or float("nan") for r in rows], marker="o", label="with the head")
    for name in rows[0]["baselines"]:
        speedups = [r["baselines"][name]["speedup"] or float("nan") for r in rows]
        left.plot(levels, speedups, marker="s", linestyle=":", label=f"vLLM {name}")
    left.axhline(1.0, color="gray", linestyle="--", linewidth=1, label="break-even (1.0)")
    left.set(title="speedup under load", xlabel="concurrency (requests in flight)", ylabel="speedup")
    for name, style in ((PLAIN, "--"), (HEAD, "-")):
        right.plot(
            levels,
            [r[name]["output_throughput"] or float("nan") for r in rows],
            marker="o",
            linestyle=style,
            label=name,
        )
    for name in rows[0]["baselines"]:
        throughput = [r["baselines"][name]["output_throughput"] or float("nan") for r in rows]
        right.plot(levels, throughput, marker="s", linestyle=":", label=f"vLLM {name}")
    right.set(title="output tokens/s", xlabel="concurrency (requests in flight)", ylabel="tokens/s")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.minorticks_off()
        ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(plt, fig, out / "serving_speedup.png")


def serving_section(
    results: dict[int, dict[str, dict]],
    identity: dict[int, dict],
    setup: dict[str, Any],
    out: Path,
    plots: bool = True,
) -> dict[str, Any]:
    """What `report.write_report(serving=...)` adds: rows, the Markdown tables, sanity notes, the plot.
    `results`: concurrency -> {"plain": vLLM's result, "head": vLLM's result, baseline name: its result};
    `identity`: concurrency -> {server name: `compare_answers` with plain}."""
    rows = [serving_row(c, results[c], identity.get(c)) for c in sorted(results)]
    return {
        "rows": rows,
        "setup": setup,
        "markdown": serving_markdown(rows, setup),
        "sanity": serving_sanity(rows),
        "plots": [plot_speedup_by_concurrency(rows, out)] if plots and rows else [],
    }
