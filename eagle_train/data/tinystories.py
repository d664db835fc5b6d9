"""TinyStories paragraphs -> ShareGPT conversations for the embedded stories260K target.

Writes JSON Lines, one conversation per paragraph of the shipped
`data/tinystories/tinystories_val_head.txt` (split on blank lines, whitespace
runs collapsed to one space):
    {"id": "tinystories_<paragraph index>",
     "conversations": [{"from": "human", "value": <first sentence>}, {"from": "gpt", "value": <the rest>}]}
Rendered with the `plain` template (BOS, then the turns joined by one space) the text is the paragraph
itself, so the head trains on ordinary story text with the loss on everything after the first sentence.
Paragraphs that are evaluation prompts (`tinystories_prompts.jsonl`: same paragraph or same first
sentence) are left out by default, so the demo evaluates on held-out stories; so are one-sentence paragraphs.

    python -m eagle_train.data.tinystories out=FILE.jsonl [limit=N] [src=FILE] [held_out=FILE|none]

The default training data (`conf/data/tinystories.yaml`) is this builder's output with the defaults,
shipped as `data/tinystories/tinystories_sharegpt.jsonl` (`make data` rewrites it; a test checks that
the builder reproduces it byte for byte), so loading the default never writes anything.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from eagle_train.config.base import data_path, flag_argv
from eagle_train.data.jsonl import jsonl_records
from eagle_train.runtime.atomic_files import atomic_write_text
from eagle_train.runtime.errors import user_errors

DEFAULT_SRC = data_path("tinystories/tinystories_val_head.txt")
DEFAULT_HELD_OUT = data_path("tinystories/tinystories_prompts.jsonl")
SHIPPED = data_path("tinystories/tinystories_sharegpt.jsonl")  # the builder's output with the defaults
# the first sentence: up to . ! or ? (and a closing quote), then whitespace and a new sentence's start
# (capital letter or opening quote: `"Look!" said Sue.` is one sentence)
FIRST_SENTENCE = re.compile(r"^(.+?[.!?][\"'\u201d\u2019]?)\s+([A-Z\"'\u201c\u2018(].*)$", re.DOTALL)


def split_first_sentence(paragraph: str) -> tuple[str, str] | None:
    """(first sentence, rest) of a whitespace-normalised paragraph, or None if it has one sentence."""
    match = FIRST_SENTENCE.match(paragraph)
    return (match.group(1), match.group(2)) if match else None


def load_held_out(path: str | Path | None) -> tuple[set[str], set[str]]:
    """(paragraphs, first sentences) of the evaluation prompts file, whitespace-normalised."""
    if path is None:
        return set(), set()
    paragraphs, prompts = set(), set()
    for _, _, record in jsonl_records(path, Path(path).read_text(encoding="utf-8").splitlines()):
        paragraphs.add(" ".join(str(record.get("paragraph", "")).split()))
        prompts.add(" ".join(str(record.get("prompt", "")).split()))
    return paragraphs - {""}, prompts - {""}


def build_tinystories_conversations(
    out_path: str | Path,
    src: str | Path = DEFAULT_SRC,
    limit: int | None = None,
    held_out_prompts: str | Path | None = DEFAULT_HELD_OUT,
) -> dict[str, int]:
    """Write the conversations JSONL atomically (temp file, then rename); return counts
    (`written`, `held_out`, `single_sentence`, `empty`)."""
    held_paragraphs, held_prompts = load_held_out(held_out_prompts)
    counts = {"written": 0, "held_out": 0, "single_sentence": 0, "empty": 0}
    lines = []
    for index, raw in enumerate(Path(src).read_text(encoding="utf-8").split("\n\n")):
        if limit is not None and counts["written"] >= limit:
            break
        paragraph = " ".join(raw.split())
        split = split_first_sentence(paragraph) if paragraph else None
        if not paragraph:
            counts["empty"] += 1
        elif split is None:
            counts["single_sentence"] += 1
        elif paragraph in held_paragraphs or split[0] in held_prompts:
            counts["held_out"] += 1
        else:
            turns = [{"from": "human", "value": split[0]}, {"from": "gpt", "value": split[1]}]
            lines.append(
                json.dumps({"id": f"tinystories_{index}", "conversations": turns}, ensure_ascii=False)
            )
            counts["written"] += 1
    atomic_write_text(out_path, "\n".join(lines) + "\n")
    return counts


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Accepts `key=value` (Hydra-like) as well as `--key value`."""
    argv = flag_argv(argv)
    parser = argparse.ArgumentParser(
        prog="python -m eagle_train.data.tinystories", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--out", required=True, help="conversations JSONL to write")
    parser.add_argument(
        "--src", default=str(DEFAULT_SRC), help="TinyStories text, paragraphs split by blank lines"
    )
    parser.add_argument("--limit", type=int, default=None, help="write at most this many conversations")
    parser.add_argument(
        "--held_out", default=str(DEFAULT_HELD_OUT), help="evaluation prompts to leave out, or 'none'"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """CLI entry point."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    held_out = None if args.held_out.lower() == "none" else args.held_out
    with user_errors():
        counts = build_tinystories_conversations(args.out, args.src, args.limit, held_out)
    print(
        f"wrote {counts['written']} conversations to {args.out} ({', '.join(f'{k} {v}' for k, v in counts.items())})"
    )


if __name__ == "__main__":
    main()
