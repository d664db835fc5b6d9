"""How to decode: the method (autoregressive, HF generate, chain, EAGLE-1 tree, EAGLE-2 tree) and sampling."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from eagle_train.config.base import CONF_DIR

METHODS = ("ar", "hf", "chain", "static_tree", "dynamic_tree")
PLAIN_METHODS = ("ar", "hf")  # plain decoding: one target forward per token, no head
SPECULATIVE = ("chain", "static_tree", "dynamic_tree")
# the tree methods' former names (EAGLE-1's static tree, EAGLE-2's dynamic one), still accepted as input;
# results, reports and choices are written under the new names
METHOD_ALIASES = {"eagle1": "static_tree", "eagle2": "dynamic_tree"}
SHAPES = ("auto", "fixed")
AUTO_TREE_BASE = "mc_sim_7b_63"  # decode.tree=auto prunes this tree, extended by the draft's top-1 chain
# Each method's shape fields and their defaults: a field left null is chosen under decode.shape=auto, else
# takes its default here (null, not the default value, is what "not given" means: decode.depth=5 pins it).
SHAPE_DEFAULTS = {"chain": {"chain_length": 4}, "dynamic_tree": {"depth": 5, "top_k": 10, "total_tokens": 60}}


@dataclass
class DecodeConfig:
    """One decoding setup for `eagle_train.decoding.decoder.SpeculativeDecoder` (batch size 1)."""

    method: str = "dynamic_tree"  # ar (plain decoding, same cache code) | hf (HF generate) | chain | static_tree | dynamic_tree
    # auto: the chain length and the EAGLE-2 depth / top_k / total_tokens left null are chosen where they
    # decode fastest here, from measured costs and acceptance (eagle_train.autotune.shapes; the evaluate stage
    # resolves them before decoding); a method with one of its fields given keeps the fields it was given
    # and the defaults for the rest (decode.depth=5: EAGLE-2 as 5 / 10 / 60, the chain still chosen) | fixed:
    # the fields as given, null ones at their defaults (chain 4; EAGLE-2 depth 5, top_k 10, 60 tokens)
    shape: str = "fixed"
    chain_length: int | None = None  # chain: draft tokens per round (null: 4, or chosen by decode.shape=auto)
    # static_tree: name of a conf/tree/<name>.yaml file (or a YAML path), or auto: mc_sim_7b_63 plus the draft's
    # top-1 chain (and its second-best children) to depth 9, pruned to the nodes accepted most often, as many
    # as decode fastest here (eagle_train.autotune.shapes, resolved by the evaluate stage)
    tree: str = "mc_sim_7b_63"
    tree_paths: Any = (
        None  # static_tree: explicit rank paths; null = read from `tree` when the config is made
    )
    # dynamic_tree (null: the default, or chosen by decode.shape=auto): draft forwards per round after the first
    # (tree depth = depth + 1; default 5), nodes expanded per depth and children kept per node (default 10),
    # tree size including the root (default 60)
    depth: int | None = None
    top_k: int | None = None
    total_tokens: int | None = None
    temperature: float = 0.0  # 0 = greedy; > 0 = sampling with lossless verification
    top_p: float = 1.0  # nucleus sampling mass (1.0 = off)
    top_k_sampling: int = 0  # sample among the k most likely tokens (0 = off)
    # chain/static_tree when sampling: draw children from the draft's q (True, as the reference's EAGLE-1) or take
    # its top-k (False); both lossless. Measured (scripts/bench_sampling.py, stories260K, trained head): tau
    # +4-11% at temperature 0.7 and +19-25% at 1.0 with children drawn from q, chain and EAGLE-1 trees alike
    sample_children: bool = True
    max_new_tokens: int = 128  # generated tokens at most (the stop token included)
    stop_strings: list[str] = field(default_factory=list)  # stop once the generated text contains one
    seed: int = 0  # seed of the decoder's torch.Generator (sampling)
    lean_draft: bool = True  # run the draft head through decoding.lean_draft (same numbers, less overhead)

    def __post_init__(self) -> None:
        self.method = method_name(self.method)
        if self.method not in METHODS:
            raise ValueError(f"decode.method must be one of {METHODS}, got {self.method!r}")
        if self.shape not in SHAPES:
            raise ValueError(f"decode.shape must be one of {SHAPES}, got {self.shape!r}")
        for fields in SHAPE_DEFAULTS.values():  # fixed, or one field given: the method's shape is set
            if self.shape == "fixed" or any(getattr(self, name) is not None for name in fields):
                for name, default in fields.items():
                    if getattr(self, name) is None:
                        setattr(self, name, default)
        if self.temperature < 0:
            raise ValueError(f"decode.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"decode.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k_sampling < 0 or self.max_new_tokens < 1 or _below(self.chain_length, 1):
            raise ValueError("decode.top_k_sampling must be >= 0, max_new_tokens and chain_length >= 1")
        if _below(self.depth, 1) or _below(self.top_k, 1):
            raise ValueError(f"decode.depth and decode.top_k must be >= 1, got {self.depth}, {self.top_k}")
        if _below(self.total_tokens, 2):
            raise ValueError(f"decode.total_tokens must be >= 2 (root + one draft), got {self.total_tokens}")
        if self.method == "static_tree" and (self.tree != "auto" or self.tree_paths is not None):
            # the tree file is read here, once, never by the decoder
            paths = self.tree_paths if self.tree_paths is not None else load_tree_paths(self.tree)
            self.tree_paths = [[int(r) for r in p] for p in paths]

    @property
    def speculative(self) -> bool:
        return self.method in SPECULATIVE

    @property
    def auto_methods(self) -> tuple[str, ...]:
        """The methods whose shape is chosen from measured costs: chain and dynamic_tree under decode.shape=auto,
        each unless one of its shape fields was given (even at its default value); static_tree under
        decode.tree=auto (until its tree_paths are given)."""
        auto = [m for m, fields in SHAPE_DEFAULTS.items() if all(getattr(self, n) is None for n in fields)]
        if self.tree == "auto" and self.tree_paths is None:
            auto.append("static_tree")
        return tuple(auto)


def block_chain_length(chain_length: int, block_size: int) -> int:
    """The draft tokens a chain of `chain_length` takes from a block of `block_size` (a DFlash head: slot 0
    is the verified token, so at most the B - 1 mask slots). The one home of that rule (the built-in
    decoder's `chain_depth`, vLLM's `num_speculative_tokens`, the speculators format's K)."""
    return min(int(chain_length), int(block_size) - 1)


def method_name(name: str) -> str:
    """A decode method's name, a former name (METHOD_ALIASES) given as the current one."""
    return METHOD_ALIASES.get(name, name)


def _below(value: int | None, least: int) -> bool:
    """A given shape field below its least value (null: not given, chosen later)."""
    return value is not None and value < least


def load_tree_paths(name: str) -> list[list[int]]:
    """Rank paths of the shipped tree `conf/tree/<name>.yaml` (or of a YAML file path)."""
    path = CONF_DIR / "tree" / f"{name}.yaml"
    if not path.is_file():
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
