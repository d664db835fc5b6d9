"""Lossless sampling end to end: `SpeculativeDecoder.generate` itself, every method, on the real
stories260K with a trained head, at temperature 1 with top-k 3. The first three generated tokens (the
prefill's sample, then a verification round) are counted over many seeded generations and tested
against the target's exact joint distribution p(t1) p(t2 | t1) p(t3 | t1, t2) with a chi-square test
(cells expected below 5 pooled), rejected below p = 1e-3; a verifier that forgets to take a rejected
child out of p fails the same test (the control). Fixed seeds: deterministic."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from eagle_train.config.decode import DecodeConfig
from eagle_train.decoding.decoder import SpeculativeDecoder
from tests.chi_square import exact_joint as exact_joint_of
from tests.chi_square import sequence_chi_square_p
from tests.decoding.test_decoder import prompts

pytestmark = pytest.mark.slow
TOP_K, TOKENS, RUNS = 3, 3, 1200
SAMPLING = dict(temperature=1.0, top_k_sampling=TOP_K, max_new_tokens=TOKENS)
CONFIGS = {
    "ar": DecodeConfig(method="ar"),
    "chain": DecodeConfig(method="chain", chain_length=3, sample_children=False),
    "chain_sampled": DecodeConfig(method="chain", chain_length=3, sample_children=True),
    "eagle1": DecodeConfig(method="static_tree", tree="mc_sim_7b_63", sample_children=False),
    "eagle1_sampled": DecodeConfig(method="static_tree", tree="mc_sim_7b_63", sample_children=True),
    "eagle2": DecodeConfig(method="dynamic_tree", depth=3, top_k=4, total_tokens=16),
}


@pytest.fixture(scope="module")
def exact_joint(target) -> dict[tuple[int, ...], float]:
    """The target's probability of every 3-token continuation of the prompt (top-k 3 at T=1)."""
    return exact_joint_of(target, prompts(target, 1)[0], TOP_K, TOKENS)


def sample_counts(target, head, cfg: DecodeConfig) -> dict[tuple[int, ...], int]:
    decoder = SpeculativeDecoder(
        target, head, replace(cfg, **SAMPLING, seed=11)
    )  # one generator for all runs
    prompt = prompts(target, 1)[0]
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(RUNS):
        tokens = tuple(decoder.generate(prompt).tokens)
        counts[tokens] = counts.get(tokens, 0) + 1
    return counts


@pytest.mark.parametrize("name", ["chain", "chain_sampled", "eagle2"])
def test_a_peagle_head_samples_the_targets_distribution(target, trained_peagle_head, exact_joint, name):
    """P-EAGLE's drafts of a round come from one forward, each depth's q not knowing the drafted tokens
    before it: still a proposal drawn from q, so the output is the target's distribution."""
    counts = sample_counts(target, trained_peagle_head, CONFIGS[name])
    assert sequence_chi_square_p(counts, exact_joint) > 1e-3


@pytest.mark.parametrize("name", ["chain", "chain_sampled"])
def test_a_dflash_head_samples_the_targets_distribution(target, trained_dflash_head, exact_joint, name):
    """DFlash drafts a round's chain from one block forward, slot k's q not knowing the tokens drafted
    before it (its top-1, or a draw from it): still a proposal from q, so the output is the target's."""
    counts = sample_counts(target, trained_dflash_head, CONFIGS[name])
    assert all(seq in exact_joint for seq in counts)
    assert sequence_chi_square_p(counts, exact_joint) > 1e-3


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_generate_samples_the_targets_distribution(target, trained_head, exact_joint, name):
    counts = sample_counts(target, trained_head, CONFIGS[name])
    assert all(seq in exact_joint for seq in counts)  # nothing outside the target's top-k support
    assert sequence_chi_square_p(counts, exact_joint) > 1e-3


def test_the_end_to_end_test_rejects_a_verifier_that_keeps_rejected_children(
    target, trained_head, exact_joint, monkeypatch
):
    """Control: the top-k rule without its residual step (a rejected child stays in p, so the bonus token
    can be the child just rejected) over-samples the draft's tokens; the same test must reject it."""
    import eagle_train.decoding.decoder as decoder

    def keep_rejected(tree, probs, generator):
        tokens, path, node = tree.token_list, [0], 0
        while True:
            p = probs[node].double()
            for child in tree.children[node]:
                if float(torch.rand((), generator=generator)) < float(p[tokens[child]]):
                    path.append(child)
                    node = child
                    break
            else:
                return path, int(torch.multinomial(p.float(), 1, generator=generator))

    monkeypatch.setattr(decoder, "accept_sampling", keep_rejected)
    counts = sample_counts(target, trained_head, CONFIGS["eagle1"])
    assert all(seq in exact_joint for seq in counts)  # still inside the support: only the rates are wrong
    assert sequence_chi_square_p(counts, exact_joint) < 1e-3


def test_the_joint_is_a_distribution(target, exact_joint):
    """Every continuation is TOKENS tokens or ends early at a stop token; the probabilities sum to 1."""
    stops = set(target.stop_token_ids)
    assert sum(exact_joint.values()) == pytest.approx(1.0)
    assert all(len(seq) == TOKENS or seq[-1] in stops for seq in exact_joint)
    assert all(t not in stops for seq in exact_joint for t in seq[:-1])
    assert len([seq for seq in exact_joint if len(seq) == TOKENS]) > TOP_K ** (TOKENS - 1)
