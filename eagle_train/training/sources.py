"""Where training samples come from: a feature store (offline) or tokenized conversations (online)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from eagle_train.config.train import TrainConfig
from eagle_train.data.render import ChatRenderer, tokenize_conversations
from eagle_train.data.sharegpt import DataError, load_conversations
from eagle_train.modeling.target import Target, TargetParts
from eagle_train.store.manifest import expected_target, target_config_hash
from eagle_train.store.reader import FeatureStore
from eagle_train.store.reader import open_store as open_feature_store


def checkpoint_identity(target: TargetParts, hf_config) -> dict[str, Any]:
    """The target block of a head checkpoint's meta (evaluation compares the weight files and the
    embedding / LM head fingerprint)."""
    return {
        "target": {
            "name": target.cfg.name,
            "source": target.source,
            "config_hash": target_config_hash(hf_config.to_dict()),
            "architectures": list(getattr(hf_config, "architectures", None) or []),
            "weights": target.weight_fingerprint,
            "weight_files": target.weight_files,
            "stop_token_ids": list(
                target.cfg.stop_token_ids
            ),  # export checks a placeholder token against them
        }
    }


def source_identity(target: TargetParts, hf_config, data: dict[str, Any]) -> dict[str, Any]:
    """The data and target part of a run's identity (training/resume.py: run_identity)."""
    return {
        "data": data,
        "target": {
            "config_hash": target_config_hash(hf_config.to_dict()),
            "weights": target.weight_fingerprint,
            "weight_files": target.weight_files,
        },
    }


def open_store(
    path: Path | None,
    target: TargetParts,
    hf_config,
    aux_layers: list[int] | None = None,
    reader: str = "draft.type=eagle3",
) -> tuple[FeatureStore, dict[str, Any]]:
    """The feature store at `path`, refused (StoreMismatchError naming the field) unless it was
    extracted from this target and, for an EAGLE-3 head (`aux_layers`), holds the inputs of exactly
    those layers (eagle_train.store.reader.open_store; `reader` names the head in the refusal). Its structure is checked when it is opened, each
    shard's checksum when it is first read."""
    store = open_feature_store(path, expected_target(target, hf_config), aux_layers, reader)
    if len(store) == 0:
        raise DataError(f"feature store {path}: no samples")
    return store, checkpoint_identity(target, hf_config)


class TokenizedSource:
    """Tokenized conversations (columns id, input_ids, loss_mask, num_tokens) as training samples
    without features: online collation runs the target on them."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset
        self.ids: list[str] = [str(i) for i in dataset["id"]]
        self.lengths: list[int] = [int(n) for n in dataset["num_tokens"]]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, Any]:
        row = self.dataset[i]
        return {
            "id": row["id"],
            "input_ids": torch.tensor(row["input_ids"], dtype=torch.long),  # [L]
            "loss_mask": torch.tensor(row["loss_mask"], dtype=torch.bool),  # [L]
        }

    def tokens(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        sample = self[i]
        return sample["input_ids"], sample["loss_mask"]


def open_online(cfg: TrainConfig, target: Target, hf_config) -> tuple[TokenizedSource, dict[str, Any]]:
    """Load, clean and tokenize cfg.data exactly as extraction does (same template, same max_len)."""
    messages, _ = load_conversations(cfg.data)
    max_len = target.length_limit(cfg.data.max_len)
    dataset, _ = tokenize_conversations(messages, ChatRenderer(target.tokenizer, target.cfg, max_len))
    if len(dataset) == 0:
        raise DataError(f"{cfg.data.path}: no conversation left to train on after tokenization")
    return TokenizedSource(dataset), checkpoint_identity(target, hf_config)


def online_features(target: Target, aux_layers: list[int] | None):
    """The target forward of online collation: {"hidden"} (+ "aux", the inputs of `aux_layers`)."""

    def features(ids: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        if aux_layers is None:
            return {"hidden": target.hidden_states(ids, mask)}
        hidden, aux = target.aux_hidden_states(ids, mask, aux_layers)
        return {"hidden": hidden, "aux": aux}

    return features
