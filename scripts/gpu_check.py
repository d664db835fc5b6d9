"""The GPU check: one command, one JSON, everything a real 8B run depends on that a 260K CPU model hides.

    python scripts/gpu_check.py                  # CUDA, a random Llama-3-8B-shaped target in bf16 (< 8 min, H200)
    python scripts/gpu_check.py --cpu --tiny     # the same code on a tiny shape on the CPU (tests/test_gpu_check.py)

The target is made on the device with random weights (eagle_train.modeling.random_target: 32 layers,
d 4096, GQA 32/8, MLP 14336, vocab 128256; speed and memory do not depend on the weights, nothing is
downloaded); its config, tokenizer (stories260K's, the ids fed are random) and its embedding and LM head
(the only tensors offline training reads) are saved to a temporary directory. Sections:

    extraction   tokens/s of extraction (bf16 and fp8 stores, written as `python -m eagle_train.extract`
                 writes them) against the bare target forward over the same batches (goal >= 80%)
    training     tokens/s and peak memory (GPU: torch.cuda.max_memory_allocated, also less the resident
                 random target's bytes; CPU: VmHWM) of offline training (`eagle_train.train.run`, bf16
                 mixed precision on the GPU, DataLoader workers) of an EAGLE-1 head (`training`) and an
                 EAGLE-3 head (`training_eagle3`: three aux states per token, the default unroll) on a
                 store of random features of the target's width
    decoding     per round of ar / chain / EAGLE-1 (mc_sim_7b_63) / EAGLE-2 (60 tokens, depth 5, top-k 10):
                 wall ms, draft ms and verify ms (the decoder's own timers), with a seeded random head
    checks       eagle_train.diagnostics.gpu_checks on stories260K: bf16 greedy identity (near-ties only),
                 flash-attention targets decoding through sdpa, the loss's peak memory flat in the positions

Prints the JSON and writes it to --out (default bench_results/gpu_check.json, or gpu_check_cpu_tiny.json).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_extract import Tokenized, bare_forward, extract_once  # noqa: E402

from eagle_train.cli import compose  # noqa: E402
from eagle_train.config.base import CONF_DIR, data_path, to_schema  # noqa: E402
from eagle_train.config.decode import DecodeConfig  # noqa: E402
from eagle_train.config.extract import ExtractConfig  # noqa: E402
from eagle_train.config.target import TargetConfig  # noqa: E402
from eagle_train.config.train import TrainConfig  # noqa: E402
from eagle_train.data.sharegpt import DropReport  # noqa: E402
from eagle_train.decoding.decoder import SpeculativeDecoder  # noqa: E402
from eagle_train.diagnostics import gpu_checks  # noqa: E402
from eagle_train.modeling.random_target import TOKENIZER_FILES, llama_config, random_llama  # noqa: E402
from eagle_train.modeling.target import Target, load_target_config, load_tokenizer  # noqa: E402
from eagle_train.store.synthetic import write_random_store  # noqa: E402
from eagle_train.train import run as train  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
SIZES = {  # per shape: extraction conversations and lengths, training steps, decode prompts / tokens
    "llama-3-8b": dict(conversations=96, min_len=256, max_len=2048, steps=30, prompts=4, new_tokens=96),
    "tiny": dict(conversations=24, min_len=16, max_len=96, steps=4, prompts=2, new_tokens=24),
}
DECODE = {
    "ar": DecodeConfig(method="ar"),
    "chain": DecodeConfig(method="chain", chain_length=4),
    "static_tree": DecodeConfig(method="static_tree", tree="mc_sim_7b_63"),
    "dynamic_tree": DecodeConfig(method="dynamic_tree", depth=5, top_k=10, total_tokens=60),
}


def make_target(shape: str, device: str, work: Path) -> Target:
    """A random target of `shape` made on `device` in bf16, its config, tokenizer, embedding and LM head
    saved under `work` (what offline training and the store's identity read). Its stop tokens' LM head
    rows are zeroed, so greedy decoding of random weights never stops early."""
    model = random_llama(llama_config(shape), torch.bfloat16, device)
    target_dir = work / "target"
    model.config.save_pretrained(target_dir)
    for name in TOKENIZER_FILES:
        if (data_path("models/stories260K") / name).is_file():
            shutil.copyfile(data_path("models/stories260K") / name, target_dir / name)
    cfg = TargetConfig(name=f"random-{shape}", path=str(target_dir), dtype="bfloat16")
    target = Target(model=model, tokenizer=load_tokenizer(cfg), cfg=cfg, source=str(target_dir))
    with torch.no_grad():
        for i in target.stop_token_ids:
            model.get_output_embeddings().weight[i] = 0
    frozen = {
        "model.embed_tokens.weight": target.embed_tokens.weight,
        "lm_head.weight": target.lm_head.weight,
    }
    save_file(
        {k: v.detach().cpu().contiguous() for k, v in frozen.items()}, str(target_dir / "model.safetensors")
    )
    return target


def random_rows(target: Target, size: dict) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(
        size["min_len"], size["max_len"] + 1, (size["conversations"],), generator=generator
    )
    return [
        {
            "id": f"random_{i}",
            "input_ids": torch.randint(3, target.vocab_size, (int(n),), generator=generator).tolist(),
            "loss_mask": [1] * int(n),
        }
        for i, n in enumerate(lengths)
    ]


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def extraction(target: Target, size: dict, repeats: int = 2) -> dict:
    """Tokens/s of extraction (bf16, fp8) against the bare forward over the same batches, interleaved."""
    rows = random_rows(target, size)
    data = Tokenized(rows, DropReport(), "synthetic", size["max_len"], {"name": "random", "sha256": "random"})
    cfg = ExtractConfig(target=target.cfg, progress=False)
    tokens = sum(data.lengths)
    seconds = {"bare forward": [], "extract bf16": [], "extract fp8": []}
    bare_forward(cfg, target, data)  # warm-up (kernels, allocator)
    for _ in range(repeats):
        seconds["bare forward"].append(bare_forward(cfg, target, data))
        for dtype in ("bfloat16", "fp8"):
            took, store_dir = extract_once(replace(cfg, dtype=dtype), target, data, False)
            seconds["extract bf16" if dtype == "bfloat16" else "extract fp8"].append(took)
            shutil.rmtree(store_dir)
    rates = {name: tokens / statistics.median(s) for name, s in seconds.items()}
    return {
        "conversations": len(rows),
        "tokens": tokens,
        "tokens_per_s": rates,
        "extract_vs_bare_forward": rates["extract bf16"] / rates["bare forward"],
        "fp8_vs_bare_forward": rates["extract fp8"] / rates["bare forward"],
        "goal_met": rates["extract bf16"] >= 0.8 * rates["bare forward"],
    }


def peak_host_mb() -> float:
    status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
    return int(status["VmHWM"].split()[0]) / 1024


def training(target: Target, size: dict, device: str, work: Path, head: str) -> dict:
    """Offline training of an EAGLE-1 or EAGLE-3 head on random features of the target's width (EAGLE-3:
    its three aux states too): tokens/s and peak memory."""
    lengths = [int(len(r["input_ids"])) for r in random_rows(target, size)]
    aux_layers = target.aux_layers if head == "eagle3" else None
    store = write_random_store(
        work / f"store-{head}", target, load_target_config(target.cfg), lengths, aux_layers=aux_layers
    )
    steps = size["steps"]
    overrides = [
        f"target.path={target.cfg.path}",
        f"target.name={target.cfg.name}",
        "target.dtype=bfloat16",
        f"draft.type={head}",
        f"features={store}",
        f"out_dir={work / f'train-{head}'}",
        f"max_steps={steps}",
        f"log_every={max(steps // 3, 1)}",
        "eval_every=0",
        "save_every=0",
        "eval_max_samples=8",
        "optim.warmup_steps=1",
        "progress=false",
        "data.eval_fraction=0.1",
    ]
    cfg = to_schema(compose("train", overrides=overrides), TrainConfig)
    resident = 0
    if device == "cuda":  # the random target stays resident; the head's own peak is what lies above it
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        resident = torch.cuda.memory_allocated()
    start = time.perf_counter()
    train(cfg)
    seconds = time.perf_counter() - start
    lines = [json.loads(x) for x in (work / f"train-{head}" / "metrics.jsonl").read_text().splitlines()]
    rates = [m["tokens_per_s"] for m in lines if "tokens_per_s" in m]
    return {
        "head": head,
        "steps": steps,
        "max_tokens": cfg.max_tokens,
        "max_batch_size": cfg.max_batch_size,
        "tokens_per_s_by_window": rates,
        "tokens_per_s": rates[-1] if rates else None,  # the last window: past the first step's warm-up
        "seconds": seconds,
        "peak_gpu_mb": torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None,
        "peak_gpu_mb_above_resident_target": (
            (torch.cuda.max_memory_allocated() - resident) / 2**20 if device == "cuda" else None
        ),
        "peak_host_mb": peak_host_mb(),
    }


def decoding(target: Target, size: dict, device: str) -> dict:
    """Per round of each method: wall, draft and verify milliseconds (the decoder's timers)."""
    head = gpu_checks.random_head(target)
    generator = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(3, target.vocab_size, (64,), generator=generator).tolist()
        for _ in range(size["prompts"])
    ]
    out = {}
    for name, cfg in DECODE.items():
        decoder = SpeculativeDecoder(
            target, None if name == "ar" else head, replace(cfg, max_new_tokens=size["new_tokens"])
        )
        decoder.generate(prompts[0])  # warm-up
        synchronize(device)
        runs = [decoder.generate(p).stats for p in prompts]
        synchronize(device)
        rounds = sum(max(s.rounds, 1) if name != "ar" else s.new_tokens for s in runs)
        total = sum(s.time_total - s.time_prefill for s in runs)
        out[name] = {
            "rounds": rounds,
            "ms_per_round": 1e3 * total / rounds,
            "draft_ms_per_round": 1e3 * sum(s.time_draft for s in runs) / rounds,
            "verify_ms_per_round": 1e3 * sum(s.time_verify for s in runs) / rounds,
            "tokens_per_s": sum(s.new_tokens for s in runs) / sum(s.time_total for s in runs),
            "tau": statistics.mean(s.tau for s in runs),
        }
    return out


def project_checks(device: str, tiny: bool) -> dict:
    """eagle_train.diagnostics.gpu_checks on stories260K (small on the CPU, as
    tests/diagnostics/test_gpu_checks.py runs them)."""
    stories = to_schema(OmegaConf.load(CONF_DIR / "target" / "stories260k.yaml"), TargetConfig)
    if tiny:
        identity = gpu_checks.bf16_greedy_identity(stories, device, prompts=1, max_new_tokens=24)
        memory = gpu_checks.loss_memory(
            device, vocab=2048, hidden=32, lengths=(256, 2048), weight_dtype=torch.float32, chunk=64
        )
    else:
        identity, memory = gpu_checks.bf16_greedy_identity(stories, device), gpu_checks.loss_memory(device)
    return {
        "bf16_greedy_identity": identity,
        "flash_attention_decoding": gpu_checks.flash_attention_decoding(stories, device),
        "loss_memory": memory,
    }


def target_sections(target: Target, size: dict, device: str, work: Path) -> dict:
    """The extraction, training and decoding sections on the random target, each with its own seconds."""
    sections = {}
    for name, fn in (
        ("extraction", lambda: extraction(target, size)),
        ("training", lambda: training(target, size, device, work, "eagle1")),
        ("training_eagle3", lambda: training(target, size, device, work, "eagle3")),
        ("decoding", lambda: decoding(target, size, device)),
    ):
        start = time.perf_counter()
        sections[name] = {**fn(), "section_seconds": time.perf_counter() - start}
    return sections


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (default: CUDA)")
    parser.add_argument("--tiny", action="store_true", help="a tiny shape instead of Llama-3-8B's")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device = "cpu" if args.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device (use --cpu --tiny to run the same code on the CPU)")
    if device == "cpu":
        torch.set_num_threads(1)
    shape = "tiny" if args.tiny else "llama-3-8b"
    size = SIZES[shape]
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "shape": shape}
    result["torch"] = torch.__version__
    sections = {}
    try:
        start = time.perf_counter()
        target = make_target(shape, device, work)
        sections["target"] = {
            "config": {
                k: getattr(target.config, k)
                for k in ("num_hidden_layers", "hidden_size", "num_key_value_heads", "vocab_size")
            },
            "seconds": time.perf_counter() - start,
        }
        sections.update(target_sections(target, size, device, work))
        del target  # the checks load their own
        if device == "cuda":
            torch.cuda.empty_cache()
        start = time.perf_counter()
        sections["checks"] = {
            **project_checks(device, args.tiny),
            "section_seconds": time.perf_counter() - start,
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result.update(sections)
    result["ok"] = all(c["ok"] for k, c in sections["checks"].items() if isinstance(c, dict) and "ok" in c)
    name = (
        "gpu_check.json"
        if device == "cuda" and not args.tiny
        else f"gpu_check_{device}{'_tiny' if args.tiny else ''}.json"
    )
    out = Path(args.out) if args.out else REPO_ROOT / "bench_results" / name
    out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(result, indent=2, default=str)
    out.write_text(text + "\n")
    print(text)
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
