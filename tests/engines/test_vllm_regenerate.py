"""`python -m eagle_train.regenerate backend=vllm`: a real vLLM (its own .venv-vllm) writes the replies of the
head_dim-32 stories260K, continuously batched: greedy, the same records as the Hugging Face backend's
`generate` (same prompts, ids, order, replies and finish reasons); a rerun resumes; an output written by one
backend is refused to the other. `make test-engines` runs these."""

from __future__ import annotations

import dataclasses
import json

import pytest

import eagle_train.regenerate as regen
from eagle_train.config.extract import VllmEngineConfig
from tests.test_regenerate import make_cfg, write_prompts

pytestmark = pytest.mark.engine
PROMPTS = 12


def regenerate(backend: str, target_cfg, wide_target_dir, engine_python, prompts, out) -> dict:
    target = dataclasses.replace(target_cfg, name="stories260k-hd32", path=str(wide_target_dir))
    cfg = make_cfg(target, prompts, out, max_new_tokens=48, batch_size=5)
    cfg.backend, cfg.vllm = backend, VllmEngineConfig(python=str(engine_python), max_num_seqs=8)
    return regen.run(cfg)


def test_vllm_writes_the_hf_backends_greedy_replies_and_resumes(
    target_cfg, wide_target_dir, engine_python, tmp_path
):
    prompts = tmp_path / "prompts.jsonl"
    ids = write_prompts(prompts, PROMPTS)
    hf = regenerate("hf", target_cfg, wide_target_dir, engine_python, prompts, tmp_path / "hf.jsonl")
    vllm = regenerate("vllm", target_cfg, wide_target_dir, engine_python, prompts, tmp_path / "vllm.jsonl")
    assert hf["records"] == vllm["records"] == PROMPTS and vllm["tokens"] == hf["tokens"] > 0
    ours = [json.loads(line) for line in (tmp_path / "hf.jsonl").read_text().splitlines()]
    theirs = [json.loads(line) for line in (tmp_path / "vllm.jsonl").read_text().splitlines()]
    assert [r["id"] for r in theirs] == ids
    assert theirs == ours  # every reply and finish reason
    assert "backend" not in json.loads((tmp_path / "hf.jsonl.stats.json").read_text())["settings"]
    assert (tmp_path / "vllm.jsonl.vllm.log").stat().st_size > 0
    # a rerun has nothing left to write (vLLM is not even started), and the other backend is refused
    again = regenerate("vllm", target_cfg, wide_target_dir, engine_python, prompts, tmp_path / "vllm.jsonl")
    assert again["already_done"] == PROMPTS and again["written"] == 0
    with pytest.raises(ValueError, match="backend"):
        regenerate("hf", target_cfg, wide_target_dir, engine_python, prompts, tmp_path / "vllm.jsonl")
