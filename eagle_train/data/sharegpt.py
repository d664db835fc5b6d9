"""Load ShareGPT conversations (JSON array or JSONL) into a `datasets.Dataset` of normalised messages.

Accepted records: `{"id"?, "conversations": [...]}` or `{"id"?, "messages": [...]}`, each turn either
`{"from", "value"}` (ShareGPT/FastChat) or `{"role", "content"}` (OpenAI/HF). Roles (case-insensitive):
human/user -> user; gpt/assistant/chatgpt/bard/model -> assistant; system -> system.

Normalisation policy, applied in this order to every conversation (drops are counted by reason;
repairs of kept conversations are counted by kind, once per conversation; both in the `DropReport`):
1. A turn with an unknown role (tool, function, ...) drops the conversation (`unknown_role`).
2. Empty turns (null or whitespace-only content) are removed (fix `empty_turn_removed`); nothing
   left drops the conversation (`empty_conversation`).
3. Leading system turns are merged into one system message; a system turn after the first user or
   assistant turn drops the conversation (`system_turn_inside`); no user turn at all drops it (`no_user_turn`).
4. Assistant turns before the first user turn (a greeting replying to nothing) are removed (fix
   `leading_assistant_removed`), or drop the conversation with `leading_assistant="drop_conversation"`.
5. Consecutive turns of the same role are merged, joined by a blank line (fix `repeated_role_merged`),
   or drop the conversation with `repeated_roles="drop_conversation"` (`repeated_role`).
6. With `require_replies`: a trailing user turn (nothing to learn from) is removed (fix
   `trailing_user_removed`); a conversation with no assistant turn is dropped (`no_assistant_turn`).
   Without it (prompts for regeneration) conversations may end in a user turn.
Missing ids become `<file stem>_<index>`; a repeated id gets `_dup<k>` appended, the smallest k that no other
record holds, so the ids of a file are unique (fix `duplicate_id_renamed`; `unique_id`).
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets

from eagle_train.config.base import resolve_path
from eagle_train.config.data import DataConfig
from eagle_train.data.jsonl import first_char, json_array_records, jsonl_records
from eagle_train.runtime.errors import InputError

ROLE_MAP = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant", "model": "assistant",
    "system": "system",
}  # fmt: skip
SHAREGPT_ROLES = {"system": "system", "user": "human", "assistant": "gpt"}  # the roles as we write ShareGPT
REGENERATE_HINT = (
    "it holds prompts only (no assistant turn in any conversation): generate the replies with the target "
    "first, `python -m eagle_train.regenerate data.path=FILE`, then train on the file it writes"
)


class DataError(InputError):
    """Bad input data; the message names the file, the record (index and id) and the reason."""


@dataclass
class DropReport:
    """What normalisation or tokenisation did: dropped conversations by reason, repairs by kind."""

    counts: dict[str, int] = field(default_factory=dict)  # dropped conversations by reason
    fixes: dict[str, int] = field(default_factory=dict)  # kept conversations repaired, by kind
    seen: int = 0  # conversations read

    def drop(self, reason: str, n: int = 1) -> None:
        """Count `n` conversations dropped for `reason`."""
        self.counts[reason] = self.counts.get(reason, 0) + n

    def fix(self, kind: str, n: int = 1) -> None:
        """Count `n` repairs of kind `kind` (the conversation is kept)."""
        self.fixes[kind] = self.fixes.get(kind, 0) + n

    @property
    def total(self) -> int:
        """Conversations dropped, all reasons together."""
        return sum(self.counts.values())

    @property
    def kept(self) -> int:
        """Conversations read and not dropped."""
        return self.seen - self.total

    def merge(self, other: DropReport) -> DropReport:
        """A new report adding up both (e.g. loading then tokenising; `seen` is this report's)."""
        out = DropReport(dict(self.counts), dict(self.fixes), self.seen)
        for reason, n in other.counts.items():
            out.drop(reason, n)
        for kind, n in other.fixes.items():
            out.fix(kind, n)
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form for manifests."""
        return {
            "seen": self.seen,
            "dropped": self.total,
            "counts": dict(self.counts),
            "fixes": dict(self.fixes),
        }

    def format(self) -> str:
        """One human-readable line, e.g. `1000 conversations, 3 dropped (no_assistant_turn 3); fixed: ...`."""
        text = f"{self.seen} conversations, {self.total} dropped"
        if self.counts:
            text += " (" + ", ".join(f"{k} {v}" for k, v in sorted(self.counts.items())) + ")"
        if self.fixes:
            text += "; fixed: " + ", ".join(f"{k} {v}" for k, v in sorted(self.fixes.items()))
        return text

    def __str__(self) -> str:
        return self.format()


def check_data_file(path: str | Path) -> Path:
    """The resolved path of a data file, or a DataError for a missing file, a directory or an empty file."""
    resolved = resolve_path(path)
    if resolved is None:
        raise DataError("no data file given (data.path is empty)")
    if not resolved.exists():
        raise DataError(f"{resolved}: data file not found")
    if resolved.is_dir():
        raise DataError(f"{resolved}: is a directory, expected a ShareGPT .json or .jsonl file")
    if resolved.stat().st_size == 0:
        raise DataError(f"{resolved}: file is empty")
    return resolved


def iter_records(path: Path, chunk: int = 1 << 20) -> Iterator[tuple[int, str, Any]]:
    """(index, location for messages, record) for each record of a JSON array or JSONL file, read as a
    stream: memory holds one record at a time, whatever the file's size (a JSON array is decoded
    element by element; a file holding one pretty-printed object is the only one read whole)."""
    try:
        with open(path, encoding="utf-8") as f:
            first = first_char(f)
            f.seek(0)
            if first == "[":
                for index, record in json_array_records(path, f, chunk, DataError):
                    yield index, f"record {index}", record
            else:
                yield from _line_records(path, f)
    except UnicodeDecodeError as e:
        raise DataError(
            f"{path}: not UTF-8 text ({e.reason}): expected a ShareGPT .json or .jsonl file"
        ) from None


def _line_records(path: Path, f) -> Iterator[tuple[int, str, Any]]:
    """JSON Lines; a file whose first line is not JSON is tried as one document (a pretty-printed record)."""
    lines = iter(f)
    head = []
    for line in lines:
        head.append(line)
        if line.strip():
            break
    try:
        json.loads(head[-1]) if head else None
    except (json.JSONDecodeError, RecursionError):
        text = "".join(head) + f.read()
        try:
            document = json.loads(text)
        except (json.JSONDecodeError, RecursionError):
            document = None
        if isinstance(document, dict):
            yield 0, "record 0", document
            return
        head, lines = text.splitlines(keepends=True), iter(())
    for index, line_no, record in jsonl_records(path, itertools.chain(head, lines), DataError):
        yield index, f"record {index} (line {line_no})", record


def turn_content(value: Any) -> str | None:
    """A turn's text: a string, null, or a list of OpenAI-style `{"type": "text", "text": ...}` parts."""
    if value is None or isinstance(value, str):
        return value if value is None else valid_text(value)
    if isinstance(value, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in value):
        return valid_text("".join(p["text"] for p in value))
    raise TypeError(f"content must be a string, got {type(value).__name__}")


def valid_text(text: str) -> str:
    """`text` unchanged; TypeError for a lone surrogate (JSON allows an escaped "\\ud800", Unicode text
    does not: it could never be written out or tokenized)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise TypeError(
            f"lone surrogate {text[e.start]!r} at character {e.start}: not valid Unicode"
        ) from None
    return text


def raw_turns(record: Any) -> list[tuple[str, str | None]]:
    """(role as written, content) of each turn; TypeError/KeyError on a wrong schema."""
    if not isinstance(record, dict):
        raise TypeError(f"a record must be a JSON object, got {type(record).__name__}")
    key = "conversations" if "conversations" in record else "messages" if "messages" in record else None
    if key is None:
        raise KeyError(f"no 'conversations' or 'messages' list (keys: {sorted(record)[:8]})")
    turns = record[key]
    if not isinstance(turns, list):
        raise TypeError(f"'{key}' must be a list, got {type(turns).__name__}")
    out = []
    for k, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise TypeError(f"turn {k} must be an object, got {type(turn).__name__}")
        if "from" in turn and "value" in turn:
            role, content = turn["from"], turn["value"]
        elif "role" in turn and "content" in turn:
            role, content = turn["role"], turn["content"]
        else:
            raise KeyError(f"turn {k} needs 'from'/'value' or 'role'/'content' (keys: {sorted(turn)})")
        if not isinstance(role, str):
            raise TypeError(f"turn {k}: role must be a string, got {type(role).__name__}")
        try:
            out.append((valid_text(role), turn_content(content)))
        except TypeError as e:
            raise TypeError(f"turn {k}: {e}") from None
    return out


def normalise(
    turns: list[tuple[str, str | None]],
    report: DropReport,
    *,
    require_replies: bool = True,
    leading_assistant: str = "drop_turns",
    repeated_roles: str = "merge",
) -> list[dict[str, str]] | None:
    """Apply the module's policy to one conversation: its messages, or None if it is dropped (counted)."""
    if any(role.lower() not in ROLE_MAP for role, _ in turns):
        return report.drop("unknown_role")
    messages = [{"role": ROLE_MAP[r.lower()], "content": c} for r, c in turns if c is not None and c.strip()]
    if not messages:
        return report.drop("empty_conversation")
    system = []
    while messages and messages[0]["role"] == "system":
        system.append(messages.pop(0)["content"])
    if any(m["role"] == "system" for m in messages):
        return report.drop("system_turn_inside")
    if not any(m["role"] == "user" for m in messages):
        return report.drop("no_user_turn")
    if messages[0]["role"] == "assistant":
        if leading_assistant == "drop_conversation":
            return report.drop("leading_assistant")
        while messages[0]["role"] == "assistant":
            messages.pop(0)
        report.fix("leading_assistant_removed")
    merged = merge_repeated(messages)
    was_merged = len(merged) < len(messages)
    if was_merged and repeated_roles == "drop_conversation":
        return report.drop("repeated_role")
    if require_replies and merged[-1]["role"] == "user" and len(merged) > 1:
        merged.pop()
        report.fix("trailing_user_removed")
    if require_replies and not any(m["role"] == "assistant" for m in merged):
        return report.drop("no_assistant_turn")
    if was_merged:
        report.fix("repeated_role_merged")
    if any(c is None or not c.strip() for _, c in turns):
        report.fix("empty_turn_removed")
    messages = merged
    if system:
        messages.insert(0, {"role": "system", "content": "\n\n".join(system)})
    return messages


def merge_repeated(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """Join consecutive messages of one role with a blank line."""
    out: list[dict[str, str]] = []
    for m in messages:
        if out and out[-1]["role"] == m["role"]:
            out[-1] = {"role": m["role"], "content": out[-1]["content"] + "\n\n" + m["content"]}
        else:
            out.append(dict(m))
    return out


def iter_conversations(
    path: str | Path,
    report: DropReport,
    *,
    require_replies: bool = True,
    limit: int | None = None,
    leading_assistant: str = "drop_turns",
    repeated_roles: str = "merge",
) -> Iterator[dict[str, Any]]:
    """Stream the normalised conversations `{"id", "messages"}` of a ShareGPT file (policy in the module
    docstring), counting drops and fixes in `report`; memory holds one record at a time.

    A missing, empty or malformed file or a wrong schema raises DataError naming the file and the record
    when the stream reaches it; a file without any conversation, or (with `require_replies`) a prompt-only
    file, raises it at the end.
    """
    file = check_data_file(path)
    ids: dict[str, int] = {}
    kept, any_reply = 0, False
    for index, where, record in iter_records(file):
        record_id = record.get("id") if isinstance(record, dict) else None
        try:
            record_id = None if record_id is None else valid_text(str(record_id))
            turns = raw_turns(record)
        except (TypeError, KeyError) as e:
            name = f"{where}, id {record_id!r}" if record_id is not None else where
            raise DataError(f"{file}: {name}: wrong schema: {e.args[0]}") from None
        report.seen += 1
        any_reply = any_reply or any(ROLE_MAP.get(r.lower()) == "assistant" and c for r, c in turns)
        messages = normalise(
            turns,
            report,
            require_replies=require_replies,
            leading_assistant=leading_assistant,
            repeated_roles=repeated_roles,
        )
        if messages is None:
            continue
        kept += 1
        yield {"id": unique_id(record_id or f"{file.stem}_{index}", ids, report), "messages": messages}
        if limit is not None and kept >= limit:
            break  # read no further
    if report.seen == 0:
        raise DataError(f"{file}: file is empty (no conversation records)")
    if require_replies and not any_reply:
        raise DataError(f"{file}: {REGENERATE_HINT}")


def load_sharegpt(
    path: str | Path,
    *,
    require_replies: bool = True,
    limit: int | None = None,
    leading_assistant: str = "drop_turns",
    repeated_roles: str = "merge",
) -> tuple[datasets.Dataset, DropReport]:
    """Load and normalise a whole ShareGPT file (`iter_conversations` collected).

    Returns a Dataset with columns `id` (str) and `messages` (list of {"role", "content"}) and the
    report of what was dropped or fixed. A missing, empty or malformed file, a wrong schema, or (with
    `require_replies`) a prompt-only file raise DataError naming the file and the record.
    """
    report = DropReport()
    rows = list(
        iter_conversations(
            path,
            report,
            require_replies=require_replies,
            limit=limit,
            leading_assistant=leading_assistant,
            repeated_roles=repeated_roles,
        )
    )
    features = datasets.Features(
        {
            "id": datasets.Value("string"),
            "messages": [{"role": datasets.Value("string"), "content": datasets.Value("string")}],
        }
    )
    columns = {"id": [r["id"] for r in rows], "messages": [r["messages"] for r in rows]}
    return datasets.Dataset.from_dict(columns, features=features), report


def load_conversations(
    cfg: DataConfig, *, require_replies: bool = True
) -> tuple[datasets.Dataset, DropReport]:
    """`load_sharegpt` with the config's path, limit and policies (reads only; never writes a file)."""
    return load_sharegpt(
        cfg.path,
        require_replies=require_replies,
        limit=cfg.limit,
        leading_assistant=cfg.leading_assistant,
        repeated_roles=cfg.repeated_roles,
    )


def stream_conversations(cfg: DataConfig, report: DropReport) -> Iterator[dict[str, Any]]:
    """`iter_conversations` with the config's path, limit and policies."""
    return iter_conversations(
        cfg.path,
        report,
        limit=cfg.limit,
        leading_assistant=cfg.leading_assistant,
        repeated_roles=cfg.repeated_roles,
    )


def unique_id(record_id: str, seen: dict[str, int], report: DropReport) -> str:
    """`record_id`, or, if an earlier record of the stream already holds it, `record_id_dup<k>` with the
    smallest k >= 1 no record holds (counted). Every id returned is recorded in `seen` (id -> the last k
    tried for it), so the ids of one stream are unique by construction: `x, x, x_dup1` -> `x, x_dup1,
    x_dup1_dup1`. The one home of the renaming rule (the loader, extraction, regeneration and the mix)."""
    if record_id not in seen:
        seen[record_id] = 0
        return record_id
    k = seen[record_id]
    while (renamed := f"{record_id}_dup{k + 1}") in seen:
        k += 1
    seen[record_id], seen[renamed] = k + 1, 0
    report.fix("duplicate_id_renamed")
    return renamed


def is_eval_id(conversation_id: str, eval_fraction: float) -> bool:
    """Deterministic held-out membership: the id's SHA-256 mapped to [0, 1) falls below `eval_fraction`."""
    digest = hashlib.sha256(conversation_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < eval_fraction


def split_by_id(ds: datasets.Dataset, eval_fraction: float) -> tuple[datasets.Dataset, datasets.Dataset]:
    """(train, eval) split of a Dataset with an `id` column, stable under reordering and subsetting."""
    held_out = [is_eval_id(i, eval_fraction) for i in ds["id"]]
    train = [k for k, h in enumerate(held_out) if not h]
    evaluation = [k for k, h in enumerate(held_out) if h]
    return ds.select(train), ds.select(evaluation)
