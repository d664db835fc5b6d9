"""P-EAGLE's training memory at the GPU presets' length: the COD sequence, its attention mask and the
activations, by formula on the elements the real sampler keeps (nothing is allocated but the masks).

    python scripts/bench_peagle_memory.py [--tokens 2048] [--depths 8] [--r 0.8] [--r-min 0.2] [--layers 1 4]

The head: Llama-3.1-8B's shape (d 4096, 32 heads of 128, 8 KV heads, MLP 14336, draft vocabulary 32000),
bf16 training. Per element and layer the tensors autograd keeps (bf16): layer 0 (the fusion layer) its fc
input (3d), the two norms' inputs (2d), the [2d] q/k/v input, q/k/v after RoPE (d + 2 x 1024), the
attention output (d), the post-attention norm's input (d), the MLP's input (d) and gate / up / activation /
product (4 x 14336); layers 1..N-1 the same with a d-wide input (no fc, one input norm). The attention mask
is bool [T, T] (the flattened sequence of T elements); on a GPU the memory-efficient SDPA kernel takes it as
an additive [T, T] mask in bf16 and never holds the [heads, T, T] scores (the math kernel would: shown as
the risk). The draft vocabulary's logits exist one chunk at a time (eagle_train.training.loss.chunk_positions).
Prints one table; the element counts come from `cod_sample` itself (mean of 5 seeds).
"""

from __future__ import annotations

import argparse

import torch

from eagle_train.training.cod import cod_attention_mask, flatten_cod
from eagle_train.training.loss import chunk_positions

D, HEADS, KV_WIDTH, MLP, DRAFT_VOCAB, BF16 = 4096, 32, 1024, 14336, 32000, 2
GB = 1024**3


def per_element_bytes(layers: int) -> int:
    """Activation bytes autograd keeps per element for a head of `layers` layers (module docstring)."""
    first = 3 * D + 2 * D + 2 * D + (D + 2 * KV_WIDTH) + D + D + D + 4 * MLP
    later = D + D + (D + 2 * KV_WIDTH) + D + D + D + 4 * MLP
    return BF16 * (first + (layers - 1) * later + 2 * D)  # + the final norm's input and the state


def elements(tokens: int, depths: int, r: float, r_min: float, masked: float) -> tuple[float, int]:
    """(mean elements of a row over 5 seeds, the largest), a share `masked` of its positions on the loss mask."""
    counts = []
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        valid = torch.rand(1, tokens, generator=g) < masked
        cod = flatten_cod(valid, torch.tensor([tokens]), depths, r, r_min, g)
        counts.append(int(cod.real.sum()))
    return sum(counts) / len(counts), max(counts)


def mask_bytes(tokens: int, depths: int, r: float, r_min: float) -> int:
    """The bool mask `cod_attention_mask` builds for one all-masked row, really allocated."""
    g = torch.Generator().manual_seed(0)
    cod = flatten_cod(torch.ones(1, tokens, dtype=torch.bool), torch.tensor([tokens]), depths, r, r_min, g)
    mask = cod_attention_mask(cod)
    return mask.numel() * mask.element_size()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--depths", type=int, default=8)
    ap.add_argument("--r", type=float, default=0.8)
    ap.add_argument("--r-min", type=float, default=0.2)
    ap.add_argument("--layers", type=int, nargs="+", default=[1, 4])
    args = ap.parse_args()
    n, k = args.tokens, args.depths
    chunk = chunk_positions(DRAFT_VOCAB, "cuda")
    print(f"{n} tokens, K={k}, r={args.r}, r_min={args.r_min}; loss chunk {chunk} elements x {DRAFT_VOCAB}")
    print(f"{'loss-masked':>11s} {'elements T':>10s} {'mask GB':>8s} {'sdpa mask GB':>12s} "
          f"{'math scores GB/layer':>20s} " + " ".join(f"{f'act GB ({x}L)':>12s}" for x in args.layers))  # fmt: skip
    for masked in (1.0, 0.6):
        mean, worst = elements(n, k, args.r, args.r_min, masked)
        row = f"{masked:11.0%} {mean:10.0f} {worst**2 / GB:8.3f} {BF16 * worst**2 / GB:12.3f} "
        row += f"{HEADS * worst**2 * (4 + BF16) / GB:20.2f} "
        row += " ".join(f"{worst * per_element_bytes(x) / GB:12.2f}" for x in args.layers)
        print(row)
    dense = n * k
    row = f"{'no COD':>11s} {dense:10d} {dense**2 / GB:8.3f} {BF16 * dense**2 / GB:12.3f} "
    row += f"{HEADS * dense**2 * (4 + BF16) / GB:20.2f} "
    print(row + " ".join(f"{dense * per_element_bytes(x) / GB:12.2f}" for x in args.layers))
    built = mask_bytes(n, k, args.r, args.r_min)
    print(f"the mask cod_attention_mask allocated for an all-masked row: {built / GB:.3f} GB")
    print(f"loss: one chunk's [{chunk}, {DRAFT_VOCAB}] float32 logits + log-softmax + target: "
          f"{3 * chunk * DRAFT_VOCAB * 4 / GB:.2f} GB at a time")  # fmt: skip


if __name__ == "__main__":
    main()
