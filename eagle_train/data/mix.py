"""Several ShareGPT files -> one conversations JSONL: a prompt mix for `eagle_train.regenerate` (or training).

    python -m eagle_train.data.mix out=FILE.jsonl source=A.jsonl[:N] source=B.json[:N] ... [overwrite=true]

Each source is read and normalised as training reads it (`eagle_train.data.sharegpt.iter_conversations`:
JSON array or JSONL, `from`/`value`, `role`/`content` or `messages`; prompt-only files allowed), its first
N conversations kept (`:N`; all without), and written in source order as ShareGPT JSONL
`{"id", "conversations": [{"from": "system"|"human"|"gpt", "value"}]}`; an id already used by an earlier
source gets `_dup<k>` (counted; `sharegpt.unique_id`: unique by construction). Bad input raises DataError
naming the file and the record, and ends the command in one line (eagle_train.runtime.errors). The output
is streamed (one conversation in memory at a time) and written atomically, with `<out>.stats.json` beside
it: each source's path, sha256, limit and counts (read, kept, dropped by reason, repaired) and the output's
own sha256, so the mix a head was trained on can always be told. An existing `out` is replaced only when it is an earlier mix, unchanged since (its stats file says
so); anything else (a dataset, a mix edited by hand, a directory) is refused unless `overwrite=true`
(eagle_train.runtime.atomic_files.check_output_file, the rule regenerate follows too).

The CPU demo regenerates a mix of TinyStories prompts and real ShareGPT prompts
(`conf/experiment/tiny_cpu.yaml`): a head that has seen the target answer chat-style questions accepts more
on mt_bench.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from eagle_train.config.base import expand_data_ref, flag_argv
from eagle_train.data.sharegpt import (
    SHAREGPT_ROLES,
    DropReport,
    iter_conversations,
    unique_id,
)
from eagle_train.runtime.atomic_files import (
    OutputError,
    atomic_write_json,
    atomic_write_lines,
    check_output_file,
    file_sha256,
    read_json,
)
from eagle_train.runtime.errors import InputError, user_errors

WRITTEN_BY = "eagle_train.data.mix"


def parse_source(spec: str) -> tuple[str, int | None]:
    """`PATH` or `PATH:N` (N > 0 conversations) -> (path, limit or None); `${data:REL}` names a shipped file."""
    path, limit = spec, None
    head, sep, tail = spec.rpartition(":")
    if sep and tail.isdigit():
        path, limit = head, int(tail)
        if limit <= 0:
            raise InputError(f"source {spec!r}: the count after ':' must be > 0")
    return expand_data_ref(path), limit


def stats_path(out: Path) -> Path:
    """`<out>.stats.json`: the mix's provenance."""
    return out.with_name(f"{out.name}.stats.json")


def check_own_mix(out: Path) -> None:
    """OutputError unless `out` is an earlier mix unchanged since: its stats file was written by this
    command and records the file's sha256 (a stats file from before it recorded one: an earlier mix)."""
    stats = stats_path(out)
    if not stats.is_file():
        raise OutputError(f"{out}: not written by {WRITTEN_BY} (no {stats.name} beside it)")
    recorded = read_json(stats, "mix stats")
    if not isinstance(recorded, dict) or not isinstance(recorded.get("sources"), list):
        raise OutputError(f"{out}: {stats.name} was not written by {WRITTEN_BY}")
    if "written_by" not in recorded:
        return  # a mix written before the stats recorded the output's sha256
    if recorded.get("sha256") != file_sha256(out):
        raise OutputError(
            f"{out}: changed since {WRITTEN_BY} wrote it (its sha256 differs from {stats.name})"
        )


def mix_conversations(
    out: str | Path, sources: list[tuple[str, int | None]], overwrite: bool = False
) -> dict[str, Any]:
    """Write the mix of `sources` [(path, limit)] to `out` (and `<out>.stats.json`), streaming: one
    conversation in memory at a time; returns the stats. An existing `out` that is not an earlier mix
    (`check_own_mix`) is refused unless `overwrite`."""
    if not sources:
        raise InputError("no source given: source=FILE[:N], once per file")
    out = Path(out)
    if out.resolve() in {Path(path).resolve() for path, _ in sources}:
        raise InputError(f"{out}: the output is one of the sources")
    check_output_file(out, lambda: check_own_mix(out), overwrite)
    seen: dict[str, int] = {}
    stats: list[dict[str, Any]] = []
    digest = hashlib.sha256()

    def lines():
        for path, limit in sources:
            report, kept = DropReport(), 0
            for conversation in iter_conversations(path, report, require_replies=False, limit=limit):
                turns = [
                    {"from": SHAREGPT_ROLES[m["role"]], "value": m["content"]}
                    for m in conversation["messages"]
                ]
                record = {"id": unique_id(conversation["id"], seen, report), "conversations": turns}
                line = json.dumps(record, ensure_ascii=False) + "\n"
                digest.update(line.encode("utf-8"))
                yield line
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
    summary = {
        "conversations": sum(s["kept"] for s in stats),
        "sources": stats,
        "sha256": digest.hexdigest(),
        "written_by": WRITTEN_BY,
    }
    atomic_write_json(stats_path(out), summary)
    return summary


def true_or_false(value: str) -> bool:
    """`true` / `false` (any case), as Hydra writes booleans."""
    if value.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")
    return value.lower() == "true"


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
    parser.add_argument(
        "--overwrite",
        type=true_or_false,
        default=False,
        help="replace an existing out that is not an earlier mix (default false)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """CLI entry point."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    with user_errors():
        summary = mix_conversations(args.out, [parse_source(s) for s in args.source], args.overwrite)
    parts = ", ".join(f"{Path(s['path']).name} {s['kept']}" for s in summary["sources"])
    print(f"wrote {summary['conversations']} conversations to {args.out} ({parts})")


if __name__ == "__main__":
    main()
