"""The family matrix as Markdown, from scripts/family_matrix.py's results (pure formatting)."""

from __future__ import annotations

from eagle_train.families.specs import not_served

METHODS = (
    "ar",
    "chain",
    "static_tree",
    "dynamic_tree",
)  # the built-in methods whose greedy identity the tables count


def _not_served(res: dict | None) -> bool:
    """The run failed with an error that specs.NOT_SERVED records for what vLLM's CPU build cannot serve."""
    return res is not None and not_served(res.get("error", ""))


def _cell_error(res: dict | None) -> str | None:
    if res is None:
        return "not run"
    if not res.get("ok", False):
        return "FAILED: " + res.get("error", "?").replace("|", "/")
    return None


def decoder_cell(res: dict | None) -> str:
    """tau per method and greedy identity against hf (the model's own generate) and ar."""
    error = _cell_error(res)
    if error:
        return error
    tau, ident = res["tau"], res["identity"]
    parts = [
        f"tau chain {tau.get('chain', '-')} / static tree {tau.get('static_tree', '-')} / dynamic tree "
        f"{tau.get('dynamic_tree', '-')}"
    ]
    for method in METHODS:
        hf, ar = ident[method]["hf"], ident[method]["ar"]
        diff = ident[method]["hf"]["first_diff"]
        note = f" (first differing answer token: {', '.join(map(str, diff))})" if diff else ""
        parts.append(
            f"{method} = hf {hf['same']}/{hf['of']}{note}"
            + ("" if method == "ar" else f", = ar {ar['same']}/{ar['of']}")
        )
    return "<br>".join(parts)


def vllm_cell(res: dict | None) -> str:
    """vLLM's tau and counters against the built-in chain decoder; greedy with and without speculation."""
    error = _cell_error(res)
    if error:
        return (
            error.replace("FAILED:", "not served by vLLM 0.32 on this CPU:", 1) if _not_served(res) else error
        )
    rows = {r["engine"]: r for r in res.get("engines", [])}
    theirs = next((r for e, r in rows.items() if e != "builtin"), None)
    if theirs is None:
        return "no engine rows"
    ours = rows.get("builtin", {})
    same = "equal" if theirs.get("counts") == ours.get("counts") else "DIFFER"
    vs_hf = "".join(f"; vLLM {m} = hf {a}/{b}" for m, (a, b) in (res.get("vs_hf") or {}).items())
    return (
        f"tau {theirs['tau']:.3f} (built-in chain {ours.get('tau', float('nan')):.3f}): counters {same}; "
        f"spec = plain {theirs['identical']}/{theirs['identity_checked']}; "
        f"= built-in {theirs['same_as_builtin']}/{theirs['compared_with_builtin']}{vs_hf}"
    )


def export_cell(result: dict, head: str) -> str:
    """The head's exports: vLLM's layout (both heads), speculators (EAGLE-3)."""
    formats = ("vllm", "speculators") if head == "eagle3" else ("vllm",)
    cells = [f"{fmt}: {stage_cell(result.get(f'export_{head}_{fmt}'))}" for fmt in formats]
    return "<br>".join(cells)


def stage_cell(res: dict | None) -> str:
    error = _cell_error(res)
    return error or f"ok ({res['wall_s']} s)"


def _sum(result: dict, keys: list[str]) -> str:
    runs = [result[k] for k in keys if isinstance(result.get(k), dict) and "wall_s" in result[k]]
    if not runs:
        return "-"
    return f"{sum(r['wall_s'] for r in runs):.0f} / {sum(r.get('cpu_s', 0) for r in runs):.0f}"


def _costs(result: dict) -> list[str]:
    """wall / CPU seconds: each stage, the exports, the built-in total (the build's wall only), vLLM."""
    exports = [k for k in result if k.startswith("export_")]
    stages = ["regenerate", "extract", "eagle1", "eagle3", "eval_eagle1", "eval_eagle3", *exports]
    total = _sum(result, stages)
    cells = [_sum(result, [k]) for k in ("regenerate", "extract", "eagle1", "eagle3")]
    cells += [_sum(result, ["eval_eagle1", "eval_eagle3"]), _sum(result, exports), total]
    return [*cells, _sum(result, ["vllm_eagle1", "vllm_eagle3"])]


def matrix_markdown(results: list[dict]) -> str:
    """One row per family and head type: extract, train, built-in decoder, vLLM; then the costs."""
    lines = [
        "| family | head | extract | train | export | built-in decoder (tau; greedy identity) | vLLM |",
        "|---|---|---|---|---|---|---|",
    ]
    costs = [
        "| family | build + shape | regenerate | extract | train EAGLE-1 | train EAGLE-3 | evaluate (both) "
        "| exports | stages total | vLLM (both) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        build = r.get("build", {})
        for head in ("eagle1", "eagle3"):
            first = f"{r['family']}<br><sub>{r.get('switches', '')}</sub>" if head == "eagle1" else ""
            extract = stage_cell(r.get("extract")) if build.get("ok") else "build " + _cell_error(build)
            lines.append(
                f"| {first} | {'EAGLE-1' if head == 'eagle1' else 'EAGLE-3'} | {extract} | {stage_cell(r.get(head))} "
                f"| {export_cell(r, head)} "
                f"| {decoder_cell(r.get(f'eval_{head}'))} | {vllm_cell(r.get(f'vllm_{head}'))} |"
            )

        made = round(build.get("build_s", 0) + build.get("shape_s", 0), 1) if build.get("ok") else "-"
        costs.append(f"| {r['family']} | {made} | " + " | ".join(_costs(r)) + " |")
    note = "Costs (seconds, wall / CPU time of the stages' processes; build + shape: the builder's own timing, wall)"
    return "\n".join(lines) + f"\n\n{note}:\n\n" + "\n".join(costs)


def _short(res: dict | None, refused: str = "refused") -> str:
    """A compact verdict: ok, refused (UnsupportedAttention), not served (an error specs.NOT_SERVED records),
    FAILED."""
    if res is None:
        return "-"
    if res.get("ok"):
        return "ok"
    if "UnsupportedAttention" in res.get("error", ""):
        return refused
    if _not_served(res):
        return "not served by vLLM"
    return "FAILED"


def _identity(res: dict | None) -> str:
    """The fewest answers any method gave identical to the model's own generate, as same/of."""
    if not (res or {}).get("ok"):
        return _short(res)
    ident = res["identity"]
    pairs = [(ident[m]["hf"]["same"], ident[m]["hf"]["of"]) for m in METHODS]
    same, of = min(pairs)
    return f"{same}/{of}"


def _vllm(res: dict | None) -> str:
    if not (res or {}).get("ok"):
        return _short(res, refused="-")
    rows = {r["engine"]: r for r in res.get("engines", [])}
    theirs = next((r for e, r in rows.items() if e != "builtin"), {})
    equal = theirs.get("counts") == rows.get("builtin", {}).get("counts")
    vs_hf = [tuple(pair) for pair in (res.get("vs_hf") or {}).values()]
    hf = "{}/{}".format(*min(vs_hf)) if vs_hf else "not compared"
    return f"{'equal' if equal else 'DIFFER'}, = generate {hf}"


def summary_markdown(results: list[dict]) -> str:
    """The README's table: one row per family, EAGLE-1 / EAGLE-3 in each cell."""
    lines = [
        "| family | extract, train, export | greedy = `generate` (every method) | EAGLE-2 tau | vLLM counters "
        "= built-in, vLLM = `generate` |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        stages = [r.get(k) for k in ("extract", "eagle1", "eagle3") if k in r] + [
            v for k, v in r.items() if k.startswith("export_")
        ]
        built = (
            "ok" if r.get("build", {}).get("ok") and all((s or {}).get("ok") for s in stages) else "FAILED"
        )
        evals = [r.get(f"eval_{h}") for h in ("eagle1", "eagle3")]
        tau = [str(e["tau"].get("dynamic_tree", "-")) if (e or {}).get("ok") else "-" for e in evals]
        vllm = [_vllm(r.get(f"vllm_{h}")) for h in ("eagle1", "eagle3")]
        lines.append(
            f"| {r['family']} | {built} | {' / '.join(_identity(e) for e in evals)} | {' / '.join(tau)} "
            f"| {' / '.join(vllm)} |"
        )
    return "\n".join(lines)
