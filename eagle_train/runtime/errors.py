"""How a command ends on a user's error: one line on stderr, no traceback; a bug keeps its traceback.

A user error is a mistake in what the user gave or asked (a bad input file, a bad setting, a refused
overwrite, a store or checkpoint that does not match, a missing engine environment) or a state of the
machine the user must change (a full disk, a path that cannot be read or written). Its message names the
file, key or record and what to do, so a traceback above it only hides it. `user_errors()` (every command:
the stages through `cli.stage_main`, the small argparse commands directly) ends the command with

    error: MESSAGE

on one line of stderr and exit code 1. What counts (`is_user_error`): an instance of `UserError` (the
project's error classes derive from it: DataError, StoreError, CheckpointError, OutputError, LockedError,
EngineError, ...; `InputError` is the ValueError of a check without a class of its own, `ConfigError` a
setting refused) or an OSError (the operating system's word about a path or the machine). Anything else
is a bug: its traceback is shown as Python shows it. EAGLE_TRAIN_TRACEBACK=1 shows the traceback of a
user error too.

Under a launcher of several processes (RANK set) every process meets an error raised on all of them
(a setting, or one `cli.on_main` passes on: `on_every_rank`); rank 0 alone prints it. An error one rank meets
alone is printed by that rank, prefixed `[rank N]`.

Standard library only: every layer may use it.
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

TRACEBACK_ENV = "EAGLE_TRAIN_TRACEBACK"
EXIT_CODE = 1
# what to do about the machine's own refusals (an OSError names its file, not the remedy)
REMEDIES = {
    errno.ENOSPC: "free disk space and rerun",
    errno.EDQUOT: "free space within your disk quota and rerun",
    errno.EFBIG: "the file system refused a file this large: free space or write elsewhere, and rerun",
    errno.EROFS: "the file system is read-only: choose a writable location",
    errno.EACCES: "check the path's permissions",
    errno.EPERM: "check the path's permissions",
}


class UserError(Exception):
    """A mistake in the user's input, settings or machine; the message names where and what to do."""


class InputError(UserError, ValueError):
    """A bad input or setting found by a check that has no error class of its own."""


class ConfigError(InputError):
    """A command line or config that the stage's schema refuses (names the key)."""

    on_every_rank = True  # every process of a launch parses the same command line


def is_user_error(err: BaseException) -> bool:
    """Whether `err` ends a command in one line (see the module docstring) rather than with a traceback."""
    return isinstance(err, (UserError, OSError))


def one_line(err: BaseException) -> str:
    """The message of a user error on one line (an OSError's path and the remedy added)."""
    if isinstance(err, OSError) and err.strerror:
        where = f"{err.filename}: " if err.filename is not None else ""
        text = f"{where}{err.strerror}" + (f" (errno {err.errno})" if err.errno else "")
        if err.errno in REMEDIES:
            text += f": {REMEDIES[err.errno]}"
    else:
        text = str(err) or type(err).__name__
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def process_rank() -> int:
    """This process's rank under a launcher (torchrun / accelerate launch set RANK), else 0."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def report(err: BaseException) -> None:
    """Print a user error as the command's last line (rank 0, or the rank that met it alone)."""
    rank = process_rank()
    if rank == 0:
        print(f"error: {one_line(err)}", file=sys.stderr, flush=True)
    elif not getattr(err, "on_every_rank", False):
        print(f"[rank {rank}] error: {one_line(err)}", file=sys.stderr, flush=True)


@contextmanager
def user_errors() -> Iterator[None]:
    """End the command on a user error raised in the body: `error: MESSAGE` on stderr, exit code 1, no
    traceback (EAGLE_TRAIN_TRACEBACK=1: the error propagates with it). Other exceptions propagate."""
    try:
        yield
    except Exception as err:
        if not is_user_error(err) or os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
            raise
        report(err)
        raise SystemExit(EXIT_CODE) from None
