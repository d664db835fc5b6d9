"""The one home for writing files: atomically, with ordinary permissions.

Every file or directory this project writes goes through here. A file is written under a unique
temporary name in its final directory (`tempfile.mkstemp`: created exclusively, so a planted symlink
is never followed), flushed to disk, given the usual mode (0666 & ~umask for files, 0777 & ~umask for
directories: 0644 / 0755 under the default umask, where mkstemp and mkdtemp would leave 0600 / 0700
and a server running as another user could not read an export) and renamed over the final name. A
reader sees the old file or the new one, never half of one; a failed write leaves nothing behind.

Standard library only: every layer may call it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def publish(tmp: str | Path, final: str | Path, *, directory: bool = False) -> None:
    """Give a finished temporary file (or directory) the usual permissions and rename it to `final`."""
    os.chmod(tmp, (0o777 if directory else 0o666) & ~_umask())
    os.replace(tmp, final)


@contextmanager
def atomic_path(final: str | Path, suffix: str = ".tmp") -> Iterator[Path]:
    """A temporary path beside `final` for writers that take a path (safetensors, matplotlib, torch).

    `suffix` keeps an extension a writer infers the format from (e.g. ".png"). On a clean exit the
    file is published as `final`; on an exception it is removed."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=suffix, dir=final.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        publish(tmp, final)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_lines(path: str | Path, lines: Iterable[str]) -> None:
    """Write text lines (each given with its own newline) atomically, flushed to disk first."""
    with atomic_path(path) as tmp, tmp.open("w", encoding="utf-8") as f:
        f.writelines(lines)
        f.flush()
        os.fsync(f.fileno())


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write `text` atomically (UTF-8)."""
    atomic_write_lines(path, [text])


def atomic_write_json(path: str | Path, obj: Any, *, sort_keys: bool = True) -> None:
    """Write `obj` as indented JSON (one trailing newline) atomically."""
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=sort_keys, ensure_ascii=False) + "\n")


def atomic_write_dir(final: str | Path, write: Callable[[Path], None]) -> Path:
    """Call `write(tmp_dir)`, then put tmp_dir in place of `final` (replacing a previous one), so
    `final` is never partial. The directory and everything `write` created get the usual permissions."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        write(tmp)
        _normalise_modes(tmp)
        if final.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old.", dir=final.parent))
            os.replace(final, old / final.name)
            publish(tmp, final, directory=True)
            shutil.rmtree(old, ignore_errors=True)
        else:
            publish(tmp, final, directory=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _normalise_modes(root: Path) -> None:
    """Files 0666 & ~umask, directories 0777 & ~umask, below `root` (writers may have used mkstemp)."""
    mask = _umask()
    for dirpath, dirnames, filenames in os.walk(root):
        for name, mode in [*((d, 0o777) for d in dirnames), *((f, 0o666) for f in filenames)]:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):  # chmod follows links: never touch what a link points at
                os.chmod(path, mode & ~mask)


def file_sha256(path: str | Path, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()
