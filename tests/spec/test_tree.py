"""The tree builder against brute force (ancestor walks), on random parent arrays and every shipped tree."""

from __future__ import annotations

import random

import pytest
import torch

from eagle_train.config.base import CONF_DIR
from eagle_train.config.decode import load_tree_paths
from eagle_train.spec.tree import build_tree, chain_paths, shape_from_paths

SHIPPED = sorted(p.stem for p in (CONF_DIR / "tree").glob("*.yaml"))


def ancestors(parents: list[int], i: int) -> list[int]:
    """Brute force: walk the parent pointers from i to the root; returns root..i."""
    chain = [i]
    while parents[chain[-1]] != -1:
        chain.append(parents[chain[-1]])
    return chain[::-1]


def check_against_brute_force(parents: list[int]) -> None:
    n = len(parents)
    tokens = torch.arange(100, 100 + n)
    tree = build_tree(tokens, parents)
    for i in range(n):
        anc = ancestors(parents, i)
        assert tree.depth[i] == len(anc) - 1
        assert set(torch.nonzero(tree.attention_mask[i]).flatten().tolist()) == set(anc)
        assert tree.children[i] == [j for j in range(n) if parents[j] == i]
    leaves = [i for i in range(n) if i not in parents]
    got = [[j for j in row if j >= 0] for row in tree.retrieve_indices.tolist()]
    assert got == [ancestors(parents, leaf) for leaf in leaves]
    assert tree.max_depth == max(len(ancestors(parents, i)) for i in range(n)) - 1


@pytest.mark.parametrize("seed", range(20))
def test_random_parent_arrays(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 40)
    parents = [-1] + [rng.randrange(0, i) for i in range(1, n)]
    check_against_brute_force(parents)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_trees(name):
    paths = load_tree_paths(name)
    shape = shape_from_paths(paths)
    check_against_brute_force(shape.parents)
    # each node's rank path equals the path it was declared with
    for i in range(1, shape.size):
        ranks = [shape.ranks[j] for j in ancestors(shape.parents, i)[1:]]
        assert tuple(ranks) == shape.paths[i]
    assert sorted(map(tuple, paths)) == sorted(shape.paths[1:])


def test_mc_sim_7b_63_is_the_reference_tree():
    shape = shape_from_paths(load_tree_paths("mc_sim_7b_63"))
    assert shape.size == 26 and shape.max_depth == 5


def test_chain_and_truncation():
    shape = shape_from_paths(chain_paths(4))
    assert shape.parents == [-1, 0, 1, 2, 3]
    short = shape_from_paths(load_tree_paths("mc_sim_7b_63")).truncated(2)
    assert short.max_depth == 2 and all(d <= 2 for d in short.depths)
    check_against_brute_force(short.parents)


@pytest.mark.parametrize(
    "paths, message",
    [
        ([[0], [0, 0], [0, 0]], "duplicates"),
        ([[0], [1, 0]], "parent path"),
        ([[0], []], "non-empty"),
        ([[-1]], "ranks"),
    ],
)
def test_bad_paths_are_refused(paths, message):
    with pytest.raises(ValueError, match=message):
        shape_from_paths(paths)


def test_bad_parent_array_is_refused():
    with pytest.raises(ValueError, match="earlier node"):
        build_tree(torch.zeros(3, dtype=torch.long), [-1, 2, 0])
