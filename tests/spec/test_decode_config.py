"""DecodeConfig: every shipped tree composes through to_schema; bad values are refused clearly."""

from __future__ import annotations

import pytest

from eagle_train.config import to_schema
from eagle_train.config.base import CONF_DIR
from eagle_train.config.decode import DecodeConfig, load_tree_paths
from eagle_train.spec.tree import shape_from_paths


@pytest.mark.parametrize("name", sorted(p.stem for p in (CONF_DIR / "tree").glob("*.yaml")))
def test_every_shipped_tree_composes(name):
    cfg = to_schema({"method": "eagle1", "tree": name}, DecodeConfig)
    assert shape_from_paths(cfg.static_paths()).size == len(load_tree_paths(name)) + 1


def test_chain_and_explicit_paths():
    assert DecodeConfig(method="chain", chain_length=3).static_paths() == [[0], [0, 0], [0, 0, 0]]
    cfg = to_schema({"method": "eagle1", "tree_paths": [[0], [1], [0, 0]]}, DecodeConfig)
    assert cfg.static_paths() == [[0], [1], [0, 0]]


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"method": "medusa"}, "method"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"total_tokens": 1}, "total_tokens"),
        ({"depth": 0}, "depth"),
    ],
)
def test_bad_values_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        DecodeConfig(**overrides)


def test_unknown_tree_names_the_shipped_ones(tmp_path):
    with pytest.raises(FileNotFoundError, match="mc_sim_7b_63"):
        load_tree_paths("no_such_tree")
    bad = tmp_path / "bad.yaml"
    bad.write_text("paths: 3\n")
    with pytest.raises(ValueError, match="bad.yaml"):
        load_tree_paths(str(bad))
