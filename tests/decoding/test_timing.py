"""decoding.timing: the decoder times draft and verify the same way and synchronises the accelerator only
when the timings are read (once per generation), never after a forward."""

from __future__ import annotations

import pytest
import torch

from eagle_train.config.decode import DecodeConfig
from eagle_train.decoding.decoder import SpeculativeDecoder
from eagle_train.decoding.stats import GenerationStats
from eagle_train.decoding.timing import PhaseTimer, median_pass, pass_orders
from tests.decoding.test_decoder import prompts

METHODS = {
    "ar": DecodeConfig(method="ar", max_new_tokens=24),
    "chain": DecodeConfig(method="chain", chain_length=3, max_new_tokens=24),
    "eagle2": DecodeConfig(method="dynamic_tree", depth=3, top_k=4, total_tokens=12, max_new_tokens=24),
}


def test_the_host_clock_adds_each_phase_as_it_ends():
    stats = GenerationStats()
    timer = PhaseTimer(stats)
    with timer("time_draft"):
        sum(range(10_000))
    start = timer.start()
    timer.stop("time_verify", start)
    timer.stop("time_verify", start)
    assert stats.time_draft > 0 and stats.time_verify > 0 and not timer.pending
    assert timer.read() is stats


def consistent(stats: GenerationStats, speculative: bool) -> None:
    """Every phase measured, inside the wall time of the call; forwards inside their phases."""
    assert stats.time_total > 0 and stats.time_prefill > 0 and stats.time_target_forward > 0
    assert stats.time_prefill + stats.time_draft + stats.time_verify <= stats.time_total
    if speculative:
        assert stats.time_draft > 0 and stats.time_verify > 0 and stats.time_draft_forward > 0
        assert stats.time_draft_forward <= stats.time_prefill + stats.time_draft
        assert stats.time_target_forward <= stats.time_prefill + stats.time_verify


@pytest.mark.parametrize("method", sorted(METHODS))
def test_the_cpu_decoder_never_synchronises_and_times_every_phase(target, random_head, method, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the decoder synchronised an accelerator on the CPU")

    monkeypatch.setattr(torch.cuda, "synchronize", refuse)
    decoder = SpeculativeDecoder(target, None if method == "ar" else random_head, METHODS[method])
    for prompt in prompts(target):
        consistent(decoder.generate(prompt).stats, method != "ar")


@pytest.mark.gpu
@pytest.mark.parametrize("method", sorted(METHODS))
def test_the_cuda_decoder_synchronises_once_per_generation(target_cfg, method, monkeypatch):
    """On a GPU: one explicit synchronisation per `generate` (when the timings are read), whatever the
    rounds, and the same timing fields as on the CPU."""
    from eagle_train.diagnostics.gpu_checks import random_head
    from eagle_train.modeling.target import load_target

    gpu_target = load_target(target_cfg, torch.device("cuda"))
    head = None if method == "ar" else random_head(gpu_target)
    calls = []
    synchronize = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: (calls.append(a), synchronize(*a, **k)))
    decoder = SpeculativeDecoder(gpu_target, head, METHODS[method])
    for i, prompt in enumerate(prompts(gpu_target)):
        stats = decoder.generate(prompt).stats
        assert len(calls) == i + 1, f"{len(calls)} synchronisations after {i + 1} generations"
        consistent(stats, method != "ar")


def test_every_pass_visits_each_decoder_once_and_the_first_rotates():
    for count, repeats, step in [(3, 3, 1), (4, 2, 1), (7, 3, 2), (1, 2, 1)]:
        firsts = []
        for index in range(count):
            orders = pass_orders(count, index, repeats, step)
            assert len(orders) == repeats
            for order in orders:
                assert sorted(order) == list(range(count))  # a pass is a permutation
                assert order == order[:1] + [(order[0] + k) % count for k in range(1, count)]  # a rotation
            firsts += [order[0] for order in orders]
        # over `count` items every decoder starts equally often (step coprime to count here)
        assert sorted(firsts) == sorted(list(range(count)) * repeats)
    with pytest.raises(ValueError, match="needs a decoder and a pass"):
        pass_orders(0, 0, 3)


def test_the_median_pass_is_one_real_pass_the_lower_middle_for_an_even_count():
    passes = [{"s": 3.0, "id": "a"}, {"s": 1.0, "id": "b"}, {"s": 2.0, "id": "c"}]
    assert median_pass(passes, lambda p: p["s"])["id"] == "c"
    assert median_pass(passes + [{"s": 9.0, "id": "d"}], lambda p: p["s"])["id"] == "c"  # not an average
    assert median_pass([0.4, 0.1]) == 0.1
    with pytest.raises(ValueError, match="no passes"):
        median_pass([])
