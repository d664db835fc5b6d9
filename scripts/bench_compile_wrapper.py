"""The compiled target's two inductor wrappers (target.compile_cpp_wrapper: Python or C++), side by side in ONE
process on stories260K: `ar` and each head's chain of K, once on a target compiled with each wrapper.

    python scripts/bench_compile_wrapper.py NAME=HEAD_DIR:K [NAME=HEAD_DIR:K ...] [--questions 12] [--repeats 3]
        [--out bench_results/compile_wrapper.json]

Two targets are loaded and compiled (target.compile_decode), one per wrapper; every decoder of both answers the
first `--questions` TinyStories prompts and mt_bench first turns (128 new tokens, one thread) in turn, each
question `--repeats` times from a rotating first decoder, the median pass kept (bench_chains.median_answers),
after two untimed warm-up questions. Greedy answers are checked against the Python wrapper's `ar` (named `ar`).
Prints and saves, per benchmark and decoder, tokens/s under each wrapper and their ratio (C++ / Python); tau
must not move (the kernels are the same).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from eagle_train.config.decode import DecodeConfig
from eagle_train.data.render import ChatRenderer
from eagle_train.decoding.decoder import SpeculativeDecoder
from eagle_train.interop.layouts import load_draft
from eagle_train.report.results import summarize

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_chains import NEW_TOKENS, answer_benches, bench_target  # noqa: E402

WRAPPERS = {"py": False, "cpp": True}


def decoders(heads: dict[str, tuple[Path, int]]) -> tuple[dict[str, SpeculativeDecoder], ChatRenderer, int]:
    """`ar` (the Python wrapper's), `cpp/ar`, and `py/NAME`, `cpp/NAME` per head: its chain of K."""
    made = {}
    for wrapper, cpp in WRAPPERS.items():
        target = bench_target(compile_decode=True, compile_cpp_wrapper=cpp)
        ar = "ar" if wrapper == "py" else f"{wrapper}/ar"
        made[ar] = SpeculativeDecoder(target, None, DecodeConfig(method="ar", max_new_tokens=NEW_TOKENS))
        for name, (head_dir, k) in heads.items():
            chain = DecodeConfig(method="chain", chain_length=k, max_new_tokens=NEW_TOKENS)
            made[f"{wrapper}/{name}"] = SpeculativeDecoder(target, load_draft(head_dir, target), chain)
    renderer = ChatRenderer(target.tokenizer, target.cfg, target.max_len)
    return made, renderer, target.max_len - NEW_TOKENS


def compare(made: dict, renderer: ChatRenderer, limit: int, questions: int, repeats: int) -> list[dict]:
    """Per (bench, decoder): tau, tokens/s and greedy identity under each wrapper, and the ratio."""
    # two warm-ups: the graphs of every query width compiled before any timing
    records = answer_benches(made, renderer, limit, questions, repeats, warmups=2)
    rows = {(r["bench"], r["method"]): r for r in summarize(records)}
    out = []
    for (bench, method), row in rows.items():
        if not method.startswith("py/") and method != "ar":
            continue
        name = method.removeprefix("py/")
        cpp = rows[(bench, f"cpp/{name}")]
        out.append({
            "bench": bench,
            "decoder": name,
            "tau": row["tau"] or 1.0,
            "tau_cpp": cpp["tau"] or 1.0,
            "tokens_per_s_py": row["tokens_per_s"],
            "tokens_per_s_cpp": cpp["tokens_per_s"],
            "cpp_over_py": cpp["tokens_per_s"] / row["tokens_per_s"],
            "identical": [r["identical"] for r in (row, cpp) if r["identical"] is not None],
            "identity_checked": [r["identity_checked"] for r in (row, cpp) if r["identical"] is not None],
        })  # fmt: skip
    return out


def head_spec(spec: str) -> tuple[str, tuple[Path, int]]:
    """NAME=DIR:K -> (NAME, (DIR, K))."""
    name, rest = spec.split("=", 1)
    head_dir, _, k = rest.rpartition(":")
    if not head_dir or not k.isdigit() or int(k) < 1:
        raise argparse.ArgumentTypeError(f"a head is NAME=DIR:K with a chain length K >= 1, got {spec!r}")
    return name, (Path(head_dir), int(k))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "heads", nargs="*", type=head_spec, help="NAME=DIR:K: a trained head and its chain length"
    )
    ap.add_argument("--questions", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3, help="passes per question; the median answer is kept")
    ap.add_argument("--out", default="bench_results/compile_wrapper.json", help="JSON result")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats takes a count of passes >= 1, got {args.repeats}")
    torch.set_num_threads(1)
    start, load = time.perf_counter(), os.getloadavg()
    made, renderer, limit = decoders(dict(args.heads))
    rows = compare(made, renderer, limit, args.questions, args.repeats)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"rows": rows, "repeats": args.repeats, "seconds": time.perf_counter() - start}
    result["loadavg"] = [load, os.getloadavg()]
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"{'bench':12s} {'decoder':10s} {'tau':>5s} {'py tok/s':>8s} {'C++ tok/s':>9s} {'C++/py':>6s}  identical"
    )
    for r in rows:
        ident = " ".join(f"{a}/{b}" for a, b in zip(r["identical"], r["identity_checked"], strict=True))
        print(f"{r['bench']:12s} {r['decoder']:10s} {r['tau']:5.2f} {r['tokens_per_s_py']:8.0f} "
              f"{r['tokens_per_s_cpp']:9.0f} {r['cpp_over_py']:5.3f}x  {ident}")  # fmt: skip
        if abs(r["tau"] - r["tau_cpp"]) > 1e-9:
            raise SystemExit(f"{r['bench']} {r['decoder']}: tau {r['tau']} (Python) != {r['tau_cpp']} (C++)")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
