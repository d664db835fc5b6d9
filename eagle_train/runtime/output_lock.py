"""One writer per output: an exclusive lock beside every file or directory a stage writes.

A stage that writes `PATH` (extract's store, train's run directory, regenerate's JSONL, evaluate's
directory, export's directory, the pipeline's run directory) first takes the lock file
`PATH.parent/.PATH.name.lock` with `fcntl.flock(LOCK_EX | LOCK_NB)` and writes its holder into it (pid,
host, command, start time). A second writer is refused at once with a message naming the holder. The
kernel drops a flock when its process dies, however it dies (SIGKILL included), so a lock file left by a
killed run is simply taken over by the next one: no pid guessing, no stale-lock timeout. The lock file
sits beside the output (not inside it) so that replacing a whole directory atomically (export) keeps it,
and it is removed when the holder releases it.

flock is per open file, so two lock objects in one process exclude each other too. On NFS, Linux maps
flock onto POSIX byte-range locks, which work across nodes. Standard library only: every layer may use it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from types import TracebackType

from eagle_train.runtime.errors import UserError


class LockedError(UserError, RuntimeError):
    """Another process holds the lock on an output; the message names it."""


def lock_path(output: str | Path) -> Path:
    """The lock file of an output path: `.NAME.lock` beside it (the path resolved first, so every
    spelling of one output shares one lock)."""
    output = Path(output).expanduser().resolve()
    return output.parent / f".{output.name}.lock"


class OutputLock:
    """An exclusive, non-blocking lock on one output path; a context manager.

    `stage` (e.g. "train") goes into the holder record and the refusal message."""

    def __init__(self, output: str | Path, stage: str):
        self.output = Path(output).expanduser().resolve()
        self.stage = stage
        self.path = lock_path(output)
        self._fd: int | None = None

    def acquire(self, wait: bool = False) -> OutputLock:
        """Take the lock or raise LockedError naming the holder; `wait`: block until the holder releases it
        (a cache that several processes may fill at once: the later ones wait for the first)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                os.close(fd)
                if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise LockedError(self._refusal()) from None
                raise
            if self._still_linked(fd):
                break
            os.close(fd)  # the holder released (and removed) the file between open and flock: retry
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(holder_record(self.stage)).encode() + b"\n")
        os.fsync(fd)
        self._fd = fd
        return self

    def _open(self) -> int:
        """The lock file, opened (created if absent) without following a symbolic link: one planted there
        is a LockedError naming it and what to do."""
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as err:
            if err.errno != errno.ELOOP:
                raise
            raise LockedError(
                f"lock file {self.path} is a symbolic link (to {os.readlink(self.path)}), which is never "
                f"followed: remove it (rm {self.path}) and rerun this {self.stage}"
            ) from None

    def release(self) -> None:
        """Remove the lock file and drop the lock (idempotent)."""
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(self._fd)
            self._fd = None

    def _still_linked(self, fd: int) -> bool:
        try:
            return os.stat(self.path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            return False

    def _refusal(self) -> str:
        holder = read_holder(self.path)
        who = (
            f"pid {holder.get('pid')} on {holder.get('host')} since {holder.get('started')} "
            f"({holder.get('stage')}: {holder.get('command')})"
            if holder
            else "another process"
        )
        return (
            f"{self.output} is being written by {who}; lock file {self.path}. Wait for that run to end or "
            f"choose another output for this {self.stage}. (A lock left by a killed run is taken over "
            "automatically: this one is held by a live process.)"
        )

    def __enter__(self) -> OutputLock:
        return self.acquire()

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


def holder_record(stage: str) -> dict[str, object]:
    """Who holds a lock: pid, host, stage, command line, start time (UTC)."""
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "stage": stage,
        "command": " ".join(sys.argv)[:500],
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def read_holder(path: Path) -> dict[str, object]:
    """The holder record of a lock file ({} if it cannot be read)."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}
