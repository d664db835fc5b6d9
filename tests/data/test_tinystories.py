"""TinyStories -> ShareGPT conversations: split, held-out prompts, atomic output, plain rendering, CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from eagle_train.config.data import DataConfig
from eagle_train.data import tinystories
from eagle_train.data.render import ChatRenderer
from eagle_train.data.sharegpt import load_conversations, load_sharegpt
from eagle_train.data.tinystories import build_tinystories_conversations, split_first_sentence
from eagle_train.modeling.target import load_tokenizer

SRC_TEXT = (
    "Tom had a red ball. He liked to throw it.\n\n"
    'Once upon a time, there was a frog. The frog said, "Hi!" Then it jumped.\n\n'
    "The end.\n\n"
    '"Look!" said Sue.  She pointed\nat the sky.\n\n'
)


@pytest.fixture
def small_src(tmp_path):
    src = tmp_path / "stories.txt"
    src.write_text(SRC_TEXT, encoding="utf-8")
    held = tmp_path / "prompts.jsonl"
    held.write_text(json.dumps({"prompt": "Once upon a time, there was a frog.", "paragraph": "x"}) + "\n")
    return src, held


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_split_first_sentence():
    assert split_first_sentence('"Look!" said Sue. She pointed.') == ('"Look!" said Sue.', "She pointed.")
    assert split_first_sentence("Spot. Spot saw the car.") == ("Spot.", "Spot saw the car.")
    assert split_first_sentence("The end.") is None


def test_build_small_file(small_src, tmp_path):
    src, held = small_src
    out = tmp_path / "out" / "conv.jsonl"
    counts = build_tinystories_conversations(out, src, held_out_prompts=held)
    assert counts == {"written": 2, "held_out": 1, "single_sentence": 1, "empty": 1}
    records = read_jsonl(out)
    assert [r["id"] for r in records] == ["tinystories_0", "tinystories_3"]
    assert records[1]["conversations"] == [
        {"from": "human", "value": '"Look!" said Sue.'},
        {"from": "gpt", "value": "She pointed at the sky."},  # whitespace runs collapsed
    ]
    assert [p.name for p in out.parent.iterdir()] == ["conv.jsonl"]  # no temporary file left
    assert build_tinystories_conversations(out, src, limit=1, held_out_prompts=None)["written"] == 1
    assert len(read_jsonl(out)) == 1


def test_real_file_avoids_evaluation_prompts_and_renders_as_the_paragraph(tmp_path, target_cfg):
    out = tmp_path / "ts.jsonl"
    counts = build_tinystories_conversations(out_path=out)
    assert counts["written"] > 3000 and counts["held_out"] >= 700
    ds, report = load_sharegpt(out)
    assert len(ds) == counts["written"] and report.total == 0
    prompts = [json.loads(line) for line in tinystories.DEFAULT_HELD_OUT.read_text().splitlines()]
    firsts = {r["messages"][0]["content"] for r in ds}
    assert not firsts & {" ".join(p["prompt"].split()) for p in prompts}
    paragraphs = tinystories.DEFAULT_SRC.read_text().split("\n\n")
    renderer = ChatRenderer(load_tokenizer(target_cfg), target_cfg)
    tok = renderer.tokenizer
    for row in ds.select(range(40)):
        paragraph = " ".join(paragraphs[int(row["id"].rsplit("_", 1)[1])].split())
        rendered = renderer.render(row["messages"])
        assert rendered.input_ids == tok(paragraph)["input_ids"]  # BOS + the story text, nothing else
        reply = tok.decode([i for i, m in zip(rendered.input_ids, rendered.loss_mask, strict=True) if m])
        assert reply == row["messages"][1]["content"]


def test_cli_writes_the_file(tmp_path):
    out = tmp_path / "cli.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "eagle_train.data.tinystories", f"out={out}", "limit=5"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "wrote 5 conversations" in result.stdout
    assert len(read_jsonl(out)) == 5


def test_the_shipped_default_is_the_builders_output(tmp_path):
    """data/tinystories/tinystories_sharegpt.jsonl is exactly what the builder writes with its defaults."""
    out = tmp_path / "ts.jsonl"
    build_tinystories_conversations(out)
    assert out.read_bytes() == tinystories.SHIPPED.read_bytes()


def test_loading_the_default_reads_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = {p: p.stat().st_mtime_ns for p in tinystories.SHIPPED.parent.iterdir()}
    ds, _ = load_conversations(DataConfig(limit=10))
    assert len(ds) == 10 and ds[0]["id"] == "tinystories_0"
    assert {p: p.stat().st_mtime_ns for p in tinystories.SHIPPED.parent.iterdir()} == before
    assert list(tmp_path.iterdir()) == []
