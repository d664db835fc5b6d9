"""`python -m eagle_train.extract backend=vllm`: a real vLLM (its own .venv-vllm) computes the features of
the head_dim-32 stories260K and writes the same store as the Hugging Face backend: the same sample ids,
token ids and loss masks exactly, hidden states equal within bf16 rounding (the stored dtype; measured
here: max abs 0.0156 at values up to 19.5, relative L2 1.1e-4), the manifest naming the backend.
`make test-engines` runs these."""

from __future__ import annotations

import pytest
import torch

from eagle_train.cli import compose
from eagle_train.config.base import to_schema
from eagle_train.config.extract import ExtractConfig
from eagle_train.extract import run as extract
from eagle_train.store.reader import FeatureStore

pytestmark = pytest.mark.engine
CONVERSATIONS = 20


def extract_with(backend: str, target_dir, out_dir, engine_python, aux: bool = False) -> FeatureStore:
    overrides = [
        f"aux={str(aux).lower()}",
        f"target.path={target_dir}",
        "target.name=stories260k-hd32",
        f"data.limit={CONVERSATIONS}",
        f"out_dir={out_dir}",
        "progress=false",
        f"backend={backend}",
        f"vllm.python={engine_python}",
    ]
    return FeatureStore(extract(to_schema(compose("extract", overrides=overrides), ExtractConfig)), aux=aux)


@pytest.mark.parametrize("aux", [False, True], ids=["eagle1", "eagle3"])
def test_vllm_features_equal_the_hf_stores(wide_target_dir, engine_python, tmp_path, aux):
    """EAGLE-3 (aux=true): vLLM's own layer inputs (`eagle_aux_hidden_state_layer_ids`) are the HF
    store's aux features, as the hidden states are."""
    hf = extract_with("hf", wide_target_dir, tmp_path / "hf", engine_python, aux)
    vllm = extract_with("vllm", wide_target_dir, tmp_path / "vllm", engine_python, aux)
    assert vllm.manifest["backend"] == "vllm" and "backend" not in hf.manifest
    assert vllm.ids == hf.ids and len(vllm) == CONVERSATIONS
    assert vllm.aux_layers == hf.aux_layers == ([1, 2, 4] if aux else [])
    for i in range(len(hf)):
        ours, theirs = hf[i], vllm[i]
        assert torch.equal(ours["input_ids"], theirs["input_ids"])
        assert torch.equal(ours["loss_mask"], theirs["loss_mask"])
        for name in ("hidden", "aux") if aux else ("hidden",):
            a, b = ours[name].float(), theirs[name].float()
            # within two bf16 steps of each value (the stored dtype rounds both: 2^-7 relative)
            assert ((a - b).abs() <= 2 * 2**-7 * a.abs().clamp_min(1.0)).all(), (i, name)
            assert float((a - b).norm() / a.norm()) < 1e-3, (i, name)


def test_a_rerun_resumes_and_a_vllm_store_is_not_taken_for_an_hf_one(
    wide_target_dir, engine_python, tmp_path
):
    first = extract_with("vllm", wide_target_dir, tmp_path / "store", engine_python)
    again = extract_with("vllm", wide_target_dir, tmp_path / "store", engine_python)
    assert again.content_hash() == first.content_hash()
    with pytest.raises(ValueError, match="backend"):
        extract_with("hf", wide_target_dir, tmp_path / "store", engine_python)
