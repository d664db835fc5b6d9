"""JSON Lines and JSON arrays read as streams, with errors that name the file, the line and the record
(pure stdlib)."""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TextIO


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
        except RecursionError:
            raise error(
                f"{path}: line {line_no} (record {index}): nested too deeply to be a record"
            ) from None
        yield index, line_no, record
        index += 1


def first_char(f: TextIO) -> str:
    """The first non-whitespace character of a text file ("" if there is none)."""
    while block := f.read(4096):
        stripped = block.lstrip()
        if stripped:
            return stripped[0]
    return ""


_NON_SPACE = re.compile(r"\S")


class _ArrayReader:
    """Decode the elements of a JSON array from a text stream, one at a time. The buffer holds the
    unread rest of the current chunk plus, for an element larger than a chunk, that element."""

    def __init__(self, path: Path, f, chunk: int, error: type[Exception]):
        self.path, self.f, self.chunk, self.error = path, f, chunk, error
        self.buf, self.pos, self.line, self.eof = "", 0, 1, False
        self.decoder = json.JSONDecoder()

    def more(self, size: int) -> bool:
        """Append `size` more characters, dropping what was consumed; False at the end of the file."""
        data = self.f.read(size)
        if not data:
            self.eof = True
            return False
        self.line += self.buf.count("\n", 0, self.pos)
        self.buf, self.pos = self.buf[self.pos :] + data, 0
        return True

    def peek(self) -> str:
        """The next non-whitespace character ("" at the end of the file); the position moves onto it."""
        while True:
            found = _NON_SPACE.search(self.buf, self.pos)
            if found:
                self.pos = found.start()
                return self.buf[self.pos]
            self.pos = len(self.buf)
            if not self.more(self.chunk):
                return ""

    def value(self, index: int) -> Any:
        """Decode the element at the position (reading more while it is cut off by the buffer's end)."""
        while True:
            try:
                record, end = self.decoder.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as e:
                cut = e.pos >= len(self.buf) - 16 or e.msg.startswith("Unterminated string")
                if cut and not self.eof and self.more(max(self.chunk, len(self.buf))):
                    continue
                self.fail(e.msg, e.pos)
            except RecursionError:
                raise self.error(
                    f"{self.path}: record {index}: nested too deeply to be a conversation"
                ) from None
            if end == len(self.buf) and not isinstance(record, dict | list) and not self.eof:
                self.more(self.chunk)  # a number or literal may continue in the next chunk
                continue
            self.pos = end
            return record

    def fail(self, message: str, pos: int | None = None) -> None:
        pos = self.pos if pos is None else pos
        line = self.line + self.buf.count("\n", 0, pos)
        column = pos - self.buf.rfind("\n", 0, pos)
        raise self.error(f"{self.path}: malformed JSON at line {line}, column {column}: {message}")


def json_array_records(
    path: str | Path, f: TextIO, chunk: int = 1 << 20, error: type[Exception] = ValueError
) -> Iterator[tuple[int, Any]]:
    """(index, element) for each element of the JSON array in the text stream `f`, decoded one
    at a time (memory: one chunk plus the element being decoded); malformed JSON raises `error` naming
    the file, the line and the column."""
    reader = _ArrayReader(Path(path), f, chunk, error)
    reader.peek()
    reader.pos += 1  # the opening "["
    if reader.peek() == "]":
        reader.pos += 1
    else:
        for index in itertools.count():
            yield index, reader.value(index)
            separator = reader.peek()
            reader.pos += 1
            if separator == "]":
                break
            if separator != ",":
                reader.fail("Expecting ',' delimiter", reader.pos - (1 if separator else 0))
            if reader.peek() == "]":
                reader.fail("Expecting value")
    if reader.peek():
        reader.fail("Extra data")
