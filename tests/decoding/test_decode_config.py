"""DecodeConfig: every shipped tree composes through to_schema; bad values are refused clearly."""

from __future__ import annotations

import pytest

from eagle_train.cli import compose
from eagle_train.config import to_schema
from eagle_train.config.base import CONF_DIR
from eagle_train.config.decode import DecodeConfig, load_tree_paths
from eagle_train.config.evaluate import EvaluateConfig
from eagle_train.decoding.tree import shape_from_paths


@pytest.mark.parametrize("name", sorted(p.stem for p in (CONF_DIR / "tree").glob("*.yaml")))
def test_every_shipped_tree_composes(name):
    cfg = to_schema({"method": "static_tree", "tree": name}, DecodeConfig)
    assert shape_from_paths(cfg.tree_paths).size == len(load_tree_paths(name)) + 1


def test_the_tree_is_read_when_the_config_is_made():
    """The decoder never reads YAML: a static_tree config carries its paths; explicit paths win."""
    assert DecodeConfig(method="static_tree").tree_paths == load_tree_paths("mc_sim_7b_63")
    assert DecodeConfig(method="dynamic_tree").tree_paths is None
    cfg = to_schema({"method": "static_tree", "tree_paths": [[0], [1], [0, 0]]}, DecodeConfig)
    assert cfg.tree_paths == [[0], [1], [0, 0]]


def test_the_former_tree_method_names_are_read_as_the_current_ones():
    """eagle1 / eagle2 (the methods' former names) still select the static and the dynamic tree, and what
    the config then holds, and so every result written from it, carries the current names."""
    assert DecodeConfig(method="eagle1").method == "static_tree"
    assert DecodeConfig(method="eagle1").tree_paths == load_tree_paths("mc_sim_7b_63")
    assert to_schema({"method": "eagle2", "depth": 3}, DecodeConfig).method == "dynamic_tree"
    cfg = to_schema(compose("evaluate", ["methods=[ar,eagle1,eagle2]", "draft.path=x"]), EvaluateConfig)
    assert cfg.methods == ["ar", "static_tree", "dynamic_tree"]
    with pytest.raises(ValueError, match="decode.method must be one of"):
        DecodeConfig(method="eagle3")  # a head kind, not a decode method


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


def test_sampling_draws_chain_and_static_tree_children_from_the_draft_by_default():
    """The default chosen by acceptance (scripts/bench_sampling.py: children drawn from q accepted more
    than the top-k at temperature 0.7 and 1.0, chain and EAGLE-1 alike); greedy decoding ignores it."""
    assert DecodeConfig().sample_children is True
    assert to_schema(compose("evaluate", ["draft.path=x"]), EvaluateConfig).decode.sample_children is True


@pytest.mark.parametrize(
    "given, auto",
    [
        ([], ("chain", "dynamic_tree", "static_tree")),
        (["decode.depth=5"], ("chain", "static_tree")),  # the default value, given: EAGLE-2 pinned
        (["decode.chain_length=4"], ("dynamic_tree", "static_tree")),
        (["decode.total_tokens=60", "decode.tree=mc_sim_7b_63"], ("chain",)),
        (["decode.shape=fixed"], ("static_tree",)),
    ],
)
def test_a_shape_field_given_is_honoured_even_at_its_default(given, auto):
    """decode.shape=auto chooses only what was not given: a field set on the command line pins its method's
    shape even when it equals the default (the method's other fields take their defaults)."""
    cfg = to_schema(compose("evaluate", ["draft.path=x", *given]), EvaluateConfig)
    assert cfg.decode.auto_methods == auto
    if "dynamic_tree" not in auto:
        assert (cfg.decode.depth, cfg.decode.top_k, cfg.decode.total_tokens) == (5, 10, 60)
    assert DecodeConfig(shape="auto", depth=5).auto_methods == ("chain",)
    assert DecodeConfig(shape="auto", depth=5, top_k=4).total_tokens == 60


def test_vllm_s_chain_is_pinned_at_its_length():
    """engine=vllm compares vLLM's chain of decode.chain_length with the built-in one: never tuned."""
    cfg = to_schema(compose("evaluate", ["draft.path=x", "engine=vllm"]), EvaluateConfig)
    assert cfg.decode.chain_length == 4 and "chain" not in cfg.decode.auto_methods
