"""The layers of docs/ARCHITECTURE.md, checked on the source of every module (ast, nothing imported).

Layers, bottom up; a module imports only its own layer and those below, and the third-party libraries
its layer allows (LAYERS: the first matching prefix wins, so specific names come first):
  0 foundation   config/*, runtime/*                                      stdlib, omegaconf
  1 pure cores   training/loss, training/metrics, training/ttt, training/cod, training/dflash,
                 modeling/logit_transform, modeling/draft_vocab, the rest of decoding/*, data/batching,
                 data/jsonl, data/templates
                 + torch, numpy; and pure: no file I/O, no clock, no process or thread (PURITY below)
  2 adapters     decoding/decoder, drafter, timing (the decode loop: it runs a model and times itself),
    and loops    modeling/*, interop/* and families/* (the only transformers importers;
                 families: tiny family instances), the rest of data/* (the only
                 datasets importers besides stages), store/*, report/* (matplotlib), engines/* (a serving
                 engine in its own environment; engines/vllm_worker, vllm_generate_worker and
                 vllm_worker_loop run there: stdlib + vllm only, and engines/vllm_extract_worker: stdlib +
                 vllm + vLLM's own torch and safetensors)
                 + safetensors
  3 stage pieces the rest of training/*, heads/*, autotune/* (it times this machine and caches what it measured),
                 diagnostics/*            torch, numpy (accelerate objects come in as arguments)
  4 stages       extract, train, evaluate, regenerate, export, pipeline, fetch, cli (the Hydra edge): the only
                 importers of hydra, accelerate, deepspeed, wandb; nothing imports a stage but `cli`.
docs/ARCHITECTURE.md's layers table lists the same prefixes per layer, and its tree every module.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "eagle_train"
ARCHITECTURE = PACKAGE.parent / "docs" / "ARCHITECTURE.md"
STAGES = {"extract", "train", "evaluate", "regenerate", "export", "pipeline", "fetch"}
PURE = 1
# module (or package prefix) -> layer; the first matching prefix wins, so list specific names first
LAYERS: list[tuple[str, int]] = [
    ("config", 0),
    ("runtime", 0),
    ("training.loss", 1),
    ("training.metrics", 1),
    ("training.ttt", 1),
    ("training.cod", 1),
    ("training.dflash", 1),
    ("modeling.logit_transform", 1),
    ("modeling.draft_vocab", 1),
    ("decoding.decoder", 2),
    ("decoding.drafter", 2),
    ("decoding.timing", 2),
    ("decoding", 1),
    ("data.batching", 1),
    ("data.jsonl", 1),
    ("data.templates", 1),
    ("data", 2),
    ("modeling", 2),
    ("interop", 2),
    ("families", 2),
    ("store", 2),
    ("report", 2),
    ("engines", 2),
    ("training", 3),
    ("heads", 3),
    ("autotune", 3),
    ("diagnostics", 3),
    ("cli", 4),
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
    "engines.vllm_worker": {"vllm"},  # runs in vLLM's own environment (checked below: nothing else)
    "engines.vllm_cli": {"vllm"},  # likewise: the `vllm` command
    # likewise, with vLLM's torch and safetensors, and their request loop (a sibling module there)
    "engines.vllm_extract_worker": {"vllm", "vllm_worker_loop"},
    "engines.vllm_generate_worker": {"vllm", "vllm_worker_loop"},
    "engines.vllm_worker_loop": {"vllm"},
    "modeling.gguf": {"gguf"},  # GGUF targets (the optional gguf package)
    "modeling": {"transformers"},
    "interop": {"transformers"},
    "families": {"transformers"},  # tiny family instances built with transformers' own config classes
    "data": {"datasets"},
    "extract": {"datasets"},
}
# What a pure module may not do, seen in its source: file I/O, the clock (wall time, accelerator timing and
# synchronisation), processes and threads. Modules it may not import at all, calls by their resolved dotted
# name (or its module's: "safetensors" is every safetensors call; "os.exec*" every os.exec...), and methods by
# name whatever they are called on (Path's).
PURITY_IMPORTS = {
    "subprocess", "multiprocessing", "threading", "concurrent", "asyncio", "socket", "signal", "sched",
    "shutil", "tempfile", "glob", "fcntl", "ctypes", "pickle", "time", "datetime", "eagle_train.runtime",
}  # fmt: skip
PURITY_CALLS = (
    "open", "print", "input", "io.open", "os.system", "os.popen", "os.fork", "os.exec*", "os.spawn*",
    "os.kill", "os.remove", "os.unlink", "os.rename", "os.replace", "os.makedirs", "os.mkdir", "os.rmdir",
    "os.listdir", "os.scandir", "os.walk", "os.open", "os.fsync", "os.stat", "os.path.exists",
    "os.path.isfile", "os.path.isdir", "os.path.getsize", "json.dump", "json.load", "torch.save",
    "torch.load", "numpy.save", "numpy.load", "numpy.fromfile", "safetensors", "torch.cuda.synchronize",
    "torch.cuda.Event", "torch.multiprocessing",
)  # fmt: skip
PURITY_METHODS = {
    "read_text", "write_text", "read_bytes", "write_bytes", "open", "mkdir", "unlink", "rmdir", "touch",
    "iterdir", "glob", "rglob", "exists", "is_file", "is_dir", "stat", "savefig", "symlink_to",
}  # fmt: skip


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
    unplaced = [m for m in MODULES if m and layer_of(m) is None]
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
            if target == "cli":
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
    [
        ("engines.vllm_worker", {"vllm"}),
        ("engines.vllm_cli", {"vllm"}),
        ("engines.vllm_extract_worker", {"vllm", "torch", "safetensors", "vllm_worker_loop"}),
        ("engines.vllm_generate_worker", {"vllm", "vllm_worker_loop"}),
        ("engines.vllm_worker_loop", {"vllm"}),
    ],
)
def test_the_vllm_workers_import_only_what_vllm_s_environment_has(worker, allowed):
    """They run in vLLM's own environment, where this package is not installed (torch and safetensors
    there are vLLM's own)."""
    imports = _modules()[worker]
    bad = sorted(
        i for i in imports if i.split(".")[0] not in sys.stdlib_module_names | allowed | {"__future__"}
    )
    assert not bad, f"eagle_train.{worker} imports {bad}"


def _dotted(node: ast.expr, aliases: dict[str, str]) -> str | None:
    """The dotted name a call goes to (`np.save` -> numpy.save through the module's imports), or None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([aliases.get(node.id, node.id), *reversed(parts)])


def impurities(path: Path) -> list[str]:
    """What the module at `path` does that a pure module may not: imports, calls, methods (line numbers)."""
    tree = ast.parse(path.read_text(), str(path))
    aliases: dict[str, str] = {}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update(
                {
                    a.asname or a.name.split(".")[0]: a.name if a.asname else a.name.split(".")[0]
                    for a in node.names
                }
            )
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            aliases.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
            names = [node.module]
        else:
            continue
        found += [f"line {node.lineno}: imports {n}" for n in names if _matches_any(n, PURITY_IMPORTS)]
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func, aliases)
        if name is not None and _matches_any(name, PURITY_CALLS):
            found.append(f"line {node.lineno}: calls {name}")
        elif isinstance(node.func, ast.Attribute) and node.func.attr in PURITY_METHODS:
            found.append(f"line {node.lineno}: calls .{node.func.attr}()")
    return found


def _matches_any(name: str, names) -> bool:
    """`name` is one of `names`, inside one of them (a.b.c in a.b), or starts one ending in *."""
    return any(
        name.startswith(n[:-1]) if n.endswith("*") else name == n or name.startswith(n + ".") for n in names
    )


def _path(module: str) -> Path:
    path = PACKAGE.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m and layer_of(m) == PURE))
def test_pure_modules_do_no_io_no_timing_and_start_nothing(module):
    """The pure layer computes: no file I/O, no wall clock or accelerator timing, no process or thread
    (a module that needs one belongs to a layer above)."""
    found = impurities(_path(module))
    assert not found, f"eagle_train.{module} is in the pure layer but: {'; '.join(found)}"


def test_the_purity_check_sees_what_it_forbids(tmp_path):
    """The check itself: each kind of impurity is found, under any import alias."""
    source = tmp_path / "impure.py"
    source.write_text(
        "import time as clock\nimport numpy as np\nfrom os import system\nimport torch\n"
        "def f(path, t):\n"
        "    path.write_text('x'); np.save(path, t); system('ls'); torch.cuda.synchronize()\n"
        "    open(path); return clock.perf_counter()\n"
    )
    found = " ".join(impurities(source))
    for what in (
        "imports time",
        ".write_text",
        "numpy.save",
        "os.system",
        "torch.cuda.synchronize",
        "calls open",
    ):
        assert what in found, (what, found)
    assert impurities(PACKAGE / "decoding" / "tree.py") == []


def _tree_listing() -> dict[str, set[str]]:
    """docs/ARCHITECTURE.md's tree of eagle_train/: package ("" for the top level) -> the modules it names."""
    text = ARCHITECTURE.read_text()
    lines = text[text.index("\neagle_train/\n") + 1 :].splitlines()[1:]
    listing: dict[str, set[str]] = {"": set()}
    package = ""
    for line in lines:
        if line and not line.startswith(" "):  # the next top-level entry of the repository
            break
        header = re.match(r"^  ([a-z_]+)/\s", line)
        if header:
            package = header.group(1)
            listing[package] = set()
        listing[package] |= set(re.findall(r"(?<![/\w])([a-z_0-9]+)\.py\b", line))
    return listing


def test_architecture_lists_every_module_under_its_package():
    """docs/ARCHITECTURE.md's tree names every module of the package, and nothing that is gone."""
    packages = {m for m in MODULES if m and (PACKAGE / m).is_dir()}
    actual: dict[str, set[str]] = {package: set() for package in ["", *packages]}
    for module in MODULES:
        if module and module not in packages:
            package, _, name = module.rpartition(".")
            actual[package].add(name)
    assert _tree_listing() == actual


def test_architecture_layers_table_is_this_test_s():
    """The layers table of docs/ARCHITECTURE.md names, per layer, the prefixes LAYERS gives that layer."""
    text = ARCHITECTURE.read_text()
    rows = {
        int(match.group(1)): {
            entry.removesuffix("/*").replace("/", ".")
            for entry in re.findall(r"`([a-z_/*]+)`", match.group(2))
        }
        for match in re.finditer(r"^\| (\d) [^|]*\| ([^|]*) \|", text, re.MULTILINE)
    }
    expected: dict[int, set[str]] = {}
    for prefix, layer in LAYERS:
        expected.setdefault(layer, set()).add(prefix)
    assert rows == expected
