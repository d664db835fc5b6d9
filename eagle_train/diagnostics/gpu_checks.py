"""Checks of what only a GPU shows, as functions a GPU check script and a `gpu` test call (they also run on
a CPU, where tests/diagnostics/test_gpu_checks.py runs them small so they cannot rot). Each returns a
JSON-friendly dict with `ok` and the figures behind it.

    bf16_greedy_identity(device)     bf16 tree forwards vs one-token forwards and greedy speculative vs
                                     plain decoding: every difference a near-tie (decoding.identity)
    flash_attention_decoding(device) flash_attention_2 targets decode through sdpa (the tree mask), bit for
                                     bit an sdpa target's, with HF generate on flash itself when installed
    loss_memory(device)              peak memory of the training loss (forward + backward) at Llama-3 sizes,
                                     flat in the number of positions (the chunked CE)

The target is any `TargetConfig` (the GPU check composes conf/target/stories260k.yaml: the device has no
network); the draft head is a seeded random one (a trained head accepts more, which only makes more
rounds, not other rules).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import replace

import torch

from eagle_train.config.decode import DecodeConfig
from eagle_train.config.target import TargetConfig
from eagle_train.data.prompts import load_questions
from eagle_train.decoding.decoder import SpeculativeDecoder
from eagle_train.decoding.identity import classify_answer, classify_divergence
from eagle_train.modeling.draft import DraftHead
from eagle_train.modeling.hf_generate import HFGenerate
from eagle_train.modeling.target import Target, load_target
from eagle_train.training.loss import eagle_loss_sums

NEAR_TIE_ULPS = 4  # as EvaluateConfig.near_tie_ulps
METHODS = {
    "chain": DecodeConfig(method="chain", chain_length=4),
    "static_tree": DecodeConfig(method="static_tree", tree="mc_sim_7b_63"),
    "dynamic_tree": DecodeConfig(method="dynamic_tree", depth=5, top_k=10, total_tokens=60),
}


def random_head(target: Target, seed: int = 0) -> DraftHead:
    torch.manual_seed(seed)
    head = DraftHead.from_target(target.config)
    head.share_target_weights(target)
    return head.to(target.device, target.dtype).eval()


def prompt_ids(target: Target, count: int) -> list[list[int]]:
    """The first `count` TinyStories evaluation prompts, tokenized."""
    return [target.tokenizer(q.turns[0])["input_ids"] for q in load_questions("tinystories", count)]


@torch.inference_mode()
def tree_versus_one_token(target: Target, prompt: list[int], continuation: list[int]) -> dict:
    """Logits of `continuation` after `prompt` from one forward over all of it (a chain verification) and
    from one-token forwards (plain decoding): their largest difference and the argmax flips between them,
    each classified (decoding.identity)."""
    n, q = len(prompt), len(continuation)
    seq = torch.tensor(prompt + continuation, device=target.device)
    cache = _prefilled(target, seq[:n], n + q)
    single = []
    for i in range(n, n + q):
        mask = torch.ones(1, 1, 1, i + 1, dtype=torch.bool, device=target.device)
        logits, _ = target.decode(seq[None, i : i + 1], seq.new_tensor([[i]]), mask, cache)
        cache.advance(1)
        single.append(logits[0, 0])
    single_logits, tree_logits = (
        torch.stack(single).float(),
        _tree_logits(target, prompt, continuation).float(),
    )
    flips = torch.nonzero(single_logits.argmax(-1) != tree_logits.argmax(-1)).flatten().tolist()
    kinds = [
        classify_divergence(
            single_logits[i],
            int(single_logits[i].argmax()),
            int(tree_logits[i].argmax()),
            target.dtype,
            NEAR_TIE_ULPS,
        )["kind"]
        for i in flips
    ]
    return {
        "max_abs_diff": float((single_logits - tree_logits).abs().max()),
        "flips": len(flips),
        "flips_near_tie": kinds.count("near_tie"),
    }


def _causal(n: int, device) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()[None, None]


def _prefilled(target: Target, prompt: torch.Tensor, capacity: int):
    """A cache of `capacity` slots holding the prompt's keys and values."""
    n = prompt.numel()
    cache = target.new_cache(capacity)
    target.decode(prompt[None], torch.arange(n, device=target.device)[None], _causal(n, target.device), cache)
    cache.advance(n)
    return cache


@torch.inference_mode()
def _tree_logits(target: Target, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """Logits [q, vocab] of the continuation from ONE forward after the prompt (a chain's verification)."""
    n, q = len(prompt), len(continuation)
    seq = torch.tensor(prompt + continuation, device=target.device)
    cache = _prefilled(target, seq[:n], n + q)
    mask = torch.cat(
        [torch.ones(q, n, dtype=torch.bool, device=target.device), _causal(q, target.device)[0, 0]], 1
    )
    logits, _ = target.decode(
        seq[None, n:], torch.arange(n, n + q, device=target.device)[None], mask[None, None], cache
    )
    return logits[0]


def answer_kind(target: Target, prompt: list[int], reference: list[int], tokens: list[int]) -> str:
    """identical | near_tie | divergence (decoding.identity.classify_answer)."""
    found = classify_answer(prompt, reference, tokens, target.next_logits, target.dtype, NEAR_TIE_ULPS)
    return "identical" if found is None else found["kind"]


def greedy_identity(target: Target, head: DraftHead, prompts: list[list[int]], max_new_tokens: int) -> dict:
    """Per method: identical / near-tie / real-divergence counts of greedy answers against plain decoding."""
    ar = SpeculativeDecoder(target, None, DecodeConfig(method="ar", max_new_tokens=max_new_tokens))
    references = [ar.generate(p).tokens for p in prompts]
    counts = {}
    for name, cfg in METHODS.items():
        decoder = SpeculativeDecoder(target, head, replace(cfg, max_new_tokens=max_new_tokens))
        kinds = [
            answer_kind(target, p, r, decoder.generate(p).tokens)
            for p, r in zip(prompts, references, strict=True)
        ]
        counts[name] = {kind: kinds.count(kind) for kind in ("identical", "near_tie", "divergence")}
    return counts


def bf16_greedy_identity(
    target_cfg: TargetConfig, device: str = "cuda", prompts: int = 16, max_new_tokens: int = 128
) -> dict:
    """The greedy-identity contract in bf16 on `device`: tree and one-token forwards differ (the premise),
    their argmax flips are all near-ties, and every greedy answer of chain / EAGLE-1 / EAGLE-2 is identical
    to plain decoding or parts from it at a near-tie; ok iff no real divergence anywhere."""
    target = load_target(replace(target_cfg, dtype="bfloat16"), device)
    head = random_head(target)
    ids = prompt_ids(target, prompts)
    ar = SpeculativeDecoder(target, None, DecodeConfig(method="ar", max_new_tokens=61))
    forwards = [tree_versus_one_token(target, p, ar.generate(p).tokens[:60]) for p in ids]
    identity = greedy_identity(target, head, ids, max_new_tokens)
    flips = sum(f["flips"] for f in forwards)
    near = sum(f["flips_near_tie"] for f in forwards)
    return {
        "device": str(target.device),
        "tree_vs_one_token_max_abs_diff": max(f["max_abs_diff"] for f in forwards),
        "argmax_flips": flips,
        "argmax_flips_near_tie": near,
        "greedy": identity,
        "ok": near == flips and all(c["divergence"] == 0 for c in identity.values()),
    }


def flash_attention_decoding(target_cfg: TargetConfig, device: str = "cuda") -> dict:
    """A flash_attention_2 target decodes through sdpa: `decode_attention`, tree-forward logits equal to an
    sdpa target's bit for bit, greedy EAGLE-2 equal to plain decoding up to near-ties, and (with flash_attn
    installed) HF generate running on flash itself. Without flash_attn the implementation is set on the
    loaded model (`emulated`: the fallback is checked, the flash kernel is not)."""
    cfg = target_cfg
    dtype = "bfloat16" if torch.device(device).type == "cuda" else cfg.dtype
    sdpa = load_target(replace(cfg, dtype=dtype, attn_implementation="sdpa"), device)
    emulated = importlib.util.find_spec("flash_attn") is None or torch.device(device).type != "cuda"
    if emulated:
        flash = load_target(replace(cfg, dtype=dtype, attn_implementation="sdpa"), device)
        flash.model.config._attn_implementation = "flash_attention_2"
    else:
        flash = load_target(replace(cfg, dtype=dtype, attn_implementation="flash_attention_2"), device)
    prompt = prompt_ids(flash, 1)[0]
    continuation = (
        SpeculativeDecoder(sdpa, None, DecodeConfig(method="ar", max_new_tokens=24)).generate(prompt).tokens
    )
    same = [_tree_logits(t, prompt, continuation) for t in (sdpa, flash)]
    head = random_head(flash)
    dynamic_tree = replace(METHODS["dynamic_tree"], max_new_tokens=64)
    ar_tokens = SpeculativeDecoder(flash, None, replace(dynamic_tree, method="ar")).generate(prompt).tokens
    spec_tokens = SpeculativeDecoder(flash, head, dynamic_tree).generate(prompt).tokens
    result = {
        "emulated": emulated,
        "decode_attention": flash.decode_attention,
        "restored": flash.attention == "flash_attention_2",
        "tree_logits_equal_sdpa": bool(torch.equal(same[0], same[1])),
        "dynamic_tree_vs_ar": answer_kind(flash, prompt, ar_tokens, spec_tokens),
    }
    if not emulated:
        result["hf_generate_tokens"] = len(
            HFGenerate(flash, replace(dynamic_tree, method="hf")).generate(prompt).tokens
        )
    result["ok"] = (
        result["decode_attention"] == "sdpa"
        and result["restored"]
        and result["tree_logits_equal_sdpa"]
        and result["dynamic_tree_vs_ar"] != "divergence"
        and result.get("hf_generate_tokens", 1) > 0
    )
    return result


def peak_memory_bytes(fn: Callable[[], None], device: torch.device | str) -> int:
    """Peak bytes allocated by torch while `fn` runs, above what was allocated before: the CUDA allocator's
    peak on a GPU; on a CPU the allocator's own events through the profiler (deterministic)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    for event in prof.profiler.kineto_results.events():
        if event.name() == "[memory]":
            live += event.nbytes()
            peak = max(peak, live)
    return peak


def loss_peak(positions: int, vocab: int, hidden: int, device, weight_dtype: torch.dtype, chunk=None) -> int:
    """Peak bytes of one loss forward + backward over `positions` masked positions (inputs excluded)."""
    g = torch.Generator(device=device).manual_seed(0)
    pred = torch.randn(1, positions, hidden, generator=g, device=device, requires_grad=True)
    target = torch.randn(1, positions, hidden, generator=g, device=device)
    weight = (torch.randn(vocab, hidden, generator=g, device=device) / hidden**0.5).to(weight_dtype)
    ids = torch.randint(0, vocab, (1, positions), generator=g, device=device)
    mask = torch.ones(1, positions, dtype=torch.bool, device=device)

    def step() -> None:
        sums = eagle_loss_sums(pred, target, weight, ids, mask, chunk=chunk)
        (sums["smooth_l1"] + 0.1 * sums["ce"]).backward()

    return peak_memory_bytes(step, device)


def loss_memory(
    device: str = "cuda",
    vocab: int = 128_256,
    hidden: int = 4096,
    lengths: tuple[int, ...] = (2048, 8192, 32768),
    weight_dtype: torch.dtype = torch.bfloat16,
    chunk: int | None = None,
) -> dict:
    """Peak memory of the loss at Llama-3-8B sizes (vocabulary 128256, hidden 4096, the LM head in bf16)
    for growing numbers of masked positions. ok iff it grows by at most a few [positions, hidden] float32
    tensors (no [positions, vocab] one: at 32768 positions that alone is 16.8 GB in float32)."""
    rows = [
        {"positions": n, "peak_bytes": loss_peak(n, vocab, hidden, device, weight_dtype, chunk)}
        for n in lengths
    ]
    growth = rows[-1]["peak_bytes"] - rows[0]["peak_bytes"]
    span = lengths[-1] - lengths[0]
    return {
        "vocab": vocab,
        "hidden": hidden,
        "rows": rows,
        "growth_bytes_per_position": growth / span,
        "one_shot_bytes_per_position": 4 * vocab,  # one [positions, vocab] float32 tensor, of several
        "ok": growth <= 16 * span * hidden * 4,
    }
