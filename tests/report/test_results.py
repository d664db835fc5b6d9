"""The report writer on a fixed set of answer records: figures, sanity lines and the files it writes."""

from __future__ import annotations

import json

import pytest

from eagle_train.decoding.stats import GenerationStats
from eagle_train.report.results import calibration, rounds_acceptance, summarize, write_report


def record(method, qid, accept_lengths, wall_s, identical=None, depth=3, confidence=(), bench="tiny"):
    new_tokens = sum(accept_lengths)
    return {
        "bench": bench,
        "method": method,
        "question_id": qid,
        "turn": 0,
        "new_tokens": new_tokens,
        "wall_s": wall_s,
        "accept_lengths": list(accept_lengths),
        "draft_depths": [depth] * len(accept_lengths),
        "confidence": [list(c) for c in confidence],
        "identical": identical,
    }


@pytest.fixture
def records():
    return [
        record("ar", "q1", [1] * 8, 0.8, depth=0),  # plain decoding: one token per round
        record("ar", "q2", [1] * 4, 0.4, depth=0),
        # chain: 5 rounds, 12 tokens
        record("chain", "q1", [4, 1, 3], 0.3, identical=True, confidence=[(0.95, 1), (0.9, 1), (0.15, 0)]),
        record("chain", "q2", [3, 1], 0.2, identical=False, confidence=[(0.12, 1), (0.55, 0)]),
    ]


def test_summary_figures(records):
    rows = {r["method"]: r for r in summarize(records)}
    ar, chain = rows["ar"], rows["chain"]
    assert ar["tau"] == 1.0 and ar["rounds"] == 12 and ar["tokens_per_s"] == pytest.approx(10.0)
    assert chain["rounds"] == 5 and chain["tau"] == pytest.approx(12 / 5)
    assert chain["tokens_per_s"] == pytest.approx(12 / 0.5)
    assert chain["speedup"] == pytest.approx(2.4)
    assert chain["identical"] == 1 and chain["identity_checked"] == 2
    # position 1: 5 rounds reach it, 3 accept (lengths 4, 3, 3); position 2: those 3 reach, all accept;
    # position 3: 3 reach, 1 accepts (length 4)
    assert rounds_acceptance(records[2:]) == pytest.approx([3 / 5, 1.0, 1 / 3])


def test_report_and_decoder_statistics_agree(records):
    """tau and acceptance by position have one home: the decoder's stats and the report give the same."""
    stats = GenerationStats(accepted_per_round=[3, 0, 2, 2, 0], tree_depth_per_round=[3] * 5)
    rows = {r["method"]: r for r in summarize(records)}
    assert stats.tau == pytest.approx(rows["chain"]["tau"])
    assert stats.acceptance_by_position == pytest.approx(rows["chain"]["acceptance_by_position"])
    assert GenerationStats(accepted_per_round=[0], tree_depth_per_round=[2]).acceptance_by_position == [
        0.0,
        None,
    ]


def test_calibration_bins(records):
    bins = {round(b["bin_low"], 1): b for b in calibration(records)}
    assert bins[0.9]["count"] == 2 and bins[0.9]["accept_rate"] == 1.0
    assert bins[0.1]["count"] == 2 and bins[0.1]["accept_rate"] == 0.5
    assert bins[0.1]["confidence"] == pytest.approx(0.135)
    assert sum(b["count"] for b in bins.values()) == 5


def test_write_report_files(records, tmp_path):
    report = write_report(
        records, tmp_path, meta={"target": "stories260k", "temperature": 0.0}, min_rounds=10
    )
    assert (tmp_path / "report.json").is_file() and (tmp_path / "report.md").is_file()
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk["results"] == json.loads(json.dumps(report["results"]))
    for name in ("acceptance_by_position", "tau_histogram", "calibration", "speedup"):
        assert (tmp_path / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob(".*tmp*"))
    md = (tmp_path / "report.md").read_text()
    assert "| tiny | chain | 2 | 5 | 2.40 | 24.0 | 2.40x over ar | 1/2 | 0.60 | 1.00 | 0.33 |" in md
    # sanity: too few rounds and a non-identical greedy answer are both flagged
    assert any("only 5 rounds" in n for n in report["sanity"])
    assert any("1 of 2 greedy answers differ from ar other than at a near-tie" in n for n in report["sanity"])
    assert "WARNING" in md and "![speedup](speedup.png)" in md


def test_near_ties_are_counted_apart_from_real_divergences(records, tmp_path):
    """A differing greedy answer whose first differing token is a near-tie is counted as such and is no
    lossless warning; a real divergence is; an answer whose prompt differs from ar's is not compared."""
    chain = [r for r in records if r["method"] == "chain"]
    chain[1]["divergence"] = {"kind": "near_tie", "index": 3, "gap": 0.0625, "ulp": 0.0625, "tokens": [5, 6]}
    meta = {"temperature": 0.0, "near_tie_ulps": 4, "target_dtype": "bfloat16"}
    report = write_report(records, tmp_path, meta=meta, min_rounds=2, plots=False)
    row = next(r for r in report["results"] if r["method"] == "chain")
    assert (row["identical"], row["near_ties"], row["divergences"]) == (1, 1, 0)
    assert report["sanity"] == []
    assert (
        report["identity"][0]
        == "tiny/chain: greedy identity: 1 identical, 1 near-tie, 0 real divergence, of 2"
    )
    md = (tmp_path / "report.md").read_text()
    assert "| 1/2 (1 near-tie) |" in md and "within 4 ulps of the top logit (bfloat16)" in md
    chain[1]["divergence"]["kind"] = "divergence"
    report = write_report(records, tmp_path, meta=meta, min_rounds=2, plots=False)
    assert report["sanity"] == [
        "tiny/chain: 1 of 2 greedy answers differ from ar other than at a near-tie: the decoder is not lossless here"
    ]
    chain[1].update(identical=None, identity="prompt_differs")
    del chain[1]["divergence"]
    report = write_report(records, tmp_path, meta=meta, min_rounds=2, plots=False)
    assert report["sanity"] == [] and "(1 more not comparable" in report["identity"][0]


def test_speedups_are_over_the_faster_plain_decoding(records, tmp_path):
    """ar slower than HF generate (e.g. ar on sdpa, hf on flash_attention_2): every speedup is over hf, and the
    report says by how much ar is behind it; hf no faster than ar: the speedups are over ar."""
    hf = [dict(r, method="hf", identical=True) for r in records if r["method"] == "ar"]
    for r in hf:
        r["wall_s"] = r["wall_s"] / 1.5
    report = write_report(records + hf, tmp_path, meta={"temperature": 0.0}, min_rounds=2, plots=False)
    assert (
        "tiny: hf (HF generate) decodes at 1.50x ar's tokens/s: ar is not the target's fastest plain decoding "
        "here, so every speedup is over hf"
    ) in report["sanity"]
    rows = {r["method"]: r for r in report["results"]}
    assert rows["chain"]["speedup"] == pytest.approx(2.4 / 1.5) and rows["chain"]["speedup_over"] == "hf"
    assert rows["ar"]["speedup"] == pytest.approx(1 / 1.5) and rows["hf"]["speedup"] == pytest.approx(1.0)
    for r in hf:
        r["wall_s"] = r["wall_s"] * 3  # half ar's speed: the speedups are over ar, nothing to say
    report = write_report(records + hf, tmp_path, meta={"temperature": 0.0}, min_rounds=2, plots=False)
    assert not any("hf (HF generate)" in n for n in report["sanity"])
    rows = {r["method"]: r for r in report["results"]}
    assert rows["chain"]["speedup"] == pytest.approx(2.4) and rows["chain"]["speedup_over"] == "ar"


def test_sanity_clean_when_numbers_hold(records, tmp_path):
    good = [r for r in records if r["identical"] is not False]
    report = write_report(good, tmp_path, meta={"temperature": 0.0}, min_rounds=2, plots=False)
    assert report["sanity"] == []
    assert "all checks passed" in (tmp_path / "report.md").read_text()
    good[0]["prompt_cut"] = 40
    cut = write_report(good, tmp_path, meta={"temperature": 0.0}, min_rounds=2, plots=False)
    assert cut["sanity"] == ["tiny/ar: 1 prompts were longer than the context allows and were cut"]
    del good[0]["prompt_cut"]
    sampled = write_report(records, tmp_path, meta={"temperature": 0.7}, min_rounds=2, plots=False)
    assert not any("differ" in n for n in sampled["sanity"])  # no identity check when sampling
