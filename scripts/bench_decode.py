"""Decoding speed on stories260K, greedy: AR baseline, HF generate, chain, EAGLE-1, EAGLE-2, and the shapes
decode.shape=auto chooses, on TinyStories prompts and mt_bench.

All methods run side by side in one process: for every prompt each method generates in turn (R
repeats, per prompt and method the pass of median time kept with its statistics; each pass starts at
another method, so no method is always first: decoding.timing), so a busy shared CPU slows them alike.
Tokens/s = generated tokens / sum of median times; speedup = tokens/s over the AR baseline's (same harness,
same cache code). Per round: draft / verify / other milliseconds (other = the rest of the wall time:
prefill, the decoder's own loop). `overhead` = wall time outside the target and draft forwards / wall time.

`chain_auto` / `eagle2_auto`: the chain length and EAGLE-2 shape eagle_train.autotune.shapes.tune_shapes
picks per benchmark (calibrated on --tune-prompts held-out prompts, the ones after the timed ones; cost
curves cached under bench_results/costs/; the EAGLE-2 pick settled by timing --race candidates on those
prompts: `race_shapes`). `--sweep` also times a coarse grid of EAGLE-2 shapes (depth
2,3,4,6,8 x top_k 2,4,6,10 x total 8,16,24,40,60,80, the totals a shape can fill) in the same run and
prints the best next to the choice, with the chosen shape's tokens/s as a share of the best's; then a final
round times the chosen shape and the sweep's five fastest again side by side (the best of ~100 noisy timings
is biased up by its own noise, so the choice is judged there).

Without --draft, a head is trained here for a few minutes (a small loop of its own: SmoothL1 on
features + 0.5 soft CE, batch 32, 3000 steps; 0.5 rather than EAGLE's 0.1 gave tau +0.2 on this target) on the target's own greedy continuations of 513
TinyStories prompts (not the timed ones); --save-draft keeps it (reuse with --draft). Every speculative output is checked
token for token against the AR baseline.

    python scripts/bench_decode.py [--draft DIR] [--bench tinystories,mt_bench] [--prompts 16]
        [--max-new-tokens 128] [--repeats 3] [--sweep]
Writes bench_results/decode.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
from omegaconf import OmegaConf

from eagle_train.autotune.shapes import tune_shapes
from eagle_train.config import CONF_DIR, TargetConfig, data_path, to_schema
from eagle_train.config.decode import DecodeConfig
from eagle_train.data.prompts import load_questions
from eagle_train.data.render import ChatRenderer
from eagle_train.decoding.decoder import SpeculativeDecoder
from eagle_train.decoding.timing import median_pass, pass_orders
from eagle_train.evaluate import fit_prompt
from eagle_train.modeling.draft import DraftHead
from eagle_train.modeling.head_checkpoint import load_head, save_head
from eagle_train.modeling.hf_generate import HFGenerate
from eagle_train.modeling.target import load_target
from eagle_train.regenerate import generate_batch

REPO_ROOT = Path(__file__).resolve().parents[1]
DATA = data_path("tinystories")

METHODS = {
    "ar": DecodeConfig(method="ar"),
    "hf": DecodeConfig(method="hf"),
    "chain4": DecodeConfig(method="chain", chain_length=4),
    "eagle1_mc_sim_7b_63": DecodeConfig(method="static_tree", tree="mc_sim_7b_63"),
    "eagle1_cpu": DecodeConfig(method="static_tree", tree="cpu_small"),
    "eagle2_ref_60_5_10": DecodeConfig(method="dynamic_tree", depth=5, top_k=10, total_tokens=60),
    "eagle2_cpu": DecodeConfig(
        method="dynamic_tree", depth=3, top_k=4, total_tokens=20
    ),  # chosen on this CPU
    "chain_auto": None,  # chosen per benchmark by decode.shape=auto (tune_shapes)
    "eagle2_auto": None,
}
DEFAULT_METHODS = (
    "ar,hf,chain4,eagle1_mc_sim_7b_63,eagle1_cpu,eagle2_ref_60_5_10,eagle2_cpu,chain_auto,eagle2_auto"
)
SWEEP = [
    (d, k, t)
    for d in (2, 3, 4, 6, 8)
    for k in (2, 4, 6, 10)
    for t in (8, 16, 24, 40, 60, 80)
    if t <= k + d * k * k + 1
]


def load_prompts(tokenizer, n: int, offset: int = 0) -> list[list[int]]:
    lines = (DATA / "tinystories_prompts.jsonl").read_text().splitlines()[offset : offset + n]
    return [tokenizer(json.loads(line)["prompt"])["input_ids"] for line in lines]


def training_rows(
    target, prompts: list[list[int]], seq_len: int = 128, max_new_tokens: int = 300
) -> torch.Tensor:
    """Token rows [n, seq_len]: each prompt followed by the target's own greedy continuation
    (self-distillation, generated in left-padded batches), joined and cut into rows."""
    rows = []
    for lo in range(0, len(prompts), 32):
        batch = prompts[lo : lo + 32]
        for prompt, (reply, _) in zip(batch, generate_batch(target, batch, max_new_tokens), strict=True):
            rows.append(torch.tensor(prompt + reply + target.stop_token_ids[:1]))
    flat = torch.cat(rows)
    n = flat.numel() // seq_len
    return flat[: n * seq_len].view(n, seq_len)


def train_draft(
    target, rows: torch.Tensor, steps: int, batch: int = 32, lr: float = 3e-3, ce_weight: float = 0.5
) -> DraftHead:
    """A 1-layer EAGLE head: SmoothL1(f^, f) + ce_weight * soft CE against the target's distribution."""
    torch.manual_seed(0)
    logits, feats = target.features(rows)  # [n, seq, vocab], [n, seq, hidden]
    head = DraftHead.from_target(target.config)
    head.share_target_weights(target)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=lr, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.05)
    for step in range(steps):
        pick = torch.randint(0, rows.shape[0], (batch,))
        f, t, lg = feats[pick], rows[pick], logits[pick]
        noisy = f[:, :-1] + (torch.rand_like(f[:, :-1]) - 0.5) * 0.2  # input noise U(-0.1, 0.1)
        pred = head(t[:, 1:], noisy)[:, :-1]  # pairs (f_j, t_{j+1}) -> f^_{j+1}
        reg = torch.nn.functional.smooth_l1_loss(pred, f[:, 1:-1])
        ce = -(torch.softmax(lg[:, 1:-1], -1) * torch.log_softmax(head.logits(pred), -1)).sum(-1).mean()
        loss = reg + ce_weight * ce
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 200 == 0 or step == steps - 1:
            print(
                f"  train step {step:5d} loss {loss.item():.4f} (smooth_l1 {reg.item():.4f}, ce {ce.item():.3f})"
            )
    return head.eval()


def time_methods(target, head, prompts, methods, max_new_tokens: int, repeats: int) -> dict:
    """Median time per (prompt, method), tokens, and the speculative stats; checks greedy equality."""
    results = {name: {"times": [], "tokens": 0, "stats": []} for name in methods}
    decoders = {}
    for name, cfg in methods.items():
        cfg = replace(cfg, max_new_tokens=max_new_tokens)
        decoders[name] = (
            HFGenerate(target, cfg) if cfg.method == "hf" else SpeculativeDecoder(target, head, cfg)
        )
    names = list(decoders)
    step = max(1, len(names) // max(1, len(prompts) * repeats))  # a sweep: spread the first methods
    for i, prompt in enumerate(prompts):
        runs: dict[str, list] = {name: [] for name in methods}
        for order in pass_orders(len(names), i, repeats, step):  # round-robin from a rotating first method
            for j in order:
                runs[names[j]].append(decoders[names[j]].generate(prompt))
        reference = runs["ar"][0].tokens if "ar" in runs else None
        for name, rs in runs.items():
            if reference is not None and rs[0].tokens != reference:
                raise AssertionError(f"{name} output differs from the AR baseline on prompt {i}")
            median = median_pass(rs, lambda r: r.stats.time_total)
            results[name]["times"].append(median.stats.time_total)
            results[name]["tokens"] += len(median.tokens)
            results[name]["stats"].append(median.stats)
    return results


def summarize(results: dict) -> dict:
    base = results["ar"]["tokens"] / sum(results["ar"]["times"])
    summary = {}
    for name, r in results.items():
        tps = r["tokens"] / sum(r["times"])
        stats = r["stats"]
        total = sum(s.time_total for s in stats)
        accepted = [a for s in stats for a in s.accepted_per_round]
        summary[name] = {
            "tokens_per_s": tps,
            "speedup": tps / base,
            "tau": (sum(a + 1 for a in accepted) / len(accepted)) if accepted else 1.0,
            "overhead_fraction": sum(s.time_other for s in stats) / total if name != "hf" else None,
            "draft_fraction": sum(s.time_draft for s in stats) / total,
            "verify_fraction": sum(s.time_verify for s in stats) / total,
            "target_forward_fraction": sum(s.time_target_forward for s in stats) / total
            if name != "hf"
            else None,
            "draft_forward_fraction": sum(s.time_draft_forward for s in stats) / total,
            "mean_tree_size": statistics.mean(n for s in stats for n in s.tree_size_per_round)
            if accepted
            else 1,
            "rounds": len(accepted),
            # per round (ar: per token): draft / verify phases and the rest of the wall time
            "round_ms": _round_ms(stats, len(accepted) or r["tokens"]) if name != "hf" else None,
            "tokens": r["tokens"],
            "seconds": sum(r["times"]),
        }
    return summary


def _round_ms(stats, rounds: int) -> dict:
    total = sum(s.time_total for s in stats)
    draft, verify = sum(s.time_draft for s in stats), sum(s.time_verify for s in stats)
    if not draft and not verify:  # ar: every token is one target forward
        verify = sum(s.time_target_forward for s in stats)
    return {
        k: v / rounds * 1e3
        for k, v in (("draft", draft), ("verify", verify), ("other", total - draft - verify))
    }


def print_table(summary: dict, shapes: dict) -> None:
    print(
        f"{'method':24s} {'shape':>12s} {'tok/s':>8s} {'speedup':>8s} {'tau':>6s} {'tree':>5s} {'overhead':>9s} "
        f"{'ms/round draft / verify / other':>32s}"
    )
    for name, s in summary.items():
        ov = "-" if s["overhead_fraction"] is None else f"{s['overhead_fraction']:.1%}"
        ms = s["round_ms"]
        split = "-" if ms is None else f"{ms['draft']:.2f} / {ms['verify']:.2f} / {ms['other']:.2f}"
        print(
            f"{name:24s} {shapes.get(name, ''):>12s} {s['tokens_per_s']:8.1f} {s['speedup']:7.2f}x {s['tau']:6.2f} "
            f"{s['mean_tree_size']:5.1f} {ov:>9s} {split:>32s}"
        )


def shape_name(cfg: DecodeConfig) -> str:
    if cfg.method == "dynamic_tree":
        return f"{cfg.depth}/{cfg.top_k}/{cfg.total_tokens}"
    return str(cfg.chain_length) if cfg.method == "chain" else ""


def bench_prompts(target, bench: str, n: int, offset: int = 0) -> list[list[int]]:
    """The first turns of a benchmark's questions offset..offset+n, rendered as evaluate renders them."""
    renderer = ChatRenderer(target.tokenizer, target.cfg, target.max_len)
    questions = load_questions(bench, offset + n, 1)[offset:]
    limit = target.max_len - 160
    return [
        fit_prompt(renderer.render_prompt([{"role": "user", "content": q.turns[0]}]), limit)[0]
        for q in questions
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft", help="a trained head directory (save_head layout); default: train one here")
    ap.add_argument("--save-draft", help="where to save the head trained here")
    ap.add_argument("--train-steps", type=int, default=3000)
    ap.add_argument(
        "--train-prompts", type=int, default=513, help="prompts 200.. of the file (the timed ones come first)"
    )
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: fastest for this d=64 model on a CPU)"
    )
    ap.add_argument(
        "--methods", default=DEFAULT_METHODS, help="comma-separated subset of " + ",".join(METHODS)
    )
    ap.add_argument("--bench", default="tinystories,mt_bench", help="benchmarks, comma-separated")
    ap.add_argument("--sweep", action="store_true", help="also time a coarse grid of EAGLE-2 shapes")
    ap.add_argument("--tune-prompts", type=int, default=6, help="held-out calibration prompts (auto shapes)")
    ap.add_argument(
        "--tune-tokens",
        type=int,
        default=None,
        help="tokens decoded per calibration prompt (default --max-new-tokens: as long as the timed answers)",
    )
    ap.add_argument(
        "--tune-offset",
        type=int,
        default=None,
        help="first calibration prompt (default: after the timed ones; 0: the timed prompts themselves, "
        "which leaves only the cost model's error between the choice and the sweep's best)",
    )
    ap.add_argument(
        "--race",
        type=int,
        default=4,
        help="EAGLE-2 candidates the chooser times on the calibration prompts (0: the cost model's pick)",
    )
    ap.add_argument(
        "--eagle2-shapes",
        default="",
        help="extra EAGLE-2 shapes to time, e.g. 4/3/12,5/2/10 (depth/top_k/total)",
    )
    ap.add_argument(
        "--compile-decode",
        action="store_true",
        help="target.compile_decode: torch.compile the target's decoder",
    )
    ap.add_argument("--out", default=str(REPO_ROOT / "bench_results" / "decode.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = to_schema(OmegaConf.load(CONF_DIR / "target" / "stories260k.yaml"), TargetConfig)
    target = load_target(replace(cfg, compile_decode=args.compile_decode))
    if args.draft:
        head, _ = load_head(args.draft)
        head.share_target_weights(target)
        head.eval()
    else:
        t0 = time.perf_counter()
        rows = training_rows(target, load_prompts(target.tokenizer, args.train_prompts, offset=200))
        print(f"training a head on {rows.numel()} tokens for {args.train_steps} steps")
        head = train_draft(target, rows, args.train_steps)
        print(f"  trained in {time.perf_counter() - t0:.0f} s")
        if args.save_draft:
            save_head(
                head, args.save_draft, {"target": "stories260k", "trained_by": "scripts/bench_decode.py"}
            )
    results = {"args": vars(args), "threads": torch.get_num_threads(), "benches": {}}
    if args.compile_decode:
        results["compile_s"] = warm_up(target, head)
    for bench in args.bench.split(","):
        results["benches"][bench] = run_bench(target, head, bench, args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=2) + "\n")
    tmp.replace(out)
    print(f"wrote {out}")


def warm_up(target, head) -> float:
    """Seconds of the first plain and speculative generations (target.compile_decode: the compile time,
    which the timed runs then do not see)."""
    t0 = time.perf_counter()
    prompt = load_prompts(target.tokenizer, 1)[0]
    for cfg in (METHODS["ar"], METHODS["eagle2_cpu"]):
        SpeculativeDecoder(target, head, replace(cfg, max_new_tokens=8)).generate(prompt)
    seconds = time.perf_counter() - t0
    print(f"compile warm-up: {seconds:.0f} s")
    return seconds


def run_bench(target, head, bench: str, args) -> dict:
    """Tune, time every method (and the sweep) side by side on one benchmark, print the table."""
    names = args.methods.split(",")
    methods = {name: METHODS[name] for name in names if METHODS[name] is not None}
    for shape in filter(None, args.eagle2_shapes.split(",")):
        depth, top_k, total = (int(x) for x in shape.split("/"))
        methods[f"eagle2_{depth}_{top_k}_{total}"] = DecodeConfig(
            method="dynamic_tree", depth=depth, top_k=top_k, total_tokens=total
        )
    tuned = None
    if "chain_auto" in names or "eagle2_auto" in names:
        offset = args.prompts if args.tune_offset is None else args.tune_offset
        calibration = bench_prompts(target, bench, args.tune_prompts, offset=offset)
        cache = Path(args.out).parent / "costs"
        tokens = args.tune_tokens or args.max_new_tokens
        choice, _, info = tune_shapes(target, head, calibration, tokens, cache, race=args.race)
        tuned = {"choice": choice.to_dict(), "info": info}
        if "chain_auto" in names:
            methods["chain_auto"] = DecodeConfig(method="chain", **choice.decode_fields("chain"))
        if "eagle2_auto" in names:
            methods["eagle2_auto"] = DecodeConfig(
                method="dynamic_tree", **choice.decode_fields("dynamic_tree")
            )
        print(
            f"{bench}: chose chain {choice.chain['chain_length']}, eagle2 {shape_name(methods.get('eagle2_auto', DecodeConfig()))} "
            f"(tuned in {info['calibration_s'] + info['phases_s'] + info['race_s'] + (0 if info['costs_reused'] else info['costs_s']):.0f} s)"
        )
        for r in choice.race:
            print(
                f"  race {r['depth']}/{r['top_k']}/{r['total_tokens']}: predicted {r['tokens_per_s']:.1f}, "
                f"measured {r['race_tokens_per_s']:.1f} tok/s (tau {r['race_tau']:.2f})"
            )
    if args.sweep:  # a shape already timed (the chosen one, say) is timed once
        timed = {shape_name(cfg) for cfg in methods.values() if cfg.method == "dynamic_tree"}
        for d, k, t in SWEEP:
            if f"{d}/{k}/{t}" not in timed:
                methods[f"sweep_{d}_{k}_{t}"] = DecodeConfig(
                    method="dynamic_tree", depth=d, top_k=k, total_tokens=t
                )
    prompts = bench_prompts(target, bench, args.prompts)
    time_methods(target, head, prompts[:1], methods, 32, 1)  # warm-up
    summary = summarize(time_methods(target, head, prompts, methods, args.max_new_tokens, args.repeats))
    shapes = {name: shape_name(cfg) for name, cfg in methods.items()}
    print(
        f"== {bench}: {len(prompts)} prompts, {args.max_new_tokens} new tokens, {args.repeats} repeats, "
        f"{torch.get_num_threads()} thread(s)"
    )
    print_table({n: s for n, s in summary.items() if not n.startswith("sweep_")}, shapes)
    record = {"summary": summary, "shapes": shapes, "tuning": tuned}
    if args.sweep:
        record["sweep"] = sweep_report(summary, shapes, tuned)
        record["final"] = final_round(target, head, prompts, methods, shapes, record["sweep"], args)
    return record


def final_round(target, head, prompts, methods, shapes, sweep: dict, args, top: int = 5) -> dict:
    """The chosen shape against the sweep's fastest `top`, timed again side by side with one more repeat:
    the best of ~100 noisy timings is biased up (its noise picked it), so the choice is judged here."""
    keep = ["ar", "eagle2_auto", *[n for n in sweep["ranked_names"][:top] if n != "eagle2_auto"]]
    again = {n: methods[n] for n in keep if n in methods}
    summary = summarize(time_methods(target, head, prompts, again, args.max_new_tokens, args.repeats + 1))
    ranked = sorted((n for n in summary if n != "ar"), key=lambda n: -summary[n]["tokens_per_s"])
    print(
        f"final round: the chosen shape and the sweep's {top} fastest, timed again ({args.repeats + 1} repeats):"
    )
    for n in ranked:
        s = summary[n]
        mark = "  <- chosen" if n == "eagle2_auto" else ""
        print(
            f"  {shapes[n]:>10s} {s['tokens_per_s']:8.1f} tok/s {s['speedup']:6.2f}x tau {s['tau']:.2f}{mark}"
        )
    out = {"ranked": [[shapes[n], summary[n]["tokens_per_s"], summary[n]["speedup"]] for n in ranked]}
    if "eagle2_auto" in summary:
        share = summary["eagle2_auto"]["tokens_per_s"] / summary[ranked[0]]["tokens_per_s"]
        print(f"chosen {shapes['eagle2_auto']}: {share:.1%} of the fastest here ({shapes[ranked[0]]})")
        out.update(chosen_share_of_best=share, chosen_speedup=summary["eagle2_auto"]["speedup"])
    return out


def sweep_report(summary: dict, shapes: dict, tuned: dict | None) -> dict:
    """The measured sweep, fastest first, printed next to the chosen shape (its tokens/s / the best's)."""
    eagle2 = {n: s for n, s in summary.items() if shapes[n].count("/") == 2}  # every EAGLE-2 shape timed
    ranked = sorted(eagle2, key=lambda n: -eagle2[n]["tokens_per_s"])
    best = ranked[0]
    print(f"sweep ({len(eagle2)} EAGLE-2 shapes: the coarse grid and the named ones), fastest first:")
    for n in ranked[:8]:
        s = eagle2[n]
        print(
            f"  {shapes[n]:>10s} {s['tokens_per_s']:8.1f} tok/s {s['speedup']:6.2f}x tau {s['tau']:.2f}{'  <- chosen' if n == 'eagle2_auto' else ''}"
        )
    out = {
        "ranked": [[shapes[n], eagle2[n]["tokens_per_s"], eagle2[n]["tau"]] for n in ranked],
        "ranked_names": ranked,
        "best": shapes[best],
    }
    if "eagle2_auto" in eagle2:
        share = eagle2["eagle2_auto"]["tokens_per_s"] / eagle2[best]["tokens_per_s"]
        rank = ranked.index("eagle2_auto") + 1
        print(
            f"chosen {shapes['eagle2_auto']}: {share:.1%} of the best measured ({shapes[best]}), rank {rank} of {len(ranked)}"
        )
        out.update(chosen=shapes["eagle2_auto"], chosen_share_of_best=share, chosen_rank=rank)
    return out


if __name__ == "__main__":
    main()
