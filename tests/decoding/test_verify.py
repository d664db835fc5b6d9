"""Verification: greedy acceptance, and lossless rejection sampling tested statistically on a stub.

The statistical tests use fixed seeds, so they are deterministic; the bound is a chi-square test of
the empirical joint distribution of the first two emitted tokens against the exact target
distribution, rejected below p = 1e-3 (a correct sampler fails it with probability 1e-3 per seed)."""

from __future__ import annotations

import pytest
import torch

from eagle_train.decoding.expand import expand_dynamic, expand_static, plan_static
from eagle_train.decoding.tree import build_tree, shape_from_paths
from eagle_train.decoding.verify import accept_greedy, accept_sampling, process_logits
from tests.chi_square import chi_square_p

VOCAB = 5
ROOT = 2


def target_probs_of(path: tuple[int, ...]) -> torch.Tensor:
    """The stub target's next-token distribution after a token path (context-dependent)."""
    from tests.decoding.conftest import path_log_probs

    return path_log_probs(("target", *path), VOCAB, scale=1.2).exp()


def node_paths(tree) -> list[tuple[int, ...]]:
    tokens, parents, out = tree.tokens.tolist(), tree.parents.tolist(), []
    for i in range(len(tokens)):
        out.append((*out[parents[i]], tokens[i]) if i else (tokens[0],))
    return out


def first_two_tokens(tree, generator) -> tuple[int, int]:
    """Run one verification round, then continue from the target itself (as the next round would)."""
    paths = node_paths(tree)
    probs = torch.stack([target_probs_of(p) for p in paths])
    path, bonus = accept_sampling(tree, probs, generator)
    emitted = [int(tree.tokens[i]) for i in path[1:]] + [bonus]
    while len(emitted) < 2:
        ctx = (ROOT, *emitted)
        emitted.append(int(torch.multinomial(target_probs_of(ctx), 1, generator=generator)))
    return emitted[0], emitted[1]


def exact_joint() -> torch.Tensor:
    p1 = target_probs_of((ROOT,))
    return torch.stack([p1[a] * target_probs_of((ROOT, a)) for a in range(VOCAB)])  # [V, V]


def verify_chi_square_p(counts: torch.Tensor, probabilities: torch.Tensor) -> float:
    return chi_square_p(counts.flatten().numpy(), probabilities.flatten().numpy(), min_expected=0.0)


def make_tree(kind: str, draft, generator, vocab_map=None):
    if kind == "dynamic":
        return expand_dynamic(ROOT, draft.root_log_probs(), draft, 2, 3, 8, vocab_map)
    paths = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
    plan = plan_static(shape_from_paths(paths))
    sample = (lambda lp: lp.exp()) if kind == "sampled" else None
    return expand_static(plan, ROOT, draft.root_log_probs(), draft, sample, generator, vocab_map)


@pytest.mark.parametrize("kind", ["topk", "sampled", "dynamic"])
def test_sampling_is_lossless_on_a_stub(scripted_draft, kind):
    g = torch.Generator().manual_seed(123)
    counts = torch.zeros(VOCAB, VOCAB)
    runs = 4000
    draft = scripted_draft(ROOT, VOCAB, scale=1.0)
    static_tree = make_tree(kind, draft, g) if kind != "sampled" else None
    for _ in range(runs):
        if static_tree is None:
            draft.reset()
            tree = make_tree(kind, draft, g)
        else:
            tree = static_tree
        a, b = first_two_tokens(tree, g)
        counts[a, b] += 1
    assert verify_chi_square_p(counts, exact_joint()) > 1e-3


DRAFT_VOCAB = torch.tensor([0, 2, 4])  # EAGLE-3: the draft proposes 3 of the 5 tokens only


@pytest.mark.parametrize("kind", ["topk", "sampled", "dynamic"])
def test_sampling_with_a_reduced_draft_vocabulary_is_lossless(scripted_draft, kind):
    """q lives on the draft vocabulary (ids 0..2 = target tokens 0, 2, 4); the target puts mass on
    tokens 1 and 3 too, which no draft can propose: the emitted tokens must still follow p exactly."""
    g = torch.Generator().manual_seed(321)
    counts = torch.zeros(VOCAB, VOCAB)
    draft = scripted_draft(ROOT, len(DRAFT_VOCAB), scale=1.0)
    static_tree = make_tree(kind, draft, g, DRAFT_VOCAB) if kind != "sampled" else None
    for _ in range(4000):
        if static_tree is None:
            draft.reset()
            tree = make_tree(kind, draft, g, DRAFT_VOCAB)
            assert tree.draft_probs.shape[-1] == 3 and torch.equal(tree.draft_vocab, DRAFT_VOCAB)
        else:
            tree = static_tree
        assert set(tree.token_list[1:]) <= {0, 2, 4}  # draft ids mapped to target ids
        a, b = first_two_tokens(tree, g)
        counts[a, b] += 1
    assert counts[1].sum() > 0 and counts[3].sum() > 0  # tokens outside the draft vocabulary are emitted
    assert verify_chi_square_p(counts, exact_joint()) > 1e-3


def test_a_reduced_q_read_as_a_full_one_is_caught(scripted_draft):
    """Control: treating q's draft-vocabulary columns as target ids (no mapping) biases the output."""
    g = torch.Generator().manual_seed(11)
    draft = scripted_draft(ROOT, len(DRAFT_VOCAB), scale=1.0)
    counts = torch.zeros(VOCAB, VOCAB)
    for _ in range(4000):
        draft.reset()
        tree = make_tree("sampled", draft, g, DRAFT_VOCAB)
        tree.draft_vocab = None
        tree.draft_probs = torch.cat([tree.draft_probs, torch.zeros(tree.size, 2)], 1)  # columns 0..2 as ids
        a, b = first_two_tokens(tree, g)
        counts[a, b] += 1
    assert verify_chi_square_p(counts, exact_joint()) < 1e-3


def test_the_chi_square_bound_detects_a_biased_sampler(scripted_draft):
    """Control: accepting every draft child (no rejection) must fail the same test."""
    g = torch.Generator().manual_seed(5)
    draft = scripted_draft(ROOT, VOCAB, scale=1.0)
    tree = make_tree("topk", draft, g)
    counts = torch.zeros(VOCAB, VOCAB)
    for _ in range(4000):
        a = int(tree.tokens[tree.children[0][0]])
        b = int(torch.multinomial(target_probs_of((ROOT, a)), 1, generator=g))
        counts[a, b] += 1
    assert verify_chi_square_p(counts, exact_joint()) < 1e-3


def test_greedy_acceptance_walks_the_longest_matching_path():
    # root 0 -> {1: 5, 2: 6}; 1 -> {3: 7}; 2 -> {4: 8}; 3 -> {5: 9}
    tree = build_tree(torch.tensor([4, 5, 6, 7, 8, 9]), [-1, 0, 0, 1, 2, 3])
    logits = torch.zeros(6, 12)
    argmax = [6, 0, 8, 0, 11, 0]  # root wants 6 (node 2), node 2 wants 8 (node 4), node 4 wants 11 (bonus)
    logits[torch.arange(6), torch.tensor(argmax)] = 1.0
    assert accept_greedy(tree, logits) == ([0, 2, 4], 11)
    logits[0] = 0
    logits[0, 3] = 1.0  # nothing matches at the root
    assert accept_greedy(tree, logits) == ([0], 3)


def test_one_token_mass_is_always_accepted_and_never_leaks():
    tree = build_tree(torch.tensor([0, 3, 1]), [-1, 0, 0])
    probs = torch.zeros(3, VOCAB)
    probs[:, 1] = 1.0  # the target is certain of token 1 everywhere
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        path, bonus = accept_sampling(tree, probs, g)
        assert path == [0, 2] and bonus == 1
    tree.draft_probs = torch.full((3, VOCAB), 1.0 / VOCAB)  # sampled-children rule: same outcome
    for _ in range(200):
        assert accept_sampling(tree, probs, g) == ([0, 2], 1)


def test_process_logits_edge_cases():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    assert torch.allclose(process_logits(logits, 1.0, top_p=1.0), torch.softmax(logits, -1))
    cold = process_logits(logits, 1e-4)
    assert cold[0, 0] == pytest.approx(1.0) and torch.isfinite(cold).all()
    top2 = process_logits(logits, 1.0, top_k=2)
    assert (top2[0, 2:] == 0).all() and top2.sum() == pytest.approx(1.0)
    nucleus = process_logits(logits, 1.0, top_p=0.5)  # p = .61, .22, ...: only the top token is needed
    assert nucleus[0].tolist() == [1.0, 0.0, 0.0, 0.0]
    nucleus = process_logits(logits, 1.0, top_p=0.7)
    assert (nucleus[0, :2] > 0).all() and (nucleus[0, 2:] == 0).all()


def test_near_zero_temperature_sampling_equals_greedy(scripted_draft):
    draft = scripted_draft(ROOT, VOCAB)
    tree = make_tree("topk", draft, None)
    logits = torch.randn(tree.size, VOCAB, generator=torch.Generator().manual_seed(3)) * 3
    probs = process_logits(logits, 1e-5)
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        assert accept_sampling(tree, probs, g) == accept_greedy(tree, logits)
