"""The tuner's budget (evaluate tune_share) on real components: the stories260K target, a trained head.

What is checked is which work the budget lets through (positions calibrated, prompts decoded, the race
planned or dropped, and why), never how long anything took (shared machines)."""

from __future__ import annotations

import math
import time

import pytest

from eagle_train.autotune.budget import MIN_ROOTS, MIN_TOKENS, PARTS, Budget, race_plan
from eagle_train.autotune.replay import calibrate, greedy_sequences
from eagle_train.autotune.shapes import tune_shapes

NEW = 24


@pytest.fixture(scope="module")
def prompts(target):
    texts = ["Once upon a time, there was a little dog", "Lily and Tom went to the park", "The sun was"]
    return [target.tokenizer(t)["input_ids"] for t in texts]


def test_the_budget_is_a_share_of_the_evaluation_at_plain_decodings_speed():
    budget = Budget(0.1, eval_tokens=2000)
    assert not budget.bounded and budget.deadline("phases") == math.inf and budget.left() == math.inf
    assert budget.probe_tokens(4, 128) == 128  # unbounded: the whole limit
    budget.fix(0.05)  # 2000 tokens at 50 ms = 100 s of evaluation: 10 s of tuning
    assert budget.total_s == pytest.approx(10.0) and budget.bounded
    assert budget.deadline("calibration") == pytest.approx(budget.start + PARTS["calibration"] * 10.0)
    assert budget.to_dict()["eval_estimate_s"] == pytest.approx(100.0)
    unbounded = Budget(None, 2000)
    unbounded.fix(0.05)
    assert not unbounded.bounded and unbounded.token_s == 0.05
    # the phases' share, 0.2 x 10 s, over 4 decodes at 50 ms a token: 10 tokens, raised to the floor
    budget.start = time.perf_counter() - PARTS["calibration"] * 10.0
    assert budget.probe_tokens(4, 128) == MIN_TOKENS
    assert budget.probe_tokens(4, 8) == 8  # never above the limit
    budget.start = time.perf_counter()  # the whole budget ahead: 7.5 s to the phases' end = 37 tokens
    assert budget.probe_tokens(4, 128) in (36, 37)


def test_the_race_plan_gives_up_repeats_then_prompts_then_shapes():
    shapes = [{"tokens_per_s": 10.0}, {"tokens_per_s": 10.0}, {"tokens_per_s": 5.0}]
    # a decode of 100 tokens: 10 s, 10 s, 20 s: one pass of one prompt = 40 s
    assert race_plan(shapes, 3, 3, 100, 1e9) == (3, 3, 3)
    assert race_plan(shapes, 3, 3, 100, 40 * 3 * 2) == (3, 3, 2)
    assert race_plan(shapes, 3, 3, 100, 40 * 2) == (3, 2, 1)
    assert race_plan(shapes, 3, 3, 100, 39) == (2, 1, 1)
    assert race_plan(shapes, 3, 3, 100, 19) is None


def test_a_spent_calibration_keeps_its_floor_and_stops(target, trained_head, prompts):
    """Past its deadline the calibration still replays the first prompt's first MIN_ROOTS positions (one
    span from its start), and no later prompt."""
    sequences = greedy_sequences(target, prompts, 2 * MIN_ROOTS, lookahead=5)
    full = calibrate(target, trained_head, sequences, 2 * MIN_ROOTS, 3, 2, 12)
    cut = calibrate(target, trained_head, sequences, 2 * MIN_ROOTS, 3, 2, 12, deadline=time.perf_counter())
    assert len(full.spans) == 3 and cut.spans == [(0, MIN_ROOTS)]
    # the positions kept are the full calibration's first ones, drafted alike
    for k, table in cut.accepted.items():
        assert (table == full.accepted[k][:MIN_ROOTS]).all()


def test_greedy_calibration_decoding_fixes_the_budget_and_stops_at_its_share(target, prompts):
    budget = Budget(0.1, eval_tokens=10)
    sequences = greedy_sequences(target, prompts, NEW, lookahead=5, budget=budget)
    # 10 tokens of evaluation are worth far less than one calibration prompt: only the first is decoded
    assert len(sequences) == 1 and budget.bounded and budget.token_s > 0
    assert budget.total_s == pytest.approx(0.1 * 10 * budget.token_s)
    unbounded = Budget(None, eval_tokens=10)
    assert len(greedy_sequences(target, prompts, NEW, lookahead=5, budget=unbounded)) == 3
    assert not unbounded.bounded and unbounded.token_s > 0


@pytest.mark.slow
def test_tuning_in_a_small_budget_does_its_floor_and_says_why_the_race_was_dropped(
    target, trained_head, prompts, tmp_path, monkeypatch
):
    # whether this small head pays on a busy machine is not the point here: a shape is said to pay
    monkeypatch.setattr("eagle_train.autotune.shapes.no_shape_pays", lambda choice: None)
    grid = dict(max_depth=3, max_k=3, max_nodes=16, repeats=1)
    small = Budget(0.01, eval_tokens=100)  # about one plain decoding token of tuning
    choice, _, info = tune_shapes(target, trained_head, prompts, NEW, tmp_path, **grid, budget=small)
    assert info["calibration_prompts"] == 1 and info["calibration_rounds_positions"] == MIN_ROOTS
    assert info["probe_tokens"] == MIN_TOKENS
    assert info["budget"]["budget_s"] == pytest.approx(0.01 * 100 * info["budget"]["token_s"])
    assert choice.race == [] and info["race_note"].startswith("not raced: two shapes on one prompt")
    # a prediction the chooser calls decisive is not raced, whatever the budget
    choice, _, info = tune_shapes(target, trained_head, prompts, NEW, tmp_path, **grid, decisive=1.0)
    assert choice.race == [] and info["costs_reused"]
    assert info["race_note"].startswith("decisive: the fastest predicted pair")
    assert info["calibration_prompts"] == 3 and info["budget"]["budget_s"] is None
    # and one that fits and is not decisive is raced, in the plan the budget allows
    choice, _, info = tune_shapes(target, trained_head, prompts, NEW, tmp_path, **grid)
    assert len(choice.race) >= 2 and info["race_note"].endswith("prompts x 3 passes")
