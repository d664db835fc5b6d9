"""eagle_train.runtime.atomic_files: what a killed write leaves is recognisable and removed, nothing else
is; JSON metadata errors name the file; writing into a directory deletes nothing."""

from __future__ import annotations

import os

import pytest

from eagle_train.runtime.atomic_files import (
    FileFormatError,
    atomic_path,
    atomic_write_dir,
    atomic_write_into,
    cached_sha256,
    read_json,
    remove_partial_files,
)


def test_temporaries_are_named_partial_and_only_they_are_removed(tmp_path):
    with atomic_path(tmp_path / "report.json") as tmp:
        assert tmp.name.startswith(".report.json.partial-") and tmp.parent == tmp_path
        tmp.write_text("{}")

    def fail(directory):
        (directory / "model.safetensors").write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):  # a failed directory write leaves nothing behind
        atomic_write_dir(tmp_path / "final", fail)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]
    # what a kill leaves (no cleanup ran): a file and a directory with the marker, beside the user's own
    (tmp_path / ".answers.jsonl.partial-ab12.tmp").write_text("half")
    (tmp_path / ".final.partial-cd34").mkdir()
    (tmp_path / ".hidden_but_mine").write_text("keep")
    (tmp_path / "notes.partial-1").write_text("keep")  # not a temporary name (no leading dot)
    assert sorted(p.name for p in remove_partial_files(tmp_path, "final")) == [".final.partial-cd34"]
    remove_partial_files(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".hidden_but_mine",
        "notes.partial-1",
        "report.json",
    ]


def test_writing_into_a_directory_replaces_only_what_is_written(tmp_path):
    (tmp_path / "config.json").write_text("old")
    (tmp_path / "notes.txt").write_text("mine")
    names = atomic_write_into(tmp_path, lambda d: (d / "config.json").write_text("new"))
    assert names == ["config.json"] and (tmp_path / "config.json").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "notes.txt"]
    assert oct((tmp_path / "config.json").stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_read_json_names_the_file_and_the_place(tmp_path):
    (tmp_path / "m.json").write_text('{"a": 1,\n "b": }')
    with pytest.raises(
        FileFormatError, match=r"m.json \(manifest\): not valid JSON \(Expecting value at line 2, column 7\)"
    ):
        read_json(tmp_path / "m.json", "manifest")
    with pytest.raises(FileFormatError, match=r"nope.json: missing"):
        read_json(tmp_path / "nope.json")
    (tmp_path / "deep.json").write_text("[" * 100_000)
    with pytest.raises(FileFormatError, match="deep.json"):
        read_json(tmp_path / "deep.json")


def test_a_cached_sha256_is_reused_until_the_file_is_written_again(tmp_path, monkeypatch):
    """A checkpoint's weight files are hashed once (cached by path, size, mtime, ctime and
    inode); a rewrite in place is hashed again even with its size and mtime set back (ctime moves)."""
    import eagle_train.runtime.atomic_files as files

    monkeypatch.setenv("EAGLE_TRAIN_CACHE", str(tmp_path / "cache"))
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"a" * 4096)
    reads = []
    real = files.file_sha256
    monkeypatch.setattr(files, "file_sha256", lambda path: reads.append(path) or real(path))
    first = cached_sha256(weights)
    assert first == real(weights) and cached_sha256(weights) == first and len(reads) == 1
    before = weights.stat()
    with weights.open("r+b") as f:
        f.write(b"b")  # same size
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert cached_sha256(weights) == real(weights) != first and len(reads) == 2
    (tmp_path / "not_a_dir").write_text("")  # a cache that cannot be written costs the hash, nothing else
    monkeypatch.setenv("EAGLE_TRAIN_CACHE", str(tmp_path / "not_a_dir"))
    assert cached_sha256(weights) == real(weights) and len(reads) == 3
