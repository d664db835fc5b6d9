"""Memory and time of the training loss (forward + backward) on the CPU: the chunked CE of
`eagle_train.training.loss.eagle_loss_sums` against the one-shot computation it replaced ([positions, vocab]
logits, softmax and log-softmax all at once), side by side at growing sequence lengths.

Peak memory is the allocator's own peak of torch CPU allocations during one forward + backward
(profiler memory events; inputs excluded, deterministic); time is the median of --repeats runs,
interleaved with the other variant's.
The one-shot loss is measured only up to --one-shot-max positions (it needs several [positions, vocab]
float32 tensors). On a GPU, eagle_train.diagnostics.gpu_checks.loss_memory measures the same at Llama-3 sizes.

    python scripts/bench_loss.py [--vocab 32000] [--hidden 256] [--lengths 1024 4096 16384] [--repeats 3]
Writes bench_results/loss.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from eagle_train.diagnostics.gpu_checks import peak_memory_bytes
from eagle_train.training.loss import chunk_positions, eagle_loss_sums

REPO_ROOT = Path(__file__).resolve().parents[1]


def one_shot_sums(pred, target, weight, target_ids, mask, soft=True, chunk=None):
    """The loss as it was before chunking: every masked position through the LM head at once."""
    mask = mask.bool()
    p, t, w = pred[mask].float(), target[mask].float(), weight.float()
    smooth_l1 = F.smooth_l1_loss(p, t, reduction="none").mean(-1).sum()
    draft_logp = torch.log_softmax(p @ w.T, dim=-1)
    with torch.no_grad():
        target_logits = t @ w.T
    ce = -(torch.softmax(target_logits, dim=-1) * draft_logp).sum(-1).sum()
    correct = (draft_logp.argmax(-1) == target_logits.argmax(-1)).sum()
    return {"smooth_l1": smooth_l1, "ce": ce, "correct": correct}


def make_step(fn, positions: int, vocab: int, hidden: int):
    """One forward + backward of `fn` over `positions` masked positions, on fixed random inputs."""
    g = torch.Generator().manual_seed(0)
    pred = torch.randn(1, positions, hidden, generator=g, requires_grad=True)
    target = torch.randn(1, positions, hidden, generator=g)
    weight = torch.randn(vocab, hidden, generator=g)
    ids = torch.randint(0, vocab, (1, positions), generator=g)
    mask = torch.ones(1, positions, dtype=torch.bool)

    def step():
        sums = fn(pred, target, weight, ids, mask, True)
        (sums["smooth_l1"] + 0.1 * sums["ce"]).backward()
        pred.grad = None

    return step


def measure(fns: dict, positions: int, vocab: int, hidden: int, repeats: int) -> dict[str, dict]:
    """Peak memory of each, then times in interleaved order (load on a shared CPU hits all alike)."""
    steps = {name: make_step(fn, positions, vocab, hidden) for name, fn in fns.items()}
    peaks = {name: peak_memory_bytes(step, "cpu") for name, step in steps.items()}
    times = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return {
        name: {"peak_mib": peaks[name] / 2**20, "seconds": statistics.median(times[name])} for name in steps
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--one-shot-max", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(REPO_ROOT / "bench_results" / "loss.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for n in args.lengths:
        fns = {"chunked": eagle_loss_sums, **({"one_shot": one_shot_sums} if n <= args.one_shot_max else {})}
        found = measure(fns, n, args.vocab, args.hidden, args.repeats)
        rows.append({"positions": n, "chunked": found["chunked"], "one_shot": found.get("one_shot")})
    print(f"vocab {args.vocab}, hidden {args.hidden}, chunk {chunk_positions(args.vocab, 'cpu')} positions")
    print(
        f"{'positions':>9} | {'chunked MiB':>11} {'s':>7} | {'one-shot MiB':>12} {'s':>7} | {'mem ratio':>9} {'time ratio':>10}"
    )
    for r in rows:
        c, o = r["chunked"], r["one_shot"]
        tail = (
            f"{o['peak_mib']:12.1f} {o['seconds']:7.3f} | {o['peak_mib'] / c['peak_mib']:9.2f} "
            f"{c['seconds'] / o['seconds']:10.2f}"
            if o
            else f"{'-':>12} {'-':>7} | {'-':>9} {'-':>10}"
        )
        print(f"{r['positions']:9d} | {c['peak_mib']:11.1f} {c['seconds']:7.3f} | {tail}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"vocab": args.vocab, "hidden": args.hidden, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
