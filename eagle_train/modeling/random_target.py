"""Random-weight Llama targets of real shapes, for measuring speed and memory (which do not depend on the
weights) without downloading a model: built in memory on any device, or saved as a sharded checkpoint.

    python -m eagle_train.modeling.random_target OUT --shape llama-1b-32k [--layers 8] [--shard-mb 500]

Shapes: `llama-3-8b` (Llama-3-8B: 32 layers, d 4096, GQA 32/8, MLP 14336, vocab 128256), `llama-1b-32k`
(Llama-3.2-1B's layers with a 32000 vocabulary: 16 layers, d 2048, GQA 32/8, MLP 8192, untied: 1.1B
parameters), `tiny` (4 layers, the fewest an EAGLE-3 head's three distinct feature layers take at their
default spread; d 64: the same code in a test). The tokenizer is the shipped stories260K's
(the ids these benchmarks feed are random, below its vocabulary).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eagle_train.config.base import data_path

SHAPES = {
    "llama-3-8b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
        tie_word_embeddings=False,
    ),
    "llama-1b-32k": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096, rope_theta=500000.0,
        tie_word_embeddings=False,
    ),
    "tiny": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024, tie_word_embeddings=False,
    ),
}  # fmt: skip
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json")


def llama_config(shape: str, num_layers: int | None = None) -> LlamaConfig:
    """The config of a named shape (`num_layers` overrides its depth)."""
    fields = dict(SHAPES[shape])
    if num_layers is not None:
        fields["num_hidden_layers"] = num_layers
    return LlamaConfig(**fields, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5)


@torch.no_grad()
def random_llama(
    config: LlamaConfig, dtype: torch.dtype = torch.bfloat16, device: str = "cpu", seed: int = 0
) -> LlamaForCausalLM:
    """A LlamaForCausalLM with random weights (normal, std = initializer_range; norms 1), made directly on
    `device` in `dtype` (no float32 copy on the host first), frozen and in eval mode."""
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval().requires_grad_(False)


def save_random_llama(
    out_dir: str | Path,
    config: LlamaConfig,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_size: str = "500MB",
    seed: int = 0,
) -> Path:
    """Save a random target as a sharded safetensors checkpoint (model.safetensors.index.json + shards)
    with the shipped tokenizer, loadable as `target.path=OUT`."""
    out_dir = Path(out_dir)
    model = random_llama(config, dtype, "cpu", seed)
    model.save_pretrained(out_dir, max_shard_size=max_shard_size)
    for name in TOKENIZER_FILES:
        source = data_path("models/stories260K") / name
        if source.is_file():
            shutil.copyfile(source, out_dir / name)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--shape", default="llama-1b-32k", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--shard-mb", type=int, default=500)
    args = parser.parse_args(argv)
    config = llama_config(args.shape, args.layers)
    save_random_llama(args.out, config, max_shard_size=f"{args.shard_mb}MB")
    print(f"wrote {args.out}: {args.shape}, {config.num_hidden_layers} layers")


if __name__ == "__main__":
    main()
