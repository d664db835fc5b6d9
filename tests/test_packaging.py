"""The repository stands on its own: an installed wheel runs from any directory, a copy of the
repository with nothing beside it runs the stages, and nothing names a path outside the repository."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import tomllib

from tests.conftest import REPO_ROOT

RUNTIME_DIRS = ("eagle_train", "conf", "scripts", "tests")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**env, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", **extra}


def _run(argv: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, cwd=cwd, env=_env(**env), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"{argv} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def test_every_code_package_is_listed_in_pyproject():
    listed = set(tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(p.parent.relative_to(REPO_ROOT).parts)
        for p in (REPO_ROOT / "eagle_train").rglob("__init__.py")
    }
    assert found <= listed, f"packages missing from pyproject.toml: {sorted(found - listed)}"


def test_nothing_names_a_path_outside_the_repository():
    pattern = re.compile(r"\.\./shared|\.\.[/\\]\.\.|[\"']shared[\"']")
    offenders = [
        f"{path.relative_to(REPO_ROOT)}:{number}"
        for folder in RUNTIME_DIRS
        for path in (REPO_ROOT / folder).rglob("*")
        if path.suffix in {".py", ".yaml"} and path != Path(__file__)
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    offenders += [
        f"Makefile:{n}"
        for n, line in enumerate((REPO_ROOT / "Makefile").read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not offenders, f"paths outside the repository: {offenders}"


def _repository_files() -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO_ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    return [f for f in out.split("\0") if f and (REPO_ROOT / f).is_file()]


def _copy_repository(dest: Path) -> Path:
    """The repository's own files (tracked and new, not ignored) copied to `dest`."""
    if shutil.which("git") is None:
        pytest.skip("needs git to list the repository's files")
    for rel in _repository_files():
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO_ROOT / rel, dest / rel)
    return dest


@pytest.mark.slow
def test_a_copy_with_nothing_beside_it_runs_extract_train_and_evaluate(tmp_path):
    """The repository's own files, copied where no ../shared exists, run the main path end to end."""
    repo = _copy_repository(tmp_path / "alone" / "eagle-train")
    assert not (repo.parent / "shared").exists()
    py, env = sys.executable, {"PYTHONPATH": str(repo)}
    where = _run([py, "-c", "import eagle_train; print(eagle_train.__file__)"], repo, **env).stdout.strip()
    assert Path(where).is_relative_to(repo)
    _run(
        [
            py,
            "-m",
            "eagle_train.extract",
            "data.limit=24",
            "out_dir=runs/f",
            "dtype=float32",
            "progress=false",
        ],
        repo,
        **env,
    )
    manifest = json.loads((repo / "runs/f/manifest.json").read_text())
    assert Path(manifest["target"]["source"]).is_relative_to(repo / "data")
    _run(
        [
            py,
            "train.py",
            "+recipe=stories260k_cpu",
            "features=runs/f",
            "out_dir=runs/t",
            "max_steps=3",
            "data.eval_fraction=0.2",
            "progress=false",
        ],
        repo,
        **env,
    )
    _run(
        [
            py,
            "-m",
            "eagle_train.evaluate",
            "draft.path=runs/t/final",
            "bench=tinystories",
            "num_questions=1",
            "decode.max_new_tokens=8",
            "methods=[ar,dynamic_tree]",
            "plots=false",
            "progress=false",
            "out_dir=runs/e",
        ],
        repo,
        **env,
    )
    report = json.loads((repo / "runs/e/report.json").read_text())
    assert all(r["identical"] in (None, r["identity_checked"]) for r in report["results"])


@pytest.mark.slow
def test_the_installed_wheel_runs_from_another_directory(tmp_path):
    """`pip install .` (no -e): the wheel carries conf/ and data/, every path resolves from the package."""
    source = _copy_repository(tmp_path / "source")  # setuptools builds in the tree: not in ours
    wheels = tmp_path / "wheels"
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            str(source),
            "-w",
            str(wheels),
        ],
        tmp_path,
    )
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], tmp_path)
    py = venv / "bin" / "python"
    _run(
        [str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", *map(str, wheels.glob("*.whl"))],
        tmp_path,
    )
    # The dependencies (torch, transformers, ...) come from this environment, after the wheel's own files.
    site = Path(
        _run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path
        ).stdout.strip()
    )
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = _run([str(py), "-c", "import eagle_train; print(eagle_train.__file__)"], elsewhere).stdout.strip()
    assert Path(where).is_relative_to(site)
    assert "out_dir" in _run([str(py), "-m", "eagle_train.extract", "--help"], elsewhere).stdout
    _run(
        [
            str(py),
            "-m",
            "eagle_train.extract",
            "data.limit=16",
            "out_dir=feats",
            "dtype=float32",
            "progress=false",
        ],
        elsewhere,
    )
    manifest = json.loads((elsewhere / "feats" / "manifest.json").read_text())
    assert manifest["counts"]["conversations"] == 16
    assert Path(manifest["target"]["source"]).is_relative_to(site / "eagle_train" / "assets")
    assert Path(manifest["data"]["path"]).is_relative_to(site / "eagle_train" / "assets")
