"""How to decode: the method (autoregressive, HF generate, chain, EAGLE-1 tree, EAGLE-2 tree) and sampling."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import OmegaConf

from eagle_train.config.base import CONF_DIR

METHODS = ("ar", "hf", "chain", "eagle1", "eagle2")
SPECULATIVE = ("chain", "eagle1", "eagle2")


@dataclass
class DecodeConfig:
    """One decoding setup for `eagle_train.spec.decoder.SpeculativeDecoder` (batch size 1)."""

    method: str = (
        "eagle2"  # ar (plain decoding, same cache code) | hf (HF generate) | chain | eagle1 | eagle2
    )
    chain_length: int = 4  # chain: draft tokens per round
    tree: str = "mc_sim_7b_63"  # eagle1: name of a conf/tree/<name>.yaml file
    tree_paths: Any = None  # eagle1: explicit list of rank paths (overrides `tree`)
    depth: int = 5  # eagle2: draft forwards per round after the first (tree depth = depth + 1)
    top_k: int = 10  # eagle2: nodes expanded per depth and children kept per node
    total_tokens: int = 60  # eagle2: tree size including the root
    temperature: float = 0.0  # 0 = greedy; > 0 = sampling with lossless verification
    top_p: float = 1.0  # nucleus sampling mass (1.0 = off)
    top_k_sampling: int = 0  # sample among the k most likely tokens (0 = off)
    sample_children: bool = False  # chain/eagle1 when sampling: draw children from q (True) or take top-k
    max_new_tokens: int = 128  # generated tokens at most (the stop token included)
    stop_strings: list[str] = field(default_factory=list)  # stop once the generated text contains one
    seed: int = 0  # seed of the decoder's torch.Generator (sampling)
    lean_draft: bool = True  # run the draft head through spec.lean_draft (same numbers, less overhead)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"decode.method must be one of {METHODS}, got {self.method!r}")
        if self.temperature < 0:
            raise ValueError(f"decode.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"decode.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k_sampling < 0 or self.max_new_tokens < 1 or self.chain_length < 1:
            raise ValueError("decode.top_k_sampling must be >= 0, max_new_tokens and chain_length >= 1")
        if self.depth < 1 or self.top_k < 1:
            raise ValueError(f"decode.depth and decode.top_k must be >= 1, got {self.depth}, {self.top_k}")
        if self.total_tokens < 2:
            raise ValueError(f"decode.total_tokens must be >= 2 (root + one draft), got {self.total_tokens}")

    @property
    def speculative(self) -> bool:
        return self.method in SPECULATIVE

    def static_paths(self) -> list[list[int]]:
        """The static tree of `chain` / `eagle1` as rank paths."""
        if self.method == "chain":
            return [[0] * k for k in range(1, self.chain_length + 1)]
        if self.tree_paths is not None:
            return [[int(r) for r in p] for p in self.tree_paths]
        return load_tree_paths(self.tree)


def load_tree_paths(name: str) -> list[list[int]]:
    """Rank paths of the shipped tree `conf/tree/<name>.yaml` (or of a YAML file path)."""
    path = CONF_DIR / "tree" / f"{name}.yaml"
    if not path.is_file():
        from pathlib import Path

        path = Path(name)
    if not path.is_file():
        shipped = sorted(p.stem for p in (CONF_DIR / "tree").glob("*.yaml"))
        raise FileNotFoundError(
            f"tree {name!r}: no conf/tree/{name}.yaml (shipped: {shipped}) and no such file"
        )
    data = OmegaConf.to_container(OmegaConf.load(path))
    paths = data.get("paths") if isinstance(data, dict) else None
    if not isinstance(paths, list) or not all(isinstance(p, list) for p in paths):
        raise ValueError(f"{path}: expected a `paths:` list of lists of child ranks")
    return [[int(r) for r in p] for p in paths]
