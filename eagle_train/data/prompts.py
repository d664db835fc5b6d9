"""Benchmark prompts for evaluation: the reference question sets, TinyStories prompts, any user JSONL.

A benchmark is named either by a short name (`mt_bench`, `humaneval`, `gsm8k`, `alpaca`, `sum`, `qa`:
the shipped `data/bench/<name>/question.jsonl`; `tinystories`: `data/tinystories/tinystories_prompts.jsonl`)
or by a path to a JSONL file. Each line of a file is one question:
`{"question_id", "category", "turns": [str, ...]}` (the reference layout; mt_bench has two turns), or a
single prompt under `prompt`, `question`, `instruction` or `text` (TinyStories prompts use `prompt`).
A multi-turn question is asked turn by turn with the model's own earlier answers kept in context.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from eagle_train.config.base import data_path, resolve_path
from eagle_train.runtime.errors import InputError

BENCH_FILES = {
    **{
        name: data_path(f"bench/{name}/question.jsonl")
        for name in ("mt_bench", "humaneval", "gsm8k", "alpaca", "sum", "qa")
    },
    "tinystories": data_path("tinystories/tinystories_prompts.jsonl"),
}
PROMPT_KEYS = ("prompt", "question", "instruction", "text")
ID_KEYS = ("question_id", "id")


@dataclass
class Question:
    """One benchmark question: the user turns, asked in order."""

    question_id: str  # the record's question_id / id, else its line number
    turns: list[str]  # user messages; turn k is asked after the model's answers to turns < k
    category: str = ""  # the record's category, if any
    meta: dict = field(default_factory=dict)  # other fields of the record, kept for answers.jsonl


def bench_path(bench: str) -> Path:
    """The question file of a benchmark name, or `bench` itself as a path to a JSONL file."""
    if bench in BENCH_FILES:
        return BENCH_FILES[bench]
    path = resolve_path(bench)
    if path is None or not path.is_file():
        known = ", ".join(sorted(BENCH_FILES))
        raise FileNotFoundError(
            f"benchmark {bench!r}: neither a known name ({known}) nor an existing JSONL file"
        )
    return path


def bench_name(bench: str) -> str:
    """A short name for reports: the benchmark name, or the file's stem (its parent's name for question.jsonl)."""
    if bench in BENCH_FILES:
        return bench
    path = Path(bench)
    return path.parent.name if path.stem == "question" else path.stem


def parse_question(record: object, where: str, line_no: int) -> Question:
    """One JSONL record -> Question; `where` (file:line) names the record in errors."""
    if not isinstance(record, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "turns" in record:
        turns = record["turns"]
        if (
            not isinstance(turns, list)
            or not turns
            or not all(isinstance(t, str) and t.strip() for t in turns)
        ):
            raise InputError(f"{where}: 'turns' must be a non-empty list of non-empty strings")
    else:
        key = next((k for k in PROMPT_KEYS if k in record), None)
        if key is None:
            raise InputError(f"{where}: no 'turns' and none of {list(PROMPT_KEYS)} in the record")
        if not isinstance(record[key], str) or not record[key].strip():
            raise InputError(f"{where}: {key!r} must be a non-empty string")
        turns = [record[key]]
    id_key = next((k for k in ID_KEYS if k in record), None)
    question_id = str(record[id_key]) if id_key else str(line_no)
    skip = {"turns", "category", *PROMPT_KEYS, *ID_KEYS}
    meta = {k: v for k, v in record.items() if k not in skip and isinstance(v, (str, int, float, bool))}
    return Question(question_id, list(turns), str(record.get("category", "") or ""), meta)


def load_questions(
    bench: str, num_questions: int | None = None, max_turns: int | None = None
) -> list[Question]:
    """The questions of a benchmark (name or JSONL path), the first `num_questions` of them (None = all),
    each cut to its first `max_turns` turns (None = all). Errors name the file, the line and the reason."""
    path = bench_path(bench)
    try:
        return _read_questions(path, num_questions, max_turns)
    except UnicodeDecodeError as err:
        raise InputError(f"{path}: not UTF-8 text ({err.reason}): save the prompt file as UTF-8") from None


def _read_questions(path: Path, num_questions: int | None, max_turns: int | None) -> list[Question]:
    questions: list[Question] = []
    seen: set[str] = set()
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if num_questions is not None and len(questions) >= num_questions:
                break
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{where}: invalid JSON ({e.msg})") from e
            question = parse_question(record, where, line_no)
            if question.question_id in seen:
                raise InputError(f"{where}: duplicate question id {question.question_id!r}")
            seen.add(question.question_id)
            question.turns = question.turns[:max_turns] if max_turns else question.turns
            questions.append(question)
    if not questions:
        raise InputError(f"{path}: no questions")
    return questions
