"""README.md and docs/*.md stay true to the code. In every page:

- every relative link resolves to a file (and to a heading, for `#anchor` links);
- every `make TARGET` (in fenced blocks and inline code) is a target of the Makefile;
- every test cited as `tests/PATH.py::test_name` exists;
- every command line in a fenced block composes, without running anything or touching a file: a Hydra stage
  (`python -m eagle_train.STAGE ...`, `accelerate launch ... train.py ...`, `make demo|train|eval|...`)
  through the stage's own composition and schema (unknown keys, types and `__post_init__` checks); the small
  argparse commands (`eagle_train.data.mix`, `eagle_train.interop.reexpress`, `scripts/*.py`) through their
  own parser; `accelerate launch` options through accelerate's parser, its `--config_file` must exist.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import re
import shlex
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import pytest

from eagle_train.cli import SCHEMAS, compose
from eagle_train.config.base import to_schema
from tests.conftest import REPO_ROOT

PAGES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.M | re.S)
INLINE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*$", re.M)
TEST_REF = re.compile(r"\b(tests/[\w/]+\.py)::(\w+)")
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
SHELL_BLOCKS = {"", "bash", "sh", "shell"}
PROGRAMS = {"make", "python", "python3", "accelerate"}  # command lines of other programs are not checked
# Hydra's own flags and how many values each takes (left out of the overrides)
HYDRA_FLAGS = {"--cfg": 1, "-c": 1, "--package": 1, "-p": 1, "--help": 0, "-h": 0, "--hydra-help": 0}


class Parsed(Exception):
    """Raised by the patched argparse once a command line has parsed: the command itself never runs."""


def fenced_lines(text: str) -> Iterator[str]:
    """The lines of the shell blocks, `\\`-continued lines joined."""
    for info, body in FENCE.findall(text):
        if info.strip() in SHELL_BLOCKS:
            yield from (line for line in body.replace("\\\n", " ").splitlines() if line.strip())


def without_code(text: str) -> str:
    """The prose of a page: fenced blocks and inline code removed (a link inside code is no link)."""
    return INLINE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings (a repeated heading gets -1, -2, ... as on GitHub)."""
    found, counts = set(), {}
    for heading in HEADING.findall(FENCE.sub("", page.read_text())):
        base = slug(heading)
        found.add(f"{base}-{counts[base]}" if base in counts else base)
        counts[base] = counts.get(base, 0) + 1
    return found


def link_problems(page: Path, text: str) -> list[str]:
    """Relative links of `text` (written in `page`) whose file or heading does not exist."""
    problems = []
    for target in LINK.findall(without_code(text)):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            problems.append(f"link {target}: no {file}")
        elif anchor and (file.suffix != ".md" or anchor not in anchors(file)):
            problems.append(f"link {target}: no heading #{anchor} in {file.name}")
    return problems


@cache
def makefile() -> tuple[dict[str, str], dict[str, list[str]]]:
    """The Makefile's variables and each target's recipe lines."""
    text = (REPO_ROOT / "Makefile").read_text()
    variables = dict(re.findall(r"^([A-Z_]+)[ \t]*[?:]?=[ \t]*(.*?)[ \t]*$", text, re.M))
    recipes: dict[str, list[str]] = {}
    target = None
    for line in text.splitlines():
        if match := re.match(r"^([A-Za-z0-9_-]+):", line):
            target = match.group(1)
            recipes[target] = []
        elif line.startswith("\t") and target:
            recipes[target].append(line.strip())
    return variables, recipes


def expand(line: str, variables: dict[str, str]) -> str:
    """A recipe line with the make variables substituted (as make does: text, then the shell parses it)."""
    for _ in range(5):
        line = re.sub(r"\$\((\w+)\)", lambda m: variables.get(m.group(1), ""), line)
    return line.replace("$$", "$")


def check_make(args: list[str]) -> None:
    """`make [VAR=value ...] TARGET ...`: the targets exist; their stage commands compose with these values."""
    defaults, recipes = makefile()
    given = dict(a.split("=", 1) for a in args if ASSIGNMENT.match(a))
    for target in (a for a in args if not ASSIGNMENT.match(a)):
        assert target in recipes, f"make {target}: no such target in the Makefile"
        for line in recipes[target]:
            if "eagle_train." in line or "train.py" in line:
                check_command(shlex.split(expand(line, {**defaults, **given})))


def check_stage(stage: str, args: list[str]) -> None:
    """The stage's Hydra composition and schema checks, Hydra's own flags left out."""
    overrides, skip = [], 0
    for arg in args:
        if skip:
            skip -= 1
        elif arg in HYDRA_FLAGS:
            skip = HYDRA_FLAGS[arg]
        else:
            overrides.append(arg)
    to_schema(compose(stage, overrides), SCHEMAS[stage])


@contextmanager
def parse_only(argv: list[str]) -> Iterator[None]:
    """argparse parses `argv` (as sys.argv) and raises Parsed instead of returning to the command."""
    saved_argv, parse = sys.argv, argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise Parsed(parse(self, args, namespace))

    sys.argv, argparse.ArgumentParser.parse_args = argv, parse_then_stop
    try:
        yield
    finally:
        sys.argv, argparse.ArgumentParser.parse_args = saved_argv, parse


def check_argparse(module, argv: list[str]) -> None:
    """`module.main()` parses `argv` with argparse; it is stopped right after parsing."""
    assert "argparse" in inspect.getsource(module), (
        f"{module.__name__}: neither a stage nor an argparse command"
    )
    try:
        with parse_only(argv):
            module.main()
    except Parsed:
        return
    except SystemExit as stop:  # --help exits 0, a refused argument 2
        assert stop.code in (0, None), f"{' '.join(argv)}: the command's parser refused it"
        return
    raise AssertionError(f"{' '.join(argv)}: main() returned without parsing its arguments")


@cache
def script(path: str):
    """A script loaded as a module (its `if __name__ == "__main__"` block does not run)."""
    name = f"docs_{Path(path).stem}"
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / path)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)  # dataclasses look themselves up
    spec.loader.exec_module(module)
    return module


def check_python(args: list[str]) -> None:
    """`python -m eagle_train.X ...` or `python FILE.py ...` (other modules are not this project's)."""
    if args[0] == "-m" and args[1].startswith("eagle_train"):
        check_module(args[1], args[2:])
    elif args[0].endswith(".py"):
        check_file(args[0], args[1:])


def check_module(module: str, args: list[str]) -> None:
    """A stage module composes; any other module of the package parses its arguments."""
    stage = module.removeprefix("eagle_train.")
    if stage in SCHEMAS:
        check_stage(stage, args)
    else:
        check_argparse(importlib.import_module(module), [module, *args])


def check_file(path: str, args: list[str]) -> None:
    """`train.py` is the train stage; a script must exist and parse its arguments."""
    if path == "train.py":
        check_stage("train", args)
        return
    assert (REPO_ROOT / path).is_file(), f"{path}: no such file"
    check_argparse(script(path), [path, *args])


def check_accelerate(args: list[str]) -> None:
    """`accelerate launch [options] (train.py | -m MODULE) ARGS`: the options, the config file, the command."""
    from accelerate.commands.launch import launch_command_parser

    assert args[0] == "launch", f"accelerate {args[0]}: only `accelerate launch` is checked"
    launch = launch_command_parser().parse_args(args[1:])
    if launch.config_file:
        assert (REPO_ROOT / launch.config_file).is_file(), f"--config_file {launch.config_file}: no such file"
    if launch.module:
        check_module(launch.training_script, launch.training_script_args)
    else:
        check_file(launch.training_script, launch.training_script_args)


def check_command(tokens: list[str]) -> None:
    """One shell command line (split): checked if it is this project's, ignored otherwise (vllm, sglang)."""
    while tokens and ASSIGNMENT.match(tokens[0]):  # VAR=value before the program
        tokens = tokens[1:]
    if not tokens:
        return
    program = Path(tokens[0]).name
    if program == "make":
        check_make(tokens[1:])
    elif program in ("python", "python3") and len(tokens) > 1:
        check_python(tokens[1:])
    elif program == "accelerate":
        check_accelerate(tokens[1:])


def problem(line: str) -> str | None:
    """What is wrong with one documented command line (None: nothing, or not a command of this project)."""
    first = re.match(r"^\s*(?:[A-Za-z_]\w*=\S*\s+)*(\S+)", line)
    if not first or Path(first.group(1)).name not in PROGRAMS:
        return None
    try:
        check_command(shlex.split(line, comments=True))
    except (Exception, SystemExit) as err:  # SystemExit: a parser's refusal
        return f"{line.strip()}\n    {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    return None


def cited_test_problems(text: str) -> list[str]:
    """`tests/PATH.py::test_name` references whose file or test function does not exist."""
    problems = []
    for path, name in TEST_REF.findall(text):
        file = REPO_ROOT / path
        if not file.is_file() or not re.search(rf"^\s*(async )?def {name}\(", file.read_text(), re.M):
            problems.append(f"{path}::{name}: no such test")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_resolve(page):
    problems = link_problems(page, page.read_text())
    assert not problems, f"{page.name}: " + "; ".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_cited_tests_exist(page):
    problems = cited_test_problems(page.read_text())
    assert not problems, f"{page.name}: " + "; ".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_commands_compose(page):
    text = page.read_text()
    inline_make = [span for span in INLINE.findall(FENCE.sub("", text)) if span.startswith("make ")]
    problems = [p for line in [*fenced_lines(text), *inline_make] if (p := problem(line))]
    assert not problems, f"{page.name}: commands that no longer compose:\n" + "\n".join(problems)


@pytest.mark.parametrize(
    "line, message",
    [
        ("python -m eagle_train.train features=DIR optim.lrr=1e-2", "optim.lrr"),
        ("python -m eagle_train.export ckpt=DIR format=onnx out_dir=DIR", "format must be one of"),
        ("accelerate launch --config_file conf/accelerate/nope.yaml train.py features=DIR", "nope.yaml"),
        ("accelerate launch --num_procs 2 train.py features=DIR", "SystemExit"),
        ("python -m eagle_train.data.mix out=FILE --src A", "refused"),
        ("python scripts/bench_heads.py --minuets 3", "refused"),
        ("python scripts/bench_nothing.py", "no such file"),
        ("python -m eagle_train.no_such_stage x=1", "No module named"),
        ('make demo ARGS="vars.processes=3"', "does not split evenly"),
        ("make no-such-target", "no such target"),
    ],
)
def test_a_drifted_command_is_caught(line, message):
    """The checker itself: each of these drifts (a renamed key, a bad value, a missing file, a misspelt
    flag, an unknown module or target) is reported, with the cause."""
    found = problem(line)
    assert found is not None and message in found, found


def test_a_broken_link_or_test_reference_is_caught(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A heading\n")
    text = "[ok](page.md#a-heading) [gone](missing.md) [anchor](page.md#nowhere) `[code](not-a-link.md)`"
    assert link_problems(page, text) == [
        f"link missing.md: no {tmp_path / 'missing.md'}",
        "link page.md#nowhere: no heading #nowhere in page.md",
    ]
    assert cited_test_problems("tests/test_docs.py::test_links_resolve tests/test_docs.py::test_nothing") == [
        "tests/test_docs.py::test_nothing: no such test"
    ]
