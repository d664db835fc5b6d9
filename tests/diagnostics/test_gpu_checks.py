"""The GPU-only checks of eagle_train.diagnostics.gpu_checks: small on the CPU here (so they cannot rot),
full size on a GPU (`gpu`: skipped without CUDA; scripts/gpu_check.py calls the same functions)."""

from __future__ import annotations

import pytest
import torch

from eagle_train.diagnostics.gpu_checks import bf16_greedy_identity, flash_attention_decoding, loss_memory


@pytest.mark.slow
def test_bf16_greedy_identity_on_the_cpu(target_cfg):
    result = bf16_greedy_identity(target_cfg, "cpu", prompts=2, max_new_tokens=48)
    assert result["ok"], result
    assert result["tree_vs_one_token_max_abs_diff"] > 0
    assert set(result["greedy"]) == {"chain", "static_tree", "dynamic_tree"}
    assert all(sum(c.values()) == 2 for c in result["greedy"].values())


def test_flash_attention_decoding_on_the_cpu(target_cfg):
    result = flash_attention_decoding(target_cfg, "cpu")
    assert result["ok"] and result["emulated"] and result["dynamic_tree_vs_ar"] == "identical", result


def test_loss_memory_on_the_cpu():
    result = loss_memory(
        "cpu", vocab=2048, hidden=32, lengths=(256, 2048), weight_dtype=torch.float32, chunk=64
    )
    assert result["ok"], result
    assert result["growth_bytes_per_position"] < result["one_shot_bytes_per_position"] / 8


@pytest.mark.gpu
def test_gpu_checks(target_cfg):
    """On CUDA: bf16 near-ties only, flash-attention targets decoding through sdpa (the real kernel when
    flash_attn is installed), and the loss at Llama-3-8B sizes flat in sequence length."""
    identity = bf16_greedy_identity(target_cfg, "cuda")
    assert identity["ok"], identity
    flash = flash_attention_decoding(target_cfg, "cuda")
    assert flash["ok"], flash
    memory = loss_memory("cuda")
    assert memory["ok"], memory
