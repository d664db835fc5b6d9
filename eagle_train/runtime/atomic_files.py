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

from eagle_train.runtime.errors import InputError

PARTIAL = ".partial-"  # marks a temporary name: `.NAME.partial-XXXXXXXX[suffix]`


class FileFormatError(InputError):
    """A file this project wrote (or reads as metadata) is not what it should be; names the file."""


class OutputError(InputError):
    """An output path holds something the command did not write (or cannot be written); names the file."""


def partial_prefix(final: str | Path) -> str:
    """The temporary-name prefix of `final` (`.NAME.partial-`)."""
    return f".{Path(final).name}{PARTIAL}"


def remove_partial_files(directory: str | Path, name: str = "*") -> list[Path]:
    """Delete what killed atomic writes left in `directory` (files and directories named
    `.NAME.partial-*`, never anything else; `name` narrows NAME, e.g. to one output's in a shared
    directory); returns them. Call it only while holding the lock of what they belong to
    (eagle_train.runtime.output_lock), so no live writer's temporary is removed."""
    removed = []
    for stale in Path(directory).glob(f".{name}{PARTIAL}*"):
        if stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)
        removed.append(stale)
    return removed


def read_json(path: str | Path, what: str = "") -> Any:
    """Parse a JSON file; a missing, unreadable or malformed one raises FileFormatError naming the file
    and, for bad JSON, the line and column (`what`: e.g. "feature store manifest", added to the message)."""
    path = Path(path)
    label = f"{path} ({what})" if what else str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileFormatError(f"{label}: missing") from None
    except (OSError, UnicodeDecodeError) as err:
        raise FileFormatError(f"{label}: unreadable ({err})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise FileFormatError(
            f"{label}: not valid JSON ({err.msg} at line {err.lineno}, column {err.colno})"
        ) from None
    except RecursionError:
        raise FileFormatError(f"{label}: not valid JSON (nested too deeply)") from None


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
    fd, tmp = tempfile.mkstemp(prefix=partial_prefix(final), suffix=suffix, dir=final.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        publish(tmp, final)
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)
        named = naming(err, final)
        if named is err:
            raise
        raise named from err


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
    tmp = Path(tempfile.mkdtemp(prefix=partial_prefix(final), dir=final.parent))
    try:
        write(tmp)
        _normalise_modes(tmp)
        if final.exists():
            old = Path(tempfile.mkdtemp(prefix=partial_prefix(final), suffix=".old", dir=final.parent))
            os.replace(final, old / final.name)
            publish(tmp, final, directory=True)
            shutil.rmtree(old, ignore_errors=True)
        else:
            publish(tmp, final, directory=True)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        named = naming(err, final)
        if named is err:
            raise
        raise named from err
    return final


def naming(err: BaseException, final: Path) -> BaseException:
    """`err`, or for an OSError that names no file (a write to a full disk: ENOSPC, EFBIG) the same error
    naming `final`, the file or directory being written."""
    if isinstance(err, OSError) and err.filename is None and err.errno is not None:
        return type(err)(err.errno, err.strerror or os.strerror(err.errno), str(final))
    return err


def atomic_write_into(directory: str | Path, write: Callable[[Path], None]) -> list[str]:
    """Call `write(tmp_dir)`, then move each file it wrote into `directory` (each file replaced
    atomically; nothing else in `directory` is touched or removed). Returns the names written."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=partial_prefix(directory), dir=directory))
    try:
        write(tmp)
        _normalise_modes(tmp)
        names = sorted(p.name for p in tmp.iterdir())
        for name in names:
            os.replace(tmp / name, directory / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return names


def _normalise_modes(root: Path) -> None:
    """Files 0666 & ~umask, directories 0777 & ~umask, below `root` (writers may have used mkstemp)."""
    mask = _umask()
    for dirpath, dirnames, filenames in os.walk(root):
        for name, mode in [*((d, 0o777) for d in dirnames), *((f, 0o666) for f in filenames)]:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):  # chmod follows links: never touch what a link points at
                os.chmod(path, mode & ~mask)


def check_output_file(
    out: Path, own: Callable[[], None], overwrite: bool, belongs: Iterable[Path] = ()
) -> bool:
    """The rule of every command that writes one output file (regenerate, the mix): an existing `out`
    (or one of the files that `belongs` to it, e.g. part files) is replaced or added to only when it is
    the command's own output: `own()` raises OutputError or FileFormatError saying why not; a symlink or
    another non-regular file never is. A directory is refused even with `overwrite`. Returns True when
    what exists is not the command's own and `overwrite` lets the run start it over; raises OutputError
    (naming the file and why) when it is not and `overwrite` is false; False when nothing is there or it
    is the command's own."""
    belongs = list(belongs)
    if out.is_dir() and not out.is_symlink():
        raise OutputError(f"out={out} is a directory: name the file to write")
    if not (out.exists() or out.is_symlink() or belongs):
        return False
    try:
        if out.is_symlink() or (out.exists() and not out.is_file()):
            raise OutputError(f"{out}: exists and is not a regular file")
        own()
    except (OutputError, FileFormatError) as err:
        if overwrite:
            return True
        raise OutputError(
            f"{err}. Refusing to add to or replace it: choose another out, or pass overwrite=true to "
            "start it over"
        ) from None
    return False


def check_output_dir(
    out: Path, own: Callable[[], bool], overwrite: bool, what: str, writes: str, flag: str = "overwrite=true"
) -> bool:
    """The rule of every command that writes one output directory (export, the re-expression): nothing of
    the user's is removed unless the user says so. Returns True when `out` is replaced whole: it does not
    exist, or it is the command's own earlier output (`own()`: `what`, e.g. "an earlier format=vllm
    export"), or, with `overwrite`, a file or link stands in its place. Returns False when the files
    (`writes`) are written into it and nothing else there is touched: an empty directory, or with
    `overwrite` any other directory. Anything else is an OutputError naming what `out` holds and the
    command's `flag` that would overwrite it."""
    if not (out.exists() or out.is_symlink()):
        return True
    if out.is_symlink() or not out.is_dir():
        if overwrite:
            return True
        raise OutputError(
            f"{out} exists and is not a directory: choose another output, or pass {flag} to replace it"
        )
    entries = sorted(p.name for p in out.iterdir())
    if entries and own():
        return True
    if not entries or overwrite:
        return False
    shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
    raise OutputError(
        f"{out} is not empty and is not {what} (it holds {shown}); choose a new or empty directory, or pass "
        f"{flag}, which writes {writes} there and deletes nothing else"
    )


def file_sha256(path: str | Path, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def cache_dir() -> Path:
    """Where eagle-train keeps what it can recompute (the sha256 of large files): $EAGLE_TRAIN_CACHE, else
    $XDG_CACHE_HOME/eagle_train, else ~/.cache/eagle_train."""
    if os.environ.get("EAGLE_TRAIN_CACHE"):
        return Path(os.environ["EAGLE_TRAIN_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "eagle_train"


def cached_sha256(path: str | Path) -> str:
    """`file_sha256` of a large file that rarely changes (a model checkpoint), computed once and kept in
    `cache_dir()/sha256/` under its real path, size, mtime, ctime and inode: any write to the file, or its
    replacement, changes one of them (ctime cannot be set back), so a stale entry is never used. A cache
    that cannot be written only costs the hash again next time."""
    real = Path(path).resolve()
    st = real.stat()
    key = {"path": str(real), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}
    key["inode"] = st.st_ino
    entry = cache_dir() / "sha256" / (hashlib.sha256(str(real).encode()).hexdigest()[:32] + ".json")
    try:
        cached = json.loads(entry.read_text(encoding="utf-8"))
        if isinstance(cached, dict) and cached.get("key") == key and isinstance(cached.get("sha256"), str):
            return cached["sha256"]
    except (OSError, ValueError):
        pass
    sha = file_sha256(real)
    try:
        atomic_write_json(entry, {"key": key, "sha256": sha})
    except OSError:
        pass
    return sha
