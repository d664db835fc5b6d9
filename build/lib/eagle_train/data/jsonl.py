"""JSON Lines reading with errors that name the file, the line and the record (pure stdlib)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any


def jsonl_records(
    path: str | Path, lines: Iterable[str], error: type[Exception] = ValueError
) -> Iterator[tuple[int, int, Any]]:
    """(record index, line number, record) for each non-blank line of a JSON Lines file read as `lines`;
    a line that is not JSON raises `error` naming the file, the line (1-based) and the record."""
    index = 0
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise error(f"{path}: malformed JSON on line {line_no} (record {index}): {e.msg}") from None
        yield index, line_no, record
        index += 1
