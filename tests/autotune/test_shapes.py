"""The replayed acceptance and the shape chooser on real components: the stories260K target, a trained head, the real decoder.

The replayed acceptance must be what the decoder really accepts on the same prompts, the choice must be
the argmax of the chooser's own predictions, and the cost curves must be cached per key and reused.
No timing is asserted (shared machines): speed is measured by scripts/bench_decode.py."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from eagle_train.autotune.costs import cache_path, cached_costs, cost_key, measure_costs, monotone
from eagle_train.autotune.replay import auto_tree_paths, calibrate, greedy_sequences, replay_tau
from eagle_train.autotune.shapes import (
    RoundModel,
    choose_shapes,
    fit_line,
    no_shape_pays,
    race_candidates,
    race_shapes,
    tune_shapes,
)
from eagle_train.config.decode import DecodeConfig, load_tree_paths
from eagle_train.decoding.decoder import SpeculativeDecoder

NEW = 24  # no TinyStories story ends this early: no stop token, so the replay is exact


@pytest.fixture(scope="module")
def prompts(target):
    texts = ["Once upon a time, there was a little dog", "Lily and Tom went to the park", "The sun was"]
    return [target.tokenizer(t)["input_ids"] for t in texts]


@pytest.fixture(scope="module")
def calibration(target, trained_head, prompts):
    sequences = greedy_sequences(target, prompts, NEW, lookahead=5)
    static = auto_tree_paths(load_tree_paths("mc_sim_7b_63"), 4)
    return calibrate(target, trained_head, sequences, NEW, 4, 4, 24, static_paths=static)


@pytest.fixture(scope="module")
def costs(target, trained_head):
    return measure_costs(target, trained_head, 32, max_nodes=24, max_depth=4, max_k=4, repeats=1)


def decoded_tau(target, head, prompts, **shape) -> float:
    decoder = SpeculativeDecoder(target, head, DecodeConfig(max_new_tokens=NEW, **shape))
    accepted = [a for p in prompts for a in decoder.generate(p).stats.accepted_per_round]
    return sum(a + 1 for a in accepted) / len(accepted)


@pytest.mark.parametrize("depth,top_k,total", [(1, 1, 2), (2, 2, 6), (3, 4, 16), (4, 3, 24), (4, 4, 10)])
def test_replayed_tau_is_the_decoders_tau(target, trained_head, prompts, calibration, depth, top_k, total):
    replayed = replay_tau(calibration.accepted[top_k][:, depth - 1, total - 2 : total - 1], calibration.spans)
    measured = decoded_tau(
        target, trained_head, prompts, method="dynamic_tree", depth=depth, top_k=top_k, total_tokens=total
    )
    assert float(replayed[0]) == pytest.approx(measured, abs=1e-9)


@pytest.mark.parametrize("length", [1, 3, 5])
def test_replayed_chain_tau_is_the_decoders(target, trained_head, prompts, calibration, costs, length):
    choice = choose_shapes(calibration, costs)
    column = calibration.accepted[1][:, max(length - 1, 1) - 1, length - 1 : length]
    assert float(replay_tau(column, calibration.spans)[0]) == pytest.approx(
        decoded_tau(target, trained_head, prompts, method="chain", chain_length=length), abs=1e-9
    )
    assert 1 <= choice.chain["chain_length"] <= calibration.max_depth + 1


def test_the_pruned_static_tree_replays_as_the_decoder_decodes(
    target, trained_head, prompts, calibration, costs
):
    choice = choose_shapes(calibration, costs)
    paths = choice.static_tree["tree_paths"]
    assert len(paths) + 1 == choice.static_tree["nodes"] and all(
        p[:-1] in paths or len(p) == 1 for p in paths
    )
    measured = decoded_tau(target, trained_head, prompts, method="static_tree", tree="auto", tree_paths=paths)
    assert choice.static_tree["tau"] == pytest.approx(measured, abs=1e-9)
    # the candidates: mc_sim_7b_63 and the top-1 chain (with second-best children) to depth 5
    assert len(calibration.static.paths) - 1 == len(auto_tree_paths(load_tree_paths("mc_sim_7b_63"), 4))
    assert (0, 0, 0, 0, 0) in calibration.static.paths and (0, 0, 0, 0, 1) in calibration.static.paths


def test_the_choice_is_the_argmax_of_its_own_model(calibration, costs):
    model = RoundModel(costs, draft_scale=1.5, verify_scale=0.8, other_s=2e-4, ar_token_s=3e-3)
    choice = choose_shapes(calibration, model)
    best = max(choice.sweep, key=lambda r: r["tokens_per_s"])
    assert choice.dynamic_tree == best == choice.sweep[0]
    for row in choice.sweep[:: max(1, len(choice.sweep) // 40)]:  # every prediction is the model's own
        again = model.predict(row["tau"], costs.expand(row["depth"], row["top_k"]), row["total_tokens"])
        assert row["tokens_per_s"] == pytest.approx(again["tokens_per_s"])
        assert row["tau"] == pytest.approx(
            float(
                replay_tau(
                    calibration.accepted[row["top_k"]][:, row["depth"] - 1, row["total_tokens"] - 2 :][:, :1],
                    calibration.spans,
                )[0]
            )
        )
    # every depth / top_k / total up to the candidates a shape has, nothing beyond
    shapes = {(r["depth"], r["top_k"], r["total_tokens"]) for r in choice.sweep}
    assert (4, 4, 24) in shapes and (1, 1, 3) in shapes and (1, 1, 4) not in shapes  # 2 candidates
    assert choice.ar_tokens_per_s == pytest.approx(1 / 3e-3)
    assert choice.decode_fields("dynamic_tree") == {k: best[k] for k in ("depth", "top_k", "total_tokens")}


def test_a_head_that_cannot_pay_is_said_to_in_one_line(calibration, costs):
    """Plain decoding faster than every predicted shape: one line with the fastest shape's prediction and the
    tau or round time it would need to break even (tokens/s = tau / round time); a shape that pays: None."""
    model = RoundModel(costs, ar_token_s=costs.verify(1))
    paying = choose_shapes(calibration, model)
    assert paying.dynamic_tree["tokens_per_s"] > paying.ar_tokens_per_s and no_shape_pays(paying) is None
    fastest = max(r["tokens_per_s"] for r in (paying.dynamic_tree, paying.chain, paying.static_tree))
    ar_s = 1 / (1.2 * fastest)  # plain decoding 1.2x the fastest shape's predicted tokens/s
    losing = choose_shapes(calibration, replace(model, ar_token_s=ar_s))
    verdict = no_shape_pays(losing)
    best = max((losing.dynamic_tree, losing.chain, losing.static_tree), key=lambda r: r["tokens_per_s"])
    round_s = sum(best["round_s"].values())
    assert verdict.startswith("no shape is predicted to beat plain decoding: the fastest, ")
    assert f"against ar's {1 / ar_s:.1f} (0.83x)" in verdict
    assert f"tau would have to reach {round_s / ar_s:.2f} (predicted {best['tau']:.2f})" in verdict
    assert f"round take {best['tau'] * ar_s * 1e3:.1f} ms (predicted {round_s * 1e3:.1f})" in verdict
    assert verdict.endswith("serve without this head")


def test_the_race_takes_the_best_predicted_shape_of_the_fastest_depth_top_k_pairs(calibration, costs):
    sweep = choose_shapes(calibration, costs).sweep
    picked = race_candidates(sweep, 3)
    pairs = [(r["depth"], r["top_k"]) for r in picked]
    assert len(picked) == 3 and len(set(pairs)) == 3
    # in the sweep's order, each the first (fastest predicted) row of its pair
    firsts = {}
    for r in sweep:
        firsts.setdefault((r["depth"], r["top_k"]), r)
    assert picked == list(firsts.values())[:3]
    assert race_candidates(sweep[:1], 4) == sweep[:1]


def test_the_race_times_the_real_decoder_and_ranks_by_what_it_measured(target, trained_head, prompts):
    shapes = [
        {"depth": 3, "top_k": 4, "total_tokens": 16, "tokens_per_s": 1.0},
        {"depth": 1, "top_k": 2, "total_tokens": 3, "tokens_per_s": 2.0},
    ]
    raced = race_shapes(target, trained_head, prompts, shapes, NEW, repeats=2)
    assert sorted((r["depth"], r["top_k"], r["total_tokens"]) for r in raced) == [(1, 2, 3), (3, 4, 16)]
    assert raced[0]["race_tokens_per_s"] >= raced[1]["race_tokens_per_s"] > 0
    for r in raced:  # the predictions are carried over, tau is what the decoder accepted
        assert r["tokens_per_s"] == (1.0 if r["depth"] == 3 else 2.0)
        shape = {"depth": r["depth"], "top_k": r["top_k"], "total_tokens": r["total_tokens"]}
        assert r["race_tau"] == pytest.approx(
            decoded_tau(target, trained_head, prompts, method="dynamic_tree", **shape)
        )
        # tokens / seconds: every prompt decodes NEW tokens, the first of them from the prefill
        assert r["race_tokens_per_s"] == pytest.approx(len(prompts) * (NEW - 1) / r["race_s"])


def test_the_phase_fit_is_a_line_with_a_fixed_part_or_through_the_origin():
    assert fit_line([(1.0, 3.0), (2.0, 5.0), (4.0, 9.0)]) == pytest.approx((1.0, 2.0))
    assert fit_line([(1.0, 0.5), (3.0, 4.5)]) == pytest.approx((0.0, 14.0 / 10.0))  # intercept < 0
    assert fit_line([(2.0, 3.0)]) == pytest.approx((0.0, 1.5))  # one probe: a scale only
    assert fit_line([(2.0, 3.0), (2.0, 5.0)]) == pytest.approx((0.0, 2.0))  # one x: a scale only


def test_cost_curves_are_measured_whole_and_monotone(costs):
    assert len(costs.verify_s) == 24 and len(costs.expand_s) == 4 and len(costs.expand_s[0]) == 4
    assert len(costs.catch_up_s) == 6 and len(costs.step_s) >= 4
    for curve in (costs.verify_s, costs.step_s, costs.catch_up_s, *zip(*costs.expand_s, strict=True)):
        assert all(0 < a <= b for a, b in zip(curve, curve[1:], strict=False))
    assert monotone([3.0, 1.0, 2.0, 5.0, 4.0]) == [1.0, 1.0, 2.0, 4.0, 4.0]


def test_the_cost_cache_is_keyed_and_reused(target, trained_head, costs, tmp_path):
    key = cost_key(target, trained_head, 32, 24, 4, 4, 1)
    calls = []

    def measure():
        calls.append(1)
        return costs

    first, reused = cached_costs(tmp_path, key, measure)
    assert not reused and calls == [1]
    again, reused = cached_costs(tmp_path, key, measure)
    assert reused and calls == [1] and again.verify_s == first.verify_s
    stored = json.loads(cache_path(tmp_path, key).read_text())
    assert stored["key"] == key and stored["key"]["threads"] == torch.get_num_threads()
    # another thread count, context or dtype is another entry ...
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        other_threads = cost_key(target, trained_head, 32, 24, 4, 4, 1)
    finally:
        torch.set_num_threads(threads)
    # ... and so is a compiled decoder (target.compile_decode: other forward times), under each wrapper
    compiled = replace(target, cfg=replace(target.cfg, compile_decode=True))
    python_wrapper = replace(target, cfg=replace(target.cfg, compile_decode=True, compile_cpp_wrapper=False))
    frozen = replace(target, cfg=replace(target.cfg, compile_decode=True, compile_frozen=True))
    others = [
        other_threads,
        cost_key(target, trained_head, 64, 24, 4, 4, 1),
        {**key, "dtype": "bfloat16"},
        cost_key(compiled, trained_head, 32, 24, 4, 4, 1),
        cost_key(python_wrapper, trained_head, 32, 24, 4, 4, 1),
        cost_key(frozen, trained_head, 32, 24, 4, 4, 1),
    ]
    assert len({cache_path(tmp_path, k) for k in [key, *others]}) == 7
    # a file whose key was edited is measured again
    stored["key"]["context"] = 99
    cache_path(tmp_path, key).write_text(json.dumps(stored))
    _, reused = cached_costs(tmp_path, key, measure)
    assert not reused and calls == [1, 1]


@pytest.mark.slow
def test_tune_shapes_end_to_end_reuses_its_cache(target, trained_head, prompts, tmp_path):
    choice, costs, info = tune_shapes(
        target, trained_head, prompts[:2], 16, tmp_path, max_depth=3, max_k=3, max_nodes=16, repeats=1
    )
    assert not info["costs_reused"] and (tmp_path / info["costs_file"].split("/")[-1]).is_file()
    assert choice.dynamic_tree["depth"] <= 3 and choice.dynamic_tree["total_tokens"] <= 16
    # the race settled the EAGLE-2 choice: its fastest measured candidate, each a predicted shape
    assert len(choice.race) >= 2 and info["race_s"] > 0
    shape = lambda r: (r["depth"], r["top_k"], r["total_tokens"])  # noqa: E731
    assert shape(choice.dynamic_tree) == shape(choice.race[0])
    assert {shape(r) for r in choice.race} <= {shape(r) for r in choice.sweep}
    _, _, again = tune_shapes(
        target, trained_head, prompts[:2], 16, tmp_path, max_depth=3, max_k=3, max_nodes=16, repeats=1
    )
    assert again["costs_reused"] and again["costs_file"] == info["costs_file"]
    # the chosen shape decodes with greedy identity
    fields = choice.decode_fields("dynamic_tree")
    ar = SpeculativeDecoder(target, None, DecodeConfig(method="ar", max_new_tokens=16))
    tree = SpeculativeDecoder(
        target, trained_head, DecodeConfig(method="dynamic_tree", max_new_tokens=16, **fields)
    )
    for p in prompts:
        assert tree.generate(p).tokens == ar.generate(p).tokens


def test_auto_shapes_are_refused_by_the_decoder_and_kept_where_set(target, trained_head):
    cfg = DecodeConfig(method="dynamic_tree", shape="auto")
    assert cfg.auto_methods == ("chain", "dynamic_tree")
    with pytest.raises(ValueError, match="decode.shape=auto"):
        SpeculativeDecoder(target, trained_head, cfg)
    assert DecodeConfig(shape="auto", depth=3).auto_methods == ("chain",)
    assert DecodeConfig(shape="auto", chain_length=2).auto_methods == ("dynamic_tree",)
    assert DecodeConfig(shape="fixed").auto_methods == ()
    assert DecodeConfig(tree="auto").auto_methods == ("static_tree",)
    assert DecodeConfig(tree="auto", tree_paths=[[0]]).auto_methods == ()
    with pytest.raises(ValueError, match="decode.shape=auto"):
        SpeculativeDecoder(target, trained_head, DecodeConfig(method="static_tree", tree="auto"))
    SpeculativeDecoder(
        target, trained_head, DecodeConfig(method="static_tree", shape="auto")
    )  # not tuned: fine
    with pytest.raises(ValueError, match="decode.shape"):
        DecodeConfig(shape="big")


@pytest.mark.slow
def test_eagle3_heads_are_tuned_too(target, trained_eagle3_head, prompts, tmp_path):
    """An EAGLE-3 head reads the target's aux features and drafts over its reduced vocabulary: the replay
    drafts as the decoder does (same tau on the same prompts), and its chosen shape decodes losslessly."""
    head = trained_eagle3_head
    sequences = greedy_sequences(target, prompts, NEW, lookahead=5)
    static = auto_tree_paths(load_tree_paths("mc_sim_7b_63"), 3)
    calibration = calibrate(target, head, sequences, NEW, 3, 3, 16, static_paths=static)
    for depth, top_k, total in ((2, 3, 10), (3, 2, 16)):
        replayed = replay_tau(
            calibration.accepted[top_k][:, depth - 1, total - 2 : total - 1], calibration.spans
        )
        decoded = decoded_tau(
            target, head, prompts, method="dynamic_tree", depth=depth, top_k=top_k, total_tokens=total
        )
        assert float(replayed[0]) == pytest.approx(decoded, abs=1e-9)
    costs = measure_costs(target, head, 32, max_nodes=16, max_depth=3, max_k=3, repeats=1)
    choice = choose_shapes(calibration, costs)
    assert choice.static_tree["tau"] == pytest.approx(
        decoded_tau(
            target,
            head,
            prompts,
            method="static_tree",
            tree="auto",
            tree_paths=choice.static_tree["tree_paths"],
        ),
        abs=1e-9,
    )
    ar = SpeculativeDecoder(target, None, DecodeConfig(method="ar", max_new_tokens=NEW))
    tree = SpeculativeDecoder(
        target,
        head,
        DecodeConfig(method="dynamic_tree", max_new_tokens=NEW, **choice.decode_fields("dynamic_tree")),
    )
    for p in prompts:
        assert tree.generate(p).tokens == ar.generate(p).tokens


@pytest.mark.slow
def test_peagle_chains_are_replayed_and_costed_as_one_forward(target, trained_peagle_head, prompts):
    """A P-EAGLE head drafts a round in its catch-up: the replay (one real pair + placeholders per position)
    gives the decoder's tau for chains and trees alike, the cost curves say so (`parallel`: a round's
    catch-up carries its tree depth - 1 placeholders, so a longer chain costs a wider catch-up, not more
    forwards), and the chosen chain decodes losslessly."""
    head = trained_peagle_head
    sequences = greedy_sequences(target, prompts, NEW, lookahead=5)
    calibration = calibrate(target, head, sequences, NEW, 4, 2, 12)
    for length in (2, 4, 5):
        column = calibration.accepted[1][:, max(length - 1, 1) - 1, length - 1 : length]
        decoded = decoded_tau(target, head, prompts, method="chain", chain_length=length)
        assert float(replay_tau(column, calibration.spans)[0]) == pytest.approx(decoded, abs=1e-9)
    replayed = replay_tau(calibration.accepted[2][:, 2, 8:9], calibration.spans)  # depth 3, top_k 2, 10 nodes
    decoded = decoded_tau(target, head, prompts, method="dynamic_tree", depth=3, top_k=2, total_tokens=10)
    assert float(replayed[0]) == pytest.approx(decoded, abs=1e-9)
    costs = measure_costs(target, head, 32, max_nodes=12, max_depth=4, max_k=2, repeats=1)
    assert costs.parallel and len(costs.catch_up_s) == 2 * 4 + 2 and costs.key["head_kind"] == "peagle"
    assert costs.catch_up(2.0, 3) == costs.catch_up(5.0)  # 2 accepted + 3 placeholders: 5 inputs
    # a static tree of any depth is one top-k over the catch-up's rows (expand.expand_parallel)
    assert costs.static_draft([1] * 5) == costs.static_draft([2, 4, 4]) == costs.step_s[0]
    serial = replace(costs, parallel=False)  # an EAGLE-3 head's curves: one draft step per depth but the last
    assert serial.static_draft([2, 4, 4]) == costs.step_s[1] + costs.step_s[3]
    choice = choose_shapes(calibration, costs)
    chain = SpeculativeDecoder(
        target, head, DecodeConfig(method="chain", max_new_tokens=NEW, **choice.decode_fields("chain"))
    )
    ar = SpeculativeDecoder(target, None, DecodeConfig(method="ar", max_new_tokens=NEW))
    for p in prompts:
        assert chain.generate(p).tokens == ar.generate(p).tokens
