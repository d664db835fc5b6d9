"""The import direction of docs/ARCHITECTURE.md, checked on the source (ast, nothing imported)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "eagle_train"
STAGES = {"extract", "train", "evaluate", "regenerate", "export", "pipeline"}
ORCHESTRATION = {"hydra", "accelerate", "deepspeed", "wandb"}
PURE_CORES = ("config", "spec", "loss", "metrics", "kv_cache", "data.batching")


def _modules() -> dict[str, set[str]]:
    """module name (relative to the package) -> top-level names it imports (absolute, dotted)."""
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
                imports.update(f"{node.module}.{alias.name}" for alias in node.names)
        found[name] = imports
    return found


def _top(name: str) -> str:
    return name.split(".")[0]


def test_package_has_modules():
    assert {"config", "modeling.target", "modeling.draft"} <= set(_modules())


def test_nothing_imports_a_stage_module():
    for module, imports in _modules().items():
        for imp in imports:
            parts = imp.split(".")
            if parts[0] == "eagle_train" and len(parts) > 1 and parts[1] in STAGES and module != parts[1]:
                raise AssertionError(f"eagle_train.{module} imports the stage module {imp}")


def test_only_stages_import_orchestration_libraries():
    for module, imports in _modules().items():
        if module.split(".")[0] in STAGES or module.startswith("training"):
            continue
        bad = sorted(i for i in imports if _top(i) in ORCHESTRATION)
        assert not bad, f"eagle_train.{module} imports {bad}; only stage modules may"


def test_only_modeling_imports_transformers_and_only_data_imports_datasets():
    for module, imports in _modules().items():
        tops = {_top(i) for i in imports}
        if "transformers" in tops:
            assert module.startswith("modeling"), f"eagle_train.{module} imports transformers"
        if "datasets" in tops:
            assert module.startswith("data") or module.split(".")[0] in STAGES, (
                f"eagle_train.{module} imports datasets"
            )


def test_pure_cores_import_only_torch_and_stdlib():
    allowed_third_party = {"torch", "numpy", "omegaconf"}
    for module, imports in _modules().items():
        if not module.startswith(PURE_CORES):
            continue
        for imp in imports:
            top = _top(imp)
            if top == "eagle_train":
                sub = imp.split(".")[1] if "." in imp else ""
                assert sub in {"config", "spec", "loss", "metrics", "kv_cache", "data"}, (
                    f"pure core eagle_train.{module} imports {imp}"
                )
            elif top not in allowed_third_party:
                import sys

                assert top in sys.stdlib_module_names or top == "__future__", (
                    f"pure core eagle_train.{module} imports {imp}"
                )


def test_the_vllm_worker_imports_only_the_standard_library_and_vllm():
    """It runs in vLLM's own environment, where neither this package nor its torch is installed."""
    import sys

    imports = _modules()["engines.vllm_worker"]
    bad = sorted(i for i in imports if _top(i) not in sys.stdlib_module_names | {"vllm", "__future__"})
    assert not bad, f"eagle_train.engines.vllm_worker imports {bad}"
