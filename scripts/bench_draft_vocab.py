"""The EAGLE-3 draft vocabulary's size, from measurement: coverage against cost.

    python scripts/bench_draft_vocab.py --features runs/smollm2_cpu/features [--sizes 2048,4096,8192,16384,32000]

For each size V: the vocabulary is fitted as training fits it (the V most frequent assistant tokens,
eagle_train.modeling.draft_vocab.top_tokens) on a split of the store's conversations (--fit, the rest held
out), and its coverage measured on the held-out ones: the share of their assistant tokens the head can draft
at all (a token outside the vocabulary is never proposed, so it caps every acceptance). Beside it, the
milliseconds of the draft LM head alone for one drafted position and for a round of --rows positions (an
EAGLE-2 tree level), [rows, hidden] @ [hidden, V] on one thread, median of --repeats, and the same for the
target's full vocabulary. Writes bench_results/draft_vocab.json.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from eagle_train.modeling.draft_vocab import count_assistant_tokens, top_tokens
from eagle_train.runtime.atomic_files import atomic_write_json
from eagle_train.store.reader import FeatureStore

REPO = Path(__file__).resolve().parents[1]


def matmul_ms(hidden: int, vocab: int, rows: int, repeats: int) -> float:
    """Median milliseconds of [rows, hidden] @ [hidden, vocab] (float32)."""
    x, w = torch.randn(rows, hidden), torch.randn(vocab, hidden)
    times = []
    for _ in range(repeats + 3):
        start = time.perf_counter()
        x @ w.T
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[3:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--features", required=True, help="a feature store (its tokens and loss masks are read)")
    ap.add_argument("--sizes", default="1024,2048,4096,8192,16384,32000")
    ap.add_argument(
        "--fit", type=float, default=0.8, help="share of conversations the vocabulary is fitted on"
    )
    ap.add_argument("--rows", type=int, default=10, help="positions of one tree level (EAGLE-2's top_k)")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--out", default=str(REPO / "bench_results" / "draft_vocab.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    store = FeatureStore(args.features)
    target = store.manifest["target"]
    vocab, hidden = int(target["vocab_size"]), int(target["hidden_size"])
    cut = int(len(store) * args.fit)
    if not 0 < cut < len(store):
        raise SystemExit(f"--fit {args.fit} leaves no conversation on one side of {len(store)}")
    fitted = count_assistant_tokens((store.tokens(i) for i in range(cut)), vocab)
    held = count_assistant_tokens((store.tokens(i) for i in range(cut, len(store))), vocab)
    rows = []
    for size in [int(s) for s in args.sizes.split(",")] + [vocab]:
        size = min(size, vocab)
        kept = top_tokens(fitted, size)
        rows.append(
            {
                "size": size,
                "held_out_coverage": float(held[kept].sum() / held.sum()),
                "fit_coverage": float(fitted[kept].sum() / fitted.sum()),
                "lm_head_ms_1": matmul_ms(hidden, size, 1, args.repeats),
                f"lm_head_ms_{args.rows}": matmul_ms(hidden, size, args.rows, args.repeats),
            }
        )
    print(
        f"{len(store)} conversations ({cut} fitted, {len(store) - cut} held out), "
        f"{int(fitted.sum())} + {int(held.sum())} assistant tokens, {int((fitted > 0).sum())} distinct "
        f"of {vocab}; hidden {hidden}"
    )
    print(f"{'size':>7} {'held-out cov':>12} {'fit cov':>8} {'LM head ms x1':>14} {f'x{args.rows}':>8}")
    for r in rows:
        print(
            f"{r['size']:>7} {r['held_out_coverage']:>12.4f} {r['fit_coverage']:>8.4f} "
            f"{r['lm_head_ms_1']:>14.3f} {r[f'lm_head_ms_{args.rows}']:>8.3f}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(
        out, {"args": vars(args), "vocab": vocab, "hidden": hidden, "rows": rows}, sort_keys=False
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
