"""The import direction of docs/ARCHITECTURE.md, checked on the source of every module (ast, nothing imported).

Layers, bottom up; a module imports only its own layer and those below, and the third-party libraries
its layer allows:
  0 foundation   config/*, files, lock, allocator        stdlib, omegaconf
  1 pure cores   loss, logits, metrics, kv_cache, unroll, cod, vocab, decoding/*, report, report_engines, data/batching,
                 data/jsonl, data/templates
                                                         + torch, numpy (report: matplotlib)
  2 adapters     modeling/* (the only transformers importers), the rest of data/* (the only datasets
                 importers besides stages), store/* (the feature store), engines/* (a serving engine in
                 its own environment; engines/vllm_worker runs there: stdlib + vllm only, and
                 engines/vllm_extract_worker: stdlib + vllm + vLLM's own torch and safetensors)   + safetensors
  3 stage pieces training/*, checks                     torch only (accelerate objects come in as arguments)
  4 stages       extract, train, evaluate, regenerate, export, pipeline, entry (the Hydra edge): the only
                 importers of hydra, accelerate, deepspeed, wandb; nothing imports a stage but `entry`.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "eagle_train"
STAGES = {"extract", "train", "evaluate", "regenerate", "export", "pipeline"}
# module (or package prefix) -> layer; the first matching prefix wins, so list specific names first
LAYERS: list[tuple[str, int]] = [
    ("config", 0),
    ("files", 0),
    ("lock", 0),
    ("allocator", 0),
    ("loss", 1),
    ("logits", 1),
    ("metrics", 1),
    ("kv_cache", 1),
    ("unroll", 1),
    ("cod", 1),
    ("vocab", 1),
    ("decoding", 1),
    ("report_engines", 1),
    ("report_shapes", 1),
    ("report", 1),
    ("data.batching", 1),
    ("data.jsonl", 1),
    ("data.templates", 1),
    ("data", 2),
    ("modeling", 2),
    ("engines", 2),
    ("store", 2),
    ("training", 3),
    ("checks", 3),
    ("entry", 4),
    *((stage, 4) for stage in sorted(STAGES)),
]
THIRD_PARTY = {
    0: {"omegaconf"},
    1: {"torch", "numpy"},
    2: {"torch", "numpy", "safetensors"},
    3: {"torch", "numpy"},
    4: {"torch", "numpy", "safetensors", "hydra", "accelerate", "deepspeed", "wandb", "tqdm", "omegaconf"},
}
EXTRA = {
    "report": {"matplotlib"},
    "report_engines": {"matplotlib"},
    "report_shapes": {"matplotlib"},
    "engines.vllm_worker": {"vllm"},  # runs in vLLM's own environment (checked below: nothing else)
    "engines.vllm_extract_worker": {"vllm"},  # likewise, with vLLM's torch and safetensors
    "modeling": {"transformers"},
    "data": {"datasets"},
    "extract": {"datasets"},
}


def _modules() -> dict[str, set[str]]:
    """module name (relative to the package, "" for the package itself) -> imported names (dotted)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).with_suffix("")
        name = ".".join(p for p in rel.parts if p != "__init__")
        imports: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                imports.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                imports.add(node.module)
            elif isinstance(node, ast.ImportFrom) and node.level > 0:
                raise AssertionError(f"{path}: relative import; use absolute eagle_train.* imports")
        found[name] = imports
    return found


def _matches(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def layer_of(module: str) -> int | None:
    """The layer of a package module (None: the package root and subpackage markers)."""
    return next((layer for prefix, layer in LAYERS if _matches(module, prefix)), None)


def _extra(module: str) -> set[str]:
    return set().union(*(libs for prefix, libs in EXTRA.items() if _matches(module, prefix)))


MODULES = _modules()


def test_every_module_has_a_layer():
    unplaced = [m for m in MODULES if m and layer_of(m) is None and m not in {"data", "decoding", "modeling"}]
    assert not unplaced, (
        f"modules with no layer in tests/test_layering.py (and docs/ARCHITECTURE.md): {unplaced}"
    )


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m))
def test_imports_point_down(module):
    own = layer_of(module)
    if own is None:
        return
    for imp in MODULES[module]:
        parts = imp.split(".")
        if parts[0] == "eagle_train" and len(parts) > 1:
            target = ".".join(parts[1:])
            if parts[1] in STAGES:
                raise AssertionError(f"eagle_train.{module} imports the stage module {imp}")
            target_layer = layer_of(target)
            assert target_layer is not None and target_layer <= own, (
                f"eagle_train.{module} (layer {own}) imports {imp} (layer {target_layer}): imports point down only"
            )
            if target == "entry":
                assert module in STAGES, (
                    f"only stage modules use the Hydra edge; eagle_train.{module} imports it"
                )
        elif parts[0] not in sys.stdlib_module_names and parts[0] != "__future__":
            allowed = THIRD_PARTY[own] | _extra(module)
            assert parts[0] in allowed, (
                f"eagle_train.{module} (layer {own}) imports {imp}; its layer allows {sorted(allowed)}"
            )


def test_the_root_shim_only_calls_the_train_stage():
    tree = ast.parse((PACKAGE.parent / "train.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported == {"eagle_train.train"}


@pytest.mark.parametrize(
    "worker, allowed",
    [("engines.vllm_worker", {"vllm"}), ("engines.vllm_extract_worker", {"vllm", "torch", "safetensors"})],
)
def test_the_vllm_workers_import_only_what_vllm_s_environment_has(worker, allowed):
    """They run in vLLM's own environment, where this package is not installed (torch and safetensors
    there are vLLM's own)."""
    imports = _modules()[worker]
    bad = sorted(
        i for i in imports if i.split(".")[0] not in sys.stdlib_module_names | allowed | {"__future__"}
    )
    assert not bad, f"eagle_train.{worker} imports {bad}"
