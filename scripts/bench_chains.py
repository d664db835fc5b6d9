"""Heads' chains on stories260K in the built-in decoder, side by side in ONE process: each K, the K
`decode.shape=auto` chooses, and the EAGLE-2 tree it chooses (a P-EAGLE head: a tree from its one forward).

    python scripts/bench_chains.py NAME=HEAD_DIR [NAME=HEAD_DIR ...] [--chains 3,5,7,8] [--questions 20] [--out FILE]
        [--compile-decode] [--repeats 3]

The decoders (ar, then per head: chain K for every K, chain at the chosen K, eagle2 at the chosen shape) answer
the first `--questions` TinyStories prompts and mt_bench first turns (128 new tokens), each question by every
decoder of every head in turn (evaluate.answer_question: the load of the moment falls on all alike, so the
heads' tokens/s compare directly; greedy answers checked against ar's), after one untimed warm-up question.
`--repeats R` answers each question R times, every pass starting at another decoder, and keeps per (question,
decoder) the answer of median wall time (its draft time with it); a decoder whose answers differ between
passes stops the run. The shapes are chosen on held-out questions (the ones after the first `--questions`)
as the evaluate stage chooses them (autotune.shapes.tune_shapes, its cost curves cached beside --out).
Per (bench, decoder): tau, acceptance by position, draft milliseconds per round (the draft phase: catch-up
and draft steps), tokens/s, speedup over ar and greedy identity (report.summarize). Writes --out (JSON) and
prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from eagle_train.autotune.shapes import tune_shapes
from eagle_train.config.base import CONF_DIR, to_schema
from eagle_train.config.decode import DecodeConfig
from eagle_train.config.target import TargetConfig
from eagle_train.data.prompts import Question, bench_name, load_questions
from eagle_train.data.render import ChatRenderer
from eagle_train.decoding.decoder import SpeculativeDecoder
from eagle_train.decoding.timing import median_pass, pass_orders
from eagle_train.evaluate import answer_question, fit_prompt
from eagle_train.interop.layouts import load_draft
from eagle_train.modeling.target import load_target
from eagle_train.report.results import summarize

BENCHES = ("tinystories", "mt_bench")
NEW_TOKENS = 128
TUNE_PROMPTS = 6


def chosen_shapes(target, head, renderer, questions: int, prompt_limit: int, cache: Path) -> dict:
    """decode.shape=auto's chain length and EAGLE-2 shape, tuned on held-out TinyStories questions."""
    pool = load_questions("tinystories", None, 1)[questions:][:TUNE_PROMPTS]
    prompts = [
        fit_prompt(renderer.render_prompt([{"role": "user", "content": q.turns[0]}]), prompt_limit)[0]
        for q in pool
    ]
    choice, _, info = tune_shapes(target, head, prompts, NEW_TOKENS, cache)
    return {
        "chain": choice.chain,
        "eagle2": {k: v for k, v in choice.dynamic_tree.items() if k != "round_s"},
        "tune_s": info["calibration_s"] + info["costs_s"] + info["phases_s"] + info["race_s"],
    }


def decoders(target, name: str, head, chains: list[int], shapes: dict) -> dict[str, SpeculativeDecoder]:
    """`name/chainK` for every K, `name/chain_auto` (the chosen K) and `name/eagle2_auto` (the chosen tree)."""
    fields = {f"chain{k}": {"method": "chain", "chain_length": k} for k in chains}
    fields["chain_auto"] = {"method": "chain", "chain_length": shapes["chain"]["chain_length"]}
    tree = shapes["eagle2"]
    fields["eagle2_auto"] = {
        "method": "dynamic_tree",
        **{k: tree[k] for k in ("depth", "top_k", "total_tokens")},
    }
    return {
        f"{name}/{kind}": SpeculativeDecoder(target, head, DecodeConfig(max_new_tokens=NEW_TOKENS, **cfg))
        for kind, cfg in fields.items()
    }


def median_answers(
    decoders: dict, renderer, question: Question, limit: int, index: int, repeats: int
) -> list:
    """`question` answered `repeats` times by every decoder, in the rotating orders of question `index`
    (decoding.timing.pass_orders: no decoder is always first); per decoder the record of median wall time
    (decoding.timing.median_pass). Greedy decoders answer the same every pass (checked)."""
    names = list(decoders)
    passes: dict[str, list[dict]] = {name: [] for name in names}
    for order in pass_orders(len(names), index, repeats):
        for record in answer_question(
            {names[j]: decoders[names[j]] for j in order}, renderer, question, limit
        ):
            passes[record["method"]].append(record)
    for name, mine in passes.items():
        if any(m["tokens"] != mine[0]["tokens"] for m in mine):
            raise AssertionError(
                f"{name} answered question {question.question_id} differently between passes"
            )
    return [median_pass(passes[name], lambda m: m["wall_s"]) for name in names]


def bench_target(**fields):
    """stories260K as every bench here loads it (conf/target/stories260k.yaml), `fields` set on its config."""
    cfg = OmegaConf.load(CONF_DIR / "target" / "stories260k.yaml")
    for key, value in fields.items():
        setattr(cfg, key, value)
    return load_target(to_schema(cfg, TargetConfig))


def answer_benches(made: dict, renderer, limit: int, questions: int, repeats: int, warmups: int = 1) -> list:
    """The first `questions` of every bench (first turns) answered by every decoder (median_answers), after
    `warmups` untimed answers of the bench's first question; the records tagged with their bench."""
    records = []
    for bench in BENCHES:
        asked = load_questions(bench, questions, 1)
        for _ in range(warmups):
            answer_question(made, renderer, Question(asked[0].question_id, asked[0].turns[:1]), limit)
        for i, question in enumerate(asked):
            records += [
                {"bench": bench_name(bench), **r}
                for r in median_answers(made, renderer, question, limit, i, repeats)
            ]
    return records


def sweep(
    heads: dict[str, Path],
    chains: list[int],
    questions: int,
    cache: Path,
    compile_decode: bool = False,
    repeats: int = 1,
) -> dict:
    """Every decoder of every head on every bench (module docstring); per head its rows and its choice.
    `compile_decode`: the target's decode-time forwards run under torch.compile (target.compile_decode);
    `repeats`: passes per question (median_answers)."""
    target = bench_target(compile_decode=compile_decode)
    renderer = ChatRenderer(target.tokenizer, target.cfg, target.max_len)
    limit = target.max_len - NEW_TOKENS
    made = {"ar": SpeculativeDecoder(target, None, DecodeConfig(method="ar", max_new_tokens=NEW_TOKENS))}
    loaded = {}
    for name, head_dir in heads.items():
        head = load_draft(head_dir, target)
        shapes = chosen_shapes(target, head, renderer, questions, limit, cache)
        loaded[name] = {
            "head": str(head_dir),
            "kind": head.kind,
            "layers": int(head.config.num_hidden_layers),
        }
        loaded[name]["chosen"] = shapes
        made.update(decoders(target, name, head, chains, shapes))
    records = answer_benches(made, renderer, limit, questions, repeats)
    rows = summarize(records)
    for row in rows:
        mine = [r for r in records if (r["bench"], r["method"]) == (row["bench"], row["method"])]
        rounds = sum(len(r["accept_lengths"]) for r in mine if r["method"] != "ar")
        row["draft_ms_per_round"] = 1e3 * sum(r["time_draft"] for r in mine) / rounds if rounds else None
    for name, result in loaded.items():  # each head's rows, ar's among them, its decoders named as above
        result["rows"] = [
            {**r, "method": r["method"].removeprefix(f"{name}/")}
            for r in rows
            if r["method"] == "ar" or r["method"].startswith(f"{name}/")
        ]
    return loaded


def print_rows(name: str, result: dict) -> None:
    """One line per (bench, decoder)."""
    chosen = result["chosen"]
    print(f"\n{name} ({result['kind']}, {result['layers']} layers): chosen chain K={chosen['chain']['chain_length']}"
          f", tree {chosen['eagle2']['depth']}/{chosen['eagle2']['top_k']}/{chosen['eagle2']['total_tokens']}")  # fmt: skip
    print(f"{'bench':12s} {'decoder':12s} {'tau':>5s} {'draft ms':>8s} {'tok/s':>6s} {'speedup':>7s} "
          f"{'ident':>6s}  acceptance by position")  # fmt: skip
    for r in result["rows"]:
        rates = " ".join("-" if x is None else f"{x:.2f}" for x in (r["acceptance_by_position"] or [])[:8])
        draft = "" if r["draft_ms_per_round"] is None else f"{r['draft_ms_per_round']:.3f}"
        ident = "" if r["identical"] is None else f"{r['identical']}/{r['identity_checked']}"
        print(f"{r['bench']:12s} {r['method']:12s} {r['tau'] or 1.0:5.2f} {draft:>8s} {r['tokens_per_s']:6.0f} "
              f"{r['speedup'] or 1.0:6.2f}x {ident:>6s}  {rates}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "heads", nargs="+", help="NAME=DIR: a trained head (run/final, any layout load_draft reads)"
    )
    ap.add_argument("--chains", default="3,5,7,8")
    ap.add_argument("--questions", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=1, help="passes per question; the median answer is kept")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="bench_results/chains.json", help="JSON result")
    ap.add_argument(
        "--compile-decode", action="store_true", help="the target's decode forwards under torch.compile"
    )
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats takes a count of passes >= 1, got {args.repeats}")
    torch.set_num_threads(args.threads)
    heads = dict(spec.split("=", 1) for spec in args.heads)
    out = Path(args.out)
    start, load = time.perf_counter(), os.getloadavg()
    chains = [int(k) for k in args.chains.split(",")]
    costs = out.parent / "costs"
    heads = {k: Path(v) for k, v in heads.items()}
    result = sweep(heads, chains, args.questions, costs, args.compile_decode, args.repeats)
    result = {
        "heads": result,
        "repeats": args.repeats,
        "seconds": time.perf_counter() - start,
        "loadavg": [load, os.getloadavg()],
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    for name, head in result["heads"].items():
        print_rows(name, head)


if __name__ == "__main__":
    main()
