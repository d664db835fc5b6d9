"""The prompt mix (eagle_train.data.mix) on the shipped files: order, limits, ids, provenance, bad input."""

from __future__ import annotations

import json
import re

import pytest

from eagle_train.data.mix import main, mix_conversations, parse_source
from eagle_train.data.sharegpt import DataError, load_sharegpt
from eagle_train.runtime.atomic_files import OutputError, file_sha256
from tests.conftest import DATA, error_line

STORIES = DATA / "tinystories" / "tinystories_sharegpt.jsonl"  # JSONL, from/value, with replies
PROMPTS = DATA / "sharegpt" / "sharegpt_v3_filtered_1000_first_prompts.json"  # JSON array, prompts only


def test_sources_are_written_in_order_with_their_limits_and_recorded(tmp_path):
    out = tmp_path / "mix.jsonl"
    summary = mix_conversations(out, [(str(STORIES), 5), (str(PROMPTS), 3)])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    stories, _ = load_sharegpt(STORIES, limit=5)
    prompts, _ = load_sharegpt(PROMPTS, require_replies=False, limit=3)
    assert [r["id"] for r in records] == list(stories["id"]) + list(prompts["id"])
    # the same conversations as the sources read them, written back as ShareGPT
    mixed, report = load_sharegpt(out, require_replies=False)
    assert (
        list(mixed["messages"]) == list(stories["messages"]) + list(prompts["messages"]) and not report.counts
    )
    assert (
        records[0]["conversations"][0]["from"] == "human" and records[0]["conversations"][1]["from"] == "gpt"
    )
    stats = json.loads((tmp_path / "mix.jsonl.stats.json").read_text())
    assert stats == summary and stats["conversations"] == 8
    assert [(s["kept"], s["limit"], s["sha256"]) for s in stats["sources"]] == [
        (5, 5, file_sha256(STORIES)),
        (3, 3, file_sha256(PROMPTS)),
    ]


def test_an_id_used_twice_is_renamed_and_counted(tmp_path):
    out = tmp_path / "mix.jsonl"
    summary = mix_conversations(out, [(str(STORIES), 2), (str(STORIES), 2)])
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert ids[2:] == [f"{i}_dup1" for i in ids[:2]]
    assert summary["sources"][1]["fixes"] == {"duplicate_id_renamed": 2}


def test_renamed_ids_stay_unique_across_sources(tmp_path):
    """A later source holding `x_dup1`, after an `x` of an earlier source was renamed to it, gets a fresh
    id."""
    turns = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text("".join(json.dumps({"id": i, "conversations": turns}) + "\n" for i in ("x", "x")))
    second.write_text("".join(json.dumps({"id": i, "conversations": turns}) + "\n" for i in ("x_dup1", "x")))
    mix_conversations(tmp_path / "mix.jsonl", [(str(first), None), (str(second), None)])
    ids = [json.loads(line)["id"] for line in (tmp_path / "mix.jsonl").read_text().splitlines()]
    assert ids == ["x", "x_dup1", "x_dup1_dup1", "x_dup2"]


def test_bad_input_names_the_file_and_record_and_writes_nothing(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"id": "a", "conversations": [{"from": "human", "value": "hi"}]}\n{"id": "b", "oops": 1}\n'
    )
    out = tmp_path / "mix.jsonl"
    with pytest.raises(DataError, match=r"bad\.jsonl.*line 2"):
        mix_conversations(out, [(str(STORIES), 2), (str(bad), None)])
    assert not out.exists() and list(tmp_path.iterdir()) == [bad]
    with pytest.raises(ValueError, match="one of the sources"):
        mix_conversations(bad, [(str(bad), None)])
    with pytest.raises(ValueError, match="no source"):
        mix_conversations(out, [])


def test_the_command_line(tmp_path, capsys):
    assert parse_source("a/b.json:12") == ("a/b.json", 12)
    assert parse_source("c:/x.json") == ("c:/x.json", None)
    assert parse_source("${data:sharegpt/sharegpt_v3_filtered_1000_first_prompts.json}") == (
        str(PROMPTS),
        None,
    )
    with pytest.raises(ValueError, match="must be > 0"):
        parse_source("a.json:0")
    out = tmp_path / "m.jsonl"
    main([f"out={out}", f"source={STORIES}:4", f"source={PROMPTS}:2"])
    assert "wrote 6 conversations" in capsys.readouterr().out
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        main([f"out={out}", f"source={tmp_path / 'missing.json'}"])
    assert stopped.value.code == 1 and "missing" in error_line(capsys.readouterr().err)


def test_an_out_that_is_not_an_earlier_mix_is_refused_and_kept(tmp_path, capsys):
    """`out=` an existing dataset is refused and the dataset kept; `out=` a directory is refused with an
    error naming it (no raw IsADirectoryError). Only an earlier mix, unchanged since, is replaced without
    overwrite=true."""
    dataset = tmp_path / "mine.jsonl"
    dataset.write_text(STORIES.read_text())
    with pytest.raises(
        OutputError, match=r"mine.jsonl: not written by eagle_train.data.mix .*overwrite=true"
    ):
        mix_conversations(dataset, [(str(PROMPTS), 2)])
    assert dataset.read_text() == STORIES.read_text() and not (tmp_path / "mine.jsonl.stats.json").exists()
    (tmp_path / "folder").mkdir()
    with pytest.raises(SystemExit):
        main([f"out={tmp_path / 'folder'}", f"source={PROMPTS}:2", "overwrite=true"])
    assert re.fullmatch(r"error: out=.*folder is a directory.*", error_line(capsys.readouterr().err))

    out = tmp_path / "mix.jsonl"
    mix_conversations(out, [(str(PROMPTS), 2)])
    mix_conversations(out, [(str(PROMPTS), 3)])  # an earlier mix: replaced
    assert len(out.read_text().splitlines()) == 3
    out.write_text(out.read_text() + out.read_text().splitlines()[0] + "\n")  # edited by hand
    edited = out.read_text()
    with pytest.raises(OutputError, match=r"mix.jsonl: changed since eagle_train.data.mix wrote it"):
        mix_conversations(out, [(str(PROMPTS), 2)])
    assert out.read_text() == edited
    main([f"out={out}", f"source={PROMPTS}:2", "overwrite=true"])
    assert len(out.read_text().splitlines()) == 2
    main([f"out={dataset}", f"source={PROMPTS}:2", "overwrite=true"])
    assert len(dataset.read_text().splitlines()) == 2
