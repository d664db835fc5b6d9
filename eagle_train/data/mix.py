"""Several ShareGPT files -> one conversations JSONL: a prompt mix for `eagle_train.regenerate` (or training).

    python -m eagle_train.data.mix out=FILE.jsonl source=A.jsonl[:N] source=B.json[:N] ...

Each source is read and normalised as training reads it (`eagle_train.data.sharegpt.iter_conversations`:
JSON array or JSONL, `from`/`value`, `role`/`content` or `messages`; prompt-only files allowed), its first
N conversations kept (`:N`; all without), and written in source order as ShareGPT JSONL
`{"id", "conversations": [{"from": "system"|"human"|"gpt", "value"}]}`; an id already used by an earlier
source gets `_dup<k>` (counted). Bad input raises DataError naming the file and the record. The output is
streamed (one conversation in memory at a time) and written atomically, with `<out>.stats.json` beside it:
each source's path, sha256, limit and counts (read, kept, dropped by reason, repaired), so the mix a head
was trained on can always be told.

The CPU demo regenerates a mix of TinyStories prompts and real ShareGPT prompts
(`conf/experiment/tiny_cpu.yaml`): a head that has seen the target answer chat-style questions accepts more
on mt_bench.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from eagle_train.config.base import expand_data_ref, flag_argv
from eagle_train.data.sharegpt import (
    SHAREGPT_ROLES,
    DataError,
    DropReport,
    iter_conversations,
    unique_id,
)
from eagle_train.runtime.atomic_files import atomic_write_json, atomic_write_lines, file_sha256


def parse_source(spec: str) -> tuple[str, int | None]:
    """`PATH` or `PATH:N` (N > 0 conversations) -> (path, limit or None); `${data:REL}` names a shipped file."""
    path, limit = spec, None
    head, sep, tail = spec.rpartition(":")
    if sep and tail.isdigit():
        path, limit = head, int(tail)
        if limit <= 0:
            raise ValueError(f"source {spec!r}: the count after ':' must be > 0")
    return expand_data_ref(path), limit


def mix_conversations(out: str | Path, sources: list[tuple[str, int | None]]) -> dict[str, Any]:
    """Write the mix of `sources` [(path, limit)] to `out` (and `<out>.stats.json`), streaming: one
    conversation in memory at a time; returns the stats."""
    if not sources:
        raise ValueError("no source given: source=FILE[:N], once per file")
    out = Path(out)
    if out.resolve() in {Path(path).resolve() for path, _ in sources}:
        raise ValueError(f"{out}: the output is one of the sources")
    seen: dict[str, int] = {}
    stats: list[dict[str, Any]] = []

    def lines():
        for path, limit in sources:
            report, kept = DropReport(), 0
            for conversation in iter_conversations(path, report, require_replies=False, limit=limit):
                turns = [
                    {"from": SHAREGPT_ROLES[m["role"]], "value": m["content"]}
                    for m in conversation["messages"]
                ]
                record = {"id": unique_id(conversation["id"], seen, report), "conversations": turns}
                yield json.dumps(record, ensure_ascii=False) + "\n"
                kept += 1
            stats.append(
                {
                    "path": str(path),
                    "sha256": file_sha256(path),
                    "limit": limit,
                    "read": report.seen,
                    "kept": kept,
                    "dropped": dict(report.counts),
                    "fixes": dict(report.fixes),
                }
            )

    atomic_write_lines(out, lines())
    summary = {"conversations": sum(s["kept"] for s in stats), "sources": stats}
    atomic_write_json(out.with_name(f"{out.name}.stats.json"), summary)
    return summary


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Accepts `key=value` (Hydra-like) as well as `--key value`."""
    argv = flag_argv(argv)
    parser = argparse.ArgumentParser(
        prog="python -m eagle_train.data.mix", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--out", required=True, help="conversations JSONL to write")
    parser.add_argument(
        "--source",
        action="append",
        required=True,
        help="a ShareGPT file, optionally :N for its first N conversations; once per file, in order",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """CLI entry point."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        summary = mix_conversations(args.out, [parse_source(s) for s in args.source])
    except (DataError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    parts = ", ".join(f"{Path(s['path']).name} {s['kept']}" for s in summary["sources"])
    print(f"wrote {summary['conversations']} conversations to {args.out} ({parts})")


if __name__ == "__main__":
    main()
