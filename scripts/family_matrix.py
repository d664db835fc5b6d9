"""The per-family support matrix (eagle_train.families.matrix): every stage on a tiny instance of each family.

    python scripts/family_matrix.py [--families llama3,gemma3] [--work runs/families] [--jobs 2] [--vllm]
                                    [--docs docs/families.md] [--readme README.md]

Each family's results go to WORK/NAME/result.json (reused while nothing they depend on changed); the table is
printed and, with --docs, written into the page between its markers, with --readme the one-line-per-family
summary into the README's (nobody types the matrix).
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle_train.families.matrix import default_work, run_family, saved_result  # noqa: E402
from eagle_train.families.specs import FAMILIES  # noqa: E402
from eagle_train.families.table import matrix_markdown, summary_markdown  # noqa: E402
from eagle_train.runtime.atomic_files import atomic_write_text  # noqa: E402

BEGIN, END = "<!-- family-matrix:begin -->", "<!-- family-matrix:end -->"
SUMMARY = "<!-- family-summary:begin -->", "<!-- family-summary:end -->"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated (default: all)")
    parser.add_argument("--work", type=Path, default=None, help="default: $EAGLE_TRAIN_CACHE/matrix")
    parser.add_argument("--jobs", type=int, default=2, help="families run at once")
    parser.add_argument("--vllm", action="store_true", help="also run vLLM (engine=vllm) on each head")
    parser.add_argument("--docs", type=Path, default=None, help="write the matrix into this page")
    parser.add_argument("--readme", type=Path, default=None, help="write the summary into this page")
    parser.add_argument(
        "--table-only", action="store_true", help="no stage runs: the table of the saved results"
    )
    args = parser.parse_args(argv)
    names = [n for n in args.families.split(",") if n]
    work = (args.work or default_work()).resolve()
    work.mkdir(parents=True, exist_ok=True)
    if args.table_only:
        results = [saved_result(work, n) for n in names]
    else:
        with ThreadPoolExecutor(args.jobs) as pool:
            results = list(pool.map(lambda n: run_family(n, work, args.vllm), names))
    table = matrix_markdown(results)
    print(table)
    if args.docs is not None:
        write_docs(args.docs, table)
    if args.readme is not None:
        write_docs(args.readme, summary_markdown(results), SUMMARY)


def write_docs(page: Path, table: str, markers: tuple[str, str] = (BEGIN, END)) -> None:
    """Replace the text between the markers of `page` with `table`."""
    begin, end = markers
    text = page.read_text(encoding="utf-8")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    atomic_write_text(page, f"{head}{begin}\n{table}\n{end}{tail}")


if __name__ == "__main__":
    main()
