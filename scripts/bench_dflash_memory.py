"""DFlash's training memory at the GPU presets' shape: one training step of a small head measured on the
CPU, and the formula that scales it to a real head (figures in docs/benchmarks.md, "DFlash training memory").

    python scripts/bench_dflash_memory.py [--tokens 2048] [--anchors 64 128 256 512] [--blocks 8 16] [--layers 1]
        [--sequences 4] [--real-layers 5] [--math-max-slots 4096]

One sequence of --tokens tokens, every position supervised (the worst case: each row keeps all its anchors),
through `DFlashObjective` exactly as a training step runs it (blocks drawn, the block mask built, one draft
forward, the chunked slot CE, backward) under bf16 autocast, as the GPU presets train (mixed precision bf16:
fp32 weights and residual stream, bf16 matmuls and attention). The head: stories260K's width (d 64, 8 heads
of 8, 4 KV heads, MLP 172, vocabulary 512), one layer (--layers), random weights. With S = A x B slots and
K = L + S keys, measured per (anchors A, block B):

- the bool block mask [S, K] (`block_attention_mask`, bytes of the tensor) and its build's peak;
- the bytes autograd saves for backward inside the layers (saved-tensor hooks, distinct storages; the
  weights excluded, their bf16 casts counted) against `layer_saved_bytes` + `weight_cast_bytes`;
- the step's peak (torch's CPU allocator events through the profiler, inputs excluded) with the default SDPA
  kernel (on the CPU the flash kernel, which like CUDA's memory-efficient one takes the mask as an additive
  [S, K] bias and never holds the scores) and, up to --math-max-slots, with the math kernel forced (it
  materialises [heads, S, K] scores): the difference per score element shows what the fallback costs
  (about 11.5 bytes per score at one layer: 4 kept for backward, the bf16 scores and their softmax, the
  rest transient; each further layer adds its 4).

Then the same formula for a Llama-3.1-8B-wide head (d 4096, 32 heads of 128, 8 KV heads, MLP 14336,
vocabulary 128256) per sequence and per layer, and for the published 5-layer head on the GPU presets'
micro-batch (4 x 2048 tokens). Prints both tables; writes bench_results/dflash_memory.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from eagle_train.config.train import LossConfig
from eagle_train.diagnostics.gpu_checks import peak_memory_bytes
from eagle_train.training.dflash import Blocks, block_attention_mask
from eagle_train.training.loss import CHUNK_ELEMENTS, chunk_positions
from eagle_train.training.objective import DFlashObjective

REPO_ROOT = Path(__file__).resolve().parents[1]
MB, GB = 2**20, 2**30


@dataclass(frozen=True)
class Shape:
    """A DFlash head's widths: hidden d, query heads, KV heads, head_dim, MLP, vocabulary."""

    d: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    vocab: int


STORIES = Shape(d=64, heads=8, kv_heads=4, head_dim=8, mlp=172, vocab=512)
LLAMA_8B = Shape(d=4096, heads=32, kv_heads=8, head_dim=128, mlp=14336, vocab=128256)


def layer_saved_bytes(s: Shape, context: int, slots: int, first: bool = True) -> dict[str, int]:
    """Bytes one DFlash layer saves for backward per sequence under bf16 autocast (fp32 residual stream and
    norms, bf16 matmul inputs and attention), by term. `context` C rows of ctx, `slots` S = A x B rows of
    blocks, K = C + S keys. A first layer's input (the frozen embedding) needs no gradient; later layers also
    keep their fp32 input and its norm statistic, and share the first's RoPE tables."""
    q, w, k = s.heads * s.head_dim, s.kv_heads * s.head_dim, context + slots
    keys = k * (
        2 * 2 * s.d  # [ctx ; block] cast to bf16 once for k_proj, once for v_proj
        + 4 * w + 4 * s.kv_heads + 2 * w  # k_norm: fp32 input, statistic, bf16 output
        + 2 * 2 * q  # keys and values repeated to the query heads (bf16), kept by SDPA
    )  # fmt: skip
    block = slots * (
        4 * s.d + 2 * s.d  # input norm's fp32 output, q_proj's bf16 input
        + 4 * q + 4 * s.heads + 2 * q  # q_norm: fp32 input, statistic, bf16 output
        + 2 * q + 2 * q + 4 * s.heads  # SDPA: rotated queries, output (o_proj's input: a view), log-sum-exp
        + 4 * s.d + 4 + 4 * s.d  # post-attention norm: input, statistic, output
        + 2 * 2 * s.d + 4 * 2 * s.mlp  # MLP: its input cast twice, gate, up, act(gate), product
        + (0 if first else 4 * s.d + 4)  # a later layer's input and its statistic
    )  # fmt: skip
    rope = 2 * 4 * s.head_dim * (k + slots)  # cos, sin (fp32) of the keys and the block: made once, kept once
    return {"keys": keys, "block": block, "additive_mask": 2 * slots * k, "rope": rope if first else 0}


def weight_cast_bytes(s: Shape) -> int:
    """The bf16 casts of a layer's seven Linear weights that autocast keeps for backward: once per forward,
    whatever the number of sequences."""
    q, w = s.heads * s.head_dim, s.kv_heads * s.head_dim
    return 2 * (s.d * (2 * q + 2 * w) + 3 * s.d * s.mlp)


def formula(s: Shape, tokens: int, anchors: int, block: int) -> dict[str, float]:
    """What one sequence costs at this shape (bytes): the bool mask, a layer's saved activations (a first
    layer, a later one), what the math kernel keeps per layer (two bf16 [heads, S, K] tensors: the masked
    scores and their softmax; it drops the additive mask),
    and the chunked CE's [chunk, vocab] fp32 logits at a time (a GPU's chunk)."""
    slots = anchors * block
    keys = tokens + slots
    first, later = layer_saved_bytes(s, tokens, slots), layer_saved_bytes(s, tokens, slots, first=False)
    chunk = chunk_positions(s.vocab, "cuda")
    return {
        "mask_bool": slots * keys,
        "layer_first": sum(first.values()),
        "layer_later": sum(later.values()),
        "additive_mask_per_layer": first["additive_mask"],
        "math_kept_per_layer": 4 * s.heads * slots * keys,
        "ce_chunk_logits": 4 * chunk * s.vocab,
    }


def make_step(tokens: int, anchors: int, block: int, layers: int = 1):
    """(head, objective, batch) of a stories260K-wide head of `layers` layers on one random sequence."""
    from transformers import LlamaConfig

    from eagle_train.modeling.dflash import DFlashHead

    s = STORIES
    config = LlamaConfig(
        hidden_size=s.d, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, head_dim=s.head_dim,
        intermediate_size=s.mlp, vocab_size=s.vocab, num_hidden_layers=layers, max_position_embeddings=tokens,
    )  # fmt: skip
    torch.manual_seed(0)
    head = DFlashHead(config, [2], block, mask_token_id=0)
    objective = DFlashObjective(LossConfig(num_anchors=anchors), head.lm_head.weight, None, head)
    g = torch.Generator().manual_seed(0)
    batch = {
        "input_ids": torch.randint(3, s.vocab, (1, tokens), generator=g),
        "loss_mask": torch.ones(1, tokens),
        "positions": torch.tensor([tokens]),
        "features": torch.randn(1, tokens, s.d, generator=g),
    }
    return head, objective, objective.prepare(batch, g)


def train_step(head, objective, batch, math: bool = False) -> None:
    """One forward + backward as train_step runs a micro-batch (bf16 autocast); math: force SDPA's math kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kernels = sdpa_kernel([SDPBackend.MATH]) if math else contextlib.nullcontext()
    with kernels, torch.autocast("cpu", dtype=torch.bfloat16):
        sums = objective.sums(head, batch, None)
        objective.loss(sums, objective.normalisers(batch)).backward()
    head.zero_grad(set_to_none=True)


def saved_in_layer(head, objective, batch) -> int:
    """Bytes autograd saves inside the head's layers during one forward (distinct storages; the weights
    themselves and the inputs excluded, their bf16 casts counted)."""
    inside, seen = [False], {}
    skip = {t.untyped_storage().data_ptr() for t in [*head.parameters(), *head.frozen.parameters()]}
    hooks = [m.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True)) for m in head.layers]
    hooks += [m.register_forward_hook(lambda *_: inside.__setitem__(0, False)) for m in head.layers]

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if inside[0] and ptr not in skip:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        torch.autocast("cpu", dtype=torch.bfloat16),
    ):
        objective.sums(head, batch, None)
    for h in hooks:
        h.remove()
    return sum(seen.values())


def measure(tokens: int, anchors: int, block: int, layers: int, math_max_slots: int) -> dict:
    head, objective, batch = make_step(tokens, anchors, block, layers)
    blocks = Blocks(batch["dflash_anchor"], batch["dflash_valid"])
    a = int(blocks.valid.sum())
    slots, keys = a * block, tokens + a * block
    mask = block_attention_mask(blocks, tokens, block)
    row = {"anchors": a, "block": block, "slots": slots, "keys": keys}
    row["mask_mb"] = mask.numel() * mask.element_size() / MB
    del mask
    row["mask_build_peak_mb"] = (
        peak_memory_bytes(lambda: block_attention_mask(blocks, tokens, block), "cpu") / MB
    )
    row["layer_saved_mb"] = saved_in_layer(head, objective, batch) / MB
    first, later = (sum(layer_saved_bytes(STORIES, tokens, slots, i == 0).values()) for i in (0, 1))
    saved = first + (layers - 1) * later + layers * weight_cast_bytes(STORIES)
    row["layer_formula_mb"] = saved / MB
    row["step_peak_mb"] = peak_memory_bytes(lambda: train_step(head, objective, batch), "cpu") / MB
    if slots <= math_max_slots:
        row["math_step_peak_mb"] = (
            peak_memory_bytes(lambda: train_step(head, objective, batch, True), "cpu") / MB
        )
        extra = (row["math_step_peak_mb"] - row["step_peak_mb"]) * MB
        row["math_extra_bytes_per_score"] = extra / (STORIES.heads * slots * keys)
    return row


def print_measured(rows: list[dict]) -> None:
    print(f"{'A':>4} {'B':>3} {'S=A*B':>6} {'K=L+S':>6} {'mask MB':>8} {'B/(S*K)':>7} {'build MB':>8} "
          f"{'saved MB':>9} {'formula MB':>10} {'step peak MB':>12} {'math peak MB':>12} {'math B/score':>12}")  # fmt: skip
    for r in rows:
        math = f"{r['math_step_peak_mb']:12.1f} {r['math_extra_bytes_per_score']:12.2f}" if "math_step_peak_mb" in r else f"{'-':>12} {'-':>12}"  # fmt: skip
        print(f"{r['anchors']:4d} {r['block']:3d} {r['slots']:6d} {r['keys']:6d} {r['mask_mb']:8.1f} "
              f"{r['mask_mb'] * MB / (r['slots'] * r['keys']):7.2f} {r['mask_build_peak_mb']:8.1f} "
              f"{r['layer_saved_mb']:9.1f} {r['layer_formula_mb']:10.1f} {r['step_peak_mb']:12.1f} {math}")  # fmt: skip


def print_formula(tokens: int, anchors: list[int], blocks: list[int]) -> list[dict]:
    print(f"\nLlama-3.1-8B-wide head, bf16 autocast, per sequence of {tokens} tokens (GB; the CE: "
          f"{chunk_positions(LLAMA_8B.vocab, 'cuda')} slots x {LLAMA_8B.vocab} per chunk, {CHUNK_ELEMENTS} elements):")  # fmt: skip
    print(f"{'A':>4} {'B':>3} {'mask':>6} {'add. mask/layer':>15} {'layer 1':>8} {'layer 2+':>8} "
          f"{'math kept/layer':>17} {'CE chunk':>8}")  # fmt: skip
    out = []
    for b in blocks:
        for a in anchors:
            f = formula(LLAMA_8B, tokens, a, b)
            out.append({"anchors": a, "block": b, **f})
            print(f"{a:4d} {b:3d} {f['mask_bool'] / GB:6.3f} {f['additive_mask_per_layer'] / GB:15.3f} "
                  f"{f['layer_first'] / GB:8.2f} {f['layer_later'] / GB:8.2f} "
                  f"{f['math_kept_per_layer'] / GB:17.2f} {f['ce_chunk_logits'] / GB:8.2f}")  # fmt: skip
    return out


def print_micro_batch(tokens: int, sequences: int, layers: int) -> dict[str, float]:
    """The published head (`layers` layers, A 512, B 16) on a micro-batch of `sequences` x `tokens`."""
    f = formula(LLAMA_8B, tokens, 512, 16)
    acts = sequences * (f["layer_first"] + (layers - 1) * f["layer_later"]) + layers * weight_cast_bytes(
        LLAMA_8B
    )
    math = sequences * layers * f["math_kept_per_layer"]
    print(f"a {layers}-layer head, A 512, B 16, {sequences} x {tokens} tokens per micro-batch: activations kept "
          f"{acts / GB:.1f} GB (the math kernel would keep {math / GB:.0f} GB more)")  # fmt: skip
    return {"sequences": sequences, "layers": layers, "activations": acts, "math_kept": math}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--anchors", type=int, nargs="+", default=[64, 128, 256, 512])
    ap.add_argument("--blocks", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--layers", type=int, default=1, help="the small head's layers")
    ap.add_argument("--sequences", type=int, default=4, help="sequences per GPU micro-batch (reference: 4)")
    ap.add_argument("--real-layers", type=int, default=5, help="the GPU head's layers (published: 5)")
    ap.add_argument("--math-max-slots", type=int, default=4096, help="force the math kernel up to this S")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = [
        measure(args.tokens, a, b, args.layers, args.math_max_slots)
        for b in args.blocks
        for a in args.anchors
    ]
    print(
        f"stories260K-wide head of {args.layers} layer(s), {args.tokens} tokens, one sequence, bf16 autocast, CPU:"
    )
    print_measured(rows)
    real = print_formula(args.tokens, args.anchors, args.blocks)
    batch = print_micro_batch(args.tokens, args.sequences, args.real_layers)
    result = {
        "tokens": args.tokens,
        "layers": args.layers,
        "measured": rows,
        "small": asdict(STORIES),
        "real": asdict(LLAMA_8B),
    }
    out = REPO_ROOT / "bench_results" / "dflash_memory.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({**result, "formula": real, "micro_batch": batch}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
