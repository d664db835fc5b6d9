"""Benchmark prompt loaders on the real shared files and on bad user files."""

from __future__ import annotations

import json

import pytest

from eagle_train.data.prompts import BENCH_FILES, bench_name, load_questions


@pytest.mark.parametrize("bench", ["humaneval", "gsm8k", "alpaca", "sum", "qa"])
def test_single_turn_benches(bench):
    questions = load_questions(bench)
    assert len(questions) == 80
    assert all(len(q.turns) == 1 and q.turns[0].strip() for q in questions)
    assert len({q.question_id for q in questions}) == 80


def test_mt_bench_two_turns_and_limits():
    questions = load_questions("mt_bench")
    assert len(questions) == 80 and all(len(q.turns) == 2 for q in questions)
    assert questions[0].question_id == "81" and questions[0].category == "writing"
    assert questions[0].turns[1].startswith("Rewrite your previous response")
    short = load_questions("mt_bench", num_questions=3, max_turns=1)
    assert [q.question_id for q in short] == ["81", "82", "83"] and all(len(q.turns) == 1 for q in short)


def test_tinystories_prompts():
    questions = load_questions("tinystories", num_questions=5)
    assert len(questions) == 5
    assert questions[0].turns == ["Once upon a time, in a big forest, there lived a rhinoceros named Roxy."]
    assert questions[0].question_id == "0" and "paragraph" in questions[0].meta
    assert len(load_questions("tinystories")) == 713


def test_user_jsonl(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"instruction": "Say hi."}\n\n{"id": "b", "turns": ["One", "Two"]}\n')
    questions = load_questions(str(path))
    assert [q.question_id for q in questions] == ["1", "b"]
    assert questions[0].turns == ["Say hi."] and questions[1].turns == ["One", "Two"]
    assert bench_name(str(path)) == "mine" and bench_name(str(BENCH_FILES["qa"])) == "qa"


@pytest.mark.parametrize(
    "line, reason",
    [
        ("{not json", "invalid JSON"),
        ('["a"]', "expected a JSON object"),
        ('{"answer": "x"}', "no 'turns'"),
        ('{"turns": []}', "non-empty list"),
        ('{"prompt": "  "}', "non-empty string"),
    ],
)
def test_bad_records_name_file_and_line(tmp_path, line, reason):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "fine"}) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=reason) as err:
        load_questions(str(path))
    assert f"{path}:2" in str(err.value)


def test_unknown_bench_and_duplicates(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        load_questions("nope")
    path = tmp_path / "dup.jsonl"
    path.write_text('{"id": 1, "prompt": "a"}\n{"id": 1, "prompt": "b"}\n')
    with pytest.raises(ValueError, match="duplicate question id"):
        load_questions(str(path))


def test_a_latin1_prompt_file_is_one_line_naming_it(tmp_path):
    """A Latin-1 encoded prompt file is refused in one line naming the file (no raw UnicodeDecodeError)."""
    path = tmp_path / "latin1.jsonl"
    path.write_bytes('{"prompt": "un caf\u00e9 au lait"}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.jsonl: not UTF-8 text \(invalid continuation byte\)"):
        load_questions(str(path))
