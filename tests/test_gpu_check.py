"""scripts/gpu_check.py runs its whole path on the CPU at a tiny shape (`--cpu --tiny`), so the command a
lent GPU runs cannot rot: the same sections, the same JSON. No figure is asserted, only that each is there."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT


@pytest.mark.slow
def test_gpu_check_runs_on_the_cpu_at_a_tiny_shape(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--cpu", "--tiny", "--out", str(out)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["shape"] == "tiny" and result["device"] == "cpu"
    extraction = result["extraction"]
    assert set(extraction["tokens_per_s"]) == {"bare forward", "extract bf16", "extract fp8"}
    assert extraction["extract_vs_bare_forward"] > 0
    assert result["training"]["tokens_per_s"] > 0 and result["training"]["peak_host_mb"] > 0
    methods = {k: v for k, v in result["decoding"].items() if k != "section_seconds"}
    assert set(methods) == {"ar", "chain", "static_tree", "dynamic_tree"}
    assert all(d["ms_per_round"] > 0 for d in methods.values())
    assert set(result["checks"]) >= {"bf16_greedy_identity", "flash_attention_decoding", "loss_memory"}
    assert result["ok"], result["checks"]
